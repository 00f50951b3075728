"""The control plane at fleet scale: the real placer process against an emulated fleet.

    python -m bench.fleet --nodes 4096,16384,131072 --gang-gpus G [--fleet h100] [--json]

Per row (N nodes), with a fresh ``herd placer run`` subprocess (framed channel on) and
``ceil(N / --per-proc)`` emulator processes (``python -m testing.fleet``: real AgentLinks,
a fake supervisor, simulated GPUs; see that module):

- ``register_s``: every node registering at once, as after a placer restart (every node
  knows the framed channel; reports multiplexed over ``--mux`` connections per emulator
  process), from ``go`` until the placer's ``GET /v1/cluster`` counts N nodes ``up``;
  ``register_placer_cpu_s``: the placer's own CPU time (``/proc/<pid>/stat``) meanwhile.
- fill: jobs drawn from placer/sim.py's job mix (priority 0, preemptible), submitted with
  ``POST /v1/jobs`` until ~``--fill`` of the GPUs are asked for (bounded in jobs and
  time); ``fill_running`` is how many run when the fill wait ends.
- ``decide_small_p50_ms`` / ``decide_small_p99_ms``: ``--probe`` gangs of 1-1,024 GPUs submitted
  one at a time on the filled fleet, ``submitted`` -> ``decided`` (each cancelled once decided;
  the decision overlaps the journal's fsync, and its placements wait for it).
- the big gang (``--gang-gpus``, priority 2, not preemptible, shaped as sim.py shapes it):
  ``decide_ms`` (the job's ``submitted`` -> ``decided`` timings), ``bookkeeping_ms``
  (``decided`` -> ``pushed``), ``acked_ms`` (``pushed`` -> ``acked``),
  ``running_after_last_event_ms`` (the last pod event the emulators sent -> the job's
  ``running`` timing; one clock, one machine), ``events_per_s`` (the gang's events over
  first event sent -> ``running``; paced by the emulated delays ``--fetch-delay`` and
  ``--run-delay`` when those dominate, so read it with them).
- ``direct_refusals``: registrations the placer refused past its ``direct_max_nodes`` (every
  node here reports directly, no rack relays; ``--direct-max-nodes 0`` lifts the limit to
  measure the direct path past it).
- ``steady_placer_cpu_frac``: placer CPU over ``--steady-s`` of steady heartbeats (every
  ``--heartbeat`` s), then its RSS and open descriptors.

Baseline in the same run (``--baseline``, on by default): the path that still exists —
registration over one HTTP ``POST /v1/nodes/{id}/report`` per node (no framed channel
known), against a fresh placer, stopped after ``--baseline-limit`` s (60) and reported as
how far it got.

Every wait is bounded; every load loop is bounded in count and time; traffic stays on
127.0.0.1. ``GET /v1/jobs/{id}`` is read sparingly (long-polls, ``pods=0:0`` asked for).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from testing.harness import (  # noqa: E402
    EmulatorProc,
    PlacerOptions,
    PlacerProc,
    nodes_up,
    wait_nodes_up,
    wait_recovered,
)


@dataclass(frozen=True, slots=True)
class Args:
    fleet: str
    gang_gpus: int | None
    fill: float
    per_proc: int
    mux: int
    heartbeat_s: float
    register_limit_s: float
    fill_max_jobs: int
    fill_limit_s: float
    gang_limit_s: float
    steady_s: float
    baseline: bool
    baseline_limit_s: float
    seed: int
    placer_root: Path
    fetch_delay_s: float = 0.2
    run_delay_s: float = 0.3
    jobs: bool = True                # False: registration and steady heartbeats only
    probe: int = 50                  # small gangs decided one at a time on the filled fleet
    direct_max_nodes: int | None = None   # the placer's [placer] direct_max_nodes (None: its default)


def _jobs_mix(fleet: str, fleet_gpus: int, target: float, seed: int, max_jobs: int) -> list[dict[str, Any]]:
    """JobSpecs from placer/sim.py's stream until ``target`` of the GPUs are asked for."""
    from placer.sim import job_stream

    goal = int(target * fleet_gpus)
    asked = 0
    out: list[dict[str, Any]] = []
    i = 0
    while asked < goal and len(out) < max_jobs and i < 50 * max_jobs:
        for sj in job_stream(fleet, 512, seed=seed * 7919 + i, fleet_gpus=fleet_gpus):
            r = sj.request
            size = r.pods * r.gpus_per_pod
            if size > goal - asked + r.gpus_per_pod:
                continue
            out.append({"job_id": f"fill-{len(out):06d}", "pods": r.pods, "gpus_per_pod": r.gpus_per_pod,
                        "within": r.within, "priority": 0, "preemptible": True, "argv": ["fill"],
                        "grace_s": 1.0})
            asked += size
            if asked >= goal or len(out) >= max_jobs:
                break
        i += 512
    return out


