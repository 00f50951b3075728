"""Read windows: the buffers a scan reads a file into, chunks and hashes, and a publish
uploads from, so the bytes written to the origin are the very bytes that were hashed (no
second read of the file, no second hash, no copy).

Theory of operation. The scan reads a file window by window (``WindowPool.window_bytes``
at a time, at least 4x the chunker's max_size) into a :class:`Window`, a buffer from a
:class:`WindowPool`. Each chunk cut in it is handed on as a view of the window; whoever
takes a chunk calls :meth:`Window.release` once done with it (uploaded, or found already
present), and the scan releases its own hold after the last chunk. A window whose holds
are all released goes back to the pool and is reused (reusing spares the page faults of
fresh memory, which cost more than the read itself). Windows for small files are reused
too: a request is rounded up to a size class (a power of two, at least ``MIN_CLASS``) and
served from that class's free list. A fresh buffer is an anonymous map, whose pages are
faulted in by the first read into it (off the GIL), not zeroed by Python holding it.
(With ``bytearray`` buffers, and only full windows reused, py-spy had the scan thread
holding the GIL ~0.4 s of a ~2.3 s publish of the 1 GB bench tree allocating them.)

Invariants: the bytes a pool holds never exceed ``budget_bytes`` (one window more when a
single window is larger: progress is always possible), counting the free buffers it keeps
for reuse (dropped, other sizes first, to make room for a fresh one); a window is reused only after
every view handed out of it was released; :meth:`WindowPool.acquire` blocks while the
budget is spent (backpressure from the uploads to the scan), calling ``on_wait`` first so
a consumer holding views can be told to let go of them, and raises WindowPoolClosed once
the pool is closed (the consumer stopped: the scan must stop too).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable

from .errors import ManifestError

WINDOW_BYTES = 16 << 20
"""Bytes of a large file read at once (raised to 4x the chunker's max_size)."""

BUDGET_BYTES = 256 << 20
"""Bytes of windows a scan may hold at once, in use or waiting to be uploaded."""

MIN_CLASS = 64 << 10
"""The smallest window kept for reuse: smaller requests are rounded up to it."""


_EMPTY = mmap.mmap(-1, 1, access=mmap.ACCESS_READ)   # what a released window holds


class WindowPoolClosed(ManifestError):
    """The pool was closed (its consumer gave up) while the scan waited for a window."""


class Window:
    """A buffer holding file bytes, shared by the chunks cut in it until each is released."""

    __slots__ = ("_pool", "buf", "size", "_holds")

    def __init__(self, pool: WindowPool, buf: mmap.mmap, size: int) -> None:
        self._pool = pool
        self.buf = buf
        self.size = size            # bytes charged to the pool's budget (len(buf), its size class)
        self._holds = 1             # the scan's own hold

    def hold(self, n: int = 1) -> None:
        """Take ``n`` more holds (one per chunk handed out). Only the scan calls this,
        while it still has its own hold."""
        with self._pool._cond:
            self._holds += n

    def release(self) -> None:
        """Drop one hold; the last one returns the buffer to the pool."""
        self._pool._release(self)


class WindowPool:
    """A bounded supply of read buffers, shared by one scan and whoever takes its chunks."""

    def __init__(self, *, window_bytes: int = WINDOW_BYTES, budget_bytes: int = BUDGET_BYTES,
                 on_wait: Callable[[], None] | None = None, wait_s: float = 0.05,
                 check: Callable[[], None] | None = None) -> None:
        if window_bytes <= 0 or budget_bytes <= 0:
            raise ValueError("window_bytes and budget_bytes must be > 0")
        self.window_bytes = window_bytes
        self.budget_bytes = budget_bytes
        self.on_wait = on_wait
        self.check = check          # called every wait_s while blocked (e.g. trio's check_cancelled)
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._used = 0
        self._free: dict[int, list[mmap.mmap]] = {}   # size class -> buffers to reuse
        self._free_bytes = 0
        self._closed = False
        self.waits = 0              # times acquire had to wait (statistics, tests)

    def acquire(self, n: int) -> Window:
        """A window of at least ``n`` (<= window_bytes) bytes; blocks while the budget is spent."""
        if not 0 < n <= self.window_bytes:
            raise ValueError(f"window of {n} bytes asked (1..{self.window_bytes})")
        size = self.size_class(n)
        told = False
        with self._cond:
            while not self._closed and self._used and self._used + size > self.budget_bytes:
                if not told:
                    self.waits += 1
                    told = True
                    if self.on_wait is not None:
                        self._cond.release()   # on_wait may block (a channel send): not under the lock
                        try:
                            self.on_wait()
                        finally:
                            self._cond.acquire()
                        continue
                self._cond.wait(self._wait_s)
                if self.check is not None:
                    self._cond.release()
                    try:
                        self.check()
                    finally:
                        self._cond.acquire()
            if self._closed:
                raise WindowPoolClosed("the scan's consumer stopped")
            self._used += size
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= size
            else:   # a fresh buffer: drop free ones of other sizes so the pool's memory stays in budget
                while self._free_bytes and self._used + self._free_bytes > self.budget_bytes:
                    cls, bufs = next((c, b) for c, b in self._free.items() if b)
                    bufs.pop()
                    self._free_bytes -= cls
        if buf is None:
            buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)   # (a shared map is shmem: dearer faults)
        return Window(self, buf, size)

    def size_class(self, n: int) -> int:
        """The buffer size a request for ``n`` bytes gets (and is charged)."""
        if n > self.window_bytes // 4:
            return self.window_bytes
        return min(self.window_bytes, max(MIN_CLASS, 1 << (n - 1).bit_length()))

    def _release(self, w: Window) -> None:
        with self._cond:
            w._holds -= 1
            if w._holds:
                return
            if w._holds < 0:
                raise RuntimeError("window released more often than held")
            self._used -= w.size
            if not self._closed and self._free_bytes + w.size <= self.budget_bytes:
                self._free.setdefault(w.size, []).append(w.buf)
                self._free_bytes += w.size
            w.buf = _EMPTY   # (a map dropped here is unmapped once no view of it is left)
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse further windows (a blocked acquire raises WindowPoolClosed); idempotent."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._free_bytes = 0
            self._cond.notify_all()

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used
