"""scan_tree: a directory on disk -> its Manifest plus where each unique chunk's bytes live.

This is the ingest path ``herd artifact publish`` runs. It walks the tree once (``os.scandir``,
sorted, no symlink following), chunks each regular file with :mod:`manifests.chunking`, and builds
the canonical manifest. Symlinks are kept as symlinks (targets must stay inside the tree; absolute
targets are refused). Special files (fifos, sockets, devices) and names that are not valid UTF-8
are refused with a clear error, since a manifest could not reproduce them faithfully.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .chunking import ChunkRef, check_chunker, chunk_open_file
from .errors import ManifestError
from .model import MAX_ENTRIES, ChunkerParams, Manifest, ManifestBuilder, normalise_file_mode


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Where the bytes of one chunk can be read back: ``size`` bytes at ``offset`` of ``path``."""

    path: Path
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    manifest: Manifest
    sources: dict[str, ChunkSource]


_SPECIAL = (
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _kind_name(mode: int) -> str:
    for test, name in _SPECIAL:
        if test(mode):
            return name
    return "special file"


def scan_tree(root: Path, params: ChunkerParams | None = None, *,
              on_chunks: Callable[[list[tuple[str, ChunkSource]]], None] | None = None) -> ScanResult:
    """Chunk and describe every entry under ``root`` (which is not itself listed).

    ``on_chunks``: called (in the scanning thread) after each file with the chunks first
    seen in it, so a caller can start on them (publish uploads them) while the scan goes
    on. The manifest itself exists only once the whole tree was scanned and validated.

    Raises ManifestError (ChunkerUnavailable if the kernel is missing) naming the offending path;
    nothing is returned for a tree that cannot be represented exactly.
    """
    params = params if params is not None else ChunkerParams()
    check_chunker(params)
    root = Path(root)
    try:
        st = os.stat(root)
    except OSError as exc:
        raise ManifestError(f"cannot scan {str(root)!r}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ManifestError(f"cannot scan {str(root)!r}: not a directory")

    sources: dict[str, ChunkSource] = {}
    # A depth-first walk does not yield str order ("a-b" < "a/x" but "a" is visited first), so
    # collect everything; the builder sorts and lays out the chunk table in first-use order.
    files: list[tuple[str, int, list[tuple[str, int]]]] = []
    others: list[tuple[str, str, str]] = []  # (path, kind, target)
    stack: list[tuple[str, str]] = [(os.fspath(root), "")]
    count = 0
    while stack:
        dir_os, dir_rel = stack.pop()
        try:
            with os.scandir(dir_os) as it:
                children = list(it)
        except OSError as exc:
            raise ManifestError(f"cannot list {dir_os!r}: {exc.strerror}") from None
        for de in children:
            name = de.name
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                raise ManifestError(
                    f"{os.path.join(dir_os, name)!r}: file name is not valid UTF-8"
                ) from None
            rel = f"{dir_rel}/{name}" if dir_rel else name
            count += 1
            if count > MAX_ENTRIES:
                raise ManifestError(f"{str(root)!r} holds more than {MAX_ENTRIES} entries")
            try:
                st = de.stat(follow_symlinks=False)
            except OSError as exc:
                raise ManifestError(f"cannot stat {de.path!r}: {exc.strerror}") from None
            mode = st.st_mode
            if stat.S_ISREG(mode):
                refs = _chunk_path(de.path, st, params)
                files.append((rel, normalise_file_mode(mode), [(r.id, r.size) for r in refs]))
                fresh: list[tuple[str, ChunkSource]] = []
                for r in refs:
                    if r.id not in sources:
                        src = sources[r.id] = ChunkSource(Path(de.path), r.offset, r.size)
                        fresh.append((r.id, src))
                if on_chunks is not None and fresh:
                    on_chunks(fresh)
            elif stat.S_ISDIR(mode):
                others.append((rel, "dir", ""))
                stack.append((de.path, rel))
            elif stat.S_ISLNK(mode):
                try:
                    target = os.readlink(de.path)
                except OSError as exc:
                    raise ManifestError(f"cannot read symlink {de.path!r}: {exc.strerror}") from None
                if os.path.isabs(target):
                    raise ManifestError(
                        f"{de.path!r}: absolute symlink target {target!r} (only relative targets inside the tree are kept)"
                    )
                others.append((rel, "symlink", target))
            else:
                raise ManifestError(f"{de.path!r}: {_kind_name(mode)} not supported in an artifact")

    builder = ManifestBuilder(params)
    for path, mode, chunks in files:
        builder.add_file(path, mode, chunks)
    for path, kind, target in others:
        if kind == "dir":
            builder.add_dir(path)
        else:
            builder.add_symlink(path, target)
    # validate: e.g. a symlink escaping the tree is refused here, naming the entry
    manifest = builder.build(validate=True)
    return ScanResult(manifest, sources)


def _chunk_path(path: str, st: os.stat_result, params: ChunkerParams) -> list[ChunkRef]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ManifestError(f"cannot open {path!r}: {exc.strerror}") from None
    try:
        return chunk_open_file(fd, path, params, scanned_ino=st.st_ino)
    finally:
        os.close(fd)
