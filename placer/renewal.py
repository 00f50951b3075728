"""The leader's lease, renewed on an OS thread of its own, and its known expiry.

Why a thread: the placer's trio loop can be busy for longer than a lease's TTL (a 4,096-node
registration storm held it past a 2 s TTL, and the leader lost its lease to a keepalive
that waited its turn on the loop). A renewal that needs the loop is only as punctual as the
loop's longest step; a thread with its own blocking HTTP client (httpx, sync) is scheduled by
the kernel, so the lease holds while the process lives and reaches etcd, however busy its loop.

Who owns what:
- :class:`LeaseExpiry` is the one piece shared across threads: the monotonic time until which
  the lease is known to hold, and whether etcd said it is gone. The renewal thread writes it,
  the event loop reads it; a lock makes each read and write one step. Its times are
  ``time.monotonic()``'s (the same clock in both threads; never compared across machines).
- :class:`Renewer` is the thread: it renews every TTL/3 (sooner after a failure), records each
  acknowledged renewal as ``sent + TTL`` (``sent``: when the request left, before etcd started
  the TTL it granted, so our view ends before etcd's), and wakes the loop (a callback that must
  not block: ``trio.lowlevel.TrioToken.run_sync_soon``) after every answer.
- A thread is not the loop, but it shares the interpreter: the cyclic garbage collector holds
  every thread while it walks the heap (a leader ingesting a 32,768-node registration storm was
  in a collection in a third of py-spy's samples). :class:`CollectorPauses` times the
  collections; a renewal answered more than two intervals after the one before says how long it
  went and how much of that the collector took (``lease renewal late``); while it runs, each full
  collection's survivors are frozen, so no later one walks the whole heap again (one second and
  more per collection, in that storm, and renewals answered 1.3-1.7 s apart with a 2 s TTL).

Invariant: the loop decides whether it leads from :meth:`LeaseExpiry.holds` with the clock
read *at the moment of the act*, never from a view published earlier: a loop that was
stalled past its lease's expiry finds out on waking, before it sends anything.
"""

from __future__ import annotations

import gc
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from .errors import EtcdError, LeaseNotFound
from .etcd import BlockingLeaseClient

log = logging.getLogger("herd.placer.renewal")

__all__ = ["CollectorPauses", "LeaseExpiry", "Renewer"]


