"""Garbage collection of an origin (``herd artifact gc``): which refs, manifests and chunks
go, and removing them without racing a publish into a manifest that names a deleted chunk.

Theory of operation
-------------------
*Mark.* The refs kept are the last ``keep_last`` refs of each name (by the ref object's own
time; a ref's name is the part before its last ``:``), every ref ``keep`` names, and every
ref younger than the grace. The live manifests are those the kept refs name plus every
manifest younger than the grace (a publish in flight, a job placed by id a moment ago); the
live chunks are those the live manifests name. ``keep_last`` is never below publish's dedup
window (:data:`p2p.publish.DEDUP_REFS`): publish may take the chunks the last N versions
of a name hold as present without asking the origin.

*Sweep.* Refs not kept, manifests not live and chunks not live go, each only when older than
the grace (the backend's own clock: a file's mtime, a GCS object's ``updated``). Removal
runs top down -- refs, manifests, chunks -- so a ref that stays never names a missing
manifest, nor a manifest that stays a missing chunk.

*Racing a publish.* A publish checks which chunks the origin holds, uploads the others,
writes its manifest, moves its ref, then checks once more that its manifest and every
chunk are there and puts back any that are not (:func:`p2p.publish.publish`). gc never
deletes a manifest or a chunk outright: it moves them aside under ``trash/<run>/``, then
lists the refs and the manifests again, restores whatever a ref or a manifest it had not
seen names, and only then deletes what it moved aside. Either that second listing saw the
publish's ref -- and gc restored what it names -- or the ref was written after it, so after
every move, and the publish's last check saw the moves and put the bytes back itself.
Either way a publish that returned leaves its ref, its manifest and every chunk it names,
whatever gc did meanwhile, and no clock is trusted for it (the grace spares work in
flight and churn, not correctness). A ref is removed only if it is still the version
listed (a GCS generation; a file renamed aside and compared), so a ref moved meanwhile stays.

The choice (:func:`choose_refs`, :func:`live_manifests`, :func:`sweep`) is plain functions
over listings, ``now`` passed in; :func:`collect` does the I/O around them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence

import msgspec

from manifests import MAX_MANIFEST_BYTES, decode_manifest

from .errors import IntegrityError, ManifestError, NotFoundError, OriginError
from .origins import ObjectInfo, Origin, is_manifest_id
from .origins.base import MAX_REF_BYTES, ref_family
from .pool import run_pool
from .publish import DEDUP_REFS

log = logging.getLogger("herd.p2p.gc")

TRASH = "trash/"
LEFTOVER_TRASH_S = 24 * 3600.0   # a run's trash older than this is a crashed run's: removed
CONCURRENCY = 16


class GcPolicy(msgspec.Struct, frozen=True, kw_only=True):
    keep_last: int = DEDUP_REFS
    keep: tuple[str, ...] = ()
    grace_s: float = 7 * 86400.0


class RefInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    manifest: str | None        # None: the ref does not hold a manifest id
    obj: ObjectInfo


def check_policy(policy: GcPolicy) -> None:
    if policy.keep_last < DEDUP_REFS:
        raise ValueError(f"--keep-last {policy.keep_last} is below publish's dedup window of {DEDUP_REFS}: "
                         f"publish takes the chunks of the last {DEDUP_REFS} versions of a name as present")
    if policy.grace_s < 0:
        raise ValueError("the grace must be >= 0")


# ---------------------------------------------------------------------- the decision

def choose_refs(refs: Sequence[RefInfo], policy: GcPolicy, now: float) -> tuple[list[RefInfo], list[RefInfo]]:
    """(kept, removed). Kept: the last ``keep_last`` of each family, those ``keep``
    names, and those younger than the grace. Pure."""
    by_family: dict[str, list[RefInfo]] = {}
    for r in refs:
        by_family.setdefault(ref_family(r.name), []).append(r)
    keep = set(policy.keep)
    kept: list[RefInfo] = []
    removed: list[RefInfo] = []
    for fam in sorted(by_family):
        ordered = sorted(by_family[fam], key=lambda r: (r.obj.updated, r.name), reverse=True)
        for i, r in enumerate(ordered):
            young = now - r.obj.updated < policy.grace_s
            (kept if i < policy.keep_last or r.name in keep or young else removed).append(r)
    return sorted(kept, key=lambda r: r.name), sorted(removed, key=lambda r: r.name)


def live_manifests(kept: Iterable[RefInfo], manifests: Iterable[ObjectInfo], policy: GcPolicy,
                   now: float) -> set[str]:
    """Manifests the kept refs name, and every manifest younger than the grace. Pure."""
    live = {r.manifest for r in kept if r.manifest is not None}
    live |= {_name(m) for m in manifests if now - m.updated < policy.grace_s}
    return live


def sweep(manifests: Iterable[ObjectInfo], chunks: Iterable[ObjectInfo], live: set[str], live_chunks: set[str],
          policy: GcPolicy, now: float) -> tuple[list[ObjectInfo], list[ObjectInfo]]:
    """(manifests, chunks) to remove: not live and older than the grace. Pure."""
    def old(o: ObjectInfo) -> bool:
        return now - o.updated >= policy.grace_s
    doomed_m = sorted((m for m in manifests if _name(m) not in live and old(m)), key=lambda o: o.key)
    doomed_c = sorted((c for c in chunks if _name(c) not in live_chunks and old(c)), key=lambda o: o.key)
    return doomed_m, doomed_c


def _name(o: ObjectInfo) -> str:
    return o.key.rsplit("/", 1)[-1]


# ---------------------------------------------------------------------- the report

class GcReport(msgspec.Struct, frozen=True, kw_only=True):
    origin: str
    dry_run: bool
    keep_last: int
    grace_s: float
    kept_refs: list[str]
    removed_refs: list[str]
    removed_manifests: list[str]
    removed_chunks: list[str]
    bytes_freed: int
    manifests_kept: int
    chunks_kept: int
    bytes_kept: int
    restored: list[str]           # put back: a publish named them while gc ran
    dangling_refs: list[str]      # kept refs whose manifest is not at the origin
    leftover_trash: int           # objects of crashed runs' trash removed
    seconds: float


# ---------------------------------------------------------------------- the I/O

async def read_refs(origin: Origin) -> list[RefInfo]:
    """Every ref at the origin with the manifest id it holds (one GET each, bounded concurrency)."""
    objs = [o for o in await origin.list_objects("refs/") if o.key != "refs/"]
    out: list[RefInfo] = []

    async def one(o: ObjectInfo) -> None:
        try:
            text = (await origin.get_object(o.key, MAX_REF_BYTES)).decode("ascii", "replace").strip()
        except NotFoundError:  # removed while we listed
            return
        out.append(RefInfo(name=o.key[len("refs/"):], manifest=text if is_manifest_id(text) else None, obj=o))

    await run_pool(objs, one, CONCURRENCY)
    return sorted(out, key=lambda r: r.name)


async def _chunks_of(origin: Origin, mids: Iterable[str], *, trash: str | None = None) -> set[str]:
    """The chunk ids the manifests name (looked for in ``trash`` too when given). A manifest
    not found is skipped; one that does not decode stops gc: nobody could tell what it needs."""
    out: set[str] = set()

    async def one(mid: str) -> None:
        try:
            data = await origin.get_manifest(mid)
        except NotFoundError:
            if trash is None:
                return
            try:  # moved aside by this run (restored meanwhile, or a ref names it again)
                data = await origin.get_object(f"{trash}manifests/{mid}", MAX_MANIFEST_BYTES)
            except NotFoundError:
                return
        try:
            m = decode_manifest(data, mid)
        except (ManifestError, IntegrityError) as e:
            raise OriginError(f"origin {origin.url}: manifest {mid} is damaged ({e}); gc stops: "
                              "it cannot tell which chunks that manifest needs") from None
        out.update(c.id for c in m.chunks)

    await run_pool(sorted(mids), one, CONCURRENCY)
    return out


async def collect(origin: Origin, policy: GcPolicy, *, dry_run: bool = False, now: float | None = None) -> GcReport:
    """Mark and sweep ``origin`` (see the module's header). ``now``: the clock the grace is
    measured against (default the local wall clock)."""
    check_policy(policy)
    t0 = time.perf_counter()
    now = time.time() if now is None else now
    refs = await read_refs(origin)
    known = {r.name for r in refs}
    unknown = sorted(set(policy.keep) - known)
    if unknown:
        raise NotFoundError(f"--keep {unknown[0]}: no such ref at origin {origin.url}")
    manifests = await origin.list_objects("manifests/")
    chunks = await origin.list_objects("chunks/")
    kept, removed_refs = choose_refs(refs, policy, now)
    live = live_manifests(kept, manifests, policy, now)
    present = {_name(m) for m in manifests}
    dangling = sorted(r.name for r in kept if r.manifest is not None and r.manifest not in present)
    live &= present
    live_chunks = await _chunks_of(origin, live)
    doomed_m, doomed_c = sweep(manifests, chunks, live, live_chunks, policy, now)
    log.info("gc plan origin=%s refs_kept=%d refs_removed=%d manifests_removed=%d chunks_removed=%d dry_run=%s",
             origin.url, len(kept), len(removed_refs), len(doomed_m), len(doomed_c), dry_run)

    removed_r = [r.name for r in removed_refs]
    restored: list[str] = []
    leftover = 0
    if not dry_run:
        leftover = await _remove_leftover_trash(origin, now)
        run = f"{TRASH}{int(now)}-{uuid.uuid4().hex[:8]}/"
        removed_r = []

        async def drop_ref(r: RefInfo) -> None:
            if await origin.delete_if_unchanged(r.obj):
                removed_r.append(r.name)

        await run_pool(removed_refs, drop_ref, CONCURRENCY)
        moved_m: list[ObjectInfo] = []
        moved_c: list[ObjectInfo] = []

        async def aside(o: ObjectInfo, into: list[ObjectInfo]) -> None:
            if await origin.move(o.key, run + o.key):
                into.append(o)

        await run_pool(doomed_m, lambda o: aside(o, moved_m), CONCURRENCY)
        await run_pool(doomed_c, lambda o: aside(o, moved_c), CONCURRENCY)
        restored = await _restore_named(origin, run, present, live, moved_m, moved_c)
        back = set(restored)
        doomed_m = [o for o in moved_m if _name(o) not in back]
        doomed_c = [o for o in moved_c if _name(o) not in back]
        for o in await origin.list_objects(run):
            await origin.delete_if_unchanged(o)
    freed = sum(o.size for o in doomed_m) + sum(o.size for o in doomed_c)
    gone_c = {_name(c) for c in doomed_c}
    kept_c = [c for c in chunks if _name(c) not in gone_c]
    report = GcReport(
        origin=origin.url, dry_run=dry_run, keep_last=policy.keep_last, grace_s=policy.grace_s,
        kept_refs=[r.name for r in kept], removed_refs=sorted(removed_r),
        removed_manifests=sorted(_name(o) for o in doomed_m), removed_chunks=sorted(_name(o) for o in doomed_c),
        bytes_freed=freed, manifests_kept=len(manifests) - len(doomed_m), chunks_kept=len(kept_c),
        bytes_kept=sum(c.size for c in kept_c), restored=sorted(restored), dangling_refs=dangling,
        leftover_trash=leftover, seconds=round(time.perf_counter() - t0, 6))
    log.info("gc done origin=%s refs_removed=%d manifests_removed=%d chunks_removed=%d bytes_freed=%d restored=%d",
             origin.url, len(report.removed_refs), len(report.removed_manifests), len(report.removed_chunks),
             freed, len(restored))
    return report


async def _restore_named(origin: Origin, run: str, seen: set[str], live: set[str],
                         moved_m: list[ObjectInfo], moved_c: list[ObjectInfo]) -> list[str]:
    """The second listing: what a ref names now, or a manifest gc had not seen, is put back
    from ``run``'s trash (manifests first, then the chunks they name). Returns their ids."""
    refs = await read_refs(origin)
    now_m = {_name(m) for m in await origin.list_objects("manifests/")}
    wanted = {r.manifest for r in refs if r.manifest is not None} | (now_m - seen)
    trashed_m = {_name(o) for o in moved_m}
    back_m = sorted(wanted & trashed_m)
    for mid in back_m:
        await origin.move(f"{run}manifests/{mid}", f"manifests/{mid}")
    need = await _chunks_of(origin, wanted - live, trash=run)
    back_c = sorted(need & {_name(o) for o in moved_c})
    await run_pool(back_c, lambda cid: origin.move(f"{run}chunks/{cid}", f"chunks/{cid}"), CONCURRENCY)
    if back_m or back_c:
        log.warning("gc restored manifests=%d chunks=%d: a publish named them while gc ran", len(back_m), len(back_c))
    return back_m + back_c


async def _remove_leftover_trash(origin: Origin, now: float) -> int:
    """Objects under ``trash/<start>-<id>/`` of runs that started over a day ago (crashed)."""
    n = 0
    for o in await origin.list_objects(TRASH):
        run = o.key[len(TRASH):].split("/", 1)[0]
        start, _, _ = run.partition("-")
        if start.isdigit() and now - int(start) > LEFTOVER_TRASH_S and await origin.delete_if_unchanged(o):
            n += 1
    return n


async def ref_table(origin: Origin) -> list[dict[str, object]]:
    """``herd artifact refs``: every ref with its manifest, the artifact's size and files, and
    the ref's time (one manifest GET per distinct manifest)."""
    refs = await read_refs(origin)
    sizes: dict[str, tuple[int, int] | None] = {}

    async def one(mid: str) -> None:
        try:
            m = decode_manifest(await origin.get_manifest(mid), mid)
            sizes[mid] = (m.total_size, sum(1 for e in m.entries if e.kind == "file"))
        except (NotFoundError, ManifestError, IntegrityError):
            sizes[mid] = None

    await run_pool(sorted({r.manifest for r in refs if r.manifest}), one, CONCURRENCY)
    out: list[dict[str, object]] = []
    for r in refs:
        s = sizes.get(r.manifest) if r.manifest else None
        out.append({"ref": r.name, "manifest": r.manifest, "bytes": s[0] if s else None,
                    "files": s[1] if s else None, "updated": r.obj.updated,
                    "ok": s is not None})
    return out


__all__ = ["GcPolicy", "GcReport", "RefInfo", "check_policy", "choose_refs", "collect", "live_manifests",
           "read_refs", "ref_family", "ref_table", "sweep"]
