"""The NVML backend, over the real ``pynvml`` module (nvidia-ml-py).

Every call is a blocking C call: the monitor runs :meth:`discover`, :meth:`poll`
and :meth:`wait_events` in worker threads with a bounded time. Per GPU and per
signal, NotSupported / FunctionNotFound mean "absent" (None, healthy); GpuIsLost
and ResetRequired from any call mark that GPU lost / needing reset and end its
poll; any other NVML error leaves the signal None and is listed in
``failed_signals`` (NoPermission, NotReady, Timeout, Unknown...). Nothing one GPU
does is fatal to the others.

The module is a constructor argument so tests and the benchmark can hand in a fake
(``testing/fake_pynvml.py``) that raises the real pynvml exception classes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pynvml

from scheduler_link.messages import GpuInfo, GpuTelemetry, NvLink

from .backend import Discovery, GpuBackend, GpuSample, RawEvent, cpulist, normalize_pci, topo_name
from .errors import GpuBackendError

log = logging.getLogger("herd.agent.gpus.nvml")

# Error codes (literals: pynvml's own constants are module globals we may not have in a fake).
E_UNINITIALIZED, E_INVALID_ARGUMENT, E_NOT_SUPPORTED, E_NO_PERMISSION = 1, 2, 3, 4
E_DRIVER_NOT_LOADED, E_TIMEOUT, E_LIBRARY_NOT_FOUND, E_FUNCTION_NOT_FOUND = 9, 10, 12, 13
E_GPU_IS_LOST, E_RESET_REQUIRED, E_OPERATING_SYSTEM, E_LIB_RM_MISMATCH = 15, 16, 17, 18
E_ARGUMENT_VERSION_MISMATCH = 25
ABSENT = frozenset({E_NOT_SUPPORTED, E_FUNCTION_NOT_FOUND})

EV_SBE, EV_DBE, EV_XID, EV_GPU_UNAVAILABLE, EV_RECOVERY = 0x1, 0x2, 0x8, 0x4000, 0x8000
WANTED_EVENTS = EV_DBE | EV_XID | EV_GPU_UNAVAILABLE | EV_RECOVERY
P2P_INDEX_NVLINK = 2            # NVML_P2P_CAPS_INDEX_NVLINK (READ is a tuple in pynvml: use literals)
FI_RECOVERY_ACTION = 230
# NVML has no memory sensor for nvmlDeviceGetTemperature (its sensor enum is GPU only); HBM
# temperature is a field value, NVML_FI_DEV_MEMORY_TEMP, as DCGM reads it. Read in the same
# nvmlDeviceGetFieldValues call as the recovery action (one C call, each field its own status).
FI_MEMORY_TEMP = 82
CLOCK_SM, CLOCK_MEM = 1, 2      # NVML_CLOCK_SM / NVML_CLOCK_MEM
MAX_LINKS = 36
FABRIC_COMPLETED = 3
FABRIC_HEALTH = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}

_INIT_CAUSES = {
    E_LIBRARY_NOT_FOUND: "LibraryNotFound (libnvidia-ml.so.1 is not installed on this host)",
    E_DRIVER_NOT_LOADED: "DriverNotLoaded (the NVIDIA kernel driver is not loaded)",
    E_NO_PERMISSION: "NoPermission (this user may not open the NVIDIA devices)",
    E_OPERATING_SYSTEM: "OperatingSystem (the OS blocked access to the NVIDIA devices: cgroup device rules?)",
    E_LIB_RM_MISMATCH: "LibRmVersionMismatch (NVML library and kernel driver versions differ: reload the driver)",
}


def _code(e: BaseException) -> int | None:
    return getattr(e, "value", None)


def unavailable_message(cause: str) -> str:
    from .simulated import PROFILES
    return (f"NVML is unavailable: {cause}; on a host without usable NVIDIA GPUs choose "
            f"--gpus simulated:PROFILE (profiles: {', '.join(sorted(PROFILES))})")


class _GpuGone(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.lost = code == E_GPU_IS_LOST


def _raise_if_gone(e: BaseException) -> None:
    """A lost GPU, or one that needs a reset, ends the read of that device: raise _GpuGone."""
    c = _code(e)
    if c in (E_GPU_IS_LOST, E_RESET_REQUIRED):
        raise _GpuGone(c) from None


@dataclass(slots=True)
class _Gpu:
    index: int
    uuid: str
    handle: Any
    links: list[int] = field(default_factory=list)   # link indices that exist
    fabric: bool = False


def _hkey(h: Any) -> int:
    try:
        v = ctypes.cast(h, ctypes.c_void_p).value
        return int(v) if v is not None else id(h)
    except (TypeError, ctypes.ArgumentError):
        return id(h)


def _field_value(v: Any) -> int | None:
    if getattr(v, "nvmlReturn", 0) != 0:
        return None
    name = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        int(getattr(v, "valueType", 1)), "uiVal")
    return int(getattr(v.value, name))


class NvmlBackend(GpuBackend):
    simulated = False

    def __init__(self, *, hostname: str = "", nvml: ModuleType | Any | None = None) -> None:
        self.spec = "nvml"
        self.hostname = hostname
        self._nvml: Any = nvml if nvml is not None else pynvml
        self._gpus: list[_Gpu] = []
        self._by_handle: dict[int, str] = {}
        self._event_set: Any = None
        self._last_wait_error: int | None = None
        self.event_wait_errors = 0
        self._closed = False
        try:
            self._nvml.nvmlInit()
        except pynvml.NVMLError as e:
            cause = _INIT_CAUSES.get(_code(e) or -1, f"{type(e).__name__} ({e})")
            raise GpuBackendError(unavailable_message(cause)) from None
        except OSError as e:  # a broken library file
            raise GpuBackendError(unavailable_message(f"LibraryNotFound ({e})")) from None

    # ------------------------------------------------------------ helpers

    def _soft(self, failed: list[str] | None, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call: absent -> None; lost/reset -> _GpuGone; other errors -> None, noted."""
        try:
            return fn(*args)
        except pynvml.NVMLError as e:
            _raise_if_gone(e)
            c = _code(e)
            if c not in ABSENT and failed is not None:
                failed.append(f"{name}:{type(e).__name__}")
            return None

    def _first(self, failed: list[str] | None, name: str, fns: tuple[str, ...], *args: Any) -> Any:
        """The first of several spellings the driver has (newer first); FunctionNotFound -> next."""
        for fn_name in fns:
            fn = getattr(self._nvml, fn_name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except pynvml.NVMLError as e:
                _raise_if_gone(e)
                c = _code(e)
                if c == E_FUNCTION_NOT_FOUND:
                    continue
                if c != E_NOT_SUPPORTED and failed is not None:
                    failed.append(f"{name}:{type(e).__name__}")
                return None
        return None

    def _fn(self, *names: str) -> Callable[..., Any] | None:
        for n in names:
            f = getattr(self._nvml, n, None)
            if f is not None:
                return f
        return None

    # ------------------------------------------------------------ discovery

    def discover(self) -> Discovery:
        n = self._nvml
        driver = self._soft(None, "driver", n.nvmlSystemGetDriverVersion)
        cuda_raw = self._soft(None, "cuda", n.nvmlSystemGetCudaDriverVersion)
        cuda = f"{cuda_raw // 1000}.{(cuda_raw % 1000) // 10}" if isinstance(cuda_raw, int) and cuda_raw else None
        try:
            count = int(n.nvmlDeviceGetCount())
        except pynvml.NVMLError as e:
            raise GpuBackendError(f"NVML cannot count GPUs: {type(e).__name__} ({e})") from None
        if count == 0:
            raise GpuBackendError(unavailable_message("NVML sees no GPUs on this host"))
        infos: list[GpuInfo] = []
        gpus: list[_Gpu] = []
        unanswered: list[str] = []
        for i in range(count):
            try:
                info, g = self._discover_one(i)
            except _GpuGone as e:
                why = "lost" if e.lost else "reset required"
                log.warning("gpu index=%d skipped at discovery: %s", i, why)
                unanswered.append(f"index {i}: {why}")
                continue
            except pynvml.NVMLError as e:
                why = {E_GPU_IS_LOST: "lost", E_RESET_REQUIRED: "reset required"}.get(_code(e) or 0,
                                                                                   type(e).__name__)
                log.warning("gpu index=%d skipped at discovery: %s", i, why)
                unanswered.append(f"index {i}: {why}")
                continue
            infos.append(info)
            gpus.append(g)
        if not gpus:
            raise GpuBackendError(unavailable_message(f"none of the {count} GPUs NVML counts answers"))
        self._gpus = gpus
        self._by_handle = {_hkey(g.handle): g.uuid for g in gpus}
        matrix = self._matrix(infos)
        domains = {(x.fabric_cluster_uuid, x.fabric_clique_id) for x in infos if x.fabric_cluster_uuid}
        domain = None
        if domains:
            c, q = sorted(domains, key=str)[0]
            domain = f"{c}/{q}"
            if len(domains) > 1:
                log.warning("gpus report %d NVLink fabric domains; reporting %s", len(domains), domain)
        self._open_events()
        return Discovery(backend=self.spec, simulated=False, driver_version=driver, cuda_version=cuda,
                         gpus=infos, topology_matrix=matrix, nvlink_domain=domain, unanswered=unanswered)

    def _discover_one(self, i: int) -> tuple[GpuInfo, _Gpu]:
        n = self._nvml
        h = n.nvmlDeviceGetHandleByIndex(i)
        uuid = str(n.nvmlDeviceGetUUID(h))
        name = str(n.nvmlDeviceGetName(h))
        s = self._soft
        mem = s(None, "memory", n.nvmlDeviceGetMemoryInfo, h)
        pci = s(None, "pci", n.nvmlDeviceGetPciInfo, h)
        bus = normalize_pci(str(pci.busId)) if pci is not None else None
        serial = s(None, "serial", n.nvmlDeviceGetSerial, h)
        minor = s(None, "minor", n.nvmlDeviceGetMinorNumber, h)
        numa = s(None, "numa", n.nvmlDeviceGetNumaNodeId, h) if hasattr(n, "nvmlDeviceGetNumaNodeId") else None
        words = max(16, ((os.cpu_count() or 64) + 63) // 64)   # >= 1024 CPUs; more words are harmless
        if numa is None and hasattr(n, "nvmlDeviceGetMemoryAffinity"):
            # Older drivers: the NUMA node(s) nearest the GPU as a node bitmask (scope 0 = NUMA node).
            nodes = s(None, "memory_affinity", n.nvmlDeviceGetMemoryAffinity, h, 4, 0)
            bits = [w * 64 + b for w, word in enumerate(nodes or []) for b in range(64) if (int(word) >> b) & 1]
            numa = bits[0] if bits else None
        aff = s(None, "cpu_affinity", n.nvmlDeviceGetCpuAffinity, h, words)
        mig = s(None, "mig", n.nvmlDeviceGetMigMode, h)
        slow = s(None, "temp_slowdown", n.nvmlDeviceGetTemperatureThreshold, h, 1)
        shut = s(None, "temp_shutdown", n.nvmlDeviceGetTemperatureThreshold, h, 0)
        links: list[NvLink] = []
        for link in range(MAX_LINKS):
            try:
                st = n.nvmlDeviceGetNvLinkState(h, link)
            except pynvml.NVMLError as e:
                _raise_if_gone(e)
                break   # NotSupported / InvalidArgument: no more links (or no NVLink at all)
            rp = s(None, "nvlink_remote_pci", n.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            rt = s(None, "nvlink_remote_type", n.nvmlDeviceGetNvLinkRemoteDeviceType, h, link) \
                if hasattr(n, "nvmlDeviceGetNvLinkRemoteDeviceType") else None
            links.append(NvLink(link=link, active=bool(st),
                                remote_pci_bus_id=normalize_pci(str(rp.busId)) if rp is not None else None,
                                remote_type={0: "gpu", 2: "switch"}.get(rt, "unknown")))  # type: ignore[arg-type]  # NVML's link type is an int or None at run time; the map gives one of the Literal's
        cluster, clique, fhealth = self._fabric(h)
        info = GpuInfo(
            index=i, uuid=uuid, name=name,
            memory_total_mib=int(mem.total // (1 << 20)) if mem is not None else 0,
            pci_bus_id=bus or "", serial=str(serial) if serial else None,
            minor_number=int(minor) if minor is not None else None,
            numa_node=int(numa) if numa is not None and int(numa) >= 0 else None,
            cpu_affinity=cpulist([int(w) for w in aff]) if aff is not None else None,
            mig_mode_current=int(mig[0]) if mig is not None else None,
            mig_mode_pending=int(mig[1]) if mig is not None else None,
            nvlinks=links, fabric_cluster_uuid=cluster, fabric_clique_id=clique, fabric_health=fhealth,
            telemetry=GpuTelemetry(temp_slowdown_c=float(slow) if slow is not None else None,
                                   temp_shutdown_c=float(shut) if shut is not None else None))
        return info, _Gpu(index=i, uuid=uuid, handle=h, links=[x.link for x in links],
                          fabric=cluster is not None or fhealth is not None)

    def _fabric(self, h: Any) -> tuple[str | None, int | None, str | None]:
        """(clusterUuid, cliqueId, health) of an NVL72-class GPU; Nones elsewhere / on old drivers."""
        fn = self._fn("nvmlDeviceGetGpuFabricInfoV")
        if fn is None:
            return None, None, None
        info: Any = None
        for struct in (pynvml.c_nvmlGpuFabricInfo_v3_t, pynvml.c_nvmlGpuFabricInfo_v2_t):
            info = struct()
            try:
                fn(h, ctypes.byref(info))   # pynvml hands the pointer straight to C
                break
            except pynvml.NVMLError as e:
                _raise_if_gone(e)
                if _code(e) == E_ARGUMENT_VERSION_MISMATCH:
                    continue            # a driver that knows v2 only
                return None, None, None    # FunctionNotFound (driver < 550), NotSupported (no fabric)
        else:
            return None, None, None
        state = int(info.state)
        if state in (1, 2):                # not started / in progress: NVLink not usable yet
            return None, None, "not_ready"
        if state != FABRIC_COMPLETED:      # 0: this GPU has no fabric (not an NVL72-class system)
            return None, None, None
        if int(info.status) != 0:          # registration with the fabric manager failed
            return None, None, "unhealthy"
        raw = bytes(info.clusterUuid)
        if not any(raw):
            return None, None, None
        health = FABRIC_HEALTH.get(int(getattr(info, "healthSummary", 1) or 1))
        return str(uuidlib.UUID(bytes=raw)), int(info.cliqueId), health

    def _matrix(self, infos: list[GpuInfo]) -> list[list[str]]:
        n = self._nvml
        by_bus = {x.pci_bus_id: k for k, x in enumerate(infos)}
        handles = [g.handle for g in self._gpus]
        out: list[list[str]] = []
        switch_links = [sum(1 for ln in x.nvlinks if ln.active and ln.remote_pci_bus_id not in by_bus
                            and ln.remote_type != "gpu") for x in infos]
        for i, a in enumerate(infos):
            row = []
            for j, b in enumerate(infos):
                if i == j:
                    row.append("X")
                    continue
                direct = sum(1 for ln in a.nvlinks if ln.active and ln.remote_pci_bus_id == b.pci_bus_id)
                if direct:
                    row.append(f"NV{direct}")
                    continue
                if switch_links[i] and switch_links[j]:
                    try:
                        st = n.nvmlDeviceGetP2PStatus(handles[i], handles[j], P2P_INDEX_NVLINK)
                    except pynvml.NVMLError:
                        st = None
                    if st == 0:
                        row.append(f"NV{min(switch_links[i], switch_links[j])}")
                        continue
                try:
                    lvl = n.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                except pynvml.NVMLError:
                    lvl = None
                row.append(topo_name(lvl))
            out.append(row)
        return out

    # ------------------------------------------------------------ events

    def _open_events(self) -> None:
        n = self._nvml
        try:
            es = n.nvmlEventSetCreate()
        except pynvml.NVMLError as e:
            log.warning("nvml event set unavailable (%s): XIDs come only from polls and the kernel log",
                        type(e).__name__)
            return
        registered = 0
        for g in self._gpus:
            try:
                mask = int(n.nvmlDeviceGetSupportedEventTypes(g.handle)) & WANTED_EVENTS
                if mask:
                    n.nvmlDeviceRegisterEvents(g.handle, mask, es)
                    registered += 1
            except pynvml.NVMLError as e:
                log.warning("gpu=%s events not registered: %s", g.uuid, type(e).__name__)
        self._event_set = es
        log.info("nvml events registered gpus=%d", registered)

    def wait_events(self, timeout_ms: int) -> list[RawEvent]:
        n = self._nvml
        if self._event_set is None or self._closed:
            time.sleep(max(0, timeout_ms) / 1000.0)
            return []
        out: list[RawEvent] = []
        wait = max(0, int(timeout_ms))
        while len(out) < 64:
            try:
                data = n.nvmlEventSetWait(self._event_set, wait)
            except pynvml.NVMLError as e:
                if _code(e) != E_TIMEOUT and not out:
                    if _code(e) != self._last_wait_error:    # log each new failure once, not every wait
                        log.warning("nvml event wait failed: %s", type(e).__name__)
                    self._last_wait_error = _code(e)
                    self.event_wait_errors += 1
                    time.sleep(max(0, timeout_ms) / 1000.0)
                break
            self._last_wait_error = None
            ev = self._event(data)
            if ev is not None:
                out.append(ev)
            wait = 0   # drain what is already queued, then return
        return out

    def _event(self, data: Any) -> RawEvent | None:
        uuid = self._by_handle.get(_hkey(data.device))
        et = int(data.eventType)
        val = int(data.eventData)
        if et & EV_XID:
            return RawEvent(uuid=uuid, kind="xid", value=val)
        if et & EV_DBE:
            return RawEvent(uuid=uuid, kind="ecc_dbe", value=1)
        if et & EV_GPU_UNAVAILABLE:
            return RawEvent(uuid=uuid, kind="gpu_unavailable")
        if et & EV_RECOVERY:
            return RawEvent(uuid=uuid, kind="recovery_action", value=val)
        if et & EV_SBE:
            return RawEvent(uuid=uuid, kind="ecc_sbe", value=1)
        return None

    # ------------------------------------------------------------ polls

    def poll(self) -> list[GpuSample]:
        return [self._poll_one(g) for g in self._gpus]

    def _poll_one(self, g: _Gpu) -> GpuSample:
        failed: list[str] = []
        try:
            return self._read(g, failed)
        except _GpuGone as e:
            return GpuSample(uuid=g.uuid, lost=e.lost, reset_required=not e.lost, failed_signals=failed)

    def _read(self, g: _Gpu, failed: list[str]) -> GpuSample:
        n = self._nvml
        h = g.handle
        s = self._soft
        temp = self._first(failed, "temperature", ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"), h, 0)
        power = s(failed, "power", n.nvmlDeviceGetPowerUsage, h)
        mem = s(failed, "memory", n.nvmlDeviceGetMemoryInfo, h)
        util = s(failed, "utilization", n.nvmlDeviceGetUtilizationRates, h)
        sm_clock = s(failed, "sm_clock", n.nvmlDeviceGetClockInfo, h, CLOCK_SM)
        mem_clock = s(failed, "mem_clock", n.nvmlDeviceGetClockInfo, h, CLOCK_MEM)
        energy = s(failed, "energy", n.nvmlDeviceGetTotalEnergyConsumption, h)   # mJ, Volta and later
        enc = s(failed, "encoder_utilization", n.nvmlDeviceGetEncoderUtilization, h)   # [util, period us]
        dec = s(failed, "decoder_utilization", n.nvmlDeviceGetDecoderUtilization, h)
        dbe_v = s(failed, "ecc_dbe_volatile", n.nvmlDeviceGetTotalEccErrors, h, 1, 0)
        dbe_a = s(failed, "ecc_dbe_aggregate", n.nvmlDeviceGetTotalEccErrors, h, 1, 1)
        sbe_v = s(failed, "ecc_sbe_volatile", n.nvmlDeviceGetTotalEccErrors, h, 0, 0)
        rows = s(failed, "remapped_rows", n.nvmlDeviceGetRemappedRows, h)
        ret_sbe = s(failed, "retired_pages", n.nvmlDeviceGetRetiredPages, h, 0)
        ret_dbe = s(failed, "retired_pages", n.nvmlDeviceGetRetiredPages, h, 1) if ret_sbe is not None else None
        ret_pend = s(failed, "retired_pages_pending", n.nvmlDeviceGetRetiredPagesPendingStatus, h)
        throttle = self._first(failed, "throttle", ("nvmlDeviceGetCurrentClocksEventReasons",
                                                    "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
        v_pow = s(failed, "power_violation", n.nvmlDeviceGetViolationStatus, h, 0)
        v_th = s(failed, "thermal_violation", n.nvmlDeviceGetViolationStatus, h, 1)
        pcie = s(failed, "pcie_replay", n.nvmlDeviceGetPcieReplayCounter, h)
        fv = s(failed, "field_values", n.nvmlDeviceGetFieldValues, h, [FI_RECOVERY_ACTION, FI_MEMORY_TEMP])
        recovery = _field_value(fv[0]) if fv is not None else None
        mem_temp = _field_value(fv[1]) if fv is not None and len(fv) > 1 else None
        active: list[int] | None = None
        crc = replay = link_recovery = None
        if g.links:
            active = []
            crc = replay = link_recovery = 0
            for link in g.links:
                if s(failed, "nvlink_state", n.nvmlDeviceGetNvLinkState, h, link):
                    active.append(link)
                rep = s(None, "nvlink_errors", n.nvmlDeviceGetNvLinkErrorCounter, h, link, 0)
                rec = s(None, "nvlink_errors", n.nvmlDeviceGetNvLinkErrorCounter, h, link, 1)
                flit = s(None, "nvlink_errors", n.nvmlDeviceGetNvLinkErrorCounter, h, link, 2)
                data = s(None, "nvlink_errors", n.nvmlDeviceGetNvLinkErrorCounter, h, link, 3)
                replay += int(rep or 0)
                link_recovery += int(rec or 0)
                crc += int(flit or 0) + int(data or 0)
        fabric_health = None
        if g.fabric:
            _, _, fabric_health = self._fabric(h)
        tel = GpuTelemetry(
            temperature_c=float(temp) if temp is not None else None,
            power_w=float(power) / 1000.0 if power is not None else None,
            fb_used_mib=int(mem.used // (1 << 20)) if mem is not None else None,
            fb_free_mib=int(mem.free // (1 << 20)) if mem is not None else None,
            util_pct=float(util.gpu) if util is not None else None,
            sm_clock_mhz=int(sm_clock) if sm_clock is not None else None,
            mem_clock_mhz=int(mem_clock) if mem_clock is not None else None,
            memory_temp_c=float(mem_temp) if mem_temp is not None else None,
            energy_mj=int(energy) if energy is not None else None,
            enc_util_pct=float(enc[0]) if enc is not None else None,
            dec_util_pct=float(dec[0]) if dec is not None else None,
            ecc_dbe_volatile=int(dbe_v) if dbe_v is not None else None,
            ecc_dbe_aggregate=int(dbe_a) if dbe_a is not None else None,
            ecc_sbe_volatile=int(sbe_v) if sbe_v is not None else None,
            remapped_rows_correctable=int(rows[0]) if rows is not None else None,
            remapped_rows_uncorrectable=int(rows[1]) if rows is not None else None,
            remap_pending=bool(rows[2]) if rows is not None else None,
            remap_failure=bool(rows[3]) if rows is not None else None,
            retired_pages=len(ret_sbe) + len(ret_dbe or []) if ret_sbe is not None else None,
            retired_pages_pending=bool(ret_pend) if ret_pend is not None else None,
            throttle_reasons=int(throttle) if throttle is not None else None,
            thermal_violation_ns=int(v_th.violationTime) if v_th is not None else None,
            power_violation_ns=int(v_pow.violationTime) if v_pow is not None else None,
            pcie_replay=int(pcie) if pcie is not None else None,
            nvlink_crc_errors=crc, nvlink_replay_errors=replay, nvlink_recovery_errors=link_recovery,
            recovery_action=recovery)
        return GpuSample(uuid=g.uuid, telemetry=tel, nvlinks_active=active, fabric_health=fabric_health,
                         failed_signals=failed)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except pynvml.NVMLError:
                pass
            self._event_set = None
        try:
            self._nvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
