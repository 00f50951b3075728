"""Placer-side push: one JSON POST to many agents, kept-alive, bounded, with deadlines.

Why not httpx here: a decision for a large gang goes to hundreds or thousands of
agents at once, and httpx's per-request cost under trio (~0.5 ms of CPU, far more
with a thousand connections open) would alone eat the fan-out budget. This is a lean
HTTP/1.1 client over trio streams: the request head is formatted directly and the
answer parsed by the strict parser the peer client shares (:mod:`infra.h1`:
status line, headers, ``content-length`` body; anything else, e.g. chunked bodies, is a
protocol error). Connections belong to
the *endpoint* (``host:port``), never to the node key: many nodes may sit behind one
listener (the fleet emulator routes ``http://host:port/n/<node>``; a base URL's path is
joined with the request path), and at most ``max_per_host`` connections to one endpoint
are open at once — pushes beyond that wait for one — with up to that many kept idle for
reuse (keep-alive). Also a global concurrency bound and a per-attempt deadline.

One attempt per push by default (``retries=0``): the placer retries above this pool, on
the outcome — an unreachable node's start rolls its gang back and places it again with
the re-placement back-off (``placer.attempts.rollback_delay``), an unanswered stop is
named in the node's next reply — so retries here would be a second layer under it,
holding a gang's acks for up to ``(retries + 1) * attempt_timeout_s`` before the same
outcome. ``retries=N`` (with backoff) is for callers with no layer above. Not a retry:
a request that failed on a *kept-alive* connection (the agent had closed it) is sent
once more on a fresh one; on a fresh connection a failure is the answer (placements
are idempotent by ``placement_id``, so the re-send is safe).

An HTTP answer is never retried: 2xx with a body is an ack, anything else is the
agent's word (e.g. 401, 409) and is returned as such.

TLS (``PushPool(ssl_context=)``, mutual: the placer's certificate is the client's): a
connection is handshaken once and kept alive like a plain one; its peer's principal is kept
with it, and a push that names ``expect`` (the placer names ``node:<id>`` of the node it
pushes to) is refused, unsent and without retry, when the connection's certificate is
another's: a placement and its env never reach a host that is not its node.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio

from infra import tls
from infra.auth import auth_header
from infra.backoff import Backoff
from infra.errors import ProtocolError
from infra.errors import PushError as PushError  # re-exported: callers import it from here
from infra.h1 import ClosedBeforeAnswer, parse_response_head, receive_head
from infra.metrics import LatencyHistogram

log = logging.getLogger("herd.link.fanout")


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


MAX_HEAD = 64 << 10
MAX_BODY = 8 << 20
RETRY_BACKOFF_CAP_S = 5.0   # the longest pause between the retries of one push


class WrongPeer(Exception):
    """The connection's certificate is not the one the push must reach (never retried)."""


class _Conn:
    __slots__ = ("stream", "buf", "reusable", "principal")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self.reusable = True
        self.principal = tls.stream_principal(stream)

    async def read_response(self) -> tuple[int, bytes]:
        """One HTTP/1.1 response with a content-length body."""
        try:
            head, self.buf = await receive_head(partial(self.stream.receive_some, 65536), self.buf,
                                                max_head=MAX_HEAD)
            status, length, keep = parse_response_head(head)[:3]
        except ClosedBeforeAnswer:
            raise PushError("connection closed by peer") from None
        except ProtocolError as e:
            raise PushError(str(e)) from None
        if not keep:
            self.reusable = False
        if length is None:
            length = 0 if status in (204, 304) or 100 <= status < 200 else -1
        if length < 0:
            raise PushError("response without content-length")
        if length > MAX_BODY:
            raise PushError("response body too large")
        while len(self.buf) < length:
            await self._fill()
        body = bytes(self.buf[:length])
        del self.buf[:length]
        return status, body

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise PushError("connection closed by peer")
        self.buf += data