class CollectorPauses:
    """How long the cyclic garbage collector held the interpreter: it runs on whichever thread
    allocated past a threshold and keeps every other thread (the renewal's too) from running
    until it is done. ``install()`` puts a ``gc.callbacks`` hook in place, ``remove()`` takes it
    out; ``total_s`` only grows, ``longest_s`` is the longest one collection took, ``by_gen``
    counts collections by generation. The clock is the caller's (monotonic seconds).

    ``freeze_full``: after each full (generation 2) collection its survivors are frozen
    (``gc.freeze``: moved out of the collector's sight, O(1)), so the next full collection walks
    only what was promoted since, not the whole fleet's records again: a process holding a lease
    is never held for a walk of its entire heap. (Cycles among frozen objects that die later are
    not reclaimed: the placer's own policy already freezes its long-lived records, placer.service.)"""

    __slots__ = ("clock", "freeze_full", "total_s", "longest_s", "by_gen", "freezes", "_start")

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, freeze_full: bool = False) -> None:
        self.clock = clock
        self.freeze_full = freeze_full
        self.freezes = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self.by_gen = [0, 0, 0]
        self._start: float | None = None

    def install(self) -> None:
        gc.callbacks.append(self._hook)

    def remove(self) -> None:
        if self._hook in gc.callbacks:
            gc.callbacks.remove(self._hook)

    def _hook(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = self.clock()
            return
        if self._start is None:
            return
        took, self._start = self.clock() - self._start, None
        self.total_s += took
        self.longest_s = max(self.longest_s, took)
        gen = info.get("generation", 2)
        if 0 <= gen < len(self.by_gen):
            self.by_gen[gen] += 1
        if self.freeze_full and gen == 2:
            gc.freeze()   # (the collection is over: its lists are merged into the permanent one)
            self.freezes += 1


class LeaseExpiry:
    """Until when one lease is known to hold (monotonic seconds), and whether it is gone.
    Thread-safe; no I/O. A new lease gets a new one, so a late answer about an old lease
    changes nothing of the new."""

    __slots__ = ("_lock", "_until", "_gone", "renewals")

    def __init__(self, until: float = -math.inf) -> None:
        self._lock = threading.Lock()
        self._until = until
        self._gone = False
        self.renewals = 0

    def renewed(self, ttl: int, sent_at: float) -> bool:
        """A renewal sent at ``sent_at`` came back with ``ttl`` (0: the lease is gone). False
        when the lease is gone. An old answer arriving late shortens nothing."""
        with self._lock:
            if ttl <= 0:
                self._gone = True
                return False
            if not self._gone:
                self._until = max(self._until, sent_at + ttl)
                self.renewals += 1
            return not self._gone

    def gone(self) -> None:
        """etcd says the lease expired or was revoked: it holds no more, whatever comes later."""
        with self._lock:
            self._gone = True

    @property
    def until(self) -> float:
        with self._lock:
            return -math.inf if self._gone else self._until

    @property
    def is_gone(self) -> bool:
        with self._lock:
            return self._gone

    def holds(self, now: float) -> bool:
        """Whether the lease is known to hold at ``now`` (monotonic)."""
        with self._lock:
            return not self._gone and now < self._until


class Renewer:
    """``start()`` renews ``lease_id`` every ``every_s`` on a daemon thread until ``stop()`` or
    until etcd says the lease is gone; each answer updates ``expiry`` and calls ``wake`` (which
    must neither block nor raise: it runs on this thread). ``join()`` waits for the thread (at most one
    request's time after ``stop()``)."""

    def __init__(self, endpoints: Sequence[str], lease_id: int, expiry: LeaseExpiry, every_s: float, *,
                 ssl_context: ssl.SSLContext | None = None, attempt_timeout_s: float = 2.0,
                 wake: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoints = list(endpoints)
        self.lease_id = lease_id
        self.expiry = expiry
        self.every_s = every_s
        self.ssl_context = ssl_context
        self.attempt_timeout_s = attempt_timeout_s
        self.wake = wake
        self.clock = clock
        self.errors = 0
        self.slowest_s = 0.0   # the longest from one renewal's sending to the next one's answer
        # what the garbage collector took of that time; full collections' survivors frozen
        self.collector = CollectorPauses(freeze_full=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"herd-lease-{lease_id:x}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Renew no more (the lease then runs out a TTL after the last renewal, unless revoked)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        client = BlockingLeaseClient(self.endpoints, ssl_context=self.ssl_context,
                                     attempt_timeout_s=self.attempt_timeout_s)
        last = self.clock()
        self.collector.install()
        held = self.collector.total_s
        try:
            while not self._stop.is_set():
                wait = self.every_s
                sent = self.clock()
                try:
                    ttl = client.keepalive(self.lease_id)
                except LeaseNotFound:
                    ttl = 0
                except EtcdError as e:
                    self.errors += 1
                    log.warning("lease renewal failed lease=%x: %s", self.lease_id, e)
                    wait = self.every_s / 2
                    ttl = -1
                # how long the lease went between two answers: what the holder's TTL must cover
                # (a thread kept from running -- its process descheduled, or another thread
                # holding the interpreter -- shows here, not as an error)
                done = self.clock()
                gap, last = done - last, done
                self.slowest_s = max(self.slowest_s, gap)
                collected, held = self.collector.total_s - held, self.collector.total_s
                if gap > 2 * self.every_s:
                    log.warning("lease renewal late lease=%x since_last_answer=%.2fs request=%.2fs "
                                "garbage_collector=%.2fs", self.lease_id, gap, done - sent, collected)
                if ttl == 0:
                    self.expiry.gone()
                if ttl >= 0 and not self.expiry.renewed(ttl, sent):
                    self.wake()
                    return      # etcd says the lease is gone: nothing left to renew
                self.wake()
                self._stop.wait(wait)
        finally:
            self.collector.remove()
            client.close()
