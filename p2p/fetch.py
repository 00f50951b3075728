"""Fetch an artifact (a manifest and every chunk it needs) into the local store.

The manifest comes first, from the store or the origin, verified by its id. Then
every chunk the store lacks is downloaded with bounded concurrency, verified by the
store on the way in, and stored; chunks already present are skipped, so an
interrupted fetch resumes where it stopped. Only when every chunk is present are
the chunk files synced and the manifest marked complete. While the fetch runs the
manifest is pinned, so quota eviction cannot undo its progress.

Single-flight (:class:`p2p.flight.SingleFlight`, over ``store.inflight``): concurrent
fetches into one store, origin-only or through the herd, share one download per chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from manifests import Manifest
from scheduler_link.messages import PeerTable

from .errors import IntegrityError
from .flight import SingleFlight
from .origins import Origin, check_hex_id
from .pool import run_pool
from .store import ChunkStore, manifest_chunks

if TYPE_CHECKING:   # p2p.herd imports this module
    from .herd import Herd

log = logging.getLogger("herd.p2p.fetch")


class FetchStats(msgspec.Struct, frozen=True, kw_only=True):
    manifest: str
    bytes: int                # unique bytes of the artifact (= from_origin + from_peers + local)
    bytes_from_origin: int
    bytes_from_peers: int
    bytes_local: int
    chunks_fetched: int
    seconds: float


async def load_manifest(store: ChunkStore, manifest_id: str, origin: Origin) -> Manifest:
    """The manifest from the store, else from the origin (verified by id, then stored;
    one download however many fetches want it at once)."""
    check_hex_id(manifest_id, "manifest id")

    async def download() -> Manifest:
        data = await origin.get_manifest(manifest_id)
        return await trio.to_thread.run_sync(store.put_manifest, manifest_id, data)

    got = await SingleFlight(store.inflight).run(f"manifest:{manifest_id}",
                                                 partial(store.has_manifest, manifest_id), download)
    return got if got is not None else await trio.to_thread.run_sync(store.get_manifest, manifest_id)


async def fetch_artifact(store: ChunkStore, manifest_id: str, origin: Origin, *,
                         peers: Sequence[Any] | PeerTable = (), node_id: str | None = None, token: str | None = None,
                         progress: Callable[[int, int], None] | None = None,
                         concurrency: int = 16, herd: Herd | None = None) -> FetchStats:
    """Make ``manifest_id`` complete in ``store``. ``progress(bytes_done, bytes_total)``.

    With ``peers`` (Peer structs or data-plane URLs) or a ``herd``, the herd protocol
    fetches (p2p.herd); without, the origin only. Raises IntegrityError (bad bytes: nothing is marked complete),
    NotFoundError/OriginError, StoreFullError, ManifestError (hostile manifest).
    """
    if peers or herd is not None:
        # The herd protocol (p2p.herd): homes fetch from the origin, the others from peers.
        # ``herd``: a long-lived p2p.herd.Herd (the agent's), else one made for this call.
        from .herd import fetch_with_peers
        return await fetch_with_peers(store, manifest_id, origin, peers=peers, node_id=node_id,
                                      token=token, progress=progress, herd=herd)
    t0 = time.perf_counter()
    manifest = await load_manifest(store, manifest_id, origin)
    store.pin(manifest_id)
    try:
        sizes = manifest_chunks(manifest)
        total = sum(sizes.values())
        todo = [cid for cid in sizes if not store.has_chunk(cid)]
        state = {"done": total - sum(sizes[c] for c in todo), "origin": 0, "chunks": 0, "shared": 0}
        if progress is not None:
            progress(state["done"], total)

        flight = SingleFlight(store.inflight)

        async def download(cid: str, size: int) -> bool:
            data = await origin.get_chunk(cid, size)   # read no more than the manifest promises
            if len(data) != size:
                raise IntegrityError(f"origin chunk {cid} is {len(data)} bytes, expected {size}")
            await trio.to_thread.run_sync(store.put_chunk, cid, data)
            return True

        async def one(cid: str) -> None:
            size = sizes[cid]
            # someone else downloading it (or done already): wait for them
            if await flight.run(cid, partial(store.has_chunk, cid), partial(download, cid, size)):
                state["origin"] += size
                state["chunks"] += 1
            else:
                state["shared"] += size
            state["done"] += size
            if progress is not None:
                progress(state["done"], total)

        await run_pool(todo, one, concurrency)
        await trio.to_thread.run_sync(store.mark_complete, manifest_id)
    finally:
        store.unpin(manifest_id)
    stats = FetchStats(manifest=manifest_id, bytes=total, bytes_from_origin=state["origin"],
                       bytes_from_peers=0, bytes_local=total - state["origin"],
                       chunks_fetched=state["chunks"], seconds=round(time.perf_counter() - t0, 6))
    log.info("fetched manifest=%s bytes=%d from_origin=%d local=%d chunks=%d seconds=%.3f",
             manifest_id, total, stats.bytes_from_origin, stats.bytes_local, stats.chunks_fetched, stats.seconds)
    return stats
