"""Read windows: the buffers a scan reads a file into, chunks and hashes, and a publish
uploads from, so the bytes written to the origin are the very bytes that were hashed (no
second read of the file, no second hash, no copy).

Theory of operation. The scan reads a file window by window (``WindowPool.window_bytes``
at a time, at least 4x the chunker's max_size) into a :class:`Window`, a buffer from a
:class:`WindowPool`. Each chunk cut in it is handed on as a view of the window; whoever
takes a chunk calls :meth:`Window.release` once done with it (uploaded, or found already
present), and the scan releases its own hold after the last chunk. A window whose holds
are all released goes back to the pool and is reused (reusing spares the page faults of
fresh memory, which cost more than the read itself).

Invariants: the bytes a pool holds never exceed ``budget_bytes`` (one window more when a
single window is larger: progress is always possible); a window is reused only after
every view handed out of it was released; :meth:`WindowPool.acquire` blocks while the
budget is spent (backpressure from the uploads to the scan), calling ``on_wait`` first so
a consumer holding views can be told to let go of them, and raises WindowPoolClosed once
the pool is closed (the consumer stopped: the scan must stop too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import ManifestError

WINDOW_BYTES = 16 << 20
"""Bytes of a large file read at once (raised to 4x the chunker's max_size)."""

BUDGET_BYTES = 256 << 20
"""Bytes of windows a scan may hold at once, in use or waiting to be uploaded."""


class WindowPoolClosed(ManifestError):
    """The pool was closed (its consumer gave up) while the scan waited for a window."""


class Window:
    """A buffer holding file bytes, shared by the chunks cut in it until each is released."""

    __slots__ = ("_pool", "buf", "size", "_holds", "_full")

    def __init__(self, pool: WindowPool, buf: bytearray, size: int, full: bool) -> None:
        self._pool = pool
        self.buf = buf
        self.size = size            # bytes charged to the pool's budget
        self._holds = 1             # the scan's own hold
        self._full = full           # a pooled full-size buffer (else freed when done)

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
        self._free: list[bytearray] = []
        self._closed = False
        self.waits = 0              # times acquire had to wait (statistics, tests)

    def acquire(self, n: int) -> Window:
        """A window of at least ``n`` (<= window_bytes) bytes; blocks while the budget is spent."""
        if not 0 < n <= self.window_bytes:
            raise ValueError(f"window of {n} bytes asked (1..{self.window_bytes})")
        full = n > self.window_bytes // 4
        size = self.window_bytes if full else n
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
            buf = self._free.pop() if full and self._free else None
        if buf is None:
            buf = bytearray(size)
        return Window(self, buf, size, full)

    def _release(self, w: Window) -> None:
        with self._cond:
            w._holds -= 1
            if w._holds:
                return
            if w._holds < 0:
                raise RuntimeError("window released more often than held")
            self._used -= w.size
            if w._full and not self._closed:
                self._free.append(w.buf)
            w.buf = bytearray()
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse further windows (a blocked acquire raises WindowPoolClosed); idempotent."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._cond.notify_all()

    @property
    def used_bytes(self) -> int:
        with self._cond:
            return self._used
