"""Frozen events the supervisor's owner task receives, and its private per-batch and
per-workload companions (see :mod:`agent.supervisor`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from scheduler_link.messages import Placement


@dataclass(frozen=True, slots=True)
class Place:
    placement: Placement
    direct: bool
    reply: trio.MemorySendChannel[Any]


@dataclass(frozen=True, slots=True)
class Stop:
    workload_id: str
    reason: str
    grace_s: float | None
    reply: trio.MemorySendChannel[Any] | None
    preempted: bool = False


@dataclass(frozen=True, slots=True)
class Change:
    """A life-cycle task reports a change of one record (fields to replace)."""
    workload_id: str
    fields: Mapping[str, Any]
    done: trio.Event | None = None
    fetch: Mapping[str, int] | None = None
    durable: bool = False        # set ``done`` only once the change is on disk


@dataclass(slots=True)
class Batch:
    """What applying a batch of events asks for: ``now`` runs as soon as the batch is
    applied; ``durable`` runs once the state that includes the batch is on disk."""
    now: list[Callable[[], None]] = field(default_factory=list)
    durable: list[Callable[[], None]] = field(default_factory=list)


@dataclass(slots=True)
class Runtime:
    """Owner-side, in-memory companions of a record (never persisted)."""
    gone: trio.Event = field(default_factory=trio.Event)       # record reached a terminal state
    stop: trio.Event = field(default_factory=trio.Event)       # a stop was requested
    pre_start: trio.CancelScope = field(default_factory=trio.CancelScope)
    killer_started: bool = False
