"""Pure parts of GPU health: the classification table, host health, kernel-log
parsing, fault validation, Prometheus rendering. No I/O, no clocks."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.gpus import (
    APPLICATION_XIDS,
    DEGRADED_XIDS,
    FATAL_XIDS,
    Fault,
    FaultError,
    GpuObservation,
    GpuSample,
    HealthConfig,
    HostHealthConfig,
    XidEvent,
    classify_gpu,
    classify_host,
    decode_fault,
    render_metrics,
    xid_class,
)
from agent.gpus.backend import cpulist, normalize_pci, topo_name
from agent.gpus.host import HostReadings
from agent.gpus.kmsg import parse_xid_line, xids_from_lines
from scheduler_link.messages import GpuInfo, GpuSnapshot, GpuTelemetry, HostHealth
from tests.prom import samples, types

U = "GPU-00000000-1111-2222-3333-444444444444"
CFG = HealthConfig()
NOW = 1_000_000.0
BASE = GpuTelemetry(temperature_c=40.0, temp_slowdown_c=89, temp_shutdown_c=92, ecc_dbe_volatile=0,
                    remap_pending=False, remap_failure=False, throttle_reasons=0, recovery_action=0)


def obs(**kw) -> GpuObservation:
    tel = kw.pop("tel", BASE)
    sample_kw = kw.pop("sample", {})
    return GpuObservation(uuid=U, sample=GpuSample(uuid=U, telemetry=tel, **sample_kw), **kw)


def state_codes(o: GpuObservation, cfg: HealthConfig = CFG, now: float = NOW):
    state, reasons = classify_gpu(o, cfg, now)
    assert all(r.gpu == U for r in reasons)
    return state, {r.code: r.severity for r in reasons}


def test_the_xid_table_is_disjoint_and_matches_the_issue():
    assert not (FATAL_XIDS & DEGRADED_XIDS) and not (FATAL_XIDS & APPLICATION_XIDS)
    assert not (DEGRADED_XIDS & APPLICATION_XIDS)
    assert FATAL_XIDS == {46, 48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 143, 144, 145, 146, 147, 148, 149,
                          150, 155}
    assert DEGRADED_XIDS == {63, 92}
    assert APPLICATION_XIDS == {8, 13, 31, 43, 45, 68, 69, 94, 109, 137}


@pytest.mark.parametrize("xid", sorted(FATAL_XIDS))
def test_fatal_xids_are_fatal_and_sticky(xid):
    long_ago = NOW - 10 * 86400.0
    state, codes = state_codes(obs(xids=[XidEvent(xid=xid, at=long_ago)]))
    assert state == "fatal" and codes == {f"xid:{xid}": "fatal"}
    _, reasons = classify_gpu(obs(xids=[XidEvent(xid=xid, at=long_ago)]), CFG, NOW)
    assert reasons[0].since == long_ago


@pytest.mark.parametrize("xid", sorted(DEGRADED_XIDS))
def test_degraded_xids_degrade_then_age_out(xid):
    ev = [XidEvent(xid=xid, at=NOW - 10)]
    assert state_codes(obs(xids=ev)) == ("degraded", {f"xid:{xid}": "degraded"})
    later = NOW + CFG.degraded_xid_window_s
    assert state_codes(obs(xids=ev), now=later) == ("healthy", {})


@pytest.mark.parametrize("xid", sorted(APPLICATION_XIDS))
def test_application_xids_blame_the_workload_until_they_recur(xid):
    one = [XidEvent(xid=xid, at=NOW - 5)]
    assert state_codes(obs(xids=one)) == ("healthy", {f"xid:{xid}": "application"})
    many = [XidEvent(xid=xid, at=NOW - 5 * k) for k in range(CFG.app_xid_recur_count)]
    assert state_codes(obs(xids=many)) == ("degraded", {f"xid_recurring:{xid}": "degraded"})
    # outside the window they no longer count
    assert state_codes(obs(xids=many), now=NOW + CFG.app_xid_window_s + 60) == ("healthy", {})


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=65535))
def test_every_xid_has_a_class_and_unknown_ones_degrade_with_the_code(xid):
    kind = xid_class(xid)
    state, codes = state_codes(obs(xids=[XidEvent(xid=xid, at=NOW)]))
    expected = {"fatal": "fatal", "degraded": "degraded", "unknown": "degraded", "application": "healthy"}[kind]
    assert state == expected
    assert any(code.endswith(f":{xid}") for code in codes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.floats(0, 7200)), max_size=30))
def test_state_is_the_worst_severity_of_the_reasons(events):
    o = obs(xids=[XidEvent(xid=x, at=NOW - age) for x, age in events])
    state, reasons = classify_gpu(o, CFG, NOW)
    worst = max(({"fatal": 2, "degraded": 1}.get(r.severity, 0) for r in reasons), default=0)
    assert state == ("healthy", "degraded", "fatal")[worst]
    assert all(r.since <= NOW for r in reasons)
    if any(xid_class(x) == "fatal" for x, _ in events):
        assert state == "fatal"


@pytest.mark.parametrize("sample,tel,expect", [
    ({"lost": True}, BASE, ("fatal", "gpu_lost")),
    ({"reset_required": True}, BASE, ("fatal", "reset_required")),
    ({}, msgspec.structs.replace(BASE, remap_failure=True), ("fatal", "row_remap_failure")),
    ({}, msgspec.structs.replace(BASE, remap_pending=True), ("degraded", "row_remap_pending")),
    ({}, msgspec.structs.replace(BASE, ecc_dbe_volatile=1), ("fatal", "ecc_dbe_volatile")),
    ({}, msgspec.structs.replace(BASE, retired_pages_pending=True), ("degraded", "retired_pages_pending")),
    ({}, msgspec.structs.replace(BASE, temperature_c=90), ("degraded", "temperature_slowdown")),
    ({}, msgspec.structs.replace(BASE, temperature_c=95), ("fatal", "temperature_shutdown")),
    ({"fabric_health": "unhealthy"}, BASE, ("fatal", "fabric_unhealthy")),
    ({"fabric_health": "limited_capacity"}, BASE, ("degraded", "fabric_limited")),
    ({"fabric_health": "not_ready"}, BASE, ("degraded", "fabric_not_ready")),
    ({}, msgspec.structs.replace(BASE, recovery_action=2), ("fatal", "recovery_action:2")),
    ({}, msgspec.structs.replace(BASE, recovery_action=3), ("degraded", "recovery_action:3")),
    ({"nvlinks_active": [0, 2]}, BASE, ("degraded", "nvlink_down:1")),
])
def test_level_signals(sample, tel, expect):
    o = obs(tel=tel, sample=sample, nvlinks_expected=[0, 1, 2])
    state, codes = state_codes(o)
    assert (state, codes.get(expect[1])) == (expect[0], expect[0])


def test_healthy_baseline_and_none_signals_are_healthy():
    assert state_codes(obs()) == ("healthy", {})
    assert state_codes(GpuObservation(uuid=U)) == ("healthy", {})
    assert state_codes(obs(tel=GpuTelemetry())) == ("healthy", {})   # every signal NotSupported


def test_ecc_bound_and_temperature_overrides_are_config():
    o = obs(tel=msgspec.structs.replace(BASE, ecc_dbe_volatile=3, temperature_c=80))
    assert state_codes(o, HealthConfig(ecc_dbe_volatile_max=5)) == ("healthy", {})
    assert state_codes(o, HealthConfig(ecc_dbe_volatile_max=5, temp_slowdown_c=75))[0] == "degraded"


def test_sustained_hardware_throttle_needs_a_fraction_of_the_window():
    cfg = HealthConfig(throttle_window_s=60, throttle_fraction=0.5, throttle_min_samples=3)

    def hist(bits):
        return [(NOW - 50 + 10 * k, msgspec.structs.replace(BASE, throttle_reasons=b)) for k, b in enumerate(bits)]

    assert state_codes(obs(history=hist([0x8, 0x8])), cfg) == ("healthy", {})          # too few samples
    assert state_codes(obs(history=hist([0, 0, 0x40, 0])), cfg) == ("healthy", {})     # 1/4
    assert state_codes(obs(history=hist([0, 0x80, 0x40, 0x8])), cfg)[1] == {"throttle_hw": "degraded"}
    assert state_codes(obs(history=hist([0x4, 0x20, 0x4, 0x20])), cfg) == ("healthy", {})  # software only
    # the same samples later fall out of the window: recovered
    assert state_codes(obs(history=hist([0x8] * 4)), cfg, now=NOW + 120) == ("healthy", {})


def test_counter_growth_within_the_window():
    def hist(vals, field):
        return [(NOW - 100 + 10 * k, msgspec.structs.replace(BASE, **{field: v})) for k, v in enumerate(vals)]

    assert state_codes(obs(history=hist([5, 5, 5], "nvlink_crc_errors")))[0] == "healthy"
    assert state_codes(obs(history=hist([5, 6, 9], "nvlink_replay_errors")))[1] == {"nvlink_errors": "degraded"}
    assert state_codes(obs(history=hist([0, 50, 100], "pcie_replay")))[0] == "healthy"
    assert state_codes(obs(history=hist([0, 50, 101], "pcie_replay")))[1] == {"pcie_replay": "degraded"}
    assert state_codes(obs(history=hist([5, 6, 9], "nvlink_crc_errors")), now=NOW + 1000)[0] == "healthy"


def test_since_is_carried_from_previous_reasons():
    o = obs(tel=msgspec.structs.replace(BASE, temperature_c=90))
    _, first = classify_gpu(o, CFG, NOW)
    _, again = classify_gpu(o, CFG, NOW + 30, first)
    assert first[0].since == again[0].since == NOW


def test_health_config_rejects_nonsense():
    with pytest.raises(ValueError):
        HealthConfig(throttle_fraction=0)
    with pytest.raises(ValueError):
        HealthConfig(app_xid_window_s=-1)


# ---------------------------------------------------------------- host health

def test_host_health_thresholds():
    cfg = HostHealthConfig()
    ok = HostReadings(mem_available_mib=50_000, disk_free_mib=100_000, load1=1.0, cpus=8)
    assert classify_host(ok, cfg, NOW) == HostHealth(state="healthy", mem_available_mib=50_000,
                                                     disk_free_mib=100_000, load1=1.0)
    h = classify_host(HostReadings(mem_available_mib=1000, disk_free_mib=100, load1=100.0, cpus=8), cfg, NOW)
    assert h.state == "fatal"
    assert {r.code: r.severity for r in h.reasons} == {"host_memory_pressure": "degraded",
                                                       "state_disk_full": "fatal", "host_load_high": "degraded"}
    assert all(r.gpu is None for r in h.reasons)
    assert classify_host(HostReadings(errors=["load: boom"]), cfg, NOW).state == "healthy"


def test_host_health_reads_this_host(tmp_path):
    from agent.gpus import host_health
    h = host_health(tmp_path / "not-yet", HostHealthConfig(disk_free_degraded_mib=0, disk_free_fatal_mib=0,
                                                           mem_available_degraded_mib=0,
                                                           mem_available_fatal_mib=0, load_per_cpu_degraded=1e9))
    assert h.state == "healthy" and h.disk_free_mib and h.mem_available_mib and h.load1 is not None


# ---------------------------------------------------------------- kernel log

KMSG = [
    "4,1234,5000000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "[  123.456789] NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x504648",
    "[  200.000001] host kernel: NVRM: Xid (PCI:0000:2a:00): 48, pid=1, name=x, An uncorrectable double bit error",
    "6,1300,7000000,-;NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.",
    "6,1301,7000001,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.86.15",
    "garbage line",
    "[  300.0] NVRM: Xid (PCI:zz:zz): 79, nonsense",
    "4,1400,9000000,-;NVRM: Xid (PCI:0000:ff:00): 31, pid=1, name=x, MMU Fault (a GPU we do not have)",
]


def test_parse_kernel_xid_lines():
    got = [parse_xid_line(ln) for ln in KMSG]
    assert [(k.pci_bus_id, k.xid, k.since_boot_s) if k else None for k in got] == [
        ("00000000:3B:00.0", 79, 5.0), ("00000000:18:00.0", 13, 123.456789), ("00000000:2A:00.0", 48, 200.000001),
        ("00000000:5D:00.0", 79, 7.0), None, None, None, ("00000000:FF:00.0", 31, 9.0)]
    assert "fallen off the bus" in got[0].detail


def test_kernel_xids_map_to_our_gpus_and_times():
    pci = {"00000000:3B:00.0": "GPU-a", "00000000:18:00.0": "GPU-b", "00000000:2A:00.0": "GPU-c",
           "00000000:5D:00.0": "GPU-d"}
    evs = xids_from_lines(KMSG, boot_time=1000.0, pci_to_uuid=pci, now=5000.0)
    assert [(e.uuid, e.value, round(e.at or 0, 6), e.source) for e in evs] == [
        ("GPU-a", 79, 1005.0, "kmsg"), ("GPU-b", 13, 1123.456789, "kmsg"), ("GPU-c", 48, 1200.000001, "kmsg"),
        ("GPU-d", 79, 1007.0, "kmsg")]


def test_helpers():
    assert normalize_pci("0000:3b:00") == "00000000:3B:00.0" == normalize_pci("00000000:3B:00.0")
    assert normalize_pci("nonsense") is None
    assert cpulist([0xF, 0x1]) == "0-3,64" and cpulist([0]) is None
    assert cpulist([0xFFFFFFFFFFFFFF, 0]) == "0-55"
    assert [topo_name(x) for x in (0, 10, 20, 30, 40, 50, None, 99)] == [
        "PIX", "PIX", "PXB", "PHB", "NODE", "SYS", "N/A", "N/A"]


# ---------------------------------------------------------------- faults

def test_fault_decoding_and_validation():
    assert decode_fault(b'{"xid": 79}') == Fault(xid=79)
    assert decode_fault(b'{"remap": "pending", "temperature_c": 90}') == Fault(remap="pending", temperature_c=90)
    for bad, why in [(b"{}", "empty fault"), (b'{"xid": 0}', "xid must be"), (b'{"xid": true}', "Expected"),
                     (b'{"ecc_dbe": -3}', "ecc_dbe must be"), (b'{"temperature_c": 1000}', "temperature_c"),
                     (b'{"clear": true, "xid": 3}', "cannot be combined"), (b'{"bogus": 1}', "unknown field"),
                     (b'{"remap": "maybe"}', "Invalid enum value"), (b'{"lost": false}', "only be set to true"),
                     (b'{"recovery_action": 5}', "recovery_action"), (b"not json", "not JSON")]:
        with pytest.raises(FaultError, match=why):
            decode_fault(bad)
    # the agent decodes with msgspec directly: validation errors surface as ValidationError (400)
    with pytest.raises(msgspec.ValidationError, match="empty fault"):
        msgspec.json.decode(b"{}", type=Fault)


# ---------------------------------------------------------------- metrics

def test_render_metrics_uses_dcgm_names_and_marks_simulated():
    from scheduler_link.messages import HealthReason
    g = GpuInfo(index=0, uuid=U, name='NVIDIA "H100"', memory_total_mib=81559, pci_bus_id="00000000:18:00.0",
                minor_number=0, simulated=True, health="fatal",
                reasons=[HealthReason(code="xid:79", severity="fatal", gpu=U, since=1.0)],
                telemetry=msgspec.structs.replace(BASE, power_w=70.5, fb_used_mib=10, fb_free_mib=20,
                                                  last_xid=79, xid_counts={"79": 2, "13": 1}))
    snap = GpuSnapshot(hostname="h1", backend="simulated:dgx-h100", simulated=True, gpus=[g],
                       host=HostHealth(mem_available_mib=1024, load1=0.5))
    text = render_metrics(snap, "h1")
    lb = {"gpu": "0", "UUID": U, "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
          "modelName": 'NVIDIA "H100"', "Hostname": "h1", "node": "h1", "simulated": "true",
          "workload": "", "job": ""}
    full = frozenset(lb.items())
    got = samples(text)
    for name, extra, want in [
            ("DCGM_FI_DEV_GPU_TEMP", {}, 40.0), ("DCGM_FI_DEV_POWER_USAGE", {}, 70.5),
            ("DCGM_FI_DEV_FB_USED", {}, 10), ("DCGM_FI_DEV_FB_FREE", {}, 20), ("DCGM_FI_DEV_XID_ERRORS", {}, 79),
            ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", {}, 0), ("DCGM_FI_DEV_ROW_REMAP_FAILURE", {}, 0),
            ("DCGM_EXP_XID_ERRORS_COUNT", {"xid": "13"}, 1),
            ]:
        assert got[(name, full | frozenset(extra.items()))] == want, name
    ours = frozenset({"gpu": "0", "uuid": U, "pci_bus_id": "00000000:18:00.0", "device": "nvidia0",
                      "model_name": 'NVIDIA "H100"', "node": "h1", "simulated": "true", "workload": "",
                      "job": ""}.items())
    for name, extra, want in [
            ("herd_gpu_health", {"state": "fatal"}, 1), ("herd_gpu_health", {"state": "healthy"}, 0),
            ("herd_gpu_health_reason", {"code": "xid:79", "severity": "fatal"}, 1), ("herd_gpu_simulated", {}, 1)]:
        assert got[(name, ours | frozenset(extra.items()))] == want, name
    host = frozenset({"node": "h1"}.items())
    assert got[("herd_host_health", host | {("state", "healthy")})] == 1
    assert got[("herd_host_mem_available_bytes", host)] == 1073741824
    assert got[("herd_host_load1", host)] == 0.5
    # dcgm-exporter's counter names are kept exactly (prometheus_client would rename a typed counter)
    assert types(text)["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == "unknown"
    assert "DCGM_FI_DEV_PCIE_REPLAY_COUNTER" not in text      # not read -> no series, never a fake 0
    # the holder of a GPU labels its series
    held = samples(render_metrics(snap, "h1", holders={U: ("w1", "job-a")}))
    assert held[("DCGM_FI_DEV_GPU_TEMP", frozenset({**lb, "workload": "w1", "job": "job-a"}.items()))] == 40.0


_tel = st.builds(
    GpuTelemetry,
    temperature_c=st.none() | st.floats(0, 120), temp_slowdown_c=st.none() | st.floats(60, 95),
    temp_shutdown_c=st.none() | st.floats(90, 110), ecc_dbe_volatile=st.none() | st.integers(0, 5),
    remap_pending=st.none() | st.booleans(), remap_failure=st.none() | st.booleans(),
    retired_pages_pending=st.none() | st.booleans(), throttle_reasons=st.none() | st.integers(0, 0x1FF),
    recovery_action=st.none() | st.sampled_from([0, 1, 2, 3, 4, 6, 7]),
    nvlink_crc_errors=st.none() | st.integers(0, 10), pcie_replay=st.none() | st.integers(0, 1000))


@settings(max_examples=150, deadline=None)
@given(tel=_tel, lost=st.booleans(), fabric=st.sampled_from([None, "healthy", "unhealthy", "limited_capacity", "not_ready"]),
       hist=st.lists(_tel, max_size=6))
def test_classification_invariants(tel, lost, fabric, hist):
    o = GpuObservation(uuid=U, sample=GpuSample(uuid=U, telemetry=tel, lost=lost, fabric_health=fabric),
                       history=[(NOW - 60 + 10 * k, h) for k, h in enumerate(hist)])
    state, reasons = classify_gpu(o, CFG, NOW)
    codes = [r.code for r in reasons]
    assert len(codes) == len(set(codes))
    worst = max(({"fatal": 2, "degraded": 1}.get(r.severity, 0) for r in reasons), default=0)
    assert state == ("healthy", "degraded", "fatal")[worst]
    if lost or fabric == "unhealthy" or tel.remap_failure or (tel.ecc_dbe_volatile or 0) > 0:
        assert state == "fatal"
    # a fatal XID on top never makes things better
    worse = msgspec.structs.replace(o, xids=[XidEvent(xid=79, at=NOW)])
    assert classify_gpu(worse, CFG, NOW)[0] == "fatal"
