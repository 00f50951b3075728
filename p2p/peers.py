"""Talking to peers' data planes, and keeping score of how they behave.

:class:`PeerClient` is the one seam to other nodes: ``get_chunk`` (with ``wait_ms``),
``get_chunk_verified``, ``get_manifest``. It maps every transport failure to a
:class:`PeerError` subclass and bounds what a peer may send (never more than the chunk's
size). ``get_chunk`` verifies nothing (its caller hashes); ``get_chunk_verified`` checks
BLAKE3 itself and raises :class:`PeerCorrupt`.

Two receive paths, one behaviour (tests/test_peer_receive.py): a body of at least
``THREAD_BODY_MIN`` on a plain connection is received by a worker thread (``readv`` into
the preallocated buffer, woken per ``RCVLOWAT`` bytes, hashing each piece as it lands when
asked), so receiving and hashing of many chunks run on several cores while the trio
thread runs the protocol; smaller bodies, TLS and a rate cap use the trio thread. With TLS
(``ssl_context``) peers are https:// and a plain URL is refused.

Timeouts are cancel scopes here, at the call site: the answer's head must come within
``wait_ms + head_grace_s``; once the body started, no ``stall_s`` without bytes.

:class:`PeerHealth` is the penalty book (plain data, ``now`` passed in): a peer that
sent bad bytes is banned for the rest of the fetch; a peer that errs or stalls cools
down for ``penalty_s`` (doubling with repeats), during which it ranks behind healthy
peers. Its ``penalties(now)`` feeds :func:`p2p.rendezvous.plan_sources`.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import blake3
import msgspec
import trio

from infra.backoff import Backoff
from infra.errors import ProtocolError
from infra.grants import HEADER as GRANT_HEADER
from infra.grants import MAX_PROOFS
from infra.h1 import ClosedBeforeAnswer, ClosedMidHead, HeadTooLarge, parse_response_head, receive_head
from infra.tls import TLSError, expect_peer

from .batch import (
    FRAME,
    FrameReader,
    Handoff,
    Received,
    Stop,
    StopLike,
    TLSFrameReader,
    poll_ms,
    query_of,
    receive_frames,
)
from .batch import tls_session as _session
from .batch import watch as _watch
from .errors import PeerError
from .ratelimit import AsyncBucket

log = logging.getLogger("herd.p2p.peers")


class PeerTimeout(PeerError):
    """The peer accepted but did not answer (or stopped sending) in time."""


class PeerUnavailable(PeerError):
    """The peer could not be reached, refused, or is busy (503)."""


class PeerRefused(PeerError):
    """The peer answered 403: this node may not read that (reads by membership,
    :mod:`p2p.readers`). ``reason``: the peer's structured reason (``not_a_member``, ...)."""

    def __init__(self, msg: str, reason: str = "") -> None:
        super().__init__(f"{msg} ({reason})" if reason else msg)
        self.reason = reason


class PeerBusy(PeerUnavailable):
    """The peer answered 503: over its request limits. Not a fault: try the next source.
    ``retry_after_s``: what the peer asked for (x-herd-retry-ms, else Retry-After), or 0."""

    def __init__(self, msg: str, retry_after_s: float = 0.0) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s


class PeerCorrupt(PeerError):
    """The peer's bytes do not hash to what was asked for. ``nbytes``: how many came."""

    def __init__(self, msg: str, nbytes: int = 0) -> None:
        super().__init__(msg)
        self.nbytes = nbytes


class PeerMissing(PeerError):
    """The peer answered 404: it does not have the object (after waiting, if asked to)."""


@dataclass(frozen=True, slots=True)
class PeerClientConfig:
    head_grace_s: float = 5.0      # on top of wait_ms, for the answer's head to arrive
    stall_s: float = 10.0          # no body bytes for this long: a stalled peer
    connect_s: float = 3.0
    rate_bps: float | None = None  # optional cap on bytes/s received from all peers


