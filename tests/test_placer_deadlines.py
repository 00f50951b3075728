"""The placer's deadlines at their exact boundaries: a node is lost ``lost_after_s`` after its
last word, its gangs are fenced ``fence_after_s`` later, a heartbeat moves the deadline, and a
restarted placer places nothing during its recovery window. PlacerState is pure (``now`` is
passed in), so these are virtual time without a clock: each deadline is checked a millisecond
before and at its instant. (tests/test_placer_service.py runs the same over real sockets.)"""

from __future__ import annotations

from placer.state import ACCEPTED
from scheduler_link.messages import JobSpec, NodeReport, RestartPolicy
from tests.test_placer_service_state import full, new_state

LOST_AFTER = 3.0   # heartbeat_s 1.0 x lost_after_missed 3
FENCE_AFTER = 5.0


def beat(node: str, seq: int) -> NodeReport:
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=False)


def test_lost_exactly_lost_after_s_after_the_last_word_and_a_beat_moves_it():
    st = new_state(lost_after_missed=3)
    st.ingest("a", full("a"), 0.0)
    st.tick(LOST_AFTER - 0.001)
    assert st.nodes["a"].state == "up"
    st.ingest("a", beat("a", 2), 2.5)            # a heartbeat: the deadline is now 5.5
    st.tick(LOST_AFTER)
    st.tick(2.5 + LOST_AFTER - 0.001)
    assert st.nodes["a"].state == "up"
    st.tick(2.5 + LOST_AFTER)
    assert (st.nodes["a"].state, st.nodes["a"].lost_since) == ("lost", 2.5 + LOST_AFTER)
    assert st.counters["nodes_lost"] == 1


def test_fenced_exactly_fence_after_s_after_lost_then_told_to_stop():
    st = new_state(lost_after_missed=3)
    st.recover_until = 0.0
    st.ingest("a", full("a"), 0.0)
    st.submit(JobSpec(job_id="j", pods=1, gpus_per_pod=8, argv=["x"], restart=RestartPolicy(kind="on-preemption")),
              0.0)
    (job, pushes), = st.schedule(0.0)
    wid = pushes[0].placement.pods[0].workload_id
    st.on_acks("j", 1, {"a": ACCEPTED}, 0.0)
    st.tick(LOST_AFTER)
    assert st.nodes["a"].state == "lost" and job.attempt == 1 and job.state != "pending"
    st.tick(LOST_AFTER + FENCE_AFTER - 0.001)
    assert job.restarts == 0 and job.state != "pending"       # lost, not yet fenced
    st.tick(LOST_AFTER + FENCE_AFTER)
    assert (job.state, job.restarts) == ("pending", 1)         # fenced: requeued by its policy
    assert st.counters["fenced_stops"] == 1 and st.nodes["a"].tell == {wid}   # told when it comes back


def test_nothing_is_placed_during_the_recovery_window():
    st = new_state()                                 # recover_s 2.0; a restarted placer
    st.recover_until = 2.0
    st.ingest("a", full("a"), 0.0)
    st.submit(JobSpec(job_id="j", pods=1, gpus_per_pod=8, argv=["x"]), 0.0)
    assert st.schedule(2.0 - 0.001) == []
    (job, pushes), = st.schedule(2.0)
    assert job.job_id == "j" and [p.node_id for p in pushes] == ["a"]
