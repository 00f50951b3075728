"""What a rack relay pays to keep the placers that follow warm (agent.relaycopies): its CPU and
the bytes it sends, with 0, 1 and 2 followers, same run, alternated.

    python -m bench.relay_copies [--relays 32] [--members 32] [--seconds 4] [--pairs 3] [--json]

``--relays`` shipped relays (agent.relay.Relay) in this process, each with ``--members``
members whose empty heartbeats (one per member and interval, 0.2 s) and a content report each
interval from one member in eight (an event) come in through :meth:`Relay.member_report`, as
from members' connections; the relays beat and forward up over real loopback frames connections
to small fake placers in a child process (a leader and two followers: they answer as a placer
and a follower do, and do nothing else). For each follower count (0, 1, 2, in alternating
order, ``--pairs`` runs of each) the relays run ``--seconds``: ``cpu_s_per_s`` is this
process's CPU per second of it (the relays' work and the members' feeding, which is the same
for every count), ``copy_bytes_per_s`` the bytes their copy connections carried per second;
the rows give medians and the added CPU against no follower. Every loop is bounded.

    python -m bench.relay_copies --follower-nodes 16384 [--pairs 3] [--json]

What a follower pays for the rack beats of ``--follower-nodes`` nodes (32 a rack, one heartbeat a
node a second, every entry's MAC valid), in its own state (no frames, no I/O): ``before`` applies
each relay's every beat the leader's way (PlacerState.beat, its deadlines moved and its answer
reduced to need_full), ``after`` every other beat, each the merge of two (agent.relaycopies), by
placer.observe.beat. ``cpu_s_per_s`` is the CPU a second of such beats takes; the two alternate,
``--pairs`` times each, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.blobs import BlobCache  # noqa: E402
from agent.relay import Relay  # noqa: E402
from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from scheduler_link.follow import OBSERVED  # noqa: E402
from scheduler_link.frames import FrameChannel, decode_payload  # noqa: E402
from scheduler_link.heartbeat_wire import HeartbeatServer, Hello, WireReply  # noqa: E402
from scheduler_link.messages import Frame, NodeReport, RackBeatReply, RackReports, ReportReply, WorkloadEvent  # noqa: E402

HEARTBEAT_S = 0.2


class _FakePlacer:
    """Answers a relay's frames as a placer (``status`` 200) or a follower (202) does."""

    def __init__(self, tokens: TokenSet, status: int) -> None:
        self.server = HeartbeatServer(tokens, self._report, frames=self)
        self.status = status

    def _report(self, node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
        return self.status, ReportReply()

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        return self._frame

    def closed(self, channel: FrameChannel) -> None:
        return None

    def _frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "beat":
            return "beat_reply", RackBeatReply()
        if f.type == "reports":
            n = len(decode_payload(f, RackReports).reports)
            return "replies", [WireReply(status=self.status)] * n
        if f.type == "report":
            return "reply", WireReply(status=self.status)
        if f.type == "ping":
            return "ping", {}
        raise ValueError(f.type)


async def _serve(token_dir: str) -> None:
    tokens = TokenSet.load(Path(token_dir))
    async with trio.open_nursery() as n:
        urls = [await n.start(_FakePlacer(tokens, st).server.run, "127.0.0.1:0") for st in (200, OBSERVED, OBSERVED)]
        print(json.dumps(urls), flush=True)
        await trio.sleep_forever()


async def _one(tokens: TokenSet, urls: list[str], followers: int, relays: int, members: int,
               seconds: float) -> dict[str, float]:
    leader, others = urls[0], urls[1:1 + followers]
    rs = [Relay(node_id=f"r{i}", rack=f"z/b/r{i}", tokens=tokens, listen=None, wire_url=lambda: leader,
                blobs=BlobCache(), heartbeat_s=HEARTBEAT_S, request_timeout_s=10.0, keys=lambda: (None, None),
                beat_offset_s=HEARTBEAT_S * i / relays,
                local_address=f"127.1.{i // 200}.{i % 200 + 1}")   # (one source address each, as hosts have)
          for i in range(relays)]
    async with trio.open_nursery() as n:
        for r in rs:
            await n.start(r.run)
        with trio.fail_after(30):
            for r in rs:
                await r.upstream_ready.wait()
                for u in others:   # (the relay host's link asks for these: scheduler_link.follow)
                    await r.own_channel(u, tokens.cluster or "", r.node_id)
        seq = 0
        t0, c0 = time.perf_counter(), time.process_time()
        b0 = sum(r.copies.statistics()["bytes"] for r in rs)
        for _ in range(max(1, round(seconds / HEARTBEAT_S))):   # (bounded: one round a heartbeat)
            seq += 1
            for r in rs:
                for m in range(members):
                    ev = [WorkloadEvent(workload_id="w", job_id="j", state="running", at=1.0)] if (m + seq) % 8 == 0 \
                        else []
                    got = r.member_report(f"{r.node_id}-m{m}", NodeReport(node_id=f"{r.node_id}-m{m}", boot_id="b",
                                                                          seq=seq, full=False, events=ev))
                    if not isinstance(got, WireReply):
                        n.start_soon(_drain, got)
            await trio.sleep(HEARTBEAT_S)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        copied = sum(r.copies.statistics()["bytes"] for r in rs) - b0
        n.cancel_scope.cancel()
    return {"cpu_s_per_s": cpu / wall, "copy_bytes_per_s": copied / wall}


async def _drain(aw: Any) -> None:
    await aw


def run(relays: int, members: int, seconds: float, pairs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="herd-relay-copies-") as d:
        td = generate_token_dir(Path(d) / "tokens")
        server = subprocess.Popen([sys.executable, "-m", "bench.relay_copies", "--serve", str(td)], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            urls = json.loads(server.stdout.readline())
            tokens = TokenSet.load(td)
            runs: dict[int, list[dict[str, float]]] = {0: [], 1: [], 2: []}
            for p in range(pairs):
                order = (0, 1, 2) if p % 2 == 0 else (2, 1, 0)
                for k in order:
                    runs[k].append(trio.run(_one, tokens, urls, k, relays, members, seconds))
        finally:
            server.terminate()
            server.wait(10)
    base = statistics.median(r["cpu_s_per_s"] for r in runs[0])
    rows = []
    for k in (0, 1, 2):
        cpu = statistics.median(r["cpu_s_per_s"] for r in runs[k])
        rows.append({"followers": k, "cpu_s_per_s": round(cpu, 4), "added_cpu_s_per_s": round(cpu - base, 4),
                     "copy_bytes_per_s": round(statistics.median(r["copy_bytes_per_s"] for r in runs[k]))})
    return {"bench": "relay_copies", "relays": relays, "members": members, "heartbeat_s": HEARTBEAT_S,
            "seconds": seconds, "pairs": pairs, "load": os.getloadavg()[0], "rows": rows}


RACK = 32


def _follower_state(nodes: int) -> Any:
    from placer.config import PlacerConfig
    from placer.state import PlacerState
    from scheduler_link.messages import GpuInfo, GpuSnapshot, TopologyPath

    st = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=60.0, recover_s=5.0), started_at=0.0)
    st.set_mac_master(b"\5" * 32)
    for i in range(nodes):
        nid = f"n{i}"
        gpus = [GpuInfo(index=g, uuid=f"{nid}-g{g}", name="sim", memory_total_mib=1, pci_bus_id=str(g), simulated=True)
                for g in range(8)]
        rep = NodeReport(node_id=nid, boot_id=f"b-{nid}", seq=1, full=True, control_url=f"http://{nid}",
                         data_url=f"http://{nid}:1", topology=TopologyPath(zone="z", block="b", rack=f"r{i // RACK}"),
                         snapshot=GpuSnapshot(simulated=True, gpus=gpus))
        status, reply, _ = st.ingest(nid, rep, 1.0)
        assert status == 200, reply
    return st


