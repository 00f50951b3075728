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

- Copies are fire and forget: a beat copy is sent as a frame that wants no answer, and a
  follower answers one only when it has something to say (scheduler_link.follow.answer_beat:
  the members it lacks, or its epoch once it leads), in a ``beat_reply`` of its own; a report
  batch is a request, answered. A follower's answers are read for ``need_full`` only (the
  members it lacks are asked for a full report, which goes up through the relay to the leader
  and to every follower); nothing else of a follower's answer is handed to anyone. A beat
  answered with an epoch comes from a follower promoted meanwhile: it is taken as the leader's
  answer is (RelayCore.beat_answered: its epoch checked, its stops handed on), and so are its
  answers to a report batch (RelayCore.copies_answered: the stops ride on each member's next
  answer).
- Flow control: at most :data:`COPY_WINDOW` beat copies go out unanswered; then one ``ping``
  asks the follower whether it reads (any answer, an answered report batch too, opens the
  window again). A follower that answers no ping within the relay's request timeout is stuck:
  its copy connection is closed (``stuck``; its host's link opens another when it next copies).
- The relay host's own empty heartbeats to a follower (its link's copies:
  scheduler_link.follow) ride in the next beat copy there, as the relay's own entry (a placer
  takes a relay's own entry with no MAC: the connection names it): :meth:`RelayCopies.fold`.
  One held entry waits at most one copy: the next one it is handed sends it at once; a report
  of the host's with news sends it first (:meth:`RelayCopies.flush_own`: the follower sees the
  host's sequence in order).
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
from functools import partial
from typing import Any

import msgspec
import trio

from scheduler_link.follow import EMPTY_EVERY_BEATS
from scheduler_link.frames import CallFailed, FrameChannel, FrameError, Refused, decode_payload
from scheduler_link.heartbeat_wire import WireReply
from scheduler_link.messages import Frame, NodeReport, RackBeat, RackBeatReply, RackReports

log = logging.getLogger("herd.agent.relay")

COPY_QUEUE = 64   # frames waiting for one follower, at most
COPY_WINDOW = 8   # beat copies sent to one follower with no answer heard, at most (then a ping)
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
    unacked: int = 0               # beat copies sent since its last answer
    own: NodeReport | None = None  # the relay host's own empty heartbeat, for the next beat copy (fold)
    own_need: bool = False         # it asked for the host's full report (told at the next fold)


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
        self.pings = 0
        self.stuck = 0               # connections closed: no answer to a ping within ``timeout_s``
        self.folded = 0              # the host's own heartbeats carried in beat copies
        self._own_id = ""            # the relay host's node (its folded heartbeats')
        self._rack = ""              # the rack its beats name
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
        if kind == "beat":
            self._rack = payload.rack
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
        c.own = None
        c.wake.set()
        return c

    async def _run(self, c: CopyConn) -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._send, c)
                await c.ch.run(partial(self._frame, c))
                n.cancel_scope.cancel()
        finally:
            if not c.promoted:
                self.bytes_closed += c.ch.bytes_out
            if self.conns.get(c.url) is c:
                del self.conns[c.url]
            if not c.promoted:
                with trio.CancelScope(shield=True):
                    await c.ch.aclose()

    def _frame(self, c: CopyConn, ch: FrameChannel, f: Frame) -> Any:
        """A frame the follower sent: its answer to a beat copy (sent only when it has something
        to say), else the relay's (a promoted follower's bundles)."""
        if f.type == "beat_reply" and not f.re:
            c.unacked = 0
            self._answered(c, "beat", None, f)
            return None
        return self._handler(ch, f)

    async def _send(self, c: CopyConn) -> None:
        while not c.promoted:
            if not c.queue:
                c.wake = trio.Event()
                await c.wake.wait()
                continue
            kind, payload = c.queue.popleft()
            try:
                if kind == "beat":   # (no answer waited for: the follower says something only when it must)
                    c.ch.send("beat", self._with_own(c, payload))
                    c.unacked += 1
                else:
                    f = await c.ch.call(kind, payload, timeout_s=self.timeout_s)
                    c.unacked = 0
                    self._answered(c, kind, payload, f)
                c.sent += 1
                self.frames += 1
            except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
                c.failures += 1
                self.failures += 1
                log.debug("copy to a follower failed url=%s kind=%s err=%s", c.url, kind, e)
            if c.unacked >= COPY_WINDOW and not await self._reads(c):
                return

    async def _reads(self, c: CopyConn) -> bool:
        """Whether the follower reads what it is sent: a ping answered (an error answer is one)
        within ``timeout_s``. Not answered: it is stuck, and its connection is closed."""
        self.pings += 1
        try:
            await c.ch.call("ping", None, timeout_s=self.timeout_s)
        except CallFailed:
            pass
        except (FrameError, trio.TooSlowError) as e:
            c.failures += 1
            self.failures += 1
            if isinstance(e, trio.TooSlowError) and not c.ch.closed.is_set():
                self.stuck += 1
                c.ch.refuse(Refused("stuck", f"a follower answered no ping in {self.timeout_s:g}s"))
            log.info("copies to a follower end url=%s err=%r", c.url, e)
            return False
        c.unacked = 0
        return True

    def fold(self, url: str, rep: NodeReport) -> bool:
        """The relay host's own empty heartbeat ``rep``, copied to the follower whose channel is
        ``url``: carried as the relay's own entry in the next beat copy there (a placer takes a
        relay's own entry with no MAC). False when no copy connection to it is open (the link
        sends it itself), and when the follower asked for the host's full report since (the
        heartbeat, sent by the link, is answered so). A heartbeat held from before goes now (no
        beat copy went since)."""
        c = self.conns.get(url)
        if c is None or c.promoted or c.ch.closed.is_set():
            return False
        if c.own_need:
            c.own_need = False
            return False
        self.flush_own(url)
        c.own = rep
        self._own_id = rep.node_id
        self.folded += 1
        return True

    def flush_own(self, url: str) -> None:
        """The host's held empty heartbeat for ``url`` sent now, on its own (a report of the
        host's follows it there: the follower sees the host's sequence in order)."""
        c = self.conns.get(url)
        if c is None or c.own is None:
            return
        own, c.own = c.own, None
        try:
            c.ch.send("beat", RackBeat(rack=self._rack, node_ids=[own.node_id], boot_ids=[own.boot_id], seqs=[own.seq],
                                       sent_at=own.sent_at, macs=[b""]))
            c.unacked += 1
        except FrameError:
            pass

    def _with_own(self, c: CopyConn, b: RackBeat) -> RackBeat:
        own, c.own = c.own, None
        if own is None or own.node_id in b.node_ids:
            return b
        return RackBeat(rack=b.rack, node_ids=[*b.node_ids, own.node_id], boot_ids=[*b.boot_ids, own.boot_id],
                        seqs=[*b.seqs, own.seq], sent_at=b.sent_at, macs=[*b.macs, b""])

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
            if self._own_id in need:   # (the host's own: asked of its link at its next heartbeat, fold)
                c.own_need = True
                need = [n for n in need if n != self._own_id]
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
                "failures": self.failures, "pings": self.pings, "stuck": self.stuck, "folded": self.folded,
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