def _gang_spec(fleet: str, gpus: int) -> dict[str, Any]:
    from placer.sim import fleet_shape, shape_job

    r = shape_job(fleet_shape(fleet), "big", gpus, priority=2, preemptible=False)
    return {"job_id": "big", "pods": r.pods, "gpus_per_pod": r.gpus_per_pod, "within": r.within,
            "priority": 2, "preemptible": False, "argv": ["train"], "grace_s": 1.0}


async def _submit_all(c: httpx.AsyncClient, url: str, op: dict[str, str], specs: list[dict[str, Any]],
                      limit_s: float) -> tuple[int, int]:
    """POST every spec (16 at a time), bounded by ``limit_s``: (accepted, refused)."""
    ok = bad = 0
    limiter = trio.CapacityLimiter(16)

    async def one(spec: dict[str, Any]) -> None:
        nonlocal ok, bad
        async with limiter:
            try:
                r = await c.post(f"{url}/v1/jobs", json=spec, headers=op)
                if r.status_code == 201:
                    ok += 1
                else:
                    bad += 1
            except httpx.HTTPError:
                bad += 1

    with trio.move_on_after(limit_s):
        async with trio.open_nursery() as n:
            for s in specs:
                n.start_soon(one, s)
    return ok, bad


async def _job_counts(c: httpx.AsyncClient, url: str) -> dict[str, int]:
    r = await c.get(f"{url}/v1/cluster", params={"detail": "0"})
    r.raise_for_status()
    return {k: int(v) for k, v in r.json().get("jobs", {}).items()}


async def _wait_fill(c: httpx.AsyncClient, url: str, n_jobs: int, limit_s: float) -> dict[str, int]:
    """Until every fill job runs, or nothing changed for 10 s, or ``limit_s``."""
    counts: dict[str, int] = {}
    last, since = None, trio.current_time()
    with trio.move_on_after(limit_s):
        while True:
            try:
                counts = await _job_counts(c, url)
            except (httpx.HTTPError, ValueError):
                pass
            if counts.get("running", 0) >= n_jobs:
                break
            key = tuple(sorted(counts.items()))
            if key != last:
                last, since = key, trio.current_time()
            elif trio.current_time() - since > 10:
                break
            await trio.sleep(0.5)
    return counts


async def _wait_job(c: httpx.AsyncClient, url: str, job_id: str, want: str, limit_s: float) -> dict[str, Any]:
    job: dict[str, Any] = {}
    with trio.move_on_after(limit_s):
        while True:
            r = await c.get(f"{url}/v1/jobs/{job_id}",
                            params={"wait": want, "timeout_ms": "30000", "pods": "0:0"})
            job = r.json()
            if job.get("state") in (want, "failed", "cancelled", "succeeded"):
                break
    return job


def _viewer(td: Path) -> dict[str, str]:
    """The placer's reads need the viewer role (scheduler_link.authz): the operator token holds it."""
    return {"authorization": f"Bearer {TokenSet.load(td).operator}"}


