"""A job's first placement leaves after one fsync, its submission's: the submission stands
for attempt 1 (placer.journal.FIRST_ATTEMPT). What recovery relies on still holds: an
acknowledged submit survives a SIGKILLed placer, and a job re-placed after the crash never
reuses the workload ids of an attempt a silent node still runs."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from cli.localcluster import LocalCluster
from infra.auth import TokenSet, auth_header, generate_token_dir
from placer.journal import FIRST_ATTEMPT, Journal
from scheduler_link.messages import JobSpec
from testing.waiting import poll


def test_the_first_attempt_appends_nothing_and_replays_as_attempt_one(tmp_path: Path) -> None:
    j = Journal.open(tmp_path)
    j.submitted(JobSpec(job_id="a", argv=["x"]), 1.0, sync=False)
    j.submitted(JobSpec(job_id="b", argv=["x"]), 1.0, sync=False)
    appends = j.appends
    j.attempt("a", FIRST_ATTEMPT, 2.0)        # the submission's own: nothing to write
    assert j.appends == appends
    j.attempt("b", 2, 2.0)                    # a re-placement: recorded
    assert j.appends == appends + 1
    j.ended("b", "failed", 3.0)
    j.close()
    again = Journal.open(tmp_path)
    # never placed or placed once, a live job replays at attempt 1: its next is 2
    assert again.attempts == {"a": 1}
    again.close()


class _Api:
    def __init__(self, c: LocalCluster, tokens: TokenSet) -> None:
        self.c, self.h = c, auth_header(tokens.operator)

    async def submit(self, job_id: str) -> None:
        assert self.c.placer is not None
        async with httpx.AsyncClient(timeout=15, headers=self.h) as cl:
            r = await cl.post(self.c.placer.url + "/v1/jobs", json={
                "job_id": job_id, "pods": 1, "gpus_per_pod": 4, "within": "any", "argv": ["sleep", "60"],
                "grace_s": 0.5})
            assert r.status_code == 201, r.text

    async def job(self, job_id: str) -> dict[str, Any]:
        assert self.c.placer is not None
        async with httpx.AsyncClient(timeout=15, headers=self.h) as cl:
            r = await cl.get(f"{self.c.placer.url}/v1/jobs/{job_id}")
            r.raise_for_status()
            return dict(r.json())

    async def workloads(self, node: str) -> dict[str, str]:
        async with httpx.AsyncClient(timeout=10, headers=self.c.read_headers()) as cl:
            data = (await cl.get(self.c.agents[node].url + "/v1/workloads")).json()
        items = data.get("workloads", data) if isinstance(data, dict) else data
        return {w["workload_id"]: w["state"] for w in items}


@pytest.mark.slow
async def test_placer_killed_after_the_push_replaces_the_gang_under_a_new_attempt(tmp_path: Path) -> None:
    """The placer SIGKILLed once a job's first attempt runs (no attempt record was ever
    written for it) and once another job's submit was acknowledged, while the node running
    them is silent: restarted, it has both jobs and places them on the other node as
    attempt 2; the silent node, back, is told to stop its attempt-1 pods."""
    td = generate_token_dir(tmp_path / "tokens")
    tokens = TokenSet.load(td)
    with LocalCluster(tmp_path, td, n_agents=2, racks=2, heartbeat_s=0.2,
                      extra_placer_config="recover_max_s = 1.0\n") as c:
        api = _Api(c, tokens)
        with trio.fail_after(90):
            await api.submit("g")
            ran = await poll(lambda: _running(api, "g"), 0.05)
            assert ran["attempt"] == FIRST_ATTEMPT
            node, old = ran["pods"][0]["node_id"], ran["pods"][0]["workload_id"]
            other = next(n for n in c.agents if n != node)
            assert (await api.workloads(node)).get(old) == "running"

            c.pause(node)                     # silent through the placer's recovery
            await api.submit("k")             # acknowledged: durable before the 201
            assert c.placer is not None
            c.placer.signal_group(signal.SIGKILL)
            c.placer.proc.wait(5)
            c.start_placer()

            for job in ("g", "k"):
                v = await poll(lambda job=job: _running(api, job), 0.05)
                assert v["attempt"] > FIRST_ATTEMPT, v
                assert [p["node_id"] for p in v["pods"]] == [other]
                assert v["pods"][0]["workload_id"] != old
            c.resume(node)
            # back, the node hears that g's gang lives elsewhere and stops its attempt-1 pod
            await poll(lambda: _stopped(api, node, old), 0.05)
            g = await api.job("g")
            assert g["state"] == "running" and g["pods"][0]["node_id"] == other


async def _running(api: _Api, job: str) -> dict[str, Any] | None:
    v = await api.job(job)
    return v if v["state"] == "running" else None


async def _stopped(api: _Api, node: str, wid: str) -> bool:
    return (await api.workloads(node)).get(wid) in ("exited", "preempted", "failed", "lost")