class _Conn:
    """One keep-alive connection. Plain: the raw trio socket (``recv_into`` straight into
    the body's buffer, no copies). TLS: a ``trio.SSLStream`` (records decrypted into
    Python bytes, then copied into the body's buffer)."""
    __slots__ = ("stream", "sock", "tls", "buf", "used")

    def __init__(self, stream: trio.SocketStream, tls: trio.SSLStream[trio.SocketStream] | None = None) -> None:
        self.stream = stream
        self.sock = stream.socket
        self.tls = tls
        self.buf = bytearray()     # bytes received past the last response
        self.used = False

    def close(self) -> None:
        self.sock.close()

    async def send(self, data: bytes) -> None:
        if self.tls is not None:
            try:
                await self.tls.send_all(data)
            except trio.BrokenResourceError as e:
                raise OSError(str(e.__cause__ or e)) from None
            return
        sent = 0
        while sent < len(data):
            sent += await self.sock.send(data[sent:])

    async def recv(self, n: int) -> bytes | bytearray:
        if self.tls is not None:
            try:
                return await self.tls.receive_some(max(n, 1))
            except trio.BrokenResourceError as e:
                raise ConnectionResetError(str(e.__cause__ or e)) from None
        return await self.sock.recv(n)

    async def recv_into(self, view: memoryview, n: int) -> int:
        if self.tls is None:
            return await self.sock.recv_into(view, n)
        data = await self.recv(n)
        view[:len(data)] = data
        return len(data)


