"""The framed channel on its own (a fake ingest, real loopback sockets): relay-mode
connections, full reports over the channel, the shared multiplexed client, hardening
(hello deadline, pre-hello byte cap, connection cap, an ingest that raises), AgentLink's
pluggable transport and remembered wire URL, and PushPool's per-endpoint connections."""

from __future__ import annotations

import struct

import msgspec
import pytest
import trio
import trio.testing

from infra.auth import TokenSet
from scheduler_link.agent_link import AgentLink
from scheduler_link.fanout import PushPool
from scheduler_link.heartbeat_wire import (
    MAX_HELLO,
    HeartbeatClient,
    HeartbeatServer,
    Hello,
    SharedWire,
    WireError,
    WireReply,
    frame,
)
from scheduler_link.messages import GpuSnapshot, NodeReport, ReportReply, Victim
from testing.waiting import poll

TOKENS = TokenSet(placer="p", cluster="c", operator="o")


class FakePlacer:
    """A synchronous ingest that records (node id, report) and can be told to raise."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, NodeReport]] = []
        self.boom_for: set[str] = set()

    def ingest(self, node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
        if node_id in self.boom_for:
            raise RuntimeError("a bug in the placer")
        if rep.node_id != node_id:
            return 400, ReportReply(ok=False)
        self.seen.append((node_id, rep))
        # the answer names its node, so tests can check answers are paired with their reports
        return 200, ReportReply(heartbeat_interval_s=0.05, stop=[Victim(workload_id=f"{node_id}/{rep.seq}")])


async def _server(nursery: trio.Nursery, placer: FakePlacer, **kw) -> tuple[HeartbeatServer, str]:
    srv = HeartbeatServer(TOKENS, placer.ingest, **kw)
    url = await nursery.start(srv.run, "127.0.0.1:0")
    return srv, url


def _rep(node: str, seq: int = 1, full: bool = False) -> NodeReport:
    return NodeReport(node_id=node, boot_id="b", seq=seq, full=full)


async def test_relay_connection_carries_many_nodes_and_full_reports():
    fp = FakePlacer()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp)
            c = await HeartbeatClient.connect(url, "c", "emu-0", relay=True)
            await c.send([_rep("a", full=True), _rep("b", full=True), _rep("a", 2)])
            replies = await c.receive(3)
            assert [r.status for r in replies] == [200, 200, 200]
            assert [(nid, r.node_id, r.full) for nid, r in fp.seen] == [
                ("a", "a", True), ("b", "b", True), ("a", "a", False)]
            assert srv.relay_connections == 1
            # a single-node connection applies reports for its hello's node only
            d = await HeartbeatClient.connect(url, "c", "a")
            assert (await d.exchange(_rep("b", 3))).status == 400
            assert (await d.exchange(_rep("a", 3, full=True))).status == 200
            await c.aclose()
            await d.aclose()
            n.cancel_scope.cancel()


async def test_an_ingest_that_raises_costs_one_frame_not_the_server():
    fp = FakePlacer()
    fp.boom_for.add("bad")
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp)
            c = await HeartbeatClient.connect(url, "c", "emu", relay=True)
            await c.send([_rep("bad"), _rep("good")])
            r1, r2 = await c.receive(2)
            assert r1.status == 500 and r2.status == 200
            assert srv.ingest_errors == 1
            # the server still serves, on this connection and on new ones
            assert (await c.exchange(_rep("good", 2))).status == 200
            d = await HeartbeatClient.connect(url, "c", "good")
            assert (await d.exchange(_rep("good", 3))).status == 200
            await c.aclose()
            await d.aclose()
            n.cancel_scope.cancel()


async def test_hello_deadline_and_pre_hello_byte_cap():
    fp = FakePlacer()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp, hello_timeout_s=0.2)
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            # silence: dropped after the hello deadline
            s = await trio.open_tcp_stream(host, int(port))
            assert await s.receive_some(100) == b""
            assert srv.hello_timeouts == 1
            await s.aclose()
            # the rest against a hello deadline past this test's bound: what ends in time
            # was not ended by the deadline
            srv, url = await _server(n, fp, hello_timeout_s=60)
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            # a hello announced bigger than MAX_HELLO: dropped at once, before its body
            s = await trio.open_tcp_stream(host, int(port))
            await s.send_all(struct.pack(">I", MAX_HELLO + 1) + b"x" * 100)
            try:
                assert await s.receive_some(100) == b""
            except trio.BrokenResourceError:
                pass
            await s.aclose()
            # a slow but honest hello still works (split across writes: the server has read
            # the first part and waits for the rest before it is sent)
            s = await trio.open_tcp_stream(host, int(port))
            raw = frame(Hello(token="c", node_id="x"))
            await s.send_all(raw[:3])
            await trio.testing.wait_all_tasks_blocked()
            await s.send_all(raw[3:])
            c = HeartbeatClient(s)
            (r,) = await c.receive(1)
            assert r.status == 200
            await c.aclose()
            assert fp.seen == [] and srv.hello_timeouts == 0
            n.cancel_scope.cancel()


async def test_connection_cap():
    fp = FakePlacer()
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp, max_connections=2)
            a = await HeartbeatClient.connect(url, "c", "a")
            b = await HeartbeatClient.connect(url, "c", "b")
            with pytest.raises(WireError, match="503"):
                await HeartbeatClient.connect(url, "c", "c")
            assert srv.over_cap == 1 and srv.open_connections == 2
            await a.aclose()
            with trio.fail_after(2):
                await poll(lambda: srv.open_connections <= 1, 0.01)
            c = await HeartbeatClient.connect(url, "c", "c")
            assert (await c.exchange(_rep("c"))).status == 200
            await b.aclose()
            await c.aclose()
            n.cancel_scope.cancel()


async def test_shared_wire_pipelines_many_nodes_and_survives_a_restart():
    fp = FakePlacer()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            srv_scope = trio.CancelScope()
            srv = HeartbeatServer(TOKENS, fp.ingest)
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            listeners[0].socket.close()

            async def serve(task_status=trio.TASK_STATUS_IGNORED):
                with srv_scope:
                    await srv.run(f"127.0.0.1:{port}", task_status=task_status)

            await n.start(serve)
            shared = SharedWire(f"tcp://127.0.0.1:{port}", "c", name="emu", backoff_max_s=0.1)
            await n.start(shared.run)
            got: dict[str, int] = {}

            async def one(i: int) -> None:
                r = await shared.exchange(_rep(f"n{i}", full=True))
                assert r.reply.stop[0].workload_id == f"n{i}/1"  # paired with its own report
                got[f"n{i}"] = r.status

            async with trio.open_nursery() as m:
                for i in range(300):
                    m.start_soon(one, i)
            assert len(got) == 300 and set(got.values()) == {200}
            assert sorted(nid for nid, _ in fp.seen) == sorted(f"n{i}" for i in range(300))
            assert shared.connects == 1 and srv.connections == 1
            # the placer goes away: waiters fail; it comes back: the same object reconnects
            srv_scope.cancel()
            with pytest.raises(WireError):
                with trio.fail_after(2):
                    while True:
                        await shared.exchange(_rep("n0", 2))
            srv_scope = trio.CancelScope()
            await n.start(serve)
            with trio.fail_after(5):
                r = await shared.exchange(_rep("n1", 2))
            assert r.status == 200 and shared.connects == 2
            n.cancel_scope.cancel()


class _Hooks:
    """The least an agent offers its link."""

    def __init__(self, node: str) -> None:
        self.node = node

    def full_report(self) -> NodeReport:
        return NodeReport(node_id=self.node, boot_id="", seq=0, full=True, control_url="http://127.0.0.1:1")

    def gpu_snapshot(self) -> GpuSnapshot:
        return GpuSnapshot()

    async def stop_workloads(self, victims: list[Victim]) -> None:
        return None


async def test_agent_link_registers_over_a_remembered_shared_wire_without_http():
    """A link built with a known wire URL and a shared connection sends its full report over
    the framed channel: no HTTP at all (the placer's HTTP URL here refuses connections)."""
    fp = FakePlacer()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp)
            shared = SharedWire(url, "c", name="emu")
            await n.start(shared.run)

            async def connect(wire_url: str, token: str, node_id: str):
                return shared.handle()

            links = [AgentLink("http://127.0.0.1:1", "c", f"n{i}", _Hooks(f"n{i}"), heartbeat_s=0.05,
                               wire_url=url, wire_connect=connect) for i in range(20)]
            for link in links:
                await n.start(link.run)
            with trio.fail_after(5):
                await poll(lambda: all(link.registered and link.reports_sent >= 3 for link in links), 0.02)
            assert all(link.wire_full_reports >= 1 and link.failures == 0 for link in links)
            assert srv.connections == 1
            full = {nid for nid, r in fp.seen if r.full}
            assert full == {f"n{i}" for i in range(20)}
            n.cancel_scope.cancel()


