"""One fetch path (issue 20 §2): the origin-only fetch is the herd with no peers, and
every path into one store shares one single flight — an origin-only fetch and a herd
fetch of the same artifact at once read each chunk and the manifest from the origin
once. Real stores, a real file origin."""

from __future__ import annotations

from pathlib import Path

import trio

from p2p.fetch import FetchStats, fetch_artifact
from p2p.herd import Herd
from p2p.store import ChunkStore
from tests.herd_cluster import FAST, make_artifact, open_file_origin


async def test_origin_only_and_herd_fetches_share_one_download(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=64 * 1024, seed=31)
    origin = open_file_origin(art)
    store = ChunkStore(tmp_path / "store")
    herd = Herd(store, node_id="n0", token=None, config=FAST)
    got: list[FetchStats] = []

    async def one(**kw: object) -> None:
        got.append(await fetch_artifact(store, art.manifest_id, origin, **kw))   # type: ignore[arg-type]

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)                        # origin only: no peers, no herd
            nursery.start_soon(lambda: one(herd=herd))     # the agent's way: a long-lived herd
            nursery.start_soon(one)
        await herd.aclose()
    assert origin.manifest_reads == 1
    assert sorted(origin.chunk_reads.values()) == [1] * len(art.chunks)
    assert sum(s.chunks_fetched for s in got) == len(art.chunks)
    for s in got:
        assert s.bytes == art.size and s.bytes_from_peers == 0
        assert s.bytes_from_origin + s.bytes_local == s.bytes
    assert store.complete_manifests() == [art.manifest_id]
    for cid, piece in art.chunks.items():
        assert store.read_chunk(cid) == piece
