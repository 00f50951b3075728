"""Bounded worker pools whose first failure is raised as itself (not an ExceptionGroup)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

T = TypeVar("T")


async def run_pool(items: Sequence[T], fn: Callable[[T], Awaitable[object]], concurrency: int) -> None:
    """Run ``fn(item)`` for every item, at most ``concurrency`` at once, in order of start.

    The first exception cancels the remaining work and is re-raised unchanged, so
    callers (and the CLI) see e.g. an IntegrityError rather than a group of them.
    """
    if not items:
        return
    errors: list[BaseException] = []
    it = iter(items)

    async with trio.open_nursery() as nursery:
        async def worker() -> None:
            for item in it:
                try:
                    await fn(item)
                except Exception as e:
                    if not errors:
                        errors.append(e)
                    nursery.cancel_scope.cancel()
                    return

        for _ in range(min(max(1, concurrency), len(items))):
            nursery.start_soon(worker)
    if errors:
        raise errors[0]
