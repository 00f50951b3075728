"""The HTTP API's TLS handshakes are bounded like the framed channel's (issue 17): at most
``ServerLimits.max_handshakes`` in progress, and a connection takes a slot only once its
client has sent something -- so silent connections (connect, send nothing) never keep a
normal client's handshake waiting, while stalled ClientHellos hold at most the bound.
Real TLS on loopback (a throwaway CA)."""

from __future__ import annotations

import httpx
import trio
import trio.testing

from infra import tls
from infra.http import App, ServerLimits, json_response, serve

N = 3   # handshake slots


def _app() -> App:
    app = App()

    async def hello(req: object) -> object:
        return json_response({"ok": True})
    app.add("GET", "/v1/hello", hello)
    return app


async def _connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def test_silent_connections_do_not_hold_handshake_slots(tls_pki) -> None:
    app = _app()
    # a head deadline far past the test's bound: a silent connection holding a slot would
    # keep the normal client waiting for it
    limits = ServerLimits(max_handshakes=N, head_timeout_s=60.0)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            url = await n.start(lambda **kw: serve(app, "127.0.0.1:0", limits=limits, **kw,
                                                   ssl_context=tls.server_context(tls_pki.files("placer"),
                                                                                  client_cert="optional")))
            silent = [await _connect(url) for _ in range(N + 1)]
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert app.handshakes is not None and app.handshakes.borrowed_tokens == 0
            async with httpx.AsyncClient(verify=tls.client_context(tls_pki.ca), timeout=10) as c:
                r = await c.get(url + "/v1/hello")
            assert r.status_code == 200 and r.json() == {"ok": True}
            for s in silent:
                await s.aclose()
            n.cancel_scope.cancel()


async def test_stalled_client_hellos_hold_at_most_the_bound(tls_pki) -> None:
    app = _app()
    limits = ServerLimits(max_handshakes=N, head_timeout_s=60.0)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            url = await n.start(lambda **kw: serve(app, "127.0.0.1:0", limits=limits, **kw,
                                                   ssl_context=tls.server_context(tls_pki.files("placer"),
                                                                                  client_cert="optional")))
            stalled = []
            for _ in range(N + 1):
                s = await _connect(url)
                # a TLS record header announcing a 512-byte ClientHello, and nothing more
                await s.send_all(b"\x16\x03\x01\x02\x00")
                stalled.append(s)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert app.handshakes is not None
            assert app.handshakes.borrowed_tokens == N and app.handshakes.statistics().tasks_waiting == 1
            for s in stalled:
                await s.aclose()
            with trio.fail_after(5):
                while app.handshakes.borrowed_tokens:
                    await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            async with httpx.AsyncClient(verify=tls.client_context(tls_pki.ca), timeout=10) as c:
                assert (await c.get(url + "/v1/hello")).status_code == 200
            n.cancel_scope.cancel()
