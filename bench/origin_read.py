"""CPU per byte of a plain-http:// origin's chunk reads: the lean client vs httpx.

    python -m bench.origin_read [--mib 256] [--repeat 4] [--concurrency 8] [--json]

A ``python -m http.server`` subprocess on loopback serves ``--mib`` 1 MiB chunk files in
the bucket layout (HTTP/1.0: a connection a request, as in ``bench.herd``); this process
reads all of them through :class:`p2p.origins.HttpOrigin` with ``--concurrency`` tasks,
once through :class:`p2p.origins.lean.LeanHttp` (the default for http://) and once
through httpx (the same origin with its lean client turned off), alternating who goes
first, ``--repeat`` times. Reported: this process's user and system CPU-s per GiB
(``getrusage`` around each read; the server's CPU is not counted) and MB/s, medians, and
the ratio httpx / lean (same run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def read_all(url: str, names: list[str], lean: bool, concurrency: int) -> dict[str, float]:
    import trio

    from p2p.origins import HttpOrigin

    async def main() -> dict[str, float]:
        o = HttpOrigin(url, max_concurrency=max(16, concurrency), retries=0)
        if not lean:
            o.http.lean = None
        total = 0

        async def worker(part: list[str]) -> None:
            nonlocal total
            for n in part:
                data = await o.get_chunk(n, MiB)   # (not `total += len(await ...)`: total is read before the await)
                total += len(data)

        (u0, s0), t0 = _cpu(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for k in range(concurrency):
                nursery.start_soon(worker, names[k::concurrency])
        (u1, s1), wall = _cpu(), time.perf_counter() - t0
        await o.aclose()
        if total != len(names) * MiB:
            raise SystemExit(f"bench.origin_read: read {total} bytes, expected {len(names) * MiB}")
        gib = total / GiB
        return {"user_s_per_gib": (u1 - u0) / gib, "sys_s_per_gib": (s1 - s0) / gib,
                "cpu_s_per_gib": (u1 - u0 + s1 - s0) / gib, "mb_s": total / wall / 1e6}

    return trio.run(main)


def run(mib: int, repeat: int, concurrency: int, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-origin-read-", dir=workdir))
    server: subprocess.Popen[bytes] | None = None
    try:
        (work / "chunks").mkdir()
        names = []
        for i in range(mib):
            cid = f"{i:064x}"
            (work / "chunks" / cid).write_bytes(os.urandom(MiB))
            names.append(cid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                   "--directory", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        load0 = [round(x, 2) for x in os.getloadavg()]
        rows: dict[str, list[dict[str, float]]] = {"lean": [], "httpx": []}
        for rep in range(repeat):
            for kind in (("lean", "httpx") if rep % 2 == 0 else ("httpx", "lean")):
                rows[kind].append(read_all(url, names, kind == "lean", concurrency))
        med = {k: {f: round(statistics.median(r[f] for r in v), 3) for f in v[0]} for k, v in rows.items()}
        return {"mib": mib, "repeat": repeat, "concurrency": concurrency, **med,
                "cpu_ratio_httpx_over_lean": round(med["httpx"]["cpu_s_per_gib"] / med["lean"]["cpu_s_per_gib"], 3),
                "load_before": load0, "load_after": [round(x, 2) for x in os.getloadavg()]}
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.origin_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.mib, a.repeat, a.concurrency, Path(a.workdir or tempfile.gettempdir()))
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"origin reads: {a.mib} MiB of 1 MiB chunks over loopback HTTP, {a.concurrency} at once, "
          f"medians of {a.repeat}; load {r['load_before']} -> {r['load_after']}")
    for k in ("lean", "httpx"):
        v = r[k]
        print(f"{k:6s} {v['cpu_s_per_gib']:6.2f} CPU-s/GiB (user {v['user_s_per_gib']:.2f}, sys {v['sys_s_per_gib']:.2f})"
              f"  {v['mb_s']:7.1f} MB/s")
    print(f"httpx / lean CPU per GiB: {r['cpu_ratio_httpx_over_lean']:.2f}x (same run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