def _note(msg: str, **kw: Any) -> None:
    """Progress on stderr (stdout carries only the result)."""
    fields = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())
    print(f"[bench.fleet {time.strftime('%H:%M:%S')}] {msg} {fields}", file=sys.stderr, flush=True)


def _ms(t: dict[str, float], a: str, b: str) -> float:
    return (t[b] - t[a]) * 1000 if a in t and b in t else float("nan")


async def bench_row(n_nodes: int, a: Args, tmp: Path) -> dict[str, Any]:
    from placer.sim import fleet_shape

    fs = fleet_shape(a.fleet)
    gpus = n_nodes * fs.gpus_per_node
    td = generate_token_dir(tmp / "tokens")
    tok = TokenSet.load(td)
    op = {"authorization": f"Bearer {tok.operator}"}
    opts = PlacerOptions(heartbeat_s=a.heartbeat_s, fence_after_s=600.0, ack_timeout_s=30.0, recover_s=2.0,
                         direct_max_nodes=a.direct_max_nodes)
    row: dict[str, Any] = {"nodes": n_nodes, "gpus": gpus, "fleet": a.fleet, "load_before": os.getloadavg()[0]}
    procs = max(1, math.ceil(n_nodes / a.per_proc))
    async with AsyncExitStack() as stack:
        placer = await stack.enter_async_context(PlacerProc(tmp / "row", td, opts, root=a.placer_root))
        c = await stack.enter_async_context(httpx.AsyncClient(timeout=120, headers=_viewer(td)))
        emus: list[EmulatorProc] = []
        for k in range(procs):
            lo = k * n_nodes // procs
            hi = (k + 1) * n_nodes // procs
            emus.append(await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=hi - lo, offset=lo, fleet=a.fleet, mux=a.mux, root=a.placer_root,
                log_path=tmp / f"emu{k}.log", extra=["--fetch-delay", str(a.fetch_delay_s), "--run-delay", str(a.run_delay_s)])))
        row["emulator_procs"] = procs
        _note("fleet ready", nodes=n_nodes, emulators=procs, placer_pid=placer.pid,
              emulator_pids=",".join(str(e.pid) for e in emus))

        # -- registration, all at once
        cpu0 = placer.cpu_s()
        for e in emus:
            await e.go()
        up, reg_s = await wait_nodes_up(c, placer.url, n_nodes, limit_s=a.register_limit_s)
        row.update(registered=up, register_s=reg_s, register_placer_cpu_s=placer.cpu_s() - cpu0,
                   register_complete=up >= n_nodes, placer_fds_registered=placer.fds())
        stats = [await e.stats(c) for e in emus]
        row["wire_full_reports"] = sum(s["wire_full_reports"] for s in stats)
        row["http_full_reports"] = sum(s["full_reports"] - s["wire_full_reports"] for s in stats)
        # registrations the placer refused past direct_max_nodes (no relays here: every node direct)
        row["direct_refusals"] = await _counter(c, placer.url, "herd_placer_direct_refusals_total")
        _note("registered", up=up, s=reg_s, placer_cpu_s=row["register_placer_cpu_s"],
              direct_refusals=row["direct_refusals"])
        if up < n_nodes:
            row["placer_rss_mib"] = placer.rss_mib()
            return row
        if a.jobs:
            await _jobs_phase(row, a, c, placer, emus, op, gpus)

        # -- steady heartbeats
        await trio.sleep(min(a.heartbeat_s, 5.0))
        cpu0, w0 = placer.cpu_s(), trio.current_time()
        ecpu0 = sum(e.cpu_s() for e in emus)
        await trio.sleep(a.steady_s)
        dt = trio.current_time() - w0
        row.update(steady_placer_cpu_frac=(placer.cpu_s() - cpu0) / dt,
                   steady_emulator_cpu_frac=(sum(e.cpu_s() for e in emus) - ecpu0) / dt,
                   steady_up=await nodes_up(c, placer.url), placer_rss_mib=placer.rss_mib(),
                   placer_fds=placer.fds(), load_after=os.getloadavg()[0])
        _note("steady", placer_cpu_frac=row["steady_placer_cpu_frac"], rss_mib=row["placer_rss_mib"],
              fds=row["placer_fds"])
    return row


