"""One run of the herd's chunk pools: what to fetch next, how many peer bodies may flow
in, when the endgame starts, when to sync. Pure: no sockets, no clocks, no trio calls
other than the Event a worker waits on for more work; ``p2p.herd.Herd`` carries out
what it decides.

Two queues, in manifest order: ``own`` (chunks this node is home for: they go to the
origin, through their own small pool so the origin link stays busy while the other pool
waits on peers' in-flight downloads) and ``rest``. The tree planner fills them block by
block (:meth:`FetchRun.add_planned`), then closes the run; a closed run takes nothing
new. A batch may take chunks out of order (:meth:`FetchRun.take_more` with ``scan``):
those past the queue's pointer are marked ``picked`` and skipped when the pointer
reaches them. Invariants: ``taken[q] <= len(queue q)``; every picked index is past
``taken[q]``; ``outstanding`` = taken and not yet finished (never negative); the endgame
is never before the run is closed and both queues are taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import trio

Item = tuple[str, int]        # (chunk id, size)
OWN, REST = 0, 1


class _Planned(Protocol):
    """What :meth:`FetchRun.add_planned` reads of a ``p2p.tree.Planner``."""
    done: int

    def is_home(self, c: int) -> bool: ...


class FetchRun:
    """A fetch run's queues and counters; the choices are methods over them."""

    def __init__(self, *, workers: int, endgame: int, sync_every_bytes: int, home_gate: int,
                 own: list[Item] | None = None, rest: list[Item] | None = None) -> None:
        self.workers = max(1, workers)
        self.endgame_at = endgame
        self.sync_every_bytes = sync_every_bytes
        self.home_gate = max(1, home_gate)
        self.queues: tuple[list[Item], list[Item]] = (own if own is not None else [],
                                                      rest if rest is not None else [])
        self.taken = [0, 0]
        self.picked: tuple[set[int], set[int]] = (set(), set())   # taken out of order, past taken[q]
        self.closed = False
        self.outstanding = 0
        self.own_active = 0
        self.unsynced = 0
        self.syncing = False
        self.failure: Exception | None = None
        self._ptr = 0                 # next item of the todo list add_planned has not queued
        self._more = trio.Event()

    @property
    def own(self) -> list[Item]:
        return self.queues[OWN]

    @property
    def rest(self) -> list[Item]:
        return self.queues[REST]

    # ------------------------------------------------------------------ filling

    def add_planned(self, plan: _Planned, todo: Sequence[Item], cindex: Mapping[str, int]) -> int:
        """Queue the chunks of ``todo`` (in manifest order) whose trees are planned
        (manifest index < ``plan.done``): home chunks to ``own``, the others to
        ``rest``. Returns how many were queued."""
        n = 0
        while self._ptr < len(todo) and cindex[todo[self._ptr][0]] < plan.done:
            item = todo[self._ptr]
            self.queues[OWN if plan.is_home(cindex[item[0]]) else REST].append(item)
            self._ptr += 1
            n += 1
        self._wake()
        return n

    def close(self) -> None:
        """Nothing more will be queued."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = trio.Event()

    async def changed(self) -> None:
        """Until something was queued or the run closed."""
        await self._more.wait()

    # ------------------------------------------------------------------ choices

    def pool_sizes(self, *, own_workers: int) -> tuple[int, int]:
        """Workers to start for (own, rest): a queue still being filled gets its whole
        pool; a closed one no more workers than chunks."""
        if not self.closed:
            return own_workers, self.workers
        return min(own_workers, len(self.own)), min(self.workers, len(self.rest))

    def _skip(self, q: int) -> None:
        """Move queue ``q``'s pointer past the chunks a batch took out of order."""
        picked = self.picked[q]
        while picked and self.taken[q] in picked:
            picked.discard(self.taken[q])
            self.taken[q] += 1

    def _count(self, q: int) -> None:
        self.outstanding += 1
        if q == OWN:
            self.own_active += 1

    def take(self, q: int) -> Item | None:
        """The next chunk of queue ``q`` (counted as outstanding), or None when there is
        none now (see :meth:`exhausted`)."""
        queue = self.queues[q]
        self._skip(q)
        if self.taken[q] >= len(queue):
            return None
        item = queue[self.taken[q]]
        self.taken[q] += 1
        self._skip(q)
        self._count(q)
        return item

    def take_more(self, q: int, fits: Callable[[str], bool], max_n: int, max_bytes: int,
                  scan: int = 0) -> list[Item]:
        """Up to ``max_n`` more chunks of queue ``q`` for the batch just taken: the next
        ones in order while ``fits(id)`` and their sizes stay within ``max_bytes``; with
        ``scan``, then also those that fit among the next ``scan`` not taken yet, out of
        order (a tree child's next chunks from one parent, whose chunks interleave with
        other parents' in the manifest). Each counted as outstanding, like :meth:`take`."""
        queue = self.queues[q]
        out: list[Item] = []
        self._skip(q)
        while len(out) < max_n and self.taken[q] < len(queue):
            item = queue[self.taken[q]]
            if item[1] > max_bytes or not fits(item[0]):
                break
            max_bytes -= item[1]
            out.append(item)
            self.taken[q] += 1
            self._skip(q)
            self._count(q)
        picked = self.picked[q]
        j = self.taken[q]
        end = min(len(queue), j + max(scan, 0))
        while len(out) < max_n and j < end:
            if j not in picked:
                item = queue[j]
                if item[1] <= max_bytes and fits(item[0]):
                    max_bytes -= item[1]
                    out.append(item)
                    picked.add(j)
                    self._count(q)
            j += 1
        self._skip(q)
        return out

    def exhausted(self, q: int) -> bool:
        """Queue ``q`` is taken and nothing more will come: its worker may stop."""
        self._skip(q)
        return self.closed and self.taken[q] >= len(self.queues[q])

    def finished(self, q: int) -> None:
        """A taken chunk is done (stored, or failed)."""
        self.outstanding -= 1
        if q == OWN:
            self.own_active -= 1

    def gate_tokens(self) -> int:
        """Peer bodies flowing in at once: while this node may still have chunks to read
        from the origin as their home, ``home_gate`` (its origin streams are everyone's
        critical path and must keep their share of its downlink); then ``workers``."""
        self._skip(OWN)
        busy_home = not self.closed or self.taken[OWN] < len(self.own) or self.own_active > 0
        return self.home_gate if busy_home else self.workers

    def in_endgame(self) -> bool:
        """Both queues taken, the run closed, at most ``endgame`` chunks outstanding: the
        last chunks may be asked of a second peer at once."""
        self._skip(OWN)
        self._skip(REST)
        return (self.closed and self.taken[OWN] >= len(self.own) and self.taken[REST] >= len(self.rest)
                and self.outstanding <= self.endgame_at)

    def stored(self, size: int) -> bool:
        """``size`` bytes were stored; True when a batched sync should start now (never
        two at once; one per ``sync_every_bytes``, not one per chunk)."""
        self.unsynced += size
        if self.unsynced >= self.sync_every_bytes and not self.syncing:
            self.unsynced = 0
            self.syncing = True
            return True
        return False

    def synced(self) -> None:
        self.syncing = False

    def fail(self, e: Exception) -> bool:
        """Record a failure; True for the first (the one the run raises)."""
        if self.failure is None:
            self.failure = e
            return True
        return False
