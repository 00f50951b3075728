"""Hostile clients against the real servers on loopback (issue 16): slowloris heads and
bodies, a body flood before authentication, idle-connection floods, wait floods and
waiters that disconnect. Every attack is bounded in count and in time; small limits
are configured so that each deadline is a fraction of a second. Where server and attacker
share this process with no worker thread (the control API's server; the data plane's
head reading) the test runs in virtual time and the deadlines are exact; the data plane's
sends run in worker threads, so those tests wait on ``DataPlane.next_change``."""

from __future__ import annotations

import os
import select
import socket
import struct
from pathlib import Path

import blake3
import httpx
import trio
import trio.testing

from infra.auth import TokenSet, auth_header
from infra.http import App, Request, Response, ServerLimits, json_response, require_role, serve
from p2p.dataplane import DataPlane, DataPlaneConfig
from p2p.store import ChunkStore
from testing.waiting import Changes, poll, until

TOKEN = "cluster-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


# ------------------------------------------------------------------ helpers

def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _connect(url: str) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", _port(url))


async def _refused(streams: list[trio.SocketStream]) -> list[trio.SocketStream]:
    """The streams the server (in this process) turned away: once every task here is
    blocked, each refused one has its answer waiting in its socket and an admitted one has
    nothing (it idles until the head deadline): no time window decides which is which."""
    await trio.testing.wait_all_tasks_blocked()
    return [s for s in streams if select.select([s.socket.fileno()], [], [], 0)[0]]


async def _closed_within(stream: trio.SocketStream, seconds: float) -> tuple[bool, bytes]:
    """Read until the server closes (True) or ``seconds`` pass (False); what it sent."""
    out = b""
    with trio.move_on_after(seconds):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return True, out
            if not data:
                return True, out
            out += data
    return False, out


async def _trickle(stream: trio.SocketStream, head: bytes, *, every_s: float, for_s: float) -> tuple[bool, float]:
    """Send ``head`` and then one more header byte every ``every_s`` (never finishing the
    head) until the server closes or ``for_s`` passes. (closed?, seconds it took)."""
    t0 = trio.current_time()
    await stream.send_all(head)
    while trio.current_time() - t0 < for_s:
        with trio.move_on_after(every_s):
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return True, trio.current_time() - t0
            # the server either answered (408) and closes, or closed
            closed, _ = await _closed_within(stream, 1.0) if data else (True, b"")
            return closed, trio.current_time() - t0
        try:
            await stream.send_all(b"a")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return True, trio.current_time() - t0
    return False, trio.current_time() - t0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _control_app(tokens: TokenSet, seen: list[int], *, body_timeout_s: float = 30.0) -> App:
    app = App(max_body=1 << 20, body_timeout_s=body_timeout_s)

    async def ok(req: Request) -> Response:
        return json_response({"ok": True})

    async def post(req: Request) -> Response:
        seen.append(len(req.body))
        return json_response({"got": len(req.body)})

    app.add("GET", "/ok", ok)
    app.add("POST", "/in", post, auth=require_role(tokens, "placer"))
    return app


# ------------------------------------------------------------------ control API (infra.http)

async def test_http_slowloris_head_is_cut_at_an_absolute_deadline(token_dir: Path, autojump_clock) -> None:
    tokens = TokenSet.load(token_dir)
    app = _control_app(tokens, [])
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(lambda task_status: serve(app, "127.0.0.1:0", task_status=task_status,
                                                          limits=ServerLimits(head_timeout_s=0.6)))
            streams = [await _connect(url) for _ in range(3)]
            async with trio.open_nursery() as attack:
                results: list[tuple[bool, float]] = []

                async def one(s: trio.SocketStream) -> None:
                    results.append(await _trickle(s, b"GET /ok HTTP/1.1\r\nhost: a\r\nx-slow: ",
                                                  every_s=0.1, for_s=4.0))
                for s in streams:
                    attack.start_soon(one, s)
            for s in streams:
                await s.aclose()
            # a byte every 0.1 s never resets the 0.6 s head deadline
            assert all(closed and 0.6 <= took < 0.7 for closed, took in results), results
            async with httpx.AsyncClient(base_url=url) as c:
                assert (await c.get("/ok")).status_code == 200
            n.cancel_scope.cancel()


