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
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .chunking import ChunkRef, check_chunker, chunk_windows
from .cutworker import BatchIter, CutWorker
from .errors import ManifestError
from .model import MAX_ENTRIES, ChunkerParams, Manifest, ManifestBuilder, normalise_file_mode
from .window import WINDOW_BYTES, Window, WindowPool

CUT_WORKER_MIN_BYTES: int | None = 64 * 1024 * 1024
"""A scan of at least this many file bytes cuts them in a :class:`CutWorker` process
(None: never; 0: always, where there is more than one CPU)."""

_ASK_AHEAD = 8
"""Files asked of the cut worker ahead of the one being read (bounds both pipes)."""


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Where the bytes of one chunk can be read back: ``size`` bytes at ``offset`` of ``path``."""

    path: Path
    offset: int
    size: int


class ScannedChunk:
    """A chunk first seen by a scan, with the bytes the scan hashed (``data``, a view of
    a read window) until :meth:`release`, which whoever takes it must call exactly once
    (after it is uploaded, or found not needed): the window is then reused."""

    __slots__ = ("id", "source", "data", "_window")

    def __init__(self, cid: str, source: ChunkSource, data: memoryview, window: Window) -> None:
        self.id = cid
        self.source = source
        self.data: memoryview | None = data
        self._window: Window | None = window

    def release(self) -> None:
        if self._window is None:
            return
        if self.data is not None:
            self.data.release()
            self.data = None
        w, self._window = self._window, None
        w.release()


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
              on_chunks: Callable[[list[ScannedChunk]], None] | None = None,
              pool: WindowPool | None = None) -> ScanResult:
    """Chunk and describe every entry under ``root`` (which is not itself listed).

    ``on_chunks``: called (in the scanning thread) as each read window of a file is
    chunked, with the chunks first seen in it, each holding the bytes that were hashed
    until released (:class:`ScannedChunk`): a caller starts on them (publish uploads
    them) while the scan goes on, and releases each. ``pool``: the windows files are read
    into (default: a new :class:`WindowPool`); its budget bounds what the scan reads ahead
    of the caller's releases. The manifest itself exists only once the whole tree was
    scanned and validated; a file that changed while it was read fails the scan (after
    some of its chunks may have been handed on: each still matches its id).

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
    if pool is None:
        pool = WindowPool(window_bytes=max(4 * params.max_size, WINDOW_BYTES))
    # A depth-first walk does not yield str order ("a-b" < "a/x" but "a" is visited first), so
    # collect everything; the builder sorts and lays out the chunk table in first-use order.
    files: list[tuple[str, int, list[tuple[str, int]]]] = []
    others: list[tuple[str, str, str]] = []  # (path, kind, target)
    stack: list[tuple[str, str]] = [(os.fspath(root), "")]
    count = 0
    regs: list[tuple[str, os.stat_result]] = []   # regular files, in walk order (files[i] is regs[i])
    worker: CutWorker | None = None
    # the cut holds the GIL: over enough bytes, cut in a helper process (off this
    # process's GIL) while this thread reads, hashes and hands chunks on
    use_worker = CUT_WORKER_MIN_BYTES is not None and (os.cpu_count() or 1) > 1
    total = asked = 0
    # hashes one window's chunks while this thread reads and cuts the next
    hasher = ThreadPoolExecutor(1, thread_name_prefix="herd-scan-hash")
    try:
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
                    regs.append((de.path, st))
                    total += st.st_size
                    if worker is None and use_worker and total >= CUT_WORKER_MIN_BYTES:  # type: ignore[operator]  # mypy cannot see that CUT_WORKER_MIN_BYTES is set whenever use_worker is true
                        worker = CutWorker(params)   # it starts (~50 ms) while the walk goes on
                    while worker is not None and asked < len(regs) and worker.pending < _ASK_AHEAD:
                        worker.ask(regs[asked][0])
                        asked += 1
                    files.append((rel, normalise_file_mode(mode), []))
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
        for i, (path, st) in enumerate(regs):
            cuts = None
            if worker is not None:
                while asked < len(regs) and worker.pending < _ASK_AHEAD:
                    worker.ask(regs[asked][0])
                    asked += 1
                cuts = worker.batches(path)
            refs = _chunk_path(path, st, params, pool, sources, on_chunks, hasher, cuts)
            files[i][2].extend((r.id, r.size) for r in refs)
        if worker is not None:
            worker.close()
            worker = None
    finally:
        if worker is not None:   # an error: the worker may be mid-reply, stop it
            worker.kill()
        hasher.shutdown(wait=True)

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


def _chunk_path(path: str, st: os.stat_result, params: ChunkerParams, pool: WindowPool,
                sources: dict[str, ChunkSource],
                on_chunks: Callable[[list[ScannedChunk]], None] | None, hasher: Executor | None,
                cuts: BatchIter | None = None) -> list[ChunkRef]:
    """Chunk one file window by window, recording each chunk first seen in ``sources``
    and handing those on (with the window's bytes) as each window is chunked."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ManifestError(f"cannot open {path!r}: {exc.strerror}") from None
    refs: list[ChunkRef] = []
    src_path = Path(path)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode) or before.st_ino != st.st_ino:
            raise ManifestError(f"{path!r} changed while the tree was being scanned")
        for win, view, got in chunk_windows(fd, before.st_size, params, pool, path, hasher, cuts):
            refs.extend(got)
            fresh: list[ScannedChunk] = []
            base = got[0].offset if got else 0
            for r in got:
                if r.id not in sources:
                    src = sources[r.id] = ChunkSource(src_path, r.offset, r.size)
                    if on_chunks is not None:
                        fresh.append(ScannedChunk(r.id, src, view[r.offset - base:r.offset - base + r.size], win))
            if fresh:
                win.hold(len(fresh))
                assert on_chunks is not None
                on_chunks(fresh)
        if cuts is not None:
            cuts.finish()
        after = os.fstat(fd)
    except OSError as exc:
        raise ManifestError(f"cannot read {path!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise ManifestError(f"{path!r} changed while it was being chunked")
    return refs
