"""testing.waiting.Changes in virtual time: a waiter wakes at the poke that makes its condition
true (never on an interval), and its bound fails when none comes."""

from __future__ import annotations

import pytest
import trio

from testing.waiting import SAFETY_S, Changes, poll, until


async def test_a_waiter_wakes_exactly_at_the_poke_that_satisfies_it(autojump_clock):
    c, box = Changes(), []

    async def emit() -> None:
        for i in range(3):
            await trio.sleep(1.0)
            box.append(i)
            c.poke()

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(emit)
        assert await c.until(lambda: len(box) >= 2 and len(box)) == 2
        assert trio.current_time() - t0 == 2.0
    assert c.pokes == 3
    with pytest.raises(trio.TooSlowError), trio.fail_after(5.0):   # the caller's bound
        await c.until(lambda: len(box) > 3)
    assert trio.current_time() - t0 == 3.0 + 5.0
    with pytest.raises(trio.TooSlowError):   # none: the safety bound
        await c.until(lambda: len(box) > 3)
    assert trio.current_time() - t0 == 3.0 + 5.0 + SAFETY_S


async def test_poll_looks_again_on_its_interval_and_takes_async_checks(autojump_clock):
    seen: list[float] = []
    t0 = trio.current_time()

    async def check() -> bool:
        seen.append(trio.current_time() - t0)
        return len(seen) >= 3

    assert await poll(check, 0.5) is True
    assert seen == [0.0, 0.5, 1.0]
    assert await poll(lambda: 7, 1.0) == 7 and trio.current_time() - t0 == 1.0


async def test_until_waits_on_the_event_the_code_sets(autojump_clock):
    state = {"ev": trio.Event(), "n": 0}

    async def owner() -> None:  # like Supervisor.run: apply, then set and replace the Event
        for _ in range(4):
            await trio.sleep(0.5)
            state["n"] += 1
            state["ev"].set()
            state["ev"] = trio.Event()

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(owner)
        assert await until(lambda: state["ev"], lambda: state["n"] >= 3) is True
        assert trio.current_time() - t0 == 1.5
