"""A rack relay's copies to the placers that follow (several placers, one leading: placer.ha).

Theory of operation
-------------------
A relay sends its members' rack beats and content reports to the leader over its connection up
(agent.relay); a copy of each frame goes to every other placer the relay host knows, so that
their warm models (placer.observe) hold the rack too. The relay host's own link learns the
followers' framed channels (scheduler_link.follow) and asks the relay for a report channel to
each (:meth:`agent.relay.Relay.own_channel`): the relay opens one frames connection per follower
(its hello names the rack, as a relay's does), the host's own copies go over it, and from then
on every beat and report batch the relay sends up is queued for it.

- Copies are fire and forget: a follower's answers are read for ``need_full`` only (the members
  it lacks are asked for a full report, which goes up through the relay to the leader and to
  every follower); nothing else of a follower's answer is handed to anyone. A beat answered
  with an epoch comes from a follower promoted meanwhile: it is taken as the leader's answer is
  (RelayCore.beat_answered: its epoch checked, its stops handed on), and so are its answers to a
  report batch (RelayCore.copies_answered: the stops ride on each member's next answer).
- Beats are copied every :data:`COPY_BEAT_EVERY` beats: a follower only keeps its model warm
  (it judges no node lost; on promotion a member heard within ``recover_s`` counts as reported:
  placer.observe), so the beats between are merged into the next copy, each member's newest
  entry kept with its own MAC (a beat's entries may skip sequence numbers: the skipped ones said
  nothing). Half the frames, entries and MACs a follower applies, and the relay copies. The held
  entries of the members in a report batch go before it (the follower sees each member's
  sequence in order; the others stay held), and a held beat goes at once while the relay has
  no connection up (a failover: the follower about to lead holds the rack as fresh as it can,
  and its answer, a leader's, is heard an interval sooner).
- Bounded: at most COPY_QUEUE frames wait for one follower; more, and the oldest is dropped
  (counted; the follower's sequence checks then ask for the full reports it lacks).
- Promotion: when the relay's connection up is to go to a placer it holds a copy connection to
  (the follower now leads), that connection becomes the connection up (:meth:`RelayCopies.take`):
  no handshake, and, when no copy to it was dropped, the members are not asked for full reports
  (the new leader already holds what they said).

The figures (``statistics()``): frames and bytes copied, frames dropped, per follower.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from scheduler_link.follow import EMPTY_EVERY_BEATS
from scheduler_link.frames import CallFailed, FrameChannel, FrameError, decode_payload
from scheduler_link.heartbeat_wire import WireReply
from scheduler_link.messages import Frame, NodeReport, RackBeat, RackBeatReply, RackReports

log = logging.getLogger("herd.agent.relay")

COPY_QUEUE = 64   # frames waiting for one follower, at most
COPY_BEAT_EVERY = EMPTY_EVERY_BEATS   # a follower is sent one beat copy every this many beats (merged)

FrameHandler = Callable[[FrameChannel, Frame], Any]


@dataclass(eq=False)
class CopyConn:
    """One follower's copy connection and the frames waiting for it."""
    url: str
    ch: FrameChannel
    queue: deque[tuple[str, Any]] = field(default_factory=deque)
    wake: trio.Event = field(default_factory=trio.Event)
    sent: int = 0
    drops: int = 0
    failures: int = 0
    promoted: bool = False
    beat: RackBeat | None = None   # the beats not copied yet, merged (each member's newest entry)
    held: int = 0                  # ... how many


