"""A job submitted again under the id of one that ended continues its attempt counter, in the
file journal and the etcd journal alike (placer.journal.KEEP_ENDED_ATTEMPTS of the most
recently ended jobs are kept): its workload ids never name an earlier incarnation's pods, so
an agent that ran the earlier job does not refuse the new placement as a replay, and a stop
bound to an earlier attempt does not reach the new pod (issue 42, finding 8)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from placer import journal as journal_mod
from placer.etcd import EtcdClient
from placer.etcdjournal import EtcdJournal, Fence, JobJournal
from placer.journal import Journal
from scheduler_link.messages import JobSpec, Placement, Victim
from testing.etcd import EtcdCluster

PREFIX = b"/herd/test-resubmit/"


def spec(job_id: str) -> JobSpec:
    return JobSpec(job_id=job_id, pods=1, gpus_per_pod=1, argv=["x"])


def run_three_attempts(j: JobJournal) -> None:
    """Job ``a`` placed three times, then it ends; ``b`` submitted and never placed, ends."""
    assert j.submitted(spec("a"), 1.0, sync=False) == 0
    for attempt in (1, 2, 3):
        j.attempt("a", attempt, 2.0 + attempt)
    assert j.submitted(spec("b"), 6.0, sync=False) == 0
    j.ended_many([("a", "cancelled", 7.0), ("b", "cancelled", 7.0)])


async def test_the_file_journal_keeps_an_ended_jobs_attempts_for_its_resubmission(tmp_path: Path) -> None:
    j = Journal.open(tmp_path)
    run_three_attempts(j)
    await j.flush()
    j.close()
    j = Journal.open(tmp_path)                               # (a restarted placer)
    assert j.jobs() == [] and j.ended_attempts == {"a": 3, "b": 1}
    assert j.submitted(spec("a"), 8.0) == 3                  # its first placement is attempt 4 ...
    appends = j.appends
    j.attempt("a", 4, 9.0)                                   # ... which its submission stands for
    assert j.appends == appends
    j.close()
    j = Journal.open(tmp_path)
    assert j.attempts == {"a": 4} and j.ended_attempts == {"b": 1}   # replayed live: not below attempt 4
    j.ended("a", "failed", 10.0)
    # compaction keeps the ended counters (as attempt records of jobs that are not live)
    for i in range(40):
        j.submitted(spec(f"c{i}"), 11.0, sync=False)
        j.ended_many([(f"c{i}", "succeeded", 12.0)])
    j.close()
    size = len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0])  # its records (zeros follow)
    j = Journal.open(tmp_path)
    assert len((tmp_path / "jobs.journal").read_bytes().split(b"\0")[0]) < size   # it was compacted
    assert j.ended_attempts["a"] == 4 and j.ended_attempts["b"] == 1 and len(j.ended_attempts) == 42
    assert j.submitted(spec("a"), 13.0) == 4
    j.close()


def test_the_kept_counters_are_bounded_oldest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "KEEP_ENDED_ATTEMPTS", 3)
    j = Journal.open(tmp_path)
    for i in range(5):
        j.submitted(spec(f"j{i}"), 1.0)
        j.ended(f"j{i}", "succeeded", 2.0)
    assert list(j.ended_attempts) == ["j2", "j3", "j4"]
    j.close()
    j = Journal.open(tmp_path)
    assert list(j.ended_attempts) == ["j2", "j3", "j4"]
    assert j.submitted(spec("j0"), 3.0) == 0                 # forgotten: starts afresh
    j.close()


async def test_the_etcd_journal_keeps_an_ended_jobs_attempts_for_its_resubmission(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(30):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            fence = Fence(PREFIX + b"leader", await c.put(PREFIX + b"leader", b"me"))
            j = await EtcdJournal.load(c, PREFIX, fence)
            run_three_attempts(j)
            await j.flush()
            j = await EtcdJournal.load(c, PREFIX, fence)       # (a promoted follower)
            assert j.jobs() == [] and j.ended_attempts == {"a": 3}   # b never placed: no id of it used
            assert j.submitted(spec("a"), 8.0) == 3
            await j.flush()
            j = await EtcdJournal.load(c, PREFIX, fence)
            assert j.attempts == {"a": 3} and j.ended_attempts == {}  # live again: its counter in its key
            j.attempt("a", 4, 9.0)
            j.ended("a", "failed", 10.0)
            await j.flush()
            j = await EtcdJournal.load(c, PREFIX, fence)
            assert j.ended_attempts == {"a": 4}
            assert j.submitted(spec("a"), 11.0) == 4


async def test_a_resubmitted_job_runs_as_its_next_attempt_and_an_old_attempts_stop_does_not_reach_it(
        tmp_path: Path, token_dir: Path) -> None:
    """A real placer and a real agent: job j runs (attempt 1) and is cancelled; the placer
    restarts on its state dir and ports; j is submitted again and runs on the same agent as
    attempt 2 (an attempt 1 again would be refused there as a replay of the first). Stops of
    attempt 1 as the placer would push them now (its epoch, the node's boot, in time) stop
    nothing of the new pod: naming attempt 1's pod it is gone already; naming the new pod it
    is refused (``refused_spec``)."""
    from agent.config import AgentConfig
    from agent.daemon import Agent
    from agent.supervisor import SupervisorConfig
    from infra.auth import TokenSet, auth_header
    from placer.service import PlacerService
    from tests.test_placer_service import cfg, wait_for

    tokens = TokenSet.load(token_dir)
    job = JobSpec(job_id="j", pods=1, gpus_per_pod=1, argv=["sleep", "30"], grace_s=0.1)
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            async with trio.open_nursery() as first:        # the first placer's life
                svc = PlacerService(cfg(tmp_path), tokens)
                url = await first.start(svc.run)
                agent = Agent(AgentConfig(node_id="a1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "a1"),
                                          listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                                          placer=url, heartbeat_s=0.1, insecure=True,
                                          workloads=SupervisorConfig(shim_pool=0)),
                              env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)
                control = await n.start(agent.run)
                async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10) as op:
                    assert (await _run(op, job))["attempt"] == 1
                    assert (await op.delete("/v1/jobs/j")).status_code in (200, 202)
                    assert (await agent.supervisor.wait_terminal("j.1.0")).state in ("exited", "preempted")
                    await wait_for(lambda: _ended(op))
                journal = svc.journal
                assert isinstance(journal, Journal)
                await wait_for(lambda: journal.synced == journal.appends)   # its end is durable
                first.cancel_scope.cancel()                   # the placer stops; the agent keeps running
            port, wire_port = (int(str(u).rsplit(":", 1)[1]) for u in (url, svc.wire_url))
            svc = PlacerService(cfg(tmp_path, listen=f"127.0.0.1:{port}", wire_listen=f"127.0.0.1:{wire_port}"), tokens)
            assert await n.start(svc.run) == url
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10) as op:
                assert (await _run(op, job))["attempt"] == 2
            assert agent.supervisor.record("j.2.0").state == "running"
            boot = agent.link_boot_id()
            assert boot
            now = time.time()
            stop = Placement(placement_id="stop:j:1:a1:late", job_id="j", node_id="a1", attempt=1,
                             victims=[Victim(workload_id="j.1.0", grace_s=0.1)], issued_at=now, expires_at=now + 30,
                             boot_id=boot, epoch=svc.epoch)
            async with httpx.AsyncClient(base_url=control, headers=auth_header(tokens.placer), timeout=10) as pc:
                r = await pc.post("/v1/placements", content=msgspec.json.encode(stop))
                assert r.status_code == 200, r.text           # its pod is gone: nothing to stop
                named = msgspec.structs.replace(stop, placement_id="stop:j:1:a1:named",
                                                victims=[Victim(workload_id="j.2.0", grace_s=0.1)])
                r = await pc.post("/v1/placements", content=msgspec.json.encode(named))
                assert r.status_code == 409 and r.json()["outcome"] == "refused_spec", r.text
            await trio.sleep(0.3)
            assert agent.supervisor.record("j.2.0").state == "running"
            n.cancel_scope.cancel()


async def _run(op: httpx.AsyncClient, job: JobSpec) -> dict[str, object]:
    """Submit ``job`` once the node is up and wait until it runs; its view."""
    from tests.test_placer_service import wait_for

    async def up() -> bool:
        return any(x["state"] == "up" for x in (await op.get("/v1/nodes")).json()["nodes"])
    await wait_for(up)
    r = await op.post("/v1/jobs", content=msgspec.json.encode(job))
    assert r.status_code == 201, r.text
    r = await op.get(f"/v1/jobs/{job.job_id}", params={"wait": "running", "timeout_ms": "15000"})
    view: dict[str, object] = r.json()
    assert view["state"] == "running", r.text
    return view


async def _ended(op: httpx.AsyncClient) -> bool:
    return (await op.get("/v1/jobs/j")).json()["state"] in ("cancelled", "failed", "succeeded")
