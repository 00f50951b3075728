"""Bounds of the framed channel (issue 42, finding 2): a hostile frames client on loopback
against an in-process placer's real framed channel -- an oversized frame, a huge beat, a
reader that never reads, more connections than an address may hold -- each costs it one
bounded, counted refusal while ``/healthz`` keeps answering; and the pieces (the write
queue's bound, held frames, aggregated rejection logs) on a channel over memory streams."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing

from infra.auth import TokenSet
from placer.service import PlacerService
from scheduler_link import frames
from scheduler_link.frames import (
    MAX_FRAME,
    MEMBER_MAX_FRAME,
    MEMBER_MAX_QUEUED,
    FrameChannel,
    Refused,
    Tally,
    check_entries,
    encode_frame,
    open_frames,
)
from scheduler_link.heartbeat_wire import HeartbeatServer, Hello, WireError, WireReply, frame
from scheduler_link.messages import BlobRequest, Frame, RackBeat, RelayHello
from testing.fake_agent import FakeAgent
from testing.waiting import poll

from .test_placer_service import cfg

R1 = "z1/b1/r1"   # FakeAgent(rack="r1")'s rack path


async def _placer(nursery: trio.Nursery, tmp: Path, tokens: TokenSet) -> tuple[PlacerService, str]:
    svc = PlacerService(cfg(tmp), tokens)
    url = await nursery.start(svc.run)
    return svc, url


async def _healthy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=2.0) as c:
        return (await c.get(f"{url}/healthz")).status_code == 200


async def _closed_by_peer(stream: trio.abc.Stream) -> bytes:
    """Read until the placer closes the connection; what it sent meanwhile."""
    got = bytearray()
    while True:
        try:
            data = await stream.receive_some(1 << 16)
        except (trio.BrokenResourceError, OSError):
            return bytes(got)
        if not data:
            return bytes(got)
        got += data


def _beat(n: int, *, node: str = "x") -> RackBeat:
    return RackBeat(rack=R1, node_ids=[f"{node}{i}" for i in range(n)], boot_ids=["b"] * n, seqs=[1] * n,
                    macs=[b"\0" * 16] * n)


async def test_an_oversized_frame_from_a_plain_member_is_refused_and_closes_it(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            ch = await open_frames(svc.wire_url, tokens.cluster or "", "n0")
            # a 32 MiB ping: its length goes out, then the first of its bytes
            await ch.stream.send_all(encode_frame("ping", None)[:0] + (32 << 20).to_bytes(4, "big") + b"\0" * 4096)
            await _closed_by_peer(ch.stream)
            await poll(lambda: svc.wire is not None and svc.wire.frames_closed == {"frame_too_big": 1}, 0.01)
            assert await _healthy(url)
            n.cancel_scope.cancel()


async def test_a_huge_beat_costs_one_bounded_refusal_not_a_line_per_entry(tmp_path, token_dir, caplog):
    """A 200,000-entry beat from a node that is no relay is over a member's frame size; a
    candidate relay's (its own rack) fits a candidate's frame but not its entries. Each is
    one refusal: no entry is looked at, none logged."""
    tokens = TokenSet.load(token_dir)
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            agent = FakeAgent("n2", tokens, rack="r1")
            await n.start(agent.run, url)
            await poll(lambda: "n2" in svc.state.nodes, 0.02)
            assert svc.wire is not None
            bad0 = svc.state.counters.get("bad_macs", 0)

            plain = await open_frames(svc.wire_url, tokens.cluster or "", "n9")
            try:   # (refused at its length: the placer may close before it is all sent)
                await plain.stream.send_all(encode_frame("beat", _beat(200_000), id=1))
            except trio.BrokenResourceError:
                pass
            await _closed_by_peer(plain.stream)

            cand = await open_frames(svc.wire_url, tokens.cluster or "", "n2",
                                     relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
            big = encode_frame("beat", _beat(100_000), id=1)
            assert MEMBER_MAX_FRAME < len(big) < frames.CANDIDATE_MAX_FRAME
            await cand.stream.send_all(big)
            await _closed_by_peer(cand.stream)

            await poll(lambda: svc.wire is not None and svc.wire.frames_closed == {"frame_too_big": 1,
                                                                                    "entries_over": 1}, 0.01)
            assert svc.state.counters.get("bad_macs", 0) == bad0   # no entry was looked at
            lines = [r for r in caplog.records if r.name.startswith("herd.") and "x1" in r.getMessage()]
            assert lines == []
            assert len([r for r in caplog.records if r.name.startswith("herd.link.frames")]) <= 4
            assert await _healthy(url)
            n.cancel_scope.cancel()


async def test_bad_macs_in_a_candidates_beat_are_logged_once_a_beat_with_a_count(tmp_path, token_dir, caplog):
    tokens = TokenSet.load(token_dir)
    caplog.set_level(logging.INFO)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            agent = FakeAgent("n2", tokens, rack="r1")
            await n.start(agent.run, url)
            await poll(lambda: "n2" in svc.state.nodes, 0.02)
            bad0 = svc.state.counters.get("bad_macs", 0)
            cand = await open_frames(svc.wire_url, tokens.cluster or "", "n2",
                                     relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
            n.start_soon(cand.run, lambda ch, f: None)
            for _ in range(3):
                f = await cand.call("beat", _beat(200), timeout_s=5)
                assert f.type == "beat_reply"
            assert svc.state.counters["bad_macs"] - bad0 == 600
            warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "MAC" in r.getMessage()]
            assert len(warned) == 3 and all("count=200 " in r.getMessage() for r in warned)   # one a beat
            await cand.aclose()
            n.cancel_scope.cancel()


async def test_a_reader_that_never_reads_is_closed_at_its_bound(tmp_path, token_dir):
    """blob_get after blob_get, never reading the answers: the placer queues at most its
    bound for it (past the socket buffers), then closes it, and keeps serving meanwhile."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            svc.state.blobs["b" * 64] = b"\1" * (60 << 10)   # a gang blob of 60 KiB
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            host, port = svc.wire_url.removeprefix("tcp://").rsplit(":", 1)
            await sock.connect((host, int(port)))
            stream = trio.SocketStream(sock)
            await stream.send_all(frame(Hello(token=tokens.cluster or "", node_id="n0", frames=True)))
            ask = encode_frame("blob_get", BlobRequest(blob_id="b" * 64), id=1)
            sent = 0
            with trio.move_on_after(20):
                while svc.wire is None or not svc.wire.frames_closed:
                    try:
                        await stream.send_all(ask * 16)
                    except (trio.BrokenResourceError, OSError):
                        break
                    sent += 16
                    if sent % 64 == 0:
                        assert await _healthy(url)
                    assert sent < 1_000   # bounded: 60 MB of answers asked for, at most
            await poll(lambda: svc.wire is not None and svc.wire.frames_closed == {"slow_reader": 1}, 0.01)
            # what it was sent plus what waited for it: socket buffers and the bound, not `sent` answers
            assert sent * (60 << 10) > MEMBER_MAX_QUEUED
            assert await _healthy(url)
            await stream.aclose()
            n.cancel_scope.cancel()


