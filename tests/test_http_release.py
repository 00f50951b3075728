"""A connection the client closed gives its slot back at once, not after the keep-alive
timer: 100 short connections in a row from one address (the per-client cap is 64) are all
served (before: from about the 70th on, within 10 s, 503). The server runs in its own
thread, the clients are plain blocking ones, as a script or the CLI would be."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import trio

from infra.http import App, Request, Response, ServerLimits, json_response, serve


def test_closed_connections_release_their_slot() -> None:
    app = App(name="t")

    async def ok(req: Request) -> Response:
        return json_response({"ok": True})
    app.add("GET", "/ok", ok)
    box: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as n:
            box["cancel"] = n.cancel_scope
            box["url"] = await n.start(serve, app, "127.0.0.1:0")
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(20)
    try:
        codes = []
        for _ in range(100):
            with httpx.Client(base_url=box["url"], timeout=5) as c:
                codes.append(c.get("/ok").status_code)
        assert codes.count(200) == 100, {c: codes.count(c) for c in set(codes)}
        assert app.gate is not None and app.gate.open <= ServerLimits().max_per_client
    finally:
        trio.from_thread.run_sync(box["cancel"].cancel, trio_token=box["token"])
        thread.join(10)
