"""A plain-HTTP origin's chunk bodies wake the reader per good piece (SO_RCVLOWAT while
the body comes, never more than the body has left), and the socket is back to normal
before the connection is kept for the next answer: a small answer on it must not wait."""

from __future__ import annotations

import functools
import os
import socket

import blake3
import trio
import trio.testing

from p2p.origins import open_origin
from testing.waiting import poll


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


def _client_sockets(origin: object) -> list[socket.socket]:
    return origin.http.lean.sockets()      # type: ignore[attr-defined]  # plain http:// GETs: p2p.origins.lean


async def test_plain_http_origin_body_lowat_and_keepalive_reset() -> None:
    cid, data = _chunk(1 << 20)
    small_id, small = _chunk(300)
    part_sent, release = trio.Event(), trio.Event()

    async def handle(stream: trio.SocketStream) -> None:
        buf = b""
        for body in (data, small):          # two answers on one kept-alive connection
            while b"\r\n\r\n" not in buf:
                piece = await stream.receive_some(65536)
                if not piece:
                    return
                buf += piece
            _, _, buf = buf.partition(b"\r\n\r\n")
            head = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
                    "Content-Type: application/octet-stream\r\n\r\n").encode()
            if body is data:
                await stream.send_all(head + body[:1000])      # a first piece with the head
                await trio.testing.wait_all_tasks_blocked()    # read by the client, which waits for more
                await stream.send_all(body[1000:100_000])      # less than a wakeup's worth
                part_sent.set()
                await release.wait()
                await stream.send_all(body[100_000:])
            else:
                await stream.send_all(head + body)
        await stream.receive_some(1)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with open_origin(f"http://127.0.0.1:{port}/herd", retries=0) as origin:
                got: list[bytes] = []

                async def fetch() -> None:
                    got.append(await origin.get_chunk(cid, len(data)))

                nursery.start_soon(fetch)
                await part_sent.wait()
                await trio.testing.wait_all_tasks_blocked()
                socks = _client_sockets(origin)   # the reader is asleep until a good piece is there
                assert socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 128 * 1024
                release.set()
                await poll(lambda: got, 0.01)
                assert got[0] == data
                (sock,) = _client_sockets(origin)
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
                # the same connection, a 300-byte answer: no wait for bytes that never come
                with trio.fail_after(2):
                    assert await origin.get_chunk(small_id, len(small)) == small
                assert len(_client_sockets(origin)) == 1
            nursery.cancel_scope.cancel()
