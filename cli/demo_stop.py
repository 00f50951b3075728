"""`herd demo stop DIR`: stop everything a `herd demo` started, workloads included.

The demo records what it started in ``DIR/demo.json`` (:func:`record`): each process
(placer, agents, the GCS emulator) by pid, start time and boot id, and each agent's state
dir. Stopping needs nothing else (no token, no placer, no environment):

1. find: every recorded process that is still the very one recorded, with all its
   descendants (an agent's shim zygote, its shims, their workloads), plus every workload
   and shim the agents' state files name (again checked by pid, start time and boot id),
   which finds a workload whose agent already died;
2. freeze them (SIGSTOP) and look again until nothing new appears, so no process can
   start another between the look and the signal;
3. SIGTERM each (and its process group, when it leads one) and let it run again; what is
   still there after the grace period gets SIGKILL.

Agents leave workloads running when they stop, by design (an agent upgrade must not stop
training); the demo's stop is the place that ends them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import psutil

from agent import procs
from agent.state import StateCorrupt, read_state
from infra.durable import atomic_write

RECORD = "demo.json"
GRACE_S = 10.0


def record(root: Path, pids: Iterable[tuple[str, int]], agent_dirs: Iterable[Path]) -> Path:
    """Write ``root/demo.json``: the processes the demo started and the agents' state dirs."""
    boot = procs.boot_id()
    doc = {"version": 1,
           "procs": [{"name": name, "pid": pid, "start_time": procs.start_time(pid), "boot_id": boot}
                     for name, pid in pids],
           "agent_dirs": [str(d) for d in agent_dirs]}
    path = Path(root) / RECORD
    atomic_write(path, json.dumps(doc, indent=1).encode(), 0o644)
    return path


def _identities(root: Path) -> tuple[list[tuple[int, int | None, str | None]], list[Path]]:
    """(pid, start time, boot id) of each recorded process and each workload and shim the
    agents' state files name; the agents' state dirs."""
    path = Path(root) / RECORD
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: is {root} a `herd demo --workdir` (or the dir it printed)?") \
            from None
    out = [(int(p["pid"]), p.get("start_time"), p.get("boot_id")) for p in doc.get("procs", [])]
    dirs = [Path(d) for d in doc.get("agent_dirs", [])]
    for d in dirs:
        for f in d.rglob("state.json"):
            try:
                st = read_state(f.parent)   # the snapshot and its log
            except (OSError, StateCorrupt):
                continue
            for r in st.records:
                out.append((r.pid or 0, r.start_time, r.boot_id))
                out.append((r.shim_pid or 0, r.shim_start_time, r.boot_id))
    return out, dirs


def _alive(pid: int) -> psutil.Process | None:
    try:
        p = psutil.Process(pid)
        return None if p.status() == psutil.STATUS_ZOMBIE else p
    except psutil.Error:
        return None


def find(root: Path) -> dict[int, psutil.Process]:
    """Every live process of the demo under ``root`` (see the module doc, step 1)."""
    found: dict[int, psutil.Process] = {}
    ids, _ = _identities(root)
    for pid, started, boot in ids:
        if not procs.same_process(pid, started, boot):
            continue
        p = _alive(pid)
        if p is None:
            continue
        found[pid] = p
        try:
            for c in p.children(recursive=True):
                found.setdefault(c.pid, c)
        except psutil.Error:
            pass
    return found


def _signal(ps: Iterable[psutil.Process], sig: int) -> None:
    for p in ps:
        try:
            if os.getpgid(p.pid) == p.pid:   # a group leader: its group (a workload's children)
                os.killpg(p.pid, sig)
            p.send_signal(sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def stop(root: Path, grace_s: float = GRACE_S) -> tuple[int, int]:
    """Stop every process of the demo under ``root``: (how many were stopped, how many
    needed SIGKILL)."""
    found = find(root)
    frozen: dict[int, psutil.Process] = {}
    for _ in range(5):   # freeze, then look again: nothing can start a process unseen
        new = [p for pid, p in found.items() if pid not in frozen]
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        frozen.update((p.pid, p) for p in new)
        for p in new:
            try:
                for c in p.children(recursive=True):
                    found.setdefault(c.pid, c)
            except psutil.Error:
                pass
    everyone = list(found.values())
    _signal(everyone, signal.SIGTERM)
    _signal(everyone, signal.SIGCONT)
    _, left = psutil.wait_procs(everyone, timeout=grace_s)
    if left:
        _signal(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=5)
    return len(everyone), len(left)


def stop_demo(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    try:
        n, killed = stop(root)
    except FileNotFoundError as e:
        from .main import CliError
        raise CliError(str(e)) from None
    print(f"stopped {n} processes of the demo under {root}" + (f" ({killed} after SIGKILL)" if killed else ""))
    return 0
