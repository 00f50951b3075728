"""The herd's source choice: pure functions, no network."""

from __future__ import annotations

import math
from collections import Counter

import blake3
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.rendezvous import (
    ORIGIN,
    chunk_key,
    home,
    is_home,
    node_key,
    order,
    plan_sources,
    rack_homes,
    score,
    scores_np,
)
from scheduler_link.messages import Peer


def _peers(n: int, racks: int = 0) -> list[Peer]:
    return [Peer(node_id=f"n{i:03d}", data_url=f"http://10.0.0.{i}:1",
                 rack=f"r{i % racks}" if racks else "") for i in range(n)]


def _cid(i: int) -> str:
    """A realistic (uniform) chunk id: BLAKE3 of something."""
    return blake3.blake3(str(i).encode()).hexdigest()


def test_everyone_agrees_on_the_order_and_the_home() -> None:
    ids = [f"n{i}" for i in range(20)]
    cid = "ab" * 32
    assert order(cid, ids) == order(cid, list(reversed(ids)))
    assert home(cid, ids) == order(cid, ids)[0]
    assert len(order(cid, ids + ids)) == 20


def test_numpy_scores_equal_scalar_scores() -> None:
    ids = [f"node-{i}" for i in range(50)]
    keys = np.array([node_key(n) for n in ids], dtype=np.uint64)
    ck = chunk_key("0123456789abcdef" * 4)
    assert [int(x) for x in scores_np(ck, keys)] == [score(ck, node_key(n)) for n in ids]


def test_homes_spread_evenly() -> None:
    ids = [f"n{i}" for i in range(10)]
    counts = Counter(home(_cid(i), ids) for i in range(5000))
    assert set(counts) == set(ids)
    assert max(counts.values()) < 1.25 * 500 and min(counts.values()) > 0.75 * 500


def test_home_goes_to_origin_others_ask_above_with_wait() -> None:
    peers = _peers(6)
    cid = "cd" * 32
    ranked = order(cid, [p.node_id for p in peers])
    assert plan_sources(cid, ranked[0], peers) == [ORIGIN]
    assert is_home(cid, ranked[0], peers)
    plan = plan_sources(cid, ranked[3], peers)
    assert [s.node_id for s in plan[:-1]] == ranked[:3]
    assert all(s.wait for s in plan[:-1]) and plan[-1] == ORIGIN


def test_no_cycles_every_waited_on_source_ranks_above() -> None:
    peers = _peers(12, racks=3)
    ids = [p.node_id for p in peers]
    for i in range(200):
        cid = _cid(i)
        rank = {n: k for k, n in enumerate(order(cid, ids))}
        for me in ids:
            for s in plan_sources(cid, me, peers):
                if s.kind == "peer" and s.wait:
                    assert rank[s.node_id] < rank[me]


def test_rack_aware_one_crossing_per_rack() -> None:
    peers = _peers(12, racks=3)
    by_id = {p.node_id: p for p in peers}
    for i in range(100):
        cid = _cid(i)
        g = home(cid, [p.node_id for p in peers])
        homes = rack_homes(cid, peers)
        assert g in homes.values()
        crossings = 0
        for me in by_id:
            first = plan_sources(cid, me, peers)[0]
            if first.kind == "origin":
                assert me == g
                continue
            if by_id[first.node_id].rack != by_id[me].rack:
                crossings += 1
                assert me in homes.values()         # only rack homes reach outside
                assert first.node_id == g           # ... and they ask the global home
        assert crossings == len(homes) - 1


def test_penalties_ban_and_cool() -> None:
    peers = _peers(5)
    cid = "ef" * 32
    ranked = order(cid, [p.node_id for p in peers])
    me = ranked[-1]
    plan = plan_sources(cid, me, peers, penalties={ranked[0]: math.inf, ranked[1]: 50.0}, now=10.0)
    names = [s.node_id for s in plan if s.kind == "peer"]
    assert ranked[0] not in names                     # banned
    assert names[-1] == ranked[1]                     # cooling: behind the healthy ones
    plan_later = plan_sources(cid, me, peers, penalties={ranked[1]: 50.0}, now=60.0)
    assert [s.node_id for s in plan_later[:2]] == ranked[:2]   # cooled down


