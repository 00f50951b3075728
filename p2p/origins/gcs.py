"""``gs://bucket/prefix`` origin over the GCS JSON API (httpx).

``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL) points it at an emulator and
switches authentication off. Otherwise credentials come from a service-account
key file named by GOOGLE_APPLICATION_CREDENTIALS (google-auth signs the JWT), or
from the GCE metadata server, obtained lazily on the first request that really
talks to GCS, and refreshed before they expire or when a 401 says so.

GCS has no bulk "exists": ``missing`` lists the ``chunks/`` prefix (paged) when
asked about many ids, or sends bounded concurrent metadata GETs for a few.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx
import trio

from ..errors import OriginError
from ..pool import run_pool
from .base import HEX64, ObjectInfo, Origin
from .transport import RetryingClient, describe_status, get_body

log = logging.getLogger("herd.p2p.origin.gcs")

GCS_BASE = "https://storage.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
METADATA_HOST = "metadata.google.internal"
LIST_THRESHOLD = 64  # above this many ids, list the prefix instead of one GET each


def emulator_base() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"


class _GoogleAuth:
    """Lazily obtained, refreshed-on-demand credentials.

    - ``GOOGLE_APPLICATION_CREDENTIALS`` names a service-account key file: google-auth signs
      the JWT and exchanges it at the key's ``token_uri`` (through an httpx transport, in a
      thread: google-auth is synchronous).
    - Otherwise the GCE metadata server (``GCE_METADATA_HOST`` overrides its address) hands out
      the instance's service-account token; asked directly over httpx.
    """

    def __init__(self) -> None:
        self._token: str | None = None
        self._expires = 0.0
        self._sa_creds: Any = None
        self._lock = trio.Lock()

    @staticmethod
    def _transport() -> Any:
        import google.auth.exceptions
        import google.auth.transport

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

    def _service_account_sync(self, path: str) -> tuple[str, float]:
        import google.auth.exceptions
        from google.oauth2 import service_account

        try:
            if self._sa_creds is None:
                self._sa_creds = service_account.Credentials.from_service_account_file(path, scopes=[SCOPE])
            self._sa_creds.refresh(self._transport())
        except (OSError, ValueError) as e:
            raise OriginError(f"cannot use service-account key {path}: {e}") from None
        except google.auth.exceptions.GoogleAuthError as e:
            raise OriginError(f"service-account token exchange failed ({path}): {e}") from None
        exp = self._sa_creds.expiry
        ttl = (exp.timestamp() - time.time()) if exp is not None else 3000.0
        return str(self._sa_creds.token), ttl

    async def _metadata_token(self) -> tuple[str, float]:
        host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_ROOT") or METADATA_HOST
        url = f"http://{host}/computeMetadata/v1/instance/service-accounts/default/token"
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(10, connect=3)) as c:
                r = await c.get(url, params={"scopes": SCOPE}, headers={"Metadata-Flavor": "Google"})
        except httpx.HTTPError as e:
            raise OriginError("no GCS credentials: GOOGLE_APPLICATION_CREDENTIALS is not set and the GCE "
                              f"metadata server at {host} is unreachable ({type(e).__name__})") from None
        if r.status_code != 200:
            raise OriginError(f"GCE metadata server refused a token: HTTP {r.status_code}")
        try:
            body = r.json()
            return str(body["access_token"]), float(body.get("expires_in", 300))
        except (ValueError, KeyError, TypeError):
            raise OriginError("GCE metadata server sent a malformed token answer") from None

    async def headers(self, force: bool) -> dict[str, str]:
        async with self._lock:
            if force or self._token is None or trio.current_time() >= self._expires:
                keyfile = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
                if keyfile:
                    token, ttl = await trio.to_thread.run_sync(self._service_account_sync, keyfile)
                else:
                    token, ttl = await self._metadata_token()
                self._token = token
                self._expires = trio.current_time() + max(0.0, ttl - 60.0)  # refresh a minute early
                log.info("gcs credentials obtained source=%s ttl_s=%.0f",
                         "service-account" if keyfile else "metadata", ttl)
            return {"authorization": f"Bearer {self._token}"}


class GCSOrigin(Origin):
    list_page = 1000  # objects per list page (the API's maximum)
    list_budget_factor = 2  # pages listed per page's worth of ids asked about (plus two)

    def __init__(self, bucket: str, prefix: str = "", *, base_url: str | None = None,
                 max_concurrency: int = 32, retries: int = 5, authenticate: bool | None = None) -> None:
        """``authenticate``: None = only when talking to real GCS (not an emulator or an
        explicit ``base_url``); True/False forces it."""
        if not bucket:
            raise OriginError("gs:// URL needs a bucket name")
        prefix = prefix.strip("/")
        super().__init__(f"gs://{bucket}/{prefix}".rstrip("/"))
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        emu = emulator_base()
        self.base = (base_url or emu or GCS_BASE).rstrip("/")
        if authenticate is None:
            authenticate = not (emu or base_url)
        self.auth = _GoogleAuth() if authenticate else None
        self.http = RetryingClient(what=f"origin {self.url}", max_concurrency=max_concurrency, retries=retries,
                                   auth_headers=self.auth.headers if self.auth else None)

    def _object_url(self, key: str) -> str:
        return f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.prefix + key, safe='')}"

    def _sync_retries(self) -> None:
        self.retries = self.http.retried

    async def _get(self, key: str, limit: int) -> bytes:
        resp = await self.http.request("GET", self._object_url(key), params={"alt": "media"}, limit=limit)
        self._sync_retries()
        return get_body(resp, self.url, key)

    async def _put(self, key: str, data: bytes) -> None:
        url = f"{self.base}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        params = {"uploadType": "media", "name": self.prefix + key}
        immutable = not key.startswith("refs/")
        if immutable:
            # Content-addressed objects never change: create-only, so a concurrent publisher's
            # copy is not rewritten (412 = it is already there, which is success).
            params["ifGenerationMatch"] = "0"
        resp = await self.http.request("POST", url, params=params, content=data,
                                       headers={"content-type": "application/octet-stream"})
        self._sync_retries()
        if resp.status_code == 412 and immutable:
            return
        if resp.status_code not in (200, 201):
            raise OriginError(f"origin {self.url}: upload {key}: {describe_status(resp)}")

    async def _exists_one(self, key: str) -> bool:
        resp = await self.http.request("GET", self._object_url(key))
        if resp.status_code == 200:
            return True
        if resp.status_code == 404:
            return False
        raise OriginError(f"origin {self.url}: metadata {key}: {describe_status(resp)}")

    async def _list(self, prefix: str, max_pages: int) -> tuple[set[str], str | None]:
        """Names under ``prefix`` in lexicographic order, at most ``max_pages`` pages.
        Returns (names, None) when the listing is complete, else (names, last name listed)."""
        url = f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        full = self.prefix + prefix
        names: set[str] = set()
        token: str | None = None
        last = ""
        for _ in range(max_pages):
            params = {"prefix": full, "maxResults": str(self.list_page), "fields": "items(name),nextPageToken"}
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
                last = max(last, name)
                if HEX64.match(name):
                    names.add(name)
            token = body.get("nextPageToken")
            if not token:
                return names, None
        return names, last

    async def _exists_many(self, prefix: str, names: set[str]) -> set[str]:
        """List the prefix when asked about many ids, but only for about two pages per
        thousand ids asked: a bucket far larger than the question is not listed whole;
        ids beyond what was listed are checked one by one (bounded concurrency)."""
        found: set[str] = set()
        unknown = names
        if len(names) > LIST_THRESHOLD:
            budget = 2 + self.list_budget_factor * len(names) // self.list_page
            listed, last = await self._list(prefix, max_pages=budget)
            found = listed & names
            unknown = set() if last is None else {n for n in names if n > last}

        async def one(n: str) -> None:
            if await self._exists_one(prefix + n):
                found.add(n)

        await run_pool(sorted(unknown), one, int(self.http.limiter.total_tokens))
        self._sync_retries()
        return found

    # ------------------------------------------------------------ gc primitives

    async def _list_info(self, prefix: str) -> list[ObjectInfo]:
        url = f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        full = self.prefix + prefix
        out: list[ObjectInfo] = []
        token: str | None = None
        while True:
            params = {"prefix": full, "maxResults": str(self.list_page),
                      "fields": "items(name,size,updated,generation),nextPageToken"}
            if token:
                params["pageToken"] = token
            resp = await self.http.request("GET", url, params=params)
            if resp.status_code == 404:
                raise OriginError(f"origin {self.url}: bucket {self.bucket!r} does not exist")
            if resp.status_code != 200:
                raise OriginError(f"origin {self.url}: list {prefix}: {describe_status(resp)}")
            try:
                body = resp.json()
                for item in body.get("items", []) or []:
                    name = str(item["name"])
                    if not name.startswith(full):
                        continue
                    out.append(ObjectInfo(key=name[len(self.prefix):], size=int(item.get("size", 0)),
                                          updated=_rfc3339(str(item.get("updated", ""))),
                                          version=str(item.get("generation", ""))))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise OriginError(f"origin {self.url}: list {prefix}: not a GCS listing") from None
            self._sync_retries()
            token = body.get("nextPageToken")
            if not token:
                return out

    async def _move(self, src: str, dst: str) -> bool:
        # GCS has no rename: a server-side copy (create-only at dst), then delete src.
        b = quote(self.bucket, safe="")
        url = (f"{self.base}/storage/v1/b/{b}/o/{quote(self.prefix + src, safe='')}"
               f"/copyTo/b/{b}/o/{quote(self.prefix + dst, safe='')}")
        resp = await self.http.request("POST", url, params={"ifGenerationMatch": "0"})
        if resp.status_code == 404:
            return False
        if resp.status_code not in (200, 412):  # 412: dst already there (same content-addressed bytes)
            raise OriginError(f"origin {self.url}: copy {src} -> {dst}: {describe_status(resp)}")
        resp = await self.http.request("DELETE", self._object_url(src))
        self._sync_retries()
        if resp.status_code not in (200, 204, 404):
            raise OriginError(f"origin {self.url}: delete {src}: {describe_status(resp)}")
        return True

    async def _delete_if_unchanged(self, info: ObjectInfo) -> bool:
        params = {"ifGenerationMatch": info.version} if info.version else {}
        resp = await self.http.request("DELETE", self._object_url(info.key), params=params)
        self._sync_retries()
        if resp.status_code in (404, 412):  # gone, or rewritten since it was listed
            return False
        if resp.status_code not in (200, 204):
            raise OriginError(f"origin {self.url}: delete {info.key}: {describe_status(resp)}")
        return True

    async def aclose(self) -> None:
        await self.http.aclose()


def _rfc3339(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise OriginError(f"GCS listing with an unreadable time {text!r:.40}") from None
