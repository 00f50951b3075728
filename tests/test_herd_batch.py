"""The herd's multi-chunk path (HerdConfig.batch_chunks; GET /v1/chunks?ids=) through
real Herds and DataPlanes on loopback: a warm peer's chunks come in batches, byte-exact;
a rotted chunk in a batch is refused and fetched elsewhere while the rest of the batch
is kept; a peer dying in the middle of a batch (a real proxy cutting the connection)
keeps what came and the fetch completes; a fetch cancelled mid-batch leaves nothing in
flight and the next fetch completes."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
from pathlib import Path

import pytest
import trio

from p2p.herd import Herd, herd_fetch
from scheduler_link.messages import Peer
from tests.herd_cluster import FAST, assert_bit_exact, make_artifact, open_file_origin, start_nodes

TOKEN = "batch-token"
CHUNK = 256 * 1024
CFG = dataclasses.replace(FAST, batch_chunks=8, batch_bytes=8 * CHUNK)


async def _warm(nursery: trio.Nursery, tmp: Path, art, origin, n: int = 2, config=CFG):
    nodes = await start_nodes(nursery, tmp, n, TOKEN, config=config)
    await herd_fetch(nodes[0].herd, art.manifest_id, origin, [])
    return nodes


async def test_a_warm_peer_serves_in_batches_byte_exact(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 6 * 1024 * 1024 + 1234, chunk_size=CHUNK, seed=21)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            warm, cold = await _warm(nursery, tmp_path, art, origin)
            reads = sum(origin.chunk_reads.values())
            _, run = await herd_fetch(cold.herd, art.manifest_id, origin, [warm.peer, cold.peer])
            assert_bit_exact(cold, art)
            assert sum(origin.chunk_reads.values()) == reads          # nothing from the origin
            s = warm.plane.statistics()
            assert run.chunks_from_peers == len(set(art.chunks))
            assert s["batches"] >= 1 and s["batches"] < len(set(art.chunks))
            assert len(cold.herd.flight) == 0
            for n in (warm, cold):
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_one_rotted_chunk_in_a_batch_is_refetched_the_rest_kept(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * 1024 * 1024, chunk_size=CHUNK, seed=22)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            warm, cold = await _warm(nursery, tmp_path, art, origin)
            rotten = list(dict.fromkeys(art.chunks))[3]
            p = warm.store.chunk_path(rotten)
            os.chmod(p, 0o644)
            data = bytearray(p.read_bytes())
            data[len(data) // 3] ^= 0x5A
            p.write_bytes(bytes(data))
            before = dict(origin.chunk_reads)
            _, run = await herd_fetch(cold.herd, art.manifest_id, origin, [warm.peer, cold.peer])
            assert_bit_exact(cold, art)
            h = cold.herd
            assert h.counters.integrity_failures >= 1 and h.health.until[warm.node_id] == float("inf")
            # the rotted chunk came from the origin; every chunk before it in its batch was kept
            assert origin.chunk_reads[rotten] == before.get(rotten, 0) + 1
            assert run.chunks_from_peers >= 3
            assert len(h.flight) == 0
            for n in (warm, cold):
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


class _CuttingProxy:
    """A real TCP proxy in front of a data plane: the ``cut``-th batch answer (GET
    /v1/chunks?ids=) is cut after ``after`` bytes, by FIN or RST (``mode``); everything
    else passes through."""

    def __init__(self, upstream: str, after: int, mode: str, cut: int = 1) -> None:
        host, _, port = upstream.removeprefix("http://").rpartition(":")
        self.up = (host, int(port))
        self.after = after
        self.mode = mode
        self.cut_at = cut
        self.batches = 0
        self.cuts = 0
        self.asked: list[list[str]] = []     # the chunk ids of every request, in order

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as n:
            await n.start(trio.serve_listeners, self._one, listeners)
            task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")

    async def _one(self, down: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream(*self.up)
        limit: list[int | None] = [None]
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

        async def client_to_server() -> None:
            while True:
                data = await down.receive_some(65536)
                if not data:
                    await up.send_eof()
                    return
                for line in data.split(b"\r\n"):
                    if line.startswith(b"GET /v1/chunks"):
                        target = line.split()[1].decode()
                        self.asked.append(target.split("ids=", 1)[1].split(",") if "ids=" in target
                                          else [target.rsplit("/", 1)[1].split("?")[0]])
                if b"GET /v1/chunks?ids=" in data:
                    self.batches += 1
                    if self.batches == self.cut_at:
                        limit[0] = self.after
                await up.send_all(data)

        async def server_to_client() -> None:
            sent = 0
            while True:
                data = await up.receive_some(65536)
                if not data:
                    return
                cut = limit[0]
                if cut is not None and sent + len(data) >= cut:
                    await down.send_all(data[: cut - sent])
                    self.cuts += 1
                    return
                sent += len(data)
                await down.send_all(data)

        try:
            async with trio.open_nursery() as n:
                async def pump(fn) -> None:
                    try:
                        await fn()
                    except gone:
                        pass
                    n.cancel_scope.cancel()
                n.start_soon(pump, client_to_server)
                n.start_soon(pump, server_to_client)
        finally:
            if self.mode == "reset":
                down.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            down.socket.close()
            up.socket.close()


@pytest.mark.parametrize("mode", ["die", "reset"])
async def test_peer_death_mid_batch_keeps_what_came_and_completes(tmp_path: Path, mode: str) -> None:
    art = make_artifact(tmp_path, 4 * 1024 * 1024, chunk_size=CHUNK, seed=23)
    origin = open_file_origin(art)
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            warm, cold = await _warm(nursery, tmp_path, art, origin)
            proxy = _CuttingProxy(warm.url, after=int(2.5 * (CHUNK + 16)) + 200, mode=mode)
            purl = await nursery.start(proxy.run)
            before = dict(origin.chunk_reads)
            peers = [Peer(node_id=warm.node_id, data_url=purl), cold.peer]
            _, run = await herd_fetch(cold.herd, art.manifest_id, origin, peers)
            assert_bit_exact(cold, art)
            assert proxy.cuts == 1
            st = cold.herd.health.stats[warm.node_id]
            assert st.errors >= 1                 # the death was noticed and penalised
            # ... and the two chunks that came whole before the cut were kept: never asked again
            # (after a FIN; an RST may discard bytes the kernel had not handed over yet)
            if mode == "die":
                kept = proxy.asked[0][:2]
                assert not {c for ids in proxy.asked[1:] for c in ids} & set(kept)
                assert all(origin.chunk_reads[c] == before.get(c, 0) for c in kept)
            assert run.chunks_from_peers + run.chunks_from_origin == len(set(art.chunks))
            assert len(cold.herd.flight) == 0
            for n in (warm, cold):
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_a_fetch_cancelled_mid_batch_leaves_nothing_in_flight(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 6 * 1024 * 1024, chunk_size=CHUNK, seed=24)
    origin = open_file_origin(art)
    slow = dataclasses.replace(CFG, peer_rate_bps=8e6 * 8)   # ~8 MB/s: a batch takes a while
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            warm, cold = await _warm(nursery, tmp_path, art, origin, config=slow)
            peers = [warm.peer, cold.peer]
            with trio.move_on_after(0.3) as cs:
                await herd_fetch(cold.herd, art.manifest_id, origin, peers)
            assert cs.cancelled_caught and not cold.store.is_complete(art.manifest_id)
            assert len(cold.herd.flight) == 0 and cold.herd.counters.chunks_in_flight == 0
            again = Herd(cold.store, node_id=cold.node_id, token=TOKEN, config=CFG)   # full speed
            await herd_fetch(again, art.manifest_id, origin, peers)
            assert_bit_exact(cold, art)
            for h in (warm.herd, cold.herd, again):
                await h.aclose()
            nursery.cancel_scope.cancel()


async def test_cold_tree_children_ask_their_parents_in_batches_that_wait(tmp_path: Path) -> None:
    """Four cold nodes at once (one rack: every node's parent for a chunk is its home):
    each asks a parent for its next chunks from that parent in one request that waits
    (HerdConfig.batch_wait_chunks); the parent sends each as it gets it from the (slow)
    origin. Byte-exact everywhere, each chunk read from the origin once, and far fewer
    requests than chunk copies."""
    art = make_artifact(tmp_path, 6 * 1024 * 1024, chunk_size=CHUNK, seed=25)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, origin_rate_bps=40e6 * 8, batch_wait_chunks=8)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 4, TOKEN, config=cfg)
            peers = [n.peer for n in nodes]
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            n_chunks = len(set(art.chunks))
            for n in nodes:
                assert_bit_exact(n, art)
                assert len(n.herd.flight) == 0
            assert sum(origin.chunk_reads.values()) == n_chunks
            stats = [n.plane.statistics() for n in nodes]
            copies = sum(s["chunks_served"] for s in stats)
            assert copies >= 3 * n_chunks - 4      # (a chunk or so may come twice: the endgame)
            assert sum(s["wait_batches"] for s in stats) >= 4
            assert sum(s["requests"] for s in stats) < copies / 2, stats
            for n in nodes:
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
