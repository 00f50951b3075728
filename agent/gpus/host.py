"""Host health with psutil: memory pressure, free disk of the state dir, load.

:func:`host_health` reads the host (the I/O shell); :func:`classify_host` decides
(pure). Thresholds live in :class:`HostHealthConfig`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import psutil

from scheduler_link.messages import HealthReason, HealthState, HostHealth

_RANK = {"info": 0, "application": 0, "degraded": 1, "fatal": 2}
_STATE: dict[int, HealthState] = {0: "healthy", 1: "degraded", 2: "fatal"}


class HostHealthConfig(msgspec.Struct, frozen=True, kw_only=True):
    mem_available_degraded_mib: int = 2048     # below: degraded
    mem_available_fatal_mib: int = 256         # below: fatal (the OOM killer is near)
    disk_free_degraded_mib: int = 4096         # state dir's file system
    disk_free_fatal_mib: int = 512
    load_per_cpu_degraded: float = 4.0         # load1 / cpu count above: degraded


class HostReadings(msgspec.Struct, frozen=True, kw_only=True):
    mem_available_mib: int | None = None
    disk_free_mib: int | None = None
    load1: float | None = None
    cpus: int = 1
    errors: list[str] = []


def classify_host(r: HostReadings, cfg: HostHealthConfig, now: float) -> HostHealth:
    """Pure: readings + thresholds -> HostHealth."""
    reasons: list[HealthReason] = []

    def add(code: str, sev: str, detail: str) -> None:
        reasons.append(HealthReason(code=code, severity=sev, gpu=None, since=now, detail=detail))  # type: ignore[arg-type]  # code and severity come from the host checks' table, whose values are the Literal's

    if r.mem_available_mib is not None:
        if r.mem_available_mib < cfg.mem_available_fatal_mib:
            add("host_memory_exhausted", "fatal", f"{r.mem_available_mib} MiB available")
        elif r.mem_available_mib < cfg.mem_available_degraded_mib:
            add("host_memory_pressure", "degraded", f"{r.mem_available_mib} MiB available")
    if r.disk_free_mib is not None:
        if r.disk_free_mib < cfg.disk_free_fatal_mib:
            add("state_disk_full", "fatal", f"{r.disk_free_mib} MiB free in the state dir")
        elif r.disk_free_mib < cfg.disk_free_degraded_mib:
            add("state_disk_low", "degraded", f"{r.disk_free_mib} MiB free in the state dir")
    if r.load1 is not None and r.load1 / max(1, r.cpus) > cfg.load_per_cpu_degraded:
        add("host_load_high", "degraded", f"load1 {r.load1:.1f} on {r.cpus} CPUs")
    for e in r.errors:
        add("host_reading_failed", "info", e)
    state = _STATE[max((_RANK[x.severity] for x in reasons), default=0)]
    return HostHealth(state=state, reasons=reasons, mem_available_mib=r.mem_available_mib,
                      disk_free_mib=r.disk_free_mib, load1=r.load1)


def read_host(state_dir: Path | None) -> HostReadings:
    """Read memory, the state dir's free disk and load (blocking, cheap)."""
    errors: list[str] = []
    mem = disk = None
    load = None
    try:
        mem = int(psutil.virtual_memory().available // (1 << 20))
    except (OSError, RuntimeError) as e:
        errors.append(f"memory: {e}")
    if state_dir is not None:
        p = Path(state_dir)
        while not p.exists() and p != p.parent:   # the dir may not exist yet: measure its file system
            p = p.parent
        try:
            disk = int(psutil.disk_usage(str(p)).free // (1 << 20))
        except OSError as e:
            errors.append(f"disk {state_dir}: {e}")
    try:
        load = float(os.getloadavg()[0])
    except OSError as e:
        errors.append(f"load: {e}")
    return HostReadings(mem_available_mib=mem, disk_free_mib=disk, load1=load,
                        cpus=psutil.cpu_count() or 1, errors=errors)


def host_health(state_dir: Path | None, cfg: HostHealthConfig = HostHealthConfig(), *,
                now: float | None = None) -> HostHealth:
    """Read the host and classify it."""
    return classify_host(read_host(state_dir), cfg, time.time() if now is None else now)
