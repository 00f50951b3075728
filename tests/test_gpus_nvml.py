"""The NVML backend against testing/fake_pynvml.py, which raises the real pynvml
exception classes: init failures, a GPU without NVLink, an old driver without
fabric info, a GPU lost mid-run, event-wait timeouts, XID events."""

from __future__ import annotations

import ctypes.util
import time

import pynvml
import pytest
import trio

from agent.gpus import Fault, GpuBackendError, GpuMonitor, HealthConfig, open_backend, render_metrics
from agent.gpus.nvml import NvmlBackend
from testing.fake_pynvml import FakeNvml, gb200_tray, h100_node, pcie_node
from tests.prom import types, value


def nvml(fake: FakeNvml) -> NvmlBackend:
    b = open_backend("nvml", hostname="fakehost", nvml_module=fake)
    assert isinstance(b, NvmlBackend)
    return b


def test_fake_raises_the_real_exception_classes():
    f = pcie_node(1)
    f.nvmlInit()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceGetNvLinkState(f.handles[0], 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        f.nvmlDeviceGetMigMode(f.handles[0])
    f.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        f.nvmlDeviceGetTemperature(f.handles[0], 0)


@pytest.mark.parametrize("code,cause", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "LibraryNotFound"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "DriverNotLoaded"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "NoPermission"),
    (pynvml.NVML_ERROR_OPERATING_SYSTEM, "OperatingSystem"),
    (pynvml.NVML_ERROR_UNKNOWN, "NVMLError_Unknown"),
])
def test_init_failure_is_one_clear_line_naming_the_cause(code, cause):
    f = h100_node()
    f.init_error = code
    with pytest.raises(GpuBackendError) as e:
        nvml(f)
    msg = str(e.value)
    assert cause in msg and "--gpus simulated:PROFILE" in msg and "dgx-h100" in msg and "\n" not in msg


def test_the_real_pynvml_on_a_host_without_a_driver():
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this host has an NVML library")
    with pytest.raises(GpuBackendError, match=r"LibraryNotFound .*--gpus simulated:PROFILE"):
        open_backend("nvml")


def test_h100_node_inventory_topology_and_events_registered():
    f = h100_node()
    b = nvml(f)
    d = b.discover()
    assert (d.backend, d.simulated, d.driver_version, d.cuda_version) == ("nvml", False, "570.86.15", "12.8")
    assert [g.uuid for g in d.gpus] == [g.uuid for g in f.gpus]
    assert all(not g.simulated for g in d.gpus)
    g0 = d.gpus[0]
    assert (g0.pci_bus_id, g0.numa_node, g0.cpu_affinity, g0.minor_number) == ("00000000:18:00.0", 0, "0-55", 0)
    assert d.gpus[7].cpu_affinity == "56-111"
    assert (g0.mig_mode_current, g0.mig_mode_pending, g0.memory_total_mib) == (0, 0, 81559)
    assert len(g0.nvlinks) == 18 and all(ln.active and ln.remote_type == "switch" for ln in g0.nvlinks)
    assert (g0.telemetry.temp_slowdown_c, g0.telemetry.temp_shutdown_c) == (89.0, 92.0)
    assert d.topology_matrix[0] == ["X"] + ["NV18"] * 7
    assert d.nvlink_domain is None and g0.fabric_clique_id is None
    assert f.registered == {i: 0x8 | 0x2 | 0x4000 | 0x8000 for i in range(8)}
    s = b.poll()
    assert all(x.failed_signals == [] and not x.lost for x in s)
    assert s[0].telemetry.power_w == 72.0 and s[0].nvlinks_active == list(range(18))
    b.close()
    assert f.event_sets == [] and not f.initialized


def test_gpu_without_nvlink_and_unsupported_signals_are_healthy_absences():
    f = pcie_node(2)
    b = nvml(f)
    d = b.discover()
    assert all(g.nvlinks == [] and g.mig_mode_current is None for g in d.gpus)
    assert d.topology_matrix == [["X", "PXB"], ["PXB", "X"]]
    s = b.poll()[0]
    assert s.failed_signals == [] and s.nvlinks_active is None
    t = s.telemetry
    assert t.nvlink_crc_errors is None and t.remap_pending is None and t.temperature_c == 35.0
    assert t.memory_temp_c is None and t.remapped_rows_correctable is None       # GDDR6, no row remapper
    assert (t.sm_clock_mhz, t.mem_clock_mhz) == (210, 9001)


