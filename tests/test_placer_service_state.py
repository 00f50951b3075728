"""PlacerState alone: pure bookkeeping over the real placer core, ``now`` passed in."""

from __future__ import annotations

from typing import Any

import msgspec

from placer.config import PlacerConfig
from placer.records import Outcome
from placer.state import ACCEPTED, PlacerState
from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    JobSpec,
    NodeReport,
    RestartPolicy,
    TopologyPath,
    WorkloadEvent,
    WorkloadStatus,
)


def snap(node: str, n: int = 8, fatal: tuple[int, ...] = ()) -> GpuSnapshot:
    return GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True,
                                                     health="fatal" if i in fatal else "healthy")
                                             for i in range(n)])


def full(node: str, seq: int = 1, workloads: list[WorkloadStatus] = (), **kw) -> NodeReport:  # type: ignore[assignment]
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=True, control_url=f"http://{node}",
                      topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=kw.get("snapshot", snap(node)),
                      workloads=list(workloads))


def wl(wid: str, job: str, node: str, slots: list[int], state: str = "running") -> WorkloadStatus:
    return WorkloadStatus(workload_id=wid, job_id=job, gpus=[f"{node}-g{s}" for s in slots], state=state)


def new_state(**kw) -> PlacerState:
    return PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=2.0, **kw), started_at=0.0)


def test_partial_gang_after_restart_is_stopped_and_placed_again():
    st = new_state()
    st.recover_until = 2.0
    st.submit(JobSpec(job_id="g", pods=2, gpus_per_pod=4, argv=["x"], grace_s=7), 0.0, recovering=True)
    st.jobs["g"].attempt = 3  # from the journal
    # only rank 0 of attempt 3 comes back; an attempt-2 leftover and an unknown job too
    code, reply, _ = st.ingest("a", full("a", workloads=[wl("g.3.0", "g", "a", [0, 1, 2, 3]),
                                                        wl("g.2.1", "g", "a", [4, 5]),
                                                        wl("zz.1.0", "zz", "a", [6])]), 0.5)
    assert code == 200
    assert sorted(v.workload_id for v in reply.stop) == ["g.2.1", "zz.1.0"]  # stale: told at once
    st.ingest("b", full("b"), 0.6)
    assert st.schedule(1.0) == []  # still inside the recovery window: nothing placed
    out = st.schedule(2.5)
    assert [j.job_id for j, _ in out] == ["g"]
    job, pushes = out[0]
    assert job.attempt == 4 and job.state == "placing"
    starts = [p for p in pushes if p.kind == "start"]
    used = {(p.node_id, g) for p in starts for pod in p.placement.pods for g in pod.gpus}
    # the stale leftovers' GPUs (a: 0-3 of the partial gang, 4-5, 6) are still held: not reused
    assert not used & {("a", f"a-g{i}") for i in range(7)}
    assert set(st.model.free_gpus("a")) <= {7}
    assert all(pod.workload_id.startswith("g.4.") for p in starts for pod in p.placement.pods)
    # the partial gang's survivor is named in a's next reply; its GPUs come back when it is gone
    code, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=2, full=False), 2.6)
    assert [v.workload_id for v in reply.stop] == ["g.3.0"] and reply.stop[0].grace_s == 7
    free0 = len(st.model.free_gpus("a"))
    st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=3, full=False, events=[
        WorkloadEvent(workload_id="g.3.0", job_id="g", state="preempted", at=2.7),
        WorkloadEvent(workload_id="zz.1.0", job_id="zz", state="exited", exit_code=0, at=2.7)]), 2.7)
    assert len(st.model.free_gpus("a")) == free0 + 5
    st.model.check_invariants()


def test_heartbeat_gaps_unknown_boots_and_mismatched_ids():
    st = new_state()
    assert st.ingest("a", NodeReport(node_id="a", boot_id="x", seq=1, full=False), 0.0)[0] == 409
    assert st.ingest("a", full("a"), 0.0)[0] == 200
    assert st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=2, full=False), 0.1)[0] == 200
    assert st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=4, full=False), 0.2)[0] == 409  # gap
    assert st.ingest("a", NodeReport(node_id="a", boot_id="other", seq=3, full=False), 0.2)[0] == 409
    assert st.ingest("b", full("a"), 0.3)[0] == 400
    assert st.counters["conflicts"] == 3


