"""Errors of the manifests package, named for who broke the rules.

- ``ManifestError``: a manifest (or a tree being scanned / materialised) breaks the format's rules.
  The message names the offending entry; callers show it as one line.
- ``IntegrityError``: bytes do not match the id (hash) they are supposed to have. A subclass of
  ``ManifestError`` so that ``except ManifestError`` around a decode catches every bad manifest.
- ``ChunkerUnavailable``: the compiled FastCDC kernel is missing (we refuse to run 100x slower).
- ``ChunkMissing``: materialise needed a chunk the chunk store does not hold.
"""

from __future__ import annotations


class ManifestError(Exception):
    """A manifest, or a tree being scanned or materialised, breaks the rules."""


class IntegrityError(ManifestError):
    """Bytes do not hash to the id they claim."""


class ChunkerUnavailable(ManifestError):
    """The compiled chunking kernel cannot be used."""


class ChunkMissing(ManifestError):
    """A chunk needed to materialise a manifest is not in the chunk store."""

    def __init__(self, chunk_id: str, path: str) -> None:
        super().__init__(f"chunk {chunk_id} needed by {path!r} is not in the chunk store")
        self.chunk_id = chunk_id
        self.path = path
