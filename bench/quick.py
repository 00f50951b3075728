"""Every benchmark once at small sizes, and docs/performance.md's tables checked against them.

    python -m bench.quick [--only bench.link,bench.agent] [--doc docs/performance.md]

Runs each bench with ``--json`` at the sizes in ``QUICK`` (one after another, each bounded
in time; the whole run targets under 5 minutes on 2 cores) and checks that every JSON key
the performance tables name is in that bench's output. A row names its keys in its last
cell: the first backticked text is the command (``python -m bench.x ...``; "same" means the
row above's), every later backticked name is a key of that bench's JSON (``a.b``: key ``b``
of object ``a``; ``rows[].b``: key ``b`` in every element of list ``rows``). The figures are
not judged here (small sizes say nothing about targets): this catches a row that names what
no bench prints any more, and a bench that no longer runs. ``bench.herd`` needs root and
network namespaces; where it prints ``{"skipped": ...}`` its keys are reported unchecked.
Exit status 1 on any failure. ``make test`` does not run this; ``make bench-quick`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

QUICK: dict[str, list[str]] = {
    "bench.artifacts": ["--size-mb", "16", "--repeat", "1"],
    "bench.node": ["--mib", "32", "--repeat", "1", "--settle-s", "0.5"],
    "bench.publish": ["--size-mb", "16", "--repeat", "1", "--settle-s", "0.5"],
    "bench.origin_read": ["--mib", "16", "--repeat", "1"],
    "bench.gpus": ["--polls", "30", "--seconds", "1"],
    "bench.agent": ["--quick"],
    "bench.placer": ["--gpus", "4096", "--reps", "3", "--naive-jobs", "10"],
    "bench.link": ["--quick", "--jobs", "4", "--fleet", "100"],
    "bench.fleet": ["--nodes", "256", "--steady-s", "2", "--no-baseline"],
    "bench.delivery": ["--nodes", "256", "--steady-s", "2", "--baseline-limit", "20", "--limit", "30"],
    "bench.delivery_ab": ["--base-root", ".", "--nodes", "256", "--reps", "1", "--steady-s", "1", "--limit-s", "120"],
    "bench.herd": ["--nodes", "2", "--size-mb", "8", "--modes", "origin,herd,flat,relay,tcp"],
    "bench.herd_sim": ["--nodes", "8,40", "--rack-size", "4", "--size-mb", "16", "--cases", "none,dead"],
    "bench.msgauth": ["--nodes", "512", "--repeat", "1"],
    "bench.relay_round": ["--nodes", "2048", "--repeat", "1"],
    "bench.registration": ["--nodes", "256", "--repeat", "1"],
    "bench.tls_handshake": ["--n", "20", "--rounds", "1"],
    "bench.dashboard": ["--nodes", "512", "--builds", "3", "--refreshes", "3", "--baseline-pages", "2"],
    "bench.failover": ["--nodes", "64"],
    "bench.read_grants": ["--nodes", "256", "--pairs", "2"],
    "bench.relay_copies": ["--relays", "4", "--members", "8", "--seconds", "1", "--pairs", "1"],
    "bench.restart": ["--nodes", "256", "--gang-hosts", "32", "--probe-gpus", "64", "--recover-s", "1",
                      "--heartbeat", "1", "--limit-s", "100", "--steady-s", "1"],
}
TIMEOUT_S = 150.0
_CMD = re.compile(r"python -m (bench\.\w+)")
_TICKS = re.compile(r"`([^`]+)`")
_HEADING = re.compile(r"^#{1,2} Performance\s*$")


def table_keys(doc: str) -> dict[str, list[str]]:
    """Module -> the JSON keys the performance tables' rows name for it (in order, once each).

    The tables are every one after the ``# Performance`` (or ``## Performance``) heading, up
    to the next heading of the same or a higher level."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _HEADING.match(line)), None)
    if start is None:
        raise SystemExit("bench.quick: the document has no 'Performance' heading")
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    out: dict[str, list[str]] = {}
    module: str | None = None
    for line in lines[start + 1:]:
        if line.startswith("#") and len(line) - len(line.lstrip("#")) <= level:
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= {"-", " "} or cells[0] in ("what", "claim"):
            continue
        last = cells[-1]
        ticks = _TICKS.findall(last)
        m = _CMD.search(ticks[0]) if ticks else None
        if m is not None:
            module, keys = m.group(1), ticks[1:]
        elif last.startswith("same") and module is not None:
            keys = ticks
        else:
            raise SystemExit(f"bench.quick: a performance row names no bench: {cells[0]!r}")
        names = out.setdefault(module, [])
        names += [k for k in keys if k not in names]
    return out


def missing(obj: Any, key: str) -> str | None:
    """Why ``key`` (``a.b``, ``rows[].b``) is not in ``obj``, or None."""
    def walk(o: Any, parts: list[str], path: str) -> str | None:
        if not parts:
            return None
        head, rest = parts[0], parts[1:]
        each = head.endswith("[]")
        name = head[:-2] if each else head
        if not isinstance(o, dict) or name not in o:
            return f"no {path + name!r}"
        v = o[name]
        if not each:
            return walk(v, rest, f"{path}{name}.")
        if not isinstance(v, list) or not v:
            return f"{path + name!r} is not a non-empty list"
        for i, x in enumerate(v):
            why = walk(x, rest, f"{path}{name}[{i}].")
            if why:
                return why
        return None
    return walk(obj, key.split("."), "")


def run_one(module: str) -> tuple[dict[str, Any] | None, str, float]:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-m", module, *QUICK[module], "--json"], cwd=ROOT,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"ran past {TIMEOUT_S:.0f} s", time.monotonic() - t0
    wall = time.monotonic() - t0
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {p.stderr.strip()[-600:]}", wall
    lines = p.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]), "", wall
    except (IndexError, json.JSONDecodeError):
        return None, f"no JSON object on stdout: {p.stdout[-300:]!r}", wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quick", description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of bench modules (default: all)")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"), help="the performance tables")
    a = ap.parse_args(argv)
    named = table_keys(Path(a.doc).read_text())
    unknown = sorted(set(named) - set(QUICK))
    if unknown:
        print(f"bench.quick: the performance tables name benches QUICK does not run: {', '.join(unknown)}", file=sys.stderr)
        return 1
    modules = [m for m in QUICK if not a.only or m in a.only.split(",")]
    failed = 0
    t_all = time.monotonic()
    for module in modules:
        keys = named.get(module, [])
        out, err, wall = run_one(module)
        if out is None:
            failed += 1
            print(f"FAIL {module:16} {wall:6.1f} s  {err}")
            continue
        if "skipped" in out and len(out) == 1:
            print(f"SKIP {module:16} {wall:6.1f} s  {out['skipped']} ({len(keys)} keys unchecked)")
            continue
        gone = [f"{k}: {why}" for k in keys if (why := missing(out, k))]
        if gone:
            failed += 1
            print(f"FAIL {module:16} {wall:6.1f} s  docs/performance.md names what it does not print: {'; '.join(gone)}")
        else:
            print(f"ok   {module:16} {wall:6.1f} s  {len(keys)} named keys present")
    print(f"{len(modules) - failed}/{len(modules)} benches ok in {time.monotonic() - t_all:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
