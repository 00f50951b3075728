"""Waiting in tests on what the code under test emits, not on a polling interval.

A :class:`Changes` is poked by a hook the code already has (the supervisor's state-change
listener, the collector of sd_notify datagrams, ...); each poke wakes every waiter, which
checks its condition again. Nothing sleeps: a waiter wakes exactly when something it might
be waiting for happened, and ``timeout`` is its ``fail_after`` bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


class Changes:
    def __init__(self) -> None:
        self._ev = trio.Event()
        self.pokes = 0

    def poke(self, *_: Any) -> None:
        """Something changed (usable as a listener: arguments are ignored)."""
        self.pokes += 1
        ev, self._ev = self._ev, trio.Event()
        ev.set()

    async def until(self, pred: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Wait until ``pred()`` is true (checked now and after every poke); returns its value."""
        with trio.fail_after(timeout):
            while not (v := pred()):
                await self._ev.wait()
        return v
