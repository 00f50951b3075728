"""The optional bandwidth cap: token-bucket arithmetic (pure) and its trio shell in
virtual time."""

from __future__ import annotations

import pytest
import trio

from p2p.ratelimit import AsyncBucket, TokenBucket


def test_bucket_allows_the_burst_then_paces() -> None:
    b = TokenBucket(rate=1000.0, burst=500.0)
    assert b.take(500, now=10.0) == 0.0            # the burst is free
    assert b.take(250, now=10.0) == pytest.approx(0.25)
    assert b.take(0, now=10.5) == 0.0               # debt paid back by now
    assert b.take(1000, now=10.5) == pytest.approx(0.75)


async def test_async_bucket_sleeps_exactly_in_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    bucket = AsyncBucket(8e6, burst=1e6)            # 1 MB/s, 1 MB burst
    t0 = trio.current_time()
    for _ in range(3):
        await bucket.consume(1_000_000)
    assert trio.current_time() - t0 == pytest.approx(2.0)
    no_cap = AsyncBucket(None)
    t1 = trio.current_time()
    await no_cap.consume(10**9)
    assert trio.current_time() == t1
