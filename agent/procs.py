"""Process identity across agent restarts, and group signalling.

A PID alone is not an identity: PIDs are recycled. A process is identified by
(pid, start time in clock ticks since boot from ``/proc/PID/stat`` field 22, boot id
from ``/proc/sys/kernel/random/boot_id``). A recorded triple that does not match the
live process means the process we started is gone, whatever now holds the PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
from functools import lru_cache


@lru_cache(maxsize=1)
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: fall back to something stable for this boot
        return "unknown-boot"


def start_time(pid: int) -> int | None:
    """Field 22 (starttime) of /proc/PID/stat, or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19])  # rest[0] is field 3
    except (IndexError, ValueError):
        return None


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    rest = data[data.rfind(b")") + 2:].split()
    return bool(rest) and rest[0] in (b"Z", b"X")


def same_process(pid: int | None, started: int | None, boot: str | None) -> bool:
    """True when ``pid`` is alive and is the very process recorded as (pid, started, boot)."""
    if not pid or started is None or boot != boot_id():
        return False
    st = start_time(pid)
    return st is not None and st == started and not is_zombie(pid)


def open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return None


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def reap(pid: int) -> None:
    """Reap ``pid`` if it is our child (no-op otherwise)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


SIGKILL = signal.SIGKILL
SIGTERM = signal.SIGTERM
