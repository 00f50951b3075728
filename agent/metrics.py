"""The agent's ``/metrics``: one ``prometheus_client`` registry per agent (never the
library's global one) with a custom collector over the owners' ``statistics()``.

Families, all with ``node``:

- GPU series under dcgm-exporter's names and labels, with ``workload``/``job`` of the
  GPU's holder (:mod:`agent.gpus.metrics`);
- the agent's own ``herd_*`` series (this module): readiness, workloads by state, starts,
  restarts, preemptions, refusals, ``herd_workload_start_seconds`` and ``herd_fetch_seconds``
  histograms, fetch bytes by source, store figures, the placer link;
- the herd and data plane ``herd_p2p_*``/``herd_dataplane_*`` (:func:`p2p.herd.metric_families`);
- ``herd_build_info`` and the process's ``process_*``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client.metrics_core import Metric

from infra.metrics import (
    FamiliesCollector,
    LatencyHistogram,
    build_info,
    exposition,
    family,
    histogram,
    new_registry,
    text_of,
)
from infra.version import PACKAGE_VERSION as VERSION
from scheduler_link.messages import WIRE_VERSION, WorkloadState

from .errors import UnknownWorkload

if TYPE_CHECKING:
    from .daemon import Agent

STATES: tuple[str, ...] = WorkloadState.__args__  # type: ignore[attr-defined]  # a Literal's members are read from __args__, which typing does not declare


Rows = list[tuple[dict[str, str], float]]


def agent_families(node_id: str, sup: Mapping[str, Any], store: Mapping[str, Any] | None, ready: bool, *,
                   start_hist: Mapping[str, LatencyHistogram] | None = None,
                   fetch_hist: LatencyHistogram | None = None,
                   link: Mapping[str, Any] | None = None) -> Iterator[Metric]:
    """``sup`` is Supervisor.statistics(); ``store`` the chunk store's statistics as a dict;
    ``start_hist``/``fetch_hist`` the supervisor's histograms; ``link`` AgentLink.statistics()."""
    n = {"node": node_id}

    def one(kind: str, name: str, help_: str, rows: Rows) -> Metric:
        return family(kind, name, help_, [({**n, **lb}, v) for lb, v in rows])

    by_state = sup.get("workloads_by_state", {})
    yield one("gauge", "herd_agent_ready", "1 once GPUs are discovered, state recovered and the API listens",
              [({}, 1 if ready else 0)])
    yield one("gauge", "herd_workloads", "Workloads known to this agent, by state",
              [({"state": s}, by_state.get(s, 0)) for s in STATES])
    yield one("counter", "herd_workload_starts_total", "Workload processes started (restarts included)",
              [({}, sup.get("starts", 0))])
    yield one("counter", "herd_workload_restarts_total", "Restarts by the agent's own restart policy",
              [({}, sup.get("restarts", 0))])
    yield one("counter", "herd_workload_preemptions_total", "Workloads that ended preempted",
              [({}, sup.get("preemptions", 0))])
    yield one("counter", "herd_placements_refused_total", "Placements refused by this agent",
              [({}, sup.get("refused", 0))])
    fb = sup.get("fetch_bytes", {})
    yield one("counter", "herd_fetch_bytes_total", "Artifact bytes fetched for workloads, by source",
              [({"source": src}, fb.get(f"bytes_from_{src}", fb.get(f"bytes_{src}", 0)))
               for src in ("origin", "peers", "local")])
    if start_hist is not None:
        yield histogram("herd_workload_start_seconds",
                        "Accepted -> running (process started, recorded by its shim) of each first start, "
                        "by whether an artifact was fetched first",
                        [({**n, "fetch": k}, h) for k, h in sorted(start_hist.items())])
    if fetch_hist is not None:
        yield histogram("herd_fetch_seconds", "Duration of each artifact fetch for a workload",
                        [(n, fetch_hist)])
    pool = sup.get("shim_pool", {})
    yield one("gauge", "herd_shim_pool_idle", "Pre-started idle workload shims", [({}, pool.get("idle", 0))])
    if store:
        yield one("gauge", "herd_store_bytes", "Chunk store figures in bytes, by kind",
                  [({"kind": k}, store[f]) for k, f in (("stored", "bytes"), ("pinned", "pinned_bytes"),
                                                         ("quota", "quota_bytes"))
                   if isinstance(store.get(f), int)])
        yield one("gauge", "herd_store_chunks", "Chunks in the store", [({}, store.get("chunks", 0))])
        yield one("gauge", "herd_store_manifests", "Manifests in the store, by completeness",
                  [({"complete": "true"}, store.get("complete_manifests", 0)),
                   ({"complete": "false"}, store.get("manifests", 0) - store.get("complete_manifests", 0))])
        yield one("counter", "herd_store_added_bytes_total", "Chunk bytes added to the store",
                  [({}, store.get("bytes_added", 0))])
        yield one("counter", "herd_store_evicted_bytes_total", "Chunk bytes evicted from the store",
                  [({}, store.get("evicted_bytes", 0))])
        yield one("counter", "herd_store_evictions_total", "Chunks evicted from the store",
                  [({}, store.get("evictions", 0))])
    if link is not None:
        yield one("gauge", "herd_link_registered", "1 while the placer knows this agent's boot",
                  [({}, 1 if link.get("registered") else 0)])
        yield one("counter", "herd_link_reports_total", "Reports sent to the placer, by kind",
                  [({"kind": "delta"}, link.get("reports_sent", 0) - link.get("full_reports_sent", 0)),
                   ({"kind": "full"}, link.get("full_reports_sent", 0))])
        yield one("counter", "herd_link_failures_total", "Reports that failed to reach the placer",
                  [({}, link.get("failures", 0))])
        yield one("counter", "herd_link_conflicts_total", "Reports the placer answered with a conflict",
                  [({}, link.get("conflicts", 0))])


