"""``GET /v1/manifests/{id}?wait_ms=`` over real loopback sockets: a manifest stored
mid-wait is answered at once, the wait is capped, a flood of waiters is told 503 (the
server keeps serving), a waiter that leaves frees its place, bad input is refused; and
the herd's client asks its tree parent with the wait."""

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
from p2p.peers import PeerBusy, PeerClient, PeerMissing
from p2p.store import ChunkStore
from testing.waiting import poll

TOKEN = "cluster-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _manifest() -> tuple[str, bytes, list[tuple[str, bytes]]]:
    chunks = []
    for i in range(3):
        d = os.urandom(1000 + i)
        chunks.append((blake3.blake3(d).hexdigest(), d))
    b = ManifestBuilder()
    b.add_file("f", 0o644, [(cid, len(d)) for cid, d in chunks])
    m = b.build()
    return m.id, encode_manifest(m), chunks


async def _serve(nursery: trio.Nursery, store: ChunkStore, **kw: object) -> tuple[DataPlane, str]:
    plane = DataPlane(store, token=TOKEN, listen="127.0.0.1:0", config=DataPlaneConfig(**kw))  # type: ignore[arg-type]
    url = await nursery.start(plane.run)
    return plane, url


async def test_a_manifest_stored_mid_wait_is_served_at_once(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    mid, raw, _ = _manifest()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            # the disk re-check every 30 s: only the store's hook can wake it in time
            plane, url = await _serve(nursery, store, max_manifest_wait_ms=10_000, poll_s=30.0)
            got: dict[str, float] = {}

            async def ask() -> None:
                async with httpx.AsyncClient(headers=AUTH, timeout=30) as c:
                    t0 = trio.current_time()
                    r = await c.get(f"{url}/v1/manifests/{mid}?wait_ms=10000")
                    assert r.status_code == 200 and r.content == raw
                    got["s"] = trio.current_time() - t0

            async with trio.open_nursery() as asks:
                asks.start_soon(ask)
                with trio.fail_after(5):
                    await poll(lambda: plane.statistics()["manifest_waits"] >= 1, 0.01)
                # stored from a worker thread, as the herd stores it
                await trio.to_thread.run_sync(store.put_manifest, mid, raw)
                stored = trio.current_time()
            # answered when it was stored, not when the 10 s wait ran out
            assert trio.current_time() - stored < 5.0 and got["s"] < 9.0
            st = plane.statistics()
            assert st["manifest_waits"] == 1 and st["manifest_waits_satisfied"] == 1
            assert st["waiting_requests"] == 0 and not plane._manifest_events
            nursery.cancel_scope.cancel()


async def test_the_wait_is_capped_and_ends_in_404(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    mid, _, _ = _manifest()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, max_manifest_wait_ms=300)
            async with httpx.AsyncClient(headers=AUTH, timeout=30) as c:
                t0 = trio.current_time()
                r = await c.get(f"{url}/v1/manifests/{mid}?wait_ms=100000000")
                assert r.status_code == 404
                assert 0.25 <= trio.current_time() - t0 < 10     # the 300 ms cap, not the 27 h asked for
                for bad in ("-1", "x", "1e3", "9" * 13):
                    r = await c.get(f"{url}/v1/manifests/{mid}?wait_ms={bad}")
                    assert r.status_code == 400, bad
                # no wait, or wait_ms=0: answered at once
                assert (await c.get(f"{url}/v1/manifests/{mid}")).status_code == 404
                assert (await c.get(f"{url}/v1/manifests/{mid}?wait_ms=0")).status_code == 404
            st = plane.statistics()
            assert st["manifest_waits"] == 1 and st["manifest_waits_satisfied"] == 0
            assert not plane._manifest_events
            nursery.cancel_scope.cancel()


async def test_a_flood_of_waiters_gets_503_and_the_server_keeps_serving(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    mid, raw, chunks = _manifest()
    cid, data = chunks[0]
    store.put_chunk(cid, data)
    limit, flood = 4, 40
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, max_manifest_waiting=limit,
                                      max_manifest_waiting_per_client=limit, max_manifest_wait_ms=20_000)
            codes: list[int] = []
            retry: list[str] = []

            async def ask(c: httpx.AsyncClient) -> None:
                r = await c.get(f"{url}/v1/manifests/{mid}?wait_ms=20000")
                codes.append(r.status_code)
                if r.status_code == 503:
                    retry.append(r.headers.get("retry-after", ""))
                else:
                    assert r.content == raw

            limits = httpx.Limits(max_connections=flood + 4)
            async with httpx.AsyncClient(headers=AUTH, timeout=60, limits=limits) as c:
                async with trio.open_nursery() as asks:
                    for _ in range(flood):
                        asks.start_soon(ask, c)
                    with trio.fail_after(10):
                        await poll(lambda: len(codes) >= flood - limit, 0.01)
                    # only `limit` wait; the rest were told 503 with Retry-After, at once
                    assert codes.count(503) == flood - limit and set(retry) == {"1"}
                    st = plane.statistics()
                    assert st["rejected_manifest_waits"] == flood - limit
                    assert st["waiting_requests"] == 0     # the chunks' wait budget is untouched
                    # the server still serves chunks and stats while they wait
                    r = await c.get(f"{url}/v1/chunks/{cid}")
                    assert r.status_code == 200 and r.content == data
                    assert (await c.get(f"{url}/v1/stats")).status_code == 200
                    store.put_manifest(mid, raw)
                assert codes.count(200) == limit
            st = plane.statistics()
            assert st["manifest_waits"] == limit and st["manifest_waits_satisfied"] == limit
            nursery.cancel_scope.cancel()


async def test_a_waiter_that_leaves_frees_its_place(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    mid, raw, _ = _manifest()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, max_manifest_waiting=1, max_manifest_waiting_per_client=1,
                                      max_manifest_wait_ms=20_000)
            host, port = url.removeprefix("http://").split(":")
            s = await trio.open_tcp_stream(host, int(port))
            await s.send_all(f"GET /v1/manifests/{mid}?wait_ms=20000 HTTP/1.1\r\nhost: x\r\n"
                             f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
            with trio.fail_after(5):
                await poll(lambda: plane.statistics()["manifest_waits"] >= 1, 0.01)
            async with httpx.AsyncClient(headers=AUTH, timeout=30) as c:
                assert (await c.get(f"{url}/v1/manifests/{mid}?wait_ms=100")).status_code == 503
                await s.aclose()
                with trio.fail_after(5):
                    await poll(lambda: plane.statistics()["waits_abandoned"] >= 1, 0.01)
                store.put_manifest(mid, raw)
                r = await c.get(f"{url}/v1/manifests/{mid}?wait_ms=100")
                assert r.status_code == 200 and r.content == raw
            nursery.cancel_scope.cancel()


async def test_peer_client_asks_with_the_wait(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    mid, raw, _ = _manifest()
    client = PeerClient(token=TOKEN)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            plane, url = await _serve(nursery, store, max_manifest_wait_ms=5_000, max_manifest_waiting=1,
                                      max_manifest_waiting_per_client=1)
            with pytest.raises(PeerMissing):
                await client.get_manifest(url, mid)               # no wait: 404 at once

            refused = trio.Event()

            async def later() -> None:
                await refused.wait()
                store.put_manifest(mid, raw)

            async def second() -> None:
                with trio.fail_after(5):
                    await poll(lambda: plane.statistics()["manifest_waits"] >= 1, 0.01)
                with pytest.raises(PeerBusy) as e:                 # over the waiters' budget
                    await client.get_manifest(url, mid, wait_ms=5_000)
                assert e.value.retry_after_s == pytest.approx(0.05)
                refused.set()

            nursery.start_soon(later)
            nursery.start_soon(second)
            assert bytes(await client.get_manifest(url, mid, wait_ms=5_000)) == raw
            assert plane.statistics()["manifest_waits_satisfied"] == 1
            await client.aclose()
            nursery.cancel_scope.cancel()
