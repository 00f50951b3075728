"""Per-node data-plane efficiency: one node fetching from one peer on loopback.

    python -m bench.node [--mib 1024] [--repeat 3] [--no-tls] [--json]

Two processes per phase, a server and a client, each timed by its own CPU (user + system,
every thread; the server's from /proc/<pid>/stat over the phase, the client's from
``getrusage`` around the transfer). Phases, alternated ``--repeat`` times (herd, loop, loop,
herd, ...), each starting from the same settled state: the client directory the phase
before wrote removed, ``sync`` (no dirty pages left: writeback throttling is charged to the
writer), then ``--settle-s`` seconds of quiet (default 5) before the server starts.

Why the settle: this VM (Firecracker) has virtio-balloon free page reporting, so a page
freed for more than ~2 s goes back to the host, and the next write into it faults it in
again, charged to the writer as system time in the copy into the page cache (perf:
``copy_folio_from_iter_atomic``). Writing 1 GiB into just-freed pages costs ~0.7-1.1 CPU-s,
into given-back ones ~1.3-2.4 (same run, alternating): without a fixed settle a phase's CPU
depended on how long after the previous phase's files were deleted it began, which is why
later repeats cost about twice the first. The settle narrows this but does not remove it
(the kernel reports free memory a fraction at a time, so 5 s may leave part of it still
backed): the phases alternate and the per-repeat ratios are the figure to read.

- ``herd``: the real thing. The server is a :class:`p2p.dataplane.DataPlane` over a
  :class:`p2p.store.ChunkStore` holding the artifact; the client a :class:`p2p.herd.Herd`
  (default config) fetching the manifest's chunks from it as its one peer
  (``fetch_with_peers``: receive, verify, store, batched fsync, mark complete). The
  origin holds only the manifest, so every chunk byte comes from the peer (checked).
  The herd asks in multi-chunk requests (``GET /v1/chunks?ids=``, :mod:`p2p.batch`): the
  herd rows record the server's ``requests``, ``batches`` and ``chunks_served``.
- ``loop``: the baseline, the least work that does the same job: one connection, every
  request pipelined up front, the server ``sendfile``s each chunk file, the client
  ``recv_into`` one preallocated buffer (MSG_WAITALL), BLAKE3, writes a new file per
  chunk and fsyncs them in 64 MiB batches as the store does (durability is part of the
  job). One stream, one thread on each side.
- ``herd_tls`` / ``loop_tls``: the same with mutual TLS 1.3 on the data plane (a
  throwaway cluster CA and node certificates from :mod:`infra.pki`, contexts
  from :mod:`infra.tls`; the loop uses blocking ``ssl`` sockets, whose
  ``sendfile`` falls back to read + send).

Figures (medians over the repeats; ``reps`` lists each repeat's herd / loop ratios, whose
medians are ``cpu_ratio_rep_median`` and ``speed_ratio_rep_median``): ``mb_s`` (client wall), ``client_cpu_s_per_gib``,
``server_cpu_s_per_gib``, and ratios herd / loop: ``cpu_ratio`` (client + server CPU per
GiB; target <= 1.2) and ``speed_ratio`` (MB/s; target >= 1.5: the herd spreads receive,
hash and write over cores and streams, the loop cannot). ``cores_per_gb_s``: the CPU
seconds both ends spend per GB moved (= cores busy per GB/s), and the 100 Gbit/s NIC
extrapolation (12.5 GB/s x that), stated as an extrapolation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-node-token"
MiB = 1 << 20
GiB = 1 << 30
TARGETS = {"cpu_ratio": ("<=", 1.2), "speed_ratio": (">=", 1.5)}
SYNC_BATCH = 64 * MiB


# ------------------------------------------------------------------------------ TLS material

def make_tls(workdir: Path) -> Path:
    """A throwaway cluster CA with node certificates for "server" and "client"
    (:func:`infra.pki.throwaway`), as production uses them: mutual TLS."""
    from infra.pki import throwaway

    return throwaway(workdir / "tls", nodes=["server", "client"]).dir


def server_context(tls: Path) -> ssl.SSLContext:
    from infra.pki import ThrowawayPKI
    from infra.tls import server_context as make

    return make(ThrowawayPKI(tls).files("node:server"), client_cert="required")


def client_context(tls: Path) -> ssl.SSLContext:
    from infra.pki import ThrowawayPKI
    from infra.tls import client_context as make

    pki = ThrowawayPKI(tls)
    return make(pki.ca, pki.files("node:client"))


# ------------------------------------------------------------------------------ roles (subprocesses)

def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sys() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def serve_herd(store_dir: str, tls: str | None) -> None:
    import trio

    from p2p.dataplane import DataPlane
    from p2p.store import ChunkStore

    async def main() -> None:
        plane = DataPlane(ChunkStore(store_dir), token=TOKEN,
                          ssl_context=server_context(Path(tls)) if tls else None)
        async with trio.open_nursery() as nursery:
            url = await nursery.start(plane.run)
            print(url, flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)   # until the parent closes stdin
            nursery.cancel_scope.cancel()

    trio.run(main)


def fetch_herd(store_dir: str, origin_dir: str, manifest_id: str, url: str, tls: str | None) -> None:
    import trio

    from p2p.herd import Herd, HerdConfig, fetch_with_peers
    from p2p.origins import FileOrigin
    from p2p.peers import PeerClient
    from p2p.store import ChunkStore
    from scheduler_link.messages import Peer

    async def main() -> dict[str, Any]:
        store = ChunkStore(store_dir)
        # HerdConfig fields for this phase (--herd-set: a same-run variant, phase herd_set)
        sets = json.loads(os.environ.get("BENCH_NODE_HERD_SET", "{}"))
        herd = Herd(store, node_id="client", token=TOKEN, config=HerdConfig(**sets))
        if tls:
            herd.client = PeerClient(token=TOKEN, config=herd.client.config,
                                     ssl_context=client_context(Path(tls)))
        c0, s0, t0 = _cpu(), _sys(), time.perf_counter()
        stats = await fetch_with_peers(store, manifest_id, FileOrigin(origin_dir),
                                       peers=[Peer(node_id="server", data_url=url)], herd=herd)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        await herd.aclose()
        if stats.bytes_from_peers != stats.bytes:
            raise SystemExit(f"bench.node: {stats.bytes_from_origin} bytes came from the origin, not the peer")
        return {"bytes": stats.bytes, "wall_s": wall, "cpu_s": cpu, "sys_s": _sys() - s0}

    print(json.dumps(trio.run(main)), flush=True)


def serve_loop(chunk_dir: str, tls: str | None) -> None:
    """One connection; each request is a 64-hex id + newline; each answer an 8-byte size
    then the file by sendfile (a TLS socket's sendfile falls back to read + send)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{lsock.getsockname()[1]}", flush=True)
    conn, _ = lsock.accept()
    if tls:
        conn = server_context(Path(tls)).wrap_socket(conn, server_side=True)
    rf = conn.makefile("rb")
    while True:
        line = rf.readline()
        if not line:
            break
        with open(os.path.join(chunk_dir, line[:2].decode(), line[:64].decode()), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            conn.sendall(struct.pack(">Q", size))
            conn.sendfile(f, 0, size)
    conn.close()


def fetch_loop(addr: str, ids_file: str, out_dir: str, tls: str | None) -> None:
    import blake3

    host, _, port = addr.rpartition(":")
    ids = [(cid, int(sz)) for cid, sz in (ln.split() for ln in Path(ids_file).read_text().splitlines())]
    c0, s0, t0 = _cpu(), _sys(), time.perf_counter()
    sock = socket.create_connection((host, int(port)))
    if tls:
        sock = client_context(Path(tls)).wrap_socket(sock, server_hostname=host)
    sock.sendall(b"".join(f"{cid}\n".encode() for cid, _ in ids))   # every request, pipelined
    buf = bytearray(max(sz for _, sz in ids) + 8)
    view = memoryview(buf)
    total = 0
    pending: list[int] = []
    unsynced = 0

    def recv_exact(n: int) -> memoryview:
        got = 0
        while got < n:
            k = sock.recv_into(view[got:n], n - got, 0 if tls else socket.MSG_WAITALL)
            if k == 0:
                raise SystemExit("bench.node: loop server closed early")
            got += k
        return view[:n]

    def sync(fds: list[int]) -> None:
        for fd in fds:
            os.fsync(fd)
            os.close(fd)

    for cid, _ in ids:
        (size,) = struct.unpack(">Q", recv_exact(8))
        body = recv_exact(size)
        if blake3.blake3(body).hexdigest() != cid:
            raise SystemExit(f"bench.node: bad bytes for {cid}")
        fd = os.open(os.path.join(out_dir, cid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        off = 0
        while off < size:
            off += os.write(fd, body[off:])
        pending.append(fd)
        total += size
        unsynced += size
        if unsynced >= SYNC_BATCH:
            sync(pending)
            pending, unsynced = [], 0
    sync(pending)
    dfd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    sock.close()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    print(json.dumps({"bytes": total, "wall_s": wall, "cpu_s": cpu, "sys_s": _sys() - s0}), flush=True)


# ------------------------------------------------------------------------------ the parent

def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(*args: str, stdin: Any = subprocess.DEVNULL, sets: dict[str, int] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_NODE_HERD_SET": json.dumps(sets or {})}
    return subprocess.Popen([sys.executable, "-m", "bench.node", "--role", *args], stdin=stdin,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def prepare(work: Path, mib: int) -> tuple[str, list[tuple[str, int]]]:
    """A tree of ``mib`` MiB of random bytes, published into a store (the server's) and a
    manifest-only file:// origin. Returns (manifest id, [(chunk id, size)])."""
    import numpy as np

    from manifests import encode_manifest, scan_tree
    from p2p.publish import read_source
    from p2p.store import ChunkStore

    tree = work / "tree"
    tree.mkdir()
    rng = np.random.default_rng(14)
    per = 64 * MiB
    left = mib * MiB
    i = 0
    while left > 0:
        n = min(per, left)
        (tree / f"part-{i:03d}.bin").write_bytes(rng.bytes(n))
        left -= n
        i += 1
    scan = scan_tree(tree)
    m = scan.manifest
    store = ChunkStore(work / "server")
    for c in m.chunks:
        store.put_chunk(c.id, read_source(c.id, scan.sources[c.id]), verified=True)
    raw = encode_manifest(m)
    store.put_manifest(m.id, raw)
    store.mark_complete(m.id)
    (work / "origin" / "manifests").mkdir(parents=True)
    (work / "origin" / "manifests" / m.id).write_bytes(raw)
    shutil.rmtree(tree)
    return m.id, [(c.id, c.size) for c in m.chunks]


def settle(out: Path, settle_s: float) -> None:
    """The state every phase starts from: ``out`` new and empty (what the phase before
    wrote is removed), no dirty pages, and ``settle_s`` of quiet so the pages that removal
    freed have gone back to the VM's host like all other free memory (see the module doc)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    os.sync()
    time.sleep(settle_s)


def phase(kind: str, work: Path, mid: str, ids_file: Path, tls: Path | None,
          sets: dict[str, int] | None = None, settle_s: float = 5.0) -> dict[str, float]:
    """One transfer: settle (fresh client dir, sync, quiet), start the server, fetch, read
    both CPUs."""
    out = work / "client"
    settle(out, settle_s)
    t = [str(tls)] if tls else []
    tls_args = ["--tls", *t] if tls else []
    if kind == "herd":
        server = _role("serve-herd", str(work / "server"), *tls_args, stdin=subprocess.PIPE)
    else:
        server = _role("serve-loop", str(work / "server" / "chunks"), *tls_args)
    try:
        assert server.stdout is not None
        addr = server.stdout.readline().strip()
        if not addr:
            raise SystemExit(f"bench.node: the {kind} server did not start")
        if kind == "herd" and tls:
            addr = addr.replace("http://", "https://")
        s0 = _proc_cpu(server.pid)
        if kind == "herd":
            client = _role("fetch-herd", str(out / "store"), str(work / "origin"), mid, addr, *tls_args, sets=sets)
        else:
            client = _role("fetch-loop", addr, str(ids_file), str(out), *tls_args)
        got, _ = client.communicate(timeout=600)
        s1 = _proc_cpu(server.pid)
        if client.returncode != 0:
            raise SystemExit(f"bench.node: the {kind} client failed (exit {client.returncode})")
        plane = _plane_stats(addr, tls) if kind == "herd" else {}
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    r = json.loads(got.strip().splitlines()[-1])
    gib = r["bytes"] / GiB
    row: dict[str, float] = {"mb_s": r["bytes"] / r["wall_s"] / 1e6, "client_cpu_s_per_gib": r["cpu_s"] / gib,
                             "client_sys_s_per_gib": r["sys_s"] / gib,
                             "server_cpu_s_per_gib": (s1 - s0) / gib, "bytes": r["bytes"]}
    if plane:   # how the herd asked: requests, multi-chunk requests (batches), chunks sent
        row.update(requests=plane["requests"], batches=plane.get("batches", 0), chunks_served=plane["chunks_served"])
    return row


def _plane_stats(url: str, tls: Path | None) -> dict[str, Any]:
    """The herd server's /v1/stats (read after the phase's CPU was taken)."""
    import urllib.request

    req = urllib.request.Request(url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    ctx = client_context(tls) if tls else None
    if ctx is not None:
        ctx.check_hostname = False
    with urllib.request.urlopen(req, timeout=10, context=ctx) as f:
        return dict(json.loads(f.read()))


def _median_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0]}


def _pair(h: dict[str, float], lp: dict[str, float]) -> dict[str, float]:
    """One repeat's herd / loop ratios (client + server CPU per GiB; MB/s)."""
    return {"cpu_ratio": round((h["client_cpu_s_per_gib"] + h["server_cpu_s_per_gib"])
                               / (lp["client_cpu_s_per_gib"] + lp["server_cpu_s_per_gib"]), 3),
            "speed_ratio": round(h["mb_s"] / lp["mb_s"], 3)}


def run(mib: int, repeat: int, tls: bool, workdir: Path, log: Any,
        herd_set: dict[str, int] | None = None, settle_s: float = 5.0) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-node-", dir=workdir))
    try:
        t0 = time.perf_counter()
        mid, chunks = prepare(work, mib)
        ids_file = work / "ids.txt"
        ids_file.write_text("".join(f"{c} {s}\n" for c, s in chunks))
        log(f"prepared {mib} MiB, {len(chunks)} chunks in {time.perf_counter() - t0:.1f}s")
        cert = make_tls(work) if tls else None
        kinds = [("herd", None), ("loop", None)] + ([("herd_tls", cert), ("loop_tls", cert)] if tls else [])
        if herd_set:
            kinds.append(("herd_set", None))
        runs: dict[str, list[dict[str, float]]] = {k: [] for k, _ in kinds}
        for rep in range(repeat):
            order = kinds if rep % 2 == 0 else kinds[::-1]   # alternate who goes first
            for name, c in order:
                r = phase(name.split("_")[0], work, mid, ids_file, c, herd_set if name == "herd_set" else None,
                          settle_s)
                runs[name].append(r)
                log(f"rep {rep} {name:9s} {r['mb_s']:8.1f} MB/s  client {r['client_cpu_s_per_gib']:.2f}"
                    f" (sys {r['client_sys_s_per_gib']:.2f})  server {r['server_cpu_s_per_gib']:.2f} CPU-s/GiB"
                    f"  load {os.getloadavg()[0]:.1f}")
        med = {k: _median_rows(v) for k, v in runs.items()}
        out: dict[str, Any] = {"mib": mib, "chunks": len(chunks), "repeat": repeat, "settle_s": settle_s, **med}

        def ratios(h: str, lp: str) -> dict[str, Any]:
            hc = med[h]["client_cpu_s_per_gib"] + med[h]["server_cpu_s_per_gib"]
            lc = med[lp]["client_cpu_s_per_gib"] + med[lp]["server_cpu_s_per_gib"]
            reps = [_pair(a, b) for a, b in zip(runs[h], runs[lp], strict=True)]
            return {"cpu_ratio": round(hc / lc, 3), "reps": reps,
                    "cpu_ratio_rep_median": round(statistics.median(r["cpu_ratio"] for r in reps), 3),
                    "speed_ratio_rep_median": round(statistics.median(r["speed_ratio"] for r in reps), 3),
                    "client_cpu_ratio":
                    round(med[h]["client_cpu_s_per_gib"] / med[lp]["client_cpu_s_per_gib"], 3),
                    "speed_ratio": round(med[h]["mb_s"] / med[lp]["mb_s"], 3),
                    # CPU-s per GB moved, both ends = cores kept busy per GB/s
                    "cores_per_gb_s": round(hc / (GiB / 1e9), 3),
                    "cores_for_100gbit": round(12.5 * hc / (GiB / 1e9), 1)}

        out["plain"] = ratios("herd", "loop")
        if herd_set:
            out["herd_set"] = {**med["herd_set"], "fields": herd_set, **ratios("herd_set", "loop")}
        if tls:
            out["tls"] = ratios("herd_tls", "loop_tls")
            out["tls_cost"] = round((med["herd_tls"]["client_cpu_s_per_gib"] + med["herd_tls"]["server_cpu_s_per_gib"])
                                    / (med["herd"]["client_cpu_s_per_gib"] + med["herd"]["server_cpu_s_per_gib"]), 3)
        out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _table(r: dict[str, Any]) -> str:
    lines = [f"one node fetching {r['mib']} MiB ({r['chunks']} chunks) from one peer on loopback, "
             f"medians of {r['repeat']}; load {r['load_avg']}",
             f"{'phase':10s} {'MB/s':>9s} {'client CPU-s/GiB':>17s} {'server CPU-s/GiB':>17s}"]
    for k in ("herd", "loop", "herd_tls", "loop_tls", "herd_set"):
        if k in r:
            v = r[k]
            lines.append(f"{k:10s} {v['mb_s']:9.1f} {v['client_cpu_s_per_gib']:17.2f} {v['server_cpu_s_per_gib']:17.2f}")
    for k in ("plain", "tls", "herd_set"):
        if k in r:
            v = r[k]
            ok_c = "ok" if v["cpu_ratio"] <= TARGETS["cpu_ratio"][1] else "MISSED"
            ok_s = "ok" if v["speed_ratio"] >= TARGETS["speed_ratio"][1] else "MISSED"
            lines.append(f"{k}: herd/loop CPU {v['cpu_ratio']:.2f} (target <= 1.2, {ok_c}); "
                         f"MB/s {v['speed_ratio']:.2f} (target >= 1.5, {ok_s}); {v['cores_per_gb_s']:.2f} cores "
                         f"per GB/s -> {v['cores_for_100gbit']} cores for 100 Gbit/s (extrapolated)")
            lines.append("  per repeat (herd / loop): CPU " + " ".join(f"{p['cpu_ratio']:.2f}" for p in v["reps"])
                         + f" (median {v['cpu_ratio_rep_median']:.2f}); MB/s "
                         + " ".join(f"{p['speed_ratio']:.2f}" for p in v["reps"])
                         + f" (median {v['speed_ratio_rep_median']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-tls", action="store_true")
    p.add_argument("--herd-set", default="", help="a=1,b=2: HerdConfig fields for an extra phase herd_set, "
                   "alternated with the others (a same-run variant)")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="quiet seconds after each phase's cleanup and sync, before it starts (see the module doc)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", action="store_true")
    a, rest = p.parse_known_args(argv)
    if a.role:
        role, *args = a.role + rest
        tls = None
        if "--tls" in args:
            i = args.index("--tls")
            tls = args[i + 1]
            args = args[:i] + args[i + 2:]
        {"serve-herd": serve_herd, "fetch-herd": fetch_herd, "serve-loop": serve_loop,
         "fetch-loop": fetch_loop}[role](*args, tls)  # type: ignore[operator]  # the role table maps names to functions of different signatures
        return 0
    if rest:
        p.error(f"unrecognised arguments: {' '.join(rest)}")

    def log(msg: str) -> None:
        print(f"[bench.node] {msg}", file=sys.stderr, flush=True)

    sets = {k: int(v) for k, _, v in (kv.partition("=") for kv in a.herd_set.split(",") if kv)}
    r = run(a.mib, a.repeat, not a.no_tls, Path(a.workdir or tempfile.gettempdir()), log, sets, a.settle_s)
    print(json.dumps(r) if a.json else _table(r))  # (one line: bench.quick reads the last line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
