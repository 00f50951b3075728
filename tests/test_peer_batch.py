"""Multi-chunk requests (``GET /v1/chunks?ids=``, p2p.batch) over real loopback sockets:
the real DataPlane and PeerClient, and a hostile server for what the real one never does.
Both receive paths (the worker thread on plain connections; the trio thread under TLS or
a rate cap) must be byte-exact, keep every good chunk of a batch when one is corrupt or
the peer dies mid-batch, and let go at once when cancelled."""

from __future__ import annotations

import functools
import os
import socket
import ssl
import struct
import tempfile
from pathlib import Path

import blake3
import pytest
import trio

from p2p.batch import BUSY, FRAME, MISSING, OK, frame
from p2p.dataplane import DataPlane, DataPlaneConfig
from p2p.peers import PeerBusy, PeerClient, PeerClientConfig, PeerError, PeerMissing, PeerUnavailable
from p2p.store import ChunkStore
from testing.waiting import Changes, poll, until

TOKEN = "cluster-secret"
# thread: plain, the worker thread; loop: plain through the trio thread (a rate cap
# takes that path); tls: TLS, decrypted by the worker thread with the connection's session
PATHS = pytest.mark.parametrize("path", ["thread", "loop", "tls"])


@functools.lru_cache(maxsize=1)
def _tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts of one throwaway cluster CA, made once per run."""
    from infra.pki import throwaway
    from infra.tls import client_context, server_context

    pki = throwaway(Path(tempfile.mkdtemp(prefix="peer-batch-pki-")), nodes=["a", "b"])
    return (server_context(pki.files("node:a"), client_cert="required"),
            client_context(pki.ca, pki.files("node:b")))


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


def _client(path: str, **cfg) -> PeerClient:
    # a rate cap sends plain connections through the trio-thread path
    if path == "loop":
        cfg.setdefault("rate_bps", 1e12)
    return PeerClient(token=TOKEN, config=PeerClientConfig(**cfg),
                      ssl_context=_tls()[1] if path == "tls" else None)


def _tls_kw(path: str) -> dict:
    return {"ssl_context": _tls()[0]} if path == "tls" else {}


def _chunks(sizes: list[int]) -> list[tuple[str, bytes]]:
    return [_chunk(n) for n in sizes]


SIZES = [1 << 20, 300_000, 17, 2 * (1 << 20) + 5]


async def _serve(nursery: trio.Nursery, store: ChunkStore, **kw) -> tuple[str, DataPlane]:
    plane = DataPlane(store, token=TOKEN, listen="127.0.0.1:0", **kw)
    return await nursery.start(plane.run), plane


class _Sink:
    """A store callback that keeps what it was given (the thread-safe ChunkStore is what
    the herd passes; this checks exactly what came). ``changes`` is poked on the event
    loop after each chunk kept, from whichever thread the client stored it in."""

    def __init__(self) -> None:
        self.got: dict[str, bytes] = {}
        self.changes = Changes()
        self._token = trio.lowlevel.current_trio_token()

    def __call__(self, cid: str, body: memoryview) -> None:
        self.got[cid] = bytes(body)
        self._token.run_sync_soon(self.changes.poke)


@PATHS
async def test_batch_byte_exact_into_the_store_and_keepalive(tmp_path: Path, path: str) -> None:
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks(SIZES)
    for cid, data in chunks:
        src.put_chunk(cid, data)
    dst = ChunkStore(tmp_path / "d")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, **_tls_kw(path))
            client = _client(path)
            items = [(cid, len(d)) for cid, d in chunks]
            got = await client.get_chunks(url, items, store=lambda c, b: dst.put_chunk(c, b, verified=True))
            assert got.outcomes == ["ok"] * len(chunks) and not got.error
            for cid, data in chunks:
                assert dst.read_chunk(cid) == data
            # the same connection again (kept alive), and a single-chunk GET on it
            sink = _Sink()
            got = await client.get_chunks(url, items[:2], store=sink)
            assert got.outcomes == ["ok", "ok"] and sink.got == dict(chunks[:2])
            assert len(client._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]) == 1   # kept alive
            assert bytes(await client.get_chunk_verified(url, *items[2])) == chunks[2][1]
            # the server counts an answer once it is sent: just after the client has it
            await until(plane.next_change, lambda: plane.statistics()["chunks_served"] == len(chunks) + 3)
            s = plane.statistics()
            assert s["batches"] == 2 and s["chunks_served"] == len(chunks) + 3 and s["connections"] == 1
            await client.aclose()
            nursery.cancel_scope.cancel()


@PATHS
async def test_missing_chunks_are_framed_and_all_missing_is_404(tmp_path: Path, path: str) -> None:
    src = ChunkStore(tmp_path / "s")
    (a, da), (b, db), (c, dc) = _chunks([5000, 6000, 7000])
    src.put_chunk(a, da)
    src.put_chunk(c, dc)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, _ = await _serve(nursery, src, **_tls_kw(path))
            client = _client(path)
            sink = _Sink()
            got = await client.get_chunks(url, [(a, 5000), (b, 6000), (c, 7000)], store=sink)
            assert got.outcomes == ["ok", "missing", "ok"] and sink.got == {a: da, c: dc}
            with pytest.raises(PeerMissing):
                await client.get_chunks(url, [(b, 6000)], store=sink)
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_a_batch_counts_as_its_chunks_against_the_per_chunk_cap(tmp_path: Path) -> None:
    """max_serving_per_chunk = 1: while chunk A is being sent (a slow reader holds it),
    a batch naming A and B gets B and A framed busy; a batch of only A gets 503 with the
    retry hint; once A's send is done, A is served again."""
    src = ChunkStore(tmp_path / "s")
    (a, da), (b, db) = _chunks([8 << 20, 4000])
    src.put_chunk(a, da)
    src.put_chunk(b, db)
    cfg = DataPlaneConfig(max_serving_per_chunk=1, busy_retry_ms=70)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, config=cfg)
            port = int(url.rsplit(":", 1)[1])
            # a reader that asks for A and reads nothing: A is being sent (socket buffers full)
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            slow.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await slow.send_all(f"GET /v1/chunks?ids={a} HTTP/1.1\r\nHost: x\r\n"
                                f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            await until(plane.next_change, lambda: plane.statistics()["serving_per_chunk_max"] >= 1)
            client = _client("thread")
            sink = _Sink()
            got = await client.get_chunks(url, [(a, len(da)), (b, len(db))], store=sink)
            assert got.outcomes == ["busy", "ok"] and sink.got == {b: db}
            with pytest.raises(PeerBusy) as e:
                await client.get_chunks(url, [(a, len(da))], store=sink)
            assert e.value.retry_after_s == pytest.approx(0.07)
            await slow.aclose()
            await until(plane.next_change, lambda: not plane._serving)
            got = await client.get_chunks(url, [(a, len(da))], store=sink)
            assert got.outcomes == ["ok"] and sink.got[a] == da
            assert plane.statistics()["batch_chunks_busy"] == 2
            await client.aclose()
            nursery.cancel_scope.cancel()


async def _raw(port: int, target: str, method: str = "GET") -> tuple[int, bytes]:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    await s.send_all(f"{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Connection: close\r\n\r\n".encode())
    buf = b""
    while True:
        piece = await s.receive_some(65536)
        if not piece:
            break
        buf += piece
    await s.aclose()
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_hostile_batch_requests_get_a_clear_4xx_and_lose_nothing(tmp_path: Path) -> None:
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks([3000, 4000, 5000])
    for cid, data in chunks:
        src.put_chunk(cid, data)
    ids = [c for c, _ in chunks]
    cfg = DataPlaneConfig(max_batch_chunks=4, max_batch_bytes=8000)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, config=cfg)
            port = int(url.rsplit(":", 1)[1])
            fake = [blake3.blake3(str(i).encode()).hexdigest() for i in range(5)]
            cases = {
                "too many": (f"/v1/chunks?ids={','.join(fake)}", 413, b"too many chunks"),
                "malformed": (f"/v1/chunks?ids={ids[0]},{ids[1][:63]}Z", 400, b"bad id"),
                "upper case": (f"/v1/chunks?ids={ids[0].upper()}", 400, b"bad id"),
                "duplicate": (f"/v1/chunks?ids={ids[0]},{ids[1]},{ids[0]}", 400, b"duplicate id"),
                "empty": ("/v1/chunks?ids=", 400, b"no ids"),
                "no query": ("/v1/chunks", 400, b"bad batch"),
                "other params": (f"/v1/chunks?ids={ids[0]}&wait_ms=5", 400, b"bad batch"),
                "over bytes": (f"/v1/chunks?ids={ids[1]},{ids[2]}", 413, b"batch too large"),
                "unknown": (f"/v1/chunks?ids={fake[0]},{fake[1]}", 404, b"no chunk named is here"),
            }
            for name, (target, status, why) in cases.items():
                got, body = await _raw(port, target)
                assert (got, why in body) == (status, True), (name, got, body)
            assert (await _raw(port, f"/v1/chunks?ids={ids[0]}", "HEAD"))[0] == 405
            # nothing was lost or left open: the store is intact and a good batch is served
            assert src.verify().ok
            sink = _Sink()
            got = await _client("thread").get_chunks(url, [(ids[0], 3000), (ids[1], 4000)], store=sink)
            assert got.outcomes == ["ok", "ok"] and sink.got == dict(chunks[:2])
            # (the server's sending thread frees its slot just after the client has every byte)
            await until(plane.next_change, lambda: not (plane._serving or plane.statistics()["active"]))
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------------------ a hostile server