def _rack_beats(st: Any, nodes: int, seq: int) -> list[tuple[str, Any]]:
    """Each rack's beat at ``seq`` (entries MACed as members do), with its relay's node id."""
    from scheduler_link.messages import RackBeat
    from scheduler_link.msgauth import beat_macs, node_key

    out = []
    for r0 in range(0, nodes, RACK):
        ids = [f"n{i}" for i in range(r0, min(nodes, r0 + RACK))]
        boots = [f"b-{nid}" for nid in ids]
        keys = [node_key(st.mac_master, nid, b) for nid, b in zip(ids, boots, strict=True)]
        raw = beat_macs(keys, ids, boots, [seq] * len(ids))
        out.append((ids[0], RackBeat(rack=f"r{r0 // RACK}", node_ids=ids, boot_ids=boots, seqs=[seq] * len(ids),
                                     macs=[raw[k * 16:(k + 1) * 16] for k in range(len(ids))])))
    return out


def follower_run(nodes: int, pairs: int) -> dict[str, Any]:
    from agent.relaycopies import COPY_BEAT_EVERY, merged_beat
    from placer import observe

    st = _follower_state(nodes)
    seq = 1
    runs: dict[str, list[float]] = {"before": [], "after": []}
    for p in range(pairs):
        for mode in (("before", "after") if p % 2 == 0 else ("after", "before")):
            # one second of the fleet's beats: COPY_BEAT_EVERY beats a relay, as each arm gets them
            seconds = COPY_BEAT_EVERY
            beats = []
            for _ in range(seconds):
                seq += 1
                beats.append(_rack_beats(st, nodes, seq))
            if mode == "after":   # (the relay's merge is the relay's CPU: done before the clock starts)
                frames = [(via, b) for via, b in beats[0]]
                for k in range(1, seconds):
                    frames = [(via, merged_beat(b0, b1)) for (via, b0), (_, b1) in zip(frames, beats[k], strict=True)]
            else:
                frames = [f for rnd in beats for f in rnd]
            c0 = time.process_time()
            for via, b in frames:
                if mode == "after":
                    observe.beat(st, b, float(seq), via)
                else:
                    observe.beat_answer(st.beat(b, float(seq), via=via)[0])
            runs[mode].append((time.process_time() - c0) / seconds)
    assert all(n.last_seq == seq for n in st.nodes.values())
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    return {"bench": "relay_copies", "mode": "follower", "nodes": nodes, "rack": RACK, "heartbeat_s": 1.0,
            "pairs": pairs, "load": os.getloadavg()[0],
            "rows": [{"path": "before", "cpu_s_per_s": round(before, 4)},
                     {"path": "after", "cpu_s_per_s": round(after, 4)}],
            "ratio": round(after / before, 3) if before else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.relay_copies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--relays", type=int, default=32)
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--follower-nodes", type=int, default=0,
                    help="instead: a follower's CPU for the rack beats of this many nodes (see the module doc)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    if ns.serve:
        trio.run(_serve, ns.serve)
        return 0
    if ns.follower_nodes:
        if not (RACK <= ns.follower_nodes <= 131072 and 1 <= ns.pairs <= 10):
            ap.error(f"--follower-nodes {RACK}..131072, --pairs 1..10")
        fo = follower_run(ns.follower_nodes, ns.pairs)
        if ns.json:
            print(json.dumps(fo))
        else:
            print(f"a follower's rack beats: {fo['nodes']} nodes, {RACK} a rack, 1 s heartbeats, load {fo['load']:.1f}")
            for r in fo["rows"]:
                print(f"  {r['path']:>6}  cpu_s_per_s={r['cpu_s_per_s']:.4f}")
            print(f"  after/before={fo['ratio']}")
        return 0
    if not (1 <= ns.relays <= 512 and 1 <= ns.members <= 128 and 0.5 <= ns.seconds <= 60 and 1 <= ns.pairs <= 10):
        ap.error("--relays 1..512, --members 1..128, --seconds 0.5..60, --pairs 1..10")
    out = run(ns.relays, ns.members, ns.seconds, ns.pairs)
    if ns.json:
        print(json.dumps(out))
    else:
        print(f"relay copies to followers: {out['relays']} relays x {out['members']} members, heartbeat "
              f"{HEARTBEAT_S} s, load {out['load']:.1f}")
        for r in out["rows"]:
            print(f"  followers={r['followers']}  cpu_s_per_s={r['cpu_s_per_s']:.4f}  "
                  f"added={r['added_cpu_s_per_s']:+.4f}  copy_bytes_per_s={r['copy_bytes_per_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
