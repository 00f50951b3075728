"""GPU discovery and health for the node agent.

What others may use::

    backend = open_backend("nvml" | "simulated:PROFILE", hostname=...)
    monitor = GpuMonitor(backend, poll_interval_s=1.0, health_config=HealthConfig(), state_dir=...)
    snapshot = await nursery.start(monitor.run)     # GpuSnapshot once GPUs are discovered
    monitor.snapshot(); monitor.subscribe(); monitor.inject(uuid, Fault(xid=79)); monitor.statistics()
    render_metrics(snapshot, hostname) -> Prometheus text
    host_health(state_dir, HostHealthConfig()) -> HostHealth

Profiles: dgx-h100, hgx-b200, gb200-nvl72 (option ``,rack=NAME`` sets the NVLink
domain's rack, e.g. ``simulated:gb200-nvl72,rack=r7``), l40s-pcie.
"""

from __future__ import annotations

import socket
from typing import Any

from .backend import Discovery, GpuBackend, GpuSample, RawEvent
from .classify import (
    APPLICATION_XIDS,
    DEGRADED_XIDS,
    FATAL_XIDS,
    GpuObservation,
    HealthConfig,
    XidEvent,
    classify_gpu,
    xid_class,
)
from .errors import FaultError, GpuBackendError, GpuError
from .faults import Fault, decode_fault
from .host import HostHealthConfig, classify_host, host_health
from .metrics import render_metrics
from .monitor import GpuMonitor, snapshot_once
from .simulated import PROFILES, SimulatedBackend

__all__ = [
    "APPLICATION_XIDS", "DEGRADED_XIDS", "FATAL_XIDS", "PROFILES",
    "Discovery", "Fault", "FaultError", "GpuBackend", "GpuBackendError", "GpuError", "GpuMonitor",
    "GpuObservation", "GpuSample", "HealthConfig", "HostHealthConfig", "RawEvent", "SimulatedBackend",
    "XidEvent", "classify_gpu", "classify_host", "decode_fault", "host_health", "open_backend",
    "render_metrics", "snapshot_once", "xid_class",
]


def open_backend(spec: str, *, hostname: str | None = None, rack: str | None = None,
                 nvml_module: Any = None) -> GpuBackend:
    """``nvml`` or ``simulated:PROFILE[,rack=NAME]`` -> a backend. Never falls back silently:
    ``nvml`` on a host without a usable NVML raises GpuBackendError naming the cause.

    ``nvml_module`` replaces the real pynvml (tests and the benchmark hand in a fake)."""
    host = hostname or socket.gethostname()
    kind, sep, rest = spec.strip().partition(":")
    if kind == "nvml" and not sep:
        from .nvml import NvmlBackend
        return NvmlBackend(hostname=host, nvml=nvml_module)
    if kind == "simulated":
        from .simulated import parse_spec_options
        if not rest:
            raise GpuBackendError("simulated backend needs a profile: simulated:PROFILE (profiles: "
                                  + ", ".join(sorted(PROFILES)) + ")")
        profile, opts = parse_spec_options(rest)
        return SimulatedBackend(profile, hostname=host, rack=opts.get("rack") or rack)
    raise GpuBackendError(f"unknown GPU backend {spec!r}; use nvml or simulated:PROFILE (profiles: "
                          + ", ".join(sorted(PROFILES)) + ")")
