"""Property tests of the placer core over random clusters and job streams (hypothesis).

Invariants: no GPU given twice; gangs all-or-nothing; ``within`` respected; unhealthy or
draining never used; preemption only of strictly lower priority and preemptible jobs, and
no victim that is not needed; after release every GPU is free; the model's invariants hold
after node add/remove/health changes; the naive reference placer agrees on feasibility.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from placer import ClusterModel, Decision, JobRequest, NodeSpec, place
from placer.model import LEVELS
from placer.reference import ReferenceCluster

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw: st.DrawFn) -> list[NodeSpec]:
    specs: list[NodeSpec] = []
    for z in range(draw(st.integers(1, 2))):
        for b in range(draw(st.integers(1, 2))):
            for r in range(draw(st.integers(1, 3))):
                nvl = draw(st.booleans())
                g = draw(st.sampled_from([1, 2, 4, 8]))
                for n in range(draw(st.integers(1, 4))):
                    gg = g if draw(st.integers(0, 5)) else draw(st.sampled_from([1, 2, 4, 8]))
                    specs.append(NodeSpec(f"z{z}b{b}r{r}n{n}", f"z{z}", f"b{b}", f"r{r}", gg,
                                          f"nvl-z{z}b{b}r{r}" if nvl else None))
    return specs


jobs_st = st.builds(
    lambda pods, g, within, prio, pre, whole: (pods, g, within, prio, pre, whole),
    st.integers(1, 6), st.integers(1, 8), st.sampled_from(["any", *LEVELS]), st.integers(0, 3),
    st.booleans(), st.integers(0, 9).map(lambda x: x == 0))
# a soft `prefer` level finer than `within`, or none
prefer_st = st.sampled_from([None, *LEVELS])


def _prefer(within: str, prefer: str | None) -> str | None:
    order = ["any", *LEVELS]
    return prefer if prefer is not None and order.index(prefer) > order.index(within) else None

ops_st = st.lists(st.one_of(
    st.tuples(st.just("place"), jobs_st, st.booleans(), prefer_st),
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("gpu_health"), st.integers(0, 1000), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("node_state"), st.integers(0, 1000), st.booleans(), st.booleans()),
    st.tuples(st.just("add"), st.integers(0, 1000), st.sampled_from([2, 4, 8])),
    st.tuples(st.just("remove"), st.integers(0, 1000)),
), min_size=1, max_size=25)


def check_decision(model: ClusterModel, job: JobRequest, d: Decision, allow_preemption: bool,
                   exclude: np.ndarray | None = None) -> None:
    pods = d.pods
    assert len(pods) == job.pods, "all or nothing"
    assert [p.rank for p in pods] == list(range(job.pods))
    seen: set[tuple[str, int]] = set()
    victims = set(d.victims)
    for p in pods:
        i = model.node_index(p.node_id)
        if job.whole_nodes:
            assert len(p.slots) == int(model.n_gpus[i]) >= max(job.gpus_per_pod, 1)
        else:
            assert len(p.slots) == job.gpus_per_pod
        for s in p.slots:
            assert (p.node_id, s) not in seen, "GPU given twice"
            seen.add((p.node_id, s))
            assert model.usable[i, s], "unhealthy, draining or missing GPU used"
            owner = model.owner_of(p.node_id, s)
            assert owner is None or owner in victims, "GPU of a non-victim used"
    if job.within != "any":
        doms = {model.domain_of(p.node_id, job.within) for p in pods}
        assert len(doms) == 1, f"within={job.within} broken: {doms}"
    if d.level != "any":
        assert {model.domain_of(p.node_id, d.level) for p in pods} == {d.domain}
    if job.prefer is not None and d.level != job.prefer:
        assert d.level == job.within and (d.victims or not _fits_anywhere(model, job, job.prefer))
    if not allow_preemption:
        assert d.victims == []
    for v in d.victims:
        rec = model.jobs[v]
        assert rec.preemptible and rec.priority < job.priority, "illegal victim"
    # no victim that is not needed: without any one of them the gang no longer fits there
    if d.victims and len(d.victims) <= 8:
        for v in d.victims:
            rest = victims - {v}
            assert not _fits_in_domain(model, job, d, rest, exclude), f"victim {v} was not needed"


def _fits_anywhere(model: ClusterModel, job: JobRequest, level: str) -> bool:
    """Could ``job`` fit (free GPUs only) inside one domain of ``level``?"""
    from placer.reference import ReferenceCluster as RC
    probe = JobRequest(job.job_id, job.pods, job.gpus_per_pod, level, job.priority, job.preemptible,
                       whole_nodes=job.whole_nodes)
    return RC.from_model(model).place(probe) is not None


def _fits_in_domain(model: ClusterModel, job: JobRequest, d: Decision, victims: set[str],
                    exclude: np.ndarray | None = None) -> bool:
    ids = model.node_ids
    if d.level == "any":
        nodes = range(len(ids))
    else:
        nodes = [i for i, nid in enumerate(ids) if model.domain_of(nid, d.level) == d.domain]
    total = 0
    for i in nodes:
        if exclude is not None and exclude[i]:
            continue
        n = int(model.n_gpus[i])
        ok = 0
        for s in range(n):
            o = model.owner_of(ids[i], s)
            if model.usable[i, s] and (o is None or o in victims):
                ok += 1
        if job.whole_nodes:
            total += int(n > 0 and ok == n and n >= max(job.gpus_per_pod, 1))
        else:
            total += ok // job.gpus_per_pod
    return total >= job.pods


@SETTINGS
@given(clusters(), ops_st)
def test_random_streams_keep_every_invariant(specs: list[NodeSpec], ops: list) -> None:
    model = ClusterModel.build(specs)
    n_jobs = 0
    for op in ops:
        kind = op[0]
        ids = model.node_ids
        if kind == "place":
            (pods, g, within, prio, pre, whole), allow = op[1], op[2]
            n_jobs += 1
            job = JobRequest(f"j{n_jobs}", pods, g, within, prio, pre, prefer=_prefer(within, op[3]),
                             whole_nodes=whole)
            ref = ReferenceCluster.from_model(model).place(job, allow_preemption=allow)
            d = place(model, job, allow_preemption=allow)
            assert (d is None) == (ref is None), f"reference disagrees on feasibility of {job}"
            event("placed" if d is not None else "infeasible")
            if d is not None and d.victims:
                event("preempted")
            if d is not None:
                check_decision(model, job, d, allow)
                gone = set(d.victims)
                model.allocate(d)
                assert not gone & set(model.jobs)
                assert job.job_id in model.jobs
        elif kind == "release" and model.jobs:
            jid = sorted(model.jobs)[op[1] % len(model.jobs)]
            model.release(jid)
        elif kind == "gpu_health" and ids:
            nid = ids[op[1] % len(ids)]
            n = int(model.gpus_per_node[model.node_index(nid)])
            if n:
                model.set_gpu_health(nid, op[2] % n, op[3])
        elif kind == "node_state" and ids:
            model.set_node_state(ids[op[1] % len(ids)], healthy=op[2], draining=op[3])
        elif kind == "add":
            model.upsert_node(NodeSpec(f"new{op[1]}", "z0", "b0", f"r{op[1] % 3}", op[2]))
        elif kind == "remove" and len(ids) > 1:
            model.remove_node(ids[op[1] % len(ids)])
        model.check_invariants()
    for jid in list(model.jobs):
        model.release(jid)
    model.check_invariants()
    assert (model.owner == -1).all(), "a GPU is still held after every job was released"
    assert int(model.free.sum()) == int(model.usable.sum())


@SETTINGS
@given(clusters(), st.lists(jobs_st, min_size=1, max_size=12), st.randoms(use_true_random=False))
def test_fill_then_preempt_agrees_with_reference(specs: list[NodeSpec], jobs: list, rnd) -> None:
    """Fill with low-priority jobs, then ask for high-priority ones (preemption path)."""
    model = ClusterModel.build(specs)
    for k, (pods, g, within, _prio, pre, whole) in enumerate(jobs):
        d = place(model, JobRequest(f"low{k}", pods, g, within, 0, pre, whole_nodes=whole), allow_preemption=False)
        if d is not None:
            model.allocate(d)
    for k, (pods, g, within, prio, pre, whole) in enumerate(jobs):
        job = JobRequest(f"high{k}", pods, g, within, prio + 1, pre, whole_nodes=whole)
        ref = ReferenceCluster.from_model(model).place(job, allow_preemption=True)
        d = place(model, job, allow_preemption=True)
        assert (d is None) == (ref is None)
        event("high: placed with victims" if d is not None and d.victims else
              "high: placed" if d is not None else "high: infeasible")
        if d is not None:
            check_decision(model, job, d, True)
            model.allocate(d)
        model.check_invariants()


def test_preemption_prefers_cheapest_victims() -> None:
    specs = [NodeSpec(f"n{i}", "z", "b", f"r{i // 2}", 8) for i in range(4)]
    model = ClusterModel.build(specs)
    model.assign("big-low", "n0", range(8), priority=0, preemptible=True)
    model.assign("big-low", "n1", range(8), priority=0, preemptible=True)
    model.assign("small-mid", "n2", range(8), priority=1, preemptible=True)
    model.assign("keep", "n3", range(8), priority=5, preemptible=True)
    d = place(model, JobRequest("x", 1, 8, "node", priority=3))
    assert d is not None
    # big-low costs 1 x 16 GPUs; small-mid costs 2 x 8 = 16 too: tie broken by fewer GPUs lost
    assert d.victims == ["small-mid"]
    d = place(model, JobRequest("y", 1, 8, "node", priority=5))
    assert d is not None and "keep" not in d.victims
    assert place(model, JobRequest("z", 1, 8, "node", priority=0)) is None      # equal priority: never
    model.assign("np", "n2", [], priority=0, preemptible=False)
    assert np.array_equal(model.free, np.zeros(4))


@SETTINGS
@given(clusters(), st.lists(jobs_st, min_size=1, max_size=8), st.data())
def test_excluded_nodes_are_never_used(specs: list[NodeSpec], jobs: list, data: st.DataObject) -> None:
    """The queue's reservations: ``exclude`` holds nodes back, with or without preemption."""
    model = ClusterModel.build(specs)
    for k, (pods, g, within, prio, pre, whole) in enumerate(jobs):
        ex = np.array(data.draw(st.lists(st.booleans(), min_size=model.n_nodes, max_size=model.n_nodes)))
        allow = data.draw(st.booleans())
        job = JobRequest(f"j{k}", pods, g, within, prio, pre, whole_nodes=whole)
        d = place(model, job, allow_preemption=allow, exclude=ex)
        if d is None:
            continue
        check_decision(model, job, d, allow, ex)
        assert not ex[d.pod_nodes].any(), "an excluded node was used"
        model.allocate(d)
    model.check_invariants()
