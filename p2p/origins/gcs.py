"""``gs://bucket/prefix`` origin over the GCS JSON API (httpx).

``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL) points it at an emulator and
switches authentication off. Otherwise credentials come from ``google.auth.default()``
(``gcs_auth.py``: key files, authorized-user and workload-identity configurations,
gcloud's application-default file, the metadata server), obtained lazily on the first
request that really talks to GCS, refreshed before they expire and when a 401 says so.

Objects are uploaded with their content type, ``Cache-Control`` and ``herd-*`` metadata in
one multipart request (``gcs_objects.py`` says what each kind carries); GCS's refusals
become one line naming the missing bucket, the permission lacking or the quota hit.

GCS has no bulk "exists": ``missing`` lists the ``chunks/`` prefix (paged) when
asked about many ids, or sends bounded concurrent metadata GETs for a few.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import AsyncIterator
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
import trio

from manifests import IntegrityError, ManifestError, decode_manifest

from ..errors import NotFoundError, OriginError
from ..pool import run_pool
from .base import HEX64, ObjectInfo, Origin
from .gcs_objects import Failure, ManifestSummary, classify, multipart_body, object_resource
from .transport import RetryingClient, describe_status

if TYPE_CHECKING:
    from .gcs_auth import GoogleCredentials

log = logging.getLogger("herd.p2p.origin.gcs")

GCS_BASE = "https://storage.googleapis.com"
LIST_THRESHOLD = 64  # above this many ids, list the prefix instead of one GET each


def emulator_base() -> str | None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return host.rstrip("/") if "://" in host else f"http://{host.rstrip('/')}"


def summarise_manifest(data: bytes, manifest_id: str) -> ManifestSummary | None:
    """Size and counts for a manifest's metadata; None for bytes that are not one (blocking)."""
    try:
        m = decode_manifest(data, expected_id=manifest_id)
    except (ManifestError, IntegrityError):
        return None
    return ManifestSummary(format=m.version, size=m.total_size, files=sum(1 for _ in m.files),
                           chunks=len(m.chunks))


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
        self.auth: GoogleCredentials | None = None
        if authenticate:
            from .gcs_auth import GoogleCredentials  # google-auth is imported only where it is used

            self.auth = GoogleCredentials()
        self.http = RetryingClient(what=f"origin {self.url}", max_concurrency=max_concurrency, retries=retries,
                                   auth_headers=self.auth.headers if self.auth else None,
                                   describe=self._describe_retryable)
        self._bucket_seen = False  # an answer showed that the bucket exists

    def _describe_retryable(self, resp: httpx.Response) -> str:
        refusal = classify(resp.status_code, resp.content, action="", bucket=self.bucket, key="")
        return refusal.line if refusal.kind is Failure.QUOTA else describe_status(resp)

    def _refused(self, resp: httpx.Response, action: str, key: str) -> OriginError:
        """One line for a refusal of ``action`` on ``key`` (see gcs_objects.classify)."""
        refusal = classify(resp.status_code, resp.content, action=action, bucket=self.bucket, key=key)
        return OriginError(f"origin {self.url}: {refusal.line}")

    async def _bucket_exists(self) -> bool:
        """Tell a missing object from a missing bucket after a 404 (GCS and the emulator
        answer both with 404). An answer other than 404 (e.g. 403 for credentials without
        storage.buckets.get) counts as "exists": the object's 404 then stands."""
        if self._bucket_seen:
            return True
        resp = await self.http.request("GET", f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}",
                                       params={"fields": "name"}, limit=64 << 10)
        self._bucket_seen = resp.status_code != 404
        return self._bucket_seen

    async def _not_found(self, resp: httpx.Response, action: str, key: str) -> bool:
        """For a 404 on one object: True if the object is absent, raise if the bucket is."""
        refusal = classify(resp.status_code, resp.content, action=action, bucket=self.bucket, key=key)
        if refusal.kind is Failure.BUCKET_MISSING or not await self._bucket_exists():
            raise OriginError(f"origin {self.url}: "
                              + classify(404, b"", action="bucket", bucket=self.bucket, key="").line)
        return True

    def _object_url(self, key: str) -> str:
        return f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.prefix + key, safe='')}"

    def _sync_retries(self) -> None:
        self.retries = self.http.retried

    async def _get(self, key: str, limit: int) -> bytes:
        resp = await self.http.request("GET", self._object_url(key), params={"alt": "media"}, limit=limit)
        self._sync_retries()
        if resp.status_code == 200:
            self._bucket_seen = True
            return resp.content
        if resp.status_code == 404 and await self._not_found(resp, "get", key):
            raise NotFoundError(f"{key} not found at origin {self.url}")
        raise self._refused(resp, "get", key)

    async def _put(self, key: str, data: bytes | memoryview) -> None:
        mid = bytes(data).decode("ascii", "replace").strip() if key.startswith("refs/") else None
        await self._upload(key, data, object_resource(key, manifest_id=mid))

    async def _put_manifest(self, key: str, data: bytes, ref: str | None) -> None:
        summary = await trio.to_thread.run_sync(summarise_manifest, data, key.removeprefix("manifests/"))
        await self._upload(key, data, object_resource(key, ref=ref, summary=summary))

    async def _upload(self, key: str, data: bytes | memoryview, resource: dict[str, object]) -> None:
        """One multipart upload: the object's metadata (content type, Cache-Control, herd-*)
        and its bytes together, so no object is ever seen without its metadata."""
        url = f"{self.base}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        params = {"uploadType": "multipart"}
        immutable = not key.startswith("refs/")
        if immutable:
            # Content-addressed objects never change: create-only, so a concurrent publisher's
            # copy is not rewritten (412 = it is already there, which is success).
            params["ifGenerationMatch"] = "0"
        body, ctype = multipart_body(self.prefix + key, resource, data, f"herd-{secrets.token_hex(12)}")
        resp = await self.http.request("POST", url, params=params, content=body,
                                       headers={"content-type": ctype})
        self._sync_retries()
        if resp.status_code == 412 and immutable:
            return
        if resp.status_code not in (200, 201):
            raise self._refused(resp, "upload", key)
        self._bucket_seen = True

    async def _exists_one(self, key: str) -> bool:
        resp = await self.http.request("GET", self._object_url(key), params={"fields": "name"}, limit=64 << 10)
        if resp.status_code == 200:
            self._bucket_seen = True
            return True
        if resp.status_code == 404:
            return False
        raise self._refused(resp, "metadata", key)

    async def _pages(self, prefix: str, fields: str,
                     max_pages: int | None = None) -> AsyncIterator[tuple[list[dict[str, Any]], bool]]:
        """``objects.list`` of ``prefix`` page by page, in lexicographic order: each page's items
        (with ``fields``) and whether more follow; at most ``max_pages`` pages (None: all)."""
        url = f"{self.base}/storage/v1/b/{quote(self.bucket, safe='')}/o"
        full = self.prefix + prefix
        token: str | None = None
        pages = 0
        while max_pages is None or pages < max_pages:
            pages += 1
            params = {"prefix": full, "maxResults": str(self.list_page), "fields": f"items({fields}),nextPageToken"}
            if token:
                params["pageToken"] = token
            resp = await self.http.request("GET", url, params=params)
            if resp.status_code != 200:
                raise self._refused(resp, "list", full)
            try:
                body = resp.json()
                items = list(body.get("items", []) or [])
                token = body.get("nextPageToken")
            except (ValueError, AttributeError, TypeError):
                raise OriginError(f"origin {self.url}: list {prefix}: not a GCS listing") from None
            self._sync_retries()
            yield items, bool(token)
            if not token:
                return

    async def _list(self, prefix: str, max_pages: int) -> tuple[set[str], str | None]:
        """Names under ``prefix`` in lexicographic order, at most ``max_pages`` pages.
        Returns (names, None) when the listing is complete, else (names, last name listed)."""
        full = self.prefix + prefix
        names: set[str] = set()
        last = ""
        more = False
        async for items, more_pages in self._pages(prefix, "name", max_pages):
            more = more_pages
            for item in items:
                name = str(item.get("name", ""))[len(full):]
                last = max(last, name)
                if HEX64.match(name):
                    names.add(name)
        return names, (last if more else None)

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
        full = self.prefix + prefix
        out: list[ObjectInfo] = []
        async for items, _ in self._pages(prefix, "name,size,updated,generation"):
            try:
                for item in items:
                    name = str(item["name"])
                    if not name.startswith(full):
                        continue
                    out.append(ObjectInfo(key=name[len(self.prefix):], size=int(item.get("size", 0)),
                                          updated=_rfc3339(str(item.get("updated", ""))),
                                          version=str(item.get("generation", ""))))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise OriginError(f"origin {self.url}: list {prefix}: not a GCS listing") from None
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
            raise self._refused(resp, "copy", f"{src} -> {dst}")
        resp = await self.http.request("DELETE", self._object_url(src))
        self._sync_retries()
        if resp.status_code not in (200, 204, 404):
            raise self._refused(resp, "delete", src)
        return True

    async def _delete_if_unchanged(self, info: ObjectInfo) -> bool:
        params = {"ifGenerationMatch": info.version} if info.version else {}
        resp = await self.http.request("DELETE", self._object_url(info.key), params=params)
        self._sync_retries()
        if resp.status_code in (404, 412):  # gone, or rewritten since it was listed
            return False
        if resp.status_code not in (200, 204):
            raise self._refused(resp, "delete", info.key)
        return True

    async def aclose(self) -> None:
        await self.http.aclose()


def _rfc3339(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise OriginError(f"GCS listing with an unreadable time {text!r:.40}") from None
