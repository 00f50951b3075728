"""The lease renewal thread (placer.renewal): renews on its own, records each acknowledged
renewal as sent + TTL, ends by itself when etcd says the lease is gone, and counts the renewals
no member answered; real etcd where installed (skipped otherwise), a closed port for the rest."""

from __future__ import annotations

import gc
import math
import socket
import threading
import time

import trio

from placer.etcd import EtcdClient
from placer.renewal import CollectorPauses, LeaseExpiry, Renewer
from testing.etcd import EtcdCluster


class Wakes:
    """What the renewal thread tells the loop: a count, and an event per call."""

    def __init__(self) -> None:
        self.n = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.n += 1
        self.event.set()


def _wait(pred, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)


def test_lease_expiry_only_grows_until_gone() -> None:
    e = LeaseExpiry(10.0)
    assert e.holds(9.9) and not e.holds(10.0)
    assert e.renewed(3, sent_at=8.0) and e.until == 11.0
    assert e.renewed(3, sent_at=7.0) and e.until == 11.0     # an old answer arriving late
    assert not e.renewed(0, sent_at=9.0) and e.is_gone
    assert e.until == -math.inf and not e.holds(0.0)
    assert not e.renewed(3, sent_at=9.5) and not e.holds(9.6)  # gone stays gone


def test_a_renewal_nobody_answers_is_counted_and_renews_nothing() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # closed once the block ends: connections are refused
    expiry, wakes = LeaseExpiry(time.monotonic() + 60), Wakes()
    until = expiry.until
    r = Renewer([f"http://127.0.0.1:{port}"], 7, expiry, 0.05, attempt_timeout_s=0.5, wake=wakes)
    r.start()
    try:
        _wait(lambda: r.errors >= 2 and wakes.n >= 2, 10)
        assert expiry.until == until and not expiry.is_gone and r.running
    finally:
        r.stop()
        r.join(5)
    assert not r.running


async def test_renews_and_ends_when_the_lease_is_revoked(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(30):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            sent = time.monotonic()
            lease = await c.grant(2)
            expiry, wakes = LeaseExpiry(sent + lease.ttl), Wakes()
            first = expiry.until
            r = Renewer(etcd_cluster.endpoints, lease.id, expiry, 0.2, wake=wakes)
            r.start()
            try:
                await trio.to_thread.run_sync(_wait, lambda: expiry.renewals >= 3, 10)
                assert expiry.until > first and expiry.holds(time.monotonic()) and r.errors == 0
                await c.revoke(lease.id)
                await trio.to_thread.run_sync(_wait, lambda: not r.running, 10)   # ended by itself (not stopped)
                assert expiry.is_gone and not expiry.holds(time.monotonic())
            finally:
                r.stop()
                await trio.to_thread.run_sync(r.join, 5)


class SteppingClock:
    """A monotonic clock that moves ``step`` seconds each time it is read (a thread kept from
    running between its reads)."""

    def __init__(self, step: float) -> None:
        self.step = step
        self.t = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.t += self.step
            return self.t


def test_a_renewal_thread_kept_from_running_says_how_long_the_lease_went(caplog) -> None:  # noqa: ANN001
    """Between two answers the thread went 3 s (its clock says so) with renewals due every
    0.05 s: a warning names the gap, and ``slowest_s`` keeps it -- what the TTL must cover."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    expiry, wakes = LeaseExpiry(60.0), Wakes()
    r = Renewer([f"http://127.0.0.1:{port}"], 7, expiry, 0.05, attempt_timeout_s=0.5, wake=wakes,
                clock=SteppingClock(1.5))
    r.start()
    try:
        _wait(lambda: wakes.n >= 2, 10)
    finally:
        r.stop()
        r.join(5)
    assert r.slowest_s == 3.0   # (two reads a renewal: sent, answered)
    assert any("lease renewal late" in m and "since_last_answer=3.00s" in m for m in caplog.messages), caplog.messages


def test_collector_pauses_are_timed_by_generation() -> None:
    """Each collection between its start and stop callbacks, on the clock given (one second a
    read here); a young collection is counted under its generation, and nothing after removal."""
    pauses = CollectorPauses(clock=SteppingClock(1.0))
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.remove()
    assert pauses.by_gen[0] >= 1 and pauses.by_gen[2] >= 1
    assert pauses.longest_s == 1.0 and pauses.total_s == sum(pauses.by_gen) * 1.0
    seen = list(pauses.by_gen)
    gc.collect(2)
    assert pauses.by_gen == seen


class Node:
    """A record with a cycle (as the placer's are: a node and its GPUs referring back)."""

    def __init__(self) -> None:
        self.me = self


def test_survivors_of_a_full_collection_are_frozen_when_asked() -> None:
    """``freeze_full``: what survives a full collection leaves the collector's sight (the next
    full collection does not walk it again); a young collection freezes nothing; without it,
    nothing is frozen."""
    keep = [Node() for _ in range(5000)]
    plain = CollectorPauses()
    plain.install()
    try:
        gc.collect(2)
    finally:
        plain.remove()
    assert plain.by_gen[2] >= 1 and plain.freezes == 0
    base = gc.get_freeze_count()
    pauses = CollectorPauses(freeze_full=True)
    pauses.install()
    try:
        gc.collect(0)
        assert pauses.freezes == 0
        gc.collect(2)
        assert pauses.freezes >= 1 and gc.get_freeze_count() >= base + len(keep)
    finally:
        pauses.remove()
        gc.unfreeze()   # (this test process's objects back under the collector)
    assert len(keep) == 5000
