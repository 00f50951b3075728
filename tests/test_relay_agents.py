"""Rack relays with real processes: a placer and three agents in one rack, one of them with
``[relay] enabled``. Gangs are delivered as RackBundles through the relay agent, which
hands its members their NodeParts over their frames connections to it; a relay killed
mid-delivery costs a direct push, never a placement lost or doubled; one node refusing
rolls the gang back everywhere."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from cli.localcluster import LocalCluster, Proc, _wait_file
from infra.auth import TokenSet, auth_header
from testing.waiting import poll

pytestmark = pytest.mark.slow


class RelayCluster(LocalCluster):
    """LocalCluster whose agents are all in one rack; ``relays`` get ``[relay] enabled``;
    ``profiles`` picks a GPU profile per agent index. Agents are started by the test (the
    relay first: members learn their relay when they register)."""

    def __init__(self, root: Path, token_dir: Path, *, relays: set[int], profiles: dict[int, str] | None = None,
                 **kw: Any) -> None:
        super().__init__(root, token_dir, n_agents=0, racks=1, **kw)
        self.relay_nodes = relays
        self.profiles = profiles or {}

    def start_agent(self, i: int, timeout: float = 30.0) -> Proc:
        assert self.placer is not None
        node = f"node{i}"
        sd = self.root / node
        sd.mkdir(parents=True, exist_ok=True)
        (sd / "endpoints.json").unlink(missing_ok=True)
        conf = self.root / f"{node}.toml"
        conf.write_text("[relay]\nenabled = true\n" if i in self.relay_nodes else "")
        p = self._spawn(node, ["agent", "run", "--config", str(conf), "--node-id", node,
                               "--gpus", self.profiles.get(i, self.profile), "--state-dir", str(sd),
                               "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                               "--placer", self.placer.url, "--token-dir", str(self.token_dir),
                               "--zone", "z1", "--block", "b1", "--rack", "rack0",
                               "--heartbeat-s", str(self.heartbeat_s)], sd,
                        tls_dir=self.pki.node_dir(node) if self.tls else None)
        p.info = _wait_file(sd / "endpoints.json", p.proc, timeout, p.log)
        p.url = p.info["control_url"]
        self.agents[node] = p
        return p


class Api:
    def __init__(self, c: RelayCluster, tokens: TokenSet) -> None:
        assert c.placer is not None
        self.c = c
        self.url = c.placer.url
        self.h = auth_header(tokens.operator)

    async def get(self, path: str, **kw: Any) -> Any:
        async with httpx.AsyncClient(timeout=15, headers=self.h, verify=self.c.verify) as cl:
            r = await cl.get(self.url + path, **kw)
            r.raise_for_status()
            return r.json()

    async def submit(self, **spec: Any) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=15, verify=self.c.verify) as cl:
            r = await cl.post(self.url + "/v1/jobs", json=spec, headers=self.h)
            assert r.status_code == 201, r.text
            return r.json()

    async def job(self, job_id: str, wait: str | None = None) -> dict[str, Any]:
        params = {"wait": wait, "timeout_ms": "8000"} if wait else None
        return await self.get(f"/v1/jobs/{job_id}", params=params)

    async def relays(self) -> dict[str, Any]:
        return (await self.get("/v1/cluster"))["placer"]["relays"]

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in (await self.get("/v1/nodes"))["nodes"]}

    async def agent(self, node: str, path: str) -> Any:
        async with httpx.AsyncClient(timeout=10, headers=self.c.read_headers(), verify=self.c.verify) as cl:
            r = await cl.get(self.c.agents[node].url + path)
            r.raise_for_status()
            return r.json()

    async def workloads(self, node: str) -> list[dict[str, Any]]:
        data = await self.agent(node, "/v1/workloads")
        return data.get("workloads", data) if isinstance(data, dict) else data

    async def until(self, pred: Any) -> Any:
        """``pred`` polled (the cluster's state is other processes'); the caller bounds it."""
        return await poll(pred, 0.05)


async def _start(c: RelayCluster, api: Api, relay: int, members: list[int]) -> None:
    """The relay agent first (registered and connected as a candidate), then its members,
    each until it reports through the relay."""
    await trio.to_thread.run_sync(c.start_agent, relay)

    async def relay_ready() -> bool:
        nodes = await api.nodes()
        return (await api.relays())["candidates"] == 1 and nodes.get(f"node{relay}", {}).get("state") == "up"
    await api.until(relay_ready)
    relay_url = (await api.agent(f"node{relay}", "/v1/status"))["relay"]["listen_url"]
    for i in members:
        await trio.to_thread.run_sync(c.start_agent, i)

    async def through_relay() -> bool:
        for i in members:
            link = (await api.agent(f"node{i}", "/v1/status"))["link"]
            if link["relay_url"] != relay_url or not link["registered"]:
                return False
        return True
    await api.until(through_relay)

    async def all_up() -> bool:
        nodes = await api.nodes()
        return len(nodes) == len(members) + 1 and all(n["state"] == "up" for n in nodes.values())
    await api.until(all_up)


async def _jobs_workloads(api: Api, job_id: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for node, p in api.c.agents.items():
        if p.alive():
            out[node] = [w for w in await api.workloads(node) if w["job_id"] == job_id]
    return out


@pytest.mark.parametrize("tls", [False, True], ids=["insecure", "mutual-tls"])
async def test_a_gang_is_delivered_through_the_relay_and_runs(tmp_path, token_dir, tls):
    """(With TLS, the product's default: the relay's upstream connection, its members'
    connections to it and the relays' blob fetches are all mutual TLS.)"""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=0.5,
                                            recover_s=0.5, tls=tls) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])
        await api.submit(job_id="g", pods=3, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)
        job = await api.job("g", wait="running")
        assert job["state"] == "running", job
        assert sorted(p["node_id"] for p in job["pods"]) == ["node0", "node1", "node2"]
        rs = await api.relays()
        assert rs["bundles"] >= 1 and rs["fallback_nodes"] == 0 and rs["relayed_nodes"] >= 3, rs
        # the relay had the blob's bytes in its bundle; its members got it from the relay
        assert rs["blob_serves"] == 0, rs
        ws = await _jobs_workloads(api, "g")
        for node in ("node0", "node1", "node2"):
            assert [w["state"] for w in ws[node]] == ["running"], (node, ws[node])
            st = await api.agent(node, "/v1/status")
            assert st["parts"]["accepted"] == 1 and st["parts"]["placed"] == 1, (node, st["parts"])
        # every pod's peers file was written from the blob (had from the relay), the whole gang
        for pod in job["pods"]:
            lines = (c.agents[pod["node_id"]].state_dir / "workloads" / pod["workload_id"] / "peers").read_text()
            assert not lines.startswith("#") and sorted(ln.split()[0] for ln in lines.splitlines()) == \
                ["node0", "node1", "node2"], lines
        relay = (await api.agent("node0", "/v1/status"))["relay"]
        assert relay["members"] == 2 and relay["parts_delivered"] >= 3 and relay["blob_serves"] >= 2, relay
        # the members' heartbeats go up as rack beats
        with trio.fail_after(10):
            await api.until(lambda: _beats(api))


