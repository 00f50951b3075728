"""The shim's pre-forked leader (agent.shim._Leader): the workload's process exists before
its command, becomes the workload with the identity the shim reported, and never outlives
a shim that got no work or a command that could not start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agent.launcher import SHIM_PATH
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


def _shim() -> tuple[subprocess.Popen[bytes], int]:
    p = subprocess.Popen([sys.executable, "-I", "-S", SHIM_PATH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    assert p.stdout is not None
    hello = json.loads(p.stdout.readline())
    assert hello["ready"] and hello["shim_pid"] == p.pid
    kids = _children(p.pid)
    assert len(kids) == 1, kids          # the leader, waiting for its command
    return p, kids[0]


def _command(p: subprocess.Popen[bytes], cmd: dict[str, Any]) -> dict[str, Any]:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(json.dumps(cmd).encode() + b"\n")
    p.stdin.flush()
    reply: dict[str, Any] = json.loads(p.stdout.readline())
    p.stdin.close()
    p.stdout.close()
    return reply


def test_a_shim_without_work_takes_its_leader_with_it() -> None:
    p, leader = _shim()
    assert p.stdin is not None
    p.stdin.close()                      # the agent went away
    assert p.wait(10) == 0
    assert p.stdout is not None
    p.stdout.close()
    assert _gone(leader)


def test_the_leader_becomes_the_workload_with_the_reported_identity(tmp_path: Path) -> None:
    p, leader = _shim()
    out = tmp_path / "out"
    reply = _command(p, {"dir": str(tmp_path), "argv": ["sh", "-c", f'echo "$X" > {out}; pwd >> {out}; sleep 30'],
                         "env": {"X": "hello", "PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    try:
        assert reply["ok"] and reply["pid"] == leader
        assert same_process(reply["pid"], reply["start_time"], reply["boot_id"])   # exec kept the identity
        run = json.loads((tmp_path / "run.json").read_text())
        assert run["pid"] == leader and run["start_time"] == reply["start_time"]
        for _ in range(200):
            if out.exists() and len(out.read_text().splitlines()) == 2:
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert out.read_text().splitlines() == ["hello", str(tmp_path)]
        assert os.getsid(leader) == leader   # a session (and group) of its own
    finally:
        os.kill(leader, 9)
    assert p.wait(20) == 0
    assert json.loads((tmp_path / "exit.json").read_text())["signal"] == 9


def test_a_command_that_cannot_start_leaves_nothing_behind(tmp_path: Path) -> None:
    for cmd, why in (({"argv": ["/no/such/program"], "cwd": str(tmp_path)}, "/no/such/program"),
                     ({"argv": ["true"], "cwd": str(tmp_path / "missing")}, "missing")):
        p, leader = _shim()
        reply = _command(p, {"dir": str(tmp_path), "env": {"PATH": os.environ["PATH"]}, **cmd})
        assert not reply["ok"] and why in reply["error"], reply
        assert p.wait(10) == 1
        assert _gone(leader)
        assert not (tmp_path / "run.json").exists()   # nothing for a restarted agent to adopt


def test_the_workload_gets_stdio_and_no_other_descriptor(tmp_path: Path) -> None:
    p, leader = _shim()
    reply = _command(p, {"dir": str(tmp_path), "argv": ["sh", "-c", "ls /proc/$$/fd"],   # the shell's own, into stdout.log
                         "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    assert reply["ok"] and reply["pid"] == leader
    assert p.wait(20) == 0
    assert sorted((tmp_path / "stdout.log").read_text().split()) == ["0", "1", "2"]


def test_the_waiting_leader_has_its_own_session_before_any_command() -> None:
    """setsid() (a new scheduler autogroup: milliseconds on a busy host) happens while the
    leader waits, so it is not between the command and the exec."""
    p, leader = _shim()
    try:
        for _ in range(250):            # the leader's own step, after the fork: bounded, 5 s
            if os.getsid(leader) == leader:
                break
            subprocess.run(["sleep", "0.02"], check=True)
        assert os.getsid(leader) == leader and os.getpgid(leader) == leader
        assert os.getsid(p.pid) == p.pid != leader      # the shim keeps its own
    finally:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.close()
        assert p.wait(10) == 0
        p.stdout.close()
    assert _gone(leader)


def _status_mask(text: str, field: str) -> int:
    return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(field + ":")), 16)


def test_the_workload_starts_with_no_signal_ignored_or_blocked(tmp_path: Path) -> None:
    """The shim ignores SIGHUP and SIGINT; its workload must not inherit that (an ignored
    signal survives exec): a Python workload would never get KeyboardInterrupt."""
    p, leader = _shim()
    reply = _command(p, {"dir": str(tmp_path), "argv": ["cat", "/proc/self/status"],
                         "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    assert reply["ok"] and reply["pid"] == leader
    assert p.wait(20) == 0
    status = (tmp_path / "stdout.log").read_text()
    # the standard signals, 1-31 (32 and 33 belong to the C library, which no process can set)
    assert _status_mask(status, "SigIgn") & 0x7FFF_FFFF == 0, status
    assert _status_mask(status, "SigBlk") & 0x7FFF_FFFF == 0, status


def test_signals_ignored_where_the_agent_started_are_not_the_workloads(tmp_path: Path) -> None:
    """A supervisor that started the agent with SIGQUIT and SIGUSR1 ignored (inherited by the
    shim): its workload still gets them by default."""
    p = subprocess.Popen([sys.executable, "-c", (
        "import signal, os, sys; signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN); os.execv(sys.executable, sys.argv[1:])"),
        sys.executable, "-I", "-S", SHIM_PATH], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, start_new_session=True)
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["ready"]
    reply = _command(p, {"dir": str(tmp_path), "argv": ["cat", "/proc/self/status"],
                         "env": {"PATH": os.environ["PATH"]}, "cwd": str(tmp_path), "grace_s": 1})
    assert reply["ok"]
    assert p.wait(20) == 0
    status = (tmp_path / "stdout.log").read_text()
    assert _status_mask(status, "SigIgn") & 0x7FFF_FFFF == 0, status