def test_lost_then_fenced_then_back_with_a_new_boot():
    st = new_state(lost_after_missed=3)
    st.recover_until = 0.0
    st.ingest("a", full("a"), 0.0)
    st.ingest("b", full("b"), 0.0)
    st.submit(JobSpec(job_id="j", pods=1, gpus_per_pod=8, argv=["x"], restart=RestartPolicy(kind="on-preemption")), 0.0)
    (job, pushes), = st.schedule(0.1)
    node = pushes[0].node_id
    other = "b" if node == "a" else "a"
    st.on_acks("j", 1, {node: ACCEPTED}, 0.2)
    beat = 1
    for t in (1.0, 2.0, 3.0, 4.0):  # only the other node keeps beating
        beat += 1
        st.ingest(other, NodeReport(node_id=other, boot_id=f"boot-{other}", seq=beat, full=False), t)
        st.tick(t)
    assert st.nodes[node].state == "lost" and job.attempt == 1  # lost, not yet fenced
    for t in (5.0, 6.0, 7.0, 8.0, 9.0):
        beat += 1
        st.ingest(other, NodeReport(node_id=other, boot_id=f"boot-{other}", seq=beat, full=False), t)
        st.tick(t)
    assert job.state == "pending" and job.restarts == 1  # fenced after fence_after_s: requeued
    (job2, pushes2), = st.schedule(9.1)
    assert pushes2[0].node_id == other and job2.attempt == 2
    # the host rebooted (new boot, no workloads): it is simply healthy again
    st.ingest(node, full(node, workloads=[]), 9.5)
    assert st.nodes[node].state == "up" and len(st.model.free_gpus(node)) == 8


def test_a_newer_attempt_reported_later_supersedes_the_adopted_one():
    st = new_state()
    st.recover_until = 2.0
    st.submit(JobSpec(job_id="g", pods=1, gpus_per_pod=2, argv=["x"]), 0.0, recovering=True)
    st.ingest("a", full("a", workloads=[wl("g.1.0", "g", "a", [0, 1])]), 0.1)
    _, reply, _ = st.ingest("b", full("b", workloads=[wl("g.2.0", "g", "b", [2, 3])]), 0.2)
    assert st.jobs["g"].attempt == 2 and [p.node_id for p in st.jobs["g"].pods] == ["b"]
    _, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=2, full=False), 0.3)
    assert [v.workload_id for v in reply.stop] == ["g.1.0"]
    assert set(st.model.free_gpus("a")) == set(range(2, 8))  # still held until it is gone
    assert st.schedule(2.5) == [] and st.jobs["g"].state in ("starting", "running")


def _ack_all(st: PlacerState, job, pushes, now: float) -> None:
    starts = [p for p in pushes if p.kind == "start"]
    st.on_acks(job.job_id, job.attempt, {p.node_id: ACCEPTED for p in starts}, now, starts)


def _one_pod_acked(job_id: str, submit_at: float, schedule_at: float, ack_at: float) -> tuple[PlacerState, Any]:
    """A placer with node ``a`` (8 GPUs) whose one-pod job ``job_id`` was placed there and acked."""
    st = new_state()
    st.ingest("a", full("a"), 0.0)
    st.recover_until = 0.0
    st.submit(JobSpec(job_id=job_id, pods=1, gpus_per_pod=8, argv=["x"]), submit_at)
    (job, pushes), = st.schedule(schedule_at)
    _ack_all(st, job, pushes, ack_at)
    return st, job


def _events(st: PlacerState, node: str, seq: int, evs: list[WorkloadEvent], now: float) -> None:
    code, _, _ = st.ingest(node, NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=False,
                                            events=evs), now)
    assert code == 200