async def test_push_pool_joins_base_paths_and_bounds_connections_per_endpoint():
    seen: list[str] = []
    open_now = 0
    peak = 0
    accepted = 0

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal open_now, peak, accepted
        accepted += 1
        open_now += 1
        peak = max(peak, open_now)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                line = head.split(b"\r\n")[0].decode()
                length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0]
                             .split(b":")[1])
                while len(buf) < length:
                    buf += await stream.receive_some(65536)
                buf = buf[length:]
                seen.append(line.split(" ")[1])
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        except trio.BrokenResourceError:
            pass
        finally:
            open_now -= 1

    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            listeners = await n.start(trio.serve_tcp, handle, 0)
            port = listeners[0].socket.getsockname()[1]
            pool = PushPool(concurrency=256, max_per_host=8)
            items = [(f"n{i}", f"http://127.0.0.1:{port}/n/n{i}", "/v1/placements", b"{}") for i in range(400)]
            out = await pool.post_many(items)
            assert all(r.ok for r in out.values()) and len(out) == 400
            assert sorted(seen) == sorted(f"/n/n{i}/v1/placements" for i in range(400))
            assert accepted <= 8 and peak <= 8 and pool.connects <= 8
            r = await pool.post(f"http://127.0.0.1:{port}", "/v1/placements", b"{}")
            assert r.ok and seen[-1] == "/v1/placements"
            await pool.aclose()
            n.cancel_scope.cancel()


