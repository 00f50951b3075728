"""Peer-to-peer artifact distribution: the chunk store, origins, publish and fetch, and the
herd data plane.

Public API (others may rely on these names):

- ``ChunkStore`` (p2p.store): chunks, manifests, materialised trees, quota/LRU, pins.
- ``open_origin(url)`` (p2p.origins): ``file://``, ``gs://``, ``http(s)://`` behind one async interface.
- ``publish(root, origin, name, params) -> PublishStats`` (p2p.publish).
- ``fetch_artifact(store, manifest_id, origin, ...) -> FetchStats`` (p2p.fetch).
- errors (p2p.errors): ``P2PError``, ``StoreError``, ``StoreFullError``, ``OriginError``,
  ``NotFoundError``, ``RefError``, ``PeerError``, ``IntegrityError``.

Submodules are imported lazily by callers (``from p2p.store import ChunkStore``) so that
importing ``p2p`` stays cheap.
"""