def test_preempted_victim_requeued_on_preemption_is_not_failed_by_its_own_exit():
    """A victim whose policy is on-preemption goes back to the queue; the exit events of the
    pods we told to stop (exit 0 after SIGTERM, or 'preempted') must not fail it."""
    st = new_state()
    st.ingest("a", full("a"), 0.0)
    st.recover_until = 0.0
    st.submit(JobSpec(job_id="low", pods=1, gpus_per_pod=8, priority=1, argv=["x"],
                      restart=RestartPolicy(kind="on-preemption")), 0.1)
    (job, pushes), = st.schedule(0.2)
    _ack_all(st, job, pushes, 0.3)
    wid = job.pods[0].workload_id
    _events(st, "a", 2, [WorkloadEvent(workload_id=wid, job_id="low", state="running", at=0.4)], 0.4)
    assert st.jobs["low"].state == "running"
    st.submit(JobSpec(job_id="high", pods=1, gpus_per_pod=8, priority=9, preemptible=False, argv=["y"]), 1.0)
    out = st.schedule(1.1)
    assert [j.job_id for j, _ in out] == ["high"]
    assert st.jobs["low"].state == "pending" and st.jobs["low"].restarts == 1
    # the victim reports terminating, then preempted (it exited 0 on SIGTERM): the job stays queued
    _events(st, "a", 3, [WorkloadEvent(workload_id=wid, job_id="low", state="terminating", at=1.4)], 1.4)
    _events(st, "a", 4, [WorkloadEvent(workload_id=wid, job_id="low", state="preempted", exit_code=0, at=1.5)], 1.5)
    assert st.jobs["low"].state == "pending"
    assert st.jobs["low"].reason and "preempted by high" in st.jobs["low"].reason


def test_update_artifact_applies_to_the_next_attempt_and_refuses_bad_input():
    import pytest

    from placer.state import JobError

    st = new_state()
    st.submit(JobSpec(job_id="j", pods=1, gpus_per_pod=1, argv=["x"], manifest_id="a" * 64, origin="file:///o"), 0.0)
    job = st.update_artifact("j", "b" * 64, None)
    assert job.spec.manifest_id == "b" * 64 and job.spec.origin == "file:///o"
    with pytest.raises(JobError):
        st.update_artifact("j", "trainer:v2", None)  # a ref, not a manifest id
    with pytest.raises(JobError) as e:
        st.update_artifact("nope", "b" * 64, None)
    assert e.value.status == 404
    st.ingest("a", full("a"), 0.1)
    st.recover_until = 0.0
    (j, pushes), = st.schedule(0.2)
    assert {p.placement.manifest_id for p in pushes if p.kind == "start"} == {"b" * 64}


def test_full_report_showing_an_ended_pod_overtakes_its_event():
    """A full report (sent every few beats) can arrive before the event of a pod that just
    exited: the pod ended (here successfully), it did not vanish."""
    st, job = _one_pod_acked("done", 0.1, 0.2, 0.3)
    wid = job.pods[0].workload_id
    _events(st, "a", 2, [WorkloadEvent(workload_id=wid, job_id="done", state="running", at=0.4)], 0.4)
    exited = WorkloadStatus(workload_id=wid, job_id="done", gpus=[f"a-g{i}" for i in range(8)], state="exited",
                            exit_code=0, updated_at=5.0)
    code, _, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=3, full=True, control_url="http://a",
                                           topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=snap("a"),
                                           workloads=[exited]), 5.1)
    assert code == 200
    assert st.jobs["done"].state == "succeeded", st.jobs["done"].reason
    assert len(st.model.free_gpus("a")) == 8


def test_events_riding_on_a_full_report_keep_their_fetch_figures():
    st = new_state()
    st.ingest("a", full("a"), 0.0)
    st.recover_until = 0.0
    st.submit(JobSpec(job_id="f", pods=1, gpus_per_pod=8, argv=["x"], manifest_id="c" * 64, origin="file:///o"), 0.1)
    (job, pushes), = st.schedule(0.2)
    _ack_all(st, job, pushes, 0.3)
    wid = job.pods[0].workload_id
    gpus = [f"a-g{i}" for i in range(8)]
    ev = WorkloadEvent(workload_id=wid, job_id="f", state="starting", at=0.5, bytes_from_origin=10,
                       bytes_from_peers=20, bytes_local=30)
    code, _, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=7, full=True, control_url="http://a",
                                           topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=snap("a"),
                                           workloads=[WorkloadStatus(workload_id=wid, job_id="f", gpus=gpus,
                                                                     state="running")], events=[ev]), 0.6)
    assert code == 200
    pod = st.jobs["f"].pods[0]
    assert pod.state == "running"  # the list is the state: the older event does not roll it back
    assert pod.fetch == {"bytes_from_origin": 10, "bytes_from_peers": 20, "bytes_local": 30}
    assert pod.timings["starting"] == 0.5


