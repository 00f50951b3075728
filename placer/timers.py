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
import math
from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np

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


class DenseDeadlines(Generic[K]):
    """Deadlines by key in one numpy array: for a key set that is nearly always armed and
    moved later again and again (every node's "lost" deadline, pushed out by each beat).

    Why not the heap above: every armed key's heap entry comes up once per lost threshold and
    is re-filed, and nodes that registered together come up together: at 131,072 nodes one
    tick re-filed ~131k entries (~200 ms with the event loop held, measured in the real placer
    with py-spy). Here :meth:`set` is a dict lookup and an array store, and :meth:`pop_due`
    is one vectorised compare over the array when the earliest deadline may have passed
    (~0.1 ms at 131,072 keys), then Python work only for the keys actually due.

    Same interface and semantics as :class:`Deadlines` (at most one live deadline a key;
    keys come out in deadline order, each once). Pure: times are passed in.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._at = np.full(max(16, capacity), np.inf)
        self._keys: list[K | None] = [None] * len(self._at)
        self._slot: dict[K, int] = {}
        self._free: list[int] = list(range(len(self._at) - 1, -1, -1))
        self._low = math.inf           # a lower bound of every live deadline

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def _grow(self) -> None:
        n = len(self._at)
        self._at = np.concatenate([self._at, np.full(n, np.inf)])
        self._keys.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def set(self, key: K, at: float) -> None:
        """Key ``key`` is due at ``at`` (replaces any earlier setting)."""
        i = self._slot.get(key)
        if i is None:
            if not self._free:
                self._grow()
            i = self._free.pop()
            self._slot[key] = i
            self._keys[i] = key
        self._at[i] = at
        if at < self._low:
            self._low = at

    def cancel(self, key: K) -> None:
        i = self._slot.pop(key, None)
        if i is not None:
            self._at[i] = np.inf
            self._keys[i] = None
            self._free.append(i)

    def pop_due(self, now: float) -> list[K]:
        """Keys whose deadline is <= ``now`` (each removed), earliest first."""
        if now < self._low or not self._slot:
            return []
        at = self._at
        idx = np.flatnonzero(at <= now)
        if len(idx):
            idx = idx[np.argsort(at[idx], kind="stable")]
            at[idx] = np.inf
        keys = self._keys
        out: list[K] = []
        for i in idx.tolist():
            k = keys[i]
            keys[i] = None
            if k is not None:
                del self._slot[k]
                out.append(k)
            self._free.append(i)
        self._low = float(at.min()) if self._slot else math.inf
        return out

    def next_at(self) -> float | None:
        return None if not self._slot else float(self._at.min())
