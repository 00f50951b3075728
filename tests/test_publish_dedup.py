"""Publish learns what the origin holds from the manifests of the name's last N refs and
asks only about the rest: an incremental release of a 10,000-chunk artifact with 1 % new
chunks makes O(new chunks + N) origin requests. Counted by the origins themselves (real
file:// I/O, and real HTTP requests to the gcp-storage-emulator), nothing mocked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from manifests import ChunkerParams
from p2p.fetch import fetch_artifact
from p2p.gc import GcPolicy, collect
from p2p.origins import FileOrigin, Origin, open_origin
from p2p.publish import publish, recent_refs
from p2p.store import ChunkStore
from tests.gcs_emulator import gcs_emulator

TINY = ChunkerParams(min_size=512, avg_size=1024, max_size=4096)


def _requests(o: Origin) -> int:
    """Every origin request: GETs, PUTs, listings and one existence check per id asked."""
    s = o.statistics()
    return s.gets + s.puts + s.lists + s.exists_checks


def _tree(root: Path, nbytes: int, seed: int) -> None:
    root.mkdir(parents=True)
    rng = __import__("random").Random(seed)
    (root / "weights.bin").write_bytes(rng.randbytes(nbytes))


def _add_new_files(root: Path, n: int, seed: int) -> None:
    """``n`` small new files: one new chunk each (each under the chunker's minimum)."""
    rng = __import__("random").Random(seed)
    d = root / "new"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:04d}").write_bytes(rng.randbytes(400))


