"""Fragmentation score (FGD-style), largest placeable gang, and the defragmentation planner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placer import ClusterModel, InvalidSpec, JobRequest, NodeSpec, place
from placer.frag import DEFAULT_SHAPES, Shape, fragmentation, largest_placeable, plan_defrag


def racks(n_racks: int, nodes: int, g: int = 8) -> ClusterModel:
    return ClusterModel.build([NodeSpec(f"r{r}n{n}", "z", "b", f"r{r}", g)
                               for r in range(n_racks) for n in range(nodes)])


def test_empty_cluster_is_not_fragmented() -> None:
    m = racks(2, 2)
    f = fragmentation(m)
    assert f["overall"] == 0.0 and f["node"] == 0.0
    assert largest_placeable(m) == {"any": 32, "zone": 32, "block": 32, "rack": 16, "nvlink": 8, "node": 8}


def test_fragmented_share_of_free_gpus() -> None:
    m = racks(1, 2)
    m.assign("a", "r0n0", [0], priority=0, preemptible=True)
    # an 8-GPU node shape fits only r0n1: r0n0's 7 free GPUs are fragmented for it
    f = fragmentation(m, [Shape(8, "node", 1.0)])
    assert f["node"] == pytest.approx(7 / 15)
    # a 4-GPU shape fits both nodes: nothing fragmented; weighted together: half of 7/15
    f = fragmentation(m, [Shape(8, "node", 1.0), Shape(4, "node", 1.0)])
    assert f["node"] == pytest.approx(7 / 30) == f["overall"]
    # a 16-GPU rack shape no longer fits the rack: every free GPU is fragmented for it
    assert fragmentation(m, [Shape(16, "rack", 1.0)])["rack"] == pytest.approx(1.0)
    # shapes no empty domain could host are left out (capacity, not fragmentation)
    assert "zone" not in fragmentation(m, [Shape(4096, "zone", 1.0)])
    assert largest_placeable(m)["rack"] == 8
    assert largest_placeable(m, gpus_per_pod=1)["rack"] == 15
    with pytest.raises(InvalidSpec):
        fragmentation(m, [Shape(0, "node", 1.0)])


def _place(m: ClusterModel, jid: str, pods: int, g: int, within: str, **kw) -> None:
    d = place(m, JobRequest(jid, pods, g, within, **kw), allow_preemption=False)
    assert d is not None
    m.allocate(d)


def test_defrag_moves_small_jobs_to_free_whole_racks() -> None:
    m = racks(3, 2)
    _place(m, "big", 1, 8, "node")                  # best fit: r0n0
    _place(m, "tiny", 1, 2, "node")                 # the tightest node with room: r0n1
    _place(m, "other", 1, 4, "node")                # r0n1 again (6 free -> 2 free)
    m.assign("stray", "r1n0", [0], priority=0, preemptible=True)
    m.set_job_shape("stray", 1, 1, "node")
    before = m.statistics()["levels"]["rack"]["wholly_free"]
    moves = plan_defrag(m, max_moves=4)
    assert moves and {mv.job_id for mv in moves} == {"stray"}
    assert moves[0].from_nodes == ("r1n0",)
    # the planner only proposes
    assert m.owner_of("r1n0", 0) == "stray"
    for mv in moves:
        m.release(mv.job_id)
        m.allocate(mv.to_decision)
    m.check_invariants()
    assert m.statistics()["levels"]["rack"]["wholly_free"] == before + 1


def test_defrag_respects_limits_and_non_preemptible_jobs() -> None:
    m = racks(2, 2)
    m.assign("pinned", "r1n0", [0], priority=0, preemptible=False)
    m.set_job_shape("pinned", 1, 1, "node")
    assert plan_defrag(m, max_moves=4) == []        # the only partly used rack cannot be emptied
    m.assign("movable", "r0n0", [0], priority=0, preemptible=True)
    m.set_job_shape("movable", 1, 1, "node")
    assert plan_defrag(m, max_moves=0) == []
    moves = plan_defrag(m, max_moves=1)
    assert [mv.job_id for mv in moves] == ["movable"]
    assert moves[0].to_decision.pods[0].node_id.startswith("r1")
    unknown = racks(1, 2)
    unknown.assign("no-shape", "r0n0", [0], priority=0, preemptible=True)
    assert plan_defrag(unknown, max_moves=4) == []  # a job of unknown gang shape never moves
    with pytest.raises(InvalidSpec):
        plan_defrag(m, max_moves=-1)
    with pytest.raises(InvalidSpec):
        plan_defrag(m, max_moves=1, level="any")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["node", "rack"]), st.integers(1, 2)),
                min_size=1, max_size=12), st.integers(0, 6))
def test_defrag_moves_are_valid_in_order(jobs: list, max_moves: int) -> None:
    m = racks(3, 3)
    for k, (g, within, pods) in enumerate(jobs):
        d = place(m, JobRequest(f"j{k}", pods, g, within), allow_preemption=False)
        if d is not None:
            m.allocate(d)
    free_before = int(m.free.sum())
    moves = plan_defrag(m, max_moves)
    assert len(moves) <= max_moves
    for mv in moves:
        rec = m.jobs[mv.job_id]
        assert rec.preemptible and rec.n_gpus <= 64
        m.release(mv.job_id)
        m.allocate(mv.to_decision)
        assert m.jobs[mv.job_id].n_gpus == rec.n_gpus
    m.check_invariants()
    assert int(m.free.sum()) == free_before
    assert 0.0 <= fragmentation(m, DEFAULT_SHAPES)["overall"] <= 1.0
