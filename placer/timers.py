"""Deadlines by key, in a heap: what is due costs O(log n) per due key, never a scan.

Each key has at most one live deadline. Moving a key's deadline later (a heartbeat pushes
its node's "lost" deadline out) costs O(1): the new deadline is only remembered, and the
heap entry, when it comes up, is re-filed at the remembered time instead of firing. So a
fleet of N nodes heartbeating every interval costs the heap about one pop and one push
per node per *lost threshold*, whatever the heartbeat rate.

Pure: times are passed in.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, float] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def set(self, key: K, at: float) -> None:
        """Key ``key`` is due at ``at`` (replaces any earlier setting)."""
        old = self._due.get(key)
        self._due[key] = at
        if old is None or at < old:
            self._seq += 1
            heapq.heappush(self._heap, (at, self._seq, key))

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)

    def pop_due(self, now: float) -> list[K]:
        """Keys whose deadline is <= ``now`` (each removed)."""
        out: list[K] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            want = self._due.get(key)
            if want is None or want < at:
                continue          # cancelled, or an older entry of a key filed earlier again
            if want > at:         # moved later since this entry was filed: re-file it
                self._seq += 1
                heapq.heappush(heap, (want, self._seq, key))
                continue
            del self._due[key]
            out.append(key)
        return out

    def next_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None
