"""GETs of a plain ``http://`` origin on raw trio sockets: the herd's origin reads.

Why not httpx here: in the namespace bench (``python -m bench.herd``) httpx's body
iteration (h11 events, httpcore's 64 KiB reads, a bytearray grown piece by piece and
copied into bytes, a Response built around it) was about half of a home node's Python
time under the GIL while it read its chunks from the origin (py-spy ``--gil``). This
client sends one GET on a kept-alive connection, parses the answer's head with the
project's HTTP/1 head parser (:func:`infra.h1.parse_response_head`), and
receives a Content-Length body with ``recv_into`` straight into one preallocated buffer,
woken per ``PIECE`` bytes (``SO_RCVLOWAT``), not per packet.

It takes only what it can take exactly: a Content-Length answer in the identity coding.
A chunked or close-delimited answer, or a content coding returns None, and
:class:`p2p.origins.transport.RetryingClient` asks httpx for that request instead (codings
decoded). A redirect is an answer like any other error: never followed. Failures to connect or to receive
(refused, reset, closed early, a stall of ``timeout`` seconds, a malformed head) raise
:class:`LeanUnavailable`, which the caller retries like httpx's transport errors and
timeouts; a body over its bound is an ``OriginError`` (not retried), as there.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

import trio

from infra.errors import ProtocolError
from infra.h1 import ClosedBeforeAnswer, parse_response_head, receive_head

from ..errors import OriginError

MAX_HEAD = 64 << 10


class LeanUnavailable(Exception):
    """A request that did not come back whole: worth asking again (``timed_out``: a
    stall or a connect timeout rather than a refusal or a reset)."""

    def __init__(self, why: str, *, timed_out: bool = False) -> None:
        super().__init__(why)
        self.timed_out = timed_out


@dataclass(slots=True)
class LeanResponse:
    """What callers of ``RetryingClient.request`` read of an answer."""
    status_code: int
    content: bytes            # a bytearray in fact (no copy): bytes-like, not to be mutated
    head: bytes = b""

    @property
    def text(self) -> str:
        return bytes(self.content).decode("utf-8", "replace")


@dataclass(slots=True)
class _Conn:
    sock: trio.socket.SocketType
    buf: bytearray = field(default_factory=bytearray)   # bytes received past the last answer
    used: bool = False

    def close(self) -> None:
        self.sock.close()


class LeanHttp:
    """Kept-alive connections to one ``http://`` origin; ``get`` is its one operation."""

    PIECE = 128 * 1024

    def __init__(self, *, max_idle: int = 32, timeout: float = 60.0, connect_timeout: float = 10.0,
                 connect: Callable[[str, int], Awaitable[trio.SocketStream]] | None = None) -> None:
        self.timeout = timeout                 # no byte for this long: a stall (settable)
        # (host, port) -> a connection (p2p.origins.addresses: to an address its check saw, no
        # second lookup); None: trio.open_tcp_stream (the host resolved by trio)
        self._open_tcp = connect or trio.open_tcp_stream
        self.connect_timeout = connect_timeout
        self.max_idle = max(1, max_idle)
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._open: set[trio.socket.SocketType] = set()     # every connection's socket (idle or in use)

    @staticmethod
    def takes(method: str, url: str) -> bool:
        return method == "GET" and url.startswith("http://")

    async def get(self, url: str, limit: int, cap_error: int) -> LeanResponse | None:
        """GET ``url``: the answer (a 200's body at most ``limit`` bytes, another status's
        at most ``cap_error``), or None for an answer this client does not take."""
        u = urlsplit(url)
        if not u.hostname:
            raise OriginError(f"bad URL {url[:160]}")
        key = (u.hostname, u.port or 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        req = (f"GET {target} HTTP/1.1\r\nHost: {u.netloc}\r\nAccept-Encoding: identity\r\n"
               "User-Agent: herd\r\n\r\n").encode()
        for attempt in (0, 1):
            conn = await self._connect(key)
            reused = conn.used
            keep = False
            try:
                got = await self._exchange(conn, req, limit, cap_error)
            except _Stale:
                self._close(conn)
                if reused and attempt == 0:      # the origin closed an idle keep-alive: once more, fresh
                    continue
                raise LeanUnavailable("connection closed before an answer") from None
            except BaseException:
                self._close(conn)
                raise
            resp, keep = got
            if keep:
                self._release(key, conn)
            else:
                self._close(conn)
            return resp
        raise LeanUnavailable("no connection")  # pragma: no cover

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            return idle.pop()
        with trio.move_on_after(self.connect_timeout):
            try:
                stream = await self._open_tcp(*key)
            except OSError as e:
                raise LeanUnavailable(f"unreachable (ConnectError: {e.strerror or e})") from None
            self._open.add(stream.socket)
            return _Conn(stream.socket)
        raise LeanUnavailable("timed out (ConnectTimeout)", timed_out=True)

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle:
            conn.used = True
            idle.append(conn)
        else:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._open.discard(conn.sock)
        conn.close()

    async def _recv(self, conn: _Conn, view: memoryview | None, n: int, what: str) -> bytes | int:
        with trio.move_on_after(self.timeout):
            try:
                if view is None:
                    return await conn.sock.recv(n)
                return await conn.sock.recv_into(view, n)
            except OSError as e:
                raise LeanUnavailable(f"unreachable (ReadError: {e.strerror or e} {what})") from None
        raise LeanUnavailable(f"timed out (ReadTimeout {what})", timed_out=True)

    async def _recv_head(self, conn: _Conn) -> bytes:
        piece = await self._recv(conn, None, 65536, "in the answer's head")
        assert isinstance(piece, bytes)
        return piece

    async def _exchange(self, conn: _Conn, req: bytes, limit: int, cap_error: int) -> tuple[LeanResponse | None, bool]:
        try:
            sent = 0
            while sent < len(req):
                sent += await conn.sock.send(req[sent:])
        except OSError:
            raise _Stale() from None
        try:
            head, rest = await receive_head(partial(self._recv_head, conn), conn.buf, max_head=MAX_HEAD)
            conn.buf = bytearray()
            h = parse_response_head(head, chunked_ok=True)
        except ClosedBeforeAnswer:
            raise _Stale() from None
        except LeanUnavailable as e:
            if not conn.buf and not e.timed_out:   # a kept-alive connection the server had closed
                raise _Stale() from None
            raise
        except ProtocolError as e:
            raise LeanUnavailable(f"unreachable (RemoteProtocolError: {e})") from None
        if h.length is None or h.chunked or h.coding not in (b"", b"identity"):
            return None, False
        cap = limit if h.status == 200 else cap_error
        if h.length > cap:
            raise OriginError(f"announces {h.length} bytes, more than the {cap} expected")
        if len(rest) > h.length:
            raise LeanUnavailable("unreachable (RemoteProtocolError: sent more than announced)")
        body = bytearray(h.length)
        got = len(rest)
        body[:got] = rest
        with memoryview(body) as view:
            await self._body(conn, view, got, h.length)
        return LeanResponse(h.status, body, head), h.keep_alive  # type: ignore[arg-type]  # bytearray: no copy

    async def _body(self, conn: _Conn, view: memoryview, got: int, length: int) -> None:
        """The rest of a body, woken per ``PIECE`` bytes (SO_RCVLOWAT, reset after)."""
        sock = conn.sock
        lowat = 1
        try:
            while got < length:
                want = min(length - got, self.PIECE)
                if want != lowat:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                n = await self._recv(conn, view[got:], length - got, f"after {got} of {length} body bytes")
                assert isinstance(n, int)
                if n == 0:
                    raise LeanUnavailable(f"unreachable (RemoteProtocolError: closed after {got} of {length} body bytes)")
                got += n
        finally:
            if lowat != 1:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                except OSError:
                    pass

    def sockets(self) -> list[trio.socket.SocketType]:
        """Every open connection's socket, idle or in use (for tests)."""
        return list(self._open)

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                self._close(c)
        self._idle.clear()


class _Stale(Exception):
    pass