def test_wire_reply_round_trip():
    r = WireReply(status=200, reply=ReportReply(wire_url="tcp://x:1"))
    assert msgspec.json.decode(frame(r)[4:], type=WireReply) == r


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_agent_link_re_registers_over_the_remembered_framed_channel_after_a_placer_restart(tmp_path, token_dir):
    """First registration over HTTP (the reply names the framed channel); after the placer
    restarts on the same channel address, the full report goes over the framed channel.
    (The restarted placer's API listens elsewhere: while the channel's port is refused the
    link uses HTTP for a while, and a placer answering there first would take the report;
    here only the remembered channel can.)"""
    from placer.service import PlacerService

    from .test_placer_service import cfg

    tokens = TokenSet.load(token_dir)
    http_port, wire_port = _free_port(), _free_port()
    hooks = _Hooks("solo")
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc_scope = trio.CancelScope()

            async def placer(http_port: int, task_status=trio.TASK_STATUS_IGNORED):
                conf = cfg(tmp_path, listen=f"127.0.0.1:{http_port}", wire_listen=f"127.0.0.1:{wire_port}")
                with svc_scope:
                    await PlacerService(conf, tokens).run(task_status=task_status)

            await n.start(placer, http_port)
            link = AgentLink(f"http://127.0.0.1:{http_port}", tokens.cluster, "solo", hooks, heartbeat_s=0.1,
                             backoff_max_s=0.1)
            await n.start(link.run)
            with trio.fail_after(5):
                await poll(lambda: link.registered and link.statistics()["framed_channel"], 0.02)
            assert link.full_reports_sent == 1 and link.wire_full_reports == 0  # over HTTP
            assert link.statistics()["wire_url"] == f"tcp://127.0.0.1:{wire_port}"
            svc_scope.cancel()
            with trio.fail_after(5):
                await poll(lambda: link.failures != 0, 0.02)
            svc_scope = trio.CancelScope()
            await n.start(placer, _free_port())
            with trio.fail_after(10):
                await poll(lambda: link.registered and link.wire_full_reports >= 1, 0.02)
            # on the remembered channel again, and only the very first full report went over HTTP
            assert link.statistics()["framed_channel"] and link.wire_full_reports >= 1
            assert link.full_reports_sent - link.wire_full_reports == 1
            n.cancel_scope.cancel()


