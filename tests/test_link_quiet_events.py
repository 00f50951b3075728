"""Start steps the placer already knows of ride on the next report (agent.daemon.reported_at_once,
AgentLink.notify(at_once=False)): a placement's accepted and starting events do not each cost a
report, so the report that says its pods run goes on an idle link. Virtual time
(``autojump_clock``); the placer is httpx's MockTransport, the link is real."""

from __future__ import annotations

import httpx
import msgspec
import trio

from agent.daemon import reported_at_once
from scheduler_link.agent_link import AgentLink
from scheduler_link.messages import NodeReport, ReportReply, WorkloadEvent
from tests.link_hooks import Hooks

HB = 10.0



def _ev(wid: str, state: str) -> WorkloadEvent:
    return WorkloadEvent(workload_id=wid, job_id="j", state=state, at=0.0)  # type: ignore[arg-type]


def test_only_the_start_steps_the_placer_knows_of_wait_for_the_next_report() -> None:
    assert not reported_at_once("accepted") and not reported_at_once("starting")
    for state in ("fetching", "running", "terminating", "exited", "failed", "preempted", "lost"):
        assert reported_at_once(state), state


async def test_quiet_events_ride_on_the_next_report_that_goes(autojump_clock) -> None:
    """Quiet events queued while a report is in flight wait for the next report that goes (here
    a pod's running event), not one of their own once the answer comes."""
    seen: list[tuple[float, bool, list[tuple[str, str]]]] = []
    t0 = trio.current_time()

    async def placer(req: httpx.Request) -> httpx.Response:
        rep = msgspec.json.decode(req.content, type=NodeReport)
        seen.append((trio.current_time() - t0, rep.full, [(e.workload_id, e.state) for e in rep.events]))
        await trio.sleep(0.2)          # the answer takes a while: the next events queue meanwhile
        return httpx.Response(200, content=msgspec.json.encode(ReportReply(ok=True)))

    def notify(link: AgentLink, wid: str, state: str) -> None:
        link.notify(_ev(wid, state), at_once=reported_at_once(state))

    async with httpx.AsyncClient(transport=httpx.MockTransport(placer)) as http:
        link = AgentLink("http://placer", None, "n1", Hooks(), heartbeat_s=HB, use_wire=False, http=http)
        async with trio.open_nursery() as n:
            await n.start(link.run)
            await trio.sleep(0.5)      # registered (a full report at 0)
            for state in ("accepted", "starting"):
                notify(link, "w0", state)
            await trio.sleep(0.5)      # nothing sent for them alone
            notify(link, "w0", "running")            # at 1.0: sent at once, answered at 1.2
            await trio.sleep(0.1)
            for state in ("accepted", "starting"):   # while that report is in flight
                notify(link, "w1", state)
            await trio.sleep(0.9)
            notify(link, "w1", "running")            # at 2.0
            await trio.sleep(0.5)
            notify(link, "w2", "accepted")
            await trio.sleep(HB)       # the heartbeat carries what is left
            n.cancel_scope.cancel()
    assert seen[0][:2] == (0.0, True)
    assert [(t, full) for t, full, _ in seen[1:3]] == [(1.0, False), (2.0, False)]
    assert seen[1][2] == [("w0", "accepted"), ("w0", "starting"), ("w0", "running")]
    assert seen[2][2] == [("w1", "accepted"), ("w1", "starting"), ("w1", "running")]
    beat = next(s for s in seen[3:] if s[2])
    # (not sent alone at 2.5: on the heartbeat due 0.8-1.0 intervals after the report at 2.0 went)
    assert beat[2] == [("w2", "accepted")] and 2.0 + 0.8 * HB <= beat[0] <= 2.5 + HB