async def test_http_slow_body_is_cut_and_a_refused_body_is_never_read(token_dir: Path, autojump_clock) -> None:
    tokens = TokenSet.load(token_dir)
    seen: list[int] = []
    app = _control_app(tokens, seen, body_timeout_s=0.6)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            # authenticated, but the body trickles, a byte every 0.1 s (never idle for the
            # 0.6 s deadline): only a deadline on the whole body ends it, with a 408, then closed
            s = await _connect(url)
            tok = tokens.placer
            await s.send_all(f"POST /in HTTP/1.1\r\nhost: a\r\nauthorization: Bearer {tok}\r\n"
                             "content-length: 1000\r\n\r\n".encode())
            answer = b""
            t0 = trio.current_time()
            for _ in range(999):   # (fewer bytes than announced: the trickle never completes the body)
                try:
                    await s.send_all(b"x")
                except trio.BrokenResourceError:
                    break
                with trio.move_on_after(0.1):
                    data = await s.receive_some(65536)
                    answer += data
                    if not data or b"\r\n\r\n" in answer:
                        break
            assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
            assert 0.6 <= trio.current_time() - t0 < 0.7   # the whole body's deadline (virtual time)
            closed, _ = await _closed_within(s, 2.0)
            assert closed
            await s.aclose()
            # no token: 401 at once after the head, the announced body is never awaited
            s = await _connect(url)
            await s.send_all(b"POST /in HTTP/1.1\r\nhost: a\r\ncontent-length: 900000\r\n\r\n")
            closed, out = await _closed_within(s, 2.0)
            assert closed and out.startswith(b"HTTP/1.1 401") and b"connection: close" in out.lower()
            await s.aclose()
            assert seen == []
            n.cancel_scope.cancel()


async def test_http_body_flood_before_auth_keeps_rss_bounded(token_dir: Path) -> None:
    """64 unauthenticated senders push 900 KB each: the server answers 401 on the head
    and never buffers their bodies (reading them first would hold ~57 MB)."""
    tokens = TokenSet.load(token_dir)
    seen: list[int] = []
    app = _control_app(tokens, seen)
    payload = b"x" * 899_000
    peak = [0]
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            base = _rss()
            answers: list[bytes] = []

            async def sender() -> None:
                s = await _connect(url)
                try:
                    await s.send_all(b"POST /in HTTP/1.1\r\nhost: a\r\ncontent-length: 900000\r\n\r\n")
                    with trio.move_on_after(3):
                        try:
                            await s.send_all(payload)   # the rest is never sent: a held upload
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            pass
                    _, out = await _closed_within(s, 3.0)
                    answers.append(out)
                finally:
                    await s.aclose()

            async def sample() -> None:
                while True:
                    peak[0] = max(peak[0], _rss())
                    await trio.sleep(0.01)

            async with trio.open_nursery() as flood:
                flood.start_soon(sample)
                async with trio.open_nursery() as senders:
                    for _ in range(64):
                        senders.start_soon(sender)
                flood.cancel_scope.cancel()
            assert seen == []
            assert peak[0] - base < 24 << 20, f"RSS grew {(peak[0] - base) >> 20} MiB"
            # most see their 401 (some only a reset: the server closes with their bytes unread)
            assert sum(a.startswith(b"HTTP/1.1 401") for a in answers) >= 32
            async with httpx.AsyncClient(base_url=url) as c:
                r = await c.post("/in", content=b"{}", headers=auth_header(tokens.placer))
                assert r.status_code == 200 and seen == [2]
            n.cancel_scope.cancel()


async def test_http_idle_connection_flood_is_capped(token_dir: Path, autojump_clock) -> None:
    tokens = TokenSet.load(token_dir)
    app = _control_app(tokens, [])
    limits = ServerLimits(max_connections=12, max_per_client=8, head_timeout_s=1.0)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(lambda task_status: serve(app, "127.0.0.1:0", limits=limits,
                                                          task_status=task_status))
            streams = [await _connect(url) for _ in range(20)]
            refused = await _refused(streams)
            for s in refused:
                closed, out = await _closed_within(s, 10.0)
                assert closed and out.startswith(b"HTTP/1.1 503"), out[:80]
            assert len(refused) == 12 and app.gate is not None and app.gate.open == 8
            # the admitted ones are closed once idle past the head deadline (without one,
            # never: the test's bound fails it)
            for s in streams:
                closed, _ = await _closed_within(s, 20.0)
                assert closed
                await s.aclose()
            await poll(lambda: app.gate.open == 0, 0.01)   # (the gate sets no event)
            async with httpx.AsyncClient(base_url=url) as c:
                assert (await c.get("/ok")).status_code == 200
            n.cancel_scope.cancel()


