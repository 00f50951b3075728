"""Optional bandwidth caps: a token bucket. The arithmetic is pure (``now`` passed in);
:class:`AsyncBucket` is the thin trio shell that sleeps for what it returns."""

from __future__ import annotations

from dataclasses import dataclass

import trio


@dataclass(slots=True)
class TokenBucket:
    rate: float              # bytes per second
    burst: float             # bucket size in bytes
    tokens: float = 0.0
    at: float | None = None    # time of the last take; None = never (the burst is full)

    def take(self, n: int, now: float) -> float:
        """Account for ``n`` bytes at ``now``; returns how long to wait (s) to stay under rate.
        The debt is taken at once, so callers in parallel queue up fairly."""
        if self.at is None:
            self.at, self.tokens = now, self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


class AsyncBucket:
    """``await bucket.consume(n)`` after receiving n bytes; ``None`` rate = no cap."""

    def __init__(self, rate_bps: float | None, burst: float | None = None) -> None:
        self._b = TokenBucket(rate_bps / 8, burst or max(rate_bps / 8 / 10, 1 << 20)) if rate_bps else None

    async def consume(self, n: int) -> None:
        if self._b is None:
            return
        delay = self._b.take(n, trio.current_time())
        if delay > 0:
            await trio.sleep(delay)
