"""HTTP with bounded concurrency and jittered exponential backoff, shared by the
GCS and http(s) origins.

Retried: 429, 5xx, timeouts and transport errors (connection refused/reset).
Everything else is answered at once. httpx exceptions never leave this module:
after the last attempt they become ``OriginUnavailable`` (an ``OriginError`` worth
asking again later) with one readable line. ``retries=0``: one attempt, for callers
that retry themselves (the herd's origin call, the one retry layer of a fetch).

Redirects are not followed: an allowed origin's 3xx is an error (its status and category),
never a request to wherever it points (a metadata server, the agent's own APIs). With a
``guard`` (http(s) origins) every connection goes to the address the guard checked
(:mod:`p2p.origins.addresses`), the lean client's and httpx's alike: httpx through a pool on
:class:`~p2p.origins.addresses.PinnedBackend` (httpx takes no network backend of its own, so
:class:`_PinnedTransport` gives its transport that pool).

Bodies are bounded: ``request(..., limit=N)`` streams the answer and refuses (OriginError,
not retried: the origin misbehaves) one that announces or sends more than N bytes after
decoding, or more than 64 KiB for a non-200 answer. The origins pass the size the
manifest promises for a chunk, the manifest ceiling for a manifest, 1 KiB for a ref.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpcore
import httpx
import trio

from infra.backoff import Backoff

from ..errors import NotFoundError, OriginError, OriginUnavailable
from .addresses import AddressGuard, PinnedBackend
from .lean import LeanHttp, LeanResponse, LeanUnavailable

log = logging.getLogger("herd.p2p.origin")

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_ERROR_BODY = 64 << 10     # a non-200 answer's body
_FRAMING = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class _PinnedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (its request and error mapping) over a connection pool whose
    connections go to the guard's checked address."""

    def __init__(self, guard: AddressGuard, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(), max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=PinnedBackend(guard))


class RetryingClient:
    def __init__(self, *, what: str, max_concurrency: int = 32, retries: int = 5,
                 backoff_base: float = 0.2, backoff_cap: float = 8.0,
                 timeout: float = 60.0, connect_timeout: float = 10.0,
                 auth_headers: Callable[[bool], Awaitable[dict[str, str]]] | None = None,
                 describe: Callable[[httpx.Response], str] | None = None, lean: bool = False,
                 guard: AddressGuard | None = None) -> None:
        """``describe``: one line for a retryable answer that was still failing after the
        last attempt (GCS names a quota or rate limit there); default ``HTTP <status>``.
        ``lean``: :meth:`get` of plain ``http://`` URLs through :class:`p2p.origins.lean.LeanHttp`
        (raw sockets, the body received into one buffer), httpx for what it does not take.
        ``guard``: connect only to the addresses it checked (no second DNS lookup)."""
        self.what = what
        self.retries = max(0, retries)
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._backoff = Backoff(backoff_base, backoff_cap)
        self._rng = random.Random()
        self.limiter = trio.CapacityLimiter(max(1, max_concurrency))
        limits = httpx.Limits(max_connections=max(1, max_concurrency),
                              max_keepalive_connections=max(1, max_concurrency))
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout), limits=limits, follow_redirects=False,
            transport=_PinnedTransport(guard, limits) if guard is not None else None)
        self._auth_headers = auth_headers
        self._describe = describe
        self.retried = 0
        self.requests = 0    # HTTP requests sent (retries included)
        self.lean = LeanHttp(max_idle=max(1, max_concurrency), timeout=timeout, connect_timeout=connect_timeout,
                             connect=guard.connect if guard is not None else None) if lean else None

    def backoff(self, attempt: int) -> float:
        """The pause before retry ``attempt + 1``: full jitter over min(cap, base * 2**attempt)."""
        return self._backoff.pause(attempt + 1, self._rng)

    async def request(self, method: str, url: str, *, ok_statuses: tuple[int, ...] = (),
                      limit: int | None = None, **kwargs: Any) -> httpx.Response:
        """Send with retries. Returns the response for any status that is not retryable
        (callers interpret 404 etc.). Raises OriginError when attempts run out, or when
        the body is over ``limit`` bytes (None: unbounded; for small control answers).
        Attempts running out on a retryable failure raise ``OriginUnavailable``."""
        base_headers = dict(kwargs.pop("headers", None) or {})

        async def once(headers: dict[str, str]) -> httpx.Response:
            if limit is None:
                return await self.client.request(method, url, headers=headers, **kwargs)
            return await self._bounded(method, url, headers, limit, **kwargs)

        resp = await self._retrying(method, url, base_headers, once)
        assert isinstance(resp, httpx.Response)
        return resp

    async def get(self, url: str, *, limit: int) -> httpx.Response | LeanResponse:
        """:meth:`request` of a GET with a body of at most ``limit`` bytes (the same
        retries, bounds and errors), through the lean client where it takes the answer."""
        lean = self.lean
        if lean is None or self._auth_headers is not None or not LeanHttp.takes("GET", url):
            return await self.request("GET", url, limit=limit)

        async def once(headers: dict[str, str]) -> httpx.Response | LeanResponse:
            try:
                resp = await lean.get(url, limit, MAX_ERROR_BODY)
            except OriginError as e:
                raise OriginError(f"{self.what}: GET {_short(url)} {e}") from None
            if resp is None:   # a redirect, a chunked or coded answer: httpx follows or decodes it
                return await self._bounded("GET", url, headers, limit)
            return resp

        return await self._retrying("GET", url, {}, once)

    async def _retrying(self, method: str, url: str, base_headers: dict[str, str],
                        once: Callable[[dict[str, str]], Awaitable[httpx.Response | LeanResponse]],
                        ) -> httpx.Response | LeanResponse:
        """``once(headers)`` with this client's retries and backoff (the one loop of both)."""
        last = ""
        refreshed = False
        attempt = 0
        while True:
            try:
                async with self.limiter:
                    headers = dict(base_headers)
                    if self._auth_headers is not None:
                        headers.update(await self._auth_headers(False))
                    self.requests += 1
                    resp = await once(headers)
            except httpx.TimeoutException as e:
                last = f"timed out ({type(e).__name__})"
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
                raise OriginError(f"{self.what}: bad URL {_short(url)}: {e}") from None
            except httpx.TransportError as e:
                last = f"unreachable ({type(e).__name__}: {e})"
            except LeanUnavailable as e:
                last = str(e)
            else:
                if resp.status_code == 401 and self._auth_headers is not None and not refreshed:
                    refreshed = True
                    await self._auth_headers(True)
                    continue
                if resp.status_code not in RETRY_STATUSES:
                    return resp
                last = (self._describe(resp) if self._describe is not None and isinstance(resp, httpx.Response)
                        else f"HTTP {resp.status_code}")
            if attempt >= self.retries:
                raise OriginUnavailable(f"{self.what}: {method} {_short(url)} failed after {attempt + 1} "
                                        f"attempt{'s' if attempt else ''}: {last}")
            delay = self.backoff(attempt)
            attempt += 1
            self.retried += 1
            log.info("origin retry what=%s method=%s attempt=%d delay=%.2f reason=%s",
                     self.what, method, attempt, delay, last)
            await trio.sleep(delay)

    async def _bounded(self, method: str, url: str, headers: dict[str, str], limit: int,
                       **kwargs: Any) -> httpx.Response:
        """One exchange whose body is read to at most ``limit`` bytes (decoded)."""
        req = self.client.build_request(method, url, headers=headers, **kwargs)
        resp = await self.client.send(req, stream=True)
        try:
            cap = limit if resp.status_code == 200 else MAX_ERROR_BODY
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > cap:
                raise OriginError(f"{self.what}: {method} {_short(url)} announces {declared} bytes, "
                                  f"more than the {cap} expected")
            buf = bytearray()
            lowat = _Lowat.of(resp, declared)
            try:
                async for piece in resp.aiter_bytes():
                    buf += piece
                    if len(buf) > cap:
                        raise OriginError(f"{self.what}: {method} {_short(url)} sent more than the {cap} bytes expected")
                    if lowat is not None:
                        lowat.update(len(buf))
            finally:
                if lowat is not None:
                    lowat.reset()
        finally:
            await resp.aclose()
        kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _FRAMING]
        return httpx.Response(resp.status_code, headers=kept, content=bytes(buf), request=req)

    async def aclose(self) -> None:
        if self.lean is not None:
            self.lean.close()
        await self.client.aclose()