class PeerClient:
    """A lean HTTP/1.1 GET client for peers' data planes: keep-alive connections per
    peer, the head parsed by hand (our own server's answers: Content-Length framing),
    the body received with ``recv_into`` straight into one buffer of the announced size.
    httpx costs several times more CPU per byte here, and the herd moves every byte
    of the artifact through this path on every node."""

    MAX_HEAD = 16 * 1024
    MAX_IDLE_PER_PEER = 32
    RCVLOWAT = 128 * 1024
    THREAD_BODY_MIN = 256 * 1024   # bodies at least this large are received in a worker thread
    MAX_THREADS = 16               # ... at most this many at once

    def __init__(self, *, token: str | None, config: PeerClientConfig | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: speak TLS to peers (their data URLs must then be https://; a
        plain http:// peer is refused rather than spoken to in the clear)."""
        self.config = config or PeerClientConfig()
        self._ssl = ssl_context
        self._auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
        self._grants: dict[str, tuple[str, float]] = {}   # manifest id -> (proof, expiry), oldest first
        self._grant_line = b""                           # the header the grants make
        self._grant_line_until = math.inf                # ... until the first of them expires
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._bucket = AsyncBucket(self.config.rate_bps)
        self._threads = trio.CapacityLimiter(self.MAX_THREADS)

    def use_tls(self, ssl_context: ssl.SSLContext | None) -> None:
        """Speak TLS to peers from now on (an agent whose certificate came by bootstrap after
        its herd was made); connections kept idle are dropped, never reused across the change."""
        self._ssl = ssl_context
        self._idle.clear()

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    def set_grant(self, manifest_id: str, proof: str, expires_at: float) -> None:
        """Present ``proof`` (a read grant's, :func:`infra.grants.prove`) with every request over
        TLS until ``expires_at`` (wall clock): peers outside this node's gang that hold the
        manifest (the placer's contacts) serve it on the grant's word. The most recent
        ``MAX_PROOFS`` grants go."""
        self._grants.pop(manifest_id, None)
        self._grants[manifest_id] = (proof, expires_at)
        self._grant_line_until = -math.inf

    def _grants_header(self) -> bytes:
        now = time.time()
        if now < self._grant_line_until:
            return self._grant_line
        self._grants = {m: g for m, g in self._grants.items() if g[1] >= now}
        live = list(self._grants.values())[-MAX_PROOFS:]
        self._grant_line = (f"{GRANT_HEADER}: {','.join(p for p, _ in live)}\r\n".encode() if live else b"")
        self._grant_line_until = min((e for _, e in live), default=math.inf)
        return self._grant_line

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    async def get_chunk(self, base_url: str, chunk_id: str, size: int, *, wait_ms: int = 0,
                        gate: trio.CapacityLimiter | None = None) -> bytes:
        """The chunk's bytes as the peer sent them (unverified), exactly ``size`` bytes.
        ``gate``: held while the body is received (after the answer's head came), to bound
        how many peer bodies flow in at once; a waiting request holds nothing."""
        path = f"/v1/chunks/{chunk_id}" + (f"?wait_ms={int(wait_ms)}" if wait_ms > 0 else "")
        return await self._get(base_url, path, limit=size, head_s=wait_ms / 1000 + self.config.head_grace_s,
                               exact=True, gate=gate)

    async def get_chunk_verified(self, base_url: str, chunk_id: str, size: int, *, wait_ms: int = 0,
                                 gate: trio.CapacityLimiter | None = None) -> bytes:
        """:meth:`get_chunk`, verified: the bytes hash to ``chunk_id`` (BLAKE3, computed
        as they arrive, in the receiving worker thread for large bodies), else
        :class:`PeerCorrupt` (the peer sent bad bytes: ban it)."""
        path = f"/v1/chunks/{chunk_id}" + (f"?wait_ms={int(wait_ms)}" if wait_ms > 0 else "")
        data, digest = await self._get_hashed(base_url, path, limit=size,
                                              head_s=wait_ms / 1000 + self.config.head_grace_s,
                                              exact=True, gate=gate, hashed=True)
        if digest != chunk_id:
            raise PeerCorrupt(f"{base_url}: chunk {chunk_id[:16]} does not match its hash", len(data))
        return data

    async def get_chunks(self, base_url: str, items: Sequence[tuple[str, int]], *,
                         store: Callable[[str, memoryview], object],
                         gate: trio.CapacityLimiter | None = None, wait_ms: int = 0) -> Received:
        """Several chunks in one request (``GET /v1/chunks?ids=``, :mod:`p2p.batch`), each
        verified (BLAKE3 as its bytes land) and handed to ``store(id, bytes)`` as soon as
        it is complete: in the receiving worker thread on plain connections (``store``
        must be thread-safe; ``ChunkStore.put_chunk`` is), in a worker thread after the
        answer under TLS or a rate cap. ``items``: (id, size) as the manifest says.

        Returns a :class:`p2p.batch.Received`: per chunk "ok" (stored), "missing",
        "busy", "corrupt" (refused: ban the peer); an answer cut short (the peer died,
        reset, stalled, broke the framing, or ``store`` raised: ``store_error``) keeps
        what came before the cut, and ``error``/``kind`` say why the rest did not come.
        Raises (nothing stored) :class:`PeerMissing` (none is there), :class:`PeerBusy`
        (503), :class:`PeerTimeout` / :class:`PeerUnavailable` / :class:`PeerError` when
        no answer came. ``gate``: held while the body flows in, like :meth:`get_chunk`.

        ``wait_ms`` > 0: a batch that can wait (the peer is fetching these chunks itself):
        the answer's head may take ``wait_ms`` (+ ``head_grace_s``), each frame up to
        ``wait_ms`` + ``stall_s`` to start; a 404 means the first chunk did not come in time,
        an answer cut short keeps the frames before the cut."""
        if not items:
            return Received()
        key = self._hostport(base_url)
        path = "/v1/chunks?" + query_of([cid for cid, _ in items], [n for _, n in items], wait_ms)
        for attempt in (0, 1):
            conn = await self._connect(key)
            reused = conn.used
            keep = False
            try:
                got, keep = await self._exchange_batch(conn, key, path, items, store, gate, wait_ms)
                return got
            except _StaleConnection:
                if reused and attempt == 0:
                    continue
                raise PeerUnavailable(f"{base_url}/v1/chunks: connection closed before an answer") from None
            finally:
                if keep:
                    self._release(key, conn)
                else:
                    conn.close()
        raise PeerUnavailable(f"{base_url}/v1/chunks: no connection")  # pragma: no cover

    async def _exchange_batch(self, conn: _Conn, key: tuple[str, int], path: str,
                              items: Sequence[tuple[str, int]], store: Callable[[str, memoryview], object],
                              gate: trio.CapacityLimiter | None, wait_ms: int = 0) -> tuple[Received, bool]:
        cfg = self.config
        where = f"http://{key[0]}:{key[1]}/v1/chunks ({len(items)} chunks{', waiting' if wait_ms else ''})"
        most = sum(FRAME.size + size for _, size in items)
        gap_s = wait_ms / 1000 + cfg.stall_s if wait_ms > 0 else 0.0
        try:
            status, length, keep, head, rest = await self._head(conn, key, path, wait_ms / 1000 + cfg.head_grace_s,
                                                                where)
            if status != 200:
                if length > 64 * 1024:
                    raise PeerError(f"{where}: HTTP {status} with a {length}-byte body")
                small = bytearray(length)
                got = min(len(rest), length)
                small[:got] = rest[:got]
                with memoryview(small) as v:
                    await self._body_in_loop(conn, v, got, length, where)
                _raise_for(status, where, head)
            if not FRAME.size * len(items) <= length <= most:
                raise PeerError(f"{where}: announces {length} bytes, not between {FRAME.size * len(items)} and {most}")
            if len(rest) > length:
                raise PeerError(f"{where}: sent more than announced")
            if gate is not None:
                await gate.acquire()
            try:
                if self.config.rate_bps is None and (conn.tls is None or _session(conn.tls) is not None):
                    got_ = await self._frames_in_thread(conn, rest, items, length, store, gap_s)
                else:
                    got_ = await self._frames_in_loop(conn, rest, items, length, store, where, gap_s)
            finally:
                if gate is not None:
                    gate.release()
        except OSError as e:
            raise PeerUnavailable(f"{where}: {e.strerror or e}") from None
        if got_.kind:
            got_.error = f"{where}: {got_.error}"
        return got_, keep and not got_.kind

    async def _frames_in_thread(self, conn: _Conn, rest: bytes, items: Sequence[tuple[str, int]], length: int,
                                store: Callable[[str, memoryview], object], gap_s: float = 0.0) -> Received:
        """The frames received, verified and stored by a worker thread (its own duplicate
        of the socket; abandoned on cancel: it stops at once, a ``Stop``). Under TLS the
        thread decrypts too, with the connection's own session (borrowed from its
        ``trio.SSLStream``, which nothing else uses meanwhile: this task holds the
        connection; a cut or cancelled batch closes it, so the session is never used
        by two threads)."""
        stop = Stop()
        fd = os.dup(conn.sock.fileno())
        session = _session(conn.tls) if conn.tls is not None else None
        reader: FrameReader
        if session is not None:
            reader = TLSFrameReader(fd, session, rest, self.config.stall_s, stop, gap_s=gap_s)
        else:
            reader = FrameReader(fd, rest, self.config.stall_s, stop, self.RCVLOWAT, gap_s=gap_s)
        hand = Handoff()
        job = partial(hand.run, partial(receive_frames, reader, items, length, store))
        try:
            got = await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self._threads)
        except BaseException:
            stop.set()
            raise
        finally:
            if hand.keep():
                reader.close()
        assert isinstance(got, Received)
        return got

    async def _frames_in_loop(self, conn: _Conn, rest: bytes, items: Sequence[tuple[str, int]], length: int,
                              store: Callable[[str, memoryview], object], where: str, gap_s: float = 0.0) -> Received:
        """TLS or a rate cap: the answer received here (at most ``max_batch_bytes``), then
        its frames verified and stored in a worker thread. A cut answer: the frames
        complete before the cut are kept."""
        body = bytearray(length)
        got = min(len(rest), length)
        body[:got] = rest[:got]
        end = ("closed", "")
        seen = [got]
        try:
            with memoryview(body) as v:
                # a batch that can wait: here the gap allowance covers the whole body
                await self._body_in_loop(conn, v, got, length, where, seen, stall_s=gap_s or None)
        except PeerError as e:
            end = ("stall" if isinstance(e, PeerTimeout) else "closed", str(e))
            body = body[:seen[0]]
        reader = FrameReader(-1, body, end=end)
        return await trio.to_thread.run_sync(partial(receive_frames, reader, items, length, store))

    async def get_manifest(self, base_url: str, manifest_id: str, *, limit: int = 64 << 20,
                           wait_ms: int = 0) -> bytes:
        """The manifest's bytes (unverified). ``wait_ms``: the peer waits that long (its
        cap: 2 s) for the manifest to arrive before answering 404."""
        path = f"/v1/manifests/{manifest_id}" + (f"?wait_ms={int(wait_ms)}" if wait_ms > 0 else "")
        return await self._get(base_url, path, limit=limit,
                               head_s=wait_ms / 1000 + self.config.head_grace_s, exact=False)

    async def get_have(self, base_url: str, manifest_id: str, nchunks: int) -> bytes:
        """The peer's have-bitmap over the manifest's chunk table (``nchunks`` bits)."""
        return await self._get(base_url, f"/v1/have/{manifest_id}", limit=(nchunks + 7) // 8,
                               head_s=self.config.head_grace_s, exact=True)

    # ------------------------------------------------------------------ transport

    def _hostport(self, base_url: str) -> tuple[str, int]:
        u = urlsplit(base_url)
        want = "https" if self._ssl is not None else "http"
        if u.scheme != want or not u.hostname:
            why = " (this node speaks TLS to peers)" if self._ssl is not None else ""
            raise PeerError(f"peer URL {base_url!r}: want {want}://host:port{why}")
        return u.hostname, u.port or (443 if self._ssl is not None else 80)

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            return idle.pop()
        host, port = key
        stream: trio.SocketStream | None = None
        with trio.move_on_after(self.config.connect_s):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as e:
                raise PeerUnavailable(f"{host}:{port}: {e.strerror or e}") from None
            if self._ssl is None:
                return _Conn(stream)
            tls = trio.SSLStream(stream, self._ssl, server_hostname=host, https_compatible=True)
            try:
                await tls.do_handshake()
                # the cluster token goes to nodes only (the context refused revoked ones already)
                expect_peer(tls, "node")
            except trio.BrokenResourceError as e:
                stream.socket.close()
                raise PeerUnavailable(f"{host}:{port}: TLS handshake failed: {e.__cause__ or e}") from None
            except TLSError as e:
                stream.socket.close()
                raise PeerError(f"{host}:{port}: {e}") from None
            return _Conn(stream, tls)
        if stream is not None:
            stream.socket.close()
        what = "TLS handshake" if stream is not None else "connect"
        raise PeerTimeout(f"{host}:{port}: {what} timed out after {self.config.connect_s:.1f}s")

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.MAX_IDLE_PER_PEER:
            conn.used = True
            idle.append(conn)
        else:
            conn.close()

    async def _get(self, base_url: str, path: str, *, limit: int, head_s: float, exact: bool,
                   gate: trio.CapacityLimiter | None = None) -> bytes:
        return (await self._get_hashed(base_url, path, limit=limit, head_s=head_s, exact=exact, gate=gate))[0]

    async def _get_hashed(self, base_url: str, path: str, *, limit: int, head_s: float, exact: bool,
                          gate: trio.CapacityLimiter | None = None, hashed: bool = False) -> tuple[bytes, str | None]:
        key = self._hostport(base_url)
        for attempt in (0, 1):
            conn = await self._connect(key)
            reused = conn.used
            ok = False
            try:
                data, keep, digest = await self._exchange(conn, key, path, limit=limit, head_s=head_s,
                                                          exact=exact, gate=gate, hashed=hashed)
                ok = keep
                return data, digest
            except _StaleConnection:
                if reused and attempt == 0:  # the peer closed an idle keep-alive: once more, fresh
                    continue
                raise PeerUnavailable(f"{base_url}{path}: connection closed before an answer") from None
            finally:
                if ok:
                    self._release(key, conn)
                else:
                    conn.close()
        raise PeerUnavailable(f"{base_url}{path}: no connection")  # pragma: no cover

    async def _exchange(self, conn: _Conn, key: tuple[str, int], path: str, *, limit: int,
                        head_s: float, exact: bool, gate: trio.CapacityLimiter | None = None,
                        hashed: bool = False) -> tuple[bytes, bool, str | None]:
        """(body, keep-alive, BLAKE3 hex of the body when ``hashed`` or when it was
        received by a worker thread, which hashes as it receives; else None)."""
        digest: str | None = None
        where = f"http://{key[0]}:{key[1]}{path}"
        try:
            status, length, keep, head, rest = await self._head(conn, key, path, head_s, where)
            if status == 200 and (length > limit or (exact and length != limit)):
                raise PeerError(f"{where}: announces {length} bytes, expected {limit}")
            if status != 200 and length > 64 * 1024:
                raise PeerError(f"{where}: HTTP {status} with a {length}-byte body")
            body = bytearray(length)
            view = memoryview(body)
            got = min(len(rest), length)
            view[:got] = rest[:got]
            if len(rest) > length:  # pipelined leftovers cannot happen with one request in flight
                raise PeerError(f"{where}: sent more than announced")
            held = False
            if gate is not None and status == 200 and got < length:
                await gate.acquire()
                held = True
            try:
                if (status == 200 and conn.tls is None and length - got >= self.THREAD_BODY_MIN
                        and self.config.rate_bps is None):
                    digest = await self._body_in_thread(conn, body, got, length, where, hashed)
                else:
                    await self._body_in_loop(conn, view, got, length, where)
                    if hashed and status == 200:
                        digest = blake3.blake3(body).hexdigest()
            finally:
                if held and gate is not None:
                    gate.release()
            view.release()
        except OSError as e:
            raise PeerUnavailable(f"{where}: {e.strerror or e}") from None
        _raise_for(status, where, head)
        return body, keep, digest  # type: ignore[return-value]  # a bytearray: no copy; hashed and stored as is

    async def _head(self, conn: _Conn, key: tuple[str, int], path: str, head_s: float,
                    where: str) -> tuple[int, int, bool, bytes, bytes]:
        """Send the GET and read the answer's head: (status, Content-Length, keep-alive,
        the head, the bytes that came after it)."""
        cfg = self.config
        req = (f"GET {path} HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\n").encode() + self._auth
        if self._grants and self._ssl is not None:
            req += self._grants_header()
        req += b"\r\n"
        with trio.move_on_after(cfg.stall_s) as cs:
            try:
                await conn.send(req)
            except OSError:  # e.g. EPIPE on a keep-alive connection the peer closed
                raise _StaleConnection() from None
        if cs.cancelled_caught:
            raise PeerTimeout(f"{where}: could not send the request")
        with trio.move_on_after(head_s + cfg.connect_s) as cs:
            try:
                head, rest = await receive_head(partial(conn.recv, 65536), conn.buf, max_head=self.MAX_HEAD)
            except ClosedBeforeAnswer:
                raise _StaleConnection() from None
            except ClosedMidHead:
                raise PeerUnavailable(f"{where}: closed mid-head") from None
            except HeadTooLarge as e:
                raise PeerError(f"{where}: {e}") from None
        if cs.cancelled_caught:
            raise PeerTimeout(f"no answer from {where} within {head_s + cfg.connect_s:.1f}s")
        conn.buf = bytearray()
        status, length, keep = _parse_head(head, where)
        if length is None:
            raise PeerError(f"{where}: answer without Content-Length")
        return status, length, keep, head, bytes(rest)

    async def _body_in_loop(self, conn: _Conn, view: memoryview, got: int, length: int, where: str,
                            seen: list[int] | None = None, stall_s: float | None = None) -> None:
        """Receive the rest of a body in the trio thread (TLS, small bodies, a rate cap).
        ``seen[0]``: how many bytes are in (kept up to date, for a caller that keeps a
        cut body's complete part)."""
        sock = conn.sock
        # SO_RCVLOWAT: be woken when a good piece has arrived, not per packet. On a
        # paced link packets trickle in, and a wakeup per 1.4 kB costs more CPU than
        # everything else on this path together.
        lowat = 1
        try:
            while got < length:
                want = min(length - got, self.RCVLOWAT)
                if want != lowat and conn.tls is None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                with trio.move_on_after(stall_s or self.config.stall_s) as cs:
                    try:
                        n = await conn.recv_into(view[got:], length - got)
                    except OSError as e:
                        raise PeerUnavailable(f"{where}: {e.strerror or e} after {got} of {length} bytes") from None
                if cs.cancelled_caught:
                    raise PeerTimeout(f"{where}: stalled after {got} of {length} bytes")
                if n == 0:
                    raise PeerUnavailable(f"{where}: closed after {got} of {length} bytes")
                got += n
                if seen is not None:
                    seen[0] = got
                await self._bucket.consume(n)
        finally:
            if lowat != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def _body_in_thread(self, conn: _Conn, body: bytearray, got: int, length: int, where: str,
                              hashed: bool) -> str | None:
        """Receive the rest of a body in a worker thread, hashing it as it arrives when
        ``hashed`` (its BLAKE3 hex; else None). The trio thread is free meanwhile (receives, hashes and writes of
        other chunks run on other cores: all three release the GIL).

        The thread works on its own duplicate of the socket's descriptor. If this task is
        cancelled (a race lost), the thread is abandoned: it notices at once (a ``Stop``),
        stops reading and closes its duplicate; the connection is closed here as usual."""
        stop = Stop()
        tfd = os.dup(conn.sock.fileno())
        job = partial(_receive_and_hash, tfd, body, got, length, self.config.stall_s, stop,
                      conn.sock.setsockopt, self.RCVLOWAT, hashed)
        try:
            outcome, n, digest = await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self._threads)
        except BaseException:
            stop.set()
            raise
        if outcome == "stall":
            raise PeerTimeout(f"{where}: stalled after {n} of {length} bytes")
        if outcome == "closed":
            raise PeerUnavailable(f"{where}: closed after {n} of {length} bytes")
        if outcome != "ok":
            raise PeerUnavailable(f"{where}: {outcome} after {n} of {length} bytes")
        return digest if hashed else None


