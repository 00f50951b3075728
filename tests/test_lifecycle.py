"""Lifecycle properties that must hold across agent restarts (issue 15 §2). Each of these
was checked to fail with the behaviour broken (see the mutation named in each docstring)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import trio.testing

from agent import procs
from agent.config import AgentConfig
from agent.daemon import Agent
from agent.state import AgentState, WorkloadRecord
from agent.supervisor import Supervisor, SupervisorConfig
from infra.auth import TokenSet, auth_header
from scheduler_link.messages import Placement, PodAssignment
from testing.waiting import poll
from testing.waiting import until as changed

GPUS = {f"GPU-{i:04d}": "healthy" for i in range(4)}

# Waits for $HERD_SCRATCH/go, then exits $CODE; with IGNORE=1 it ignores SIGTERM.
WAITER = r"""
trap 'echo term >> "$HERD_SCRATCH/terms"; [ "$IGNORE" = 1 ] || exit 0' TERM
echo started > "$HERD_SCRATCH/started"
n=0; while [ ! -e "$HERD_SCRATCH/go" ] && [ $n -lt 1200 ]; do sleep 0.05; n=$((n+1)); done
exit "${CODE:-0}"
"""


def make(tmp: Path, clock: Callable[[], float] = time.time) -> Supervisor:
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: GPUS,
                      config=SupervisorConfig(shim_pool=1), base_env={"PATH": "/usr/bin:/bin"}, clock=clock)


def place(wid: str, gpus: list[str], env: dict[str, str] | None = None, grace: float = 5.0) -> Placement:
    return Placement(placement_id=f"p-{wid}", job_id=f"j-{wid}", argv=["sh", "-c", WAITER], env=env or {},
                     grace_s=grace, pods=[PodAssignment(workload_id=wid, rank=0, gpus=gpus)])


async def until(pred) -> None:
    """``pred`` polled: it reads a real process's state; the caller bounds it."""
    await poll(pred, 0.02)


async def test_exit_while_the_agent_is_down_is_reported_with_its_code(tmp_path):
    """Mutation checked: recovery reporting 'lost' (ignoring exit.json) fails this."""
    sup = make(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(place("w", ["GPU-0000"], {"CODE": "7"}))
            scratch = sup.wl_dir / "w" / "scratch"
            await until(lambda: (scratch / "started").exists())
            rec = sup.record("w")
            n.cancel_scope.cancel()  # the agent goes away; the shim and the workload stay
        # the workload ends while no agent runs: only its shim sees it
        (scratch / "go").touch()
        await until(lambda: (sup.wl_dir / "w" / "exit.json").exists())
        await until(lambda: not procs.same_process(rec.shim_pid, rec.shim_start_time, rec.boot_id))
        sup2 = make(tmp_path)
        async with trio.open_nursery() as n:
            await n.start(sup2.run)
            st = sup2.record("w").status()
            assert (st.state, st.exit_code) == ("exited", 7)
            assert sup2.gpu_holders() == {}
            n.cancel_scope.cancel()


@pytest.mark.parametrize("wrong", ["start_time", "boot_id"])
@pytest.mark.parametrize("state", ["running", "terminating"])
async def test_a_recycled_pid_is_never_adopted_nor_signalled(tmp_path, wrong, state):
    """A live process that is not ours holds the recorded pid (and is named as the shim).
    Mutation checked: ``same_process`` ignoring the start time, or the boot id, fails this."""
    other = await trio.lowlevel.open_process(["sleep", "30"])
    try:
        st = procs.start_time(other.pid) or 0
        start = st + 12345 if wrong == "start_time" else st
        boot = procs.boot_id() if wrong != "boot_id" else "00000000-0000-0000-0000-000000000000"
        rec = WorkloadRecord(workload_id="w", job_id="j", state=state, gpus=["GPU-0000"], pid=other.pid,
                             start_time=start, boot_id=boot, shim_pid=other.pid, shim_start_time=start,
                             stop_reason="preempted" if state == "terminating" else None,
                             stop_preempted=state == "terminating",
                             stop_deadline=time.time() - 1 if state == "terminating" else None)
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / "state.json").write_bytes(msgspec.json.encode(AgentState(records=[rec])))
        sup = make(tmp_path)
        with trio.fail_after(15):
            async with trio.open_nursery() as n:
                await n.start(sup.run)
                assert sup.record("w").state in ("lost", "preempted")
                assert sup.gpu_holders() == {}
                await trio.testing.wait_all_tasks_blocked()   # whatever it would do to that process, done
                n.cancel_scope.cancel()
        assert other.poll() is None, "a process that is not ours was signalled"
    finally:
        other.kill()
        await other.wait()


async def test_restart_resumes_the_grace_countdown(tmp_path):
    """The agent dies right after SIGTERM; it restarts ``later`` s later (its wall clock
    runs that far ahead: nothing sleeps): the SIGKILL comes at the original deadline, not a
    fresh grace after the restart (deadline + ``later`` or later, on the restarted agent's
    clock). Mutation checked: the killer taking ``now + grace`` as its deadline fails this."""
    grace, later = 6.0, 4.5
    sup = make(tmp_path)
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(place("w", [], {"IGNORE": "1"}))
            scratch = sup.wl_dir / "w" / "scratch"
            await until(lambda: (scratch / "started").exists())
            await sup.stop("w", reason="preempted", grace_s=grace, preempted=True)
            await changed(sup.next_change, lambda: sup.record("w").term_sent)
            await changed(sup.next_saved, sup.saved)  # and on disk, where the next agent reads it
            deadline = sup.record("w").stop_deadline
            assert deadline is not None
            n.cancel_scope.cancel()
        sup2 = make(tmp_path, clock=lambda: time.time() + later)
        async with trio.open_nursery() as n:
            await n.start(sup2.run)
            assert sup2.record("w").state == "terminating" and sup2.record("w").stop_deadline == deadline
            st = await sup2.wait_terminal("w")
            ended = time.time() + later
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("preempted", 128 + signal.SIGKILL)
    assert deadline - 0.05 <= ended < deadline + later - 1.5, (ended - deadline)
    assert (scratch / "terms").read_text() == "term\n"  # one SIGTERM, not one per agent life


async def test_prefetch_really_fetches(tmp_path, token_dir):
    """``POST /v1/prefetch`` of a manifest this agent never had: its chunks land in the
    store from the origin, nothing starts. Mutation checked: a prefetch that only answers
    202 fails this."""
    from p2p.origins import open_origin
    from p2p.publish import publish

    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(3 << 20))
    origin_url = f"file://{tmp_path / 'origin'}"
    async with open_origin(origin_url) as o:
        pub = await publish(src, o, "w:v1")
    tokens = TokenSet.load(token_dir)
    agent = Agent(AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                              listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                              workloads=SupervisorConfig(shim_pool=0), allowed_origins=(origin_url,)),
                  env={"PATH": os.environ["PATH"]}, handle_signals=False)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            assert pub.manifest not in agent.store.complete_manifests()
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.placer)) as c:
                body = msgspec.json.encode({"manifest_id": pub.manifest, "origin": origin_url})
                assert (await c.post("/v1/prefetch", content=body)).status_code == 202
            await until(lambda: pub.manifest in agent.store.complete_manifests())
            # (the store marks the manifest complete inside the fetch; the supervisor adds the
            # fetch's byte counts when it returns, a moment later: wait for those too)
            await until(lambda: agent.supervisor.fetch_bytes["bytes_from_origin"] >= 3 << 20)
            assert agent.supervisor.workloads() == []
            n.cancel_scope.cancel()