async def _jobs_phase(row: dict[str, Any], a: Args, c: httpx.AsyncClient, placer: PlacerProc,
                      emus: list[EmulatorProc], op: dict[str, str], gpus: int) -> None:
    """Fill with the sim mix, then the big gang; figures into ``row``."""
    # -- fill to ~75 % with the sim job mix (once the placer's post-restart wait is over)
    await wait_recovered(c, placer.url)
    specs = _jobs_mix(a.fleet, gpus, a.fill, a.seed, a.fill_max_jobs)
    t0 = trio.current_time()
    _note("filling", jobs=len(specs))
    ok, bad = await _submit_all(c, placer.url, op, specs, a.fill_limit_s)
    _note("fill submitted", ok=ok, refused=bad, s=trio.current_time() - t0)
    counts = await _wait_fill(c, placer.url, ok, max(1.0, a.fill_limit_s - (trio.current_time() - t0)))
    row.update(fill_jobs=ok, fill_refused=bad, fill_gpus_asked=sum(s["pods"] * s["gpus_per_pod"] for s in specs),
               fill_running=counts.get("running", 0), fill_counts=counts, fill_s=trio.current_time() - t0)

    _note("filled", counts=counts, s=row["fill_s"])

    # -- decisions through the service for gangs <= 1,024 GPUs, one at a time on the filled fleet
    await _decide_probe(row, a, c, placer.url, op)

    # -- the big gang
    g = a.gang_gpus or min(200_000, gpus // 5)
    spec = _gang_spec(a.fleet, g)
    row.update(gang_gpus=spec["pods"] * spec["gpus_per_pod"], gang_pods=spec["pods"], gang_within=spec["within"])
    cpu0, ecpu0 = placer.cpu_s(), sum(e.cpu_s() for e in emus)
    r = await c.post(f"{placer.url}/v1/jobs", json=spec, headers=op)
    if r.status_code != 201:
        row["gang_error"] = r.text[:200]
        return
    job = await _wait_job(c, placer.url, "big", "running", a.gang_limit_s)
    row["gang_placer_cpu_s"] = placer.cpu_s() - cpu0
    row["gang_emulator_cpu_s"] = sum(e.cpu_s() for e in emus) - ecpu0
    t = job.get("timings", {})
    row.update(gang_state=job.get("state", f"no answer within {a.gang_limit_s:.0f} s"),
               decide_ms=_ms(t, "submitted", "decided"), bookkeeping_ms=_ms(t, "decided", "pushed"), acked_ms=_ms(t, "pushed", "acked"),
               submit_to_running_ms=_ms(t, "submitted", "running"))
    if "pod_counts" in job:
        row["gang_pod_counts"] = job["pod_counts"]
    es = [await e.stats(c, "big") for e in emus]
    js = [s["job"] for s in es]
    row["placements_received"] = sum(s["placements"] for s in es)
    row["placement_mib_received"] = sum(s["placement_bytes"] for s in es) / (1 << 20)
    row["placement_bytes_max"] = max(s["placement_bytes_max"] for s in es)
    events = sum(j["events"] for j in js)
    first = min((j["first_at"] for j in js if j["events"]), default=0.0)
    last = max((j["last_at"] for j in js if j["events"]), default=0.0)
    row["gang_events"] = events
    if "running" in t and events:
        row["running_after_last_event_ms"] = (t["running"] - last) * 1000
        row["events_per_s"] = events / max(1e-6, t["running"] - first)

    _note("gang", state=row["gang_state"], decide_ms=row["decide_ms"], events=events,
          submit_to_running_ms=row["submit_to_running_ms"])


PROBE_SHAPES = ((1, 8, "node"), (2, 8, "rack"), (8, 8, "rack"), (32, 8, "block"), (128, 8, "block"), (1, 1, "any"),
                (4, 2, "any"))  # (pods, GPUs a pod, within): 1 .. 1,024 GPUs


async def _decide_probe(row: dict[str, Any], a: Args, c: httpx.AsyncClient, url: str, op: dict[str, str]) -> None:
    """``--probe`` small gangs submitted one after another through ``POST /v1/jobs`` on the
    filled fleet: ``submitted`` -> ``decided`` (the placer's own two timings: its queue pass,
    the model, the decision) as p50/p99; each is cancelled once decided. Bounded in count and
    in time (``--fill-limit``)."""
    if a.probe <= 0:
        return
    ms: list[float] = []
    with trio.move_on_after(a.fill_limit_s):
        for k in range(a.probe):
            pods, gpp, within = PROBE_SHAPES[k % len(PROBE_SHAPES)]
            jid = f"probe{k}"
            spec: dict[str, Any] = {"job_id": jid, "pods": pods, "gpus_per_pod": gpp, "within": within, "priority": 1,
                    "preemptible": True, "argv": ["probe"], "grace_s": 0}
            r = await c.post(f"{url}/v1/jobs", json=spec, headers=op)
            if r.status_code != 201:
                continue
            job = await _wait_job(c, url, jid, "running", 10.0)
            t = job.get("timings", {})
            if "decided" in t:
                ms.append(_ms(t, "submitted", "decided"))
            await c.delete(f"{url}/v1/jobs/{jid}", headers=op)
    ms.sort()
    if ms:
        row.update(probe_jobs=len(ms), decide_small_p50_ms=ms[len(ms) // 2],
                   decide_small_p99_ms=ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)],
                   decide_small_max_ms=ms[-1])
    _note("decide probe", jobs=len(ms), p50_ms=row.get("decide_small_p50_ms"), p99_ms=row.get("decide_small_p99_ms"))


