"""Artifact path benchmark: ingest, fetch, materialise, and a v1 -> v2 upgrade.

    python -m bench.artifacts [--size-mb N] [--repeat R] [--avg-chunk SIZE] [--json]

Figures (medians of R runs where timed; every baseline is measured in the same run):

- ``ingest_ratio``: throughput of ``manifests.scan_tree`` (the very code ``herd artifact
  publish`` runs) over its bound: the fastest loop doing the same work, the fastcdc compiled
  kernel + BLAKE3 over the same files read the same way (pread for small files, populated
  mmap for the rest), page cache warm for both, the two alternated, each going first
  in half the pairs (at least 6 pairs).
  <= 1 but for noise; ``ingest_ratio_best`` is the ratio of the best run of each (the
  least noise where other work shares the cores). Target >= 0.9.
- ``fetch_mb_s``: the agents' fetch path (``p2p.herd.fetch_with_peers``, the herd with no
  peers) from a file:// origin into an empty store, copying every byte (read, verify, write,
  batched fsync, mark complete). Target >= 400. ``fetch_origin_only_mb_s``: the same through
  ``p2p.fetch.fetch_artifact`` (the origin-only path of ``herd artifact fetch`` without peers).
  Baseline ``fetch_baseline_mb_s``: a bare one-thread read+BLAKE3+write loop over the same
  chunk files without fsync (``fetch_vs_baseline`` = ours / baseline).
- ``materialize_mb_s``: ``ChunkStore.materialise`` of a complete manifest into a store holding
  no earlier tree (fsynced before rename, as the agent does). Target >= 1000. Baseline
  ``materialize_baseline_mb_s``: ``shutil.copytree`` of the source tree, without fsync.
- ``upgrade_overhead``: fetching v2 into a store holding v1: bytes_from_origin / bytes of the
  chunks v2 has and v1 lacks. A check, not a measurement: with no peers the fetch reads
  exactly the chunks it lacks, so it is 1 by construction (it catches a fetch that re-reads).
- ``upgrade_over_changed``: the same bytes_from_origin / bytes the generator actually changed,
  inserted or added. Target <= 2.0 at the default chunk sizes.

The v2 generator (seeded): rewrites ~3 % of all bytes in place as a few contiguous regions
(whole-tensor style updates) inside large files, inserts 1 MiB blocks into three files at
random offsets, renames six files (one into another directory), deletes one and adds two.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import blake3
import msgspec
import numpy as np
import trio

from manifests import ChunkerParams, scan_tree
from manifests.chunking import SMALL_FILE, _kernel
from manifests.materialise import materialise as materialise_tree
from p2p.fetch import fetch_artifact
from p2p.herd import fetch_with_peers
from p2p.origins import FileOrigin
from p2p.publish import publish
from p2p.store import ChunkStore, manifest_chunks

MiB = 1 << 20
TARGETS = {"ingest_ratio": (">=", 0.9), "fetch_mb_s": (">=", 400.0), "materialize_mb_s": (">=", 1000.0),
           "upgrade_overhead": ("<=", 1.02), "upgrade_over_changed": ("<=", 2.0)}


# ------------------------------------------------------------------------------ data generator

def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def generate_v1(root: Path, size: int, rng: np.random.Generator) -> list[Path]:
    """About ``size`` bytes: 2 large files (20 % each), 10 medium (3.5 % each), 1 MiB files for
    ~20 %, and 100 small config-like files."""
    files: list[Path] = []
    for i in range(2):
        p = root / "weights" / f"shard-{i:02d}.bin"
        _write(p, rng.bytes(int(size * 0.20)))
        files.append(p)
    for i in range(10):
        p = root / "layers" / f"layer-{i:02d}.bin"
        _write(p, rng.bytes(int(size * 0.035)))
        files.append(p)
    for i in range(max(1, int(size * 0.20) // MiB)):
        p = root / "assets" / f"{i // 50:02d}" / f"asset-{i:04d}.dat"
        _write(p, rng.bytes(MiB))
        files.append(p)
    for i in range(100):
        p = root / "conf" / f"c{i:03d}.json"
        _write(p, rng.bytes(4096))
        files.append(p)
    (root / "bin").mkdir()
    _write(root / "bin" / "run.sh", b"#!/bin/sh\nexec python -m trainer\n")
    os.chmod(root / "bin" / "run.sh", 0o755)
    return files


def make_v2(v1: Path, v2: Path, rng: np.random.Generator) -> int:
    """Copy v1 to v2 and change it; return the bytes changed, inserted or added."""
    shutil.copytree(v1, v2, symlinks=True)
    total = sum(p.stat().st_size for p in v2.rglob("*") if p.is_file())
    changed = 0
    big = sorted(p for p in v2.rglob("*.bin") if p.stat().st_size >= 8 * MiB)
    region = 4 * MiB
    goal = int(total * 0.03)
    while changed < goal and big:
        p = big[int(rng.integers(len(big)))]
        size = p.stat().st_size
        off = int(rng.integers(0, size - region))
        with open(p, "r+b") as f:
            f.seek(off)
            f.write(rng.bytes(region))
        changed += region
    mids = sorted(v2.glob("layers/*.bin"))
    for p in mids[:3]:  # insertions shift everything after them
        data = p.read_bytes()
        off = int(rng.integers(0, len(data)))
        p.write_bytes(data[:off] + rng.bytes(MiB) + data[off:])
        changed += MiB
    assets = sorted(v2.glob("assets/*/*.dat"))
    for p in assets[:5]:
        p.rename(p.with_name("renamed-" + p.name))
    if len(mids) > 4:
        (v2 / "moved").mkdir()
        mids[4].rename(v2 / "moved" / mids[4].name)
    if len(assets) > 6:
        assets[6].unlink()
    for i in range(2):
        _write(v2 / "new" / f"added-{i}.dat", rng.bytes(MiB))
        changed += MiB
    return changed


# ------------------------------------------------------------------------------------- ingest

def bare_chunk_hash(files: list[Path], params: ChunkerParams) -> int:
    """The bound: the fastest loop doing scan_tree's work, the fastcdc kernel + BLAKE3 per chunk
    over each file, read the way the real path reads it (one pread for a small file, else a
    populated read-only map, ``MAP_POPULATE``), and nothing else: no stat checks, no chunk
    list, no manifest."""
    kernel = _kernel()
    n = 0
    for p in files:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            if size <= SMALL_FILE:
                buf: Any = os.pread(fd, size, 0)
                mm = None
            else:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
                buf = mm
            with memoryview(buf) as view:
                gen = kernel(view, params.min_size, params.avg_size, params.max_size, False, blake3.blake3)
                for c in gen:
                    n += c.length
                gen.close()
                del gen
            if mm is not None:
                mm.close()
        finally:
            os.close(fd)
    return n


def bare_fetch_copy(src: Path, dst: Path) -> int:
    """Baseline for fetch: read each origin chunk file, BLAKE3 it, write it to a new file
    (one thread, no fsync, no store bookkeeping)."""
    dst.mkdir(parents=True)
    n = 0
    for e in os.scandir(src):
        with open(e.path, "rb") as f:
            data = f.read()
        blake3.blake3(data).hexdigest()
        with open(dst / e.name, "wb") as f:
            f.write(data)
        n += len(data)
    return n


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def run(size_mb: int, repeat: int, avg_chunk: int | None, workdir: Path, log: Any) -> dict[str, Any]:
    rng = np.random.default_rng(42)
    params = ChunkerParams() if avg_chunk is None else ChunkerParams(
        min_size=avg_chunk // 4, avg_size=avg_chunk, max_size=avg_chunk * 4)
    v1 = workdir / "v1"
    t = time.perf_counter()
    files = generate_v1(v1, size_mb * MiB, rng)
    nbytes = sum(p.stat().st_size for p in files)
    log(f"generated v1: {len(files)} files, {nbytes / MiB:.0f} MiB in {time.perf_counter() - t:.1f}s")

    # Ingest: alternate the two so both see the same cache and noise.
    bare_s: list[float] = []
    scan_s: list[float] = []
    bare_chunk_hash(files, params)  # warm the page cache
    for i in range(max(6, repeat)):   # cheap (a second or so each): more pairs, less noise
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):   # which goes first alternates too
            t = time.perf_counter()
            if which == 0:
                bare_chunk_hash(files, params)
                bare_s.append(time.perf_counter() - t)
            else:
                scan_tree(v1, params)
                scan_s.append(time.perf_counter() - t)
    ingest_ratio = _median(bare_s) / _median(scan_s)   # bound time / ours: <= 1 unless noise
    ingest_ratio_best = min(bare_s) / min(scan_s)       # best of each: the least noise on a shared machine

    async def main() -> dict[str, Any]:
        origin = FileOrigin(workdir / "origin")
        t = time.perf_counter()
        p1 = await publish(v1, origin, "bench:v1", params)
        publish_s = time.perf_counter() - t
        fetch_s: list[float] = []
        mat_s: list[float] = []
        mat_nosync_s: list[float] = []
        base_fetch_s: list[float] = []
        base_copy_s: list[float] = []
        solo_s: list[float] = []
        store = None
        # Every timed section starts from a settled disk: what the previous one wrote is
        # deleted (or flushed) and os.sync() runs untimed, so no writeback backlog or
        # pending discards of one section are billed to the next.
        for i in range(repeat):
            _settle()
            t = time.perf_counter()
            bare_fetch_copy(workdir / "origin" / "chunks", workdir / "bare-fetch")
            base_fetch_s.append(time.perf_counter() - t)
            _force_rm(workdir / "bare-fetch")
            _settle()
            t = time.perf_counter()
            shutil.copytree(v1, workdir / "bare-copy", symlinks=True)
            base_copy_s.append(time.perf_counter() - t)
            _force_rm(workdir / "bare-copy")
            if store is not None:
                _force_rm(store.root)
            _settle()
            store = ChunkStore(workdir / f"store-{i}")
            t = time.perf_counter()
            fs = await fetch_with_peers(store, p1.manifest, FileOrigin(workdir / "origin"), peers=[],
                                        node_id="bench")
            fetch_s.append(time.perf_counter() - t)
            assert fs.bytes_from_origin == fs.bytes
            _settle()
            solo = ChunkStore(workdir / f"solo-{i}")
            t = time.perf_counter()
            await fetch_artifact(solo, p1.manifest, FileOrigin(workdir / "origin"))
            solo_s.append(time.perf_counter() - t)
            _force_rm(solo.root)
            _settle()
            t = time.perf_counter()
            await trio.to_thread.run_sync(store.materialise, p1.manifest)
            mat_s.append(time.perf_counter() - t)
            _settle()
            m = store.get_manifest(p1.manifest)
            t = time.perf_counter()
            await trio.to_thread.run_sync(partial(materialise_tree, m, chunk_path=store.chunk_path,
                                                  dest=workdir / "nosync"))
            mat_nosync_s.append(time.perf_counter() - t)
            _force_rm(workdir / "nosync")
        assert store is not None
        # Upgrade: v2 into the store that holds (and has materialised) v1.
        changed = make_v2(v1, workdir / "v2", rng)
        p2 = await publish(workdir / "v2", origin, "bench:v2", params)
        m1 = store.get_manifest(p1.manifest)
        up_origin = FileOrigin(workdir / "origin")
        fs2 = await fetch_with_peers(store, p2.manifest, up_origin, peers=[], node_id="bench")
        m2 = store.get_manifest(p2.manifest)
        c1 = manifest_chunks(m1)
        new_bytes = sum(s for c, s in manifest_chunks(m2).items() if c not in c1)
        t = time.perf_counter()
        await trio.to_thread.run_sync(store.materialise, p2.manifest)
        up_mat_s = time.perf_counter() - t
        return {
            "size_mb": round(p1.bytes / MiB, 1), "files": p1.files, "chunks": p1.chunks,
            "publish_s": round(publish_s, 3),
            "fetch_s_p50": round(_median(fetch_s), 3), "fetch_mb_s": round(fs.bytes / MiB / _median(fetch_s), 1),
            "fetch_origin_only_mb_s": round(fs.bytes / MiB / _median(solo_s), 1),
            "fetch_baseline_mb_s": round(fs.bytes / MiB / _median(base_fetch_s), 1),
            "fetch_vs_baseline": round(_median(base_fetch_s) / _median(fetch_s), 3),
            "materialize_s_p50": round(_median(mat_s), 3),
            "materialize_nosync_mb_s": round(p1.bytes / MiB / _median(mat_nosync_s), 1),
            "materialize_baseline_mb_s": round(p1.bytes / MiB / _median(base_copy_s), 1),
            "materialize_vs_baseline": round(_median(base_copy_s) / _median(mat_s), 3),
            "materialize_mb_s": round(p1.bytes / MiB / _median(mat_s), 1),
            "upgrade_bytes_from_origin": fs2.bytes_from_origin, "upgrade_new_chunk_bytes": new_bytes,
            "upgrade_changed_bytes": changed,
            "upgrade_overhead": round(fs2.bytes_from_origin / max(1, new_bytes), 4),
            "upgrade_over_changed": round(fs2.bytes_from_origin / max(1, changed), 4),
            "upgrade_fetch_s": round(fs2.seconds, 3), "upgrade_materialize_s": round(up_mat_s, 3),
        }

    out = trio.run(main)
    ingest = {
        "ingest_ratio": round(ingest_ratio, 3), "ingest_ratio_best": round(ingest_ratio_best, 3),
        "ingest_pairs": len(scan_s),
        "ingest_scan_mb_s": round(nbytes / MiB / _median(scan_s), 1),
        "ingest_bare_mb_s": round(nbytes / MiB / _median(bare_s), 1),
    }
    result = {**ingest, **out, "repeat": repeat,
              "chunker": msgspec.structs.asdict(params)}
    result["targets_met"] = {k: (result[k] >= v if op == ">=" else result[k] <= v) for k, (op, v) in TARGETS.items()}
    return result


def _settle() -> None:
    os.sync()


def _force_rm(path: Path) -> None:
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.artifacts", description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=512, help="size of the v1 tree in MiB (default 512)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per figure; medians are reported")
    ap.add_argument("--avg-chunk", type=int, default=None, help="average chunk size in bytes (default 1 MiB)")
    ap.add_argument("--workdir", default=None, help="where to generate data (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    args = ap.parse_args(argv)
    if args.size_mb < 16 or args.size_mb > 65536 or not 1 <= args.repeat <= 20:
        ap.error("--size-mb must be 16..65536 and --repeat 1..20")

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    parent = Path(args.workdir) if args.workdir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="herd-bench-", dir=parent))
    try:
        result = run(args.size_mb, args.repeat, args.avg_chunk, tmp, log)
    finally:
        _force_rm(tmp)
    if args.json:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
        return 0
    rows = [
        ("ingest_ratio", result["ingest_ratio"],
         f"scan_tree {result['ingest_scan_mb_s']} MB/s vs bound {result['ingest_bare_mb_s']} MB/s (medians of "
         f"{result['ingest_pairs']}; best of each: {result['ingest_ratio_best']})"),
        ("fetch_mb_s", result["fetch_mb_s"],
         f"herd, no peers: p50 {result['fetch_s_p50']}s for {result['size_mb']} MiB; x{result['fetch_vs_baseline']} "
         f"of a bare read+hash+write loop ({result['fetch_baseline_mb_s']} MB/s, no fsync); origin-only path "
         f"{result['fetch_origin_only_mb_s']} MB/s"),
        ("materialize_mb_s", result["materialize_mb_s"],
         f"p50 {result['materialize_s_p50']}s with fsync; {result['materialize_nosync_mb_s']} MB/s without; "
         f"x{result['materialize_vs_baseline']} of shutil.copytree ({result['materialize_baseline_mb_s']} MB/s, "
         "no fsync)"),
        ("upgrade_overhead", result["upgrade_overhead"],
         f"{result['upgrade_bytes_from_origin']} B fetched / {result['upgrade_new_chunk_bytes']} B new chunks "
         "(a check: 1 by construction)"),
        ("upgrade_over_changed", result["upgrade_over_changed"],
         f"/ {result['upgrade_changed_bytes']} B changed by the generator"),
    ]
    print(f"{'figure':<22}{'value':>10}  {'target':<9}{'met':<5}detail")
    for k, v, detail in rows:
        op, target = TARGETS[k]
        print(f"{k:<22}{v:>10}  {op + str(target):<9}{'yes' if result['targets_met'][k] else 'NO':<5}{detail}")
    print(f"(publish {result['publish_s']}s, upgrade fetch {result['upgrade_fetch_s']}s, "
          f"upgrade materialise {result['upgrade_materialize_s']}s; medians of {result['repeat']} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
