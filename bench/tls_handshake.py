"""The cost of one mutual-TLS handshake here: CPU per connection, both sides together.

    python -m bench.tls_handshake [--n 300] [--json]

One trio process, a loopback listener: ``--n`` sequential connections, each a full TLS 1.3
handshake with client certificates (ECDSA P-256, the cluster CA of scheduler_link.pki), then
closed. Both ends run in this one thread, so the CPU time around a client's connect counts the
server's handshake work too (it runs while the client awaits): the figure is client + server.
The same-run baseline is the same connections without TLS (TCP connect + accept + close).
Medians over ``--rounds`` rounds. Records the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scheduler_link import pki, tls  # noqa: E402


async def _round(n: int, use_tls: bool, ca: pki.ThrowawayPKI) -> dict[str, float]:
    sctx = tls.server_context(ca.files("placer")) if use_tls else None
    cctx = tls.client_context(ca.ca, ca.files("node:bench")) if use_tls else None
    server_cpu = [0.0]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    done = trio.Semaphore(0)

    async def handle(stream: trio.SocketStream) -> None:
        t0 = time.process_time()
        s = await tls.accept(stream, sctx) if sctx else stream
        await s.send_all(b"k")
        server_cpu[0] += time.process_time() - t0
        await s.aclose()
        done.release()

    client_cpu = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        wall0 = time.perf_counter()
        for _ in range(n):
            t0 = time.process_time()
            s = await tls.connect("127.0.0.1", port, cctx)
            await s.receive_some(1)
            client_cpu += time.process_time() - t0
            await s.aclose()
            await done.acquire()
        wall = time.perf_counter() - wall0
        nursery.cancel_scope.cancel()
    return {"wall_ms_per_conn": 1000 * wall / n, "cpu_ms_per_conn": 1000 * (client_cpu) / n,
            "server_handler_cpu_ms": 1000 * server_cpu[0] / n}


async def main_async(n: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        ca = pki.throwaway(Path(d) / "pki")
        out: dict[str, Any] = {"n": n, "rounds": rounds, "load_before": list(os.getloadavg())}
        res: dict[str, list[dict[str, float]]] = {"plain": [], "tls": []}
        for r in range(rounds):
            for mode in (("plain", "tls") if r % 2 == 0 else ("tls", "plain")):
                res[mode].append(await _round(n, mode == "tls", ca))
        for mode, rows in res.items():
            out[mode] = {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
        out["tls_extra_cpu_ms_per_conn"] = round(out["tls"]["cpu_ms_per_conn"] - out["plain"]["cpu_ms_per_conn"], 3)
        out["load_after"] = list(os.getloadavg())
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tls_handshake")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = trio.run(main_async, a.n, a.rounds)
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{a.n} connections x {a.rounds} rounds (medians), load {out['load_before']} -> {out['load_after']}")
        for mode in ("plain", "tls"):
            m = out[mode]
            print(f"  {mode:5}: {m['wall_ms_per_conn']:.3f} ms wall/conn, {m['cpu_ms_per_conn']:.3f} ms CPU/conn "
                  f"(client + server, one process), server handler {m['server_handler_cpu_ms']:.3f} ms")
        print(f"  mutual-TLS handshake: +{out['tls_extra_cpu_ms_per_conn']:.3f} ms CPU per connection (both sides)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
