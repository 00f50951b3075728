"""infra.backoff: the one back-off type (capped exponential, full jitter, a deadline)."""

from __future__ import annotations

import random

import pytest

from infra.backoff import Backoff, Retry


class Fixed:
    """A random source that always draws ``x``."""

    def __init__(self, x: float) -> None:
        self.x = x

    def random(self) -> float:
        return self.x


def test_windows_double_up_to_the_cap() -> None:
    b = Backoff(0.5, 3.0)
    assert [b.window(n) for n in range(0, 6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.window(10_000) == 3.0   # no overflow however long the outage
    assert Backoff(1.0, 100.0, factor=1.5).window(3) == 2.25


@pytest.mark.parametrize("jitter,draw,want", [(1.0, 0.0, 2.0), (1.0, 0.75, 0.5), (0.5, 0.999, 1.001),
                                               (0.0, 0.3, 2.0)])
def test_full_jitter_draws_over_the_whole_window(jitter: float, draw: float, want: float) -> None:
    assert Backoff(1.0, 10.0, jitter=jitter).pause(2, Fixed(draw)) == pytest.approx(want)


def test_full_jitter_spreads_a_storm_over_the_window() -> None:
    rng = random.Random(7)
    pauses = [Backoff(1.0, 8.0).pause(4, rng) for _ in range(2000)]
    assert 0.0 <= min(pauses) < 0.1 and 7.9 < max(pauses) <= 8.0
    assert sum(pauses) / len(pauses) == pytest.approx(4.0, rel=0.05)


def test_a_retry_counts_failures_in_a_row_and_its_deadline_ends_it() -> None:
    r = Retry(Backoff(1.0, 4.0, deadline_s=10.0, jitter=0.0), Fixed(0.5))
    assert [r.failed(t) for t in (100.0, 101.0, 103.0)] == [1.0, 2.0, 4.0]
    assert not r.expired(109.9)
    assert r.failed(108.0) == 2.0   # never past the deadline (10 s after the first failure)
    assert r.expired(110.0)
    r.succeeded()
    assert not r.expired(500.0) and r.failed(500.0) == 1.0   # a new streak, a new deadline


def test_a_failing_peers_penalty_doubles_per_strike_up_to_64_times() -> None:
    from p2p.peers import PeerError, PeerHealth

    h = PeerHealth(penalty_s=1.0)
    ends = []
    for _ in range(9):
        h.failed("p", PeerError("x"), 100.0)
        ends.append(h.until["p"] - 100.0)
    assert ends == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0]
