"""Simulated GPU hosts for development, tests and the demo.

Each profile describes a real system's shape — names, memory, PCI ids, NUMA and
CPU affinity, NVLink wiring, the topology matrix `nvidia-smi topo -m` prints on
it, temperature thresholds — so everything above the backend sees the same data
shapes as with NVML. Everything it reports carries ``simulated=True`` and UUIDs
``GPU-sim-...`` ("s", "i", "m" are not hex digits, so they can never collide with
a real GPU's UUID), deterministic per (hostname, profile, index).

Raw signals start at a baseline and change only through :meth:`inject`, which
mutates the raw counters/flags under a lock and queues events for
:meth:`wait_events` — the same path the NVML backend's event thread takes. The one
exception is the energy counter, which (like NVML's) grows by itself: each poll adds
the power drawn since the previous one.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_link.messages import GpuInfo, GpuTelemetry, NvLink

from .backend import Discovery, GpuBackend, GpuSample, RawEvent
from .errors import FaultError, GpuBackendError
from .faults import THROTTLE_BITS, Fault


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    model: str
    memory_mib: int
    bus_ids: tuple[str, ...]
    numa: tuple[int, ...]
    cpu_affinity: tuple[str, ...]             # per NUMA node
    nvlinks: int                              # links per GPU (0: PCIe only)
    nvlink_remote: str                        # "switch" | "gpu" | ""
    pcie_matrix: tuple[tuple[str, ...], ...] | None  # used when there is no NVLink
    temp_slowdown_c: float
    temp_shutdown_c: float
    power_idle_w: float
    sm_clock_idle_mhz: int
    mem_clock_mhz: int
    hbm: bool = True                          # memory temperature readable (GDDR boards: None)
    mig_supported: bool = True
    fabric: bool = False
    driver_version: str = "570.133.20"
    cuda_version: str = "12.8"


def _numa_matrix(numa: tuple[int, ...], same: str) -> tuple[tuple[str, ...], ...]:
    n = len(numa)
    return tuple(tuple("X" if i == j else (same if numa[i] == numa[j] else "SYS") for j in range(n))
                 for i in range(n))


PROFILES: dict[str, Profile] = {
    # DGX H100: 8x H100 SXM5 80GB, 18 NVLink4 links each to 4 NVSwitches -> NV18 everywhere.
    "dgx-h100": Profile(
        name="dgx-h100", model="NVIDIA H100 80GB HBM3", memory_mib=81559,
        bus_ids=("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
                 "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0"),
        numa=(0, 0, 0, 0, 1, 1, 1, 1), cpu_affinity=("0-55,112-167", "56-111,168-223"),
        nvlinks=18, nvlink_remote="switch", pcie_matrix=None,
        temp_slowdown_c=89.0, temp_shutdown_c=92.0, power_idle_w=72.0, sm_clock_idle_mhz=345,
        mem_clock_mhz=2619),
    # HGX B200: 8x B200 180GB, 18 NVLink5 links each to the NVSwitch chips -> NV18.
    "hgx-b200": Profile(
        name="hgx-b200", model="NVIDIA B200", memory_mib=183359,
        bus_ids=("00000000:1B:00.0", "00000000:43:00.0", "00000000:52:00.0", "00000000:61:00.0",
                 "00000000:9D:00.0", "00000000:C3:00.0", "00000000:D1:00.0", "00000000:DF:00.0"),
        numa=(0, 0, 0, 0, 1, 1, 1, 1), cpu_affinity=("0-55,112-167", "56-111,168-223"),
        nvlinks=18, nvlink_remote="switch", pcie_matrix=None,
        temp_slowdown_c=87.0, temp_shutdown_c=92.0, power_idle_w=140.0, sm_clock_idle_mhz=345,
        mem_clock_mhz=3996),
    # One GB200 NVL72 compute tray: 2 Grace CPUs x 2 B200-class GPUs, 18 links each into the
    # rack's NVLink switch trays; the rack is one NVLink domain (fabric clique).
    "gb200-nvl72": Profile(
        name="gb200-nvl72", model="NVIDIA GB200", memory_mib=189471,
        bus_ids=("00000008:01:00.0", "00000009:01:00.0", "00000018:01:00.0", "00000019:01:00.0"),
        numa=(0, 0, 1, 1), cpu_affinity=("0-71", "72-143"),
        nvlinks=18, nvlink_remote="switch", pcie_matrix=None,
        temp_slowdown_c=87.0, temp_shutdown_c=92.0, power_idle_w=160.0, sm_clock_idle_mhz=345,
        mem_clock_mhz=3996, fabric=True),
    # 4x L40S on PCIe, two per CPU socket behind a PCIe switch; no NVLink, no MIG.
    "l40s-pcie": Profile(
        name="l40s-pcie", model="NVIDIA L40S", memory_mib=46068,
        bus_ids=("00000000:21:00.0", "00000000:41:00.0", "00000000:A1:00.0", "00000000:C1:00.0"),
        numa=(0, 0, 1, 1), cpu_affinity=("0-31,64-95", "32-63,96-127"),
        nvlinks=0, nvlink_remote="", pcie_matrix=(
            ("X", "PXB", "SYS", "SYS"), ("PXB", "X", "SYS", "SYS"),
            ("SYS", "SYS", "X", "PXB"), ("SYS", "SYS", "PXB", "X")),
        temp_slowdown_c=88.0, temp_shutdown_c=93.0, power_idle_w=35.0, sm_clock_idle_mhz=210,
        mem_clock_mhz=9001, hbm=False, mig_supported=False),
}

DEFAULT_RACK = "rack-a"


def sim_uuid(hostname: str, profile: str, index: int) -> str:
    h = hashlib.blake2b(f"{hostname}/{profile}/{index}".encode(), digest_size=16).hexdigest()
    return f"GPU-sim-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def fabric_ids(rack: str) -> tuple[str, int]:
    """(clusterUuid, cliqueId) of a simulated NVL72 rack, derived from its name."""
    cluster = str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"herd-sim-nvl72.{rack}"))
    clique = int.from_bytes(hashlib.blake2b(rack.encode(), digest_size=2).digest(), "big") % 32767 + 1
    return cluster, clique


@dataclass(slots=True)
class _Raw:
    """The mutable raw signals of one simulated GPU (guarded by the backend's lock)."""
    temperature_c: float
    power_w: float
    ecc_dbe: int = 0
    ecc_sbe: int = 0
    ecc_dbe_agg: int = 0
    throttle: int = 0
    lost: bool = False
    reset_required: bool = False
    remap_pending: bool = False
    remap_failure: bool = False
    retired_pages_pending: bool = False
    links_down: set[int] = field(default_factory=set)
    nvlink_crc: int = 0
    pcie_replay: int = 0
    recovery_action: int = 0
    fabric_health: str | None = None
    energy_mj: int = 0                  # since this backend started ("driver load")


class SimulatedBackend(GpuBackend):
    simulated = True

    def __init__(self, profile: str, *, hostname: str = "localhost", rack: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if profile not in PROFILES:
            raise GpuBackendError(f"unknown simulated profile {profile!r}; choose one of: "
                                  + ", ".join(sorted(PROFILES)))
        self.profile = PROFILES[profile]
        self.hostname = hostname
        self.rack = rack or DEFAULT_RACK
        self.spec = f"simulated:{profile}"
        n = len(self.profile.bus_ids)
        self.uuids = [sim_uuid(hostname, profile, i) for i in range(n)]
        self._lock = threading.Lock()
        self._raw = {u: self._baseline(i) for i, u in enumerate(self.uuids)}
        self._events: queue.SimpleQueue[RawEvent] = queue.SimpleQueue()
        self._closed = False
        self._clock = clock
        self._last_poll = clock()

    def _baseline(self, i: int) -> _Raw:
        p = self.profile
        return _Raw(temperature_c=31.0 + i % 4, power_w=p.power_idle_w + i % 3,
                    fabric_health="healthy" if p.fabric else None)

    # ------------------------------------------------------------ GpuBackend

    def discover(self) -> Discovery:
        p = self.profile
        n = len(p.bus_ids)
        cluster, clique = fabric_ids(self.rack) if p.fabric else (None, None)
        gpus = []
        for i, u in enumerate(self.uuids):
            links = [NvLink(link=k, active=True, remote_pci_bus_id=None,
                            remote_type="switch" if p.nvlink_remote == "switch" else "gpu")
                     for k in range(p.nvlinks)]
            gpus.append(GpuInfo(
                index=i, uuid=u, name=p.model, memory_total_mib=p.memory_mib, pci_bus_id=p.bus_ids[i],
                serial=f"sim-{u[8:16]}", minor_number=i, numa_node=p.numa[i],
                cpu_affinity=p.cpu_affinity[p.numa[i]],
                mig_mode_current=0 if p.mig_supported else None,
                mig_mode_pending=0 if p.mig_supported else None,
                nvlinks=links, fabric_cluster_uuid=cluster, fabric_clique_id=clique,
                fabric_health="healthy" if p.fabric else None, simulated=True,
                telemetry=GpuTelemetry(temp_slowdown_c=p.temp_slowdown_c, temp_shutdown_c=p.temp_shutdown_c)))
        if p.nvlinks:
            matrix = [["X" if i == j else f"NV{p.nvlinks}" for j in range(n)] for i in range(n)]
        else:
            assert p.pcie_matrix is not None
            matrix = [list(r) for r in p.pcie_matrix]
        return Discovery(backend=self.spec, simulated=True, driver_version=p.driver_version,
                         cuda_version=p.cuda_version, gpus=gpus, topology_matrix=matrix,
                         nvlink_domain=f"{cluster}/{clique}" if p.fabric else None)

    def poll(self) -> list[GpuSample]:
        p = self.profile
        out = []
        with self._lock:
            now = self._clock()
            dt, self._last_poll = max(0.0, now - self._last_poll), now
            for u in self.uuids:
                r = self._raw[u]
                r.energy_mj += round(r.power_w * dt * 1000.0)
                if r.lost or r.reset_required:
                    out.append(GpuSample(uuid=u, lost=r.lost, reset_required=r.reset_required))
                    continue
                tel = GpuTelemetry(
                    temperature_c=r.temperature_c, temp_slowdown_c=p.temp_slowdown_c,
                    temp_shutdown_c=p.temp_shutdown_c, power_w=r.power_w, fb_used_mib=0,
                    fb_free_mib=p.memory_mib, util_pct=0.0, sm_clock_mhz=p.sm_clock_idle_mhz,
                    mem_clock_mhz=p.mem_clock_mhz, memory_temp_c=r.temperature_c + 3.0 if p.hbm else None,
                    energy_mj=r.energy_mj, enc_util_pct=0.0, dec_util_pct=0.0,
                    ecc_dbe_volatile=r.ecc_dbe, ecc_dbe_aggregate=r.ecc_dbe_agg, ecc_sbe_volatile=r.ecc_sbe,
                    remapped_rows_correctable=0, remapped_rows_uncorrectable=r.ecc_dbe_agg, remap_pending=r.remap_pending,
                    remap_failure=r.remap_failure, retired_pages=0,
                    retired_pages_pending=r.retired_pages_pending, throttle_reasons=r.throttle,
                    thermal_violation_ns=0, power_violation_ns=0, pcie_replay=r.pcie_replay,
                    nvlink_crc_errors=r.nvlink_crc if p.nvlinks else None,
                    nvlink_replay_errors=0 if p.nvlinks else None,
                    nvlink_recovery_errors=0 if p.nvlinks else None,
                    recovery_action=r.recovery_action)
                active = [k for k in range(p.nvlinks) if k not in r.links_down] if p.nvlinks else None
                out.append(GpuSample(uuid=u, telemetry=tel, nvlinks_active=active, fabric_health=r.fabric_health))
        return out

    def wait_events(self, timeout_ms: int) -> list[RawEvent]:
        try:
            first = self._events.get(timeout=max(0, timeout_ms) / 1000.0)
        except queue.Empty:
            return []
        out = [first]
        while len(out) < 256:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                break
        return out

    def inject(self, uuid: str, fault: Fault) -> None:
        if uuid not in self._raw:
            raise FaultError(f"no simulated GPU {uuid} on this host")
        p = self.profile
        # Validate everything before changing anything: a bad fault loses nothing.
        if fault.nvlink_down is not None and fault.nvlink_down >= p.nvlinks:
            raise FaultError(f"{p.name} GPUs have {p.nvlinks} NVLinks; no link {fault.nvlink_down}")
        if fault.fabric_health is not None and not p.fabric:
            raise FaultError(f"{p.name} has no NVLink fabric; fabric_health applies to gb200-nvl72")
        if fault.nvlink_errors is not None and not p.nvlinks:
            raise FaultError(f"{p.name} has no NVLink")
        events: list[RawEvent] = []
        with self._lock:
            if fault.clear:
                i = self.uuids.index(uuid)
                energy = self._raw[uuid].energy_mj      # a counter since "driver load": a clear keeps it
                self._raw[uuid] = self._baseline(i)
                self._raw[uuid].energy_mj = energy
                events.append(RawEvent(uuid=uuid, kind="reset", source="inject", detail="clear"))
            r = self._raw[uuid]
            if fault.xid is not None:
                events.append(RawEvent(uuid=uuid, kind="xid", value=fault.xid, source="inject"))
            if fault.ecc_dbe is not None:
                r.ecc_dbe += fault.ecc_dbe
                r.ecc_dbe_agg += fault.ecc_dbe
                events.append(RawEvent(uuid=uuid, kind="ecc_dbe", value=fault.ecc_dbe, source="inject"))
            if fault.ecc_sbe is not None:
                r.ecc_sbe += fault.ecc_sbe
            if fault.temperature_c is not None:
                r.temperature_c = fault.temperature_c
            if fault.throttle is not None:
                r.throttle = THROTTLE_BITS[fault.throttle]
            if fault.lost:
                r.lost = True
                events.append(RawEvent(uuid=uuid, kind="gpu_unavailable", source="inject"))
            if fault.reset_required:
                r.reset_required = True
            if fault.remap is not None:
                r.remap_pending = fault.remap == "pending"
                r.remap_failure = fault.remap == "failure"
            if fault.retired_pages_pending is not None:
                r.retired_pages_pending = fault.retired_pages_pending
            if fault.nvlink_down is not None:
                r.links_down.add(fault.nvlink_down)
            if fault.nvlink_errors is not None:
                r.nvlink_crc += fault.nvlink_errors
            if fault.pcie_replay is not None:
                r.pcie_replay += fault.pcie_replay
            if fault.recovery_action is not None:
                r.recovery_action = fault.recovery_action
                events.append(RawEvent(uuid=uuid, kind="recovery_action", value=fault.recovery_action,
                                       source="inject"))
            if fault.fabric_health is not None:
                r.fabric_health = fault.fabric_health
        for ev in events:
            self._events.put(ev)

    def close(self) -> None:
        self._closed = True


def parse_spec_options(rest: str) -> tuple[str, dict[str, str]]:
    """``gb200-nvl72,rack=r7`` -> ("gb200-nvl72", {"rack": "r7"})."""
    name, *opts = rest.split(",")
    out: dict[str, str] = {}
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep or not k or not v:
            raise GpuBackendError(f"bad simulated option {o!r}; expected key=value (e.g. rack=r7)")
        if k != "rack":
            raise GpuBackendError(f"unknown simulated option {k!r}; known: rack")
        out[k] = v
    return name, out

