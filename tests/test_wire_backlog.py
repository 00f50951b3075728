"""Silence is judged only from what the placer has read (issue 12, the one-POST baseline at
131,072 nodes): over shared framed connections a registration storm queues registered nodes'
beats behind thousands of full reports, unread, and they went lost (241,710 'node lost' lines
in a 90 s run), then registered again into the same storm. The framed channel now says, for
each multi-node connection that has more to read than its last read took, since when it was
last caught up (HeartbeatServer.heard_until), and the placer's lost check goes no further.

Real loopback sockets: a shared connection sends a burst larger than one read while the
placer's ingest is slow; during the burst the server is behind no later than before the burst,
once it is read nobody is behind. In process (the placer service's tick): a node whose
connection is behind is not lost, for at most WIRE_HOLD_LOST_AFTERS lost_after_s."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import trio

from placer.config import PlacerConfig
from placer.service import WIRE_HOLD_LOST_AFTERS, PlacerService
from scheduler_link.auth import TokenSet
from scheduler_link.heartbeat_wire import (
    READ_MAX,
    HeartbeatServer,
    Hello,
    frame,
    parse_wire_url,
    split_frames,
)
from scheduler_link.messages import GpuInfo, GpuSnapshot, NodeReport, ReportReply, TopologyPath


async def test_a_shared_connection_with_unread_reports_is_behind_until_they_are_read(token_dir: Path) -> None:
    """The client (a plain blocking socket in a thread: the placer's ingest holds the event
    loop, as a busy placer does) sends one report, and while the placer is busy with it a
    burst of several reads' worth: until the burst has been read, the connection is behind
    since the read that took the first report, before the burst was sent."""
    tokens = TokenSet.load(token_dir)
    seen: list[float | None] = []
    in_slow = threading.Event()

    def ingest(node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
        seen.append(server.heard_until())
        if node_id == "slow":
            in_slow.set()
            end = time.perf_counter() + 0.5   # busy: meanwhile the burst fills the socket
            while time.perf_counter() < end:
                pass
        return 200, ReportReply(ok=True)
    server = HeartbeatServer(tokens, ingest)
    pad = "x" * 2000
    burst = b"".join(frame(NodeReport(node_id=f"n{i}", boot_id="b", seq=1, full=False, control_url=pad))
                     for i in range(600))
    assert len(burst) > 3 * READ_MAX
    marks: dict[str, float] = {}

    def client(host: str, port: int) -> int:
        with socket.create_connection((host, port)) as s:
            s.sendall(frame(Hello(token=tokens.cluster or "", node_id="emu", relay=True)))
            got = _replies(s, 1)
            s.sendall(frame(NodeReport(node_id="slow", boot_id="b", seq=1, full=False)))
            assert in_slow.wait(10)
            marks["before"] = time.time()
            s.sendall(burst)
            return got + _replies(s, 601)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url = await n.start(server.run, "127.0.0.1:0")
            host, port = parse_wire_url(url)
            assert await trio.to_thread.run_sync(client, host, port) == 602
            behind = [h for h in seen if h is not None]
            assert len(behind) > 100, "never behind during a burst of three reads' worth"
            assert max(behind) <= marks["before"]   # caught up last before the burst was sent
            assert server.heard_until() is None     # all read and answered
            n.cancel_scope.cancel()


def _replies(s: socket.socket, n: int) -> int:
    buf = bytearray()
    got = 0
    while got < n:
        data = s.recv(1 << 16)
        assert data
        buf += data
        got += len(split_frames(buf))
    return got


def _full(node: str) -> NodeReport:
    snap = GpuSnapshot(hostname=node, backend="simulated:test", simulated=True,
                       gpus=[GpuInfo(index=0, uuid=f"GPU-{node}", name="sim", memory_total_mib=80000,
                                     pci_bus_id="0000:01:00.0", simulated=True)])
    return NodeReport(node_id=node, boot_id="b", seq=1, full=True, control_url=f"http://127.0.0.1:9/{node}",
                      data_url="http://127.0.0.1:9", topology=TopologyPath(zone="z", block="b", rack="r"),
                      snapshot=snap, sent_at=time.time())


def test_the_lost_check_waits_for_a_connection_that_is_behind_for_a_bounded_time(tmp_path: Path) -> None:
    now = [100.0]
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, lost_after_missed=3),
                        TokenSet(), clock=lambda: now[0])
    assert svc._ingest("n1", _full("n1"))[0] == 200
    svc.wire = HeartbeatServer(TokenSet(), svc._ingest, clock=lambda: now[0])
    svc.wire._behind[1] = 100.5     # a shared connection behind since 100.5 (its beats unread)
    hold = WIRE_HOLD_LOST_AFTERS * 3.0
    for t in (104.0, 110.0, 100.0 + 3.0 + hold - 0.5):
        now[0] = t
        svc._tick(t)
        assert svc.state.nodes["n1"].state == "up", t
    now[0] = 100.0 + 3.0 + hold + 0.5   # held so long at most: then silence is silence
    svc._tick(now[0])
    assert svc.state.nodes["n1"].state == "lost"
