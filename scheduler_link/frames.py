"""Frames connections: msgpack :class:`~scheduler_link.messages.Frame` envelopes both ways.

The framed channel's second form (DESIGN.md, "Fleet scale"). The placer holds one of these
to each rack relay, and a relay holds one to each member of its rack. Unlike a report
stream (a request from the agent, an answer from the placer, in order), either side may
send requests here: the placer sends a ``bundle`` to a relay and gets ``acks`` back, a
relay sends ``part`` to a member and gets an ``ack``, a relay sends ``report`` and
``beat`` frames up and gets ``reply`` / ``beat_reply``. A request carries ``id`` (> 0);
its answer carries the same number in ``re``. A frame with ``id == 0`` wants no answer.

Framing: u32 big-endian length + the msgpack of a Frame; a frame over ``max_frame`` is a
protocol error and ends the connection. A handler's exception for one frame is logged and
answered with an ``error`` frame; it never ends the connection or escapes -- but a
:class:`Refused` (the peer broke a bound) ends it, with a counted reason (``close_code``).

Bounds per connection (bad input costs its sender; DESIGN.md, Security model): a listener's
channel takes frames of at most ``MEMBER_MAX_FRAME`` bytes and beats of one entry until its
owner admits it as a relay candidate (:meth:`FrameChannel.make_candidate`: ``CANDIDATE_MAX_FRAME``,
beats of up to the rack's size, :func:`check_entries`) or makes it a rack's active relay
(:meth:`FrameChannel.make_relay`: ``MAX_FRAME``); bytes queued for a peer that does not read are bounded
(``max_queued``: past it the connection is closed, ``slow_reader``), and so are the frames
its owner holds back for later (:meth:`FrameChannel.hold`, ``deferred_over``) and the
requests whose answers are being worked on at once (``max_inflight``, ``inflight_over``). An
owner counting rejections that may come per entry (a MAC that does not verify) logs them once
per connection and interval, with a count (:meth:`FrameChannel.tally`).

Opening one: the client sends the framed channel's JSON ``Hello`` (``frames=True``; see
:mod:`scheduler_link.heartbeat_wire`), reads its JSON ``WireReply``, and from then on both
sides speak frames. :func:`open_frames` does that; servers hand the stream to
:class:`FrameChannel` after their hello checks.
"""

from __future__ import annotations

import fcntl
import inspect
import logging
import math
import ssl
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from infra import tls

from .messages import Frame, RelayHello

if TYPE_CHECKING:   # (heartbeat_wire imports this module)
    from .heartbeat_wire import HeartbeatClient, WireReply

log = logging.getLogger("herd.link.frames")

MAX_FRAME = 32 << 20          # a bundle with its blob (an 80,000-node table is ~8 MB)
# A listener's frames from a peer that is not (yet) a rack's active relay: a member's full
# report (GPU inventory, workloads, manifests held: a few KiB), a ping, a blob_get.
MEMBER_MAX_FRAME = 64 << 10
# A connection its owner admitted as a rack's relay candidate (its hello's rack checked) but
# has not chosen yet: what any node may send on its own report stream (heartbeat_wire.MAX_FRAME),
# e.g. the full reports of a rack's members registering through it.
CANDIDATE_MAX_FRAME = 4 << 20
# Bytes queued for one peer (not yet taken by its socket): past this, the peer is a reader
# that does not read and the connection is closed. An active relay's bound holds a
# delivery's bundles (each at most MAX_FRAME); anyone else's, a few answers.
MEMBER_MAX_QUEUED = 1 << 20
RELAY_MAX_QUEUED = 4 * MAX_FRAME
# Frames an owner holds back to apply later (the placer during a delivery), per connection.
MEMBER_MAX_HELD = 1 << 20
# Requests of one peer whose (asynchronous) answers are being worked on at once: a member has
# one report out at a time, and a blob_get or two.
MEMBER_MAX_INFLIGHT = 16
RELAY_MAX_HELD = 2 * MAX_FRAME
TALLY_INTERVAL_S = 10.0       # per connection, one log line per reason this often at most
_LEN = struct.Struct(">I")
_enc = msgspec.msgpack.Encoder()
_frame_dec = msgspec.msgpack.Decoder(Frame)

# handler(channel, frame) -> None | (type, payload struct) | an awaitable of either
Answer = tuple[str, Any] | None
Handler = Callable[["FrameChannel", Frame], Answer | Awaitable[Answer]]


