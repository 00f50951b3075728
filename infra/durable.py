"""Writing a small file so that a crash leaves it old or new, never torn: the one helper.

Every whole-file rewrite of ours goes through :func:`atomic_write`: the agent's state,
its part records, endpoints and peers files, the placer journal's compaction, the chunk
store's manifests and completion marks. (Two exceptions, on purpose: the workload shim,
a standalone script started with ``python -I -S`` that imports nothing of ours, keeps a
few lines of its own; appends to the journal and chunk files are not rewrites.)

It lives here because this is the package the agent, the placer and the p2p store may all
import; it depends on nothing but the standard library.

The steps, and why each: a unique temp name in the same directory (or ``tmp_dir``, on the
same filesystem) opened ``O_EXCL | O_NOFOLLOW`` (no collision with another writer, no
symlink followed); the mode set with ``fchmod`` (whatever the umask); writes looped until
every byte is down (``os.write`` may write less than asked); ``fsync`` of the file before
the rename (else the rename can land before the bytes and a crash shows an empty file);
``os.replace`` (atomic over an existing file); ``fsync`` of the directory (else the rename
itself can be lost). On any failure the temp file is removed and the ``OSError`` goes to
the caller, which maps it to its own error (e.g. the store's ``StoreFullError``).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

# the temp names :func:`atomic_write` (and the chunk store's hot path) make: ``.<name>.p<pid>.<12 hex>``
_TEMP = re.compile(r"\..*\.p[0-9]+\.[0-9a-f]{12}")


def temp_name(name: str, tag: str | None = None) -> str:
    """The temp file name for an atomic write of ``name``: hidden, unique (the pid and
    ``tag``, by default 48 random bits), recognised by :func:`is_temp_name`."""
    return f".{name[:48]}.p{os.getpid()}.{tag if tag is not None else secrets.token_hex(6)}"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is an atomic write's temp file (one a crash may leave behind: a
    sweeper removes it, a listing skips it)."""
    return _TEMP.fullmatch(name) is not None


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (looping over short writes)."""
    with memoryview(data) as view:
        while view:
            n = os.write(fd, view)
            view = view[n:]


def write_all_at(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write every byte of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    with memoryview(data) as view:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory: makes the entries created, renamed or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes | bytearray | memoryview, mode: int = 0o600, *,
                 tmp_dir: str | os.PathLike[str] | None = None, sync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one.

    ``mode``: the new file's permission bits (not subject to the umask). ``tmp_dir``: where
    the temp file is made (the same filesystem as ``path``; default its directory, created
    if missing). ``sync=False`` skips both fsyncs: still never torn for readers, but a
    crash may keep the old file (for files rewritten on every start anyway).
    """
    path = Path(path)
    where = Path(tmp_dir) if tmp_dir is not None else path.parent
    tmp = where / temp_name(path.name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        if tmp_dir is not None:
            raise
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    fill_and_replace(fd, tmp, path, data, mode, sync=sync)
    if sync:
        fsync_dir(path.parent)


def fill_and_replace(fd: int, tmp: str | os.PathLike[str], path: str | os.PathLike[str],
                     data: bytes | bytearray | memoryview, mode: int, *, sync: bool) -> None:
    """The steps of :func:`atomic_write` after its temp file ``tmp`` was opened as ``fd``
    (which this closes): mode, every byte, the file's fsync if ``sync``, the rename over
    ``path``; on any failure the temp file is removed and the error raised. For a caller
    that names its temp files itself (the chunk store's hot path); the directory's fsync
    is the caller's."""
    try:
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["atomic_write", "fill_and_replace", "fsync_dir", "is_temp_name", "temp_name", "write_all"]
