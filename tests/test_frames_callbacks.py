"""FrameChannel.call_cb: a call answered by a callback in the reader task, not by a waiting task
(RelayHub.deliver waits on a round of thousands of bundles with one task)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from scheduler_link.frames import FrameChannel
from scheduler_link.messages import Frame
from testing.waiting import poll


def _echo(ch: FrameChannel, f: Frame) -> tuple[str, Any] | None:
    if f.type == "bundle":
        return None   # taken, never answered
    return "ping", None


async def test_answers_closes_forgets_and_a_failing_callback() -> None:
    a_stream, b_stream = trio.testing.memory_stream_pair()
    a, b = FrameChannel(a_stream, name="a"), FrameChannel(b_stream, name="b")
    got: dict[str, list[Any]] = {"one": [], "forgotten": [], "boom": [], "hung": []}

    def boom(f: Frame | None) -> None:
        got["boom"].append(f)
        raise RuntimeError("the caller's bug")

    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(a.run, _echo)
            n.start_soon(b.run, _echo)
            rid, data = a.prepare("ping", {})
            a.call_cb(rid, data, got["one"].append)
            rid2, data2 = a.prepare("ping", {})
            a.call_cb(rid2, data2, got["forgotten"].append)
            a.forget(rid2)
            rid3, data3 = a.prepare("ping", {})
            a.call_cb(rid3, data3, boom)
            rid4, data4 = a.prepare("bundle", {})
            a.call_cb(rid4, data4, got["hung"].append)
            await poll(lambda: got["one"] and got["boom"], 0.01)
            # the connection survived the callback that raised: a plain call still works
            assert (await a.call("ping", {}, timeout_s=2)).type == "ping"
            await b.aclose()          # the hung call's answer never comes: its callback hears None
            await poll(lambda: got["hung"], 0.01)
            n.cancel_scope.cancel()
    assert [f.type for f in got["one"]] == ["ping"] and got["one"][0].re == rid
    assert got["forgotten"] == []
    assert [f.type for f in got["boom"]] == ["ping"]
    assert got["hung"] == [None]
