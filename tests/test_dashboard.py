"""The dashboard's routes on a real placer service with in-process fake agents (real
loopback sockets): the map against the fleet's states, the roles, "why pending?", the
node and job answers, the cache, and no env value anywhere the page reads."""

from __future__ import annotations

import time

import httpx
import trio

from infra.auth import TokenSet, auth_header
from placer import clustermap as cm
from scheduler_link.messages import GpuInfo, GpuSnapshot, HealthReason, WorkloadEvent
from testing.fake_agent import FakeAgent

from .test_placer_service import Cluster, cfg, wait_for

SECRET = "hunter2-do-not-show"


class DegradedAgent(FakeAgent):
    """A fake agent whose GPU 5 the backend reports degraded (with a reason code)."""

    def gpu_snapshot(self) -> GpuSnapshot:
        snap = super().gpu_snapshot()
        gpus = [GpuInfo(index=g.index, uuid=g.uuid, name=g.name, memory_total_mib=1, pci_bus_id=g.pci_bus_id,
                        simulated=True, health="degraded",
                        reasons=[HealthReason(code="ecc_sbe_rate", severity="degraded", gpu=g.uuid)])
                if g.index == 5 else g for g in snap.gpus]
        return GpuSnapshot(backend=snap.backend, simulated=True, gpus=gpus)


async def _true(v):
    return v


