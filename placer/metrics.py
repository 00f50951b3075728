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
- ``herd_build_info`` and ``process_*``;
- this start (scheduler_link.epochs): ``herd_placer_epoch`` (a single placer's own epoch),
  ``herd_placer_started_timestamp_seconds``, ``herd_placer_recover_seconds_left`` (0 once
  placing), ``herd_placer_nodes_reported`` (nodes heard since this start) and
  ``herd_placer_stale_epoch_acks_total`` (nodes that refused this placer's epoch: it was replaced);
- with ``[placer] etcd`` set (several placers, one leading: placer.ha): ``herd_placer_leader``
  (1 while this placer leads and places), ``herd_placer_epoch`` (the epoch of the leader it
  knows, its own when it leads), ``herd_placer_fenced`` (1 while it leads but cannot renew its
  lease: no etcd quorum), ``herd_placer_failovers_total`` (the leader it knew replaced
  by another) and ``herd_placer_etcd_errors_total`` (etcd calls no member answered, or refused).

Decision latencies: the state observes every decision into its own :class:`LatencyHistogram`
(``decision_hist``), so the histogram is exact however seldom it is scraped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import Metric

from infra.http import Response
from infra.metrics import (
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
from infra.version import PACKAGE_VERSION as VERSION
from scheduler_link.messages import WIRE_VERSION

if TYPE_CHECKING:
    from .ha import HighAvailability
    from .service import PlacerService


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
    "mass_silences": "Times more than lost_mass_fraction of the fleet fell silent at once (held, not declared lost)",
    "fenced_stops": "Stops sent to a lost node's fenced pods when it came back",
    "refused_reports": "Reports refused as invalid",
    "compact_registrations": "Registrations that named a stored GPU inventory instead of sending it",
    "inventory_misses": "Compact registrations answered 409: no such inventory stored (the node sends it)",
    "direct_refusals": "Registrations refused: direct_max_nodes registered and no rack relay connected",
    "rebuilds": "Cluster model rebuilds",
    "passes": "Scheduling passes",
    "passes_deferred": "Scheduling passes deferred",
}


class PlacerMetrics:
    """One placer service's registry: :meth:`of` finds (or makes) the service's own."""

    def __init__(self, service: PlacerService) -> None:
        self.service = service
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
        yield gauge("herd_placer_nodes_silent", "Up nodes held silent in a mass silence (no new work, not lost)", {},
                    st.silent_nodes)
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
        yield family("counter", "herd_placer_tls_handshakes_total", "TLS handshakes completed, by listener",
                     [({"listener": "wire"}, svc.wire.statistics()["tls_handshakes"] if svc.wire is not None else 0),
                      ({"listener": "http"}, svc.app.tls_handshakes)])
        yield counter("herd_placer_gc_freezes_total", "Heap freezes after passes that grew it", {}, svc.freezes)
        yield histogram("herd_placer_decision_seconds", "One placement decision (place(), preemption included)",
                        [({}, st.decision_hist)])
        rs = svc.relays.statistics()
        yield gauge("herd_placer_relay_racks", "Racks with a relay candidate connected", {}, rs["racks"])
        for key, what in (("bundles", "Rack bundles sent to relays"),
                          ("bundle_failures", "Rack bundles a relay did not answer in time (their racks pushed directly)"),
                          ("fallback_nodes", "Nodes pushed directly because their relay did not reach them"),
                          ("relayed_nodes", "Nodes whose outcome came through a relay"),
                          ("blob_serves", "Gang blobs served by the placer itself"),
                          ("beats", "Aggregated rack heartbeats received"),
                          ("beat_entries", "Node heartbeats inside rack beats")):
            yield counter(f"herd_placer_relay_{key}_total", what, {}, rs[key])
        rs_ = svc.restart_status()
        if svc.ha is None:   # (with etcd: the leader's, below)
            yield gauge("herd_placer_epoch", "This placer's epoch (greater than every earlier start's)", {},
                        rs_["epoch"])
        yield gauge("herd_placer_started_timestamp_seconds", "When this placer started (unix seconds)", {},
                    rs_["started_at"])
        yield gauge("herd_placer_recover_seconds_left", "Seconds left before recovered jobs are placed "
                    "(0 once placing)", {}, rs_["recover_s_left"])
        yield gauge("herd_placer_nodes_reported", "Nodes heard since this placer started", {},
                    rs_["nodes_reported"])
        yield counter("herd_placer_stale_epoch_acks_total", "Nodes that refused this placer's placements as "
                      "of a stale epoch (a newer placer has spoken to them)", {}, svc.stale_epoch_acks)
        if svc.ha is not None:
            yield from ha_families(svc.ha)
        delivery = svc.pool.latency.get("/v1/placements") or LatencyHistogram()
        yield histogram("herd_placement_delivery_seconds",
                        "One placement push: send -> the agent's answer (retries included)", [({}, delivery)])

    def render(self) -> bytes:
        return exposition(self.registry)

    def response(self) -> Response:
        return Response(body=self.render(), content_type=CONTENT_TYPE)


def ha_families(ha: HighAvailability) -> Iterator[Metric]:
    """The families of a placer among several (``[placer] etcd``)."""
    h = ha.health()
    yield gauge("herd_placer_leader", "1 while this placer leads and places (0: a follower, a candidate, "
                "or a leader that cannot reach an etcd quorum)", {}, 1 if h["placing"] else 0)
    yield gauge("herd_placer_epoch", "Epoch of the leader this placer knows (its own when it leads; 0: none)",
                {}, h["epoch"])
    yield gauge("herd_placer_fenced", "1 while this placer leads but cannot renew its etcd lease (no etcd quorum, "
                "or etcd out of reach): it places nothing, stops nothing", {}, 1 if h.get("fenced") else 0)
    yield counter("herd_placer_failovers_total", "Leaders this placer saw replaced by another", {}, h["failovers"])
    yield counter("herd_placer_etcd_errors_total", "etcd calls that failed: no member answered, or etcd refused",
                  {}, h["etcd_errors"])
