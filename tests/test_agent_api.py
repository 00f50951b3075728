"""The agent's HTTP API, in process: auth (401), bounds (413), malformed bodies (400),
placements, stops, logs, status, metrics, fault injection and the OpenAPI check."""

from __future__ import annotations

import os

import httpx
import msgspec
import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra.auth import TokenSet, auth_header
from scheduler_link.messages import Placement, PlacementAck, PodAssignment, Victim
from testing.waiting import poll
from tests.prom import value


def make_agent(tmp_path, token_dir) -> Agent:
    cfg = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                      listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir), gpu_poll_interval_s=0.2,
                      workloads=SupervisorConfig(shim_pool=1))
    return Agent(cfg, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)


async def wait_state(c: httpx.AsyncClient, wid: str, *states: str) -> dict:
    with trio.fail_after(10):
        while True:
            r = await c.get(f"/v1/workloads/{wid}")
            if r.status_code == 200 and r.json()["state"] in states:
                return r.json()
            await trio.sleep(0.03)


async def test_api_end_to_end(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    op, pl = auth_header(tokens.operator), auth_header(tokens.placer)
    viewer = auth_header(tokens.viewer)
    agent = make_agent(tmp_path, token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            endpoints = msgspec.json.decode((tmp_path / "state" / "endpoints.json").read_bytes())
            assert endpoints["control_url"] == url and endpoints["data_url"] is None
            async with httpx.AsyncClient(base_url=url, headers=viewer) as c:
                h = (await c.get("/healthz")).json()
                assert h["ok"] is True and h["service"] == "herd-agent" and h["version"]
                assert (await c.get("/readyz")).status_code == 200
                st = (await c.get("/v1/status")).json()
                assert st["simulated"] is True and len(st["gpus"]["gpus"]) == 8
                assert st["isolation"] in ("cgroup", "subreaper") and st["workload_user"]
                assert st["gpus"]["topology_matrix"][0][0] == "X"
                uuids = [g["uuid"] for g in st["gpus"]["gpus"]]

                p = Placement(placement_id="p1", job_id="j1", argv=["sh", "-c", "echo out; echo err >&2; sleep 30"],
                              pods=[PodAssignment(workload_id="w1", rank=0, gpus=uuids[:2])], grace_s=5)
                body = msgspec.json.encode(p)
                # 401: a wrong token; 403: the cluster or viewer token; nothing happens
                for h, code in ((auth_header("wrong"), 401), (auth_header(tokens.cluster), 403), ({}, 403)):
                    r = await c.post("/v1/placements", content=body, headers=h)
                    assert r.status_code == code
                assert (await c.get("/v1/workloads")).json() == []
                # 400: malformed and invalid bodies
                r = await c.post("/v1/placements", content=b"{nope", headers=pl)
                assert r.status_code == 400 and r.json()["error"] == "malformed request body"
                r = await c.post("/v1/placements", content=b'{"placement_id": 1, "job_id": "j"}', headers=pl)
                assert r.status_code == 400 and "placement_id" in r.json()["detail"]
                # 413: body over the bound
                r = await c.post("/v1/placements", content=b"x" * (5 << 20), headers=pl)   # over 4 MiB
                assert r.status_code == 413
                assert (await c.get("/v1/workloads")).json() == []

                r = await c.post("/v1/placements", content=body, headers=pl)
                assert r.status_code == 200
                ack = msgspec.convert(r.json(), PlacementAck)
                assert ack.accepted and ack.workloads == ["w1"] and ack.node_id == "n1"
                # idempotent
                assert (await c.post("/v1/placements", content=body, headers=pl)).json() == r.json()
                await wait_state(c, "w1", "running")
                # double booking refused (409 with the ack and its reason)
                p2 = Placement(placement_id="p2", job_id="j2", argv=["true"],
                               pods=[PodAssignment(workload_id="w2", rank=0, gpus=[uuids[1]])])
                r = await c.post("/v1/placements", content=msgspec.json.encode(p2), headers=op)
                assert r.status_code == 409 and "in use by workload w1" in r.json()["reason"]
                async def logged() -> bool:
                    return "out" in (await c.get("/v1/workloads/w1/logs")).text

                with trio.fail_after(5):
                    await poll(logged, 0.03)
                r = await c.get("/v1/workloads/w1/logs", params={"tail": "1", "stream": "stderr"})
                assert r.text == "err\n"
                assert (await c.get("/v1/workloads/w1/logs", params={"tail": "x"})).status_code == 400
                assert (await c.get("/v1/workloads/nope")).status_code == 404
                st = (await c.get("/v1/status")).json()
                assert st["gpu_holders"] == {uuids[0]: "w1", uuids[1]: "w1"}

                m = (await c.get("/metrics")).text
                assert value(m, "herd_workloads", node="n1", state="running") == 1
                assert "herd_workload_starts_total" in m and "DCGM_FI_DEV_GPU_TEMP" in m
                assert value(m, "herd_workload_start_seconds_count", node="n1", fetch="false") >= 1
                assert value(m, "herd_p2p_bytes_total", node="n1", source="origin") == 0  # the agent's one herd fetcher
                # the GPUs w1 holds say so on their dcgm series
                assert value(m, "DCGM_FI_DEV_GPU_TEMP", UUID=uuids[0], workload="w1", node="n1") is not None
                assert st["herd"]["bytes_from_origin"] == 0

                # fault injection: operator only, then health follows through the GPU monitor
                inj = f"/v1/gpus/{uuids[3]}/inject"
                assert (await c.post(inj, content=b'{"xid": 79}', headers=pl)).status_code == 403
                assert (await c.post(inj, content=b'{"bogus": 1}', headers=op)).status_code == 400
                assert (await c.post("/v1/gpus/GPU-nope/inject", content=b'{"xid": 79}', headers=op)).status_code == 404
                assert (await c.post(inj, content=b'{"xid": 79}', headers=op)).status_code == 200
                async def fatal() -> bool:
                    return (await c.get("/v1/gpus")).json()["gpus"][3]["health"] == "fatal"

                with trio.fail_after(5):
                    await poll(fatal, 0.05)
                p3 = Placement(placement_id="p3", job_id="j3", argv=["true"],
                               pods=[PodAssignment(workload_id="w3", rank=0, gpus=[uuids[3]])])
                r = await c.post("/v1/placements", content=msgspec.json.encode(p3), headers=pl)
                assert r.status_code == 409 and "fatal" in r.json()["reason"]

                # stop: operator token only; bad body 400; unknown 404
                assert (await c.post("/v1/workloads/w1/stop", headers=pl)).status_code == 403
                r = await c.post("/v1/workloads/w1/stop", content=b'{"grace_s": -1}', headers=op)
                assert r.status_code == 400
                assert (await c.post("/v1/workloads/zz/stop", headers=op)).status_code == 404
                r = await c.post("/v1/workloads/w1/stop", content=b'{"grace_s": 0.2}', headers=op)
                assert r.status_code == 200 and r.json()["state"] == "terminating"
                w = await wait_state(c, "w1", "exited", "preempted")
                assert w["state"] == "exited" and w["reason"] == "stopped"

                # a placer placement that preempts a victim and starts a pod on its GPU
                p4 = Placement(placement_id="p4", job_id="j4", argv=["sleep", "30"], grace_s=1,
                               pods=[PodAssignment(workload_id="w4", rank=0, gpus=[uuids[0]])])
                assert (await c.post("/v1/placements", content=msgspec.json.encode(p4), headers=pl)).status_code == 200
                await wait_state(c, "w4", "running")
                p5 = Placement(placement_id="p5", job_id="j5", argv=["sleep", "30"],
                               victims=[Victim(workload_id="w4", grace_s=0.5, preempted=True)],
                               pods=[PodAssignment(workload_id="w5", rank=0, gpus=[uuids[0]])])
                r = await c.post("/v1/placements", content=msgspec.json.encode(p5), headers=pl)
                assert r.status_code == 200 and r.json()["accepted"]
                assert (await wait_state(c, "w4", "preempted", "exited"))["state"] == "preempted"
                await wait_state(c, "w5", "running")
                await c.post("/v1/workloads/w5/stop", content=b'{"grace_s": 0.5}', headers=op)
                await wait_state(c, "w5", "preempted", "exited")
                m = (await c.get("/metrics")).text
                assert value(m, "herd_workload_preemptions_total", node="n1") == 1

                # prefetch without a store-backed origin: clear error, nothing started
                r = await c.post("/v1/prefetch", content=b'{"manifest_id": 5}', headers=pl)
                assert r.status_code == 400
            n.cancel_scope.cancel()


async def test_openapi_lists_every_route(tmp_path, token_dir):
    agent = make_agent(tmp_path, token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            async with httpx.AsyncClient(base_url=url, headers=auth_header(TokenSet.load(token_dir).viewer)) as c:
                spec = (await c.get("/openapi.json")).json()
                served = {(r.method.lower(), r.template) for r in _app_routes(agent)}
                listed = {(m, p) for p, ops in spec["paths"].items() for m in ops}
                assert served == listed
                want = {"/healthz", "/readyz", "/v1/status", "/v1/gpus", "/v1/workloads", "/v1/workloads/{wid}",
                        "/v1/workloads/{wid}/logs", "/v1/workloads/{wid}/stop", "/v1/gpus/{uuid}/inject",
                        "/v1/placements", "/v1/prefetch", "/v1/store", "/v1/store/evict", "/metrics", "/openapi.json"}
                assert set(spec["paths"]) == want
                assert spec["paths"]["/v1/placements"]["post"]["security"] == [{"bearer": []}]
                # every listed GET without path parameters really answers 200 to the viewer
                for path, ops in spec["paths"].items():
                    if "get" in ops and "{" not in path:
                        assert (await c.get(path)).status_code == 200, path
            n.cancel_scope.cancel()


def _app_routes(agent: Agent):
    from agent.api import build_app
    return build_app(agent).routes
