"""Reports and beats copied to the placers that follow (several placers, one leading: placer.ha).

Theory of operation
-------------------
A follower keeps a warm model of the fleet (placer.observe): every report a node sends its
leader goes to each other placer it knows too -- by the node itself when it reports directly
(scheduler_link.agent_link), by its rack's relay otherwise (agent.relay). A follower applies what
it is sent and answers :data:`OBSERVED` (202): taken into its model, nothing to act on (the
answer carries no stop, relay, key or epoch; only ``need_full`` when it lacks the node's state).
A node's main link that reaches a follower takes 202 as "this placer does not lead" and moves
on, as it does on 503.

:class:`FollowerCopy` decides, for one follower, what goes next (no I/O; the link carries it
out over a framed connection of its own to that follower): the reports as the node built them,
in order, each at most once; after a gap (a report not taken, a queue overflowing, the node
just started) a *full* report at the sequence of the newest report built, so the follower's
sequence check holds without the leader's ever seeing a report twice: a copy never takes a
sequence number of its own. Its framed channel is learnt from the follower's 307
(:func:`follower_wire_of`: a follower names its own channel there).

A relay copies its rack's beats to each follower as frames that want no answer
(agent.relaycopies): a follower answers one only when it has something to say
(:func:`answer_beat`: the members it lacks; its epoch, once it leads). A relay host's own empty
heartbeats ride in those beat copies (:meth:`CopyHost.fold_copy`): one frame a relay and copy
interval reaches a follower, none comes back.

When the leader goes and the node moves to a follower its copies kept in step (every report
built was taken there: :meth:`FollowerCopy.caught_up`), the node goes on with its next heartbeat
over the copy's connection: no full report, no handshake -- the promoted follower already holds
what the node said.
"""

from __future__ import annotations

import logging
import math
import random
from collections import deque
from typing import Any, Literal, Protocol

import msgspec
import trio

from infra import tls

from .frames import FrameChannel, FrameError
from .heartbeat_wire import WireError, WireReply
from .messages import Frame, NodeReport, RackBeatReply

log = logging.getLogger("herd.link.follow")

__all__ = ["OBSERVED", "FULL", "Copies", "CopyHost", "FollowerCopy", "answer_beat", "follower_wire_of", "is_empty"]

OBSERVED = 202   # a follower applied the report (or beat) to its model and acts on nothing
MAX_QUEUED = 16  # reports waiting for one follower; more, and a full report replaces them
FULL: Literal["full"] = "full"
EMPTY_EVERY_BEATS = 2   # an empty heartbeat is copied every this many intervals (the newest; one with news at once)


_NOTHING = RackBeatReply()


def answer_beat(ch: FrameChannel, f: Frame, reply: RackBeatReply) -> tuple[str, RackBeatReply] | None:
    """The answer ``reply`` to the rack beat ``f``: returned when ``f`` asks for one (its
    ``id``); a beat copy that asks for none (agent.relaycopies) is answered only when ``reply``
    says something (members to send full reports, an epoch: the placer leads), in a
    ``beat_reply`` frame of its own."""
    if f.id:
        return "beat_reply", reply
    if reply != _NOTHING:
        try:
            ch.send("beat_reply", reply)
        except FrameError:
            pass
    return None


def is_empty(rep: NodeReport) -> bool:
    """A heartbeat that says only "alive" (no events, no snapshot, no manifests): a placer
    takes the newest of them past a gap in the sequence (a rack beat's entries are such)."""
    return not rep.full and not rep.events and rep.snapshot is None and rep.manifests is None


class _Redirect(msgspec.Struct, frozen=True):
    wire: str | None = None


_redirect = msgspec.json.Decoder(_Redirect)


def follower_wire_of(status: int, body: bytes) -> str | None:
    """The framed channel a follower names in its 307 (its own ``wire``), else None."""
    if status != 307:
        return None
    try:
        wire = _redirect.decode(body).wire
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return wire if wire and wire.startswith(("tcp://", "tls://")) else None


