"""Fetch an artifact (a manifest and every chunk it needs) into the local store.

One path, the herd's (``p2p.herd.herd_fetch``), with or without peers: the manifest
first, from the store, its tree or the origin, verified by its id; then every chunk
the store lacks, with bounded concurrency, verified before it is stored; chunks
already present are skipped, so an interrupted fetch resumes where it stopped. Only
when every chunk is present are the chunk files synced and the manifest marked
complete. While the fetch runs the manifest is pinned, so quota eviction cannot undo
its progress. Concurrent fetches into one store share one download per chunk and per
manifest (:class:`p2p.flight.SingleFlight`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from infra.peers import PeerTable

from .origins import Origin
from .store import ChunkStore

if TYPE_CHECKING:   # p2p.herd imports this module
    from .herd import Herd


class FetchStats(msgspec.Struct, frozen=True, kw_only=True):
    manifest: str
    bytes: int                # unique bytes of the artifact (= from_origin + from_peers + local)
    bytes_from_origin: int
    bytes_from_peers: int
    bytes_local: int
    chunks_fetched: int
    seconds: float


async def fetch_artifact(store: ChunkStore, manifest_id: str, origin: Origin, *,
                         peers: Sequence[Any] | PeerTable = (), node_id: str | None = None, token: str | None = None,
                         progress: Callable[[int, int], None] | None = None,
                         concurrency: int = 16, herd: Herd | None = None,
                         origin_tries: int | None = None) -> FetchStats:
    """Make ``manifest_id`` complete in ``store``. ``progress(bytes_done, bytes_total)``.

    Always through the herd (p2p.herd): with ``peers`` (Peer structs, data-plane URLs or
    the gang's PeerTable) or a ``herd``, the herd protocol; without, a herd of one (the
    origin only). Raises IntegrityError (bad bytes, at rest: nothing is marked complete),
    NotFoundError/OriginError, StoreFullError, ManifestError (hostile manifest).

    Retries: the herd's origin call is the one layer (``origin_tries`` requests a chunk
    when the origin is down or says "later"; default ``HerdConfig.origin_tries``, or the
    ``herd``'s own config). Open ``origin`` with ``retries=0`` (``open_origin``), or its
    transport retries inside every one of those requests.
    """
    # One fetch path: the herd (p2p.herd). Without peers it is a herd of one -- this node
    # is every chunk's home and reads the origin, ``concurrency`` requests at once.
    # ``herd``: a long-lived p2p.herd.Herd (the agent's, whose config says), else one
    # made for this call.
    from .herd import HerdConfig, fetch_with_peers
    config = None
    if herd is None:
        config = HerdConfig() if peers else HerdConfig(origin_concurrency=max(1, concurrency))
        if origin_tries is not None:
            config = dataclasses.replace(config, origin_tries=max(1, origin_tries))
    return await fetch_with_peers(store, manifest_id, origin, peers=peers, node_id=node_id,
                                  token=token, progress=progress, herd=herd, config=config)
