"""The data plane over real loopback sockets: routes, waits, auth, limits, bad input."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import httpx
import pytest
import trio

from manifests import encode_manifest
from manifests.model import ManifestBuilder
from p2p.dataplane import DataPlane, DataPlaneConfig
from p2p.store import ChunkStore
from testing.waiting import poll, until

TOKEN = "cluster-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


async def _serve(nursery: trio.Nursery, store: ChunkStore, **kw) -> tuple[DataPlane, str]:
    plane = DataPlane(store, token=kw.pop("token", TOKEN), listen="127.0.0.1:0", **kw)
    url = await nursery.start(plane.run)
    return plane, url


async def _raw(url: str, request: bytes, *, read_until_close: bool = True) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        out = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                break
            out += data
            if not read_until_close and b"\r\n\r\n" in out:
                break
        return out


async def test_chunk_get_head_and_keepalive(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(3 * 1024 * 1024 + 17)
    store.put_chunk(cid, data)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store)
            async with httpx.AsyncClient(headers=AUTH) as c:
                for _ in range(3):  # one keep-alive connection, several requests
                    r = await c.get(f"{url}/v1/chunks/{cid}")
                    assert r.status_code == 200 and r.content == data
                h = await c.head(f"{url}/v1/chunks/{cid}")
                assert h.status_code == 200 and int(h.headers["content-length"]) == len(data)
                assert h.content == b""
                missing = "ab" * 32
                assert (await c.head(f"{url}/v1/chunks/{missing}")).status_code == 404
                assert (await c.get(f"{url}/v1/chunks/{missing}")).status_code == 404
            st = plane.statistics()
            assert st["chunks_served"] == 3 and st["bytes_served"] == 3 * len(data)
            assert st["connections"] == 1 and st["sendfile_fallbacks"] == 0
            nursery.cancel_scope.cancel()


async def test_wait_ms_waits_for_a_chunk_that_arrives_later(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(200_000)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store)

            async def arrive() -> None:
                # once the request waits for it; stored from a worker thread, as the fetcher does
                await until(plane.next_change, lambda: plane.statistics()["waits"] == 1)
                await trio.to_thread.run_sync(store.put_chunk, cid, data)

            nursery.start_soon(arrive)
            async with httpx.AsyncClient(headers=AUTH) as c:
                r = await c.get(f"{url}/v1/chunks/{cid}?wait_ms=10000")
                assert r.status_code == 200 and r.content == data
                assert plane.statistics()["waits_satisfied"] == 1   # it waited, and the chunk ended the wait
                # a chunk that never comes: 404 after the wait
                t0 = trio.current_time()
                r = await c.get(f"{url}/v1/chunks/{'cd' * 32}?wait_ms=300")
                assert r.status_code == 404 and trio.current_time() - t0 >= 0.29
            st = plane.statistics()
            assert st["waits"] == 2 and st["waits_satisfied"] == 1 and st["waiting"] == 0
            nursery.cancel_scope.cancel()


async def test_auth_required_and_constant_time_token(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(1000)
    store.put_chunk(cid, data)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            _, url = await _serve(nursery, store)
            _, url_none = await _serve(nursery, store, token=None)
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"{url}/v1/chunks/{cid}")).status_code == 401
                bad = {"authorization": "Bearer nope"}
                assert (await c.get(f"{url}/v1/chunks/{cid}", headers=bad)).status_code == 401
                basic = {"authorization": f"Basic {TOKEN}"}
                assert (await c.get(f"{url}/v1/chunks/{cid}", headers=basic)).status_code == 401
                # no token configured: nothing can be authenticated (never open)
                assert (await c.get(f"{url_none}/v1/chunks/{cid}", headers=AUTH)).status_code == 401
                assert (await c.get(f"{url}/v1/chunks/{cid}", headers=AUTH)).status_code == 200
            nursery.cancel_scope.cancel()


async def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store)
            async with httpx.AsyncClient(headers=AUTH) as c:
                r = await c.get(f"{url}/v1/chunks/not-a-hash")
                assert r.status_code == 400 and r.json()["error"] == "bad id"
                r = await c.get(f"{url}/v1/chunks/{'AB' * 32}")
                assert r.status_code == 400
                r = await c.get(f"{url}/v1/chunks/{'ab' * 32}?wait_ms=-5")
                assert r.status_code == 400 and r.json()["error"] == "bad wait_ms"
                r = await c.post(f"{url}/v1/chunks/{'ab' * 32}", content=b"x" * 10)
                assert r.status_code in (405, 413)
                r = await c.get(f"{url}/v1/nothing/here")
                assert r.status_code == 404
                r = await c.get(f"{url}/v1/manifests/{'ab' * 32}")
                assert r.status_code == 404
                r = await c.get(f"{url}/v1/have/{'ab' * 32}")
                assert r.status_code == 404
            # a head over the size bound
            resp = await _raw(url, b"GET /v1/chunks/x HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * 40000 + b"\r\n\r\n")
            assert resp.startswith(b"HTTP/1.1 431")
            # garbage instead of HTTP
            resp = await _raw(url, b"\x00\x01\x02 not http\r\n\r\n")
            assert resp.startswith(b"HTTP/1.1 400")
            # the server is still fine
            async with httpx.AsyncClient(headers=AUTH) as c:
                assert (await c.get(f"{url}/v1/chunks/{'ab' * 32}")).status_code == 404
            assert plane.statistics()["bad_requests"] >= 4
            nursery.cancel_scope.cancel()


async def test_manifest_and_have_bitmap(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    chunks = [_chunk(1000 + i) for i in range(11)]
    b = ManifestBuilder()
    b.add_file("f", 0o644, [(cid, len(d)) for cid, d in chunks])
    m = b.build()
    raw = encode_manifest(m)
    store.put_manifest(m.id, raw)
    table = [c.id for c in m.chunks]
    held = {table[0], table[3], table[8], table[10]}
    for cid, d in chunks:
        if cid in held:
            store.put_chunk(cid, d)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            _, url = await _serve(nursery, store)
            async with httpx.AsyncClient(headers=AUTH) as c:
                r = await c.get(f"{url}/v1/manifests/{m.id}")
                assert r.status_code == 200 and r.content == raw
                r = await c.get(f"{url}/v1/have/{m.id}")
                assert r.status_code == 200
                assert r.headers["x-herd-chunks"] == "11" and r.headers["x-herd-have"] == "4"
                bits = r.content
                assert len(bits) == 2
                got = {table[i] for i in range(11) if bits[i >> 3] & (0x80 >> (i & 7))}
                assert got == held
            nursery.cancel_scope.cancel()


async def test_busy_when_over_per_client_limit(tmp_path: Path) -> None:
    """Waits have their own budget: a client over it gets 503 for another wait, while
    plain requests still take serving slots (the parked waits hold none)."""
    store = ChunkStore(tmp_path / "s")
    cfg = DataPlaneConfig(max_per_client=2, max_concurrent=100, max_waiting_per_client=2)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, config=cfg)
            async with httpx.AsyncClient(headers=AUTH) as c:
                async with trio.open_nursery() as waiters:
                    for i in range(2):  # two requests parked on chunks that will not come
                        waiters.start_soon(c.get, f"{url}/v1/chunks/{i:064x}?wait_ms=1500")
                    await until(plane.next_change, lambda: plane.statistics()["waiting_requests"] >= 2)
                    r = await c.get(f"{url}/v1/chunks/{'ee' * 32}?wait_ms=1000")
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    assert plane.statistics()["active"] == 0
                    assert (await c.get(f"{url}/v1/chunks/{'ee' * 32}")).status_code == 404
                # the wait places are free again
                assert (await c.get(f"{url}/v1/chunks/{'ee' * 32}?wait_ms=10")).status_code == 404
            assert plane.statistics()["rejected_waits"] == 1
            nursery.cancel_scope.cancel()


async def test_idle_connection_is_closed(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cfg = DataPlaneConfig(idle_timeout_s=0.3, head_timeout_s=0.3)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            _, url = await _serve(nursery, store, config=cfg)
            # a client that sends half a request head and then nothing
            resp = await _raw(url, b"GET /v1/chunks/")
            assert resp.startswith(b"HTTP/1.1 408 ")   # the head deadline passed: answered and closed
            nursery.cancel_scope.cancel()


async def test_peer_client_survives_a_closed_keepalive_and_reports_errors(tmp_path: Path) -> None:
    from p2p.errors import PeerError
    from p2p.peers import PeerClient, PeerMissing, PeerUnavailable

    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(300_000)
    store.put_chunk(cid, data)
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, config=DataPlaneConfig(idle_timeout_s=0.2))
            client = PeerClient(token=TOKEN)
            assert await client.get_chunk(url, cid, len(data)) == data
            # the server closes the idle keep-alive connection
            await until(plane.next_change, lambda: plane.statistics()["open_connections"] == 0)
            assert await client.get_chunk(url, cid, len(data)) == data
            with pytest.raises(PeerMissing):
                await client.get_chunk(url, "ab" * 32, 10)
            with pytest.raises(PeerError, match="announces"):   # the wrong size: refused
                await client.get_chunk(url, cid, len(data) - 1)
            bad = PeerClient(token="wrong")
            with pytest.raises(PeerError, match="401"):
                await bad.get_chunk(url, cid, len(data))
            with pytest.raises(PeerUnavailable):
                await client.get_chunk("http://127.0.0.1:9", cid, len(data))
            await client.aclose()
            await bad.aclose()
            nursery.cancel_scope.cancel()


async def test_the_data_plane_counts_what_it_owes_a_slow_reader(tmp_path: Path) -> None:
    """A batch answer sent to a client that does not read (more than the sockets' buffers
    hold): its chunk bytes are owed (send_backlog) while it is being sent, nothing once
    the client has read it all."""
    import socket

    big = 4 << 20
    store = ChunkStore(tmp_path / "warm")
    ids = []
    for _ in range(3):
        cid, piece = _chunk(big)
        store.put_chunk(cid, piece)
        ids.append(cid)
    plane = DataPlane(store, token=TOKEN)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(plane.run)
            host, _, port = url.removeprefix("http://").rpartition(":")
            assert plane.send_backlog() == 0
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            await sock.connect((host, int(port)))
            await sock.send(f"GET /v1/chunks?ids={','.join(ids)} HTTP/1.1\r\nHost: x\r\n"
                            f"Authorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode())
            await poll(lambda: plane.send_backlog() == 3 * big, 0.005)   # owed (handed to a thread: no event)
            assert plane.statistics()["send_backlog"] == 3 * big
            got = 0
            while data := await sock.recv(1 << 20):
                got += len(data)
            assert got > 3 * big
            sock.close()
            await until(plane.next_change, lambda: plane.send_backlog() == 0)   # paid
            nursery.cancel_scope.cancel()