class FrameError(Exception):
    """The other side broke the protocol, or the connection is gone."""


class CallFailed(Exception):
    """A request was answered with an ``error`` frame."""


class Refused(FrameError):
    """The peer broke a bound of this connection: raised by a handler (or a check it calls,
    :func:`check_entries`), it ends the connection with ``code`` as the counted reason; from
    a hello check (a ``FramesHost.opened``), it refuses the connection with that reason."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def check_entries(n: int, limit: int, *, what: str = "beat") -> None:
    """A frame carrying ``n`` per-node entries on a connection allowed ``limit``: raises
    :class:`Refused` (``entries_over``) past it. Pure: checked before any entry is looked at,
    so an oversized frame costs one refusal, not one check (or log line) per entry."""
    if n > limit:
        raise Refused("entries_over", f"a {what} of {n} entries is over this connection's {limit}")


class Tally:
    """Rejections of one kind on one connection, logged at most once per ``interval_s``
    (the first at once, then a count of those since): per-entry rejections never cost one
    log line each. Pure bookkeeping over the clock it is given."""

    __slots__ = ("name", "interval_s", "clock", "total", "_pending", "_last", "_logger")

    def __init__(self, name: str, *, interval_s: float = TALLY_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, logger: logging.Logger | None = None) -> None:
        self.name = name
        self.interval_s = interval_s
        self.clock = clock
        self.total = 0
        self._pending = 0
        self._last = -math.inf
        self._logger = logger or log

    def add(self, reason: str, n: int = 1, detail: str = "") -> None:
        if n <= 0:
            return
        self.total += n
        self._pending += n
        now = self.clock()
        if now - self._last >= self.interval_s:
            self.flush(reason, detail)
            self._last = now

    def flush(self, reason: str, detail: str = "") -> None:
        if self._pending:
            self._logger.warning("frames connection %s: %s count=%d total=%d%s", self.name, reason, self._pending,
                                 self.total, f" last={detail[:200]}" if detail else "")
            self._pending = 0


def encode_frame(type_: str, payload: Any, *, id: int = 0, re: int = 0, term: int = 0) -> bytes:
    body = _enc.encode(Frame(type=type_, payload=msgspec.Raw(_enc.encode(payload)), id=id, re=re,  # type: ignore[arg-type]  # the frame type is checked by the Literal on decode; encoding takes any of ours
                             term=term))
    return _LEN.pack(len(body)) + body


def decode_payload(f: Frame, kind: type[Any]) -> Any:
    return msgspec.msgpack.decode(f.payload, type=kind)


class _Waiter:
    __slots__ = ("done", "frame")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.frame: Frame | None = None

    def resolve(self, f: Frame | None) -> None:
        self.frame = f
        self.done.set()


class _Callback:
    """A call answered by a function instead of a waiting task (:meth:`FrameChannel.call_cb`)."""
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Frame | None], None]) -> None:
        self.fn = fn

    def resolve(self, f: Frame | None) -> None:
        try:
            self.fn(f)
        except Exception:  # the caller's bug: contained, never the connection's end
            log.exception("frames answer callback failed")


class WriteQueue:
    """Bytes queued by any task without blocking, written by one writer task: everything queued
    since the last write goes in one ``send_all`` (many frames per syscall). Shared by frames
    connections and the multiplexed report connection (``heartbeat_wire.SharedWire``).

    ``limit``: the bytes that may wait unwritten (None: unbounded); :meth:`put` past it raises
    :class:`Refused` (``slow_reader``) and queues nothing. One frame is always taken into an
    empty queue, so a bound smaller than a frame still lets one answer through at a time."""

    __slots__ = ("_out", "_wake", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self._out = bytearray()
        self._wake = trio.Event()
        self.limit = limit

    def put(self, data: bytes) -> None:
        if self.limit is not None and self._out and len(self._out) + len(data) > self.limit:
            raise Refused("slow_reader", f"{len(self._out)} bytes wait unread, over the {self.limit} bound")
        self._out += data
        self._wake.set()

    def queued(self) -> int:
        return len(self._out)

    def clear(self) -> None:
        self._out.clear()

    async def write_to(self, stream: trio.abc.SendStream) -> None:
        """Write what is queued as it comes, until cancelled or the stream fails."""
        while True:
            if not self._out:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            data, self._out = bytes(self._out), bytearray()
            await stream.send_all(data)
            del data  # not held while idle (a burst is megabytes)


class ReadBacklog:
    """Connections with bytes still unread in their socket once what was read is applied
    (``FIONREAD``), and since when each was last caught up. A registration storm queues beats
    behind thousands of full reports, maybe for long: the placer judges a node silent only up
    to :meth:`heard_until` (its beats may be in a socket it has not read yet)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._behind: dict[int, float] = {}
        self._serial = 0

    def track(self, stream: trio.abc.Stream) -> BacklogMark:
        self._serial += 1
        return BacklogMark(self, self._serial, _fileno(stream))

    def heard_until(self) -> float | None:
        return min(self._behind.values()) if self._behind else None

    def behind(self) -> int:
        return len(self._behind)


