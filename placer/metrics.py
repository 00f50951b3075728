"""The placer's ``/metrics``: one ``prometheus_client`` registry per placer service (never
the library's global one) with a custom collector over the service's snapshots.

Placer series describe the cluster, not a node, so they carry no ``node`` label (the
scrape's ``instance`` says which placer). Families:

- ``herd_placer_nodes{state}``, ``herd_placer_nodes_cordoned``, ``herd_placer_jobs{state}``;
- GPUs: ``herd_placer_gpus`` (capacity), ``herd_placer_gpus_usable``, ``_free``,
  ``_allocated``, ``_unhealthy``;
- ``herd_placer_<event>_total`` for every counter of the state (decisions, preemptions,
  rollbacks, reports, ...), ``herd_placer_pushes_total{kind}``, the push pool's and the framed
  channel's counters;
- histograms ``herd_placer_decision_seconds`` (one placement decision) and
  ``herd_placement_delivery_seconds`` (one placement push, send -> the agent's answer);
- ``herd_build_info`` and ``process_*``.

Decision latencies: the state keeps the last 1000 in ``decision_s`` (a bounded list it
trims from the front); :class:`SampleTap` turns that list into cumulative histogram counts
by remembering the last sample it saw (by identity: each one is a fresh float). It is exact
while scrapes come at least every 1000 decisions; a scrape that finds the last sample it saw
trimmed away counts one ``herd_placer_decision_tap_overruns_total`` (some may be missing)
rather than guessing. (The state observing a :class:`LatencyHistogram` itself would make it
exact always: a one-line change in ``placer/scheduling.py``.)
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from scheduler_link.http import Response
from scheduler_link.messages import WIRE_VERSION
from scheduler_link.metrics import (
    CONTENT_TYPE,
    FamiliesCollector,
    LatencyHistogram,
    build_info,
    counter,
    exposition,
    family,
    gauge,
    histogram,
    new_registry,
)

if TYPE_CHECKING:
    from .service import PlacerService

try:
    VERSION = importlib.metadata.version("herd")
except importlib.metadata.PackageNotFoundError:
    VERSION = "unknown"

NODE_STATES = ("up", "lost")

# state counter -> help (a counter not listed here still gets a family, with a plain help)
COUNTER_HELP: dict[str, str] = {
    "reports": "Node reports ingested",
    "full_reports": "Full node reports ingested",
    "conflicts": "Reports answered 409 (unknown boot or sequence gap)",
    "decisions": "Placement decisions applied",
    "preemptions": "Workloads preempted for higher-priority jobs",
    "rollbacks": "Gang attempts rolled back after a refusal",
    "requeues": "Jobs put back in the queue",
    "nodes_lost": "Nodes declared lost (missed heartbeats)",
    "fenced_stops": "Stops sent to a lost node's fenced pods when it came back",
    "refused_reports": "Reports refused as invalid",
    "rebuilds": "Cluster model rebuilds",
    "passes": "Scheduling passes",
    "passes_deferred": "Scheduling passes deferred",
}


class SampleTap:
    """Cumulative histogram counts over an owner's bounded, front-trimmed sample list."""

    __slots__ = ("hist", "overruns", "_last")

    def __init__(self) -> None:
        self.hist = LatencyHistogram()
        self.overruns = 0
        self._last: float | None = None

    def take(self, samples: list[float]) -> None:
        """Observe the samples appended since the last call (pure over ``samples``)."""
        if not samples:
            return
        start = 0
        if self._last is not None:
            for i in range(len(samples) - 1, -1, -1):
                if samples[i] is self._last:
                    start = i + 1
                    break
            else:   # the last one seen was trimmed away: samples after it may have been too
                self.overruns += 1
        for v in samples[start:]:
            self.hist.observe(v)
        self._last = samples[-1]


