"""The shared HTTP layer: routing, auth, body bounds, malformed bodies, port 0."""

from __future__ import annotations

import httpx
import msgspec
import trio

from infra.auth import TokenSet, auth_header
from infra.http import App, HTTPError, json_response, require_role, serve
from scheduler_link.messages import Placement


def make_app(tokens: TokenSet) -> tuple[App, list[Placement]]:
    app = App(max_body=1024)
    got: list[Placement] = []

    @app.route("GET", "/v1/things/{tid}")
    async def get_thing(req):
        if req.params["tid"] == "missing":
            raise HTTPError(404, "no such thing", req.params["tid"])
        return json_response({"id": req.params["tid"]})

    @app.route("POST", "/v1/placements", auth=require_role(tokens, "placer"))
    async def place(req):
        got.append(req.decode(Placement))
        return json_response({"ok": True})

    return app, got


async def test_routes_auth_and_bounds(token_dir):
    tokens = TokenSet.load(token_dir)
    app, got = make_app(tokens)
    body = msgspec.json.encode(Placement(placement_id="p1", job_id="j1"))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
            async with httpx.AsyncClient(base_url=url) as c:
                r = await c.get("/v1/things/abc")
                assert (r.status_code, r.json()) == (200, {"id": "abc"})
                r = await c.get("/v1/things/missing")
                assert r.status_code == 404 and r.json()["error"] == "no such thing"
                assert (await c.get("/nope")).status_code == 404
                assert (await c.delete("/v1/things/abc")).status_code == 405
                # no token, wrong token, wrong role: 401 and nothing happens
                assert (await c.post("/v1/placements", content=body)).status_code == 401
                r = await c.post("/v1/placements", content=body, headers=auth_header("wrong"))
                assert r.status_code == 401
                r = await c.post("/v1/placements", content=body, headers=auth_header(tokens.operator))
                assert r.status_code == 401
                assert got == []
                # malformed and oversized bodies
                r = await c.post("/v1/placements", content=b"{not json", headers=auth_header(tokens.placer))
                assert r.status_code == 400 and r.json()["error"] == "malformed request body"
                r = await c.post("/v1/placements", content=b'{"job_id": 3}', headers=auth_header(tokens.placer))
                assert r.status_code == 400
                r = await c.post("/v1/placements", content=b"x" * 5000, headers=auth_header(tokens.placer))
                assert r.status_code == 413
                assert got == []
                r = await c.post("/v1/placements", content=body, headers=auth_header(tokens.placer))
                assert r.status_code == 200
                assert [p.placement_id for p in got] == ["p1"]
            n.cancel_scope.cancel()


def test_missing_token_file_never_authenticates(tmp_path):
    tokens = TokenSet.load(tmp_path / "nothing-here")
    assert not tokens.check("placer", "")
    assert not tokens.check("placer", "anything")
    assert tokens.placer is None


def test_openapi_lists_every_route(token_dir):
    app, _ = make_app(TokenSet.load(token_dir))
    spec = app.openapi("t")
    assert set(spec["paths"]) == {"/v1/things/{tid}", "/v1/placements"}
    assert spec["paths"]["/v1/placements"]["post"]["security"] == [{"bearer": []}]
