"""scheduler_link.daemon_client: httpx's failures leave as one ClientError line naming the daemon
(real loopback sockets; the sync client runs in a thread while trio serves the canned answers)."""

from __future__ import annotations

import socket

import httpx
import pytest
import trio

from infra.errors import ClientError, LinkError
from scheduler_link.daemon_client import DaemonClient, get_json

HTML = b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\nconnection: close\r\n\r\n<html></html>"
REFUSED = (b"HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\ncontent-length: 38\r\nconnection: close\r\n"
           b'\r\n{"error": "in use", "detail": "gpu 3"}')
CUT = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 1000\r\nconnection: close\r\n\r\n"
       b"only a part")


async def _serve(nursery: trio.Nursery, answer: bytes | None) -> str:
    """A loopback server that reads a request and sends ``answer`` (None: never answers)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.receive_some(65536)
            if answer is None:
                await trio.sleep_forever()
            await stream.send_all(answer)

    nursery.start_soon(trio.serve_listeners, handle, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _err(url: str, **kw: object) -> ClientError:
    with DaemonClient(url, "agent", timeout=0.5) as c, pytest.raises(ClientError) as e:
        r = c.send("GET", "/x", **kw)  # type: ignore[arg-type]
        list(c.iter_bytes(r))
    assert isinstance(e.value, LinkError) and "\n" not in str(e.value) and e.value.__cause__ is None
    return e.value


async def test_failures_are_one_line_client_errors():
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            hung, html, refused, cut = [await _serve(n, a) for a in (None, HTML, REFUSED, CUT)]
            down = f"http://127.0.0.1:{_closed_port()}"
            e = await trio.to_thread.run_sync(_err, hung)
            assert str(e).startswith(f"the agent at {hung} did not answer in time (ReadTimeout;") and e.status is None
            e = await trio.to_thread.run_sync(_err, down)
            assert str(e).startswith(f"cannot reach the agent at {down}: ")
            e = await trio.to_thread.run_sync(_err, refused)
            assert (str(e), e.status) == ("agent answered 409: in use: gpu 3", 409)
            e = await trio.to_thread.run_sync(lambda: _err(cut, stream=True))
            assert str(e).startswith(f"the stream from the agent at {cut} broke: ")

            def not_herd() -> ClientError:
                with DaemonClient(html, "placer", timeout=5) as c, pytest.raises(ClientError) as e:
                    c.json("GET", "/healthz")
                return e.value
            e = await trio.to_thread.run_sync(not_herd)
            assert "answered HTTP 200 with text/html (13 bytes): not a herd server" in str(e)
            async with httpx.AsyncClient(timeout=0.5) as c:
                with pytest.raises(ClientError, match="did not answer in time"):
                    await get_json(c, hung + "/v1/store", "agent")
                assert await get_json(c, refused + "/v1/store", "agent") == (409, None)
            n.cancel_scope.cancel()


def test_an_https_daemon_is_verified_against_the_cluster_ca(tmp_path):
    """Like the placer's client: no CA in the TLS dir is one line, before any connection."""
    with pytest.raises(ClientError, match=r"^no cluster CA at .*ca\.crt: pass --tls-dir") as e:
        DaemonClient("https://127.0.0.1:1", "agent", timeout=1, tls_dir=tmp_path)
    assert "\n" not in str(e.value)
    DaemonClient("http://127.0.0.1:1", "agent", timeout=1, tls_dir=tmp_path).close()  # plain http: no CA needed
