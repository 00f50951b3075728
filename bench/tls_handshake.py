"""The cost of one mutual-TLS handshake here: CPU per connection, both sides together.

    python -m bench.tls_handshake [--n 300] [--json]

One trio process, a loopback listener: ``--n`` sequential connections, each a full TLS 1.3
handshake with client certificates (ECDSA P-256, the cluster CA of infra.pki), then
closed. Both ends run in this one thread, so the CPU time around a client's connect counts the
server's handshake work too (it runs while the client awaits): the figure is client + server.
The same-run baseline is the same connections without TLS (TCP connect + accept + close).
Medians over ``--rounds`` rounds. Records the machine's load average.

A second, component figure (no sockets, no trio): the handshake alone, client and server
``SSLObject`` s over memory BIOs in this thread, each side's ``do_handshake`` calls timed in
thread CPU time, with our contexts (the leaf certificate only: ``tls.send_leaf_only``) against
the same material in contexts left at OpenSSL's default (it re-verifies its own chain and sends
the CA too), alternating, same run. Instruction counts (load-independent) come from running
this under ``valgrind --tool=callgrind`` with ``--memory-only``.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra import pki, tls  # noqa: E402


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


def _default_chain(files: tls.TLSFiles, server: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cafile=str(files.ca))
    ctx.load_cert_chain(str(files.cert), str(files.key))
    if server:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.num_tickets = 0
    else:
        ctx.check_hostname = False
    return ctx


def _memory_pairs(sctx: ssl.SSLContext, cctx: ssl.SSLContext, n: int) -> dict[str, float]:
    cs: list[float] = []
    ss: list[float] = []
    for _ in range(n):
        ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        c = cctx.wrap_bio(ci, co, server_side=False)
        s = sctx.wrap_bio(si, so, server_side=True)
        ct = st = 0.0
        cdone = sdone = False
        for _ in range(8):
            t = time.thread_time()
            try:
                c.do_handshake()
                cdone = True
            except ssl.SSLWantReadError:
                pass
            ct += time.thread_time() - t
            si.write(co.read())
            t = time.thread_time()
            try:
                s.do_handshake()
                sdone = True
            except ssl.SSLWantReadError:
                pass
            st += time.thread_time() - t
            ci.write(so.read())
            if cdone and sdone:
                break
        if not (cdone and sdone):
            raise RuntimeError("in-memory handshake did not complete")
        cs.append(ct)
        ss.append(st)
    return {"client_cpu_ms": round(1000 * statistics.median(cs), 3),
            "server_cpu_ms": round(1000 * statistics.median(ss), 3)}


def memory_rows(n: int, rounds: int, ca: pki.ThrowawayPKI) -> dict[str, Any]:
    sf, cf = ca.files("placer"), ca.files("node:bench")
    ours = (tls.server_context(sf), tls.client_context(ca.ca, cf))
    default = (_default_chain(sf, True), _default_chain(cf, False))
    res: dict[str, list[dict[str, float]]] = {"leaf_only": [], "default_chain": []}
    for r in range(rounds):
        for mode in (("leaf_only", "default_chain") if r % 2 == 0 else ("default_chain", "leaf_only")):
            res[mode].append(_memory_pairs(*(ours if mode == "leaf_only" else default), n))
    out: dict[str, Any] = {"leaf_only_took": tls.sends_leaf_only(ours[0]) and tls.sends_leaf_only(ours[1])}
    for mode, rows in res.items():
        out[mode] = {k: round(statistics.median(x[k] for x in rows), 3) for k in rows[0]}
    return out


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
        out["memory"] = memory_rows(n, rounds, ca)
        out["load_after"] = list(os.getloadavg())
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tls_handshake")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the in-memory handshake rows (for valgrind --tool=callgrind)")
    a = ap.parse_args(argv)
    if a.memory_only:
        with tempfile.TemporaryDirectory() as d:
            mem = memory_rows(a.n, a.rounds, pki.throwaway(Path(d) / "pki"))
        print(json.dumps({"n": a.n, "rounds": a.rounds, "memory": mem}))
        return 0
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
        mem = out["memory"]
        print("  component, in memory (the handshake alone, thread CPU per side):")
        for mode in ("leaf_only", "default_chain"):
            m = mem[mode]
            print(f"    {mode:13}: client {m['client_cpu_ms']:.3f} ms, server {m['server_cpu_ms']:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