async def baseline_row(n_nodes: int, a: Args, tmp: Path) -> dict[str, Any]:
    """Registration over one HTTP POST per node (no framed channel known), bounded."""
    td = generate_token_dir(tmp / "tokens")
    opts = PlacerOptions(heartbeat_s=max(a.heartbeat_s, 30.0), fence_after_s=600.0, direct_max_nodes=a.direct_max_nodes)
    procs = max(1, math.ceil(n_nodes / a.per_proc))
    row: dict[str, Any] = {"nodes": n_nodes, "limit_s": a.baseline_limit_s, "path": "HTTP POST per node"}
    async with AsyncExitStack() as stack:
        placer = await stack.enter_async_context(PlacerProc(tmp / "base", td, opts, root=a.placer_root))
        c = await stack.enter_async_context(httpx.AsyncClient(timeout=120, headers=_viewer(td)))
        emus = []
        for k in range(procs):
            lo, hi = k * n_nodes // procs, (k + 1) * n_nodes // procs
            emus.append(await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=hi - lo, offset=lo, fleet=a.fleet, http_only=True, root=a.placer_root,
                log_path=tmp / f"base{k}.log")))
        cpu0 = placer.cpu_s()
        for e in emus:
            await e.go()
        _note("baseline: registering over HTTP", nodes=n_nodes)
        up, s = await wait_nodes_up(c, placer.url, n_nodes, limit_s=a.baseline_limit_s, poll_s=1.0)
        _note("baseline", up=up, s=s)
        row.update(registered=up, register_s=s, complete=up >= n_nodes, register_placer_cpu_s=placer.cpu_s() - cpu0,
                   nodes_per_s=up / s if s else float("nan"))
    return row