async def test_incremental_publish_costs_new_chunks_plus_n(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, 10_000 * 1024, seed=1)
    with trio.fail_after(120):
        v1 = await publish(src, FileOrigin(tmp_path / "origin"), "app:v1", TINY)
        assert v1.chunks >= 9_000 and v1.chunks_checked == v1.chunks
        _add_new_files(src, 100, seed=2)                       # ~1 % new chunks
        origin = FileOrigin(tmp_path / "origin")               # fresh counters
        v2 = await publish(src, origin, "app:v2", TINY)
    new = v2.chunks_uploaded
    assert 90 <= new <= 110 and v2.chunks == v1.chunks + new
    assert v2.dedup_refs == ["app:v1"] and v2.chunks_known == v1.chunks and v2.chunks_checked == new
    st = origin.statistics()
    # asked about the new chunks twice (before uploading, and in the check after the ref)
    assert st.exists_checks == 2 * new + 1                     # + has_manifest
    # ref listing twice (before, after), ref + manifest GETs twice, puts: chunks + manifest + ref
    assert st.puts == new + 2
    assert _requests(origin) <= 3 * new + 4 * 4 + 10, st
    # and the artifact is whole: fetch it back byte for byte
    with trio.fail_after(60):
        store = ChunkStore(tmp_path / "store")
        await fetch_artifact(store, v2.manifest, FileOrigin(tmp_path / "origin"))
    tree = store.materialise(v2.manifest)
    assert (tree / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    assert sorted(os.listdir(tree / "new")) == sorted(os.listdir(src / "new"))


async def test_dedup_off_asks_about_every_chunk(tmp_path: Path) -> None:
    """The same release with --dedup-refs 0: one existence check per chunk (the baseline the
    test above is measured against; it fails if the dedup stopped counting)."""
    src = tmp_path / "src"
    _tree(src, 2_000 * 1024, seed=3)
    with trio.fail_after(60):
        v1 = await publish(src, FileOrigin(tmp_path / "origin"), "app:v1", TINY)
        _add_new_files(src, 20, seed=4)
        origin = FileOrigin(tmp_path / "origin")
        v2 = await publish(src, origin, "app:v2", TINY, dedup_refs=0)
    assert v2.dedup_refs == [] and v2.chunks_checked == v2.chunks > v1.chunks
    assert origin.statistics().exists_checks >= 2 * v2.chunks


async def test_only_the_last_n_refs_of_the_same_name_count(tmp_path: Path) -> None:
    origin = FileOrigin(tmp_path / "origin")
    with trio.fail_after(60):
        for i in range(6):
            src = tmp_path / f"v{i}"
            _tree(src, 20 * 1024, seed=10 + i)
            await publish(src, origin, f"app:v{i}", TINY)
            os.utime(tmp_path / "origin" / "refs" / f"app:v{i}", (1_000 + i, 1_000 + i))
        other = tmp_path / "other"
        _tree(other, 20 * 1024, seed=99)
        await publish(other, origin, "app2:v1", TINY)          # another name sharing the prefix
        got = await recent_refs(origin, "app:v9", 4)
    assert sorted(got.refs) == ["app:v2", "app:v3", "app:v4", "app:v5"]
    assert (await recent_refs(origin, "app:v9", 0)).refs == {}


async def test_a_bad_recent_manifest_is_not_trusted(tmp_path: Path) -> None:
    """A ref naming a manifest that is missing or damaged adds nothing: its chunks are checked."""
    src = tmp_path / "src"
    _tree(src, 200 * 1024, seed=5)
    with trio.fail_after(60):
        v1 = await publish(src, FileOrigin(tmp_path / "origin"), "app:v1", TINY)
        mpath = tmp_path / "origin" / "manifests" / v1.manifest
        mpath.write_bytes(mpath.read_bytes()[:-3] + b"xyz")   # damaged (no longer its id)
        for c in os.listdir(tmp_path / "origin" / "chunks")[:5]:
            os.unlink(tmp_path / "origin" / "chunks" / c)     # and some chunks gone
        v2 = await publish(src, FileOrigin(tmp_path / "origin"), "app:v2", TINY)
        assert v2.dedup_refs == [] and v2.chunks_checked == v2.chunks and v2.chunks_uploaded == 5
        store = ChunkStore(tmp_path / "store")
        await fetch_artifact(store, v2.manifest, FileOrigin(tmp_path / "origin"))


async def test_a_gc_that_drops_a_relied_on_ref_makes_publish_check_everything(tmp_path: Path) -> None:
    """Between publish's first read of the refs and its check after the ref, a ref it relied
    on was removed and its chunks pruned (a gc with keep_last below the window): the check
    after the ref sees the ref gone, checks every chunk and puts back what is missing."""
    src = tmp_path / "src"
    _tree(src, 100 * 1024, seed=6)
    root = tmp_path / "origin"

    class Racing(FileOrigin):
        """A real file:// origin; right after publish's manifest is written, a gc-like
        removal of ref v1 and of v1's chunks happens (real files removed)."""
        fired = False

        async def _put_manifest(self, key: str, data: bytes, ref: str | None) -> None:
            await super()._put_manifest(key, data, ref)
            if not self.fired:
                self.fired = True
                os.unlink(root / "refs" / "app:v1")
                shutil.rmtree(root / "chunks")

    with trio.fail_after(60):
        await publish(src, FileOrigin(root), "app:v1", TINY)
        v2 = await publish(src, Racing(root), "app:v2", TINY)
        assert v2.dedup_refs == ["app:v1"] and v2.chunks_uploaded == 0
        store = ChunkStore(tmp_path / "store")
        await fetch_artifact(store, v2.manifest, FileOrigin(root))   # every chunk was put back
    assert (store.materialise(v2.manifest) / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()


async def test_gc_between_releases_keeps_the_dedup_window_whole(tmp_path: Path) -> None:
    """gc keeps at least the dedup window, so a publish after a gc still finds every chunk it
    assumes present."""
    origin = FileOrigin(tmp_path / "origin")
    src = tmp_path / "src"
    _tree(src, 50 * 1024, seed=7)
    with trio.fail_after(60):
        for i in range(6):
            (src / "v.txt").write_text(f"version {i}\n")
            await publish(src, origin, f"app:v{i}", TINY)
        await collect(origin, GcPolicy(keep_last=4, grace_s=0.0))
        (src / "v.txt").write_text("version 6\n")
        v6 = await publish(src, origin, "app:v6", TINY)
        assert v6.chunks_checked <= 2
        await fetch_artifact(ChunkStore(tmp_path / "store"), v6.manifest, origin)


async def test_incremental_publish_over_http_to_the_gcs_emulator(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same against a real HTTP origin (the emulator; kept small: it rewrites its
    metadata on every write): the HTTP requests of the second publish grow with the new
    chunks and N, not with the artifact."""
    src = tmp_path / "src"
    _tree(src, 300 * 1024, seed=8)
    with gcs_emulator(tmp_path / "emu") as host:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        with trio.fail_after(120):
            first = open_origin("gs://herd-test/a", max_concurrency=4)
            v1 = await publish(src, first, "app:v1", TINY)
            await first.aclose()
            _add_new_files(src, 3, seed=9)
            origin = open_origin("gs://herd-test/a", max_concurrency=4)
            v2 = await publish(src, origin, "app:v2", TINY)
            sent = origin.http.requests  # type: ignore[attr-defined]
            await origin.aclose()
            store = ChunkStore(tmp_path / "store")
            check = open_origin("gs://herd-test/a", max_concurrency=4)
            await fetch_artifact(store, v2.manifest, check)
            await check.aclose()
    assert v1.chunks > 200 and v2.chunks_uploaded == 3 and v2.chunks_known == v1.chunks
    # 2 x (list refs + GET ref + GET manifest), 2 x 3 existence checks, 3 chunk + manifest
    # + ref uploads, has_manifest, and one auth-free extra at most
    assert sent <= 2 * 3 + 2 * 3 + 5 + 4, sent


# ------------------------------------------------------------------ the pipeline's failures

def _many_files(root: Path, n: int, size: int, seed: int) -> None:
    rng = __import__("random").Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i:04d}.bin").write_bytes(rng.randbytes(size))


async def test_a_tree_that_fails_mid_scan_publishes_nothing(tmp_path: Path) -> None:
    """The scan refuses a FIFO found after uploads began: the ManifestError comes out as
    itself, and the origin holds no manifest and no ref (uploaded chunks are harmless)."""
    from p2p.errors import ManifestError

    src = tmp_path / "src"
    _many_files(src, 50, 3000, seed=20)          # the root's files are scanned (and uploaded) first
    (src / "sub").mkdir()
    os.mkfifo(src / "sub" / "pipe")
    root = tmp_path / "origin"
    with trio.fail_after(30):
        with pytest.raises(ManifestError, match="pipe"):
            await publish(src, FileOrigin(root), "app:v1", TINY)
    assert not (root / "refs").exists() or not os.listdir(root / "refs")
    assert not (root / "manifests").exists() or not os.listdir(root / "manifests")


async def test_an_origin_failing_mid_upload_stops_the_scan_too(tmp_path: Path) -> None:
    """An upload fails while the scan still has many files to go (its channel full): the
    OriginError comes out as itself, promptly, and nothing names the partial upload."""
    from p2p.errors import OriginError

    src = tmp_path / "src"
    _many_files(src, 400, 2000, seed=21)
    root = tmp_path / "origin"

    class Failing(FileOrigin):
        """A real file:// origin whose disk 'fills' after 20 chunk writes."""
        writes = 0

        async def _put(self, key: str, data: bytes) -> None:
            if key.startswith("chunks/"):
                self.writes += 1
                if self.writes > 20:
                    raise OriginError(f"origin {self.url} is full while writing {key}")
            await super()._put(key, data)

    with trio.fail_after(30):
        with pytest.raises(OriginError, match="is full"):
            await publish(src, Failing(root), "app:v1", TINY, concurrency=2)
    assert not (root / "refs").exists() or not os.listdir(root / "refs")


async def test_a_file_rewritten_after_its_scan_publishes_the_scanned_bytes(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Uploads come from the scan's read windows (the bytes that were hashed), not from a
    second read of the file: a file rewritten between its scan and the upload of its
    chunks cannot put bytes at the origin that do not match their id. Every chunk file
    hashes to its name and a fetch gives back the tree as it was scanned."""
    from blake3 import blake3

    src = tmp_path / "src"
    _many_files(src, 30, 3000, seed=22)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    root = tmp_path / "origin"

    import threading

    import p2p.publish as publish_mod

    scanned = threading.Event()
    real_scan = publish_mod.scan_tree

    def scan_tree(*args: Any, **kwargs: Any) -> Any:   # the scan, then say it is done
        try:
            return real_scan(*args, **kwargs)
        finally:
            scanned.set()

    monkeypatch.setattr(publish_mod, "scan_tree", scan_tree)

    class Rewriting(FileOrigin):
        """Before the first chunk write, once the scan is over (uploads may start while it
        runs; the tree fits its window budget), every file is rewritten (same size)."""
        done = False

        async def _put(self, key: str, data: bytes | memoryview) -> None:
            if not self.done:
                self.done = True
                await trio.to_thread.run_sync(scanned.wait)
                for p in src.iterdir():
                    p.write_bytes(b"\0" * p.stat().st_size)
            await super()._put(key, data)

    with trio.fail_after(30):
        st = await publish(src, Rewriting(root), "app:v1", TINY, concurrency=1)
    for f in (root / "chunks").iterdir():
        assert blake3(f.read_bytes()).hexdigest() == f.name
    store = ChunkStore(tmp_path / "store")
    with trio.fail_after(30):
        await fetch_artifact(store, st.manifest, FileOrigin(root))
    tree = store.materialise(st.manifest)
    assert {p.name: p.read_bytes() for p in tree.iterdir()} == before


def test_read_source_refuses_a_changed_file(tmp_path: Path) -> None:
    """The put-back path (after the ref) reads chunks from the tree again: it re-hashes
    them, so a file changed since the scan is refused rather than uploaded."""
    from blake3 import blake3

    from manifests import ChunkSource
    from p2p.errors import IntegrityError
    from p2p.publish import read_source

    f = tmp_path / "f"
    f.write_bytes(b"a" * 1000)
    cid = blake3(b"a" * 500).hexdigest()
    assert read_source(cid, ChunkSource(f, 500, 500)) == b"a" * 500
    f.write_bytes(b"b" * 1000)
    with pytest.raises(IntegrityError, match="changed while it was being published"):
        read_source(cid, ChunkSource(f, 500, 500))


async def test_publish_through_a_tiny_window_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for only a few read windows the scan waits for the uploads to release
    them (backpressure, and the check is told to ask at once rather than wait for a full
    batch); what is published is still byte-exact."""
    import p2p.publish as pub
    from manifests.window import WindowPool

    pools: list[WindowPool] = []

    class Counting(WindowPool):
        def __init__(self, **kw: object) -> None:
            super().__init__(**kw)  # type: ignore[arg-type]
            pools.append(self)

    monkeypatch.setattr(pub, "WindowPool", Counting)
    monkeypatch.setattr(pub, "WINDOW_BYTES", 4 * TINY.max_size)
    monkeypatch.setattr(pub, "WINDOW_BUDGET", 3 * 4 * TINY.max_size)
    src = tmp_path / "src"
    _tree(src, 400_000, seed=31)
    _many_files(src / "many", 40, 20_000, seed=32)
    root = tmp_path / "origin"
    with trio.fail_after(60):
        st = await publish(src, FileOrigin(root), "app:v1", TINY, concurrency=2)
    assert pools and pools[0].waits > 0 and pools[0].used_bytes == 0
    store = ChunkStore(tmp_path / "store")
    with trio.fail_after(60):
        await fetch_artifact(store, st.manifest, FileOrigin(root))
    tree = store.materialise(st.manifest)
    assert (tree / "weights.bin").read_bytes() == (src / "weights.bin").read_bytes()
    for p in (src / "many").iterdir():
        assert (tree / "many" / p.name).read_bytes() == p.read_bytes()
