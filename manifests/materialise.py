"""Materialise a manifest into a read-only directory tree, atomically.

The tree is built in a temp dir next to ``dest`` (``.<name>.partial-<pid>-<rand>``) and renamed into
place only when complete, so a reader sees either nothing or the whole tree; on any error the temp
dir is removed and the error re-raised. Files whose (chunk list, mode) equal a file of an already
materialised tree (``link_from``) are hard-linked from it; otherwise they are assembled from the
chunk files with ``os.copy_file_range`` (in-kernel copy, a reflink on filesystems that can), falling
back to ``os.sendfile`` and then to read/write where the kernel refuses.

Chunks were verified when they entered the store, so content is not re-hashed here; chunk file
sizes are checked. The result is read-only: write bits cleared on files and directories, exec bits
of the manifest kept. Errors: ChunkMissing (a chunk is not in the store), IntegrityError (a chunk
file has the wrong size), ManifestError (invalid manifest, dest is not a directory); OSError from the
filesystem (e.g. ENOSPC) propagates unchanged, after cleanup, so callers can tell a full disk.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import ChunkMissing, IntegrityError, ManifestError
from .model import Entry, Manifest
from .plan import file_key, link_index
from .validate import validate_manifest

log = logging.getLogger("herd.manifests.materialise")

PARTIAL_MARK = ".partial-"

_COPY_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.EBADF}


@dataclass
class MaterialiseStats:
    """Filled in by :func:`materialise` when passed: how each file was produced."""

    files_linked: int = 0
    bytes_linked: int = 0
    files_copied: int = 0
    bytes_copied: int = 0
    reused: bool = False


def is_partial(name: str) -> bool:
    """True for the name of a temp dir :func:`materialise` leaves behind if the process dies."""
    return name.startswith(".") and PARTIAL_MARK in name


def remove_partials(parent: Path) -> int:
    """Remove leftover temp dirs of interrupted materialisations under ``parent``; returns how many."""
    removed = 0
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return 0
    for name in names:
        if is_partial(name):
            force_rmtree(Path(parent) / name)
            removed += 1
    return removed


def force_rmtree(path: Path) -> None:
    """Remove a (possibly read-only) tree; missing is fine."""
    try:
        os.chmod(path, 0o700, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError:
        pass
    for dirpath, _dirnames, _files in os.walk(path):
        try:
            os.chmod(dirpath, 0o700)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def materialise(
    manifest: Manifest,
    *,
    chunk_path: Callable[[str], Path],
    dest: Path,
    link_from: Mapping[str, tuple[Path, Manifest]] = {},  # noqa: B006 - read-only default
    sync: bool = False,
    stats: MaterialiseStats | None = None,
) -> Path:
    """Build ``dest`` holding exactly ``manifest``'s tree; return ``dest``.

    ``chunk_path(id)`` names the file holding a chunk; ``link_from`` maps manifest ids to
    ``(root, manifest)`` of trees already materialised. With ``sync`` every file and directory is
    fsynced before the rename. If ``dest`` already exists it is returned as is (trees are named by
    manifest id and only ever appear complete).
    """
    dest = Path(dest)
    stats = stats if stats is not None else MaterialiseStats()
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestError(f"{str(dest)!r} exists and is not a directory")
        stats.reused = True
        return dest
    validate_manifest(manifest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}{PARTIAL_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(tmp, 0o700)
    try:
        _build(manifest, tmp, chunk_path, link_from, sync, stats)
        try:
            os.rename(tmp, dest)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and dest.is_dir():
                log.info("materialise race dest=%s: another writer finished first", dest)
                force_rmtree(tmp)
                stats.reused = True
                return dest
            raise
    except BaseException:
        force_rmtree(tmp)
        raise
    if sync:
        _fsync_dir(dest.parent)
    log.debug(
        "materialised manifest=%s dest=%s linked=%d copied=%d",
        manifest.id, dest, stats.files_linked, stats.files_copied,
    )
    return dest


def _build(
    m: Manifest,
    tmp: Path,
    chunk_path: Callable[[str], Path],
    link_from: Mapping[str, tuple[Path, Manifest]],
    sync: bool,
    stats: MaterialiseStats,
) -> None:
    index = link_index({mid: mf for mid, (_, mf) in link_from.items()}) if link_from else {}
    base = os.fspath(tmp)
    dirs: list[str] = []
    copier = _Copier()
    for e in m.entries:
        dst = f"{base}/{e.path}"
        if e.kind == "dir":
            os.mkdir(dst, 0o700)
            dirs.append(dst)
        elif e.kind == "symlink":
            os.symlink(e.target, dst)
        else:
            src = index.get(file_key(m, e)) if (index and e.chunks) else None
            if src is not None:
                root = link_from[src[0]][0]
                if _link(os.path.join(root, src[1]), dst, e, copier, sync):
                    stats.files_linked += 1
                    stats.bytes_linked += e.size
                    continue
            _assemble(m, e, dst, chunk_path, copier, sync)
            stats.files_copied += 1
            stats.bytes_copied += e.size
    # Seal bottom-up: children before parents, the root last.
    for d in reversed(dirs):
        if sync:
            _fsync_dir(d)
        os.chmod(d, 0o555)
    if sync:
        _fsync_dir(base)
    os.chmod(base, 0o555)


def _link(src: str, dst: str, e: Entry, copier: _Copier, sync: bool) -> bool:
    """Hard-link ``src`` to ``dst`` if it is the file we expect; else copy it whole. False: neither."""
    want_mode = e.mode & ~0o222
    try:
        st = os.lstat(src)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != e.size:
        return False
    # Only a file of ours, read-only as we sealed it, is shared by a hard link: a tree that
    # anyone else could write is never linked into another one.
    if stat.S_IMODE(st.st_mode) == want_mode and st.st_uid == os.geteuid():
        try:
            os.link(src, dst, follow_symlinks=False)
            return True
        except OSError as exc:
            log.debug("hard link failed src=%s err=%s: copying", src, exc.strerror)
    # Same filesystem refused the link (EXDEV, EMLINK, EPERM) or the mode differs: copy the file.
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            copier.copy(sfd, dfd, 0, e.size, e.path)
            os.fchmod(dfd, want_mode)
            if sync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    return True


def _assemble(
    m: Manifest, e: Entry, dst: str, chunk_path: Callable[[str], Path], copier: _Copier, sync: bool
) -> None:
    table = m.chunks
    dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        for i in e.chunks:
            c = table[i]
            try:
                sfd = os.open(chunk_path(c.id), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise ChunkMissing(c.id, e.path) from None
            try:
                size = os.fstat(sfd).st_size
                if size != c.size:
                    raise IntegrityError(f"chunk {c.id} is {size} bytes in the store, the manifest says {c.size}")
                copier.copy(sfd, dfd, 0, c.size, e.path)
            finally:
                os.close(sfd)
        os.fchmod(dfd, e.mode & ~0o222)
        if sync:
            os.fsync(dfd)
    finally:
        os.close(dfd)


class _Copier:
    """Appends ``count`` bytes from ``sfd`` at ``offset`` to ``dfd``'s current position.

    copy_file_range first; the first refusal switches this materialisation to sendfile, then to
    plain read/write.
    """

    def __init__(self) -> None:
        self.method = 0  # 0 copy_file_range, 1 sendfile, 2 read/write

    def copy(self, sfd: int, dfd: int, offset: int, count: int, path: str) -> None:
        end = offset + count
        while offset < end:
            try:
                if self.method == 0:
                    n = os.copy_file_range(sfd, dfd, end - offset, offset)
                elif self.method == 1:
                    n = os.sendfile(dfd, sfd, offset, end - offset)
                else:
                    buf = os.pread(sfd, min(end - offset, 1 << 20), offset)
                    n = os.write(dfd, buf) if buf else 0
                    if buf and n != len(buf):  # short write: write the rest
                        n += _write_all(dfd, memoryview(buf)[n:])
            except OSError as exc:
                if self.method < 2 and exc.errno in _COPY_FALLBACK_ERRNOS:
                    self.method += 1
                    continue
                raise
            if n == 0:
                raise IntegrityError(f"chunk file for {path!r} ended {end - offset} bytes early")
            offset += n


def _write_all(fd: int, view: memoryview) -> int:
    total = 0
    while total < len(view):
        total += os.write(fd, view[total:])
    return total


def _fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
