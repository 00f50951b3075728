"""Content-defined chunking: the fastcdc package's compiled kernel plus BLAKE3 per chunk.

Hot path. The kernel runs over a read-only mmap of the file (or a small read for small files) and
hashes each chunk through the kernel's ``hf`` hook, which receives a memoryview slice of the map:
no chunk bytes are copied in Python. Large files are mapped in windows of ``WINDOW`` bytes so a
file bigger than memory still works; windows restart at a chunk boundary, and since the kernel
starts every chunk from a fresh rolling state the cut points are exactly those of one pass over the
whole file.

If only the package's pure-Python fallback is present we raise ChunkerUnavailable rather than run
~150x slower. (We look for the compiled module without importing the package's ``__init__``, which
would print a warning to stdout when the kernel is missing.)
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import stat
from collections import deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import blake3

from .errors import ChunkerUnavailable, ManifestError
from .model import CHUNKER_NAME, CHUNKER_VERSION, ChunkerParams
from .window import Window, WindowPool

if TYPE_CHECKING:
    from .cutworker import BatchIter

WINDOW = 256 * 1024 * 1024
"""Bytes of a file mapped at once (must exceed the largest max_size)."""

SMALL_FILE = 256 * 1024
"""Files up to this size are read with one read() instead of mapped."""

_MAP_ALIGN = mmap.ALLOCATIONGRANULARITY


class ChunkRef(NamedTuple):
    """A chunk of a file or buffer: BLAKE3-256 hex id, offset and size."""

    id: str
    offset: int
    size: int


_kernel_cache: list[Callable[..., Generator[Any, None, None]]] = []


def _kernel() -> Callable[..., Generator[Any, None, None]]:
    """The compiled ``chunk_generator`` of fastcdc, or ChunkerUnavailable."""
    if _kernel_cache:
        return _kernel_cache[0]
    spec = importlib.util.find_spec("fastcdc")
    if spec is None:
        raise ChunkerUnavailable("the fastcdc package is not installed (pip install fastcdc)")
    locations = list(spec.submodule_search_locations or [])
    compiled = any(
        name.startswith("fastcdc_cy.") and name.endswith((".so", ".pyd"))
        for loc in locations
        if os.path.isdir(loc)
        for name in os.listdir(loc)
    )
    if not compiled:
        raise ChunkerUnavailable(
            "fastcdc's compiled kernel (fastcdc_cy) is missing; only its pure-Python fallback is "
            "installed, which is ~150x slower: install a fastcdc wheel built for this platform"
        )
    try:
        from fastcdc.fastcdc_cy import chunk_generator
    except ImportError as exc:
        raise ChunkerUnavailable(f"fastcdc's compiled kernel cannot be loaded: {exc}") from None
    _kernel_cache.append(chunk_generator)
    return chunk_generator


def check_chunker(params: ChunkerParams) -> None:
    """Raise ChunkerUnavailable unless ``params`` name the kernel installed here."""
    _kernel()
    if params.name != CHUNKER_NAME or params.version != CHUNKER_VERSION:
        raise ChunkerUnavailable(
            f"chunker {params.name} {params.version} requested but {CHUNKER_NAME} {CHUNKER_VERSION} "
            "is installed (its cut points may differ)"
        )


def _hash(view: Any) -> Any:
    return blake3.blake3(view)


def _chunk_view(view: memoryview, params: ChunkerParams, base: int, out: list[ChunkRef], final: bool) -> int:
    """Chunk ``view`` (file bytes starting at file offset ``base``) into ``out``.

    If not ``final``, the last chunk may have been cut short by the end of the view: it is not
    emitted, and its start (a file offset) is returned so the next window restarts there.
    Returns the file offset where the next window must start (== base + len(view) when final).
    """
    gen = _kernel()(view, params.min_size, params.avg_size, params.max_size, False, _hash)
    end = base + len(view)
    try:
        if final:
            out.extend([ChunkRef(c.hash, base + c.offset, c.length) for c in gen])
            return end
        pending: ChunkRef | None = None
        for c in gen:
            if pending is not None:
                out.append(pending)
            pending = ChunkRef(c.hash, base + c.offset, c.length)
        if pending is None:
            return end
        return pending.offset
    finally:
        gen.close()
        del gen


def chunk_buffer(buf: Any, params: ChunkerParams | None = None) -> list[ChunkRef]:
    """Chunk an in-memory bytes-like object. Offsets are relative to its start."""
    params = params if params is not None else ChunkerParams()
    check_chunker(params)
    out: list[ChunkRef] = []
    with memoryview(buf) as view:
        if view.nbytes == 0:
            return out
        flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        try:
            _chunk_view(flat, params, 0, out, True)
        finally:
            if flat is not view:
                flat.release()
    return out


def chunk_fd(fd: int, size: int, params: ChunkerParams) -> list[ChunkRef]:
    """Chunk the first ``size`` bytes of an open regular file (no checks of ``params``)."""
    out: list[ChunkRef] = []
    if size == 0:
        return out
    if size <= SMALL_FILE:
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise ManifestError(f"file shrank while reading ({len(data)} of {size} bytes)")
        _chunk_view(memoryview(data), params, 0, out, True)
        return out
    window = max(WINDOW, 4 * params.max_size)
    pos = 0
    while pos < size:
        start = pos - pos % _MAP_ALIGN
        length = min(size - start, window)
        final = start + length >= size
        mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ, offset=start)
        try:
            with memoryview(mm) as whole:
                with whole[pos - start:] as view:
                    nxt = _chunk_view(view, params, pos, out, final)
        finally:
            try:
                mm.close()
            except BufferError:  # a view still alive after an error: unmapped when collected
                pass
        if nxt <= pos:  # cannot happen with window > max_size; guards an endless loop
            raise ManifestError("chunker made no progress")
        pos = nxt
    return out


def _cut_view(view: memoryview, params: ChunkerParams, base: int, final: bool) -> tuple[list[tuple[int, int]], int]:
    """Cut points only (no hashing) of ``view``: ``([(file offset, size)], next start)``,
    as :func:`_chunk_view` (the last, possibly short, chunk left out unless ``final``)."""
    gen = _kernel()(view, params.min_size, params.avg_size, params.max_size, False, None)
    try:
        cuts = [(base + c.offset, c.length) for c in gen]
    finally:
        gen.close()
        del gen
    if final or not cuts:
        return cuts, base + len(view)
    return cuts[:-1], cuts[-1][0]


def _hash_cuts(view: memoryview, base: int, cuts: list[tuple[int, int]]) -> list[ChunkRef]:
    # BLAKE3 releases the GIL for each chunk: the scan thread cuts the next window meanwhile
    return [ChunkRef(blake3.blake3(view[off - base:off - base + n]).hexdigest(), off, n) for off, n in cuts]


def _take_cuts(cuts: BatchIter, ends: deque[int], pos: int, n: int, final: bool, size: int,
               params: ChunkerParams, name: str) -> tuple[list[tuple[int, int]], int]:
    """:func:`_cut_view`'s answer for the window ``[pos, pos + n)`` from a cut worker's
    chunk ends (``ends``: those read but not used yet), checked: contiguous from ``pos``,
    each chunk ``1..max_size`` bytes, the last ending exactly at ``size``."""
    limit = pos + n
    while not cuts.done and (not ends or ends[-1] < limit):
        ends.extend(cuts.next())
    out: list[tuple[int, int]] = []
    start = pos
    ma = params.max_size
    while ends and ends[0] <= limit:
        e = ends.popleft()
        if not 0 < e - start <= ma:
            raise ManifestError(f"{name!r} changed while it was being chunked (bad cut at {e})")
        out.append((start, e - start))
        start = e
    if final:
        if start != size or ends or not cuts.done:
            raise ManifestError(f"{name!r} changed while it was being chunked (cuts end at {start}, size {size})")
        return out, size
    if not out:
        raise ManifestError(f"{name!r} changed while it was being chunked (no cut in a window)")
    return out, start


def chunk_windows(fd: int, size: int, params: ChunkerParams, pool: WindowPool,
                  name: str = "file", hasher: Executor | None = None,
                  cuts: BatchIter | None = None,
                  ) -> Iterator[tuple[Window, memoryview, list[ChunkRef]]]:
    """Chunk the first ``size`` bytes of an open regular file, reading it into windows of
    ``pool``: yields ``(window, view, refs)`` per window, ``view`` holding the file's bytes
    from ``refs[0].offset`` on (``view[c.offset - refs[0].offset:][:c.size]`` is chunk
    ``c``), as soon as the window is chunked. The generator holds one hold on the window
    until it is resumed; a caller handing chunks on takes a hold per chunk first
    (:meth:`Window.hold`). Cut points equal :func:`chunk_fd`'s (a window restarts at the
    last chunk the window before may have cut short, whose bytes are read again: each
    chunk is hashed from the one read it was cut in).

    ``hasher``: an executor (one thread) that hashes a window's chunks while this thread
    reads and cuts the next one (the cut holds the GIL, BLAKE3 does not); windows are then
    yielded one behind. ``cuts``: the file's chunk ends from a :class:`CutWorker` (this
    thread then only reads and hashes; the cut runs in the worker's process, off this
    process's GIL), checked against the bytes read. Raises ManifestError if the file
    shrinks while being read, or the cuts do not fit it.
    """
    if size == 0:
        return
    step = pool.window_bytes
    if size <= step:
        hasher = None   # one window: nothing to overlap the hash with
    if step < 4 * params.max_size:
        raise ValueError(f"windows of {step} bytes are too small for max_size {params.max_size}")
    pos = 0
    ends: deque[int] = deque()
    prev: tuple[Window, memoryview, Future[list[ChunkRef]]] | None = None
    try:
        while pos < size:
            n = min(size - pos, step)
            win = pool.acquire(n)
            try:
                view = memoryview(win.buf)[:n]
                # the whole window from the file, the bytes of the chunk the window before
                # cut short included: read again (into a reused buffer, off the GIL), not
                # copied over (a fresh bytes object and a copy, both holding the GIL)
                filled = 0
                while filled < n:
                    got = os.preadv(fd, [view[filled:]], pos + filled)
                    if got <= 0:
                        raise ManifestError(f"{name!r} shrank while it was being read ({pos + filled} of {size} bytes)")
                    filled += got
                final = pos + n >= size
                if cuts is None:
                    cut, nxt = _cut_view(view, params, pos, final)
                else:
                    cut, nxt = _take_cuts(cuts, ends, pos, n, final, size, params, name)
                if nxt <= pos:  # cannot happen with windows > max_size; guards an endless loop
                    raise ManifestError("chunker made no progress")
            except BaseException:
                win.release()
                raise
            if hasher is None:
                refs = _hash_cuts(view, pos, cut)
                try:
                    yield win, view, refs
                finally:
                    win.release()
            else:
                fut = hasher.submit(_hash_cuts, view, pos, cut)
                if prev is not None:
                    pw, pv, pf = prev
                    prev = None
                    try:
                        yield pw, pv, pf.result()
                    finally:
                        pw.release()
                prev = (win, view, fut)
            pos = nxt
        if prev is not None:
            pw, pv, pf = prev
            prev = None
            try:
                yield pw, pv, pf.result()
            finally:
                pw.release()
    finally:
        if prev is not None:   # an error or an abandoned generator: wait for the hash, drop the hold
            prev[2].cancel()
            try:
                prev[2].result()
            except BaseException:  # noqa: S110 - the error that got us here is the one raised
                pass
            prev[0].release()


def chunk_file(path: str | os.PathLike[str], params: ChunkerParams | None = None) -> list[ChunkRef]:
    """Chunk one regular file. Raises ManifestError if it is not one or changes while being read."""
    params = params if params is not None else ChunkerParams()
    check_chunker(params)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ManifestError(f"cannot open {os.fspath(path)!r}: {exc.strerror}") from None
    try:
        return chunk_open_file(fd, Path(path), params)
    finally:
        os.close(fd)


def chunk_open_file(fd: int, path: str | os.PathLike[str], params: ChunkerParams, *,
                    scanned_ino: int | None = None) -> list[ChunkRef]:
    """Chunk an open file, checking that it is regular and unchanged across the read.

    ``scanned_ino``: the inode a tree scan saw at this path; opening something else (or a
    non-regular file) then reads as the tree changing under the scan.
    """
    name = os.fspath(path)
    try:
        before = os.fstat(fd)
        if scanned_ino is not None and (not stat.S_ISREG(before.st_mode) or before.st_ino != scanned_ino):
            raise ManifestError(f"{name!r} changed while the tree was being scanned")
        if not stat.S_ISREG(before.st_mode):
            raise ManifestError(f"{name!r} is not a regular file")
        refs = chunk_fd(fd, before.st_size, params)
        after = os.fstat(fd)
    except OSError as exc:
        raise ManifestError(f"cannot read {name!r}: {exc.strerror}") from None
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
        raise ManifestError(f"{name!r} changed while it was being chunked")
    return refs
