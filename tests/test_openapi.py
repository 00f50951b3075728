"""/openapi.json of both daemons: generated from the route tables and the msgspec Structs,
valid OpenAPI 3.1 (openapi-spec-validator), every route with its bodies, answers, query
parameters and security."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import trio
from openapi_spec_validator import validate

from agent.api import build_app
from infra.auth import TokenSet, auth_header
from infra.http import App, Text
from placer.service import PlacerService

from .test_agent_api import make_agent
from .test_placer_service import cfg as placer_cfg


@pytest.fixture
def apps(tmp_path, token_dir) -> dict[str, App]:
    return {"agent": build_app(make_agent(tmp_path / "a", token_dir)),
            "placer": PlacerService(placer_cfg(tmp_path / "p"), TokenSet.load(token_dir)).app}


def resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    name = ref.removeprefix("#/components/schemas/")
    assert name in spec["components"]["schemas"], ref
    return spec["components"]["schemas"][name]


def test_documents_validate_and_list_every_route_with_its_bodies(apps):
    for name, app in apps.items():
        spec = app.openapi(f"herd-{name}")
        validate(spec)          # raises on an invalid OpenAPI 3.1 document
        served = {(r.method.lower(), r.template) for r in app.routes}
        listed = {(m, p) for p, ops in spec["paths"].items() for m in ops}
        assert served == listed, name
        for r in app.routes:
            assert r.doc is not None, f"{name}: {r.method} {r.template} has no RouteDoc (scheduler_link/apidocs.py)"
            op = spec["paths"][r.template][r.method.lower()]
            assert op["summary"], (name, r.template)
            if r.doc.body is not None:
                body = op["requestBody"]["content"]
                if isinstance(r.doc.body, Text):
                    assert r.doc.body.content_type in body
                else:
                    sch = resolve(spec, body["application/json"]["schema"])
                    assert sch.get("type") == "object" or "anyOf" in sch or "properties" in sch, (r.template, sch)
            elif r.method == "POST":
                assert "requestBody" not in op
            for status, b in r.doc.responses.items():
                resp = op["responses"][str(status)]
                if b is None:
                    continue
                (ctype, media), = resp["content"].items()
                if isinstance(b, Text):
                    assert ctype == b.content_type
                else:
                    assert ctype == "application/json" and resolve(spec, media["schema"])
            # every error answer is the {"error", "detail"} body
            for status, resp in op["responses"].items():
                if status == "default" or int(status) >= 400 and status not in {str(s) for s in r.doc.responses}:
                    sch = resolve(spec, resp["content"]["application/json"]["schema"])
                    assert set(sch["required"]) == {"error"} and set(sch["properties"]) == {"error", "detail"}
            # security per route: public ones say so explicitly
            assert op["security"] == ([{"bearer": []}] if r.auth is not None else [])
            if r.auth is not None:
                assert {"401", "403"} <= set(op["responses"])
            for pname in re.findall(r"\{(\w+)\}", r.template):
                assert any(p["in"] == "path" and p["name"] == pname for p in op["parameters"])


def test_bodies_and_query_parameters_are_the_structs_the_handlers_use(apps):
    a = apps["agent"].openapi("herd-agent")
    place = a["paths"]["/v1/placements"]["post"]
    assert place["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Placement"}
    assert place["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlacementAck")
    assert place["responses"]["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlacementAck")
    assert "pods" in a["components"]["schemas"]["Placement"]["properties"]
    logs = a["paths"]["/v1/workloads/{wid}/logs"]["get"]
    q = {p["name"]: p for p in logs["parameters"] if p["in"] == "query"}
    assert set(q) == {"tail", "stream", "follow"} and q["tail"]["schema"] == {"type": "integer"}
    assert sorted(q["stream"]["schema"]["enum"]) == ["stderr", "stdout"]
    assert "text/plain; charset=utf-8" in logs["responses"]["200"]["content"]
    stop = a["paths"]["/v1/workloads/{wid}/stop"]["post"]
    assert stop["requestBody"]["required"] is False
    assert "grace_s" in resolve(a, stop["requestBody"]["content"]["application/json"]["schema"])["properties"]
    inject = a["paths"]["/v1/gpus/{uuid}/inject"]["post"]
    assert "xid" in resolve(a, inject["requestBody"]["content"]["application/json"]["schema"])["properties"]
    assert a["paths"]["/healthz"]["get"]["security"] == []

    p = apps["placer"].openapi("herd-placer")
    sub = p["paths"]["/v1/jobs"]["post"]
    assert sub["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobSpec")
    assert sub["responses"]["201"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobView")
    assert sub["x-herd-roles"] == ["operator"]
    job = p["paths"]["/v1/jobs/{job_id}"]["get"]
    assert {"wait", "pods", "timeout_ms"} <= {x["name"] for x in job["parameters"] if x["in"] == "query"}
    jobs = p["paths"]["/v1/jobs"]["get"]
    assert "state" in {x["name"] for x in jobs["parameters"] if x["in"] == "query"}
    items = jobs["responses"]["200"]["content"]["application/json"]["schema"]["properties"]["jobs"]
    assert items == {"type": "array", "items": {"$ref": "#/components/schemas/JobView"}}
    rep = p["paths"]["/v1/nodes/{node_id}/report"]["post"]
    assert rep["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/NodeReport")
    assert rep["security"] == [{"bearer": []}] and rep["x-herd-roles"] == ["node"]


async def test_served_documents_validate(tmp_path, token_dir):
    """What GET /openapi.json really answers, on both daemons."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            aurl = await n.start(make_agent(tmp_path / "a", token_dir).run)
            purl = await n.start(PlacerService(placer_cfg(tmp_path / "p"), tokens).run)
            async with httpx.AsyncClient(headers=auth_header(tokens.viewer)) as c:
                for url in (aurl, purl):
                    r = await c.get(url + "/openapi.json")
                    assert r.status_code == 200
                    validate(r.json())
            n.cancel_scope.cancel()
