"""Reading a workload's size-capped, rotated logs (written by :mod:`agent.shim`).

Every open is relative to the workload's directory, opened itself with ``O_NOFOLLOW``,
and opens the log with ``O_NOFOLLOW`` too: a symlink put where a log belongs (by anyone
who could write there) is refused, never followed to ``/etc/shadow``. Reads go
backwards from the end in blocks, so a tail costs what it returns, whatever the file's
size; callers run it in a worker thread (it is blocking file I/O).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import trio

from .errors import AgentError

_BLOCK = 64 << 10


def read_tail(wdir: Path, stream: str, tail: int, keep: int) -> str:
    """The last ``tail`` lines of ``stream`` (stdout|stderr) across ``<stream>.log`` and its
    ``keep`` rotations (newest first)."""
    if tail <= 0:
        return ""
    names = [f"{stream}.log" if i == 0 else f"{stream}.log.{i}" for i in range(keep + 1)]
    try:
        dfd = os.open(wdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as e:
        raise AgentError(f"cannot open the workload's dir: {e.strerror}") from None
    try:
        data, complete = _tail_bytes(dfd, names, tail)
    finally:
        os.close(dfd)
    lines = data.splitlines(keepends=True)
    if not complete and lines:
        lines = lines[1:]  # the first line may be cut
    return b"".join(lines[-tail:]).decode(errors="replace")


def _open_log(dfd: int, name: str) -> int | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AgentError(f"{name} is a symlink: refused") from None
        raise AgentError(f"cannot open {name}: {e.strerror}") from None
    if not _is_regular(fd):
        os.close(fd)
        raise AgentError(f"{name} is not a regular file: refused")
    return fd


def _is_regular(fd: int) -> bool:
    import stat
    return stat.S_ISREG(os.fstat(fd).st_mode)


def _tail_bytes(dfd: int, names: list[str], n: int, block: int = _BLOCK) -> tuple[bytes, bool]:
    """Enough bytes from the end of the stream (files newest first; rotation may cut a
    line in two files) to hold its last ``n`` lines; True when it is the whole stream.
    Each block is read once and its newlines counted once (linear in what is read)."""
    parts: list[bytes] = []
    newlines = 0
    for name in names:
        fd = _open_log(dfd, name)
        if fd is None:
            continue
        try:
            pos = os.lseek(fd, 0, os.SEEK_END)
            while pos > 0:
                if newlines > n:
                    return b"".join(reversed(parts)), False
                step = min(block, pos)
                pos -= step
                chunk = os.pread(fd, step, pos)
                parts.append(chunk)
                newlines += chunk.count(b"\n")
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
    return b"".join(reversed(parts)), True


async def follow(wdir: Path, stream: str, tail: int, keep: int, done: Callable[[], bool], *,
                 poll_s: float = 0.2, block: int = _BLOCK) -> AsyncGenerator[bytes, None]:
    """The last ``tail`` lines of ``stream``, then what is appended, piece by piece (each
    at most ``block`` bytes: memory stays bounded whatever the workload writes), until
    ``done()`` says the workload ended and everything it wrote was sent. A rotation is
    followed (the old file is read to its end, then the new one from its start). The file
    size is taken before the tail is read, so a line written meanwhile may come twice but
    is never lost. Blocking file I/O runs in worker threads."""
    name = f"{stream}.log"
    fd: int | None = None
    dfd: int | None = None
    try:
        try:
            dfd = os.open(wdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            dfd = None
        except OSError as e:
            raise AgentError(f"cannot open the workload's dir: {e.strerror}") from None
        offset = 0
        if dfd is not None:
            fd = _open_log(dfd, name)
            if fd is not None:
                offset = os.fstat(fd).st_size
        text = await trio.to_thread.run_sync(read_tail, wdir, stream, tail, keep)
        if text:
            yield text.encode()
        while True:
            if dfd is None:
                with contextlib.suppress(OSError):
                    dfd = os.open(wdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if fd is None and dfd is not None:
                fd, offset = _open_log(dfd, name), 0
            ended = done()  # asked before reading: what it wrote before ending is read below
            data = b""
            if fd is not None:
                data = await trio.to_thread.run_sync(os.pread, fd, block, offset)
            if data:
                offset += len(data)
                yield data
                continue
            if fd is not None and dfd is not None and _rotated(dfd, name, fd):
                # the old file may have grown between the read above and the check: read it
                # to its end once more (nothing is written to it after the rotation) first
                data = await trio.to_thread.run_sync(os.pread, fd, block, offset)
                if data:
                    offset += len(data)
                    yield data
                    continue
                os.close(fd)
                fd, offset = _open_log(dfd, name), 0
                continue
            if ended:
                return
            await trio.sleep(poll_s)
    finally:
        for f in (fd, dfd):
            if f is not None:
                with contextlib.suppress(OSError):
                    os.close(f)


def _rotated(dfd: int, name: str, fd: int) -> bool:
    """Is ``name`` now another file than the one ``fd`` reads (the shim rotated it)?"""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_ino != os.fstat(fd).st_ino
