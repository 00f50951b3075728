"""The agent as its rack's relay: one framed connection up, its members' connections down.

Theory of operation
-------------------
An agent with ``[relay] enabled`` serves a *members listener* (a
:class:`~scheduler_link.heartbeat_wire.HeartbeatServer` taking frames connections only)
and keeps one frames connection to the placer's framed channel, saying in its hello which
rack it may relay for and where its members reach it. The placer decides whether it is
the rack's active relay (and tells the members, ``ReportReply.relay_url``); this side
serves whatever comes:

- ``bundle`` from the placer: the blob is kept (other relays and members ``blob_get`` it
  here); each part goes to its node, this node's own through the same acceptor a member
  uses, a member's as a ``part`` call on its connection, all at once; the outcomes that
  came back by ``min(deliver_by, now + 0.4 s)`` are the ``acks``. A member not reached is
  left out: the placer pushes it directly (placements are idempotent by id).
- ``report`` from a member: an *empty* heartbeat (not full, no events, no snapshot, no
  manifests) is answered at once and kept as the member's pending entry (the latest only);
  one ``beat`` frame per heartbeat interval carries every pending entry up. Any other
  report is queued for one forwarder task, which sends what is queued as one ``reports``
  frame (RackReports; while one is out the next ones gather: no added wait, batches under
  load) and hands each answer back -- after a beat with those members' pending entries, so
  the placer sees each node's sequence in order. What a ``beat_reply`` says of a member
  (``need_full``, fencing ``stop``) rides on the next answer to that member.
- ``enroll_key`` / ``enroll`` from a member (scheduler_link.enroll): a member with no MAC key
  registers through its relay. ``enroll_key`` is answered with the placer's certificate
  (fetched once over the connection up; the member checks it against its CA); an ``enroll``
  for the connection's own node is queued for one enrolment forwarder, which sends what is
  queued as one ``enrolls`` frame and hands each answer back (its keys sealed to the member:
  this relay learns nothing of them). No connection up: ``upstream_down`` (the member keeps
  trying this relay for a while, as with its reports); no answer: ``unavailable``, and the
  member registers directly.
- ``blob_get`` from a member: from the cache, fetched first if needed (the bundle's
  ``blob_sources`` in order, then the placer). From another relay: from the cache, or once
  the fetch in flight here ended (waiting a little for a bundle naming it that has not come
  yet) -- never a new fetch, so relays asking each other cannot wait on one another in a
  cycle.

What a relay decides -- taking a bundle after its signature check, which parts go to whom,
the ack bundle, beat aggregation, report batches, blob sources -- is
:class:`~agent.relaycore.RelayCore` (no I/O); :class:`Relay` is the trio driver that carries
it out. The hop to the members is a seam (:class:`MemberHop`): the shipped one is a ``part``
call on each member's frames connection; the fleet emulator (testing.fleet) runs this same
``Relay`` with a hop that calls its emulated members in process.

A relay can delay or drop, never forge (scheduler_link.msgauth): a bundle is acted on only
once the placer's signature over it verifies (the key came with this node's registration);
each member gets its part with the signed proof and checks it itself; a member's content
report and heartbeat carry the member's MAC, which this relay passes on untouched.

Without a connection up, members' reports are answered 503 with the reason ``upstream_down``
(and so are the reports queued when the connection went), saying (``dialling``) whether this
relay is getting through: never connected since it started, or a dial to the placer in flight
now. A member's link keeps its relay for up to ``hold_s`` of those answers (a restart: this
relay reconnects within seconds and the members' full reports go up through it, MACed with
keys that outlive the placer process, so a restart costs the placer one handshake per relay,
not one per node), and up to ``DIAL_HOLD_FACTOR`` times that on answers that say dialling
(scheduler_link.relayhold: a cold start or a large fleet's restart, where every relay waits
its turn in the placer's handshake queue and a member that went directly would only lengthen
it); then it falls back to the placer directly
(a relay that cannot reach the placer must not hold its rack for longer). The rack does not
look alive meanwhile: the placer hears nothing of it. Once it is connected again, every member
it knows is asked for a full report in the answer to its next heartbeat (:meth:`agent.beats.BeatBook.reconnected`): a restarted placer holds nothing of them,
and waiting for its answer to the relay's next beat would cost another interval.

Several placers (one leading, the others following: agent.relaycopies): a relay that loses its
connection up while it holds copy connections to followers expects one of them to lead within a
failover (one etcd lease TTL and the promotion), so for up to ``failover_hold_s`` it goes on
taking its members' reports as if connected -- empty heartbeats answered at once and sent in a
beat to every follower each interval (their models keep the members heard), content reports
queued for the next connection up -- instead of answering ``upstream_down``, which would send
every member's full report up once it is connected again.
The connection up that comes next is a follower's copy connection when it leads now: that
follower holds what the members said, and the rack goes on there with no full report. Any other
(a placer that holds nothing of them) asks every member for a full report, as after any
reconnection. No connection up by the end of the hold: what is queued is answered
``upstream_down``, and so is every report after. A follower that answers a copy (or the host's
own report over its copy connection) as the leader, at a newer epoch than the connection up
carried, is gone up to at once over that copy connection: after a leader that is gone, and
after one that stops answering without closing its connections (paused, cut off).

"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import trio

from infra.auth import TokenSet
from infra.tls import Security, TLSError
from scheduler_link.enroll import ENROLL_WAIT_S
from scheduler_link.epochs import Check, Epochs
from scheduler_link.frames import CallFailed, FrameChannel, FrameError, decode_payload, open_frames
from scheduler_link.heartbeat_wire import UPSTREAM_DOWN, HeartbeatServer, Hello, WireError, WireReply
from scheduler_link.messages import (
    BlobReply,
    BlobRequest,
    Enroll,
    EnrollAnswer,
    Frame,
    NodeOutcome,
    NodePart,
    NodeReport,
    PlacerCert,
    RackBeat,
    RackBeatReply,
    RackEnrolls,
    RackReports,
    RelayHello,
    ReportReply,
)
from scheduler_link.msgauth import BundleVerifier

from .blobs import BlobCache, BlobSource
from .relaycopies import RelayCopies
from .relaycore import Acks, Batch, EnrollBatch, Hand, KeepBlob, Refuse, RelayCore, WantBlob

log = logging.getLogger("herd.agent.relay")
T = TypeVar("T")

PartHandler = Callable[[NodePart], Awaitable[NodeOutcome]]
# () -> (this node's MAC key, the placer's signing key), None until registered
Keys = Callable[[], tuple[bytes | None, bytes | None]]
PEER_BLOB_WAIT_S = 2.0       # a relay asking for a blob whose bundle has not reached us yet waits this long
FAILOVER_HOLD_S = 10.0       # members' reports taken this long after losing the leader, while followers are held
# what a hop gives back for a part: the member's outcome (None: no answer), now or later
HopAnswer = NodeOutcome | None | Awaitable[NodeOutcome | None]


class MemberHop(Protocol):
    """How the relay reaches a node of its rack with its part (``own``: the relay's own node).
    The shipped hop (:class:`Relay`'s own, when none is given) is a ``part`` call on the
    member's frames connection; an answer may come at once or later."""

    def hand(self, part: NodePart, own: bool) -> HopAnswer: ...


def _frames_only(node_id: str, report: NodeReport) -> tuple[int, ReportReply]:
    return 400, ReportReply(ok=False, error="a relay's members listener takes frames connections only")


class Relay:
    """This agent's relay role (see the module docstring): the trio driver of a
    :class:`~agent.relaycore.RelayCore`. ``await n.start(relay.run)`` returns the members
    listener's URL (tcp://host:port)."""

    def __init__(self, *, node_id: str, rack: str, tokens: TokenSet, listen: str | None,
                 wire_url: Callable[[], str | None], own_part: PartHandler | None = None, blobs: BlobCache,
                 placer_blob: BlobSource | None = None, advertise: str | None = None, heartbeat_s: float = 5.0,
                 backoff_min_s: float = 0.05, backoff_max_s: float = 2.0, request_timeout_s: float = 10.0,
                 max_connections: int = 512, keys: Keys, on_bad_bundle: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, security: Security | None = None,
                 connect_timeout_s: float = 60.0, hop: MemberHop | None = None, local_address: str | None = None,
                 verifiers: dict[bytes, tuple[BundleVerifier, dict[bytes, bytes]]] | None = None, beat_offset_s: float = 0.0,
                 epochs: Epochs | None = None, failover_hold_s: float = FAILOVER_HOLD_S,
                 dial: Callable[[str], Awaitable[FrameChannel]] | None = None) -> None:
        """``security``: the agent's TLS set-up (None or insecure: plain TCP). With it the members
        listener takes mutual TLS only (a member's certificate names the member), the upstream
        connection must reach the placer's certificate, and blobs come from other relays over
        mutual TLS too. ``listen`` None: no members listener (``advertise`` is the URL other
        relays fetch blobs from; the fleet emulator's shared one). ``hop``: how parts reach the
        members (default: their frames connections here). ``verifiers``: the signature
        cache several relays of one host may share (RelayCore). ``beat_offset_s``: the first
        beat's delay into the interval (relays of one host spread over it). ``failover_hold_s``:
        how long members' reports are taken while no connection is up but copy connections to
        followers are (see the module docstring). ``dial``: how the connection up is opened to a
        placer's channel URL (default: a frames connection saying this relay's hello; tests give
        one over in-memory streams)."""
        self.node_id = node_id
        self.failover_hold_s = failover_hold_s
        self._dial_with = dial
        self._hold_until = 0.0   # trio time members' reports are taken until, with no connection up
        self._client_ssl = security.client if security is not None else None   # (insecure: none)
        self._keys = keys
        self._on_bad_bundle = on_bad_bundle   # e.g. the link's request_full_report: a new placer key
        self.rack = rack
        self.tokens = tokens
        self.token = tokens.cluster or ""
        self.listen = listen
        self.advertise = advertise
        self._wire_url = wire_url
        self._own_part = own_part
        self._hop = hop
        self._local_address = local_address
        self.blobs = blobs
        self._placer_blob = placer_blob
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.request_timeout_s = request_timeout_s
        # the upstream hello is waited for longer than a request: a placer in a registration
        # storm (every node and relay reconnecting) answers late, and a relay that gave up and
        # dialled again would only add to the storm (AgentLink.wire_connect_timeout_s likewise)
        self.connect_timeout_s = max(request_timeout_s, connect_timeout_s)
        self._beat_offset_s = beat_offset_s
        self._clock = clock
        self.core = RelayCore(node_id=node_id, rack=rack, heartbeat_s=heartbeat_s, verifiers=verifiers, epochs=epochs)
        self.book = self.core.book
        # a rack is small (<= 72 trays an NVL72) plus the few relays come for a blob: not the
        # descriptor-derived default, which may be 64 under a low ulimit
        self.server = HeartbeatServer(tokens, _frames_only, frames=self, max_connections=max_connections,
                                      ssl_context=security.channel if security is not None else None,
                                      require_certs=security.require_certs if security is not None else False
                                      ) if listen is not None else None
        self.listen_url = ""
        self._members: dict[str, FrameChannel] = {}
        self._up: FrameChannel | None = None
        self._up_url: str | None = None       # the placer's channel the connection up is to
        self._up_epoch = 0                    # the highest epoch its answers carried
        self._move_to: str | None = None      # a follower that leads now: the next connection up (_copy_leads)
        self._moved = trio.Event()            # set when _move_to is (the loop's wait between connections ends)
        # copies of what goes up to the placers that follow (agent.relaycopies)
        self.copies = RelayCopies(open_conn=self._open_copy, handler=self._upstream_frame,
                                  need_full=self.core.follower_needs, leader_beat=self.core.beat_answered,
                                  leader_reports=self.core.copies_answered, leads=self._copy_leads,
                                  timeout_s=request_timeout_s)
        self._tickets: Tickets[WireReply] = Tickets()
        self._sending: Batch | None = None    # the batch out now (answered 503 if the connection goes)
        self._finished: dict[int, Acks] = {}   # rounds over before their _round looked (answers, a member left)
        self._waiting: dict[int, trio.CancelScope] = {}   # rounds whose hand-outs are still out
        self._out_wake = trio.Event()
        self._batches = True          # the placer takes ``reports`` frames (else one ``report`` each)
        # enrolments (scheduler_link.enroll): the placer's certificate as it handed it over the
        # connection up (None: not fetched on this connection yet), members' tickets
        self._placer_cert: bytes | None = None
        self._cert_fetch: trio.Event | None = None
        self._enroll_tickets: Tickets[EnrollAnswer] = Tickets()
        self._enroll_sending: EnrollBatch | None = None
        self._enroll_wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.upstream_ready = trio.Event()    # set while connected up (a fresh one after each loss)
        # fault injection (tests, the fleet emulator's hung relays): bundles are read and never
        # answered, as by a relay whose host froze (the placer's relay_timeout_s and fallback act)
        self.stalled = False
        # statistics (the core's decisions: self.core's counters)
        self.connects = 0
        self._dial_in_flight = False   # a dial up (not a copy connection taken) is under way now
        self.drops = 0
        self.drop_reasons: dict[str, int] = {}   # why the connection up ended, by reason
        self.leader_moves = 0                    # moves up to a follower that answered as the leader (_copy_leads)
        self.beats = 0
        self.beat_entries = 0
        self.report_frames = 0
        self.blob_serves = 0
        self.failures = 0

    @property
    def upstream(self) -> FrameChannel | None:
        return self._up

    @property
    def dialling(self) -> bool:
        """No connection up, and either none since this relay started (its first dial is under
        way) or a dial to the placer in flight now (a restarted placer's handshake queue: the
        relay is getting through, not backing off). Its members are told so with
        ``upstream_down`` (scheduler_link.relayhold)."""
        return self._up is None and (self.connects == 0 or self._dial_in_flight)

    def statistics(self) -> dict[str, Any]:
        c = self.core
        return {"listen_url": self.listen_url, "rack": self.rack, "upstream": self._up is not None,
                "members": len(self._members) if self._hop is None else len(c.members),
                "connects": self.connects, "drops": self.drops, "leader_moves": self.leader_moves, "bundles": c.bundles,
                "parts_delivered": c.parts_delivered, "parts_missed": c.parts_missed, "beats": self.beats,
                "beat_entries": self.beat_entries, "reports_forwarded": c.reports_forwarded,
                "report_frames": self.report_frames, "late_answers": c.late_answers, "late_bundles": c.late_bundles,
                "empty_answered": c.empty_answered, "blob_serves": self.blob_serves,
                "bad_bundles": c.bad_bundles, "part_bytes_max": c.part_bytes_max, "failures": self.failures,
                "enrolls_forwarded": c.enrolls_forwarded, "enrolls_refused": dict(c.enrolls_refused),
                "pending_beats": self.book.pending, "blobs": self.blobs.statistics(),
                "copies": self.copies.statistics()}

    def blob_sources(self, blob_id: str) -> list[BlobSource]:
        """Where this relay gets a blob: the relays a bundle named, in order, then the placer
        over the upstream connection (the daemon adds the placer's HTTP route after)."""
        out: list[BlobSource] = [self._peer_source(u) for u in self.core.blob_sources(blob_id, self.listen_url)]
        out.append(self._upstream_blob)
        return out

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            self.copies.start(n)
            if self.server is not None and self.listen is not None:
                url = await n.start(self.server.run, self.listen)
                self.listen_url = _advertised(url, self.advertise)
                log.info("relay members listener url=%s rack=%s", self.listen_url, self.rack)
            else:
                self.listen_url = _advertised("", self.advertise)
            task_status.started(self.listen_url)
            await self._upstream_loop()

    async def _upstream_loop(self) -> None:
        backoff = self.backoff_min_s
        while True:
            url, self._move_to = self._move_to or self._wire_url(), None
            if self._moved.is_set():
                self._moved = trio.Event()
            if not url:
                await self._pause(backoff)
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            taken = self.copies.take(url)   # a follower that leads now: its copy connection goes up
            dial_at = time.monotonic()
            self._dial_in_flight = taken is None
            try:
                ch = taken.ch if taken is not None else await self._dial(url)
            except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError,
                    TLSError) as e:   # (a busy placer resets handshakes: tried again, never the relay's end)
                self._dial_in_flight = False
                self.failures += 1
                log.info("relay upstream connect failed url=%s after=%.1fs err=%r", url, time.monotonic() - dial_at, e)
                await self._pause(backoff * 2 * random.uniform(0.5, 1.0))  # jittered: relays do not retry in step
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            self._dial_in_flight = False
            backoff = self.backoff_min_s
            self.connects += 1
            # (a follower that held every copy holds what the members said: none asked again)
            in_step = taken is not None and taken.drops == 0 and taken.failures == 0
            asked = self.book.reconnected() if self.connects > 1 and not in_step else 0
            log.info("relay connected to the placer url=%s rack=%s members_asked_full=%d copy_taken=%s dial_s=%.1f", url,
                     self.rack, asked, taken is not None, time.monotonic() - dial_at)
            self._up = ch
            self._up_url = url
            self._up_epoch = 0
            self._hold_until = 0.0
            self.upstream_ready.set()
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._beats, ch, in_step)
                    n.start_soon(self._forwarder, ch)
                    n.start_soon(self._enroll_forwarder, ch)
                    if taken is not None:   # (its frames are served where it was opened: RelayCopies)
                        await ch.closed.wait()
                    else:
                        await ch.run(self._upstream_frame)
                    n.cancel_scope.cancel()
            finally:
                why = ch.close_reason or "ended here"
                self.drops += 1
                self.drop_reasons[why] = self.drop_reasons.get(why, 0) + 1
                if self._up is ch:
                    self._up = None
                    self.upstream_ready = trio.Event()
                self._fail_queued("the relay lost its connection to the placer")
                self._fail_enrolls()
                if self.copies.conns and self._nursery is not None:   # a follower may lead soon: held
                    self._hold_until = trio.current_time() + self.failover_hold_s
                    self._nursery.start_soon(self._hold_ends, self._hold_until)
            log.warning("relay lost its placer connection rack=%s after=%.1fs why=%s", self.rack,
                        time.monotonic() - ch.opened_at, why)
            await self._pause(backoff)

    async def _pause(self, seconds: float) -> None:
        """A wait between connections up, ended early by a follower that answered as the leader."""
        with trio.move_on_after(seconds):
            await self._moved.wait()

    async def _dial(self, url: str) -> FrameChannel:
        """A frames connection to the placer's channel ``url``, saying hello as the rack's relay."""
        if self._dial_with is not None:
            return await self._dial_with(url)
        return await open_frames(url, self.token, self.node_id, timeout_s=self.connect_timeout_s,
                                 relay=RelayHello(racks=[self.rack], listen_url=self.listen_url),
                                 local_address=self._local_address,
                                 ssl_context=self._client_ssl, expect="placer" if self._client_ssl else None)

    async def _open_copy(self, url: str) -> FrameChannel:
        with trio.fail_after(self.request_timeout_s):
            return await self._dial(url)

    async def _beats(self, ch: FrameChannel, at_once: bool = False) -> None:
        """One beat an interval; ``at_once``: the first now (a follower that leads now, over its
        copy connection: the members' entries kept through the failover go up before its
        deadlines for them run out)."""
        if self._beat_offset_s and not at_once:
            await trio.sleep(self._beat_offset_s)
        while not ch.closed.is_set():
            if not at_once:
                await trio.sleep(self.book.heartbeat_s)
            at_once = False
            b = self.core.beat(self._clock())
            if b is not None:
                await self._send_beat(ch, b)

    async def _send_beat(self, ch: FrameChannel, b: RackBeat) -> None:
        self.copies.copy("beat", b, self._up_url)
        self.beats += 1
        self.beat_entries += len(b.node_ids)
        try:
            f = await ch.call("beat", b, timeout_s=self.request_timeout_s)
            r = decode_payload(f, RackBeatReply)
            self.core.beat_answered(r)
            if ch is self._up:
                self._up_epoch = max(self._up_epoch, r.epoch)
        except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.failures += 1
            log.warning("rack beat failed rack=%s entries=%d err=%s", self.rack, len(b.node_ids), e)

    # ------------------------------------------------------------ frames from the placer

    def _upstream_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "bundle":
            return None if self.stalled else self._bundle(f.payload)
        if f.type == "part":
            return self._own(decode_payload(f, NodePart))
        if f.type == "ping":
            return ("ping", {})
        raise ValueError(f"a relay does not take {f.type} frames from the placer")

    async def _own(self, part: NodePart) -> tuple[str, NodeOutcome]:
        if self._own_part is None:
            raise ValueError("this relay takes no direct parts for its own node")
        return "ack", await self._own_part(part)

    def _bundle(self, payload: bytes) -> Any:
        """Carry out what the core decided of a bundle: an answer now when every part was
        answered at once (or none was handed), else an awaitable of it."""
        got = self.core.bundle(payload, self._keys()[1], now=trio.current_time(), wall=self._clock())
        if isinstance(got, Refuse):
            if got.new_key and self._on_bad_bundle is not None:  # (it came over our own connection to the
                self._on_bad_bundle()        # placer: maybe the placer has a new key; our own answer has it)
            return "error", {"error": got.error}
        later: list[tuple[Hand, Awaitable[NodeOutcome | None]]] = []
        for a in got.actions:
            if isinstance(a, Acks):
                return "acks", a.acks
            if isinstance(a, KeepBlob):
                self.blobs.put(a.blob_id, a.raw)
            elif isinstance(a, WantBlob):
                if self.blobs.cached(a.blob_id) is None and self._nursery is not None:
                    self._nursery.start_soon(self._prefetch, a.blob_id)  # members will ask for it soon
            elif isinstance(a, Hand):
                out = self._hand(a)
                if out is None or isinstance(out, NodeOutcome):
                    done = self.core.answered(a.round_id, a.slot, out)
                    if done is not None:
                        return "acks", done.acks
                else:
                    later.append((a, out))
        return self._round(got.round_id, got.until, later)

    def _hand(self, a: Hand) -> HopAnswer:
        if self._hop is not None:
            return self._hop.hand(a.part, a.own)
        if a.own:
            return self._hand_own(a.part)
        ch = self._members.get(a.part.node_id)
        if ch is None:
            return None
        return self._hand_member(ch, a.part)

    async def _round(self, rid: int, until: float, later: list[tuple[Hand, Awaitable[NodeOutcome | None]]]
                     ) -> tuple[str, Any]:
        with trio.move_on_at(until) as scope:
            self._waiting[rid] = scope   # cancelled when the round ends before its last answer
            try:
                async with trio.open_nursery() as n:
                    for a, aw in later:
                        n.start_soon(self._answer_later, a, aw)
            finally:
                del self._waiting[rid]
        acks = self._finished.pop(rid, None) or self.core.expire(rid)
        if acks is None:
            raise FrameError("the round ended without its acks")   # (cannot: every close is kept)
        return "acks", acks.acks

    async def _answer_later(self, a: Hand, aw: Awaitable[NodeOutcome | None]) -> None:
        acks = self.core.answered(a.round_id, a.slot, await aw)
        if acks is not None:
            self._finished[acks.round_id] = acks

    async def _hand_own(self, part: NodePart) -> NodeOutcome | None:
        if self._own_part is None:
            return None
        try:
            return await self._own_part(part)
        except Exception as e:  # not accepted durably: left out, the placer pushes it directly
            log.warning("own part not answered placement=%s err=%s", part.placement_id, e)
            return None

    async def _hand_member(self, ch: FrameChannel, part: NodePart) -> NodeOutcome | None:
        try:
            f = await ch.call("part", part)
            return decode_payload(f, NodeOutcome)
        except (FrameError, CallFailed, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("part not delivered node=%s placement=%s err=%s", part.node_id, part.placement_id, e)
            return None

    async def _prefetch(self, blob_id: str) -> None:
        try:
            await self.blobs.get(blob_id, self._all_sources(blob_id))
        except Exception as e:
            log.warning("relay could not prefetch gang blob blob=%s err=%s", blob_id[:16], e)

    def _all_sources(self, blob_id: str) -> list[BlobSource]:
        out = self.blob_sources(blob_id)
        if self._placer_blob is not None:
            out.append(self._placer_blob)
        return out

    async def _upstream_blob(self, blob_id: str) -> bytes | None:
        ch = self._up
        if ch is None:
            return None
        f = await ch.call("blob_get", BlobRequest(blob_id=blob_id), timeout_s=self.request_timeout_s)
        return _blob_data(decode_payload(f, BlobReply))

    def _peer_source(self, url: str) -> BlobSource:
        async def fetch(blob_id: str) -> bytes | None:
            return await fetch_blob_from(url, self.token, self.node_id, blob_id, racks=[self.rack],
                                         timeout_s=self.request_timeout_s, ssl_context=self._client_ssl)
        return fetch

    # ------------------------------------------------------------ members (the listener: FramesHost)

    def member_joined(self, node_id: str) -> None:
        """``node_id`` is reachable through this relay's hop (a connection opened here)."""
        self.core.member_opened(node_id)

    def member_left(self, node_id: str) -> None:
        for a in self.core.member_closed(node_id):   # rounds its leaving ended: their _round answers them
            self._finished[a.round_id] = a
            scope = self._waiting.get(a.round_id)
            if scope is not None:
                scope.cancel()

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        if hello.racks:  # another relay, come for a blob
            return self._peer_frame
        old = self._members.get(hello.node_id)
        self._members[hello.node_id] = channel
        self.member_joined(hello.node_id)
        if old is not None and old is not channel and self._nursery is not None:
            self._nursery.start_soon(old.aclose)
        return self._member_frame

    def closed(self, channel: FrameChannel) -> None:
        if self._members.get(channel.name) is channel:
            del self._members[channel.name]
            self.member_left(channel.name)

    def _member_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "report":
            return self._member_report(ch, decode_payload(f, NodeReport))
        if f.type == "blob_get":
            return self._serve_blob(decode_payload(f, BlobRequest), from_relay=False)
        if f.type == "ping":
            return ("ping", {})
        if f.type == "enroll_key":
            return self._member_enroll_key()
        if f.type == "enroll":
            return self._member_enroll(ch, decode_payload(f, Enroll))
        raise ValueError(f"a relay does not take {f.type} frames from a member")

    def _peer_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "blob_get":
            return self._serve_blob(decode_payload(f, BlobRequest), from_relay=True)
        raise ValueError(f"a relay takes only blob_get frames from another relay, not {f.type}")

    def _member_report(self, ch: FrameChannel, rep: NodeReport) -> Any:
        got = self.member_report(ch.name, rep)
        if isinstance(got, WireReply):
            return "reply", got
        return self._reply_later(got)

    async def _reply_later(self, aw: Awaitable[WireReply]) -> tuple[str, WireReply]:
        return "reply", await aw

    def member_report(self, node_id: str, rep: NodeReport) -> WireReply | Awaitable[WireReply]:
        """A member's report (``node_id``: whom its connection is of): the answer now, or an
        awaitable of it once the placer answered the batch it went up in."""
        up = self._up is not None or (self._hold_until > 0 and trio.current_time() < self._hold_until)
        got = self.core.report(node_id, rep, upstream=up, dialling=self.dialling)
        if isinstance(got, WireReply):
            return got
        self._out_wake.set()
        return self._tickets.wait(got, self.request_timeout_s * 2, lambda: WireReply(
            status=503, error="the relay could not forward the report in time"))

    async def _hold_ends(self, until: float) -> None:
        """The failover hold until ``until``: meanwhile the rack's beat goes to the followers
        each interval (their models keep the members heard: the one promoted counts them as
        reported, and its answer, a leader's, moves the relay up there: _copy_leads); no
        connection up by then, what is queued is answered ``upstream_down`` (and so is every
        report after)."""
        while self._up is None and self._hold_until == until:
            with trio.move_on_at(until):
                await trio.sleep(self.book.heartbeat_s)
                b = self.core.beat(self._clock()) if self._up is None else None
                if b is not None:
                    self.copies.copy("beat", b, None)
                    self.beats += 1
                    self.beat_entries += len(b.node_ids)
                continue
            break
        if self._up is None and self._hold_until == until:
            self._hold_until = 0.0
            self._fail_queued("no placer took over within the relay's failover hold")

    def _fail_queued(self, why: str) -> None:
        tickets = self.core.upstream_lost()
        if self._sending is not None:
            tickets = self._sending.tickets + tickets
            self._sending = None
        for t in tickets:
            self._tickets.answer(t, WireReply(status=503, reason=UPSTREAM_DOWN, error=why))

    async def _forwarder(self, ch: FrameChannel) -> None:
        """The one task that sends members' content reports up, batched (see the docstring)."""
        while True:
            batch = self.core.next_batch(self._clock())
            if batch is None:
                self._out_wake = trio.Event()
                await self._out_wake.wait()
                continue
            self._sending = batch  # answered by _fail_queued if the connection goes meanwhile
            if batch.beat is not None:
                await self._send_beat(ch, batch.beat)
            answers = await self._send_reports(ch, batch.reports)
            if ch is self._up:
                self._up_epoch = max([self._up_epoch, *(a.reply.epoch for a in answers if a.status == 200)])
            self._sending = None
            for t, wr in self.core.batch_answered(batch, answers):
                self._tickets.answer(t, wr)

    async def _send_reports(self, ch: FrameChannel, reps: list[NodeReport]) -> list[WireReply]:
        self.copies.copy("reports", RackReports(rack=self.rack, reports=reps), self._up_url)
        try:
            if self._batches and len(reps) > 1:
                self.report_frames += 1
                try:
                    f = await ch.call("reports", RackReports(rack=self.rack, reports=reps),
                                      timeout_s=self.request_timeout_s)
                    out: list[WireReply] = decode_payload(f, list[WireReply])
                    if len(out) == len(reps):
                        return out
                    raise FrameError(f"{len(out)} answers to {len(reps)} reports")
                except CallFailed:  # a placer without 'reports' frames: one frame each from now on
                    log.info("the placer takes no 'reports' frames: forwarding one report per frame")
                    self._batches = False
            out = []
            for r in reps:
                self.report_frames += 1
                out.append(decode_payload(await ch.call("report", r, timeout_s=self.request_timeout_s),
                                          WireReply))
            return out
        except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.failures += 1
            return [WireReply(status=503, error=f"the relay could not forward the report: {e}")] * len(reps)

    async def own_channel(self, wire_url: str, token: str, node_id: str) -> OwnReports:
        """This host's own report channel over the relay's connection up (an AgentLink
        ``wire_connect``): once the relay is connected (the caller's deadline bounds the wait).
        For another placer's channel than the one the relay goes up to (the host's link copies
        its reports to a follower: scheduler_link.follow), over the relay's copy connection to
        it, opened now if needed -- and from then on the rack's beats and reports are copied
        there too (agent.relaycopies)."""
        up = self._up_url or self._wire_url()   # (the link may have moved before the relay: _copy_leads)
        if wire_url and up and wire_url.rstrip("/") != up.rstrip("/"):
            return OwnReports(await self.copies.channel(wire_url), self.request_timeout_s,
                              on_leader=partial(self._copy_leads, wire_url),
                              before=partial(self.copies.flush_own, wire_url))
        while self._up is None:
            await self.upstream_ready.wait()
        return OwnReports(self._up, self.request_timeout_s)

    async def leader_wire(self, wait_s: float) -> str | None:
        """The framed channel of the placer this relay goes up to, or is about to go up to (a
        follower answered a copy as the leader: :meth:`_copy_leads`). The relay host's link asks
        here when its placer goes silent: the relay hears a promoted follower first (its answers
        to the beat copies carry its epoch). While the relay has no connection up and holds copy
        connections (a failover), waited for up to ``wait_s``; None when no placer is known."""
        def up() -> bool:   # (a connection that closed is gone, whether or not its loop has noticed yet)
            return self._up is not None and not self._up.closed.is_set()
        with trio.move_on_after(wait_s):
            while not up() and self._move_to is None and self.copies.conns:
                await _first(self._moved, self.upstream_ready)
        return self._up_url if up() else self._move_to

    def _copy_leads(self, url: str, epoch: int) -> None:
        """The placer at ``url`` answered this host's own report over the relay's copy connection
        as a leader does, at ``epoch``, newer than any the connection up carried (or the one lost
        last): the placer up there has been replaced (killed; paused, or cut off: its connection can
        stay open long after its lease ended, its answers never coming). The relay goes up to
        ``url`` over that copy connection now -- no handshake, the members not asked for full
        reports when every copy went -- instead of when the old connection ends, or after its
        back-off between connections. What it sent the old placer meanwhile is
        that placer's to refuse (a deposed leader applies nothing), and any answer of its, of an
        older epoch, is dropped here."""
        up = self._up
        if ((up is not None and self._up_url is not None and url.rstrip("/") == self._up_url.rstrip("/"))
                or epoch <= self._up_epoch or url not in self.copies.conns
                or self.core.epochs.compare(epoch) is Check.STALE or self._nursery is None):
            return
        self._move_to = url
        self._moved.set()   # (no connection up: the wait for the next one ends now)
        self.leader_moves += 1
        log.warning("relay moves up to the placer that leads now rack=%s from=%s to=%s epoch=%d", self.rack,
                    self._up_url, url, epoch)
        if up is not None:
            self._nursery.start_soon(up.aclose)

    # ------------------------------------------------------------ members' enrolments

    async def _member_enroll_key(self) -> tuple[str, PlacerCert]:
        return "placer_cert", await self.member_enroll_key()

    def _member_enroll(self, ch: FrameChannel, e: Enroll) -> Any:
        got = self.member_enroll(ch.name, e)
        if isinstance(got, EnrollAnswer):
            return "enrolled", got
        return self._enrolled_later(got)

    async def _enrolled_later(self, aw: Awaitable[EnrollAnswer]) -> tuple[str, EnrollAnswer]:
        return "enrolled", await aw

    async def member_enroll_key(self) -> PlacerCert:
        """The placer's certificate for a member's enrolment: asked for once over the
        connection up (members asking meanwhile wait for that one answer)."""
        while self._placer_cert is None:
            ch = self._up
            if ch is None:
                return PlacerCert(error="the relay has no connection to the placer", outcome="upstream_down",
                                  dialling=self.dialling)
            if self._cert_fetch is not None:
                await self._cert_fetch.wait()
                if self._placer_cert is None:
                    return PlacerCert(error="the placer did not hand its certificate", outcome="unavailable")
                break
            done = self._cert_fetch = trio.Event()
            try:
                pc = decode_payload(await ch.call("enroll_key", {}, timeout_s=self.request_timeout_s), PlacerCert)
                if not pc.cert:
                    return pc
                if self._up is ch:
                    self._placer_cert = pc.cert
                else:
                    return pc
            except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
                return PlacerCert(error=str(e), outcome="unavailable")
            finally:
                self._cert_fetch = None
                done.set()
        return PlacerCert(cert=self._placer_cert)

    def member_enroll(self, node_id: str, e: Enroll) -> EnrollAnswer | Awaitable[EnrollAnswer]:
        """A member's enrolment (``node_id``: whom its connection is of): a refusal now, or
        an awaitable of the placer's answer once the batch it went up in was answered."""
        got = self.core.enroll(node_id, e, upstream=self._up is not None)
        if isinstance(got, EnrollAnswer):
            return got
        self._enroll_wake.set()
        return self._enroll_tickets.wait(got, ENROLL_WAIT_S + self.connect_timeout_s, lambda: EnrollAnswer(
            node_id=e.node_id, outcome="unavailable", detail="the relay could not forward it in time"))

    def _fail_enrolls(self) -> None:
        self._placer_cert = None   # (fetched again on the next connection: the placer may have a new one)
        tickets = self.core.enrolls_lost()
        if self._enroll_sending is not None:
            tickets = self._enroll_sending.tickets + tickets
            self._enroll_sending = None
        for t in tickets:
            self._enroll_tickets.answer(t, EnrollAnswer(node_id="", outcome="unavailable",
                                                detail="the relay lost its connection to the placer"))

    async def _enroll_forwarder(self, ch: FrameChannel) -> None:
        """The one task that sends members' enrolments up, batched (as :meth:`_forwarder`).
        An enrolment is a registration: the placer may be working through a storm of them, so
        its answer is waited for ENROLL_WAIT_S (the placer answers batches first come first served)."""
        while True:
            batch = self.core.next_enrolls()
            if batch is None:
                self._enroll_wake = trio.Event()
                await self._enroll_wake.wait()
                continue
            self._enroll_sending = batch
            answers: list[EnrollAnswer] | None = None
            try:
                f = await ch.call("enrolls", RackEnrolls(rack=self.rack, enrolls=batch.enrolls),
                                  timeout_s=max(self.connect_timeout_s, ENROLL_WAIT_S))
                answers = decode_payload(f, list[EnrollAnswer])
            except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
                self.failures += 1
                log.warning("enrolments not forwarded rack=%s count=%d err=%s", self.rack, len(batch.enrolls), e)
            if self._enroll_sending is not batch:
                continue   # (the connection went meanwhile: its tickets were answered)
            self._enroll_sending = None
            for t, a in self.core.enrolls_answered(batch, answers):
                self._enroll_tickets.answer(t, a)

    async def member_blob(self, blob_id: str) -> BlobReply:
        """What a member's ``blob_get`` is answered: from the cache, fetched first if needed."""
        return await self._blob_reply(blob_id, from_relay=False)

    async def _serve_blob(self, req: BlobRequest, *, from_relay: bool) -> tuple[str, BlobReply]:
        return "blob", await self._blob_reply(req.blob_id, from_relay=from_relay)

    async def _blob_reply(self, blob_id: str, *, from_relay: bool) -> BlobReply:
        got: tuple[bytes, Any] | None = None
        with trio.move_on_after(self.request_timeout_s):
            if self.core.may_fetch(from_relay):
                try:
                    got = await self.blobs.get(blob_id, self._all_sources(blob_id))
                except Exception as e:
                    return BlobReply(blob_id=blob_id, error=str(e))
            else:
                got = await self.blobs.wait_cached(blob_id, PEER_BLOB_WAIT_S)
        if got is None:
            return BlobReply(blob_id=blob_id, error="not here")
        self.blob_serves += 1
        return BlobReply(blob_id=blob_id, data=got[0])


class Tickets(Generic[T]):
    """The answers a relay owes its members, by the core's ticket (a report or an enrolment
    that went up in a batch): one waiter each, answered once; one not answered within its
    bound gets ``late()``, and an answer that comes after is dropped."""

    def __init__(self) -> None:
        self._waiting: dict[int, trio.MemorySendChannel[T]] = {}

    def wait(self, ticket: int, timeout_s: float, late: Callable[[], T]) -> Awaitable[T]:
        send, recv = trio.open_memory_channel[T](1)
        self._waiting[ticket] = send
        return self._wait(ticket, recv, timeout_s, late)

    async def _wait(self, ticket: int, recv: trio.MemoryReceiveChannel[T], timeout_s: float,
                    late: Callable[[], T]) -> T:
        with trio.move_on_after(timeout_s):
            return await recv.receive()
        self._waiting.pop(ticket, None)
        return late()

    def answer(self, ticket: int, value: T) -> None:
        send = self._waiting.pop(ticket, None)
        if send is not None:
            send.send_nowait(value)


class OwnReports:
    """The relay host's own reports over its relay's connection to the placer (a
    :class:`~scheduler_link.agent_link.ReportChannel`). The placer takes a report on a relay's
    connection for the relay's own node as over the node's own connection (the certificate
    names it: keys and all), so a relay host opens one connection to the placer, not two: a
    placer restart costs one handshake per relay host, and its own full report goes up as soon
    as the relay has reconnected. The connection is the relay's: closing this closes nothing."""

    def __init__(self, ch: FrameChannel, timeout_s: float, on_leader: Callable[[int], None] | None = None,
                 before: Callable[[], None] | None = None) -> None:
        self._ch = ch
        self._timeout_s = timeout_s
        self._on_leader = on_leader   # over a copy connection: its placer answered as the leader, at this epoch
        self._before = before         # ... and what goes before each report there (RelayCopies.flush_own)

    async def exchange(self, report: NodeReport) -> WireReply:
        if self._ch.closed.is_set():
            raise WireError("the relay's connection to the placer is gone")
        if self._before is not None:
            self._before()
        try:
            f = await self._ch.call("report", report, timeout_s=self._timeout_s)
            wr: WireReply = decode_payload(f, WireReply)
        except (FrameError, CallFailed, msgspec.DecodeError, msgspec.ValidationError) as e:
            raise WireError(f"the relay's connection to the placer: {e}") from None
        if self._on_leader is not None and wr.status == 200 and wr.reply.epoch:
            self._on_leader(wr.reply.epoch)
        return wr

    async def aclose(self) -> None:
        return None


async def _first(*events: trio.Event) -> None:
    """Until any of ``events`` is set."""
    async with trio.open_nursery() as n:
        for e in events:
            n.start_soon(_set_then_cancel, e, n.cancel_scope)


async def _set_then_cancel(e: trio.Event, scope: trio.CancelScope) -> None:
    await e.wait()
    scope.cancel()


def _blob_data(r: BlobReply) -> bytes | None:
    if r.data is None:
        if r.error:
            log.debug("blob_get answered blob=%s err=%s", r.blob_id[:16], r.error)
        return None
    return r.data


async def fetch_blob_from(url: str, token: str, node_id: str, blob_id: str, *, racks: list[str] | None = None,
                          timeout_s: float = 10.0, ssl_context: ssl.SSLContext | None = None) -> bytes | None:
    """One ``blob_get`` on a fresh frames connection to ``url`` (a relay's members listener;
    with ``ssl_context``, mutual TLS to any node's certificate)."""
    ch = await open_frames(url, token, node_id, relay=RelayHello(racks=list(racks or [])), timeout_s=timeout_s,
                           ssl_context=ssl_context, expect="node" if ssl_context else None)
    try:
        async with trio.open_nursery() as n:
            n.start_soon(ch.run, _no_requests)
            try:
                f = await ch.call("blob_get", BlobRequest(blob_id=blob_id), timeout_s=timeout_s)
            finally:
                n.cancel_scope.cancel()
    finally:
        await ch.aclose()
    return _blob_data(decode_payload(f, BlobReply))


def _no_requests(ch: FrameChannel, f: Frame) -> None:
    raise ValueError(f"no {f.type} frames expected here")


def _advertised(url: str, advertise: str | None) -> str:
    if advertise:
        return advertise if advertise.startswith("tcp://") else f"tcp://{advertise}"
    return url

