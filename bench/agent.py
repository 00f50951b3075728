"""Benchmark the node agent: placement -> process start latency, /v1/status latency, RSS.

    python -m bench.agent [--json] [--placements 200] [--status-requests 300]

Runs a real agent process (simulated dgx-h100 GPUs, loopback, a temp state dir) and:

* start latency: POST /v1/placements at t0; the workload is a tiny program that writes
  CLOCK_REALTIME in ns to a file (a static C program when a compiler is present, else
  ``sh -c 'date +%s%N'``); latency = its timestamp - t0. Each workload is waited to its
  exit before the next placement, then ``--gap-ms`` passes (placements to one node are
  spaced in practice; the pool's replacement shim costs ~30 ms of CPU on the same cores;
  ``--gap-ms 0`` measures back-to-back placements). Baseline, same run: the same program started by a
  bare ``posix_spawn`` from this Python process, so the program's own start-up is in
  both and ``start_overhead_p50_ms`` is what the agent adds.
* /v1/status latency with 8 running workloads (one per GPU); baseline GET /healthz
  (the HTTP floor: hypercorn + httpx on loopback).
* agent RSS (VmRSS of the agent process, shims not included) idle and with 8 workloads;
  the shims are forked from a zygote (the agent's child), so they are found as the
  zygote's children: ``shim_rss_mb``/``shim_pss_mb``/``shim_uss_mb`` is one shim's
  RSS/PSS/USS (USS: the pages only it maps; median over every shim, the 8 busy ones and
  the idle pool), ``zygote_*`` the zygote's own, ``agent_tree_pss_busy_mb`` the sum of the
  agent's, the zygote's and every shim's PSS with 8 workloads.

Prints a table, or exactly one JSON object with ``--json``. Every loop is bounded in
count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent

C_SRC = r"""
#include <stdio.h>
#include <time.h>
int main(int argc, char **argv) {
    struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    FILE *f = fopen(argc > 1 ? argv[1] : "ts", "w");
    if (!f) return 1;
    fprintf(f, "%lld\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    return fclose(f) != 0;
}
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def stamp_program(tmp: Path) -> tuple[list[str], str]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc:
        src = tmp / "stamp.c"
        src.write_text(C_SRC)
        exe = tmp / "stamp"
        r = subprocess.run([cc, "-O2", "-static", "-o", str(exe), str(src)], capture_output=True, timeout=120)
        if r.returncode != 0:
            r = subprocess.run([cc, "-O2", "-o", str(exe), str(src)], capture_output=True, timeout=120)
        if r.returncode == 0:
            return [str(exe)], "static C program"
    return ["sh", "-c", 'date +%s%N > "$1"', "stamp"], "sh -c date"


def read_stamp(path: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        try:
            text = path.read_text()
            if text.endswith("\n"):
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    raise TimeoutError(f"no timestamp in {path}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pss_mb(pid: int) -> float:
    """Proportional set size: shared pages (libpython, the interpreter) split among sharers."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def baseline_start(prog: list[str], tmp: Path, n: int) -> list[float]:
    out = []
    for i in range(n):
        f = tmp / f"base-{i}"
        t0 = time.time_ns()
        pid = os.posix_spawn(prog[0] if prog[0].startswith("/") else shutil.which(prog[0]) or prog[0],
                             [*prog, str(f)], dict(os.environ))
        ts = read_stamp(f, time.monotonic() + 10)
        os.waitpid(pid, 0)
        out.append((ts - t0) / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--placements", type=int, default=200)
    ap.add_argument("--status-requests", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=100.0,
                    help="pause between placements (default 100: the shim pool refills, ~30 ms of CPU)")
    ap.add_argument("--quick", action="store_true", help="small sizes (make bench-quick)")
    ap.add_argument("--time-limit", type=float, default=240.0, help="stop measuring after this many seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.placements, args.status_requests, args.time_limit = 20, 30, 30.0
    tmp = Path(tempfile.mkdtemp(prefix="herd-bench-agent-"))
    # as root the agent runs workloads as nobody: they must reach the program and write
    # their timestamps (a sticky world-writable dir)
    tmp.chmod(0o755)
    stamps = tmp / "stamps"
    stamps.mkdir()
    stamps.chmod(0o1777)
    proc = None
    try:
        from infra.auth import TokenSet, auth_header, generate_token_dir
        toks = TokenSet.load(generate_token_dir(tmp / "tokens"))
        op = {**auth_header(toks.operator), "content-type": "application/json"}
        prog, prog_kind = stamp_program(tmp)
        state = tmp / "state"
        log = open(tmp / "agent.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "agent", "run", "--node-id", "bench", "--gpus", "simulated:dgx-h100",
             "--state-dir", str(state), "--listen", "127.0.0.1:0", "--no-data-plane", "--token-dir",
             str(tmp / "tokens"), "--gpu-poll-interval-s", "5"], cwd=ROOT, stdout=log, stderr=log,
            env={**os.environ, "HERD_INSECURE": "1"})  # plain HTTP and tokens: the agent's own costs, not TLS's
        deadline = time.monotonic() + 60
        while not (state / "endpoints.json").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("agent did not start:\n" + (tmp / "agent.log").read_text()[-2000:])
            time.sleep(0.05)
        url = json.loads((state / "endpoints.json").read_text())["control_url"]
        stop_at = time.monotonic() + args.time_limit
        with httpx.Client(base_url=url, timeout=30, headers=auth_header(toks.viewer)) as c:
            gpus = [g["uuid"] for g in c.get("/v1/gpus").json()["gpus"]]
            time.sleep(1.0)
            rss_idle = rss_mb(proc.pid)

            def place(wid: str, gpu: str, argv: list[str]) -> float:
                body = json.dumps({"placement_id": f"p-{wid}", "job_id": "bench", "argv": argv, "grace_s": 1.0,
                                   "pods": [{"workload_id": wid, "rank": 0, "gpus": [gpu]}]})
                t = time.perf_counter()
                r = c.post("/v1/placements", content=body, headers=op)
                if r.status_code != 200:
                    raise SystemExit(f"placement refused: {r.text}")
                return (time.perf_counter() - t) * 1e3

            def wait_done(wid: str) -> None:
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    if c.get(f"/v1/workloads/{wid}").json()["state"] in ("exited", "failed", "lost", "preempted"):
                        return
                    time.sleep(0.002)
                raise SystemExit(f"workload {wid} did not finish")

            # warm-up (not counted)
            for i in range(5):
                wid = f"warm-{i}"
                place(wid, gpus[i % 8], [*prog, str(stamps / wid)])
                try:
                    read_stamp(stamps / wid, time.monotonic() + 10)
                except TimeoutError:
                    raise SystemExit(f"workload {wid} wrote no timestamp: {c.get(f'/v1/workloads/{wid}').text}"
                                     f"\n{(tmp / 'agent.log').read_text()[-2000:]}") from None
                wait_done(wid)
            starts: list[float] = []
            acks: list[float] = []
            for i in range(args.placements):
                if time.monotonic() > stop_at:
                    break
                wid = f"s-{i}-{uuid.uuid4().hex[:6]}"
                f = stamps / wid
                t0 = time.time_ns()
                acks.append(place(wid, gpus[i % 8], [*prog, str(f)]))
                starts.append((read_stamp(f, time.monotonic() + 10) - t0) / 1e6)
                wait_done(wid)
                time.sleep(args.gap_ms / 1e3)  # placements to one node are spaced; the shim pool refills
            base = baseline_start(prog, tmp, max(50, min(len(starts), 200)))

            # 8 running workloads, then /v1/status latency against /healthz
            busy = [f"busy-{i}" for i in range(8)]
            for i, wid in enumerate(busy):
                place(wid, gpus[i], ["sleep", "600"])
            end = time.monotonic() + 20
            while time.monotonic() < end and sum(
                    w["state"] == "running" for w in c.get("/v1/workloads").json() if w["workload_id"] in busy) < 8:
                time.sleep(0.02)
            status_ms: list[float] = []
            healthz_ms: list[float] = []
            for _ in range(args.status_requests):
                if time.monotonic() > stop_at + 30:
                    break
                t = time.perf_counter()
                r = c.get("/v1/status")
                status_ms.append((time.perf_counter() - t) * 1e3)
                assert r.status_code == 200 and len(r.json()["workloads"]) >= 8
                t = time.perf_counter()
                c.get("/healthz")
                healthz_ms.append((time.perf_counter() - t) * 1e3)
            rss_busy = rss_mb(proc.pid)
            zygote, shim_pids = shim_tree(proc.pid)
            mem = {"zygote_rss_mb": rss_mb(zygote) if zygote else float("nan"),
                   "zygote_pss_mb": pss_mb(zygote) if zygote else float("nan"),
                   "zygote_uss_mb": uss_mb(zygote) if zygote else float("nan"),
                   "shim_rss_mb": _median_of(rss_mb, shim_pids), "shim_pss_mb": _median_of(pss_mb, shim_pids),
                   "shim_uss_mb": _median_of(uss_mb, shim_pids),
                   # everything the agent holds: itself, the zygote and every shim, shared pages split
                   "agent_tree_pss_busy_mb": pss_mb(proc.pid) + (pss_mb(zygote) if zygote else 0.0)
                   + sum(pss_mb(p) for p in shim_pids)}
            for wid in busy:
                c.post(f"/v1/workloads/{wid}/stop", content=b'{"grace_s": 2}', headers=op)
            for wid in busy:
                wait_done(wid)
        res = {
            "placements": len(starts), "workload_program": prog_kind, "gap_ms": args.gap_ms,
            "start_p50_ms": round(statistics.median(starts), 3), "start_p99_ms": round(pct(starts, 99), 3),
            "start_max_ms": round(max(starts), 3),
            "baseline_start_p50_ms": round(statistics.median(base), 3),
            "baseline_start_p99_ms": round(pct(base, 99), 3),
            "start_ratio_p50": round(statistics.median(starts) / statistics.median(base), 2),
            "start_overhead_p50_ms": round(statistics.median(starts) - statistics.median(base), 3),
            "ack_p50_ms": round(statistics.median(acks), 3), "ack_p99_ms": round(pct(acks, 99), 3),
            "status_p50_ms": round(statistics.median(status_ms), 3), "status_p99_ms": round(pct(status_ms, 99), 3),
            "healthz_p50_ms": round(statistics.median(healthz_ms), 3),
            "healthz_p99_ms": round(pct(healthz_ms, 99), 3),
            "status_ratio_p99": round(pct(status_ms, 99) / pct(healthz_ms, 99), 2),
            "rss_idle_mb": round(rss_idle, 1), "rss_busy_mb": round(rss_busy, 1),
            **{k: round(v, 1) for k, v in mem.items()}, "shims": len(shim_pids),
            "targets": {"start_p99_ms": 10, "status_p99_ms": 5, "rss_busy_mb": 100},
        }
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        rows = [("placement -> process start", "start", "baseline_start"),
                ("GET /v1/status, 8 workloads", "status", "healthz")]
        print(f"agent benchmark ({res['placements']} placements, workload: {res['workload_program']})")
        print(f"{'measure':32} {'p50 ms':>9} {'p99 ms':>9}   {'baseline p50':>12} {'baseline p99':>12}")
        for name, k, b in rows:
            print(f"{name:32} {res[k + '_p50_ms']:9.3f} {res[k + '_p99_ms']:9.3f}   "
                  f"{res[b + '_p50_ms']:12.3f} {res[b + '_p99_ms']:12.3f}")
        print(f"{'placement ack (POST round trip)':32} {res['ack_p50_ms']:9.3f} {res['ack_p99_ms']:9.3f}")
        print(f"start ratio p50 {res['start_ratio_p50']}x baseline (+{res['start_overhead_p50_ms']} ms); "
              f"status p99 {res['status_ratio_p99']}x /healthz")
        print(f"agent RSS idle {res['rss_idle_mb']} MB, with 8 workloads {res['rss_busy_mb']} MB; "
              f"zygote {res['zygote_rss_mb']} MB RSS / {res['zygote_pss_mb']} PSS / {res['zygote_uss_mb']} USS; "
              f"one shim {res['shim_rss_mb']} MB RSS / {res['shim_pss_mb']} PSS / {res['shim_uss_mb']} USS "
              f"({res['shims']} shims); agent + zygote + shims {res['agent_tree_pss_busy_mb']} MB PSS")
    return 0


def _ppid_and_cmd(p: Path) -> tuple[int, list[bytes]] | None:
    try:
        cmd = (p / "cmdline").read_bytes().split(b"\0")
        stat = (p / "stat").read_bytes()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2:].split()[1]), cmd


def shim_tree(agent_pid: int) -> tuple[int | None, list[int]]:
    """(the agent's shim zygote, the shims): the zygote is the agent's child running
    ``shim.py --zygote``; every shim is forked from it, so the shims are its children."""
    procs = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and (pc := _ppid_and_cmd(p)) is not None:
            procs[int(p.name)] = pc
    zygotes = [pid for pid, (ppid, cmd) in procs.items()
               if ppid == agent_pid and b"--zygote" in cmd and any(a.endswith(b"agent/shim.py") for a in cmd)]
    if not zygotes:
        return None, []
    return zygotes[0], sorted(pid for pid, (ppid, _) in procs.items() if ppid == zygotes[0])


def uss_mb(pid: int) -> float:
    """Unique set size: the pages only this process maps (its own memory; what exiting frees)."""
    try:
        kb = sum(int(line.split()[1]) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                 if line.startswith(("Private_Clean:", "Private_Dirty:")))
        return kb / 1024
    except OSError:
        return float("nan")


def _median_of(f: Any, pids: list[int]) -> float:
    return statistics.median([f(p) for p in pids]) if pids else float("nan")


if __name__ == "__main__":
    sys.exit(main())
