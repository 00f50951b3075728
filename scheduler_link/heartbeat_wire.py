"""Framed reports over persistent TCP connections (one per agent, or one per emulator/relay shard).

Why: an HTTP request per heartbeat costs the placer ~0.3-0.5 ms of CPU in hypercorn;
125,000 nodes at a 10 s interval need 12,500 reports/s. Here a connection carries
length-prefixed frames; the server decodes every complete frame a read delivered,
applies them in order and answers with one write, so the cost per heartbeat is a
msgspec decode, the apply, and a share of one syscall.

Protocol (all integers big-endian):
- frame = u32 length + JSON body (at most ``MAX_FRAME`` bytes; before the hello at most
  ``MAX_HELLO``).
- the client's first frame is a :class:`Hello` (cluster token, node id); a wrong token
  gets one error reply and the connection is closed (nothing was applied).
- then each client frame is a :class:`NodeReport` — full (registration) or heartbeat —
  and each answer frame a :class:`WireReply` (HTTP-like status + ReportReply), in order.
- A hello with ``relay=True`` opens a *multi-node* connection: each report names its own
  node (``NodeReport.node_id``) and is applied for that node. The cluster token already
  lets its holder report for any node over HTTP, so this grants nothing new; it lets one
  socket carry the reports of many nodes (the fleet emulator, later the rack relays).
  On a single-node connection a report is applied for the hello's node, and a report
  naming another node is the placer's 400.

Bad input costs the sender, never the placer (DESIGN.md, Security model):
- a connection must complete its hello within ``hello_timeout_s`` and may send at most
  ``MAX_HELLO`` bytes before it;
- at most ``max_connections`` connections are served at once (default: the descriptor
  limit less a reserve); one more gets a 503 reply and is closed;
- an exception raised by ``ingest`` for one frame is logged and answered with a 500
  :class:`WireReply` on that connection; it never escapes into the server's nursery.
- frames connections (``Hello.frames``) are handed to the frames host only after its
  ``opened`` accepted them (it may refuse: 403 with ``WireReply.reason``); at most
  ``max_frames_per_address`` are open per client address (relay candidates the host checked
  aside, one per node); each starts with a member's bounds (``frame_limit``, bounded queues, beats of one
  entry: :class:`~scheduler_link.frames.FrameChannel`), which only the host raises; refusals
  and closes by a bound are counted by reason (``frames_refused_*``, ``frames_closed_*``).

TLS (``ssl_context=``, mutual; :mod:`infra.tls`): the handshake runs inside the hello
deadline; a plain client gets one plain :class:`WireReply` 400 saying the listener speaks TLS.
A client certificate then *is* the authentication: ``node:X`` may open a connection only for
hello node X, and on a multi-node (``relay=True``) connection each report must still be X's
(node restriction on direct connections; reports forwarded by relays are checked by their
MACs). The hello's token counts only without a certificate, and not at all under
``require_certs`` unless ``accept_tokens`` (recorded in ``token_use``).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import trio

from infra import tls
from infra.auth import TokenSet
from infra.backoff import Backoff, Retry
from infra.gate import ConnectionGate

from .frames import (
    MEMBER_MAX_FRAME,
    MEMBER_MAX_HELD,
    MEMBER_MAX_INFLIGHT,
    MEMBER_MAX_QUEUED,
    FrameChannel,
    Handler,
    ReadBacklog,
    Refused,
    WriteQueue,
)
from .messages import NodeReport, ReportReply

log = logging.getLogger("herd.link.wire")

MAX_FRAME = 4 << 20
ACCEPT_BATCH = 512   # connections taken from the listen backlog per wake-up (HeartbeatServer._accept_loop)
_ACCEPT_RETRY = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                           errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH})
_ACCEPT_FULL = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
MAX_HELLO = 16 << 10
MAX_FRAMES_PER_ADDRESS = 8   # frames connections one address may hold open (relay candidates aside)
_LEN = struct.Struct(">I")


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    node_id: str
    version: int = 1
    relay: bool = False              # one connection carrying reports of many nodes
    frames: bool = False             # after the hello, msgpack Frames both ways (scheduler_link.frames)
    racks: list[str] = []            # frames: the racks this node may relay for
    listen_url: str | None = None    # frames: where the relay's members reach it


# WireReply.reason of a rack relay's 503 while it has no connection to the placer (its first
# dial under way, or the placer restarting): its members hold on to it for a while instead of
# going to the placer directly (scheduler_link.relayhold)
UPSTREAM_DOWN = "upstream_down"


class WireReply(msgspec.Struct, frozen=True, kw_only=True):
    status: int
    reply: ReportReply = ReportReply()
    error: str | None = None
    reason: str | None = None        # a refused hello: why, as a code (rack_mismatch, per_address, ...)
    # with ``upstream_down``: the relay has not been connected since it started (its first dial
    # is under way), rather than having lost the placer; members hold on longer (relayhold)
    dialling: bool = False


class WireError(Exception):
    """A peer broke the framing protocol, or refused the channel (``status``: its answer)."""

    def __init__(self, msg: str, *, status: int | None = None) -> None:
        super().__init__(msg)
        self.status = status


_hello = msgspec.json.Decoder(Hello)
_report = msgspec.json.Decoder(NodeReport)
_wire_reply = msgspec.json.Decoder(WireReply)
_enc = msgspec.json.Encoder()


def frame(obj: Any) -> bytes:
    body = _enc.encode(obj)
    return _LEN.pack(len(body)) + body


def split_frames(buf: bytearray, limit: int = MAX_FRAME) -> list[bytes]:
    """Pop every complete frame off the front of ``buf``; a frame announced over ``limit``
    bytes is a :class:`WireError` at once (before its body arrives)."""
    out = []
    pos = 0
    n = len(buf)
    while n - pos >= 4:
        (ln,) = _LEN.unpack_from(buf, pos)
        if ln > limit:
            raise WireError(f"frame of {ln} bytes is over the {limit} limit")
        if n - pos - 4 < ln:
            break
        out.append(bytes(buf[pos + 4:pos + 4 + ln]))
        pos += 4 + ln
    del buf[:pos]
    return out


# ingest(node_id, report) -> (status, reply); must be synchronous (one owner of state)
Ingest = Callable[[str, NodeReport], tuple[int, ReportReply]]


class FramesHost(Protocol):
    """Who serves frames connections (``Hello.frames``) on a heartbeat listener. ``opened``
    runs before the hello is answered: raising :class:`~scheduler_link.frames.Refused`
    refuses the connection (403, ``WireReply.reason`` = its code). A connection it admits as
    a relay candidate (``channel.make_candidate``) is not counted against the listener's
    per-address cap (its rack was checked; the cap is for everything else)."""

    def opened(self, hello: Hello, channel: FrameChannel) -> Handler: ...

    def closed(self, channel: FrameChannel) -> None: ...


def default_max_connections(reserve: int = 2048) -> int:
    """The process's descriptor limit less a reserve for HTTP, pushes and files."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, soft - reserve)


