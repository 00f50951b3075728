"""Back-fill of XIDs from the kernel log since boot.

NVML's event set is not historical: an XID raised while nothing listened (before
the agent started, or while it was restarting) is lost to NVML. The driver also
logs every XID to the kernel ring buffer::

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.

:func:`parse_xid_line` / :func:`xids_from_lines` are pure (tested with sample
lines); :func:`read_kernel_log` is the best-effort, bounded reader: ``/dev/kmsg``
(non-blocking, needs CAP_SYSLOG or ``kernel.dmesg_restrict=0``), else
``journalctl -k -b``. Neither readable: an empty list and a log line, never an error.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import time

import msgspec

from .backend import RawEvent, normalize_pci

log = logging.getLogger("herd.agent.gpus.kmsg")

_XID_RE = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>\d+)(?:,\s*(?P<detail>.*))?$")
_BUS_RE = re.compile(r"NVRM: GPU (?P<pci>[0-9A-Fa-f:.]+): GPU has fallen off the bus")
_KMSG_PREFIX = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;]*;")
_BRACKET_TS = re.compile(r"^\[\s*(?P<sec>\d+\.\d+)\]")

FALLEN_OFF_BUS_XID = 79


class KernelXid(msgspec.Struct, frozen=True, kw_only=True):
    pci_bus_id: str           # normalised like NVML: 00000000:3B:00.0
    xid: int
    since_boot_s: float | None
    detail: str = ""


def parse_xid_line(line: str) -> KernelXid | None:
    """One kernel log line (``/dev/kmsg`` record, ``journalctl -o short-monotonic`` or
    ``dmesg`` form) -> a KernelXid, or None when it is not an NVRM XID line."""
    ts: float | None = None
    m = _KMSG_PREFIX.match(line)
    if m:
        ts = int(m.group("usec")) / 1e6
    else:
        b = _BRACKET_TS.match(line)
        if b:
            ts = float(b.group("sec"))
    x = _XID_RE.search(line.rstrip())
    if x:
        pci = normalize_pci(x.group("pci"))
        if pci is None:
            return None
        return KernelXid(pci_bus_id=pci, xid=int(x.group("xid")), since_boot_s=ts,
                         detail=(x.group("detail") or "").strip()[:200])
    f = _BUS_RE.search(line)
    if f:
        pci = normalize_pci(f.group("pci"))
        if pci is None:
            return None
        return KernelXid(pci_bus_id=pci, xid=FALLEN_OFF_BUS_XID, since_boot_s=ts,
                         detail="GPU has fallen off the bus")
    return None


def xids_from_lines(lines: list[str], *, boot_time: float, pci_to_uuid: dict[str, str],
                    now: float) -> list[RawEvent]:
    """Kernel log lines -> XID raw events for the GPUs we know (others are ignored)."""
    out = []
    for line in lines:
        k = parse_xid_line(line)
        if k is None:
            continue
        uuid = pci_to_uuid.get(k.pci_bus_id)
        if uuid is None:
            continue
        at = boot_time + k.since_boot_s if k.since_boot_s is not None else now
        out.append(RawEvent(uuid=uuid, kind="xid", value=k.xid, source="kmsg", at=min(at, now),
                            detail=k.detail))
    return out


def _read_kmsg(max_records: int, deadline: float) -> list[str] | None:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        log.info("kernel log: /dev/kmsg not readable (%s)", e.strerror)
        return None
    out: list[str] = []
    scanned = 0
    try:
        while len(out) < max_records and scanned < 4 * max_records and time.monotonic() < deadline:
            scanned += 1
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break            # caught up with the ring buffer
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue     # a record was overwritten while we read: skip it
                if e.errno == errno.EINVAL:
                    continue
                log.info("kernel log: /dev/kmsg read failed (%s)", e.strerror)
                break
            if not rec:
                break
            text = rec.decode("utf-8", "replace")
            if "NVRM" in text:
                out.append(text.split("\n", 1)[0])
    finally:
        os.close(fd)
    return out


def _read_journal(max_records: int, timeout_s: float) -> list[str] | None:
    try:
        p = subprocess.run(["journalctl", "-k", "-b", "-q", "--no-pager", "-o", "short-monotonic",
                            "-n", str(max_records)], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.info("kernel log: journalctl unavailable (%s)", e)
        return None
    if p.returncode != 0:
        return None
    return [ln for ln in p.stdout.decode("utf-8", "replace").splitlines() if "NVRM" in ln]


def read_kernel_log(*, max_records: int = 100_000, timeout_s: float = 3.0) -> list[str]:
    """NVRM lines of the kernel log since boot; best effort, bounded in records and time."""
    deadline = time.monotonic() + timeout_s
    lines = _read_kmsg(max_records, deadline)
    if lines is None:
        lines = _read_journal(max_records, max(0.5, deadline - time.monotonic()))
    return lines or []


def boot_time() -> float:
    import psutil
    return float(psutil.boot_time())
