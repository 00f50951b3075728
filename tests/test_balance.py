"""p2p.balance: the planning order that balances the rack homes' bytes."""

from __future__ import annotations

import numpy as np

from p2p.balance import balanced_order


def _loads(sizes: np.ndarray, order: np.ndarray, w: int) -> np.ndarray:
    return np.bincount(np.arange(len(order)) % w, weights=sizes[order], minlength=w)


def test_a_round_robin_over_the_order_deals_even_bytes() -> None:
    rng = np.random.default_rng(7)
    for n, w in ((259, 8), (259, 16), (1000, 18), (37, 32), (5, 8), (64, 1)):
        sizes = rng.integers(256 << 10, 4 << 20, n)
        order = balanced_order(sizes, w)
        assert sorted(order.tolist()) == list(range(n))                  # a permutation
        assert np.abs(order - np.arange(n)).max() < max(w, 1)            # moved within its block
        full = n - n % w                  # a last partial block's positions are fixed
        if w > 1 and full >= 2 * w:
            load = _loads(sizes, order[:full], w)
            assert load.max() - load.min() <= sizes.max()                # within one chunk
            # by count (the manifest's order) the spread is several chunks here
            naive = _loads(sizes, np.arange(full), w)
            assert load.max() - load.min() < (naive.max() - naive.min()) / 2


def test_the_order_is_the_same_everywhere() -> None:
    sizes = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    assert balanced_order(sizes, 4).tolist() == balanced_order(list(sizes), 4).tolist()
    assert balanced_order(sizes, 1).tolist() == list(range(len(sizes)))
    assert balanced_order([], 8).tolist() == []


async def test_a_herd_reads_the_origin_in_even_bytes_per_home(tmp_path) -> None:
    """Eight nodes in one rack, chunks of uneven sizes: each node reads its homes' chunks
    from the origin, and those come to within one chunk of the same bytes (by count they
    differ by several), byte-exact everywhere, one origin copy."""
    import dataclasses

    import trio

    from p2p.herd import herd_fetch
    from tests.herd_cluster import FAST, assert_bit_exact, make_artifact, open_file_origin, start_nodes

    rng = np.random.default_rng(11)
    sizes = rng.integers(8 << 10, 256 << 10, 96)
    art = make_artifact(tmp_path, int(sizes.sum()), seed=-1, chunk_sizes=[int(x) for x in sizes])
    chunks = art.chunks
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, workers=4)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 8, "balance-token", config=cfg)
            peers = [n.peer for n in nodes]
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            got = [n.herd.counters.bytes_from_origin for n in nodes]
            for n in nodes:
                assert_bit_exact(n, art)
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
    assert sum(origin.chunk_reads.values()) == len(chunks)
    assert sum(got) == art.size
    assert max(got) - min(got) <= int(sizes.max())
