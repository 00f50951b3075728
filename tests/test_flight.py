"""p2p.flight: one download per key, whichever caller (in virtual time); a failed
download lets a waiter try; the table is the store's, shared by every SingleFlight."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.flight import SingleFlight


async def test_concurrent_callers_share_one_download(autojump_clock: trio.abc.Clock) -> None:
    table: dict[str, object] = {}
    a, b = SingleFlight(table), SingleFlight(table)            # two paths over one store's table
    have: set[str] = set()
    calls: list[float] = []
    got: list[object] = []

    async def fetch() -> str:
        calls.append(trio.current_time())
        await trio.sleep(1)
        have.add("k")
        return "bytes"

    async def caller(f: SingleFlight) -> None:
        got.append(await f.run("k", lambda: "k" in have, fetch))

    async with trio.open_nursery() as nursery:
        for f in (a, b, a):
            nursery.start_soon(caller, f)
        await trio.testing.wait_all_tasks_blocked()
        assert "k" in a and len(b) == 1
    assert calls == [0.0] and sorted(map(str, got)) == ["None", "None", "bytes"]
    assert trio.current_time() == 1.0 and not table
    assert await a.run("k", lambda: True, fetch) is None and calls == [0.0]   # done already: no call


async def test_a_failed_download_lets_a_waiter_try(autojump_clock: trio.abc.Clock) -> None:
    f = SingleFlight()
    have: set[str] = set()
    tries: list[float] = []

    async def fetch() -> int:
        tries.append(trio.current_time())
        await trio.sleep(1)
        if len(tries) == 1:
            raise OSError("first try fails")
        have.add("k")
        return len(tries)

    results: list[object] = []

    async def first() -> None:
        with pytest.raises(OSError):
            await f.run("k", lambda: "k" in have, fetch)

    async def second() -> None:
        await trio.sleep(0.5)
        results.append(await f.run("k", lambda: "k" in have, fetch))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        nursery.start_soon(second)
    assert tries == [0.0, 1.0] and results == [2] and "k" not in f
