"""bench.herd_sim's model, small: the byte accounting it reports follows from the
homes rendezvous.py assigns (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.herd_sim import simulate


def test_rack_aware_herd_crosses_into_each_rack_about_once() -> None:
    r = simulate(64, 64, 1, 8, 100, 100, 4)
    assert r["racks"] == 8 and r["herd_origin_egress_over_size"] == 1.0
    # each rack receives every chunk once, except those homed inside it
    assert r["cross_rack_in_per_rack_over_size"] == pytest.approx(7 / 8, abs=1e-9)
    assert r["cross_rack_in_per_rack_max_over_size"] <= 1.0
    # a flat herd pulls each chunk into a rack once per node there
    assert r["flat_cross_rack_in_per_rack_over_size"] > 6
    assert r["origin_only_completion_over_ideal"] >= 64
    assert r["herd_completion_over_ideal"] < r["flat_herd_completion_over_ideal"]


def test_single_rack_and_cli_json() -> None:
    r = simulate(4, 16, 1, 32, 10, 10, 1)
    assert r["racks"] == 1 and r["cross_rack_in_per_rack_over_size"] == 0.0
    out = subprocess.run([sys.executable, "-m", "bench.herd_sim", "--nodes", "8,32", "--size-mb", "32",
                          "--chunk-mb", "1", "--json"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [x["nodes"] for x in rows] == [8, 32]
    bad = subprocess.run([sys.executable, "-m", "bench.herd_sim", "--nodes", "0"], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode == 2 and "--nodes" in bad.stderr