_INTERNAL = WireReply(status=500, error="internal error applying the report")


class HeartbeatServer:
    """Accepts agents' framed report streams and feeds them to ``ingest``."""

    def __init__(self, tokens: TokenSet, ingest: Ingest, *, hello_timeout_s: float = 10.0,
                 max_connections: int | None = None, frames: FramesHost | None = None,
                 ssl_context: ssl.SSLContext | None = None, require_certs: bool = False,
                 token_use: Any = None, handshakes: int = 256, handshake_queue_s: float = 45.0,
                 clock: Callable[[], float] = time.time, max_frames_per_address: int = MAX_FRAMES_PER_ADDRESS,
                 frame_limit: int = MEMBER_MAX_FRAME) -> None:
        """``max_frames_per_address`` and ``frame_limit``: the frames connections' bounds (see
        :class:`~scheduler_link.frames.FrameChannel`: the owner raises a connection's own)."""
        self.tokens = tokens
        self.frame_limit = frame_limit
        self.frames_gate = ConnectionGate(1 << 30, max_frames_per_address)
        self.frames_refused: dict[str, int] = {}   # frames hellos refused, by reason
        self.frames_closed: dict[str, int] = {}    # frames connections a bound ended, by reason
        self._candidates: dict[str, FrameChannel] = {}   # node id -> its relay candidate connection (one each)
        # multi-node and frames connections with bytes unread once a batch is applied (heard_until)
        self.backlog = ReadBacklog(clock)
        # Handshakes cost the placer's one thread ~1.5-3 ms of CPU each. A registration storm
        # (every agent reconnecting at once) run all at once would finish them all late, past
        # the deadline, and their retries would feed the storm: a few at a time, in arrival
        # order, each within hello_timeout_s once it has a slot; a connection waits for a slot
        # at most handshake_queue_s (it holds a socket meanwhile, bounded by max_connections),
        # less than an agent waits for it (AgentLink.wire_connect_timeout_s, 60 s); one whose
        # client hung up while it waited is dropped without a handshake (its ClientHello is
        # still in the socket: the handshake's crypto would be spent on nobody).
        self._handshakes = trio.CapacityLimiter(max(1, handshakes))
        self.handshake_queue_s = handshake_queue_s
        self.ssl_context = ssl_context
        self.require_certs = require_certs
        self.token_use = token_use      # scheduler_link.authz.TokenUse (accept_tokens), or None
        self.tls_refused = 0            # failed or timed-out handshakes
        self.tls_handshakes = 0         # completed ones (what a registration storm costs)
        self.tls_refusals: dict[str, int] = {}   # ... by cause (queue, timeout, peer, certificate, plain)
        self.wrong_node = 0             # a node certificate speaking for another node
        self.ingest = ingest
        self.frames_host = frames
        self.frames_connections = 0    # open frames connections (relays, and members of a relay)
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = default_max_connections() if max_connections is None else max_connections
        self.frames = 0
        self.connections = 0           # accepted since start
        self.revoked_closed = 0        # open connections closed because their node was revoked
        self._open_by_node: dict[str, set[trio.CancelScope]] = {}
        self.open_connections = 0
        self.relay_connections = 0     # open multi-node connections
        self.refused = 0               # bad tokens
        self.over_cap = 0              # connections turned away by max_connections
        self.hello_timeouts = 0
        self.ingest_errors = 0
        # the last 200 answer and its frame: ingest returns one shared object for the common reply
        self._last_reply: ReportReply | None = None
        self._last_frame = b""

    def statistics(self) -> dict[str, int]:
        return {"frames": self.frames, "connections": self.connections, "open_connections": self.open_connections,
                "relay_connections": self.relay_connections, "frames_connections": self.frames_connections,
                "refused": self.refused, "over_cap": self.over_cap,
                "hello_timeouts": self.hello_timeouts, "ingest_errors": self.ingest_errors,
                "tls_refused": self.tls_refused, "tls_handshakes": self.tls_handshakes, "wrong_node": self.wrong_node,
                **{f"tls_refused_{k}": v for k, v in sorted(self.tls_refusals.items())},
                **{f"frames_refused_{k}": v for k, v in sorted(self.frames_refused.items())},
                **{f"frames_closed_{k}": v for k, v in sorted(self.frames_closed.items())}}

    async def run(self, listen: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        host, _, port = listen.rpartition(":")
        listeners = await trio.open_tcp_listeners(int(port or 0), host=host.strip("[]") or "127.0.0.1")
        sock = listeners[0].socket
        h, p = sock.getsockname()[:2]
        task_status.started(f"{'tls' if self.ssl_context else 'tcp'}://{h}:{p}")
        try:
            async with trio.open_nursery() as n:
                for lst in listeners:
                    n.start_soon(self._accept_loop, lst, n)
        finally:
            for lst in listeners:
                lst.socket.close()

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Take every connection the kernel has queued at each wake-up (up to ACCEPT_BATCH),
        not one per scheduler pass as ``trio.serve_listeners`` does (each of its accepts
        yields): in a registration storm a pass of the placer's loop is tens of ms, so 4,096
        relays connecting at once waited over a minute in the listen backlog, past their
        connect deadline (60 s); the placer then took each from the backlog, answered its
        hello to a client that had gone, and logged it connected and at once disconnected
        (63-222 such in slow 131,072-node registrations), while the relay dialled again."""
        std = socket.socket(fileno=os.dup(listener.socket.fileno()))   # the same listening queue
        std.setblocking(False)
        try:
            while True:
                await trio.lowlevel.wait_readable(std)
                for _ in range(ACCEPT_BATCH):
                    try:
                        conn, _ = std.accept()
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError as e:
                        if e.errno in _ACCEPT_RETRY:     # the client went before we took it
                            continue
                        if e.errno in _ACCEPT_FULL:      # out of descriptors or memory: wait a little
                            log.error("framed channel: accept failed: %s", e)
                            await trio.sleep(0.1)
                            break
                        raise
                    conn.setblocking(False)
                    nursery.start_soon(self._handle, trio.SocketStream(trio.socket.from_stdlib_socket(conn)))
                await trio.lowlevel.checkpoint()
        finally:
            std.close()

    async def _handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        if self.open_connections >= self.max_connections:
            self.over_cap += 1
            with trio.move_on_after(1.0):
                try:
                    await stream.send_all(frame(WireReply(status=503, error="too many connections")))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            await stream.aclose()
            return
        self.open_connections += 1
        node_id: str | None = None
        try:
            conn: trio.abc.Stream = stream
            if self.ssl_context is not None:
                accepted = await self._tls_accept(stream)
                if accepted is None:
                    return
                conn = accepted
            async with conn:
                node_id = await self._serve(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, WireError, OSError) as e:
            log.debug("heartbeat connection closed node=%s err=%s", node_id, e)
        except Exception:  # contained to this connection: never take the placer down
            log.exception("heartbeat connection failed node=%s", node_id)
        finally:
            self.open_connections -= 1

    async def _tls_accept(self, stream: trio.SocketStream) -> trio.SSLStream[trio.SocketStream] | None:
        assert self.ssl_context is not None
        failed = tls.HandshakeFailed(tls.Refusal.TIMEOUT, "no ClientHello in time")
        with trio.move_on_after(self.hello_timeout_s):
            # a connection takes a slot only once its client has said something: connected
            # and silent, it holds none (only a socket, under max_connections)
            await trio.lowlevel.wait_readable(stream.socket)
            failed = tls.HandshakeFailed(tls.Refusal.QUEUE, "no handshake slot in time")
        with trio.move_on_after(self.handshake_queue_s if failed.refusal is tls.Refusal.QUEUE else 0):
            async with self._handshakes:
                if tls.peer_hung_up(stream):
                    self.tls_refusals["gone"] = self.tls_refusals.get("gone", 0) + 1
                    self.tls_refused += 1
                    await trio.aclose_forcefully(stream)
                    return None
                # (also when the queue's bound ends the handshake)
                failed = tls.HandshakeFailed(tls.Refusal.TIMEOUT, "handshake timed out")
                s = await tls.server_handshake(stream, self.ssl_context, self.hello_timeout_s)
                if not isinstance(s, tls.HandshakeFailed):
                    self.tls_handshakes += 1
                    return s
                failed = s
        self.tls_refused += 1
        self.tls_refusals[failed.refusal] = self.tls_refusals.get(failed.refusal, 0) + 1
        log.info("framed channel: TLS handshake refused client=%s: %s", tls.peer_address(stream), failed.why)
        await tls.refuse(stream, failed, frame(WireReply(status=400, error="this listener speaks TLS only "
                                                                           "(the placer is not insecure)")))
        return None

    def _admit(self, hello: Hello, principal: tls.Principal | None) -> WireReply | None:
        """None when ``hello`` may go on over this connection, else the refusal to send."""
        if principal is not None:
            if principal.kind == "node" and principal.node_id == hello.node_id:
                return None
            self.wrong_node += 1
            return WireReply(status=403, error=f"this certificate is {principal.name}; it may not speak "
                                               f"for node {hello.node_id[:200]}")
        if self.require_certs:
            return WireReply(status=401, error="this listener needs a node's client certificate")
        if not self.tokens.check("cluster", hello.token):
            return WireReply(status=401, error="unauthorized")
        if self.token_use is not None:
            self.token_use.record(hello.node_id[:200])
        return None

    async def _read_hello(self, stream: trio.abc.Stream, buf: bytearray) -> Hello | None:
        """Read until the hello frame is complete (bounded in bytes and time); None when the
        connection is to be dropped. Bytes after the hello stay in ``buf``."""
        with trio.move_on_after(self.hello_timeout_s):
            while True:
                if len(buf) >= 4:
                    (ln,) = _LEN.unpack_from(buf, 0)
                    if ln > MAX_HELLO:
                        raise WireError(f"hello frame of {ln} bytes is over the {MAX_HELLO} limit")
                    if len(buf) - 4 >= ln:
                        break
                data = await stream.receive_some(MAX_HELLO)
                if not data:
                    return None
                buf += data
            body = bytes(buf[4:4 + ln])
            del buf[:4 + ln]
            try:
                return _hello.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await stream.send_all(frame(WireReply(status=400, error=f"bad hello: {e}")))
                return None
        self.hello_timeouts += 1
        log.info("heartbeat connection dropped: no hello within %.1fs", self.hello_timeout_s)
        return None

    async def _serve(self, stream: trio.abc.Stream) -> str | None:
        buf = bytearray()
        hello = await self._read_hello(stream, buf)
        if hello is None:
            return None
        principal = tls.stream_principal(stream)
        refusal = self._admit(hello, principal)
        if refusal is not None:
            self.refused += 1
            await stream.send_all(frame(refusal))
            return hello.node_id
        # whose connection it is (its certificate's node; else the hello's): closed at once when
        # that node is revoked (close_nodes), not left open until it goes away by itself
        who = principal.node_id if principal is not None and principal.node_id else hello.node_id
        with trio.CancelScope() as cs:
            self._open_by_node.setdefault(who, set()).add(cs)
            try:
                return await self._serve_admitted(stream, hello, buf, principal)
            finally:
                scopes = self._open_by_node.get(who)
                if scopes is not None:
                    scopes.discard(cs)
                    if not scopes:
                        del self._open_by_node[who]
        if cs.cancelled_caught:
            log.warning("connection of a revoked node closed node=%s", who[:200])
        return hello.node_id

    def close_nodes(self, node_ids: list[str]) -> int:
        """Close every open connection of these nodes (revoked: herd pki revoke); how many."""
        n = 0
        for nid in node_ids:
            for cs in self._open_by_node.get(nid, ()):
                cs.cancel()
                n += 1
        self.revoked_closed += n
        return n

    async def _serve_admitted(self, stream: trio.abc.Stream, hello: Hello, buf: bytearray,
                              principal: tls.Principal | None) -> str | None:
        if hello.frames:
            if self.frames_host is None:
                await stream.send_all(frame(WireReply(status=400, error="this listener serves no frames connections")))
                return hello.node_id
            await self._frames(stream, hello, buf)
            return hello.node_id
        relay = hello.relay
        node_id = hello.node_id
        only = principal.node_id if principal is not None else None  # node restriction, per report
        mark = self.backlog.track(stream) if relay else None
        if relay:
            self.relay_connections += 1
        try:
            await stream.send_all(frame(WireReply(status=200)))
            while True:
                frames = split_frames(buf)
                if frames:
                    out = bytearray()
                    for f in frames:
                        out += self._apply(f, node_id, relay, only)
                if mark is not None:
                    mark.applied()
                if frames:
                    await stream.send_all(bytes(out))
                data = await stream.receive_some(READ_MAX)
                if not data:
                    return node_id
                buf += data
        finally:
            if mark is not None:
                mark.close()
            if relay:
                self.relay_connections -= 1

    async def _frames(self, stream: trio.abc.Stream, hello: Hello, buf: bytearray) -> None:
        """A frames connection, once its hello is authenticated: the per-address cap, the
        host's own checks (``opened``), then served until it closes."""
        assert self.frames_host is not None
        address = tls.peer_address(stream) or "?"
        ch = FrameChannel(stream, name=hello.node_id, buf=bytes(buf), backlog=self.backlog.track(stream),
                          max_frame=self.frame_limit, max_queued=MEMBER_MAX_QUEUED, max_held=MEMBER_MAX_HELD,
                          max_entries=1, max_inflight=MEMBER_MAX_INFLIGHT)
        try:
            handler = self.frames_host.opened(hello, ch)
        except Refused as e:
            await self._refuse_frames(stream, e)
            return
        # a relay candidate its host checked is not under the address's cap (the cap is for the
        # rest), but a node holds one: a newer connection replaces the one before
        counted = not ch.candidate
        if ch.candidate:
            old = self._candidates.get(hello.node_id)
            if old is not None and old is not ch:
                old.refuse(Refused("replaced", f"node {hello.node_id[:200]} opened a newer relay connection"))
            self._candidates[hello.node_id] = ch
        if counted and not self.frames_gate.enter(address):
            self.frames_host.closed(ch)
            await self._refuse_frames(stream, Refused("per_address", f"{address} holds "
                                                      f"{self.frames_gate.max_per_client} frames connections already"))
            return
        self.frames_connections += 1
        try:
            await stream.send_all(frame(WireReply(status=200)))
            await ch.run(handler)
        finally:
            self.frames_connections -= 1
            if counted:
                self.frames_gate.leave(address)
            if self._candidates.get(hello.node_id) is ch:
                del self._candidates[hello.node_id]
            if ch.close_code:
                self.frames_closed[ch.close_code] = self.frames_closed.get(ch.close_code, 0) + 1
            self.frames_host.closed(ch)

    async def _refuse_frames(self, stream: trio.abc.Stream, e: Refused) -> None:
        self.frames_refused[e.code] = self.frames_refused.get(e.code, 0) + 1
        log.info("frames connection refused: %s", str(e)[:300])
        await stream.send_all(frame(WireReply(status=403, error=str(e)[:500], reason=e.code)))

    def heard_until(self) -> float | None:
        """When the multi-node or frames connection that is furthest behind was last caught up
        (None: none is behind). Beats that arrived before then have been applied; later ones
        may wait in a socket, unread, so the placer judges a node silent only up to this
        instant (as with relays' held frames, placer.relays.RelayHub.heard_until)."""
        return self.backlog.heard_until()

    def _apply(self, f: bytes, node_id: str, relay: bool, only: str | None = None) -> bytes:
        self.frames += 1
        try:
            rep = _report.decode(f)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return frame(WireReply(status=400, error=f"malformed report: {e}"))
        target = rep.node_id if relay else node_id
        if only is not None and target != only:
            self.wrong_node += 1
            return frame(WireReply(status=403, error=f"this certificate is node:{only}; it may not report "
                                                     f"for node {target[:200]}"))
        try:
            status, reply = self.ingest(target, rep)
            if status == 200 and reply is self._last_reply:
                return self._last_frame  # the shared common answer: its bytes made once
            out = frame(WireReply(status=status, reply=reply))
            if status == 200:
                self._last_reply, self._last_frame = reply, out
            return out
        except Exception:
            self.ingest_errors += 1
            log.exception("ingest failed node=%s seq=%d full=%s", target, rep.seq, rep.full)
            return frame(_INTERNAL)


READ_MAX = 1 << 18   # bytes a multi-node connection's read takes at most


def parse_wire_url(url: str) -> tuple[str, int]:
    hostport = url.removeprefix("tcp://").removeprefix("tls://")
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


class HeartbeatClient:
    """One framed connection (an agent's own, or a relay-mode one carrying many nodes).

    Not safe for concurrent use: :meth:`exchange` sends one report and reads its answer.
    For many nodes sharing one connection concurrently, use :class:`SharedWire`."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    @classmethod
    async def connect(cls, url: str, token: str, node_id: str, *, relay: bool = False,
                      local_address: str | None = None, ssl_context: ssl.SSLContext | None = None,
                      expect: str | None = "placer") -> HeartbeatClient:
        """Open the channel (TLS with ``ssl_context``: the peer must be ``expect``)."""
        host, port = parse_wire_url(url)
        c = cls(await tls.connect(host, port, ssl_context, expect=expect, local_address=local_address))
        try:
            await c.stream.send_all(frame(Hello(token=token, node_id=node_id, relay=relay)))
            (r,) = await c.receive(1)
        except trio.BrokenResourceError as e:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(c.stream)
            if ssl_context is None:
                raise
            # TLS 1.3: a server that refuses our certificate says so after our side finished;
            # one that closes without saying why is past its handshake deadline (busy: 503)
            refusal, why = tls.classify_ssl_error(e.__cause__ or e)
            raise WireError(f"the framed channel closed during TLS set-up: {why} (is our certificate this "
                            "cluster's, unexpired, and a node's?)",
                            status=503 if refusal is tls.Refusal.PEER else None) from None
        except BaseException:
            with trio.CancelScope(shield=True):
                await c.stream.aclose()
            raise
        if r.status != 200:
            await c.stream.aclose()
            raise WireError(f"placer refused the heartbeat channel: {r.status} {r.error}", status=r.status)
        return c

    async def send(self, reports: list[NodeReport]) -> None:
        await self.stream.send_all(b"".join(frame(r) for r in reports))

    async def receive(self, n: int) -> list[WireReply]:
        """Exactly ``n`` answers (later ones stay buffered)."""
        out: list[WireReply] = []
        while True:
            while len(out) < n and len(self.buf) >= 4:
                (ln,) = _LEN.unpack_from(self.buf, 0)
                if ln > MAX_FRAME:
                    raise WireError(f"frame of {ln} bytes is over the {MAX_FRAME} limit")
                if len(self.buf) - 4 < ln:
                    break
                out.append(_wire_reply.decode(bytes(self.buf[4:4 + ln])))
                del self.buf[:4 + ln]
            if len(out) >= n:
                return out
            data = await self.stream.receive_some(1 << 18)
            if not data:
                raise WireError("placer closed the heartbeat channel")
            self.buf += data

    async def exchange(self, report: NodeReport) -> WireReply:
        await self.send([report])
        (r,) = await self.receive(1)
        return r

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Waiter:
    __slots__ = ("done", "reply", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.reply: WireReply | None = None
        self.error: str | None = None


class SharedWire:
    """One relay-mode framed connection carrying the reports of many nodes, used concurrently.

    Reports are pipelined: :meth:`exchange` appends the frame to an outgoing buffer that
    one writer task flushes (many frames per syscall), and registers a waiter; answers
    come back in order, so one reader task pairs them with the waiters FIFO. When the
    connection breaks every waiter gets a :class:`WireError` and ``run`` reconnects
    (backing off); :meth:`exchange` while down waits for the next connection (callers
    bound it with their own deadline).

    ``await nursery.start(shared.run)`` returns once the first connection is up."""

    def __init__(self, url: str, token: str, *, name: str = "relay", local_address: str | None = None,
                 backoff_min_s: float = 0.05, backoff_max_s: float = 2.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.url = url
        self.ssl_context = ssl_context
        self.token = token
        self.name = name
        self.local_address = local_address
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self._q = WriteQueue()
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._up = trio.Event()
        self._client: HeartbeatClient | None = None
        self.connects = 0
        self.breaks = 0
        self.exchanges = 0

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        retry = Retry(Backoff(self.backoff_min_s, self.backoff_max_s))
        started = False
        while True:
            try:
                client = await HeartbeatClient.connect(self.url, self.token, self.name, relay=True,
                                                       local_address=self.local_address,
                                                       ssl_context=self.ssl_context)
            except (OSError, WireError, trio.BrokenResourceError, msgspec.DecodeError, tls.TLSError) as e:
                log.debug("shared wire connect failed name=%s err=%s", self.name, e)
                await trio.sleep(retry.failed(trio.current_time()))
                continue
            retry.succeeded()
            self.connects += 1
            self._client = client
            self._up.set()
            if not started:
                started = True
                task_status.started()
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._guard, self._writer, client, n.cancel_scope)
                    n.start_soon(self._guard, self._reader, client, n.cancel_scope)
            finally:
                self.breaks += 1
                self._client = None
                self._up = trio.Event()
                self._fail_all("framed connection lost")
                with trio.CancelScope(shield=True):
                    await client.aclose()

    async def _guard(self, fn: Callable[[HeartbeatClient], Awaitable[None]], client: HeartbeatClient,
                     scope: trio.CancelScope) -> None:
        try:
            await fn(client)
        except (OSError, WireError, trio.BrokenResourceError, trio.ClosedResourceError,
                msgspec.DecodeError, msgspec.ValidationError) as e:
            log.debug("shared wire broke name=%s err=%s", self.name, e)
        finally:
            scope.cancel()

    def _fail_all(self, why: str) -> None:
        self._q.clear()
        while self._waiters:
            w = self._waiters.popleft()
            w.error = why
            w.done.set()

    async def _writer(self, client: HeartbeatClient) -> None:
        await self._q.write_to(client.stream)

    async def _reader(self, client: HeartbeatClient) -> None:
        buf = client.buf
        while True:
            for f in split_frames(buf):
                r = _wire_reply.decode(f)
                if not self._waiters:
                    raise WireError("an answer nobody asked for")
                w = self._waiters.popleft()
                w.reply = r
                w.done.set()
            data = await client.stream.receive_some(1 << 18)
            if not data:
                raise WireError("placer closed the heartbeat channel")
            buf += data

    async def wait_connected(self) -> None:
        await self._up.wait()

    async def exchange(self, report: NodeReport) -> WireReply:
        while self._client is None:
            await self._up.wait()
        w = _Waiter()
        self._waiters.append(w)
        self._q.put(frame(report))
        self.exchanges += 1
        await w.done.wait()
        if w.reply is None:
            raise WireError(w.error or "framed connection lost")
        return w.reply

    def handle(self) -> SharedWireHandle:
        return SharedWireHandle(self)


class SharedWireHandle:
    """One node's view of a :class:`SharedWire` (closing it leaves the connection open)."""

    __slots__ = ("shared",)

    def __init__(self, shared: SharedWire) -> None:
        self.shared = shared

    async def exchange(self, report: NodeReport) -> WireReply:
        return await self.shared.exchange(report)

    async def aclose(self) -> None:
        return None
