"""A highly available placer as it runs (skipped where ``etcd`` is absent): a real 3-member
etcd, three ``herd placer run`` and real agents (``herd agent run``, simulated GPUs) that know
every placer. The leader SIGKILLed: a follower leads, the agents move to it by themselves, a
submit made during the failover is answered once (by the new leader), the running job is
untouched; a paused leader continued is a follower; etcd's quorum lost, the leader places
nothing and says so, then places again; ``herd demo --ha`` end to end with nothing left
running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo_ha import HACluster
from cli.localcluster import Proc
from infra.auth import TokenSet, auth_header
from scheduler_link.client import PlacerClient
from scheduler_link.messages import JobSpec
from testing.etcd import ETCD, EtcdCluster, etcd_running

REPO = Path(__file__).resolve().parent.parent
TTL = 2


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


@pytest.fixture
def cluster(tmp_path: Path, token_dir: Path, etcd3: EtcdCluster) -> Iterator[HACluster]:
    c = HACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=3, n_agents=3, heartbeat_s=0.3,
                  fence_after_s=30.0, recover_s=1.0, lease_ttl_s=TTL, racks=1)
    with c:
        yield c


def get(c: HACluster, p: Proc, path: str) -> Any:
    return httpx.get(p.url + path, headers=c.read_headers(), timeout=5).json()


def wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.05)
    return v


def nodes_up(c: HACluster, p: Proc) -> set[str]:
    try:
        return {n["node_id"] for n in get(c, p, "/v1/nodes")["nodes"] if n["state"] == "up"}
    except (httpx.HTTPError, ValueError, KeyError):
        return set()


def workloads(c: HACluster, node: str) -> list[dict[str, Any]]:
    r = httpx.get(c.agents[node].url + "/v1/workloads", headers=c.read_headers(), timeout=5).json()
    return list(r.get("workloads", r) if isinstance(r, dict) else r)


def test_leader_killed_agents_follow_and_a_submit_meanwhile_is_answered_once(cluster: HACluster,
                                                                            token_dir: Path) -> None:
    c = cluster
    op = TokenSet.load(token_dir).operator
    first = c.leader()
    wait(lambda: nodes_up(c, first) == set(c.agents), 30, "agents up at the leader")
    with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
        pc.submit(JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
        j1 = pc.job("j1", wait="running", timeout_ms=20000)
    assert j1.state == "running"
    node1 = j1.pods[0].node_id
    wl1 = [w for w in workloads(c, node1) if w.get("state") == "running"]
    assert len(wl1) == 1

    # the leader dies; a submit goes out at once, to every address (the dead one first)
    answers: list[Any] = []
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            urls = [first.url] + [u for u in c.placer_urls if u != first.url]
            with PlacerClient(urls, op, timeout=10, failover_s=30) as pc:
                answers.append((pc.submit(JobSpec(job_id="j2", pods=1, gpus_per_pod=8, argv=["sleep", "600"],
                                                  grace_s=0.5)), pc.url))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    c.kill_placer(first)
    killed = time.monotonic()
    t = threading.Thread(target=submit)
    t.start()
    nxt = c.leader(timeout_s=TTL + 8, besides=first)
    promoted_s = time.monotonic() - killed
    t.join(40)
    assert not errors, errors
    assert len(answers) == 1
    view, answered_by = answers[0]
    assert view.job_id == "j2" and answered_by == nxt.url
    assert promoted_s <= TTL + 8

    # the agents moved to the new leader by themselves
    wait(lambda: nodes_up(c, nxt) == set(c.agents), 30, "agents up at the new leader")
    jobs = get(c, nxt, "/v1/jobs")["jobs"]
    assert sorted(j["job_id"] for j in jobs) == ["j1", "j2"]          # j2 once
    for p in c.placers:
        if p is not nxt and p.alive():
            assert httpx.get(p.url + "/v1/jobs", headers=c.read_headers(), timeout=5).status_code == 307
    with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
        j2 = pc.job("j2", wait="running", timeout_ms=20000)
        j1b = pc.job("j1")
    assert j2.state == "running" and j2.pods[0].node_id != node1
    # the running job untouched: the same workload, still running, on the same node
    assert j1b.state == "running" and j1b.pods[0].node_id == node1
    assert [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"] == \
        [wl1[0]["workload_id"]]
    st = httpx.get(c.agents[node1].url + "/v1/status", headers=c.read_headers(), timeout=5).json()
    assert json.dumps(st).count(nxt.url) >= 1


def test_paused_leader_replaced_then_continued_is_a_follower(tmp_path: Path, token_dir: Path,
                                                            etcd3: EtcdCluster) -> None:
    """The leader SIGSTOPped past its TTL: another leads and the agents move to it; the paused
    one continued finds its lease gone and serves again, on its address, as a follower of the
    new leader; the running workload untouched throughout. An agent leaves a silent (paused)
    placer once another placer names a newer leader (scheduler_link.leaderprobe), at the latest
    after its request timeout (10 s): the new leader's recover_s outlasts even that, or it would
    place the recovered job a second time before its workload is reported."""

    with HACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=2, n_agents=2, heartbeat_s=0.3,
                   fence_after_s=30.0, recover_s=12.0, lease_ttl_s=TTL, racks=1) as c:
        _paused_leader(c, token_dir)


def _paused_leader(c: HACluster, token_dir: Path) -> None:
    import signal

    op = TokenSet.load(token_dir).operator
    old = c.leader()
    wait(lambda: nodes_up(c, old) == set(c.agents), 30, "agents up at the leader")
    with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
        pc.submit(JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
        j1 = pc.job("j1", wait="running", timeout_ms=20000)
    node1 = j1.pods[0].node_id
    wl = [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"]
    epoch = get(c, old, "/healthz")["ha"]["epoch"]
    old.proc.send_signal(signal.SIGSTOP)
    try:
        nxt = c.leader(timeout_s=TTL + 8, besides=old)
        wait(lambda: nodes_up(c, nxt) == set(c.agents), 40, "agents up at the new leader")
    finally:
        old.proc.send_signal(signal.SIGCONT)
    h = wait(lambda: (x := c.health(old)) is not None and x["role"] == "follower" and x, TTL + 10,
             "the old leader a follower")
    assert h["leader"] == nxt.url and h["epoch"] > epoch and old.alive()
    assert httpx.get(old.url + "/v1/jobs", headers=c.read_headers(), timeout=5).status_code == 307
    assert "lost the leadership" in old.log.read_text()
    with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
        pc.submit(JobSpec(job_id="j2", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
        j2 = pc.job("j2", wait="running", timeout_ms=30000)
        j1b = pc.job("j1", wait="running", timeout_ms=10000)
        assert pc.url == nxt.url
    assert j1b.state == "running" and j2.state == "running"
    assert [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"] == wl


def test_quorum_lost_the_leader_is_fenced_then_places_again(tmp_path: Path, token_dir: Path,
                                                           etcd3: EtcdCluster) -> None:
    """Two of three etcd members killed: the leader places nothing and says so (/healthz,
    /v1/status, /metrics), the running workload is untouched; the members back, the same
    epoch leads on within a TTL and a new job is placed."""
    from tests.prom import value

    op = TokenSet.load(token_dir).operator
    with HACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=2, n_agents=2, heartbeat_s=0.3,
                   fence_after_s=2.0, recover_s=1.0, lease_ttl_s=TTL, racks=1) as c:
        lead = c.leader()
        wait(lambda: nodes_up(c, lead) == set(c.agents), 30, "agents up at the leader")
        with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
            pc.submit(JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
            j1 = pc.job("j1", wait="running", timeout_ms=20000)
        node1 = j1.pods[0].node_id
        wl = [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"]
        epoch = get(c, lead, "/healthz")["ha"]["epoch"]

        etcd3.kill_member(1)
        etcd3.kill_member(2)
        h = wait(lambda: (x := get(c, lead, "/healthz")["ha"])["role"] == "fenced" and x, TTL + 8, "fenced")
        assert not h["placing"] and h["why"] and h["epoch"] == epoch
        assert get(c, lead, "/v1/status")["ha"]["role"] == "fenced"
        m = httpx.get(lead.url + "/metrics", headers=c.read_headers(), timeout=5).text
        assert value(m, "herd_placer_leader") == 0 and value(m, "herd_placer_fenced") == 1
        r = httpx.post(lead.url + "/v1/jobs", headers=auth_header(op), timeout=5,
                       content=b'{"job_id": "j2", "pods": 1, "gpus_per_pod": 8, "argv": ["x"]}')
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["leader"] is None
        time.sleep(2.0 + 1.0)   # past fence_after_s: a placer that judged the nodes would stop j1 now
        assert [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"] == wl

        etcd3.start_member(1)
        etcd3.start_member(2)
        back = time.monotonic()
        h = wait(lambda: (x := c.health(lead)) is not None and x["placing"] and x, 30, "placing again")
        resumed_s = time.monotonic() - back
        assert h["epoch"] == epoch and resumed_s <= 15   # (1.1 s measured: etcd's start and election included)
        with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
            pc.submit(JobSpec(job_id="j2", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
            j2 = pc.job("j2", wait="running", timeout_ms=20000)
            j1b = pc.job("j1")
        assert j2.state == "running" and j1b.state == "running" and j1b.pods[0].node_id == node1
        m = httpx.get(lead.url + "/metrics", headers=c.read_headers(), timeout=5).text
        assert value(m, "herd_placer_nodes_lost_total") == 0    # its own deafness judged nobody lost
        assert value(m, "herd_placer_leader") == 1 and value(m, "herd_placer_fenced") == 0
        assert [w["workload_id"] for w in workloads(c, node1) if w.get("state") == "running"] == wl


@pytest.mark.skipif(ETCD is None, reason="etcd absent (Debian package etcd-server)")
def test_demo_ha(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--ha", "--json", "--workdir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["leader_after"] != out["leader_before"] and out["epoch_after"] > out["epoch_before"]
    assert out["placed_by"] == out["leader_after"]
    assert out["jobs"] == {"train-a": "running", "train-b": "running"}
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "d") not in ps      # nothing left running: etcd, placers, agents, workloads


__all__ = ["auth_header"]
