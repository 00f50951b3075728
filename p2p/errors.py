"""Errors of the p2p package, named by who broke the rules.

``IntegrityError`` (bytes that do not match their hash) belongs to ``manifests``
and is re-exported here so callers of the store and the fetcher catch one class
whichever layer noticed the mismatch.
"""

from __future__ import annotations

from manifests.errors import IntegrityError, ManifestError

__all__ = [
    "IntegrityError",
    "ManifestError",
    "NotFoundError",
    "OriginError",
    "OriginUnavailable",
    "P2PError",
    "PeerError",
    "ReadOnlyOriginError",
    "RefError",
    "StoreError",
    "StoreFullError",
]


class P2PError(Exception):
    """Base of every p2p error."""


class StoreError(P2PError):
    """The local chunk store cannot do what was asked (missing chunk, incomplete manifest...)."""


class StoreFullError(StoreError):
    """The store's disk or quota is full; nothing half-written was left behind."""


class OriginError(P2PError):
    """The origin is unreachable, misbehaved, or kept failing after retries."""


class OriginUnavailable(OriginError):
    """The origin did not answer, or answered "later" (408, 429, 5xx, a timeout, a refused
    or reset connection): asking again may work. Any other ``OriginError`` is an answer
    that will not change (401/403, a bad request, a body over its bound) and is not retried."""


class NotFoundError(OriginError):
    """The origin answered, and it does not hold the object (unknown ref, chunk, manifest)."""


class ReadOnlyOriginError(OriginError):
    """A write was attempted on a read-only origin (http(s)://)."""


class RefError(P2PError, ValueError):
    """A ref name or manifest id that is not acceptable."""


class PeerError(P2PError):
    """A peer misbehaved (bad bytes, bad answer): penalise it and try the next source."""
