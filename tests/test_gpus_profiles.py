"""Simulated profiles: the data each reports, deterministic and collision-proof UUIDs,
topology like the real systems, backend selection errors."""

from __future__ import annotations

import re

import msgspec
import pytest

from agent.gpus import PROFILES, Fault, GpuBackendError, SimulatedBackend, open_backend, render_metrics
from agent.gpus.simulated import fabric_ids, sim_uuid
from scheduler_link.messages import GpuSnapshot
from tests.prom import value

REAL_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.mark.parametrize("name,count,model,mem,nv", [
    ("dgx-h100", 8, "NVIDIA H100 80GB HBM3", 81559, "NV18"),
    ("hgx-b200", 8, "NVIDIA B200", 183359, "NV18"),
    ("gb200-nvl72", 4, "NVIDIA GB200", 189471, "NV18"),
    ("l40s-pcie", 4, "NVIDIA L40S", 46068, None),
])
def test_profile_inventory_and_topology(name, count, model, mem, nv):
    b = open_backend(f"simulated:{name}", hostname="node-1")
    d = b.discover()
    assert (d.backend, d.simulated, b.simulated) == (f"simulated:{name}", True, True)
    assert len(d.gpus) == count and [g.index for g in d.gpus] == list(range(count))
    assert {g.name for g in d.gpus} == {model} and {g.memory_total_mib for g in d.gpus} == {mem}
    assert all(g.simulated for g in d.gpus)
    assert all(g.uuid.startswith("GPU-sim-") and not REAL_UUID.match(g.uuid) for g in d.gpus)
    assert len({g.uuid for g in d.gpus}) == count and len({g.pci_bus_id for g in d.gpus}) == count
    m = d.topology_matrix
    assert len(m) == count and all(len(r) == count for r in m)
    assert all(m[i][i] == "X" for i in range(count))
    assert all(m[i][j] == m[j][i] for i in range(count) for j in range(count))
    if nv:
        assert all(m[i][j] == nv for i in range(count) for j in range(count) if i != j)
        assert all(sum(1 for ln in g.nvlinks if ln.active and ln.remote_type == "switch") == 18 for g in d.gpus)
    else:
        assert all(g.nvlinks == [] for g in d.gpus)
        assert m[0][1] == "PXB" and m[0][2] == "SYS" and m[2][3] == "PXB"
    assert {g.numa_node for g in d.gpus} == {0, 1}
    assert all(g.cpu_affinity for g in d.gpus)
    assert all(g.telemetry.temp_shutdown_c > g.telemetry.temp_slowdown_c for g in d.gpus)
    samples = b.poll()
    assert [s.uuid for s in samples] == [g.uuid for g in d.gpus]
    assert all(not s.lost and s.telemetry.temperature_c is not None for s in samples)
    assert all(s.telemetry.temperature_c < g.telemetry.temp_slowdown_c for s, g in zip(samples, d.gpus, strict=True))


def test_uuids_are_deterministic_per_host_and_profile():
    a = [g.uuid for g in SimulatedBackend("dgx-h100", hostname="n1").discover().gpus]
    assert a == [g.uuid for g in SimulatedBackend("dgx-h100", hostname="n1").discover().gpus]
    assert not set(a) & {g.uuid for g in SimulatedBackend("dgx-h100", hostname="n2").discover().gpus}
    assert not set(a) & {g.uuid for g in SimulatedBackend("hgx-b200", hostname="n1").discover().gpus}
    assert sim_uuid("n1", "dgx-h100", 0) == a[0]


def test_gb200_fabric_domain_comes_from_the_rack_name():
    d1 = open_backend("simulated:gb200-nvl72,rack=r7", hostname="tray-1").discover()
    d2 = open_backend("simulated:gb200-nvl72", hostname="tray-2", rack="r7").discover()
    d3 = open_backend("simulated:gb200-nvl72,rack=r8", hostname="tray-3").discover()
    cluster, clique = fabric_ids("r7")
    assert d1.nvlink_domain == d2.nvlink_domain == f"{cluster}/{clique}" != d3.nvlink_domain
    assert {(g.fabric_cluster_uuid, g.fabric_clique_id, g.fabric_health) for g in d1.gpus} == {
        (cluster, clique, "healthy")}
    for other in ("dgx-h100", "hgx-b200", "l40s-pcie"):
        d = open_backend(f"simulated:{other}").discover()
        assert d.nvlink_domain is None and all(g.fabric_clique_id is None for g in d.gpus)


