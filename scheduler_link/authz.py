"""Who may call what: every route of the agent's and the placer's HTTP APIs and the role it
needs, declared once (DESIGN.md, Security model).

Roles
-----
``placer``   the placer pushing placements to agents            (``placer.token``)
``node``     an agent reporting to the placer; peers' data plane (``cluster.token``; the
             identity issue narrows it to ``node:ID`` certificates)
``operator`` operator actions: stop, inject, submit, cancel      (``operator.token``)
``viewer``   reads: status, workloads, logs, jobs                 (``viewer.token``)
``metrics``  Prometheus scrapes                                   (``metrics.token``)

A credential of a stronger role also holds the weaker ones it implies: ``operator`` reads
(``viewer``) and scrapes (``metrics``); ``viewer`` scrapes. Nothing implies ``placer`` or
``node``. Loopback is not trusted by address: a workload on the host is a local client
too. Three routes are public whatever the credential (``/healthz``, ``/readyz``) or public
by configuration (``/metrics`` while ``open_metrics``; every viewer route while
``open_reads``, for a lab set-up).

Invariants
----------
* every route a daemon serves has exactly one :class:`Rule` in its table, and every rule
  a handler: :func:`install` refuses an app that does not match its table, and the test
  over the tables checks every route against every credential kind;
* a missing or wrong token is 401, a valid token without the role 403; the check sees the
  request head only (bodies of refused senders are never read).

Certificates (issue 17)
-----------------------
A request over TLS carries the verified client certificate's principal
(``Request.principal``, :mod:`infra.tls`): ``placer``, ``node:ID``, ``operator``,
``viewer``, ``metrics``, with the roles :data:`infra.tls.ROLES_OF_KIND` gives it. A
certificate and a bearer token both count; the roles held are the union.

* ``require_certs`` (flag; a TLS daemon sets it unless ``accept_tokens``): the ``placer`` and
  ``node`` roles are proved only by a certificate -- the shared ``placer.token`` and
  ``cluster.token`` prove nothing then. Operator, viewer and metrics tokens keep working
  (scripts, the browser, the CLI over TLS).
* **Node restriction**: a ``node:X`` certificate acts only for X: a route with a
  ``{node_id}`` parameter naming another node is 403 whatever else the request holds.
* Under ``accept_tokens`` a node role proved by ``cluster.token`` is recorded in
  :class:`TokenUse` (logged the first time each node is seen; ``herd pki status`` lists them).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from infra.auth import TokenSet, bearer
from infra.http import App, AuthPolicy, Handler, HTTPError, Request, RouteDoc
from infra.tls import Principal

log = logging.getLogger("herd.authz")
CERT_ONLY = frozenset({"placer", "node"})   # under require_certs, only a certificate proves these

PUBLIC = "public"
ROLES = ("placer", "node", "operator", "viewer", "metrics")
# role -> the token file (TokenSet field) that proves it
ROLE_TOKEN: Mapping[str, str] = {"placer": "placer", "node": "cluster", "operator": "operator",
                                 "viewer": "viewer", "metrics": "metrics"}
IMPLIES: Mapping[str, frozenset[str]] = {
    "operator": frozenset({"viewer", "metrics"}),
    "viewer": frozenset({"metrics"}),
}


@dataclass(frozen=True, slots=True)
class Rule:
    """``method template`` needs one of ``roles`` (or nothing: ``(PUBLIC,)``); ``open_flag``
    names a config flag that, when true, makes the route public."""
    method: str
    template: str
    roles: tuple[str, ...]
    open_flag: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.method, self.template)

    @property
    def public(self) -> bool:
        return self.roles == (PUBLIC,)


_VIEW = ("viewer",)
_OPS = ("operator",)

AGENT_ROUTES: tuple[Rule, ...] = (
    Rule("GET", "/healthz", (PUBLIC,)),
    Rule("GET", "/readyz", (PUBLIC,)),
    Rule("GET", "/metrics", ("metrics",), open_flag="open_metrics"),
    Rule("GET", "/openapi.json", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/status", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/gpus", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/workloads", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/workloads/{wid}", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/workloads/{wid}/logs", _VIEW, open_flag="open_reads"),
    Rule("POST", "/v1/workloads/{wid}/stop", _OPS),
    Rule("POST", "/v1/gpus/{uuid}/inject", _OPS),
    Rule("POST", "/v1/placements", ("placer", "operator")),
    Rule("POST", "/v1/prefetch", ("placer", "operator")),
    Rule("GET", "/v1/store", _VIEW, open_flag="open_reads"),
    Rule("POST", "/v1/store/evict", _OPS),
)

# The placer's API (placer/service.py ``_build_app``). Its reads need the viewer role
# like the agent's; the placer is wired to this table with :func:`install`.
PLACER_ROUTES: tuple[Rule, ...] = (
    Rule("GET", "/healthz", (PUBLIC,)),
    Rule("GET", "/metrics", ("metrics",), open_flag="open_metrics"),
    Rule("GET", "/openapi.json", _VIEW, open_flag="open_reads"),
    Rule("POST", "/v1/nodes/{node_id}/report", ("node",)),
    Rule("GET", "/v1/nodes", _VIEW, open_flag="open_reads"),
    Rule("POST", "/v1/nodes/{node_id}/cordon", _OPS),
    Rule("POST", "/v1/nodes/{node_id}/uncordon", _OPS),
    Rule("POST", "/v1/nodes/{node_id}/drain", _OPS),
    Rule("POST", "/v1/nodes/{node_id}/approve", _OPS),      # herd node approve (placer.approvals)
    Rule("GET", "/v1/approvals", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/cluster", _VIEW, open_flag="open_reads"),
    # the dashboard (placer/dashboard): the page and its assets hold no data; the map does
    Rule("GET", "/", (PUBLIC,)),
    Rule("GET", "/dashboard/{asset}", (PUBLIC,)),
    Rule("GET", "/v1/cluster/map", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/cluster/map/node/{row}", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/cluster/map/job/{job_id}", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/gangs/{blob_id}", ("node",)),
    Rule("POST", "/v1/jobs", _OPS),
    Rule("GET", "/v1/jobs", _VIEW, open_flag="open_reads"),
    Rule("GET", "/v1/jobs/{job_id}", _VIEW, open_flag="open_reads"),
    Rule("DELETE", "/v1/jobs/{job_id}", _OPS),
    Rule("POST", "/v1/jobs/{job_id}/artifact", _OPS),
    Rule("POST", "/v1/defrag", _OPS),
    Rule("POST", "/v1/prefetch", _OPS),
    Rule("GET", "/v1/status", _VIEW, open_flag="open_reads"),
    # the handler checks the single-use bootstrap token (scheduler_link.pki_api)
    Rule("POST", "/v1/pki/bootstrap", (PUBLIC,)),
    Rule("POST", "/v1/pki/renew", ("node",)),
)

TABLES: Mapping[str, tuple[Rule, ...]] = {"agent": AGENT_ROUTES, "placer": PLACER_ROUTES}


def held_roles(tokens: TokenSet, presented: str | None) -> frozenset[str]:
    """The roles a presented bearer token proves (with the ones they imply). Every role's
    token is compared (constant time each), so timing does not tell which one matched."""
    if not presented:
        return frozenset()
    held: set[str] = set()
    p = presented.encode()
    for role, token_file in ROLE_TOKEN.items():
        expected = tokens.get(token_file)
        if expected and hmac.compare_digest(expected.encode(), p):
            held.add(role)
    for role in list(held):
        held |= IMPLIES.get(role, frozenset())
    return frozenset(held)


@dataclass(slots=True)
class TokenUse:
    """Nodes that reported with ``cluster.token`` while ``accept_tokens`` (a migration):
    node id -> requests; each node logged once, when first seen."""
    nodes: dict[str, int] = field(default_factory=dict)
    limit: int = 100_000

    def record(self, node_id: str) -> None:
        n = self.nodes.get(node_id)
        if n is None:
            if len(self.nodes) >= self.limit:
                return
            log.warning("token-authenticated agent node=%s (accept_tokens: issue it a certificate)", node_id)
            n = 0
        self.nodes[node_id] = n + 1


def _token_principal(held: frozenset[str]) -> Principal | None:
    for kind in ("operator", "placer", "node", "viewer", "metrics"):
        if kind in held:
            return Principal(kind, via="token")
    return None


def request_roles(req: Request, tokens: TokenSet, flags: Mapping[str, bool]) -> frozenset[str]:
    """The roles a request holds: its certificate's and its bearer token's (less the
    certificate-only roles under ``require_certs``). Sets ``req.principal`` from the token
    when no certificate came."""
    held = held_roles(tokens, bearer(req.headers))
    if flags.get("require_certs", False):
        held = held - CERT_ONLY
    if req.principal is None:
        req.principal = _token_principal(held)
    elif req.principal.via == "cert":
        held = held | req.principal.roles
    return held


def allowed(rule: Rule, held: frozenset[str], flags: Mapping[str, bool]) -> bool:
    """Pure: may a caller holding ``held`` call ``rule`` under config ``flags``?"""
    if rule.public or (rule.open_flag is not None and flags.get(rule.open_flag, False)):
        return True
    return any(r in held for r in rule.roles)


def policy(rule: Rule, tokens: TokenSet, flags: Mapping[str, bool],
           token_use: TokenUse | None = None) -> AuthPolicy | None:
    """The request check for ``rule`` (None: public under these flags)."""
    if allowed(rule, frozenset(), flags):
        return None
    need = ", ".join(rule.roles)
    certs = flags.get("require_certs", False)
    names_node = "{node_id}" in rule.template

    def check(req: Request) -> None:
        held = request_roles(req, tokens, flags)
        p = req.principal
        if names_node and p is not None and p.via == "cert" and p.kind == "node" \
                and req.params.get("node_id") != p.node_id:
            raise HTTPError(403, "forbidden", f"this certificate is node:{p.node_id}; it may not act for "
                                              f"node {req.params.get('node_id', '')[:200]}")
        if any(r in held for r in rule.roles):
            if token_use is not None and "node" in rule.roles and p is not None and p.via == "token" \
                    and p.kind == "node" and names_node:
                token_use.record(req.params.get("node_id", "")[:200])
            return
        if not held:
            what = "a client certificate" if certs and set(rule.roles) <= CERT_ONLY else "a bearer token"
            raise HTTPError(401, "unauthorized", f"needs {what} with the role: {need}")
        raise HTTPError(403, "forbidden", f"this credential ({', '.join(sorted(held))}) lacks the role: {need}")
    return check


def install(app: App, table: tuple[Rule, ...], handlers: Mapping[tuple[str, str], Handler],
            tokens: TokenSet, flags: Mapping[str, bool] | None = None,
            max_body: Mapping[tuple[str, str], int] | None = None,
            docs: Mapping[tuple[str, str], RouteDoc] | None = None,
            token_use: TokenUse | None = None) -> None:
    """Add every route of ``table`` to ``app`` with its policy. ``handlers`` maps
    ``(method, template)`` to the handler; a handler without a rule, or a rule without a
    handler, is a ``ValueError`` at build time (no route is ever served undeclared).
    Each route's OpenAPI description is the table's in :mod:`scheduler_link.apidocs`,
    or the one ``docs`` gives for it (types of the daemon's own package)."""
    from .apidocs import DOCS

    flags = flags or {}
    max_body = max_body or {}
    name = next((k for k, t in TABLES.items() if t is table), None)
    route_docs = {**(DOCS.get(name, {}) if name else {}), **(docs or {})}
    rules = {r.key: r for r in table}
    if len(rules) != len(table):
        raise ValueError("a route is declared twice in the authz table")
    undeclared = sorted(set(handlers) - set(rules))
    if undeclared:
        raise ValueError(f"routes without a declared role: {undeclared}")
    missing = sorted(set(rules) - set(handlers))
    if missing:
        raise ValueError(f"declared routes without a handler: {missing}")
    for rule in table:
        app.add(rule.method, rule.template, handlers[rule.key], auth=policy(rule, tokens, flags, token_use),
                max_body=max_body.get(rule.key), doc=route_docs.get(rule.key),
                roles=() if rule.public else rule.roles)
