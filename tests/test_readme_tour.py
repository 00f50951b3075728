"""README.md's five-minute tour, run as written: its steps (publish, submit, watch, preempt,
upgrade) are read from the README's tour block and run by bash, one step at a time, against a
real local cluster of the demo's shape (a placer and 4 agent processes with simulated dgx-h100
GPUs in 2 racks of one block, mutual TLS with a throwaway CA, a file:// origin), with the
environment the demo's ``--keep`` exports. What each step must leave behind is asserted from the
placer's and the agents' own answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cli.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

STEP = re.compile(r"^# (\d)\. ")


def tour_steps(readme: str) -> dict[int, str]:
    """The tour block (the last code block of "## A five-minute tour"), split at its
    ``# N. ...`` comment lines: step number -> the bash text of that step."""
    section = readme.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 2, "the tour section has a set-up block and the tour block"
    assert "herd demo --keep" in blocks[0] and "HERD_ORIGIN=" in blocks[0]
    steps: dict[int, list[str]] = {}
    current = 0
    for line in blocks[1].splitlines():
        m = STEP.match(line)
        if m:
            current = int(m.group(1))
        steps.setdefault(current, []).append(line)
    return {n: "\n".join(lines) for n, lines in steps.items()}


def test_the_tour_block_has_its_steps() -> None:
    steps = tour_steps((ROOT / "README.md").read_text())
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert "herd artifact publish" in steps[1] and "herd job submit" in steps[2]
    assert "herd job logs" in steps[3] and "--priority 100" in steps[4] and "hello:v2" in steps[5]


class Tour:
    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd, self.env = cwd, env

    def bash(self, script: str, timeout: float = 120) -> str:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.cwd, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, f"{script}\n--- stdout\n{r.stdout[-2000:]}\n--- stderr\n{r.stderr[-2000:]}"
        return r.stdout

    def job(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.bash(f"herd job show {job_id} --json"))
        return out

    def until(self, what: str, fn: Any, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = fn()
            if v:
                return v
            assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
            time.sleep(0.3)

    def log_has(self, job_id: str, rank: int, text: str) -> bool:
        return text in self.bash(f"herd job logs {job_id} --rank {rank}")


def test_readme_tour(tmp_path: Path, token_dir: Path) -> None:
    steps = tour_steps((ROOT / "README.md").read_text())
    origin = tmp_path / "origin"
    origin.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    t0 = time.monotonic()
    with LocalCluster(tmp_path / "cluster", token_dir, n_agents=4, racks=2, heartbeat_s=0.5, fence_after_s=10.0,
                      origins=(origin.as_uri(),), tls=True) as c:
        assert c.placer is not None and c.pki is not None
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "PYTHONPATH": str(ROOT), "HERD_PLACER": c.placer.url, "HERD_TOKEN_DIR": str(token_dir),
               "HERD_TLS_DIR": str(c.pki.dir), "SSL_CERT_FILE": str(c.pki.ca), "HERD_ORIGIN": origin.as_uri()}
        for k in ("HERD_AGENT", "STORAGE_EMULATOR_HOST"):
            env.pop(k, None)
        tour = Tour(work, env)
        tour.until("4 nodes up", lambda: sum(n["state"] == "up" for n in json.loads(
            tour.bash("herd nodes --json"))["nodes"]) == 4)

        # 1. publish: the ref names a manifest in the origin
        tour.bash(steps[1])
        assert (origin / "refs" / "hello:v1").is_file()

        # 2. submit: the gang runs, 2 pods of 8 GPUs in one rack
        tour.bash(steps[2])
        hello = tour.job("hello")
        assert hello["state"] == "running" and len(hello["pods"]) == 2
        assert all(len(p["gpus"]) == 8 for p in hello["pods"])

        # 3. watch: the step's commands answer; each rank's output reaches its log
        tour.bash(steps[3])
        tour.until("rank 1's line in its log", lambda: tour.log_has("hello", 1, "rank 1 of 2 on GPU-"))
        assert tour.log_has("hello", 1, ": v1")

        # 4. preempt: urgent took the whole block, hello was preempted and requeued; once
        # urgent is cancelled, hello runs again by itself
        out = tour.bash(steps[4], timeout=180)
        assert "preempted" in out or "pending" in out, out
        back = tour.until("hello running again", lambda: (j := tour.job("hello"))["state"] == "running" and j)
        assert back["restarts"] >= 1
        assert tour.job("urgent")["state"] == "cancelled"

        # 5. upgrade: v2 published beside v1, the gang runs on it
        tour.bash(steps[5], timeout=180)
        v2 = tour.job("hello-v2")
        assert v2["state"] == "running" and v2["spec"]["manifest_id"] == (origin / "refs" / "hello:v2").read_text().strip()
        tour.until("v2 in rank 0's log", lambda: tour.log_has("hello-v2", 0, ": v2"))
        # every node held v1 (urgent ran it on all four): each fetched only the changed chunk
        moved = sum(p["fetch"].get("bytes_from_origin", 0) + p["fetch"].get("bytes_from_peers", 0)
                    for p in v2["pods"])
        tree = sum(f.stat().st_size for f in (work / "hello").iterdir())
        assert 0 < moved <= len(v2["pods"]) * (work / "hello" / "VERSION").stat().st_size < len(v2["pods"]) * tree
    assert time.monotonic() - t0 < 300, "the tour takes a new user at most five minutes"
