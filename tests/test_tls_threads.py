"""A server handshake whose crypto runs in worker threads (tls.server_handshake(threads=)):
over real loopback sockets it admits a good client with the same principal and stream as
trio's own handshake, refuses the same bad ones with the same reasons, and the OpenSSL work on
the client's flights happens off the event loop's thread (seen by the context's message
callback, which OpenSSL calls from whichever thread processes a handshake message)."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from scheduler_link import pki, tls
from scheduler_link.tls import Principal, TLSError


@pytest.fixture
def ca(tmp_path: Path) -> pki.ThrowawayPKI:
    return pki.throwaway(tmp_path / "pki", nodes=["n1"])


def _watched(ctx: ssl.SSLContext) -> list[tuple[int, Any]]:
    """Which thread OpenSSL processed each handshake message the server received in."""
    seen: list[tuple[int, Any]] = []

    def cb(conn: Any, direction: str, version: Any, content_type: Any, msg_type: Any, data: bytes) -> None:
        if direction == "read" and content_type == ssl._TLSContentType.HANDSHAKE:  # type: ignore[attr-defined]
            seen.append((threading.get_ident(), msg_type))

    ctx._msg_callback = cb  # type: ignore[attr-defined]
    return seen


async def _serve(ctx: ssl.SSLContext, threads: trio.CapacityLimiter | None, results: list[Any],
                 task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        s, why = await tls.server_handshake(stream, ctx, 5.0, threads=threads)
        if s is None:
            results.append(why)
            await trio.aclose_forcefully(stream)
            return
        results.append(tls.stream_principal(s))
        data = await s.receive_some(100)
        await s.send_all(b"echo:" + data)
        await s.aclose()

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


@pytest.mark.parametrize("threaded", [True, False])
async def test_good_client_admitted_with_its_principal(ca: pki.ThrowawayPKI, threaded: bool) -> None:
    ctx = tls.server_context(ca.files("placer"))
    seen = _watched(ctx)
    results: list[Any] = []
    loop_thread = threading.get_ident()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            port = await n.start(_serve, ctx, trio.CapacityLimiter(2) if threaded else None, results)
            for _ in range(3):
                s = await tls.connect("127.0.0.1", port, tls.client_context(ca.ca, ca.files("node:n1")),
                                      expect="placer")
                await s.send_all(b"hi")
                assert await s.receive_some(100) == b"echo:hi"
                await s.aclose()
            n.cancel_scope.cancel()
    assert results == [Principal("node", "n1")] * 3
    threads = {t for t, _ in seen}
    assert seen, "no handshake messages seen"
    if threaded:   # ClientHello, Certificate, CertificateVerify, Finished: all off the loop
        assert loop_thread not in threads, seen
    else:
        assert threads == {loop_thread}


async def test_bad_clients_refused_with_reasons(ca: pki.ThrowawayPKI, tmp_path: Path) -> None:
    other = pki.throwaway(tmp_path / "other", nodes=["n1"])
    k, c = pki.CA.load(ca.dir).issue("node:n1", days=1, not_before=pki._now() - dt.timedelta(days=3))
    pki.write_pair(tmp_path / "expired", "node", k, c)
    expired = tls.TLSFiles(ca.ca, tmp_path / "expired/node.crt", tmp_path / "expired/node.key")
    results: list[Any] = []
    ctx = tls.server_context(ca.files("placer"))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            port = await n.start(_serve, ctx, trio.CapacityLimiter(2), results)
            for client in (tls.client_context(ca.ca, other.files("node:n1")),   # another CA's certificate
                           tls.client_context(ca.ca, expired),                   # an expired one
                           tls.client_context(ca.ca)):                           # none at all
                with pytest.raises((TLSError, trio.BrokenResourceError)):
                    s = await tls.connect("127.0.0.1", port, client)
                    await s.receive_some(10)   # TLS 1.3: the refusal comes after the client's finish

            def plain_then_cut() -> None:
                with socket.create_connection(("127.0.0.1", port)) as raw:
                    raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    raw.recv(100)
                with socket.create_connection(("127.0.0.1", port)) as raw:   # half a ClientHello, then gone
                    raw.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
            await trio.to_thread.run_sync(plain_then_cut)
            with trio.move_on_after(5):
                while len(results) < 5:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()
    assert len(results) == 5, results
    assert "not signed by this cluster's CA" in results[0], results
    assert "expired" in results[1], results
    assert "certificate" in results[2].lower(), results
    assert "does not speak TLS" in results[3], results
    assert "closed the connection during the handshake" in results[4], results


async def test_falls_back_to_trios_handshake_when_internals_differ(ca: pki.ThrowawayPKI) -> None:
    """A stream whose handshake already started (so trio's private state is not as expected)
    is not taken over: the check says so, and trio's own path runs."""
    a, b = trio.testing.memory_stream_pair()
    s = trio.SSLStream(a, tls.server_context(ca.files("placer")), server_side=True)
    assert tls._threadable(s)
    s._handshook.started = True  # type: ignore[attr-defined]
    assert not tls._threadable(s)