async def _beats(api: Api) -> bool:
    return (await api.relays())["beat_entries"] >= 2


async def test_the_relay_killed_mid_delivery_every_node_placed_once(tmp_path, token_dir):
    """The relay agent (4 GPUs: the 8-GPU pods cannot go there) is frozen, the gang is
    submitted, and once its bundle is on the relay's socket the relay is SIGKILLed: the
    placer pushes the rack's parts directly; each member runs its pod once; the members
    report to the placer directly again."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, profiles={0: "simulated:l40s-pcie"},
                                            heartbeat_s=1.0, recover_s=0.5) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])
        bundles0 = (await api.relays())["bundles"]
        relay = c.agents["node0"]
        relay.proc.send_signal(signal.SIGSTOP)
        await api.submit(job_id="k", pods=2, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)

        async def bundle_sent() -> bool:
            return (await api.relays())["bundles"] > bundles0
        await api.until(bundle_sent)
        relay.signal_group(signal.SIGKILL)
        relay.signal_group(signal.SIGCONT)
        await trio.to_thread.run_sync(relay.proc.wait, 10)
        job = await api.job("k", wait="running")
        assert job["state"] == "running", job
        assert sorted(p["node_id"] for p in job["pods"]) == ["node1", "node2"]
        rs = await api.relays()
        assert rs["fallback_nodes"] >= 2, rs
        ws = await _jobs_workloads(api, "k")
        for node in ("node1", "node2"):
            assert len(ws[node]) == 1 and ws[node][0]["state"] == "running", (node, ws[node])

        # the members notice their relay is gone and report to the placer directly, staying up
        async def direct_again() -> bool:
            for node in ("node1", "node2"):
                link = (await api.agent(node, "/v1/status"))["link"]
                if link["relay_url"] is not None or not link["registered"]:
                    return False
            nodes = await api.nodes()
            return all(nodes[n]["state"] == "up" for n in ("node1", "node2"))
        with trio.fail_after(30):
            await api.until(direct_again)
        ws = await _jobs_workloads(api, "k")
        assert all(len(ws[n]) == 1 and ws[n][0]["state"] == "running" for n in ("node1", "node2")), ws
        job = await api.job("k")
        assert job["state"] == "running" and job["attempt"] == 1, job


async def test_one_node_refusing_rolls_the_gang_back_everywhere(tmp_path, token_dir):
    """node2's GPU 0 turned fatal just before the gang's part came (the placer has not
    heard: long heartbeats): node2 refuses, the nodes that accepted stop their pods."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=5.0,
                                            recover_s=0.5) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])
        snap = await api.agent("node2", "/v1/gpus")
        bad = next(g["uuid"] for g in snap["gpus"] if g["index"] == 0)
        async with httpx.AsyncClient(timeout=10) as cl:
            r = await cl.post(f"{c.agents['node2'].url}/v1/gpus/{bad}/inject", json={"xid": 79},
                              headers=auth_header(tokens.operator))
            assert r.status_code == 200, r.text

        async def fatal() -> bool:
            s = await api.agent("node2", "/v1/gpus")
            return any(g["uuid"] == bad and g["health"] == "fatal" for g in s["gpus"])
        await api.until(fatal)
        await api.submit(job_id="r", pods=3, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)

        async def refused() -> bool:
            st = await api.agent("node2", "/v1/status")
            return st["parts"]["refused"] >= 1
        await api.until(refused)

        async def rolled_back() -> bool:
            ws = await _jobs_workloads(api, "r")
            return all(w["state"] not in ("accepted", "fetching", "starting", "running", "terminating")
                       for lst in ws.values() for w in lst)
        with trio.fail_after(30):
            await api.until(rolled_back)
        ws = await _jobs_workloads(api, "r")
        assert ws["node2"] == []  # refused: nothing was ever created there
        job = await api.job("r")
        assert job["state"] != "running", job
        nodes = await api.nodes()
        assert 0 in nodes["node2"]["unhealthy_gpus"], nodes["node2"]
        rs = await api.relays()
        assert rs["fallback_nodes"] == 0, rs


