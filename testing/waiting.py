"""Waiting in tests on what the code under test emits, not on a polling interval.

A :class:`Changes` is poked by a hook the code already has (a fake placer's handler, the
collector of sd_notify datagrams, a state-change listener, ...); :func:`until` waits on an
Event the code sets itself (``Supervisor.next_change``). Each wakes every waiter, which
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


async def until(next_change: Callable[[], trio.Event], pred: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Wait until ``pred()`` is true, checked now and each time the Event that
    ``next_change()`` returns is set (e.g. ``Supervisor.next_change``); returns its value."""
    with trio.fail_after(timeout):
        while not (v := pred()):
            await next_change().wait()
    return v