class FollowerCopy:
    """What one follower placer has been sent of this node's reports, and what goes next."""

    __slots__ = ("url", "wire", "latest", "taken", "need_full", "queue", "sent", "fulls", "gaps", "empty",
                 "empty_every_s", "sent_at", "flush")

    def __init__(self, url: str, *, empty_every_s: float = 0.0) -> None:
        self.url = url
        self.empty_every_s = empty_every_s   # an empty heartbeat is copied at most this often
        self.empty: NodeReport | None = None   # the newest empty heartbeat not copied yet
        self.sent_at = -math.inf         # when it last took a copy (the caller's clock)
        self.flush = False               # copy the pending empty heartbeat now (the node moves there)
        self.wire: str | None = None     # its framed channel (None: not learnt yet)
        self.latest = 0                  # the sequence of the newest report the node built
        self.taken = 0                   # the sequence of the newest report it took (0: none)
        self.need_full = True            # the next copy is a full report at ``latest``
        self.queue: deque[NodeReport] = deque()
        self.sent = 0                    # copies it took
        self.fulls = 0                   # ... of them full reports made for it
        self.gaps = 0                    # times its copies fell out of step (a full report then)

    def offer(self, rep: NodeReport) -> None:
        """A report the node built for its leader (in sequence order). An empty heartbeat is
        kept as the newest only (a placer takes one past a gap, as a rack beat's entry); it goes
        before the next report that says something, or on its own every ``empty_every_s``."""
        self.latest = max(self.latest, rep.seq)
        if self.need_full:
            return
        if is_empty(rep):
            self.empty = rep
            return
        if len(self.queue) >= MAX_QUEUED - 1:
            self._gap()
            return
        if self.empty is not None:
            self.queue.append(self.empty)
            self.empty = None
        self.queue.append(rep)

    def delivered(self, seq: int) -> None:
        """The follower took report ``seq`` another way (the node's own link asked it)."""
        self.taken = max(self.taken, seq)   # (a placer takes a report only in sequence, or a full one)
        self._drop_taken()

    def next(self, now: float) -> NodeReport | Literal["full"] | None:
        """What to send at ``now``: a report, a full report to be made at :attr:`latest`
        (FULL), or nothing yet (:meth:`due` says until when)."""
        if self.need_full:
            return FULL if self.latest else None
        if self.queue:
            return self.queue[0]
        if self.empty is not None and (self.flush or now >= self.sent_at + self.empty_every_s):
            return self.empty
        return None

    def due(self) -> float | None:
        """When the pending empty heartbeat is to be copied (None: none is pending)."""
        return None if self.empty is None or self.need_full else self.sent_at + self.empty_every_s

    def answered(self, rep: NodeReport, status: int | None, need_full: bool = False, now: float = 0.0) -> None:
        """The follower's answer to ``rep`` at ``now`` (None: none came, the connection failed)."""
        if status is not None and status in (OBSERVED, 200):
            self.sent += 1
            self.fulls += rep.full
            self.sent_at = now
            self.taken = max(self.taken, rep.seq)
            self._drop_taken()
            if need_full:
                self._gap()
            return
        self._gap()

    def _drop_taken(self) -> None:
        while self.queue and self.queue[0].seq <= self.taken:
            self.queue.popleft()
        if self.empty is not None and self.empty.seq <= self.taken:
            self.empty = None

    def made_full(self) -> int:
        """A full report is being made for it: at :attr:`latest`, superseding what is queued;
        what the node builds meanwhile queues behind it."""
        self.need_full = False
        self.queue.clear()
        self.empty = None
        return self.latest

    def caught_up(self) -> bool:
        """It took every report the node built."""
        return self.taken >= self.latest > 0 and not self.need_full

    def _gap(self) -> None:
        self.gaps += 1
        self.need_full = True
        self.queue.clear()
        self.empty = None

    def statistics(self) -> dict[str, object]:
        return {"url": self.url, "wire": self.wire, "latest": self.latest, "taken": self.taken,
                "sent": self.sent, "fulls": self.fulls, "gaps": self.gaps, "queued": len(self.queue)}


# ---------------------------------------------------------------- the driver (trio)

class CopyChannel(Protocol):
    """A framed connection to one placer that takes this node's reports (agent_link.ReportChannel)."""

    async def exchange(self, report: NodeReport) -> WireReply: ...

    async def aclose(self) -> None: ...


class CopyHost(Protocol):
    """What :class:`Copies` needs of the node's link (scheduler_link.agent_link.AgentLink)."""

    placer_url: str            # the placer the node reports to now (no copies go there)
    heartbeat_s: float
    request_timeout_s: float

    def copies_on(self) -> bool:
        """Whether copies go out now (the node reports directly, and has reported once)."""

    def full_copy(self, seq: int) -> NodeReport:
        """A full report of the node now, at sequence ``seq`` (no inventory digest named)."""

    async def ask_redirect(self, url: str) -> tuple[int, bytes] | None:
        """An empty report posted to the placer at ``url`` over HTTP: its answer (None: none)."""

    async def connect(self, wire_url: str, placer_url: str) -> CopyChannel:
        """A framed connection to the channel ``wire_url`` of the placer at ``placer_url``."""

    def fold_copy(self, wire_url: str, placer_url: str, rep: NodeReport) -> bool:
        """The empty heartbeat ``rep``, copied to that placer, handed to the node's relay to ride
        in its next beat copy there (agent.relaycopies.RelayCopies.fold): True when taken so
        (the copy counts as taken), False when it is to be sent as a report."""


