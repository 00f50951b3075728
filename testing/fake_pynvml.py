"""A fake ``pynvml`` for tests and the benchmark: an honest, small implementation of
the NVML calls agent/gpus/nvml.py makes, over an in-memory host description. It
raises the REAL pynvml exception classes (``pynvml.NVMLError(code)`` returns the
subclass, e.g. NVMLError_NotSupported), so the backend's error handling is the
one production runs.

Knobs a test turns: ``init_error`` (LibraryNotFound, DriverNotLoaded...), per GPU
``unsupported`` (function names answering NotSupported), ``missing`` (functions
answering FunctionNotFound, as on an old driver), ``lost`` / ``reset_required``
(every call on that GPU fails), raw counters, and ``emit(index, type, data)`` to
queue an event for ``nvmlEventSetWait``.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import uuid as uuidlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NVMLError = pynvml.NVMLError
c_nvmlGpuFabricInfo_v3_t = pynvml.c_nvmlGpuFabricInfo_v3_t

NOT_SUPPORTED, FUNCTION_NOT_FOUND, TIMEOUT, GPU_IS_LOST, RESET_REQUIRED = 3, 13, 10, 15, 16
INVALID_ARGUMENT, UNINITIALIZED = 2, 1


@dataclass(eq=False)
class FakeGpu:
    index: int
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    memory_mib: int = 81559
    bus_id: str = "00000000:18:00.0"
    serial: str = "1650123456789"
    numa: int = 0
    cpu_words: tuple[int, ...] = (0xFFFFFFFFFFFFFF,)
    mig: tuple[int, int] = (0, 0)
    links: list[tuple[bool, str, int]] = field(default_factory=list)   # (active, remote bus id, remote type)
    fabric: dict[str, Any] | None = None     # cluster (uuid str), clique, state, status, health
    temperature: int = 35
    slowdown: int = 89
    shutdown: int = 92
    power_mw: int = 72000
    used_mib: int = 0
    util: int = 0
    sm_clock: int = 345             # MHz
    mem_clock: int = 2619           # MHz
    memory_temp: int | None = 33    # the NVML_FI_DEV_MEMORY_TEMP field; None: NotSupported (GDDR boards)
    energy_mj: int = 9_876_543_210_123   # above 2**32, as after weeks of uptime
    enc_util: int = 0
    dec_util: int = 0
    ecc_dbe_vol: int = 0
    ecc_dbe_agg: int = 0
    ecc_sbe_vol: int = 0
    remapped: tuple[int, int, int, int] = (0, 0, 0, 0)   # correctable, uncorrectable, pending, failure
    retired_pending: int = 0
    throttle: int = 0
    pcie_replay: int = 0
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    recovery_action: int = 0
    supported_events: int = 0x8 | 0x2 | 0x1 | 0x4000 | 0x8000
    unsupported: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    lost: bool = False
    reset_required: bool = False


class FakeHandle:
    """Opaque like c_nvmlDevice_t; ctypes.cast refuses it, so the backend keys it by id()."""
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class FakeNvml:
    def __init__(self, gpus: list[FakeGpu], *, topo: list[list[int]] | None = None,
                 init_error: int | None = None, driver: str = "570.86.15", cuda: int = 12080,
                 missing: set[str] | None = None, no_events: bool = False) -> None:
        self.gpus = gpus
        self.handles = [FakeHandle(g.index) for g in gpus]
        self.topo = topo
        self.init_error = init_error
        self.driver = driver
        self.cuda = cuda
        self.global_missing = set(missing or ())
        self.no_events = no_events
        self.initialized = False
        self.calls = 0
        self.events: queue.SimpleQueue[SimpleNamespace] = queue.SimpleQueue()
        self.event_sets: list[object] = []
        self.registered: dict[int, int] = {}
        self.lock = threading.Lock()

    # ------------------------------------------------------------ plumbing

    def __getattr__(self, name: str) -> Any:
        # Functions the fake does not implement do not exist (hasattr() -> False), like
        # symbols absent from an old pynvml.
        raise AttributeError(name)

    def _check(self, fn: str, h: FakeHandle | None = None) -> FakeGpu | None:
        self.calls += 1
        if not self.initialized:
            raise NVMLError(UNINITIALIZED)
        if fn in self.global_missing:
            raise NVMLError(FUNCTION_NOT_FOUND)
        if h is None:
            return None
        g = self.gpus[h.index]
        if g.lost:
            raise NVMLError(GPU_IS_LOST)
        if g.reset_required:
            raise NVMLError(RESET_REQUIRED)
        if fn in g.missing:
            raise NVMLError(FUNCTION_NOT_FOUND)
        if fn in g.unsupported:
            raise NVMLError(NOT_SUPPORTED)
        return g

    def emit(self, index: int, event_type: int, data: int = 0) -> None:
        self.events.put(SimpleNamespace(device=self.handles[index], eventType=event_type, eventData=data,
                                        gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF))

    # ------------------------------------------------------------ library / system

    def nvmlInit(self) -> None:
        self.calls += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._check("nvmlSystemGetCudaDriverVersion")
        return self.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeHandle:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.gpus):
            raise NVMLError(INVALID_ARGUMENT)
        return self.handles[i]

    # ------------------------------------------------------------ identity

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        g = self._check("nvmlDeviceGetUUID", h)
        assert g is not None
        return g.uuid

    def nvmlDeviceGetName(self, h: FakeHandle) -> str:
        g = self._check("nvmlDeviceGetName", h)
        assert g is not None
        return g.name

    def nvmlDeviceGetMemoryInfo(self, h: FakeHandle) -> SimpleNamespace:
        g = self._check("nvmlDeviceGetMemoryInfo", h)
        assert g is not None
        total = g.memory_mib << 20
        return SimpleNamespace(total=total, used=g.used_mib << 20, free=total - (g.used_mib << 20))

    def nvmlDeviceGetPciInfo(self, h: FakeHandle) -> SimpleNamespace:
        g = self._check("nvmlDeviceGetPciInfo", h)
        assert g is not None
        return SimpleNamespace(busId=g.bus_id)

    def nvmlDeviceGetSerial(self, h: FakeHandle) -> str:
        g = self._check("nvmlDeviceGetSerial", h)
        assert g is not None
        return g.serial

    def nvmlDeviceGetMinorNumber(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetMinorNumber", h)
        assert g is not None
        return g.index

    def nvmlDeviceGetNumaNodeId(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetNumaNodeId", h)
        assert g is not None
        return g.numa

    def nvmlDeviceGetMemoryAffinity(self, h: FakeHandle, words: int, scope: int) -> list[int]:
        g = self._check("nvmlDeviceGetMemoryAffinity", h)
        assert g is not None
        return [1 << g.numa] + [0] * (words - 1)

    def nvmlDeviceGetCpuAffinity(self, h: FakeHandle, words: int) -> list[int]:
        g = self._check("nvmlDeviceGetCpuAffinity", h)
        assert g is not None
        return list(g.cpu_words[:words]) + [0] * max(0, words - len(g.cpu_words))

    def nvmlDeviceGetMigMode(self, h: FakeHandle) -> list[int]:
        g = self._check("nvmlDeviceGetMigMode", h)
        assert g is not None
        return list(g.mig)

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeHandle, which: int) -> int:
        g = self._check("nvmlDeviceGetTemperatureThreshold", h)
        assert g is not None
        return {0: g.shutdown, 1: g.slowdown}[which]

    # ------------------------------------------------------------ topology

    def _link(self, fn: str, h: FakeHandle, link: int) -> tuple[bool, str, int]:
        g = self._check(fn, h)
        assert g is not None
        if not g.links:
            raise NVMLError(NOT_SUPPORTED)
        if not 0 <= link < len(g.links):
            raise NVMLError(INVALID_ARGUMENT)
        return g.links[link]

    def nvmlDeviceGetNvLinkState(self, h: FakeHandle, link: int) -> int:
        return int(self._link("nvmlDeviceGetNvLinkState", h, link)[0])

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: FakeHandle, link: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._link("nvmlDeviceGetNvLinkRemotePciInfo", h, link)[1])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: FakeHandle, link: int) -> int:
        return self._link("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)[2]

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeHandle, link: int, counter: int) -> int:
        self._link("nvmlDeviceGetNvLinkErrorCounter", h, link)
        return self.gpus[h.index].nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetP2PStatus(self, a: FakeHandle, b: FakeHandle, index: int) -> int:
        ga = self._check("nvmlDeviceGetP2PStatus", a)
        gb = self._check("nvmlDeviceGetP2PStatus", b)
        assert ga is not None and gb is not None
        if not isinstance(index, int):
            raise TypeError("p2p index must be an int (pynvml's NVML_P2P_CAPS_INDEX_READ is a tuple)")
        both = any(x[0] for x in ga.links) and any(x[0] for x in gb.links)
        return 0 if index == 2 and both else 4  # NVML_P2P_STATUS_OK / _NOT_SUPPORTED

    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeHandle, b: FakeHandle) -> int:
        ga = self._check("nvmlDeviceGetTopologyCommonAncestor", a)
        gb = self._check("nvmlDeviceGetTopologyCommonAncestor", b)
        assert ga is not None and gb is not None
        if self.topo is not None:
            return self.topo[a.index][b.index]
        return 40 if ga.numa == gb.numa else 50

    def nvmlDeviceGetGpuFabricInfoV(self, h: FakeHandle, ref: Any) -> int:
        g = self._check("nvmlDeviceGetGpuFabricInfoV", h)
        assert g is not None
        if g.fabric is None:
            raise NVMLError(NOT_SUPPORTED)
        info = ref._obj          # pynvml hands the byref() straight to C; we fill the struct
        assert isinstance(info, c_nvmlGpuFabricInfo_v3_t | pynvml.c_nvmlGpuFabricInfo_v2_t), \
            "pass ctypes.byref(c_nvmlGpuFabricInfo_v3_t())"
        if isinstance(info, c_nvmlGpuFabricInfo_v3_t) and g.fabric.get("v2_only"):
            raise NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        raw = uuidlib.UUID(g.fabric["cluster"]).bytes
        ctypes.memmove(ctypes.addressof(info.clusterUuid), raw, 16)
        info.cliqueId = g.fabric["clique"]
        info.state = g.fabric.get("state", 3)
        info.status = g.fabric.get("status", 0)
        if isinstance(info, c_nvmlGpuFabricInfo_v3_t):
            info.healthSummary = g.fabric.get("health", 1)
        return 0

    # ------------------------------------------------------------ health

    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        g = self._check("nvmlDeviceGetTemperature", h)
        assert g is not None
        return g.temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetPowerUsage", h)
        assert g is not None
        return g.power_mw

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> SimpleNamespace:
        g = self._check("nvmlDeviceGetUtilizationRates", h)
        assert g is not None
        return SimpleNamespace(gpu=g.util, memory=0)

    def nvmlDeviceGetClockInfo(self, h: FakeHandle, clock_type: int) -> int:
        g = self._check("nvmlDeviceGetClockInfo", h)
        assert g is not None
        clocks = {0: g.sm_clock, 1: g.sm_clock, 2: g.mem_clock}   # GRAPHICS, SM, MEM (VIDEO: not modelled)
        if clock_type not in clocks:
            raise NVMLError(INVALID_ARGUMENT)
        return clocks[clock_type]

    def nvmlDeviceGetTotalEnergyConsumption(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        assert g is not None
        return g.energy_mj

    def nvmlDeviceGetEncoderUtilization(self, h: FakeHandle) -> list[int]:
        g = self._check("nvmlDeviceGetEncoderUtilization", h)
        assert g is not None
        return [g.enc_util, 167000]     # [utilization %, sampling period us], as pynvml returns

    def nvmlDeviceGetDecoderUtilization(self, h: FakeHandle) -> list[int]:
        g = self._check("nvmlDeviceGetDecoderUtilization", h)
        assert g is not None
        return [g.dec_util, 167000]

    def nvmlDeviceGetTotalEccErrors(self, h: FakeHandle, error_type: int, counter_type: int) -> int:
        g = self._check("nvmlDeviceGetTotalEccErrors", h)
        assert g is not None
        if error_type == 1:
            return g.ecc_dbe_vol if counter_type == 0 else g.ecc_dbe_agg
        return g.ecc_sbe_vol

    def nvmlDeviceGetRemappedRows(self, h: FakeHandle) -> tuple[int, int, int, int]:
        g = self._check("nvmlDeviceGetRemappedRows", h)
        assert g is not None
        return g.remapped

    def nvmlDeviceGetRetiredPages(self, h: FakeHandle, cause: int) -> list[int]:
        self._check("nvmlDeviceGetRetiredPages", h)
        return []

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetRetiredPagesPendingStatus", h)
        assert g is not None
        return g.retired_pending

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetCurrentClocksEventReasons", h)
        assert g is not None
        return g.throttle

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeHandle) -> int:
        """The pre-535 spelling of the same call."""
        g = self._check("nvmlDeviceGetCurrentClocksThrottleReasons", h)
        assert g is not None
        return g.throttle

    def nvmlDeviceGetViolationStatus(self, h: FakeHandle, policy: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetViolationStatus", h)
        return SimpleNamespace(referenceTime=0, violationTime=0)

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetPcieReplayCounter", h)
        assert g is not None
        return g.pcie_replay

    def nvmlDeviceGetFieldValues(self, h: FakeHandle, ids: list[int]) -> list[SimpleNamespace]:
        g = self._check("nvmlDeviceGetFieldValues", h)
        assert g is not None
        known = {230: g.recovery_action, 82: g.memory_temp}   # recovery action, memory temperature
        out = []
        for fid in ids:
            if known.get(fid) is not None:
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0, valueType=1,
                                           value=SimpleNamespace(uiVal=known[fid])))
            else:
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=NOT_SUPPORTED, valueType=1,
                                           value=SimpleNamespace(uiVal=0)))
        return out

    # ------------------------------------------------------------ events

    def nvmlEventSetCreate(self) -> object:
        self._check("nvmlEventSetCreate")
        if self.no_events:
            raise NVMLError(NOT_SUPPORTED)
        es = object()
        self.event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeHandle) -> int:
        g = self._check("nvmlDeviceGetSupportedEventTypes", h)
        assert g is not None
        return g.supported_events

    def nvmlDeviceRegisterEvents(self, h: FakeHandle, mask: int, es: object) -> None:
        self._check("nvmlDeviceRegisterEvents", h)
        self.registered[h.index] = mask

    def nvmlEventSetWait(self, es: object, timeout_ms: int) -> SimpleNamespace:
        self._check("nvmlEventSetWait")
        try:
            return self.events.get(timeout=timeout_ms / 1000.0) if timeout_ms else self.events.get_nowait()
        except queue.Empty:
            raise NVMLError(TIMEOUT) from None

    def nvmlEventSetFree(self, es: object) -> None:
        self._check("nvmlEventSetFree")
        self.event_sets.remove(es)


# ---------------------------------------------------------------- ready-made hosts

def _uuid(i: int, tag: str = "fake") -> str:
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{tag}-{i}"))


H100_BUS = ("00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0", "00000000:5D:00.0",
            "00000000:9A:00.0", "00000000:AB:00.0", "00000000:BA:00.0", "00000000:DB:00.0")


def h100_node(n: int = 8, links: int = 18) -> FakeNvml:
    """An HGX H100 node: ``links`` NVLinks per GPU, all to NVSwitches (remote type 2)."""
    gpus = [FakeGpu(index=i, uuid=_uuid(i, "h100"), bus_id=H100_BUS[i], numa=0 if i < n // 2 else 1,
                    cpu_words=(0xFFFFFFFFFFFFFF, 0) if i < n // 2 else (0xFF00000000000000, 0xFFFFFFFFFFFF),
                    links=[(True, f"00000000:{0x80 + k:02X}:00.0", 2) for k in range(links)])
            for i in range(n)]
    return FakeNvml(gpus)


def pcie_node(n: int = 2) -> FakeNvml:
    """GPUs without NVLink (NvLinkState answers NotSupported), no MIG, no fabric."""
    gpus = [FakeGpu(index=i, uuid=_uuid(i, "l40s"), name="NVIDIA L40S", memory_mib=46068,
                    bus_id=f"00000000:{0x21 + 0x20 * i:02X}:00.0", numa=i % 2, sm_clock=210, mem_clock=9001,
                    memory_temp=None, unsupported={"nvmlDeviceGetMigMode", "nvmlDeviceGetRemappedRows"})
            for i in range(n)]
    return FakeNvml(gpus, topo=[[0 if i == j else 20 for j in range(n)] for i in range(n)])


def gb200_tray(*, old_driver: bool = False, cluster: str = "5b1c3a3e-0c7e-4f0e-9a53-3d2f4c8a9e11",
               clique: int = 4242) -> FakeNvml:
    """A GB200 NVL72 compute tray; ``old_driver`` makes the fabric call FunctionNotFound."""
    fabric = {"cluster": cluster, "clique": clique, "state": 3, "status": 0, "health": 1}
    gpus = [FakeGpu(index=i, uuid=_uuid(i, "gb200"), name="NVIDIA GB200", memory_mib=189471,
                    bus_id=f"{8 + i % 2 + (16 if i >= 2 else 0):08X}:01:00.0",
                    numa=i // 2, links=[(True, f"00000000:{0xA0 + k:02X}:00.0", 2) for k in range(18)],
                    fabric=None if old_driver else dict(fabric)) for i in range(4)]
    return FakeNvml(gpus, missing={"nvmlDeviceGetGpuFabricInfoV"} if old_driver else None)
