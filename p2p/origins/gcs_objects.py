"""What herd's objects look like in a bucket, and what GCS's refusals mean: plain functions
over plain data (no I/O), used by ``gcs.py``.

Objects (the layout of ``base.py``; metadata so ``gcloud storage`` / ``gsutil`` users and the
official clients can read a bucket without herd)::

    chunks/<id>      application/octet-stream               herd-kind=chunk
    manifests/<id>   application/vnd.herd.manifest+msgpack  herd-kind=manifest, herd-ref (the ref it
                                                            was first published as), herd-size,
                                                            herd-files, herd-chunks, herd-format
    refs/<name>      text/plain; charset=utf-8              herd-kind=ref, herd-manifest

Chunks and manifests are content-addressed, so they never change: ``Cache-Control:
max-age=31536000, immutable`` (no ``public``: a shared cache then keeps only what was read
without credentials, RFC 9111 §3.5). Refs move: ``no-cache``, else GCS's default of an hour for
publicly readable objects would hide a new ref from an http(s):// mirror.

Refusals are classified from GCS's JSON error body (``error.errors[].reason``, and the
permission its message names) into one line an operator can act on: a missing bucket,
which permission the credentials lack, a quota or rate limit.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any

import msgspec

MANIFEST_CONTENT_TYPE = "application/vnd.herd.manifest+msgpack"
CHUNK_CONTENT_TYPE = "application/octet-stream"
REF_CONTENT_TYPE = "text/plain; charset=utf-8"
IMMUTABLE = "max-age=31536000, immutable"
MUTABLE = "no-cache"


class ManifestSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a manifest object's metadata says about the manifest."""
    format: int
    size: int
    files: int
    chunks: int


def object_resource(key: str, *, ref: str | None = None, summary: ManifestSummary | None = None,
                    manifest_id: str | None = None) -> dict[str, Any]:
    """The JSON object resource (name excluded) herd uploads with ``key``'s bytes."""
    if key.startswith("chunks/"):
        return {"contentType": CHUNK_CONTENT_TYPE, "cacheControl": IMMUTABLE, "metadata": {"herd-kind": "chunk"}}
    if key.startswith("manifests/"):
        meta = {"herd-kind": "manifest"}
        if ref:
            meta["herd-ref"] = ref
        if summary is not None:
            meta.update({"herd-format": str(summary.format), "herd-size": str(summary.size),
                         "herd-files": str(summary.files), "herd-chunks": str(summary.chunks)})
        return {"contentType": MANIFEST_CONTENT_TYPE, "cacheControl": IMMUTABLE, "metadata": meta}
    if key.startswith("refs/"):
        meta = {"herd-kind": "ref"}
        if manifest_id:
            meta["herd-manifest"] = manifest_id
        return {"contentType": REF_CONTENT_TYPE, "cacheControl": MUTABLE, "metadata": meta}
    return {"contentType": CHUNK_CONTENT_TYPE}


def multipart_body(name: str, resource: dict[str, Any], data: bytes | memoryview, boundary: str) -> tuple[bytes, str]:
    """A ``uploadType=multipart`` body (metadata and media in one request) and its content type."""
    meta = json.dumps({**resource, "name": name}, separators=(",", ":")).encode()
    ctype = str(resource.get("contentType", CHUNK_CONTENT_TYPE))
    b = boundary.encode()
    body = b"".join((
        b"--", b, b"\r\ncontent-type: application/json; charset=UTF-8\r\n\r\n", meta,
        b"\r\n--", b, b"\r\ncontent-type: ", ctype.encode(), b"\r\n\r\n", data,
        b"\r\n--", b, b"--\r\n"))
    return body, f'multipart/related; boundary="{boundary}"'


# ------------------------------------------------------------------ refusals

class Failure(Enum):
    BUCKET_MISSING = "bucket-missing"
    PERMISSION = "permission"
    QUOTA = "quota"
    BILLING = "billing"
    CREDENTIALS = "credentials"
    OTHER = "other"