def test_old_driver_without_fabric_info_and_a_new_one_with_it():
    old = nvml(gb200_tray(old_driver=True)).discover()
    assert old.nvlink_domain is None and all(g.fabric_cluster_uuid is None for g in old.gpus)
    new = nvml(gb200_tray()).discover()
    assert new.nvlink_domain == "5b1c3a3e-0c7e-4f0e-9a53-3d2f4c8a9e11/4242"
    assert {(g.fabric_clique_id, g.fabric_health) for g in new.gpus} == {(4242, "healthy")}
    assert new.gpus[2].pci_bus_id == "00000018:01:00.0"
    # a driver knowing only the v2 struct; a GPU still registering; one whose registration failed
    f = gb200_tray()
    f.gpus[0].fabric["v2_only"] = True          # type: ignore[index]
    f.gpus[1].fabric["state"] = 2               # type: ignore[index]
    f.gpus[2].fabric["status"] = pynvml.NVML_ERROR_UNKNOWN  # type: ignore[index]
    f.gpus[3].fabric["health"] = 3              # type: ignore[index]
    b = nvml(f)
    d = b.discover()
    assert [(g.fabric_clique_id, g.fabric_health) for g in d.gpus] == [
        (4242, "healthy"), (None, "not_ready"), (None, "unhealthy"), (4242, "limited_capacity")]
    f.gpus[1].fabric["state"] = 3               # type: ignore[index]
    assert [s.fabric_health for s in b.poll()] == ["healthy", "healthy", "unhealthy", "limited_capacity"]


def test_other_errors_are_noted_per_signal_never_fatal():
    f = h100_node(2)
    f.gpus[1].unsupported.add("nvmlDeviceGetTemperature")
    b = nvml(f)
    b.discover()
    orig = f.nvmlDeviceGetPowerUsage

    def no_permission(h):
        if h.index == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return orig(h)

    f.nvmlDeviceGetPowerUsage = no_permission  # type: ignore[method-assign]
    s = b.poll()
    assert s[0].failed_signals == ["power:NVMLError_NoPermission"] and s[0].telemetry.power_w is None
    assert s[1].failed_signals == [] and s[1].telemetry.temperature_c is None and s[1].telemetry.power_w == 72.0


def test_lost_gpus_at_discovery_are_skipped_and_all_lost_is_an_error():
    f = h100_node(3)
    f.gpus[1].lost = True
    d = nvml(f).discover()
    assert [g.index for g in d.gpus] == [0, 2] and d.unanswered == ["index 1: lost"]
    f2 = h100_node(1)
    f2.gpus[0].lost = True
    with pytest.raises(GpuBackendError, match="none of the 1 GPUs"):
        nvml(f2).discover()


def test_event_wait_times_out_empty_then_delivers_xids():
    f = h100_node(2)
    b = nvml(f)
    b.discover()
    t0 = time.monotonic()
    assert b.wait_events(50) == []
    assert time.monotonic() - t0 >= 0.04
    f.emit(1, 0x8, 79)
    f.emit(0, 0x8, 13)
    evs = b.wait_events(50)
    assert [(e.uuid, e.kind, e.value) for e in evs] == [(f.gpus[1].uuid, "xid", 79), (f.gpus[0].uuid, "xid", 13)]
    f.emit(0, 0x4000)
    assert [e.kind for e in b.wait_events(50)] == ["gpu_unavailable"]


def test_old_driver_numa_from_memory_affinity_and_event_wait_errors_are_contained():
    f = h100_node(8)
    for g in f.gpus:
        g.missing.add("nvmlDeviceGetNumaNodeId")
    b = nvml(f)
    d = b.discover()
    assert [g.numa_node for g in d.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]

    def broken(es, ms):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    f.nvmlEventSetWait = broken  # type: ignore[method-assign]
    assert b.wait_events(10) == [] and b.wait_events(10) == []
    assert b.event_wait_errors == 2


