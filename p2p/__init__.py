"""Peer-to-peer artifact distribution: the chunk store, origins, publish and fetch, and the
herd data plane.

Public API (others may rely on these names):

- ``ChunkStore`` (p2p.store): chunks, manifests, materialised trees, quota/LRU, pins.
- ``open_origin(url)`` (p2p.origins): ``file://``, ``gs://``, ``http(s)://`` behind one async interface.
- ``publish(root, origin, name, params) -> PublishStats`` (p2p.publish).
- ``fetch_artifact(store, manifest_id, origin, ...) -> FetchStats`` (p2p.fetch).
- ``DataPlane(store, token=..., listen=...)`` (p2p.dataplane): the peer-facing chunk server
  (h11, ``os.sendfile``, ``wait_ms``), ``await nursery.start(dp.run)`` -> its URL.
- ``Readers`` (p2p.readers): who may read which manifests from a data plane (reads by
  membership: ``DataPlane(..., readers=)``, ``set_gangs``); ``chunk_refusal`` / ``manifest_refusal``.
- ``Herd(store, node_id=..., token=...)`` (p2p.herd): a node's long-lived herd fetcher
  (rendezvous homes, single flight, penalties, endgame); ``render_metrics`` for /metrics.
- ``plan_sources`` / ``assign_homes`` (p2p.rendezvous): the pure source choice.
- errors (p2p.errors): ``P2PError``, ``StoreError``, ``StoreFullError``, ``OriginError``,
  ``NotFoundError``, ``RefError``, ``PeerError``, ``IntegrityError``.

Submodules are imported lazily by callers (``from p2p.store import ChunkStore``) so that
importing ``p2p`` stays cheap.
"""