class _Hostile:
    """Answers a batch request for ``chunks`` with well-formed frames, then misbehaves
    as ``mode`` says: corrupt (chunk 1's bytes flipped, the rest fine), die (FIN in the
    middle of chunk 2), reset (RST there), stall (silence there), badsize (chunk 1's
    frame announces another size), overlong (Content-Length past what the frames can
    take), short (Content-Length ending inside the last chunk)."""

    def __init__(self, chunks: list[tuple[str, bytes]], mode: str, tls: bool = False) -> None:
        self.chunks = chunks
        self.mode = mode
        self.tls = tls

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as n:
            await n.start(trio.serve_listeners, self._one, listeners)
            scheme = "https" if self.tls else "http"
            task_status.started(f"{scheme}://127.0.0.1:{listeners[0].socket.getsockname()[1]}")

    async def _one(self, raw: trio.SocketStream) -> None:
        stream: trio.abc.Stream = raw
        if self.tls:
            stream = trio.SSLStream(raw, _tls()[0], server_side=True)
            await stream.do_handshake()
        buf = b""
        while b"\r\n\r\n" not in buf:
            piece = await stream.receive_some(4096)
            if not piece:
                return
            buf += piece
        body = b""
        for i, (_, data) in enumerate(self.chunks):
            d = bytearray(data)
            if self.mode == "corrupt" and i == 1:
                d[len(d) // 2] ^= 0x01
            size = len(d) + 1 if self.mode == "badsize" and i == 1 else len(d)
            body += frame(OK, size) + bytes(d)
        length = len(body) + {"overlong": FRAME.size, "short": -10}.get(self.mode, 0)
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {length}\r\n\r\n".encode()
        if self.mode in ("corrupt", "badsize", "overlong", "short"):
            await stream.send_all(head + body + (frame(MISSING, 0) if self.mode == "overlong" else b""))
            await trio.sleep_forever()   # held open until the test is done
        cut = sum(FRAME.size + len(d) for _, d in self.chunks[:2]) + len(self.chunks[2][1]) // 2
        await stream.send_all(head + body[:cut])
        if self.mode == "stall":
            await trio.sleep_forever()
        elif self.mode == "reset":
            raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.socket.close()
        else:   # a FIN (under TLS without close_notify: the peer died)
            raw.socket.close()


async def _against(mode: str, path: str, sizes: list[int] | None = None, **cfg):
    chunks = _chunks(sizes or [1 << 20, 600_000, 1 << 20, 5000])
    client = _client(path, **cfg)
    sink = _Sink()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(_Hostile(chunks, mode, tls=path == "tls").run)
        try:
            got = await client.get_chunks(url, [(c, len(d)) for c, d in chunks], store=sink)
        except PeerError as e:
            got = e
        nursery.cancel_scope.cancel()
    await client.aclose()
    return got, sink, chunks


@PATHS
async def test_a_corrupt_chunk_in_a_batch_is_refused_the_rest_kept(path: str) -> None:
    with trio.fail_after(20):
        got, sink, chunks = await _against("corrupt", path)
    assert got.outcomes == ["ok", "corrupt", "ok", "ok"] and not got.error
    assert sink.got == {c: d for i, (c, d) in enumerate(chunks) if i != 1}


@PATHS
@pytest.mark.parametrize("mode", ["die", "reset", "stall"])
async def test_peer_death_mid_batch_keeps_what_came(path: str, mode: str) -> None:
    with trio.fail_after(20):
        got, sink, chunks = await _against(mode, path, stall_s=0.5)
    assert got.outcomes == ["ok", "ok"], got
    assert got.kind in ({"stall"} if mode == "stall" else {"closed", "reset"}) and got.error
    assert sink.got == dict(chunks[:2])


@PATHS
@pytest.mark.parametrize("mode", ["badsize", "short"])
async def test_broken_framing_ends_the_batch(path: str, mode: str) -> None:
    with trio.fail_after(20):
        got, sink, chunks = await _against(mode, path)
    assert got.kind == "protocol", got
    keep = 1 if mode == "badsize" else 3
    assert got.outcomes == ["ok"] * keep and sink.got == dict(chunks[:keep])


@PATHS
async def test_an_answer_longer_than_its_frames_can_be_is_refused(path: str) -> None:
    with trio.fail_after(20):
        got, sink, _ = await _against("overlong", path)
    assert isinstance(got, PeerError) and "announces" in str(got) and not sink.got


@PATHS
async def test_cancel_mid_batch_lets_go_and_the_client_works_after(tmp_path: Path, path: str) -> None:
    chunks = _chunks([1 << 20, 1 << 20, 1 << 20])
    client = _client(path)
    sink = _Sink()
    src = ChunkStore(tmp_path / "s")
    for cid, data in chunks:
        src.put_chunk(cid, data)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            bad = await nursery.start(_Hostile(chunks, "stall", tls=path == "tls").run)
            t0 = trio.current_time()
            with trio.move_on_after(0.5) as cs:
                await client.get_chunks(bad, [(c, len(d)) for c, d in chunks], store=sink)
            assert cs.cancelled_caught and trio.current_time() - t0 < 2
            good, _ = await _serve(nursery, src, **_tls_kw(path))
            sink2 = _Sink()
            got = await client.get_chunks(good, [(c, len(d)) for c, d in chunks], store=sink2)
            assert got.outcomes == ["ok"] * 3 and sink2.got == dict(chunks)
            nursery.cancel_scope.cancel()
    await client.aclose()


async def test_a_store_failure_mid_batch_is_reported(tmp_path: Path) -> None:
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks([4000, 5000, 6000])
    for cid, data in chunks:
        src.put_chunk(cid, data)
    calls: list[str] = []

    def store(cid: str, body: memoryview) -> None:
        calls.append(cid)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, _ = await _serve(nursery, src)
            got = await _client("thread").get_chunks(url, [(c, len(d)) for c, d in chunks], store=store)
            nursery.cancel_scope.cancel()
    assert got.outcomes == ["ok"] and got.kind == "store" and isinstance(got.store_error, OSError)


# ------------------------------------------------------------------------------ TLS

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    from infra.pki import throwaway
    return throwaway(tmp_path_factory.mktemp("pki"), nodes=["a", "b"])


async def test_tls_batch_byte_exact_keepalive_and_busy(tmp_path: Path, pki) -> None:
    from infra.tls import client_context, server_context

    src = ChunkStore(tmp_path / "s")
    chunks = _chunks(SIZES)
    for cid, data in chunks:
        src.put_chunk(cid, data)
    missing = _chunk(100)[0]
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, ssl_context=server_context(pki.files("node:a"),
                                                                              client_cert="required"))
            client = PeerClient(token=TOKEN, ssl_context=client_context(pki.ca, pki.files("node:b")))
            for _ in range(2):
                sink = _Sink()
                items = [(c, len(d)) for c, d in chunks] + [(missing, 100)]
                got = await client.get_chunks(url, items, store=sink)
                assert got.outcomes == ["ok"] * len(chunks) + ["missing"] and sink.got == dict(chunks)
            assert plane.statistics()["connections"] == 1
            with pytest.raises(PeerError):   # a plain client gets nothing from a TLS plane
                await PeerClient(token=TOKEN).get_chunks(url.replace("https", "http"), items, store=sink)
            await client.aclose()
            nursery.cancel_scope.cancel()


