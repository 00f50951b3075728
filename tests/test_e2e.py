"""The demo's whole flow, end to end, asserted: a placer, 4 agent processes with
simulated GPUs, the GCS emulator (or file://) as origin, real workloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_demo_flow(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("STORAGE_EMULATOR_HOST", None)
    r = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--json", "--workdir", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    # derived from what every node's GPU backend reported, not a constant of the demo
    assert out["simulated_gpus"] is True and len(out["nodes"]) == 4 and all(n["simulated"] for n in out["nodes"])

    # the 16-GPU job within one rack, on 16 distinct GPUs
    a = out["job_a"]
    assert len(a["gpus"]) == 16 and len(set(a["gpus"])) == 16
    assert len(a["racks"]) == 1 and len(a["nodes"]) == 2
    assert all(g.startswith("GPU-sim-") for g in a["gpus"])  # simulated GPUs are never passed off as real

    # the 32-GPU job within the block took every GPU, each once, and preempted A
    b = out["job_b"]
    assert len(b["gpus"]) == 32 and len(set(b["gpus"])) == 32 and len(b["nodes"]) == 4
    assert out["job_a_preempted"]["restarts"] >= 1

    # origin egress for the first fetch is about one copy however many nodes fetched
    v1_bytes = out["publish_v1"]["bytes"]
    assert a["fetch"]["bytes_from_origin"] <= 1.05 * v1_bytes
    assert a["fetch"]["bytes_from_origin"] + a["fetch"]["bytes_from_peers"] + a["fetch"]["bytes_local"] == 2 * v1_bytes
    assert b["fetch"]["bytes_from_origin"] == 0  # B's nodes had A's bytes or got them from peers

    # every victim wrote its final checkpoint on SIGTERM, before its exit was reported
    cps = out["job_a_preempted"]["final_checkpoints"]
    pods = {p["workload"]: p for p in out["job_a_preempted"]["pods"]}
    assert len(cps) == 2
    for c in cps:
        assert c["final"] is True and c["reason"] == "preempted"
        ended = pods[c["workload"]]["ended_at"]
        assert ended is not None and c["time"] <= ended

    # B finished by itself; A came back on v2 with a delta fetch smaller than the whole
    assert out["job_b_done"]["state"] == "succeeded"
    a2 = out["job_a_v2"]
    assert a2["state"] == "running" and a2["manifest"] == out["publish_v2"]["manifest"]
    moved = a2["fetch"]["bytes_from_origin"] + a2["fetch"]["bytes_from_peers"]
    assert 0 < moved < out["publish_v2"]["bytes"]
    assert a2["fetch"]["bytes_from_origin"] <= out["publish_v2"]["bytes_uploaded"] * 1.05
    assert len(set(a2["gpus"])) == 16 and len(a2["racks"]) == 1
