"""The placer service with in-process fake agents (testing.fake_agent: small honest HTTP servers that keep
a workload table, check GPUs against their inventory, and report through the real
AgentLink). Real loopback sockets; no processes.

The lost/fence/recovery tests run in virtual time (``autojump_clock``, the placer's clock
``trio.current_time``) over the same real sockets: trio jumps the clock only when every
task waits and no loopback byte is ready, so heartbeats, ticks and deadlines keep their
order and the assertions are the deadlines' exact instants (to a tick)."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import trio.testing

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig, PlacerConfigError, load_config
from placer.journal import Journal, JournalError
from placer.service import PlacerService
from scheduler_link.messages import (
    TERMINAL_STATES,
    JobSpec,
    NodeReport,
)
from testing.fake_agent import FakeAgent
from testing.waiting import poll


def cfg(tmp: Path, **kw) -> PlacerConfig:
    base = dict(listen="127.0.0.1:0", state_dir=str(tmp / "placer"), heartbeat_s=0.1, lost_after_missed=3,
                fence_after_s=0.5, recover_s=0.4, ack_timeout_s=1.0, tick_s=0.05, wire_listen="127.0.0.1:0")
    base.update(kw)
    return PlacerConfig(**base)


async def wait_for(pred):
    """``pred`` (async) polled: agents and placer answer over HTTP; the caller bounds it."""
    return await poll(pred, 0.02)


class Cluster:
    def __init__(self, tokens: TokenSet, url: str, agents: list[FakeAgent]) -> None:
        self.tokens = tokens
        self.url = url
        self.agents = {a.node_id: a for a in agents}
        self.c = httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10)

    async def submit(self, **kw) -> dict:
        kw.setdefault("argv", ["sleep", "100"])
        r = await self.c.post("/v1/jobs", content=msgspec.json.encode(JobSpec(**kw)))
        assert r.status_code == 201, r.text
        return r.json()

    async def job(self, job_id: str, wait: str | None = None) -> dict:
        q = f"?wait={wait}&timeout_ms=5000" if wait else ""
        r = await self.c.get(f"/v1/jobs/{job_id}{q}")
        assert r.status_code == 200
        return r.json()

    async def nodes_up(self, n: int) -> bool:
        r = await self.c.get("/v1/nodes")
        return sum(x["state"] == "up" for x in r.json()["nodes"]) == n


async def start_cluster(nursery, tmp: Path, tokens: TokenSet, n_agents: int = 4, *, clock=time.time, **kw):
    svc = PlacerService(cfg(tmp, **kw), tokens, clock=clock)
    url = await nursery.start(svc.run)
    agents = [FakeAgent(f"n{i}", tokens, rack=f"r{i // 2}") for i in range(n_agents)]
    for a in agents:
        await nursery.start(a.run, url)
    cl = Cluster(tokens, url, agents)
    await wait_for(lambda: cl.nodes_up(n_agents))
    return svc, cl


async def test_submit_runs_on_the_chosen_gpus_then_preempt_and_cancel(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            # (no node is lost for a loaded host's late beat: where each pod lands is what is checked)
            svc, cl = await start_cluster(n, tmp_path, tokens, lost_after_missed=50)
            j = await cl.submit(job_id="low", pods=2, gpus_per_pod=8, priority=1, preemptible=True,
                                restart={"kind": "on-preemption"}, within="rack", grace_s=1.0)
            assert j["state"] in ("pending", "placing", "starting")  # decided while its journal entry synced
            v = await cl.job("low", wait="running")
            assert v["state"] == "running"
            # (the running events may overtake the acks: both end up recorded)
            v = await wait_for(lambda: _with_timing(cl, "low", "acked"))
            assert {"submitted", "decided", "pushed", "acked", "running"} <= set(v["timings"])
            t = v["timings"]
            assert t["submitted"] <= t["decided"] <= t["pushed"] <= t["acked"]
            # every pod runs on the node and GPUs the placer chose
            for pod in v["pods"]:
                w = cl.agents[pod["node_id"]].workloads[pod["workload_id"]]
                assert w.state == "running" and w.gpus == pod["gpus"]
            racks = {cl.agents[p["node_id"]].topology.rack for p in v["pods"]}
            assert len(racks) == 1
            # a high-priority job that needs every GPU preempts it
            await cl.submit(job_id="high", pods=4, gpus_per_pod=8, priority=10, preemptible=False)
            h = await cl.job("high", wait="running")
            assert h["state"] == "running"
            low = await cl.job("low")
            assert low["state"] == "pending" and low["restarts"] == 1  # requeued by its policy
            old = [p["workload_id"] for p in v["pods"]]
            for pod in v["pods"]:
                assert cl.agents[pod["node_id"]].workloads[pod["workload_id"]].state == "preempted"
            # victims and new pods went out together, one placement per node
            together = [p for a in cl.agents.values() for p in a.placements if p.job_id == "high"]
            assert {v.workload_id for p in together for v in p.victims} == set(old)
            assert all(p.pods for p in together)
            # no GPU is used twice on any agent
            for a in cl.agents.values():
                live = [g for w in a.workloads.values() if w.state not in TERMINAL_STATES for g in w.gpus]
                assert len(live) == len(set(live))
            # cancel: stopped gracefully, its GPUs free again, the low job runs again
            r = await cl.c.delete("/v1/jobs/high")
            assert r.status_code == 200 and r.json()["state"] == "cancelled"
            low = await cl.job("low", wait="running")
            assert low["state"] == "running" and low["attempt"] == 2
            assert (await cl.c.delete("/v1/jobs/nope")).status_code == 404
            n.cancel_scope.cancel()


async def _with_timing(cl: Cluster, job: str, key: str):
    v = await cl.job(job)
    return v if key in v["timings"] else None


async def test_refused_gang_rolls_back_and_places_elsewhere(tmp_path, token_dir, autojump_clock):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, clock=trio.current_time)
            # n0 will refuse GPU 0 before the placer hears it is fatal
            cl.agents["n0"].fatal.add("GPU-n0-0")
            await cl.submit(job_id="g", pods=4, gpus_per_pod=4, within="any")
            v = await cl.job("g", wait="running")
            assert v["state"] == "running"
            used = {(p["node_id"], g) for p in v["pods"] for g in p["gpus"]}
            assert ("n0", "GPU-n0-0") not in used
            # whatever was started by a rolled-back attempt was stopped
            for a in cl.agents.values():
                for w in a.workloads.values():
                    if w.job_id == "g" and not w.workload_id.startswith(f"g.{v['attempt']}."):
                        assert w.state in TERMINAL_STATES
            n.cancel_scope.cancel()


async def test_wrong_tokens_change_nothing(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=1)
            body = msgspec.json.encode(JobSpec(job_id="x", argv=["true"]))
            async with httpx.AsyncClient(base_url=cl.url) as c:
                # no token or a wrong one: 401; a real token of another role: 403
                for hdr, code in (({}, 401), (auth_header("wrong"), 401), (auth_header(tokens.cluster), 403),
                                  (auth_header(tokens.placer), 403)):
                    assert (await c.post("/v1/jobs", content=body, headers=hdr)).status_code == code
                    assert (await c.delete("/v1/jobs/x", headers=hdr)).status_code == code
                rep = msgspec.json.encode(NodeReport(node_id="evil", boot_id="b", seq=1))
                for hdr, code in (({}, 401), (auth_header("wrong"), 401), (auth_header(tokens.operator), 403)):
                    r = await c.post("/v1/nodes/evil/report", content=rep, headers=hdr)
                    assert r.status_code == code
                assert (await c.get("/v1/jobs")).status_code == 401  # reads need the viewer role
                view = auth_header(tokens.operator)
                assert (await c.get("/v1/jobs", headers=view)).json()["jobs"] == []
                assert [x["node_id"] for x in (await c.get("/v1/nodes", headers=view)).json()["nodes"]] == ["n0"]
                # bad input: clear errors, nothing stored
                hdr = auth_header(tokens.operator)
                for bad in (b"{", msgspec.json.encode({"job_id": "x", "pods": 0, "argv": ["a"]}),
                            msgspec.json.encode({"job_id": "../x", "argv": ["a"]}),
                            msgspec.json.encode({"job_id": "x", "argv": []}),
                            msgspec.json.encode({"job_id": "x", "within": "galaxy", "argv": ["a"]}),
                            msgspec.json.encode({"job_id": "x", "gpus_per_pod": 65, "argv": ["a"]}),
                            msgspec.json.encode({"job_id": "x", "priority": 1 << 40, "argv": ["a"]}),
                            msgspec.json.encode({"job_id": "x", "env": {"A=B": "c"}, "argv": ["a"]})):
                    r = await c.post("/v1/jobs", content=bad, headers=hdr)
                    assert r.status_code == 400 and r.json()["error"], r.text
                assert (await c.get("/v1/jobs", headers=hdr)).json()["jobs"] == []
                r = await c.post("/v1/nodes/n0/report", headers=auth_header(tokens.cluster),
                                 content=msgspec.json.encode(NodeReport(node_id="n0", boot_id="zz", seq=5,
                                                                        full=False)))
                assert r.status_code == 409  # unknown boot: the agent must send a full report
                spec = (await c.get("/openapi.json", headers=hdr)).json()
                assert "/v1/jobs/{job_id}" in spec["paths"] and "/v1/nodes/{node_id}/report" in spec["paths"]
                m = (await c.get("/metrics")).text
                assert 'herd_placer_nodes{state="up"} 1' in m
            n.cancel_scope.cancel()


async def test_restart_rebuilds_from_reports_and_nothing_doubles(tmp_path, token_dir, autojump_clock):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(25):
        async with trio.open_nursery() as outer:
            agents = [FakeAgent(f"n{i}", tokens, rack=f"r{i // 2}") for i in range(4)]
            # the placer listens on a fixed port so agents find it again after the restart
            svc = PlacerService(cfg(tmp_path), tokens, clock=trio.current_time)
            scope = trio.CancelScope()

            async def run_svc(s, *, task_status=trio.TASK_STATUS_IGNORED):
                with scope:
                    await s.run(task_status=task_status)
            url = await outer.start(run_svc, svc)
            for a in agents:
                await outer.start(a.run, url)
            cl = Cluster(tokens, url, agents)
            await wait_for(lambda: cl.nodes_up(4))
            await cl.submit(job_id="a", pods=2, gpus_per_pod=8, within="rack")
            await cl.submit(job_id="b", pods=1, gpus_per_pod=4)
            await cl.submit(job_id="big", pods=8, gpus_per_pod=8)  # cannot fit: stays pending
            va = await cl.job("a", wait="running")
            vb = await cl.job("b", wait="running")
            scope.cancel()
            await trio.sleep(0.3)  # agents fail a few reports and back off
            port = url.rsplit(":", 1)[1]
            svc2 = PlacerService(cfg(tmp_path, listen=f"127.0.0.1:{port}"), tokens, clock=trio.current_time)
            t_start = trio.current_time()
            await outer.start(svc2.run)
            await wait_for(lambda: cl.nodes_up(4))
            a2 = await cl.job("a", wait="running")
            b2 = await cl.job("b", wait="running")
            assert a2["attempt"] == va["attempt"] and b2["attempt"] == vb["attempt"]
            assert sorted((p["node_id"], p["gpus"]) for p in a2["pods"]) == sorted(
                (p["node_id"], p["gpus"]) for p in va["pods"])
            assert (await cl.job("big"))["state"] == "pending"
            # the recovery ends once every node of the placer's fleet snapshot reported and every
            # recovered job is whole (placer.fleetsnap), recover_s after the restart at the latest:
            # nothing placed again before or after it
            assert svc2.state.recover_until <= t_start + svc2.cfg.recover_window_s + 0.01
            await trio.sleep_until(t_start + svc2.cfg.recover_window_s + 0.5)
            # nothing placed twice: each agent ran exactly the workloads of the first placements
            all_w = [w for ag in agents for w in ag.workloads.values()]
            assert sorted(w.workload_id for w in all_w) == sorted(
                [p["workload_id"] for p in va["pods"]] + [p["workload_id"] for p in vb["pods"]])
            assert svc2.state.model.statistics()["allocated"] == 20
            outer.cancel_scope.cancel()


async def _until(pred, step: float = 0.001) -> float:
    """The virtual instant ``pred()`` (of the service's state) first holds, to ``step``."""
    await poll(pred, step)
    return trio.current_time()


async def test_lost_node_is_fenced_then_rescheduled_and_told_to_stop(tmp_path, token_dir, autojump_clock):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, clock=trio.current_time)
            c = svc.cfg
            await cl.submit(job_id="r", pods=1, gpus_per_pod=8, restart={"kind": "on-failure", "limit": 2})
            v = await cl.job("r", wait="running")
            victim_node = v["pods"][0]["node_id"]
            agent = cl.agents[victim_node]
            link = agent.link
            assert link is not None
            # partition: the agent stops reporting (its workloads keep running)
            agent.cancel.cancel()
            node = svc.state.nodes[victim_node]
            job = svc.state.jobs["r"]
            seen = await _until(lambda: node.state == "lost")
            t_lost = node.lost_since
            assert t_lost is not None and t_lost <= seen < t_lost + 0.0011
            # lost at the first tick at or after lost_after_s of silence; fenced (the pod's
            # attempt ended, requeued by its policy) at the first tick fence_after_s later
            assert node.last_seen + c.lost_after_s <= t_lost < node.last_seen + c.lost_after_s + c.tick_s + 0.001
            t_fenced = await _until(lambda: job.restarts == 1)
            assert t_lost + c.fence_after_s <= t_fenced < t_lost + c.fence_after_s + c.tick_s + 0.001
            v2 = await wait_for(lambda: _job_elsewhere(cl, "r", victim_node))
            assert v2["attempt"] == v["attempt"] + 1 and v2["restarts"] == 1
            # the partitioned agent comes back (same workloads, new link): told to stop the old pod
            old = v["pods"][0]["workload_id"]
            assert agent.workloads[old].state == "running"
            agent.cancel = trio.CancelScope()
            await n.start(agent.run, cl.url)
            await wait_for(lambda: _true(agent.workloads[old].state == "preempted"))
            await wait_for(lambda: cl.nodes_up(4))
            assert (await cl.job("r"))["state"] == "running"
            n.cancel_scope.cancel()


