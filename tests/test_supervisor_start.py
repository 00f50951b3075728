"""A pod's start path in the supervisor: its directories, made with as few metadata changes
as hold their modes and owners whatever the agent's umask or what an earlier start left."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.isolation import WorkloadUser
from agent.supervisor import _workload_dirs


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_workload_dirs_get_their_modes_under_any_umask(tmp_path: Path) -> None:
    me = WorkloadUser(name="me", uid=os.geteuid(), gid=os.getegid(), groups=(os.getegid(),))
    old = os.umask(0o077)            # strips the 0o011 a workload needs to reach its scratch
    try:
        _workload_dirs(tmp_path / "wl" / "w1", me)
    finally:
        os.umask(old)
    assert (_mode(tmp_path / "wl" / "w1"), _mode(tmp_path / "wl" / "w1" / "scratch")) == (0o711, 0o700)


def test_workload_dirs_mend_what_an_earlier_start_left(tmp_path: Path) -> None:
    me = WorkloadUser(name="me", uid=os.geteuid(), gid=os.getegid(), groups=(os.getegid(),))
    wdir = tmp_path / "w1"
    (wdir / "scratch").mkdir(parents=True)
    os.chmod(wdir, 0o755)
    os.chmod(wdir / "scratch", 0o777)
    (wdir / "scratch" / "kept").write_text("x")
    _workload_dirs(wdir, me)
    assert (_mode(wdir), _mode(wdir / "scratch")) == (0o711, 0o700)
    assert (wdir / "scratch" / "kept").read_text() == "x"


def test_workload_dirs_give_the_scratch_to_the_workload_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    other = WorkloadUser(name="other", uid=3100123, gid=3100124, groups=(3100124,))
    _workload_dirs(tmp_path / "w1", other)
    s = os.lstat(tmp_path / "w1" / "scratch")
    w = os.lstat(tmp_path / "w1")
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (3100123, 3100124, 0o700)
    assert (w.st_uid, stat.S_IMODE(w.st_mode)) == (0, 0o711)


async def test_a_pod_is_launched_without_waiting_for_the_owner_to_apply_starting(tmp_path: Path) -> None:
    """The launch follows the pod's set-up at once: the owner applies "starting" after the
    command left (on the same channel, before "running"), not as a round trip in between; the
    command's record (run.json's copy) says starting; the events come in order."""
    import trio

    from agent.launcher import LaunchCommand, ShimPool
    from agent.supervisor import Supervisor, SupervisorConfig
    from scheduler_link.messages import Placement, PodAssignment, WorkloadEvent

    seen: list[tuple[str, str]] = []   # (the owner's state of the pod, the command's record's) at launch
    sup: Supervisor | None = None

    def prepare(cmd: LaunchCommand) -> LaunchCommand:
        assert sup is not None
        seen.append((sup.record("w").state, cmd.record["state"]))
        return cmd

    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: {"GPU-0": "healthy"},
                     config=SupervisorConfig(shim_pool=1), base_env={"PATH": os.environ["PATH"]},
                     pool=ShimPool(1, prepare=prepare))
    events: list[WorkloadEvent] = []
    sup.add_listener(events.append)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = Placement(placement_id="p1", job_id="j", argv=["true"],
                          pods=[PodAssignment(workload_id="w", rank=0, gpus=["GPU-0"])])
            assert (await sup.place(p)).accepted
            st = await sup.wait_terminal("w")
            n.cancel_scope.cancel()
    assert seen == [("accepted", "starting")]
    assert (st.state, st.exit_code) == ("exited", 0)
    assert [e.state for e in events] == ["accepted", "starting", "running", "exited"]
