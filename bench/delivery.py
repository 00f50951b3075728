"""A fleet-sized gang delivered through rack relays: the real placer process, the real wire.

    python -m bench.delivery --nodes 4096,16384,131072 [--fleet h100|gb200] [--gang-gpus 200000] [--json]

Per row (N nodes): a fresh ``herd placer run`` subprocess and ``ceil(N / --per-proc)``
emulator processes in relay mode (``python -m testing.fleet --relays``): one real frames
connection per rack from the emulator to the placer, carrying its members' registrations,
event reports and one aggregated beat per heartbeat interval, and answering the placer's
RackBundles. **The relay -> member hop is emulated in-process** (a method call per
NodePart, with the real checks: binding, expiry, inventory hash, slots): what is measured
is the placer and the real wire to the relays, with the emulators on the same 2 cores.
The members' reports of their pods fetching and running (real reports, each with its MAC)
wait while their emulator process still has bundles of the round to handle (testing.fleet's
``bundles_quiet``: on a fleet they are other hosts' work); ``--no-hold-events`` sends them
at once, competing with the acks for the same cores.

Every measured delivery is submitted once the fleet has settled: the placer's and the
emulators' CPU no longer falling from one second to the next (at most 20 s; ``settle_s``,
and ``cores_busy_at_submit``: the cores they were using then, their heartbeats).

Phases, in one run:
1. ``empty``: the big gang (``--gang-gpus``, default min(200,000, 60 % of the fleet's GPUs),
   whole nodes) on the empty fleet: submit -> decided -> pushed -> every node acked, from
   the job's own timings (one clock: the placer's); the placer's CPU over that window (from
   ``/proc`` before the submit to the placer's own stamp when its round ended: exact), the
   emulators' (to their stamps when each last answered a bundle: a lower bound; to when the
   bench's poll saw the job starting: an upper bound); bytes the placer wrote in bundles for the gang; the largest
   NodePart a member would receive (``part_bytes_max``, re-encoded by the emulated relay);
   racks, direct pushes, fallbacks; then running.
2. ``hung``: 1 % of the relays take bundles and never answer (``POST /relays/hang``); the same
   gang again: every node still acked (the hung racks pushed directly after
   ``relay_timeout_s``); the added time against phase 1.
   ``again`` instead, with ``--hung 0``: the same gang a second time, nothing hung.
   ``nice_ab`` (``--nice-ab K``): K more deliveries of the gang on the same fleet, the emulator
   processes at niceness 0 and ``--emulator-nice`` (10) in turn, the placer at 0 throughout:
   how much of submit -> acked is the emulated hosts taking the placer's 2 cores (on a fleet
   they are other machines); medians per niceness.
3. ``steady``: the phase-2 gang running, heartbeats through the relays every
   ``--heartbeat`` s: the placer's CPU fraction over ``--steady-s``, its open descriptors
   and frames connections.
4. ``preempt``: the fleet filled to ~``--fill`` (at least so far that at most half the gang's
   GPUs are free) with placer/sim.py's job mix (priority 0),
   then the big gang at priority 2: submit -> acked, and submit -> the last victim told
   (the emulators record when each stop arrives).

Baseline in the same run, same N (``--no-baseline`` to skip): a fresh placer with
``relays = false`` and emulators without relays (their nodes multiplexed on the framed
channel for reports, heartbeats every 30 s — per-node beats every 5 s at 131,072 nodes are
more than that path holds —, placements one HTTP POST per node): a 2,000-node gang's
submit -> acked, and the big gang bounded at ``--baseline-limit`` s (60), reported as how
many nodes had acked by then.

``--manifest``: the gang names an artifact (``manifest_id``, ``origin``) that one emulated node
in ``--manifest-every`` (2048) reports holding; those outside the gang are its contacts, listed
in the parts (up to ``[placer] max_peers``, 64, in every part: each adds ~40 bytes a part), and
the placer signs the gang's read grant (in its blob), as for a real gang whose artifact some
nodes already hold. Without it the gang names no artifact: no contacts, no grant.

Every wait is bounded; every loop is bounded in count and time; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import (  # noqa: E402
    _jobs_mix,
    _ms,
    _note,
    _submit_all,
    _viewer,
    _wait_fill,
    _wait_job,
    run_printed,
)
from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from testing.harness import (  # noqa: E402
    DIRECT_DEFAULT,
    EmulatorProc,
    PlacerOptions,
    PlacerProc,
    wait_nodes_up,
    wait_recovered,
)
from testing.waiting import poll  # noqa: E402


@dataclass(frozen=True, slots=True)
class Args:
    fleet: str
    gang_gpus: int | None
    per_proc: int
    heartbeat_s: float
    steady_s: float
    fill: float
    fill_max_jobs: int
    limit_s: float
    baseline: bool
    baseline_limit_s: float
    hung_fraction: float
    preempt: bool
    seed: int
    root: Path = ROOT                # the tree whose placer and emulators run (--placer-root: A/B)
    relays: bool = True              # False (--no-relays): the baseline rows only
    register_limit_s: float = 300.0  # bound on the registration wait (--register-limit)
    hold_events: bool = True         # False (--no-hold-events): members report events while bundles come
    nice_ab: int = 0                 # --nice-ab K: K more deliveries, alternating the emulators' niceness
    emulator_nice: int = 10          # --emulator-nice: the niceness of the odd ones
    manifest: bool = False           # --manifest: the gang names MANIFEST, which some nodes hold (contacts)
    manifest_every: int = 2048       # --manifest-every K: one node in K reports holding it


# --manifest: the artifact the big gang names; one emulated node in --manifest-every reports
# holding it (testing.fleet --holds), so the placer lists those outside the gang as contacts and
# signs the gang's read grant (placer.scheduling: contacts read on the grant), as for a real gang
MANIFEST = "5e" * 32
ORIGIN = "gs://bench-artifacts/herd"


def _gang(fleet: str, gpus_total: int, want: int | None, manifest: bool = False) -> dict[str, Any]:
    from placer.sim import fleet_shape

    gpn = fleet_shape(fleet).gpus_per_node
    g = want or min(200_000, int(gpus_total * 0.6))
    spec: dict[str, Any] = {"pods": max(1, g // gpn), "gpus_per_pod": gpn, "whole_nodes": True, "priority": 2,
                            "preemptible": False, "argv": ["/bin/sleep", "3600"], "grace_s": 1}
    if manifest:
        spec.update(manifest_id=MANIFEST, origin=ORIGIN)
    return spec


async def _fleet(stack: AsyncExitStack, tmp: Path, td: Path, a: Args, n: int, *, relays: bool
                 ) -> tuple[PlacerProc, list[EmulatorProc], httpx.AsyncClient]:
    # Without relays every node heartbeats on its own: at 131,072 nodes every 5 s that alone is
    # more than the placer keeps up with (nodes go lost and re-register), so the baseline
    # fleet heartbeats every 30 s (as bench/fleet.py's does): it measures delivery, not beats.
    hb = a.heartbeat_s if relays else max(a.heartbeat_s, 30.0)
    # (the baseline measures one POST a node on a fleet past the placer's direct_max_nodes: no limit)
    opts = PlacerOptions(heartbeat_s=hb, fence_after_s=600.0, ack_timeout_s=30.0, recover_s=2.0,
                         relays=relays, direct_max_nodes=0 if not relays and n > DIRECT_DEFAULT else None)
    placer = await stack.enter_async_context(PlacerProc(tmp, td, opts, root=a.root))
    c = await stack.enter_async_context(httpx.AsyncClient(timeout=120, headers=_viewer(td)))
    procs = max(1, math.ceil(n / a.per_proc))
    emus = []
    # Whole racks per process: a rack split over two processes would have two relays, each
    # reaching only its own members (no real relay is like that), and every round would push
    # the rest of that rack directly (28 trays a round at gb200 131,072, measured).
    from placer.sim import fleet_shape
    npr = fleet_shape(a.fleet).nodes_per_rack
    racks = math.ceil(n / npr)
    for k in range(procs):
        lo, hi = min(n, k * racks // procs * npr), min(n, (k + 1) * racks // procs * npr)
        extra = ["--fetch-delay", "0.2", "--run-delay", "0.3"] + (["--relays"] if relays else [])
        if relays and not a.hold_events:
            extra.append("--no-hold-events")
        if a.manifest:
            extra += ["--holds", MANIFEST, "--holds-every", str(a.manifest_every)]
        emus.append(await stack.enter_async_context(EmulatorProc(
            placer, td, nodes=hi - lo, offset=lo, fleet=a.fleet, mux=8, log_path=tmp / f"emu{k}.log", extra=extra,
            root=a.root)))
    return placer, emus, c


async def _register(row: dict[str, Any], key: str, placer: PlacerProc, emus: list[EmulatorProc],
                    c: httpx.AsyncClient, n: int, gpus: int, op: dict[str, str], limit_s: float = 300.0) -> bool:
    cpu0 = placer.cpu_s()
    for e in emus:
        await e.go()
    up, s = await wait_nodes_up(c, placer.url, n, limit_s=limit_s)
    row[key] = {"up": up, "s": s, "placer_cpu_s": placer.cpu_s() - cpu0}
    try:  # nodes the placer took for lost meanwhile (a registration storm that starves beats)
        row[key]["nodes_lost"] = (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})
                                  ).json()["placer"].get("nodes_lost")
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    try:  # relays' connections made and lost meanwhile, and why they ended (testing.fleet's /stats)
        ss = [await e.stats(c) for e in emus]
        reasons: dict[str, int] = {}
        for st in ss:
            for k, v in (st.get("relay_drop_reasons") or {}).items():
                reasons[k] = reasons.get(k, 0) + v
        row[key].update(relay_connects=sum(st.get("relay_connects", 0) for st in ss),
                        relay_drops=sum(st.get("relay_drops", 0) for st in ss), relay_drop_reasons=reasons)
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    _note(f"{key}", up=up, s=s, nodes_lost=row[key].get("nodes_lost"), relay_connects=row[key].get("relay_connects"),
          relay_drops=row[key].get("relay_drops"), why=row[key].get("relay_drop_reasons"))
    if up < n:
        return False
    await wait_recovered(c, placer.url)
    # One small job first, so the model's rebuild after the registration storm happens here
    # and not inside the measured decision (a settled fleet's model is built already).
    r = await c.post(f"{placer.url}/v1/jobs", json={"job_id": "warm", "pods": 1, "gpus_per_pod": 1,
                                                     "argv": ["/bin/true"], "grace_s": 0}, headers=op)
    if r.status_code == 201:
        await _wait_job(c, placer.url, "warm", "running", 30.0)
        # its stop reaches its node before the measured submit (it was counted as the first
        # delivery's victim, told before that delivery began), and its GPU is free again
        await _cancel(c, placer.url, op, "warm", gpus)
    return True


DIAG = ("relay_connects", "relay_drops", "reregistrations", "events_superseded", "events_unsent", "gc_s",
        "gc_collections")


async def _stats(c: httpx.AsyncClient, emus: list[EmulatorProc], job: str | None = None) -> dict[str, Any]:
    ss = [await e.stats(c, job) for e in emus]
    states: dict[str, int] = {}
    for s in ss:
        for k, v in (s.get("job") or {}).get("states", {}).items():
            states[k] = states.get(k, 0) + v
    acks: dict[str, int] = {}
    for s in ss:
        for k, v in s["acks"].items():
            acks[k] = acks.get(k, 0) + v
    return {"acks": acks, "placements": sum(s["placements"] for s in ss), "parts": sum(s.get("parts", 0) for s in ss),
            "part_bytes_max": max(s.get("part_bytes_max", 0) for s in ss),
            "placement_bytes_max": max(s["placement_bytes_max"] for s in ss),
            "victims_told": sum(s["victims_told"] for s in ss),
            "last_victim_at": max(s["last_victim_at"] for s in ss),
            "victims_by": {k: sum((s.get("victims_by") or {}).get(k, 0) for s in ss)
                           for k in {k for s in ss for k in (s.get("victims_by") or {})}},
            "blob_fetches": [s.get("blob_fetches") for s in ss],
            "cpu_s": [s.get("cpu_s") for s in ss], "cpu_at_last_answer_s": [s.get("cpu_at_last_answer_s") for s in ss],
            "diag": {k: sum(s.get(k, 0) for s in ss) for k in DIAG}, "job_states": states}


async def _relay_stats(c: httpx.AsyncClient, url: str) -> dict[str, Any]:
    cl = (await c.get(f"{url}/v1/cluster", params={"detail": "0"})).json()
    return {"relays": cl["placer"]["relays"], "framed": cl.get("framed_channel", {})}


def _sub(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a}


def _pyspy(pids: dict[str, int], name: str, seconds: float | None = None) -> list[subprocess.Popen[bytes]]:
    """``HERD_BENCH_PYSPY=DIR``: sample the placer (and, with ``HERD_BENCH_PYSPY_EMU=1``, the
    first emulator; ``=all``, every emulator) with py-spy, idle frames included, at
    ``HERD_BENCH_PYSPY_RATE`` Hz (250), for ``HERD_BENCH_PYSPY_S`` (3)
    seconds from just before the submit, into ``DIR/<job>-<who>.txt`` (``HERD_BENCH_PYSPY_FORMAT``:
    raw or speedscope); ``seconds`` instead of that (the steady phase: its whole window). A
    profiling aid: rows measured so carry py-spy's cost, not figures."""
    d = os.environ.get("HERD_BENCH_PYSPY")
    if not d:
        return []
    spy = Path(sys.executable).with_name("py-spy")
    Path(d).mkdir(parents=True, exist_ok=True)
    emu = os.environ.get("HERD_BENCH_PYSPY_EMU")
    if emu != "all":
        pids = {k: v for k, v in pids.items() if k == "placer" or (emu and k == "emu0")}
    return [subprocess.Popen(
        [str(spy), "record", "--pid", str(pid), "-r", os.environ.get("HERD_BENCH_PYSPY_RATE", "250"), "--idle",
         "--nonblocking",
         "--format", os.environ.get("HERD_BENCH_PYSPY_FORMAT", "raw"),
         "--duration", str(math.ceil(seconds)) if seconds is not None else os.environ.get("HERD_BENCH_PYSPY_S", "3"), "-o", str(Path(d) / f"{name}-{who}.txt")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for who, pid in pids.items()]


SETTLE_WINDOW_S = 1.0
SETTLE_MAX_S = 20.0


async def _settle(placer: PlacerProc, emus: list[EmulatorProc]) -> dict[str, Any]:
    """Wait (at most SETTLE_MAX_S) until the placer's and the emulators' CPU, in windows of
    SETTLE_WINDOW_S, stops falling: the last two windows each within 15 % of the lowest seen,
    after at least three. So a delivery lands on a settled fleet (its heartbeats only), not on
    what a registration storm, the previous phase's pods or the baseline's processes left
    behind; what the machine was doing then is reported beside the figure (cores in use)."""
    rates: list[float] = []
    t0 = time.monotonic()
    prev = placer.cpu_s() + sum(e.cpu_s() for e in emus)
    while time.monotonic() - t0 < SETTLE_MAX_S:
        await trio.sleep(SETTLE_WINDOW_S)
        now = placer.cpu_s() + sum(e.cpu_s() for e in emus)
        rates.append((now - prev) / SETTLE_WINDOW_S)
        prev = now
        low = min(rates)
        if len(rates) >= 3 and all(r <= 1.15 * low + 0.02 for r in rates[-2:]):
            break
    return {"settle_s": time.monotonic() - t0, "cores_busy_at_submit": rates[-1] if rates else None,
            "load_at_submit": os.getloadavg()[0]}


async def _deliver(c: httpx.AsyncClient, placer: PlacerProc, emus: list[EmulatorProc], op: dict[str, str],
                   spec: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """Submit ``spec`` once the fleet settled (:func:`_settle`); wait until every node acked
    (then running), bounded; the figures."""
    settled = await _settle(placer, emus)
    s0 = await _stats(c, emus)
    r0 = await _relay_stats(c, placer.url)
    cpu0, ecpu0 = placer.cpu_s(), sum(e.cpu_s() for e in emus)
    spies = _pyspy({"placer": placer.pid, **{f"emu{i}": e.pid for i, e in enumerate(emus)}}, spec["job_id"])
    r = await c.post(f"{placer.url}/v1/jobs", json=spec, headers=op)
    if r.status_code != 201:
        return {"error": r.text[:300]}
    job = await _wait_job(c, placer.url, spec["job_id"], "starting", limit_s)
    cpu_acked, ecpu_acked = placer.cpu_s() - cpu0, sum(e.cpu_s() for e in emus) - ecpu0
    run = await _wait_job(c, placer.url, spec["job_id"], "running", limit_s)
    for spy in spies:
        await trio.to_thread.run_sync(spy.wait)
    t = run.get("timings", {}) or job.get("timings", {})
    s1 = await _stats(c, emus, spec["job_id"])
    r1 = await _relay_stats(c, placer.url)
    rel0, rel1 = r0["relays"], r1["relays"]
    # Exact where the processes stamped it: the placer's CPU-s when its round ended (every node
    # acked), the emulators' when each last answered a bundle of this round (a lower bound of
    # theirs to acked: what they did after their last answer and before the last ack is left
    # out); the polled readings above (when the poll saw "starting") are upper bounds.
    ld = rel1.get("last_delivery") or {}
    exact = ld.get("process_cpu_at_end_s") if ld.get("job_id") == spec["job_id"] else None
    cpu_exact = exact - cpu0 if exact is not None else None
    e_low = None
    if all(isinstance(x, float) for x in s0["cpu_s"] + s1["cpu_at_last_answer_s"]):
        e_low = sum(max(0.0, b - a) for a, b in zip(s0["cpu_s"], s1["cpu_at_last_answer_s"], strict=True))
    out: dict[str, Any] = {
        "state": run.get("state"), "pods": spec["pods"],
        "submit_to_acked_ms": _ms(t, "submitted", "acked"), "decide_ms": _ms(t, "submitted", "decided"),
        "bookkeeping_ms": _ms(t, "decided", "pushed"), "delivery_ms": _ms(t, "pushed", "acked"),
        "submit_to_running_ms": _ms(t, "submitted", "running"),
        "placer_cpu_to_acked_s": cpu_exact if cpu_exact is not None else cpu_acked,
        "placer_cpu_to_acked_exact": cpu_exact is not None, "placer_cpu_to_poll_s": cpu_acked,
        "emulator_cpu_to_acked_s": ecpu_acked, "emulator_cpu_to_last_answer_s": e_low,
        "bundle_bytes": rel1["bytes_out"] - rel0["bytes_out"], "bundles": rel1["bundles"] - rel0["bundles"],
        "bundle_failures": rel1["bundle_failures"] - rel0["bundle_failures"],
        "fallback_nodes": rel1["fallback_nodes"] - rel0["fallback_nodes"],
        "blob_serves_by_placer": rel1["blob_serves"] - rel0["blob_serves"],
        "last_delivery": rel1.get("last_delivery"),
        "acks": _sub(s1["acks"], s0["acks"]), "http_placements": s1["placements"] - s0["placements"],
        "parts": s1["parts"] - s0["parts"], "part_bytes_max": s1["part_bytes_max"],
        "victims_told": s1["victims_told"] - s0["victims_told"],
        # what the placer holds of the job's pods against what the emulated members hold (a
        # difference is events the placer never got), and the emulators' connection diagnostics
        "pod_counts": run.get("pod_counts"), "member_states": s1["job_states"],
        "emulator_diag": _sub(s1["diag"], s0["diag"]),
        **settled,
    }
    if out["victims_told"] and "submitted" in t:
        out["submit_to_last_victim_told_ms"] = (s1["last_victim_at"] - t["submitted"]) * 1000
        # what carried the stops (a part, a direct placement, a report's answer), counted since the submit
        out["victims_by"] = _sub(s1["victims_by"], s0["victims_by"])
    return out


async def _cancel(c: httpx.AsyncClient, url: str, op: dict[str, str], job_id: str, gpus: int) -> None:
    await c.delete(f"{url}/v1/jobs/{job_id}", headers=op)

    async def freed() -> bool:   # the placer's state, over HTTP: nothing to wait on but its answers
        return bool((await c.get(f"{url}/v1/cluster")).json()["model"]["free"] >= gpus)

    with trio.move_on_after(120):
        await poll(freed, 0.5)


async def relay_row(n: int, a: Args, tmp: Path) -> dict[str, Any]:
    from placer.sim import fleet_shape

    gpus = n * fleet_shape(a.fleet).gpus_per_node
    td = generate_token_dir(tmp / "tokens")
    op = {"authorization": f"Bearer {TokenSet.load(td).operator}"}
    row: dict[str, Any] = {"nodes": n, "gpus": gpus, "fleet": a.fleet, "path": "rack relays",
                           "load_before": os.getloadavg()[0]}
    gang = _gang(a.fleet, gpus, a.gang_gpus, a.manifest)
    row["gang_gpus"] = gang["pods"] * gang["gpus_per_pod"]
    if a.manifest:
        row["manifest"] = {"manifest_id": MANIFEST, "held_by_one_node_in": a.manifest_every}
    async with AsyncExitStack() as stack:
        placer, emus, c = await _fleet(stack, tmp, td, a, n, relays=True)
        row["emulator_procs"] = len(emus)
        if not await _register(row, "register", placer, emus, c, n, gpus, op, a.register_limit_s):
            return row
        row["empty"] = await _deliver(c, placer, emus, op, {**gang, "job_id": "big1"}, a.limit_s)
        _note("empty fleet", **{k: row["empty"].get(k) for k in ("state", "submit_to_acked_ms", "bundle_bytes")})
        await _cancel(c, placer.url, op, "big1", gpus)

        if a.hung_fraction > 0:
            hung = 0
            for e in emus:
                hung += (await c.post(f"{e.control}/relays/hang", params={"fraction": a.hung_fraction})).json()["hung"]
            row["hung_relays"] = hung
            row["hung"] = await _deliver(c, placer, emus, op, {**gang, "job_id": "big2"}, a.limit_s)
            _note("hung relays", hung=hung, **{k: row["hung"].get(k) for k in ("state", "submit_to_acked_ms")})
            for e in emus:
                await c.post(f"{e.control}/relays/hang", params={"fraction": 0})
            held = "big2"
        else:
            row["again"] = await _deliver(c, placer, emus, op, {**gang, "job_id": "big2"}, a.limit_s)
            held = "big2"

        if a.nice_ab:   # (before the steady phase, which wants the big2 gang running: cancelled first)
            await _cancel(c, placer.url, op, held, gpus)
            row["nice_ab"] = await _nice_ab(c, placer, emus, op, gang, gpus, a)
            held = "big2b"
            r = await c.post(f"{placer.url}/v1/jobs", json={**gang, "job_id": held}, headers=op)
            if r.status_code == 201:
                await _wait_job(c, placer.url, held, "running", a.limit_s)

        # steady state with the gang running
        await trio.sleep(min(a.heartbeat_s, 5.0))
        cpu0, ecpu0, w0 = placer.cpu_s(), sum(e.cpu_s() for e in emus), trio.current_time()
        spies = _pyspy({"placer": placer.pid}, "steady", a.steady_s)
        await trio.sleep(a.steady_s)
        dt = trio.current_time() - w0
        rs = await _relay_stats(c, placer.url)
        row["steady"] = {"placer_cpu_frac": (placer.cpu_s() - cpu0) / dt,
                         "emulator_cpu_frac": (sum(e.cpu_s() for e in emus) - ecpu0) / dt,
                         "placer_fds": placer.fds(), "frames_connections": rs["framed"].get("frames_connections"),
                         "placer_rss_mib": placer.rss_mib(),
                         "nodes_up": (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})).json()["nodes"]["up"]}
        _note("steady", **row["steady"])
        for spy in spies:
            await trio.to_thread.run_sync(spy.wait)
        row["load_steady"] = os.getloadavg()[0]
        await _cancel(c, placer.url, op, held, gpus)

        if a.preempt:
            # full enough that the gang cannot fit without victims: at most half its GPUs free
            fill = max(a.fill, 1 - 0.5 * row["gang_gpus"] / gpus)
            specs = _jobs_mix(a.fleet, gpus, fill, a.seed, a.fill_max_jobs)
            ok, bad = await _submit_all(c, placer.url, op, specs, 120.0)
            counts = await _wait_fill(c, placer.url, ok, 180.0)
            row["fill"] = {"jobs": ok, "refused": bad, "running": counts.get("running", 0), "target": fill}
            _note("filled", **row["fill"])
            row["preempt"] = await _deliver(c, placer, emus, op, {**gang, "job_id": "big3"}, a.limit_s)
            _note("preempting gang", **{k: row["preempt"].get(k) for k in
                                        ("state", "submit_to_acked_ms", "victims_told", "submit_to_last_victim_told_ms")})
    return row


def _renice(pid: int, nice: int) -> bool:
    """Every thread of ``pid`` at niceness ``nice`` (Linux's setpriority is per thread). False
    when not allowed (lowering it again needs CAP_SYS_NICE)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        return False
    return True


AB_KEYS = ("submit_to_acked_ms", "decide_ms", "bookkeeping_ms", "delivery_ms", "placer_cpu_to_acked_s",
           "emulator_cpu_to_last_answer_s", "emulator_cpu_to_acked_s", "state", "fallback_nodes")


async def _nice_ab(c: httpx.AsyncClient, placer: PlacerProc, emus: list[EmulatorProc], op: dict[str, str],
                   gang: dict[str, Any], gpus: int, a: Args) -> dict[str, Any]:
    """``a.nice_ab`` deliveries of the gang on the same fleet, the emulators at niceness 0 and
    ``a.emulator_nice`` in turn (the placer stays at 0): how much of submit -> acked is the
    emulated hosts taking the placer's cores (on a fleet they are other machines). Each
    delivery is cancelled before the next; the emulators end at niceness 0 where allowed."""
    samples: list[dict[str, Any]] = []
    try:
        for k in range(a.nice_ab):
            nice = 0 if k % 2 == 0 else a.emulator_nice
            if not all(_renice(e.pid, nice) for e in emus):
                samples.append({"nice": nice, "error": "renice not allowed"})
                break
            job = f"ab{k}"
            d = await _deliver(c, placer, emus, op, {**gang, "job_id": job}, a.limit_s)
            samples.append({"nice": nice, **{key: d.get(key) for key in AB_KEYS}})
            _note("nice a/b", nice=nice, state=d.get("state"), submit_to_acked_ms=d.get("submit_to_acked_ms"),
                  placer_cpu_to_acked_s=d.get("placer_cpu_to_acked_s"))
            await _cancel(c, placer.url, op, job, gpus)
    finally:
        for e in emus:
            _renice(e.pid, 0)
    out: dict[str, Any] = {"emulator_nice": a.emulator_nice, "samples": samples}
    for nice in sorted({s["nice"] for s in samples}):
        ms = [s["submit_to_acked_ms"] for s in samples if s["nice"] == nice and s.get("state") == "running"
              and s.get("submit_to_acked_ms") is not None]
        cpu = [s["placer_cpu_to_acked_s"] for s in samples if s["nice"] == nice
               and s.get("placer_cpu_to_acked_s") is not None]
        out[f"nice{nice}"] = {"n": len(ms), "submit_to_acked_ms_median": statistics.median(ms) if ms else None,
                              "placer_cpu_to_acked_s_median": statistics.median(cpu) if cpu else None}
    return out


async def baseline_row(n: int, a: Args, tmp: Path) -> dict[str, Any]:
    from placer.sim import fleet_shape

    gpus = n * fleet_shape(a.fleet).gpus_per_node
    td = generate_token_dir(tmp / "tokens")
    op = {"authorization": f"Bearer {TokenSet.load(td).operator}"}
    row: dict[str, Any] = {"nodes": n, "fleet": a.fleet, "path": "one HTTP POST per node (relays = false)"}
    gang = _gang(a.fleet, gpus, a.gang_gpus, a.manifest)
    async with AsyncExitStack() as stack:
        placer, emus, c = await _fleet(stack, tmp, td, a, n, relays=False)
        if not await _register(row, "register", placer, emus, c, n, gpus, op, a.register_limit_s):
            return row
        small = {**gang, "pods": min(2000, gang["pods"]), "job_id": "base-small"}
        row["small"] = await _deliver(c, placer, emus, op, small, 120.0)
        _note("baseline small gang", **{k: row["small"].get(k) for k in ("state", "submit_to_acked_ms")})
        await _cancel(c, placer.url, op, "base-small", gpus)
        # the big gang, bounded: how many nodes had acked when the limit came
        s0 = await _stats(c, emus)
        cpu0 = placer.cpu_s()
        t0 = trio.current_time()
        r = await c.post(f"{placer.url}/v1/jobs", json={**gang, "job_id": "base-big"}, headers=op)
        job = await _wait_job(c, placer.url, "base-big", "starting", a.baseline_limit_s) if r.status_code == 201 else {}
        s1 = await _stats(c, emus)
        t = job.get("timings", {})
        row["big"] = {"pods": gang["pods"], "state": job.get("state"), "limit_s": a.baseline_limit_s,
                      "waited_s": trio.current_time() - t0,
                      "acked_nodes": sum(_sub(s1["acks"], s0["acks"]).values()),
                      "submit_to_acked_ms": _ms(t, "submitted", "acked"), "placer_cpu_s": placer.cpu_s() - cpu0,
                      "placement_bytes_max": s1["placement_bytes_max"]}
        _note("baseline big gang", **row["big"])
    return row


async def run_all(nodes: list[int], a: Args) -> dict[str, Any]:
    rows, base = [], []
    keep = os.environ.get("HERD_BENCH_KEEP")  # a directory: the rows' logs stay there (diagnosis)
    for n in nodes:
        with tempfile.TemporaryDirectory(prefix="herd-bench-delivery-", dir=keep) as d:
            if a.baseline:
                base.append(await baseline_row(n, a, Path(d) / "b"))
            if a.relays:
                rows.append(await relay_row(n, a, Path(d) / "r"))
            if keep:
                os.rename(d, Path(keep) / f"{a.fleet}-{n}-{time.strftime('%H%M%S')}")
                os.mkdir(d)  # (the context removes its directory)
    return {"fleet": a.fleet, "rows": rows, "baseline": base, "cores": os.cpu_count(),
            "note": "relay -> member hop emulated in-process; placer <-> relays over the real framed channel"}


def _f(v: Any, spec: str = ".0f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def print_table(out: dict[str, Any]) -> None:
    print(f"fleet {out['fleet']} — a big gang through rack relays: real placer process, real wire to the relays, "
          f"relay->member hop in-process; {out['cores']} cores shared with the emulators")
    hdr = (f"  {'nodes':>7} {'gang gpus':>9} {'phase':>7} {'acked ms':>8} {'decide':>7} {'bookk.':>7} {'deliv.':>7} "
           f"{'cpu s':>6} {'emu cpu lo/hi':>13} {'MB out':>7} {'part B':>6} {'fallbk':>6} {'victims':>7} {'vict. ms':>8}")
    print(hdr)
    for r in out["rows"]:
        for ph in ("empty", "hung", "again", "preempt"):
            d = r.get(ph)
            if not d:
                continue
            print(f"  {r['nodes']:>7,} {r['gang_gpus']:>9,} {ph:>7} {_f(d.get('submit_to_acked_ms')):>8} "
                  f"{_f(d.get('decide_ms')):>7} {_f(d.get('bookkeeping_ms')):>7} {_f(d.get('delivery_ms')):>7} "
                  f"{_f(d.get('placer_cpu_to_acked_s'), '.2f'):>6} "
                  f"{_f(d.get('emulator_cpu_to_last_answer_s'), '.2f') + '/' + _f(d.get('emulator_cpu_to_acked_s'), '.2f'):>13} "
                  f"{_f(d.get('bundle_bytes', 0) / 1e6, '.2f'):>7} {_f(d.get('part_bytes_max')):>6} "
                  f"{_f(d.get('fallback_nodes')):>6} {_f(d.get('victims_told')):>7} "
                  f"{_f(d.get('submit_to_last_victim_told_ms')):>8}")
        ab = r.get("nice_ab")
        if ab:
            each = ", ".join(f"{_f(x.get('submit_to_acked_ms'))} (nice {x['nice']})" for x in ab["samples"])
            meds = "; ".join(f"emulators at nice {k[4:]}: median {_f(v['submit_to_acked_ms_median'])} ms over {v['n']}, "
                             f"placer CPU {_f(v['placer_cpu_to_acked_s_median'], '.2f')} s"
                             for k, v in ab.items() if k.startswith("nice") and isinstance(v, dict))
            print(f"  {r['nodes']:>7,} nice a/b: {each}; {meds}")
        st = r.get("steady")
        if st:
            print(f"  {r['nodes']:>7,} steady: placer {st['placer_cpu_frac']:.3f} of a core, emulators "
                  f"{st['emulator_cpu_frac']:.2f}, {st['frames_connections']} frames connections, "
                  f"{st['placer_fds']} fds, {st['placer_rss_mib']:.0f} MiB, {st['nodes_up']:,} up")
    for b in out["baseline"]:
        sm, bg = b.get("small", {}), b.get("big", {})
        print(f"  baseline {b['nodes']:,} ({b['path']}): {sm.get('pods', 0):,}-node gang acked in "
              f"{_f(sm.get('submit_to_acked_ms'))} ms; {bg.get('pods', 0):,}-node gang: {bg.get('acked_nodes', 0):,} "
              f"nodes acked after {_f(bg.get('waited_s'), '.1f')} s (limit {_f(bg.get('limit_s'))} s, "
              f"state {bg.get('state')}), placer CPU {_f(bg.get('placer_cpu_s'), '.1f')} s")
    for r, b in zip(out["rows"], out["baseline"], strict=False):
        e, bs = r.get("empty", {}), b.get("small", {})
        if e.get("submit_to_acked_ms") and bs.get("submit_to_acked_ms"):
            print(f"  {r['nodes']:,} nodes: relays {e['pods']:,} nodes in {e['submit_to_acked_ms']:.0f} ms vs "
                  f"one POST per node {bs['pods']:,} nodes in {bs['submit_to_acked_ms']:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delivery", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="4096", help="comma-separated node counts, one row each")
    ap.add_argument("--fleet", choices=["h100", "gb200"], default="h100")
    ap.add_argument("--gang-gpus", type=int, default=None, help="default: min(200,000, 60%% of the fleet)")
    ap.add_argument("--per-proc", type=int, default=16384, help="emulated nodes per emulator process")
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument("--steady-s", type=float, default=15.0)
    ap.add_argument("--fill", type=float, default=0.75, help="the preemption phase's fill")
    ap.add_argument("--fill-max-jobs", type=int, default=4000)
    ap.add_argument("--limit", type=float, default=120.0, help="bound on each phase's waits (s)")
    ap.add_argument("--hung", type=float, default=0.01, help="fraction of relays hung in the failure phase")
    ap.add_argument("--no-preempt", action="store_true")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--no-relays", action="store_true", help="the same-run baseline rows only")
    ap.add_argument("--register-limit", type=float, default=300.0, help="bound on the registration wait (s)")
    ap.add_argument("--baseline-limit", type=float, default=60.0)
    ap.add_argument("--no-hold-events", action="store_true",
                    help="the emulated members report their pods' events at once, even while their process's "
                         "relays are still handling the round's bundles (testing.fleet's bundles_quiet)")
    ap.add_argument("--nice-ab", type=int, default=0, metavar="K",
                    help="K more deliveries of the gang after the first two, the emulators at niceness 0 and "
                         "--emulator-nice in turn (the placer at 0): a same-run A/B of the shared cores")
    ap.add_argument("--emulator-nice", type=int, default=10)
    ap.add_argument("--manifest", action="store_true",
                    help="the gang names an artifact that one emulated node in --manifest-every holds: those "
                         "outside the gang are its contacts and the placer signs the gang's read grant")
    ap.add_argument("--manifest-every", type=int, default=2048, metavar="K")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--placer-root", default=str(ROOT),
                    help="the tree whose placer and emulators run (default: this one; a same-run A/B)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ns = ap.parse_args(argv)
    nodes = [int(x) for x in ns.nodes.split(",") if x.strip()]
    if not nodes or min(nodes) < 64:
        ap.error("need --nodes >= 64 each")
    a = Args(fleet=ns.fleet, gang_gpus=ns.gang_gpus, per_proc=ns.per_proc, heartbeat_s=ns.heartbeat,
             steady_s=ns.steady_s, fill=ns.fill, fill_max_jobs=ns.fill_max_jobs, limit_s=ns.limit,
             baseline=not ns.no_baseline, baseline_limit_s=ns.baseline_limit, hung_fraction=ns.hung,
             preempt=not ns.no_preempt, seed=ns.seed, root=Path(ns.placer_root), relays=not ns.no_relays,
             register_limit_s=ns.register_limit, hold_events=not ns.no_hold_events, nice_ab=max(0, ns.nice_ab),
             emulator_nice=ns.emulator_nice, manifest=ns.manifest, manifest_every=max(1, ns.manifest_every))
    return run_printed(partial(run_all, nodes, a), json_out=ns.json, table=print_table)


if __name__ == "__main__":
    sys.exit(main())
