"""p2p.tree, pure: the same trees from a PeerTable and from a Peer list in any order;
the waits-on relation is acyclic; successors take over a dead home; the plan's sources."""

from __future__ import annotations

import math

import blake3
import numpy as np

from p2p.rendezvous import ORIGIN
from p2p.tree import PeerView, Planner, all_parents, chunk_keys, plan_node
from scheduler_link.messages import Peer, PeerTable


def _peers(n: int, rack: int) -> list[Peer]:
    return [Peer(node_id=f"n{i:03d}", data_url=f"http://10.0.{i // 250}.{i % 250}:1", zone="z", block="b",
                 rack=f"r{i // rack:03d}") for i in range(n)]


def _table(peers: list[Peer]) -> PeerTable:
    racks = sorted({f"{p.zone}/{p.block}/{p.rack}" for p in peers})
    rpos = {r: i for i, r in enumerate(racks)}
    rows = sorted(peers, key=lambda p: (f"{p.zone}/{p.block}/{p.rack}", p.node_id))
    rack_of = [rpos[f"{p.zone}/{p.block}/{p.rack}"] for p in rows]
    starts = [rack_of.index(r) for r in range(len(racks))]
    return PeerTable(node_ids=[p.node_id for p in rows], data_urls=[p.data_url for p in rows], rack_of=rack_of,
                     racks=racks, rack_start=starts)


CIDS = [blake3.blake3(str(i).encode()).hexdigest() for i in range(50)]


def test_peer_table_and_peer_list_give_the_same_plan() -> None:
    peers = _peers(70, 6)
    a = PeerView.from_table(_table(peers))
    b = PeerView.from_peers(list(reversed(peers)))
    ck = chunk_keys(CIDS)
    for nid in ("n000", "n033", "n069"):
        pa = plan_node(a, a.index[nid], ck, k=3, rack_fanout=2)
        pb = plan_node(b, b.index[nid], ck, k=3, rack_fanout=2)
        for c in range(len(CIDS)):
            assert [s.node_id for s in pa.sources(c)] == [s.node_id for s in pb.sources(c)]


def test_waits_are_acyclic_and_each_chunk_has_one_origin_reader() -> None:
    peers = _peers(60, 5)
    v = PeerView.from_peers(peers)
    ck = chunk_keys(CIDS)
    plans = [plan_node(v, i, ck, k=2, rack_fanout=2) for i in range(len(peers))]
    for c in range(len(CIDS)):
        waits = {i: [v.index[s.node_id] for s in p.sources(c) if s.kind == "peer" and s.wait]
                 for i, p in enumerate(plans)}
        readers = [i for i, p in enumerate(plans) if p.sources(c) == [ORIGIN]]
        assert len(readers) == 1 and readers[0] == int(plans[0].home[c])
        _assert_acyclic(waits)


def _assert_acyclic(waits: dict[int, list[int]]) -> None:
    """Kahn's algorithm: every node is removed once nothing it waits on is left."""
    left = {x: len(set(ys)) for x, ys in waits.items()}
    waited_by: dict[int, list[int]] = {}
    for x, ys in waits.items():
        for y in set(ys):
            waited_by.setdefault(y, []).append(x)
    ready = [x for x, n in left.items() if n == 0]
    seen = 0
    while ready:
        y = ready.pop()
        seen += 1
        for x in waited_by.get(y, []):
            left[x] -= 1
            if left[x] == 0:
                ready.append(x)
    assert seen == len(waits), "a cycle in waits-on"


def test_dead_home_successor_reads_origin_others_re_root() -> None:
    peers = _peers(40, 4)
    v = PeerView.from_peers(peers)
    ck = chunk_keys(CIDS[:5])
    par, home, root = all_parents(v, ck, k=2, rack_fanout=2)
    g, s1 = v.node_ids[int(home[0])], v.node_ids[int(root[0, 1])]
    dead = {g: math.inf}
    p1 = plan_node(v, v.index[s1], ck, k=2, rack_fanout=2)
    assert p1.sources(0, dead, 0.0) == [ORIGIN]
    assert p1.sources(0)[0].node_id == g                       # alive: the successor waits on the home
    other = next(i for i in range(len(peers)) if i not in (int(home[0]), int(root[0, 1]), int(root[0, 2]))
                 and par[0, i] == home[0])
    po = plan_node(v, other, ck, k=2, rack_fanout=2)
    srcs = po.sources(0, dead, 0.0)
    assert srcs[0].node_id == s1 and ORIGIN not in srcs         # re-rooted on the successor, not the origin
    # balance: in a rack every member is rack home for the same number of chunks (+-1 per duty)
    many = [blake3.blake3(f"m{i}".encode()).hexdigest() for i in range(400)]
    par, home, _ = all_parents(v, chunk_keys(many), k=2, rack_fanout=2)
    rack = v.rack_of
    is_rack_home = (par < 0) | (rack[np.maximum(par, 0)] != rack[None, :])
    counts = is_rack_home.sum(axis=0)
    for r in range(len(v.racks)):
        c = counts[rack == r]
        assert c.max() - c.min() <= 2, c


def test_planner_in_blocks_of_any_size_equals_the_whole_plan() -> None:
    peers = _peers(150, 7)
    v = PeerView.from_peers(peers)
    many = chunk_keys([blake3.blake3(f"b{i}".encode()).hexdigest() for i in range(300)])
    par, home, _ = all_parents(v, many, k=3, rack_fanout=2)
    for me in (0, 77, 149):
        whole = plan_node(v, me, many, k=3, rack_fanout=2, block=4096)
        pl = Planner(v, me, many, k=3, rack_fanout=2)
        sizes = iter([1, 2, 5, 31, 64, 7, 1000])
        while pl.done < len(pl):
            before = pl.done
            assert pl.step(next(sizes)) > before
            # rows planned so far are final: the parents agree with the simulator's trees
            assert (pl.plan.parent[:pl.done] == par[:pl.done, me]).all()
        for f in ("home", "parent", "chain", "siblings", "origin_rank"):
            assert np.array_equal(getattr(pl.plan, f), getattr(whole, f)), f
        assert np.array_equal(whole.home, home)
        # each chain: no repeats, never this node, and it starts with the parent
        for c in range(len(many)):
            ch = [int(x) for x in whole.chain[c] if x >= 0]
            assert len(set(ch)) == len(ch) and me not in ch
            assert (ch[0] if ch else -1) == int(whole.parent[c])