class _StaleConnection(Exception):
    pass




def _receive_and_hash(fd: int, body: bytearray, got: int, length: int, stall_s: float, stop: StopLike,
                      setsockopt: Callable[[int, int, int], None], lowat_max: int,
                      hashed: bool) -> tuple[str, int, str]:
    """Worker thread: receive ``body[got:length]`` from the non-blocking socket ``fd``
    (a duplicate this function closes), hashing each piece as it lands (when ``hashed``;
    else the digest is ""). ``SO_RCVLOWAT``
    (through ``setsockopt``, up to ``lowat_max``) makes each wakeup carry a large piece.
    Returns (outcome, bytes received, BLAKE3 hex): outcome "ok", "stall" (no byte for
    ``stall_s``), "closed", "stopped" (``stop`` was set) or an error's text."""
    view = memoryview(body)
    hasher = blake3.blake3() if hashed else None
    done = got
    if got and hasher is not None:
        hasher.update(view[:got])
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    watched = _watch(poller, stop)
    last = time.monotonic()
    lowat = 1
    try:
        while got < length:
            if stop.is_set():
                return "stopped", got, ""
            want = min(length - got, lowat_max)
            if want != lowat:
                setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                lowat = want
            if not poller.poll(poll_ms(watched, stall_s - (time.monotonic() - last))):
                if time.monotonic() - last >= stall_s:
                    return "stall", got, ""
                continue
            try:
                n = os.readv(fd, [view[got:length]])
            except BlockingIOError:
                continue
            if n == 0:
                return "closed", got, ""
            got += n
            last = time.monotonic()
            if hasher is not None:
                hasher.update(view[done:got])
                done = got
        return "ok", got, hasher.hexdigest() if hasher is not None else ""
    except OSError as e:   # a reset, or the socket closed under an abandoned thread
        return e.strerror or str(e), got, ""
    finally:
        view.release()
        os.close(fd)
        if lowat != 1:
            try:
                setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass


