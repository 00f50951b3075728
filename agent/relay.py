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
- ``blob_get`` from a member: from the cache, fetched first if needed (the bundle's
  ``blob_sources`` in order, then the placer). From another relay: from the cache, or once
  the fetch in flight here ended (waiting a little for a bundle naming it that has not come
  yet) -- never a new fetch, so relays asking each other cannot wait on one another in a
  cycle.

A relay can delay or drop, never forge (scheduler_link.msgauth): a bundle is acted on only
once the placer's signature over it verifies (the key came with this node's registration);
each member gets its part with the signed proof and checks it itself; a member's content
report and heartbeat carry the member's MAC, which this relay passes on untouched.

Without a connection up, members' reports are answered 503: their links fall back to the
placer directly (a relay that cannot reach the placer must not keep its rack looking alive).

:class:`~agent.beats.BeatBook` holds the aggregation (pure methods, no I/O); :class:`Relay`
is the trio code around it.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from infra.auth import TokenSet
from infra.tls import Security
from scheduler_link.frames import CallFailed, FrameChannel, FrameError, decode_payload, open_frames
from scheduler_link.heartbeat_wire import HeartbeatServer, Hello, WireError, WireReply
from scheduler_link.messages import (
    AckBundle,
    BlobReply,
    BlobRequest,
    Frame,
    NodeOutcome,
    NodePart,
    NodeReport,
    RackBeat,
    RackBeatReply,
    RackBundle,
    RackReports,
    RelayHello,
    ReportReply,
)
from scheduler_link.msgauth import AuthError, BundleVerifier

from .beats import BeatBook, is_empty
from .blobs import BlobCache, BlobSource

log = logging.getLogger("herd.agent.relay")

PartHandler = Callable[[NodePart], Awaitable[NodeOutcome]]
# () -> (this node's MAC key, the placer's signing key), None until registered
Keys = Callable[[], tuple[bytes | None, bytes | None]]
ACK_WINDOW_S = 0.4           # a bundle's acks go back at most this long after it came
KEEP_SOURCES = 16            # blob ids whose sources (from bundles) are remembered
PEER_BLOB_WAIT_S = 2.0       # a relay asking for a blob whose bundle has not reached us yet waits this long


def _frames_only(node_id: str, report: NodeReport) -> tuple[int, ReportReply]:
    return 400, ReportReply(ok=False, error="a relay's members listener takes frames connections only")