class _StallThenForward:
    """A loopback listener in front of a framed channel: the first ``stall`` connections are
    accepted and never answered (a placer whose handshake queue is full), later ones are
    forwarded byte for byte to ``target``."""

    def __init__(self, target: str, stall: int, delay_s: float = 0.0, reply_delay_s: float = 0.0) -> None:
        self.host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.port = int(port)
        self.stall = stall
        self.delay_s = delay_s   # before each forwarded connection starts (a placer answering late)
        self.reply_delay_s = reply_delay_s   # before each piece of the server's answers (a busy placer)
        self.accepted = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(f"tcp://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        if self.accepted <= self.stall:
            await trio.sleep_forever()
        await trio.sleep(self.delay_s)
        async with client, await trio.open_tcp_stream(self.host, self.port) as up:
            async def pump(a: trio.SocketStream, b: trio.SocketStream, delay_s: float) -> None:
                while data := await a.receive_some(1 << 16):
                    await trio.sleep(delay_s)
                    await b.send_all(data)
                await b.send_eof()

            async with trio.open_nursery() as n:
                n.start_soon(pump, client, up, 0.0)
                n.start_soon(pump, up, client, self.reply_delay_s)


@pytest.mark.parametrize("stall", [2, 10])
async def test_agent_link_waits_out_a_busy_framed_channel_before_falling_back_to_http(stall, autojump_clock):
    """A framed channel that takes no connection in time (a placer handshaking a storm) is
    tried again after a back-off, not replaced by HTTP (which would cost the busy placer one
    more handshake): two stalled connects, then the third registers over the channel with no
    HTTP request at all; a channel that never answers falls back to HTTP after
    WIRE_BUSY_TRIES connects (the placer's HTTP URL here refuses, which the link reports).
    In virtual time (loopback sockets within this process, no worker thread): a stalled
    connect lasts exactly its 0.2 s deadline and the forwarded one none, so the counts
    cannot depend on how loaded the machine is."""
    from scheduler_link.agent_link import WIRE_BUSY_TRIES

    fp = FakePlacer()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            _, url = await _server(n, fp)
            front = _StallThenForward(url, stall)
            front_url = await n.start(front.run)
            link = AgentLink("http://127.0.0.1:1", "c", "solo", _Hooks("solo"), heartbeat_s=0.05,
                             wire_url=front_url, wire_connect_timeout_s=0.2, wire_busy_backoff_s=0.02,
                             backoff_max_s=0.05)
            await n.start(link.run)
            if stall < WIRE_BUSY_TRIES:
                with trio.fail_after(10):
                    await poll(lambda: link.registered and link.reports_sent >= 2, 0.02)
                assert link.wire_busy == stall and front.accepted == stall + 1
                assert link.failures == 0 and link.full_reports_sent == link.wire_full_reports == 1
                assert [r.full for nid, r in fp.seen][:1] == [True]
            else:
                with trio.fail_after(10):
                    await poll(lambda: link.failures != 0, 0.02)
                assert link.wire_busy == WIRE_BUSY_TRIES - 1 and front.accepted == WIRE_BUSY_TRIES
                assert "127.0.0.1:1" in (link.last_error or "") or "onnect" in (link.last_error or "")
                assert fp.seen == []
            n.cancel_scope.cancel()


async def test_a_registration_is_waited_for_longer_than_a_heartbeat(autojump_clock):
    """A busy placer answers each report 0.6 s late; the request timeout is 0.3 s. The full
    report that registers is waited for (wire_connect_timeout_s): registered at the first
    try, no report given up on and sent again (a storm's retries were what collapsed 131,072
    emulated nodes). The heartbeats after it keep the short deadline: they fail. (Virtual
    time, as above: 0.6 s against 0.3 s exactly.)"""
    fp = FakePlacer()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            _, url = await _server(n, fp)
            front = _StallThenForward(url, 0, reply_delay_s=0.6)
            front_url = await n.start(front.run)
            link = AgentLink("http://127.0.0.1:1", "c", "solo", _Hooks("solo"), heartbeat_s=0.05,
                             wire_url=front_url, request_timeout_s=0.3, wire_connect_timeout_s=5.0,
                             backoff_max_s=0.05)
            await n.start(link.run)
            with trio.fail_after(10):
                await poll(lambda: link.registered, 0.02)
            assert link.full_reports_sent == link.wire_full_reports == 1 and link.failures == 0
            with trio.fail_after(10):
                await poll(lambda: link.failures != 0, 0.02)  # a heartbeat answered 0.6 s late: over its 0.3 s
            assert "TooSlowError" in (link.last_error or "")
            n.cancel_scope.cancel()


async def test_a_frames_connection_says_why_it_closed():
    """FrameChannel.close_reason (the placer's "relay disconnected" log, the emulator's drop
    reasons): the side that closes says so, the other side that its peer did."""
    from scheduler_link.frames import FrameChannel

    with trio.fail_after(10):
        a_sock, b_sock = trio.socket.socketpair()
        a, b = FrameChannel(trio.SocketStream(a_sock), name="a"), FrameChannel(trio.SocketStream(b_sock), name="b")
        assert a.close_reason == b.close_reason == ""
        async with trio.open_nursery() as n:
            n.start_soon(a.run, lambda ch, f: None)
            n.start_soon(b.run, lambda ch, f: None)
            await trio.testing.wait_all_tasks_blocked()
            await a.aclose()
            await b.closed.wait()
        assert a.close_reason == "closed here" and b.close_reason == "closed by the peer"


async def test_a_backlog_of_connections_is_taken_in_a_few_scheduler_passes():
    """HeartbeatServer takes every connection queued in the listen backlog at each wake-up,
    not one per pass of trio's loop (in a registration storm a pass is tens of ms, and 4,096
    relays connecting at once waited past their connect deadline). 300 clients dial and say
    hello while the loop is blocked: every one is taken (its handler started) within a few
    passes of the loop, where one accept a pass would need 300; then all are answered."""
    import socket

    fp = FakePlacer()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            srv, url = await _server(n, fp)
            host, port = url.removeprefix("tcp://").rsplit(":", 1)
            base = srv.connections
            clients = []
            for i in range(300):   # queued in the kernel's backlog: the loop is not running meanwhile
                s = socket.create_connection((host, int(port)))
                s.sendall(frame(Hello(token="c", node_id=f"n{i}")))
                clients.append(s)
            # passes of the loop until every queued connection has a handler: counted in
            # loop passes, not time, so load cannot move it
            passes = 0
            while srv.connections - base < 300 and passes < 1000:
                await trio.lowlevel.checkpoint()
                passes += 1
            assert srv.connections - base == 300 and passes < 20, (srv.connections - base, passes)

            def answers() -> int:
                got = 0
                for s in clients:
                    s.settimeout(15)
                    (ln,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
                    got += msgspec.json.decode(s.recv(ln, socket.MSG_WAITALL))["status"] == 200
                return got

            assert await trio.to_thread.run_sync(answers) == 300
            for s in clients:
                s.close()
            n.cancel_scope.cancel()