def test_frame_layout_is_fixed() -> None:
    assert FRAME.size == 16 and frame(BUSY, 0)[:5] == b"HCK1\x02" and frame(OK, 7)[-8:] == (7).to_bytes(8, "big")


async def test_unreachable_peer_is_unavailable() -> None:
    with pytest.raises(PeerUnavailable):
        await _client("thread", connect_s=1).get_chunks("http://127.0.0.1:9", [("a" * 64, 1)], store=_Sink())


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_client_leaving_mid_batch_frees_the_server(tmp_path: Path, tls: bool) -> None:
    """The asker stops reading, then goes away in the middle of a large batch: the
    server's sending thread notices (within send_stall_s at worst), the connection,
    its serving slot and the per-chunk counts are freed, and the next batch is served."""
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks([4 << 20] * 4)
    for cid, data in chunks:
        src.put_chunk(cid, data)
    ids = ",".join(c for c, _ in chunks)
    cfg = DataPlaneConfig(send_stall_s=2.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, config=cfg, **_tls_kw("tls" if tls else "thread"))
            port = int(url.rsplit(":", 1)[1])
            raw = await trio.open_tcp_stream("127.0.0.1", port)
            raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stream: trio.abc.Stream = raw
            if tls:
                stream = trio.SSLStream(raw, _tls()[1], server_hostname="127.0.0.1")
            await stream.send_all(f"GET /v1/chunks?ids={ids} HTTP/1.1\r\nHost: x\r\n"
                                  f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            await stream.receive_some(65536)                  # the head and a little
            await until(plane.next_change, lambda: plane._serving)
            raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.socket.close()                                 # gone, mid-batch
            await until(plane.next_change, lambda: not plane._serving and plane.statistics()["open_connections"] == 0)
            s = plane.statistics()
            assert not plane._serving and s["active"] == 0 and s["open_connections"] == 0
            assert s["batches"] == 0                           # that answer was never complete
            sink = _Sink()
            got = await _client("tls" if tls else "thread").get_chunks(
                url, [(c, len(d)) for c, d in chunks], store=sink)
            assert got.outcomes == ["ok"] * 4 and sink.got == dict(chunks)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_a_batch_holds_one_chunk_file_open_and_an_evicted_one_cuts_it(tmp_path: Path, tls: bool) -> None:
    """However many chunks a batch names, the server has one of their files open at a
    time (a flood of batches cannot run it out of descriptors); a chunk that vanishes
    before its turn ends the answer there: the frames before it arrive whole, then the
    connection closes (the asker fetches the rest elsewhere)."""
    src = ChunkStore(tmp_path / "s")
    # large enough that the server blocks inside chunk 0 while this reads nothing
    # (socket buffers on loopback take a few MB)
    chunks = _chunks([16 << 20, 16 << 20, 16 << 20, 5000])
    for cid, data in chunks:
        src.put_chunk(cid, data)
    chunk_dir = str(src.chunks_dir)

    def open_chunk_files() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith(chunk_dir)
            except OSError:
                pass
        return n

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, **_tls_kw("tls" if tls else "thread"))
            raw = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            stream: trio.abc.Stream = raw
            if tls:
                # (a cut answer ends without close_notify: read that as the end)
                stream = trio.SSLStream(raw, _tls()[1], server_hostname="127.0.0.1", https_compatible=True)
            await stream.send_all(f"GET /v1/chunks?ids={','.join(c for c, _ in chunks)} HTTP/1.1\r\nHost: x\r\n"
                                  f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            got = bytearray(await stream.receive_some(65536))
            # the server is sending chunk 0 (blocked: this reads nothing more); a later
            # chunk's file would be open by now if it opened them ahead of their turn
            await poll(open_chunk_files, 0.01)             # (descriptors set no event)
            assert plane._serving and open_chunk_files() == 1
            os.unlink(src.chunk_path(chunks[2][0]))        # gone before its turn
            while True:
                piece = await stream.receive_some(1 << 20)
                if not piece:
                    break
                got += piece
            head, _, body = bytes(got).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            want = b"".join(frame(OK, len(d)) + d for _, d in chunks[:2])
            assert body == want                            # two whole frames, then the cut
            await until(plane.next_change, lambda: plane.statistics()["open_connections"] == 0)
            assert open_chunk_files() == 0 and not plane._serving
            assert plane.statistics()["batches"] == 0 and plane.statistics()["open_connections"] == 0
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ batches that can wait

@PATHS
async def test_a_waiting_batch_streams_each_chunk_as_it_arrives(tmp_path: Path, path: str) -> None:
    """?ids=&sizes=&wait_ms=: the server holds none of the chunks when asked; each frame
    comes once its chunk is stored there, in order, byte-exact, in one answer (one
    request), and the connection is kept alive after it."""
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks(SIZES)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, **_tls_kw(path))
            client = _client(path)
            sink = _Sink()
            items = [(cid, len(d)) for cid, d in chunks]
            got: list = []
            done = trio.Event()

            async def ask() -> None:
                got.append(await client.get_chunks(url, items, store=sink, wait_ms=10_000))
                done.set()

            nursery.start_soon(ask)
            for i, (cid, data) in enumerate(chunks):   # they arrive one by one, after the request
                # the server has sent every chunk before it and waits for chunk i
                await until(plane.next_change, lambda i=i: plane.statistics()["waits"] == i + 1)
                assert cid not in sink.got
                src.put_chunk(cid, data)
            await sink.changes.until(lambda: len(sink.got) == len(chunks))
            await until(plane.next_change, lambda: plane.statistics()["wait_batches"] == 1)
            await done.wait()
            assert got[0].outcomes == ["ok"] * len(chunks) and not got[0].error
            assert sink.got == dict(chunks)
            await until(plane.next_change, lambda: plane.statistics()["waiting_requests"] == 0)
            s = plane.statistics()
            assert s["wait_batches"] == 1 and s["wait_batches_cut"] == 0 and s["requests"] == 1
            assert s["chunks_served"] == len(chunks) and s["waiting_requests"] == 0
            assert len(client._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]) == 1   # kept alive
            await client.aclose()
            nursery.cancel_scope.cancel()


