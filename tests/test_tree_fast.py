"""p2p.tree's fast paths give exactly what the plain computations give: the view from a
PeerTable equals PeerView.build over its rows (self appended, duplicates, unused and
unsorted racks), node keys of ASCII ids equal the byte-by-byte fold, the partial rack
order equals a stable argsort (ties forced), and a plan made in cache-sized sub-blocks
equals one made whole. Bad tables are refused with a clear error."""

from __future__ import annotations

import random

import blake3
import numpy as np
import pytest

from p2p import tree
from p2p.herd import peer_view
from p2p.tree import PeerView, Planner, chunk_keys, id_keys, plan_node
from scheduler_link.messages import PeerTable

_U = np.uint64


def _ref_keys(ids: list[str]) -> np.ndarray:
    """The node key, spelled out: splitmix64 folded over the UTF-8 bytes, 8 at a time
    (little-endian, zero-padded to the longest id's multiple of 8), after the length."""
    out = []
    width = max((len(s.encode()) for s in ids), default=0)
    width = -(-max(width, 1) // 8) * 8
    for s in ids:
        b = s.encode().ljust(width, b"\0")
        h = tree._mix(np.array([len(s.encode())], np.uint64) ^ _U(0x6E6F64652D6B6579))
        for j in range(0, width, 8):
            h = tree._mix(h ^ np.frombuffer(b[j:j + 8], "<u8"))
        out.append(h[0])
    return np.array(out, np.uint64)


def test_node_keys_equal_the_plain_fold() -> None:
    rng = random.Random(5)
    cases = [["node-00001", "node-00002"], ["a"], [""], ["", "x"], ["a\0b", "abc"], ["\0\0", "\0a"],
             ["ü", "x"], ["gpu-€"], ["n" * 17, "n" * 16, "n"]]
    for t in range(400):
        alph = "ab\0-.9Z" if t % 3 else "ab\0-ü€"
        if t % 2:
            L = rng.randint(0, 20)
            cases.append(["".join(rng.choice(alph) for _ in range(L)) for _ in range(rng.randint(1, 30))])
        else:
            cases.append(["".join(rng.choice(alph) for _ in range(rng.randint(0, 20)))
                          for _ in range(rng.randint(1, 30))])
    for ids in cases:
        assert (id_keys(ids) == _ref_keys(ids)).all(), ids
    assert len(id_keys([])) == 0


def test_top_order_equals_a_stable_argsort_even_with_ties() -> None:
    rng = np.random.default_rng(2)
    for t in range(300):
        R = int(rng.integers(1, 300))
        top = int(rng.integers(1, R + 1))
        x = rng.integers(0, 2**64, (int(rng.integers(1, 12)), R), dtype=np.uint64)
        if t % 2:
            x[:, rng.integers(0, R, max(R // 2, 1))] = x[:, :1]                  # equal scores
        if t % 3 == 0:                                                            # equal high bits
            x = (x & ~_U(0xFFFF)) | rng.integers(0, 4, x.shape, dtype=np.uint64)
        assert (tree._top_order(x, top) == np.argsort(x, axis=1, kind="stable")[:, :top]).all()


def _same_view(a: PeerView, b: PeerView) -> None:
    assert a.node_ids == b.node_ids and a.urls == b.urls and a.racks == b.racks
    for f in ("rack_of", "nkeys", "rkeys", "grid", "sizes", "offsets"):
        assert (getattr(a, f) == getattr(b, f)).all(), f
    assert dict(a.index) == dict(b.index) and len(a.index) == len(b.index)


def test_the_view_of_a_table_equals_build_over_its_rows() -> None:
    rng = random.Random(3)
    for t in range(300):
        R = rng.randint(1, 30)
        labels = [f"z{rng.randint(0, 3)}/b/r{rng.randint(0, 60 if t % 5 else 5)}" for _ in range(R)]
        n = rng.randint(0, 150)
        ids = [f"n{rng.randint(0, 200 if t % 4 == 0 else 10**9)}" for _ in range(n)]
        rack_of = [rng.randrange(R) for _ in range(n)]
        urls = [f"http://{i}:1" for i in ids]
        table = PeerTable(node_ids=ids, data_urls=urls, rack_of=rack_of, racks=labels)
        me = rng.choice(ids) if ids and t % 2 else "self-node"
        view, row = peer_view(table, me)
        i2, u2, l2 = list(ids), list(urls), [labels[r] for r in rack_of]
        if me not in i2:
            i2, u2, l2 = i2 + [me], u2 + [""], l2 + ["//"]
        ref = PeerView.build(i2, u2, l2)
        _same_view(view, ref)
        assert view.node_ids[row] == me and row == ref.index[me] and view.row_of(me) == row


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="rack_of must index"):
        PeerView.from_table(PeerTable(node_ids=["a"], data_urls=["u"], rack_of=[3], racks=["z/b/r"]))
    with pytest.raises(ValueError, match="differ in length"):
        PeerView.from_table(PeerTable(node_ids=["a", "b"], data_urls=["u"], rack_of=[0, 0], racks=["z/b/r"]))
    view = PeerView.from_table(PeerTable(node_ids=["a"], data_urls=["u"], rack_of=[0], racks=["z/b/r"]))
    with pytest.raises(KeyError):
        view.row_of("nobody")


def test_a_plan_in_cache_sized_sub_blocks_equals_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    n, rs = 3000, 7
    ids = [f"host-{i * 7919 % 100003}" for i in range(n)]
    view = PeerView.build(ids, ids, [f"z/b/r{i // rs:04d}" for i in range(n)])
    ck = chunk_keys([blake3.blake3(str(i).encode()).hexdigest() for i in range(700)])
    monkeypatch.setattr(Planner, "CACHE_CELLS", 1 << 40)      # one block
    whole = {me: plan_node(view, me, ck, k=3, rack_fanout=3, block=700) for me in (0, 1234, n - 1)}
    monkeypatch.setattr(Planner, "CACHE_CELLS", 1)            # sub-blocks of 8 chunks
    for me, ref in whole.items():
        pl = Planner(view, me, ck, k=3, rack_fanout=3)
        for size in (1, 5, 64, 1000):
            pl.step(size)
        got = pl.run(333)
        for f in ("home", "parent", "chain", "siblings", "origin_rank"):
            assert (getattr(got, f) == getattr(ref, f)).all(), f


def test_repeated_ids_are_found_even_when_distinct_ids_share_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # the table's ids are checked for repeats by their 64-bit keys first; equal keys
    # (forced here) fall back to comparing the ids themselves
    def same_key(ids: list[str]) -> np.ndarray:
        return np.zeros(len(ids), np.uint64)

    monkeypatch.setattr(tree, "id_keys", same_key)
    distinct = PeerView.from_table(PeerTable(node_ids=["a", "b", "c"], data_urls=["1", "2", "3"],
                                             rack_of=[0, 0, 0], racks=["z/b/r"]))
    assert distinct.node_ids == ["a", "b", "c"] and distinct.urls == ["1", "2", "3"]
    repeated = PeerView.from_table(PeerTable(node_ids=["a", "b", "a"], data_urls=["1", "2", "3"],
                                             rack_of=[0, 0, 0], racks=["z/b/r"]))
    assert repeated.node_ids == ["a", "b"] and repeated.urls == ["1", "2"]