def test_holders_first_without_wait_even_from_below() -> None:
    peers = _peers(5)
    cid = "12" * 32
    ranked = order(cid, [p.node_id for p in peers])
    plan = plan_sources(cid, ranked[0], peers, holders={ranked[4]})
    assert plan[0].node_id == ranked[4] and not plan[0].wait and plan[-1] == ORIGIN


def test_self_missing_from_peer_list_and_empty_list() -> None:
    assert plan_sources("aa" * 32, "lonely", []) == [ORIGIN]
    peers = _peers(3)
    plan = plan_sources("aa" * 32, "outsider", peers)
    assert plan[-1] == ORIGIN and len(plan) >= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(0, 5), st.binary(min_size=32, max_size=32))
def test_plan_is_well_formed(n: int, racks: int, raw: bytes) -> None:
    peers = _peers(n, racks)
    cid = raw.hex()
    homes = 0
    for p in peers:
        plan = plan_sources(cid, p.node_id, peers)
        assert plan[-1] == ORIGIN and plan.count(ORIGIN) == 1
        assert p.node_id not in [s.node_id for s in plan]
        assert len({s.node_id for s in plan}) == len(plan)
        homes += plan == [ORIGIN]
    assert homes == 1


def test_assign_homes_balances_bytes_and_agrees() -> None:
    from p2p.rendezvous import assign_homes

    peers = _peers(8)
    ids = [p.node_id for p in peers]
    chunks = [(_cid(i), 1 << 20) for i in range(64)]
    a = assign_homes(chunks, ids)
    assert a == assign_homes(chunks, list(reversed(ids)))          # same map on every node
    loads = Counter(a.values())
    assert set(loads) == set(ids) and max(loads.values()) <= 64 // 8 + 2
    plain = Counter(home(c, ids) for c, _ in chunks)
    assert max(loads.values()) <= max(plain.values())
    # the assigned home goes first in everyone's plan
    cid = chunks[0][0]
    h = a[cid]
    assert plan_sources(cid, h, peers, home=h) == [ORIGIN]
    other = next(n for n in ids if n != h)
    assert plan_sources(cid, other, peers, home=h)[0].node_id == h


def test_balanced_rack_homes_keep_the_wait_graph_acyclic() -> None:
    from p2p.rendezvous import assign_homes, assign_rack_homes, rack_label

    peers = _peers(24, racks=4)
    ids = [p.node_id for p in peers]
    chunks = [(_cid(i), 1000 + i) for i in range(60)]
    g = assign_homes(chunks, ids)
    by_rack: dict[str, list[str]] = {}
    for p in peers:
        by_rack.setdefault(rack_label(p), []).append(p.node_id)
    rh = {r: assign_rack_homes(chunks, m, g) for r, m in by_rack.items()}
    rack_of = {p.node_id: rack_label(p) for p in peers}
    for r, m in by_rack.items():      # loads inside a rack are balanced too
        loads = Counter(rh[r].values())
        assert max(loads.values()) <= 60 // len(m) + 3
    for cid, _ in chunks:
        edges = {}
        for me in ids:
            plan = plan_sources(cid, me, peers, home=g[cid], rack_home=rh[rack_of[me]][cid])
            edges[me] = [s.node_id for s in plan if s.kind == "peer" and s.wait]
            if me == g[cid]:
                assert plan == [ORIGIN]
            elif me == rh[rack_of[me]][cid]:
                assert edges[me][0] == g[cid]                       # rack home <- global home
            else:
                assert edges[me][0] == rh[rack_of[me]][cid]         # mates <- their rack home
        assert _acyclic(edges)


def _acyclic(edges: dict[str, list[str]]) -> bool:
    state: dict[str, int] = {}

    def visit(n: str) -> None:
        assert state.get(n) != 1, f"wait cycle through {n}"
        if state.get(n) == 2:
            return
        state[n] = 1
        for m in edges[n]:
            visit(m)
        state[n] = 2

    for n in edges:
        visit(n)
    return True