class BacklogMark:
    """One connection's part of a :class:`ReadBacklog`; :meth:`applied` after each batch."""

    __slots__ = ("_owner", "_key", "_fd", "_caught_up")

    def __init__(self, owner: ReadBacklog, key: int, fd: int) -> None:
        self._owner, self._key, self._fd = owner, key, fd
        self._caught_up = owner.clock()

    def applied(self) -> None:
        """What was read so far is applied: caught up now, unless more waits in the socket."""
        if _unread(self._fd):
            self._owner._behind.setdefault(self._key, self._caught_up)
        else:
            self._caught_up = self._owner.clock()
            self._owner._behind.pop(self._key, None)

    def close(self) -> None:
        self._owner._behind.pop(self._key, None)


def _fileno(stream: trio.abc.Stream) -> int:
    """The socket under a plain or TLS stream (-1: none known)."""
    s = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    return s.socket.fileno() if isinstance(s, trio.SocketStream) else -1


def _unread(fd: int) -> int:
    """Bytes waiting in a socket's receive queue, unread (0 when unknown)."""
    if fd < 0:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


class FrameChannel:
    """One frames connection (either side). ``await channel.run(handler)`` serves it until
    it closes; :meth:`call` and :meth:`send` may be used from any task meanwhile."""

    def __init__(self, stream: trio.abc.Stream, *, name: str = "", buf: bytes = b"",
                 max_frame: int = MAX_FRAME, backlog: BacklogMark | None = None,
                 max_queued: int | None = None, max_held: int | None = None, max_entries: int | None = None,
                 max_inflight: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``max_frame``, ``max_queued``, ``max_held``, ``max_entries``, ``max_inflight``: this connection's bounds
        (None: unbounded; a listener passes the small ones, :meth:`make_relay` raises them)."""
        self.stream = stream
        self._backlog = backlog     # the listener's read backlog (ReadBacklog), or None
        # the peer's verified certificate (infra.tls.Principal), None on a plain channel
        self.principal: Any = tls.stream_principal(stream)
        self.name = name
        self.max_frame = max_frame
        self.max_held = max_held
        self.max_entries = max_entries  # per-node entries a beat or reports frame may carry (None: any)
        self.candidate = False          # its owner admitted it as a relay candidate (make_candidate)
        self.held = 0                   # bytes of this peer's frames the owner holds back (hold/release)
        self.max_inflight = max_inflight
        self.inflight = 0               # its requests whose answers are being worked on
        self.relay_racks: tuple[str, ...] = ()   # the racks this connection is the active relay of
        self._in = bytearray(buf)
        self._q = WriteQueue(max_queued)
        self._waiters: dict[int, _Waiter | _Callback] = {}
        self._next_id = 0
        self._scope: trio.CancelScope | None = None   # run()'s, to end it from a bound's check
        self.closed = trio.Event()
        self.frames_in = 0
        self.frames_out = 0
        self.bytes_out = 0
        self.handler_errors = 0
        self.info: Any = None      # what the owner wants to keep with the connection
        self.term = 0              # Frame.term of what this side sends (the placer's epoch; 0 elsewhere)
        self.opened_at = time.monotonic()
        self.close_reason = ""     # why it closed, once it has: for the logs of whoever held it
        self.close_code = ""       # ... when a bound closed it: frame_too_big, slow_reader, deferred_over, ...
        self.rejections = Tally(name, clock=clock)

    # ------------------------------------------------------------ bounds

    @property
    def entry_limit(self) -> int:
        """What :func:`check_entries` holds this connection's beats and report batches to."""
        return (1 << 62) if self.max_entries is None else self.max_entries

    def make_candidate(self, entries: int) -> None:
        """Its owner checked the hello's rack (the node is registered there): a candidate for
        that rack's relay, with frames of a report stream's size and beats of up to
        ``entries``; rack-sized frames wait for :meth:`make_relay`."""
        self.candidate = True
        self.max_frame = max(self.max_frame, CANDIDATE_MAX_FRAME)
        self.max_entries = entries if self.max_entries is None else max(self.max_entries, entries)

    def make_relay(self, rack: str, entries: int) -> None:
        """Make this connection ``rack`` 's active relay (its owner chose it): rack-sized
        frames (``MAX_FRAME``), beats of up to ``entries`` (the rack's size), and the queues
        of a relay. Never lowered again on this connection (a relay that stops being the
        active one still carries what its members sent it meanwhile)."""
        self.candidate = True
        if rack not in self.relay_racks:
            self.relay_racks = (*self.relay_racks, rack)
        self.max_frame = max(self.max_frame, MAX_FRAME)
        self.max_entries = entries if self.max_entries is None else max(self.max_entries, entries)
        self.max_held = None if self.max_held is None else max(self.max_held, RELAY_MAX_HELD)
        if self._q.limit is not None:
            self._q.limit = max(self._q.limit, RELAY_MAX_QUEUED)

    def hold(self, f: Frame) -> bool:
        """The owner keeps ``f`` to apply later (:meth:`release` once it has): False, and the
        connection is closed (``deferred_over``), when that would pass ``max_held``."""
        n = len(f.payload)
        if self.max_held is not None and self.held + n > self.max_held:
            self.refuse(Refused("deferred_over", f"{self.held} bytes held back, over the {self.max_held} bound"))
            return False
        self.held += n
        return True

    def release(self, f: Frame) -> None:
        self.held = max(0, self.held - len(f.payload))

    def tally(self, reason: str, n: int = 1, detail: str = "") -> None:
        """Count ``n`` rejections of the peer's entries; logged once per interval, with a count."""
        self.rejections.add(reason, n, detail)

    def refuse(self, e: Refused) -> None:
        """End the connection for having broken a bound (``close_code``: the counted reason)."""
        if not self.close_code:
            self.close_code = e.code
            self.close_reason = self.close_reason or str(e)[:200]
            log.warning("frames connection %s closed: %s", self.name, str(e)[:200])
        self.closed.set()
        if self._scope is not None:
            self._scope.cancel()

    # ------------------------------------------------------------ sending

    def send(self, type_: str, payload: Any, *, re: int = 0, id: int = 0) -> None:
        """Queue a frame (never blocks; the writer task flushes many frames per syscall)."""
        if self.closed.is_set():
            raise FrameError(f"frames connection {self.name} is closed")
        data = encode_frame(type_, payload, id=id, re=re, term=self.term)
        self._put(data)
        self.frames_out += 1
        self.bytes_out += len(data)

    def send_raw(self, data: bytes) -> None:
        """Queue frames already encoded (``encode_frame``)."""
        if self.closed.is_set():
            raise FrameError(f"frames connection {self.name} is closed")
        self._put(data)
        self.bytes_out += len(data)
        self.frames_out += 1

    def _put(self, data: bytes) -> None:
        try:
            self._q.put(data)
        except Refused as e:  # a peer that does not read: it is closed, the sender told
            self.refuse(e)
            raise

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        """A request encoded now, sent later with :meth:`call_prepared` (its id is taken now)."""
        rid = self.new_id()
        return rid, encode_frame(type_, payload, id=rid, term=self.term)

    async def call_prepared(self, rid: int, data: bytes) -> Frame:
        """Send a :meth:`prepare` d request and wait for its answer (callers bound the wait)."""
        w = self._waiters[rid] = _Waiter()
        try:
            self.send_raw(data)
            await w.done.wait()
        finally:
            self._waiters.pop(rid, None)
        if w.frame is None:
            raise FrameError(f"frames connection {self.name} closed before the answer")
        if w.frame.type == "error":
            raise CallFailed(_error_text(w.frame))
        return w.frame

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        """Send a :meth:`prepare` d request; ``fn`` gets its answer (an ``error`` frame
        included) in the reader task, synchronously, or None once the connection closed
        first. No task waits for it: a round of thousands of calls costs one waiting task,
        not one each. Raises FrameError if the connection is closed already (``fn`` is then
        never called); :meth:`forget` gives up on the answer."""
        self._waiters[rid] = _Callback(fn)
        try:
            self.send_raw(data)
        except FrameError:
            del self._waiters[rid]
            raise

    def forget(self, rid: int) -> None:
        """Stop waiting for ``rid`` 's answer (a callback is then never called)."""
        self._waiters.pop(rid, None)

    async def call(self, type_: str, payload: Any, *, timeout_s: float | None = None) -> Frame:
        """Send a request and wait for its answer (an ``error`` answer raises CallFailed)."""
        rid, data = self.prepare(type_, payload)
        if timeout_s is None:
            return await self.call_prepared(rid, data)
        with trio.fail_after(timeout_s):
            return await self.call_prepared(rid, data)

    # ------------------------------------------------------------ serving

    async def run(self, handler: Handler) -> None:
        """Read and write until the connection closes (then every pending call fails)."""
        try:
            async with trio.open_nursery() as n:
                self._scope = n.cancel_scope
                if self.closed.is_set():   # refused before it ran
                    n.cancel_scope.cancel()
                n.start_soon(self._writer, n.cancel_scope)
                await self._reader(handler, n)
                n.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.debug("frames connection %s broke: %s", self.name, e)
            self.close_reason = self.close_reason or f"broke: {e!r}"[:200]
        finally:
            self.close_reason = self.close_reason or "closed here"
            self.closed.set()
            self.rejections.flush("rejected")
            if self._backlog is not None:
                self._backlog.close()
            waiters = list(self._waiters.values())
            self._waiters.clear()
            for w in waiters:
                w.resolve(None)
            self._q.clear()
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def aclose(self) -> None:
        self.close_reason = self.close_reason or "closed here"
        self.closed.set()
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    async def _writer(self, scope: trio.CancelScope) -> None:
        try:
            await self._q.write_to(self.stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            log.debug("frames connection %s: write failed: %s", self.name, e)
            self.close_reason = self.close_reason or f"write failed: {e!r}"[:200]
            scope.cancel()

    async def _reader(self, handler: Handler, nursery: trio.Nursery) -> None:
        try:
            await self._read_loop(handler, nursery)
        except Refused as e:
            self.refuse(e)

    async def _read_loop(self, handler: Handler, nursery: trio.Nursery) -> None:
        buf = self._in
        while True:
            pos = 0
            size = len(buf)
            while size - pos >= 4:
                (ln,) = _LEN.unpack_from(buf, pos)
                if ln > self.max_frame:
                    raise Refused("frame_too_big", f"a frame of {ln} bytes is over this connection's "
                                                   f"{self.max_frame} limit")
                if size - pos - 4 < ln:
                    break
                body = bytes(buf[pos + 4:pos + 4 + ln])
                pos += 4 + ln
                self._dispatch(body, handler, nursery)
            del buf[:pos]
            if self._backlog is not None:
                self._backlog.applied()
            try:
                data = await self.stream.receive_some(1 << 18)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                self.close_reason = self.close_reason or f"read failed: {e!r}"[:200]
                return
            if not data:
                self.close_reason = self.close_reason or "closed by the peer"
                return
            buf += data

    def _dispatch(self, body: bytes, handler: Handler, nursery: trio.Nursery) -> None:
        self.frames_in += 1
        try:
            f = _frame_dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.handler_errors += 1
            self._answer_error(0, f"malformed frame: {e}")
            return
        if f.re:
            w = self._waiters.pop(f.re, None)
            if w is not None:
                w.resolve(f)
            return  # an answer nobody waits for any more (timed out): dropped
        try:
            out = handler(self, f)
        except Refused as e:   # a bound broken: the connection ends (after its error answer)
            self._answer_error(f.id, str(e))
            self.refuse(e)
            return
        except Exception as e:  # contained to this frame
            self._handler_failed(f, e)
            return
        if inspect.isawaitable(out):
            if self.max_inflight is not None and self.inflight >= self.max_inflight:
                if inspect.iscoroutine(out):
                    out.close()
                self.refuse(Refused("inflight_over", f"over {self.max_inflight} requests worked on at once"))
                return
            self.inflight += 1
            nursery.start_soon(self._finish, f, out)
        elif out is not None and f.id:
            self._answer(f, out)

    async def _finish(self, f: Frame, aw: Awaitable[Answer]) -> None:
        try:
            out = await aw
        except Refused as e:
            self._answer_error(f.id, str(e))
            self.refuse(e)
            return
        except Exception as e:
            self._handler_failed(f, e)
            return
        finally:
            self.inflight -= 1
        if out is not None and f.id and not self.closed.is_set():
            self._answer(f, out)

    def _answer(self, f: Frame, out: tuple[str, Any]) -> None:
        try:
            self.send(out[0], out[1], re=f.id)
        except FrameError:
            pass

    def _handler_failed(self, f: Frame, e: Exception) -> None:
        self.handler_errors += 1
        log.exception("frame handler failed connection=%s type=%s", self.name, f.type, exc_info=e)
        self._answer_error(f.id, f"internal error handling a {f.type} frame")

    def _answer_error(self, rid: int, why: str) -> None:
        if self.closed.is_set():
            return
        try:
            self.send("error", {"error": why}, re=rid)
        except FrameError:
            pass


# What an owner (the placer's relay hub) calls on a connection it holds: no-ops on anything
# that is not a FrameChannel (the hub's tests and benchmarks drive it with small fakes).

def make_candidate(ch: Any, entries: int) -> None:
    """:meth:`FrameChannel.make_candidate`."""
    if isinstance(ch, FrameChannel):
        ch.make_candidate(entries)


def make_relay(ch: Any, rack: str, entries: int) -> None:
    """:meth:`FrameChannel.make_relay`."""
    if isinstance(ch, FrameChannel):
        ch.make_relay(rack, entries)


def hold(ch: Any, f: Frame) -> bool:
    """:meth:`FrameChannel.hold` (True: held)."""
    return ch.hold(f) if isinstance(ch, FrameChannel) else True


def release(ch: Any, f: Frame) -> None:
    """:meth:`FrameChannel.release`."""
    if isinstance(ch, FrameChannel):
        ch.release(f)


def entry_limit(ch: Any) -> int:
    """:attr:`FrameChannel.entry_limit` (a fake: any)."""
    return ch.entry_limit if isinstance(ch, FrameChannel) else 1 << 62


def _error_text(f: Frame) -> str:
    try:
        d = msgspec.msgpack.decode(f.payload)
        return str(d.get("error") if isinstance(d, dict) else d)
    except msgspec.DecodeError:
        return "error"


async def answer_by(c: HeartbeatClient, deadline: float, grace_s: float, *, name: str = "") -> WireReply:
    """The answer to our hello, read by ``c``, by ``deadline``. Past it, an answer whose bytes already wait
    unread here (in our socket, or half read) came in time: this side was late to read it (a
    host whose CPU is taken, an emulator playing a thousand of them), so it is read, within
    ``grace_s`` more, rather than the connection the peer accepted being closed and dialled
    again (in a registration storm, another handshake for a placer that is busy already).
    Nothing waiting: ``trio.TooSlowError``, as before."""
    with trio.move_on_at(deadline):
        (r,) = await c.receive(1)
        return r
    if not c.buf and not _unread(_fileno(c.stream)):
        raise trio.TooSlowError
    log.info("frames connection %s: the answer to its hello came in time and waited unread past the deadline: "
             "read now", name)
    with trio.fail_after(grace_s):
        (r,) = await c.receive(1)
        return r


async def open_frames(url: str, token: str, node_id: str, *, relay: RelayHello | None = None,
                      local_address: str | None = None, timeout_s: float = 10.0,
                      name: str | None = None, ssl_context: ssl.SSLContext | None = None,
                      expect: str | None = None) -> FrameChannel:
    """Dial a frames listener (the placer's framed channel, or a relay's members listener),
    say hello, and return the channel (not yet running: ``nursery.start_soon(ch.run, h)``).
    With ``ssl_context`` the connection is mutual TLS and the peer must be ``expect``
    (``placer``, ``node:<relay>``, or ``node``: any node's certificate)."""
    from .heartbeat_wire import HeartbeatClient, Hello, WireError, frame, parse_wire_url

    host, port = parse_wire_url(url)
    deadline = trio.current_time() + timeout_s
    with trio.fail_at(deadline):
        stream = await tls.connect(host, port, ssl_context, expect=expect, local_address=local_address)
    c = HeartbeatClient(stream)
    try:
        with trio.fail_at(deadline):
            await stream.send_all(frame(Hello(token=token, node_id=node_id, frames=True,
                                              relay=bool(relay and relay.racks),
                                              racks=list(relay.racks) if relay else [],
                                              listen_url=relay.listen_url if relay else None)))
        r = await answer_by(c, deadline, timeout_s, name=name or node_id)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    if r.status != 200:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise WireError(f"frames connection refused: {r.status} {r.error}")
    return FrameChannel(stream, name=name or node_id, buf=bytes(c.buf))
