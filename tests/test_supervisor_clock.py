"""The supervisor's deadlines on trio's clock, in virtual time (``autojump_clock``): a stop's
countdown to SIGKILL, one resumed after a restart from its recorded wall-clock deadline, and the
restart back-off. Exact virtual times; nothing really sleeps. The same code stops real workloads
in tests/test_supervisor.py (real shims and processes, real clock, fail_after bounds)."""

from __future__ import annotations

import pytest
import trio

from agent.supervisor import KILL_EVERY_S, kill_after_deadline, on_trio_clock, restart_delay_s
from scheduler_link.messages import RestartPolicy


class Workload:
    """Stands in for the process group: records when it was killed; ``dies_after`` kills end it."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.gone = trio.Event()
        self.kills: list[float] = []
        self.dies_after = dies_after

    async def kill(self) -> None:
        self.kills.append(trio.current_time())
        if self.dies_after is not None and len(self.kills) >= self.dies_after:
            self.gone.set()


async def test_sigkill_at_the_deadline_then_every_second_until_gone(autojump_clock):
    w = Workload(dies_after=3)
    t0 = trio.current_time()
    assert await kill_after_deadline(t0 + 5.0, w.gone, w.kill) == 3
    assert [k - t0 for k in w.kills] == [5.0, 5.0 + KILL_EVERY_S, 5.0 + 2 * KILL_EVERY_S]
    assert trio.current_time() - t0 == 5.0 + 2 * KILL_EVERY_S


async def test_a_workload_that_exits_within_its_grace_is_never_killed(autojump_clock):
    w = Workload()
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(kill_after_deadline, t0 + 30.0, w.gone, w.kill)
        await trio.sleep(3.0)  # it exits 3 s into its 30 s grace
        w.gone.set()
    assert w.kills == [] and trio.current_time() - t0 == 3.0


async def test_countdown_resumed_after_a_restart_keeps_the_recorded_deadline(autojump_clock):
    # the first agent recorded wall deadline 1000.0; its successor starts at wall 997.5
    w = Workload(dies_after=1)
    t0 = trio.current_time()
    kill_at = on_trio_clock(1000.0, 997.5, t0)
    assert kill_at == t0 + 2.5                           # the rest of the grace, not a fresh one
    await kill_after_deadline(kill_at, w.gone, w.kill)
    assert [k - t0 for k in w.kills] == [2.5]


async def test_a_deadline_already_past_kills_at_once(autojump_clock):
    w = Workload(dies_after=1)
    t0 = trio.current_time()
    await kill_after_deadline(on_trio_clock(1000.0, 1004.0, t0), w.gone, w.kill)
    assert w.kills == [t0]


@pytest.mark.parametrize("backoff,delays", [(1.0, [1.0, 2.0, 4.0, 8.0]), (0.25, [0.25, 0.5, 1.0, 2.0])])
def test_restart_back_off_doubles(backoff, delays):
    pol = RestartPolicy(kind="on-failure", limit=4, backoff_s=backoff)
    assert [restart_delay_s(pol, a) for a in (1, 2, 3, 4)] == delays