async def test_map_node_job_and_roles(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            from placer.service import PlacerService
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            agents = [(DegradedAgent if i == 1 else FakeAgent)(f"n{i}", tokens, rack=f"r{i // 2}") for i in range(8)]
            for a in agents:
                await n.start(a.run, url)
            cl = Cluster(tokens, url, agents)
            await wait_for(lambda: cl.nodes_up(8))
            view = httpx.AsyncClient(base_url=url, headers=auth_header(tokens.viewer), timeout=10)
            await cl.submit(job_id="train", pods=2, gpus_per_pod=8, within="rack", env={"TOKEN": SECRET},
                            argv=["python", SECRET])
            await cl.job("train", wait="running")
            await cl.submit(job_id="small", pods=1, gpus_per_pod=3, priority=1)
            await cl.job("small", wait="running")
            await cl.submit(job_id="huge", pods=64, gpus_per_pod=8, env={"K": SECRET})   # more than the fleet
            await cl.submit(job_id="racky", pods=3, gpus_per_pod=8, within="rack")      # no rack holds 3 nodes
            # a fatal GPU, a cordon, a lost node
            cl.agents["n6"].fatal.add("GPU-n6-2")
            await wait_for(lambda: _true(2 in svc.state.nodes["n6"].fatal))
            assert (await cl.c.post("/v1/nodes/n7/cordon", json={"reason": "bad fan"})).status_code == 200
            cl.agents["n5"].cancel.cancel()
            await wait_for(lambda: _true(svc.state.nodes["n5"].state == "lost"))
            await wait_for(lambda: _true(svc.state.queue.get("racky") is not None
                                         and svc.state.queue.get("racky").waiting.code != "not_tried"))

            r = await view.get("/v1/cluster/map")
            assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.herd.cluster-map"
            assert float(r.headers["x-herd-now"]) > 0
            mp = cm.decode(r.content)
            ids = svc.state.model.node_ids
            states = {ids[i]: cm.STATES[s] for i, s in enumerate(mp.state.tolist())}
            train_nodes = {p["node_id"] for p in (await cl.job("train"))["pods"]}
            small_node = (await cl.job("small"))["pods"][0]["node_id"]
            assert states["n5"] == "lost" and states["n7"] == "cordoned" and states["n6"] == "fatal"
            assert states["n1"] == "degraded"                # (over full or partial: a GPU needs a look)
            for nid in train_nodes - {"n1", "n5", "n6", "n7"}:
                assert states[nid] == "full"
            if small_node not in {"n1", "n5", "n6", "n7"}:
                assert states[small_node] == "partial"
            table = mp.job_ids
            for i, nid in enumerate(ids):
                j = int(mp.job[i])
                want = "train" if nid in train_nodes else "small" if nid == small_node else None
                assert (table[j] if j != mp.none_job else None) == want, nid
            # the counts GET /v1/cluster reports are the map's
            c = (await view.get("/v1/cluster")).json()
            assert c["nodes"]["by_state"] == mp.counts()
            assert mp.counts()["lost"] == c["nodes"]["lost"] == 1
            assert mp.header["ha"] is None                  # one placer: no leader to name
            assert sum(mp.counts().values()) == c["nodes"]["total"] == 8
            # why pending: structured, from where the queue decided
            cols = mp.header["jobs"]
            why = {jid: w for jid, w in zip(cols["id"], cols["waiting"], strict=True)}
            assert why["huge"]["code"] == "too_few_free" and why["huge"]["free_gpus"] < 64 * 8
            assert why["racky"]["code"] == "no_domain"
            assert why["train"] is None
            row = table.index("train")
            assert cols["state"][row] == "running" and cols["gpus"][row] == 16 and cols["nodes"][row] == 2
            t = cols["timings"][row]
            assert 0 <= t["decided"] <= t["pushed"] <= t["acked"] and "running" in t
            # one job, one node; fetch bytes by source ride on the agents' events (summed over its pods)
            sent = 0
            for k, nid in enumerate(sorted(train_nodes)):
                a = cl.agents[nid]
                wid = next(w for w, st in a.workloads.items() if st.job_id == "train")
                assert a.link is not None
                a.link.notify(WorkloadEvent(workload_id=wid, job_id="train", state="running", at=time.time(),
                                            bytes_from_origin=100 if k == 0 else 0, bytes_from_peers=900 + 100 * k,
                                            bytes_local=5 * (1 - k)))
                sent += 1
            await wait_for(lambda: _true(sum(bool(p.fetch) for p in svc.state.jobs["train"].pods) == sent))
            j = (await view.get("/v1/cluster/map/job/train")).json()
            assert j["state"] == "running" and j["pod_counts"] == {"running": 2}
            assert j["fetch"] == {"origin": 100, "peers": 1900, "local": 5} and j["fetch_pods"] == 2
            assert (await view.get("/v1/cluster/map/job/nope")).status_code == 404
            row1 = ids.index("n1")
            d = (await view.get(f"/v1/cluster/map/node/{row1}?epoch={mp.header['model_epoch']}")).json()
            assert d["node_id"] == "n1" and d["rack"] == "z1/b1/r0" and len(d["gpus"]) == 8
            assert d["degraded_gpus"] == [5] and "gpu5:ecc_sbe_rate" in d["health_reasons"]
            d7 = (await view.get(f"/v1/cluster/map/node/{ids.index('n7')}")).json()
            assert d7["cordon_reason"] == "bad fan"
            assert (await view.get(f"/v1/cluster/map/node/{row1}?epoch=99999")).status_code == 409
            assert (await view.get("/v1/cluster/map/node/8")).status_code == 404
            # no env value (nor argv) in anything the page reads
            for path in ("/v1/cluster/map", "/v1/cluster/map/job/train", "/v1/cluster/map/job/huge",
                         *(f"/v1/cluster/map/node/{i}" for i in range(8))):
                body = (await view.get(path)).content
                assert SECRET.encode() not in body, path
            # the page and its assets are public; the data needs the viewer role
            async with httpx.AsyncClient(base_url=url, timeout=10) as anon:
                page = await anon.get("/")
                assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
                assert "default-src 'self'" in page.headers["content-security-policy"]
                assert b"/dashboard/app.js" in page.content
                for asset, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
                    a = await anon.get(f"/dashboard/{asset}")
                    assert a.status_code == 200 and a.headers["content-type"].startswith(kind) and a.content
                assert (await anon.get("/dashboard/..%2Fservice.py")).status_code == 404
                assert (await anon.get("/v1/cluster/map")).status_code == 401
                r = await anon.get("/v1/cluster/map", headers=auth_header(tokens.metrics))
                assert r.status_code == 403
                assert (await anon.get("/v1/cluster/map/job/train")).status_code == 401
            # cached: nothing changed, nothing rebuilt (and the page's If-None-Match: 304); a change, one build
            b0 = svc.dashboard.builds
            r1 = await view.get("/v1/cluster/map")
            r2 = await view.get("/v1/cluster/map", headers={"if-none-match": r1.headers["etag"]})
            assert r2.status_code == 304 and r2.content == b"" and r2.headers["etag"] == r1.headers["etag"]
            assert svc.dashboard.builds == b0 and svc.dashboard.hits >= 2
            await cl.c.delete("/v1/jobs/small")
            await wait_for(lambda: _true(svc.state.model.jobs.get("small") is None))
            mp2 = cm.decode((await view.get("/v1/cluster/map")).content)
            assert svc.dashboard.builds > b0 and mp2.header["generation"] != mp.header["generation"]
            assert mp2.job_ids.count("small") == 0 or mp2.header["jobs"]["state"][mp2.job_ids.index("small")] \
                == "cancelled"
            # watched: after a change the next map is built ahead, before anyone asks
            b1 = svc.dashboard.builds
            await cl.submit(job_id="tiny", pods=1, gpus_per_pod=1)
            await wait_for(lambda: _true(svc.dashboard.builds > b1))
            r = await view.get("/v1/cluster/map")
            assert "tiny" in cm.decode(r.content).job_ids
            await view.aclose()
            n.cancel_scope.cancel()


def test_the_static_files_are_package_data():
    """Every file the page needs ships in the wheel (pyproject's package-data), and the
    dashboard serves exactly those."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from placer.dashboard import ASSETS

    root = Path(__file__).resolve().parent.parent
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "placer.dashboard"]
    static = sorted(p.name for p in (root / "placer" / "dashboard" / "static").iterdir())
    assert static == sorted(["index.html", *ASSETS])
    for name in static:
        assert any(fnmatch.fnmatch(f"static/{name}", g) for g in globs), name



async def test_the_map_names_the_leader_and_its_epoch(tmp_path, token_dir, etcd_cluster):
    """With several placers on etcd (skipped where etcd is absent): the leader's map carries
    its role, its URL and its epoch (the page's status line shows them)."""
    from placer.service import PlacerService

    from .test_etcd_placer import Placer, health, until
    from .test_etcd_placer import cfg as ha_cfg

    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n, httpx.AsyncClient(headers=auth_header(tokens.viewer), timeout=10) as c:
            p = Placer(PlacerService(ha_cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url = await n.start(p.run)
            await until(lambda: _lead(c, url))
            mp = cm.decode((await c.get(url + "/v1/cluster/map")).content)
            ha = mp.header["ha"]
            assert ha["role"] == "leader" and ha["leader"] == url and ha["epoch"] >= 1
            assert ha["epoch"] == (await health(c, url))["epoch"]
            n.cancel_scope.cancel()


async def _lead(c: httpx.AsyncClient, url: str) -> bool:
    from .test_etcd_placer import health
    return (await health(c, url))["role"] == "leader"


def test_why_pending_is_decided_by_the_queue():
    """The queue records, per pending job, why the last round left it (placer.queue.Waiting):
    what the page's "why pending?" says, as codes, never parsed from text."""
    from placer.model import ClusterModel, NodeSpec
    from placer.place import JobRequest
    from placer.queue import WAIT_NO_DOMAIN, WAIT_NOT_TRIED, WAIT_TOO_FEW_FREE, JobQueue

    m = ClusterModel.build([NodeSpec(f"n{i}", "z", "b", f"r{i // 2}", 8) for i in range(8)])   # racks of 2
    q = JobQueue(reserve_after_rounds=1)
    q.submit(JobRequest(job_id="low", pods=4, gpus_per_pod=8, priority=0, preemptible=True), 0.0)
    assert q.get("low").waiting.code == WAIT_NOT_TRIED
    assert [d.job_id for d in q.schedule(m, 0.0)] == ["low"]
    q.submit(JobRequest(job_id="wide", pods=3, gpus_per_pod=8, within="rack", priority=5), 1.0)
    q.submit(JobRequest(job_id="huge", pods=9, gpus_per_pod=8, priority=0), 1.0)
    q.submit(JobRequest(job_id="after", pods=1, gpus_per_pod=8, within="rack", priority=-1), 1.0)
    q.schedule(m, 1.0)
    wide, huge = q.get("wide").waiting, q.get("huge").waiting
    # no rack holds 3 nodes, even preempting "low" (which "wide" may: lower priority, preemptible)
    assert wide.code == WAIT_NO_DOMAIN and wide.may_preempt and wide.free_gpus == 32
    assert not wide.behind_reservation and q.get("wide").reserved
    # more GPUs than free, and nothing of lower priority to preempt
    assert huge.code == WAIT_TOO_FEW_FREE and not huge.may_preempt
    # "after" fits a free rack, but the reservations taken above hold every node with room
    assert q.get("after").waiting.behind_reservation and q.get("after").waiting.code == WAIT_NO_DOMAIN
    off = JobQueue(allow_preemption=False)
    off.submit(JobRequest(job_id="wide", pods=3, gpus_per_pod=8, within="rack", priority=5), 0.0)
    off.schedule(m, 0.0)
    assert off.get("wide").waiting.code == WAIT_NO_DOMAIN and not off.get("wide").waiting.may_preempt
