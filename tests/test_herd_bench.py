"""bench.herd, small and fast (3 nodes, 8 MiB), on real tbf-shaped namespace links.
Skips unless root, iproute2 and tbf are there. Checks what the bench reports and that
it leaves nothing behind; it asserts no timing (performance lives in bench/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _namespaces() -> set[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


@pytest.mark.slow
@pytest.mark.root
def test_small_herd_bench_in_namespaces() -> None:
    from bench.netns import NetnsUnavailable, check

    try:
        check()
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    proc = subprocess.Popen([sys.executable, "-m", "bench.herd", "--nodes", "3", "--size-mb", "8", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout)
    for key in ("nodes", "size_mb", "herd_completion_over_ideal", "herd_origin_egress_over_size",
                "origin_only_completion_over_ideal", "origin_only_origin_egress_over_size", "herd_speedup"):
        assert key in out
    assert out["nodes"] == 3 and out["size_mb"] == 8
    # bytes, not speed: the herd pulls one copy from the origin, origin-only pulls N
    assert out["herd_origin_egress_over_size"] == 1.0
    assert out["origin_only_origin_egress_over_size"] == 3.0
    assert out["herd_bytes_from_peers"] == 2 * out["bytes"]
    # each node's CPU-s, and the machine's load beside the figures
    assert len(out["herd_node_cpu_s"]) == 3 and all(v > 0 for v in out["herd_node_cpu_s"].values())
    assert len(out["loadavg_before"]) == 3 and len(out["loadavg_after"]) == 3
    # everything it made (namespaces named hb<its pid>-...) is gone; others' are none of its business
    assert not {n for n in _namespaces() if n.startswith(f"hb{proc.pid}-")}


def test_bench_refuses_bad_arguments() -> None:
    r = subprocess.run([sys.executable, "-m", "bench.herd", "--nodes", "0"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--nodes" in r.stderr