def render_agent_metrics(node_id: str, sup: Mapping[str, Any], store: Mapping[str, Any] | None,
                         ready: bool) -> str:
    """Prometheus text of :func:`agent_families` alone (no GPU, p2p or process series)."""
    return text_of(agent_families(node_id, sup, store, ready))


class AgentMetrics:
    """One agent's registry: build it once per agent (``agent.api.build_app`` does), scrape
    with :meth:`render`. Reads the agent's parts at scrape time; holds no state of theirs."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.registry = new_registry(FamiliesCollector(self.families))

    def holders(self) -> dict[str, tuple[str, str]]:
        """GPU UUID -> (workload, job) of its current holder."""
        sup = self.agent.supervisor
        out: dict[str, tuple[str, str]] = {}
        for uuid, wid in sup.gpu_holders().items():
            try:
                out[uuid] = (wid, sup.record(wid).job_id)
            except UnknownWorkload:
                out[uuid] = (wid, "")
        return out

    def families(self) -> Iterator[Metric]:
        from agent.gpus.metrics import gpu_families
        from p2p.herd import metric_families

        a = self.agent
        node = a.node_id
        yield build_info("agent", VERSION, WIRE_VERSION, {"node": node})
        if a.monitor is not None:
            yield from gpu_families(a.gpu_snapshot(), node, holders=self.holders())
        sup = a.supervisor
        yield from agent_families(node, sup.statistics(), a.store_statistics(), a.ready,
                                  start_hist=sup.start_hist, fetch_hist=sup.fetch_hist,
                                  link=a.link.statistics() if a.link is not None else None)
        ep = a.epochs   # (scheduler_link.epochs)
        yield family("counter", "herd_agent_stale_epoch_total", "Messages of a replaced placer refused (older "
                     "epoch than one seen), by kind", [({"node": node, "kind": k}, ep.stale.get(k, 0))
                                                       for k in ("bundle", "part", "placement", "reply", "stop")])
        yield family("gauge", "herd_agent_placer_epoch", "The highest placer epoch this node has seen",
                     [({"node": node}, ep.highest)])
        if a.herd is not None:
            yield from metric_families(node, a.herd.statistics(),
                                       a.dataplane.statistics() if a.dataplane is not None else None)

    def render(self) -> bytes:
        return exposition(self.registry)
