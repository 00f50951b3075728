"""Rack relays, the placer's side: which node relays for each rack, and delivery through them.

Theory of operation (DESIGN.md, "Fleet scale"; issue 12):
- A node that may relay opens a *frames* connection to the placer's framed channel naming
  its rack(s) (``Hello.frames``, ``racks``, ``listen_url``). Each rack's *active* relay is
  the connected candidate that ranks first by rendezvous hash of (rack, node): a stable
  choice that moves only when that relay goes away, and then to the next in the same
  order. The placer holds connections to relays (and to the few nodes whose rack has
  none), not to every node.
- A decision's pushes (start parts and victims' stops together) are grouped by rack; a
  rack with an active relay gets one :class:`RackBundle` with its members' NodeParts and
  answers one :class:`AckBundle`. A relay that has not answered within ``relay_timeout_s``,
  whose connection broke, or that left members out: those members are pushed directly
  (HTTP, the same placement ids, so a member that was reached after all acks the same
  placement again and nothing is placed twice). Every node's first outcome is the one kept.
- A preempting gang's racks are built and sent victims first: the racks whose members get
  only stops (victims on nodes given no pod), then the gang's racks with a victim, then the
  rest, each in topology order (:func:`placer.delivery.victims_first`).
- The gang blob's bytes ride in the first ``blob_seeds`` bundles that name it only; every
  other such bundle names where to fetch it (``blob_sources``): its parent in a tree of
  fan-out 8 over their order (a relay earlier in that order, itself seeded or fetching), then
  the seeds (:func:`placer.delivery.blob_tree`). The placer serves ``blob_get`` as a last
  resort, and counts it.
- Relays also carry their members' reports up: content reports as ``report`` frames,
  empty heartbeats aggregated into one ``beat`` per interval (:meth:`Reports.beat`).
- A relay can delay or drop, never forge (scheduler_link.msgauth): every bundle is signed
  (Ed25519 over its parts' exact bytes: one signature per BUILD_BATCH bundles, over a Merkle
  root of their headers; each bundle carries its path); every outcome, report and beat
  entry a relay forwards for another node must carry that node's MAC, else it is dropped,
  counted (``bad_macs``) and the node is reached directly as if the relay had left it out.
  Members that plainly accepted come as the rack's aggregate (AckBundle.accepted, a bitmap
  over the bundle's parts, and their MACs in part order): the placer makes each one's MAC
  over its own placement with its own key and compares the whole rack's at once.

This module does the I/O: what a round decides (which racks failed, who is pushed directly,
which outcome counts, when the round is done) is :class:`placer.delivery.DeliveryRound`'s,
and :class:`_RoundDriver` only carries it out; what a beat or an outcome means is decided by
the state. The hub reaches the service only through :class:`RelayHost`.
"""

from __future__ import annotations

import collections
import functools
import gc
import hashlib
import hmac
import inspect
import itertools
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import msgspec
import numpy as np
import trio
import trio.lowlevel

from infra.pki import PKIError
from infra.tls import Security
from scheduler_link import enroll, frames, msgauth
from scheduler_link.follow import answer_beat
from scheduler_link.frames import FrameChannel, FrameError, check_entries, decode_payload
from scheduler_link.heartbeat_wire import Hello, WireReply
from scheduler_link.messages import (
    MAC_LEN,
    AckBundle,
    BlobReply,
    BlobRequest,
    Enroll,
    EnrollAnswer,
    Frame,
    NodeReport,
    PlacerCert,
    RackBeat,
    RackBeatReply,
    RackEnrolls,
    RackReports,
    ReportReply,
)

from . import membership, relaypolicy
from .attempts import ACCEPTED, Outcome
from .config import PlacerConfig
from .delivery import (
    NO_OUTCOME,
    RACK_SETTLED,
    RACK_STARTS,
    RACK_STOPS,
    RACK_VICTIMS,
    Action,
    DeliveryRound,
    Done,
    PushDirect,
    RackFailed,
    RacksSettled,
    RoundOutcomes,
    SendBundle,
    blob_tree,
    victims_first,
)
from .enrollpool import Checking, EnrollPool
from .records import GangPushes, NodeRec, Push

log = logging.getLogger("herd.placer.relays")

TREE_FANOUT = 8
DRAIN_SLICE_S = 0.02      # the deferred frames are applied in slices of this much CPU, then others run
ENROLL_SLICE_S = 0.01     # an enrolment batch is worked on in slices of this much CPU, then others run
STOPS_CAP_S = 10.0        # a round of stops only: relays' time at most, and without progress
STOPS_PATIENCE_S = 2.0
BUILD_BATCH = 32          # bundles built between checkpoints, signed and sent together
FALLBACK_HOLD_S = 1.0     # a start round's fallback pushes: reports stay held this much longer, at most


