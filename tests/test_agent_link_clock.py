"""An agent's link through a placer outage, in virtual time (``autojump_clock``): heartbeats
every heartbeat_s (jittered 0.8-1.0 x), a placer that stops answering is retried with doubling
back-off capped at the heartbeat interval, and the first report that gets through after it is a
full one (re-registration). The placer is httpx's MockTransport (no sockets), the link is real."""

from __future__ import annotations

from itertools import pairwise

import httpx
import msgspec
import trio

from scheduler_link.agent_link import AgentLink
from scheduler_link.messages import NodeReport, ReportReply
from tests.link_hooks import Hooks

HB = 1.0



async def test_heartbeats_backoff_through_an_outage_and_full_report_after(autojump_clock):
    seen: list[tuple[float, bool, bool]] = []   # (virtual time, full, answered)
    down = [False]
    t0 = trio.current_time()

    def placer(req: httpx.Request) -> httpx.Response:
        rep = msgspec.json.decode(req.content, type=NodeReport)
        seen.append((trio.current_time() - t0, rep.full, not down[0]))
        if down[0]:
            raise httpx.ConnectError("connection refused", request=req)
        return httpx.Response(200, content=msgspec.json.encode(ReportReply(ok=True)))

    async with httpx.AsyncClient(transport=httpx.MockTransport(placer)) as http:
        link = AgentLink("http://placer", None, "n1", Hooks(), heartbeat_s=HB, backoff_min_s=0.05,
                         backoff_max_s=5.0, use_wire=False, http=http)
        async with trio.open_nursery() as n:
            await n.start(link.run)
            await trio.sleep(5.0)
            down[0] = True
            await trio.sleep(4.0)
            down[0] = False
            await trio.sleep(3.0)
            n.cancel_scope.cancel()

    up1 = [t for t, _, ok in seen if ok and t < 5.0]
    failed = [t for t, _, ok in seen if not ok]
    after = [(t, full) for t, full, ok in seen if ok and t >= 9.0]
    # registration at once, then one beat every 0.8-1.0 x heartbeat_s
    assert seen[0] == (0.0, True, True) and not any(full for t, full, _ in seen[1:len(up1)])
    assert all(0.8 * HB <= b - a <= HB for a, b in pairwise(up1)) and 5 <= len(up1) <= 7
    # the outage: each retry within a doubling window (0.05, 0.1, ...) capped at HB, full jitter
    gaps = [b - a for a, b in pairwise(failed)]
    caps = [min(HB, 0.05 * 2 ** i) for i in range(len(gaps))]
    assert all(0 <= g <= c for g, c in zip(gaps, caps, strict=True)), gaps
    assert link.failures == len(failed) >= 5 and link.registered
    # back: the first report that is answered is a full one, no later than one capped back-off
    assert after[0][1] is True and after[0][0] - 9.0 <= HB
    assert not any(full for _, full in after[1:])