class _Lowat:
    """``SO_RCVLOWAT`` on a plain-HTTP answer's socket while its body comes: be woken
    when a good piece is there (at most ``PIECE``, never more than the body has left),
    not per packet. On a paced link (a mirror's upload shared by many streams) packets
    trickle in, and a wakeup per 1.4 kB through httpx costs more CPU than the rest of a
    herd node's work together (``python -m bench.herd``). Only where the bytes left on
    the socket are exactly the body's: a Content-Length answer, no content coding, no
    TLS (a TLS layer may hold decrypted bytes the socket no longer counts)."""

    PIECE = 128 * 1024

    def __init__(self, sock: socket.socket, length: int) -> None:
        self.sock, self.length, self.now = sock, length, 1

    @classmethod
    def of(cls, resp: httpx.Response, declared: str) -> _Lowat | None:
        if resp.status_code != 200 or not declared.isdigit() or resp.headers.get("content-encoding", "identity") != "identity":
            return None
        stream = resp.extensions.get("network_stream")
        if stream is None or stream.get_extra_info("ssl_object") is not None:
            return None
        sock = stream.get_extra_info("socket")
        if sock is None:
            return None
        # set after each piece only: the first may have come with the head (h11 holds it,
        # the socket no longer counts it); after a piece, every byte read was handed on
        return cls(sock, int(declared))

    def _set(self, n: int) -> None:
        if n != self.now:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self.now = n
            except OSError:
                pass

    def update(self, got: int) -> None:
        self._set(max(1, min(self.PIECE, self.length - got)))

    def reset(self) -> None:
        self._set(1)


def _short(url: str) -> str:
    return url.split("?", 1)[0][:160]


def status_category(status: int) -> str:
    """What an error status means, in a word or two (a pod's reason says this, not the body)."""
    if 300 <= status < 400:
        return "redirect, not followed"
    if status in (401, 403):
        return "access denied"
    if status == 404:
        return "not found"
    if status in (408, 429):
        return "rate limited or timed out"
    if 400 <= status < 500:
        return "request refused"
    if status >= 500:
        return "origin error"
    return "unexpected answer"


def describe_status(resp: httpx.Response | LeanResponse) -> str:
    """``HTTP <status> (<category>)``: an error answer's body is the origin's (or whatever
    answers at its address) and never travels on into logs or a pod's reason."""
    return f"HTTP {resp.status_code} ({status_category(resp.status_code)})"


def get_body(resp: httpx.Response | LeanResponse, origin_url: str, key: str) -> bytes:
    """The body of a GET of ``key``: NotFoundError on 404, OriginError on any other non-200."""
    if resp.status_code == 404:
        raise NotFoundError(f"{key} not found at origin {origin_url}")
    if resp.status_code != 200:
        raise OriginError(f"origin {origin_url}: GET {key}: {describe_status(resp)}")
    return resp.content
