"""The job queue: strict priority, FIFO within a priority, backfill, reservations, cancel."""

from __future__ import annotations

import pytest

from placer import ClusterModel, Conflict, InvalidSpec, JobRequest, NodeSpec, UnknownJob
from placer.queue import JobQueue


def racks(n_racks: int, nodes: int, g: int = 8) -> ClusterModel:
    return ClusterModel.build([NodeSpec(f"r{r}n{n}", "z", "b", f"r{r}", g)
                               for r in range(n_racks) for n in range(nodes)])


def test_strict_priority_then_fifo() -> None:
    m = racks(1, 1)
    q = JobQueue(allow_preemption=False)
    q.submit(JobRequest("a", 1, 8, "node", priority=0), now=0)
    q.submit(JobRequest("b", 1, 8, "node", priority=1), now=1)
    q.submit(JobRequest("c", 1, 8, "node", priority=1), now=2)
    assert [p.request.job_id for p in q.pending()] == ["b", "c", "a"]
    order = []
    for t in range(3):
        ds = q.schedule(m, now=10 + t)
        assert len(ds) == 1
        order.append(ds[0].job_id)
        m.release(ds[0].job_id)
    assert order == ["b", "c", "a"]
    assert len(q) == 0 and q.statistics()["placed"] == 3


def test_small_jobs_backfill_past_a_large_one() -> None:
    m = racks(1, 2)
    m.assign("running", "r0n0", [0, 1, 2, 3], priority=0, preemptible=False)
    q = JobQueue(allow_preemption=False, reserve_after_rounds=100)
    q.submit(JobRequest("big", 2, 8, "rack"), now=0)
    q.submit(JobRequest("small", 1, 4, "node"), now=1)
    ds = q.schedule(m, now=2)
    assert [d.job_id for d in ds] == ["small"]
    assert "big" in q and q.pending()[0].rounds == 1


def _blocked_cluster() -> ClusterModel:
    # r0: nodes with 7 and 1 free; r1: 6 and 6 free. No rack holds two whole nodes.
    m = racks(2, 2)
    m.assign("hold-r0n0", "r0n0", [0], priority=0, preemptible=False)
    m.assign("hold-r0n1", "r0n1", range(7), priority=0, preemptible=False)
    m.assign("hold-r1n0", "r1n0", [0, 1], priority=0, preemptible=False)
    m.assign("hold-r1n1", "r1n1", [0, 1], priority=0, preemptible=False)
    return m


@pytest.mark.parametrize("reserve", [True, False])
def test_reservation_after_bounded_wait_lets_the_large_job_in(reserve: bool) -> None:
    m = _blocked_cluster()
    q = JobQueue(allow_preemption=False, reserve_after_rounds=2 if reserve else 10**6)
    q.submit(JobRequest("big", 2, 8, "rack"), now=0)
    placed: list[str] = []
    for t in range(1, 4):
        q.submit(JobRequest(f"s{t}", 1, 1, "node"), now=t)
        placed += [d.job_id for d in q.schedule(m, now=t)]
    assert placed == ["s1", "s2", "s3"]             # small jobs are never blocked
    racks_used = {m.domain_of(n, "rack") for j in placed[1:] for n in m.jobs[j].gpus_by_node}
    if not reserve:
        # best fit alone sends them to r1's tighter nodes: the big job would wait forever
        assert racks_used == {"z/b/r1"}
        return
    assert q.pending()[0].reserved
    assert racks_used == {"z/b/r0"}                 # r1 is held for "big"
    m.release("hold-r1n0")
    m.release("hold-r1n1")
    ds = q.schedule(m, now=10)
    assert [d.job_id for d in ds] == ["big"] and ds[0].domain == "z/b/r1"
    m.check_invariants()


def test_reservation_by_time() -> None:
    m = racks(1, 1)
    m.assign("hold", "r0n0", [0], priority=0, preemptible=False)
    q = JobQueue(allow_preemption=False, reserve_after_rounds=10**6, reserve_after_s=30.0)
    q.submit(JobRequest("big", 1, 8, "node"), now=0)
    q.schedule(m, now=10)
    assert not q.pending()[0].reserved
    q.schedule(m, now=31)
    assert q.pending()[0].reserved
    q.submit(JobRequest("small", 1, 1, "node"), now=32)
    assert q.schedule(m, now=33) == []          # the only node is held for "big"


def test_preemption_through_the_queue() -> None:
    m = racks(1, 1)
    q = JobQueue()
    q.submit(JobRequest("low", 1, 8, "node", priority=0), now=0)
    assert [d.job_id for d in q.schedule(m, now=0)] == ["low"]
    q.submit(JobRequest("high", 1, 8, "node", priority=5), now=1)
    ds = q.schedule(m, now=1)
    assert [(d.job_id, d.victims) for d in ds] == [("high", ["low"])]
    assert "low" not in m.jobs and q.statistics()["preemptions"] == 1


def test_cancel_and_bad_input_lose_nothing() -> None:
    m = racks(1, 1)
    q = JobQueue()
    q.submit(JobRequest("a", 1, 8, "node"), now=0)
    with pytest.raises(Conflict):
        q.submit(JobRequest("a", 1, 8, "node"), now=0)
    with pytest.raises(InvalidSpec):
        q.submit(JobRequest("b", 0, 8, "node"), now=0)
    with pytest.raises(InvalidSpec):
        q.submit(JobRequest("b", 1, 8, "galaxy"), now=0)
    with pytest.raises(InvalidSpec):
        q.submit(JobRequest("b", 1, 8, "rack", prefer="zone"), now=0)
    assert len(q) == 1
    assert q.cancel("a").job_id == "a"
    with pytest.raises(UnknownJob):
        q.cancel("a")
    assert len(q) == 0 and q.schedule(m, now=1) == []
    assert int(m.free.sum()) == 8
