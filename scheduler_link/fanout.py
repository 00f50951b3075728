"""Placer-side push: one JSON POST to many agents, kept-alive, bounded, with deadlines.

Why not httpx here: a decision for a large gang goes to hundreds or thousands of
agents at once, and httpx's per-request cost under trio (~0.5 ms of CPU) would alone
eat the fan-out budget. This is a lean HTTP/1.1 client over trio streams with h11
doing the protocol: one pool of idle connections per ``host:port``, reused across
pushes (keep-alive), a global concurrency bound, a per-attempt deadline and a
bounded number of retries for transport failures (placements are idempotent by
``placement_id``, so a retry after a lost answer is safe).

An HTTP answer is never retried: 2xx with a body is an ack, anything else is the
agent's word (e.g. 401, 409) and is returned as such.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11
import msgspec
import trio

from .auth import auth_header

log = logging.getLogger("herd.link.fanout")


class PushError(Exception):
    """A push that got no HTTP answer (connect refused, reset, deadline)."""


@dataclass(slots=True)
class PushResult:
    key: str                       # the caller's key (e.g. the node id)
    status: int | None             # HTTP status, None when no answer came
    body: bytes = b""
    error: str | None = None
    attempts: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class _Conn:
    __slots__ = ("stream", "h11")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)


class PushPool:
    """Kept-alive HTTP/1.1 connections to many agents (one owner: the placer service)."""

    def __init__(self, *, concurrency: int = 256, attempt_timeout_s: float = 2.0,
                 retries: int = 2, retry_backoff_s: float = 0.05, max_idle_per_host: int = 4) -> None:
        self.concurrency = concurrency
        self.attempt_timeout_s = attempt_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = defaultdict(list)
        self._limiter = trio.CapacityLimiter(concurrency)
        self.requests = 0
        self.connects = 0
        self.failures = 0

    async def aclose(self) -> None:
        conns = [c for lst in self._idle.values() for c in lst]
        self._idle.clear()
        for c in conns:
            with trio.move_on_after(0.5) as cs:
                cs.shield = True
                await c.stream.aclose()

    def statistics(self) -> dict[str, Any]:
        return {"requests": self.requests, "connects": self.connects, "failures": self.failures,
                "idle_connections": sum(len(v) for v in self._idle.values()),
                "concurrency": self.concurrency}

    async def post(self, base_url: str, path: str, body: bytes, *, token: str | None = None,
                   key: str = "") -> PushResult:
        """POST ``body`` to ``base_url + path`` with retries on transport failure."""
        t0 = time.perf_counter()
        res = PushResult(key=key or base_url, status=None)
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            res.error = f"unsupported url {base_url!r} (http://host:port only)"
            return res
        host, port = u.hostname, u.port or 80
        headers = [("host", f"{host}:{port}"), ("content-type", "application/json"),
                   ("content-length", str(len(body)))]
        headers += list(auth_header(token).items())
        for attempt in range(self.retries + 1):
            res.attempts = attempt + 1
            try:
                async with self._limiter:
                    with trio.fail_after(self.attempt_timeout_s):
                        res.status, res.body = await self._request(host, port, path, headers, body)
                res.error = None
                break
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                    h11.ProtocolError, PushError) as e:
                self.failures += 1
                res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if attempt < self.retries:
                    await trio.sleep(self.retry_backoff_s * (2 ** attempt))
        res.elapsed_s = time.perf_counter() - t0
        return res

    async def _request(self, host: str, port: int, path: str, headers: list[tuple[str, str]],
                       body: bytes) -> tuple[int, bytes]:
        pool = self._idle[(host, port)]
        fresh = not pool
        conn = pool.pop() if pool else await self._connect(host, port)
        try:
            status, data = await self._exchange(conn, path, headers, body)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, PushError):
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
            if fresh:
                raise
            # a stale kept-alive connection (the agent closed it): once more on a new one
            conn = await self._connect(host, port)
            try:
                status, data = await self._exchange(conn, path, headers, body)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await conn.stream.aclose()
                raise
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
            raise
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE and len(pool) < self.max_idle_per_host:
            conn.h11.start_next_cycle()
            pool.append(conn)
        else:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
        return status, data

    async def _connect(self, host: str, port: int) -> _Conn:
        self.connects += 1
        stream = await trio.open_tcp_stream(host, port)
        return _Conn(stream)

    async def _exchange(self, conn: _Conn, path: str, headers: list[tuple[str, str]],
                        body: bytes) -> tuple[int, bytes]:
        self.requests += 1
        c = conn.h11
        out = c.send(h11.Request(method="POST", target=path, headers=headers))
        out += c.send(h11.Data(data=body)) + c.send(h11.EndOfMessage())
        await conn.stream.send_all(out)
        status = 0
        chunks: list[bytes] = []
        while True:
            ev = c.next_event()
            if ev is h11.NEED_DATA:
                data = await conn.stream.receive_some(65536)
                if not data:
                    raise PushError("connection closed by peer")
                c.receive_data(data)
                continue
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                chunks.append(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                return status, b"".join(chunks)
            elif isinstance(ev, h11.ConnectionClosed):
                raise PushError("connection closed by peer")

    async def post_many(self, items: list[tuple[str, str, str, bytes]], *,
                        token: str | None = None) -> dict[str, PushResult]:
        """``items``: (key, base_url, path, body). All pushed concurrently (bounded); returns by key."""
        out: dict[str, PushResult] = {}

        async def one(key: str, url: str, path: str, body: bytes) -> None:
            out[key] = await self.post(url, path, body, token=token, key=key)

        async with trio.open_nursery() as n:
            for key, url, path, body in items:
                n.start_soon(one, key, url, path, body)
        return out


def decode_json(body: bytes, kind: type[Any]) -> Any:
    """Decode an answer; None when it is not a valid ``kind``."""
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
