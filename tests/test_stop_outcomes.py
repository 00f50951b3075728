"""A stop says what it is (``Victim.preempted``), and a workload ends ``preempted`` or
``exited`` by that flag, never by the words of its reason."""

from __future__ import annotations

from scheduler_link.messages import JobSpec, RestartPolicy

from .test_nodeops import _run, _two_nodes


def test_the_placer_flags_preemptions_and_not_cancellations() -> None:
    st = _two_nodes()
    seq: dict[str, int] = {}
    _run(st, JobSpec(job_id="p", pods=1, gpus_per_pod=4, argv=["x"], restart=RestartPolicy(kind="on-preemption")),
         0.1, seq)
    _run(st, JobSpec(job_id="c", pods=1, gpus_per_pod=4, argv=["y"], preemptible=False), 1.0, seq)
    n = st.jobs["p"].pods[0].node_id
    _, drained = st.drain(n, 2.0)
    preempted = [v for p in drained for v in p.placement.victims]
    assert preempted and all(v.preempted for v in preempted)
    cancelled = [v for p in st.cancel("c", 3.0) for v in p.placement.victims]
    assert cancelled and not any(v.preempted for v in cancelled)
