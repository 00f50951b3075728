"""The herd path verifies origin bytes (issue 13 §3): one bad answer in transit is
refused and asked again; bytes corrupt at rest end in an OriginError naming the chunk
after N tries, and nothing is marked complete."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from p2p.errors import OriginError
from p2p.herd import herd_fetch
from tests.herd_cluster import FAST, assert_bit_exact, make_artifact, open_file_origin, start_nodes

TOKEN = "verify-token"


async def test_one_bad_origin_answer_is_refused_and_refetched(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 1024 * 1024, chunk_size=64 * 1024, seed=31)
    origin = open_file_origin(art)
    bad = sorted(art.chunks)[3]
    origin.corrupt_once.add(bad)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN)
            peers = [n.peer for n in nodes]
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            for n in nodes:
                assert_bit_exact(n, art)
            stats = [n.herd.statistics() for n in nodes]
            for n in nodes:
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
    assert origin.chunk_reads[bad] == 2                      # the bad answer and the good one
    assert sum(s["origin_bad_answers"] for s in stats) == 1
    assert sum(s["bytes_from_origin"] for s in stats) == art.size


async def test_corrupt_at_rest_is_an_origin_error_naming_the_chunk(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 512 * 1024, chunk_size=64 * 1024, seed=32)
    origin = open_file_origin(art)
    bad = sorted(art.chunks)[1]
    origin.corrupt.add(bad)
    cfg = dataclasses.replace(FAST, origin_verify_tries=3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (node,) = await start_nodes(nursery, tmp_path, 1, TOKEN, config=cfg)
            with pytest.raises(OriginError) as ei:
                await herd_fetch(node.herd, art.manifest_id, origin, [node.peer])
            assert bad in str(ei.value)
            assert not node.store.is_complete(art.manifest_id)
            assert not node.store.has_chunk(bad)
            assert node.herd.counters.origin_bad_answers == 3
            await node.herd.aclose()
            nursery.cancel_scope.cancel()
    assert origin.chunk_reads[bad] == 3
