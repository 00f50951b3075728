"""Errors of the placer core, by who broke the rules.

``PlacerError`` is the base; every error here is one clear line for a user.
"""

from __future__ import annotations


class PlacerError(Exception):
    """Base of every placer error."""


class InvalidSpec(PlacerError, ValueError):
    """A node spec or a job request that cannot be valid (bad sizes, unknown level, empty ids)."""


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
