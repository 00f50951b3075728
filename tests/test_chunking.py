"""Chunking: determinism, bounds, windowed mmap == one pass, shift resistance, refusing slow paths."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import pytest

import manifests.chunking as chunking
from manifests import ChunkerParams, ChunkRef, ManifestError, chunk_buffer, chunk_file
from manifests.errors import ChunkerUnavailable

ROOT = Path(__file__).resolve().parent.parent
SMALL = ChunkerParams(4096, 16384, 65536)


def _data(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


def _check_cover(refs: list[ChunkRef], data: bytes, params: ChunkerParams) -> None:
    pos = 0
    for i, r in enumerate(refs):
        assert r.offset == pos
        assert r.size <= params.max_size
        if i < len(refs) - 1:
            assert r.size >= params.min_size
        assert r.id == blake3.blake3(data[r.offset:r.offset + r.size]).hexdigest()
        pos += r.size
    assert pos == len(data)


def test_defaults_are_the_documented_ones() -> None:
    p = ChunkerParams()
    assert (p.min_size, p.avg_size, p.max_size) == (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
    assert p.name == "fastcdc" and p.version


def test_chunk_buffer_is_deterministic_and_covers_the_data() -> None:
    data = _data(3 << 20)
    a = chunk_buffer(data, SMALL)
    b = chunk_buffer(bytearray(data), SMALL)
    assert a == b
    assert len(a) > 20
    _check_cover(a, data, SMALL)


def test_empty_and_tiny_inputs(tmp_path: Path) -> None:
    assert chunk_buffer(b"", SMALL) == []
    one = chunk_buffer(b"x", SMALL)
    assert one == [ChunkRef(blake3.blake3(b"x").hexdigest(), 0, 1)]
    (tmp_path / "empty").write_bytes(b"")
    assert chunk_file(tmp_path / "empty", SMALL) == []


def test_chunk_file_equals_chunk_buffer_across_mmap_windows(tmp_path: Path, monkeypatch) -> None:
    data = _data(5 << 20, seed=2)
    path = tmp_path / "f"
    path.write_bytes(data)
    whole = chunk_buffer(data, SMALL)
    # Windows of 4 * max_size = 256 KiB: the file is mapped ~20 times; cut points must not move.
    monkeypatch.setattr(chunking, "WINDOW", 1)
    assert chunk_file(path, SMALL) == whole
    monkeypatch.setattr(chunking, "WINDOW", 256 * 1024 * 1024)
    assert chunk_file(path, SMALL) == whole


def test_large_file_default_params(tmp_path: Path) -> None:
    data = _data(12 << 20, seed=3)
    path = tmp_path / "big"
    path.write_bytes(data)
    refs = chunk_file(path)
    _check_cover(refs, data, ChunkerParams())
    assert 3 <= len(refs) <= 48


def test_insert_near_start_keeps_most_chunks() -> None:
    data = _data(4 << 20, seed=4)
    shifted = data[:1000] + b"inserted bytes!" * 7 + data[1000:]
    a = {r.id for r in chunk_buffer(data, SMALL)}
    b = {r.id for r in chunk_buffer(shifted, SMALL)}
    assert len(a & b) >= 0.9 * len(a)


def test_in_place_change_touches_few_chunks() -> None:
    data = bytearray(_data(4 << 20, seed=5))
    before = {r.id for r in chunk_buffer(data, SMALL)}
    data[2_000_000:2_000_100] = b"\0" * 100
    after = {r.id for r in chunk_buffer(data, SMALL)}
    assert len(before - after) <= 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_size": 10}, "min_size"),
        ({"min_size": 2 << 20, "avg_size": 1 << 20}, "min <= avg <= max"),
        ({"max_size": 2 << 30}, "max_size"),
        ({"name": "rabin"}, "unknown chunker"),
        ({"version": "1 2"}, "bad chunker version"),
    ],
)
def test_bad_params_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        ChunkerParams(**kwargs)


def test_params_of_another_kernel_version_refused() -> None:
    with pytest.raises(ChunkerUnavailable, match="installed"):
        chunk_buffer(b"abc", ChunkerParams(version="0.0.1"))


def test_chunk_file_refuses_non_regular_and_missing(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot open"):
        chunk_file(tmp_path / "nope", SMALL)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError, match="not a regular file"):
        chunk_file(fifo, SMALL)
    with pytest.raises(ManifestError, match="not a regular file"):
        chunk_file(tmp_path, SMALL)


def test_pure_python_fallback_is_refused_with_one_line(tmp_path: Path) -> None:
    """A fastcdc without its compiled kernel: a clear ChunkerUnavailable, no slow run, no stdout noise."""
    fake = tmp_path / "fastcdc"
    fake.mkdir()
    (fake / "__init__.py").write_text("print('imported the package __init__')\n__version__ = '1.7.0'\n")
    (fake / "fastcdc_py.py").write_text("def fastcdc_py(*a, **k):\n    raise SystemExit('slow path ran')\n")
    script = textwrap.dedent(
        """
        from manifests import chunk_buffer, ChunkerUnavailable
        try:
            chunk_buffer(b"x" * 100000)
        except ChunkerUnavailable as exc:
            print("REFUSED:", exc)
        """
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("REFUSED:"), out.stdout
    assert "compiled kernel" in lines[0]


@pytest.mark.parametrize("hashing", ["inline", "thread"])
def test_read_windows_cut_where_one_pass_does_and_hold_the_hashed_bytes(tmp_path: Path, hashing: str) -> None:
    """chunk_windows (the scan's path) reads the file into pooled windows of 4 * max_size:
    the cut points equal one pass over the whole buffer, each view holds exactly the bytes
    its chunks were hashed from, and every window goes back to the pool once released;
    likewise with the hashes computed on a thread while the next window is cut."""
    from concurrent.futures import ThreadPoolExecutor

    from manifests.window import WindowPool

    hasher = ThreadPoolExecutor(1) if hashing == "thread" else None

    data = _data(5 << 20, seed=7)
    path = tmp_path / "f"
    path.write_bytes(data)
    pool = WindowPool(window_bytes=4 * SMALL.max_size, budget_bytes=128 * SMALL.max_size)  # room for all
    refs: list[ChunkRef] = []
    held = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for win, view, got in chunking.chunk_windows(fd, len(data), SMALL, pool, str(path), hasher):
            assert got and view.nbytes >= sum(r.size for r in got)
            win.hold(len(got))
            for r in got:
                held.append((r, view[r.offset - got[0].offset:][:r.size], win))
            refs.extend(got)
    finally:
        os.close(fd)
        if hasher is not None:
            hasher.shutdown()
    assert refs == chunk_buffer(data, SMALL)
    assert pool.used_bytes > 0            # the views still hold their windows
    for r, v, win in held:
        assert blake3.blake3(v).hexdigest() == r.id
        v.release()
        win.release()
    assert pool.used_bytes == 0


def test_window_pool_reuses_small_windows_by_size_class_within_its_budget() -> None:
    """A small request is rounded up to a power-of-two class (at least MIN_CLASS), charged
    that, and a released window is handed out again for the same class (not allocated
    afresh); the free buffers count against the budget: a fresh window of another class
    drops them rather than let the pool's memory grow past it."""
    from manifests.window import MIN_CLASS, WindowPool

    pool = WindowPool(window_bytes=16 << 20, budget_bytes=8 << 20)
    assert pool.size_class(1) == MIN_CLASS
    assert pool.size_class((1 << 20) + 1) == 2 << 20
    assert pool.size_class(4 << 20) == 4 << 20
    assert pool.size_class((4 << 20) + 1) == 16 << 20   # over a quarter window: a whole one
    a = pool.acquire(700 << 10)
    assert a.size == 1 << 20 and len(a.buf) == 1 << 20 and pool.used_bytes == 1 << 20
    buf = a.buf
    a.release()
    assert pool.used_bytes == 0
    b = pool.acquire(1 << 20)
    assert b.buf is buf                      # the same buffer, reused
    b.release()
    big = [pool.acquire(4 << 20), pool.acquire(3 << 20)]   # 8 MiB in use: the 1 MiB free one is dropped
    assert sum(w.size for w in big) == 8 << 20
    assert pool._free_bytes == 0
    for w in big:
        w.release()
    assert pool.used_bytes == 0 and pool._free_bytes == 8 << 20
    c = pool.acquire(1 << 20)                # no 1 MiB buffer free: a fresh one, after dropping a 4 MiB one
    assert c.buf is not buf and pool.used_bytes + pool._free_bytes <= 8 << 20
    c.release()


def test_window_pool_blocks_until_released_and_close_frees_a_waiter() -> None:
    """acquire waits while the budget is spent (calling on_wait once), returns once a
    window is released, and raises WindowPoolClosed when the pool is closed meanwhile."""
    import threading

    from manifests.window import WindowPool, WindowPoolClosed

    told: list[int] = []
    pool = WindowPool(window_bytes=1 << 20, budget_bytes=2 << 20, on_wait=lambda: told.append(1), wait_s=0.01)
    a = pool.acquire(1 << 20)
    b = pool.acquire(1 << 20)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(1 << 20)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and told == [1]   # blocked, and said so once
    a.release()
    t.join(5)
    assert not t.is_alive() and len(got) == 1
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            pool.acquire(1 << 20)
        except WindowPoolClosed as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    t.join(0.1)
    pool.close()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1
    b.release()
    with pytest.raises(ValueError):
        pool.acquire(2 << 20)


def test_cut_worker_cuts_where_one_pass_does(tmp_path: Path) -> None:
    """Cuts from the worker process (its read steps of 5 * max_size, the scan's windows of
    4 * max_size: the two never line up) give exactly the in-process chunks, file after
    file, an empty file included; the hashes are the scan's own."""
    from manifests.cutworker import CutWorker
    from manifests.window import WindowPool

    datas = [_data(3 << 20, seed=11), b"", _data(1000, seed=12), _data(700_000, seed=13)]
    paths = []
    for i, d in enumerate(datas):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(d)
    pool = WindowPool(window_bytes=4 * SMALL.max_size, budget_bytes=64 * SMALL.max_size)
    worker = CutWorker(SMALL, step_bytes=5 * SMALL.max_size)
    try:
        for p in paths:
            worker.ask(str(p))
        for p, d in zip(paths, datas, strict=True):
            cuts = worker.batches(str(p))
            refs: list[ChunkRef] = []
            fd = os.open(p, os.O_RDONLY)
            try:
                for _win, _view, got in chunking.chunk_windows(fd, len(d), SMALL, pool, str(p), None, cuts):
                    refs.extend(got)
            finally:
                os.close(fd)
            cuts.finish()
            assert refs == (chunk_buffer(d, SMALL) if d else [])
            _check_cover(refs, d, SMALL)
    finally:
        worker.close()
    assert pool.used_bytes == 0


def test_cut_worker_errors_are_clear(tmp_path: Path) -> None:
    """A file the worker cannot open, or whose cuts do not fit the bytes the scan read (it
    changed between the two reads), fails with a ManifestError naming it."""
    from manifests.cutworker import CutWorker
    from manifests.window import WindowPool

    pool = WindowPool(window_bytes=4 * SMALL.max_size, budget_bytes=64 * SMALL.max_size)
    worker = CutWorker(SMALL)
    try:
        worker.ask(str(tmp_path / "missing"))
        with pytest.raises(ManifestError, match="cannot chunk .*missing.*No such file"):
            worker.batches(str(tmp_path / "missing")).next()
    finally:
        worker.close()
    short, long = tmp_path / "short", tmp_path / "long"
    short.write_bytes(_data(300_000, seed=3))
    long.write_bytes(_data(600_000, seed=3))
    for cut, read, size in ((short, long, 600_000), (long, short, 300_000)):
        worker = CutWorker(SMALL)
        try:
            worker.ask(str(cut))      # the worker cuts one size; the scan reads the other
            cuts = worker.batches(str(read))
            fd = os.open(read, os.O_RDONLY)
            try:
                with pytest.raises(ManifestError, match=f"{read.name}.*changed while it was being chunked"):
                    for _ in chunking.chunk_windows(fd, size, SMALL, pool, str(read), None, cuts):
                        pass
            finally:
                os.close(fd)
        finally:
            worker.kill()
    assert pool.used_bytes == 0
