"""The shared infrastructure every herd package stands on, and which imports nothing of ours:
TLS and the principals of certificates (``tls``), the cluster PKI (``pki``), bearer tokens
(``auth``), the HTTP/1.1 server (``http``), the response-head reader and parser of our
keep-alive clients (``h1``), connection caps (``gate``), durable whole-file writes
(``durable``), the back-off of every retry loop (``backoff``), the Prometheus writer
(``metrics``), TOML config loading (``tomlconfig``), the version (``version``), the errors
they raise (``errors``) and how nodes are named and reached (``peers``).

The layers (checked by import-linter in ``make lint``): ``infra`` and ``manifests`` import
nothing of ours; ``p2p`` imports ``manifests`` and ``infra``; ``scheduler_link`` imports
``infra``; ``agent`` and ``placer`` sit above them and never import each other; ``cli`` is on top.
"""