async def _true(v):
    return v


async def _node_state(cl: Cluster, node: str, state: str) -> bool:
    r = await cl.c.get("/v1/nodes")
    return any(x["node_id"] == node and x["state"] == state for x in r.json()["nodes"])


async def _job_elsewhere(cl: Cluster, job: str, not_on: str):
    v = await cl.job(job)
    if v["state"] == "running" and all(p["node_id"] != not_on for p in v["pods"]):
        return v
    return None


async def test_failed_pod_restarts_by_policy_then_fails(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            await cl.submit(job_id="f", pods=1, gpus_per_pod=2, restart={"kind": "on-failure", "limit": 1})
            for attempt in (1, 2):
                v = await cl.job("f", wait="running")
                assert v["attempt"] == attempt
                p = v["pods"][0]
                cl.agents[p["node_id"]].exit(p["workload_id"], 3)
                await wait_for(lambda a=attempt: _attempt_done(cl, "f", a))
            v = await cl.job("f", wait="failed")
            assert v["state"] == "failed" and "code 3" in v["reason"]
            await cl.submit(job_id="ok", pods=2, gpus_per_pod=1)
            v = await cl.job("ok", wait="running")
            for p in v["pods"]:
                cl.agents[p["node_id"]].exit(p["workload_id"], 0)
            assert (await cl.job("ok", wait="succeeded"))["state"] == "succeeded"
            assert sorted(s.job_id for s in svc.journal.jobs()) == []  # both ended in the journal
            n.cancel_scope.cancel()


async def _attempt_done(cl: Cluster, job: str, attempt: int) -> bool:
    v = await cl.job(job)
    return v["attempt"] > attempt or v["state"] in ("failed", "pending")


def test_journal_survives_torn_line_and_refuses_corruption(tmp_path):
    j = Journal.open(tmp_path)
    j.submitted(JobSpec(job_id="a", argv=["x"]), 1.0)
    j.submitted(JobSpec(job_id="b", argv=["x"]), 2.0)
    j.ended("a", "succeeded", 3.0)
    j.close()
    with open(tmp_path / "jobs.journal", "ab") as f:
        f.write(b'{"v":1,"op":"sub')  # a crash mid-append
    j2 = Journal.open(tmp_path)
    assert [s.job_id for s in j2.jobs()] == ["b"]
    j2.attempt("b", 3, 4.0)
    j2.attempt("b", 2, 5.0)  # never goes back
    j2.close()
    assert Journal.open(tmp_path).attempts == {"b": 3}
    (tmp_path / "jobs.journal").write_bytes(b"garbage\n" + (tmp_path / "jobs.journal").read_bytes())
    with pytest.raises(JournalError, match="line 1 is corrupt"):
        Journal.open(tmp_path)


def test_journal_compacts_and_keeps_live_jobs_and_attempts(tmp_path):
    j = Journal.open(tmp_path)
    for i in range(100):
        j.submitted(JobSpec(job_id=f"j{i}", argv=["x"]), float(i))
        if i != 7:
            j.ended(f"j{i}", "succeeded", float(i))
    j.attempt("j7", 5, 1.0)
    j.close()
    with open(tmp_path / "jobs.journal", "ab") as f:
        f.write(b'{"v":1,"op":"end","job_id":"j7"')  # torn, then compacted away
    size = len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0])  # its records (zeros follow)
    j = Journal.open(tmp_path)  # compacted on open
    assert [s.job_id for s in j.jobs()] == ["j7"] and j.attempts == {"j7": 5}
    # the ended jobs' specs are gone; their attempt counters stay (a resubmission continues them)
    assert len(j.ended_attempts) == 99 and len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0]) < size / 3
    j.close()
    assert Journal.open(tmp_path).attempts == {"j7": 5}


