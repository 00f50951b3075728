"""``http(s)://`` origin: a read-only static mirror or CDN of the bucket layout.

Read only at addresses :mod:`p2p.origins.addresses` allows (no link-local or metadata address,
no loopback unless the URL names it), resolved once and connected to as checked (no DNS
rebinding), redirects not followed; an error answer is reported by its status and
category, never its body (which the mirror, or whatever answers at its address, wrote)."""

from __future__ import annotations

from ..errors import OriginError, ReadOnlyOriginError
from ..pool import run_pool
from .addresses import AddressGuard
from .base import Origin
from .transport import RetryingClient, describe_status, get_body


class HttpOrigin(Origin):
    read_only = True

    def __init__(self, url: str, *, max_concurrency: int = 32, retries: int = 5) -> None:
        super().__init__(url)
        self.base = url.rstrip("/")
        self.guard = AddressGuard(url)
        # plain http:// GETs (chunks, manifests, refs) on raw sockets: p2p.origins.lean; every
        # connection to the address the guard checked
        self.http = RetryingClient(what=f"origin {url}", max_concurrency=max_concurrency, retries=retries,
                                   lean=url.startswith("http://"), guard=self.guard)

    async def _get(self, key: str, limit: int) -> bytes:
        await self.guard.check()
        resp = await self.http.get(f"{self.base}/{key}", limit=limit)
        self.retries = self.http.retried
        return get_body(resp, self.url, key)

    async def _put(self, key: str, data: bytes | memoryview) -> None:
        raise ReadOnlyOriginError(f"origin {self.url} is read-only (http/https); publish to file:// or gs://")

    async def _exists_many(self, prefix: str, names: set[str]) -> set[str]:
        await self.guard.check()
        found: set[str] = set()

        async def head(name: str) -> None:
            resp = await self.http.request("HEAD", f"{self.base}/{prefix}{name}")
            if resp.status_code == 200:
                found.add(name)
            elif resp.status_code != 404:
                raise OriginError(f"origin {self.url}: HEAD {prefix}{name}: {describe_status(resp)}")

        await run_pool(sorted(names), head, int(self.http.limiter.total_tokens))
        self.retries = self.http.retried
        return found

    async def aclose(self) -> None:
        await self.http.aclose()
