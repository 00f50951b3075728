"""Publish a directory to an origin: scan, upload what the origin lacks, then the manifest,
then move the ref. Readers never see a ref to a manifest whose chunks are not all there.

What the origin holds is learnt first from the manifests of the last ``dedup_refs`` refs of
the same name (``trainer:v41``, ``trainer:v40``, ... for ``trainer:v42``; newest by the ref
object's time, as gc orders them): one listing of the name's refs, one GET per ref and one
per manifest. Only the chunks none of them names are asked about (an existence check per
chunk, in bulk where the backend allows). So an incremental release costs O(new chunks +
N) origin requests however large the artifact (tests/test_publish_dedup.py counts them).

After the ref, publish checks once more and puts back anything missing: a ``herd artifact
gc`` running meanwhile may have moved aside chunks this publish found present (p2p/gc.py
says why that check, with gc's own second listing, leaves nothing missing). The check is
as cheap as the first: the chunks that were asked about (found, or uploaded: a gc with a
short grace may move either) are checked again, and the refs the dedup relied on are read
again. gc removes refs before it moves any chunk, so a
relied-on ref that still names the same manifest means no gc run took that manifest's
chunks; one that changed or vanished makes publish check every chunk, as without dedup.
The dedup trusts that only gc prunes an origin (a chunk deleted by hand from under a kept
manifest is not noticed here; ``herd artifact verify`` finds it)."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec
import trio
from blake3 import blake3

from manifests import Chunk, ChunkerParams, ChunkSource, decode_manifest, encode_manifest, scan_tree
from manifests.scan import ScannedChunk, ScanResult
from manifests.window import WINDOW_BYTES, WindowPool

from .errors import IntegrityError, ManifestError, NotFoundError, P2PError, ReadOnlyOriginError
from .origins import Origin, check_ref_name, is_manifest_id
from .origins.base import MAX_REF_BYTES, ref_family
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
    dedup_refs: list[str] = []     # the recent refs whose manifests were taken as present
    chunks_known: int = 0          # chunks one of those manifests names: not asked about
    chunks_checked: int = 0        # chunks asked about (an existence check each)


class RecentRefs(msgspec.Struct, frozen=True, kw_only=True):
    """What the last N refs of a name say the origin holds."""
    refs: dict[str, str]           # ref name -> the manifest id it named when read
    chunks: frozenset[str]         # every chunk id those manifests name


READ_CONCURRENCY = 8
CHECK_BATCH = 1024       # chunk ids per existence check while the scan runs ...
CHECK_WAIT_S = 0.25      # ... or what came within this long (so uploads start early)
CHECK_BYTES = 64 << 20   # ... or this many bytes of them (they hold the scan's windows)
WINDOW_BUDGET = 256 << 20   # bytes of read windows the scan may be ahead of the uploads


async def recent_refs(origin: Origin, name: str, n: int) -> RecentRefs:
    """The last ``n`` refs of ``name``'s family (``name`` itself included when it exists:
    it still names the version being replaced) and the chunks their manifests name. A ref
    that vanished meanwhile, names no manifest id, or whose manifest is missing or does not
    decode against its id is left out (its chunks are then checked, not assumed)."""
    if n <= 0:
        return RecentRefs(refs={}, chunks=frozenset())
    family = ref_family(name)
    listed = [o for o in await origin.list_objects(f"refs/{family}")
              if ref_family(o.key[len("refs/"):]) == family]
    listed.sort(key=lambda o: (o.updated, o.key), reverse=True)
    refs: dict[str, str] = {}

    async def read_ref(key: str) -> None:
        try:
            text = (await origin.get_object(key, MAX_REF_BYTES)).decode("ascii", "replace").strip()
        except NotFoundError:
            return
        if is_manifest_id(text):
            refs[key[len("refs/"):]] = text

    await run_pool([o.key for o in listed[:n]], read_ref, READ_CONCURRENCY)
    chunks: set[str] = set()
    bad: set[str] = set()

    async def read_manifest(mid: str) -> None:
        try:
            m = decode_manifest(await origin.get_manifest(mid), mid)
        except (NotFoundError, ManifestError, IntegrityError) as e:
            log.warning("publish dedup: skipping manifest=%s (%s); its chunks are checked instead", mid, e)
            bad.add(mid)
            return
        chunks.update(c.id for c in m.chunks)

    await run_pool(sorted(set(refs.values())), read_manifest, READ_CONCURRENCY)
    return RecentRefs(refs={r: m for r, m in refs.items() if m not in bad}, chunks=frozenset(chunks))


def read_source(cid: str, src: ChunkSource) -> bytes:
    """Read a chunk back from the published tree and check it still hashes to its id."""
    with open(src.path, "rb") as f:
        data = os.pread(f.fileno(), src.size, src.offset)
    if len(data) != src.size or blake3(data).hexdigest() != cid:
        raise IntegrityError(f"{src.path} changed while it was being published; publish again")
    return data


async def publish(root: str | os.PathLike[str], origin: Origin, name: str,
                  params: ChunkerParams | None = None, *, concurrency: int = 16,
                  progress: Callable[[int, int], None] | None = None,
                  dedup_refs: int = DEDUP_REFS) -> PublishStats:
    """Publish the tree at ``root`` as ``name`` (a ref like ``trainer:v42``).

    ``dedup_refs``: how many of the name's latest refs tell what the origin holds (0: ask
    about every chunk). ``progress(bytes_uploaded, bytes_to_upload)`` is called as
    uploads finish. Raises ManifestError for a tree that cannot be represented,
    OriginError/RefError.
    """
    check_ref_name(name)
    if dedup_refs < 0:
        raise P2PError(f"--dedup-refs must be >= 0 (got {dedup_refs})")
    if origin.read_only:
        raise ReadOnlyOriginError(f"origin {origin.url} is read-only; publish to file:// or gs://")
    root = Path(root)
    if not root.is_dir():
        raise P2PError(f"not a directory: {root}")
    t0 = time.perf_counter()
    # A pipeline, so the disk and the origin work while the tree is still being scanned:
    # the scan (a worker thread) hands each read window's new chunks over a channel, with
    # the bytes it hashed (manifests.window); one task (once the recent refs are known)
    # asks the origin about those no recent manifest names, in batches of whatever has
    # queued up; uploaders put the missing ones straight from the scan's windows (no
    # second read or hash of the file) and release them, which lets the scan read on.
    found: list[RecentRefs] = []
    scanned: list[ScanResult] = []
    learned = trio.Event()
    # unbounded: what the scan may hold is bounded by its windows (WINDOW_BUDGET), and a
    # hand-off that waited for the trio thread cost the scan ~a third of its time (the
    # thread waits for the loop to take the GIL: 0.9-1.3 s of a 2.8-3.7 s scan of 1 GB)
    batches_in, batches_out = trio.open_memory_channel[list[ScannedChunk]](math.inf)
    uploads_in, uploads_out = trio.open_memory_channel[ScannedChunk](math.inf)
    unknown: list[str] = []
    uploaded: dict[str, int] = {}
    done = {"bytes": 0, "total": 0}
    params = params if params is not None else ChunkerParams()

    token = trio.lowlevel.current_trio_token()

    def hand_over(batch: list[ScannedChunk]) -> None:   # on the trio thread, in call order
        try:
            batches_in.send_nowait(batch)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            for c in batch:    # the check stopped (it closed the pool: the scan stops too)
                c.release()

    def on_chunks(batch: list[ScannedChunk]) -> None:   # the scanning thread: does not wait
        token.run_sync_soon(hand_over, batch)

    def ask_now() -> None:   # the scanning thread, out of windows: the check must not wait
        token.run_sync_soon(hand_over, [])

    pool = WindowPool(window_bytes=max(WINDOW_BYTES, 4 * params.max_size),
                      budget_bytes=max(WINDOW_BUDGET, 8 * params.max_size),
                      on_wait=ask_now, check=trio.from_thread.check_cancelled)

    async def scan_it() -> None:
        with batches_in:
            scanned.append(await trio.to_thread.run_sync(
                partial(scan_tree, root, params, on_chunks=on_chunks, pool=pool)))

    async def learn() -> None:
        found.append(await recent_refs(origin, name, dedup_refs))
        learned.set()

    async def check() -> None:
        # closing batches_out frees a scan blocked on a full channel, closing the pool one
        # blocked on the windows
        with batches_out, uploads_in:
            try:
                await check_loop()
            finally:
                pool.close()

    async def check_loop() -> None:
        await learned.wait()
        known = found[0].chunks
        pending: list[ScannedChunk] = []
        pending_bytes = 0

        def take(batch: list[ScannedChunk]) -> bool:
            """Queue the chunks no recent manifest names; False for the scan's 'ask now'."""
            nonlocal pending_bytes
            for c in batch:
                if c.id in known:
                    c.release()
                else:
                    pending.append(c)
                    pending_bytes += c.source.size
            return bool(batch)

        closed = False
        first = True
        while not closed:
            # gather CHECK_BATCH ids (or CHECK_BYTES of them, or CHECK_WAIT_S' worth, or
            # until the scan runs out of windows) per existence check: a backend that
            # lists in bulk (gs://) then lists rather than asks one by one. The window
            # opens with the first new chunk: waiting for a whole batch first held every
            # upload until the scan had found CHECK_BATCH new chunks
            if not pending:
                try:
                    take(await batches_out.receive())
                except trio.EndOfChannel:
                    break
                if not pending:
                    continue
            # ... except the first: nothing is being uploaded yet, so waiting only delays
            # the first upload (it started ~0.28 s into a ~2.3 s publish of the 1 GB bench
            # tree, small files first, ~0.12 s asking at once)
            with trio.move_on_after(0 if first else CHECK_WAIT_S):
                while len(pending) < CHECK_BATCH and pending_bytes < CHECK_BYTES:
                    try:
                        if not take(await batches_out.receive()):
                            break
                    except trio.EndOfChannel:
                        closed = True
                        break
            first = False
            ask, pending, pending_bytes = pending, [], 0
            unknown.extend(c.id for c in ask)
            try:
                missing = await origin.missing([c.id for c in ask])
            except BaseException:
                for c in ask:
                    c.release()
                raise
            for c in ask:
                if c.id in missing:
                    done["total"] += c.source.size
                    uploads_in.send_nowait(c)
                else:
                    c.release()

    async def put(cid: str, src: ChunkSource, data: memoryview | None = None, *, again: bool = False) -> None:
        if data is None:
            data = memoryview(await trio.to_thread.run_sync(read_source, cid, src))
        await origin.put_chunk(cid, data)
        if again:   # put back after the ref (see the module's header): not counted as new
            return
        uploaded[cid] = src.size
        done["bytes"] += src.size
        if progress is not None:
            progress(done["bytes"], done["total"])

    async def uploader() -> None:
        async for c in uploads_out:
            try:
                await put(c.id, c.source, c.data)
            finally:
                c.release()

    # the first failure is raised as itself (and cancels the rest: a blocked scan is freed)
    await run_pool([scan_it, learn, check] + [uploader] * max(1, concurrency), lambda job: job(),
                   3 + max(1, concurrency))
    recent, scan = found[0], scanned[0]
    m = scan.manifest
    ids = [c.id for c in m.chunks]
    total = sum(uploaded.values())
    log.info("publish name=%s manifest=%s chunks=%d known_from_refs=%d checked=%d uploaded=%d bytes_uploaded=%d",
             name, m.id, len(ids), len(ids) - len(unknown), len(unknown), len(uploaded), total)

    async def upload(c: Chunk) -> None:
        await put(c.id, scan.sources[c.id], again=True)

    raw = encode_manifest(m)
    await origin.put_manifest(m.id, raw, ref=name)
    await origin.set_ref(name, m.id)
    # The check after the ref (see the module's header): a gc may have moved aside what we reused.
    recheck = unknown   # found present or uploaded by us: as exposed to a gc as without dedup
    if recent.refs:
        # our own ref is now the newest of the family: read one more to see the N before it
        again = await recent_refs(origin, name, dedup_refs + 1)
        if any(again.refs.get(r) != mid for r, mid in recent.refs.items() if r != name):
            log.info("publish name=%s: a ref the dedup relied on changed meanwhile; checking every chunk", name)
            recheck = ids
    by_id = {c.id: c for c in m.chunks}
    lost = [by_id[cid] for cid in sorted(await origin.missing(recheck))] if recheck else []
    if lost or not await origin.has_manifest(m.id):
        log.warning("publish name=%s manifest=%s put back chunks=%d removed while it ran (a gc?)",
                    name, m.id, len(lost))
        await run_pool(lost, upload, concurrency)
        await origin.put_manifest(m.id, raw, ref=name)
    files = sum(1 for e in m.entries if e.kind == "file")
    return PublishStats(manifest=m.id, name=name, files=files, bytes=m.total_size, chunks=len(m.chunks),
                        chunks_uploaded=len(uploaded), bytes_uploaded=total,
                        seconds=round(time.perf_counter() - t0, 6), dedup_refs=sorted(recent.refs),
                        chunks_known=len(ids) - len(unknown), chunks_checked=len(unknown))
