"""Reading a workload's size-capped, rotated logs (written by :mod:`agent.shim`)."""

from __future__ import annotations

import os
from pathlib import Path


def read_tail(wdir: Path, stream: str, tail: int, keep: int) -> str:
    """The last ``tail`` lines of ``stream`` (stdout|stderr) across ``<stream>.log`` and its
    ``keep`` rotations. Reads backwards from the end in blocks, so a tail of a large log
    costs what it returns."""
    if tail <= 0:
        return ""
    files = [wdir / (f"{stream}.log" if i == 0 else f"{stream}.log.{i}") for i in range(keep + 1)]
    data, complete = _tail_bytes([f for f in files if f.exists()], tail)
    lines = data.splitlines(keepends=True)
    if not complete and lines:
        lines = lines[1:]  # the first line may be cut
    return b"".join(lines[-tail:]).decode(errors="replace")


def _tail_bytes(files: list[Path], n: int, block: int = 64 << 10) -> tuple[bytes, bool]:
    """Enough bytes from the end of the stream ``files`` (newest first; rotation may cut
    a line in two files) to hold its last ``n`` lines; True when it is the whole stream."""
    data = b""
    for path in files:
        with open(path, "rb") as f:
            pos = f.seek(0, os.SEEK_END)
            while pos > 0:
                if data.count(b"\n") > n:
                    return data, False
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    return data, True
