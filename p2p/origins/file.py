"""``file:///dir`` origin: the bucket layout in a local (or NFS) directory.

Writes are atomic (temp file in the same directory + rename). Chunk files are
fsynced in a batch (``_flush``, concurrently) before a manifest or ref is written that
refers to them, and every ``SYNC_EVERY_BYTES`` while uploading (so the disk works while
publish does); manifests and refs are fsynced with their directory at once.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import trio

from infra.durable import atomic_write, is_temp_name

from ..errors import NotFoundError, OriginError, OriginUnavailable
from ..store import fsync_paths
from .base import HEX64, ObjectInfo, Origin

# errors of a file origin (often a network mount) that asking again may cure
_TRANSIENT = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EMFILE, errno.ENFILE, errno.EAGAIN,
                        errno.EINTR, errno.EBUSY, errno.ENOTCONN, errno.EHOSTDOWN, errno.EHOSTUNREACH})


def _is_temp(name: str) -> bool:
    """A write's temp file or a deletion's aside (``.tmp-`` is the temp mark of earlier writers)."""
    return is_temp_name(name) or (name.startswith(".") and (".tmp-" in name or ".gc-" in name))


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_mtime_ns}"


def _fsync_path(path: str | os.PathLike[str], directory: bool = False) -> None:
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileOrigin(Origin):
    SYNC_EVERY_BYTES = 64 << 20   # chunk bytes written between batched fsyncs

    def __init__(self, root: str | os.PathLike[str], url: str | None = None) -> None:
        self.root = Path(root)
        super().__init__(url or f"file://{self.root}")
        self._pending: list[Path] = []
        self._pending_bytes = 0

    def _path(self, key: str) -> Path:
        return self.root / key

    def _oserror(self, e: OSError, key: str, action: str) -> OriginError:
        """Mapped by whether asking again may help: a directory that is not there (yet: a
        network mount), an I/O error, a stale handle or no file descriptor left is
        ``OriginUnavailable``; a refusal (permissions, a full disk) is an answer."""
        if not self.root.is_dir():
            return OriginUnavailable(f"origin {self.url} is unreachable: directory {self.root} does not exist")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OriginError(f"origin {self.url} is full while writing {key}")
        cls = OriginUnavailable if e.errno in _TRANSIENT else OriginError
        return cls(f"origin {self.url}: cannot {action} {key}: {e.strerror or e}")

    async def _get(self, key: str, limit: int) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
            if len(data) > limit:
                raise OriginError(f"origin {self.url}: {key} holds more than the {limit} bytes expected")
            return data
        try:
            return await trio.to_thread.run_sync(read)
        except FileNotFoundError as e:
            if self.root.is_dir():
                raise NotFoundError(f"{key} not found at origin {self.url}") from None
            raise self._oserror(e, key, "read") from None
        except IsADirectoryError:
            raise NotFoundError(f"{key} not found at origin {self.url}") from None
        except OSError as e:
            raise self._oserror(e, key, "read") from None

    def _write(self, key: str, data: bytes | memoryview, durable: bool) -> Path:
        """:func:`infra.durable.atomic_write` (0644; the fsyncs only when ``durable``): the
        bytes straight from the caller's buffer, the folder made when the first write finds
        it missing (one mkdir per folder, not per chunk)."""
        path = self._path(key)
        atomic_write(path, data, 0o644, sync=durable)
        return path

    async def _put(self, key: str, data: bytes | memoryview) -> None:
        durable = not key.startswith("chunks/")
        try:
            path = await trio.to_thread.run_sync(self._write, key, data, durable)
        except OSError as e:
            raise self._oserror(e, key, "write") from None
        if not durable:
            self._pending.append(path)
            self._pending_bytes += len(data)
            if self._pending_bytes >= self.SYNC_EVERY_BYTES:
                # fsync in batches while uploading (this uploader waits, the others go
                # on), so the disk works meanwhile and little is left for _flush
                batch, self._pending, self._pending_bytes = self._pending, [], 0
                try:
                    await trio.to_thread.run_sync(fsync_paths, [str(p) for p in batch])
                except OSError as e:
                    self._pending = batch + self._pending
                    raise self._oserror(e, "chunks", "sync") from None

    async def _flush(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0

        def sync() -> None:
            # concurrent fsyncs: the filesystem folds them into few journal commits
            fsync_paths([str(p) for p in pending])
            if pending:
                _fsync_path(self.root / "chunks", directory=True)

        try:
            await trio.to_thread.run_sync(sync)
        except OSError as e:
            self._pending = pending + self._pending
            raise self._oserror(e, "chunks", "sync") from None

    async def _exists_many(self, prefix: str, names: set[str]) -> set[str]:
        d = self._path(prefix)

        def scan() -> set[str]:
            if len(names) <= 64:
                return {n for n in names if (d / n).is_file()}
            try:
                return {e.name for e in os.scandir(d) if HEX64.match(e.name)} & names
            except FileNotFoundError:
                return set()

        if not self.root.is_dir():
            # Publishing into a directory that does not exist yet is fine: nothing is there.
            return set()
        try:
            return await trio.to_thread.run_sync(scan)
        except OSError as e:
            raise self._oserror(e, prefix, "list") from None

    # ------------------------------------------------------------ gc primitives

    async def _list_info(self, prefix: str) -> list[ObjectInfo]:
        """A folder's objects (``prefix`` ending in '/'), or, like a bucket listing, every
        object whose key starts with ``prefix`` (``refs/trainer``: the files and folders
        of ``refs/`` whose names start with ``trainer``)."""
        base = self._path(prefix.rstrip("/"))

        def info(full: str, out: list[ObjectInfo]) -> None:
            try:
                st = os.stat(full, follow_symlinks=False)
            except FileNotFoundError:  # removed while we listed
                return
            key = os.path.relpath(full, self.root).replace(os.sep, "/")
            out.append(ObjectInfo(key=key, size=st.st_size, updated=st.st_mtime, version=_version(st)))

        def walk_dir(d: str, out: list[ObjectInfo]) -> None:
            for dirpath, _dirs, files in os.walk(d):
                for name in files:
                    if not _is_temp(name):
                        info(os.path.join(dirpath, name), out)

        def walk() -> list[ObjectInfo]:
            out: list[ObjectInfo] = []
            if prefix.endswith("/"):
                walk_dir(str(base), out)
                return out
            try:
                entries = list(os.scandir(base.parent))
            except FileNotFoundError:
                return out
            for e in entries:
                if not e.name.startswith(base.name) or _is_temp(e.name):
                    continue
                if e.is_dir(follow_symlinks=False):
                    walk_dir(e.path, out)
                else:
                    info(e.path, out)
            return out

        try:
            return await trio.to_thread.run_sync(walk)
        except OSError as e:
            raise self._oserror(e, prefix, "list") from None

    def _move_sync(self, src: str, dst: str) -> bool:
        s, d = self._path(src), self._path(dst)
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(s, d)  # no clobber: an object already at dst is kept
        except FileNotFoundError:
            return False
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                raise
            if d.exists():  # no hard links here: rename, unless dst already holds one
                pass
            else:
                try:
                    os.rename(s, d)
                except FileNotFoundError:
                    return False
                _fsync_path(d.parent, directory=True)
                return True
        try:
            os.unlink(s)
        except FileNotFoundError:
            return False
        _fsync_path(d.parent, directory=True)
        _fsync_path(s.parent, directory=True)
        return True

    async def _move(self, src: str, dst: str) -> bool:
        try:
            return await trio.to_thread.run_sync(self._move_sync, src, dst)
        except OSError as e:
            raise self._oserror(e, src, "move") from None

    def _delete_sync(self, info: ObjectInfo) -> bool:
        # Rename aside (atomic), then look at what was renamed: a writer that replaced the
        # object after it was listed gets its version put back (no clobber of a newer one).
        path = self._path(info.key)
        aside = path.parent / f".{path.name[:64]}.gc-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return False
        try:
            same = _version(os.stat(aside)) == info.version
            if not same:
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
        finally:
            aside.unlink(missing_ok=True)
            _fsync_path(path.parent, directory=True)
        if same and info.key.startswith("trash/"):
            self._prune_empty(path.parent)
        return same

    def _prune_empty(self, d: Path) -> None:
        """Remove the empty folders a gc run's trash leaves (up to, not including, trash/)."""
        stop = self.root / "trash"
        while d != stop and stop in d.parents:
            try:
                d.rmdir()
            except OSError:
                return
            d = d.parent

    async def _delete_if_unchanged(self, info: ObjectInfo) -> bool:
        try:
            return await trio.to_thread.run_sync(self._delete_sync, info)
        except OSError as e:
            raise self._oserror(e, info.key, "delete") from None
