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
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from infra.auth import TokenSet
from placer.config import PlacerConfig
from placer.service import WIRE_HOLD_LOST_AFTERS, PlacerService
from scheduler_link.frames import FrameChannel, encode_frame
from scheduler_link.heartbeat_wire import (
    HeartbeatServer,
    Hello,
    frame,
    parse_wire_url,
    split_frames,
)
from scheduler_link.messages import Frame, GpuInfo, GpuSnapshot, NodeReport, ReportReply, TopologyPath


class SlowFrames:
    """A FramesHost whose handler is slow for the frame named ``slow`` (as a busy placer)."""

    def __init__(self, on_frame: Any) -> None:
        self.on_frame = on_frame

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        def handle(ch: FrameChannel, f: Frame) -> tuple[str, Any]:
            self.on_frame(msgspec.msgpack.decode(f.payload)["n"])
            return "ok", None
        return handle

    def closed(self, channel: FrameChannel) -> None:
        return None


@pytest.mark.parametrize("kind", ["shared", "frames"])
async def test_a_connection_with_unread_bytes_is_behind_until_they_are_read(token_dir: Path, kind: str) -> None:
    """The client (a plain blocking socket in a thread: the placer's handling holds the event
    loop, as a busy placer does) sends one message, and while the placer is busy with it a
    burst of several reads' worth: until the burst has been read, the connection is behind
    since the read that took the first message, before the burst was sent. Both kinds: a
    shared report connection (the one-POST baseline's nodes) and a relay's frames connection."""
    tokens = TokenSet.load(token_dir)
    seen: list[float | None] = []
    in_slow = threading.Event()

    def on(name: str) -> None:
        seen.append(server.heard_until())
        if name == "slow":
            in_slow.set()
            end = time.perf_counter() + 0.5   # busy: meanwhile the burst fills the socket
            while time.perf_counter() < end:
                pass

    def ingest(node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
        on(rep.node_id)
        return 200, ReportReply(ok=True)
    server = HeartbeatServer(tokens, ingest, frames=SlowFrames(on))
    pad = "x" * 2000
    if kind == "shared":
        hello = Hello(token=tokens.cluster or "", node_id="emu", relay=True)
        one = frame(NodeReport(node_id="slow", boot_id="b", seq=1, full=False))
        burst = b"".join(frame(NodeReport(node_id=f"n{i}", boot_id="b", seq=1, full=False, control_url=pad))
                         for i in range(600))
    else:
        hello = Hello(token=tokens.cluster or "", node_id="relay0", frames=True, racks=["z/b/r"])
        one = encode_frame("beat", {"n": "slow"}, id=1)
        burst = b"".join(encode_frame("beat", {"n": f"n{i}", "pad": pad}, id=2 + i) for i in range(600))
    assert len(burst) > 3 * (1 << 18)
    marks: dict[str, float] = {}

    def client(host: str, port: int) -> int:
        with socket.create_connection((host, port)) as s:
            s.sendall(frame(hello))
            got = _replies(s, 1)
            s.sendall(one)
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
            await trio.testing.wait_all_tasks_blocked()
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
    svc.wire.backlog._behind[1] = 100.5   # a connection behind since 100.5 (its beats unread)
    hold = WIRE_HOLD_LOST_AFTERS * 3.0
    for t in (104.0, 110.0, 100.0 + 3.0 + hold - 0.5):
        now[0] = t
        svc._tick(t)
        assert svc.state.nodes["n1"].state == "up", t
    now[0] = 100.0 + 3.0 + hold + 0.5   # held so long at most: then silence is silence
    svc._tick(now[0])
    assert svc.state.nodes["n1"].state == "lost"
