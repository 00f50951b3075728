"""Streamed answers (Response.stream) over real loopback sockets: pieces arrive as they are
made, and a client that goes away closes the generator."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import httpx
import trio

from infra.http import App, Request, Response, serve


async def test_stream_pieces_arrive_in_order_and_a_leaving_client_closes_the_generator():
    closed = trio.Event()
    made: list[int] = []

    async def finite() -> AsyncGenerator[bytes, None]:
        for i in range(3):
            yield f"piece {i}\n".encode()
            await trio.sleep(0.01)

    async def endless() -> AsyncGenerator[bytes, None]:
        try:
            made.append(0)
            yield b"line 0\n"
            await trio.sleep_forever()  # quiet (a workload printing nothing): only the client's leaving ends it
            yield b"never"
        finally:
            closed.set()

    app = App(name="t")

    @app.route("GET", "/finite")
    async def h_finite(req: Request) -> Response:
        return Response(body=b"head\n", content_type="text/plain", stream=finite)

    @app.route("GET", "/endless")
    async def h_endless(req: Request) -> Response:
        return Response(content_type="text/plain", stream=endless)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url, timeout=5) as c:
                r = await c.get("/finite")
                assert r.status_code == 200 and r.text == "head\npiece 0\npiece 1\npiece 2\n"
                assert "content-length" not in r.headers
                async with c.stream("GET", "/endless") as r:
                    async for chunk in r.aiter_bytes():
                        assert chunk.startswith(b"line 0")
                        break
                # the client closed its connection: the idle generator is closed
                await closed.wait()
                assert made == [0]
            n.cancel_scope.cancel()
