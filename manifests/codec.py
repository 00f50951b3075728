"""Canonical binary encoding of a Manifest, its id, and a JSON view for humans.

Encoding: msgpack via msgspec, every Struct ``array_like`` (fields in declaration order, no keys),
every field always written (no omitted defaults). msgspec writes each integer, string and array
header in its shortest msgpack form, so a Manifest *value* has exactly one byte string. The value is
itself unique per tree (see :mod:`manifests.model`: sorted entries, normalised modes, first-use chunk
table), so one tree has one encoding and one id.

Decoding is strict: size bound first, typed decode, :func:`validate_manifest`, then the bytes must be
exactly the re-encoding of the decoded value (this refuses trailing fields, non-shortest integers and
any other second spelling of the same value), and, when the caller knows it, the id must match.

``manifest_id = BLAKE3-256(canonical bytes)``, lowercase hex.
"""

from __future__ import annotations

from typing import Any

import blake3
import msgspec

from .errors import IntegrityError, ManifestError
from .model import MANIFEST_VERSION, MAX_MANIFEST_BYTES, Manifest
from .validate import validate_manifest

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Manifest)


class _Head(msgspec.Struct, array_like=True):
    version: int


_head_decoder = msgspec.msgpack.Decoder(_Head)


def encode_manifest(m: Manifest) -> bytes:
    """The canonical bytes of ``m`` (no validation: :func:`validate_manifest` does that)."""
    return _encoder.encode(m)


def manifest_id(m: Manifest) -> str:
    return blake3.blake3(_encoder.encode(m)).hexdigest()


def decode_manifest(data: bytes, expected_id: str | None = None) -> Manifest:
    """Decode and fully validate a manifest; never returns a partly valid one.

    Raises IntegrityError if ``expected_id`` is given and the bytes do not hash to it, ManifestError
    (with the offending entry named) for anything else wrong.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ManifestError(f"manifest must be bytes, got {type(data).__name__}")
    size = len(data)
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {size} bytes, more than the limit {MAX_MANIFEST_BYTES}")
    digest = blake3.blake3(data).hexdigest()
    if expected_id is not None and digest != expected_id:
        raise IntegrityError(f"manifest bytes hash to {digest}, expected {expected_id:.80}")
    try:
        m = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # Say "unknown version" rather than a type error when a later format is what we got.
        try:
            head = _head_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise ManifestError(f"not a herd manifest: {exc}") from None
        if head.version != MANIFEST_VERSION:
            raise ManifestError(
                f"unknown manifest version {head.version} (this herd reads {MANIFEST_VERSION})"
            ) from None
        raise ManifestError(f"malformed manifest: {exc}") from None
    validate_manifest(m)
    if _encoder.encode(m) != data:
        raise ManifestError("manifest bytes are not in canonical form")
    m.__dict__["id"] = digest  # seed the cached property: we just hashed these exact bytes
    return m


def to_json_view(m: Manifest) -> dict[str, Any]:
    """A JSON-ready dict for humans: modes in octal, chunk ids inline per file."""
    table = m.chunks
    entries: list[dict[str, Any]] = []
    for e in m.entries:
        item: dict[str, Any] = {"path": e.path, "kind": e.kind, "mode": f"{e.mode:04o}"}
        if e.kind == "file":
            item["size"] = e.size
            item["chunks"] = [table[i].id for i in e.chunks]
        elif e.kind == "symlink":
            item["target"] = e.target
        entries.append(item)
    c = m.chunker
    return {
        "id": m.id,
        "version": m.version,
        "chunker": {
            "name": c.name,
            "version": c.version,
            "min_size": c.min_size,
            "avg_size": c.avg_size,
            "max_size": c.max_size,
        },
        "files": sum(1 for e in m.entries if e.kind == "file"),
        "bytes": m.total_size,
        "unique_chunks": len(table),
        "unique_bytes": m.unique_size,
        "entries": entries,
    }
