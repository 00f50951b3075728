"""The one interface both GPU backends (NVML and simulated) implement.

A backend is synchronous and blocking: the monitor calls it from worker threads
with a bounded time (a thread blocked in a C call cannot be cancelled, so waits
inside the backend are kept short). It reports *raw* signals only — inventory,
counters, flags, events. It never decides health; :mod:`agent.gpus.classify` does.

Data shapes (the same for every backend):

- :class:`Discovery` — static inventory and topology, read once at start.
- :class:`GpuSample` — one poll of one GPU: a :class:`GpuTelemetry` plus the
  "lost" / "reset required" flags any NVML call may raise, the NVLink links active
  now and the NVL72 fabric health.
- :class:`RawEvent` — one event from the event set (an XID, a DBE, a GPU that
  became unavailable, a recovery action), or ``reset`` (the GPU was reset or
  cleared: history from before no longer applies).
"""

from __future__ import annotations

import abc
import re
from typing import TYPE_CHECKING, Literal

import msgspec

from scheduler_link.messages import GpuInfo, GpuTelemetry

from .errors import GpuBackendError

if TYPE_CHECKING:
    from .faults import Fault

EventKind = Literal["xid", "ecc_dbe", "ecc_sbe", "gpu_unavailable", "recovery_action", "reset"]


class Discovery(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    simulated: bool
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[GpuInfo] = []                 # static fields only; health is filled by the monitor
    topology_matrix: list[list[str]] = []
    nvlink_domain: str | None = None
    unanswered: list[str] = []               # GPUs counted but not usable at discovery ("index 3: lost")


class GpuSample(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str
    telemetry: GpuTelemetry = GpuTelemetry()
    lost: bool = False
    reset_required: bool = False
    nvlinks_active: list[int] | None = None  # None: NVLink not supported / not read
    fabric_health: str | None = None         # "healthy" | "unhealthy" | "limited_capacity" | None
    failed_signals: list[str] = []           # signals that failed for a reason other than NotSupported


class RawEvent(msgspec.Struct, frozen=True, kw_only=True):
    uuid: str | None                          # None: the device could not be identified
    kind: EventKind
    value: int = 0                            # XID code, recovery action, ...
    source: Literal["nvml", "kmsg", "inject"] = "nvml"
    at: float | None = None                   # event time where the source knows it (kmsg)
    detail: str = ""


class GpuBackend(abc.ABC):
    """Inventory, polls and events of one host's GPUs. Blocking; call from worker threads."""

    spec: str = ""
    simulated: bool = False
    hostname: str = ""

    @abc.abstractmethod
    def discover(self) -> Discovery:
        """Inventory and topology. Called once, before poll/wait_events."""

    @abc.abstractmethod
    def poll(self) -> list[GpuSample]:
        """Read every GPU's health signals once. Never raises for one GPU's trouble."""

    @abc.abstractmethod
    def wait_events(self, timeout_ms: int) -> list[RawEvent]:
        """Wait at most ``timeout_ms`` for events; ``[]`` on timeout."""

    def inject(self, uuid: str, fault: Fault) -> None:
        """Feed raw signals (simulated backends only)."""
        raise GpuBackendError(f"fault injection needs a simulated GPU backend; this one is {self.spec!r}")

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release the library / event set. Idempotent."""


# ---------------------------------------------------------------- helpers shared by backends

# nvmlDeviceGetTopologyCommonAncestor levels -> the words `nvidia-smi topo -m` prints.
TOPO_LEVEL_NAMES: dict[int, str] = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def topo_name(level: int | None) -> str:
    if level is None:
        return "N/A"
    return TOPO_LEVEL_NAMES.get(int(level), "N/A")


_PCI_RE = re.compile(r"^(?:(?P<dom>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<dev>[0-9a-fA-F]{1,2})"
                     r"(?:\.(?P<fn>[0-7]))?$")


def normalize_pci(bus_id: str) -> str | None:
    """Normalise a PCI bus id to NVML's form ``00000000:3B:00.0``; None if unparsable.

    Accepts NVML (``00000000:3B:00.0``), sysfs (``0000:3b:00.0``) and the kernel log's
    XID form (``0000:3b:00``)."""
    m = _PCI_RE.match(bus_id.strip())
    if not m:
        return None
    dom = int(m.group("dom") or "0", 16)
    return f"{dom:08X}:{int(m.group('bus'), 16):02X}:{int(m.group('dev'), 16):02X}.{int(m.group('fn') or 0)}"


def cpulist(words: list[int], word_bits: int = 64) -> str | None:
    """CPU bitmask words (NVML's cpuSet, least significant word first) -> ``"0-55,112-167"``."""
    cpus = [w * word_bits + b for w, word in enumerate(words) for b in range(word_bits) if (int(word) >> b) & 1]
    if not cpus:
        return None
    return ranges(cpus)


def ranges(cpus: list[int]) -> str:
    out: list[str] = []
    start = prev = cpus[0]
    for c in cpus[1:] + [-2]:
        if c == prev + 1:
            prev = c
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = c
    return ",".join(out)