class Copies:
    """The copies of one node's reports to every other placer it knows (see the module
    docstring): one :class:`FollowerCopy` and one task each, started by :meth:`offer` for a
    placer not seen yet."""

    def __init__(self, host: CopyHost, nursery: trio.Nursery, rng: random.Random, *,
                 empty_every_s: float = 0.0) -> None:
        self.host = host
        self.empty_every_s = empty_every_s
        self._nursery = nursery
        self._rng = rng
        self.copies: dict[str, FollowerCopy] = {}
        self._channels: dict[str, CopyChannel] = {}
        self._wake: dict[str, trio.Event] = {}
        self._progress: dict[str, trio.Event] = {}
        self.failures = 0
        self.handovers = 0    # moves to a placer whose copies were in step: no full report, no handshake

    def offer(self, rep: NodeReport, urls: list[str]) -> None:
        """A report the node built for ``host.placer_url``: queued for every other of ``urls``."""
        for url in urls:
            if url == self.host.placer_url:
                continue
            f = self.copies.get(url)
            if f is None:
                f = self.copies[url] = FollowerCopy(url, empty_every_s=self.empty_every_s)
                self._wake[url] = trio.Event()
                self._progress[url] = trio.Event()
                self._nursery.start_soon(self._run, f)
            f.empty_every_s = self.empty_every_s or EMPTY_EVERY_BEATS * self.host.heartbeat_s
            f.offer(rep)
            self._wake[url].set()

    def delivered(self, url: str, seq: int) -> None:
        """The placer at ``url`` took report ``seq`` from the node's own link."""
        f = self.copies.get(url)
        if f is not None:
            f.delivered(seq)

    async def take(self, url: str, wait_s: float) -> CopyChannel | None:
        """The copy connection to ``url`` (the node now reports there) when its copies are in
        step -- waited for up to ``wait_s``, or until a copy to it fails -- else None (a full
        report is due there)."""
        f = self.copies.get(url)
        if f is None or url not in self._channels:
            return None
        f.flush = True   # its pending empty heartbeat now: then it holds every report built
        self._wake[url].set()
        with trio.move_on_after(wait_s):
            while not f.caught_up() and url in self._channels:
                await self._progress[url].wait()
        f.flush = False
        ch = self._channels.pop(url, None)
        if ch is None or not f.caught_up():
            if ch is not None:
                self._channels[url] = ch
            return None
        self.handovers += 1
        return ch

    def give_back(self, url: str, ch: CopyChannel) -> None:
        """The node's own connection to ``url``, which answered as a follower (202): its copies'
        from now on (kept for the next move there, instead of a new handshake)."""
        f = self.copies.get(url)
        if f is None or url in self._channels:
            self._nursery.start_soon(ch.aclose)
            return
        self._channels[url] = ch
        self._wake[url].set()

    async def _run(self, f: FollowerCopy) -> None:
        url = f.url
        while True:
            # (flush: the node moves there, and waits for this last copy before it goes on there)
            on = self.host.copies_on()
            active = (url != self.host.placer_url or f.flush) and on
            item = f.next(trio.current_time()) if active else None
            if item is None:
                due = f.due() if active else None
                if not on:   # (not yet: asked again at the node's next report, which wakes us)
                    due = None
                self._wake[url] = trio.Event()
                with trio.move_on_at(due if due is not None else math.inf):
                    await self._wake[url].wait()
                continue
            ch = self._channels.get(url)
            if ch is None:
                ch = await self._connect(f)
                if ch is None:
                    await self._pause()
                    continue
            rep = self.host.full_copy(f.made_full()) if item == FULL else item
            if isinstance(item, NodeReport) and not f.flush and f.wire and is_empty(rep) and self.host.fold_copy(f.wire, url, rep):
                f.answered(rep, OBSERVED, False, trio.current_time())   # (it rides in the relay's beat copy)
                self._progressed(url)
                continue
            try:
                with trio.fail_after(self.host.request_timeout_s):
                    wr = await ch.exchange(rep)
            except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                    msgspec.DecodeError) as e:
                log.debug("copy to a follower failed placer=%s err=%r", url, e)
                f.answered(rep, None)
                await self._drop(url)
                self._progressed(url)   # (a move waiting for this copy ends now: take)
                await self._pause()
                continue
            f.answered(rep, wr.status, wr.reply.need_full, trio.current_time())
            self._progressed(url)
            if wr.status not in (OBSERVED, 200, 409):
                await self._pause()

    def _progressed(self, url: str) -> None:
        self._progress[url].set()
        self._progress[url] = trio.Event()

    async def _connect(self, f: FollowerCopy) -> CopyChannel | None:
        if f.wire is None:
            got = await self.host.ask_redirect(f.url)
            f.wire = follower_wire_of(*got) if got is not None else None
            if f.wire is None:
                return None
        try:
            with trio.fail_after(self.host.request_timeout_s):
                ch = await self.host.connect(f.wire, f.url)
        except (OSError, WireError, FrameError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError,
                tls.TLSError) as e:   # (FrameError: closed before its hello was answered)
            log.debug("copy channel to a follower not opened placer=%s err=%r", f.url, e)
            f.wire = None   # (asked again: a follower restarted may listen elsewhere)
            return None
        self._channels[f.url] = ch
        return ch

    async def _drop(self, url: str) -> None:
        ch = self._channels.pop(url, None)
        if ch is not None:
            with trio.CancelScope(shield=True):
                await ch.aclose()

    async def _pause(self) -> None:
        self.failures += 1
        await trio.sleep(self.host.heartbeat_s * self._rng.uniform(0.5, 1.0))

    async def aclose(self) -> None:
        for url in list(self._channels):
            await self._drop(url)

    def statistics(self) -> dict[str, Any]:
        return {"handovers": self.handovers, "failures": self.failures,
                "placers": [f.statistics() for f in self.copies.values()]}