def test_a_stopped_pod_that_says_it_lives_is_told_again_in_the_answer():
    """A rolled-back attempt's stop that never took effect (lost with its relay, or it overtook
    the start it was meant to undo and found nothing to stop): the pod starts anyway and its
    events say so. The answer to that report names it again; only a live state does (a pod
    already terminating is not told twice)."""
    st = new_state()
    st.ingest("a", full("a"), 0.0)
    st.ingest("b", full("b"), 0.0)
    st.recover_until = 0.0
    st.submit(JobSpec(job_id="j", pods=2, gpus_per_pod=8, argv=["x"], grace_s=5), 0.1)
    (job, pushes), = st.schedule(0.2)
    by_node = {p.node_id: p for p in pushes if p.kind == "start"}
    assert set(by_node) == {"a", "b"}
    wid_a = by_node["a"].placement.pods[0].workload_id
    refused = {"a": ACCEPTED, "b": Outcome("refused_gpus", ("b-g0",))}
    stops = st.on_acks("j", 1, refused, 0.3, list(by_node.values()))   # b refused: all or nothing
    assert job.state == "pending" and [p.node_id for p in stops if p.kind == "stop"] == ["a"]
    # that stop is lost; a's pod goes on to start and reports it
    code, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=2, full=False, events=[
        WorkloadEvent(workload_id=wid_a, job_id="j", state="fetching", at=0.5)]), 0.5)
    assert code == 200 and [v.workload_id for v in reply.stop] == [wid_a] and reply.stop[0].grace_s == 5
    _, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=3, full=False), 0.6)
    assert reply.stop == []     # told once per report that shows it alive, not on every beat
    _, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=4, full=False, events=[
        WorkloadEvent(workload_id=wid_a, job_id="j", state="running", at=0.7)]), 0.7)
    assert [v.workload_id for v in reply.stop] == [wid_a]
    _, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=5, full=False, events=[
        WorkloadEvent(workload_id=wid_a, job_id="j", state="terminating", at=0.8)]), 0.8)
    assert reply.stop == []
    _, reply, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=6, full=False, events=[
        WorkloadEvent(workload_id=wid_a, job_id="j", state="exited", exit_code=0, at=0.9)]), 0.9)
    assert reply.stop == [] and len(st.model.free_gpus("a")) == 8   # gone: its GPUs come back
    st.model.check_invariants()


def test_a_full_report_built_before_the_ack_does_not_make_its_pods_vanished():
    """A node's full report built before it accepted a placement cannot list the new pods. When
    a loaded placer reads it more than a second after the ack, the report's own ``sent_at``
    says it is older than the ack: the pods are not declared vanished. One built after the ack
    that does not list them is."""
    st, job = _one_pod_acked("j", 10.0, 10.0, 10.1)
    acked = job.timings["acked"]
    old = NodeReport(node_id="a", boot_id="boot-a", seq=2, full=True, control_url="http://a",
                     topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=snap("a"), workloads=[],
                     sent_at=acked - 0.05)
    code, _, _ = st.ingest("a", old, acked + 4.0)       # read 4 s after the ack: built before it
    assert code == 200 and job.state in ("starting", "running") and job.pods[0].state != "lost"
    late = msgspec.structs.replace(old, seq=3, sent_at=acked + 2.0)   # built after the ack, no pod
    st.ingest("a", late, acked + 4.5)
    assert job.state == "failed" and "vanished" in (job.reason or "")   # (its policy: no restart)
