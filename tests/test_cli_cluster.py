"""The operator's CLI against real processes (a placer and two agents with simulated GPUs,
cli/localcluster.py): `herd logs`, `herd job logs [--follow]`, `herd node drain --wait` moving a gang
to the other node, and a cordon that outlives a placer restart."""

from __future__ import annotations

import json

import pytest
import trio

from cli.localcluster import LocalCluster
from testing.waiting import poll

from .test_cli_job import herd, one_line

pytestmark = pytest.mark.slow

SCRIPT = 'echo "hello from $HERD_RANK"; echo "oops" >&2; exec sleep 60'


async def _until(fn):
    """``fn`` (async) polled: the cluster is other processes; the caller bounds it."""
    return await poll(fn, 0.2)


async def test_logs_drain_and_cordon_across_a_placer_restart(tmp_path, token_dir):
    with trio.fail_after(150), LocalCluster(tmp_path, token_dir, n_agents=2, heartbeat_s=0.2, racks=1) as c:
        assert c.placer is not None
        env = {"HERD_PLACER": c.placer.url, "HERD_TOKEN_DIR": str(token_dir), "HERD_AGENT": ""}

        async def nodes() -> dict:
            rc, out, err = await herd(["nodes", "--json"], env)
            return {x["node_id"]: x for x in json.loads(out)["nodes"]} if rc == 0 else {}

        await _until(lambda: _n_up(nodes, 2))
        rc, out, err = await herd(["job", "submit", "--job-id", "lg", "--gpus-per-pod", "8", "--grace", "2",
                                   "--restart", "on-preemption", "--wait", "running", "--json",
                                   "--", "sh", "-c", SCRIPT], env)
        assert rc == 0, err
        pod = json.loads(out)["pods"][0]
        first = pod["node_id"]
        other = ({"node0", "node1"} - {first}).pop()

        async def job_logs(*extra: str) -> str:
            rc, out, err = await herd(["job", "logs", "lg", *extra], env)
            assert rc == 0, err
            return out
        assert "hello from 0" in await _until(lambda: job_logs())
        assert "oops" in await _until(lambda: job_logs("--stderr"))
        rc, out, err = await herd(["job", "logs", "lg", "--rank", "3"], env)
        assert rc == 1 and "no pod of rank 3" in one_line(err)
        # straight from the agent, by a prefix of the workload id
        agent = c.agents[first].url
        rc, out, err = await herd(["logs", pod["workload_id"][:4], "--agent", agent, "--tail", "1"], env)
        assert rc == 0 and out == "hello from 0\n", (out, err)
        rc, out, err = await herd(["logs", "zzz", "--agent", agent], env)
        assert rc == 1 and "no workload 'zzz'" in one_line(err)

        # --follow streams until the workload ends (then the command ends, exit 0)
        rc, out, err = await herd(["job", "submit", "--job-id", "fl", "--gpus-per-pod", "8", "--wait", "running",
                                   "--", "sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.4; done"], env)
        assert rc == 0, err
        rc, out, err = await herd(["job", "logs", "fl", "--follow"], env)
        assert rc == 0 and out == "line 1\nline 2\nline 3\n", (out, err)
        rc, out, err = await herd(["version", "--agent", agent, "--json"], env)
        assert rc == 0 and json.loads(out)["agent"]["version"] == "0.1.0", (out, err)

        # drain: cordon, stop the preemptible gang (grace 1 s); it is placed on the other node
        rc, out, err = await herd(["node", "drain", first, "--grace", "1", "--wait", "--wait-timeout", "30"], env)
        assert rc == 0 and "stopping lg" in out and "(0 workload(s) on it)" in out, (out, err)
        v = await _until(lambda: _job_running(env))
        assert v["pods"][0]["node_id"] == other and v["restarts"] == 1, v
        views = await nodes()
        assert views[first]["cordoned"] and views[first]["workloads"] == 0

        # the cordon is journaled: a restarted placer still keeps the node out of service
        c.stop_proc(c.placer)
        c.start_placer()
        await _until(lambda: _n_up(nodes, 2))
        views = await nodes()
        assert views[first]["cordoned"] and not views[other]["cordoned"], views
        rc, out, err = await herd(["nodes"], env)
        assert any(line.startswith(first) and "cordoned" in line for line in out.splitlines()), out
        rc, out, err = await herd(["node", "uncordon", first], env)
        assert rc == 0 and "schedulable" in out
        assert not (await nodes())[first]["cordoned"]
        rc, out, err = await herd(["job", "cancel", "lg", "--wait", "--wait-timeout", "30"], env)
        assert rc == 0 and "job lg: cancelled" in out, err
        # an agent's workload named by a prefix of its id (as `herd status` prints it)
        wid = v["pods"][0]["workload_id"]
        rc, out, err = await herd(["agent", "stop", wid[:6], "--agent", c.agents[other].url, "--json"], env)
        assert rc == 0 and json.loads(out)["workload_id"] == wid, (out, err)


async def _n_up(nodes, n: int) -> bool:
    return sum(x["state"] == "up" for x in (await nodes()).values()) == n


async def _job_running(env: dict[str, str]):
    rc, out, err = await herd(["job", "show", "lg", "--json"], env)
    if rc != 0:
        return None
    v = json.loads(out)
    return v if v["state"] == "running" else None
