"""Publish a directory to an origin: scan, upload what the origin lacks, then the manifest,
then move the ref. Readers never see a ref to a manifest whose chunks are not all there.

After the ref, publish checks once more that its manifest and every chunk it names are at
the origin and puts back any that are not: a ``herd artifact gc`` running meanwhile may have
moved aside chunks this publish found present (p2p/gc.py says why that check, with gc's own
second listing, leaves nothing missing)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio
from blake3 import blake3

from manifests import Chunk, ChunkerParams, ChunkSource, encode_manifest, scan_tree

from .errors import IntegrityError, P2PError, ReadOnlyOriginError
from .origins import Origin, check_ref_name
from .pool import run_pool

log = logging.getLogger("herd.p2p.publish")

# Publish's dedup window: the chunks the last DEDUP_REFS refs of a name hold may be taken as
# present at the origin without asking it (issue 14's incremental publish). gc keeps at least
# that many refs of each name (p2p/gc.py refuses a smaller --keep-last).
DEDUP_REFS = 4


class PublishStats(msgspec.Struct, frozen=True, kw_only=True):
    manifest: str
    name: str
    files: int
    bytes: int
    chunks: int
    chunks_uploaded: int
    bytes_uploaded: int
    seconds: float


def read_source(cid: str, src: ChunkSource) -> bytes:
    """Read a chunk back from the published tree and check it still hashes to its id."""
    with open(src.path, "rb") as f:
        data = os.pread(f.fileno(), src.size, src.offset)
    if len(data) != src.size or blake3(data).hexdigest() != cid:
        raise IntegrityError(f"{src.path} changed while it was being published; publish again")
    return data


async def publish(root: str | os.PathLike[str], origin: Origin, name: str,
                  params: ChunkerParams | None = None, *, concurrency: int = 16,
                  progress: Callable[[int, int], None] | None = None) -> PublishStats:
    """Publish the tree at ``root`` as ``name`` (a ref like ``trainer:v42``).

    ``progress(bytes_uploaded, bytes_to_upload)`` is called as uploads finish.
    Raises ManifestError for a tree that cannot be represented, OriginError/RefError.
    """
    check_ref_name(name)
    if origin.read_only:
        raise ReadOnlyOriginError(f"origin {origin.url} is read-only; publish to file:// or gs://")
    root = Path(root)
    if not root.is_dir():
        raise P2PError(f"not a directory: {root}")
    t0 = time.perf_counter()
    scan = await trio.to_thread.run_sync(scan_tree, root, params)
    m = scan.manifest
    missing = await origin.missing([c.id for c in m.chunks])
    todo = [c for c in m.chunks if c.id in missing]
    total = sum(c.size for c in todo)
    done = {"bytes": 0}
    log.info("publish name=%s manifest=%s chunks=%d missing=%d bytes_to_upload=%d",
             name, m.id, len(m.chunks), len(todo), total)

    async def upload(c: Chunk) -> None:
        data = await trio.to_thread.run_sync(read_source, c.id, scan.sources[c.id])
        await origin.put_chunk(c.id, data)
        done["bytes"] += c.size
        if progress is not None:
            progress(done["bytes"], total)

    await run_pool(todo, upload, concurrency)
    raw = encode_manifest(m)
    await origin.put_manifest(m.id, raw, ref=name)
    await origin.set_ref(name, m.id)
    # The check after the ref (see the module's header): a gc may have moved aside what we reused.
    lost = [c for c in m.chunks if c.id in await origin.missing([c.id for c in m.chunks])]
    if lost or not await origin.has_manifest(m.id):
        log.warning("publish name=%s manifest=%s put back chunks=%d removed while it ran (a gc?)",
                    name, m.id, len(lost))
        await run_pool(lost, upload, concurrency)
        await origin.put_manifest(m.id, raw, ref=name)
    files = sum(1 for e in m.entries if e.kind == "file")
    return PublishStats(manifest=m.id, name=name, files=files, bytes=m.total_size, chunks=len(m.chunks),
                        chunks_uploaded=len(todo), bytes_uploaded=total,
                        seconds=round(time.perf_counter() - t0, 6))