async def test_http_client_that_never_reads_its_answer_is_dropped(token_dir: Path, autojump_clock) -> None:
    big = b"y" * (32 << 20)     # far over what the socket buffers hold

    async def dump(req: Request) -> Response:
        return Response(body=big, content_type="application/octet-stream")

    async def start(app: App, send_stall_s: float) -> str:
        app.add("GET", "/big", dump)
        return await n.start(lambda task_status: serve(app, "127.0.0.1:0", task_status=task_status,
                                                       limits=ServerLimits(send_stall_s=send_stall_s)))

    app, patient = App(), App()
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await start(app, 0.5)
            s = await _connect(url)
            await s.send_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
            await poll(lambda: app.gate is not None and app.gate.open == 1, 0.01)
            await poll(lambda: not app.gate.open, 0.05)   # never reading: dropped once sending stalls 0.5 s
            await s.aclose()
            # one that goes away in the middle of its answer: its connection ends at once (a
            # server whose send-stall bound is past this test's: only the reset can end it)
            url = await start(patient, 60.0)
            s = await _connect(url)
            await s.send_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
            await s.receive_some(1000)
            s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await s.aclose()                # a reset
            await poll(lambda: patient.gate is not None and not patient.gate.open, 0.02)
            n.cancel_scope.cancel()


async def test_http_oversized_heads_are_refused(token_dir: Path) -> None:
    app = _control_app(TokenSet.load(token_dir), [])
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            for head in (b"GET /ok HTTP/1.1\r\nhost: a\r\nx-big: " + b"a" * 40000 + b"\r\n\r\n",   # whole, 40 KB
                         b"GET /ok HTTP/1.1\r\nhost: a\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(200))
                         + b"\r\n"):                                                           # 200 headers
                s = await _connect(url)
                await s.send_all(head)
                closed, out = await _closed_within(s, 2.0)
                assert out.startswith(b"HTTP/1.1 431"), out[:60]
                await s.aclose()
            n.cancel_scope.cancel()


async def test_http_handler_crash_is_contained(token_dir: Path) -> None:
    app = App()

    async def boom(req: Request) -> Response:
        raise RuntimeError("a bug")

    async def ok(req: Request) -> Response:
        return json_response({"ok": True})

    app.add("GET", "/boom", boom)
    app.add("GET", "/ok", ok)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            async with httpx.AsyncClient(base_url=url) as c:
                for _ in range(3):
                    assert (await c.get("/boom")).status_code == 500
                assert (await c.get("/ok")).status_code == 200
            n.cancel_scope.cancel()


# ------------------------------------------------------------------ data plane

async def _plane(nursery: trio.Nursery, store: ChunkStore, cfg: DataPlaneConfig) -> tuple[DataPlane, str]:
    plane = DataPlane(store, token=TOKEN, listen="127.0.0.1:0", config=cfg)
    return plane, await nursery.start(plane.run)


async def test_dataplane_slowloris_head_is_cut_at_an_absolute_deadline(tmp_path: Path, autojump_clock) -> None:
    store = ChunkStore(tmp_path / "s")
    cfg = DataPlaneConfig(head_timeout_s=0.6, idle_timeout_s=10.0)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            plane, url = await _plane(n, store, cfg)
            streams = [await _connect(url) for _ in range(3)]
            results: list[tuple[bool, float]] = []
            async with trio.open_nursery() as attack:
                async def one(s: trio.SocketStream) -> None:
                    results.append(await _trickle(s, b"GET /v1/stats HTTP/1.1\r\nhost: a\r\nx-slow: ",
                                                  every_s=0.1, for_s=4.0))
                for s in streams:
                    attack.start_soon(one, s)
            for s in streams:
                await s.aclose()
            assert all(closed and 0.6 <= took < 0.7 for closed, took in results), results
            assert plane.statistics()["head_timeouts"] == 3
            async with httpx.AsyncClient(headers=AUTH) as c:
                assert (await c.get(f"{url}/v1/stats")).status_code == 200
            n.cancel_scope.cancel()


