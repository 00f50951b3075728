"""Single flight: one download of a chunk (or a manifest) per node at a time, whichever
fetch path asks for it — the herd's pools, the origin-only fetch, a second fetch of the
same artifact. Callers that find a download in flight wait for it, then look again (it
may have failed: then one of them downloads).

The table of downloads in flight is the store's (``ChunkStore.inflight``: one per store,
touched only from the trio thread), so every :class:`SingleFlight` over one store is the
same single flight; this class is the only code that reads or writes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class SingleFlight:
    """At most one ``fetch`` per key in flight; see the module doc."""

    def __init__(self, table: MutableMapping[str, Any] | None = None) -> None:
        self._table: MutableMapping[str, Any] = table if table is not None else {}

    def __contains__(self, key: str) -> bool:
        return key in self._table

    def __len__(self) -> int:
        return len(self._table)

    def claim(self, key: str) -> bool:
        """Take ``key`` as in flight now, without waiting: False when it already is (the
        caller leaves it to :meth:`run`, which waits for that download). A claim must be
        given back with :meth:`release` (a batch of downloads claims each of its keys).
        The caller checks it is not done yet first."""
        if key in self._table:
            return False
        self._table[key] = trio.Event()
        return True

    async def wait(self, key: str) -> bool:
        """Wait for the download of ``key`` in flight, if any, to end; whether there was one."""
        ev = self._table.get(key)
        if ev is None:
            return False
        await ev.wait()
        return True

    def release(self, key: str) -> None:
        """The claimed download of ``key`` is over (done or failed): wake its waiters."""
        ev = self._table.pop(key, None)
        if ev is not None:
            ev.set()

    async def run(self, key: str, done: Callable[[], bool], fetch: Callable[[], Awaitable[T]]) -> T | None:
        """Until ``done()``: when ``key`` is in flight, wait for it and look again; else
        run ``fetch()`` as the one download of ``key`` and return what it returned.
        None when it was done already, or got done by another caller's download."""
        while True:
            if done():
                return None
            ev = self._table.get(key)
            if ev is None:
                break
            await ev.wait()
        ev = self._table[key] = trio.Event()
        try:
            return await fetch()
        finally:
            del self._table[key]
            ev.set()
