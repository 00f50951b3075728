"""Origin garbage collection (p2p/gc.py, `herd artifact gc|refs`).

In process: every interleaving of a publish that reuses old chunks with a gc that removes
them (each stopped at each of its steps in turn, both orders) ends with every ref naming a
present manifest and every manifest's chunks present; shared chunks are never removed;
every kept ref fetches byte for byte. Through the real `herd` entry point: refs and gc on
file:// and on gs:// against the real gcp-storage-emulator process.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import trio

from manifests import ChunkerParams, decode_manifest
from p2p.fetch import fetch_artifact
from p2p.gc import GcPolicy, collect, read_refs
from p2p.origins import FileOrigin, ObjectInfo
from p2p.publish import DEDUP_REFS, publish
from p2p.store import ChunkStore
from tests.gcs_emulator import gcs_emulator
from tests.test_artifact_cli import HERD, ROOT, one_line_error


def _params() -> ChunkerParams:
    return ChunkerParams(min_size=4096, avg_size=16384, max_size=65536)


class Paused(FileOrigin):
    """A file origin that stops at one step (``name#n``: the n-th call of that step) until
    released: the test's handle on an interleaving."""

    def __init__(self, root: Path, point: str | None) -> None:
        super().__init__(root)
        self.point = point
        self.calls: Counter[str] = Counter()
        self.reached = trio.Event()
        self.go = trio.Event()

    async def _hook(self, name: str) -> None:
        self.calls[name] += 1
        if f"{name}#{self.calls[name]}" == self.point:
            self.reached.set()
            await self.go.wait()

    async def missing(self, ids: Iterable[str]) -> set[str]:
        out = await super().missing(ids)
        await self._hook("missing")
        return out

    async def put_manifest(self, manifest_id: str, data: bytes, *, ref: str | None = None) -> None:
        await super().put_manifest(manifest_id, data, ref=ref)
        await self._hook("put_manifest")

    async def set_ref(self, name: str, manifest_id: str) -> None:
        await super().set_ref(name, manifest_id)
        await self._hook("set_ref")

    async def move(self, src: str, dst: str) -> bool:
        await self._hook("move")
        return await super().move(src, dst)

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        await self._hook("list:" + prefix.split("/")[0])
        return await super().list_objects(prefix)

    async def delete_if_unchanged(self, info: ObjectInfo) -> bool:
        await self._hook("delete")
        return await super().delete_if_unchanged(info)


def _tree(root: Path, seed: int, nbytes: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "w.bin").write_bytes(os.urandom(nbytes) if seed < 0 else _det(seed, nbytes))
    return root


def _det(seed: int, n: int) -> bytes:
    import random
    return random.Random(seed).randbytes(n)


async def _history(tmp: Path, origin_dir: Path) -> dict[str, Path]:
    """app:v1..v5 (v1 the oldest, beyond the dedup window); each ref a second older than
    the next. Returns each ref's source tree."""
    o = FileOrigin(origin_dir)
    trees = {}
    for i in range(1, 6):
        src = _tree(tmp / f"src{i}", seed=i, nbytes=200_000)
        if i in (1, 5):  # v1 (removed) and v5 (kept) share a file: chunks both name stay
            (src / "shared.bin").write_bytes(_det(99, 200_000))
        await publish(src, o, f"app:v{i}", _params())
        trees[f"app:v{i}"] = src
    for i in range(1, 6):
        t = 1_000_000 + i
        os.utime(origin_dir / "refs" / f"app:v{i}", (t, t))
    return trees


async def _check_origin(origin_dir: Path, trees: dict[str, Path], tmp: Path) -> None:
    """Every ref names a present manifest, every present manifest's chunks are present, and
    every ref fetches byte for byte."""
    o = FileOrigin(origin_dir)
    chunks = {p.name for p in (origin_dir / "chunks").iterdir()}
    for mpath in (origin_dir / "manifests").iterdir():
        m = decode_manifest(mpath.read_bytes(), mpath.name)
        lost = {c.id for c in m.chunks} - chunks
        assert not lost, f"manifest {mpath.name[:12]} names {len(lost)} deleted chunks"
    for r in await read_refs(o):
        assert r.manifest is not None and (origin_dir / "manifests" / r.manifest).exists(), r.name
        store = ChunkStore(tmp / f"store-{r.name.replace(':', '_')}")
        await fetch_artifact(store, r.manifest, o)
        tree = store.materialise(r.manifest)
        for f in trees[r.name].iterdir():
            assert (tree / f.name).read_bytes() == f.read_bytes(), (r.name, f.name)


PUBLISH_POINTS = ["missing#1", "put_manifest#1", "set_ref#1", "missing#2"]
GC_POINTS = ["delete#1", "move#1", "list:refs#2", "list:trash#2"]


async def _run_to(nursery: trio.Nursery, fn, origin: Paused) -> trio.Event:  # noqa: ANN001
    done = trio.Event()

    async def go() -> None:
        try:
            await fn(origin)
        finally:
            done.set()
    nursery.start_soon(go)
    async with trio.open_nursery() as n:  # until it stops at its point or ends
        async def wait(ev: trio.Event) -> None:
            await ev.wait()
            n.cancel_scope.cancel()
        n.start_soon(wait, origin.reached)
        n.start_soon(wait, done)
    return done


@pytest.mark.parametrize(("first", "p_point", "g_point"),
                         [(f, p, g) for f in ("publish", "gc") for p, g in itertools.product(PUBLISH_POINTS, GC_POINTS)])
async def test_publish_racing_gc_never_leaves_a_manifest_naming_a_deleted_chunk(
        tmp_path: Path, first: str, p_point: str, g_point: str) -> None:
    """A publish of v1's bytes under a new name (so it reuses chunks gc is removing) and a gc
    that removes app:v1: the first runs to its point, the second to its point, then the
    first ends, then the second. Mutation checked: without publish's check after the ref,
    or without gc's second listing and restore, some interleavings end with a manifest
    naming a deleted chunk (or a ref naming a deleted manifest)."""
    origin_dir = tmp_path / "origin"
    with trio.fail_after(60):
        trees = await _history(tmp_path, origin_dir)
        trees["reuse:v1"] = trees["app:v1"]
        pub = Paused(origin_dir, p_point)
        gco = Paused(origin_dir, g_point)

        async def do_publish(o: Paused) -> None:
            await publish(trees["reuse:v1"], o, "reuse:v1", _params())

        async def do_gc(o: Paused) -> None:
            rep = await collect(o, GcPolicy(keep_last=DEDUP_REFS, grace_s=0.0))
            assert "app:v1" in rep.removed_refs

        order = [(do_publish, pub), (do_gc, gco)]
        if first == "gc":
            order.reverse()
        async with trio.open_nursery() as n:
            done_a = await _run_to(n, order[0][0], order[0][1])
            done_b = await _run_to(n, order[1][0], order[1][1])
            order[0][1].go.set()
            await done_a.wait()
            order[1][1].go.set()
            await done_b.wait()
        trees.pop("app:v1")
        await _check_origin(origin_dir, trees, tmp_path)
        assert not (origin_dir / "refs" / "app:v1").exists()


async def test_gc_keeps_shared_chunks_and_every_kept_ref_fetches(tmp_path: Path) -> None:
    origin_dir = tmp_path / "origin"
    with trio.fail_after(60):
        trees = await _history(tmp_path, origin_dir)
        # v1 and v5 share a file: v1 goes, the chunks v5 still names stay
        o = FileOrigin(origin_dir)
        before = {p.name for p in (origin_dir / "chunks").iterdir()}
        dry = await collect(o, GcPolicy(grace_s=0.0), dry_run=True)
        assert {p.name for p in (origin_dir / "chunks").iterdir()} == before  # a dry run removes nothing
        rep = await collect(o, GcPolicy(grace_s=0.0))
        assert rep.removed_refs == dry.removed_refs == ["app:v1"]
        assert rep.removed_chunks == dry.removed_chunks and rep.removed_chunks
        assert rep.bytes_freed == dry.bytes_freed > 0
        after = {p.name for p in (origin_dir / "chunks").iterdir()}
        assert after == before - set(rep.removed_chunks)
        v5 = decode_manifest((origin_dir / "manifests" / (await o.resolve("app:v5"))).read_bytes())
        shared = {c.id for e in v5.entries if e.path == "shared.bin" for c in (v5.chunks[i] for i in e.chunks)}
        assert shared and shared <= after
        trees.pop("app:v1")
        await _check_origin(origin_dir, trees, tmp_path)
        assert not list((origin_dir / "trash").rglob("*")) or all(p.is_dir() for p in (origin_dir / "trash").rglob("*"))
        # a grace longer than the objects' age keeps everything; --keep keeps an old ref
        again = await collect(o, GcPolicy(grace_s=0.0, keep=("app:v2",), keep_last=DEDUP_REFS))
        assert again.removed_refs == [] and again.removed_chunks == []
        with pytest.raises(ValueError, match="dedup window"):
            await collect(o, GcPolicy(keep_last=DEDUP_REFS - 1))


async def test_grace_keeps_young_objects(tmp_path: Path) -> None:
    origin_dir = tmp_path / "origin"
    with trio.fail_after(60):
        await _history(tmp_path, origin_dir)
        o = FileOrigin(origin_dir)
        rep = await collect(o, GcPolicy(grace_s=3600.0))
        # the refs' times were set a long time ago, so app:v1 goes; its manifest and chunks
        # were written just now: younger than the grace, they stay
        assert rep.removed_refs == ["app:v1"]
        assert rep.removed_manifests == [] and rep.removed_chunks == []


# ------------------------------------------------------------------ the real entry point

def _herd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HERD, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "HERD_ORIGIN": "", **(env or {})})