async def test_an_address_holds_at_most_eight_frames_connections_but_relay_candidates(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            agent = FakeAgent("n2", tokens, rack="r1")
            await n.start(agent.run, url)
            await poll(lambda: "n2" in svc.state.nodes, 0.02)
            held = [await open_frames(svc.wire_url, tokens.cluster or "", f"p{i}") for i in range(8)]
            with pytest.raises(WireError, match="per_address"):
                await open_frames(svc.wire_url, tokens.cluster or "", "p8")
            cand = await open_frames(svc.wire_url, tokens.cluster or "", "n2",
                                     relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
            assert svc.wire is not None and svc.wire.frames_refused == {"per_address": 1}
            await held[0].aclose()
            await poll(lambda: svc.wire is not None and svc.wire.frames_gate.open == 7, 0.01)
            held[0] = await open_frames(svc.wire_url, tokens.cluster or "", "p8")
            for ch in [*held, cand]:
                await ch.aclose()
            n.cancel_scope.cancel()


async def test_a_node_holds_one_relay_candidate_connection(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url = await _placer(n, tmp_path, tokens)
            agent = FakeAgent("n2", tokens, rack="r1")
            await n.start(agent.run, url)
            await poll(lambda: "n2" in svc.state.nodes, 0.02)
            hello = RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9")
            first = await open_frames(svc.wire_url, tokens.cluster or "", "n2", relay=hello)
            chans = [await open_frames(svc.wire_url, tokens.cluster or "", "n2", relay=hello) for _ in range(20)]
            await _closed_by_peer(first.stream)
            await poll(lambda: svc.wire is not None and svc.wire.frames_connections == 1, 0.01)
            assert svc.wire is not None and svc.wire.frames_closed == {"replaced": 20}
            conn = svc.relays.relay_for(R1)
            assert conn is not None and conn.channel.name == "n2" and not conn.channel.closed.is_set()
            for ch in [first, *chans]:
                await ch.aclose()
            n.cancel_scope.cancel()


class _Host:
    """A frames host that serves pings (a relay's members listener, reduced)."""

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        return lambda ch, f: ("ping", None)

    def closed(self, channel: FrameChannel) -> None:
        pass


async def test_a_members_listener_caps_connections_per_address_and_member_frames(token_dir):
    tokens = TokenSet.load(token_dir)
    server = HeartbeatServer(tokens, lambda n, r: (400, None), frames=_Host())   # type: ignore[arg-type, return-value]  # no report streams here
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(server.run, "127.0.0.1:0")
            held = [await open_frames(url, tokens.cluster or "", f"m{i}") for i in range(8)]
            with pytest.raises(WireError) as e:
                await open_frames(url, tokens.cluster or "", "m8")
            assert "per_address" in str(e.value)
            ch = held[0]
            n.start_soon(ch.run, lambda c, f: None)
            assert (await ch.call("ping", {}, timeout_s=5)).type == "ping"
            await ch.stream.send_all((MEMBER_MAX_FRAME + 1).to_bytes(4, "big"))
            await ch.closed.wait()
            await poll(lambda: server.frames_closed == {"frame_too_big": 1}, 0.01)
            for c in held[1:]:
                await c.aclose()
            n.cancel_scope.cancel()


class _Slow(_Host):
    """A relay whose answers take long (it forwards each report up and waits)."""

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        return self._frame

    async def _frame(self, ch: FrameChannel, f: Frame) -> None:
        await trio.sleep_forever()


async def test_a_member_with_too_many_requests_in_flight_is_closed(token_dir):
    tokens = TokenSet.load(token_dir)
    server = HeartbeatServer(tokens, lambda n, r: (400, None), frames=_Slow())   # type: ignore[arg-type, return-value]  # no report streams here
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(server.run, "127.0.0.1:0")
            ch = await open_frames(url, tokens.cluster or "", "m0")
            await ch.stream.send_all(b"".join(encode_frame("ping", None, id=i + 1) for i in range(1000)))
            await _closed_by_peer(ch.stream)
            await poll(lambda: server.frames_closed == {"inflight_over": 1}, 0.01)
            n.cancel_scope.cancel()


# ------------------------------------------------------------------ the pieces, over memory streams


def _pair(**kw: Any) -> tuple[FrameChannel, trio.testing.MemoryStapledStream]:   # type: ignore[name-defined]
    a, b = trio.testing.memory_stream_pair()
    return FrameChannel(a, name="peer", **kw), b


def test_check_entries_is_a_pure_bound():
    check_entries(48, 48)
    with pytest.raises(Refused) as e:
        check_entries(49, 48)
    assert e.value.code == "entries_over"


def test_a_tally_logs_once_per_interval_with_a_count(caplog):
    caplog.set_level(logging.INFO)
    now = [0.0]

    def clock() -> float:
        return now[0]

    t = Tally("relay1", interval_s=10.0, clock=clock)
    for _ in range(1000):
        t.add("bad MAC", 1, "node=x")
    now[0] = 10.0
    t.add("bad MAC", 5)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "count=1 " in msgs[0] and "count=1004 " in msgs[1] and t.total == 1005


async def test_make_relay_raises_the_frame_size_and_entries_only_for_that_connection():
    ch, peer = _pair(max_frame=MEMBER_MAX_FRAME, max_queued=MEMBER_MAX_QUEUED, max_held=1 << 10, max_entries=1)
    assert ch.entry_limit == 1
    frames.make_candidate(ch, 256)
    assert ch.max_frame == frames.CANDIDATE_MAX_FRAME and ch.entry_limit == 256
    frames.make_relay(ch, R1, 256)
    assert ch.max_frame == MAX_FRAME and ch.relay_racks == (R1,)
    other, _ = _pair(max_frame=MEMBER_MAX_FRAME)
    assert other.max_frame == MEMBER_MAX_FRAME


async def test_held_frames_are_bounded_per_connection():
    ch, _ = _pair(max_held=3000)
    f = msgspec.msgpack.decode(encode_frame("beat", _beat(20))[4:], type=Frame)
    n = 0
    while frames.hold(ch, f):
        n += 1
        assert n < 100
    assert ch.close_code == "deferred_over" and ch.closed.is_set() and ch.held <= 3000
    frames.release(ch, f)
    assert ch.held <= 3000 - len(f.payload)


async def test_a_send_past_the_write_bound_closes_the_connection():
    ch, _ = _pair(max_queued=10_000)
    ch.send("blob", {"x": b"\0" * 20_000})   # one frame always goes into an empty queue
    with pytest.raises(frames.FrameError):
        ch.send("ping", None)
    assert ch.close_code == "slow_reader" and ch.closed.is_set()


def test_a_refused_hello_says_why_as_a_code():
    r = msgspec.json.decode(frame(WireReply(status=403, error="x", reason="rack_mismatch"))[4:], type=WireReply)
    assert r.reason == "rack_mismatch"
