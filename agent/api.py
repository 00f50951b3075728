"""The agent's operator/control HTTP API (infra.http.App served by hypercorn).

Auth: every route and the role it needs are declared in :mod:`scheduler_link.authz`
(``AGENT_ROUTES``) and installed from there. Reads need the viewer token (or the
operator's) from anywhere, loopback included -- a workload on this host is a loopback
client too; ``/healthz`` and ``/readyz`` are public, ``/metrics`` is public unless
``open_metrics = false``. Placements and prefetch take the placer or the operator token
(an operator's placement is a *direct* one: the agent's own restart policy applies to it
only); stopping workloads, fault injection and store eviction take the operator token;
``GET /v1/store`` (the manifests held) is a read.

``POST /v1/placements`` answers 200 with the PlacementAck when accepted (or already
accepted: idempotent by placement id) and 409 with the PlacementAck (``accepted:
false``, ``reason``) when refused -- also when its ``origin`` is not among
``allowed_origins`` (``outcome: refused_spec``), and when the placer's placement carries an
epoch older than the highest this node has seen (``outcome: stale_epoch``: a replaced placer;
scheduler_link.epochs; an operator's direct placement is not fenced); a prefetch naming such
an origin is 403. An agent configured with no origins (the default) refuses every one.

Body bounds per route: placements and prefetches ``max_body_bytes`` (default 4 MiB, a
fleet-scale placement is a few MB at most), stop 4 KiB, fault injection 16 KiB, every
other route (reads: no body) 4 KiB. Bodies are read only after authentication.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import trio

from infra.auth import bearer
from infra.http import (
    App,
    HTTPError,
    Param,
    Request,
    Response,
    RouteDoc,
    json_response,
    text_response,
)
from infra.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from infra.version import PACKAGE_VERSION as _VERSION
from p2p.errors import StoreError
from p2p.origins.allow import origin_refusal
from p2p.store import ChunkStore, EvictReport, HeldManifest, check_id
from scheduler_link import authz
from scheduler_link.apidocs import AGENT_DOCS
from scheduler_link.messages import TERMINAL_STATES, WIRE_VERSION, Placement, PlacementAck, PrefetchRequest

from .errors import AgentError, UnknownWorkload
from .gpus.faults import Fault, decode_fault
from .logs import follow as follow_log
from .metrics import AgentMetrics
from .parts import stop_binding
from .placement import check_binding

if TYPE_CHECKING:
    from .daemon import Agent


log = logging.getLogger("herd.agent.api")
SMALL_BODY = 4096      # every route without a bound of its own (reads carry no body)


class _StopBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    reason: str = "stopped"
    grace_s: float | None = None
    preempted: bool = False   # the workload ends "preempted" (else "exited")


class _EvictBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    manifest_id: str | None = None
    unused: bool = False


def build_app(agent: Agent) -> App:
    cfg = agent.config
    tokens = agent.tokens
    app = App(max_body=SMALL_BODY, name="herd-agent")
    allowed = cfg.allowed_origins
    prom = AgentMetrics(agent)       # this agent's own registry, for the agent's life

    async def healthz(req: Request) -> Response:
        """Liveness: the process answers; the package and wire versions."""
        return json_response({"ok": True, "service": "herd-agent", "version": _VERSION, "wire_version": WIRE_VERSION})

    async def readyz(req: Request) -> Response:
        """Readiness: GPUs discovered, state recovered, API listening."""
        return json_response({"ready": agent.ready}, status=200 if agent.ready else 503)

    async def status(req: Request) -> Response:
        """Node, GPUs (topology, health, holder), workloads, store and data-plane figures."""
        return Response(body=agent.status_json())

    async def gpus(req: Request) -> Response:
        """The GPU snapshot: inventory, topology matrix, health."""
        return json_response(agent.gpu_snapshot())

    async def workloads(req: Request) -> Response:
        """Every workload this agent knows (live and recent)."""
        return json_response(agent.supervisor.workloads())

    async def workload(req: Request) -> Response:
        """One workload's status."""
        try:
            return json_response(agent.supervisor.record(req.params["wid"]).status())
        except UnknownWorkload as e:
            raise HTTPError(404, "no such workload", str(e)) from None

    async def logs(req: Request) -> Response:
        """The last ``tail`` lines (default 100) of ``stream`` (stdout|stderr) as text;
        ``follow=1`` then streams what is appended until the workload ended (or the client left)."""
        try:
            tail = int(req.query.get("tail", "100"))
            if not 0 <= tail <= 100_000:
                raise ValueError
        except ValueError:
            raise HTTPError(400, "bad tail", "tail must be an integer within 0..100000") from None
        stream = req.query.get("stream", "stdout")
        if stream not in ("stdout", "stderr"):
            raise HTTPError(400, "bad stream", "stream must be stdout or stderr")
        if req.query.get("follow") in ("1", "true"):
            return _follow(req.params["wid"], stream, tail)
        try:
            # off the event loop: a tail reads from the end of files of any size
            text = await trio.to_thread.run_sync(lambda: agent.supervisor.read_log(
                req.params["wid"], stream=stream, tail=tail))
            return text_response(text)
        except UnknownWorkload as e:
            raise HTTPError(404, "no such workload", str(e)) from None
        except AgentError as e:  # a symlink or a non-file where the log belongs
            raise HTTPError(409, "log refused", str(e)) from None

    def _follow(wid: str, stream: str, tail: int) -> Response:
        sup = agent.supervisor
        try:
            wdir = sup.workload_dir(wid)
        except UnknownWorkload as e:
            raise HTTPError(404, "no such workload", str(e)) from None

        def ended() -> bool:
            try:
                return sup.record(wid).state in TERMINAL_STATES
            except UnknownWorkload:
                return True
        return Response(content_type="text/plain; charset=utf-8",
                        stream=lambda: follow_log(wdir, stream, tail, sup.config.log_keep, ended))

    async def stop(req: Request) -> Response:
        """Stop a workload gracefully (notice file, SIGTERM, grace, SIGKILL). Body optional: {reason, grace_s}."""
        body = req.decode(_StopBody) if req.body.strip() else _StopBody()
        if body.grace_s is not None and body.grace_s < 0:
            raise HTTPError(400, "bad grace_s", "grace_s must be >= 0")
        try:
            st = await agent.supervisor.stop(req.params["wid"], reason=body.reason, grace_s=body.grace_s,
                                             preempted=body.preempted)
        except UnknownWorkload as e:
            raise HTTPError(404, "no such workload", str(e)) from None
        return json_response(st)

    async def inject(req: Request) -> Response:
        """Feed a raw fault signal (XID, counters, lost GPU) into a simulated GPU's data path."""
        try:
            fault = decode_fault(req.body)
        except (ValueError, msgspec.ValidationError, msgspec.DecodeError) as e:
            raise HTTPError(400, "malformed fault", str(e)) from None
        uuid = req.params["uuid"]
        if uuid not in {g.uuid for g in agent.gpu_snapshot().gpus}:
            raise HTTPError(404, "no such GPU", uuid)
        try:
            agent.inject(uuid, fault)
        except AgentError as e:
            raise HTTPError(409, "fault injection refused", str(e)) from None
        return json_response({"injected": True, "gpu": uuid})

    async def place(req: Request) -> Response:
        """Start pods and/or stop victims; idempotent by placement_id. Returns a PlacementAck."""
        p = req.decode(Placement)
        direct = (req.principal is not None and req.principal.via == "cert" and req.principal.kind == "operator") or (
            tokens.check("operator", bearer(req.headers)) and not tokens.check("placer", bearer(req.headers)))
        if not direct:   # the placer's: fenced by its epoch (an operator's placement carries none)
            try:
                fresh = agent.epochs.admit(p.epoch, "placement")
            except OSError as e:
                raise HTTPError(503, "placer epoch not durable", str(e)) from None
            if not fresh:
                log.warning("placement refused placement=%s job=%s outcome=stale_epoch epoch=%d highest=%d",
                            p.placement_id, p.job_id, p.epoch, agent.epochs.highest)
                return json_response(PlacementAck(
                    placement_id=p.placement_id, node_id=agent.node_id, accepted=False, outcome="stale_epoch",
                    reason=f"placer epoch {p.epoch} is older than {agent.epochs.highest}: a newer placer leads"),
                    status=409)
        if not direct and not p.pods and (bad := stop_binding(p, now=time.time(), boot_id=agent.link_boot_id())):
            # the placer's stop pushed directly: bound to this node's boot, expiring (a replay stops nothing)
            log.warning("stop refused placement=%s job=%s outcome=%s reason=%s", p.placement_id, p.job_id,
                        bad.outcome, bad.detail)
            return json_response(PlacementAck(placement_id=p.placement_id, node_id=agent.node_id, accepted=False,
                                              reason=bad.detail, outcome=bad.outcome), status=409)
        if agent.supervisor.known_ack(p.placement_id) is None or (p.node_id and p.node_id != agent.node_id):
            # bound to this node, unexpired, not a replay (an accepted id is answered again instead)
            bad = check_binding(p, node_id=agent.node_id, now=time.time(), records=agent.supervisor.records_view())
            if bad is not None:
                log.warning("placement refused placement=%s job=%s outcome=%s reason=%s", p.placement_id, p.job_id,
                            bad.outcome, bad.detail)
                return json_response(PlacementAck(placement_id=p.placement_id, node_id=agent.node_id, accepted=False,
                                                  reason=bad.detail, outcome=bad.outcome), status=409)
        if p.origin is not None and (why := origin_refusal(p.origin, allowed)):
            log.warning("placement refused placement=%s job=%s reason=%s", p.placement_id, p.job_id, why)
            return json_response(PlacementAck(placement_id=p.placement_id, node_id=agent.node_id, accepted=False,
                                              reason=why, outcome="refused_spec"), status=409)
        if p.victims:  # a rollback's stop may overtake a part not handed over yet
            await agent.parts.hold_stops(p.victims)
        agent.take_grant(p)
        ack = await agent.supervisor.place(p, direct=direct)
        return json_response(ack, status=200 if ack.accepted else 409)

    async def prefetch(req: Request) -> Response:
        """Fetch an artifact into the store without starting anything (answers at once, 202)."""
        pr = req.decode(PrefetchRequest)
        if why := origin_refusal(pr.origin, allowed):
            raise HTTPError(403, "origin not allowed", why)
        try:
            agent.prefetch(pr)
        except AgentError as e:
            raise HTTPError(503, "prefetch unavailable", str(e)) from None
        return json_response({"accepted": True, "manifest_id": pr.manifest_id}, status=202)

    def _in_use() -> set[str]:
        return {w.manifest_id for w in agent.supervisor.workloads()
                if w.manifest_id and w.state not in TERMINAL_STATES}

    def _store() -> ChunkStore:
        if agent.store is None:
            raise HTTPError(503, "no store", "this agent has no artifact store")
        return agent.store

    async def store_ls(req: Request) -> Response:
        """Manifests held: sizes, bytes present, complete, materialised, pinned, last used;
        ``manifest=ID`` for one; ``fetching``: the prefetches in progress."""
        store = _store()
        one = req.query.get("manifest")
        if one is not None:
            try:
                check_id(one, "manifest id")
            except StoreError as e:
                raise HTTPError(400, "bad manifest id", str(e)) from None
        busy = _in_use()

        def ls() -> list[HeldManifest]:
            return [h for h in store.held(busy) if one is None or h.manifest_id == one]
        held = await trio.to_thread.run_sync(ls)
        last_use: dict[str, float] = {}
        for w in agent.supervisor.workloads():
            if w.manifest_id:
                last_use[w.manifest_id] = max(last_use.get(w.manifest_id, 0.0), w.updated_at)
        held = [msgspec.structs.replace(h, last_used=max(h.last_used, last_use.get(h.manifest_id, 0.0)))
                for h in held]
        fetching = sorted(agent._prefetching)  # the daemon's own record of prefetches in flight
        return json_response({"node_id": agent.node_id, "manifests": held,
                              "fetching": [m for m in fetching if one is None or m == one]})

    async def store_evict(req: Request) -> Response:
        """Evict one manifest (``manifest_id``) or every unused one (``unused: true``): its
        tree, and the chunks no other manifest held here names. In use: 409."""
        store = _store()
        body = req.decode(_EvictBody)
        if (body.manifest_id is None) == (not body.unused):
            raise HTTPError(400, "bad evict request", "give manifest_id or unused: true (one of them)")
        if body.manifest_id is not None:
            try:
                check_id(body.manifest_id, "manifest id")
            except StoreError as e:
                raise HTTPError(400, "bad manifest id", str(e)) from None
        busy = _in_use()
        ids = None if body.unused else [body.manifest_id or ""]
        rep = await trio.to_thread.run_sync(lambda: store.evict_manifests(ids, busy))
        if body.manifest_id is not None and body.manifest_id in rep.refused:
            why = rep.refused[body.manifest_id]
            raise HTTPError(404 if why == "not in this store" else 409, "not evicted", f"{body.manifest_id}: {why}")
        log.info("store evict manifests=%d chunks=%d bytes=%d", len(rep.manifests), rep.chunks, rep.bytes_freed)
        return json_response(rep)

    async def metrics(req: Request) -> Response:
        """Prometheus text: GPU series (dcgm-exporter names), herd_* agent series, process_*."""
        return Response(body=prom.render(), content_type=METRICS_CONTENT_TYPE)

    async def openapi(req: Request) -> Response:
        """This API's OpenAPI description, generated from the route table."""
        return json_response(app.openapi("herd-agent"))

    handlers = {
        ("GET", "/healthz"): healthz, ("GET", "/readyz"): readyz, ("GET", "/metrics"): metrics,
        ("GET", "/openapi.json"): openapi, ("GET", "/v1/status"): status, ("GET", "/v1/gpus"): gpus,
        ("GET", "/v1/workloads"): workloads, ("GET", "/v1/workloads/{wid}"): workload,
        ("GET", "/v1/workloads/{wid}/logs"): logs, ("POST", "/v1/workloads/{wid}/stop"): stop,
        ("POST", "/v1/gpus/{uuid}/inject"): inject, ("POST", "/v1/placements"): place,
        ("POST", "/v1/prefetch"): prefetch,
        ("GET", "/v1/store"): store_ls, ("POST", "/v1/store/evict"): store_evict,
    }
    sec = agent.security   # None: a bootstrap is pending, and the certificate will be required
    authz.install(app, authz.AGENT_ROUTES, handlers, tokens,
                  flags={"open_reads": cfg.open_reads, "open_metrics": cfg.open_metrics,
                         "require_certs": sec.require_certs if sec is not None else True},
                  max_body={("POST", "/v1/workloads/{wid}/stop"): 4096, ("POST", "/v1/gpus/{uuid}/inject"): 16 << 10,
                            ("POST", "/v1/placements"): cfg.max_body_bytes,
                            ("POST", "/v1/prefetch"): cfg.max_body_bytes},
                  docs=_route_docs())
    return app


def _route_docs() -> dict[tuple[str, str], RouteDoc]:
    """/openapi.json for the routes whose bodies are this package's types (the rest:
    scheduler_link.apidocs)."""
    docs = dict(AGENT_DOCS)
    stop = ("POST", "/v1/workloads/{wid}/stop")
    docs[stop] = dataclasses.replace(docs[stop], body=_StopBody, body_required=False)
    docs[("GET", "/v1/store")] = RouteDoc(
        responses={200: {"type": "object", "description": "the manifests held and the prefetches in flight",
                         "properties": {"node_id": {"type": "string"}, "manifests": list[HeldManifest],
                                        "fetching": {"type": "array", "items": {"type": "string"}}}}},
        errors={503: "no store"}, query=(Param("manifest", str, "only this manifest id"),))
    docs[("POST", "/v1/store/evict")] = RouteDoc(
        body=_EvictBody, responses={200: EvictReport},
        errors={404: "not in this store", 409: "in use by a live workload", 503: "no store"})
    inject = ("POST", "/v1/gpus/{uuid}/inject")
    docs[inject] = dataclasses.replace(docs[inject], body=Fault)
    return docs


