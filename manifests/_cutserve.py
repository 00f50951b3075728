"""The cut worker's process (:mod:`manifests.cutworker`): a stand-alone script, stdlib and
fastcdc's compiled kernel only, so it starts without importing herd.

    python _cutserve.py MIN_SIZE AVG_SIZE MAX_SIZE [STEP_BYTES]

Reads requests from stdin, writes each file's chunk ends to stdout (wire format: see
:mod:`manifests.cutworker`). A file is read with ``preadv`` into one reused buffer in
``WINDOW``-byte steps, each step's ends sent at once (the scan waits for the first).
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from typing import BinaryIO

REQ = struct.Struct("=II")
REP = struct.Struct("=IBI")
MORE, LAST, ERROR = 0, 1, 2
WINDOW = 16 * 1024 * 1024


def read_exact(f: BinaryIO, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = f.read(n - len(buf))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)


def serve(mi: int, av: int, ma: int, window: int = WINDOW) -> None:  # pragma: no cover - the worker
    from fastcdc.fastcdc_cy import chunk_generator as kernel

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    window = max(window, 4 * ma)
    buf = bytearray(window)
    whole = memoryview(buf)

    def send(idx: int, kind: int, ends: array) -> None:  # type: ignore[type-arg]
        out.write(REP.pack(idx, kind, len(ends)) + ends.tobytes())
        out.flush()

    while True:
        try:
            idx, n = REQ.unpack(read_exact(inp, REQ.size))
            path = os.fsdecode(read_exact(inp, n)) if n else ""
        except EOFError:
            return
        if not path:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                size = os.fstat(fd).st_size
                pos = 0
                carry = 0       # bytes at the start of buf carried over from the step before
                if size == 0:
                    send(idx, LAST, array("Q"))
                while pos < size:
                    n = min(size - pos, window)
                    filled = carry
                    while filled < n:
                        got = os.preadv(fd, [whole[filled:n]], pos + filled)
                        if got <= 0:
                            raise OSError(f"file shrank while it was being cut ({pos + filled} of {size} bytes)")
                        filled += got
                    final = pos + n >= size
                    view = whole[:n]
                    gen = kernel(view, mi, av, ma, False, None)
                    ends = array("Q", [pos + c.offset + c.length for c in gen])
                    gen.close()
                    del gen
                    view.release()
                    if not final:
                        ends.pop()      # the last chunk may be cut short by the step's end
                        if not ends:
                            raise OSError("chunker made no progress")
                        nxt = ends[-1]
                        carry = pos + n - nxt
                        buf[:carry] = buf[nxt - pos:n]
                        pos = nxt
                    else:
                        pos = size
                    send(idx, LAST if final else MORE, ends)
            finally:
                os.close(fd)
        except OSError as exc:
            msg = str(exc).encode("utf-8", "replace")
            out.write(REP.pack(idx, ERROR, len(msg)) + msg)
            out.flush()


if __name__ == "__main__":  # pragma: no cover
    serve(*(int(a) for a in sys.argv[1:5]))
