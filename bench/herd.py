"""Herd benchmark on rate-limited links in network namespaces.

    python -m bench.herd [--nodes N] [--size-mb S] [--rate 100mbit] [--json]

Builds N host namespaces plus an origin namespace on a private bridge (bench/netns.py:
made here, removed at the end, even on error or Ctrl-C), every host link shaped with
``tc`` in both directions (``--shaping``: htb by default, tbf the older token bucket; the
run's JSON names the exact tc lines). The origin serves a published artifact over plain
HTTP (``python -m http.server``, read-only, the bucket layout) from its namespace; each
host runs one data plane + fetcher process (``ip netns exec``). All nodes fetch the
same artifact at once, twice, on cold stores:

(a) origin only — no peers: every node pulls the whole artifact from the origin;
(b) herd — every node gets the full peer list.

Reported per mode: time until the last node completes / ideal (S / link rate), the
per-node completion p50/p99, and origin egress / S — app-level (bytes the nodes got
from the origin) and on the wire (the origin eth0's tx bytes, L2 headers included).
Mode (a) is the same-run baseline: ``herd_speedup`` = (a) / (b).

Needs root, iproute2 and the shaping's qdiscs; says why and exits 0 without results where any
is missing. Bounded: each mode has a deadline derived from the ideal time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ORIGIN_PORT = 8080
DATA_PORT = 7070
TOKEN = "bench-cluster-token"


# ---------------------------------------------------------------------------------- worker

def worker_main(argv: list[str]) -> int:
    """One node, inside its namespace: serve the data plane, fetch on "go", report, and
    keep serving until stdin closes (others may still need our chunks)."""
    import trio

    from p2p.dataplane import DataPlane
    from p2p.fetch import fetch_artifact
    from p2p.herd import Herd, HerdConfig
    from p2p.origins import open_origin
    from p2p.store import ChunkStore
    from scheduler_link.messages import Peer

    p = argparse.ArgumentParser()
    p.add_argument("--node-id", required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--origin", required=True)
    p.add_argument("--manifest", required=True)
    a = p.parse_args(argv)

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def main() -> None:
        store = ChunkStore(a.store)
        plane = DataPlane(store, token=TOKEN, listen=a.listen)
        # the origin's client made before "ready", as a long-lived agent has it: made after
        # "go" it cost each node ~0.3 CPU-s of imports and TLS set-up at the same moment
        origin = open_origin(a.origin, max_concurrency=16)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(plane.run)
            say({"ready": url})
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            go = json.loads(line)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)   # start-up (imports, the store) excluded below
            peers = [Peer(node_id=x["node_id"], data_url=x["data_url"]) for x in go["peers"]]
            herd = None
            if go["mode"] == "herd":
                cfg = HerdConfig(wait_ms=120_000, workers=go["workers"], per_peer=8, origin_concurrency=8,
                                 home_concurrency=go["home"], tree=bool(go.get("tree", True)))
                if go.get("batch_wait") is not None:
                    cfg = dataclasses.replace(cfg, batch_wait_chunks=int(go["batch_wait"]))
                if go.get("set"):
                    cfg = dataclasses.replace(cfg, **go["set"])
                herd = Herd(store, node_id=a.node_id, token=TOKEN, config=cfg)
            t0 = time.time()
            curve: list[tuple[float, int, int]] = []

            def progress(done: int, total: int) -> None:
                if not curve or done - curve[-1][1] >= total // 20 or done == total:
                    fo = herd.counters.bytes_from_origin if herd is not None else 0
                    curve.append((round(time.time() - t0, 2), done, fo))

            try:
                st = await fetch_artifact(store, a.manifest, origin, peers=peers, node_id=a.node_id,
                                          token=TOKEN, herd=herd, progress=progress)
                res: dict[str, Any] = {"node": a.node_id, "t_start": t0, "t_end": time.time(),
                                       "bytes_from_origin": st.bytes_from_origin,
                                       "bytes_from_peers": st.bytes_from_peers, "bytes": st.bytes,
                                       "curve": curve}
                ru = resource.getrusage(resource.RUSAGE_SELF)
                res["cpu_s"] = round(ru.ru_utime + ru.ru_stime, 3)
                res["cpu_user_s"] = round(ru.ru_utime, 3)
                res["cpu_start_s"] = round(ru0.ru_utime + ru0.ru_stime, 3)
                res["cpu_fetch_s"] = round(ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, 3)
                res["cpu_fetch_sys_s"] = round(ru.ru_stime - ru0.ru_stime, 3)
                ps = plane.statistics()
                res["plane_requests"] = ps["requests"]
                res["plane_wait_batches"] = ps["wait_batches"]
                if herd is not None:
                    hs = herd.statistics()
                    res["endgame_duplicates"] = hs["endgame_duplicates"]
                    res["peer_errors"] = sum(v["errors"] for v in hs["peers"].values())
            except Exception as e:
                res = {"node": a.node_id, "error": f"{type(e).__name__}: {e}"}
            say(res)
            await trio.to_thread.run_sync(sys.stdin.read)   # until the coordinator closes it
            if herd is not None:
                await herd.aclose()
            await origin.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return 0


# ---------------------------------------------------------------------------------- plain TCP

TCP_PORT = 7071
_TCP_BUF = 1 << 20


def tcp_worker_main(argv: list[str]) -> int:
    """The plain-TCP baseline's two ends, inside a namespace (no herd code at all).

    ``--recv IP:PORT --conns K``: accept K connections, read each to EOF, report bytes and
    the time the last byte came. ``--send --to IP:PORT,... --bytes B --streams S``: after
    "go" on stdin, S connections to each target, B bytes to each target split over them.
    ``--relay IP:PORT,...`` (with ``--recv``; the sender with ``--tag``): on "go", one
    connection to each of those peers; every byte that comes on a connection the origin
    tagged is forwarded to each of them as it comes (the herd's pattern -- each host
    gets 1/N from the origin and passes it on -- with nothing but sockets). Every socket
    and queue wait has a timeout, so every loop ends."""
    import queue
    import socket
    import threading

    p = argparse.ArgumentParser()
    p.add_argument("--recv", default="")
    p.add_argument("--conns", type=int, default=1)
    p.add_argument("--send", action="store_true")
    p.add_argument("--to", default="")
    p.add_argument("--bytes", type=int, default=0)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--relay", default="")
    p.add_argument("--tag", action="store_true")
    a = p.parse_args(argv)

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    errors: list[str] = []
    if a.recv:
        host, _, port = a.recv.rpartition(":")
        ls = socket.create_server((host, int(port)), backlog=64)
        ls.settimeout(120)
        say({"ready": a.recv})
        got = [0] * a.conns
        ends = [0.0] * a.conns
        relay = [x for x in a.relay.split(",") if x]
        # one bounded queue per peer: a slow peer holds the origin's connections back
        # (as a full socket would), never this process's memory
        outq: list[queue.Queue[bytes | None]] = [queue.Queue(maxsize=64) for _ in relay]
        origin_open = [0]
        lock = threading.Lock()

        def forwarder(target: str, q: queue.Queue[bytes | None]) -> None:
            host, _, port = target.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=60) as c:
                    c.sendall(b"P")
                    while (data := q.get(timeout=120)) is not None:
                        c.sendall(data)
            except (OSError, queue.Empty) as e:
                errors.append(f"forward {type(e).__name__}: {e}")

        def reader(i: int, c: socket.socket) -> None:
            buf = bytearray(_TCP_BUF)
            try:
                with c:
                    c.settimeout(60)
                    tag = c.recv(1) if relay else b""
                    if tag == b"O":
                        with lock:
                            origin_open[0] += 1
                        while data := c.recv(_TCP_BUF):
                            got[i] += len(data)
                            for q in outq:
                                q.put(data, timeout=120)
                        with lock:
                            origin_open[0] -= 1
                            last = origin_open[0] == 0
                        if last:
                            for q in outq:
                                q.put(None, timeout=120)
                    else:
                        while n := c.recv_into(buf):
                            got[i] += n
                    ends[i] = time.time()
            except (OSError, queue.Full) as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = []
        if relay:
            sys.stdin.readline()
            for target, q in zip(relay, outq, strict=True):
                t = threading.Thread(target=forwarder, args=(target, q), daemon=True)
                t.start()
                threads.append(t)
        try:
            for i in range(a.conns):
                c, _ = ls.accept()
                t = threading.Thread(target=reader, args=(i, c), daemon=True)
                t.start()
                threads.append(t)
            for t in threads:
                t.join(300)
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
        res: dict[str, Any] = {"bytes": sum(got), "t_end": max(ends)}
    else:
        targets = [x for x in a.to.split(",") if x]
        say({"ready": "sender"})
        sys.stdin.readline()
        payload = memoryview(os.urandom(_TCP_BUF))
        t0 = time.time()

        def writer(target: str, n: int) -> None:
            host, _, port = target.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=60) as c:
                    if a.tag:
                        c.sendall(b"O")
                    while n > 0:
                        k = min(n, _TCP_BUF)
                        c.sendall(payload[:k])
                        n -= k
            except OSError as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = []
        for tg in targets:
            for s in range(a.streams):
                share = a.bytes // a.streams + (1 if s < a.bytes % a.streams else 0)
                threads.append(threading.Thread(target=writer, args=(tg, share), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        res = {"bytes": a.bytes * len(targets), "t_start": t0, "t_end": time.time()}
    if errors:
        res["error"] = errors[0]
    say(res)
    return 0


def run_tcp_mode(hosts: list[Any], origin_host: Any, size: int, ideal: float, streams: int,
                 relay: bool = False, hub: str = "") -> dict[str, Any]:
    """The same-run plain-TCP baselines, through the same shaped links, no herd code.

    ``tcp``: the origin's namespace sends ``size`` bytes split evenly over the hosts,
    ``streams`` TCP connections to each (as many as the herd's homes open to the origin):
    what the lab lets one origin uplink do with plain sockets.
    ``relay`` (the herd's traffic pattern): the same, and each host forwards what the
    origin sends it to every other host as it comes, so every host ends with ``size``
    bytes, every link carrying what the herd's would; completion is the last host's."""
    procs: list[subprocess.Popen[str]] = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    each = [size // len(hosts) + (1 if i < size % len(hosts) else 0) for i in range(len(hosts))]
    try:
        for h in hosts:
            extra = []
            if relay:
                extra = ["--relay", ",".join(f"{o.ip}:{TCP_PORT}" for o in hosts if o is not h),
                         "--conns", str(streams + len(hosts) - 1)]
            else:
                extra = ["--conns", str(streams)]
            argv = h.exec_argv([sys.executable, "-m", "bench.herd", "--tcp-worker", "--recv",
                                f"{h.ip}:{TCP_PORT}", *extra])
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env))
        # one sender per target size (they differ by at most one byte): one process, same share
        argv = origin_host.exec_argv([sys.executable, "-m", "bench.herd", "--tcp-worker", "--send",
                                      "--to", ",".join(f"{h.ip}:{TCP_PORT}" for h in hosts),
                                      "--bytes", str(each[0]), "--streams", str(streams),
                                      *(["--tag"] if relay else [])])
        sender = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
        procs.append(sender)
        _read_lines(procs, time.monotonic() + 60, "tcp start")
        tx0 = origin_host.tx_bytes()
        t_go = time.time()
        for p in procs if relay else [sender]:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        sampler = _Sampler(origin_host, hub) if os.environ.get("HERD_BENCH_CURVES") else None
        results = _read_lines(procs, time.monotonic() + ideal * 3 + 60, "tcp transfer")
        tx1 = origin_host.tx_bytes()
        if sampler is not None:
            sampler.report()
    finally:
        for p in procs:
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"tcp: {len(errors)} ends failed: {errors[0]}")
    recv = results[:-1]
    sent = each[0] * len(hosts)
    want = sent * len(hosts) if relay else sent
    if sum(r["bytes"] for r in recv) != want:
        raise RuntimeError(f"tcp: {sum(r['bytes'] for r in recv)} bytes received of {want}")
    ends = [r["t_end"] - t_go for r in recv]
    completion = max(ends)
    return {
        "completion_s": round(completion, 3),
        "completion_over_ideal": round(completion / ideal, 3),
        "node_p50_s": round(_pctl(ends, 0.5), 3),
        "node_p99_s": round(_pctl(ends, 0.99), 3),
        "origin_egress_over_size": round(sent / size, 4),
        "origin_wire_egress_over_size": round((tx1 - tx0) / size, 4),
        "streams_per_host": streams,
        "node_cpu_s": {},
        "node_cpu_fetch_s_p50": 0.0,
    }


# ---------------------------------------------------------------------------------- coordinator

def _read_lines(procs: list[subprocess.Popen[str]], deadline: float, what: str) -> list[dict[str, Any]]:
    """One JSON line from each process's stdout, by ``deadline`` (monotonic)."""
    sel = selectors.DefaultSelector()
    out: dict[int, dict[str, Any]] = {}
    bufs: dict[int, str] = {}
    for i, p in enumerate(procs):
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        sel.register(p.stdout, selectors.EVENT_READ, i)
        bufs[i] = ""
    try:
        while len(out) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: {len(procs) - len(out)} of {len(procs)} nodes did not answer in time")
            for key, _ in sel.select(timeout=min(left, 1.0)):
                i = key.data
                chunk = os.read(key.fd, 65536).decode()
                if not chunk:
                    sel.unregister(key.fileobj)
                    if i not in out:
                        raise RuntimeError(f"{what}: node {i} exited: {procs[i].stderr.read() if procs[i].stderr else ''}")
                    continue
                bufs[i] += chunk
                if "\n" in bufs[i] and i not in out:
                    line, _, rest = bufs[i].partition("\n")
                    out[i] = json.loads(line)
                    bufs[i] = rest
    finally:
        sel.close()
    return [out[i] for i in range(len(procs))]


class _Sampler:
    """Debug aid (HERD_BENCH_CURVES=1): the origin's tx rate every 0.5 s, and every host
    link's download and upload (MB/s, the hub side of each veth)."""

    def __init__(self, host: Any, hub: str = "") -> None:
        import threading

        self.host = host
        self.hub = hub
        self.rates: list[float] = []
        self.links: list[list[tuple[float, float]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _links(self) -> list[tuple[int, int]]:
        if not self.hub:
            return []
        r = subprocess.run(["ip", "netns", "exec", self.hub, "sh", "-c",
                            "for d in /sys/class/net/vh*; do echo $(cat $d/statistics/tx_bytes) "
                            "$(cat $d/statistics/rx_bytes); done"], capture_output=True, text=True, timeout=5)
        return [(int(a), int(b)) for a, b in (ln.split() for ln in r.stdout.split("\n") if ln.strip())]

    def _run(self) -> None:
        # rates over the time that really passed (under load a sample takes longer than 0.5 s)
        last, t_last = self.host.tx_bytes(), time.monotonic()
        llast, tl_last = self._links(), time.monotonic()
        while not self._stop.wait(0.5):
            now, t = self.host.tx_bytes(), time.monotonic()
            self.rates.append(round((now - last) / max(t - t_last, 1e-3) / 1e6, 1))
            last, t_last = now, t
            lnow, tl = self._links(), time.monotonic()
            dt = max(tl - tl_last, 1e-3)
            self.links.append([(round((a - a0) / dt / 1e6, 1), round((b - b0) / dt / 1e6, 1))
                               for (a, b), (a0, b0) in zip(lnow, llast, strict=False)])
            llast, tl_last = lnow, tl

    def stop(self) -> list[float]:
        self._stop.set()
        self._t.join()
        return self.rates

    def report(self) -> None:
        print("origin MB/s per 0.5s:", self.stop(), file=sys.stderr)
        for t, row in enumerate(self.links):   # vh0 is the origin's link
            print(f"t={t / 2:5.1f} down/up MB/s:", " ".join(f"{d:4.1f}/{u:4.1f}" for d, u in row), file=sys.stderr)


def _pctl(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def run_mode(lab: Any, hosts: list[Any], origin_host: Any, mode: str, manifest_id: str,
             size: int, work: Path, ideal: float, tuning: dict[str, Any], baseline: Path | None = None) -> dict[str, Any]:
    procs: list[subprocess.Popen[str]] = []
    name = mode
    root = ROOT
    if mode == "baseline":   # the herd mode of another checkout's code (--baseline-root), same lab, same run
        assert baseline is not None
        root, mode = baseline, "herd"
    env = dict(os.environ, PYTHONPATH=str(root), HERD_LOG_LEVEL="WARNING")
    # herd@rack_fanout=3: HerdConfig fields set for this mode (several joined by '+':
    # herd@balance_homes=0+batch_wait_chunks=0)
    mode, _, over = mode.partition("@")
    sets = {k: int(v) for k, _, v in (kv.partition("=") for kv in over.replace("+", ",").split(",") if kv)}
    budget = ideal * (len(hosts) if mode == "origin" else 1) * 3 + 60
    try:
        for h in hosts:
            store = work / f"{name}-{h.index}"
            argv = h.exec_argv([sys.executable, "-m", "bench.herd", "--worker", "--node-id", f"n{h.index}",
                                "--listen", f"{h.ip}:{DATA_PORT}", "--store", str(store),
                                "--origin", f"http://{origin_host.ip}:{ORIGIN_PORT}", "--manifest", manifest_id])
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, cwd=root, env=env))
        ready = _read_lines(procs, time.monotonic() + 60, "start")
        peers = [{"node_id": f"n{h.index}", "data_url": r["ready"]} for h, r in zip(hosts, ready, strict=True)]
        tx0 = origin_host.tx_bytes()
        herd = mode in ("herd", "flat", "perchunk")
        go = json.dumps({"mode": "herd" if herd else "origin", "peers": peers if herd else [],
                         "workers": tuning["workers"], "home": tuning["home"],
                         "tree": bool(tuning.get("tree", True)) and mode != "flat",
                         # perchunk: the trees with one waiting request per chunk (before batches could wait)
                         "batch_wait": 1 if mode == "perchunk" else tuning.get("batch_wait"), "set": sets}) + "\n"
        t_go = time.time()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(go)
            p.stdin.flush()
        sampler = _Sampler(origin_host, lab.hub) if os.environ.get("HERD_BENCH_CURVES") else None
        results = _read_lines(procs, time.monotonic() + budget, f"{mode} fetch")
        tx1 = origin_host.tx_bytes()
        if sampler is not None:
            sampler.report()
    finally:
        for p in procs:
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for h in hosts:
            shutil.rmtree(work / f"{name}-{h.index}", ignore_errors=True)
    if os.environ.get("HERD_BENCH_CURVES"):
        for r in results:
            print(r["node"], " ".join(f"{c[0]}:{c[1] >> 20}/{c[2] >> 20}" for c in r.get("curve", [])),
                  file=sys.stderr)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{mode}: {len(errors)} nodes failed: {errors[0]}")
    ends = [r["t_end"] - t_go for r in results]
    completion = max(ends)
    return {
        "completion_s": round(completion, 3),
        "completion_over_ideal": round(completion / ideal, 3),
        "node_p50_s": round(_pctl(ends, 0.5), 3),
        "node_p99_s": round(_pctl(ends, 0.99), 3),
        "origin_egress_over_size": round(sum(r["bytes_from_origin"] for r in results) / size, 4),
        "origin_wire_egress_over_size": round((tx1 - tx0) / size, 4),
        "bytes_from_peers": sum(r["bytes_from_peers"] for r in results),
        "endgame_duplicates": sum(r.get("endgame_duplicates", 0) for r in results),
        "peer_errors": sum(r.get("peer_errors", 0) for r in results),
        # data-plane requests answered by all nodes up to their own completion, and how
        # many of them were batches that could wait
        "plane_requests": sum(r.get("plane_requests", 0) for r in results),
        "plane_wait_batches": sum(r.get("plane_wait_batches", 0) for r in results),
        "node_cpu_s_p50": round(_pctl([r.get("cpu_s", 0.0) for r in results], 0.5), 3),
        "node_cpu_s_max": round(max(r.get("cpu_s", 0.0) for r in results), 3),
        "node_cpu_s": {r["node"]: r.get("cpu_s", 0.0) for r in sorted(results, key=lambda r: int(r["node"][1:]))},
        "node_cpu_user_s_p50": round(_pctl([r.get("cpu_user_s", 0.0) for r in results], 0.5), 3),
        # from "go" to this node's completion: the start-up (imports, the store) left out
        "node_cpu_start_s_p50": round(_pctl([r.get("cpu_start_s", 0.0) for r in results], 0.5), 3),
        "node_cpu_fetch_s_p50": round(_pctl([r.get("cpu_fetch_s", 0.0) for r in results], 0.5), 3),
        "node_cpu_fetch_sys_s_p50": round(_pctl([r.get("cpu_fetch_sys_s", 0.0) for r in results], 0.5), 3),
    }


def publish_artifact(src_dir: Path, origin_dir: Path, size_mb: float) -> tuple[str, int]:
    import trio

    from p2p.origins import open_origin
    from p2p.publish import publish

    src_dir.mkdir(parents=True)
    n = int(size_mb * 1024 * 1024)
    with open(src_dir / "weights.bin", "wb") as f:
        left = n
        while left:
            k = min(left, 8 << 20)
            f.write(os.urandom(k))
            left -= k

    async def go() -> Any:
        async with open_origin(f"file://{origin_dir}") as origin:
            return await publish(src_dir, origin, "bench:herd")

    st = trio.run(go)
    return st.manifest, st.bytes


def run(nodes: int, size_mb: float, rate: str, modes: list[str],
        tuning: dict[str, Any] | None = None, burst: str = "64kb", latency: str = "400ms",
        mtu: int = 1500, baseline: Path | None = None, bridge_nf: bool = False,
        sysctls: dict[str, str] | None = None, origin_http: str = "1.0",
        shapings: list[str] | None = None, queue: str = "100ms") -> dict[str, Any]:
    """``shapings`` (entries of :func:`shaping_of`; default htb): with several, every mode runs
    under each in turn in the same lab (the links reshaped between), and its keys carry
    the shaping (``herd_tbf_completion_s``); with one, the keys are the mode's alone."""
    from bench.netns import NetLab, check, rate_bits

    kinds = shapings or ["htb"]
    shapes = {k: shaping_of(k, rate=rate, burst=burst, latency=latency, queue=queue) for k in kinds}
    for sh in shapes.values():
        check(shaping=sh)
    work = Path(tempfile.mkdtemp(prefix="herd-bench-"))
    origin_proc: subprocess.Popen[bytes] | None = None
    try:
        mid, size = publish_artifact(work / "src", work / "origin", size_mb)
        shutil.rmtree(work / "src")
        ideal = size * 8 / rate_bits(rate)
        out: dict[str, Any] = {"nodes": nodes, "size_mb": size_mb, "rate": rate, "ideal_s": round(ideal, 3),
                               "bytes": size, "mtu": mtu, "origin_http": origin_http,
                               "tbf_burst": burst, "tbf_latency": latency, "bridge_nf": bridge_nf, "sysctls": dict(sysctls or {}),
                               "shapings": {k: sh.describe() for k, sh in shapes.items()}}
        with NetLab(shapes[kinds[0]], mtu=mtu, bridge_nf=bridge_nf, sysctls=sysctls or {}) as lab:
            origin_host = lab.add_host(octet=2)
            hosts = [lab.add_host(octet=10 + i) for i in range(nodes)]
            origin_proc = subprocess.Popen(
                origin_host.exec_argv([sys.executable, "-m", "bench.herd", "--origin-server", origin_host.ip,
                                       str(ORIGIN_PORT), str(work / "origin"), origin_http]),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _wait_port(origin_host, ORIGIN_PORT)
            out["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            tun = tuning or {"workers": 16, "home": None}
            # the plain-TCP modes open as many streams to the origin as the herd's homes do
            from p2p.herd import HerdConfig, home_streams
            streams = tun["home"] or home_streams(HerdConfig(), homes=len(hosts))
            # modes outer, shapings inner: each pair of one mode's runs back to back
            for mode in modes:
                for kind in kinds:
                    if lab.shaping != shapes[kind]:
                        lab.reshape(shapes[kind])
                    if mode in ("tcp", "relay"):
                        res = run_tcp_mode(hosts, origin_host, size, ideal, streams, relay=mode == "relay",
                                           hub=lab.hub)
                    else:
                        res = run_mode(lab, hosts, origin_host, mode, mid, size, work, ideal, tun, baseline)
                    key = {"origin": "origin_only", "tcp": "tcp", "relay": "relay", "herd": "herd", "flat": "flat",
                           "perchunk": "perchunk", "baseline": "baseline"}.get(
                        mode, mode.replace("@", "_").replace("=", "").replace(",", "_").replace("+", "_"))
                    if len(kinds) > 1:
                        key = f"{key}_{kind.replace(':', '')}"
                    for k, v in res.items():
                        out[f"{key}_{k}"] = v
        out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        if "origin_only_completion_s" in out and "herd_completion_s" in out:
            out["herd_speedup"] = round(out["origin_only_completion_s"] / out["herd_completion_s"], 2)
        return out
    finally:
        if origin_proc is not None:
            origin_proc.terminate()
            try:
                origin_proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                origin_proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def shaping_of(spec: str, *, rate: str, burst: str, latency: str, queue: str) -> Any:
    """``--shaping`` entry -> bench.netns.Shaping: ``tbf``, ``htb``, or a kind with its
    queue (``tbf:50ms``: tbf's latency; ``htb:100ms``: htb's bulk FIFO), so one run can
    compare queue sizes too. Raises ValueError on a bad one."""
    from bench.netns import Shaping

    kind, _, q = spec.partition(":")
    if q and kind == "tbf":
        latency = q
    elif q:
        queue = q
    return Shaping(kind=kind, rate=rate, burst=burst, latency=latency, queue=queue)


def origin_server_main(bind: str, port: str, directory: str, http: str = "1.1") -> int:
    """The bench's origin: the stdlib's read-only static file server over ``directory``
    (the bucket layout), threaded. ``http`` "1.1" keeps connections alive, as GCS and
    any production object store do (the herd's origin client reuses them); "1.0" is
    ``python -m http.server`` as it comes: one TCP connection per chunk, each starting
    in slow start."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Handler(SimpleHTTPRequestHandler):
        protocol_version = f"HTTP/{http}"

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    with ThreadingHTTPServer((bind, int(port)), functools.partial(Handler, directory=directory)) as srv:
        srv.serve_forever()
    return 0


def _wait_port(host: Any, port: int) -> None:
    probe = f"import socket,sys; socket.create_connection(('{host.ip}', {port}), timeout=1)"
    for _ in range(100):
        if subprocess.run(host.exec_argv([sys.executable, "-c", probe]), capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("origin HTTP server did not start")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "--origin-server":
        return origin_server_main(*argv[1:])
    if argv and argv[0] == "--tcp-worker":
        return tcp_worker_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.herd", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--size-mb", type=float, default=64.0)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--modes", default="origin,herd",
                   help="comma list of origin (no peers), herd (trees), flat (the design before the trees), "
                        "perchunk (the trees, one waiting request per chunk: before batches could wait), "
                        "tcp (plain TCP, no herd: the origin sends the size split over the hosts, "
                        "--home-concurrency connections to each), relay (plain TCP in the herd's pattern: "
                        "that, and each host forwards what it gets to every other host)")
    p.add_argument("--workers", type=int, default=16, help="herd: chunks in flight per node")
    p.add_argument("--flat", action="store_true", help="herd: the flat design before the trees (HerdConfig.tree=False)")
    p.add_argument("--home-concurrency", type=int, default=None,
                   help="herd: origin streams per home (default: HerdConfig's, derived from the number of homes)")
    p.add_argument("--shaping", default="htb",
                   help="how every host link is shaped, both directions (bench.netns): htb (default: the link "
                        "rate, small TCP packets such as ACKs ahead of a --queue bulk FIFO, as a NIC and a switch "
                        "port behave), tbf (one token bucket and a --tbf-latency FIFO: the older lab); "
                        "a comma list (tbf,htb) runs every mode under each in the same run; kind:QUEUE sets "
                        "that one's queue (tbf:50ms, htb:100ms)")
    p.add_argument("--tbf-burst", default="64kb", help="the token bucket of either shaping (default 64kb)")
    p.add_argument("--tbf-latency", default="400ms", help="tbf: its queue, as latency at the rate (default 400ms)")
    p.add_argument("--queue", default="100ms", help="htb: the bulk FIFO, as time at the rate (default 100ms)")
    p.add_argument("--mtu", type=int, default=1500, help="MTU of every host link (9000: jumbo frames)")
    p.add_argument("--bridge-nf", action="store_true",
                   help="run bridged frames through iptables in the hub (br_netfilter; off by default, see bench.netns)")
    p.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every host namespace (repeatable), e.g. net.ipv4.tcp_slow_start_after_idle=0")
    p.add_argument("--baseline-root", type=Path, default=None,
                   help="mode 'baseline': the herd mode run from this checkout's code (e.g. the main branch)")
    p.add_argument("--origin-http", choices=("1.0", "1.1"), default="1.0",
                   help="the origin's HTTP version: 1.1 keeps connections alive, "
                        "1.0 (default) opens one per chunk (python -m http.server as it comes)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not 1 <= a.nodes <= 64:
        p.error("--nodes must be 1..64")
    if not 0 < a.size_mb <= 4096:
        p.error("--size-mb must be in (0, 4096]")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m.partition("@")[0] not in ("origin", "herd", "flat", "perchunk", "baseline", "tcp", "relay")
                        for m in modes):
        p.error("--modes: origin, herd, flat, perchunk, baseline, tcp and/or relay")
    if "baseline" in modes and (a.baseline_root is None or not (a.baseline_root / "bench" / "herd.py").is_file()):
        p.error("--modes baseline needs --baseline-root DIR holding bench/herd.py")
    shapings = [k.strip() for k in a.shaping.split(",") if k.strip()]
    if not shapings or len(set(shapings)) != len(shapings):
        p.error("--shaping: a comma list of distinct shapings")
    for k in shapings:
        try:
            shaping_of(k, rate=a.rate, burst=a.tbf_burst, latency=a.tbf_latency, queue=a.queue)
        except ValueError as e:
            p.error(f"--shaping {k}: {e}")
    sysctls = dict(kv.split("=", 1) for kv in a.sysctl if "=" in kv)
    if len(sysctls) != len(a.sysctl):
        p.error("--sysctl takes KEY=VALUE")
    from bench.netns import NetnsUnavailable

    try:
        out = run(a.nodes, a.size_mb, a.rate, modes, {"workers": a.workers, "home": a.home_concurrency, "tree": not a.flat},
                  burst=a.tbf_burst, latency=a.tbf_latency, mtu=a.mtu, baseline=a.baseline_root,
                  bridge_nf=a.bridge_nf, sysctls=sysctls, origin_http=a.origin_http, shapings=shapings, queue=a.queue)
    except NetnsUnavailable as e:
        msg = f"bench.herd skipped: {e}"
        if a.json:
            print(json.dumps({"skipped": msg}))
        else:
            print(msg, file=sys.stderr)
        return 0
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"herd bench: {a.nodes} nodes, {a.size_mb:g} MiB, {a.rate} links; ideal {out['ideal_s']:.2f}s")
    print(f"{'mode':<16} {'last done':>10} {'/ideal':>8} {'p50':>8} {'p99':>8} {'origin/S':>9} {'wire/S':>8}")
    rows: tuple[tuple[str, str], ...] = (("tcp", "plain TCP"), ("relay", "TCP relay"), ("origin_only", "origin only"), ("herd", "herd"), ("perchunk", "per chunk"),
            ("flat", "herd, flat"), ("baseline", "baseline"))
    if len(shapings) > 1:
        rows = tuple((f"{key}_{k}", f"{name} {k}") for key, name in rows for k in shapings)
    print(f"shaping: {'; '.join(' | '.join(d['tc']) for d in out['shapings'].values())}")
    for key, name in rows:
        if f"{key}_completion_s" in out:
            print(f"{name:<16} {out[f'{key}_completion_s']:>9.2f}s {out[f'{key}_completion_over_ideal']:>8.2f} "
                  f"{out[f'{key}_node_p50_s']:>7.2f}s {out[f'{key}_node_p99_s']:>7.2f}s "
                  f"{out[f'{key}_origin_egress_over_size']:>9.3f} {out[f'{key}_origin_wire_egress_over_size']:>8.3f}"
                  f"  CPU-s per node: {' '.join(f'{v:.1f}' for v in out[f'{key}_node_cpu_s'].values())}"
                  f" (fetch p50 {out[f'{key}_node_cpu_fetch_s_p50']:.2f}; 0: not reported)")
    if "herd_speedup" in out:
        print(f"herd speedup over origin-only (same run): {out['herd_speedup']:.2f}x")
    print(f"load average before {out['loadavg_before']} after {out['loadavg_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
