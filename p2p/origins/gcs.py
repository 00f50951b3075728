"""``gs://bucket/prefix`` origin over the GCS JSON API (httpx).

``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL) points it at an emulator and
switches authentication off. Otherwise credentials come from google-auth's
application-default chain (a service-account key file named by
GOOGLE_APPLICATION_CREDENTIALS, or the GCE metadata server), obtained lazily on
the first request that really talks to GCS, and refreshed when they expire or
a 401 says so. google-auth is synchronous: its token exchange runs in a thread
through a small httpx-backed transport.

GCS has no bulk "exists": ``missing`` lists the ``chunks/`` prefix (paged) when
asked about many ids, or sends bounded concurrent metadata GETs for a few.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import quote

import trio

from ..errors import NotFoundError, OriginError
from ..pool import run_pool
from .base import HEX64, Origin
from .transport import RetryingClient, describe_status

log = logging.getLogger("herd.p2p.origin.gcs")

GCS_BASE = "https://storage.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
LIST_THRESHOLD = 64  # above this many ids, list the prefix instead of one GET each


def emulator_base() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"


class _GoogleAuth:
    """Lazily obtained, refreshed-on-demand application-default credentials."""

    def __init__(self) -> None:
        self._creds: Any = None
        self._lock = trio.Lock()

    @staticmethod
    def _transport() -> Any:
        import google.auth.exceptions
        import google.auth.transport
        import httpx

        class _Response(google.auth.transport.Response):
            def __init__(self, r: httpx.Response) -> None:
                self._r = r

            @property
            def status(self) -> int:
                return self._r.status_code

            @property
            def headers(self) -> Any:
                return self._r.headers

            @property
            def data(self) -> bytes:
                return self._r.content

        class _Request(google.auth.transport.Request):
            def __call__(self, url: str, method: str = "GET", body: Any = None, headers: Any = None,
                         timeout: Any = None, **kwargs: Any) -> Any:
                try:
                    r = httpx.request(method, url, content=body, headers=headers, timeout=timeout or 30)
                except httpx.HTTPError as e:
                    raise google.auth.exceptions.TransportError(str(e)) from e
                return _Response(r)

        return _Request()

    def _refresh_sync(self) -> Any:
        import google.auth
        import google.auth.exceptions

        try:
            request = self._transport()
            creds = self._creds
            if creds is None:
                creds, _ = google.auth.default(scopes=[SCOPE], request=request)
            creds.refresh(request)
            return creds
        except google.auth.exceptions.GoogleAuthError as e:
            raise OriginError(f"no usable GCS credentials (metadata server or service-account key): {e}") from None

    async def headers(self, force: bool) -> dict[str, str]:
        async with self._lock:
            if force or self._creds is None or not self._creds.valid:
                self._creds = await trio.to_thread.run_sync(self._refresh_sync)
            return {"authorization": f"Bearer {self._creds.token}"}


class GCSOrigin(Origin):
    def __init__(self, bucket: str, prefix: str = "", *, base_url: str | None = None,
                 max_concurrency: int = 32, retries: int = 5) -> None:
        if not bucket:
            raise OriginError("gs:// URL needs a bucket name")
        prefix = prefix.strip("/")
        super().__init__(f"gs://{bucket}/{prefix}".rstrip("/"))
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        emu = emulator_base()
        self.base = (base_url or emu or GCS_BASE).rstrip("/")
        self.auth = None if (emu or base_url) else _GoogleAuth()
        self.http = RetryingClient(what=f"origin {self.url}", max_concurrency=max_concurrency, retries=retries,
                                   auth_headers=self.auth.headers if self.auth else None)

    def _object_url(self, key: str) -> str:
        return f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.prefix + key, safe='')}"

    def _sync_retries(self) -> None:
        self.retries = self.http.retried

    async def _get(self, key: str) -> bytes:
        resp = await self.http.request("GET", self._object_url(key), params={"alt": "media"})
        self._sync_retries()
        if resp.status_code == 404:
            raise NotFoundError(f"{key} not found at origin {self.url}")
        if resp.status_code != 200:
            raise OriginError(f"origin {self.url}: GET {key}: {describe_status(resp)}")
        return resp.content

    async def _put(self, key: str, data: bytes) -> None:
        url = f"{self.base}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        resp = await self.http.request("POST", url, params={"uploadType": "media", "name": self.prefix + key},
                                       content=data, headers={"content-type": "application/octet-stream"})
        self._sync_retries()
        if resp.status_code not in (200, 201):
            raise OriginError(f"origin {self.url}: upload {key}: {describe_status(resp)}")

    async def _exists_one(self, key: str) -> bool:
        resp = await self.http.request("GET", self._object_url(key))
        if resp.status_code == 200:
            return True
        if resp.status_code == 404:
            return False
        raise OriginError(f"origin {self.url}: metadata {key}: {describe_status(resp)}")

    async def _list(self, prefix: str) -> set[str]:
        url = f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        full = self.prefix + prefix
        names: set[str] = set()
        token: str | None = None
        while True:
            params = {"prefix": full, "maxResults": "1000"}
            if token:
                params["pageToken"] = token
            resp = await self.http.request("GET", url, params=params)
            if resp.status_code == 404:
                raise OriginError(f"origin {self.url}: bucket {self.bucket!r} does not exist")
            if resp.status_code != 200:
                raise OriginError(f"origin {self.url}: list {prefix}: {describe_status(resp)}")
            try:
                body = resp.json()
            except ValueError:
                raise OriginError(f"origin {self.url}: list {prefix}: not JSON") from None
            for item in body.get("items", []) or []:
                name = str(item.get("name", ""))[len(full):]
                if HEX64.match(name):
                    names.add(name)
            token = body.get("nextPageToken")
            if not token:
                return names

    async def _exists_many(self, prefix: str, names: set[str]) -> set[str]:
        if len(names) > LIST_THRESHOLD:
            found = await self._list(prefix) & names
        else:
            found = set()

            async def one(n: str) -> None:
                if await self._exists_one(prefix + n):
                    found.add(n)

            await run_pool(sorted(names), one, int(self.http.limiter.total_tokens))
        self._sync_retries()
        return found

    async def aclose(self) -> None:
        await self.http.aclose()