def _cli_history(tmp: Path, origin: str, env: dict[str, str] | None = None) -> None:
    for i in range(1, 6):
        src = _tree(tmp / f"src{i}", seed=i, nbytes=150_000)
        r = _herd("artifact", "publish", str(src), "--origin", origin, "--name", f"app:v{i}", "--avg-chunk", "16k",
                  "--json", env=env)
        assert r.returncode == 0, r.stderr


def _cli_gc_round(tmp: Path, origin: str, env: dict[str, str] | None = None) -> None:
    _cli_history(tmp, origin, env)
    r = _herd("artifact", "refs", "--origin", origin, "--json", env=env)
    assert r.returncode == 0, r.stderr
    refs = json.loads(r.stdout)["refs"]
    assert [x["ref"] for x in refs] == [f"app:v{i}" for i in range(1, 6)]
    assert all(x["ok"] and x["bytes"] == 150_000 and x["files"] == 1 and len(x["manifest"]) == 64 for x in refs)
    assert set(refs[0]) == {"ref", "manifest", "bytes", "files", "updated", "ok"}
    r = _herd("artifact", "refs", "--origin", origin, env=env)
    assert r.returncode == 0 and "app:v3" in r.stdout and "146.5 KiB" in r.stdout, r.stdout + r.stderr

    r = _herd("artifact", "gc", "--origin", origin, "--keep-last", str(DEDUP_REFS - 1), env=env)
    one_line_error(r, "dedup window")
    assert r.returncode == 2
    r = _herd("artifact", "gc", "--origin", origin, "--grace", "soon", env=env)
    one_line_error(r, "--grace")

    # the refs were written within the same second or two: app:v1 is the oldest
    r = _herd("artifact", "gc", "--origin", origin, "--grace", "0", "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert "would remove ref app:v1" in r.stdout and f"would remove manifest {refs[0]['manifest']}" in r.stdout
    r = _herd("artifact", "gc", "--origin", origin, "--grace", "0", "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["removed_refs"] == ["app:v1"] and rep["removed_manifests"] == [refs[0]["manifest"]]
    assert rep["bytes_freed"] >= 150_000 and rep["dry_run"] is False and len(rep["removed_chunks"]) >= 5
    assert rep["kept_refs"] == [f"app:v{i}" for i in range(2, 6)]
    for i in range(2, 6):
        r = _herd("artifact", "fetch", f"app:v{i}", "--origin", origin, "--store", str(tmp / "store"),
                  "--into", str(tmp / f"t{i}"), "--json", env=env)
        assert r.returncode == 0, r.stderr
        assert (tmp / f"t{i}" / "w.bin").read_bytes() == _det(i, 150_000)
    r = _herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(tmp / "store2"),
              "--into", str(tmp / "t1"), env=env)
    one_line_error(r, "app:v1")
    r = _herd("artifact", "gc", "--origin", origin, "--grace", "0", env=env)
    assert r.returncode == 0 and "removed 0 refs, 0 manifests, 0 chunks" in r.stdout, r.stdout + r.stderr


def test_cli_refs_and_gc_file_origin(tmp_path: Path) -> None:
    _cli_gc_round(tmp_path, f"file://{tmp_path}/origin")
    r = _herd("artifact", "gc", "--origin", "https://mirror.invalid/x", "--grace", "0")
    one_line_error(r, "read-only")


def test_cli_refs_and_gc_gcs_emulator(tmp_path: Path) -> None:
    with gcs_emulator(tmp_path / "emu", bucket="herd-gc") as host:
        _cli_gc_round(tmp_path, "gs://herd-gc/team", env={"STORAGE_EMULATOR_HOST": host})