class PlacerMetrics:
    """One placer service's registry: :meth:`of` finds (or makes) the service's own."""

    def __init__(self, service: PlacerService) -> None:
        self.service = service
        self.decisions = SampleTap()
        self.registry = new_registry(FamiliesCollector(self.families))

    @classmethod
    def of(cls, service: PlacerService) -> PlacerMetrics:
        """The service's registry, made on its first scrape and kept on the service."""
        d = vars(service)
        m = d.get("_placer_metrics")
        if not isinstance(m, PlacerMetrics):
            m = d["_placer_metrics"] = cls(service)
        return m

    def families(self) -> Iterator[Metric]:
        svc = self.service
        st = svc.state
        yield build_info("placer", VERSION, WIRE_VERSION, {})
        yield family("gauge", "herd_placer_nodes", "Nodes known to the placer, by state",
                     [({"state": s}, st.node_states[s]) for s in NODE_STATES])
        yield gauge("herd_placer_nodes_cordoned", "Nodes cordoned (no new placements)", {}, len(st.cordons))
        yield family("gauge", "herd_placer_jobs", "Jobs, by state",
                     [({"state": s}, c) for s, c in sorted(st.job_counts().items())])
        ms = st.model.statistics()
        for key, name, help_ in (("gpus", "herd_placer_gpus", "GPUs of every known node (capacity)"),
                                 ("usable", "herd_placer_gpus_usable", "GPUs healthy on up, uncordoned nodes"),
                                 ("free", "herd_placer_gpus_free", "Usable GPUs not allocated"),
                                 ("allocated", "herd_placer_gpus_allocated", "GPUs allocated to pods"),
                                 ("unhealthy_gpus", "herd_placer_gpus_unhealthy", "GPUs reported unhealthy")):
            yield gauge(name, help_, {}, ms.get(key, 0))
        for k, v in sorted(st.counters.items()):
            yield counter(f"herd_placer_{k}_total", COUNTER_HELP.get(k, f"Placer events: {k.replace('_', ' ')}"),
                          {}, v)
        yield family("counter", "herd_placer_pushes_total", "Pushes to agents, by kind and failure",
                     [({"kind": k}, v) for k, v in sorted(svc.push_counts.items())])
        ps = svc.pool.statistics()
        yield counter("herd_placer_push_requests_total", "HTTP requests the push pool sent", {}, ps["requests"])
        yield counter("herd_placer_push_connects_total", "Connections the push pool opened", {}, ps["connects"])
        yield counter("herd_placer_push_failures_total", "Push attempts with no HTTP answer", {}, ps["failures"])
        yield family("gauge", "herd_placer_push_connections", "Push pool connections, by state",
                     [({"state": "idle"}, ps["idle_connections"]), ({"state": "busy"}, ps["busy_connections"])])
        if svc.wire is not None:
            ws = svc.wire.statistics()
            yield counter("herd_placer_wire_frames_total", "Frames received on the framed channel", {}, ws["frames"])
            yield gauge("herd_placer_wire_connections", "Open framed-channel connections", {},
                        ws["open_connections"])
            yield counter("herd_placer_wire_ingest_errors_total", "Framed-channel frames that failed ingest", {},
                          ws["ingest_errors"])
        yield counter("herd_placer_gc_freezes_total", "Heap freezes after passes that grew it", {}, svc.freezes)
        self.decisions.take(st.decision_s)
        yield histogram("herd_placer_decision_seconds", "One placement decision (place(), preemption included)",
                        [({}, self.decisions.hist)])
        yield counter("herd_placer_decision_tap_overruns_total",
                      "Scrapes that found the decision latencies seen last trimmed away (some may be missing)",
                      {}, self.decisions.overruns)
        delivery = svc.pool.latency.get("/v1/placements") or LatencyHistogram()
        yield histogram("herd_placement_delivery_seconds",
                        "One placement push: send -> the agent's answer (retries included)", [({}, delivery)])

    def render(self) -> bytes:
        return exposition(self.registry)

    def response(self) -> Response:
        return Response(body=self.render(), content_type=CONTENT_TYPE)
