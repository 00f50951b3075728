"""The shim's pre-forked leader (agent.shim._Leader): the workload's process exists before
its command, becomes the workload with the identity the shim reported, and never outlives
a shim that got no work or a command that could not start."""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.errors import ShimError
from agent.launcher import SHIM_PATH, LaunchCommand, ShimPool, wait_identity
from agent.procs import same_process


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return True
    return data[data.rfind(b")") + 2:].split()[0] in (b"Z", b"X")


@dataclass
class Shim:
    """A shim as the agent holds it (agent.launcher): its process, its leader's pid, the write
    end of the leader's command pipe and the read end of its answer pipe, and its greeting."""
    p: subprocess.Popen[bytes]
    leader: int
    cmd: int
    answer: int
    hello: dict[str, Any]

    def wait(self, timeout: float) -> int:
        return self.p.wait(timeout)


def _shim(pre: list[str] | None = None) -> Shim:
    cmd_r, cmd_w = os.pipe()
    ans_r, ans_w = os.pipe()
    p = subprocess.Popen([*(pre or []), sys.executable, "-I", "-S", SHIM_PATH, "--leader-fds", f"{cmd_r},{ans_w}"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         start_new_session=True, pass_fds=(cmd_r, ans_w))
    os.close(cmd_r)
    os.close(ans_w)
    assert p.stdout is not None
    hello = json.loads(p.stdout.readline())
    p.stdout.close()
    assert hello["ready"] and hello["shim_pid"] == p.pid
    kids = _children(p.pid)
    assert kids == [hello["pid"]], kids          # the leader, waiting for its command
    return Shim(p, kids[0], cmd_w, ans_r, hello)


def _to_eof(fd: int, timeout: float = 10.0) -> bytes:
    """Everything read from ``fd`` until EOF (bounded: a missing EOF fails the test); closes it."""
    got = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no EOF within {timeout}s (read {got!r})"
            chunk = os.read(fd, 4096)
            if not chunk:
                return got
            got += chunk
    finally:
        os.close(fd)


def _command(s: Shim, cmd: dict[str, Any]) -> str:
    """The command to the leader, as the agent sends it; the leader's answer ("": exec'd)."""
    os.write(s.cmd, json.dumps(cmd).encode())
    os.close(s.cmd)
    return _to_eof(s.answer).decode()


def test_a_shim_without_work_takes_its_leader_with_it() -> None:
    s = _shim()
    os.close(s.cmd)                      # the agent went away
    assert s.wait(10) == 0
    assert _to_eof(s.answer) == b""      # (the leader never exec'd: EOF, and nothing said)
    assert _gone(s.leader)


def test_the_leader_becomes_the_workload_with_the_reported_identity(tmp_path: Path) -> None:
    s = _shim()
    out = tmp_path / "out"
    why = _command(s, {"dir": str(tmp_path), "argv": ["sh", "-c", f'echo "$X" > {out}; pwd >> {out}; sleep 30'],
                       "env": {"X": "hello", "PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    try:
        assert why == ""
        assert same_process(s.leader, s.hello["start_time"], s.hello["boot_id"])   # exec kept the identity
        for _ in range(200):
            if out.exists() and len(out.read_text().splitlines()) == 2:
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert out.read_text().splitlines() == ["hello", str(tmp_path)]
        assert os.getsid(s.leader) == s.leader   # a session (and group) of its own
    finally:
        os.kill(s.leader, 9)
    assert s.wait(20) == 0
    assert json.loads((tmp_path / "exit.json").read_text())["signal"] == 9


def test_the_workload_starts_while_its_shim_is_not_scheduled(tmp_path: Path) -> None:
    """The command goes to the leader and the answer comes from it: a shim that gets no CPU
    (stopped here) is not on the path from a command to its process running; it looks after
    the workload once it runs again."""
    s = _shim()
    os.kill(s.p.pid, signal.SIGSTOP)
    try:
        out = tmp_path / "out"
        why = _command(s, {"dir": str(tmp_path), "argv": ["sh", "-c", f"echo started > {out}; echo to-the-log"],
                           "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
        assert why == ""
        for _ in range(250):
            if out.exists() and out.read_text():
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert out.read_text() == "started\n"
        assert not (tmp_path / "exit.json").exists()
    finally:
        os.kill(s.p.pid, signal.SIGCONT)
    assert s.wait(20) == 0
    assert json.loads((tmp_path / "exit.json").read_text())["code"] == 0
    assert (tmp_path / "stdout.log").read_text() == "to-the-log\n"


def test_the_leader_writes_the_pods_files_before_its_exec(tmp_path: Path) -> None:
    """A small gang's peers file comes with the command: the leader writes it (0644, over the
    last start's, no temp file left) before the workload runs, which reads it at once."""
    (tmp_path / "peers").write_text("an earlier start's\n")
    s = _shim()
    out = tmp_path / "out"
    why = _command(s, {"dir": str(tmp_path), "argv": ["sh", "-c", f"cat {tmp_path}/peers > {out}"],
                       "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1,
                       "files": {"peers": "node-a http://a\nnode-b http://b\n"}})
    assert why == ""
    assert s.wait(20) == 0
    assert out.read_text() == "node-a http://a\nnode-b http://b\n"
    assert stat.S_IMODE((tmp_path / "peers").stat().st_mode) == 0o644
    assert not list(tmp_path.glob("*.tmp"))


def test_a_command_that_cannot_start_leaves_nothing_running(tmp_path: Path) -> None:
    for cmd, why in (({"argv": ["/no/such/program"], "cwd": str(tmp_path)}, "/no/such/program"),
                     ({"argv": ["true"], "cwd": str(tmp_path / "missing")}, "missing")):
        s = _shim()
        got = _command(s, {"dir": str(tmp_path), "env": {"PATH": os.environ["PATH"]}, **cmd})
        assert why in got, got
        assert s.wait(10) == 0
        assert _gone(s.leader)


def test_a_command_that_does_not_decode_is_answered_and_the_shim_leaves(tmp_path: Path) -> None:
    s = _shim()
    os.write(s.cmd, b"{not json")
    os.close(s.cmd)
    got = _to_eof(s.answer)
    assert got.startswith(b"JSONDecodeError")
    assert s.wait(10) == 0 and _gone(s.leader)
    assert not list(tmp_path.iterdir())   # the shim wrote nothing


def test_the_workload_gets_stdio_and_no_other_descriptor(tmp_path: Path) -> None:
    s = _shim()
    why = _command(s, {"dir": str(tmp_path), "argv": ["sh", "-c", "ls /proc/$$/fd"],   # the shell's own, into stdout.log
                       "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    assert why == ""
    assert s.wait(20) == 0
    assert sorted((tmp_path / "stdout.log").read_text().split()) == ["0", "1", "2"]


def test_the_waiting_leader_has_its_own_session_before_any_command() -> None:
    """setsid() (a new scheduler autogroup: milliseconds on a busy host) happens while the
    leader waits, so it is not between the command and the exec."""
    s = _shim()
    try:
        for _ in range(250):            # the leader's own step, after the fork: bounded, 5 s
            if os.getsid(s.leader) == s.leader:
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert os.getsid(s.leader) == s.leader and os.getpgid(s.leader) == s.leader
        assert os.getsid(s.p.pid) == s.p.pid != s.leader      # the shim keeps its own
    finally:
        os.close(s.cmd)
        os.close(s.answer)
        assert s.wait(10) == 0
    assert _gone(s.leader)


def _status_mask(text: str, field: str) -> int:
    return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(field + ":")), 16)


def _workload_status(s: Shim, tmp_path: Path) -> str:
    """The shim's workload ``cat /proc/self/status``, run to its end: what it printed."""
    why = _command(s, {"dir": str(tmp_path), "argv": ["cat", "/proc/self/status"],
                       "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    assert why == ""
    assert s.wait(20) == 0
    return (tmp_path / "stdout.log").read_text()


def test_the_workload_starts_with_no_signal_ignored_or_blocked(tmp_path: Path) -> None:
    """The shim ignores SIGHUP and SIGINT; its workload must not inherit that (an ignored
    signal survives exec): a Python workload would never get KeyboardInterrupt."""
    s = _shim()
    status = _workload_status(s, tmp_path)
    # the standard signals, 1-31 (32 and 33 belong to the C library, which no process can set)
    assert _status_mask(status, "SigIgn") & 0x7FFF_FFFF == 0, status
    assert _status_mask(status, "SigBlk") & 0x7FFF_FFFF == 0, status


def test_signals_ignored_where_the_agent_started_are_not_the_workloads(tmp_path: Path) -> None:
    """A supervisor that started the agent with SIGQUIT and SIGUSR1 ignored (inherited by the
    shim): its workload still gets them by default."""
    s = _shim([sys.executable, "-c", (
        "import signal, os, sys; signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN); os.execv(sys.executable, sys.argv[1:])")])
    status = _workload_status(s, tmp_path)
    assert _status_mask(status, "SigIgn") & 0x7FFF_FFFF == 0, status
    assert _status_mask(status, "SigBlk") & 0x7FFF_FFFF == 0, status


@pytest.mark.parametrize("zygote", [True, False])
async def test_the_pool_writes_run_json_before_the_command_leaves(tmp_path: Path, zygote: bool) -> None:
    """ShimPool.launch: run.json (the identity the shim said, the agent's record) is on disk
    before the leader gets its command -- the workload itself finds it -- and the identity
    returned is the process's; a command that cannot start leaves no run.json."""
    pool = ShimPool(1, use_zygote=zygote)
    seen = tmp_path / "seen"
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(pool.run)
            ln = await pool.launch(LaunchCommand(
                dir=str(tmp_path), argv=["sh", "-c", f"cat {tmp_path}/run.json > {seen}"],
                env={"PATH": os.environ["PATH"]}, cwd=str(tmp_path), record={"workload_id": "w"}, grace_s=1))
            await wait_identity(ln.shim_pid, ln.shim_start_time, ln.boot_id)   # the shim ends after its workload
            assert json.loads((tmp_path / "exit.json").read_text())["pid"] == ln.pid
            run = json.loads(seen.read_text())
            assert (run["pid"], run["start_time"], run["shim_pid"], run["record"]) == (
                ln.pid, ln.start_time, ln.shim_pid, {"workload_id": "w"})
            assert run["started_at"] == ln.started_at and "ready" not in run
            (tmp_path / "run.json").unlink()
            with pytest.raises(ShimError, match="/no/such/program"):
                await pool.launch(LaunchCommand(dir=str(tmp_path), argv=["/no/such/program"],
                                                env={"PATH": os.environ["PATH"]}, cwd=str(tmp_path)))
            assert not (tmp_path / "run.json").exists()   # nothing started: nothing to adopt
            n.cancel_scope.cancel()
