"""The supervisor's state writes: a write nothing waits on gathers its burst (one fdatasync
for a gang's pods going starting -> running), an ack is never held back by it, and what is
pending when the supervisor stops is on disk after."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from agent.state import read_state
from agent.supervisor import WRITE_COALESCE_S, Supervisor, SupervisorConfig
from scheduler_link.messages import Placement, PodAssignment
from testing.waiting import until

GPUS = {f"GPU-{i:04d}": "healthy" for i in range(4)}


def _placement(pid: str, n: int) -> Placement:
    return Placement(placement_id=pid, job_id=f"job-{pid}", argv=["sleep", "30"], grace_s=0.2,
                     pods=[PodAssignment(workload_id=f"{pid}-{i}", rank=i, gpus=[f"GPU-{i:04d}"]) for i in range(n)])


def _writes(sup: Supervisor) -> int:
    return int(sup.statistics()["state_syncs"])   # writes by the writer task, each one fdatasync


def _make(tmp: Path) -> Supervisor:
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: GPUS,
                      config=SupervisorConfig(shim_pool=4), base_env={"PATH": os.environ["PATH"]})


async def test_a_burst_is_one_write_and_the_ack_is_not_held(tmp_path: Path) -> None:
    sup = _make(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            writes = _writes(sup)
            t0 = trio.current_time()
            ack = await sup.place(_placement("p", 4))
            assert ack.accepted
            assert trio.current_time() - t0 < WRITE_COALESCE_S   # durable at once: its write waits for nothing
            await until(sup.next_change, lambda: all(sup.record(f"p-{i}").state == "running" for i in range(4)))
            await until(sup.next_saved, sup.saved)
            # the ack's write, then the pods' starting and running together (bounded: a slow
            # host may split the burst, never into a write per change)
            assert _writes(sup) - writes <= 3
            for i in range(4):
                await sup.stop(f"p-{i}", reason="done", grace_s=0.2)
            for i in range(4):
                await sup.wait_terminal(f"p-{i}")
            n.cancel_scope.cancel()


async def test_what_is_pending_at_stop_is_written(tmp_path: Path) -> None:
    sup = _make(tmp_path)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(_placement("q", 1))
            await until(sup.next_change, lambda: sup.record("q-0").state == "running")
            assert not sup.saved()      # "running" waits for the rest of its burst ...
            n.cancel_scope.cancel()     # ... and the supervisor stops first
    st = read_state(tmp_path / "state")
    assert {r.workload_id: r.state for r in st.records} == {"q-0": "running"}
    pid = next(r.pid for r in st.records)
    assert pid is not None
    os.kill(pid, 9)   # (a workload outlives its agent's stop, by design)