@PATHS
async def test_a_waiting_batch_cut_at_its_deadline_keeps_what_came(tmp_path: Path, path: str) -> None:
    """The third chunk never arrives: the answer ends after the first two (kept, stored),
    the connection is closed; a batch whose first chunk never comes is a 404."""
    src = ChunkStore(tmp_path / "s")
    chunks = _chunks([300_000, 5000, 7000, 9000])
    for cid, data in chunks[:2]:
        src.put_chunk(cid, data)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, **_tls_kw(path))
            client = _client(path)
            sink = _Sink()
            got = await client.get_chunks(url, [(c, len(d)) for c, d in chunks], store=sink, wait_ms=300)
            assert got.outcomes == ["ok", "ok"] and got.kind in ("closed", "reset")
            assert sink.got == dict(chunks[:2])
            with pytest.raises(PeerMissing):
                await client.get_chunks(url, [(c, len(d)) for c, d in chunks[2:]], store=sink, wait_ms=200)
            # the server leaves the wait budget just after its answer went
            await until(plane.next_change, lambda: plane.statistics()["waiting_requests"] == 0)
            s = plane.statistics()
            assert s["wait_batches_cut"] == 1 and s["waiting_requests"] == 0 and not plane._serving
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_a_waiting_batch_ends_at_a_chunk_of_another_size(tmp_path: Path) -> None:
    """Sizes are the asker's word for framing only: a chunk whose size differs from the
    one named ends the answer before it (nothing wrong is framed); the first one: 409."""
    src = ChunkStore(tmp_path / "s")
    (a, da), (b, db) = _chunks([4000, 6000])
    src.put_chunk(a, da)
    src.put_chunk(b, db)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src)
            client = _client("thread")
            sink = _Sink()
            got = await client.get_chunks(url, [(a, 4000), (b, 6001)], store=sink, wait_ms=1000)
            assert got.outcomes == ["ok"] and got.kind and sink.got == {a: da}
            with pytest.raises(PeerError, match="409"):
                await client.get_chunks(url, [(b, 5999)], store=sink, wait_ms=1000)
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_a_waiting_batch_waits_for_a_copy_of_a_chunk_over_the_cap_to_finish(tmp_path: Path) -> None:
    """max_serving_per_chunk = 1 and chunk A being sent to a slow reader: a waiting batch
    [B, A] gets B at once and A once that copy is done (never two copies of A at once);
    a waiting batch of only A whose wait runs out first: 503 with the retry hint."""
    src = ChunkStore(tmp_path / "s")
    (a, da), (b, db) = _chunks([8 << 20, 4000])
    src.put_chunk(a, da)
    src.put_chunk(b, db)
    cfg = DataPlaneConfig(max_serving_per_chunk=1, busy_retry_ms=20)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, config=cfg)
            port = int(url.rsplit(":", 1)[1])
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            slow.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await slow.send_all(f"GET /v1/chunks?ids={a} HTTP/1.1\r\nHost: x\r\n"
                                f"Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            await until(plane.next_change, lambda: plane.statistics()["serving_per_chunk_max"] >= 1)
            client = _client("thread")
            with pytest.raises(PeerBusy) as e:
                await client.get_chunks(url, [(a, len(da))], store=_Sink(), wait_ms=200)
            assert e.value.retry_after_s == pytest.approx(0.02)
            sink = _Sink()
            got: list = []
            done = trio.Event()

            async def ask() -> None:
                got.append(await client.get_chunks(url, [(b, len(db)), (a, len(da))], store=sink, wait_ms=10_000))
                done.set()

            nursery.start_soon(ask)
            await sink.changes.until(lambda: b in sink.got)
            # B came; the server holds A back for the slow copy (its second delay by the cap)
            await until(plane.next_change, lambda: plane.statistics()["rejected_chunk_busy"] == 2)
            assert a not in sink.got and not got          # A waits for the slow copy
            await slow.aclose()
            await done.wait()
            assert got[0].outcomes == ["ok", "ok"] and sink.got == {a: da, b: db}
            assert plane.statistics()["serving_per_chunk_max"] == 1
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_hostile_waiting_batches_get_a_clear_4xx(tmp_path: Path) -> None:
    src = ChunkStore(tmp_path / "s")
    (a, da), (b, db) = _chunks([3000, 4000])
    src.put_chunk(a, da)
    cfg = DataPlaneConfig(max_batch_chunks=4, max_batch_bytes=8000)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url, plane = await _serve(nursery, src, config=cfg)
            port = int(url.rsplit(":", 1)[1])
            cases = {
                f"/v1/chunks?ids={a},{b}&sizes=3000&wait_ms=10": (400, b"bad sizes"),
                f"/v1/chunks?ids={a}&sizes=-1&wait_ms=10": (400, b"bad sizes"),
                f"/v1/chunks?ids={a}&sizes=3000&wait_ms=x": (400, b"bad wait_ms"),
                f"/v1/chunks?ids={a}&wait_ms=10&sizes=3000": (400, b"bad batch"),
                f"/v1/chunks?ids={a}&sizes=3000&wait_ms=10&x=1": (400, b"bad batch"),
                f"/v1/chunks?ids={a},{b}&sizes=3000,9000&wait_ms=10": (413, b"batch too large"),
                f"/v1/chunks?ids={b}&sizes=4000&wait_ms=10": (404, b"chunk not here"),
            }
            for target, (status, why) in cases.items():
                got, body = await _raw(port, target)
                assert (got, why in body) == (status, True), (target, got, body)
            got, body = await _raw(port, f"/v1/chunks?ids={a}&sizes=3000&wait_ms=0")   # an ordinary batch
            assert got == 200 and body.endswith(da)
            await until(plane.next_change, lambda: plane.statistics()["waiting_requests"] == 0)
            nursery.cancel_scope.cancel()


def test_the_receive_buffer_pool_reuses_and_rounds() -> None:
    from p2p.batch import BufferPool

    pool = BufferPool(floor=1 << 16, keep=2)
    a = pool.take(100_000)
    assert len(a) == 1 << 17 and pool.allocated == 1        # rounded up to a power of two
    pool.give(a)
    assert pool.take(70_000) is a and pool.allocated == 1    # fits: reused, not made
    b, c = pool.take(10), pool.take(1 << 18)
    assert len(b) == 1 << 16 and len(c) == 1 << 18 and pool.allocated == 3
    for buf in (a, b, c):
        pool.give(buf)
    # two kept, the smallest dropped
    assert pool.take(1 << 18) is c and pool.take(1 << 17) is a and pool.allocated == 3


def test_frames_received_into_reused_buffers_are_byte_exact() -> None:
    """One pooled buffer serves a whole batch (a large chunk, then smaller ones, a
    corrupt one in between, and one cut short): each stored chunk is exactly its bytes,
    no stale byte of an earlier chunk leaks into a later one, and the cut one is not
    stored."""
    import p2p.batch as batch
    from p2p.batch import BufferPool, FrameReader, receive_frames

    pool = BufferPool(floor=1 << 16)
    old, batch.BUFFERS = batch.BUFFERS, pool
    try:
        big, small, tiny = os.urandom(1 << 20), os.urandom(300_000), os.urandom(5000)
        bad = bytearray(os.urandom(400_000))
        bad_id = blake3.blake3(bytes(bad)).hexdigest()
        bad[123] ^= 1
        cut = os.urandom(900_000)
        items = [(blake3.blake3(big).hexdigest(), len(big)), (blake3.blake3(small).hexdigest(), len(small)),
                 (bad_id, len(bad)), (blake3.blake3(tiny).hexdigest(), len(tiny)),
                 (blake3.blake3(cut).hexdigest(), len(cut))]
        body = b"".join(frame(OK, len(d)) + bytes(d) for d in (big, small, bad, tiny))
        body += frame(OK, len(cut)) + cut[:len(cut) // 2]
        length = len(body) + len(cut) - len(cut) // 2
        got: dict[str, bytes] = {}
        r = receive_frames(FrameReader(-1, body), items, length, lambda cid, v: got.__setitem__(cid, bytes(v)))
        assert r.outcomes == ["ok", "ok", "corrupt", "ok"] and r.kind == "closed"
        assert got == {items[0][0]: big, items[1][0]: small, items[3][0]: tiny}
        assert pool.allocated == 1                      # one buffer for the whole batch
        r = receive_frames(FrameReader(-1, body), items, length, lambda cid, v: None)
        assert r.outcomes == ["ok", "ok", "corrupt", "ok"] and pool.allocated == 1   # and the next
    finally:
        batch.BUFFERS = old


def test_a_stop_wakes_a_poll_that_would_sleep_until_its_deadline() -> None:
    """A worker thread polls its socket and its Stop together, sleeping until its
    deadline (no look every POLL_S); setting the Stop from another thread wakes it."""
    import select
    import threading

    from p2p.batch import POLL_S, Stop, poll_ms, watch

    assert poll_ms(True, 60.0) == 60_001 and poll_ms(False, 60.0) == int(POLL_S * 1000) + 1
    assert poll_ms(True, -1.0) == 1
    a, b = socket.socketpair()
    try:
        stop = Stop()
        poller = select.poll()
        poller.register(a.fileno(), select.POLLIN)
        assert watch(poller, stop) and not watch(select.poll(), threading.Event())
        threading.Timer(0.05, stop.set).start()
        events = poller.poll(poll_ms(True, 60.0))     # returns on the set, not after 60 s
        assert [fd for fd, _ in events] == [stop.fileno()] and stop.is_set()
    finally:
        a.close()
        b.close()


def test_a_receiver_waiting_for_its_next_frame_stops_when_told() -> None:
    """A batch that can wait: the receiving thread is in a 60 s gap wait for a frame that
    never comes; a Stop ends it with kind "stopped", nothing stored."""
    import threading

    from p2p.batch import FrameReader, Stop, receive_frames

    a, b = socket.socketpair()
    a.setblocking(False)
    stop = Stop()
    reader = FrameReader(os.dup(a.fileno()), b"", stall_s=60.0, stop=stop, gap_s=60.0)
    stored: list[str] = []
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(receive_frames(reader, [("a" * 64, 10)], FRAME.size + 10,
                                                                  lambda c, v: stored.append(c))))
    try:
        t.start()
        stop.set()
        t.join(10)
        assert not t.is_alive()
        (got,) = out
        assert got.kind == "stopped" and got.outcomes == [] and not stored   # type: ignore[attr-defined]
    finally:
        a.close()
        b.close()
