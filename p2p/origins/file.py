"""``file:///dir`` origin: the bucket layout in a local (or NFS) directory.

Writes are atomic (temp file in the same directory + rename). Chunk files are
fsynced in a batch (``_flush``) before a manifest or ref is written that refers
to them; manifests and refs are fsynced with their directory at once.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import trio

from ..errors import NotFoundError, OriginError
from .base import HEX64, Origin


def _fsync_path(path: str | os.PathLike[str], directory: bool = False) -> None:
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileOrigin(Origin):
    def __init__(self, root: str | os.PathLike[str], url: str | None = None) -> None:
        self.root = Path(root)
        super().__init__(url or f"file://{self.root}")
        self._pending: list[Path] = []

    def _path(self, key: str) -> Path:
        return self.root / key

    def _oserror(self, e: OSError, key: str, action: str) -> OriginError:
        if not self.root.is_dir():
            return OriginError(f"origin {self.url} is unreachable: directory {self.root} does not exist")
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OriginError(f"origin {self.url} is full while writing {key}")
        return OriginError(f"origin {self.url}: cannot {action} {key}: {e.strerror or e}")

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

    def _write(self, key: str, data: bytes, durable: bool) -> Path:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name[:64]}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.rename(tmp, path)
            if durable:
                _fsync_path(path.parent, directory=True)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    async def _put(self, key: str, data: bytes) -> None:
        durable = not key.startswith("chunks/")
        try:
            path = await trio.to_thread.run_sync(self._write, key, data, durable)
        except OSError as e:
            raise self._oserror(e, key, "write") from None
        if not durable:
            self._pending.append(path)

    async def _flush(self) -> None:
        pending, self._pending = self._pending, []

        def sync() -> None:
            for p in pending:
                _fsync_path(p)
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