def _raise_for(status: int, where: str, head: bytes) -> None:
    if status == 404:
        raise PeerMissing(f"{where}: not there")
    if status == 503:
        raise PeerBusy(f"{where}: busy", _retry_after_s(head))
    if status == 403:
        raise PeerRefused(f"{where}: refused", _refusal(head))
    if status != 200:
        raise PeerError(f"{where}: HTTP {status}")


def _refusal(head: bytes) -> str:
    """A 403's structured reason (``x-herd-refused``: p2p.readers.ReadRefusal), or ""."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-herd-refused":
            v = value.strip()[:32].decode("ascii", "replace")
            return v if v.replace("_", "").isalnum() else ""
    return ""


def _retry_after_s(head: bytes) -> float:
    """A 503's wait hint, bounded to [0, 30] s; 0 when absent or malformed."""
    ms = sec = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        if name == b"x-herd-retry-ms" and value.isdigit() and len(value) < 9:
            ms = int(value) / 1000
        elif name == b"retry-after" and value.isdigit() and len(value) < 9:
            sec = float(int(value))
    got = ms if ms is not None else sec
    return min(max(got or 0.0, 0.0), 30.0)


def _parse_head(head: bytes, where: str) -> tuple[int, int | None, bool]:
    try:
        h = parse_response_head(head)
    except ProtocolError as e:
        raise PeerError(f"{where}: {e}") from None
    return h.status, h.length, h.keep_alive