class RelayHost(Protocol):
    """What the hub needs of the placer service (PlacerService is one): all it reads of the
    state and every report it hands in go through these, never through the service's insides."""

    cfg: PlacerConfig
    signer: msgauth.BundleSigner
    clock: Callable[[], float]
    security: Security        # the placer's TLS files (its enrolment key) and the deny-list
    rack_pins: relaypolicy.RackPins   # the racks nodes are pinned to (certificates, approvals)

    @property
    def epoch(self) -> int:
        """The placer's epoch (scheduler_link.epochs), signed into every bundle's header."""

    def leading(self) -> bool:
        """Whether this placer may send what makes nodes act now: it leads and its lease is
        known to hold (always, for a placer without etcd). Asked before each bundle leaves."""

    @property
    def nodes(self) -> Mapping[str, NodeRec]:
        """The registered nodes' records, by id (read only)."""

    def gang_blob(self, blob_id: str) -> bytes | None:
        """A live gang blob's bytes."""

    def mac_key(self, node_id: str, boot_id: str) -> bytes:
        """A node's MAC key for one of its boots."""

    def count_bad_macs(self, n: int) -> None:
        """``n`` messages a relay forwarded did not verify."""

    def count_stale_epoch(self, n: int) -> None:
        """``n`` nodes answered ``stale_epoch`` (a newer placer has spoken to them)."""

    def apply_beat(self, beat: RackBeat, at: float, *, via: str, answered: float | None) -> RackBeatReply:
        """A relay's aggregated heartbeats, arrived at ``at`` (answered now, if it waited);
        the stops they call for are carried out."""

    def ingest_relayed(self, rep: NodeReport, via: str) -> tuple[int, ReportReply]:
        """One report a relay forwarded."""

    def ingest_relayed_many(self, reps: list[NodeReport], via: str) -> list[tuple[int, ReportReply]]:
        """Reports a relay sent together, in order."""

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` in the service's nursery (nothing, if the service is not running)."""


@dataclass(slots=True)
class RelayConn:
    node_id: str
    racks: tuple[str, ...]
    listen_url: str | None
    channel: FrameChannel


@dataclass(slots=True)
class RelayStats:
    bundles: int = 0
    bundle_failures: int = 0       # no answer in time, or the connection broke
    fallback_nodes: int = 0        # nodes pushed directly after their relay did not reach them
    relayed_nodes: int = 0         # nodes whose outcome came through a relay
    late_nodes: int = 0            # of those: answered after their relay's deadline (not pushed twice)
    blob_seeds: int = 0            # bundles that carried the blob's bytes
    blob_serves: int = 0           # blob_get answered by the placer
    beats: int = 0
    beat_entries: int = 0
    reports: int = 0
    bytes_out: int = 0             # bundle bytes written
    bundles_withheld: int = 0      # not sent: the placer did not lead (its lease ran out mid-round)
    last_delivery: dict[str, Any] = field(default_factory=dict)


def _rank(rack: str, node_id: str) -> bytes:
    return hashlib.blake2b(f"{rack}|{node_id}".encode(), digest_size=8).digest()


class RelayHub:
    """The placer's FramesHost: relay connections, the rack -> relay choice, delivery."""

    def __init__(self, host: RelayHost, *, enroll_workers: int = 0) -> None:
        self.host = host
        self._cands: dict[str, dict[str, RelayConn]] = {}   # rack -> node id -> connection
        self._active: dict[str, RelayConn] = {}             # rack -> chosen (cache)
        self.stats = RelayStats()
        self._delivering = 0                                 # deliveries in flight
        # (channel, frame, when it arrived by the placer's clock): what relays sent during a delivery
        self._deferred: collections.deque[tuple[FrameChannel, Frame, float]] = collections.deque()
        self._drained = 0
        self._draining = False
        self._desk: enroll.EnrollDesk | None = None   # made when the first enrolment frame comes
        self._budgets: weakref.WeakKeyDictionary[FrameChannel, enroll.EnrollBudget] = weakref.WeakKeyDictionary()
        self._enroll_turn = trio.Lock()   # enrolment batches one at a time, first come first served
        self._enroll_waiting: dict[object, float] = {}   # batches waiting or being worked on -> arrival
        self.enroll_pool = EnrollPool(enroll_workers)     # their certificate checks, ahead (placer.enrollpool)
        self.enrolled = 0

    # ------------------------------------------------------------ connections

    def opened(self, hello: Hello, channel: FrameChannel) -> Callable[[FrameChannel, Frame], Any]:
        relaypolicy.admit(hello, self.host.nodes.get(hello.node_id), channel, self.host.rack_pins)  # (raises Refused)
        conn = RelayConn(hello.node_id, tuple(hello.racks), hello.listen_url, channel)
        channel.info = conn
        for rack in conn.racks:
            self._cands.setdefault(rack, {})[conn.node_id] = conn
            self._active.pop(rack, None)
        if conn.racks:
            log.info("relay connected node=%s racks=%s listen=%s", conn.node_id, ",".join(conn.racks[:4]),
                     conn.listen_url)
        return self._handle

    def closed(self, channel: FrameChannel) -> None:
        conn: RelayConn | None = channel.info
        if conn is None:
            return
        for rack in conn.racks:
            c = self._cands.get(rack)
            if c is not None and c.get(conn.node_id) is conn:
                del c[conn.node_id]
                if not c:
                    del self._cands[rack]
            self._active.pop(rack, None)
        if conn.racks:
            log.warning("relay disconnected node=%s racks=%s after=%.1fs why=%s", conn.node_id, ",".join(conn.racks[:4]),
                        time.monotonic() - channel.opened_at, channel.close_reason or "?")

    def has_candidates(self) -> bool:
        """Whether any relay is connected (the placer then serves racks through relays)."""
        return bool(self._cands)

    def relay_for(self, rack: str) -> RelayConn | None:
        hit = self._active.get(rack)
        if hit is not None:
            n = self.host.nodes.get(hit.node_id)
            if n is not None and n.state == "up" and relaypolicy.may_relay(rack, n, self.host.rack_pins) \
                    and not hit.channel.closed.is_set():
                return hit
        best: RelayConn | None = None
        best_rank = b""
        nodes = self.host.nodes
        pins = self.host.rack_pins
        for nid, conn in self._cands.get(rack, {}).items():
            n = nodes.get(nid)
            if n is None or n.state != "up" or not relaypolicy.may_relay(rack, n, pins) or conn.channel.closed.is_set():
                continue
            r = _rank(rack, nid)
            if best is None or r > best_rank:
                best, best_rank = conn, r
        if best is not None:  # (no choice is not remembered: a candidate may register any moment)
            self._active[rack] = best
            frames.make_relay(best.channel, rack, relaypolicy.RACK_MAX_ENTRIES)
        else:
            self._active.pop(rack, None)
        return best

    def forget_choice(self, rack: str) -> None:
        self._active.pop(rack, None)

    def relay_url_for(self, node_id: str, rack: str) -> str | None:
        """Where ``node_id`` should send its reports: its rack's relay (not itself)."""
        conn = self.relay_for(rack)
        if conn is None or conn.node_id == node_id or not conn.listen_url:
            return None
        return conn.listen_url

    def provisional_url(self, rack: str, via: str) -> str | None:
        """The members listener of ``via``'s connection when it is a candidate of ``rack`` and
        the rack has no chosen relay: only while ``via``'s node has not registered yet (a
        registration elsewhere ends it, :func:`relaypolicy.may_relay`)."""
        conn = self._cands.get(rack, {}).get(via)
        if conn is None or conn.channel.closed.is_set() or not conn.listen_url:
            return None
        n = self.host.nodes.get(via)
        pins = self.host.rack_pins
        ok = pins.relays_for(via, rack) if n is None else relaypolicy.may_relay(rack, n, pins)
        return conn.listen_url if ok else None

    def statistics(self) -> dict[str, Any]:
        s = self.stats
        return {"candidates": sum(len(c) for c in self._cands.values()), "racks": len(self._cands),
                "bundles": s.bundles, "bundle_failures": s.bundle_failures, "fallback_nodes": s.fallback_nodes,
                "relayed_nodes": s.relayed_nodes, "late_nodes": s.late_nodes, "blob_seeds": s.blob_seeds, "blob_serves": s.blob_serves,
                "beats": s.beats, "beat_entries": s.beat_entries, "reports": s.reports, "bytes_out": s.bytes_out,
                "bundles_withheld": s.bundles_withheld,
                "last_delivery": s.last_delivery,
                "enroll": self._desk.statistics() if self._desk is not None else {"taken": 0, "refused": {}},
                "enroll_pool": self.enroll_pool.statistics()}

    # ------------------------------------------------------------ frames from relays

    def _handle(self, ch: FrameChannel, f: Frame) -> tuple[str, Any] | None:
        if (self._delivering or self._deferred) and f.type in ("beat", "report", "reports", "enrolls"):
            # acks first: what relays report while a delivery is out waits until it is in, in
            # arrival order (per connection too), then is applied and answered
            if frames.hold(ch, f):   # (else: over the connection's bound, and it is closed)
                self._deferred.append((ch, f, self.host.clock()))
            return None
        return self._apply(ch, f)

    def heard_until(self) -> float | None:
        """When the oldest frame still waiting here arrived (None: nothing waits). Heartbeats
        that came before then have all been applied; later ones may still be in the queue, so
        a node is judged silent only up to this instant (the lost check's clock, service._tick):
        beats the placer itself held back never make a node lost. An enrolment batch waiting
        or being worked on counts too: a placer behind on a registration storm cannot say it
        read its relays' beats in time (a 131,072-node cold start declared 6,673 nodes lost in
        waves, each under the mass-silence bound, while the emulated hosts waited for it)."""
        deferred = self._deferred[0][2] if self._deferred else None
        enrolling = next(iter(self._enroll_waiting.values())) if self._enroll_waiting else None
        if deferred is None or enrolling is None:
            return deferred if enrolling is None else enrolling
        return min(deferred, enrolling)

    async def _drain_deferred(self) -> None:
        """Apply the frames that waited for a delivery, in order, yielding now and then."""
        if self._draining:
            return
        self._draining = True
        try:
            await self._drain()
        finally:
            self._draining = False

    async def _drain(self) -> None:
        # In slices of DRAIN_SLICE_S, not of a fixed count: on a busy loop each checkpoint waits
        # for every other runnable task, and 64 frames a turn drained ~1,300 frames/s at 131,072
        # nodes under load, slower than 7,000 relays' beats arrive (the backlog never emptied,
        # and its beats came too late: the whole fleet was marked lost, measured).
        slice_end = time.perf_counter() + DRAIN_SLICE_S
        while self._deferred and not self._delivering:
            ch, f, at = self._deferred.popleft()
            frames.release(ch, f)
            if ch.closed.is_set():
                continue
            try:
                got = self._apply(ch, f, at)
                out = await got if inspect.isawaitable(got) else got   # (an enrolment batch: in slices)
            except Exception:
                log.exception("deferred frame failed type=%s", f.type)
                out = ("error", {"error": f"internal error handling a {f.type} frame"})
            if out is not None and f.id and not ch.closed.is_set():
                try:
                    ch.send(out[0], out[1], re=f.id)
                except FrameError:
                    pass
            self._drained += 1
            if time.perf_counter() >= slice_end:
                await trio.lowlevel.checkpoint()
                slice_end = time.perf_counter() + DRAIN_SLICE_S

    def _apply(self, ch: FrameChannel, f: Frame, at: float | None = None) -> Any:
        """One frame from a relay; ``at``: when it arrived, if it waited (a beat counts then)."""
        t = f.type
        ch.term = self.host.epoch   # (the answer's Frame.term: this placer's epoch now)
        conn: RelayConn | None = ch.info
        via = conn.node_id if conn is not None else ch.name
        if t == "beat":
            b = decode_payload(f, RackBeat)
            check_entries(len(b.node_ids), frames.entry_limit(ch))
            self.stats.beats += 1
            self.stats.beat_entries += len(b.node_ids)
            now = self.host.clock()
            # (a relay's copy wants no answer: a follower answers it only when it has something to say)
            return answer_beat(ch, f, self.host.apply_beat(b, now if at is None else at, via=via,
                                                            answered=None if at is None else now))
        if t == "report":
            try:
                rep = decode_payload(f, NodeReport)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return "reply", WireReply(status=400, error=f"malformed report: {e}")
            self.stats.reports += 1
            status, reply = self.host.ingest_relayed(rep, via)
            return "reply", WireReply(status=status, reply=reply, error=reply.error if status != 200 else None)
        if t == "reports":
            try:
                batch = decode_payload(f, RackReports)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return "error", {"error": f"malformed reports: {e}"}
            check_entries(len(batch.reports), frames.entry_limit(ch), what="reports batch")
            self.stats.reports += len(batch.reports)
            return "replies", [WireReply(status=st, reply=r, error=r.error if st != 200 else None)
                               for st, r in self.host.ingest_relayed_many(batch.reports, via)]
        if t == "blob_get":
            req = decode_payload(f, BlobRequest)
            raw = self.host.gang_blob(req.blob_id)
            if raw is None:
                return "blob", BlobReply(blob_id=req.blob_id, error="no such gang blob")
            if (refused := membership.frames_refusal(self.host, conn, req.blob_id)) is not None:
                return "blob", refused
            self.stats.blob_serves += 1
            return "blob", BlobReply(blob_id=req.blob_id, data=raw)
        if t == "ping":
            return "ping", None
        if t in ("enroll_key", "enrolls"):
            return self._enroll_frame(ch, f, via)
        return "error", {"error": f"unexpected frame type {t!r} from a relay"}

    # ------------------------------------------------------------ enrolment (scheduler_link.enroll)

    def enroll_desk(self) -> enroll.EnrollDesk | None:
        """The placer's enrolment desk, from its TLS files (None: insecure, no identities)."""
        if self._desk is None:
            files = self.host.security.files
            if self.host.security.insecure or files is None:
                return None
            try:
                self._desk = enroll.desk_from_files(files)
            except PKIError as e:
                log.warning("enrolment through relays unavailable: %s", e)
                return None
        return self._desk

    def _enroll_frame(self, ch: FrameChannel, f: Frame, via: str) -> Any:
        desk = self.enroll_desk()
        if f.type == "enroll_key":
            if desk is None:
                return "placer_cert", PlacerCert(error="this placer runs without TLS", outcome="no_tls")
            self.enroll_pool.warm(desk)   # (its members' enrolments follow)
            return "placer_cert", PlacerCert(cert=desk.cert)
        try:
            batch = decode_payload(f, RackEnrolls)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return "error", {"error": f"malformed enrolments: {e}"}
        check_entries(len(batch.enrolls), frames.entry_limit(ch), what="enrolment batch")
        now = time.monotonic()
        budget = self._budgets.get(ch)
        if budget is None:
            budget = self._budgets[ch] = enroll.EnrollBudget(now=now)
        n = budget.take(len(batch.enrolls), now)
        if n < len(batch.enrolls) and desk is not None:
            log.warning("enrolments over the connection's budget relay=%s count=%d", via, len(batch.enrolls) - n)
            for _ in range(len(batch.enrolls) - n):
                desk.refuse("busy")
        checking = self.enroll_pool.submit(desk, desk.unchecked(batch.enrolls[:n])) if desk is not None else None
        return self._enroll_batch(batch.enrolls, n, via, checking)

    def close(self) -> None:
        """The enrolment worker processes stopped (the service's end)."""
        self.enroll_pool.close()

    async def _enroll_batch(self, enrolls: list[Enroll], n: int, via: str,
                            checking: Checking | None = None) -> tuple[str, Any]:
        """A batch of enrolments (~0.9 ms each: a CA check, an ECDH, the report), worked on in
        slices of ENROLL_SLICE_S with the event loop let go between them: a relay's batch of 256
        held the loop ~230 ms, and in a 131,072-node storm (the placer 97 % busy, 78 % of it
        here) relays' beats waited behind batches until 8,612 nodes were marked lost in 90 s.
        One batch at a time, in arrival order (trio's Lock is fair): worked on all at once, every
        batch of a storm was answered at its end, each relay's later than it waited (scheduling
        by turns gives every job the longest latency), and their members registered directly.
        ``checking``: its new certificates, handed to a worker process when it came
        (placer.enrollpool); by its turn they are checked and the desk works from its cache."""
        token = object()
        self._enroll_waiting[token] = self.host.clock()   # (arrival order: the oldest first)
        try:
            async with self._enroll_turn:
                if checking is not None:   # (its certificates went to a worker when it came)
                    await checking.wait()
                    got = checking.result()
                    desk = self.enroll_desk()
                    if got is not None and desk is not None:
                        desk.learn(checking.ders, got)
                return await self._enroll_batch_now(enrolls, n, via)
        finally:
            del self._enroll_waiting[token]

    async def _enroll_batch_now(self, enrolls: list[Enroll], n: int, via: str) -> tuple[str, Any]:
        out: list[EnrollAnswer] = []
        slice_end = time.perf_counter() + ENROLL_SLICE_S
        for k, e in enumerate(enrolls):
            out.append(self.enroll_one(e, via) if k < n else
                       EnrollAnswer(node_id=e.node_id[:256], outcome="busy",
                                    detail="over this connection's enrolment budget: register directly"))
            if time.perf_counter() >= slice_end:
                await trio.lowlevel.checkpoint()
                slice_end = time.perf_counter() + ENROLL_SLICE_S
        return "enrolls_reply", out

    def enroll_one(self, e: Enroll, via: str) -> EnrollAnswer:
        """One member's enrolment a relay forwarded: checked (scheduler_link.enroll.EnrollDesk),
        then its full report registered as if over the member's own connection (the
        certificate's key proved who sent it, as a handshake would have), and the answer's keys
        sealed to the member. A refusal is a structured outcome, counted, with nothing ingested."""
        desk = self.enroll_desk()
        if desk is None:
            return EnrollAnswer(node_id=e.node_id[:256], outcome="no_tls", detail="this placer runs without TLS")
        node = self.host.nodes.get(e.node_id)
        revoked = self.host.security.revoked
        try:
            # (wall-clock time, whatever the placer's clock: certificates' validity and the
            # members' own times are unix times)
            c = desk.check(e, now=time.time(), denied=(revoked.nodes, revoked.serials),
                           known=(node.boot_id, node.last_seq) if node is not None else None)
        except enroll.EnrollRefused as r:
            log.info("enrolment refused node=%s relay=%s outcome=%s: %s", e.node_id[:200], via, r.outcome, r.detail)
            return EnrollAnswer(node_id=e.node_id[:256], outcome=r.outcome, detail=r.detail[:300])
        self.host.rack_pins.certificate(c.node_id, c.rack)   # (its certificate's rack pins its registration)
        status, reply = self.host.ingest_relayed(c.report, c.node_id)   # (via itself: its own connection's rules)
        if status != 200 or reply.mac_key is None:
            desk.refuse("refused")
            return EnrollAnswer(node_id=c.node_id, outcome="refused", detail=reply.error or f"status {status}",
                                reply=msgspec.structs.replace(reply, mac_key=None, placer_key=None))
        self.enrolled += 1
        key = reply.mac_key
        if reply.stop:   # (fencing stops pass the relay: with the placer's MAC in the member's key)
            reply = msgspec.structs.replace(reply, stop=msgauth.with_stop_macs(key, c.node_id, c.boot_id, reply.stop))
        if reply.epoch:  # (and the placer's epoch, which the member takes only under that MAC)
            reply = msgspec.structs.replace(reply, epoch_mac=msgauth.epoch_mac(key, c.node_id, c.boot_id, reply.epoch))
        return desk.answer(c, reply, key, reply.placer_key or self.host.signer.public)

    # ------------------------------------------------------------ delivery

    def split(self, pushes: Sequence[Push]) -> tuple[list[int], list[tuple[str, RelayConn, list[int]]]]:
        """(the pushes' indices pushed directly, by rack in order of first appearance: its
        path, its relay and its pushes' indices). A decision's :class:`GangPushes` in topology
        order are split by their rack runs (a look a rack, not a node); its other pushes (stops
        on nodes given no pod) join their rack's list, or start one."""
        direct: list[int] = []
        racks: list[tuple[str, RelayConn, list[int]]] = []
        where: dict[str, list[int] | None] = {}   # rack -> its members' list (None: no relay)
        nodes = self.host.nodes
        ids = pushes.node_ids if isinstance(pushes, GangPushes) else [p.node_id for p in pushes]
        first = 0
        if isinstance(pushes, GangPushes) and pushes.runs is not None:
            paths, starts = pushes.runs
            bounds = [*starts, pushes.n_cols]
            for r, rack in enumerate(paths):
                members = list(range(bounds[r], bounds[r + 1]))
                conn = self.relay_for(rack)   # (each rack once: the runs are in topology order)
                if conn is None:
                    where[rack] = None
                    direct += members
                else:
                    where[rack] = members
                    racks.append((rack, conn, members))
            first = pushes.n_cols
        last_rack, last_hit = None, None   # a gang's pushes come in topology order: racks in runs
        for i in range(first, len(ids)):
            rec = nodes.get(ids[i])
            if rec is None:
                direct.append(i)
                continue
            rack = rec.rack_path
            if rack == last_rack and last_hit is not None:
                last_hit.append(i)
                continue
            if rack in where:
                hit = where[rack]
            else:
                conn = self.relay_for(rack)
                hit = where[rack] = None if conn is None else []
                if conn is not None and hit is not None:
                    racks.append((rack, conn, hit))
            if hit is None:
                direct.append(i)
                continue
            hit.append(i)
            last_rack, last_hit = rack, hit
        return direct, racks

    async def deliver(self, job_id: str, blob_id: str | None, pushes: Sequence[Push],
                      push_direct: Callable[[Push], Awaitable[Outcome]],
                      ready: Callable[[], Awaitable[bool]] | None = None) -> RoundOutcomes | None:
        """Carry out a decision's pushes through the relays (directly where a rack has none or
        its relay fails). Returns the start pushes' outcomes by node.

        The round's bundles are built (and encoded) in batches of ``BUILD_BATCH``, each sent as
        soon as it is built; with ``ready`` (the journal's sync), nothing leaves until it says
        yes (awaited once the first batch is built, so that build overlaps the fsync). None
        when it says no. What the round decides is :class:`placer.delivery.DeliveryRound`'s;
        :class:`_RoundDriver` carries it out."""
        return await _RoundDriver(self, job_id, blob_id, pushes, push_direct, ready).run()

    def _defer_reports(self) -> None:
        self._delivering += 1

    def _release_reports(self) -> None:
        self._delivering -= 1
        if not self._delivering and self._deferred:
            self.host.spawn(self._drain_deferred)


class RoundIds(Protocol):
    """A round's nodes in the round's order: their ids, and their placements' ids by rack."""

    ids: list[str]

    def pids(self, lo: int, hi: int) -> list[str]:
        """The placement ids of the round's nodes ``lo`` .. ``hi - 1``."""


def check_acks(ab: AckBundle, core: DeliveryRound, r: int, pushes: RoundIds, relay_id: str,
               nodes: Mapping[str, NodeRec], mac_key: Callable[[str, str], bytes]
               ) -> tuple[list[int], list[Outcome] | None, list[int]]:
    """A relay's AckBundle for rack ``r`` of ``core``'s round (``pushes``: its nodes in the round's order):
    (the members still waiting whose outcome answers their placement and verifies, their
    outcomes (None: all accepted), the members whose MAC did not verify). A member's outcome
    needs that member's MAC (the relay's own does not: it is the connection's owner); a member
    left out, or whose MAC fails, is left to the direct push. Outcomes in the parts' order
    are matched by position, others through a map of the rack's members. One pass: the MAC
    check is the only work a member costs that its identity does not need."""
    lo, hi = core.rack_slice(r)
    waiting = core.code[lo:hi].tolist()     # (one conversion, not a numpy read per member)
    size = hi - lo
    ok = msgauth.outcome_ok
    idx: list[int] = []
    odd: list[tuple[int, Outcome]] = []     # (position in idx, outcome) of those not plainly accepted
    bad: list[int] = []
    where: dict[str, int] | None = None
    ids = pushes.ids
    pids: list[str] | None = None
    for k, o in enumerate(ab.outcomes):
        nid = o.node_id
        if k >= size or ids[lo + k] != nid:
            if where is None:
                where = {n: j for j, n in enumerate(ids[lo:hi])}
            k = where.get(nid, -1)
            if k < 0:
                continue
        if waiting[k] != NO_OUTCOME:
            continue
        waiting[k] = 0                      # (a repeat: its first is the one checked)
        i = lo + k
        if nid != relay_id:
            node = nodes.get(nid)
            if node is None or not ok(node.mac or mac_key(nid, node.boot_id), o):
                bad.append(i)
                continue
        if pids is None:
            pids = pushes.pids(lo, hi)
        if o.placement_id != pids[k]:
            continue
        if o.outcome != "accepted" or o.refused_gpus or o.detail is not None:
            odd.append((len(idx), Outcome(o.outcome, tuple(o.refused_gpus), o.detail)))
        idx.append(i)
    if ab.accepted:
        _check_aggregate(ab, lo, size, waiting, pushes, relay_id, nodes, mac_key, idx, bad)
    if not odd:
        return idx, None, bad
    outs = [ACCEPTED] * len(idx)
    for j, out in odd:
        outs[j] = out
    return idx, outs, bad


def _check_aggregate(ab: AckBundle, lo: int, size: int, waiting: list[int], pushes: RoundIds, relay_id: str,
                     nodes: Mapping[str, NodeRec], mac_key: Callable[[str, str], bytes],
                     idx: list[int], bad: list[int]) -> None:
    """The rack's aggregate of plain acceptances (AckBundle.accepted, .macs): each member it
    names and that still waits is added to ``idx`` when its MAC is the one its own key makes
    over its own placement (checked for the whole rack in one comparison; member by member
    only when that fails), else to ``bad``. The relay's own needs none (its connection's
    owner). A malformed aggregate (bits past the parts, MACs that do not match the bits in
    number) names nobody: its members are pushed directly."""
    if (ab.accepted == _all_bits(size) and len(ab.macs) == size * MAC_LEN and waiting.count(NO_OUTCOME) == size
            and _whole_rack(ab, pushes.ids[lo:lo + size], pushes.pids(lo, lo + size), nodes, mac_key)):
        for k in range(size):
            waiting[k] = 0
        idx += range(lo, lo + size)
        return
    named = np.flatnonzero(np.unpackbits(np.frombuffer(ab.accepted, dtype=np.uint8), bitorder="little"))
    if len(ab.macs) != len(named) * MAC_LEN or (len(named) and int(named[-1]) >= size):
        log.warning("relay answered a malformed ack aggregate rack=%s relay=%s bits=%d macs=%d parts=%d", ab.rack,
                    relay_id, len(named), len(ab.macs), size)
        return
    keys: list[bytes] = []
    nids: list[str] = []
    pids: list[str] = []
    at: list[int] = []        # their MACs' positions in ab.macs
    members: list[int] = []   # and their indices in the round
    ids, rack_pids = pushes.ids, pushes.pids(lo, lo + size)
    for j, k in enumerate(named.tolist()):
        if waiting[k] != NO_OUTCOME:
            continue
        waiting[k] = 0
        i = lo + k
        nid = ids[i]
        if nid == relay_id:
            idx.append(i)
            continue
        node = nodes.get(nid)
        if node is None:
            bad.append(i)
            continue
        keys.append(node.mac or mac_key(nid, node.boot_id))
        nids.append(nid)
        pids.append(rack_pids[k])
        at.append(j)
        members.append(i)
    if not members:
        return
    macs = ab.macs
    got = macs if len(at) == len(named) else b"".join([macs[j * MAC_LEN:(j + 1) * MAC_LEN] for j in at])
    want = msgauth.accepted_macs(keys, nids, pids)
    if hmac.compare_digest(want, got):
        idx += members
        return
    for n, i in enumerate(members):
        lo_, hi_ = n * MAC_LEN, (n + 1) * MAC_LEN
        (idx if hmac.compare_digest(want[lo_:hi_], got[lo_:hi_]) else bad).append(i)


@functools.lru_cache(maxsize=256)
def _all_bits(size: int) -> bytes:
    """The aggregate's bitmap naming every one of ``size`` parts."""
    return ((1 << size) - 1).to_bytes((size + 7) // 8, "little")


def _whole_rack(ab: AckBundle, nids: list[str], pids: list[str], nodes: Mapping[str, NodeRec],
                mac_key: Callable[[str, str], bytes]) -> bool:
    """The common answer: every member of the rack plainly accepted and each MAC is its own
    (the relay's own made by its own key too): one comparison over the whole rack's MACs, made
    in list passes. False: the member-by-member check decides."""
    try:   # (no per-member test for a missing record: ``None in recs`` cost a Python __eq__ each)
        recs = list(map(nodes.__getitem__, nids))
    except KeyError:
        return False
    keys = [n.mac or mac_key(n.node_id, n.boot_id) for n in recs]
    return hmac.compare_digest(msgauth.accepted_macs(keys, nids, pids), ab.macs)


def _rack_kind(src: GangPushes, members: list[int]) -> int:
    """What rack's ``members`` (indices into ``src``) get: stops only, a victim's stop among
    the gang's pods, or the gang's pods only (placer.delivery.victims_first)."""
    n = src.n_cols
    if members[0] >= n:
        return RACK_STOPS
    vs = src.victims   # (members past n are stops joined to the rack: they come last)
    if members[-1] >= n or (vs is not None and any(map(vs.__getitem__, members))):
        return RACK_VICTIMS
    return RACK_STARTS


class _RoundDriver:
    """One round's trio side: builds, signs and sends the bundles, carries out what the round's
    :class:`DeliveryRound` returns, and times the round. No task waits per rack: each bundle's
    answer comes to a callback in its relay connection's reader (FrameChannel.call_cb), and
    one task watches the deadline (a nursery and two tasks per rack cost ~0.1 ms of placer CPU
    each, ~0.3 s of a 2,778-rack round's, measured)."""

    def __init__(self, hub: RelayHub, job_id: str, blob_id: str | None, pushes: Sequence[Push],
                 push_direct: Callable[[Push], Awaitable[Outcome]], ready: Callable[[], Awaitable[bool]] | None) -> None:
        self.hub = hub
        host = hub.host
        self.cfg = cfg = host.cfg
        self.job_id = job_id
        self.blob_id = blob_id
        self.push_direct = push_direct
        self.ready = ready
        src = self.src = GangPushes.of(pushes)
        direct, racks = hub.split(src)
        if len(racks) > 1 and (src.extra or src.victims is not None):   # (the victims' racks first)
            racks = [racks[r] for r in victims_first([_rack_kind(src, ms) for _, _, ms in racks])]
        # the round's nodes in rack order (each rack's bundle a slice), then those pushed directly
        # (a gang's pushes mostly come so already: then they are taken as they are); ``order``:
        # the round's position -> the push's index, if they differ
        nxt = 0
        for _, _, ms in racks:
            if ms[0] != nxt or ms[-1] != nxt + len(ms) - 1:
                break
            nxt += len(ms)
        else:
            if direct == list(range(nxt, len(src))):
                nxt = -1
        self.order: list[int] | None = (None if nxt == -1 else
                                        list(itertools.chain.from_iterable(ms for _, _, ms in racks)) + direct)
        self.ids = src.node_ids if self.order is None else list(map(src.node_ids.__getitem__, self.order))
        self.racks = [(path, conn) for path, conn, _ in racks]
        self.raw = host.gang_blob(blob_id) if blob_id else None
        self.expires = host.clock() + cfg.placement_ttl_s
        self.epoch = host.epoch   # the round's bundles are all of the epoch it was decided in
        self.urls = [conn.listen_url for _, conn in self.racks]
        bounds = np.zeros(len(racks) + 1, dtype=np.int64)
        np.cumsum([len(ms) for _, _, ms in racks], out=bounds[1:])
        # A relay has failed when it has not answered relay_timeout_s after the round last made
        # progress, and never later than 4x relay_timeout_s after the last bundle left; a round
        # of stops only is not waited on by anyone: slow relays get longer before their racks are
        # pushed one by one (a storm of direct stops helps nobody).
        patience = cfg.relay_timeout_s if job_id else max(cfg.relay_timeout_s, STOPS_PATIENCE_S)
        cap = 4 * cfg.relay_timeout_s if job_id else max(4 * cfg.relay_timeout_s, STOPS_CAP_S)
        counted = src.counted()
        if self.order is not None:
            counted = counted[np.array(self.order, dtype=np.int64)]
        # racks with a start push among their members (their bundle names the gang's blob)
        self.rack_starts: list[bool] = ((np.add.reduceat(counted[:bounds[-1]], bounds[:-1]) > 0).tolist()
                                        if len(racks) else [])
        self.carry, self.parent = blob_tree(self.rack_starts, max(1, cfg.blob_seeds), TREE_FANOUT)
        self.seed_urls = [u for r, u in enumerate(self.urls) if self.carry[r] and u]
        self.core = DeliveryRound(len(src), bounds, patience_s=patience, cap_s=cap, counted=counted,
                                  durable=ready is None)
        self.rids: dict[int, int] = {}            # rack -> its bundle's request id (while sent)
        self.frames: dict[int, bytes] = {}        # rack -> its bundle's frame, built, not yet sent
        self.withheld: set[int] = set()           # racks whose bundle was not sent: the placer did not lead
        # members of racks whose relay did not deliver, waiting for a direct push: taken by at
        # most push_concurrency workers, each asking the core before it pushes (a late answer
        # may have come), so a round whose every relay ran late makes no task a member
        self.fallback_queue: collections.deque[int] = collections.deque()
        self.fallback_workers = 0
        self.fallback_max = max(1, cfg.push_concurrency)
        self.nursery: trio.Nursery | None = None
        self.changed = trio.Event()               # the racks settled or the round is done
        self.done = trio.Event()
        self.deferring = False
        self.t0 = trio.current_time()
        self.fb_first = math.inf
        self.fb_last = 0.0
        self.fb_max = 0.0
        self.cpu_acked: float | None = None

    # ------------------------------------------------------------ actions

    def apply(self, actions: list[Action]) -> None:
        hub = self.hub
        for a in actions:
            if isinstance(a, SendBundle):
                self._send(a.rack)
            elif isinstance(a, PushDirect):
                assert self.nursery is not None
                if a.fallback:
                    self.fallback_queue.extend(a.nodes.tolist())
                    while self.fallback_workers < min(self.fallback_max, len(self.fallback_queue)):
                        self.fallback_workers += 1
                        self.nursery.start_soon(self._fall_back)
                else:
                    for i in a.nodes.tolist():
                        self.nursery.start_soon(self._push, i)
            elif isinstance(a, RackFailed):
                if a.rack in self.withheld:   # (the relay did not fail: kept, and its members' direct
                    continue                  # pushes are refused by push_direct as well)
                hub.stats.bundle_failures += 1
                path, conn = self.racks[a.rack]
                hub.forget_choice(path)
                lo, hi = self.core.rack_slice(a.rack)
                log.warning("relay did not deliver rack=%s relay=%s parts=%d err=%s; pushing directly",
                            path, conn.node_id, hi - lo, a.why)
            elif isinstance(a, RacksSettled):
                if not a.timed_out:
                    self._stop_deferring()
                self.changed.set()
            elif isinstance(a, Done):
                self.cpu_acked = time.process_time()
                self.done.set()
                self.changed.set()

    def _send(self, r: int) -> None:
        conn = self.racks[r][1]
        data = self.frames.pop(r)
        stats = self.hub.stats
        if not self.hub.host.leading():
            # The round took its epoch when it began; the lease is not known to hold now (a
            # round outlived it, a placer paused mid-round): nothing more leaves. The rack ends
            # as if its relay were unreachable, and its members' direct pushes are not sent either.
            stats.bundles_withheld += 1
            self.withheld.add(r)
            if len(self.withheld) == 1:
                log.warning("this placer does not lead now: the round's remaining bundles are not sent job=%s",
                            self.job_id or "(stops)")
            self.apply(self.core.closed(r, "NotLeading"))
            return
        stats.bundles += 1
        stats.bytes_out += len(data)
        try:
            conn.channel.call_cb(self.rids[r], data, partial(self._answered, r))
        except FrameError:
            self.apply(self.core.closed(r, "FrameError"))

    def _answered(self, r: int, f: Frame | None) -> None:
        """The relay's answer (None: its connection closed first), in its reader task."""
        core = self.core
        if f is None or f.type == "error":
            self.apply(core.closed(r, "FrameError" if f is None else "CallFailed"))
            return
        late = core.phase[r] == RACK_SETTLED
        path, conn = self.racks[r]
        try:
            ab = decode_payload(f, AckBundle)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            if not late:
                log.warning("relay answered a malformed ack bundle rack=%s relay=%s err=%s", path, conn.node_id, e)
                self.apply(core.acked(r, trio.current_time(), ()))
            return
        host = self.hub.host
        idx, outs, bad = check_acks(ab, core, r, self, conn.node_id, host.nodes, host.mac_key)
        if outs is not None and (stale := sum(o.outcome == "stale_epoch" for o in outs)):
            host.count_stale_epoch(stale)
        if bad:
            self.hub.host.count_bad_macs(len(bad))
            log.warning("relay's ack refused: MAC does not verify nodes=%d first=%s relay=%s rack=%s", len(bad),
                        self.ids[bad[0]], conn.node_id, path)
        relayed0, late0 = core.relayed_nodes, core.late_nodes
        self.apply(core.acked(r, trio.current_time(), idx, outs, bad))
        self.hub.stats.relayed_nodes += core.relayed_nodes - relayed0
        self.hub.stats.late_nodes += core.late_nodes - late0

    def _at(self, lo: int, hi: int) -> Sequence[int]:
        """The indices of the round's nodes ``lo`` .. ``hi - 1`` among its pushes (a range
        where they are consecutive pushes: a rack of the gang with no stop of its own joined)."""
        if self.order is None:
            return range(lo, hi)
        seg = self.order[lo:hi]
        if seg and seg[-1] - seg[0] == len(seg) - 1 and seg == list(range(seg[0], seg[-1] + 1)):
            return range(seg[0], seg[-1] + 1)
        return seg

    def pids(self, lo: int, hi: int) -> list[str]:
        """(RoundIds) the placement ids of the round's nodes ``lo`` .. ``hi - 1``."""
        return self.src.placement_ids(self._at(lo, hi))

    async def _push(self, i: int) -> None:
        """Node ``i`` (no relay for its rack) pushed directly."""
        core = self.core
        core.direct_starting(i)
        self.apply(core.direct_answered(i, await self.push_direct(self.src[i if self.order is None else self.order[i]])))

    async def _fall_back(self) -> None:
        """One worker of the fallback: pushes the queued members directly, one at a time, each
        only if no outcome came for it meanwhile (a relay's late answer)."""
        core, queue = self.core, self.fallback_queue
        try:
            while queue:
                i = queue.popleft()
                if not core.direct_starting(i):
                    continue  # the relay's late answer came first
                self.hub.stats.fallback_nodes += 1
                f0 = trio.current_time()
                self.fb_first = min(self.fb_first, f0 - self.t0)
                o = await self.push_direct(self.src[i if self.order is None else self.order[i]])
                f1 = trio.current_time()
                self.fb_last = max(self.fb_last, f1 - self.t0)
                self.fb_max = max(self.fb_max, f1 - f0)
                self.apply(core.direct_answered(i, o))
        finally:
            self.fallback_workers -= 1

    def _stop_deferring(self) -> None:
        """What relays report waits while a start round's acks are awaited (acks first), and
        no longer."""
        if self.deferring:
            self.deferring = False
            self.hub._release_reports()

    # ------------------------------------------------------------ building

    def _spec(self, r: int, deliver_by: float) -> msgauth.BundleSpec:
        """One rack's bundle, but for its signature (signed with its batch's)."""
        path, conn = self.racks[r]
        raw = self.raw
        carry = raw is not None and self.carry[r]
        sources: list[str] = []
        if raw is not None and not carry:
            parent = self.urls[self.parent[r]] if self.parent[r] >= 0 else None
            sources = [u for u in [parent, *self.seed_urls] if u and u != conn.listen_url]
        lo, hi = self.core.rack_slice(r)
        at = self._at(lo, hi)
        src = self.src
        starts = self.rack_starts[r]
        if carry and starts:
            self.hub.stats.blob_seeds += 1
        return msgauth.BundleSpec(path, (self.blob_id or "") if starts else "", src.parts_bytes(at, self.expires),
                                  deliver_by, raw if carry and starts else None, sources if starts else [],
                                  self.epoch)

    def _build(self, lo: int, hi: int) -> list[Action]:
        """Racks lo..hi-1's bundles, under one signature (a Merkle root over their headers)."""
        deliver_by = self.hub.host.clock() + self.cfg.relay_timeout_s * 0.8
        rbs = self.hub.host.signer.bundles_raw([self._spec(r, deliver_by) for r in range(lo, hi)])
        out: list[Action] = []
        for r, rb in zip(range(lo, hi), rbs, strict=True):
            ch = self.racks[r][1].channel
            ch.term = self.epoch
            self.rids[r], self.frames[r] = ch.prepare("bundle", rb)
            out += self.core.built(r)
        return out

    # ------------------------------------------------------------ the round

    async def run(self) -> RoundOutcomes | None:
        hub, core = self.hub, self.core
        bytes0, fallbacks0 = hub.stats.bytes_out, hub.stats.fallback_nodes
        if self.job_id:
            hub._defer_reports()
            self.deferring = True
        # The bundles are tens of thousands of young objects: a full collection while they are
        # built would walk the whole fleet's records for nothing (as during a pass).
        gc_was = gc.isenabled()
        gc.disable()
        built_at = sent_at = 0.0
        try:
            async with trio.open_nursery() as n:
                self.nursery = n
                # Bundles leave in batches as they are built (the first batch once ``ready``
                # says yes), so the relays work while the rest of the round is encoded: a
                # 2,778-rack round takes ~0.5 s to build here, and relays are other hosts.
                for b0 in range(0, len(self.racks), BUILD_BATCH):
                    self.apply(self._build(b0, min(b0 + BUILD_BATCH, len(self.racks))))
                    if not await self._journal():
                        return None
                    await trio.lowlevel.checkpoint()  # the batch goes out; acks and reports flow meanwhile
                built_at = trio.current_time() - self.t0
                if gc_was:
                    gc.enable()
                if not await self._journal():
                    return None
                await trio.lowlevel.checkpoint()
                sent_at = trio.current_time() - self.t0
                self.apply(core.all_built(trio.current_time()))
                await self._watch()
                await self.done.wait()
                n.cancel_scope.cancel()   # (pushes a late answer made needless)
        finally:
            for r, rid in self.rids.items():   # answers that come now are no one's
                self.racks[r][1].channel.forget(rid)
            if gc_was:
                gc.enable()
            self._stop_deferring()
        if self.job_id:  # (a round of stops only is not a delivery to report)
            self._report(bytes0, fallbacks0, built_at, sent_at)
        return RoundOutcomes(self.ids, core)

    async def _journal(self) -> bool:
        """Once: whether the journal's sync says the job is durable (the bundles held go out)."""
        if self.ready is None or self.core.durable:
            return True
        ok = await self.ready()
        self.apply(self.core.journal(ok, trio.current_time()))
        return ok

    async def _watch(self) -> None:
        """Until every rack answered or failed (the core fails them at its deadline); then, if
        some were given up on, the reports held back wait a little longer while the failed
        racks' members are pushed directly (bounded: a long fallback must not starve them)."""
        core = self.core
        while core.waiting and not core.done:
            with trio.move_on_at(core.wake_at):
                await self.changed.wait()
            self.changed = trio.Event()
            self.apply(core.tick(trio.current_time()))
        if self.deferring and core.timed_out:
            with trio.move_on_after(FALLBACK_HOLD_S):
                await self.done.wait()
        self._stop_deferring()

    def _report(self, bytes0: int, fallbacks0: int, built_at: float, sent_at: float) -> None:
        core, stats = self.core, self.hub.stats
        stats.last_delivery = {
            "job_id": self.job_id, "nodes": len(self.ids), "racks": len(self.racks), "direct": len(core.direct),
            "fallback_nodes": stats.fallback_nodes - fallbacks0, "bundle_bytes": stats.bytes_out - bytes0,
            "seconds": trio.current_time() - self.t0, "built_s": built_at, "last_bundle_sent_s": sent_at,
            "first_ack_s": core.first_ack - self.t0 if math.isfinite(core.first_ack) else 0.0,
            "last_ack_s": max(0.0, core.last_ack - self.t0),
            # the direct pushes to the members of racks whose relay did not deliver: when the
            # first began and the last ended, and the slowest one
            "fallback_first_s": self.fb_first if math.isfinite(self.fb_first) else None,
            "fallback_last_s": self.fb_last or None, "fallback_push_max_s": self.fb_max or None,
            # the placer's process CPU-s (time.process_time) when every node had an outcome, and
            # when the round ended: the bench's exact "placer CPU to acked" against its reading
            # before the submit
            "process_cpu_at_members_acked_s": self.cpu_acked, "process_cpu_at_end_s": time.process_time()}
