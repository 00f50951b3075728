"""The fleet dashboard the placer serves: the page at ``/`` and the data it reads.

- ``GET /`` and ``GET /dashboard/{asset}``: static HTML, JavaScript and CSS shipped in this
  package (``static/``; no build step, nothing from another origin). Public: they hold no
  data. The page asks for a viewer token (from the URL fragment, ``#token=...``, which
  browsers never send to a server, or a login form) and sends it as a bearer header.
- ``GET /v1/cluster/map``: the fleet map (:mod:`placer.clustermap`, binary), built from the
  model's arrays and the job table, cached by a digest of everything it reads: a page
  polling every 2 s costs one build per change, not one per poll; while the map is watched,
  the next one is built within a second of a change, so a poll finds it ready. While the model waits for
  a deferred rebuild (a registration storm), the last map is served (``x-herd-map-stale``)
  rather than forcing the rebuild early.
- ``GET /v1/cluster/map/node/{row}``: one node of the map (by its row, checked against the
  map's ``model_epoch``): GPUs and their holders, health reasons, workloads.
- ``GET /v1/cluster/map/job/{job_id}``: one job's timeline, why it waits, and its pods'
  fetch bytes by source (O(its pods), asked only for the job selected on the page).

Nothing here returns a job's env (names or values) or argv.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

import trio

from infra.http import HTTPError, Param, Request, Response, RouteDoc, Text, json_response
from infra.version import PACKAGE_VERSION

from .. import clustermap
from ..frag import fragmentation, largest_placeable
from ..records import TERMINAL_JOB_STATES, JobRec

if TYPE_CHECKING:
    from ..service import PlacerService

__all__ = ["DASHBOARD_DOCS", "Dashboard"]

log = logging.getLogger("herd.placer.dashboard")

MAP_TYPE = "application/vnd.herd.cluster-map"
ASSETS: Mapping[str, str] = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
WARM_EVERY_S = 1.0          # while watched, the next map is built at most this often after a change
WATCHED_FOR_S = 10.0        # "watched": a map was asked for this recently
FRAG_EVERY_S = 5.0          # fragmentation per level is recomputed at most this often
ENDED_SHOWN = 20            # jobs that ended, newest first, kept in the table
PENDING_SHOWN = 2000        # live jobs that hold nothing (pending), at most this many in the table
TIMINGS = ("durable", "decided", "pushed", "delivered", "acked", "running", "requeued", "retry_at", "ended")
_NO_STORE = [("cache-control", "no-store")]
_PAGE_HEADERS = [("cache-control", "no-cache"), ("x-content-type-options", "nosniff"),
                 ("referrer-policy", "no-referrer"),
                 ("content-security-policy", "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                             "base-uri 'none'; frame-ancestors 'none'")]

DASHBOARD_DOCS: Mapping[tuple[str, str], RouteDoc] = {
    ("GET", "/"): RouteDoc(summary="The fleet dashboard (static HTML; its data needs the viewer role)",
                           responses={200: Text("text/html; charset=utf-8")}),
    ("GET", "/dashboard/{asset}"): RouteDoc(summary="The dashboard's script and style sheet",
                                            responses={200: Text("text/plain; charset=utf-8")},
                                            errors={404: "no such asset"}),
    ("GET", "/v1/cluster/map"): RouteDoc(
        summary="The fleet map: a state byte and a job index per node in topology order, the job table, "
                "zone/block/rack boundaries (binary, placer.clustermap)",
        responses={200: Text(MAP_TYPE), 304: None}),
    ("GET", "/v1/cluster/map/node/{row}"): RouteDoc(
        summary="One node of the map by row: GPUs and holders, health, workloads",
        responses={200: {"type": "object"}}, query=(Param("epoch", int, "the map's model_epoch"),),
        errors={404: "no such row", 409: "the map is out of date (the model was rebuilt)"}),
    ("GET", "/v1/cluster/map/job/{job_id}"): RouteDoc(
        summary="One job for the dashboard: timeline, why it waits, fetch bytes by source",
        responses={200: {"type": "object"}}, errors={404: "no such job"}),
}


def _load_static() -> dict[str, bytes]:
    root = resources.files(__name__).joinpath("static")
    return {name: root.joinpath(name).read_bytes() for name in ("index.html", *ASSETS)}


class Dashboard:
    """The dashboard's routes over one placer service (reads its state; changes nothing)."""

    def __init__(self, svc: PlacerService) -> None:
        self.svc = svc
        self.static = _load_static()
        self._key: str | None = None
        self._map: bytes = b""
        self._map_counts: dict[str, int] = {}
        self.builds = 0
        self.hits = 0
        self.last_build_cpu_ms = 0.0
        self._frag_cache: dict[str, Any] | None = None
        self._asked_at = -WATCHED_FOR_S
        self._frag_at = 0.0

    def handlers(self) -> dict[tuple[str, str], Any]:
        return {("GET", "/"): self.h_page, ("GET", "/dashboard/{asset}"): self.h_asset,
                ("GET", "/v1/cluster/map"): self.h_map, ("GET", "/v1/cluster/map/node/{row}"): self.h_node,
                ("GET", "/v1/cluster/map/job/{job_id}"): self.h_job}

    # ------------------------------------------------------------ the map

    def job_rows(self) -> list[clustermap.JobRow]:
        """The table: live jobs (those pending bounded), then the newest jobs that ended.
        O(jobs), never O(nodes)."""
        live: list[JobRec] = []
        ended: list[JobRec] = []
        pending = 0
        for j in self.svc.state.jobs.values():
            if j.state in TERMINAL_JOB_STATES:
                ended.append(j)
            elif j.state == "pending":
                if pending < PENDING_SHOWN:
                    live.append(j)
                pending += 1
            else:
                live.append(j)
        return [self._row(j) for j in live + ended[-ENDED_SHOWN:][::-1]]

    def _row(self, j: JobRec) -> clustermap.JobRow:
        s = j.spec
        t0 = j.timings.get("submitted", 0.0)
        return clustermap.JobRow(
            job_id=j.job_id, state=j.state, priority=s.priority, gpus=s.pods * s.gpus_per_pod, pods=s.pods,
            within=s.within, attempt=j.attempt, submitted=t0,
            timings={k: round((j.timings[k] - t0) * 1000) for k in TIMINGS if k in j.timings},
            waiting=self.waiting(j), reason=j.reason)

    def waiting(self, j: JobRec) -> dict[str, Any] | None:
        """Why a pending job waits: the queue's structured outcome of the last round that
        looked at it (placer.queue.Waiting), or where it waits outside the queue."""
        if j.state != "pending":
            return None
        if j.recovering:
            return {"code": "recovering"}            # the placer restarted: waiting for its nodes' reports
        p = self.svc.state.queue.get(j.job_id)
        if p is None:
            if "retry_at" in j.timings:
                return {"code": "backoff", "rollbacks": j.rollbacks}   # refused placements: backing off
            return {"code": "not_queued"}
        w = p.waiting
        return {"code": w.code, "may_preempt": w.may_preempt, "behind_reservation": w.behind_reservation,
                "free_gpus": w.free_gpus, "reserved": p.reserved, "rounds": p.rounds,
                "preemption_on": bool(self.svc.state.queue.allow_preemption)}

    def _lost_rows(self) -> list[int]:
        """Rows of lost nodes: among the rows the model holds unhealthy (lost or host
        fatal, few), those the state says are lost."""
        st = self.svc.state
        m = st.model
        ids = m.node_ids
        out = []
        for i in (~m.node_healthy).nonzero()[0].tolist():
            n = st.nodes.get(ids[i])
            if n is not None and n.state == "lost":
                out.append(i)
        return out

    def _degraded_rows(self) -> list[int]:
        st = self.svc.state
        m = st.model
        out = []
        for nid in st.degraded_nodes:
            if m.has_node(nid):
                out.append(m.node_index(nid))
        return out

    def current(self) -> tuple[bytes, bool]:
        """(the map now, whether it is the last one kept because the model awaits a rebuild)."""
        st = self.svc.state
        if st.model.needs_rebuild and self._key is not None:
            return self._map, True
        rows = self.job_rows()
        lost, degraded = self._lost_rows(), self._degraded_rows()
        key = clustermap.fingerprint(st.model, rows, lost_rows=lost, degraded_rows=degraded,
                                     extra={"pending": len(st.queue), "ha": self._ha()})
        if key == self._key:
            self.hits += 1
            return self._map, False
        t0 = time.thread_time()
        m = st.model
        extra = {"service": "herd-placer", "placer_version": PACKAGE_VERSION, **self._frag(),
                 "queue": {"pending": len(st.queue)}, "ha": self._ha()}
        raw = clustermap.encode(m, rows, lost_rows=lost, degraded_rows=degraded, extra=extra, generation=key)
        self.last_build_cpu_ms = (time.thread_time() - t0) * 1000
        self.builds += 1
        self._key, self._map = key, raw
        self._map_counts = clustermap.decode(raw).counts()
        return raw, False

    def _ha(self) -> dict[str, Any] | None:
        """With several placers (placer.ha): this one's role, the leader and its epoch."""
        ha = self.svc.ha
        if ha is None:
            return None
        h = ha.health()
        return {"role": h["role"], "leader": h["leader"], "epoch": h["epoch"]}

    def _frag(self) -> dict[str, Any]:
        """Fragmentation and the largest placeable job per level: a pass over the model
        (~10 ms at 131,072 nodes) that moves slowly, so at most every ``FRAG_EVERY_S``
        (a map built meanwhile shows the last figures, with ``fragmentation_at``)."""
        now = time.monotonic()
        if self._frag_cache is None or now - self._frag_at >= FRAG_EVERY_S:
            m = self.svc.state.model
            self._frag_cache = {
                "fragmentation": {k: round(float(v), 4) for k, v in fragmentation(m).items()},
                "largest_placeable": {k: int(v) for k, v in largest_placeable(m).items()},
                "fragmentation_at": round(self.svc.clock(), 3)}
            self._frag_at = now
        return self._frag_cache

    def counts(self) -> dict[str, int]:
        """Nodes by map state (GET /v1/cluster shows them; the page counts the same bytes)."""
        self.current()
        return dict(self._map_counts)

    async def warm(self) -> None:
        """While someone watches (a map asked for in the last ``WATCHED_FOR_S``), build the
        map after a change, at most every ``WARM_EVERY_S``: the page's next poll is then a
        cache hit instead of waiting for a build. Nobody watching: nothing is built."""
        while True:
            await trio.sleep(WARM_EVERY_S)
            if time.monotonic() - self._asked_at < WATCHED_FOR_S:
                self.current()

    async def h_map(self, req: Request) -> Response:
        """The fleet map (placer.clustermap's binary format). ``If-None-Match`` with the
        ETag of the map the caller holds: 304 without a body while it is still the map."""
        self._asked_at = time.monotonic()
        raw, stale = self.current()
        etag = f'"{self._key}"'
        headers = [*_NO_STORE, ("etag", etag), ("x-herd-now", f"{self.svc.clock():.3f}"),
                   ("x-herd-map-build-cpu-ms", f"{self.last_build_cpu_ms:.2f}")]
        if stale:
            headers.append(("x-herd-map-stale", "1"))
        if req.headers.get("if-none-match") == etag:
            return Response(status=304, body=b"", content_type=MAP_TYPE, headers=headers)
        return Response(body=raw, content_type=MAP_TYPE, headers=headers)

    # ------------------------------------------------------------ one node, one job

    async def h_node(self, req: Request) -> Response:
        """One node of the map by row (``?epoch=`` the map's model_epoch: 409 if the model
        was rebuilt since, as rows may have moved)."""
        st = self.svc.state
        m = st.model
        try:
            row = int(req.params["row"])
            epoch = int(req.query["epoch"]) if "epoch" in req.query else None
        except ValueError:
            raise HTTPError(400, "row and epoch are integers") from None
        if m.needs_rebuild or (epoch is not None and epoch != m.epoch):
            raise HTTPError(409, "the map is out of date", "the model was rebuilt: fetch the map again")
        ids = m.node_ids
        if not 0 <= row < len(ids):
            raise HTTPError(404, "no such row", str(row))
        nid = ids[row]
        owners = [m.job_id_of(int(j)) if j >= 0 else None for j in m.owner[row, :int(m.n_gpus[row])].tolist()]
        out: dict[str, Any] = {"row": row, "model_epoch": m.epoch, "node_id": nid,
                               "zone": m.domain_of(nid, "zone"), "block": m.domain_of(nid, "block"),
                               "rack": m.domain_of(nid, "rack"),
                               "gpus": [{"slot": s, "holder": o, "healthy": bool(m.gpu_healthy[row, s])}
                                        for s, o in enumerate(owners)]}
        n = st.nodes.get(nid)
        if n is not None:
            out["node"] = st.node_view(n)
            out["degraded_gpus"] = sorted(n.degraded)
            out["health_reasons"] = list(n.health_reasons)
            out["cordon_reason"] = st.cordons.get(nid)
            pods = list(n.pods.items())[:64]
            out["workloads"] = [{"workload_id": w, "job_id": job.job_id, "state": p.state, "gpus": list(p.slots)}
                                for w, (job, p) in pods]
            out["stale_workloads"] = sorted(n.stale)[:64]
        return json_response(out)

    async def h_job(self, req: Request) -> Response:
        """One job for the dashboard: its timeline (ms after submission), why it waits,
        counts of its pods by state and their fetch bytes by source (no env, no argv)."""
        job = self.svc.state.jobs.get(req.params["job_id"])
        if job is None:
            raise HTTPError(404, "no such job", req.params["job_id"][:200])
        fetch = {"origin": 0, "peers": 0, "local": 0}
        reporting = 0
        for p in job.pods:
            if p.fetch:
                reporting += 1
                fetch["origin"] += int(p.fetch.get("bytes_from_origin", 0))
                fetch["peers"] += int(p.fetch.get("bytes_from_peers", 0))
                fetch["local"] += int(p.fetch.get("bytes_local", 0))
        s = job.spec
        row = self._row(job)
        return json_response({
            "job_id": job.job_id, "state": job.state, "attempt": job.attempt, "restarts": job.restarts,
            "reason": job.reason, "submitted": row.submitted, "timings": dict(row.timings),
            "waiting": row.waiting, "pod_counts": job.pod_counts(), "pods_total": len(job.pods),
            "fetch": fetch, "fetch_pods": reporting,
            "spec": {"pods": s.pods, "gpus_per_pod": s.gpus_per_pod, "within": s.within, "priority": s.priority,
                     "preemptible": s.preemptible, "manifest_id": s.manifest_id, "restart": s.restart.kind}})

    # ------------------------------------------------------------ static

    async def h_page(self, req: Request) -> Response:
        """The dashboard page."""
        return Response(body=self.static["index.html"], content_type="text/html; charset=utf-8",
                        headers=list(_PAGE_HEADERS))

    async def h_asset(self, req: Request) -> Response:
        """The dashboard's script or style sheet."""
        name = req.params["asset"]
        ctype = ASSETS.get(name)
        if ctype is None:
            raise HTTPError(404, "no such asset", name[:100])
        return Response(body=self.static[name], content_type=ctype, headers=list(_PAGE_HEADERS))