async def test_dataplane_idle_connection_flood_is_capped(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cfg = DataPlaneConfig(max_connections_per_client=8, max_connections=100, idle_timeout_s=1.0)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            plane, url = await _plane(n, store, cfg)
            streams = [await _connect(url) for _ in range(20)]
            refused = await _refused(streams)
            for s in refused:
                closed, out = await _closed_within(s, 10.0)
                assert closed and out.startswith(b"HTTP/1.1 503"), out[:80]
            assert len(refused) == 12
            assert plane.statistics()["open_connections"] == 8
            for s in streams:
                closed, _ = await _closed_within(s, 20.0)
                assert closed
                await s.aclose()
            await until(plane.next_change, lambda: plane.statistics()["open_connections"] == 0)
            n.cancel_scope.cancel()


async def test_dataplane_wait_flood_does_not_starve_serving(tmp_path: Path) -> None:
    """40 requests wait on a chunk that never comes; the wait budget (16) turns the rest
    away, and a present chunk and /v1/stats are still served at once."""
    store = ChunkStore(tmp_path / "s")
    data = os.urandom(100_000)
    cid = blake3.blake3(data).hexdigest()
    store.put_chunk(cid, data)
    cfg = DataPlaneConfig(max_concurrent=16, max_per_client=16, max_waiting=16, max_waiting_per_client=16,
                          max_connections_per_client=100)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            plane, url = await _plane(n, store, cfg)
            codes: list[int] = []
            async with httpx.AsyncClient(headers=AUTH, limits=httpx.Limits(max_connections=100)) as c:
                answered = Changes()
                async with trio.open_nursery() as flood:
                    async def waiter() -> None:
                        # (a wait that outlives the test: none ends and frees its place meanwhile)
                        r = await c.get(f"{url}/v1/chunks/{'ab' * 32}?wait_ms=60000", timeout=None)
                        codes.append(r.status_code)
                        answered.poke()
                    for _ in range(40):
                        flood.start_soon(waiter)
                    await answered.until(lambda: len(codes) == 24)
                    await until(plane.next_change, lambda: plane.statistics()["waiting_requests"] == 16)
                    # served while every wait place is held (a starved one would wait out a
                    # 60 s wait: past this test's bound)
                    r = await c.get(f"{url}/v1/chunks/{cid}")
                    assert r.status_code == 200 and r.content == data
                    assert (await c.get(f"{url}/v1/stats")).status_code == 200
                    flood.cancel_scope.cancel()
            assert codes.count(503) == 24
            n.cancel_scope.cancel()


async def test_dataplane_waiter_that_disconnects_frees_its_place(tmp_path: Path) -> None:
    store = ChunkStore(tmp_path / "s")
    cfg = DataPlaneConfig(max_waiting=8, max_waiting_per_client=8)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            plane, url = await _plane(n, store, cfg)
            streams = []
            for i in range(8):
                s = await _connect(url)
                await s.send_all(f"GET /v1/chunks/{i:064x}?wait_ms=60000 HTTP/1.1\r\nhost: a\r\n"
                                 f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
                streams.append(s)
            await until(plane.next_change, lambda: plane.statistics()["waiting"] >= 8)
            for s in streams:
                await s.aclose()
            # at once, not after wait_ms (60 s: past this test's whole bound)
            await until(plane.next_change, lambda: plane.statistics()["open_connections"] == 0)
            s = plane.statistics()
            assert s["waiting"] == 0 and s["waiting_requests"] == 0 and s["waits_abandoned"] == 8
            # the budget is whole again: a new wait is admitted (and times out normally)
            async with httpx.AsyncClient(headers=AUTH) as c:
                r = await c.get(f"{url}/v1/chunks/{'cd' * 32}?wait_ms=50")
                assert r.status_code == 404
            n.cancel_scope.cancel()
