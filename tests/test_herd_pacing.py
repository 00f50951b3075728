"""Origin reads paced by the uplink (HerdConfig.home_backlog_bytes): while a node's data
plane still owes its askers more than the limit (DataPlane.send_backlog, counted over
real sockets here), the herd reads nothing more from the origin; the pause is bounded."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import blake3
import trio

from p2p.dataplane import DataPlane
from p2p.herd import Herd, herd_fetch, origin_paused
from p2p.store import ChunkStore
from tests.herd_cluster import FAST, assert_bit_exact, make_artifact, open_file_origin, start_nodes

TOKEN = "pacing-token"
CHUNK = 64 * 1024


def test_origin_paused_rule() -> None:
    assert origin_paused(2, 1) and not origin_paused(1, 1)
    assert not origin_paused(10 << 30, 0)       # 0: pacing off


async def _wait_until(cond, what: str) -> None:   # what: for the reader of a timeout
    with trio.fail_after(10):
        while not cond():
            await trio.sleep(0.005)


async def test_origin_reads_wait_while_the_uplink_owes_a_backlog(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 8 * CHUNK, chunk_size=CHUNK, seed=41)
    origin = open_file_origin(art)
    owed = [8 << 20]
    polls = [0]

    def backlog() -> int:
        polls[0] += 1
        return owed[0]

    cfg = dataclasses.replace(FAST, home_backlog_bytes=1 << 20, home_backlog_poll_s=0.005,
                              home_backlog_max_pause_s=60.0)
    store = ChunkStore(tmp_path / "store")
    herd = Herd(store, node_id="a", token=TOKEN, config=cfg, uplink_backlog=backlog)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(herd_fetch, herd, art.manifest_id, origin, [])
            # the herd keeps asking how much the uplink owes, and reads no chunk meanwhile
            await _wait_until(lambda: polls[0] >= 20, "polls")
            assert sum(origin.chunk_reads.values()) == 0
            assert herd.counters.origin_paced >= 1
            owed[0] = 1 << 20                         # at the limit: no longer over it
        assert_bit_exact_store(store, art)
        assert sum(origin.chunk_reads.values()) == len(set(art.chunks))
        await herd.aclose()


def assert_bit_exact_store(store: ChunkStore, art) -> None:
    assert store.is_complete(art.manifest_id)
    for cid, piece in art.chunks.items():
        assert store.read_chunk(cid) == piece


async def test_a_pause_is_bounded(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * CHUNK, chunk_size=CHUNK, seed=42)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, home_backlog_bytes=1, home_backlog_poll_s=0.005,
                              home_backlog_max_pause_s=0.05)
    store = ChunkStore(tmp_path / "store")
    herd = Herd(store, node_id="a", token=TOKEN, config=cfg, uplink_backlog=lambda: 1 << 30)
    with trio.fail_after(30):
        await herd_fetch(herd, art.manifest_id, origin, [])
    assert_bit_exact_store(store, art)
    # every chunk's read waited (the uplink never caught up) and still went ahead
    assert herd.counters.origin_paced == len(set(art.chunks))
    assert herd.counters.origin_paced_s >= 0.05 * len(set(art.chunks)) / FAST.origin_concurrency
    await herd.aclose()


async def test_the_data_plane_counts_what_it_owes_a_slow_reader(tmp_path: Path) -> None:
    """A batch answer sent to a client that does not read (more than the sockets' buffers
    hold): its chunk bytes are owed while it is being sent, nothing once the client has
    read it all."""
    big = 4 << 20
    store = ChunkStore(tmp_path / "warm")
    ids = []
    for _ in range(3):
        piece = os.urandom(big)
        cid = blake3.blake3(piece).hexdigest()
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
            await _wait_until(lambda: plane.send_backlog() == 3 * big, "owed")
            assert plane.statistics()["send_backlog"] == 3 * big
            got = 0
            while data := await sock.recv(1 << 20):
                got += len(data)
            assert got > 3 * big
            sock.close()
            await _wait_until(lambda: plane.send_backlog() == 0, "paid")
            nursery.cancel_scope.cancel()


async def test_a_herd_with_its_uplink_wired_is_byte_exact(tmp_path: Path) -> None:
    """Eight nodes whose herds read their own data plane's backlog (as the agent wires
    them), a limit low enough to pause: byte-exact everywhere, about one origin copy."""
    art = make_artifact(tmp_path, 48 * CHUNK, chunk_size=CHUNK, seed=44)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, home_backlog_bytes=CHUNK, home_backlog_poll_s=0.005)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 8, TOKEN, config=cfg)
            peers = [n.peer for n in nodes]
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    assert n.herd.uplink_backlog == n.plane.send_backlog
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            for n in nodes:
                assert_bit_exact(n, art)
                await n.herd.aclose()
            assert sum(origin.chunk_reads.values()) <= 1.05 * len(set(art.chunks))
            nursery.cancel_scope.cancel()


def test_a_home_is_ahead_past_the_first_missing_chunk_plus_its_lead(tmp_path: Path) -> None:
    from p2p.herd import HerdConfig, _Lead, home_lead

    store = ChunkStore(tmp_path / "store")
    pieces = [os.urandom(100) + bytes([i]) for i in range(10)]
    ids = [blake3.blake3(p).hexdigest() for p in pieces]
    lead = _Lead(store, ids, 2)
    assert not lead.ahead(ids[2]) and lead.ahead(ids[3])
    for p, cid in zip(pieces[:3], ids[:3], strict=True):
        store.put_chunk(cid, p)
    assert not lead.ahead(ids[5]) and lead.ahead(ids[6])
    assert lead.low == 3
    assert home_lead(HerdConfig(home_lead_chunks=-1), 8) == 24 and home_lead(HerdConfig(home_lead_chunks=-1), 1) == 0
    assert home_lead(HerdConfig(home_lead_chunks=0), 8) == 0


async def test_a_home_ahead_of_the_herd_waits_then_goes_on(tmp_path: Path) -> None:
    """Two nodes, one fetching (the other serves but fetches nothing): the fetching node's
    own chunks past its lead wait for the other's chunks before them (bounded), and the
    fetch completes byte-exact with one origin read a chunk."""
    art = make_artifact(tmp_path, 24 * CHUNK, chunk_size=CHUNK, seed=45)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, wait_ms=200, home_lead_chunks=2, home_lead_max_pause_s=0.05)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a, b = await start_nodes(nursery, tmp_path, 2, TOKEN, config=cfg)
            await herd_fetch(a.herd, art.manifest_id, origin, [a.peer, b.peer])
            assert_bit_exact(a, art)
            assert a.herd.counters.origin_paced >= 1
            assert a.herd.counters.origin_paced_s > 0
            assert sum(origin.chunk_reads.values()) == len(set(art.chunks))
            assert not a.herd._leads          # the run's step is gone with it
            for n in (a, b):
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
