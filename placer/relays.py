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
- The gang blob's bytes ride in the first ``blob_seeds`` bundles only; every other bundle
  names where to fetch it (``blob_sources``): its parent in a tree of fan-out 8 over the
  bundles' order (a relay earlier in that order, itself seeded or fetching), then the
  seeds. The placer serves ``blob_get`` as a last resort, and counts it.
- Relays also carry their members' reports up: content reports as ``report`` frames,
  empty heartbeats aggregated into one ``beat`` per interval (:meth:`Reports.beat`).
- A relay can delay or drop, never forge (scheduler_link.msgauth): every bundle is signed
  (Ed25519 over its parts' exact bytes: one signature per BUILD_BATCH bundles, over a Merkle
  root of their headers; each bundle carries its path); every outcome, report and beat
  entry a relay forwards for another node must carry that node's MAC, else it is dropped,
  counted (``bad_macs``) and the node is reached directly as if the relay had left it out.

This module does the I/O; what a beat or an outcome means is decided by the state.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio
import trio.lowlevel

from scheduler_link import msgauth
from scheduler_link.frames import FrameChannel, FrameError, decode_payload
from scheduler_link.heartbeat_wire import Hello, WireReply
from scheduler_link.messages import (
    AckBundle,
    BlobReply,
    BlobRequest,
    Frame,
    NodeReport,
    RackBeat,
    RackReports,
)

from .attempts import ACCEPTED, Outcome
from .records import Push

if TYPE_CHECKING:
    from .service import PlacerService

log = logging.getLogger("herd.placer.relays")

TREE_FANOUT = 8
DRAIN_SLICE_S = 0.02      # the deferred frames are applied in slices of this much CPU, then others run
STOPS_CAP_S = 10.0        # a round of stops only: relays' time at most, and without progress
STOPS_PATIENCE_S = 2.0
BUILD_BATCH = 32          # bundles built between checkpoints, signed and sent together
FALLBACK_HOLD_S = 1.0     # a start round's fallback pushes: reports stay held this much longer, at most


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
    last_delivery: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _RackCall:
    """One rack's bundle in a delivery round, waiting for its relay's answer."""
    path: str
    conn: RelayConn
    ps: list[Push]
    rid: int
    settled: bool = False     # its wait is over: answered, failed, or given up on
    fell_back: bool = False   # its members not reached were pushed directly


def _rank(rack: str, node_id: str) -> bytes:
    return hashlib.blake2b(f"{rack}|{node_id}".encode(), digest_size=8).digest()