class RelayCopies:
    """The copy connections of one relay (see the module docstring)."""

    def __init__(self, *, open_conn: Callable[[str], Awaitable[FrameChannel]], handler: FrameHandler,
                 need_full: Callable[[list[str], list[str]], None], leader_beat: Callable[[RackBeatReply], None],
                 leader_reports: Callable[[list[NodeReport], list[WireReply]], None],
                 leads: Callable[[str, int], None] | None = None, timeout_s: float) -> None:
        self._open = open_conn
        self._handler = handler      # frames a follower sends (a promoted one's bundles: the relay's own)
        self._need_full = need_full
        self._leader_beat = leader_beat   # a beat answer of a placer that leads now (its epoch, its stops)
        self._leader_reports = leader_reports   # ... and its answers to a report batch
        self._leads = leads   # (follower url, its epoch): a copy answered as a leader answers
        self.timeout_s = timeout_s
        self.conns: dict[str, CopyConn] = {}
        self._opening: dict[str, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self.frames = 0
        self.drops = 0
        self.failures = 0
        self.bytes_closed = 0        # bytes copied over connections gone since

    def start(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    async def channel(self, url: str) -> FrameChannel:
        """The copy connection to the follower whose channel is ``url``, opened if needed
        (OSError and the like when it cannot be)."""
        while True:
            c = self.conns.get(url)
            if c is not None and not c.ch.closed.is_set():
                return c.ch
            opening = self._opening.get(url)
            if opening is None:
                break
            await opening.wait()
        done = self._opening[url] = trio.Event()
        try:
            ch = await self._open(url)
        finally:
            del self._opening[url]
            done.set()
        c = self.conns[url] = CopyConn(url, ch)
        assert self._nursery is not None
        self._nursery.start_soon(self._run, c)
        log.info("relay copies to a follower url=%s", url)
        return ch

    def copy(self, kind: str, payload: Any, upstream: str | None) -> None:
        """A frame sent up (``beat`` or ``reports``; ``upstream``: where it went, None while the
        relay has no connection up): queued for every follower but ``upstream``, a beat every
        :data:`COPY_BEAT_EVERY` (see the module docstring)."""
        for url, c in self.conns.items():
            if url == upstream or c.promoted:
                continue
            if kind == "beat":
                c.beat = payload if c.beat is None else merged_beat(c.beat, payload)
                c.held += 1
                if c.held >= COPY_BEAT_EVERY or upstream is None:
                    self._queue(c, "beat", c.beat)
                    c.beat, c.held = None, 0
                continue
            if c.beat is not None:   # the held entries of its members go first (each one's sequence in order)
                ids = ({r.node_id for r in payload.reports} if isinstance(payload, RackReports)
                       else set(c.beat.node_ids))
                first, c.beat = split_beat(c.beat, ids)
                if c.beat is None:
                    c.held = 0
                if first is not None:
                    self._queue(c, "beat", first)
            self._queue(c, kind, payload)

    def _queue(self, c: CopyConn, kind: str, payload: Any) -> None:
        if len(c.queue) >= COPY_QUEUE:
            c.queue.popleft()
            c.drops += 1
            self.drops += 1
        c.queue.append((kind, payload))
        c.wake.set()

    def take(self, url: str) -> CopyConn | None:
        """The copy connection to ``url`` as the relay's connection up (the follower leads now):
        its copies stop; its frames keep being served. None when there is none open."""
        c = self.conns.get(url)
        if c is None or c.ch.closed.is_set():
            return None
        del self.conns[url]
        self.bytes_closed += c.ch.bytes_out   # (what it carried as a copy connection)
        c.promoted = True
        c.queue.clear()
        c.beat = None
        c.wake.set()
        return c

    async def _run(self, c: CopyConn) -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._send, c)
                await c.ch.run(self._handler)
                n.cancel_scope.cancel()
        finally:
            if not c.promoted:
                self.bytes_closed += c.ch.bytes_out
            if self.conns.get(c.url) is c:
                del self.conns[c.url]
            if not c.promoted:
                with trio.CancelScope(shield=True):
                    await c.ch.aclose()

    async def _send(self, c: CopyConn) -> None:
        while not c.promoted:
            if not c.queue:
                c.wake = trio.Event()
                await c.wake.wait()
                continue
            kind, payload = c.queue.popleft()
            try:
                f = await c.ch.call(kind, payload, timeout_s=self.timeout_s)
                c.sent += 1
                self.frames += 1
                self._answered(c, kind, payload, f)
            except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
                c.failures += 1
                self.failures += 1
                log.debug("copy to a follower failed url=%s kind=%s err=%s", c.url, kind, e)

    def _answered(self, c: CopyConn, kind: str, payload: Any, f: Frame) -> None:
        """A follower's answer: the members it needs a full report of (and of those, the ones
        whose compact registration it refused: it lacks their GPU inventory), nothing else."""
        inventories: list[str] = []
        if kind == "beat":
            r = decode_payload(f, RackBeatReply)
            if r.epoch:   # the follower leads now: its answer is a leader's, taken as the core takes one
                self._leader_beat(r)
                if self._leads is not None:
                    self._leads(c.url, r.epoch)
                return
            need = r.need_full
        elif kind == "reports" and isinstance(payload, RackReports):
            answers = decode_payload(f, list[WireReply])
            if any(a.status == 200 and a.reply.epoch for a in answers):   # (a follower leads now, as above)
                self._leader_reports(payload.reports, answers)
                if self._leads is not None:
                    self._leads(c.url, max(a.reply.epoch for a in answers if a.status == 200))
                return
            need = [r.node_id for r, a in zip(payload.reports, answers, strict=False)
                    if a.status == 409 or a.reply.need_full]
            inventories = [r.node_id for r, a in zip(payload.reports, answers, strict=False)
                           if a.status == 409 and r.compact]
        else:
            return
        if need:
            self._need_full(need, inventories)

    def statistics(self) -> dict[str, Any]:
        return {"followers": len(self.conns), "frames": self.frames, "drops": self.drops,
                "failures": self.failures,
                "bytes": self.bytes_closed + sum(c.ch.bytes_out for c in self.conns.values()),
                "by_follower": {u: {"sent": c.sent, "drops": c.drops, "queued": len(c.queue)}
                                for u, c in self.conns.items()}}


def merged_beat(old: RackBeat, new: RackBeat) -> RackBeat:
    """``old`` then ``new`` as one beat: each member once, with its newest entry (``new``'s where
    both have one) and that entry's own MAC."""
    if not all(len(b.boot_ids) == len(b.seqs) == len(b.macs) == len(b.node_ids) for b in (old, new)):
        return new   # (columns of unequal length: the placer refuses such a beat; no entry of old is merged in)
    ent = dict(zip(old.node_ids, zip(old.boot_ids, old.seqs, old.macs, strict=True), strict=True))
    ent.update(zip(new.node_ids, zip(new.boot_ids, new.seqs, new.macs, strict=True), strict=True))
    if len(ent) == len(new.node_ids):   # (the common case: the members of the next beat are the same)
        return new
    boots, seqs, macs = zip(*ent.values(), strict=True)
    return RackBeat(rack=new.rack, node_ids=list(ent), boot_ids=list(boots), seqs=list(seqs), sent_at=new.sent_at,
                    macs=list(macs))


def split_beat(b: RackBeat, ids: set[str]) -> tuple[RackBeat | None, RackBeat | None]:
    """``b``'s entries of the members in ``ids``, and the others (each None when empty)."""
    mine = [k for k, nid in enumerate(b.node_ids) if nid in ids]
    if not mine:
        return None, b
    if len(mine) == len(b.node_ids) or not len(b.boot_ids) == len(b.seqs) == len(b.macs) == len(b.node_ids):
        return b, None
    rest = [k for k, nid in enumerate(b.node_ids) if nid not in ids]
    return _entries(b, mine), _entries(b, rest)


def _entries(b: RackBeat, ks: list[int]) -> RackBeat:
    return RackBeat(rack=b.rack, node_ids=[b.node_ids[k] for k in ks], boot_ids=[b.boot_ids[k] for k in ks],
                    seqs=[b.seqs[k] for k in ks], sent_at=b.sent_at, macs=[b.macs[k] for k in ks])