def test_no_event_set_means_polls_only():
    f = h100_node(1)
    f.no_events = True
    b = nvml(f)
    b.discover()
    t0 = time.monotonic()
    assert b.wait_events(30) == []
    assert time.monotonic() - t0 >= 0.02


FAST = HealthConfig(throttle_window_s=1.0, throttle_min_samples=2, counter_window_s=1.0)


async def until(mon: GpuMonitor, rx: trio.MemoryReceiveChannel, pred):
    snap = mon.snapshot()
    while not pred(snap):
        snap = await rx.receive()
    return snap


async def test_monitor_over_nvml_xid_event_lost_gpu_and_recovery():
    f = h100_node(4)
    mon = GpuMonitor(nvml(f), poll_interval_s=0.05, health_config=FAST, kernel_log=False, event_wait_ms=50)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            first = await n.start(mon.run)
            assert first.backend == "nvml" and not first.simulated and len(first.gpus) == 4
            assert {g.health for g in first.gpus} == {"healthy"}
            rx = mon.subscribe()
            u = [g.uuid for g in first.gpus]
            # an XID event from the event set: fatal, sticky
            f.emit(1, 0x8, 79)
            snap = await until(mon, rx, lambda s: s.gpus[1].health == "fatal")
            assert [r.code for r in snap.gpus[1].reasons] == ["xid:79"]
            assert snap.gpus[1].telemetry.last_xid == 79 and snap.gpus[1].telemetry.xid_counts == {"79": 1}
            # an application XID: blamed on the workload, the GPU stays healthy
            f.emit(0, 0x8, 13)
            snap = await until(mon, rx, lambda s: any(r.code == "xid:13" for r in s.gpus[0].reasons))
            assert snap.gpus[0].health == "healthy" and snap.gpus[0].reasons[0].severity == "application"
            # a GPU lost mid-run: every call fails with GpuIsLost
            f.gpus[2].lost = True
            snap = await until(mon, rx, lambda s: s.gpus[2].health == "fatal")
            assert [r.code for r in snap.gpus[2].reasons] == ["gpu_lost"]
            assert snap.gpus[3].health == "healthy"
            # reset required, then the GPU answers again: recovers (level signals are not sticky)
            f.gpus[2].lost = False
            f.gpus[2].reset_required = True
            await until(mon, rx, lambda s: [r.code for r in s.gpus[2].reasons] == ["reset_required"])
            f.gpus[2].reset_required = False
            await until(mon, rx, lambda s: s.gpus[2].health == "healthy")
            # a DBE counter + event, then a remap pending
            f.gpus[3].ecc_dbe_vol = 2
            f.emit(3, 0x2)
            await until(mon, rx, lambda s: s.gpus[3].health == "fatal")
            f.gpus[3].ecc_dbe_vol = 0
            f.gpus[3].remapped = (0, 1, 1, 0)
            snap = await until(mon, rx, lambda s: s.gpus[3].health == "degraded")
            assert [r.code for r in snap.gpus[3].reasons] == ["row_remap_pending"]
            # fault injection is refused on real GPUs
            with pytest.raises(GpuBackendError, match="simulated"):
                mon.inject(u[0], Fault(xid=79))
            st = mon.statistics()
            assert st["backend"] == "nvml" and st["polls"] >= 3 and st["xids"] == 2 and st["injected"] == 0
            assert snap.gpus[1].health == "fatal"     # XID 79 is still there
            n.cancel_scope.cancel()
    assert f.event_sets == [] and not f.initialized      # closed after the event thread stopped


async def test_a_gpu_missing_at_start_shows_in_host_health():
    f = h100_node(4)
    f.gpus[3].reset_required = True
    mon = GpuMonitor(nvml(f), poll_interval_s=0.05, health_config=HealthConfig(expected_gpus=4),
                     kernel_log=False, event_wait_ms=20)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            snap = await n.start(mon.run)
            assert len(snap.gpus) == 3 and snap.host.state == "fatal"
            assert {(r.code, r.severity) for r in snap.host.reasons} >= {
                ("gpu_unanswered", "degraded"), ("gpu_count_mismatch", "fatal")}
            n.cancel_scope.cancel()