class RelayHub:
    """The placer's FramesHost: relay connections, the rack -> relay choice, delivery."""

    def __init__(self, service: PlacerService) -> None:
        self.svc = service
        self._cands: dict[str, dict[str, RelayConn]] = {}   # rack -> node id -> connection
        self._active: dict[str, RelayConn] = {}             # rack -> chosen (cache)
        self.stats = RelayStats()
        self._delivering = 0                                 # deliveries in flight
        # (channel, frame, when it arrived by the placer's clock): what relays sent during a delivery
        self._deferred: collections.deque[tuple[FrameChannel, Frame, float]] = collections.deque()
        self._drained = 0
        self._draining = False

    # ------------------------------------------------------------ connections

    def opened(self, hello: Hello, channel: FrameChannel) -> Callable[[FrameChannel, Frame], Any]:
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

    def relay_for(self, rack: str) -> RelayConn | None:
        hit = self._active.get(rack)
        if hit is not None:
            n = self.svc.state.nodes.get(hit.node_id)
            if n is not None and n.state == "up" and not hit.channel.closed.is_set():
                return hit
        best: RelayConn | None = None
        best_rank = b""
        nodes = self.svc.state.nodes
        for nid, conn in self._cands.get(rack, {}).items():
            n = nodes.get(nid)
            if n is None or n.state != "up" or conn.channel.closed.is_set():
                continue
            r = _rank(rack, nid)
            if best is None or r > best_rank:
                best, best_rank = conn, r
        if best is not None:  # (no choice is not remembered: a candidate may register any moment)
            self._active[rack] = best
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

    def statistics(self) -> dict[str, Any]:
        s = self.stats
        return {"candidates": sum(len(c) for c in self._cands.values()), "racks": len(self._cands),
                "bundles": s.bundles, "bundle_failures": s.bundle_failures, "fallback_nodes": s.fallback_nodes,
                "relayed_nodes": s.relayed_nodes, "late_nodes": s.late_nodes, "blob_seeds": s.blob_seeds, "blob_serves": s.blob_serves,
                "beats": s.beats, "beat_entries": s.beat_entries, "reports": s.reports, "bytes_out": s.bytes_out,
                "last_delivery": s.last_delivery}

    # ------------------------------------------------------------ frames from relays

    def _handle(self, ch: FrameChannel, f: Frame) -> tuple[str, Any] | None:
        if (self._delivering or self._deferred) and f.type in ("beat", "report", "reports"):
            # acks first: what relays report while a delivery is out waits until it is in, in
            # arrival order (per connection too), then is applied and answered
            self._deferred.append((ch, f, self.svc.clock()))
            return None
        return self._apply(ch, f)

    def heard_until(self) -> float | None:
        """When the oldest frame still waiting here arrived (None: nothing waits). Heartbeats
        that came before then have all been applied; later ones may still be in the queue, so
        a node is judged silent only up to this instant (the lost check's clock, service._tick):
        beats the placer itself held back never make a node lost."""
        return self._deferred[0][2] if self._deferred else None

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
            if ch.closed.is_set():
                continue
            try:
                out = self._apply(ch, f, at)
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

    def _apply(self, ch: FrameChannel, f: Frame, at: float | None = None) -> tuple[str, Any] | None:
        """One frame from a relay; ``at``: when it arrived, if it waited (a beat counts then)."""
        t = f.type
        conn: RelayConn | None = ch.info
        via = conn.node_id if conn is not None else ch.name
        if t == "beat":
            b = decode_payload(f, RackBeat)
            self.stats.beats += 1
            self.stats.beat_entries += len(b.node_ids)
            now = self.svc.clock()
            beat_reply, pushes = self.svc.state.beat(b, now if at is None else at, via=via,
                                                     answered=None if at is None else now)
            self.svc._carry_out(pushes)
            return "beat_reply", beat_reply
        if t == "report":
            try:
                rep = decode_payload(f, NodeReport)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return "reply", WireReply(status=400, error=f"malformed report: {e}")
            self.stats.reports += 1
            status, reply = self.svc._ingest(rep.node_id, rep, via)
            return "reply", WireReply(status=status, reply=reply, error=reply.error if status != 200 else None)
        if t == "reports":
            try:
                batch = decode_payload(f, RackReports)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return "error", {"error": f"malformed reports: {e}"}
            self.stats.reports += len(batch.reports)
            return "replies", [WireReply(status=st, reply=r, error=r.error if st != 200 else None)
                               for st, r in self.svc._ingest_many(batch.reports, via)]
        if t == "blob_get":
            req = decode_payload(f, BlobRequest)
            raw = self.svc.state.blobs.get(req.blob_id)
            if raw is None:
                return "blob", BlobReply(blob_id=req.blob_id, error="no such gang blob")
            self.stats.blob_serves += 1
            return "blob", BlobReply(blob_id=req.blob_id, data=raw)
        if t == "ping":
            return "ping", None
        return "error", {"error": f"unexpected frame type {t!r} from a relay"}

    # ------------------------------------------------------------ delivery

    def split(self, pushes: list[Push]) -> tuple[list[Push], dict[str, tuple[RelayConn, list[Push]]]]:
        """(pushed directly, by rack: its relay and its pushes)."""
        direct: list[Push] = []
        by_rack: dict[str, tuple[RelayConn, list[Push]]] = {}
        nodes = self.svc.state.nodes
        last_rack, last_hit = None, None   # a gang's pushes come in topology order: racks in runs
        for p in pushes:
            node = nodes.get(p.node_id)
            if node is None:
                direct.append(p)
                continue
            rack = node.rack_path
            if rack == last_rack and last_hit is not None:
                last_hit[1].append(p)
                continue
            hit = by_rack.get(rack)
            if hit is None:
                conn = self.relay_for(rack)
                if conn is None:
                    direct.append(p)
                    continue
                hit = by_rack[rack] = (conn, [])
            hit[1].append(p)
            last_rack, last_hit = rack, hit
        return direct, by_rack

    async def deliver(self, job_id: str, blob_id: str | None, pushes: list[Push],
                      push_direct: Callable[[Push], Awaitable[Outcome]],
                      ready: Callable[[], Awaitable[bool]] | None = None) -> dict[str, Outcome] | None:
        """Carry out a decision's pushes through the relays (directly where a rack has none or
        its relay fails). Returns the start pushes' outcomes by node.

        The round's bundles are built (and encoded) in batches of ``BUILD_BATCH``, each sent as
        soon as it is built; with ``ready`` (the journal's sync), nothing leaves until it says
        yes (awaited once the first batch is built, so that build overlaps the fsync). None
        when it says no.

        No task waits per rack: each bundle's answer is handled by a callback in its relay
        connection's reader (:meth:`FrameChannel.call_cb`), and this one task watches the
        round's deadline (a nursery and two tasks per rack cost ~0.1 ms of placer CPU each,
        ~0.3 s of a 2,778-rack round's, measured). A rack's members that its relay did not
        reach (no answer by the deadline, a broken connection, left out, a MAC that does not
        verify) are pushed directly, while a late answer from the relay still counts (each
        node's first outcome is kept, and a member answered either way is not pushed again)."""
        cfg = self.svc.cfg
        t0 = trio.current_time()
        direct, by_rack = self.split(pushes)
        acks: dict[str, Outcome] = {}
        raw = self.svc.state.blobs.get(blob_id) if blob_id else None
        now = self.svc.clock()
        expires = now + cfg.placement_ttl_s
        racks = list(by_rack.items())
        urls = [conn.listen_url for _, (conn, _) in racks]
        seeds = max(1, cfg.blob_seeds)
        seed_urls = [u for u in urls[:seeds] if u]
        bytes0 = self.stats.bytes_out
        marks = {"built": 0.0, "sent": 0.0, "first_ack": math.inf, "last_ack": 0.0,
                 "fallback_first": math.inf, "fallback_last": 0.0, "fallback_push_max": 0.0}
        fallbacks0 = self.stats.fallback_nodes

        # A relay has failed when it has not answered relay_timeout_s after the round last made
        # progress: after the last bundle left, or after the latest ack any relay of the round
        # gave (so relays slowed by a busy host are not taken for dead while their peers answer),
        # and never later than 4x relay_timeout_s after the last bundle left (STOPS_CAP_S for a
        # round of stops only).
        patience = cfg.relay_timeout_s if job_id else max(cfg.relay_timeout_s, STOPS_PATIENCE_S)
        fallback_slots = trio.CapacityLimiter(max(1, cfg.push_concurrency))
        deadline = [math.inf]
        cap = [math.inf]
        done: set[str] = set()                    # rack members with an outcome (the first is kept)
        members_left = [len({p.node_id for _, (_, ps) in racks for p in ps})]
        all_done = trio.Event()                   # every rack member has an outcome
        waits_left = [len(racks)]
        idle = trio.Event()                       # every rack's wait is over (answered or failed)
        if not members_left[0]:
            all_done.set()
        if not racks:
            idle.set()
        calls: list[_RackCall] = []
        fb: list[trio.Nursery] = []               # the round's fallback pushes

        async def one(p: Push) -> None:
            o = await push_direct(p)
            if p.kind == "start":
                acks.setdefault(p.node_id, o)

        def spec(i: int, path: str, conn: RelayConn, ps: list[Push], deliver_by: float) -> msgauth.BundleSpec:
            """One rack's bundle, but for its signature (signed with its batch's)."""
            carry = raw is not None and i < seeds
            sources: list[str] = []
            if raw is not None and not carry:
                parent = urls[(i - seeds) // TREE_FANOUT] if i - seeds >= 0 else None
                sources = [u for u in [parent, *seed_urls] if u and u != conn.listen_url]
            starts = any(p.kind == "start" for p in ps)
            if carry and starts:
                self.stats.blob_seeds += 1
            return msgauth.BundleSpec(path, (blob_id or "") if starts else "", [p.part_bytes(expires) for p in ps],
                                      deliver_by, raw if carry and starts else None, sources if starts else [])

        def build(batch: list[tuple[int, str, RelayConn, list[Push]]]) -> list[tuple[_RackCall, bytes]]:
            """A batch of racks' bundles, under one signature (a Merkle root over their headers)."""
            deliver_by = self.svc.clock() + cfg.relay_timeout_s * 0.8
            rbs = self.svc.signer.bundles_raw([spec(i, path, conn, ps, deliver_by) for i, path, conn, ps in batch])
            out = []
            for (_, path, conn, ps), rb in zip(batch, rbs, strict=True):
                rid, data = conn.channel.prepare("bundle", rb)
                out.append((_RackCall(path, conn, ps, rid), data))
            return out

        def record(p: Push, o: Outcome) -> None:
            if p.node_id in done:
                return
            done.add(p.node_id)
            if p.kind == "start":
                acks.setdefault(p.node_id, o)
            members_left[0] -= 1
            if members_left[0] <= 0:
                all_done.set()

        def from_relay(rc: _RackCall, f: Frame) -> int:
            """A relay's AckBundle: each member's outcome that verifies, recorded (a member that
            already has one is not checked again)."""
            ab = decode_payload(f, AckBundle)
            got = {o.node_id: o for o in ab.outcomes}
            n_new = 0
            state = self.svc.state
            nodes = state.nodes
            mac_key = state.mac_key
            ok = msgauth.outcome_ok
            relay_id = rc.conn.node_id
            for p in rc.ps:
                nid = p.node_id
                o = got.get(nid)
                if o is None or nid in done:
                    continue
                if nid != relay_id:  # a member's: only with its MAC
                    node = nodes.get(nid)
                    if node is None or not ok(mac_key(nid, node.boot_id), o):
                        state.counters["bad_macs"] += 1
                        log.warning("relay's ack refused: MAC does not verify node=%s relay=%s rack=%s",
                                    nid, relay_id, rc.path)
                        continue   # as if left out: pushed directly
                if o.placement_id == p.placement_id:
                    n_new += 1
                    record(p, ACCEPTED if o.outcome == "accepted" and not o.refused_gpus and o.detail is None
                           else Outcome(o.outcome, tuple(o.refused_gpus), o.detail))  # (one shared, mostly)
            self.stats.relayed_nodes += n_new
            return n_new

        async def push_fallback(p: Push) -> None:
            async with fallback_slots:  # (queued here, not in the pool: a late answer can still save the push)
                if p.node_id in done:
                    return  # the relay's late answer came first
                self.stats.fallback_nodes += 1
                f0 = trio.current_time()
                marks["fallback_first"] = min(marks["fallback_first"], f0 - t0)
                o = await push_direct(p)
                f1 = trio.current_time()
                marks["fallback_last"] = max(marks["fallback_last"], f1 - t0)
                marks["fallback_push_max"] = max(marks["fallback_push_max"], f1 - f0)
            record(p, o)

        def settle(rc: _RackCall) -> None:
            rc.settled = True
            waits_left[0] -= 1
            if waits_left[0] <= 0:
                idle.set()

        def fall_back(rc: _RackCall) -> None:
            """The rack's members without an outcome: pushed directly (once per rack)."""
            if rc.fell_back:
                return
            rc.fell_back = True
            for p in rc.ps:
                if p.node_id not in done:
                    fb[0].start_soon(push_fallback, p)

        def fail(rc: _RackCall, why: str) -> None:
            self.stats.bundle_failures += 1
            self.forget_choice(rc.path)
            log.warning("relay did not deliver rack=%s relay=%s parts=%d err=%s; pushing directly",
                        rc.path, rc.conn.node_id, len(rc.ps), why)
            settle(rc)
            fall_back(rc)

        def answered(rc: _RackCall, f: Frame | None) -> None:
            """The relay's answer (None: its connection closed first), in its reader task."""
            if f is None or f.type == "error":
                if not rc.settled:
                    fail(rc, "FrameError" if f is None else "CallFailed")
                return
            if rc.settled:  # late: its members are being pushed directly; what it says still counts
                try:
                    self.stats.late_nodes += from_relay(rc, f)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
                return
            now_t = trio.current_time()
            deadline[0] = max(deadline[0], min(cap[0], now_t + patience))  # the round progresses
            a = now_t - t0
            marks["first_ack"] = min(marks["first_ack"], a)
            marks["last_ack"] = max(marks["last_ack"], a)
            try:
                from_relay(rc, f)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("relay answered a malformed ack bundle rack=%s relay=%s err=%s", rc.path,
                            rc.conn.node_id, e)
            settle(rc)
            if any(p.node_id not in done for p in rc.ps):
                fall_back(rc)

        def send(rc: _RackCall, data: bytes) -> None:
            self.stats.bundles += 1
            self.stats.bytes_out += len(data)
            calls.append(rc)
            try:
                rc.conn.channel.call_cb(rc.rid, data, partial(answered, rc))
            except FrameError:
                fail(rc, "FrameError")

        # What relays report waits while a start round's acks are awaited (acks first), and no
        # longer: once every relay answered or the deadline passed, the fallback pushes run
        # while reports flow again (a long fallback must not starve heartbeats). Rounds of stops
        # only never hold reports back.
        deferring = [False]

        def stop_deferring() -> None:
            if deferring[0]:
                deferring[0] = False
                self._delivering -= 1
                if not self._delivering and self._deferred and self.svc._nursery is not None:
                    self.svc._nursery.start_soon(self._drain_deferred)

        async def watch() -> None:
            """Until every rack answered, or the deadline: the racks still waiting then fail."""
            try:
                while not idle.is_set():
                    with trio.move_on_at(min(deadline[0], cap[0])):
                        await idle.wait()
                    t = trio.current_time()
                    if idle.is_set() or t < min(deadline[0], cap[0]):
                        continue   # (the deadline moved: the round made progress)
                    for rc in calls:
                        if not rc.settled:
                            fail(rc, "TooSlowError")
                    if deferring[0]:
                        # the failed racks' members are now pushed directly: the reports
                        # held back wait a little longer, so the pushes do not queue behind
                        # their application (bounded: a long fallback must not starve them)
                        with trio.move_on_after(FALLBACK_HOLD_S):
                            await all_done.wait()
                    return
            finally:
                stop_deferring()

        if job_id:
            self._delivering += 1
            deferring[0] = True
        # The bundles are tens of thousands of young objects: a full collection while they are
        # built would walk the whole fleet's records for nothing (as during a pass).
        gc_was = gc.isenabled()
        gc.disable()
        try:
            async with trio.open_nursery() as n:
                async with trio.open_nursery() as fbn:
                    fb.append(fbn)
                    # Bundles leave in batches as they are built (the first batch once ``ready``
                    # says yes), so the relays work while the rest of the round is encoded: a
                    # 2,778-rack round takes ~0.5 s to build here, and relays are other hosts.
                    durable = ready is None
                    for b0 in range(0, len(racks), BUILD_BATCH):
                        built = build([(i, path, conn, ps) for i, (path, (conn, ps))
                                       in enumerate(racks[b0:b0 + BUILD_BATCH], b0)])
                        if not durable:
                            assert ready is not None
                            if not await ready():
                                return None
                            durable = True
                        for rc, data in built:
                            send(rc, data)
                        await trio.lowlevel.checkpoint()  # the batch goes out; acks and reports flow meanwhile
                    marks["built"] = trio.current_time() - t0
                    if gc_was:
                        gc.enable()
                    if not durable:
                        assert ready is not None
                        if not await ready():
                            return None
                    for p in direct:
                        n.start_soon(one, p)
                    await trio.lowlevel.checkpoint()
                    sent_at = trio.current_time()
                    deadline[0] = sent_at + patience
                    # a round of stops only is not waited on by anyone: slow relays get longer before
                    # their racks are pushed one by one (a storm of direct stops helps nobody)
                    cap[0] = sent_at + (4 * cfg.relay_timeout_s if job_id else max(4 * cfg.relay_timeout_s, STOPS_CAP_S))
                    marks["sent"] = sent_at - t0
                    if racks:
                        await watch()
                    else:
                        stop_deferring()
                    await all_done.wait()
                    marks["cpu_acked"] = time.process_time()
                    fbn.cancel_scope.cancel()   # (pushes a late answer made needless)
        finally:
            for rc in calls:   # answers that come now are no one's
                rc.conn.channel.forget(rc.rid)
            if gc_was:
                gc.enable()
            stop_deferring()
        if job_id:  # (a round of stops only is not a delivery to report)
            self.stats.last_delivery = {
                "job_id": job_id, "nodes": len(pushes), "racks": len(racks), "direct": len(direct),
                "fallback_nodes": self.stats.fallback_nodes - fallbacks0, "bundle_bytes": self.stats.bytes_out - bytes0,
                "seconds": trio.current_time() - t0, "built_s": marks["built"], "last_bundle_sent_s": marks["sent"],
                "first_ack_s": marks["first_ack"] if racks else 0.0, "last_ack_s": marks["last_ack"],
                # the direct pushes to the members of racks whose relay did not deliver: when the
                # first began and the last ended, and the slowest one
                "fallback_first_s": marks["fallback_first"] if math.isfinite(marks["fallback_first"]) else None,
                "fallback_last_s": marks["fallback_last"] or None, "fallback_push_max_s": marks["fallback_push_max"] or None,
                # the placer's process CPU-s (time.process_time) when every rack member had an
                # outcome, and when the round (direct pushes included) ended: the bench's exact
                # "placer CPU to acked" against its reading before the submit
                "process_cpu_at_members_acked_s": marks.get("cpu_acked"), "process_cpu_at_end_s": time.process_time()}
        return acks
