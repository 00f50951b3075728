"""The simulator (fleets, job stream, replay), its CLI, and a smoke run of bench/placer.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from placer import ClusterModel, InvalidSpec
from placer.queue import JobQueue
from placer.sim import FLEETS, build_fleet, fill, job_stream, replay, saturate

ROOT = Path(__file__).resolve().parent.parent


def test_fleet_shapes_are_whole_racks_with_the_right_nvlink_domains() -> None:
    h = build_fleet("h100", 300)                     # rounds up to 2 racks of 32 x 8
    assert len(h) == 64 and {s.n_gpus for s in h} == {8} and all(s.nvlink_domain is None for s in h)
    g = build_fleet("gb200", 100)                    # 2 NVL72 racks of 18 x 4
    assert len(g) == 36 and {s.n_gpus for s in g} == {4}
    m = ClusterModel.build(g)
    st = m.statistics()["levels"]
    assert st["nvlink"]["domains"] == st["rack"]["domains"] == 2
    assert FLEETS["h100"].zone_gpus == 262_144 and abs(FLEETS["gb200"].zone_gpus - 262_144) < 1152
    with pytest.raises(InvalidSpec):
        build_fleet("tpu", 8)
    with pytest.raises(InvalidSpec):
        build_fleet("h100", 0)


def test_job_stream_is_deterministic_and_in_range() -> None:
    a = job_stream("h100", 300, seed=3, fleet_gpus=1 << 20)
    b = job_stream("h100", 300, seed=3, fleet_gpus=1 << 20)
    c = job_stream("h100", 300, seed=4, fleet_gpus=1 << 20)
    assert a == b and a != c
    sizes = [j.request.pods * j.request.gpus_per_pod for j in a]
    assert 1 <= min(sizes) and max(sizes) <= 200_000
    assert all(j.request.within in ("node", "rack", "block", "zone", "any") for j in a)
    assert {j.request.priority for j in a} <= {0, 1, 2}
    arrivals = [j.arrival for j in a]
    assert arrivals == sorted(arrivals)


def test_fill_and_saturate() -> None:
    m = ClusterModel.build(build_fleet("h100", 4096))
    fill(m, "h100", 0.7, seed=1)
    used = 1 - int(m.free.sum()) / 4096
    assert 0.7 <= used <= 0.9
    saturate(m)
    assert int(m.free.sum()) == 0
    m.check_invariants()


def test_replay_is_deterministic_and_leaves_a_clean_model() -> None:
    def run() -> tuple[dict, ClusterModel]:
        m = ClusterModel.build(build_fleet("h100", 2048))
        jobs = job_stream("h100", 150, seed=9, fleet_gpus=2048, load=1.2)
        rep = replay(m, jobs, queue=JobQueue(reserve_after_rounds=4), frag_every=50)
        return rep, m
    r1, m1 = run()
    r2, _ = run()
    keys = ("placed", "completed", "preempted", "pending_at_end", "utilisation_mean", "utilisation_steady",
            "queue_delay_s")
    assert {k: r1[k] for k in keys} == {k: r2[k] for k in keys}
    assert r1["completed"] == r1["jobs"] == 150 and r1["pending_at_end"] == 0
    assert r1["placed"] == 150 + r1["preempted"]
    assert 0.0 < r1["utilisation_mean"] <= 1.0
    assert not m1.jobs and int(m1.free.sum()) == 2048
    m1.check_invariants()


async def _run(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(120):
        return await trio.run_process([sys.executable, *args], cwd=ROOT, capture_stdout=True,
                                      capture_stderr=True, check=False)


async def test_sim_cli_prints_one_json_object_and_refuses_bad_flags() -> None:
    p = await _run("-m", "placer.sim", "--gpus", "1024", "--jobs", "60", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["gpus"] == 1024 and rep["jobs"] == 60 and rep["decision_ms"]["n"] > 0
    p = await _run("-m", "placer.sim", "--gpus", "0")
    assert p.returncode == 2 and b"--gpus" in p.stderr
    p = await _run("-m", "placer.sim", "--fleet", "tpu")
    assert p.returncode == 2 and b"invalid choice" in p.stderr


async def test_bench_placer_smoke_json_keys() -> None:
    p = await _run("-m", "bench.placer", "--gpus", "4096", "--reps", "3", "--naive-jobs", "10", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    for k in ("gpus", "p99_ms_le_1024", "p99_ms_200k", "p99_ms_preempt", "naive_ratio", "rss_mb"):
        assert k in out, k
    assert 0 < out["naive"]["placed"] <= out["naive"]["jobs"] == 10 and out["naive_ratio"] > 0
    p = await _run("-m", "bench.placer", "--gpus", "10")
    assert p.returncode == 2