async def test_parts_reached_acks_lost_nothing_placed_twice(tmp_path, token_dir):
    """node1 is frozen so the relay waits for its ack; node2 has accepted its part through
    the relay when the relay is SIGKILLed, so the placer never hears that ack and pushes
    node2's placement directly as well: node2 answers it as the same placement (one pod),
    and node1, once thawed, gets its pod once though its part may come both ways."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, profiles={0: "simulated:l40s-pcie"},
                                            heartbeat_s=1.0, recover_s=0.5) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])

        async def node2_accepted() -> bool:
            return (await api.agent("node2", "/v1/status"))["parts"]["accepted"] >= 1
        c.agents["node1"].proc.send_signal(signal.SIGSTOP)
        await api.submit(job_id="a", pods=2, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)
        with trio.fail_after(10):
            await api.until(node2_accepted)
        relay = c.agents["node0"]
        relay.signal_group(signal.SIGKILL)
        await trio.to_thread.run_sync(relay.proc.wait, 10)
        await trio.sleep(0.5)
        c.agents["node1"].proc.send_signal(signal.SIGCONT)
        job = await api.job("a", wait="running")
        assert job["state"] == "running" and job["attempt"] == 1, job
        assert sorted(p["node_id"] for p in job["pods"]) == ["node1", "node2"]
        rs = await api.relays()
        assert rs["fallback_nodes"] >= 1, rs
        ws = await _jobs_workloads(api, "a")
        for node in ("node1", "node2"):
            assert len(ws[node]) == 1 and ws[node][0]["state"] == "running", (node, ws[node])
        await trio.sleep(2.0)  # nothing more arrives later either
        ws = await _jobs_workloads(api, "a")
        assert all(len(ws[n]) == 1 and ws[n][0]["state"] == "running" for n in ("node1", "node2")), ws
        assert (await api.job("a"))["attempt"] == 1


async def test_a_node_that_registered_before_its_rack_had_a_relay_moves_to_it(tmp_path, token_dir):
    """A member up before any relay of its rack reports directly; once the relay connects, the
    answer to its next direct heartbeat names the relay and it moves over (not only at its
    next periodic full report, 60 beats later): the placer ends holding the relay's
    connection, not one per node."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=0.5,
                                            recover_s=0.5) as c:
        api = Api(c, tokens)
        await trio.to_thread.run_sync(c.start_agent, 1)

        async def up(node: str) -> bool:
            return (await api.nodes()).get(node, {}).get("state") == "up"
        await api.until(lambda: up("node1"))
        assert (await api.agent("node1", "/v1/status"))["link"]["relay_url"] is None
        await trio.to_thread.run_sync(c.start_agent, 0)
        await api.until(lambda: up("node0"))
        relay_url = (await api.agent("node0", "/v1/status"))["relay"]["listen_url"]

        async def moved() -> bool:
            link = (await api.agent("node1", "/v1/status"))["link"]
            return link["relay_url"] == relay_url and link["registered"]
        with trio.fail_after(10.0):
            await api.until(moved)   # 10 s = 20 beats: well before the 60-beat full report
        with trio.fail_after(10):
            await api.until(lambda: _beats(api))
        assert (await api.agent("node0", "/v1/status"))["relay"]["members"] == 1
