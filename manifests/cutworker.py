"""Cut points in a helper process: fastcdc's cut-point search holds the GIL, so a scan that
cuts in its own process serialises the cut with everything else it does (hashing, uploads).

:class:`CutWorker` starts a Python process running :func:`main` and asks it for the cut points of
files (by path); the worker maps each file and streams back, window by window, the END offsets
of its chunks. Only offsets cross the pipe: the scan still reads and hashes its own bytes, so a
chunk handed on always matches its id. The scan checks the offsets (contiguous, each chunk
``1..max_size`` bytes, ending exactly at the size it read) and the file's size and mtime around
its own read, so a file changed under the two reads fails the scan as before.

Wire (native byte order, both ways over the worker's stdin/stdout):
request  ``<I idx><I n><n bytes path>`` (a zero-length path: exit);
reply    ``<I idx><B kind><I n>`` then ``n`` uint64 chunk ends (kind 0, more follow),
the same (kind 1: the last batch of this file), or ``n`` bytes of UTF-8 error text (kind 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from collections import deque
from typing import BinaryIO

from ._cutserve import ERROR, LAST, REP, REQ, read_exact
from .errors import ManifestError
from .model import ChunkerParams


class CutWorker:
    """One helper process cutting files for a scan, in the order they are asked for.

    :meth:`ask` queues a path (ask a few ahead: the worker cuts them while the scan reads,
    hashes and uploads); :meth:`ends` yields the asked files' chunk ends, in ask order.
    """

    def __init__(self, params: ChunkerParams, step_bytes: int | None = None) -> None:
        """``step_bytes``: what the worker reads and cuts per reply (default 16 MiB; tests)."""
        # the worker is a stand-alone script (stdlib and fastcdc only): it starts in ~30 ms
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cutserve.py")
        self._proc = subprocess.Popen(
            [sys.executable, script, str(params.min_size), str(params.avg_size), str(params.max_size),
             *([str(step_bytes)] if step_bytes is not None else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in: BinaryIO = self._proc.stdin  # type: ignore[assignment]  # Popen types stdin as optional; it was opened with PIPE, so it is there
        self._out: BinaryIO = self._proc.stdout  # type: ignore[assignment]  # Popen types stdout as optional; it was opened with PIPE, so it is there
        self._next = 0
        self._asked: deque[int] = deque()

    @property
    def pending(self) -> int:
        return len(self._asked)

    def ask(self, path: str) -> int:
        raw = os.fsencode(path)
        if not raw:
            raise ValueError("empty path")
        idx = self._next
        self._next += 1
        self._in.write(REQ.pack(idx, len(raw)) + raw)
        self._in.flush()
        self._asked.append(idx)
        return idx

    def batches(self, path: str) -> BatchIter:
        """The chunk-end batches of the oldest asked file (``path`` names it in errors)."""
        if not self._asked:
            raise RuntimeError("no file asked for")
        return BatchIter(self, self._asked.popleft(), path)

    def _reply(self, idx: int, path: str) -> tuple[int, array]:
        try:
            got, kind, n = REP.unpack(read_exact(self._out, REP.size))
            body = read_exact(self._out, n * 8 if kind != ERROR else n)
        except EOFError:
            raise ManifestError(f"the cut worker exited while cutting {path!r} (rc {self._proc.poll()})") from None
        if got != idx:
            raise ManifestError(f"cut worker answered file #{got}, expected #{idx}")
        if kind == ERROR:
            raise ManifestError(f"cannot chunk {path!r}: {body.decode('utf-8', 'replace')}")
        ends = array("Q")
        ends.frombytes(body)
        return kind, ends

    def kill(self) -> None:
        """Stop the worker at once (after an error, when replies may be left unread)."""
        self._proc.kill()
        self._proc.wait()
        for f in (self._in, self._out):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        """Ask the worker to exit (every asked file's replies read) and wait for it."""
        try:
            self._in.write(REQ.pack(0, 0))
            self._in.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.close()


class BatchIter:
    """Chunk-end batches of one file, read on demand from the worker."""

    def __init__(self, worker: CutWorker, idx: int, path: str) -> None:
        self._w, self._idx, self._path = worker, idx, path
        self.done = False

    def next(self) -> array:
        if self.done:
            raise ManifestError(f"{self._path!r} changed while it was being chunked (cuts end early)")
        kind, ends = self._w._reply(self._idx, self._path)
        self.done = kind == LAST
        return ends

    def finish(self) -> None:
        """Check that this file's replies were all used (an empty file's one reply is read
        here), else the file changed between the worker's read and the scan's."""
        if not self.done and (len(self.next()) or not self.done):
            raise ManifestError(f"{self._path!r} changed while it was being chunked (cuts for more bytes)")
