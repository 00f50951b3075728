"""``python -m agent.gpus.probe [--gpus nvml] [--seconds 5]``: discover, then run the
monitor's poll and event loops for a few seconds and print one JSON object: the
snapshot at start and end, every health change seen, and the monitor statistics.
Meant for a first look at a real GPU host (bench/nvml_probe.sh)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import trio

from . import GpuBackendError, GpuMonitor, open_backend


async def _probe(spec: str, seconds: float, poll_interval: float) -> dict[str, object]:
    backend = open_backend(spec)
    mon = GpuMonitor(backend, poll_interval_s=poll_interval)
    changes: list[object] = []
    t0 = time.perf_counter()
    async with trio.open_nursery() as n:
        first = await n.start(mon.run)
        discovered_s = time.perf_counter() - t0
        rx = mon.subscribe()

        async def watch() -> None:
            async for snap in rx:
                changes.append({"at": snap.taken_at, "gpus": [
                    {"uuid": g.uuid, "health": g.health, "reasons": [r.code for r in g.reasons]} for g in snap.gpus]})

        n.start_soon(watch)
        await trio.sleep(seconds)
        last = mon.snapshot()
        stats = mon.statistics()
        n.cancel_scope.cancel()
    return {"spec": spec, "discovery_s": round(discovered_s, 3), "seconds": seconds,
            "first": msgspec.to_builtins(first), "last": msgspec.to_builtins(last),
            "health_changes": changes, "statistics": stats}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m agent.gpus.probe")
    p.add_argument("--gpus", default="nvml")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--poll-interval", type=float, default=0.5)
    a = p.parse_args(argv)
    try:
        out = trio.run(_probe, a.gpus, a.seconds, a.poll_interval)
    except GpuBackendError as e:
        print(json.dumps({"spec": a.gpus, "error": str(e)}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
