"""Artifact origins behind one async interface: ``open_origin(url)``.

- ``file:///dir``          a local directory (atomic writes)
- ``gs://bucket/prefix``   Google Cloud Storage JSON API (or STORAGE_EMULATOR_HOST)
- ``http(s)://host/path``  a read-only static mirror / CDN
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from ..errors import OriginError
from .allow import origin_refusal
from .base import ObjectInfo, Origin, OriginStatistics, check_hex_id, check_ref_name, is_manifest_id
from .file import FileOrigin
from .gcs import GCSOrigin, emulator_base
from .http_origin import HttpOrigin

__all__ = ["FileOrigin", "GCSOrigin", "HttpOrigin", "ObjectInfo", "Origin", "OriginStatistics", "check_hex_id",
           "check_ref_name", "is_manifest_id", "open_origin", "origin_refusal"]


def open_origin(url: str, *, max_concurrency: int | None = None, retries: int = 5) -> Origin:
    """An origin for ``url``. Opening never does I/O; errors surface on first use.

    ``max_concurrency`` bounds concurrent requests (default 32 for GCS/http, 4 for a
    single-threaded GCS emulator named by STORAGE_EMULATOR_HOST);
    ``retries`` is how many times a 429/5xx/timeout is retried with backoff.
    """
    if not isinstance(url, str) or not url:
        raise OriginError("empty origin URL")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - validates the port
    except ValueError as e:
        raise OriginError(f"invalid origin URL {url!r}: {e}") from None
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise OriginError(f"file:// origin must be local (file:///dir), got host {parts.netloc!r}")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise OriginError(f"file:// origin needs an absolute path: {url}")
        return FileOrigin(path, url=url)
    if scheme == "gs":
        default = 4 if emulator_base() else 32
        return GCSOrigin(parts.netloc, unquote(parts.path), max_concurrency=max_concurrency or default,
                         retries=retries)
    if scheme in ("http", "https"):
        if not parts.hostname:
            raise OriginError(f"{scheme}:// origin URL needs a host: {url!r}")
        return HttpOrigin(url, max_concurrency=max_concurrency or 32, retries=retries)
    if scheme == "" and url.startswith("/"):
        return FileOrigin(url, url=f"file://{url}")
    raise OriginError(f"unsupported origin URL {url!r}: use file:///dir, gs://bucket/prefix or https://...")
