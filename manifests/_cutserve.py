"""The cut worker's process (:mod:`manifests.cutworker`): a stand-alone script, stdlib and
fastcdc's compiled kernel only, so it starts without importing herd.

    python _cutserve.py MIN_SIZE AVG_SIZE MAX_SIZE [STEP_BYTES]

Reads requests from stdin, writes each file's chunk ends to stdout (wire format: see
:mod:`manifests.cutworker`). A file is mapped read-only in ``WINDOW``-byte steps (measured:
~0.2 CPU-s/GB less than ``preadv`` into a buffer), each step's ends sent at once (the scan
waits for the first).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from array import array
from typing import BinaryIO

REQ = struct.Struct("=II")
REP = struct.Struct("=IBI")
MORE, LAST, ERROR = 0, 1, 2
WINDOW = 16 * 1024 * 1024
ALIGN = mmap.ALLOCATIONGRANULARITY


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

    def send(idx: int, kind: int, ends: array) -> None:
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
                if size == 0:
                    send(idx, LAST, array("Q"))
                while pos < size:
                    start = pos - pos % ALIGN
                    length = min(size - start, window)
                    final = start + length >= size
                    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                   prot=mmap.PROT_READ, offset=start)
                    with memoryview(mm) as whole, whole[pos - start:] as view:
                        gen = kernel(view, mi, av, ma, False, None)
                        ends = array("Q", [pos + c.offset + c.length for c in gen])
                        gen.close()
                        del gen
                    mm.close()
                    if not final:
                        ends.pop()      # the last chunk may be cut short by the step's end
                        if not ends:
                            raise OSError("chunker made no progress")
                        pos = ends[-1]
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