async def run_all(nodes: list[int], a: Args) -> dict[str, Any]:
    rows, base = [], []
    for n in nodes:
        with tempfile.TemporaryDirectory(prefix="herd-bench-fleet-") as d:
            if a.baseline:
                base.append(await baseline_row(n, a, Path(d) / "b"))
            rows.append(await bench_row(n, a, Path(d) / "f"))
    return {"fleet": a.fleet, "rows": rows, "baseline": base, "cores": os.cpu_count()}


def _f(v: Any, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def print_table(out: dict[str, Any]) -> None:
    print(f"fleet {out['fleet']} — real placer process vs emulated agents on {out['cores']} cores "
          "(placer and emulators share them)")
    cols = [("nodes", "nodes", ","), ("register_s", "reg s", ".2f"), ("register_placer_cpu_s", "reg cpu s", ".2f"),
            ("fill_running", "fill run", ","), ("decide_small_p50_ms", "small p50", ".1f"),
            ("decide_small_p99_ms", "small p99", ".1f"), ("gang_gpus", "gang gpus", ","), ("decide_ms", "decide ms", ".1f"),
            ("bookkeeping_ms", "bookkeep ms", ".1f"), ("acked_ms", "acked ms", ".0f"),
            ("running_after_last_event_ms", "run-after-last ms", ".0f"), ("events_per_s", "events/s", ",.0f"),
            ("steady_placer_cpu_frac", "steady cpu", ".3f"), ("placer_rss_mib", "rss MiB", ".0f"),
            ("placer_fds", "fds", "d")]
    print("  " + " ".join(f"{h:>{max(len(h), 9)}}" for _, h, _ in cols))
    for r in out["rows"]:
        print("  " + " ".join(f"{_f(r.get(k), s):>{max(len(h), 9)}}" for k, h, s in cols))
    for b in out["baseline"]:
        print(f"  baseline ({b['path']}): {b['registered']:,}/{b['nodes']:,} nodes up in {b['register_s']:.1f} s "
              f"(limit {b['limit_s']:.0f} s), placer CPU {b['register_placer_cpu_s']:.1f} s, "
              f"{b['nodes_per_s']:,.0f} nodes/s")
    for r in out["rows"]:
        if r.get("direct_refusals"):
            print(f"  {r['nodes']:,} nodes: the placer took {r['registered']:,} and refused "
                  f"{r['direct_refusals']:,.0f} registrations past its direct_max_nodes (no rack relays in this "
                  "bench: --direct-max-nodes 0 measures past it)")
    for r, b in zip(out["rows"], out["baseline"], strict=False):
        if r.get("register_complete") and b.get("nodes_per_s"):
            print(f"  {r['nodes']:,} nodes: framed registration {r['nodes'] / r['register_s']:,.0f} nodes/s vs "
                  f"HTTP {b['nodes_per_s']:,.0f} nodes/s ({r['nodes'] / r['register_s'] / b['nodes_per_s']:.1f}x)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="4096", help="comma-separated node counts, one row each")
    ap.add_argument("--fleet", choices=["h100", "gb200"], default="h100")
    ap.add_argument("--gang-gpus", type=int, default=None, help="the big gang (default: a fifth of the fleet)")
    ap.add_argument("--fill", type=float, default=0.75)
    ap.add_argument("--per-proc", type=int, default=16384, help="emulated nodes per emulator process")
    ap.add_argument("--mux", type=int, default=8,
                    help="shared framed connections per emulator process (0: one per node, as real agents)")
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument("--register-limit", type=float, default=180.0)
    ap.add_argument("--direct-max-nodes", type=int, default=None,
                    help="the placer's direct_max_nodes (default: its own, 16,384; 0: no limit, to measure past it)")
    ap.add_argument("--fill-max-jobs", type=int, default=5000)
    ap.add_argument("--fill-limit", type=float, default=120.0)
    ap.add_argument("--gang-limit", type=float, default=120.0)
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-jobs", action="store_true", help="registration and steady heartbeats only")
    ap.add_argument("--baseline-limit", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--probe", type=int, default=50,
                    help="small gangs (1-1,024 GPUs) submitted one at a time on the filled fleet for decide p50/p99")
    ap.add_argument("--fetch-delay", type=float, default=0.2, help="emulated accepted -> fetching (s)")
    ap.add_argument("--run-delay", type=float, default=0.3, help="emulated fetching -> running (s)")
    ap.add_argument("--placer-root", default=str(ROOT), help="the tree whose placer and emulator run (default: this)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--tls", action="store_true",
                    help="registration only, over mutual TLS vs the same without TLS (bench/fleet_tls.py)")
    ap.add_argument("--repeat", type=int, default=1, help="--tls: runs per mode (medians)")
    ap.add_argument("--relays", action="store_true", help="--tls: relay mode (members beat through their relay)")
    ap.add_argument("--modes", default=None, help="--tls: comma-separated subset of plain,tls,enroll,enroll_ecdh (default: plain,tls,enroll)")
    ap.add_argument("--baseline-root", default=None,
                    help="--tls --relays: also the enroll mode run by this tree (another checkout), alternated in the "
                         "same run (enroll_base; ratios *_enroll_over_base)")
    ns = ap.parse_args(argv)
    nodes = [int(x) for x in ns.nodes.split(",") if x.strip()]
    if ns.tls:
        from bench.fleet_tls import print_tls_table, run_tls_bench
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with tempfile.TemporaryDirectory(prefix="herd-bench-fleet-tls-") as d:
            t0 = time.perf_counter()
            out = trio.run(partial(run_tls_bench, nodes, per_proc=min(ns.per_proc, 4096), heartbeat_s=ns.heartbeat,
                                   limit_s=ns.register_limit, repeat=max(1, ns.repeat),
                                   root=Path(ns.placer_root), tmp=Path(d), relays=ns.relays,
                                   modes=tuple(m for m in (ns.modes or "").split(",") if m) or None,
                                   baseline_root=Path(ns.baseline_root) if ns.baseline_root else None))
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            out["cores"] = os.cpu_count()
        print(json.dumps(out)) if ns.json else print_tls_table(out)
        return 0
    if not nodes or min(nodes) < 32 or not 0 < ns.fill < 1:
        ap.error("need --nodes >= 32 each and 0 < --fill < 1")
    a = Args(fleet=ns.fleet, gang_gpus=ns.gang_gpus, fill=ns.fill, per_proc=ns.per_proc, mux=ns.mux,
             heartbeat_s=ns.heartbeat, register_limit_s=ns.register_limit, fill_max_jobs=ns.fill_max_jobs,
             fill_limit_s=ns.fill_limit, gang_limit_s=ns.gang_limit, steady_s=ns.steady_s,
             baseline=not ns.no_baseline, baseline_limit_s=ns.baseline_limit, seed=ns.seed,
             placer_root=Path(ns.placer_root), fetch_delay_s=ns.fetch_delay, run_delay_s=ns.run_delay,
             jobs=not ns.no_jobs, probe=ns.probe, direct_max_nodes=ns.direct_max_nodes)
    return run_printed(partial(run_all, nodes, a), json_out=ns.json, table=print_table)


async def _counter(c: httpx.AsyncClient, placer_url: str, name: str) -> float:
    """One unlabelled sample of the placer's /metrics (0 when it is not served)."""
    for line in (await c.get(placer_url + "/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_printed(run: Callable[[], Awaitable[dict[str, Any]]], *, json_out: bool,
                table: Callable[[dict[str, Any]], None]) -> int:
    """A fleet bench's main: ``run`` under trio, its wall time added, then one JSON object or
    the table. SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the placer and the
    emulators are stopped."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0 = time.perf_counter()
    out = trio.run(run)
    out["wall_s"] = time.perf_counter() - t0
    if json_out:
        print(json.dumps(out))
    else:
        table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
