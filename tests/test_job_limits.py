"""A job's own cgroup limits (JobSpec.limits): checked where they enter (the placer refuses a
malformed value, so does the agent), carried in each placement, and applied on top of the
agent's defaults where a controller is enabled (said once where not)."""

from __future__ import annotations

import pytest

from agent.isolation import CgroupTree, Isolation
from agent.placement import check_placement
from agent.supervisor import workload_limits
from placer.config import PlacerConfig
from placer.records import JobError
from placer.state import PlacerState
from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    JobSpec,
    NodeReport,
    Placement,
    PodAssignment,
    ResourceLimits,
    TopologyPath,
)


def test_values_are_checked():
    assert ResourceLimits(memory_max="64G", cpu_max="800000 100000", pids_max="4096").problem() is None
    assert ResourceLimits(memory_max="max", cpu_max="max 100000", pids_max="max").problem() is None
    for bad in (ResourceLimits(memory_max="64 G"), ResourceLimits(memory_max="-1"), ResourceLimits(cpu_max="8"),
                ResourceLimits(cpu_max="1 2 3"), ResourceLimits(pids_max="0x10"), ResourceLimits(memory_max="1\n")):
        assert bad.problem() is not None, bad


def test_the_placer_refuses_a_bad_limit_and_carries_a_good_one():
    st_ = PlacerState(PlacerConfig(), started_at=0.0)
    st_.recover_until = 0.0
    with pytest.raises(JobError, match="limits: memory_max"):
        st_.submit(JobSpec(job_id="b", argv=["x"], limits=ResourceLimits(memory_max="lots")), 0.0)
    snap = GpuSnapshot(gpus=[GpuInfo(index=i, uuid=f"u{i}", name="g", memory_total_mib=1, pci_bus_id="p")
                             for i in range(8)])
    st_.ingest("a", NodeReport(node_id="a", boot_id="b", seq=1, control_url="http://a", snapshot=snap,
                               topology=TopologyPath()), 0.0)
    lim = ResourceLimits(memory_max="16G", pids_max="512")
    st_.submit(JobSpec(job_id="g", pods=1, gpus_per_pod=8, argv=["x"], limits=lim), 0.1)
    (_, pushes), = st_.schedule(0.1)
    assert [p.placement.limits for p in pushes] == [lim]


def test_the_agent_refuses_a_malformed_limit():
    p = Placement(placement_id="p", job_id="j", argv=["x"], limits=ResourceLimits(cpu_max="all of them"),
                  pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["u0"])])
    r = check_placement(p, {}, {"u0": "healthy"})
    assert r is not None and r.outcome == "refused_spec" and "cpu_max" in r.detail


def test_job_limits_go_on_top_of_the_agents_where_a_controller_is(tmp_path):
    agent = {"memory.max": "64G", "pids.max": "4096"}
    job = ResourceLimits(memory_max="16G", cpu_max="200000 100000").as_files()
    have, note = workload_limits(agent, job, Isolation(None))
    assert have == agent and note and "no cgroup" in note
    tree = CgroupTree(tmp_path)
    tree.controllers = frozenset({"memory", "pids"})
    have, note = workload_limits(agent, job, Isolation(tree))
    assert have == {"memory.max": "16G", "pids.max": "4096"} and note and "cpu.max" in note
    assert workload_limits(agent, {}, Isolation(tree)) == (agent, None)
