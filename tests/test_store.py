"""ChunkStore: verify on put, layout, LRU + watermarks, pins, leftovers, verify(), a real full disk."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from blake3 import blake3

from manifests.codec import encode_manifest
from manifests.model import ManifestBuilder
from p2p.errors import IntegrityError, StoreError, StoreFullError
from p2p.store import SYNC_THREADS, ChunkStore
from tests.conftest import is_root


def chunk(seed: int, size: int = 1000) -> tuple[str, bytes]:
    data = (seed.to_bytes(4, "big") * (size // 4 + 1))[:size]
    return blake3(data).hexdigest(), data


def manifest_of(chunks: list[tuple[str, bytes]], name: str = "f") -> tuple[str, bytes]:
    b = ManifestBuilder()
    b.add_file(name, 0o644, [(cid, len(d)) for cid, d in chunks])
    m = b.build()
    return m.id, encode_manifest(m)


def test_put_read_layout_and_hook(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s")
    seen: list[str] = []
    s.on_chunk_added.append(seen.append)
    cid, data = chunk(1)
    assert s.put_chunk(cid, data) is True
    assert s.put_chunk(cid, data) is False  # already there: no second write, no hook
    assert seen == [cid]
    assert s.has_chunk(cid)
    assert s.chunk_path(cid) == tmp_path / "s" / "chunks" / cid[:2] / cid
    assert s.read_chunk(cid) == data
    st = s.statistics()
    assert (st.chunks, st.bytes, st.pending_sync) == (1, len(data), 1)
    assert s.sync() == 1
    assert s.statistics().pending_sync == 0
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_put_rejects_bad_bytes_and_bad_ids(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s")
    cid, data = chunk(1)
    with pytest.raises(IntegrityError):
        s.put_chunk(cid, data + b"x")
    assert not s.has_chunk(cid)
    assert not s.chunk_path(cid).exists()
    with pytest.raises(StoreError, match="invalid chunk id"):
        s.put_chunk("../../etc/passwd", b"")
    with pytest.raises(StoreError, match="not in the store"):
        s.read_chunk(chunk(2)[0])
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_bad_watermarks_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="watermarks"):
        ChunkStore(tmp_path / "s", quota_bytes=100, high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(StoreError, match="quota"):
        ChunkStore(tmp_path / "s", quota_bytes=0)


def test_manifest_put_get_complete(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s")
    chunks = [chunk(i) for i in range(3)]
    mid, mbytes = manifest_of(chunks)
    with pytest.raises(IntegrityError):
        s.put_manifest(chunk(9)[0], mbytes)
    assert not s.has_manifest(chunk(9)[0])
    m = s.put_manifest(mid, mbytes)
    assert s.get_manifest(mid) == m
    assert s.manifest_bytes(mid) == mbytes
    assert s.missing_chunks(m) == [c for c, _ in chunks]
    with pytest.raises(StoreError, match="not complete"):
        s.mark_complete(mid)
    for cid, data in chunks:
        s.put_chunk(cid, data)
    assert s.missing_chunks(m) == []
    s.mark_complete(mid)
    assert s.statistics().pending_sync == 0  # mark_complete synced first
    assert s.complete_manifests() == [mid]
    # Survives reopening; the LRU is re-seeded from disk.
    s2 = ChunkStore(tmp_path / "s")
    assert s2.complete_manifests() == [mid]
    assert s2.statistics().chunks == 3
    assert s2.get_manifest(mid).id == mid


def test_leftovers_removed_at_open(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s")
    cid, data = chunk(1)
    s.put_chunk(cid, data)
    (tmp_path / "s" / "tmp" / "half-written").write_bytes(b"junk")
    junk_tree = tmp_path / "s" / "artifacts" / ".tmp-abc"
    (junk_tree / "d").mkdir(parents=True)
    (junk_tree / "d" / "f").write_bytes(b"x")
    os.chmod(junk_tree / "d", 0o555)
    (tmp_path / "s" / "chunks" / "00" / "not-a-chunk").write_bytes(b"y")
    s2 = ChunkStore(tmp_path / "s")
    assert os.listdir(tmp_path / "s" / "tmp") == []
    assert os.listdir(tmp_path / "s" / "artifacts") == []
    assert os.listdir(tmp_path / "s" / "chunks" / "00") == []
    assert s2.has_chunk(cid)


def test_open_keeps_temp_files_of_live_writers(tmp_path: Path) -> None:
    ChunkStore(tmp_path / "s")
    live = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    try:
        tmp = tmp_path / "s" / "tmp"
        (tmp / f"abc.p{live.pid}.0123").write_bytes(b"being written")
        (tmp / f"abc.p{dead.pid}.0123").write_bytes(b"leftover")
        (tmp_path / "s" / "artifacts" / f".{'0' * 64}.partial-{dead.pid}-ab").mkdir()
        ChunkStore(tmp_path / "s")
        assert os.listdir(tmp) == [f"abc.p{live.pid}.0123"]
        assert os.listdir(tmp_path / "s" / "artifacts") == []
    finally:
        live.kill()
        live.wait(timeout=10)


def test_lru_eviction_watermarks_and_pins(tmp_path: Path) -> None:
    # quota 10 000 bytes, chunks of 1000: filling past 9000 evicts down to 8000 - incoming.
    s = ChunkStore(tmp_path / "s", quota_bytes=10_000, high_watermark=0.9, low_watermark=0.5)
    pinned_chunks = [chunk(100 + i) for i in range(2)]
    mid, mbytes = manifest_of(pinned_chunks)
    s.put_manifest(mid, mbytes)
    s.pin(mid)
    for cid, data in pinned_chunks:
        s.put_chunk(cid, data)
    plain = [chunk(i) for i in range(7)]
    for cid, data in plain:
        s.put_chunk(cid, data)
    assert s.statistics().bytes == 9000
    assert s.statistics().evictions == 0
    s.read_chunk(plain[0][0])  # plain[0] is now the most recently used
    extra = chunk(50)
    s.put_chunk(*extra)  # 9000 + 1000 > 9000: evict to 5000 - 1000
    st = s.statistics()
    assert st.bytes <= 5000
    assert st.evictions > 0
    for cid, _ in pinned_chunks:
        assert s.has_chunk(cid), "a pinned chunk was evicted"
        assert s.chunk_path(cid).exists()
    assert s.has_chunk(plain[0][0]), "LRU evicted a recently used chunk before older ones"
    assert not s.has_chunk(plain[1][0])
    assert s.has_chunk(extra[0])
    assert st.pinned_bytes == 2000
    # Nothing evictable left beyond pins: a store full of pinned chunks refuses, clearly.
    s2 = ChunkStore(tmp_path / "s2", quota_bytes=2500)
    many = [chunk(200 + i) for i in range(3)]
    mid2, mbytes2 = manifest_of(many)
    s2.put_manifest(mid2, mbytes2)
    s2.pin(mid2)
    s2.put_chunk(*many[0])
    s2.put_chunk(*many[1])
    with pytest.raises(StoreFullError, match="pinned"):
        s2.put_chunk(*many[2])
    assert s2.has_chunk(many[0][0]) and s2.has_chunk(many[1][0])
    assert os.listdir(tmp_path / "s2" / "tmp") == []
    s2.unpin(mid2)
    s2.put_chunk(*many[2])  # now the older chunks may go
    assert s2.has_chunk(many[2][0])


def test_eviction_unmarks_complete(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s", quota_bytes=3000, high_watermark=1.0, low_watermark=0.5)
    chunks = [chunk(i) for i in range(2)]
    mid, mbytes = manifest_of(chunks)
    s.put_manifest(mid, mbytes)
    for c in chunks:
        s.put_chunk(*c)
    s.mark_complete(mid)
    s.put_chunk(*chunk(7))
    s.put_chunk(*chunk(8))  # 4000 > 3000: evicts the unpinned manifest's chunks
    assert mid not in s.complete_manifests()
    assert not (tmp_path / "s" / "complete" / mid).exists()


def test_verify_drops_bad_chunks_and_manifests(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s")
    good, bad = chunk(1), chunk(2)
    s.put_chunk(*good)
    s.put_chunk(*bad)
    mid, mbytes = manifest_of([good, bad])
    s.put_manifest(mid, mbytes)
    s.mark_complete(mid)
    p = s.chunk_path(bad[0])
    os.chmod(p, 0o644)
    p.write_bytes(b"rotten" + bad[1][6:])
    mid2, mbytes2 = manifest_of([good], name="g")
    s.put_manifest(mid2, mbytes2)
    mp = tmp_path / "s" / "manifests" / mid2
    os.chmod(mp, 0o644)
    mp.write_bytes(mbytes2[:-1] + b"\x00")
    s3 = ChunkStore(tmp_path / "s")
    report = s3.verify()
    assert report.bad_chunks == [bad[0]]
    assert report.bad_manifests == [mid2]
    assert report.chunks_checked == 2
    assert not s3.has_chunk(bad[0]) and not p.exists()
    assert mid not in s3.complete_manifests()
    assert s3.verify().ok


def _mount_tmpfs(path: Path, size: str) -> bool:
    if not is_root():
        return False
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, timeout=10)
    return r.returncode == 0


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tiny"
    if not _mount_tmpfs(mnt, "600k"):
        pytest.skip("needs root and mount -t tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)


def test_real_full_disk(tiny_tmpfs: Path) -> None:
    s = ChunkStore(tiny_tmpfs / "s")
    stored: list[tuple[str, bytes]] = []
    with pytest.raises(StoreFullError, match="disk full"):
        for i in range(100):
            c = chunk(i, 64 * 1024)
            s.put_chunk(*c)
            stored.append(c)
    assert 0 < len(stored) < 100
    assert os.listdir(tiny_tmpfs / "s" / "tmp") == []
    s.sync()
    # Consistent: every indexed chunk is whole, and a reopened store agrees.
    s2 = ChunkStore(tiny_tmpfs / "s")
    assert s2.statistics().chunks == len(stored)
    assert s2.verify().ok
    for cid, data in stored:
        assert s2.read_chunk(cid) == data


def _tree_manifest(store: ChunkStore, files: dict[str, list[tuple[str, bytes]]]) -> str:
    b = ManifestBuilder()
    b.add_dir("d")
    for name, chunks in files.items():
        b.add_file(name, 0o644, [(cid, len(d)) for cid, d in chunks])
        for c in chunks:
            store.put_chunk(*c)
    m = b.build()
    store.put_manifest(m.id, encode_manifest(m))
    store.mark_complete(m.id)
    return m.id


def test_materialise_links_upgrade_and_remove(tmp_path: Path) -> None:
    s = ChunkStore(tmp_path / "s", quota_bytes=100_000, high_watermark=0.5, low_watermark=0.1)
    shared = [chunk(1, 5000), chunk(2, 5000)]
    v1 = _tree_manifest(s, {"d/a": shared, "d/b": [chunk(3, 5000)]})
    t1 = s.materialise(v1)
    assert (t1 / "d" / "a").read_bytes() == shared[0][1] + shared[1][1]
    assert s.materialise(v1) == t1  # once
    v2 = _tree_manifest(s, {"d/renamed": shared, "d/c": [chunk(4, 5000)]})
    t2 = s.materialise(v2)
    assert os.stat(t2 / "d" / "renamed").st_ino == os.stat(t1 / "d" / "a").st_ino  # linked, not copied
    assert s.pinned() == sorted([v1, v2])
    # Materialised trees protect their chunks; after removal they are evictable.
    s.pin(v1)
    with pytest.raises(StoreError, match="pinned"):
        s.remove_artifact(v1)
    s.unpin(v1)
    assert s.remove_artifact(v1) and not t1.exists()
    assert (t2 / "d" / "renamed").read_bytes() == shared[0][1] + shared[1][1]
    assert s.evict(0) == 5000  # only d/b's chunk was unprotected
    assert not s.has_chunk(chunk(3)[0]) and s.has_chunk(shared[0][0])
    assert os.listdir(tmp_path / "s" / "tmp") == []


def test_materialise_on_full_disk(tiny_tmpfs: Path) -> None:
    s = ChunkStore(tiny_tmpfs / "s")
    big = [chunk(i, 100_000) for i in range(2)]
    mid = _tree_manifest(s, {f"d/f{i}": big for i in range(4)})  # 200 KB of chunks, 800 KB of tree
    with pytest.raises(StoreFullError, match="disk full"):
        s.materialise(mid)
    assert os.listdir(tiny_tmpfs / "s" / "artifacts") == []
    assert os.listdir(tiny_tmpfs / "s" / "tmp") == []
    assert not s.is_materialised(mid)
    assert s.verify().ok


def test_sync_keeps_its_fsync_threads_for_the_stores_life(tmp_path: Path) -> None:
    """sync() fsyncs on threads the store keeps (a pool per sync started SYNC_THREADS
    threads every batch): the second sync runs on the first one's threads."""
    import threading

    s = ChunkStore(tmp_path / "store")

    def fsync_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("herd-fsync")}

    def put(n: int, salt: bytes) -> None:
        for i in range(n):
            data = salt + i.to_bytes(4, "big")
            s.put_chunk(blake3(data).hexdigest(), data)

    before = fsync_threads()
    put(40, b"one")
    assert s.sync() == 40
    first = fsync_threads() - before
    assert first                     # still there after the sync returned
    for salt in (b"two", b"three"):
        put(40, salt)
        assert s.sync() == 40
    assert all(t.is_alive() for t in first)
    assert len(fsync_threads() - before) <= SYNC_THREADS
    assert s.statistics().pending_sync == 0


def test_a_chunk_write_steps_over_a_temp_name_already_taken(tmp_path: Path) -> None:
    """A chunk's temp file is named like every store temp (``.<id>.p<pid>.<hex>``); where a
    leftover holds the next name, the write takes the one after and leaves it alone."""
    s = ChunkStore(tmp_path / "store")
    data = b"temp names " * 100
    cid = blake3(data).hexdigest()
    n = next(s._tmp_seq)
    taken = [s.tmp_dir / f".{cid[:48]}.p{os.getpid()}.{n + i:012x}" for i in (1, 2)]
    for t in taken:
        t.write_bytes(b"leftover")
    assert s.put_chunk(cid, data)
    assert s.read_chunk(cid) == data
    assert oct(os.stat(s.chunk_path(cid)).st_mode & 0o777) == oct(0o444)
    assert all(t.read_bytes() == b"leftover" for t in taken)
    assert sorted(p.name for p in s.tmp_dir.iterdir()) == sorted(t.name for t in taken)
