"""agent.logs.follow: the tail, then what is appended, across a rotation, until the
workload is done and everything it wrote was sent (real files, short polls)."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from agent.logs import follow
from testing.waiting import poll


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


async def test_follow_tail_appends_rotation_and_end(tmp_path: Path):
    wdir = tmp_path / "w"
    wdir.mkdir()
    log = wdir / "stdout.log"
    log.write_bytes(b"old 1\nold 2\nold 3\n")
    done = False
    got: list[bytes] = []

    async def reader() -> None:
        async for piece in follow(wdir, "stdout", 2, 1, lambda: done, poll_s=0.01, block=4):
            assert len(piece) <= 4 or piece.startswith(b"old")  # appended bytes come in bounded pieces
            got.append(piece)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await poll(lambda: b"".join(got) == b"old 2\nold 3\n", 0.01)
            _append(log, b"new 1\n")
            await poll(lambda: b"".join(got).endswith(b"new 1\n"), 0.01)
            # the shim rotates: stdout.log -> stdout.log.1, a fresh stdout.log
            _append(log, b"last of the old file\n")
            os.replace(log, wdir / "stdout.log.1")
            log.write_bytes(b"first of the new file\n")
            done = True  # the workload ended: the reader sends what is left, then stops
    assert b"".join(got) == (b"old 2\nold 3\nnew 1\nlast of the old file\nfirst of the new file\n")


async def test_follow_reads_what_the_old_file_got_after_its_last_read(tmp_path: Path, monkeypatch):
    """A line written to the old file between the reader's last (empty) read and its check
    for a rotation is still sent, before the new file's lines (a race seen on a slow CI VM;
    here the hook makes it happen every time)."""
    import agent.logs as logs

    wdir = tmp_path / "w"
    wdir.mkdir()
    log = wdir / "stdout.log"
    log.write_bytes(b"a\n")
    real = logs._rotated
    late = {"written": False}

    def rotated_after_a_late_write(dfd: int, name: str, fd: int) -> bool:
        if real(dfd, name, fd) and not late["written"]:
            late["written"] = True
            _append(wdir / "stdout.log.1", b"late line\n")  # lands after the empty read
        return real(dfd, name, fd)

    monkeypatch.setattr(logs, "_rotated", rotated_after_a_late_write)
    done = False
    got: list[bytes] = []

    async def reader() -> None:
        async for piece in follow(wdir, "stdout", 5, 1, lambda: done, poll_s=0.01):
            got.append(piece)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await poll(lambda: b"".join(got) == b"a\n", 0.01)
            os.replace(log, wdir / "stdout.log.1")
            log.write_bytes(b"new\n")
            await poll(lambda: b"".join(got).endswith(b"new\n"), 0.01)
            done = True
    assert late["written"]
    assert b"".join(got) == b"a\nlate line\nnew\n"


async def test_follow_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path):
    wdir = tmp_path / "w"
    done = False
    got: list[bytes] = []
    following = trio.Event()   # the reader asked whether the workload ended: it follows now

    def ended() -> bool:
        following.set()
        return done

    async def reader() -> None:
        async for piece in follow(wdir, "stderr", 10, 1, ended, poll_s=0.01):
            got.append(piece)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(reader)
            await following.wait()   # past the (empty) tail, waiting for a log not there yet
            wdir.mkdir()
            (wdir / "stderr.log").write_bytes(b"hello\n")
            await poll(lambda: b"".join(got) == b"hello\n", 0.01)
            done = True
    assert b"".join(got) == b"hello\n"
