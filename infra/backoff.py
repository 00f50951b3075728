"""Back-off between retries: capped exponential, full jitter, a deadline. The one type.

Every retry loop of ours (the agent's reports and framed channel, the relay's shared wire,
the placer's pushes, the herd's and the origins' requests, the supervisor's restarts)
takes its pauses from a :class:`Backoff`. It is pure: it computes a pause from the number
of failures in a row and a random source the caller gives it, and never sleeps; the trio
sleep stays at the call site, where the cancel scope that bounds it is.

The window after ``n`` failures in a row is ``first_s * factor**(n-1)``, capped at
``cap_s``. Full jitter (``jitter=1``, the default) draws the pause uniformly from the
whole window: clients that failed together (a placer restart seen by a thousand agents)
spread their retries over it instead of coming back in waves. ``jitter=0`` is the window
itself (the supervisor's restarts, where one process is waited on and exact times are
what an operator reads); in between keeps ``1 - jitter`` of the window as a floor.

A :class:`Retry` is one loop's place in its back-off: the failures in a row and when the
first of them was, so a ``deadline_s`` (time since the first failure) ends the loop.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol


class RandomSource(Protocol):
    def random(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float
    cap_s: float
    deadline_s: float = math.inf   # give up this long after the first failure in a row
    jitter: float = 1.0            # the share of the window drawn at random (1: full jitter)
    factor: float = 2.0

    def window(self, failures: int) -> float:
        """The longest pause after ``failures`` (1, 2, ...) failures in a row."""
        if failures <= 0:
            return 0.0
        return min(self.cap_s, self.first_s * self.factor ** min(failures - 1, 1023))

    def pause(self, failures: int, rng: RandomSource) -> float:
        """A pause after ``failures`` failures in a row: within the window, jittered."""
        return self.window(failures) * (1.0 - self.jitter * rng.random())


class Retry:
    """One retry loop's place in its :class:`Backoff` (state owned by the loop's task)."""

    __slots__ = ("backoff", "failures", "first_at", "rng")

    def __init__(self, backoff: Backoff, rng: RandomSource | None = None) -> None:
        self.backoff = backoff   # may be replaced between failures (a cap that follows a setting)
        self.rng: RandomSource = rng if rng is not None else random.Random()
        self.failures = 0
        self.first_at = 0.0

    def failed(self, now: float) -> float:
        """Count a failure at ``now``; the pause before the next try, never past the deadline."""
        if self.failures == 0:
            self.first_at = now
        self.failures += 1
        left = self.backoff.deadline_s - (now - self.first_at)
        return max(0.0, min(self.backoff.pause(self.failures, self.rng), left))

    def expired(self, now: float) -> bool:
        """Whether the failures in a row began ``deadline_s`` or more before ``now``: give up."""
        return self.failures > 0 and now - self.first_at >= self.backoff.deadline_s

    def succeeded(self) -> None:
        self.failures = 0


__all__ = ["Backoff", "RandomSource", "Retry"]
