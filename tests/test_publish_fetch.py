"""publish -> origin -> fetch -> materialise, bit-exact, through file:// and the real GCS emulator;
a corrupted origin chunk; an interrupted fetch that resumes; a full disk during fetch."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import trio
from blake3 import blake3

from manifests import ChunkerParams
from p2p.errors import IntegrityError, StoreError, StoreFullError
from p2p.fetch import fetch_artifact
from p2p.origins import FileOrigin, open_origin
from p2p.publish import publish
from p2p.store import ChunkStore
from tests.conftest import is_root
from tests.gcs_emulator import gcs_emulator

SMALL = ChunkerParams(min_size=16 * 1024, avg_size=64 * 1024, max_size=256 * 1024)


def make_tree(root: Path, *, big_mib: int = 0, seed: int = 1) -> Path:
    rnd = __import__("random").Random(seed)
    root.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "run.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "bin" / "run.sh", 0o755)
    (root / "data").mkdir()
    (root / "data" / "weights.bin").write_bytes(rnd.randbytes(700_000))
    (root / "data" / "copy.bin").write_bytes((root / "data" / "weights.bin").read_bytes())  # dedup
    (root / "data" / "empty").write_bytes(b"")
    (root / "empty-dir" / "nested-empty").mkdir(parents=True)
    (root / "naïve ☃ 名前.txt").write_text("unicode names\n", encoding="utf-8")
    os.symlink("data/weights.bin", root / "link-to-weights")
    os.symlink("../bin", root / "data" / "bin-link")
    os.chmod(root / "data" / "weights.bin", 0o600)  # normalised to 0o644 in the manifest
    if big_mib:
        with open(root / "data" / "big.bin", "wb") as f:
            block = rnd.randbytes(1 << 20)
            for i in range(big_mib):
                f.write(block[i:] + block[:i])  # distinct content per MiB
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    """path -> (kind, exec bit, content-or-target) for everything under root."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("symlink", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", bool(st.st_mode & 0o100), p.read_bytes())
    return out


def assert_same_tree(src: Path, dst: Path) -> None:
    a, b = snapshot(src), snapshot(dst)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k] == b[k], k
    for dirpath, _, filenames in os.walk(dst):  # materialised trees are read-only
        for name in filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                assert os.lstat(p).st_mode & 0o222 == 0, p


async def test_roundtrip_file_origin_with_big_file(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big_mib=65)
    origin = open_origin(f"file://{tmp_path}/origin")
    with trio.fail_after(60):
        pub = await publish(src, origin, "app:v1")
        assert pub.name == "app:v1" and pub.files == 6 and pub.chunks_uploaded == pub.chunks
        assert pub.bytes == sum(len(v[2]) for v in snapshot(src).values() if v[0] == "file")
        again = await publish(src, origin, "app:v1-again")
        assert again.manifest == pub.manifest and again.chunks_uploaded == 0 and again.bytes_uploaded == 0
        store = ChunkStore(tmp_path / "store")
        mid = await origin.resolve("app:v1")
        assert mid == pub.manifest
        fs = await fetch_artifact(store, mid, open_origin(f"file://{tmp_path}/origin"))
    assert fs.bytes_from_origin == fs.bytes and fs.bytes_local == 0 and fs.chunks_fetched == pub.chunks
    assert store.complete_manifests() == [mid]
    tree = store.materialise(mid)
    assert tree == tmp_path / "store" / "artifacts" / mid
    assert_same_tree(src, tree)


async def test_roundtrip_gcs_emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_tree(tmp_path / "src")
    with gcs_emulator(tmp_path / "emu") as host:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        origin = open_origin("gs://herd-test/artifacts", max_concurrency=4)
        with trio.fail_after(30):
            pub = await publish(src, origin, "team/app:v1", SMALL)
            assert pub.chunks_uploaded == pub.chunks > 5
            mid = await origin.resolve("team/app:v1")
            store = ChunkStore(tmp_path / "store")
            fs = await fetch_artifact(store, mid, origin)
            # missing(): a listing cut short (tiny pages) falls back to one check per id.
            m = store.get_manifest(mid)
            fake = [blake3(str(i).encode()).hexdigest() for i in range(70)]
            origin.list_page = 5  # type: ignore[attr-defined]
            origin.list_budget_factor = 0  # type: ignore[attr-defined]  # list 2 pages, then GET each
            assert await origin.missing([c.id for c in m.chunks] + fake) == set(fake)
            await origin.aclose()
    assert fs.chunks_fetched == pub.chunks
    assert_same_tree(src, store.materialise(mid))


