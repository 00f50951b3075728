"""materialise: bit-exact, read-only, atomic trees from a chunk dir, linking what is already there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manifests import (
    ChunkerParams,
    ChunkMissing,
    IntegrityError,
    Manifest,
    ManifestError,
    MaterialiseStats,
    ScanResult,
    materialise,
    remove_partials,
    scan_tree,
)
from manifests.materialise import _Copier

SMALL = ChunkerParams(4096, 16384, 65536)


def store_chunks(res: ScanResult, chunks: Path) -> None:
    """A tiny in-test chunk dir: one file per chunk, named by id."""
    chunks.mkdir(exist_ok=True)
    for chunk_id, src in res.sources.items():
        with open(src.path, "rb") as f:
            f.seek(src.offset)
            (chunks / chunk_id).write_bytes(f.read(src.size))


def make_tree(root: Path, seed: bytes = b"v1") -> None:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run").write_bytes(b"#!/bin/sh\necho " + seed + b"\n")
    os.chmod(root / "bin" / "run", 0o755)
    (root / "data" / "deep" / "er").mkdir(parents=True)
    rnd = blake3.blake3(seed).digest(length=400_000)
    (root / "data" / "model.bin").write_bytes(rnd)
    (root / "data" / "same.bin").write_bytes(b"shared content " * 20_000)
    (root / "data" / "empty").write_bytes(b"")
    (root / "empty-dir").mkdir()
    (root / "ünïcødé ✓ 日本.txt").write_text("non-ascii\n")
    os.symlink("bin/run", root / "latest")
    os.symlink("../../model.bin", root / "data" / "deep" / "link")
    os.symlink("nowhere", root / "dangling")


def walk(root: Path) -> dict[str, tuple]:
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
                out[rel] = ("file", blake3.blake3(p.read_bytes()).hexdigest(), bool(st.st_mode & 0o100))
    return out


def build(tmp_path: Path, seed: bytes = b"v1") -> tuple[Path, Manifest, Path]:
    src = tmp_path / f"src-{seed.decode()}"
    make_tree(src, seed)
    res = scan_tree(src, SMALL)
    chunks = tmp_path / "chunks"
    store_chunks(res, chunks)
    return src, res.manifest, chunks


def test_round_trip_bit_exact_and_read_only(tmp_path: Path) -> None:
    src, m, chunks = build(tmp_path)
    stats = MaterialiseStats()
    dest = materialise(m, chunk_path=lambda c: chunks / c, dest=tmp_path / "art" / m.id, stats=stats)
    assert dest == tmp_path / "art" / m.id
    assert walk(dest) == walk(src)
    assert stats.files_copied == 5 and stats.files_linked == 0
    for dirpath, _dirnames, filenames in os.walk(dest):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o555
        for name in filenames:
            st = os.lstat(Path(dirpath) / name)
            if stat.S_ISREG(st.st_mode):
                assert stat.S_IMODE(st.st_mode) in (0o444, 0o555)
    assert stat.S_IMODE(os.stat(dest / "bin" / "run").st_mode) == 0o555
    assert stat.S_IMODE(os.stat(dest / "data" / "model.bin").st_mode) == 0o444
    assert os.listdir(tmp_path / "art") == [m.id]  # no temp dir left
    # Materialising again returns the existing tree without reading any chunk.
    again = MaterialiseStats()
    assert materialise(m, chunk_path=lambda c: 1 / 0, dest=dest, stats=again) == dest  # type: ignore[arg-type,return-value]
    assert again.reused


def test_file_over_64_mib(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = src / "weights.bin"
    with open(big, "wb") as f:  # sparse, with some real data scattered through it
        f.truncate(65 * 1024 * 1024 + 12345)
        for i in range(8):
            f.seek(i * 8 * 1024 * 1024 + 777)
            f.write(blake3.blake3(bytes([i])).digest(length=50_000))
    res = scan_tree(src, ChunkerParams())
    chunks = tmp_path / "chunks"
    store_chunks(res, chunks)
    dest = materialise(res.manifest, chunk_path=lambda c: chunks / c, dest=tmp_path / "out")
    out = dest / "weights.bin"
    assert out.stat().st_size == big.stat().st_size
    with open(big, "rb") as a, open(out, "rb") as b:
        while True:
            x, y = a.read(8 << 20), b.read(8 << 20)
            assert x == y
            if not x:
                break


def test_links_from_an_existing_tree(tmp_path: Path) -> None:
    _, m1, chunks = build(tmp_path, b"v1")
    d1 = materialise(m1, chunk_path=lambda c: chunks / c, dest=tmp_path / "art" / m1.id)
    src2, m2, _ = build(tmp_path, b"v2")  # same.bin, empty, non-ascii file unchanged; run/model changed
    linked_only = {c.id for c in m1.chunks} - {
        cid for e in m2.files if e.path in ("bin/run", "data/model.bin") for cid in m2.chunk_ids(e)
    }
    for cid in linked_only:  # chunks only linked files need can be gone from the store
        (chunks / cid).unlink()
    stats = MaterialiseStats()
    d2 = materialise(
        m2, chunk_path=lambda c: chunks / c, dest=tmp_path / "art" / m2.id, link_from={m1.id: (d1, m1)}, stats=stats
    )
    assert walk(d2) == walk(src2)
    assert stats.files_linked == 2  # same.bin and the non-ascii file (empty files are created, not linked)
    assert os.stat(d2 / "data" / "same.bin").st_ino == os.stat(d1 / "data" / "same.bin").st_ino
    assert os.stat(d2 / "data" / "model.bin").st_ino != os.stat(d1 / "data" / "model.bin").st_ino


def test_tampered_link_source_falls_back_to_chunks(tmp_path: Path) -> None:
    src, m, chunks = build(tmp_path)
    fake_root = tmp_path / "fake"
    (fake_root / "data").mkdir(parents=True)
    (fake_root / "data" / "same.bin").write_bytes(b"not the right size")
    stats = MaterialiseStats()
    d = materialise(m, chunk_path=lambda c: chunks / c, dest=tmp_path / "out", link_from={"x": (fake_root, m)}, stats=stats)
    assert walk(d) == walk(src)
    # The wrong-size source is not used; the other "sources" do not exist: all assembled from chunks.
    assert stats.files_linked == 0 and stats.files_copied == 5


def _nothing_visible(parent: Path, dest: Path) -> None:
    assert not dest.exists()
    assert [n for n in os.listdir(parent) if n != "keep"] == []


def test_missing_chunk_mid_way_leaves_nothing(tmp_path: Path) -> None:
    _, m, chunks = build(tmp_path)
    last = next(e for e in reversed(m.entries) if e.kind == "file" and e.chunks)
    (chunks / m.chunk_ids(last)[-1]).unlink()
    parent = tmp_path / "art"
    parent.mkdir()
    (parent / "keep").mkdir()
    with pytest.raises(ChunkMissing, match=repr(last.path)):
        materialise(m, chunk_path=lambda c: chunks / c, dest=parent / m.id)
    _nothing_visible(parent, parent / m.id)


def test_wrong_size_chunk_is_an_integrity_error(tmp_path: Path) -> None:
    _, m, chunks = build(tmp_path)
    victim = m.chunks[len(m.chunks) // 2].id
    (chunks / victim).write_bytes(b"short")
    parent = tmp_path / "art"
    parent.mkdir()
    with pytest.raises(IntegrityError, match=victim):
        materialise(m, chunk_path=lambda c: chunks / c, dest=parent / m.id)
    assert os.listdir(parent) == []


def test_chunk_path_error_mid_way_leaves_nothing(tmp_path: Path) -> None:
    _, m, chunks = build(tmp_path)
    calls = []

    def chunk_path(c: str) -> Path:
        calls.append(c)
        if len(calls) == 3:
            raise RuntimeError("store went away")
        return chunks / c

    parent = tmp_path / "art"
    parent.mkdir()
    with pytest.raises(RuntimeError, match="store went away"):
        materialise(m, chunk_path=chunk_path, dest=parent / m.id)
    assert os.listdir(parent) == []


def test_invalid_manifest_creates_nothing(tmp_path: Path) -> None:
    import msgspec

    _, m, chunks = build(tmp_path)
    bad = msgspec.structs.replace(m, entries=m.entries + (m.entries[0],))
    with pytest.raises(ManifestError, match="sorted|duplicate"):
        materialise(bad, chunk_path=lambda c: chunks / c, dest=tmp_path / "art" / "x")
    assert not (tmp_path / "art").exists() or os.listdir(tmp_path / "art") == []


def test_dest_that_is_a_file_refused(tmp_path: Path) -> None:
    _, m, chunks = build(tmp_path)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ManifestError, match="not a directory"):
        materialise(m, chunk_path=lambda c: chunks / c, dest=tmp_path / "file")
    assert (tmp_path / "file").read_bytes() == b"x"


def test_concurrent_writer_wins_race(tmp_path: Path) -> None:
    """Another materialisation finishes first: ours is discarded and the finished tree returned."""
    src, m, chunks = build(tmp_path)
    dest = tmp_path / "art" / m.id
    inner_done = []

    def chunk_path(c: str) -> Path:
        if not inner_done:
            inner_done.append(True)
            materialise(m, chunk_path=lambda c: chunks / c, dest=dest)
        return chunks / c

    stats = MaterialiseStats()
    assert materialise(m, chunk_path=chunk_path, dest=dest, stats=stats) == dest
    assert stats.reused and walk(dest) == walk(src)
    assert os.listdir(tmp_path / "art") == [m.id]


def test_sync_mode_and_remove_partials(tmp_path: Path) -> None:
    src, m, chunks = build(tmp_path)
    d = materialise(m, chunk_path=lambda c: chunks / c, dest=tmp_path / "art" / m.id, sync=True)
    assert walk(d) == walk(src)
    left = tmp_path / "art" / f".{m.id}.partial-1-abcd"
    (left / "sub").mkdir(parents=True)
    (left / "sub" / "f").write_bytes(b"x")
    os.chmod(left / "sub", 0o555)
    os.chmod(left, 0o555)
    assert remove_partials(tmp_path / "art") == 1
    assert os.listdir(tmp_path / "art") == [m.id]
    assert remove_partials(tmp_path / "missing") == 0


@pytest.mark.parametrize("method", [0, 1, 2])
def test_copy_methods_are_equivalent(tmp_path: Path, method: int) -> None:
    data = blake3.blake3(b"x").digest(length=3_000_000)
    (tmp_path / "src").write_bytes(data)
    copier = _Copier()
    copier.method = method
    sfd = os.open(tmp_path / "src", os.O_RDONLY)
    dfd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        copier.copy(sfd, dfd, 1000, 2_000_000, "f")
        copier.copy(sfd, dfd, 0, 1000, "f")
        with pytest.raises(IntegrityError, match="early"):
            copier.copy(sfd, dfd, 2_999_000, 5000, "f")
    finally:
        os.close(sfd)
        os.close(dfd)
    assert (tmp_path / "dst").read_bytes()[:2_001_000] == data[1000:2_001_000] + data[:1000]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 256 KiB tmpfs mounted for the test (root only; skipped where mounting is not allowed)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_disk_is_an_oserror_and_leaves_nothing(tmp_path: Path, tiny_tmpfs: Path) -> None:
    import errno

    _, m, chunks = build(tmp_path)  # ~700 KB of files: does not fit in 256 KiB
    (tiny_tmpfs / "art").mkdir()
    with pytest.raises(OSError) as info:
        materialise(m, chunk_path=lambda c: chunks / c, dest=tiny_tmpfs / "art" / m.id)
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tiny_tmpfs / "art") == []
    assert os.statvfs(tiny_tmpfs).f_bfree == os.statvfs(tiny_tmpfs).f_blocks  # every byte given back


@st.composite
def disk_trees(draw) -> list[tuple[str, str, object]]:
    """(path, kind, payload) in creation order: dirs before their children."""
    items: list[tuple[str, str, object]] = []
    dirs = [""]
    used: set[str] = set()
    for _ in range(draw(st.integers(0, 12))):
        parent = draw(st.sampled_from(dirs))
        name = draw(st.text(alphabet="abç✓-_ .", min_size=1, max_size=5).filter(lambda s: s not in (".", "..")))
        path = f"{parent}/{name}" if parent else name
        if path in used:
            continue
        used.add(path)
        kind = draw(st.sampled_from(["file", "file", "file", "dir", "symlink"]))
        if kind == "dir":
            dirs.append(path)
            items.append((path, "dir", None))
        elif kind == "symlink":
            items.append((path, "symlink", draw(st.sampled_from(["x", "../" * path.count("/") + "x", "."]))))
        else:
            size = draw(st.sampled_from([0, 1, 100, 5000, 70_000, 200_000]))
            items.append((path, "file", (size, draw(st.integers(0, 3)), draw(st.booleans()))))
    return items


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(disk_trees())
def test_random_trees_round_trip(tmp_path_factory, items) -> None:
    base = tmp_path_factory.mktemp("rt")
    src = base / "src"
    src.mkdir()
    for path, kind, payload in items:
        p = src / path
        if kind == "dir":
            p.mkdir()
        elif kind == "symlink":
            os.symlink(payload, p)
        else:
            size, seed, exe = payload  # type: ignore[misc]
            p.write_bytes(blake3.blake3(bytes([seed])).digest(length=size) if size else b"")
            os.chmod(p, 0o755 if exe else 0o644)
    res = scan_tree(src, SMALL)
    store_chunks(res, base / "chunks")
    dest = materialise(res.manifest, chunk_path=lambda c: base / "chunks" / c, dest=base / "out")
    assert walk(dest) == walk(src)
