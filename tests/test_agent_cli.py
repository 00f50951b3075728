"""`herd agent place|stop` and `herd status` as real subprocesses against an in-process
agent, and placements with an artifact (file:// origin): fetch, read-only tree, prefetch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import msgspec
import trio

from agent.config import AgentConfig, StoreConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra.auth import TokenSet, auth_header
from scheduler_link.messages import Placement, PodAssignment
from testing.waiting import Changes, until

ROOT = Path(__file__).resolve().parent.parent


def make_agent(tmp_path: Path, token_dir: Path, store: StoreConfig = StoreConfig()) -> Agent:
    cfg = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                      listen="127.0.0.1:0", data_listen="127.0.0.1:0", token_dir=str(token_dir),
                      store=store, workloads=SupervisorConfig(shim_pool=1),
                      allowed_origins=(f"file://{tmp_path / 'origin'}",))
    return Agent(cfg, env={"PATH": os.environ["PATH"]}, handle_signals=False)


async def herd(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    r = await trio.run_process([sys.executable, "-m", "cli.main", *args], cwd=str(ROOT), env=env,
                               capture_stdout=True, capture_stderr=True, check=False)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


async def test_cli_place_status_stop(tmp_path, token_dir):
    agent = make_agent(tmp_path, token_dir)
    # the workload outlives every CLI call below (a dozen interpreter starts: ~40 s on a loaded 2-core host)
    with trio.fail_after(240):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            env = {**os.environ, "HERD_AGENT": url, "HERD_TOKEN_DIR": str(token_dir)}
            rc, out, err = await herd("agent", "place", "--gpus", "2", "--json", "--grace", "5", "--",
                                      "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; sleep 600", env=env)
            assert rc == 0, err
            placed = json.loads(out)
            assert set(placed) >= {"workload", "gpus", "state"} and len(placed["gpus"]) == 2
            wid = placed["workload"]
            rc, out, err = await herd("agent", "place", "--gpu-ids", "2", "--", "true", env=env)
            assert rc == 0 and out.strip().startswith("w-"), err
            rc, out, err = await herd("status", env=env)
            assert rc == 0, err
            assert "SIMULATED" in out and wid in out and "healthy" in out
            rc, out, err = await herd("status", "--json", env=env)
            assert rc == 0 and json.loads(out)["node_id"] == "n1"
            # bad input: one clear line, exit 1, nothing placed
            before = len(agent.supervisor.workloads())
            for bad, msg in ((["--gpus", "9", "--", "true"], "free usable GPUs"),
                             (["--gpu-ids", "0", "--", "true"], "in use by workload"),
                             (["--gpus", "1", "--restart", "sometimes", "--", "true"], "--restart must be"),
                             (["--gpus", "1"], "nothing to run"),
                             (["--gpus", "1", "--env", "NOEQUALS", "--", "true"], "KEY=VALUE"),
                             (["--gpus", "1", "--artifact", "x:1", "--", "true"], "go together")):
                rc, out, err = await herd("agent", "place", *bad, env=env)
                assert rc == 1 and msg in err and len(err.strip().splitlines()) == 1, (bad, err)
            assert len(agent.supervisor.workloads()) == before
            rc, out, err = await herd("agent", "place", "--gpus", "1", "--", "true",
                                      env={**env, "HERD_TOKEN_DIR": str(tmp_path / "none")})
            assert rc == 1 and "operator token" in err
            rc, out, err = await herd("agent", "place", "--gpus", "1", "--agent", "http://127.0.0.1:1", "--",
                                      "true", env=env)
            assert rc == 1 and "cannot reach the agent at http://127.0.0.1:1" in err
            rc, out, err = await herd("agent", "stop", wid, "--json", env=env)
            assert rc == 0 and json.loads(out)["state"] == "terminating", err
            st = await agent.supervisor.wait_terminal(wid)
            assert (st.state, st.exit_code) == ("exited", 128 + 15)  # sh died of SIGTERM
            assert agent.supervisor.read_log(wid) == ",".join(placed["gpus"]) + "\n"
            rc, out, err = await herd("agent", "stop", "no-such", env=env)
            assert rc == 1 and "404" in err
            n.cancel_scope.cancel()


async def test_artifact_placement_runs_in_read_only_tree(tmp_path, token_dir):
    from p2p.origins import open_origin
    from p2p.publish import publish

    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "run.sh").write_text("#!/bin/sh\ncat data.txt\npwd\necho scratch > \"$HERD_SCRATCH/out\"\n")
    os.chmod(src / "bin" / "run.sh", 0o755)
    (src / "data.txt").write_text("payload\n")
    origin_url = f"file://{tmp_path / 'origin'}"
    async with open_origin(origin_url) as o:
        pub = await publish(src, o, "demo:v1")
    tokens = TokenSet.load(token_dir)
    agent = make_agent(tmp_path, token_dir)
    events = []
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            agent.supervisor.add_listener(events.append)
            gpu = agent.gpu_snapshot().gpus[0].uuid
            p = Placement(placement_id="p1", job_id="j", argv=["./bin/run.sh"], manifest_id=pub.manifest,
                          origin=origin_url, pods=[PodAssignment(workload_id="w", rank=0, gpus=[gpu])])
            assert (await agent.supervisor.place(p)).accepted
            st = await agent.supervisor.wait_terminal("w")
            assert (st.state, st.exit_code) == ("exited", 0), st
            data, cwd = agent.supervisor.read_log("w").splitlines()
            assert data == "payload" and Path(cwd).name == pub.manifest
            assert os.stat(cwd).st_mode & 0o222 == 0  # the tree is read-only (bits; root ignores them)
            assert (agent.supervisor.wl_dir / "w" / "scratch" / "out").read_text() == "scratch\n"
            assert [e.state for e in events] == ["accepted", "fetching", "starting", "running", "exited"]
            assert events[2].bytes_from_origin == pub.bytes
            # a placement naming a manifest the origin does not have fails cleanly
            p2 = Placement(placement_id="p2", job_id="j", argv=["true"], manifest_id="ab" * 32,
                           origin=origin_url, pods=[PodAssignment(workload_id="w2", rank=0, gpus=[gpu])])
            assert (await agent.supervisor.place(p2)).accepted
            st2 = await agent.supervisor.wait_terminal("w2")
            assert st2.state == "failed" and st2.reason
            # prefetch: into the store, nothing started; bad bodies are 400
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.viewer)) as c:
                h = auth_header(tokens.placer)
                assert (await c.post("/v1/prefetch", content=b'{"manifest_id": 1}', headers=h)).status_code == 400
                body = msgspec.json.encode({"manifest_id": pub.manifest, "origin": origin_url})
                assert (await c.post("/v1/prefetch", content=body, headers=h)).status_code == 202
                st = (await c.get("/v1/status")).json()
                assert st["store"]["complete_manifests"] == 1 and st["data_url"].startswith("http://127.0.0.1:")
                assert 'herd_fetch_bytes_total{node="n1",source="origin"}' in (await c.get("/metrics")).text
            # the CLI resolves a ref against the origin before it places
            env = {**os.environ, "HERD_AGENT": url, "HERD_TOKEN_DIR": str(token_dir)}
            rc, out, err = await herd("agent", "place", "--gpus", "1", "--artifact", "demo:v1", "--origin", origin_url,
                                      "--json", "--", "./bin/run.sh", env=env)
            assert rc == 0, err
            placed = json.loads(out)
            assert placed["manifest_id"] == pub.manifest
            st = await agent.supervisor.wait_terminal(placed["workload"])
            assert (st.state, st.exit_code) == ("exited", 0)
            rc, out, err = await herd("agent", "place", "--gpus", "1", "--artifact", "nope:v9", "--origin", origin_url,
                                      "--", "true", env=env)
            assert rc == 1 and len(err.strip().splitlines()) == 1, err
            n.cancel_scope.cancel()


async def test_scheduler_link_reports_and_fencing_stops(tmp_path, token_dir):
    """With --placer the agent registers (full report), reports events at once, and
    stops the workloads a placer reply names (fencing)."""
    from infra.http import App, json_response, serve
    from scheduler_link.messages import NodeReport, ReportReply, TopologyPath, Victim

    reports: list[NodeReport] = []
    reported = Changes()   # poked by every report the agent sends
    stop_next: list[Victim] = []
    placer = App()

    @placer.route("POST", "/v1/nodes/{node}/report")
    async def report(req):
        reports.append(req.decode(NodeReport))
        reported.poke()
        stops, stop_next[:] = list(stop_next), []
        return json_response(ReportReply(stop=stops))

    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            placer_url = await n.start(serve, placer, "127.0.0.1:0")
            cfg = AgentConfig(node_id="n9", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                              listen="127.0.0.1:0", data_listen="127.0.0.1:0", token_dir=str(token_dir),
                              placer=placer_url, heartbeat_s=0.2,
                              topology=TopologyPath(zone="z1", block="b1", rack="r1"),
                              workloads=SupervisorConfig(shim_pool=1))
            agent = Agent(cfg, env={"PATH": os.environ["PATH"]}, handle_signals=False)
            url = await n.start(agent.run)
            await reported.until(lambda: reports)
            first = reports[0]
            assert first.full and first.node_id == "n9" and first.control_url == url
            assert first.data_url == agent.data_url and first.data_url.startswith("http://")
            assert (first.topology.zone, first.topology.rack) == ("z1", "r1")
            assert first.snapshot is not None and len(first.snapshot.gpus) == 8 and first.snapshot.simulated
            gpu = first.snapshot.gpus[0].uuid
            p = Placement(placement_id="p1", job_id="j", argv=["sleep", "30"], grace_s=5,
                          pods=[PodAssignment(workload_id="w", rank=0, gpus=[gpu])])
            assert (await agent.supervisor.place(p)).accepted
            await reported.until(lambda: any(e.workload_id == "w" and e.state == "running"
                                             for r in reports for e in r.events))
            stop_next.append(Victim(workload_id="w", grace_s=1, reason="fenced"))
            st = await agent.supervisor.wait_terminal("w")
            assert (st.state, st.reason) == ("exited", "fenced")
            n.cancel_scope.cancel()


async def test_unused_trees_are_collected_but_never_a_live_workloads(tmp_path, token_dir):
    from p2p.origins import open_origin
    from p2p.publish import publish

    origin_url = f"file://{tmp_path / 'origin'}"
    pubs = []
    for v in ("v1", "v2"):
        src = tmp_path / f"src-{v}"
        src.mkdir()
        (src / "data.txt").write_text(f"payload {v}\n")
        async with open_origin(origin_url) as o:
            pubs.append(await publish(src, o, f"t:{v}"))
    agent = make_agent(tmp_path, token_dir, store=StoreConfig(keep_trees=0))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(agent.run)
            gpus = [g.uuid for g in agent.gpu_snapshot().gpus]
            done = Placement(placement_id="p1", job_id="j1", argv=["true"], manifest_id=pubs[0].manifest,
                             origin=origin_url, pods=[PodAssignment(workload_id="w1", rank=0, gpus=[gpus[0]])])
            live = Placement(placement_id="p2", job_id="j2", argv=["sleep", "30"], manifest_id=pubs[1].manifest,
                             origin=origin_url, pods=[PodAssignment(workload_id="w2", rank=0, gpus=[gpus[1]])])
            assert (await agent.supervisor.place(done)).accepted and (await agent.supervisor.place(live)).accepted
            assert (await agent.supervisor.wait_terminal("w1")).state == "exited"
            await until(agent.supervisor.next_change, lambda: agent.supervisor.record("w2").state == "running")
            assert sorted(agent.store.materialised()) == sorted(p.manifest for p in pubs)
            await agent._collect_trees()
            assert agent.store.materialised() == [pubs[1].manifest]  # the live one stays
            assert not agent.store.artifact_path(pubs[0].manifest).exists()
            await agent.supervisor.stop("w2", grace_s=1)
            await agent.supervisor.wait_terminal("w2")
            n.cancel_scope.cancel()
