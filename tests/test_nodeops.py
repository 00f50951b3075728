"""Cordon, uncordon and drain on PlacerState alone (``now`` passed in), and the cordon
journal record across a reopen."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placer.journal import Journal
from placer.state import JobError, PlacerState
from scheduler_link.messages import JobSpec, NodeReport, RestartPolicy, WorkloadEvent

from .test_placer_service_state import _ack_all, _events, full, new_state, wl


def _two_nodes() -> PlacerState:
    st = new_state()
    st.ingest("a", full("a"), 0.0)
    st.ingest("b", full("b"), 0.0)
    st.recover_until = 0.0
    return st


def _run(st: PlacerState, spec: JobSpec, now: float, seq: dict[str, int]) -> None:
    st.submit(spec, now)
    (job, pushes), = st.schedule(now + 0.1)
    _ack_all(st, job, pushes, now + 0.2)
    for p in job.pods:
        seq[p.node_id] = seq.get(p.node_id, 1) + 1
        _events(st, p.node_id, seq[p.node_id], [WorkloadEvent(workload_id=p.workload_id, job_id=job.job_id,
                                                               state="running", at=now + 0.3)], now + 0.3)
    assert st.jobs[spec.job_id].state == "running"


def test_cordon_places_nothing_new_and_survives_a_full_report():
    st = _two_nodes()
    st.cordon("a", 1.0, reason="disk")
    assert st.nodes["a"].cordoned and st.node_view(st.nodes["a"]).cordoned
    assert st.model.statistics()["draining_nodes"] == 1
    st.submit(JobSpec(job_id="j", pods=2, gpus_per_pod=8, argv=["x"]), 1.0)
    assert st.schedule(1.1) == []            # only b is usable: a 2 x 8 gang does not fit
    # the node re-registers (a full report rebuilds its record): still cordoned
    st.ingest("a", full("a", seq=5), 1.2)
    assert st.nodes["a"].cordoned and st.model.statistics()["draining_nodes"] == 1
    assert st.schedule(1.3) == []
    # a heartbeat after being lost (node back) must not clear it either
    st.tick(10.0)
    assert st.nodes["a"].state == "lost"
    st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=6, full=False), 10.1)
    assert st.nodes["a"].state == "up" and st.model.statistics()["draining_nodes"] == 1
    st.ingest("b", full("b", seq=9), 10.1)
    st.uncordon("a", 10.2)
    assert not st.nodes["a"].cordoned and st.model.statistics()["draining_nodes"] == 0
    (job, _), = st.schedule(10.3)
    assert {p.node_id for p in job.pods} == {"a", "b"}
    st.model.check_invariants()


def test_cordon_of_an_unknown_node_is_404_unless_replayed():
    st = new_state()
    with pytest.raises(JobError) as e:
        st.cordon("zz", 0.0)
    assert e.value.status == 404
    st.cordon("zz", 0.0, reason="from the journal", known=False)  # a replay: applies at registration
    st.ingest("zz", full("zz"), 0.1)
    assert st.nodes["zz"].cordoned and st.model.statistics()["draining_nodes"] == 1


def test_drain_stops_preemptible_gangs_lists_the_others_and_force_stops_them():
    st = _two_nodes()
    seq: dict[str, int] = {}
    _run(st, JobSpec(job_id="p", pods=1, gpus_per_pod=4, priority=1, argv=["x"], grace_s=30,
                     restart=RestartPolicy(kind="on-preemption")), 0.1, seq)
    _run(st, JobSpec(job_id="q", pods=1, gpus_per_pod=4, preemptible=False, argv=["y"]), 1.0, seq)
    node_p = st.jobs["p"].pods[0].node_id
    node_q = st.jobs["q"].pods[0].node_id
    assert node_p == node_q == "a" or node_p == node_q == "b"   # best fit packs them together
    n = node_p
    wid = st.jobs["p"].pods[0].workload_id
    out, pushes = st.drain(n, 2.0, grace_s=3.0)
    assert out.stopped == ("p",) and out.left == ("q",)
    assert st.nodes[n].cordoned and st.node_view(st.nodes[n]).draining
    # the preemptible gang's pod is told to stop with the drain's grace; the job is requeued
    victims = [v for p in pushes for v in p.placement.victims]
    assert [v.workload_id for v in victims] == [wid]
    assert victims[0].grace_s == 3.0
    assert st.jobs["p"].state == "pending" and st.jobs["q"].state == "running"
    # placed again, never on the cordoned node
    (job, _), = st.schedule(2.1)
    assert job.job_id == "p" and {p.node_id for p in job.pods} == ({"a", "b"} - {n})
    # force stops the non-preemptible one too (restart never: it ends preempted)
    out, pushes = st.drain(n, 3.0, force=True)
    assert out.stopped == ("q",) and out.left == ()
    assert st.jobs["q"].state == "preempted" and st.jobs["q"].reason == f"node {n} drained"
    st.model.check_invariants()


def test_drain_with_a_bad_grace_is_refused():
    st = _two_nodes()
    with pytest.raises(JobError):
        st.drain("a", 0.0, grace_s=-1)
    with pytest.raises(JobError) as e:
        st.drain("nope", 0.0)
    assert e.value.status == 404


def test_a_running_workload_reported_on_a_cordoned_node_is_kept():
    """A cordon never moves what runs: a full report of a running pod keeps it adopted."""
    st = _two_nodes()
    seq: dict[str, int] = {}
    _run(st, JobSpec(job_id="p", pods=1, gpus_per_pod=8, argv=["x"]), 0.1, seq)
    n = st.jobs["p"].pods[0].node_id
    st.cordon(n, 1.0)
    wid = st.jobs["p"].pods[0].workload_id
    st.ingest(n, full(n, seq=20, workloads=[wl(wid, "p", n, list(range(8)))]), 1.1)
    assert st.jobs["p"].state == "running" and st.nodes[n].cordoned


def test_journal_keeps_the_last_cordon_per_node_and_compaction_keeps_it(tmp_path):
    j = Journal.open(tmp_path)
    j.cordon("a", True, 1.0, "disk")
    j.cordon("b", True, 1.0, "")
    j.cordon("b", False, 2.0)
    j.close()
    j = Journal.open(tmp_path)
    assert j.cordons == {"a": "disk"}
    for i in range(80):  # enough ended jobs to make the next open compact the file
        spec = JobSpec(job_id=f"j{i}", argv=["x"])
        j.submitted(spec, 3.0)
        j.ended(spec.job_id, "succeeded", 3.0)
    j.close()
    before = len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0])  # its records (zeros follow)
    j = Journal.open(tmp_path)
    assert len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0]) < before  # compacted
    assert j.cordons == {"a": "disk"}
    j.close()
    assert Journal.open(tmp_path).cordons == {"a": "disk"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st_ops=st.lists(st.tuples(st.sampled_from(["cordon", "uncordon", "drain", "submit", "report", "tick"]),
                                 st.integers(0, 3), st.integers(1, 8), st.booleans()), max_size=25))
def test_nothing_new_is_ever_placed_on_a_cordoned_node(st_ops):
    """Whatever the order of cordons, drains, submissions and full reports, a decision
    never puts a pod on a node cordoned at that moment, and the model's invariants hold."""
    s = new_state()
    nodes = [f"n{i}" for i in range(4)]
    seq = dict.fromkeys(nodes, 1)
    for n in nodes:
        s.ingest(n, full(n), 0.0)
    s.recover_until = 0.0
    now = 0.0
    for k, (op, i, g, flag) in enumerate(st_ops):
        now += 0.1
        n = nodes[i]
        if op == "cordon":
            s.cordon(n, now)
        elif op == "uncordon":
            s.uncordon(n, now)
        elif op == "drain":
            s.drain(n, now, force=flag)
        elif op == "submit":
            s.submit(JobSpec(job_id=f"j{k}", pods=1 + (g % 2), gpus_per_pod=g, preemptible=flag, argv=["x"],
                             restart=RestartPolicy(kind="on-preemption")), now)
        elif op == "report":
            seq[n] += 10
            s.ingest(n, full(n, seq=seq[n]), now)  # a re-registration (no workloads: they are gone)
        else:
            s.tick(now)
        for job, pushes in s.schedule(now):
            _ack_all(s, job, pushes, now)
            placed = {p.node_id for p in job.pods}
            assert not placed & set(s.cordons), (job.job_id, placed, s.cordons)
        assert s.model.statistics()["draining_nodes"] == sum(
            1 for x in s.nodes.values() if x.cordoned) == len(set(s.cordons) & set(s.nodes))
        s.model.check_invariants()
