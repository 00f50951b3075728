"""Waiting in tests on what the code under test emits, not on a polling interval.

A :class:`Changes` is poked by a hook the code already has (a fake placer's handler, the
collector of sd_notify datagrams, a state-change listener, ...); :func:`until` waits on an
Event the code sets itself (``Supervisor.next_change``). Each wakes every waiter, which
checks its condition again. Nothing sleeps: a waiter wakes exactly when something it might
be waiting for happened. The caller bounds the wait with its own ``fail_after``; a
generous :data:`SAFETY_S` bound inside only turns a hang into a failure.

:func:`poll` is the one place tests look again on an interval: for state that sets no
Event of ours (another process, a file, a server's counters read over HTTP, a counter a
daemon under test keeps without a hook). A test that can wait on an Event does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import trio

SAFETY_S = 300.0   # the bound inside every wait here (longer than any caller's): a hang becomes a failure


class Changes:
    def __init__(self) -> None:
        self._ev = trio.Event()
        self.pokes = 0

    def poke(self, *_: Any) -> None:
        """Something changed (usable as a listener: arguments are ignored)."""
        self.pokes += 1
        ev, self._ev = self._ev, trio.Event()
        ev.set()

    async def until(self, pred: Callable[[], Any]) -> Any:
        """Wait until ``pred()`` is true (checked now and after every poke); returns its value."""
        with trio.fail_after(SAFETY_S):
            while not (v := pred()):
                await self._ev.wait()
        return v


async def until(next_change: Callable[[], trio.Event], pred: Callable[[], Any]) -> Any:
    """Wait until ``pred()`` is true, checked now and each time the Event that
    ``next_change()`` returns is set (e.g. ``Supervisor.next_change``); returns its value."""
    with trio.fail_after(SAFETY_S):
        while not (v := pred()):
            await next_change().wait()
    return v


async def poll(pred: Callable[[], Any], every_s: float) -> Any:
    """Wait until ``pred()`` (a function or an async one) is true, looking again every
    ``every_s``; returns its value. Only for state that sets no Event of ours (see the
    module doc)."""
    with trio.fail_after(SAFETY_S):
        while True:
            v = pred()
            if inspect.isawaitable(v):
                v = await v
            if v:
                return v
            await trio.sleep(every_s)
