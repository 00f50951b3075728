"""bench.herd_sim: small rows of the simulator, its byte accounting, the baseline beside
it, and the tree it simulates equal to what the fetchers plan (p2p.tree.plan_node)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from bench.herd_sim import Params, run_row, tree_of
from p2p.herd import HerdConfig
from p2p.tree import PeerView, all_parents, all_parents_standins, chunk_keys, plan_node
from scheduler_link.messages import Peer

ROOT = Path(__file__).resolve().parent.parent


def _params(n: int, rack: int, chunks: int = 64) -> Params:
    return Params(nodes=n, rack_size=rack, chunks=chunks, chunk_bytes=1 << 20, manifest_bytes=75 * chunks,
                  link=12.5e9, origin=12.5e9, oversub=2, k=2, rack_fanout=4, serve_cap=6, retry_s=0.05,
                  recv_cpu=6.0, send_cpu=0.9, cores=1.0)


def test_tree_rows_count_bytes_and_beat_todays_fan_in() -> None:
    r = run_row(_params(600, 4), "none")
    t, b = r["tree"], r["today"]
    assert r["racks"] == 150
    assert t["nodes_incomplete"] == 0 and b["nodes_incomplete"] == 0
    # counted, not set: one origin copy per chunk, the manifest once
    # (egress counts the manifest's bytes too: 75 B a chunk)
    assert t["origin_egress_over_size"] == pytest.approx(1.0, abs=2e-4) and t["manifest_origin_copies"] == 1.0
    # each rack takes each chunk across the spine about once (the home's rack: never)
    assert 0.98 <= t["cross_rack_in_per_rack_over_size"] <= 1.0
    # today: 149 rack homes ask the global home; within its 256 waits, but every cold
    # node reads the manifest from the origin and probes 256 peers
    assert b["manifest_origin_copies"] == 600
    assert b["have_probes"] == 600 * 256 and t["have_probes"] == 600 * 3
    # nothing beats size / rate (the figure itself is the bench's, not a test's)
    assert t["completion_over_ideal"] >= 1.0 and t["manifest_last_s"] > 0


def test_todays_503s_go_to_the_origin_past_256_waiters() -> None:
    r = run_row(_params(1200, 4, chunks=16), "none")
    b = r["today"]
    # 300 racks: 299 rack homes wait on the home, 43 are told 503 and read the origin
    assert b["busy_503"] == 16 * 43
    manifests = 1200 * 75 * 16 / (16 << 20)           # every cold node read the manifest from the origin
    assert b["origin_egress_over_size"] == pytest.approx(44.0 + manifests, abs=1e-3)
    assert r["tree"]["origin_egress_over_size"] == pytest.approx(1.0, abs=1e-3)


def test_failures_are_simulated_not_assumed() -> None:
    dead = run_row(_params(200, 8), "dead")
    home = run_row(_params(200, 8), "home")
    assert dead["tree"]["nodes_incomplete"] == 0 and home["tree"]["nodes_incomplete"] == 0
    assert dead["tree"]["origin_egress_over_size"] <= 1.1
    # a global home dying mid-way: its successors re-read what it had not passed on
    assert 1.0 <= home["tree"]["origin_egress_over_size"] <= 1.1


def test_simulated_tree_equals_every_fetchers_plan() -> None:
    ids = [f"n{i:03d}" for i in range(90)]
    peers = [Peer(node_id=i, data_url=f"http://{i}", rack=f"r{j % 7}") for j, i in enumerate(ids)]
    cids = [blake3.blake3(str(i).encode()).hexdigest() for i in range(40)]
    parent, home, view = tree_of(ids, peers, cids, k=2, rack_fanout=3)
    # the fetcher builds its view from the same peers in another order
    view2 = PeerView.from_peers(list(reversed(peers)))
    for nid in ids:
        plan = plan_node(view2, view2.index[nid], chunk_keys(cids), k=2, rack_fanout=3)
        me = view.index[nid]
        got = [view2.node_ids[x] if x >= 0 else None for x in plan.parent]
        want = [view.node_ids[x] if x >= 0 else None for x in parent[:, me]]
        assert got == want
        assert [view2.node_ids[x] for x in plan.home] == [view.node_ids[x] for x in home]
    # bounded fan-in: nobody is asked by more than k child racks + rack_fanout mates
    for c in range(len(cids)):
        assert np.bincount(parent[c][parent[c] >= 0], minlength=len(ids)).max() <= 2 + 3


def test_cli_json_and_refusals() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.herd_sim", "--nodes", "8,40", "--rack-size", "4",
                          "--size-mb", "16", "--cases", "none,dead", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [(x["nodes"], x["case"]) for x in rows] == [(8, "none"), (8, "dead"), (40, "none"), (40, "dead")]
    # the simulator's tree is the fetcher's by default
    cfg = HerdConfig()
    assert (json.loads(out.stdout)["k"], json.loads(out.stdout)["rack_fanout"]) == (cfg.tree_k, cfg.rack_fanout)
    bad = subprocess.run([sys.executable, "-m", "bench.herd_sim", "--nodes", "0"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--nodes" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "bench.herd_sim", "--nodes", "8", "--designs", "tree@0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "tree@M" in bad.stderr


def test_fan_out_variants_run_side_by_side() -> None:
    r = run_row(_params(64, 16, chunks=32), "none", designs=("tree", "tree@15", "tree@2", "tree@2:3"))
    # tree = the params' own fan-out (4); each variant's serving cap follows it (k + 2M) or is given
    assert (r["tree"]["rack_fanout"], r["tree@15"]["rack_fanout"], r["tree@2"]["rack_fanout"]) == (4, 15, 2)
    assert r["tree@15"]["serve_cap"] == 32 and r["tree@2"]["serve_cap"] == 6 and r["tree@2:3"]["serve_cap"] == 3
    for d in ("tree", "tree@15", "tree@2"):
        assert r[d]["nodes_incomplete"] == 0
        assert r[d]["origin_egress_over_size"] == pytest.approx(1.0, abs=1e-3)
    # a flat rack of 16 (15 rack-mates under the rack home) is not the in-rack tree
    assert r["tree@15"]["completion_over_ideal"] != r["tree@2"]["completion_over_ideal"]
    with pytest.raises(ValueError, match="tree@M"):
        run_row(_params(8, 4), "none", designs=("today@3",))


def test_default_trees_put_an_in_rack_tree_in_racks_of_32() -> None:
    # m = k: a rack home sends a chunk to at most k rack-mates (plus k child racks' homes),
    # the rack's other members hang below them
    cfg = HerdConfig()
    assert cfg.rack_fanout == cfg.tree_k == 8
    ids = [f"n{i:04d}" for i in range(32 * 20)]
    view = PeerView.build(ids, ids, [f"r{i // 32:02d}" for i in range(len(ids))])
    ck = chunk_keys([blake3.blake3(str(i).encode()).hexdigest() for i in range(16)])
    parent, home, _ = all_parents(view, ck)                 # the defaults
    for c in range(len(ck)):
        kids = np.flatnonzero(parent[c] >= 0)
        par = parent[c][kids]
        same = view.rack_of[kids] == view.rack_of[par]
        assert np.bincount(par[same], minlength=len(ids)).max() == cfg.rack_fanout
        assert np.bincount(par, minlength=len(ids)).max() <= cfg.tree_k + cfg.rack_fanout
    for me in (0, 100, 639):                                 # the fetcher's defaults agree
        plan = plan_node(view, me, ck)
        assert (plan.home == home).all() and (plan.parent == parent[:, me]).all()


def test_manifest_polls_cost_each_level_one_pause() -> None:
    from bench.herd_sim import Sim, _poll_times
    from p2p.herd import HerdConfig, manifest_polls

    cfg = HerdConfig(manifest_poll_s=0.002, manifest_poll_growth=2.0, manifest_poll_max_s=0.005)
    gen = manifest_polls(cfg)
    assert [next(gen) for _ in range(4)] == [0.002, 0.004, 0.005, 0.005]
    p = _params(3, 3, chunks=1)
    p.origin = p.link = 1e12                     # transfers ~free: only the polls show
    p.recv_cpu = p.send_cpu = 1e-9
    sim = Sim(p, np.zeros(3, np.int64), np.full(3, np.inf), np.full(1, 1e12))
    polls = np.array([0.0, 0.002, 0.006, 0.011])
    have = sim.transfer(np.array([-1, 0, 1]), 1000.0, np.zeros(3), [], poll=polls)
    # the root reads the origin at once; node 1 finds it at its 2nd ask (2 ms), node 2 at its 3rd (6 ms)
    assert have[0] < 1e-6
    assert abs(have[1] - 0.002) < 1e-6 and abs(have[2] - 0.006) < 1e-6
    assert _poll_times()[0] == 0.0 and np.all(np.diff(_poll_times()) > 0)


def test_manifest_waits_cost_no_pause_within_the_cap() -> None:
    from bench.herd_sim import Sim, _poll_times

    p = _params(3, 3, chunks=1)
    p.origin = p.link = 1e12
    p.recv_cpu = p.send_cpu = 1e-9
    polls = _poll_times()
    for wait_s in (2.0, 0.001):
        sim = Sim(p, np.zeros(3, np.int64), np.full(3, np.inf), np.full(1, 1e12))
        sim.w_origin = 0.005                  # the origin busy for 5 ms: the root has it then
        have = sim.transfer(np.array([-1, 0, 1]), 1000.0, np.zeros(3), [], poll=polls, wait_s=wait_s)
        assert have[0] == pytest.approx(0.005, abs=1e-6)
        if wait_s == 2.0:    # within the wait: sent when the source has it, level after level
            assert have[1] == pytest.approx(0.005, abs=1e-6) and have[2] == pytest.approx(0.005, abs=1e-6)
        else:                # each expired 1 ms wait costs a poll pause more
            assert have[1] == pytest.approx(0.005 + 5 * polls[1], abs=1e-6)


def test_stand_ins_agree_with_the_fetchers_and_spread_a_dead_home() -> None:
    from p2p.tree import all_parents_standins

    ids = [f"n{i:03d}" for i in range(150)]
    peers = [Peer(node_id=i, data_url=f"http://{i}", rack=f"r{j % 9}") for j, i in enumerate(ids)]
    cids = [blake3.blake3(str(i).encode()).hexdigest() for i in range(120)]
    view = PeerView.from_peers(peers)
    ck = chunk_keys(cids)
    for m in (3, 32):              # racks of ~17: an in-rack tree, and everyone under the rack home
        _, _, _, standin = all_parents_standins(view, ck, k=2, rack_fanout=m)
        for me in range(len(ids)):
            plan = plan_node(view, me, ck, k=2, rack_fanout=m)
            want = np.where(plan.origin_rank >= 0, -1, standin[:, me])
            assert (plan.standin == want).all()
            # asked right after the parent, when the parent is dead
            for c in np.flatnonzero(plan.standin >= 0)[:10]:
                srcs = plan.sources(int(c), {view.node_ids[int(plan.parent[c])]: float("inf")})
                assert srcs[0].node_id == view.node_ids[int(plan.standin[c])] and srcs[0].wait
    # a node's chunks as rack home are taken over by several rack-mates, not one
    _, _, _, standin = all_parents_standins(view, ck, k=2, rack_fanout=32)
    par, _, _ = all_parents(view, ck, k=2, rack_fanout=32)
    d = 0
    kids = [(c, x) for c in range(len(cids)) for x in np.flatnonzero(par[c] == d)
            if view.rack_of[x] == view.rack_of[d]]
    assert len({int(standin[c, x]) for c, x in kids}) >= 3


def test_the_serving_cap_leaves_room_for_a_stand_in() -> None:
    # a dead node's chunks as rack home go to one stand-in per chunk (its in-rack children
    # and the child racks' homes alike), on top of the stand-in's own children: with a cap
    # of k + m it answers 503s, with p2p.tree.serving_cap (k + 2m) none
    from p2p.tree import serving_cap

    p = _params(96, 24, chunks=48)
    p.rack_fanout = 6
    # both variants in one row: they share the fan-out, so one planning measurement (the
    # only measured input) serves both, and they differ in the cap alone
    tight_d, roomy_d = f"tree@6:{p.k + 6}", "tree@6"
    row = run_row(p, "dead", designs=(tight_d, roomy_d))
    tight, roomy = row[tight_d], row[roomy_d]
    assert p.with_fanout(6).serve_cap == serving_cap(p.k, 6) == p.k + 12
    assert tight["busy_503"] > 0 and roomy["busy_503"] == 0
    # the 503s' retries cost time (equal is possible at these link rates, later is not)
    assert roomy["completion_over_ideal"] <= tight["completion_over_ideal"]


# ---------------------------------------------------------------- the fast paths

def _lexsort_ref(src: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.lexsort((r, src))


def test_grouping_by_source_equals_lexsort_with_ties_nan_and_inversions() -> None:
    from bench.herd_sim import _by_source

    rng = np.random.default_rng(3)
    for trial in range(300):
        m = int(rng.integers(0, 400))
        n = int(rng.choice([50, 5000, 70000]))          # 70,000: past 16-bit sources
        src = rng.integers(0, min(n, int(rng.integers(1, 60))), m)
        r = np.round(rng.random(m) * 4, int(rng.integers(0, 3)))   # many ties
        if trial % 3 == 0:                               # ascending within sources: the fast path
            r = np.sort(r)
        if trial % 7 == 0 and m:
            r[rng.integers(0, m, 3)] = np.inf
        if trial % 11 == 0 and m:
            r[rng.integers(0, m, 2)] = np.nan
        got = _by_source(src, r, n)
        assert (got == _lexsort_ref(src, r)).all(), trial


def _depth_ref(par: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(par), np.int64)
    for i in range(len(par)):
        j = par[i]
        while j >= 0:
            depth[i] += 1
            j = par[j]
    return depth


def test_levels_are_depths_live_first_ascending() -> None:
    from bench.herd_sim import _levels

    view = PeerView.build([f"n{i}" for i in range(300)], [""] * 300, [f"r{i % 23}" for i in range(300)])
    par, _, _ = all_parents(view, chunk_keys([str(i) for i in range(6)]), k=2, rack_fanout=3)
    rng = np.random.default_rng(1)
    for row in par:
        alive = rng.random(len(row)) > 0.1
        order, bounds, maxd = _levels(row, alive)
        depth = _depth_ref(row)
        assert maxd == depth.max()
        for d in range(maxd + 1):
            assert (order[bounds[2 * d]:bounds[2 * d + 1]] == np.flatnonzero((depth == d) & alive)).all()
            assert (order[bounds[2 * d + 1]:bounds[2 * d + 2]] == np.flatnonzero((depth == d) & ~alive)).all()


class _PlainSim:
    """The simulator's transfer as it was before the fast paths (a masked pass over every
    node per tree level, lexsort per round), kept as the reference: the fast one must
    give the same floats, bit for bit."""

    @staticmethod
    def make(p: Any, rack: np.ndarray, die: np.ndarray, cap: np.ndarray) -> Any:
        from bench.herd_sim import Sim

        class Plain(Sim):
            def transfer(self, parent, size, ready, succ, origin_fallback=None, cap=0, poll=None,  # type: ignore[no-untyped-def]
                         wait_s=0.0, standin=None, levels=None):
                import math
                p = self.p
                n = p.nodes
                die = self.die
                have = np.full(n, np.inf)
                tau = size / self.rate
                alive0 = die > 0
                par = parent.copy()
                self._mortal = True
                if origin_fallback is not None:
                    par[origin_fallback] = -1
                if standin is not None:
                    x = np.flatnonzero((par >= 0) & (standin >= 0))
                    x = x[(die[par[x]] <= ready[x]) & (die[standin[x]] > ready[x])]
                    if len(x):
                        par[x] = standin[x]
                        ready = ready.copy()
                        ready[x] += 0.001
                        self.dead_probes += len(x)
                depth = np.zeros(n, np.int64)
                cur = par.copy()
                while True:
                    m = cur >= 0
                    if not m.any():
                        break
                    depth[m] += 1
                    cur[m] = par[cur[m]]
                roots = np.flatnonzero((par < 0) & alive0)
                order = roots[np.argsort(ready[roots], kind="stable")]
                self._origin_reads(order, size, ready, have)
                dead_roots = np.flatnonzero((par < 0) & ~alive0)
                failed_root = [int(r) for r in np.flatnonzero(par < 0) if have[r] > die[r]]
                if failed_root or len(dead_roots):
                    for s in succ:
                        if die[s] > 0 and not math.isfinite(have[s]):
                            t = min((float(min(die[r], have[r])) for r in np.flatnonzero(par < 0)), default=0.0)
                            self.dead_probes += 1
                            self._origin_reads(np.array([s]), size, np.maximum(ready, t + 0.001), have)
                            if have[s] <= die[s]:
                                break
                maxd = int(depth.max()) if n else 0
                for lvl in range(1, maxd + 1):
                    xs = np.flatnonzero((depth == lvl) & alive0 & ~np.isfinite(have))
                    pending = xs
                    t_ask = ready[xs]
                    for _ in range(64):
                        if len(pending) == 0:
                            break
                        src, t_known = self._sources(pending, par, have, succ, t_ask)
                        ok = src >= 0
                        if (~ok).any():
                            r2 = ready.copy()
                            r2[pending[~ok]] = np.maximum(ready[pending[~ok]], t_known[~ok])
                            self._origin_reads(pending[~ok], size, r2, have)
                        pending, src, t_known, t_ask = pending[ok], src[ok], t_known[ok], t_ask[ok]
                        if len(pending) == 0:
                            break
                        pending, t_ask = self._peer_round(pending, src, size, tau,
                                                          np.maximum.reduce([ready[pending], t_known, t_ask]), have,
                                                          cap, poll, wait_s)
                have[have > die] = np.inf
                return have

            def _peer_round(self, xs, src, size, tau, ready, have, cap, poll=None, wait_s=0.0):  # type: ignore[no-untyped-def]
                r = np.maximum(ready, have[src])
                if poll is not None and wait_s > 0:
                    late = np.maximum(have[src] - ready, 0.0)
                    r = ready + late + np.floor(late / wait_s) * poll[1]
                elif poll is not None:
                    late = np.maximum(have[src] - ready, 0.0)
                    i = np.minimum(np.searchsorted(poll, late), len(poll) - 1)
                    r = np.where(late > 0, ready + np.maximum(poll[i], late), ready)
                o = np.lexsort((r, src))
                xs, src, r = xs[o], src[o], r[o]
                grp_start = np.r_[True, src[1:] != src[:-1]]
                # _grouped_fifo as it was
                s = np.broadcast_to(np.asarray(tau, dtype=np.float64), (len(src),))
                gid = np.cumsum(grp_start) - 1
                starts = np.flatnonzero(grp_start)
                idx = np.arange(len(xs)) - starts[gid]
                v = r - idx * s
                span = float(v.max() - v.min()) + 1.0
                ends = (idx + 1) * s + (np.maximum.accumulate(v + gid * span) - gid * span)
                ends = np.maximum.reduce([ends, self.t0[src] + self.w_up[src] + (idx + 1) * tau,
                                          self.t0[xs] + self.w_down[xs] + tau])
                if cap > 0:
                    waited = np.maximum(ends - tau - r, 0.0)
                    over = (idx >= cap) & (waited > 0)
                    tries = np.ceil(waited[over] / self.p.retry_s)
                    self.busy_503 += int(tries.sum())
                    ends[over] = r[over] + tries * self.p.retry_s + tau
                gl = np.r_[src[1:] != src[:-1], True]
                self.w_up[src[gl]] += (idx[gl] + 1) * tau
                self.w_down[xs] += tau
                cross = self.rack[src] != self.rack[xs]
                if cross.any():
                    ci = np.flatnonzero(cross)
                    for key, work in ((self.rack[src[ci]], self.w_rout), (self.rack[xs[ci]], self.w_rin)):
                        oo = np.lexsort((ends[ci], key))
                        kk, jj = key[oo], ci[oo]
                        first = np.r_[True, kk[1:] != kk[:-1]]
                        g2 = np.cumsum(first) - 1
                        k_idx = np.arange(len(kk)) - np.flatnonzero(first)[g2]
                        ends[jj] = np.maximum(ends[jj], work[kk] + (k_idx + 1) * size / self.rack_cap[kk])
                        last = np.r_[kk[1:] != kk[:-1], True]
                        work[kk[last]] += (k_idx[last] + 1) * size / self.rack_cap[kk[last]]
                cut = ends > self.die[src]
                good = ~cut
                have[xs[good]] = ends[good]
                self.peer_bytes += size * float(good.sum())
                self.cross_bytes += size * float((good & cross).sum())
                if cut.any():
                    self.wasted += float(np.clip((self.die[src[cut]] - (ends[cut] - tau)) * self.rate, 0, size).sum())
                return xs[cut], self.die[src[cut]] + 0.001

        return Plain(p, rack, die, cap)


_STATE = ("w_down", "w_up", "w_rin", "w_rout", "w_origin", "done", "origin_bytes", "cross_bytes", "peer_bytes",
          "wasted", "busy_503", "dead_probes")


@pytest.mark.parametrize("case", ["none", "dead", "home", "slowrack"])
def test_the_fast_transfer_equals_the_plain_one_bit_for_bit(case: str) -> None:
    """Chunks down real trees (racks of 7, k = 2, m = 2: depth >= 4) with a serving cap
    of 3 (503s), dead nodes, a home dying mid-way and a slow rack, two designs sharing
    the levels as run_row does; a manifest with polls and waits; today's fallbacks."""
    from bench.herd_sim import Sim, _poll_times, _scenario

    p = _params(150, 7, chunks=48)
    p.rack_fanout, p.serve_cap = 2, 3
    rack, die, cap = _scenario(p, case, 0)
    view = PeerView.build([f"n{i:03d}" for i in range(150)], [""] * 150, [f"r{int(r):03d}" for r in rack])
    ck = chunk_keys([blake3.blake3(f"c{i}".encode()).hexdigest() for i in range(48)])
    par, _, root, st = all_parents_standins(view, ck, k=2, rack_fanout=2)
    if case == "home":          # the busiest home, and a node under it, die while sending
        die[int(np.argmax(np.bincount(root[:, 0], minlength=150)))] = 0.25
        die[int(par[5][par[5] >= 0][7])] = 0.33
    rng = np.random.default_rng(5)
    starts = [rng.random(150) * 0.002, np.full(150, 0.001)]
    fast = [Sim(p, rack, die.copy(), cap.copy()) for _ in starts]
    plain = [_PlainSim.make(p, rack, die.copy(), cap.copy()) for _ in starts]
    busy = 0
    for i in range(len(ck)):
        succ = [int(x) for x in root[i, 1:3] if x >= 0]
        shared: dict = {}
        for f, q, ready in zip(fast, plain, starts, strict=True):
            a = f.transfer(par[i], p.chunk_bytes, ready + i * 1e-4, succ, cap=p.serve_cap, standin=st[i],
                           levels=shared)
            b = q.transfer(par[i], p.chunk_bytes, ready + i * 1e-4, succ, cap=p.serve_cap, standin=st[i])
            np.testing.assert_array_equal(a, b)
            np.maximum(f.done, a, out=f.done)
            np.maximum(q.done, b, out=q.done)
        busy += fast[0].busy_503
    for f, q in zip(fast, plain, strict=True):
        for name in _STATE:
            np.testing.assert_array_equal(getattr(f, name), getattr(q, name), err_msg=name)
    assert busy > 0 and fast[0].cross_bytes > 0                  # the cap and the spine were exercised
    if case in ("dead", "home"):
        assert fast[0].dead_probes > 0
    if case == "home":
        assert fast[0].wasted > 0                                 # transfers cut by a death
    # the manifest: polls and the capped wait
    for wait_s in (2.0, 0.0005):
        f, q = Sim(p, rack, die.copy(), cap.copy()), _PlainSim.make(p, rack, die.copy(), cap.copy())
        f.w_origin = q.w_origin = 0.003
        args = (par[0], 7000.0, starts[0], [int(x) for x in root[0, 1:3] if x >= 0])
        kw = dict(cap=p.serve_cap, poll=_poll_times(), wait_s=wait_s, standin=st[0])
        np.testing.assert_array_equal(f.transfer(*args, **kw), q.transfer(*args, **kw))
    # today's design: everyone under the home's rack, some rack homes told 503
    f, q = Sim(p, rack, die.copy(), cap.copy()), _PlainSim.make(p, rack, die.copy(), cap.copy())
    flat = np.where(np.arange(150) % 7 == 0, 0, (np.arange(150) // 7) * 7)
    flat[0] = -1
    fb = np.arange(14, 150, 21)
    fb_par = flat.copy()
    fb_par[fb] = -1
    np.testing.assert_array_equal(f.transfer(fb_par, p.chunk_bytes, starts[0], []),
                                  q.transfer(flat, p.chunk_bytes, starts[0], [], origin_fallback=fb))
    np.testing.assert_array_equal(f.transfer(flat, p.chunk_bytes, starts[0], [], origin_fallback=fb),
                                  q.transfer(flat, p.chunk_bytes, starts[0], [], origin_fallback=fb))
    for name in _STATE:
        np.testing.assert_array_equal(getattr(f, name), getattr(q, name), err_msg=name)