class Relay:
    """This agent's relay role (see the module docstring). ``await n.start(relay.run)``
    returns the members listener's URL (tcp://host:port)."""

    def __init__(self, *, node_id: str, rack: str, tokens: TokenSet, listen: str, wire_url: Callable[[], str | None],
                 own_part: PartHandler, blobs: BlobCache, placer_blob: BlobSource | None = None,
                 advertise: str | None = None, heartbeat_s: float = 5.0, backoff_min_s: float = 0.05,
                 backoff_max_s: float = 2.0, request_timeout_s: float = 10.0, max_connections: int = 512,
                 keys: Keys, on_bad_bundle: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, security: Security | None = None,
                 connect_timeout_s: float = 60.0) -> None:
        """``security``: the agent's TLS set-up (None or insecure: plain TCP). With it the members
        listener takes mutual TLS only (a member's certificate names the member), the upstream
        connection must reach the placer's certificate, and blobs come from other relays over
        mutual TLS too."""
        self.node_id = node_id
        self._client_ssl = security.client if security is not None else None   # (insecure: none)
        self._keys = keys
        self._on_bad_bundle = on_bad_bundle   # e.g. the link's request_full_report: a new placer key
        self._verifier: BundleVerifier | None = None
        self.rack = rack
        self.tokens = tokens
        self.token = tokens.cluster or ""
        self.listen = listen
        self.advertise = advertise
        self._wire_url = wire_url
        self._own_part = own_part
        self.blobs = blobs
        self._placer_blob = placer_blob
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.request_timeout_s = request_timeout_s
        # the upstream hello is waited for longer than a request: a placer in a registration
        # storm (every node and relay reconnecting) answers late, and a relay that gave up and
        # dialled again would only add to the storm (AgentLink.wire_connect_timeout_s likewise)
        self.connect_timeout_s = max(request_timeout_s, connect_timeout_s)
        self._clock = clock
        self.book = BeatBook(rack, heartbeat_s)
        # a rack is small (<= 72 trays an NVL72) plus the few relays come for a blob: not the
        # descriptor-derived default, which may be 64 under a low ulimit
        self.server = HeartbeatServer(tokens, _frames_only, frames=self, max_connections=max_connections,
                                      ssl_context=security.channel if security is not None else None,
                                      require_certs=security.require_certs if security is not None else False)
        self.listen_url = ""
        self._members: dict[str, FrameChannel] = {}
        self._up: FrameChannel | None = None
        self._sources: OrderedDict[str, list[str]] = OrderedDict()
        self._outq: list[tuple[NodeReport, trio.MemorySendChannel[WireReply]]] = []   # content reports to send up
        self._sending: list[tuple[NodeReport, trio.MemorySendChannel[WireReply]]] = []   # the batch out now
        self._out_wake = trio.Event()
        self._batches = True          # the placer takes ``reports`` frames (else one ``report`` each)
        self._nursery: trio.Nursery | None = None
        # statistics
        self.connects = 0
        self.bundles = 0
        self.parts_delivered = 0
        self.parts_missed = 0
        self.beats = 0
        self.beat_entries = 0
        self.reports_forwarded = 0
        self.report_frames = 0
        self.empty_answered = 0
        self.blob_serves = 0
        self.bad_bundles = 0

    def statistics(self) -> dict[str, Any]:
        return {"listen_url": self.listen_url, "rack": self.rack, "upstream": self._up is not None,
                "members": len(self._members), "connects": self.connects, "bundles": self.bundles,
                "parts_delivered": self.parts_delivered, "parts_missed": self.parts_missed, "beats": self.beats,
                "beat_entries": self.beat_entries, "reports_forwarded": self.reports_forwarded,
                "report_frames": self.report_frames,
                "empty_answered": self.empty_answered, "blob_serves": self.blob_serves,
                "bad_bundles": self.bad_bundles,
                "pending_beats": self.book.pending, "blobs": self.blobs.statistics()}

    def blob_sources(self, blob_id: str) -> list[BlobSource]:
        """Where this relay gets a blob: the relays a bundle named, in order, then the placer
        over the upstream connection (the daemon adds the placer's HTTP route after)."""
        out: list[BlobSource] = [self._peer_source(u) for u in self._sources.get(blob_id, [])
                                 if u != self.listen_url]
        out.append(self._upstream_blob)
        return out

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            url = await n.start(self.server.run, self.listen)
            self.listen_url = _advertised(url, self.advertise)
            log.info("relay members listener url=%s rack=%s", self.listen_url, self.rack)
            task_status.started(self.listen_url)
            await self._upstream_loop()

    async def _upstream_loop(self) -> None:
        backoff = self.backoff_min_s
        while True:
            url = self._wire_url()
            if not url:
                await trio.sleep(backoff)
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            try:
                ch = await open_frames(url, self.token, self.node_id, timeout_s=self.connect_timeout_s,
                                       relay=RelayHello(racks=[self.rack], listen_url=self.listen_url),
                                       ssl_context=self._client_ssl, expect="placer" if self._client_ssl else None)
            except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError) as e:
                log.info("relay upstream connect failed url=%s err=%r", url, e)
                await trio.sleep(backoff * 2 * random.uniform(0.5, 1.0))  # jittered: relays do not retry in step
                backoff = min(self.backoff_max_s, backoff * 2)
                continue
            backoff = self.backoff_min_s
            self.connects += 1
            log.info("relay connected to the placer url=%s rack=%s", url, self.rack)
            self._up = ch
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._beats, ch)
                    n.start_soon(self._forwarder, ch)
                    await ch.run(self._upstream_frame)
                    n.cancel_scope.cancel()
            finally:
                if self._up is ch:
                    self._up = None
                self._fail_queued("the relay lost its connection to the placer")
            log.warning("relay lost its placer connection rack=%s", self.rack)
            await trio.sleep(backoff)

    async def _beats(self, ch: FrameChannel) -> None:
        while not ch.closed.is_set():
            await trio.sleep(self.book.heartbeat_s)
            b = self.book.take_all(self._clock())
            if b is not None:
                await self._send_beat(ch, b)

    async def _send_beat(self, ch: FrameChannel, b: RackBeat) -> None:
        self.beats += 1
        self.beat_entries += len(b.node_ids)
        try:
            f = await ch.call("beat", b, timeout_s=self.request_timeout_s)
            self.book.apply(decode_payload(f, RackBeatReply))
        except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("rack beat failed rack=%s entries=%d err=%s", self.rack, len(b.node_ids), e)

    # ------------------------------------------------------------ frames from the placer

    def _upstream_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "bundle":
            try:
                b, parts = self._verified(f)
            except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as e:
                return "error", {"error": f"bundle refused: {e}"}
            return self._bundle(b, parts)
        if f.type == "part":
            return self._own(decode_payload(f, NodePart))
        if f.type == "ping":
            return ("ping", {})
        raise ValueError(f"a relay does not take {f.type} frames from the placer")

    async def _own(self, part: NodePart) -> tuple[str, NodeOutcome]:
        return "ack", await self._own_part(part)

    def _verified(self, f: Frame) -> tuple[RackBundle, list[NodePart]]:
        """The bundle, checked against the placer's signature (raises: nothing of it is acted
        on, the frame is answered with an error and the placer reaches the rack directly),
        and its parts each with the proof its member checks."""
        pub = self._keys()[1]
        if pub is None:
            self.bad_bundles += 1
            raise AuthError("no placer signing key yet (this relay has not registered directly)")
        if self._verifier is None or self._verifier.public != pub:
            self._verifier = BundleVerifier(pub)
        try:
            view, parts, proofs = self._verifier.bundle(f.payload)
        except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.bad_bundles += 1
            log.warning("bundle refused rack=%s: %s", self.rack, e)
            if self._on_bad_bundle is not None:  # (it came over our own connection to the placer:
                self._on_bad_bundle()            # maybe the placer has a new key; our own answer has it)
            raise
        b = RackBundle(rack=view.rack, blob_id=view.blob_id, blob=view.blob, blob_sources=list(view.blob_sources),
                       deliver_by=view.deliver_by, sig=view.sig)
        return b, [msgspec.structs.replace(p, proof=pr) for p, pr in zip(parts, proofs, strict=True)]

    async def _bundle(self, b: RackBundle, parts: list[NodePart]) -> tuple[str, AckBundle]:
        self.bundles += 1
        if b.blob_id:
            self._sources[b.blob_id] = list(b.blob_sources)
            self._sources.move_to_end(b.blob_id)
            while len(self._sources) > KEEP_SOURCES:
                self._sources.popitem(last=False)
            if b.blob is not None:
                self.blobs.put(b.blob_id, b.blob)
            elif self.blobs.cached(b.blob_id) is None and self._nursery is not None:
                self._nursery.start_soon(self._prefetch, b.blob_id)  # members will ask for it soon
        now_wall, now = self._clock(), trio.current_time()
        until = now + ACK_WINDOW_S
        if b.deliver_by:
            until = min(until, now + max(0.0, b.deliver_by - now_wall))
        outcomes: list[NodeOutcome] = []
        with trio.move_on_at(until):
            async with trio.open_nursery() as n:
                for part in parts:
                    if part.pods and not part.blob_id:  # inside a bundle a part's blob is the bundle's
                        part = msgspec.structs.replace(part, blob_id=b.blob_id)
                    n.start_soon(self._deliver, part, outcomes)
        self.parts_delivered += len(outcomes)
        self.parts_missed += len(parts) - len(outcomes)
        return "acks", AckBundle(rack=b.rack, blob_id=b.blob_id, outcomes=outcomes)

    async def _deliver(self, part: NodePart, outcomes: list[NodeOutcome]) -> None:
        if part.node_id == self.node_id:
            try:
                outcomes.append(await self._own_part(part))
            except Exception as e:  # not accepted durably: left out, the placer pushes it directly
                log.warning("own part not answered placement=%s err=%s", part.placement_id, e)
            return
        ch = self._members.get(part.node_id)
        if ch is None:
            return  # not one of ours (yet): the placer reaches it directly
        try:
            f = await ch.call("part", part)
            out = decode_payload(f, NodeOutcome)
        except (FrameError, CallFailed, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("part not delivered node=%s placement=%s err=%s", part.node_id, part.placement_id, e)
            return
        if out.node_id == part.node_id and out.placement_id == part.placement_id:
            outcomes.append(out)

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

    # ------------------------------------------------------------ the members listener (FramesHost)

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        if hello.racks:  # another relay, come for a blob
            return self._peer_frame
        old = self._members.get(hello.node_id)
        self._members[hello.node_id] = channel
        if old is not None and old is not channel and self._nursery is not None:
            self._nursery.start_soon(old.aclose)
        return self._member_frame

    def closed(self, channel: FrameChannel) -> None:
        if self._members.get(channel.name) is channel:
            del self._members[channel.name]
            self.book.forget(channel.name)

    def _member_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "report":
            return self._member_report(ch, decode_payload(f, NodeReport))
        if f.type == "blob_get":
            return self._serve_blob(decode_payload(f, BlobRequest), fetch=True)
        if f.type == "ping":
            return ("ping", {})
        raise ValueError(f"a relay does not take {f.type} frames from a member")

    def _peer_frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "blob_get":
            return self._serve_blob(decode_payload(f, BlobRequest), fetch=False)
        raise ValueError(f"a relay takes only blob_get frames from another relay, not {f.type}")

    async def _member_report(self, ch: FrameChannel, rep: NodeReport) -> tuple[str, WireReply]:
        if rep.node_id != ch.name:
            return "reply", WireReply(status=403, error=f"this connection reports for {ch.name}, not {rep.node_id}")
        up = self._up
        if up is None:
            return "reply", WireReply(status=503, error="the relay has no connection to the placer")
        if is_empty(rep):
            self.empty_answered += 1
            return "reply", WireReply(status=200, reply=self.book.empty(rep))
        send, recv = trio.open_memory_channel[WireReply](1)
        self._outq.append((rep, send))
        self._out_wake.set()
        with trio.move_on_after(self.request_timeout_s * 2):
            return "reply", await recv.receive()
        return "reply", WireReply(status=503, error="the relay could not forward the report in time")

    def _fail_queued(self, why: str) -> None:
        q, self._outq, self._sending = self._sending + self._outq, [], []
        for _, send in q:
            send.send_nowait(WireReply(status=503, error=why))

    async def _forwarder(self, ch: FrameChannel) -> None:
        """The one task that sends members' content reports up, batched (see the docstring)."""
        while True:
            if not self._outq:
                self._out_wake = trio.Event()
                await self._out_wake.wait()
                continue
            batch, self._outq = self._outq, []
            self._sending = batch  # answered by _fail_queued if the connection goes meanwhile
            reps = [r for r, _ in batch]
            beat = self.book.take_some([r.node_id for r in reps], self._clock())
            if beat is not None:
                await self._send_beat(ch, beat)
            for r in reps:
                self.book.forwarded(r)
            self.reports_forwarded += len(reps)
            answers = await self._send_reports(ch, reps)
            self._sending = []
            for (r, send), wr in zip(batch, answers, strict=True):
                if wr.status == 200:
                    wr = msgspec.structs.replace(wr, reply=self.book.answer(r.node_id, wr.reply))
                send.send_nowait(wr)

    async def _send_reports(self, ch: FrameChannel, reps: list[NodeReport]) -> list[WireReply]:
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
            return [WireReply(status=503, error=f"the relay could not forward the report: {e}")] * len(reps)

    async def _serve_blob(self, req: BlobRequest, *, fetch: bool) -> tuple[str, BlobReply]:
        got: tuple[bytes, Any] | None = None
        with trio.move_on_after(self.request_timeout_s):
            if fetch:
                try:
                    got = await self.blobs.get(req.blob_id, self._all_sources(req.blob_id))
                except Exception as e:
                    return "blob", BlobReply(blob_id=req.blob_id, error=str(e))
            else:
                got = await self.blobs.wait_cached(req.blob_id, PEER_BLOB_WAIT_S)
        if got is None:
            return "blob", BlobReply(blob_id=req.blob_id, error="not here")
        self.blob_serves += 1
        return "blob", BlobReply(blob_id=req.blob_id, data=got[0])


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