def test_mig_is_reported_where_the_gpu_has_it():
    h = open_backend("simulated:dgx-h100").discover().gpus[0]
    lp = open_backend("simulated:l40s-pcie").discover().gpus[0]
    assert (h.mig_mode_current, h.mig_mode_pending) == (0, 0)
    assert (lp.mig_mode_current, lp.mig_mode_pending) == (None, None)


@pytest.mark.parametrize("spec,msg", [
    ("simulated:nope", "unknown simulated profile 'nope'"),
    ("simulated:", "needs a profile"),
    ("simulated:gb200-nvl72,rack", "expected key=value"),
    ("simulated:gb200-nvl72,colour=red", "unknown simulated option"),
    ("cuda", "unknown GPU backend 'cuda'"),
    ("nvml:x", "unknown GPU backend"),
])
def test_bad_backend_specs_are_one_clear_error(spec, msg):
    with pytest.raises(GpuBackendError, match=msg) as e:
        open_backend(spec)
    assert "\n" not in str(e.value)
    assert set(PROFILES) <= set(re.findall(r"[a-z0-9]+-[a-z0-9]+", str(e.value))) or "option" in msg or \
        "key=value" in msg


class StepClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_dcgm_default_fields_from_the_simulated_profiles():
    clock = StepClock()
    b = SimulatedBackend("dgx-h100", hostname="n1", clock=clock)
    d = b.discover()
    clock.now += 2.0
    t = b.poll()[0].telemetry
    assert (t.sm_clock_mhz, t.mem_clock_mhz, t.memory_temp_c, t.enc_util_pct, t.dec_util_pct) == (
        345, 2619, 34.0, 0.0, 0.0)
    assert (t.remapped_rows_correctable, t.remapped_rows_uncorrectable) == (0, 0)
    assert t.energy_mj == 144_000                 # 72 W for 2 s
    clock.now += 0.5
    assert b.poll()[0].telemetry.energy_mj == 180_000    # a counter: it only grows
    text = render_metrics(GpuSnapshot(gpus=[msgspec.structs.replace(d.gpus[0], telemetry=t)]), "n1")
    lb = {"gpu": "0", "UUID": d.gpus[0].uuid, "Hostname": "n1", "simulated": "true"}
    assert value(text, "DCGM_FI_DEV_SM_CLOCK", **lb) == 345
    assert value(text, "DCGM_FI_DEV_MEM_CLOCK", **lb) == 2619
    assert value(text, "DCGM_FI_DEV_MEMORY_TEMP", **lb) == 34
    assert value(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **lb) == 144_000
    assert value(text, "DCGM_FI_DEV_ENC_UTIL", **lb) == 0 and value(text, "DCGM_FI_DEV_DEC_UTIL", **lb) == 0
    assert value(text, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", **lb) == 0
    assert value(text, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", **lb) == 0
    # a GDDR6 board reads no memory temperature: no series at all
    pcie = SimulatedBackend("l40s-pcie", hostname="n2")
    pd = pcie.discover()
    pt = pcie.poll()[0].telemetry
    assert pt.memory_temp_c is None and (pt.sm_clock_mhz, pt.mem_clock_mhz) == (210, 9001)
    text = render_metrics(GpuSnapshot(gpus=[msgspec.structs.replace(pd.gpus[0], telemetry=pt)]), "n2")
    assert value(text, "DCGM_FI_DEV_MEMORY_TEMP") is None and value(text, "DCGM_FI_DEV_MEM_CLOCK", gpu="0") == 9001


def test_a_cleared_fault_keeps_the_energy_counter():
    clock = StepClock()
    b = SimulatedBackend("l40s-pcie", hostname="n1", clock=clock)
    b.discover()
    clock.now += 1.0
    before = b.poll()[0].telemetry.energy_mj
    assert before == 35_000
    b.inject(b.uuids[0], Fault(temperature_c=95.0))
    b.inject(b.uuids[0], Fault(clear=True))
    assert b.poll()[0].telemetry.energy_mj == before      # no time passed; not reset to 0