def test_old_driver_spellings_fall_back():
    f = h100_node(1)
    f.gpus[0].missing.add("nvmlDeviceGetCurrentClocksEventReasons")   # driver < 535
    f.gpus[0].throttle = 0x40
    b = nvml(f)
    b.discover()
    s = b.poll()[0]
    assert s.telemetry.throttle_reasons == 0x40 and s.failed_signals == []
    f.gpus[0].missing.add("nvmlDeviceGetCurrentClocksThrottleReasons")
    s = b.poll()[0]
    assert s.telemetry.throttle_reasons is None and s.failed_signals == []


async def test_no_gpus_is_a_clear_error_and_the_library_is_released():
    f = FakeNvml([])
    mon = GpuMonitor(nvml(f), kernel_log=False)
    with trio.fail_after(5), pytest.raises(GpuBackendError, match="NVML sees no GPUs.*simulated:PROFILE"):
        await mon.run()
    assert not f.initialized


# dcgm-exporter's default fields that GpuTelemetry carries beyond the health signals
DCGM_DEFAULTS = ("DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
                 "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL",
                 "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")


async def test_dcgm_default_fields_are_served_and_absent_where_not_supported():
    f = h100_node(2)
    g0 = f.gpus[0]
    g0.sm_clock, g0.mem_clock, g0.memory_temp, g0.enc_util, g0.dec_util = 1980, 2619, 41, 12, 34
    g0.remapped = (5, 2, 0, 0)
    g0.energy_mj = 2**53 - 1          # the largest count the parser round-trips exactly
    f.gpus[1].memory_temp = None      # the field answers NotSupported (nvmlReturn 3)
    f.gpus[1].unsupported |= {"nvmlDeviceGetClockInfo", "nvmlDeviceGetTotalEnergyConsumption",
                              "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
                              "nvmlDeviceGetRemappedRows"}
    mon = GpuMonitor(nvml(f), poll_interval_s=0.05, kernel_log=False, event_wait_ms=50)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            snap = await n.start(mon.run)
            n.cancel_scope.cancel()
    t0, t1 = snap.gpus[0].telemetry, snap.gpus[1].telemetry
    assert (t0.sm_clock_mhz, t0.mem_clock_mhz, t0.memory_temp_c, t0.energy_mj, t0.enc_util_pct,
            t0.dec_util_pct, t0.remapped_rows_correctable, t0.remapped_rows_uncorrectable) == (
        1980, 2619, 41.0, 2**53 - 1, 12.0, 34.0, 5, 2)
    assert (t1.sm_clock_mhz, t1.mem_clock_mhz, t1.memory_temp_c, t1.energy_mj, t1.enc_util_pct,
            t1.dec_util_pct, t1.remapped_rows_correctable, t1.remapped_rows_uncorrectable) == (None,) * 8
    assert {g.health for g in snap.gpus} == {"healthy"}     # absent is healthy, never noted as a failure
    text = render_metrics(snap, "fakehost")
    got = {name: value(text, name, gpu="0", UUID=f.gpus[0].uuid, Hostname="fakehost", node="fakehost",
                       modelName="NVIDIA H100 80GB HBM3", device="nvidia0", simulated="false")
           for name in DCGM_DEFAULTS}
    assert got == {"DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_MEM_CLOCK": 2619, "DCGM_FI_DEV_MEMORY_TEMP": 41,
                   "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 2**53 - 1, "DCGM_FI_DEV_ENC_UTIL": 12,
                   "DCGM_FI_DEV_DEC_UTIL": 34, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 5,
                   "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 2}
    assert all(value(text, name, gpu="1") is None for name in DCGM_DEFAULTS)   # no series, not a 0
    assert value(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1") == 35                   # the GPU itself is there
    fams = types(text)
    assert fams["DCGM_FI_DEV_SM_CLOCK"] == "gauge" and fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == "unknown"


def test_field_values_failing_as_a_whole_loses_memory_temperature_and_recovery_action_only():
    f = h100_node(1)
    f.gpus[0].unsupported.add("nvmlDeviceGetFieldValues")
    b = nvml(f)
    b.discover()
    s = b.poll()[0]
    assert s.telemetry.memory_temp_c is None and s.telemetry.recovery_action is None
    assert s.telemetry.sm_clock_mhz == 345 and s.failed_signals == []
