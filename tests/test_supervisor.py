"""Workload supervisor with real subprocess workloads under real shims."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import trio

from agent import procs
from agent.state import AgentState, WorkloadRecord, read_state
from agent.supervisor import Supervisor, SupervisorConfig
from scheduler_link.messages import Placement, PodAssignment, RestartPolicy, Victim
from testing.waiting import poll, until

GPUS = {f"GPU-{i:04d}": "healthy" for i in range(4)}

# Traps SIGTERM: counts the TERMs it got, writes a checkpoint, exits 0 (or ignores TERM when IGNORE=1).
TRAP = r"""
trap 'echo term >> "$HERD_SCRATCH/terms"; if [ "$IGNORE" != 1 ]; then echo ckpt > "$HERD_SCRATCH/checkpoint"; exit 0; fi' TERM
echo started > "$HERD_SCRATCH/started"
n=0; while [ ! -e "$HERD_SCRATCH/go" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done  # bounded: 30 s
exit "${CODE:-0}"
"""


def placement(pid: str, *, wid: str, gpus: list[str], argv: list[str] | None = None, env=None,
              victims=(), grace: float = 5.0, restart=RestartPolicy()) -> Placement:
    return Placement(placement_id=pid, job_id=f"job-{pid}", pods=[PodAssignment(workload_id=wid, rank=0, gpus=gpus)],
                     victims=list(victims), argv=argv or ["sh", "-c", TRAP], env=env or {}, grace_s=grace,
                     restart=restart)


def make(tmp: Path, health=GPUS, base_env=None, clock=time.time) -> Supervisor:
    env = dict(base_env if base_env is not None else {"PATH": os.environ["PATH"]})
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: health,
                      config=SupervisorConfig(shim_pool=1), base_env=env, clock=clock)


async def wait_state(sup: Supervisor, wid: str, *states: str):
    """Woken by the supervisor itself each time it applied changes (never a polling interval)."""
    await until(sup.next_change, lambda: sup.record(wid).state in states)
    return sup.record(wid)


async def wait_file(p: Path) -> None:
    """A file the workload (another process) writes, polled; the caller bounds it."""
    await poll(trio.Path(p).exists, 0.02)


def scratch(sup: Supervisor, wid: str) -> Path:
    return sup.wl_dir / wid / "scratch"


async def test_env_logs_and_exit_code(tmp_path):
    sup = make(tmp_path, base_env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1",
                                   "GOOGLE_APPLICATION_CREDENTIALS": "/secret.json", "LC_ALL": "C.UTF-8"})
    events = []
    sup.add_listener(events.append)
    argv = ["sh", "-c", "env | sort; pwd; echo oops >&2; exit 3"]
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            ack = await sup.place(placement("p1", wid="w1", gpus=["GPU-0001", "GPU-0002"], argv=argv,
                                            env={"FOO": "bar", "NOTIFY_SOCKET": "@leak"}))
            assert ack.accepted and ack.workloads == ["w1"]
            st = await sup.wait_terminal("w1")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("exited", 3)
    out = sup.read_log("w1", tail=1000)
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0001,GPU-0002"
    assert (env["HERD_JOB_ID"], env["HERD_RANK"], env["HERD_WORLD_SIZE"], env["FOO"]) == ("job-p1", "0", "1", "bar")
    assert env["HERD_SCRATCH"] == str(scratch(sup, "w1"))
    assert env["HERD_PREEMPT_NOTICE"].endswith("preempt-notice.json")
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env and env["LC_ALL"] == "C.UTF-8"  # an allow-list
    assert out.splitlines()[-1] == str(scratch(sup, "w1"))  # cwd is scratch when there is no artifact
    assert sup.read_log("w1", stream="stderr") == "oops\n"
    assert [e.state for e in events] == ["accepted", "starting", "running", "exited"]
    assert sup.statistics()["starts"] == 1


async def test_graceful_stop_writes_notice_and_checkpoint(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p1", wid="w1", gpus=["GPU-0000"]))
            await wait_state(sup, "w1", "running")
            await wait_file(scratch(sup, "w1") / "started")
            st = await sup.stop("w1", reason="stopped", grace_s=5)
            assert st.state == "terminating"
            st = await sup.wait_terminal("w1")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code, st.reason) == ("exited", 0, "stopped")
    assert (scratch(sup, "w1") / "checkpoint").read_text() == "ckpt\n"
    notice = json.loads((sup.wl_dir / "w1" / "preempt-notice.json").read_text())
    assert notice["reason"] == "stopped" and notice["deadline"] > 0


async def test_sigkill_after_grace_and_victims_free_gpus(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p1", wid="old", gpus=["GPU-0000"], env={"IGNORE": "1"}, grace=0.3))
            await wait_state(sup, "old", "running")
            await wait_file(scratch(sup, "old") / "started")
            # double booking: refused with a clear reason, nothing started
            ack = await sup.place(placement("p2", wid="new", gpus=["GPU-0000"]))
            assert not ack.accepted and "in use by workload old" in (ack.reason or "")
            # the same GPU freed by this placement's victim: accepted; starts after the victim is gone
            ack = await sup.place(placement("p3", wid="new", gpus=["GPU-0000"],
                                            victims=[Victim(workload_id="old", grace_s=0.3, preempted=True)]))
            assert ack.accepted
            old = await sup.wait_terminal("old")
            assert sup.record("new").state in ("accepted", "starting", "running")
            await wait_state(sup, "new", "running")
            assert sup.record("new").started_at >= sup.record("old").updated_at - 0.01
            await sup.stop("new", grace_s=5)
            await sup.wait_terminal("new")
            n.cancel_scope.cancel()
    assert (old.state, old.exit_code) == ("preempted", 128 + signal.SIGKILL)
    assert (scratch(sup, "old") / "terms").read_text() == "term\n"
    assert sup.statistics()["preemptions"] == 1


async def test_stop_before_start_runs_nothing(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p1", wid="old", gpus=["GPU-0000"], env={"IGNORE": "1"}))
            await wait_state(sup, "old", "running")
            await sup.place(placement("p2", wid="new", gpus=["GPU-0000"], argv=["sh", "-c", "touch ran"],
                                      victims=[Victim(workload_id="old", grace_s=0.5, preempted=True)]))
            st = await sup.stop("new", reason="cancelled")
            assert st.state == "accepted"  # waiting for its victim; it never starts now
            new = await sup.wait_terminal("new")
            old = await sup.wait_terminal("old")
            n.cancel_scope.cancel()
    assert (new.state, new.reason, new.pid) == ("exited", "cancelled before start", None)
    assert not (scratch(sup, "new") / "ran").exists()
    assert old.state == "preempted"


async def test_refusals(tmp_path):
    health = dict(GPUS, **{"GPU-0003": "fatal"})
    sup = make(tmp_path, health=health)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            cases = {
                "unknown GPU GPU-9999": placement("a", wid="a", gpus=["GPU-9999"]),
                "fatal-unhealthy": placement("b", wid="b", gpus=["GPU-0003"]),
                "names a GPU twice": placement("c", wid="c", gpus=["GPU-0000", "GPU-0000"]),
                "bad workload id": placement("d", wid="../etc", gpus=["GPU-0000"]),
                "needs argv": Placement(placement_id="e", job_id="j", pods=[
                    PodAssignment(workload_id="e", rank=0, gpus=[])]),
                "given to both": Placement(placement_id="f", job_id="j", argv=["true"], pods=[
                    PodAssignment(workload_id="f1", rank=0, gpus=["GPU-0001"]),
                    PodAssignment(workload_id="f2", rank=1, gpus=["GPU-0001"])]),
            }
            for want, p in cases.items():
                ack = await sup.place(p)
                assert not ack.accepted and want in (ack.reason or ""), (want, ack)
            assert sup.workloads() == []
            # idempotent by placement id
            p = placement("g", wid="g", gpus=["GPU-0000"], argv=["true"])
            a1, a2 = await sup.place(p), await sup.place(p)
            assert a1 == a2 and a1.accepted
            await sup.wait_terminal("g")
            assert [w.workload_id for w in sup.workloads()] == ["g"]
            n.cancel_scope.cancel()


async def test_restart_policy_on_failure(tmp_path):
    sup = make(tmp_path)
    events = []
    sup.add_listener(lambda e: events.append((e.workload_id, e.state)))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = placement("p", wid="w", gpus=[], argv=["sh", "-c", "echo run >> $HERD_SCRATCH/runs; exit 1"],
                          restart=RestartPolicy(kind="on-failure", limit=2, backoff_s=0.05))
            await sup.place(p, direct=True)
            st = await sup.wait_terminal("w")
            # a stop during the back-off ends the workload without another run
            await sup.place(placement("b", wid="b", gpus=[], argv=["sh", "-c", "echo run >> $HERD_SCRATCH/runs; exit 2"],
                                      restart=RestartPolicy(kind="on-failure", limit=5, backoff_s=30)), direct=True)
            await until(sup.next_change, lambda: sup.record("b").restarts >= 1)  # it restarts into "starting"
            assert sup.record("b").state == "starting" and sup.record("b").pid is None
            await sup.stop("b", reason="stopped")
            b = await sup.wait_terminal("b")
            # the placer's placements never restart on the agent
            await sup.place(placement("q", wid="q", gpus=[], argv=["false"],
                                      restart=RestartPolicy(kind="on-failure", limit=2, backoff_s=0.05)))
            q = await sup.wait_terminal("q")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code, sup.record("w").restarts) == ("exited", 1, 2)
    assert (scratch(sup, "w") / "runs").read_text() == "run\n" * 3
    assert [s for w, s in events if w == "w"] == ["accepted", "starting", "running"] * 1 + [
        "starting", "running"] * 2 + ["exited"]
    assert (b.state, b.exit_code, b.reason) == ("exited", 2, "stopped before start")
    assert (scratch(sup, "b") / "runs").read_text() == "run\n"
    assert (q.state, q.exit_code, sup.record("q").restarts) == ("exited", 1, 0)


async def test_readopt_after_restart_and_later_exit_code(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p", wid="w", gpus=["GPU-0000"], env={"CODE": "7"}))
            await wait_file(scratch(sup, "w") / "started")
            pid = (await wait_state(sup, "w", "running")).pid
            n.cancel_scope.cancel()  # the agent goes away; the shim and workload stay
        assert procs.same_process(pid, procs.start_time(pid), procs.boot_id())
        sup2 = make(tmp_path)
        async with trio.open_nursery() as n:
            await n.start(sup2.run)
            rec = sup2.record("w")
            assert (rec.state, rec.pid) == ("running", pid)
            # GPU still booked after the restart
            ack = await sup2.place(placement("p2", wid="w2", gpus=["GPU-0000"]))
            assert not ack.accepted
            (scratch(sup2, "w") / "go").touch()
            st = await sup2.wait_terminal("w")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("exited", 7)


async def test_countdown_resumes_after_restart(tmp_path):
    """Restarted ``later`` s after the SIGTERM (its wall clock runs that far ahead: nothing
    sleeps), the supervisor kills at the recorded deadline, not after a fresh grace."""
    grace, later = 6.0, 4.5
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p", wid="w", gpus=[], env={"IGNORE": "1"}))
            await wait_state(sup, "w", "running")
            await wait_file(scratch(sup, "w") / "started")
            await sup.stop("w", reason="preempted", grace_s=grace, preempted=True)
            await wait_file(scratch(sup, "w") / "terms")
            await wait_state(sup, "w", "terminating")
            with trio.fail_after(5):
                await until(sup.next_change, lambda: sup.record("w").term_sent)
                await until(sup.next_saved, sup.saved)  # and on disk, where sup2 reads it
            deadline = sup.record("w").stop_deadline
            n.cancel_scope.cancel()
        sup2 = make(tmp_path, clock=lambda: time.time() + later)
        async with trio.open_nursery() as n:
            await n.start(sup2.run)
            assert sup2.record("w").state == "terminating"
            assert sup2.record("w").stop_deadline == deadline
            st = await sup2.wait_terminal("w")
            ended = sup2.record("w").updated_at
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("preempted", 128 + signal.SIGKILL)
    # not killed at once, and at the original deadline, not after a fresh grace period (which
    # ends at deadline + later or after; on trio's clock, exactly: test_supervisor_clock.py)
    assert deadline - 0.05 <= ended < deadline + later - 1.5
    assert (scratch(sup2, "w") / "terms").read_text() == "term\n"  # SIGTERM not sent twice


async def test_recycled_pid_never_adopted(tmp_path):
    # A live process that is not ours, named by a state file with a wrong start time.
    other = await trio.lowlevel.open_process(["sleep", "30"])
    try:
        st = procs.start_time(other.pid)
        rec = WorkloadRecord(workload_id="w", job_id="j", state="running", gpus=["GPU-0000"], pid=other.pid,
                             start_time=(st or 0) + 12345, boot_id=procs.boot_id(), shim_pid=other.pid,
                             shim_start_time=(st or 0) + 1)
        (tmp_path / "state").mkdir()
        (tmp_path / "state" / "state.json").write_bytes(msgspec.json.encode(AgentState(records=[rec])))
        sup = make(tmp_path)
        with trio.fail_after(10):
            async with trio.open_nursery() as n:
                await n.start(sup.run)
                assert sup.record("w").state == "lost"
                ack = await sup.place(placement("p", wid="w2", gpus=["GPU-0000"], argv=["true"]))
                assert ack.accepted  # a lost workload holds no GPU
                await sup.wait_terminal("w2")
                n.cancel_scope.cancel()
        assert other.poll() is None  # never signalled
    finally:
        other.kill()
        await other.wait()


async def test_corrupt_state_file_set_aside(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text("{not json")
    sup = make(tmp_path)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            assert sup.workloads() == []
            n.cancel_scope.cancel()
    assert list((tmp_path / "state").glob("state.json.bad-*"))


def test_shim_runs_without_the_package():
    # the shim is started with -I -S: it must import only the standard library
    src = Path(__file__).resolve().parent.parent / "agent" / "shim.py"
    cmd_r, cmd_w = os.pipe()
    ans_r, ans_w = os.pipe()
    os.close(cmd_w)   # no command: the leader and then the shim exit
    try:
        r = subprocess.run([sys.executable, "-I", "-S", str(src), "--leader-fds", f"{cmd_r},{ans_w}"],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10, pass_fds=(cmd_r, ans_w))
    finally:
        for fd in (cmd_r, ans_r, ans_w):
            os.close(fd)
    assert r.returncode == 0 and json.loads(r.stdout)["ready"] is True, r.stderr


async def test_workload_recovered_from_run_json_when_state_lagged(tmp_path):
    # The agent died right after a launch, before state.json had the record: the shim's
    # run.json (written before it answered) carries it, so nothing is lost or doubled.
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = placement("p", wid="w", gpus=["GPU-0002"], env={"CODE": "4"})
            await sup.place(p)
            pid = (await wait_state(sup, "w", "running")).pid
            n.cancel_scope.cancel()
        (tmp_path / "state" / "state.json").write_bytes(msgspec.json.encode(AgentState(node_id="n1")))
        sup2 = make(tmp_path)
        async with trio.open_nursery() as n:
            await n.start(sup2.run)
            rec = sup2.record("w")
            assert (rec.state, rec.pid, rec.job_id, rec.gpus) == ("running", pid, "job-p", ["GPU-0002"])
            assert (await sup2.place(p)).accepted  # a retried placement is the same one, not a second start
            assert [w.workload_id for w in sup2.workloads()] == ["w"]
            assert not (await sup2.place(placement("q", wid="q", gpus=["GPU-0002"]))).accepted
            (scratch(sup2, "w") / "go").touch()
            st = await sup2.wait_terminal("w")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("exited", 4)


async def test_a_run_json_cut_short_is_read_as_no_start(tmp_path):
    """run.json is written in place before the command leaves: one cut short (the agent killed
    mid-write) means nothing was started, so a restarted agent neither adopts it nor starts
    the pod again -- the pod is lost -- and a dir holding only such a file is no orphan."""
    state = tmp_path / "state"
    wl = state / "workloads"
    rec = WorkloadRecord(workload_id="w", job_id="j", placement_id="p", gpus=["GPU-0001"], argv=["true"],
                         state="starting")
    whole = json.dumps({"pid": os.getpid(), "start_time": procs.start_time(os.getpid()), "boot_id": procs.boot_id(),
                        "shim_pid": os.getpid(), "record": msgspec.to_builtins(rec)}).encode()
    for wid in ("w", "orphan"):
        (wl / wid).mkdir(parents=True)
        (wl / wid / "run.json").write_bytes(whole[: len(whole) // 2])
    (state / "state.json").write_bytes(msgspec.json.encode(AgentState(node_id="n1", records=[rec])))
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            st = await sup.wait_terminal("w")
            assert [w.workload_id for w in sup.workloads()] == ["w"]
            n.cancel_scope.cancel()
    assert st.state == "lost" and st.pid is None


async def test_log_rotation_and_tail(tmp_path):
    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: GPUS, base_env={"PATH": os.environ["PATH"]},
                     config=SupervisorConfig(shim_pool=1, log_max_bytes=1024, log_keep=1))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            argv = ["sh", "-c", "i=0; while [ $i -lt 400 ]; do echo line-$i; i=$((i+1)); done"]
            await sup.place(placement("p", wid="w", gpus=[], argv=argv))
            await sup.wait_terminal("w")
            n.cancel_scope.cancel()
    wdir = sup.wl_dir / "w"
    assert (wdir / "stdout.log").stat().st_size <= 1024 and (wdir / "stdout.log.1").stat().st_size == 1024
    assert not (wdir / "stdout.log.2").exists()  # only log_keep rotations are kept
    assert sup.read_log("w", tail=3) == "line-397\nline-398\nline-399\n"
    tail = sup.read_log("w", tail=150).splitlines()
    assert len(tail) == 150 and tail[-1] == "line-399"
    assert all(int(a[5:]) + 1 == int(b[5:]) for a, b in zip(tail[1:], tail[2:], strict=False))
    assert sup.read_log("w", tail=0) == ""


def _pidfds_on(pid: int) -> int:
    """Descriptors of this process that are pidfds on ``pid`` (fdinfo's Pid line)."""
    n = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                n += f"Pid:\t{pid}\n" in f.read()
        except OSError:
            pass
    return n


async def test_killed_shim_workload_still_holds_its_gpu(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p", wid="w", gpus=["GPU-0000"]))
            rec = await wait_state(sup, "w", "running")
            assert _pidfds_on(rec.pid) == 0
            os.kill(rec.shim_pid, signal.SIGKILL)
            # the supervisor has reaped its shim and waits on the workload itself (a pidfd on it)
            await poll(lambda: not os.path.exists(f"/proc/{rec.shim_pid}") and _pidfds_on(rec.pid), 0.01)
            assert sup.record("w").state == "running"  # its process still runs: GPU still booked
            assert not (await sup.place(placement("q", wid="q", gpus=["GPU-0000"]))).accepted
            (scratch(sup, "w") / "go").touch()
            st = await sup.wait_terminal("w")
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("exited", None) and "unknown" in (st.reason or "")


async def test_old_terminal_workloads_are_forgotten(tmp_path):
    now = [1000.0]
    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: GPUS, base_env={"PATH": os.environ["PATH"]},
                     config=SupervisorConfig(shim_pool=1, keep_terminal=1), clock=lambda: now[0])
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            for i in range(3):
                await sup.place(placement(f"p{i}", wid=f"w{i}", gpus=[], argv=["true"]))
                await sup.wait_terminal(f"w{i}")
                now[0] += 10
            assert {w.workload_id for w in sup.workloads()} == {"w0", "w1", "w2"}  # all too young to forget
            now[0] += 100
            await sup.place(placement("p3", wid="w3", gpus=[], argv=["true"]))
            await sup.wait_terminal("w3")
            with trio.fail_after(5):
                await poll(lambda: not any((sup.wl_dir / f"w{i}").exists() for i in range(3)), 0.02)
            n.cancel_scope.cancel()
    assert {w.workload_id for w in sup.workloads()} == {"w3"}
    saved = read_state(tmp_path / "state")   # what a restart reads: the snapshot and its log
    assert {r.workload_id for r in saved.records} == {"w3"}


async def test_missing_program_fails_with_a_clear_reason(tmp_path):
    sup = make(tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await sup.place(placement("p", wid="w", gpus=["GPU-0000"], argv=["/no/such/program", "x"]))
            st = await sup.wait_terminal("w")
            # the GPU is free again at once
            assert (await sup.place(placement("q", wid="q", gpus=["GPU-0000"], argv=["true"]))).accepted
            await sup.wait_terminal("q")
            n.cancel_scope.cancel()
    assert st.state == "failed" and "launch failed" in st.reason and "/no/such/program" in st.reason


def test_trees_to_remove_keeps_live_and_recent_trees():
    from agent.supervisor import trees_to_remove
    from scheduler_link.messages import WorkloadStatus

    def w(wid: str, mid: str | None, state: str, at: float) -> WorkloadStatus:
        return WorkloadStatus(workload_id=wid, job_id="j", manifest_id=mid, state=state, updated_at=at)  # type: ignore[arg-type]

    trees = ["a" * 64, "b" * 64, "c" * 64, "d" * 64, "e" * 64]
    ws = [w("1", "a" * 64, "running", 1.0), w("2", "b" * 64, "exited", 5.0), w("3", "c" * 64, "exited", 9.0),
          w("4", "d" * 64, "preempted", 7.0), w("5", "a" * 64, "exited", 10.0), w("6", None, "running", 3.0)]
    # a is live; of the idle ones c (9) and d (7) are the most recent; e was never used here
    assert trees_to_remove(trees, ws, keep=2) == ["e" * 64, "b" * 64]
    assert trees_to_remove(trees, ws, keep=0) == ["e" * 64, "b" * 64, "d" * 64, "c" * 64]
    assert trees_to_remove(trees, ws, keep=10) == []
    assert trees_to_remove(["a" * 64], ws, keep=0) == []  # a live workload's tree is never removed
