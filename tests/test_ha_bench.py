"""``python -m bench.failover`` at a tiny size (skipped where ``etcd`` is absent): its JSON has
the figures it promises and the invariants hold (no job lost, nothing placed twice, the gang
kept running, nothing stopped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing.etcd import ETCD

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(ETCD is None, reason="etcd absent (Debian package etcd-server)")
def test_failover_bench_small() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.failover", "--nodes", "64", "--recover-s", "3", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    ha, single = out["rows"]
    assert (ha["mode"], single["mode"]) == ("ha-3-placers", "single-placer-restart")
    for row in (ha, single):
        assert row["probe_state"] == "running" and 0 < row["failover_s"] < 60
        assert row["jobs_lost"] == 0 and row["placements_doubled"] == 0 and row["stops"] == 0
        assert row["gang_running"] == 32 and row["refused_acks"] == 0
    assert ha["promoted_s"] > 0 and single["promoted_s"] is None
    assert ha["leader_kept"] is True and "leader_kept" not in single


@pytest.mark.skipif(ETCD is None, reason="etcd absent (Debian package etcd-server)")
def test_failover_bench_paused_leader() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.failover", "--pause-agents", "2", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout)["rows"][0]
    assert row["mode"] == "leader-paused" and row["agents"] == 2
    assert 0 < row["promoted_s"] <= row["agents_moved_s"] and row["leader_moves"] >= 2
