"""The herd end to end in one process: real stores, real data planes on loopback, a real
file:// origin; every node checked byte for byte."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import trio

from p2p.herd import herd_fetch
from tests.herd_cluster import (
    FAST,
    assert_bit_exact,
    make_artifact,
    open_file_origin,
    start_nodes,
)

TOKEN = "t0k3n-cluster"


async def _fetch_all(nodes, art, origin, peers=None):
    peers = [n.peer for n in nodes] if peers is None else peers
    results = {}

    async def one(n):
        results[n.node_id] = await herd_fetch(n.herd, art.manifest_id, origin, peers)

    async with trio.open_nursery() as nursery:
        for n in nodes:
            nursery.start_soon(one, n)
    return results


async def test_cold_herd_pulls_each_chunk_from_origin_once(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 6 * 1024 * 1024 + 1234, chunk_size=256 * 1024)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 5, TOKEN)
            results = await _fetch_all(nodes, art, origin)
            for n in nodes:
                assert_bit_exact(n, art)
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
    # about one copy of egress: every chunk read from the origin exactly once
    assert set(origin.chunk_reads) == set(art.chunks)
    assert max(origin.chunk_reads.values()) == 1
    total_origin = sum(r.bytes_from_origin for _, r in results.values())
    total_peers = sum(r.bytes_from_peers for _, r in results.values())
    assert total_origin == art.size
    assert total_peers == 4 * art.size
    served = sum(n.plane.statistics()["bytes_served"] for n in nodes)
    dups = sum(n.herd.counters.endgame_duplicates for n in nodes)
    # the data planes served what the peers got, plus at most the endgame's duplicates
    assert total_peers <= served <= total_peers + dups * 256 * 1024


async def test_rack_aware_each_chunk_enters_each_rack_once(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 3 * 1024 * 1024, chunk_size=128 * 1024, seed=2)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            # endgame off: its duplicate requests may cross racks (a few chunks, by design)
            nodes = await start_nodes(nursery, tmp_path, 6, TOKEN, racks=2,
                                      config=dataclasses.replace(FAST, endgame=0))
            await _fetch_all(nodes, art, origin)
            rack_of = {n.node_id: n.rack for n in nodes}
            cross = 0
            for n in nodes:
                assert_bit_exact(n, art)
                for peer_id, st in n.herd.health.stats.items():
                    if rack_of[peer_id] != n.rack:
                        cross += st.bytes
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
    assert max(origin.chunk_reads.values()) == 1
    errs = {n.node_id: n.herd.statistics() for n in nodes}
    # two racks: each chunk crosses into the rack that does not hold its global home once
    assert cross == art.size, repr(errs)


async def test_warm_node_serves_and_second_fetch_is_local(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=256 * 1024, seed=3)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN)
            # node0 alone first (no peers): everything from the origin
            _, r0 = await herd_fetch(nodes[0].herd, art.manifest_id, origin, [])
            assert r0.bytes_from_origin == art.size
            reads_before = sum(origin.chunk_reads.values())
            # the others, with node0 (a holder) in the list: nothing more from the origin
            res = await _fetch_all(nodes[1:], art, origin, peers=[n.peer for n in nodes])
            assert sum(origin.chunk_reads.values()) == reads_before
            assert all(r.bytes_from_origin == 0 for _, r in res.values())
            _, again = await herd_fetch(nodes[1].herd, art.manifest_id, origin, [n.peer for n in nodes])
            assert again.bytes_local == art.size and again.bytes_from_peers == 0
            for n in nodes:
                assert_bit_exact(n, art)
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_single_flight_one_download_for_many_callers(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 512 * 1024, chunk_size=512 * 1024, seed=4)
    origin = open_file_origin(art)
    (cid, piece), = art.chunks.items()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            (node,) = await start_nodes(nursery, tmp_path, 1, TOKEN)
            async with trio.open_nursery() as inner:
                for _ in range(10):
                    inner.start_soon(node.herd.get_chunk, cid, len(piece), origin, [])
            assert origin.chunk_reads[cid] == 1
            assert node.store.read_chunk(cid) == piece
            await node.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_statistics_and_metrics_text(tmp_path: Path) -> None:
    from p2p.herd import render_metrics
    from tests.prom import value

    art = make_artifact(tmp_path, 1024 * 1024, chunk_size=256 * 1024, seed=5)
    origin = open_file_origin(art)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 2, TOKEN)
            await _fetch_all(nodes, art, origin)
            st = nodes[1].herd.statistics()
            assert st["bytes_from_origin"] + st["bytes_from_peers"] == art.size
            text = render_metrics("node1", st, nodes[1].plane.statistics())
            peer_bytes = st["peers"]["node0"]["bytes"]
            assert value(text, "herd_p2p_peer_bytes_total", node="node1", peer="node0") == peer_bytes
            assert value(text, "herd_p2p_bytes_total", node="node1", source="peers") == st["bytes_from_peers"]
            assert "# TYPE herd_dataplane_bytes_served_total counter" in text
            for n in nodes:
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