async def test_corrupted_origin_chunk_is_refused(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    origin = FileOrigin(tmp_path / "origin")
    with trio.fail_after(20):
        pub = await publish(src, origin, "app:v1", SMALL)
        m_chunks = sorted(os.listdir(tmp_path / "origin" / "chunks"))
        victim = tmp_path / "origin" / "chunks" / m_chunks[len(m_chunks) // 2]
        victim.write_bytes(b"\x00" * victim.stat().st_size)  # same size, wrong bytes
        store = ChunkStore(tmp_path / "store")
        with pytest.raises(IntegrityError):
            await fetch_artifact(store, pub.manifest, origin)
    assert store.complete_manifests() == []
    assert not store.has_chunk(victim.name)
    with pytest.raises(StoreError, match="chunks missing"):
        store.materialise(pub.manifest)
    assert os.listdir(tmp_path / "store" / "artifacts") == []
    assert os.listdir(tmp_path / "store" / "tmp") == []


async def test_interrupted_fetch_resumes_without_refetching(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", seed=3)
    origin = FileOrigin(tmp_path / "origin")
    with trio.fail_after(20):
        pub = await publish(src, origin, "app:v1", SMALL)
        store = ChunkStore(tmp_path / "store")
        first = FileOrigin(tmp_path / "origin")
        with trio.CancelScope() as scope:
            def progress(done: int, total: int) -> None:
                if done >= total // 3:
                    scope.cancel()
            await fetch_artifact(store, pub.manifest, first, progress=progress, concurrency=2)
        assert scope.cancelled_caught
        held = store.statistics().chunks
        assert 0 < held < pub.chunks
        assert store.complete_manifests() == []
        # A fresh process view of the same store: resumes, fetching only what is missing.
        store2 = ChunkStore(tmp_path / "store")
        second = FileOrigin(tmp_path / "origin")
        fs = await fetch_artifact(store2, pub.manifest, second)
    assert second.statistics().gets == pub.chunks - held  # the manifest came from the store
    assert fs.chunks_fetched == pub.chunks - held
    assert fs.bytes_local > 0 and fs.bytes_local + fs.bytes_from_origin == fs.bytes
    assert store2.complete_manifests() == [pub.manifest]
    assert_same_tree(src, store2.materialise(pub.manifest))


async def test_concurrent_fetches_share_downloads(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", seed=4)
    origin = FileOrigin(tmp_path / "origin")
    with trio.fail_after(20):
        pub = await publish(src, origin, "app:v1", SMALL)
        store = ChunkStore(tmp_path / "store")
        reader = FileOrigin(tmp_path / "origin")
        results = []
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(lambda: _append(results, fetch_artifact(store, pub.manifest, reader)))
    assert reader.statistics().gets == pub.chunks + 1  # one manifest read, one read per chunk
    assert sum(r.chunks_fetched for r in results) == pub.chunks


async def _append(out: list, coro) -> None:  # type: ignore[no-untyped-def]
    out.append(await coro)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    if not is_root():
        pytest.skip("needs root for mount -t tmpfs")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                      capture_output=True, timeout=10).returncode != 0:
        pytest.skip("mount -t tmpfs refused")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


async def test_fetch_into_full_disk(tmp_path: Path, tiny_tmpfs: Path) -> None:
    src = make_tree(tmp_path / "src", seed=5)
    origin = FileOrigin(tmp_path / "origin")
    with trio.fail_after(20):
        pub = await publish(src, origin, "app:v1", SMALL)
        store = ChunkStore(tiny_tmpfs / "store")
        with pytest.raises(StoreFullError, match="disk full"):
            await fetch_artifact(store, pub.manifest, origin)
    assert os.listdir(tiny_tmpfs / "store" / "tmp") == []
    assert store.complete_manifests() == []
    assert ChunkStore(tiny_tmpfs / "store").verify().ok
