"""One retry layer for the placer's pushes (issue 20 §2): the push pool sends a push
once; the placer's re-placement back-off (an unreachable node's start rolls its gang
back and places it again) is the layer that retries. Counted against a real loopback
endpoint that accepts each connection and closes it unanswered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import trio

from infra.auth import TokenSet
from placer.service import PlacerService
from scheduler_link.fanout import PushPool
from scheduler_link.messages import NodeReport
from testing.fake_agent import FakeAgent
from tests.test_placer_service import Cluster, cfg, wait_for


async def _hang_up(nursery: trio.Nursery, seen: list[int]) -> str:
    """An endpoint that accepts, reads the request, and closes without an answer."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        seen.append(1)
        async with stream:
            with trio.move_on_after(1):
                await stream.receive_some(65536)

    nursery.start_soon(trio.serve_listeners, handle, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_a_push_is_one_attempt_unless_the_pool_is_made_with_retries() -> None:
    seen: list[int] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await _hang_up(n, seen)
            pool = PushPool(attempt_timeout_s=2)
            res = await pool.post(url, "/v1/placements", b"{}", key="n0")
            assert res.status is None and res.attempts == 1 and "closed" in (res.error or "")
            assert len(seen) == 1 and pool.requests == 1
            # a caller with no retry layer above may ask for one here
            again = PushPool(attempt_timeout_s=2, retries=2, retry_backoff_s=0.01)
            res = await again.post(url, "/v1/placements", b"{}", key="n0")
            assert res.attempts == 3 and len(seen) == 1 + 3
            await pool.aclose()
            await again.aclose()
            n.cancel_scope.cancel()


class _Unreachable(FakeAgent):
    """Reports through the real link, but names a control URL that hangs up."""

    def __init__(self, *a: Any, control_url: str, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.bad_url = control_url

    def full_report(self) -> NodeReport:
        return msgspec.structs.replace(super().full_report(), control_url=self.bad_url)


async def test_an_unreachable_node_is_retried_by_re_placement_one_push_each(tmp_path: Path, token_dir: Path,
                                                                            autojump_clock: trio.abc.Clock) -> None:
    """In virtual time (the rollback back-off's 0, 0.5, 1 s are the clock's), real sockets."""
    tokens = TokenSet.load(token_dir)
    seen: list[int] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            bad = await _hang_up(n, seen)
            svc = PlacerService(cfg(tmp_path), tokens, clock=trio.current_time)
            url = await n.start(svc.run)
            agent = _Unreachable("n0", tokens, control_url=bad)
            await n.start(agent.run, url)
            cl = Cluster(tokens, url, [agent])
            await wait_for(lambda: cl.nodes_up(1))
            await cl.submit(job_id="j", pods=1, gpus_per_pod=8)

            async def three_rollbacks() -> bool:
                return svc.state.counters["rollbacks"] >= 3

            # rollback delays 0, 0.5, 1 s: three re-placements within ~2 s
            with trio.fail_after(20):
                await wait_for(three_rollbacks)
            failed = svc.push_counts["failed"]
            assert failed >= 3
            # one connection per push: the re-placement is the only retry layer
            # (the pool's old 2 retries made it 3 per push)
            assert len(seen) == failed
            assert svc.pool.requests == failed
            n.cancel_scope.cancel()
