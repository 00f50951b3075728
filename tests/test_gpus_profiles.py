"""Simulated profiles: the data each reports, deterministic and collision-proof UUIDs,
topology like the real systems, backend selection errors."""

from __future__ import annotations

import re

import pytest

from agent.gpus import PROFILES, GpuBackendError, SimulatedBackend, open_backend
from agent.gpus.simulated import fabric_ids, sim_uuid

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