class PeerStats(msgspec.Struct, kw_only=True):
    bytes: int = 0
    chunks: int = 0
    errors: int = 0
    integrity_errors: int = 0
    timeouts: int = 0
    misses: int = 0
    last_error: str | None = None


@dataclass(slots=True)
class PeerHealth:
    """The penalty book. One owner (the fetcher); plain data; ``now`` passed in."""
    penalty_s: float = 30.0
    until: dict[str, float] = field(default_factory=dict)
    strikes: dict[str, int] = field(default_factory=dict)
    stats: dict[str, PeerStats] = field(default_factory=dict)

    def _s(self, node_id: str) -> PeerStats:
        s = self.stats.get(node_id)
        if s is None:
            s = self.stats[node_id] = PeerStats()
        return s

    def ok(self, node_id: str, nbytes: int) -> None:
        s = self._s(node_id)
        s.bytes += nbytes
        s.chunks += 1
        self.strikes.pop(node_id, None)

    def missing(self, node_id: str) -> None:
        """404 after waiting, or 503 busy: not a fault (it may not be fetching this
        artifact, or it is serving many); no penalty, the next source is tried."""
        self._s(node_id).misses += 1

    def bad_bytes(self, node_id: str, detail: str) -> None:
        s = self._s(node_id)
        s.integrity_errors += 1
        s.last_error = detail
        self.until[node_id] = math.inf
        log.warning("peer sent bad bytes; banned node=%s detail=%s", node_id, detail)

    def failed(self, node_id: str, err: Exception, now: float) -> None:
        s = self._s(node_id)
        s.errors += 1
        if isinstance(err, PeerTimeout):
            s.timeouts += 1
        s.last_error = str(err)[:200]
        n = self.strikes[node_id] = self.strikes.get(node_id, 0) + 1
        if self.until.get(node_id) != math.inf:
            # doubling with each strike up to 64x; no jitter: it orders sources, nobody retries on it
            self.until[node_id] = now + Backoff(self.penalty_s, self.penalty_s * 64, jitter=0.0).window(n)
        log.info("peer failed node=%s strikes=%d err=%s", node_id, n, err)

    def penalties(self, now: float) -> dict[str, float]:
        return {n: u for n, u in self.until.items() if u > now}

    def snapshot(self) -> dict[str, Any]:
        return {n: msgspec.structs.asdict(s) for n, s in sorted(self.stats.items())}