class PushPool:
    """Kept-alive HTTP/1.1 connections to many agents (one owner: the placer service)."""

    def __init__(self, *, concurrency: int = 256, attempt_timeout_s: float = 2.0,
                 retries: int = 0, retry_backoff_s: float = 0.05,
                 max_idle_per_host: int | None = None, max_per_host: int = 32,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.ssl_context = ssl_context
        self.concurrency = concurrency
        self.attempt_timeout_s = attempt_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._backoff = Backoff(retry_backoff_s, RETRY_BACKOFF_CAP_S)
        self._rng = random.Random()
        self.max_per_host = max(1, max_per_host)
        idle = self.max_per_host if max_idle_per_host is None else max(max_idle_per_host, 0)
        self.max_idle_per_host = min(idle, self.max_per_host)
        self._idle: dict[tuple[str, int], list[_Conn]] = defaultdict(list)
        self._per_host: dict[tuple[str, int], trio.Semaphore] = {}
        self._busy: dict[tuple[str, int], int] = defaultdict(int)  # requests holding a slot
        self._limiter = trio.CapacityLimiter(concurrency)
        self.requests = 0
        self.connects = 0
        self.failures = 0
        # send -> answer of each POST (retries included), by the caller's path (a few constants)
        self.latency: dict[str, LatencyHistogram] = {}

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
                "busy_connections": sum(self._busy.values()), "endpoints": len(self._idle),
                "concurrency": self.concurrency, "max_per_host": self.max_per_host}

    async def post(self, base_url: str, path: str, body: bytes, *, token: str | None = None,
                   key: str = "", expect: str | None = None) -> PushResult:
        """POST ``body`` to ``base_url``'s path joined with ``path`` (``http://h:p/n/x`` +
        ``/v1/placements`` -> ``/n/x/v1/placements``), one attempt (``retries`` more on a
        transport failure: none unless the pool was made with them).
        Over TLS, ``expect`` names the principal the peer's certificate must be."""
        t0 = time.perf_counter()
        req_path = path
        res = PushResult(key=key or base_url, status=None)
        u = urlsplit(base_url)
        want = "https" if self.ssl_context is not None else "http"
        if u.scheme != want or not u.hostname:
            res.error = (f"unsupported url {base_url!r} ({want}://host:port only: this placer's pushes are "
                         f"{'TLS' if want == 'https' else 'plain (insecure)'})")
            return res
        host, port = u.hostname, u.port or (443 if want == "https" else 80)
        path = u.path.rstrip("/") + ("/" + path.lstrip("/") if path else "")
        extra = "".join(f"{k}: {v}\r\n" for k, v in auth_header(token).items())
        if any(c in path for c in " \r\n") or any(c in extra[:-2] for c in "\r\n"):
            res.error = "bad path or token"
            return res
        head = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{extra}\r\n").encode("latin-1")
        for attempt in range(self.retries + 1):
            res.attempts = attempt + 1
            try:
                async with self._slot(host, port), self._limiter:
                    with trio.fail_after(self.attempt_timeout_s):
                        res.status, res.body = await self._request(host, port, head, body, expect)
                res.error = None
                break
            except WrongPeer as e:
                self.failures += 1
                res.error = f"WrongPeer: {e}"
                break
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError,
                    PushError, tls.TLSError) as e:
                self.failures += 1
                res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if attempt < self.retries:
                    await trio.sleep(self._backoff.pause(attempt + 1, self._rng))
        res.elapsed_s = time.perf_counter() - t0
        hist = self.latency.get(req_path)
        if hist is None:
            hist = self.latency[req_path] = LatencyHistogram()
        hist.observe(res.elapsed_s)
        return res

    def _slot(self, host: str, port: int) -> _HostSlot:
        ep = (host, port)
        sem = self._per_host.get(ep)
        if sem is None:
            sem = self._per_host[ep] = trio.Semaphore(self.max_per_host)
        return _HostSlot(self, ep, sem)

    async def _request(self, host: str, port: int, head: bytes, body: bytes,
                       expect: str | None = None) -> tuple[int, bytes]:
        pool = self._idle[(host, port)]
        fresh = not pool
        conn = pool.pop() if pool else await self._connect(host, port)
        if expect is not None and self.ssl_context is not None and (
                conn.principal is None or conn.principal.name != expect):
            got = conn.principal.name if conn.principal else "no herd principal"
            if len(pool) < self.max_idle_per_host:
                pool.append(conn)   # a good connection to whoever it is; just not this push's node
            else:
                with trio.CancelScope(shield=True):
                    await conn.stream.aclose()
            raise WrongPeer(f"{host}:{port} presented the certificate of {got}, not {expect}")
        try:
            status, data = await self._exchange(conn, head, body)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, PushError):
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
            if fresh:
                raise
            # a stale kept-alive connection (the agent closed it): once more on a new one
            conn = await self._connect(host, port)
            try:
                status, data = await self._exchange(conn, head, body)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await conn.stream.aclose()
                raise
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
            raise
        if conn.reusable and not conn.buf and len(pool) < self.max_idle_per_host:
            pool.append(conn)
        else:
            with trio.CancelScope(shield=True):
                await conn.stream.aclose()
        return status, data

    async def _connect(self, host: str, port: int) -> _Conn:
        self.connects += 1
        stream = await tls.connect(host, port, self.ssl_context)
        return _Conn(stream)

    async def _exchange(self, conn: _Conn, head: bytes, body: bytes) -> tuple[int, bytes]:
        self.requests += 1
        await conn.stream.send_all(head + body)
        return await conn.read_response()

    async def post_many(self, items: list[tuple[str, str, str, bytes]], *,
                        token: str | None = None, expect_node: bool = False) -> dict[str, PushResult]:
        """``items``: (key, base_url, path, body). All pushed concurrently (bounded); returns by key.
        ``expect_node``: over TLS each must reach the certificate ``node:<key>``."""
        out: dict[str, PushResult] = {}

        async def one(key: str, url: str, path: str, body: bytes) -> None:
            out[key] = await self.post(url, path, body, token=token, key=key,
                                       expect=f"node:{key}" if expect_node else None)

        async with trio.open_nursery() as n:
            for key, url, path, body in items:
                n.start_soon(one, key, url, path, body)
        return out


class _HostSlot:
    """Holds one of an endpoint's ``max_per_host`` connection slots for one attempt."""

    __slots__ = ("pool", "ep", "sem")

    def __init__(self, pool: PushPool, ep: tuple[str, int], sem: trio.Semaphore) -> None:
        self.pool, self.ep, self.sem = pool, ep, sem

    async def __aenter__(self) -> None:
        await self.sem.acquire()
        self.pool._busy[self.ep] += 1

    async def __aexit__(self, *exc: object) -> None:
        self.pool._busy[self.ep] -= 1
        self.sem.release()


def decode_json(body: bytes, kind: type[Any]) -> Any:
    """Decode an answer; None when it is not a valid ``kind``."""
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
