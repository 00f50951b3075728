"""PeerClient's two receive paths over real loopback sockets: bodies below
``THREAD_BODY_MIN`` are received in the trio thread, larger ones by a worker thread that
hashes as it receives. Both must be byte-exact, and fail the same way when the peer dies,
resets, stalls or sends bad bytes; a cancelled receive must let go at once. TLS on the data
plane (DataPlane / PeerClient ``ssl_context``) is checked here too."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import blake3
import pytest
import trio

from p2p.dataplane import DataPlane
from p2p.peers import PeerClient, PeerClientConfig, PeerCorrupt, PeerError, PeerTimeout, PeerUnavailable
from p2p.store import ChunkStore

TOKEN = "cluster-secret"
SMALL = 200_000                       # the trio-thread path
LARGE = 3 * 1024 * 1024 + 17          # the worker-thread path
SIZES = pytest.mark.parametrize("size", [SMALL, LARGE], ids=["loop", "thread"])


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


def test_sizes_take_both_paths() -> None:
    assert SMALL < PeerClient.THREAD_BODY_MIN <= LARGE


async def _serve(nursery: trio.Nursery, store: ChunkStore, **kw) -> str:
    plane = DataPlane(store, token=TOKEN, listen="127.0.0.1:0", **kw)
    return await nursery.start(plane.run)


@SIZES
async def test_byte_exact_and_keepalive(tmp_path: Path, size: int) -> None:
    store = ChunkStore(tmp_path / "s")
    chunks = [_chunk(size + i) for i in range(4)]
    for cid, data in chunks:
        store.put_chunk(cid, data)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, store)
            client = PeerClient(token=TOKEN)
            for cid, data in chunks:
                assert bytes(await client.get_chunk(url, cid, len(data))) == data
                assert bytes(await client.get_chunk_verified(url, cid, len(data))) == data

            async def both(cid: str, data: bytes) -> None:   # concurrent, several connections
                assert bytes(await client.get_chunk_verified(url, cid, len(data))) == data

            async with trio.open_nursery() as inner:
                for cid, data in chunks:
                    inner.start_soon(both, cid, data)
            assert len(client._idle[("127.0.0.1", int(url.rsplit(":", 1)[1]))]) >= 1   # kept alive
            await client.aclose()
            nursery.cancel_scope.cancel()


class _Hostile:
    """A loopback server that answers every GET with a 200 for ``size`` bytes, then
    misbehaves as ``mode`` says: corrupt (all bytes sent, one flipped), die (half, then
    FIN), reset (half, then RST), stall (half, then silence)."""

    def __init__(self, data: bytes, mode: str) -> None:
        self.data = data
        self.mode = mode
        self.url = ""

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with trio.open_nursery() as n:
            await n.start(trio.serve_listeners, self._one, listeners)
            task_status.started(self.url)

    async def _one(self, stream: trio.SocketStream) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            piece = await stream.receive_some(4096)
            if not piece:
                return
            buf += piece
        data = bytearray(self.data)
        half = len(data) // 2
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        if self.mode == "corrupt":
            data[len(data) * 3 // 4] ^= 0x01
            await stream.send_all(head + bytes(data))
            await trio.sleep_forever()   # held open until the test is done
        await stream.send_all(head + bytes(data[:half]))
        if self.mode == "stall":
            await trio.sleep_forever()
        elif self.mode == "reset":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stream.socket.close()
        else:
            await stream.aclose()


async def _against(mode: str, size: int, **cfg) -> tuple[BaseException | None, str, bytes]:
    cid, data = _chunk(size)
    hostile = _Hostile(data, mode)
    client = PeerClient(token=TOKEN, config=PeerClientConfig(**cfg))
    err: BaseException | None = None
    async with trio.open_nursery() as nursery:
        url = await nursery.start(hostile.run)
        try:
            await client.get_chunk_verified(url, cid, size)
        except PeerError as e:
            err = e
        nursery.cancel_scope.cancel()
    await client.aclose()
    return err, cid, data


@SIZES
async def test_corrupt_bytes_are_refused(size: int) -> None:
    with trio.fail_after(20):
        err, cid, data = await _against("corrupt", size)
    assert isinstance(err, PeerCorrupt) and err.nbytes == size and cid[:16] in str(err)


@SIZES
async def test_unverified_get_returns_what_came(size: int) -> None:
    """get_chunk (the herd hashes itself) hands back the bad bytes exactly as sent."""
    cid, data = _chunk(size)
    hostile = _Hostile(data, "corrupt")
    client = PeerClient(token=TOKEN)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(hostile.run)
            got = bytes(await client.get_chunk(url, cid, size))
            nursery.cancel_scope.cancel()
    want = bytearray(data)
    want[size * 3 // 4] ^= 0x01
    assert got == bytes(want) and blake3.blake3(got).hexdigest() != cid


@SIZES
@pytest.mark.parametrize("mode", ["die", "reset"])
async def test_peer_death_mid_body(size: int, mode: str) -> None:
    with trio.fail_after(20):
        err, _, _ = await _against(mode, size)
    assert isinstance(err, PeerUnavailable), err
    assert f"of {size} bytes" in str(err)


@SIZES
async def test_stalled_peer_times_out(size: int) -> None:
    with trio.fail_after(20):
        t0 = trio.current_time()
        err, _, _ = await _against("stall", size, stall_s=0.5)
        took = trio.current_time() - t0
    assert isinstance(err, PeerTimeout) and "stalled after" in str(err)
    assert took < 10


@SIZES
async def test_cancelled_receive_lets_go(size: int) -> None:
    """A race's loser is cancelled mid-body: the call returns at once (the worker thread is
    abandoned and stops on its own), and the client still works afterwards."""
    cid, data = _chunk(size)
    hostile = _Hostile(data, "stall")
    client = PeerClient(token=TOKEN)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(hostile.run)
            with trio.move_on_after(0.5) as cs:
                await client.get_chunk(url, cid, size)
            assert cs.cancelled_caught
            # a good server afterwards: same client, fresh connection
            store = ChunkStore(Path(os.environ.get("TMPDIR", "/tmp")) / f"peer-recv-{os.getpid()}-{size}")
            cid2, data2 = _chunk(size)
            store.put_chunk(cid2, data2)
            good = await _serve(nursery, store)
            assert bytes(await client.get_chunk_verified(good, cid2, size)) == data2
            nursery.cancel_scope.cancel()
    await client.aclose()


# ------------------------------------------------------------------------------ TLS

@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory):
    from infra.pki import throwaway
    return throwaway(tmp_path_factory.mktemp("pki"), nodes=["a", "b"])


def _contexts(pki):
    from infra.tls import client_context, server_context
    return (server_context(pki.files("node:a"), client_cert="required"),
            client_context(pki.ca, pki.files("node:b")))


@SIZES
async def test_tls_byte_exact(tmp_path: Path, pki, size: int) -> None:
    server_ctx, client_ctx = _contexts(pki)
    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(size)
    store.put_chunk(cid, data)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await _serve(nursery, store, ssl_context=server_ctx)
            assert url.startswith("https://")
            client = PeerClient(token=TOKEN, ssl_context=client_ctx)
            for _ in range(2):   # keep-alive over TLS
                assert bytes(await client.get_chunk_verified(url, cid, size)) == data
            # a plain client, or a TLS client told of an http:// URL, gets nothing
            with pytest.raises(PeerError):
                await PeerClient(token=TOKEN).get_chunk(url.replace("https://", "http://"), cid, size)
            with pytest.raises(PeerError, match="want https"):
                await client.get_chunk(url.replace("https://", "http://"), cid, size)
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_tls_refuses_a_client_without_a_cluster_certificate(tmp_path: Path, pki) -> None:
    import ssl

    server_ctx, _ = _contexts(pki)
    store = ChunkStore(tmp_path / "s")
    cid, data = _chunk(SMALL)
    store.put_chunk(cid, data)
    anon = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anon.load_verify_locations(cafile=str(pki.ca))
    anon.check_hostname = False
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            plane = DataPlane(store, token=TOKEN, listen="127.0.0.1:0", ssl_context=server_ctx)
            url = await nursery.start(plane.run)
            with pytest.raises(PeerError):
                await PeerClient(token=TOKEN, ssl_context=anon).get_chunk(url, cid, SMALL)
            assert plane.statistics()["bytes_served"] == 0
            nursery.cancel_scope.cancel()
