"""GPU health poll benchmark.

    python -m bench.gpus [--json] [--polls 300] [--seconds 5]

What one full health poll of 8 GPUs costs (target: well under 50 ms, so a 1 s poll
interval costs under 5% of one core):

- ``sim_poll``: the simulated backend's raw poll of a dgx-h100 (8 GPUs).
- ``sim_full``: that poll + host readings + classification of every GPU + the
  snapshot rebuild (what the monitor's owner does per poll).
- ``nvml_fake_poll``: the NVML backend's poll over testing/fake_pynvml.py (8 H100s,
  18 NVLinks each: ~700 NVML calls, every one through the backend's error handling).
- ``nvml_fake_full``: that + host readings + classification + snapshot.
- ``monitor_poll``: the poll time the running GpuMonitor records (worker-thread hop
  included), simulated dgx-h100 at a 10 ms interval.
- ``nvml_real_poll``: the real NVML backend's poll, where this host has a driver.
- baseline ``bare_calls``: a bare loop of the same number of fake NVML calls with
  no backend around them; ``nvml_overhead_ratio`` = nvml_fake_poll / bare_calls.

A real NVML call is a C call into the driver (microseconds to tens of
microseconds, more on a busy GPU); the fake measures our own per-call overhead.
Reported: p50 / p99 / mean in ms. Every loop is bounded by ``--polls`` and ``--seconds``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": round(pct(xs, 0.5) * 1e3, 4), "p99_ms": round(pct(xs, 0.99) * 1e3, 4),
            "mean_ms": round(statistics.fmean(xs) * 1e3, 4) if xs else float("nan")}


def timed(fn: Any, polls: int, seconds: float) -> list[float]:
    fn()  # warm
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(out) < polls and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def full_cycle(backend: Any) -> Any:
    """A monitor whose discovery is done, and a callable doing one full poll cycle in-line
    (backend poll + host readings + apply + classify + snapshot), without threads."""
    from agent.gpus import GpuMonitor
    from agent.gpus.backend import Discovery
    from agent.gpus.monitor import _GpuState

    mon = GpuMonitor(backend, kernel_log=False)
    disc: Discovery = backend.discover()
    mon._discovery = disc
    mon._gpus = {g.uuid: _GpuState(info=g) for g in disc.gpus}

    def cycle() -> None:
        samples, host = mon._poll_blocking()
        mon._apply_poll(samples, host, time.time())
        mon._rebuild()

    return mon, cycle


def bench_monitor(polls: int, seconds: float) -> list[float]:
    import trio

    from agent.gpus import GpuMonitor, open_backend
    from testing.waiting import poll

    mon = GpuMonitor(open_backend("simulated:dgx-h100", hostname="bench"), poll_interval_s=0.01,
                     kernel_log=False)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(mon.run)
            with trio.move_on_after(seconds):   # the monitor counts its polls; it has no event for them
                await poll(lambda: mon.statistics()["polls"] >= polls, 0.05)
            n.cancel_scope.cancel()

    trio.run(main)
    return [x / 1e3 for x in mon._poll_ms]


def real_nvml(polls: int, seconds: float) -> dict[str, Any] | None:
    """The real NVML backend's poll where this host has a driver (None elsewhere)."""
    from agent.gpus import GpuBackendError, open_backend

    try:
        b = open_backend("nvml", hostname="bench")
        d = b.discover()
    except GpuBackendError as e:
        return {"unavailable": str(e)}
    try:
        return {"gpus": len(d.gpus), "model": d.gpus[0].name, **summary(timed(b.poll, polls, seconds))}
    finally:
        b.close()


def run(polls: int, seconds: float) -> dict[str, Any]:
    from agent.gpus import open_backend
    from testing.fake_pynvml import h100_node

    res: dict[str, Any] = {"gpus": 8}
    sim = open_backend("simulated:dgx-h100", hostname="bench")
    sim.discover()
    res["sim_poll"] = summary(timed(sim.poll, polls, seconds))
    _, cyc = full_cycle(open_backend("simulated:dgx-h100", hostname="bench"))
    res["sim_full"] = summary(timed(cyc, polls, seconds))

    fake = h100_node(8)
    nv = open_backend("nvml", hostname="bench", nvml_module=fake)
    nv.discover()
    before = fake.calls
    nv.poll()
    calls = fake.calls - before
    res["nvml_calls_per_poll"] = calls
    res["nvml_fake_poll"] = summary(timed(nv.poll, polls, seconds))
    fake2 = h100_node(8)
    _, cyc2 = full_cycle(open_backend("nvml", hostname="bench", nvml_module=fake2))
    res["nvml_fake_full"] = summary(timed(cyc2, polls, seconds))

    h = fake.handles[0]
    f = fake.nvmlDeviceGetTemperature

    def bare() -> None:
        for _ in range(calls):
            f(h, 0)

    res["bare_calls"] = summary(timed(bare, polls, seconds))
    res["nvml_overhead_ratio"] = round(res["nvml_fake_poll"]["p50_ms"] / res["bare_calls"]["p50_ms"], 2)
    res["monitor_poll"] = summary(bench_monitor(min(polls, 200), seconds))
    res["nvml_real_poll"] = real_nvml(polls, seconds)
    res["target_ms"] = 50.0
    res["worst_full_p99_over_target"] = round(
        max(res["sim_full"]["p99_ms"], res["nvml_fake_full"]["p99_ms"]) / 50.0, 4)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpus")
    p.add_argument("--json", action="store_true")
    p.add_argument("--polls", type=int, default=300)
    p.add_argument("--seconds", type=float, default=5.0, help="time bound per measurement")
    a = p.parse_args(argv)
    res = run(a.polls, a.seconds)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"GPU health poll, {res['gpus']} GPUs ({res['nvml_calls_per_poll']} fake NVML calls per nvml poll)")
    print(f"{'measure':<16} {'n':>5} {'p50 ms':>10} {'p99 ms':>10} {'mean ms':>10}")
    for k in ("sim_poll", "sim_full", "nvml_fake_poll", "nvml_fake_full", "monitor_poll", "bare_calls"):
        s = res[k]
        print(f"{k:<16} {s['n']:>5} {s['p50_ms']:>10.3f} {s['p99_ms']:>10.3f} {s['mean_ms']:>10.3f}")
    real = res["nvml_real_poll"]
    if real and "p50_ms" in real:
        print(f"real NVML poll: {real['gpus']}x {real['model']}: p50 {real['p50_ms']:.3f} ms, "
              f"p99 {real['p99_ms']:.3f} ms")
    else:
        print(f"real NVML: {real['unavailable'] if real else 'n/a'}")
    print(f"nvml backend / bare fake calls (p50): {res['nvml_overhead_ratio']}x; "
          f"worst full-poll p99 / 50 ms target: {res['worst_full_p99_over_target']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
