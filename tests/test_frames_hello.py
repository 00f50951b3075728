"""The answer to a frames connection's hello (scheduler_link.frames.answer_by): an answer
that came in time but waited unread past the deadline -- the dialling side's process was late
to read it, as an emulator playing a thousand relay hosts on a loaded core is -- is read, not
abandoned (closing a connection the placer had accepted, then dialling it again); with nothing
waiting the deadline holds. Over a socket pair: what the peer sent is in the socket before the
call, and the deadline has passed before the call starts, so no timing decides the outcome."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from scheduler_link.frames import answer_by
from scheduler_link.heartbeat_wire import HeartbeatClient, WireReply, frame


def _pair() -> tuple[HeartbeatClient, socket.socket]:
    a, b = socket.socketpair()
    return HeartbeatClient(trio.SocketStream(trio.socket.from_stdlib_socket(a))), b


async def test_an_answer_waiting_unread_past_the_deadline_is_read():
    c, peer = _pair()
    with peer:
        peer.sendall(frame(WireReply(status=200)))   # the peer answered in time ...
        with trio.fail_after(5):
            r = await answer_by(c, trio.current_time() - 1.0, 5.0, name="r1")   # ... read late
        assert r.status == 200
        await c.aclose()


async def test_half_an_answer_read_before_the_deadline_is_finished():
    c, peer = _pair()
    with peer:
        raw = frame(WireReply(status=403, error="no"))
        c.buf += raw[:3]   # (read before the deadline struck)
        peer.sendall(raw[3:])
        with trio.fail_after(5):
            r = await answer_by(c, trio.current_time() - 1.0, 5.0)
        assert r.status == 403 and r.error == "no"
        await c.aclose()


async def test_with_nothing_waiting_the_deadline_holds():
    c, peer = _pair()
    with peer:
        with trio.fail_after(5), pytest.raises(trio.TooSlowError):
            await answer_by(c, trio.current_time() - 1.0, 5.0)
        await c.aclose()


async def test_an_answer_that_comes_by_the_deadline_is_read_as_ever(autojump_clock):
    s, r = trio.testing.memory_stream_pair()
    c = HeartbeatClient(s)

    async def answer_later() -> None:
        await trio.sleep(3.0)
        await r.send_all(frame(WireReply(status=200)))

    async with trio.open_nursery() as n:
        n.start_soon(answer_later)
        got = await answer_by(c, trio.current_time() + 10.0, 10.0)
    assert got.status == 200 and trio.current_time() == pytest.approx(3.0)
