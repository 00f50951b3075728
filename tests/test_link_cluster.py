"""The scheduler link end to end: a placer process and agent processes with simulated
GPUs on loopback (tests/cluster.py). Real sockets, real subprocesses, real workloads."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from cli.localcluster import LocalCluster
from infra.auth import TokenSet, auth_header
from testing.waiting import poll

pytestmark = pytest.mark.slow

# A workload that records SIGTERM (with the time) and exits 0 on it.
TRAP = ('trap \'date +%s.%N > "$MARK/$HERD_JOB_ID.$HERD_RANK.term"; exit 0\' TERM; '
        'while :; do sleep 0.05; done')


class Api:
    def __init__(self, c: LocalCluster, tokens: TokenSet) -> None:
        assert c.placer is not None
        self.c = c
        self.tokens = tokens
        self.h = auth_header(tokens.operator)

    @property
    def url(self) -> str:
        assert self.c.placer is not None
        return self.c.placer.url

    async def get(self, path: str, **kw: Any) -> Any:
        async with httpx.AsyncClient(timeout=15, headers=self.h) as cl:
            r = await cl.get(self.url + path, **kw)
            r.raise_for_status()
            return r.json()

    async def submit(self, **spec: Any) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=15) as cl:
            r = await cl.post(self.url + "/v1/jobs", json=spec, headers=self.h)
            assert r.status_code == 201, r.text
            return r.json()

    async def cancel(self, job_id: str) -> None:
        async with httpx.AsyncClient(timeout=15) as cl:
            r = await cl.delete(f"{self.url}/v1/jobs/{job_id}", headers=self.h)
            assert r.status_code == 200, r.text

    async def job(self, job_id: str, wait: str | None = None) -> dict[str, Any]:
        params = {"wait": wait, "timeout_ms": "8000"} if wait else None
        return await self.get(f"/v1/jobs/{job_id}", params=params)

    async def until(self, pred: Any, what: str = "") -> Any:
        """``pred`` polled (the cluster's state is other processes'); the caller bounds it."""
        return await poll(pred, 0.05)

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in (await self.get("/v1/nodes"))["nodes"]}

    async def agent_workloads(self, node: str) -> dict[str, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=10, headers=self.c.read_headers()) as cl:
            r = await cl.get(self.c.agents[node].url + "/v1/workloads")
            data = r.json()
        items = data.get("workloads", data) if isinstance(data, dict) else data
        return {w["workload_id"]: w for w in items}

    async def metric(self, name: str) -> float:
        async with httpx.AsyncClient(timeout=10) as cl:
            text = (await cl.get(self.url + "/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


async def all_up(api: Api, n: int) -> bool:
    nodes = await api.nodes()
    return sum(x["state"] == "up" for x in nodes.values()) == n


def _cluster(tmp_path: Path, token_dir: Path, **kw: Any) -> LocalCluster:
    return LocalCluster(tmp_path, token_dir, **kw)


async def test_run_preempt_and_refused_fatal_gpu(tmp_path, token_dir):
    """submit -> pods on the chosen GPUs; a higher priority job preempts (SIGTERM within
    grace) and runs; a GPU that just turned fatal makes its node refuse; placed elsewhere."""
    tokens = TokenSet.load(token_dir)
    marks = tmp_path / "marks"
    marks.mkdir()
    marks.chmod(0o777)  # workloads run as an unprivileged user when the agent is root
    env = {"MARK": str(marks)}
    # long heartbeats: the placer learns of the injected fault only through the refusal
    with trio.fail_after(90), _cluster(tmp_path, token_dir, n_agents=4, heartbeat_s=5.0,
                                       recover_s=1.0) as c:
        api = Api(c, tokens)
        await api.until(lambda: all_up(api, 4))
        await api.submit(job_id="low", pods=2, gpus_per_pod=8, priority=1, preemptible=True,
                         restart={"kind": "on-preemption"}, grace_s=5.0, argv=["sh", "-c", TRAP], env=env)
        low = await api.job("low", wait="running")
        assert low["state"] == "running", low
        for pod in low["pods"]:
            w = (await api.agent_workloads(pod["node_id"]))[pod["workload_id"]]
            assert w["state"] == "running" and w["gpus"] == pod["gpus"]
        # preemption: every GPU is wanted by a more important job
        t_pre = time.time()
        await api.submit(job_id="high", pods=4, gpus_per_pod=8, priority=10, preemptible=False,
                         argv=["sleep", "60"], grace_s=1.0)
        high = await api.job("high", wait="running")
        assert high["state"] == "running", high
        for pod in low["pods"]:
            term = marks / f"low.{pod['rank']}.term"
            assert term.exists(), "the victim never saw SIGTERM"
            assert float(term.read_text()) - t_pre < 5.0  # within its grace
            w = (await api.agent_workloads(pod["node_id"]))[pod["workload_id"]]
            assert w["state"] in ("preempted", "exited")
        low2 = await api.job("low")
        assert low2["state"] == "pending" and low2["restarts"] == 1
        used = [g for p in high["pods"] for g in p["gpus"]]
        assert len(used) == len(set(used)) == 32
        await api.cancel("high")
        low3 = await api.job("low", wait="running")
        assert low3["state"] == "running" and low3["attempt"] == 2
        await api.cancel("low")
        # a filler takes three whole nodes: the fourth is the only place for the next job
        await api.until(lambda: _free_total(api, 32), what="GPUs freed")
        await api.submit(job_id="filler", pods=3, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)
        filler = await api.job("filler", wait="running")
        free_node = ({f"node{i}" for i in range(4)} - {p["node_id"] for p in filler["pods"]}).pop()
        async with httpx.AsyncClient(timeout=10, headers=c.read_headers()) as cl:
            snap = (await cl.get(c.agents[free_node].url + "/v1/gpus")).json()
            bad = next(g["uuid"] for g in snap["gpus"] if g["index"] == 0)
            r = await cl.post(f"{c.agents[free_node].url}/v1/gpus/{bad}/inject", json={"xid": 79},
                              headers=auth_header(tokens.operator))
            assert r.status_code == 200, r.text
        with trio.fail_after(10):
            await api.until(lambda: _agent_gpu_fatal(c, free_node, bad))
        rollbacks0 = await api.metric("herd_placer_rollbacks_total")
        await api.submit(job_id="f", pods=1, gpus_per_pod=4, argv=["sleep", "60"], grace_s=1.0)
        f = await api.job("f", wait="running")
        assert f["state"] == "running", f
        assert bad not in f["pods"][0]["gpus"] and f["pods"][0]["node_id"] == free_node
        assert await api.metric("herd_placer_rollbacks_total") >= rollbacks0 + 1
        node = (await api.nodes())[free_node]
        assert 0 in node["unhealthy_gpus"]


async def _free_total(api: Api, n: int) -> bool:
    return sum(x["free_gpus"] for x in (await api.nodes()).values()) == n


async def _agent_gpu_fatal(c: LocalCluster, node: str, uuid: str) -> bool:
    async with httpx.AsyncClient(timeout=10, headers=c.read_headers()) as cl:
        snap = (await cl.get(c.agents[node].url + "/v1/gpus")).json()
    return any(g["uuid"] == uuid and g["health"] == "fatal" for g in snap["gpus"])


async def test_partition_host_failure_and_placer_restart(tmp_path, token_dir):
    """A partitioned agent is told to stop what was placed elsewhere; a host failure
    reschedules after the fence; a restarted placer rebuilds from reports, nothing doubled."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(100), _cluster(tmp_path, token_dir, n_agents=3, heartbeat_s=0.2,
                                        fence_after_s=1.0) as c:
        api = Api(c, tokens)
        await api.until(lambda: all_up(api, 3))
        await api.submit(job_id="r", pods=1, gpus_per_pod=8, restart={"kind": "on-failure", "limit": 3},
                         argv=["sleep", "120"], grace_s=1.0)
        v1 = await api.job("r", wait="running")
        n1 = v1["pods"][0]["node_id"]
        # partition: the agent freezes (its workloads keep running)
        c.pause(n1)
        t0 = time.monotonic()
        with trio.fail_after(20):
            v2 = await api.until(lambda: _moved(api, "r", v1["attempt"]))
        assert time.monotonic() - t0 >= 1.0  # lost (3 missed beats) then fenced (1 s)
        assert v2["pods"][0]["node_id"] != n1
        old = v1["pods"][0]["workload_id"]
        assert (await _wl_state(api, n1, old, resume=True)) is not None
        # back: it hears that the old pod's gang lives elsewhere and stops it
        with trio.fail_after(15):
            await api.until(lambda: _wl_terminal(api, n1, old))
        await api.until(lambda: all_up(api, 3))
        assert (await api.job("r"))["attempt"] == v2["attempt"]

        # host failure: the agent and its workloads die together
        n2 = v2["pods"][0]["node_id"]
        pids = c.workload_pids(n2)
        assert pids, "the agent lists the workload's pid"
        c.kill_host(n2)
        with trio.fail_after(5):
            await api.until(lambda: _true(not any(_alive(p) for p in pids)))
        with trio.fail_after(20):
            v3 = await api.until(lambda: _moved(api, "r", v2["attempt"]))
        assert v3["pods"][0]["node_id"] not in (n2,)
        assert v3["restarts"] == 2

        # placer killed and restarted on the same port: rebuilt from reports, nothing doubled
        before = {n: set(await api.agent_workloads(n)) for n in c.agents if c.agents[n].alive()}
        assert c.placer is not None
        c.placer.signal_group(signal.SIGKILL)
        c.placer.proc.wait(5)
        c.start_placer()
        with trio.fail_after(20):
            await api.until(lambda: _alive_nodes_up(api, c))
        v4 = await api.job("r", wait="running")
        assert v4["state"] == "running" and v4["attempt"] == v3["attempt"]
        assert [(p["node_id"], p["gpus"]) for p in v4["pods"]] == [(p["node_id"], p["gpus"]) for p in v3["pods"]]
        await trio.sleep(1.0)  # past the recovery window: nothing is placed again
        after = {n: set(await api.agent_workloads(n)) for n in before}
        assert after == before
        cluster = await api.get("/v1/cluster")
        assert cluster["model"]["allocated"] == 8


async def _true(v: Any) -> Any:
    return v


async def _alive_nodes_up(api: Api, c: LocalCluster) -> bool:
    nodes = await api.nodes()
    live = [n for n, p in c.agents.items() if p.alive()]
    return all(nodes.get(n, {}).get("state") == "up" for n in live)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


async def _moved(api: Api, job: str, attempt: int) -> dict[str, Any] | None:
    v = await api.job(job)
    if v["attempt"] > attempt and v["state"] == "running":
        return v
    return None


async def _wl_state(api: Api, node: str, wid: str, *, resume: bool = False) -> str | None:
    if resume:
        api.c.resume(node)
    return (await api.agent_workloads(node)).get(wid, {}).get("state")


async def _wl_terminal(api: Api, node: str, wid: str) -> bool:
    return (await api.agent_workloads(node)).get(wid, {}).get("state") in ("preempted", "exited", "failed", "lost")
