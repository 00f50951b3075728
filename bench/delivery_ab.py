"""Same-run A/B of bench.delivery: the relay rows of two trees, alternating.

    python -m bench.delivery_ab --base-root /path/to/baseline/tree [--nodes 16384] [--reps 3] [--manifest] [--json]

Each rep runs ``python -m bench.delivery --nodes N --no-baseline --no-preempt --json`` (this
tree's bench driver) once with ``--placer-root`` = the baseline tree and once with this tree,
in alternating order (base, new, new, base, ...), so both see the same machine. Per phase
(``empty``, ``hung``; ``preempt`` with ``--preempt``: the last victim told too) it reports the medians of submit -> acked, decide, bookkeeping, delivery
and the placer's and the emulators' CPU-s to acked, with the 1-minute load before each run;
then the steady phase's placer CPU fraction (the gang running, heartbeats through the relays),
and new/base ratios of the medians. ``--manifest`` passes bench.delivery's ``--manifest`` to
both: the gang names an artifact some nodes outside it hold, so the placer lists contacts and
signs the gang's read grant.
Every run is bounded (``--limit-s``); traffic stays on loopback (bench.delivery's rules).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("submit_to_acked_ms", "decide_ms", "bookkeeping_ms", "delivery_ms", "placer_cpu_to_acked_s",
        "emulator_cpu_to_acked_s", "emulator_cpu_to_last_answer_s", "submit_to_last_victim_told_ms")


def phases(a: argparse.Namespace) -> tuple[str, ...]:
    return ("empty", "hung", "preempt") if a.preempt else ("empty", "hung")


def one(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.delivery", "--nodes", str(a.nodes), "--fleet", a.fleet, "--no-baseline",
           "--steady-s", str(a.steady_s), "--json", "--placer-root", str(root),
           "--per-proc", str(a.per_proc)] + (["--no-hold-events"] if a.no_hold_events and root != Path(a.base_root) else [])
    cmd += [] if a.preempt else ["--no-preempt"]
    if a.manifest:
        cmd += ["--manifest", "--manifest-every", str(a.manifest_every)]
    load = os.getloadavg()[0]
    p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=a.limit_s)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:], "load": load}
    out = json.loads(p.stdout)
    row = out["rows"][0]
    res: dict[str, Any] = {"load": load, "load_after": os.getloadavg()[0]}
    for ph in phases(a):
        d = row.get(ph) or {}
        res[ph] = {k: d.get(k) for k in KEYS}
        res[ph]["fallback_nodes"] = d.get("fallback_nodes")
        res[ph]["part_bytes_max"] = d.get("part_bytes_max")   # (with --manifest: its contacts listed)
        res[ph]["last_delivery"] = d.get("last_delivery")
        res[ph]["emulator_diag"] = d.get("emulator_diag")
    res["steady_placer_cpu_frac"] = (row.get("steady") or {}).get("placer_cpu_frac")
    res["register"] = row.get("register")   # (its time, and relays' connections made and lost)
    return res


def _ratio(new: float | None, base: float | None) -> float | None:
    return new / base if new is not None and base else None


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delivery_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-root", required=True, help="the baseline tree (e.g. a `git archive` of main)")
    ap.add_argument("--new-root", default=str(ROOT), help="the tree measured against it (default: this one)")
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--fleet", choices=["h100", "gb200"], default="h100")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--per-proc", type=int, default=16384,
                    help="emulated nodes per emulator process (bench.delivery's; e.g. 32768 nodes at 4096 "
                         "a process: 131,072's 8 processes and a ~20,000-node gang in a fifth of the time)")
    ap.add_argument("--no-hold-events", action="store_true",
                    help="the new tree's emulated members report events at once (bench.delivery's flag)")
    ap.add_argument("--steady-s", type=float, default=3.0)
    ap.add_argument("--manifest", action="store_true",
                    help="the gang names an artifact that some nodes outside it hold (contacts, a read grant)")
    ap.add_argument("--manifest-every", type=int, default=2048, metavar="K",
                    help="with --manifest: one emulated node in K holds it")
    ap.add_argument("--preempt", action="store_true",
                    help="bench.delivery's preemption phase too (the fleet filled, the gang preempting): its "
                         "submit -> acked and submit -> the last victim told")
    ap.add_argument("--limit-s", type=float, default=900.0, help="bound on each run (s)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    order: list[str] = []
    for r in range(max(1, a.reps)):
        order += [("base", "new"), ("new", "base")][r % 2]
    for who in order:
        res = one(Path(a.base_root) if who == "base" else Path(a.new_root), a)
        runs[who].append(res)
        e = res.get("empty", {})
        print(f"[bench.delivery_ab] {who} load={res['load']:.2f} acked_ms={e.get('submit_to_acked_ms')} "
              f"placer_cpu={e.get('placer_cpu_to_acked_s')} emu_cpu={e.get('emulator_cpu_to_acked_s')}",
              file=sys.stderr, flush=True)
    med: dict[str, Any] = {}
    for who, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        med[who] = {ph: {k: statistics.median(v) if (v := [r[ph][k] for r in ok if r[ph].get(k) is not None]) else None
                         for k in KEYS} for ph in phases(a)}
        med[who]["loads"] = [round(r["load"], 2) for r in rs]
        steady = [r["steady_placer_cpu_frac"] for r in ok if r.get("steady_placer_cpu_frac") is not None]
        med[who]["steady_placer_cpu_frac"] = statistics.median(steady) if steady else None
    ratios: dict[str, Any] = {ph: {k: _ratio(med["new"][ph][k], med["base"][ph][k]) for k in KEYS} for ph in phases(a)}
    ratios["steady_placer_cpu_frac"] = _ratio(med["new"]["steady_placer_cpu_frac"],
                                              med["base"]["steady_placer_cpu_frac"])
    out = {"nodes": a.nodes, "fleet": a.fleet, "reps": a.reps, "base_root": a.base_root, "new_root": a.new_root,
           "manifest": a.manifest, "medians": med, "ratios_new_over_base": ratios, "runs": runs}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"bench.delivery A/B, {a.fleet} {a.nodes:,} nodes{', gang with a manifest' if a.manifest else ''}, "
              f"medians of {a.reps} (alternating; loads per run)")
        for ph in phases(a):
            print(f"  {ph}:")
            for who in ("base", "new"):
                m = med[who][ph]
                print(f"    {who:4s} " + " ".join(f"{k}={m[k]:.2f}" if m[k] is not None else f"{k}=-" for k in KEYS))
            print("    new/base " + " ".join(f"{k}={_f(ratios[ph][k])}" for k in KEYS))
        print("  steady placer CPU fraction: " + " ".join(
            f"{who}={_f(med[who]['steady_placer_cpu_frac'])}" for who in ("base", "new"))
            + f" new/base={_f(ratios['steady_placer_cpu_frac'])}")
        for who in ("base", "new"):
            print(f"  {who} loads: {med[who]['loads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
