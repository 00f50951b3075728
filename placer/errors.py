"""Errors of the placer, by who broke the rules.

``PlacerError`` is the base of every error the placer raises on purpose; each is one clear
line for a user. Third-party failures are mapped to these where they enter: the journal's
OSError and msgspec errors become :class:`JournalError`, TOML and msgspec errors of the
config become :class:`PlacerConfigError`, a KeyError of a lookup becomes
:class:`UnknownNode`/:class:`UnknownJob`, httpx failures and etcd's answers become
:class:`EtcdError` and its kinds (placer.etcd).
"""

from __future__ import annotations


class PlacerError(Exception):
    """Base of every placer error."""


class InvalidSpec(PlacerError, ValueError):
    """A node spec or a job request that cannot be valid (bad sizes, unknown level, empty ids)."""


class BadRequest(PlacerError, ValueError):
    """A request or message whose shape the placer cannot use (a page that is not OFFSET:LIMIT,
    a rack beat whose columns differ in length); the sender's error, nothing was changed."""


class UnknownNode(PlacerError, KeyError):
    """A node id the model does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown node"


class UnknownJob(PlacerError, KeyError):
    """A job id the model (or the queue) does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown job"


class Conflict(PlacerError):
    """A mutation that would break an invariant: a GPU given twice, a duplicate job id,
    a stale decision naming GPUs that are no longer free or usable. Nothing was changed."""


class ContractError(PlacerError, ValueError):
    """A core was driven against its contract (events out of order, an answer naming nodes it
    cannot name, bytes that are not the format asked for): a bug in the caller or a peer's
    answer that cannot be. Nothing was changed."""


class JobError(PlacerError):
    """A job request the placer refuses (bad spec, unknown job, wrong state); ``status`` is the
    HTTP status the service answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class JournalError(PlacerError):
    """The journal cannot be read or written."""


class PlacerConfigError(PlacerError):
    """A config file or flag the placer cannot use."""


class EtcdError(PlacerError):
    """etcd answered with an error, or with something that is not etcd's answer."""


class EtcdUnavailable(EtcdError):
    """No endpoint of the etcd cluster answered (down, cut off from its quorum, no leader): try again later."""


class EtcdRefused(EtcdError):
    """etcd refused the request itself (too large, too many operations, a compacted revision):
    sending it again cannot help."""


class LeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


class Deposed(JournalError):
    """This placer no longer leads: etcd refused its write because the leader key it was elected
    with is gone (its lease ran out or was revoked), so nothing of the write landed."""


class LeadershipLost(PlacerError):
    """This placer led and no longer does (its etcd lease ran out or was revoked); it stops so
    that, restarted, it joins as a follower with a fresh state."""
