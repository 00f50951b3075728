"""Talking to peers' data planes, and keeping score of how they behave.

:class:`PeerClient` is the one seam to other nodes: ``get_chunk`` (with ``wait_ms``),
``get_manifest``. It maps every transport failure to a :class:`PeerError` subclass,
bounds what a peer may send (never more than the chunk's size), and verifies nothing
itself (the fetcher verifies BLAKE3 and tells :class:`PeerHealth`).

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
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import trio

from scheduler_link.auth import auth_header

from .errors import PeerError
from .ratelimit import AsyncBucket

log = logging.getLogger("herd.p2p.peers")


class PeerTimeout(PeerError):
    """The peer accepted but did not answer (or stopped sending) in time."""


class PeerUnavailable(PeerError):
    """The peer could not be reached, refused, or is busy (503)."""


class PeerMissing(PeerError):
    """The peer answered 404: it does not have the object (after waiting, if asked to)."""


@dataclass(frozen=True, slots=True)
class PeerClientConfig:
    head_grace_s: float = 5.0      # on top of wait_ms, for the answer's head to arrive
    stall_s: float = 10.0          # no body bytes for this long: a stalled peer
    connect_s: float = 3.0
    rate_bps: float | None = None  # optional cap on bytes/s received from all peers


class PeerClient:
    def __init__(self, *, token: str | None, config: PeerClientConfig | None = None) -> None:
        self.config = config or PeerClientConfig()
        self._client = httpx.AsyncClient(
            headers=auth_header(token), timeout=None, http2=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            transport=httpx.AsyncHTTPTransport(retries=0))
        self._bucket = AsyncBucket(self.config.rate_bps)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._client.aclose()

    async def get_chunk(self, base_url: str, chunk_id: str, size: int, *, wait_ms: int = 0) -> bytes:
        """The chunk's bytes as the peer sent them (unverified), at most ``size`` bytes."""
        url = f"{base_url.rstrip('/')}/v1/chunks/{chunk_id}"
        if wait_ms > 0:
            url += f"?wait_ms={int(wait_ms)}"
        return await self._get(url, limit=size, head_s=wait_ms / 1000 + self.config.head_grace_s,
                               exact=True)

    async def get_manifest(self, base_url: str, manifest_id: str, *, limit: int = 64 << 20) -> bytes:
        url = f"{base_url.rstrip('/')}/v1/manifests/{manifest_id}"
        return await self._get(url, limit=limit, head_s=self.config.head_grace_s, exact=False)

    async def get_have(self, base_url: str, manifest_id: str, nchunks: int) -> bytes:
        """The peer's have-bitmap over the manifest's chunk table (``nchunks`` bits)."""
        url = f"{base_url.rstrip('/')}/v1/have/{manifest_id}"
        n = (nchunks + 7) // 8
        return await self._get(url, limit=n, head_s=0.0, exact=True)

    async def _get(self, url: str, *, limit: int, head_s: float, exact: bool) -> bytes:
        cfg = self.config
        try:
            with trio.move_on_after(head_s + cfg.connect_s) as cs:
                resp_cm = self._client.stream("GET", url)
                resp = await resp_cm.__aenter__()
            if cs.cancelled_caught:
                raise PeerTimeout(f"no answer from {url} within {head_s + cfg.connect_s:.1f}s")
            try:
                if resp.status_code == 404:
                    raise PeerMissing(f"{url}: not there")
                if resp.status_code == 503:
                    raise PeerUnavailable(f"{url}: busy")
                if resp.status_code != 200:
                    raise PeerError(f"{url}: HTTP {resp.status_code}")
                declared = resp.headers.get("content-length")
                if declared is not None and (not declared.isdigit() or int(declared) > limit
                                             or (exact and int(declared) != limit)):
                    raise PeerError(f"{url}: announces {declared} bytes, expected {limit}")
                buf = bytearray()
                it = resp.aiter_raw().__aiter__()
                while True:
                    with trio.move_on_after(cfg.stall_s) as cs:
                        try:
                            piece = await it.__anext__()
                        except StopAsyncIteration:
                            break
                    if cs.cancelled_caught:
                        raise PeerTimeout(f"{url}: stalled after {len(buf)} bytes")
                    buf += piece
                    if len(buf) > limit:
                        raise PeerError(f"{url}: sent more than {limit} bytes")
                    await self._bucket.consume(len(piece))
                if exact and len(buf) != limit:
                    raise PeerError(f"{url}: sent {len(buf)} bytes, expected {limit}")
                return bytes(buf)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await resp_cm.__aexit__(None, None, None)
        except httpx.TimeoutException as e:
            raise PeerTimeout(f"{url}: {e!r}") from None
        except (httpx.TransportError, OSError) as e:
            raise PeerUnavailable(f"{url}: {type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise PeerError(f"{url}: {type(e).__name__}: {e}") from None


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
        """404 after waiting: not a fault (it may not be fetching this artifact)."""
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
            self.until[node_id] = now + self.penalty_s * (2 ** min(n - 1, 6))
        log.info("peer failed node=%s strikes=%d err=%s", node_id, n, err)

    def penalties(self, now: float) -> dict[str, float]:
        return {n: u for n, u in self.until.items() if u > now}

    def snapshot(self) -> dict[str, Any]:
        return {n: msgspec.structs.asdict(s) for n, s in sorted(self.stats.items())}
