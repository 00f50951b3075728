"""Cluster model: construction, domains, mutations, invariants, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from placer import ClusterModel, Conflict, InvalidSpec, JobRequest, NodeSpec, UnknownJob, UnknownNode, place


def hgx(zones: int = 1, blocks: int = 2, racks: int = 2, nodes: int = 3, g: int = 8) -> list[NodeSpec]:
    return [NodeSpec(f"z{z}b{b}r{r}n{n}", f"z{z}", f"b{b}", f"r{r}", g)
            for z in range(zones) for b in range(blocks) for r in range(racks) for n in range(nodes)]


def test_domains_are_contiguous_slices_in_topology_order() -> None:
    specs = hgx(zones=2)
    m = ClusterModel.build(reversed(specs))
    assert m.node_ids == sorted(s.node_id for s in specs)
    m.check_invariants()
    st = m.statistics()
    assert st["gpus"] == 2 * 2 * 2 * 3 * 8 == st["free"]
    assert [st["levels"][lv]["domains"] for lv in ("zone", "block", "rack", "nvlink", "node")] == [2, 4, 8, 24, 24]
    assert m.domain_of("z1b0r1n2", "rack") == "z1/b0/r1"


def test_nvl72_trays_share_an_nvlink_domain_per_rack() -> None:
    specs = [NodeSpec(f"t{r}-{i}", "z", "b", f"r{r}", 4, nvlink_domain=f"clique-{r}")
             for r in range(2) for i in range(18)]
    m = ClusterModel.build(specs)
    assert m.statistics()["levels"]["nvlink"]["domains"] == 2
    d = place(m, JobRequest("j", 18, 4, "nvlink"))
    assert d is not None and d.domain in ("clique-0", "clique-1")
    assert len({m.domain_of(p.node_id, "nvlink") for p in d.pods}) == 1


def test_bad_specs_are_refused_and_lose_nothing() -> None:
    with pytest.raises(InvalidSpec):
        ClusterModel.build([NodeSpec("a", "z", "b", "r", -1)])
    with pytest.raises(InvalidSpec):
        ClusterModel.build([NodeSpec("", "z", "b", "r", 8)])
    with pytest.raises(InvalidSpec):
        ClusterModel.build([NodeSpec("a", "z", "b", "r", 8), NodeSpec("a", "z", "b", "r", 8)])
    m = ClusterModel.build(hgx())
    with pytest.raises(UnknownNode):
        m.set_node_state("nope", healthy=False)
    with pytest.raises(InvalidSpec):
        m.set_gpu_health("z0b0r0n0", 8, healthy=False)
    with pytest.raises(UnknownJob):
        m.release("nope")
    with pytest.raises(InvalidSpec):
        m.upsert_node(NodeSpec("x", "z", "b", "r", 999))
    assert m.n_nodes == 12
    m.check_invariants()


def test_allocate_release_and_stale_decisions() -> None:
    m = ClusterModel.build(hgx())
    d = place(m, JobRequest("a", 2, 8, "rack"))
    assert d is not None
    m.allocate(d)
    with pytest.raises(Conflict):
        m.allocate(d)               # same job id again
    d2 = place(m, JobRequest("b", 1, 8, "node"))
    assert d2 is not None
    m.assign("other", d2.pods[0].node_id, [0], priority=0, preemptible=True)
    with pytest.raises(Conflict):
        m.allocate(d2)              # stale: slot 0 is taken now
    assert "b" not in m.jobs
    m.check_invariants()
    assert m.release("a") == 16
    assert m.release("other") == 1
    assert int(m.free.sum()) == 96
    m.check_invariants()


def test_assign_rebuilds_allocations_and_refuses_conflicts() -> None:
    m = ClusterModel.build(hgx())
    m.assign("j", "z0b0r0n0", [0, 1], priority=3, preemptible=False)
    m.assign("j", "z0b0r0n0", [1, 2], priority=3, preemptible=False)   # idempotent for 1
    m.assign("j", "z0b1r1n2", [7], priority=3, preemptible=False)
    assert m.jobs["j"].gpus_by_node == {"z0b0r0n0": (0, 1, 2), "z0b1r1n2": (7,)}
    with pytest.raises(Conflict):
        m.assign("k", "z0b0r0n0", [2, 3], priority=0, preemptible=True)
    with pytest.raises(InvalidSpec):
        m.assign("k", "z0b0r0n0", [8], priority=0, preemptible=True)
    with pytest.raises(InvalidSpec):
        m.assign("k", "z0b0r0n0", [4, 4], priority=0, preemptible=True)
    assert "k" not in m.jobs
    m.check_invariants()


def test_health_and_drain_exclude_gpus_but_keep_owners() -> None:
    m = ClusterModel.build(hgx(blocks=1, racks=1, nodes=2))
    m.assign("j", "z0b0r0n0", [0, 1], priority=0, preemptible=True)
    m.set_gpu_health("z0b0r0n0", 0, healthy=False)
    m.set_gpu_health("z0b0r0n0", 5, healthy=False)
    assert m.free_gpus("z0b0r0n0") == [2, 3, 4, 6, 7]
    assert m.owner_of("z0b0r0n0", 0) == "j"
    m.set_node_state("z0b0r0n1", healthy=True, draining=True)
    assert m.free_gpus("z0b0r0n1") == []
    assert place(m, JobRequest("x", 1, 6, "node"), allow_preemption=False) is None
    m.set_gpu_health("z0b0r0n0", 5, healthy=True)
    d = place(m, JobRequest("x", 1, 6, "node"), allow_preemption=False)
    assert d is not None and d.pods[0].slots == (2, 3, 4, 5, 6, 7)
    m.check_invariants()


def test_upsert_and_remove_rebuild_and_keep_allocations_and_health() -> None:
    specs = hgx(blocks=1, racks=2, nodes=2)
    m = ClusterModel.build(specs)
    m.assign("j", "z0b0r1n1", [3, 4], priority=1, preemptible=True)
    m.assign("k", "z0b0r0n0", [0], priority=1, preemptible=True)
    m.set_gpu_health("z0b0r1n1", 7, healthy=False)
    m.set_node_state("z0b0r0n1", healthy=False)
    m.upsert_node(NodeSpec("a-first", "z0", "a", "r0", 4))
    m.upsert_node(NodeSpec("z0b0r1n1", "z0", "b0", "r1", 8))      # unchanged: no rebuild needed
    assert m.node_ids[0] == "a-first"
    assert m.jobs["j"].gpus_by_node == {"z0b0r1n1": (3, 4)}
    assert m.free_gpus("z0b0r1n1") == [0, 1, 2, 5, 6]
    assert m.free_gpus("z0b0r0n1") == []
    assert m.remove_node("z0b0r0n0") == ["k"]
    assert m.jobs["k"].n_gpus == 0 and not m.has_node("z0b0r0n0")
    m.upsert_node(NodeSpec("z0b0r1n1", "z0", "b0", "r1", 4))       # shrinks: slot 4 vanishes
    assert m.jobs["j"].gpus_by_node == {"z0b0r1n1": (3,)}
    m.check_invariants()
    assert int(m.gpus_per_node.sum()) == 4 + 8 + 8 + 4


def test_copy_is_independent() -> None:
    m = ClusterModel.build(hgx())
    c = m.copy()
    c.assign("j", "z0b0r0n0", [0], priority=0, preemptible=True)
    assert "j" not in m.jobs and m.free_gpus("z0b0r0n0") == list(range(8))
    c.check_invariants()
    m.check_invariants()
    assert np.array_equal(m.owner >= 0, np.zeros_like(m.owner, bool))


def test_prefer_packs_softly_and_falls_back() -> None:
    m = ClusterModel.build(hgx(blocks=1, racks=2, nodes=2))
    m.assign("x", "z0b0r0n0", [0], priority=0, preemptible=False)
    d = place(m, JobRequest("p", 2, 8, "any", prefer="rack"), allow_preemption=False)
    assert d is not None and d.level == "rack" and d.domain == "z0/b0/r1"
    m.allocate(d)
    # no rack can hold 2 whole nodes now: falls back to `within=any`
    m.release("x")
    m.assign("y", "z0b0r0n1", [0], priority=0, preemptible=False)
    d = place(m, JobRequest("q", 2, 4, "any", prefer="node"), allow_preemption=False)
    assert d is not None and d.level == "node" and len({p.node_id for p in d.pods}) == 1
    d = place(m, JobRequest("r", 3, 4, "any", prefer="node"), allow_preemption=False)
    assert d is not None and d.level == "any" and len({p.node_id for p in d.pods}) == 2


def test_whole_nodes_take_every_gpu_of_free_nodes_only() -> None:
    specs = [NodeSpec("a4", "z", "b", "r", 4), NodeSpec("b8", "z", "b", "r", 8), NodeSpec("c8", "z", "b", "r", 8)]
    m = ClusterModel.build(specs)
    m.assign("x", "c8", [7], priority=0, preemptible=True)
    d = place(m, JobRequest("w", 2, 0, "rack", whole_nodes=True), allow_preemption=False)
    assert d is not None
    assert sorted((p.node_id, p.slots) for p in d.pods) == [("a4", (0, 1, 2, 3)), ("b8", tuple(range(8)))]
    assert place(m, JobRequest("w8", 2, 8, "rack", whole_nodes=True), allow_preemption=False) is None
    d = place(m, JobRequest("w8", 2, 8, "rack", whole_nodes=True, priority=1))
    assert d is not None and d.victims == ["x"] and {p.node_id for p in d.pods} == {"b8", "c8"}
    m.allocate(d)
    m.check_invariants()


def test_fits_when_empty_tells_jobs_that_can_never_run() -> None:
    from placer import fits_when_empty
    m = ClusterModel.build(hgx(blocks=1, racks=2, nodes=2))
    m.assign("x", "z0b0r0n0", range(8), priority=9, preemptible=False)
    assert fits_when_empty(m, JobRequest("a", 2, 8, "rack"))
    assert not fits_when_empty(m, JobRequest("b", 3, 8, "rack"))     # a rack has 2 nodes
    assert not fits_when_empty(m, JobRequest("c", 1, 16, "node"))    # no node has 16 GPUs
    m.set_node_state("z0b0r1n0", healthy=False)
    assert not fits_when_empty(m, JobRequest("d", 4, 8, "any"))
    with pytest.raises(InvalidSpec):
        fits_when_empty(m, JobRequest("e", 1, 8, "rack", prefer="block"))


def test_a_decision_naming_a_gpu_twice_is_refused() -> None:
    from placer.place import Decision
    m = ClusterModel.build(hgx())
    i = m.node_index("z0b0r0n0")
    bad = Decision("dup", 0, True, [], None, "any", np.array([i, i]), np.array([[0, 1], [1, 2]]),
                   m.epoch, m.node_ids, 2)
    with pytest.raises(Conflict):
        m.allocate(bad)
    with pytest.raises(Conflict):
        m.assign_arrays("dup2", np.array([i, i]), np.array([3, 3]), priority=0, preemptible=True)
    assert not m.jobs and m.free_gpus("z0b0r0n0") == list(range(8))
    ok = Decision("ok", 0, True, [], None, "any", np.array([i, i]), np.array([[0, 1], [2, 3]]),
                  m.epoch, m.node_ids, 2)
    m.allocate(ok)
    assert m.jobs["ok"].gpus_by_node == {"z0b0r0n0": (0, 1, 2, 3)}
    m.check_invariants()


def test_hold_many_past_the_job_tables_capacity_grows_it_and_rows_are_each_holders() -> None:
    """More holders than the job table has free rows: it grows (in one call), each holder gets
    a row of its own with its priority and GPU count, and releasing them gives every row back."""
    specs = hgx(racks=8, nodes=16)
    m = ClusterModel.build(specs)
    free_rows = len(m._free_job_idx)
    holders = [(f"stale:w{k}", s.node_id, list(range(8))) for k, s in enumerate(specs)]
    holders += [(f"stale:x{k}", s.node_id, [0]) for k, s in enumerate(specs)]   # (taken: nothing given)
    assert len(specs) > free_rows
    assert m.hold_many(holders, 7) == 8 * len(specs)
    m.check_invariants()
    rows = [m.jobs[f"stale:w{k}"].index for k in range(len(specs))]
    assert len(set(rows)) == len(specs) and "stale:x0" not in m.jobs
    assert set(m.job_priority[rows].tolist()) == {7} and set(m.job_gpus[rows].tolist()) == {8}
    assert m.job_active[rows].all() and not m.job_preemptible[rows].any()
    assert [m._job_ids[r] for r in rows] == [f"stale:w{k}" for k in range(len(specs))]
    for k in range(len(specs)):
        m.release(f"stale:w{k}")
    m.check_invariants()
    assert int(m.free.sum()) == 8 * len(specs) and not m.job_active[rows].any()


def _hold_one_by_one(m: ClusterModel, holders: list[tuple[str, str, list[int]]], priority: int) -> None:
    """What the placer did before hold_many: free_gpus, then assign, holder by holder."""
    for hid, node_id, slots in holders:
        if node_id not in m.node_ids or not slots:
            continue
        free = set(m.free_gpus(node_id))
        keep = [s for s in slots if s in free]
        if keep:
            m.assign(hid, node_id, keep, priority, False)


def _holdings(m: ClusterModel) -> dict[str, tuple[int, bool, list[tuple[int, int]]]]:
    return {j: (r.priority, r.preemptible, sorted(zip(r.nodes.tolist(), r.slots.tolist(), strict=True)))
            for j, r in m.jobs.items()}


@pytest.mark.parametrize("seed", range(40))
def test_hold_many_gives_what_free_then_assign_gave(seed: int) -> None:
    """hold_many in one vector step ends in the same model as one free_gpus + assign a holder:
    GPUs already taken or unhealthy skipped, a GPU named twice kept by the first holder, holders
    that exist already, unknown nodes and bad slots."""
    rng = np.random.default_rng(seed)
    specs = hgx(racks=3, nodes=4)
    base = ClusterModel.build(specs)
    ids = [s.node_id for s in specs]
    for k in range(int(rng.integers(0, 6))):
        node = ids[int(rng.integers(len(ids)))]
        free = base.free_gpus(node)
        if free:
            base.assign(f"j{k}", node, rng.choice(free, size=int(rng.integers(1, len(free) + 1)),
                                                  replace=False).tolist(), 1, True)
    for _ in range(int(rng.integers(0, 5))):
        base.set_gpu_health(ids[int(rng.integers(len(ids)))], int(rng.integers(8)), False)
    holders: list[tuple[str, str, list[int]]] = []
    for h in range(int(rng.integers(1, 30))):
        node = ids[int(rng.integers(len(ids)))] if rng.random() > 0.05 else "nowhere"
        slots = sorted(set(rng.integers(0, 8, size=int(rng.integers(0, 5))).tolist()))
        if rng.random() < 0.05:
            slots.append(9)   # out of range: skipped
        holders.append((f"stale:w{h}", node, slots))
    if holders and rng.random() < 0.3:   # a holder held before
        hid, node, slots = holders[0]
        if node in ids:
            _hold_one_by_one(base, [(hid, node, slots[:1])], 5)
    a, b = base.copy(), base.copy()
    _hold_one_by_one(a, [(h, n, [s for s in sl if s < 8]) for h, n, sl in holders], 5)
    got = b.hold_many(holders, 5)
    b.check_invariants()
    a.check_invariants()
    assert np.array_equal(a.owner >= 0, b.owner >= 0) and np.array_equal(a.free, b.free)
    assert _holdings(a) == _holdings(b)
    assert got == int((b.owner >= 0).sum() - (base.owner >= 0).sum())


def test_a_job_given_gpus_node_by_node_grows_in_place() -> None:
    """assign() node by node (a promoted follower adopting a gang pod by pod) appends into room
    kept for it, not a copy of everything held so far per call (quadratic at 25,000 pods); the
    arrays handed out before keep their length and contents, and a copy of the model is not
    written through."""
    m = ClusterModel.build(hgx(blocks=4, racks=4, nodes=8))
    ids = m.node_ids
    m.assign("g", ids[0], [0, 1], 5, False)
    before = m.job("g")
    kept_nodes, kept_slots = before.nodes, before.slots
    copied = m.copy()
    m.assign("g", ids[1], [1], 5, False)
    prev, copies = m.job("g").nodes, 0
    for k, nid in enumerate(ids[2:40], start=2):
        m.assign("g", nid, [k % 8], 5, False)
        rec = m.job("g")
        assert rec.nodes.size == 2 + k
        copies += not np.shares_memory(rec.nodes, prev)
        prev = rec.nodes
    assert copies <= 3   # 38 appends: the room doubled as it filled (6, 14, 30, 62), never a copy per append
    rec = m.job("g")
    assert [ids[i] for i in rec.nodes.tolist()] == [ids[0], ids[0], *ids[1:40]]
    assert rec.slots.tolist() == [0, 1, *[k % 8 for k in range(1, 40)]]
    assert kept_nodes.tolist() == [m.node_index(ids[0])] * 2 and kept_slots.tolist() == [0, 1]
    assert copied.job("g").n_gpus == 2
    copied.assign("g", ids[1], [7], 5, False)
    assert m.job("g").slots[2] == 1 and copied.job("g").slots.tolist() == [0, 1, 7]
    m.check_invariants()
    copied.check_invariants()
    m.release("g")
    assert m.free_gpus(ids[0]) == list(range(8))
