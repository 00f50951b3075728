"""The fleet emulator's relays beat from one task per process (testing.fleet.BeatClock), as each
relay host would on its own: one RackBeat per relay per interval, the next one an interval
after the answer to the last (or after request_timeout_s without one), every entry with its
member's MAC; a relay whose connection ended stops beating until its next connection.
In process, on trio's virtual clock, with fake frames connections that record what goes up."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import trio
import trio.testing

from scheduler_link.auth import TokenSet
from scheduler_link.frames import encode_frame
from scheduler_link.messages import Frame, RackBeat, RackBeatReply
from scheduler_link.msgauth import beat_mac
from testing.fleet import EmulatedNode, EmulatedRelay, Fleet, FleetConfig, fleet_nodes

HB = 5.0


class BeatChannel:
    """A relay's frames connection: beats recorded with when they left; answered by the test."""

    def __init__(self) -> None:
        self.closed = trio.Event()
        self.sent: list[tuple[float, RackBeat]] = []
        self.pending: dict[int, Callable[[Frame | None], None]] = {}
        self.forgot: list[int] = []
        self._id = 0

    def prepare(self, type_: str, payload: RackBeat) -> tuple[int, bytes]:
        assert type_ == "beat"
        self._id += 1
        return self._id, encode_frame(type_, payload, id=self._id)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        f = msgspec.msgpack.decode(data[4:], type=Frame)
        self.sent.append((trio.current_time(), msgspec.msgpack.decode(f.payload, type=RackBeat)))
        self.pending[rid] = fn

    def forget(self, rid: int) -> None:
        self.forgot.append(rid)
        self.pending.pop(rid, None)

    def answer_all(self) -> None:
        ok = msgspec.msgpack.decode(encode_frame("beat_reply", RackBeatReply(heartbeat_interval_s=HB))[4:], type=Frame)
        pending, self.pending = self.pending, {}
        for fn in pending.values():
            fn(ok)


def _relays(n: int) -> tuple[Fleet, list[tuple[EmulatedRelay, BeatChannel]]]:
    fleet = Fleet(FleetConfig(placer_url="http://127.0.0.1:9", nodes=2 * n, relays=True, heartbeat_s=HB,
                              request_timeout_s=30.0), TokenSet())
    out = []
    for k in range(n):
        members = [EmulatedNode(fleet, s, f"http://127.0.0.1:9/n/{s.node_id}", None)
                   for s in fleet_nodes("h100", 32 * k, 2)]
        relay = EmulatedRelay(fleet, f"hz00/b000/r{k:02d}", members, None)
        for i, m in enumerate(members):
            m.relay = relay
            m.registered, m.boot_id, m.seq, m.mac_key = True, f"boot-{m.slot.node_id}", 1, bytes([k, i]) * 16
        ch = BeatChannel()
        relay.channel = ch  # type: ignore[assignment]
        out.append((relay, ch))
    return fleet, out


async def test_one_beat_per_interval_after_each_answer_with_macs(autojump_clock) -> None:
    fleet, relays = _relays(3)
    async with trio.open_nursery() as n:
        fleet._nursery = n
        n.start_soon(fleet.beat_clock.run)
        for r, _ in relays:
            fleet.beat_clock.start(r)
        await trio.sleep(HB)                       # each relay's first beat within one interval
        assert [len(ch.sent) for _, ch in relays] == [1, 1, 1]
        await trio.sleep(3 * HB)                   # unanswered: no second beat before the timeout
        assert [len(ch.sent) for _, ch in relays] == [1, 1, 1]
        answered_at = trio.current_time()
        for _, ch in relays:
            ch.answer_all()
        await trio.sleep(HB - 0.01)
        assert [len(ch.sent) for _, ch in relays] == [1, 1, 1]
        await trio.sleep(0.02)                     # an interval after the answer: the next one
        assert [len(ch.sent) for _, ch in relays] == [2, 2, 2]
        for r, ch in relays:
            t, b = ch.sent[1]
            assert abs(t - (answered_at + HB)) < 0.02
            assert b.rack == r.rack and b.seqs == [3, 3]   # (seq 1 registered, 2 the first beat)
            assert b.macs == [beat_mac(m.mac_key, m.slot.node_id, m.boot_id, 3) for m in r.members]
        # never answered: given up after request_timeout_s, and the next beat an interval later
        await trio.sleep(30.0 + HB + 0.1)
        assert [len(ch.forgot) for _, ch in relays] == [1, 1, 1]
        assert [len(ch.sent) for _, ch in relays] == [3, 3, 3]
        # a relay whose connection ended beats no more (its next connection starts again)
        gone, gone_ch = relays[0]
        gone.beat_gen += 1
        gone.channel = None
        for _, ch in relays:
            ch.answer_all()
        await trio.sleep(3 * HB)
        assert len(gone_ch.sent) == 3 and [len(ch.sent) for _, ch in relays[1:]] == [4, 4]
        assert relays[1][0].beats == 2            # answers counted
        n.cancel_scope.cancel()
