"""What each route of the two APIs takes and answers, for ``/openapi.json``: one
:class:`~infra.http.RouteDoc` per route of :mod:`scheduler_link.authz`'s tables,
keyed like them. Bodies are the msgspec Structs the handlers decode and encode (their JSON
Schemas become the document's components); answers a handler builds as a dict are
described by a small JSON Schema here, whose values may be types too (``list[NodeView]``). A daemon adds the docs of routes whose types live
in its own package (the agent's stop and fault bodies) through ``authz.install(docs=)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from infra.http import Param, RouteDoc, Text

from .messages import (
    ArtifactUpdate,
    DefragRequest,
    GpuSnapshot,
    JobSpec,
    JobView,
    NodeOp,
    NodeReport,
    NodeView,
    Placement,
    PlacementAck,
    PrefetchFanout,
    PrefetchRequest,
    ReportReply,
    WorkloadStatus,
)

Key = tuple[str, str]
PROMETHEUS = Text("text/plain; version=0.0.4; charset=utf-8")
OPENAPI: dict[str, Any] = {"type": "object", "description": "an OpenAPI 3.1 document"}


def obj(description: str, **props: Any) -> dict[str, Any]:
    """A JSON object schema with the properties that matter (others may follow)."""
    return {"type": "object", "description": description, "properties": props}


HEALTH = obj("liveness", ok={"type": "boolean"}, service={"type": "string"}, version={"type": "string"},
             wire_version={"type": "integer"})
_PAGE = Param("page", str, "OFFSET:LIMIT or LIMIT (a page of the list)")

AGENT_DOCS: Mapping[Key, RouteDoc] = {
    ("GET", "/healthz"): RouteDoc(responses={200: HEALTH}),
    ("GET", "/readyz"): RouteDoc(responses={200: obj("ready", ready={"type": "boolean"}),
                                            503: obj("not ready yet", ready={"type": "boolean"})}),
    ("GET", "/metrics"): RouteDoc(responses={200: PROMETHEUS}),
    ("GET", "/openapi.json"): RouteDoc(responses={200: OPENAPI}),
    ("GET", "/v1/status"): RouteDoc(responses={200: obj(
        "node, GPUs, holders, workloads and the parts' statistics", node_id={"type": "string"},
        ready={"type": "boolean"}, gpu_holders={"type": "object", "additionalProperties": {"type": "string"}})}),
    ("GET", "/v1/gpus"): RouteDoc(responses={200: GpuSnapshot}),
    ("GET", "/v1/workloads"): RouteDoc(responses={200: list[WorkloadStatus]}),
    ("GET", "/v1/workloads/{wid}"): RouteDoc(responses={200: WorkloadStatus}, errors={404: "no such workload"}),
    ("GET", "/v1/workloads/{wid}/logs"): RouteDoc(
        responses={200: Text()}, errors={404: "no such workload", 409: "log refused (not a regular file)"},
        query=(Param("tail", int, "the last N lines (0..100000, default 100)"),
               Param("stream", Literal["stdout", "stderr"], "which log (default stdout)"),
               Param("follow", Literal["0", "1", "true"], "1: stream what is appended until the workload ends"))),
    ("POST", "/v1/workloads/{wid}/stop"): RouteDoc(responses={200: WorkloadStatus},
                                                   errors={404: "no such workload"}),
    ("POST", "/v1/gpus/{uuid}/inject"): RouteDoc(
        responses={200: obj("injected", injected={"type": "boolean"}, gpu={"type": "string"})},
        errors={404: "no such GPU", 409: "fault injection refused (not a simulated GPU)",
                503: "fault injection unavailable"}),
    ("POST", "/v1/placements"): RouteDoc(body=Placement, responses={200: PlacementAck, 409: PlacementAck}),
    ("POST", "/v1/prefetch"): RouteDoc(
        body=PrefetchRequest,
        responses={202: obj("fetch started", accepted={"type": "boolean"}, manifest_id={"type": "string"})},
        errors={403: "origin not allowed", 503: "prefetch unavailable"}),
}

PLACER_DOCS: Mapping[Key, RouteDoc] = {
    ("GET", "/healthz"): RouteDoc(responses={200: HEALTH}),
    ("GET", "/metrics"): RouteDoc(responses={200: PROMETHEUS}),
    ("GET", "/openapi.json"): RouteDoc(responses={200: OPENAPI}),
    ("POST", "/v1/nodes/{node_id}/report"): RouteDoc(
        body=NodeReport, responses={200: ReportReply, 409: ReportReply}),
    ("GET", "/v1/nodes"): RouteDoc(
        responses={200: obj("one page of nodes", nodes=list[NodeView],
                            total={"type": "integer"}, offset={"type": "integer"})},
        query=(_PAGE, Param("state", Literal["up", "lost"], "only nodes in this state"))),
    ("POST", "/v1/nodes/{node_id}/cordon"): RouteDoc(body=NodeOp, body_required=False,
                                                     responses={200: obj("the node", node=NodeView)},
                                                     errors={404: "no such node"}),
    ("POST", "/v1/nodes/{node_id}/uncordon"): RouteDoc(body=NodeOp, body_required=False,
                                                       responses={200: obj("the node", node=NodeView)},
                                                       errors={404: "no such node"}),
    ("POST", "/v1/nodes/{node_id}/drain"): RouteDoc(body=NodeOp, body_required=False,
                                                    responses={200: obj("the node", node=NodeView)},
                                                    errors={404: "no such node", 409: "cannot drain"}),
    ("GET", "/v1/cluster"): RouteDoc(
        responses={200: obj("capacity, fragmentation, queue, counters", nodes={"type": "object"},
                            model={"type": "object"})},
        query=(Param("detail", Literal["0", "1"], "0: the cheap figures only"),)),
    ("GET", "/v1/gangs/{blob_id}"): RouteDoc(
        responses={200: Text("application/octet-stream")}, errors={404: "no such gang blob"}),
    ("POST", "/v1/jobs"): RouteDoc(body=JobSpec, responses={201: JobView},
                                   errors={409: "job refused (a job of that id exists)", 503: "job not stored"}),
    ("GET", "/v1/jobs"): RouteDoc(
        responses={200: obj("one page of jobs", jobs=list[JobView])},
        query=(_PAGE, Param("state", str, "only jobs in this state"))),
    ("GET", "/v1/jobs/{job_id}"): RouteDoc(
        responses={200: JobView}, errors={404: "no such job"},
        query=(Param("pods", str, "OFFSET:LIMIT of the job's pods"),
               Param("wait", str, "answer once the job reaches this state (or a terminal one)"),
               Param("timeout_ms", int, "how long wait waits (default 10000, at most 60000)"))),
    ("DELETE", "/v1/jobs/{job_id}"): RouteDoc(responses={200: JobView},
                                              errors={404: "no such job", 409: "cannot cancel"}),
    ("POST", "/v1/jobs/{job_id}/artifact"): RouteDoc(body=ArtifactUpdate, responses={200: JobView},
                                                     errors={404: "no such job", 409: "cannot update the artifact"}),
    ("POST", "/v1/defrag"): RouteDoc(body=DefragRequest, body_required=False, responses={200: obj(
        "the moves planned (and applied when asked)", moves={"type": "array"}, applied={"type": "boolean"})}),
    ("POST", "/v1/prefetch"): RouteDoc(body=PrefetchFanout, responses={200: obj(
        "each node's answer", nodes={"type": "object"})}, errors={404: "unknown or lost nodes"}),
}

DOCS: Mapping[str, Mapping[Key, RouteDoc]] = {"agent": AGENT_DOCS, "placer": PLACER_DOCS}