def test_config_errors_are_clear(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text("[placer]\nheartbeat_s = 1.5\nfence_after_s = 3\n")
    c = load_config(p, listen="127.0.0.1:0")
    assert c.heartbeat_s == 1.5 and c.fence_after_s == 3 and c.lost_after_s == 4.5
    p.write_text("[placer]\nheartbeat = 1\n")
    with pytest.raises(PlacerConfigError, match="bad placer config"):
        load_config(p)
    p.write_text("[placer\n")
    with pytest.raises(PlacerConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(PlacerConfigError, match="not found"):
        load_config(tmp_path / "none.toml")
    with pytest.raises(PlacerConfigError):
        load_config(None, heartbeat_s=0)
    with pytest.raises(PlacerConfigError, match="enroll_workers must be within 0..64"):
        load_config(None, enroll_workers=-1)
    with pytest.raises(PlacerConfigError, match="direct_max_nodes must be >= 0"):
        load_config(None, direct_max_nodes=-5)
    assert load_config(None, enroll_workers=0).enroll_workers == 0


async def test_peers_prefetch_and_fatal_gpu_reports(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    mid = "ab" * 32
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens)
            holder = cl.agents["n3"]
            holder.manifests = [mid]
            holder.link.request_full_report()
            await wait_for(lambda: _true(mid in svc.state.nodes["n3"].manifests))
            await cl.submit(job_id="p", pods=1, gpus_per_pod=8, manifest_id=mid, origin="file:///o",
                            within="node")
            v = await cl.job("p", wait="running")
            node = v["pods"][0]["node_id"]
            pl = next(p for p in cl.agents[node].placements if p.job_id == "p")
            assert pl.manifest_id == mid and pl.origin == "file:///o"
            assert {p.node_id for p in pl.peers} == {node, "n3"}  # the gang + a holder
            # prefetch fan-out: by node list, by domain; clear errors
            r = await cl.c.post("/v1/prefetch", json={"manifest_id": mid, "origin": "file:///o",
                                                      "level": "rack", "domain": "r0"})
            assert r.status_code == 200 and set(r.json()["nodes"]) == {"n0", "n1"}
            assert all(x["ok"] for x in r.json()["nodes"].values())
            assert cl.agents["n0"].prefetches[0]["manifest_id"] == mid
            r = await cl.c.post("/v1/prefetch", json={"manifest_id": mid, "origin": "file:///missing",
                                                      "nodes": ["n2"]})
            assert r.status_code == 200 and r.json()["nodes"]["n2"]["status"] == 404
            r = await cl.c.post("/v1/prefetch", json={"manifest_id": mid, "origin": "x", "nodes": ["zz"]})
            assert r.status_code == 404 and "zz" in r.json()["detail"]
            r = await cl.c.post("/v1/prefetch", json={"manifest_id": mid, "origin": "x", "level": "rack"})
            assert r.status_code == 400
            async with httpx.AsyncClient() as anon:
                r = await anon.post(cl.url + "/v1/prefetch", json={"manifest_id": mid, "origin": "x"})
                assert r.status_code == 401
            # a GPU the agent reports fatal: nothing more is placed on it
            cl.agents["n0"].fatal.add("GPU-n0-3")
            await wait_for(lambda: _true(3 in svc.state.nodes["n0"].fatal))
            nodes = (await cl.c.get("/v1/nodes")).json()["nodes"]
            assert next(x for x in nodes if x["node_id"] == "n0")["unhealthy_gpus"] == [3]
            await cl.submit(job_id="many", pods=8, gpus_per_pod=2)
            v = await cl.job("many", wait="running")
            assert all("GPU-n0-3" not in p["gpus"] for p in v["pods"])
            c = (await cl.c.get("/v1/cluster")).json()
            assert c["model"]["unhealthy_gpus"] == 1 and "fragmentation" in c
            n.cancel_scope.cancel()



async def test_defrag_plan_and_apply(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            # (no node is lost for a loaded host's late beat: where each job lands is what is checked)
            svc, cl = await start_cluster(n, tmp_path, tokens, lost_after_missed=50)
            for j in ("j1", "j2", "j3", "j4", "j5"):
                await cl.submit(job_id=j, pods=1, gpus_per_pod=4, grace_s=0.5)
                await cl.job(j, wait="running")
            for j in ("j2", "j3"):
                await cl.c.delete(f"/v1/jobs/{j}")
            await wait_for(lambda: _free_is(cl, 20))
            where = {j: (await cl.job(j))["pods"][0]["node_id"] for j in ("j1", "j4", "j5")}
            rack = {a.node_id: a.topology.rack for a in cl.agents.values()}
            assert rack[where["j1"]] == rack[where["j4"]] != rack[where["j5"]]  # one half-used rack each
            r = await cl.c.post("/v1/defrag", json={"max_moves": 4})
            assert r.status_code == 200
            moves = r.json()["moves"]
            assert [m["job_id"] for m in moves] == ["j5"] and r.json()["applied"] == []
            assert (await cl.job("j5"))["attempt"] == 1  # a plan changes nothing
            r = await cl.c.post("/v1/defrag", json={"max_moves": 4, "apply": True})
            assert r.json()["applied"] == ["j5"]
            v = await wait_for(lambda: _attempt_running(cl, "j5", 2))
            assert rack[v["pods"][0]["node_id"]] == rack[where["j1"]]
            assert (await cl.c.post("/v1/defrag", json={"max_moves": -1})).status_code == 400
            async with httpx.AsyncClient() as anon:
                assert (await anon.post(cl.url + "/v1/defrag", json={})).status_code == 401
            n.cancel_scope.cancel()


async def _free_is(cl: Cluster, n: int) -> bool:
    nodes = (await cl.c.get("/v1/nodes")).json()["nodes"]
    return sum(x["free_gpus"] for x in nodes) == n


async def _attempt_running(cl: Cluster, job: str, attempt: int):
    v = await cl.job(job)
    return v if v["attempt"] == attempt and v["state"] == "running" else None


async def test_cancel_while_placing_stops_what_lands_late(tmp_path, token_dir, autojump_clock):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=1, clock=trio.current_time)
            agent = cl.agents["n0"]
            agent.ack_delay = 0.5
            agent.link.full_every = 0  # no periodic full report to heal it: the late stop must
            await cl.submit(job_id="late", pods=1, gpus_per_pod=2)
            await wait_for(lambda: _state_is(cl, "late", "placing"))
            r = await cl.c.delete("/v1/jobs/late")
            assert r.json()["state"] == "cancelled"
            # the start lands after the stop; the placer tells the agent again once it acks
            with trio.fail_after(3):
                await wait_for(lambda: _wl_is(agent, "late.1.0", "preempted"))
            await wait_for(lambda: _free_is(cl, 8))
            n.cancel_scope.cancel()


async def _state_is(cl: Cluster, job: str, state: str) -> bool:
    return (await cl.job(job))["state"] == state


async def _wl_is(agent: FakeAgent, wid: str, state: str) -> bool:
    w = agent.workloads.get(wid)
    return w is not None and w.state == state


async def test_a_job_is_decided_while_its_journal_syncs_but_pushed_only_once_durable(tmp_path, token_dir,
                                                                                     monkeypatch):
    """Deciding overlaps the journal's fsync; no placement leaves before the job is durable,
    and the submission's 201 comes after the fsync too."""
    import threading

    import placer.journal as journal_mod

    tokens = TokenSet.load(token_dir)
    gate = threading.Event()
    syncing = threading.Event()   # the journal's fsync has begun (and waits for the gate)
    real_fsync = journal_mod.os.fdatasync   # (the journal syncs its data: placer.journal)
    slow = {"on": False}

    def fsync(fd: int) -> None:
        if slow["on"]:
            syncing.set()
            gate.wait(10)
        real_fsync(fd)

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            monkeypatch.setattr(journal_mod.os, "fdatasync", fsync)
            slow["on"] = True
            answered = trio.Event()

            async def submit() -> None:
                r = await cl.c.post("/v1/jobs", content=msgspec.json.encode(
                    JobSpec(job_id="d", pods=1, gpus_per_pod=8, argv=["x"])))
                assert r.status_code == 201
                answered.set()

            n.start_soon(submit)
            await wait_for(lambda: _true("decided" in svc.state.jobs.get("d", _NoJob).timings))
            await trio.to_thread.run_sync(syncing.wait, 10)
            # decided, the fsync held: whatever this process would do before it lands, it has done
            await trio.testing.wait_all_tasks_blocked()
            assert not answered.is_set()                                   # not acknowledged yet
            assert not any(p.job_id == "d" for a in cl.agents.values() for p in a.placements)  # nor pushed
            gate.set()
            slow["on"] = False
            await answered.wait()
            v = await cl.job("d", wait="running")
            assert v["state"] == "running" and v["timings"]["decided"] <= v["timings"]["durable"]
            n.cancel_scope.cancel()


class _NoJob:
    timings: dict = {}


async def test_a_decision_is_delivered_with_the_collector_off_then_collected_and_frozen(tmp_path, token_dir):
    """No garbage collection between a decision and its acks (the first collection after a big
    pass walks every young record); once the round's acks are recorded the collector is on
    again and the survivors were frozen."""
    tokens = TokenSet.load(token_dir)
    assert gc.isenabled()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            freezes = svc.freezes
            await cl.submit(job_id="g", pods=2, gpus_per_pod=8)
            v = await cl.job("g", wait="running")
            assert v["state"] == "running"
            arrivals = [on for a in cl.agents.values() for on in a.gc_enabled_at_arrival]
            assert arrivals == [False, False]      # both placements pushed with the collector off
            await wait_for(lambda: _true(svc._gc_holds == 0))
            assert gc.isenabled() and svc.freezes == freezes + 1
            n.cancel_scope.cancel()