# The permission each of herd's requests needs (what GCS checks first for it).
PERMISSIONS = {
    "get": "storage.objects.get",
    "metadata": "storage.objects.get",
    "list": "storage.objects.list",
    "upload": "storage.objects.create",
    "overwrite": "storage.objects.delete",   # replacing an existing object (a ref) needs delete too
    "copy": "storage.objects.create",
    "delete": "storage.objects.delete",
    "bucket": "storage.buckets.get",
}

_QUOTA_REASONS = frozenset({"quotaExceeded", "rateLimitExceeded", "userRateLimitExceeded",
                            "dailyLimitExceeded", "storageQuotaExceeded", "resourceExhausted"})
_BILLING_REASONS = frozenset({"accountDisabled", "billingNotEnabled", "userProjectAccountProblem",
                              "billingDisabled"})
_PERMISSION = re.compile(r"\b(storage\.[a-zA-Z]+\.[a-zA-Z]+)\b")
_PRINCIPAL = re.compile(r"^(\S+@\S+) does not have\b")


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    kind: Failure
    line: str


def _error_fields(body: bytes) -> tuple[str, list[str]]:
    """(message, reasons) of a GCS JSON error body; ('', []) when it is not one."""
    try:
        err = json.loads(body)["error"]
        message = str(err.get("message", "")) if isinstance(err, dict) else str(err)
        reasons = [str(e.get("reason", "")) for e in (err.get("errors") or []) if isinstance(e, dict)] \
            if isinstance(err, dict) else []
    except (ValueError, KeyError, TypeError, AttributeError):
        return "", []    # not GCS's JSON: whatever answered wrote it, and it is not repeated
    return message.strip().splitlines()[0][:300] if message.strip() else "", reasons


def classify(status: int, body: bytes, *, action: str, bucket: str, key: str) -> Refusal:
    """What a non-success answer to ``action`` (a key of PERMISSIONS) on ``key`` means.

    A 404 means a missing bucket for an upload, a list or a bucket lookup, or when GCS
    says so; for a read of one object it is that object's absence (callers handle that
    before asking here)."""
    message, reasons = _error_fields(body)
    what = f"{action} {key}".strip()
    on = f" on {what}" if what else ""
    detail = f" ({message})" if message else ""
    if status == 404 and (action in ("upload", "overwrite", "list", "bucket", "copy")
                          or "bucket does not exist" in message.lower()):
        return Refusal(kind=Failure.BUCKET_MISSING,
                       line=f"bucket {bucket!r} does not exist (or is not visible to these credentials); "
                            f"create it with: gcloud storage buckets create gs://{bucket}")
    if status == 429 or _QUOTA_REASONS.intersection(reasons):
        reason = next((r for r in reasons if r in _QUOTA_REASONS), "rate limit")
        return Refusal(kind=Failure.QUOTA,
                       line=f"GCS quota or rate limit exceeded ({reason}, HTTP {status}){on}{detail}")
    if status == 403 and _BILLING_REASONS.intersection(reasons):
        return Refusal(kind=Failure.BILLING, line=f"GCS refused {what or 'the request'}: billing problem "
                                                  f"on the bucket's project (HTTP 403){detail}")
    if status == 403:
        m = _PERMISSION.search(message)
        perm = m.group(1) if m else PERMISSIONS.get(action, "storage.objects.*")
        p = _PRINCIPAL.match(message)
        who = f"{p.group(1)} needs" if p else "the credentials in use need"
        return Refusal(kind=Failure.PERMISSION,
                       line=f"permission denied: {who} {perm} on gs://{bucket} ({what}); grant a role "
                            "with it (roles/storage.objectViewer to fetch, roles/storage.objectUser to "
                            "publish and gc)")
    if status == 401:
        return Refusal(kind=Failure.CREDENTIALS,
                       line=f"GCS refused the credentials (HTTP 401){on}{detail}")
    return Refusal(kind=Failure.OTHER, line=f"{what + ': ' if what else ''}HTTP {status}{detail}")
