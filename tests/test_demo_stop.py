"""`herd demo --keep` ends with one command that stops everything it started, workloads
included: the demo runs under a helper process that is a child subreaper (every process
the demo starts, orphaned or not, stays its descendant), the printed `herd demo stop DIR`
runs with a bare environment, and no descendant may be left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")]

HELPER = r'''
import ctypes, json, os, subprocess, sys, time
import psutil

PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    print(json.dumps({"skip": "no child subreaper"}))
    sys.exit(0)
workdir, herd = sys.argv[1], sys.argv[2]


def descendants():
    while True:   # reap what ended (orphans are ours now), then list the live ones
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.cmdline()))
        except psutil.Error:
            pass
    return out


env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
demo = subprocess.run([herd, "demo", "--keep", "--workdir", workdir], capture_output=True, text=True,
                      timeout=240, env=env)
before = descendants()
lines = [ln.strip() for ln in demo.stderr.splitlines() if ln.strip().startswith("herd demo stop ")]
stop = None
if lines:
    bare = {"PATH": os.path.dirname(herd) + ":/usr/bin:/bin"}   # none of the demo's environment
    stop = subprocess.run(lines[-1].split(), capture_output=True, text=True, timeout=120, env=bare)
after = descendants()
for _ in range(50):   # bounded: a process that got SIGKILL is reaped within moments
    if not after:
        break
    time.sleep(0.1)
    after = descendants()
for p in psutil.Process().children(recursive=True):   # never leave anything behind, even on failure
    try:
        p.kill()
    except psutil.Error:
        pass
print(json.dumps({"demo_rc": demo.returncode, "demo_err": demo.stderr[-3000:], "stop_line": lines,
                  "stop_rc": stop.returncode if stop else None, "stop_out": (stop.stdout + stop.stderr) if stop else "",
                  "before": before, "after": after}))
'''


def test_demo_stop_from_a_bare_shell_leaves_no_process(tmp_path: Path) -> None:
    herd = Path(sys.executable).parent / "herd"
    if not herd.exists():
        pytest.skip("the herd entry point is not installed next to this interpreter")
    r = subprocess.run([sys.executable, "-c", HELPER, str(tmp_path / "demo"), str(herd)], capture_output=True,
                       text=True, timeout=420, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["demo_rc"] == 0, out["demo_err"]
    assert out["stop_line"] == [f"herd demo stop {tmp_path / 'demo'}"]
    # what --keep left running: the placer, the agents, their shim zygotes and the workloads
    assert any("train.py" in c for c in out["before"]), out["before"]
    assert any("--zygote" in c for c in out["before"]), out["before"]
    assert any("placer run" in c for c in out["before"]), out["before"]
    assert out["stop_rc"] == 0, out["stop_out"]
    assert out["after"] == [], out["after"]
    # the running trainers were stopped gracefully (SIGTERM first, no preemption notice)
    finals = [json.loads(f.read_text()) for f in (tmp_path / "demo").rglob("scratch/final.json")]
    assert any(f["reason"] == "sigterm" for f in finals), finals
