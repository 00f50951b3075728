"""The herd at fleet scale, simulated with the real decision functions, every byte counted.

    python -m bench.herd_sim [--nodes 8,64,1024,10000,25000,50000] [--rack-size 18,32]
                             [--size-mb 2048] [--chunk-mb 1] [--cases none,dead,home,slowrack]
                             [--cores 1] [--designs tree,serial,today] [--json]
                             [--k 8] [--rack-fanout 8] [--serve-cap 0]

``--designs tree@M,tree@N:C`` compares in-rack fan-outs (serving cap C, else
``p2p.tree.serving_cap``: k + 2M) in one
run, beside or instead of the default ``tree``: every other input the same, planning
measured for each in turn.

What runs. For each chunk, the tree every fetcher computes (``p2p.tree.all_parents``: the
same primitives as ``plan_node``, which ``p2p.herd`` calls; a test checks they agree) and
for today's design the homes the old fetcher computes (``p2p.rendezvous.assign_homes``
global homes; rack homes = each rack's top rendezvous node). Then a chunk-level
store-and-forward schedule, chunk by chunk in manifest order (the fetchers' order),
level by level down each chunk's tree:

- every transfer occupies its sender's uplink and its receiver's downlink for one chunk
  time at ``min(link, CPU-bound rate)``; each node's uplink, each rack's spine uplink (in
  and out, ``rack nodes x link / oversub``) and the origin are FIFO servers (exact FIFO
  recurrences, vectorised with a grouped cumulative max);
- the data plane's per-chunk serving cap: askers beyond ``--serve-cap`` copies in flight
  are answered 503 and come back after Retry-After (counted, their start delayed to the
  next retry); today's design: a chunk's global home takes at most 256 waiting requests
  (``max_waiting``), the rest are 503 and go to the origin, as its plan says;
- failures, from the fetcher's own rules: a dead parent is skipped for its stand-in
  (``p2p.tree``: the rack-mate ranked after it), then the next live source up the
  chain (1 ms to learn it: connection refused), a dead global home hands
  the origin read to its first live successor; a transfer cut by a death is re-asked of
  the fallback at the moment of death (its partial bytes counted as wasted);
- the manifest travels like a chunk (its own tree; today: every cold node reads it from
  the origin), asked with the data plane's capped ``?wait_ms=`` (2 s): sent when the
  source has it, and after each wait that ran out one pause of the fetcher's schedule
  (``p2p.herd.manifest_polls``, without jitter); have-probes
  counted (today: 256 peers each, tree: the rack, or everyone up to 64 nodes);
- CPU: receive and send CPU-s per GiB from the efficiency issue's loopback figures
  (6 and 0.9 on one core) bound each node's rates. Planning is measured in this run on
  this machine, in CPU-s of the planning thread (``time.thread_time``: other processes
  count only through shared caches and cores; the least of PLAN_REPS = 3 runs, the
  variants alternating), the way the fetcher does it: the peer
  view from the gang's ``PeerTable`` (``p2p.herd.peer_view``, node keys uncached), the
  manifest's tree, then ``p2p.tree.Planner`` stepped
  with the fetcher's block sizes. Design ``tree``: a node asks for the manifest after
  its view and the manifest's tree, and for chunk c once c's block is planned (with 2+
  cores: the planner has a core of its own); ``serial``: the same trees, every chunk
  after the whole plan (the design before); ``today``: ``plan_sources`` per chunk,
  timed on a few chunks, before the first.

Origin egress, cross-rack bytes and 503s are sums over simulated transfers. Not modelled:
TCP dynamics, latency other than chunk times and manifest polls, the have-probes' round
trip (the fetcher sends them while it plans the first block), per-node worker windows (a
node asks for every chunk as soon as its downlink is free), disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import blake3
import numpy as np

from p2p.balance import balanced_order
from p2p.herd import HerdConfig, manifest_polls, peer_view
from p2p.rendezvous import assign_homes, node_key, plan_sources
from p2p.tree import (
    PeerView,
    Planner,
    Rotations,
    _mix_inplace,
    all_parents,
    all_parents_standins,
    chunk_keys,
    plan_node,
    serving_cap,
)
from scheduler_link.messages import Peer, PeerTable

GIB = 1 << 30


def tree_of(node_ids: Sequence[str], peers: Sequence[Peer], chunk_ids: Sequence[str], *, k: int,
            rack_fanout: int, sizes: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, PeerView]:
    """The simulator's trees for these inputs: (parent [C, N] rows, home [C], view), rows
    in ``chunk_ids``' order. ``sizes`` (the chunks' sizes): planned as the fetcher plans
    (``HerdConfig.balance_homes``), in :func:`p2p.balance.balanced_order` for racks of the
    view's largest size; the simulator's own chunks are all one size, where that order is
    the manifest's."""
    view = PeerView.from_peers(peers)
    order = (balanced_order(sizes, int(view.sizes.max())) if sizes is not None and len(view)
             else np.arange(len(chunk_ids)))
    par_p, home_p, _ = all_parents(view, chunk_keys([chunk_ids[int(i)] for i in order]), k=k, rack_fanout=rack_fanout)
    parent, home = np.empty_like(par_p), np.empty_like(home_p)
    parent[order], home[order] = par_p, home_p
    return parent, home, view


@dataclass
class Params:
    nodes: int
    rack_size: int
    chunks: int
    chunk_bytes: float
    manifest_bytes: float
    link: float             # bytes/s
    origin: float
    oversub: float
    k: int
    rack_fanout: int
    serve_cap: int
    retry_s: float
    recv_cpu: float         # CPU-s per GiB received
    send_cpu: float
    cores: float
    fixed_cap: bool = False  # serve_cap as given for every fan-out variant (else k + its fan-out)

    def with_fanout(self, m: int, cap: int = 0) -> Params:
        """These parameters with in-rack fan-out ``m``; the serving cap ``cap``, else as
        the agent sets the data plane's (``p2p.tree.serving_cap``) unless fixed."""
        return replace(self, rack_fanout=m,
                       serve_cap=cap or (self.serve_cap if self.fixed_cap else serving_cap(self.k, m)))


def _fifo_in_groups(gid: np.ndarray, idx: np.ndarray, ready: np.ndarray, s: float) -> np.ndarray:
    """FIFO servers, one per group (jobs sorted by group, served in the given order):
    each job's end time e_i = max(r_i, e_{i-1}) + s, exact, as
    e_i = (i+1) s + cummax(r_j - j s) within the group. ``gid``: each job's group number
    (0, 1, ... in order), ``idx``: its index within the group."""
    if len(gid) == 0:
        return ready
    v = ready - idx * s
    span = float(v.max() - v.min()) + 1.0
    gs = gid * span
    acc = np.maximum.accumulate(v + gs) - gs
    return (idx + 1) * s + acc


def _by_source(src: np.ndarray, r: np.ndarray, n: int) -> np.ndarray:
    """``np.lexsort((r, src))`` (by source, then ready time, then position), for sources
    in [0, n): a radix sort of 16-bit sources, kept when the ready times already
    ascend within each source's askers (the usual case: they wait on the source), else
    the sort of the groups out of order by (source, ready) alone."""
    if n > 1 << 16 or len(src) < 2:
        return np.lexsort((r, src))
    o = np.argsort(src.astype(np.uint16), kind="stable")
    ss, rs = src[o], r[o]
    same = ss[1:] == ss[:-1]
    bad = same & ~(rs[1:] >= rs[:-1])
    if not bad.any():
        return o
    # the groups with an inversion, sorted by (source, ready) among themselves, in place
    g = np.cumsum(np.concatenate(([True], ~same))) - 1
    sel = np.flatnonzero(np.isin(g, g[1:][bad]))
    sub = o[sel]
    o[sel] = sub[np.lexsort((rs[sel], ss[sel]))]
    return o


Levels = tuple[np.ndarray, np.ndarray, int]


def _levels(par: np.ndarray, alive: np.ndarray) -> Levels:
    """A tree's nodes by depth (the number of ancestors up to an origin reader, -1 in
    ``par``), live ones (``alive``) before dead ones at each depth, ascending within:
    (order, bounds, max depth); depth d's live nodes are ``order[bounds[2d]:bounds[2d + 1]]``,
    its dead ones ``order[bounds[2d + 1]:bounds[2d + 2]]``. One gather per level and a
    radix sort of 16-bit keys, not a masked pass over every node per level."""
    n = len(par)
    up = np.empty(n + 1, np.int64)               # parent, n for none (n: its own parent)
    np.copyto(up[:n], par)
    up[:n][par < 0] = n
    up[n] = n
    depth = np.zeros(n, np.int16)
    cur = up[:n]
    while True:
        has = cur != n
        if not has.any():
            break
        depth += has
        cur = up[cur]
    key = depth * np.int16(2) + ~alive
    order = np.argsort(key, kind="stable")
    maxd = int(depth.max()) if n else 0
    bounds = np.zeros(2 * maxd + 3, np.int64)
    np.cumsum(np.bincount(key, minlength=2 * maxd + 2), out=bounds[1:])
    return order, bounds, maxd


class Sim:
    """One design, one scenario: the state of every resource and every node."""

    def __init__(self, p: Params, rack: np.ndarray, die: np.ndarray, rack_cap: np.ndarray) -> None:
        self.p = p
        n = p.nodes
        self.rack = rack
        self.die = die
        self.rack_cap = rack_cap
        rate_down = min(p.link, p.cores * GIB / p.recv_cpu)
        rate_up = min(p.link, p.cores * GIB / p.send_cpu)
        self.rate = min(rate_down, rate_up)
        self.t0 = np.zeros(n)              # when each node starts moving chunks
        self.w_down = np.zeros(n)          # chunk-times of work each resource took so far
        self.w_up = np.zeros(n)
        self.w_rin = np.zeros(len(rack_cap))
        self.w_rout = np.zeros(len(rack_cap))
        self.w_origin = 0.0                # objects the origin sent so far
        self.done = np.zeros(n)            # last chunk's arrival per node
        self.origin_bytes = 0.0
        self.cross_bytes = 0.0
        self.peer_bytes = 0.0
        self.wasted = 0.0
        self.busy_503 = 0
        self.dead_probes = 0
        self._mortal = True                # some node dies (set by each transfer)

    # ---------------------------------------------------------------- one object

    def transfer(self, parent: np.ndarray, size: float, ready: np.ndarray, succ: Sequence[int],
                 origin_fallback: np.ndarray | None = None, cap: int = 0,
                 poll: np.ndarray | None = None, wait_s: float = 0.0,
                 standin: np.ndarray | None = None, levels: dict[bytes, Levels] | None = None) -> np.ndarray:
        """Move one object down ``parent`` (-1 = reads the origin). Returns each node's
        arrival time (inf: never, dead). ``succ``: the root's successors (re-rooting).
        ``origin_fallback``: nodes told 503 that read the origin instead (today).
        ``poll``: when a source without the object (404) is asked again, seconds after
        the first ask, ascending (the manifest: ``p2p.herd.manifest_polls``), and
        ``wait_s``: how long one ask waits at the source first (the manifest: the data
        plane's ``?wait_ms=`` cap, 2 s): an object that comes within the wait is sent when
        it comes, a later one costs the wait and a poll pause per wait that ran out.
        ``poll`` None: waited for without a cap (chunks, ``?wait_ms=`` of 60 s).
        ``standin``: each node's stand-in (``p2p.tree``: asked, 1 ms later, when the
        parent is dead when the node asks; when it is dead too, the chain above as
        usual). ``levels``: the :func:`_levels` of ``parent`` (key ``b""``) and of the
        trees stand-ins or fallbacks made of it (keyed by what changed), with this
        simulation's ``die > 0``: designs with the same trees and deaths share them
        (computed here when missing, and added)."""
        p = self.p
        n = p.nodes
        die = self.die
        have = np.full(n, np.inf)
        tau = size / self.rate
        par = parent
        key = b""                          # how par differs from parent (levels[key]: its levels)
        if origin_fallback is not None and len(origin_fallback):
            par = par.copy()
            par[origin_fallback] = -1
            key = b"f" + origin_fallback.tobytes()
        mortal = np.isfinite(die)          # (die may change between transfers: a victim)
        self._mortal = bool(mortal.any())
        if standin is not None:            # the parent known dead when asked: its stand-in
            if self._mortal:               # only a parent that dies can be dead when asked
                x = np.flatnonzero(mortal[par] & (par >= 0) & (standin >= 0))
                x = x[(die[par[x]] <= ready[x]) & (die[standin[x]] > ready[x])]
                if len(x):
                    if par is parent:
                        par = par.copy()
                    par[x] = standin[x]
                    ready = ready.copy()
                    ready[x] += 0.001      # connection refused: the parent is gone
                    self.dead_probes += len(x)
                    key += b"s" + x.tobytes()
        lv = levels.get(key) if levels is not None else None
        if lv is None:
            lv = _levels(par, die > 0)
            if levels is not None:
                levels[key] = lv
        order, bnd, maxd = lv
        # level 0: origin reads, FIFO at the origin, in ready order; a dead root hands
        # the read to its first live successor at the moment it is known dead
        roots = order[bnd[0]:bnd[1]]
        self._origin_reads(roots[np.argsort(ready[roots], kind="stable")], size, ready, have)
        all_roots = order[bnd[0]:bnd[2]]   # the live roots, then the dead ones
        if (have[all_roots] > die[all_roots]).any():
            for s in succ:
                if die[s] > 0 and not math.isfinite(have[s]):
                    t = float(np.minimum(die[all_roots], have[all_roots]).min()) if len(all_roots) else 0.0
                    self.dead_probes += 1
                    self._origin_reads(np.array([s]), size, np.maximum(ready, t + 0.001), have)
                    if have[s] <= die[s]:
                        break
        for lvl in range(1, maxd + 1):
            xs = order[bnd[2 * lvl]:bnd[2 * lvl + 1]]      # live, ascending
            if len(xs) == 0:
                continue
            xs = xs[~np.isfinite(have[xs])]    # (a successor may have it from the origin)
            pending = xs
            t_ask = ready[xs]
            for _ in range(64):
                if len(pending) == 0:
                    break
                src, t_known = self._sources(pending, par, have, succ, t_ask)
                ok = src >= 0
                # no live source above: read the origin (the tree above is dead)
                if not ok.all():
                    r2 = ready.copy()
                    r2[pending[~ok]] = np.maximum(ready[pending[~ok]], t_known[~ok])
                    self._origin_reads(pending[~ok], size, r2, have)
                    pending, src, t_known, t_ask = pending[ok], src[ok], t_known[ok], t_ask[ok]
                if len(pending) == 0:
                    break
                pending, t_ask = self._peer_round(pending, src, size, tau,
                                                  np.maximum(np.maximum(ready[pending], t_known), t_ask), have,
                                                  cap, poll, wait_s)
        # a node that died before it got the object never has it
        have[have > die] = np.inf
        return have

    def _sources(self, xs: np.ndarray, par: np.ndarray, have: np.ndarray,
                 succ: Sequence[int], t_ask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first usable source up each node's chain (the fetcher's rule: skip dead
        ancestors, then successors); -1 when none. Usable: has it before it dies, and
        is not dead when asked."""
        die = self.die
        src = par[xs].copy()
        t = np.zeros(len(xs))
        for _ in range(64):
            s0 = np.maximum(src, 0)
            d = die[s0]
            bad = (src >= 0) & (~(have[s0] < d) | (d <= np.maximum(t_ask, t)))
            if not bad.any():
                break
            t[bad] = np.maximum(t[bad], np.minimum(die[src[bad]], 1e18)) + 0.001
            self.dead_probes += int(bad.sum())
            src[bad] = par[src[bad]]
        top = src < 0
        if top.any():
            for s in succ:
                cand = top & (xs != s) & bool(have[s] < die[s]) & (die[s] > np.maximum(t_ask, t))
                src[cand] = s
                top &= ~cand
        return src, t

    def _origin_reads(self, xs: np.ndarray, size: float, ready: np.ndarray, have: np.ndarray) -> None:
        if len(xs) == 0:
            return
        tau = size / self.rate
        xs = xs[np.argsort(ready[xs], kind="stable")]
        r = ready[xs]
        i = np.arange(len(xs))
        ends = np.maximum.reduce([r + tau, self.w_origin + (i + 1) * size / self.p.origin,
                                  self.t0[xs] + self.w_down[xs] + tau])
        self.w_origin += len(xs) * size / self.p.origin
        self.w_down[xs] += tau
        cut = ends > self.die[xs]
        self.origin_bytes += size * float((~cut).sum())
        self.wasted += float(np.clip((self.die[xs][cut] - (ends[cut] - tau)) * self.rate, 0, size).sum())
        have[xs] = np.where(cut, np.inf, ends)

    def _peer_round(self, xs: np.ndarray, src: np.ndarray, size: float, tau: float, ready: np.ndarray,
                    have: np.ndarray, cap: int, poll: np.ndarray | None = None,
                    wait_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """One round of peer transfers src -> xs; returns the nodes whose transfer was cut
        (their sender died) to be re-asked, and when. Each resource is work-conserving: a transfer
        ends no earlier than its sender's copies of this chunk before it (one chunk time
        each), the sender's uplink work so far, the receiver's downlink work so far, and
        the spine work of the racks it crosses."""
        r = np.maximum(ready, have[src])
        if poll is not None and wait_s > 0:    # each ask waits up to wait_s, then a pause
            late = np.maximum(have[src] - ready, 0.0)
            r = ready + late + np.floor(late / wait_s) * poll[1]
        elif poll is not None:             # asked at ready + poll[i] until the source has it
            late = np.maximum(have[src] - ready, 0.0)
            i = np.minimum(np.searchsorted(poll, late), len(poll) - 1)
            r = np.where(late > 0, ready + np.maximum(poll[i], late), ready)
        o = _by_source(src, r, self.p.nodes)
        xs, src, r = xs[o], src[o], r[o]
        grp_start = np.concatenate(([True], src[1:] != src[:-1]))
        starts = np.flatnonzero(grp_start)
        gid = np.cumsum(grp_start) - 1
        idx = np.arange(len(xs)) - starts[gid]
        ends = _fifo_in_groups(gid, idx, r, tau)
        ends = np.maximum(np.maximum(ends, self.t0[src] + self.w_up[src] + (idx + 1) * tau),
                          self.t0[xs] + self.w_down[xs] + tau)
        # the per-chunk serving cap: askers beyond it were told 503 and came back after
        # Retry-After (their start moves to the retry that found a free slot)
        if cap > 0:
            waited = np.maximum(ends - tau - r, 0.0)
            over = (idx >= cap) & (waited > 0)
            tries = np.ceil(waited[over] / self.p.retry_s)
            self.busy_503 += int(tries.sum())
            ends[over] = r[over] + tries * self.p.retry_s + tau
        gl = np.concatenate((grp_start[1:], [True]))
        self.w_up[src[gl]] += (idx[gl] + 1) * tau
        self.w_down[xs] += tau
        # spine: cross-rack transfers add work to the sender rack's uplink out and the receiver's in
        cross = self.rack[src] != self.rack[xs]
        if cross.any():
            ci = np.flatnonzero(cross)
            for key, work in ((self.rack[src[ci]], self.w_rout), (self.rack[xs[ci]], self.w_rin)):
                oo = np.lexsort((ends[ci], key))
                kk, jj = key[oo], ci[oo]
                first = np.concatenate(([True], kk[1:] != kk[:-1]))
                g2 = np.cumsum(first) - 1
                k_idx = np.arange(len(kk)) - np.flatnonzero(first)[g2]
                ends[jj] = np.maximum(ends[jj], work[kk] + (k_idx + 1) * size / self.rack_cap[kk])
                last = np.concatenate((first[1:], [True]))
                work[kk[last]] += (k_idx[last] + 1) * size / self.rack_cap[kk[last]]
        if not self._mortal:               # nobody dies: no transfer is cut
            have[xs] = ends
            self.peer_bytes += size * float(len(xs))
            self.cross_bytes += size * float(cross.sum())
            return xs[:0], ends[:0]
        cut = ends > self.die[src]
        good = ~cut
        have[xs[good]] = ends[good]
        self.peer_bytes += size * float(good.sum())
        self.cross_bytes += size * float((good & cross).sum())
        if cut.any():
            self.wasted += float(np.clip((self.die[src[cut]] - (ends[cut] - tau)) * self.rate, 0, size).sum())
        return xs[cut], self.die[src[cut]] + 0.001


def _scenario(p: Params, case: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = p.nodes
    rack = np.arange(n) // p.rack_size
    n_racks = int(rack[-1]) + 1
    rack_nodes = np.bincount(rack, minlength=n_racks)
    cap = rack_nodes * p.link / p.oversub
    die = np.full(n, np.inf)
    rng = np.random.default_rng(seed)
    if case == "dead" and n > 1:
        die[rng.choice(n, size=max(1, n // 100), replace=False)] = 0.0
    if case == "slowrack" and n_racks > 1:
        cap[int(rng.integers(n_racks))] /= 10
    return rack, die, cap


PROBE_ALL_BELOW = HerdConfig().probe_all_below
TREE_BLOCK = 64        # chunks per all_parents_standins call (any size gives the same trees)
DESIGNS = ("tree", "serial", "today")


def _poll_times() -> np.ndarray:
    """When a node asks its manifest source again, seconds after its first ask (the
    fetcher's schedule without jitter, up to its wait)."""
    cfg = HerdConfig()
    out, t = [0.0], 0.0
    for d in manifest_polls(cfg):
        t += d
        out.append(t)
        if t > cfg.wait_ms / 1000:
            return np.array(out)
    raise AssertionError("unreachable")


def _plan_times(view: PeerView, ck: np.ndarray, p: Params) -> np.ndarray:
    """[C] seconds after the manifest arrived at which each chunk's tree is planned, by
    one node (row 0) stepping the real planner with the fetcher's block sizes, in CPU-s
    of this thread (``time.thread_time``: other processes' load is not counted, though
    it still slows a thread through shared caches; see :func:`_measure`)."""
    cfg = HerdConfig()
    pl = Planner(view, 0, ck, k=p.k, rack_fanout=p.rack_fanout)
    at = np.zeros(len(ck))
    size = cfg.plan_first
    t0 = time.thread_time()
    lo = pl.step(size)
    at[:lo] = time.thread_time() - t0
    while pl.done < len(pl):
        size = min(size * 4, cfg.plan_block)
        hi = pl.step(size)
        at[lo:hi] = time.thread_time() - t0
        lo = hi
    return at


PLAN_REPS = 3          # planning measured this many times, alternating variants; the least kept


@dataclass
class _Planned:
    """One fan-out variant's planning costs (thread CPU-s, least of PLAN_REPS) and trees."""
    t_mplan: float
    plan_at: np.ndarray
    par_m: np.ndarray
    root_m: np.ndarray
    st_m: np.ndarray


def _measure(view: PeerView, table: PeerTable, me_id: str, mkeys: np.ndarray, ck: np.ndarray,
             ps: Sequence[Params]) -> tuple[float, list[_Planned]]:
    """The view's CPU-s and each variant's planning (the manifest's tree, then the chunks'
    blocks), measured PLAN_REPS times in turn (variants alternating, so load falls on all
    alike), the least of each kept: CPU-s of this thread, which other processes' load
    inflates only through shared caches and cores; the least of a few runs is the code's
    own cost on this machine."""
    t_view = math.inf
    best: list[tuple[float, float, np.ndarray]] = [(math.inf, 0.0, np.zeros(0))] * len(ps)
    for _ in range(PLAN_REPS):
        t = time.thread_time()
        peer_view(table, me_id)
        t_view = min(t_view, time.thread_time() - t)
        for i, q in enumerate(ps):
            t = time.thread_time()
            plan_node(view, 0, mkeys, k=q.k, rack_fanout=q.rack_fanout)
            t_m = time.thread_time() - t
            at = _plan_times(view, ck, q)
            if t_m + float(at[-1]) < best[i][0]:
                best[i] = (t_m + float(at[-1]), t_m, at)
    out = []
    for q, (_, t_m, at) in zip(ps, best, strict=True):
        par_m, _, root_m, st_m = all_parents_standins(view, mkeys, k=q.k, rack_fanout=q.rack_fanout)
        out.append(_Planned(t_m, at, par_m, root_m, st_m))
    return t_view, out


@dataclass
class _Run:
    """One design's simulation in a row, between its manifest and its results."""
    design: str
    base: str
    q: Params
    sim: Sim
    s_die: np.ndarray
    ideal: float
    have_m: np.ndarray
    start: np.ndarray
    overlap: bool
    plan_at: np.ndarray
    cpu_tree: float
    t_mplan: float
    probes: int
    manifest_origin: float

    finite: np.ndarray       # isfinite(start)


def design_fanout(design: str, p: Params) -> tuple[str, Params]:
    """``tree`` / ``serial`` / ``today``, or ``tree@M`` / ``serial@M`` (``@M:C``): the
    design with in-rack fan-out M (and serving cap C; else ``p2p.tree.serving_cap`` unless
    fixed). Returns (base design, params)."""
    base, _, spec = design.partition("@")
    m, _, c = spec.partition(":")
    if base not in DESIGNS or (spec and (base == "today" or not m.isdigit() or int(m) < 1
                                         or (c and (not c.isdigit() or int(c) < 1)))):
        raise ValueError(f"design {design!r}: tree, serial, today, or tree@M / serial@M[:C] (M, C >= 1)")
    return base, (p.with_fanout(int(m), int(c or 0)) if spec else p)


def run_row(p: Params, case: str, seed: int = 0, designs: Sequence[str] = DESIGNS) -> dict[str, Any]:
    t_wall = time.perf_counter()
    load0 = os.getloadavg()[0]
    n, C = p.nodes, p.chunks
    variants = [design_fanout(d, p) for d in designs]
    ids = [f"node-{i:05d}" for i in range(n)]
    rack, die, cap = _scenario(p, case, seed)
    labels = [f"z/b/r{int(r):05d}" for r in rack]
    view = PeerView.build(ids, ids, labels)
    # view rows == ids order (build keeps first-seen order)
    chunk_ids = [blake3.blake3(f"{seed}:{i}".encode()).hexdigest() for i in range(C)]
    manifest_id = blake3.blake3(f"{seed}:manifest".encode()).hexdigest()
    ck = chunk_keys(chunk_ids)
    mkeys = chunk_keys([manifest_id])
    size = C * p.chunk_bytes

    # ---- planning CPU, measured here, the way the fetcher plans: the view once, the
    # manifest's tree, then the chunks' trees block by block (p2p.tree.Planner, the same
    # block sizes as p2p.herd): plan_at[c] = when chunk c's tree is known, after the
    # manifest arrived
    # the view from the gang's PeerTable (what a fetcher in a gang is given), by the
    # fetcher's own function, node keys uncached
    table = PeerTable(node_ids=ids, data_urls=ids, rack_of=rack.tolist(),
                      racks=[f"z/b/r{r:05d}" for r in range(int(rack[-1]) + 1)],
                      rack_start=np.searchsorted(rack, np.arange(int(rack[-1]) + 1)).tolist())
    tree_ps = {q.rack_fanout: q for b, q in variants if b != "today"}
    t_view, planned_l = _measure(view, table, ids[0], mkeys, ck, list(tree_ps.values()))
    planned = dict(zip(tree_ps, planned_l, strict=True))
    cpu_today = 0.0
    homes_today: dict[str, str] = {}
    if any(b == "today" for b, _ in variants):
        peers = [Peer(node_id=i, data_url=i, zone="z", block="b", rack=lab.split("/")[2])
                 for i, lab in zip(ids, labels, strict=True)]
        sample = chunk_ids[: 2 if n > 5000 else 8]
        t = time.thread_time()
        for cid in sample:
            plan_sources(cid, ids[0], peers)
        cpu_today = (time.thread_time() - t) / len(sample) * C
        t = time.thread_time()
        homes_today = assign_homes([(c, int(p.chunk_bytes)) for c in chunk_ids], ids)
        cpu_today += time.thread_time() - t

    # a global home dying mid-transfer: the node that is home for the most chunks (the
    # homes do not depend on the in-rack fan-out)
    victim = -1
    if case == "home" and n > 1:
        _, tree_home, _ = all_parents(view, ck[: min(C, 256)], k=p.k, rack_fanout=p.rack_fanout)
        victim = int(np.argmax(np.bincount(tree_home, minlength=n)))
    out: dict[str, Any] = {"nodes": n, "rack_size": p.rack_size, "racks": int(rack[-1]) + 1, "case": case,
                           "chunks": C, "size_mib": round(size / (1 << 20), 1)}
    # each design's manifest first, then the chunks block by block, every design in
    # turn (their states are disjoint: the same results as one design after another),
    # so designs with the same trees (tree and serial) share each block's trees and
    # each chunk's levels
    runs: list[_Run] = []
    for design, (base, q) in zip(designs, variants, strict=True):
        s_die = die.copy()
        sim = Sim(q, rack, s_die, cap)
        ideal = size / sim.rate
        if victim >= 0:
            s_die[victim] = 0.5 * ideal
        t0 = np.zeros(n)
        # ---- the manifest
        cpu_tree = t_mplan = 0.0
        plan_at = np.zeros(C)
        overlap = False
        if base in ("tree", "serial"):
            pq = planned[q.rack_fanout]
            t_mplan, plan_at = pq.t_mplan, pq.plan_at
            cpu_tree = float(plan_at[-1])
            succ = [int(x) for x in pq.root_m[0, 1:3] if x >= 0]
            # every node builds its view and plans the manifest's tree before asking
            have_m = sim.transfer(pq.par_m[0], q.manifest_bytes, t0 + t_view + t_mplan, succ, cap=q.serve_cap,
                                  poll=_poll_times(), wait_s=HerdConfig().manifest_wait_ms / 1000,
                                  standin=pq.st_m[0])
            probes = n * (n - 1 if n <= PROBE_ALL_BELOW else q.rack_size - 1)
            # overlapped: chunk c once its block is planned (the planner has a core of its
            # own only with 2 or more); serial: every chunk after the whole plan
            overlap = base == "tree" and q.cores >= 2
            start = have_m + (plan_at[0] if overlap else cpu_tree)
        else:
            have_m = sim.transfer(np.full(n, -1), q.manifest_bytes, t0, [])
            probes = n * min(256, n - 1)
            start = have_m + cpu_today
        manifest_origin = sim.origin_bytes
        sim.t0 = np.where(np.isfinite(start), start, 0.0)
        sim.w_down[:] = 0.0
        sim.w_up[:] = 0.0
        runs.append(_Run(design, base, q, sim, s_die, ideal, have_m, start, overlap, plan_at, cpu_tree, t_mplan,
                         probes, manifest_origin, np.isfinite(start)))
    # designs with the same trees: (k, in-rack fan-out) -> their runs
    groups: dict[tuple[int, int], list[_Run]] = {}
    for run in runs:
        if run.base != "today":
            groups.setdefault((run.q.k, run.q.rack_fanout), []).append(run)
    rots = {key: Rotations(view, key[0]) for key in groups}
    # alive at the start: the same in every design (a victim dies later), which share levels
    alive0 = runs[0].s_die > 0
    if any(((run.s_die > 0) != alive0).any() for run in runs):
        raise AssertionError("designs of one row differ in who is alive at the start")
    today_keys = (np.array([node_key(nid) for nid in view.node_ids], dtype=np.uint64)
                  if any(run.base == "today" for run in runs) else np.zeros(0, np.uint64))
    today_runs = [run for run in runs if run.base == "today"]
    # stand-ins matter only where a parent can die
    need_st = not bool(np.isinf(runs[0].s_die).all()) if runs else False
    for lo in range(0, C, 256):
        hi = min(C, lo + 256)
        for (k, m), group in groups.items():
            # the trees in sub-blocks whose [chunks x nodes] arrays stay in cache (the same
            # trees: the rotations carry over)
            for slo in range(lo, hi, TREE_BLOCK):
                shi = min(hi, slo + TREE_BLOCK)
                par, _, root, st = all_parents_standins(view, ck[slo:shi], k=k, rack_fanout=m,
                                                        rotations=rots[(k, m)], standins=need_st)
                for i in range(shi - slo):
                    succ = [int(x) for x in root[i, 1:3] if x >= 0]
                    shared: dict[bytes, Levels] = {}       # filled by the first design to need them
                    for run in group:
                        ready = run.start
                        if run.overlap:
                            ready = np.where(run.finite, run.have_m + run.plan_at[slo + i], run.start)
                        have = run.sim.transfer(par[i], run.q.chunk_bytes, ready, succ, cap=run.q.serve_cap,
                                                standin=st[i] if need_st else None, levels=shared)
                        np.maximum(run.sim.done, have, out=run.sim.done)
        if today_runs:
            for parent, fallback in _today_parents(view, ck[lo:hi], chunk_ids[lo:hi], homes_today, rack, today_keys):
                parent[fallback] = -1                  # told 503: they read the origin instead
                lv: dict[bytes, Levels] = {}
                for run in today_runs:
                    have = run.sim.transfer(parent, run.q.chunk_bytes, run.start, [], levels=lv)
                    run.sim.busy_503 += len(fallback)
                    np.maximum(run.sim.done, have, out=run.sim.done)
    for run in runs:
        design, base, q, sim, s_die, ideal = run.design, run.base, run.q, run.sim, run.s_die, run.ideal
        have_m, cpu_tree, t_mplan, plan_at = run.have_m, run.cpu_tree, run.t_mplan, run.plan_at
        probes, manifest_origin = run.probes, run.manifest_origin
        alive = s_die == np.inf
        completion = float(sim.done[alive].max()) if alive.any() else 0.0
        n_racks = int(rack[-1]) + 1
        out[design] = {
            "completion_over_ideal": round(completion / ideal, 3),
            "origin_egress_over_size": round(sim.origin_bytes / size, 4),
            "manifest_origin_copies": round(manifest_origin / q.manifest_bytes, 2),
            "cross_rack_in_per_rack_over_size": round(sim.cross_bytes / max(n_racks, 1) / size, 3),
            "wasted_over_size": round(sim.wasted / size, 4),
            "busy_503": sim.busy_503,
            "have_probes": probes,
            "rack_fanout": q.rack_fanout if base != "today" else None,
            "serve_cap": q.serve_cap if base != "today" else None,
            "view_cpu_s": round(t_view, 4) if base != "today" else None,
            "plan_cpu_s_per_node": round(cpu_tree if base != "today" else cpu_today, 4),
            "plan_before_first_chunk_s": round(t_view + t_mplan + float(plan_at[0]) if base == "tree" and
                                               q.cores >= 2 else (t_view + t_mplan + cpu_tree
                                                                  if base != "today" else cpu_today), 4),
            "nodes_incomplete": int((~np.isfinite(sim.done[alive])).sum()),
            "manifest_last_s": round(float(have_m[alive & np.isfinite(have_m)].max()) if alive.any() else 0.0, 4),
        }
    out["ideal_s"] = round(size / min(p.link, p.cores * GIB / p.recv_cpu, p.cores * GIB / p.send_cpu), 3)
    out["sim_s"] = round(time.perf_counter() - t_wall, 1)
    # the machine's 1-minute load average before and after the row (planning is measured
    # in CPU-s of this thread, the least of PLAN_REPS runs, which load still inflates)
    out["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return out


def _today_parents(view: PeerView, ck: np.ndarray, cids: Sequence[str], homes: dict[str, str],
                   rack: np.ndarray, rkeys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Today's design: global home (assign_homes) -> every other rack's top node (waits
    on it; beyond 256 waiting the home answers 503 and the plan's next source is the
    origin) -> that rack's members. ``rkeys``: every row's rendezvous key
    (``p2p.rendezvous.node_key``, BLAKE3 of the id, as p2p.rendezvous ranks; the tree's
    member keys differ). Returns (parent, the rack homes told 503) per chunk."""
    R = len(view.racks)
    # today's rack homes: each rack's top node by rendezvous score (p2p.rendezvous.score:
    # splitmix64 of chunk key ^ node key, p2p.tree._mix), all chunks of the block at once
    grid = view.grid
    valid = grid >= 0
    sc = _mix_inplace(ck[:, None, None] ^ rkeys[np.maximum(grid, 0)][None, :, :])
    sc[:, ~valid] = 0
    # the top node (the first of the highest scores: a stable sort of ~score, first)
    rh_all = grid[np.arange(R)[None, :], np.argmax(sc, axis=2)]                           # [B, R]
    rack_of = view.rack_of
    out = []
    rng = np.random.default_rng(int(ck[0] & np.uint64(0xFFFF)) if len(ck) else 0)
    for i, cid in enumerate(cids):
        g = view.index[homes[cid]]
        gr = int(rack[g])
        rh = rh_all[i]
        # every member -> its rack's top node; the home's rack -> the home; the other
        # racks' top nodes -> the home
        par = rh[rack_of]
        par[grid[gr][grid[gr] >= 0]] = g
        others = np.concatenate((rh[:gr], rh[gr + 1:]))
        par[others] = g
        par[g] = -1
        # the home's wait budget: 256 waiters; the rest 503 -> origin
        fallback = np.zeros(0, np.int64)
        if len(others) > 256:
            fallback = rng.permutation(others)[256:]
        out.append((par, fallback))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.herd_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,64,1024,10000,25000,50000")
    ap.add_argument("--rack-size", default="18,32", help="GB200 racks of 18, H100 racks of 32")
    ap.add_argument("--cases", default="none,dead,home,slowrack")
    ap.add_argument("--size-mb", type=float, default=2048)
    ap.add_argument("--chunk-mb", type=float, default=1)
    ap.add_argument("--max-cells", type=float, default=52e6,
                    help="chunks x nodes per row at most (big rows get fewer chunks)")
    ap.add_argument("--link-gbit", type=float, default=100)
    ap.add_argument("--origin-gbit", type=float, default=100)
    ap.add_argument("--oversub", type=float, default=2)
    ap.add_argument("--k", type=int, default=HerdConfig().tree_k, help="child racks per rack (the fetcher's)")
    ap.add_argument("--rack-fanout", type=int, default=HerdConfig().rack_fanout,
                    help="rack-mates under one member (the fetcher's; designs tree@M compare others)")
    ap.add_argument("--serve-cap", type=int, default=0,
                    help="copies of one chunk a node sends at once (0: p2p.tree.serving_cap, k + 2 x fan-out)")
    ap.add_argument("--retry-ms", type=float, default=50)
    ap.add_argument("--recv-cpu", type=float, default=6.0, help="CPU-s per GiB received (loopback figure)")
    ap.add_argument("--send-cpu", type=float, default=0.9, help="CPU-s per GiB sent (loopback figure)")
    ap.add_argument("--cores", type=float, default=1.0)
    ap.add_argument("--manifest-bytes-per-chunk", type=float, default=75.0)
    ap.add_argument("--designs", default=",".join(DESIGNS),
                    help="tree (planning overlapped with the first transfers), serial (the same trees, "
                         "planned before any chunk moves: the design before), today (flat rendezvous)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        sweep = [int(x) for x in a.nodes.split(",") if x.strip()]
        racks = [int(x) for x in a.rack_size.split(",") if x.strip()]
    except ValueError:
        ap.error("--nodes/--rack-size: comma-separated integers")
    if not sweep or any(not 1 <= n <= 50000 for n in sweep):
        ap.error("--nodes: each between 1 and 50000")
    if not racks or any(r < 1 for r in racks):
        ap.error("--rack-size: positive integers")
    cases = [c for c in a.cases.split(",") if c]
    if any(c not in ("none", "dead", "home", "slowrack") for c in cases):
        ap.error("--cases: none, dead, home, slowrack")
    designs = [d for d in a.designs.split(",") if d]
    if not designs:
        ap.error("--designs: tree, serial, today, tree@M, serial@M")
    for d in designs:
        try:
            design_fanout(d, Params(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1))
        except ValueError as e:
            ap.error(f"--designs: {e}")
    if a.size_mb <= 0 or a.chunk_mb <= 0 or a.k < 1 or a.rack_fanout < 1:
        ap.error("--size-mb, --chunk-mb, --k, --rack-fanout must be positive")
    t0 = time.perf_counter()
    rows = []
    for rs in racks:
        for n in sweep:
            chunks = max(1, min(int(round(a.size_mb / a.chunk_mb)), int(a.max_cells // n)))
            p = Params(nodes=n, rack_size=min(rs, n), chunks=chunks, chunk_bytes=a.chunk_mb * (1 << 20),
                       manifest_bytes=a.manifest_bytes_per_chunk * chunks, link=a.link_gbit * 1e9 / 8,
                       origin=a.origin_gbit * 1e9 / 8, oversub=a.oversub, k=a.k, rack_fanout=a.rack_fanout,
                       serve_cap=a.serve_cap or serving_cap(a.k, a.rack_fanout), fixed_cap=a.serve_cap > 0, retry_s=a.retry_ms / 1000, recv_cpu=a.recv_cpu,
                       send_cpu=a.send_cpu, cores=a.cores)
            for case in cases:
                row = run_row(p, case, designs=designs)
                rows.append(row)
                figs = " ".join(f"{d} {row[d]['completion_over_ideal']}/{row[d]['origin_egress_over_size']}"
                                for d in designs)
                print(f"  {n} nodes racks of {rs} {case}: {row['sim_s']}s, load {row['load']}, T/ideal/egress "
                      f"{figs}", file=sys.stderr, flush=True)
    out = {"model": "chunk-level store-and-forward, FIFO resources, real tree/home functions",
           "designs": designs,
           "link_gbit": a.link_gbit, "origin_gbit": a.origin_gbit, "oversub": a.oversub, "k": a.k,
           "rack_fanout": a.rack_fanout, "serve_cap": a.serve_cap, "cpu_s_per_gib": [a.recv_cpu, a.send_cpu],
           "cores": a.cores, "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"herd sim: {a.size_mb:g} MiB in {a.chunk_mb:g} MiB chunks (big rows fewer), {a.link_gbit:g} Gbit/s "
          f"links, origin {a.origin_gbit:g} Gbit/s, spine {a.oversub:g}:1, k={a.k}, cap {a.serve_cap}, "
          f"CPU {a.recv_cpu:g}/{a.send_cpu:g} s/GiB on {a.cores:g} core(s)")
    head = f"{'nodes':>6} {'rack':>4} {'case':>8} {'chunks':>6} {'load':>11}"
    cols = f" | {{:>{8}}} {'T/ideal':>7} {'egress/S':>8} {'xrack/S':>7} {'503s':>7} {'plan s':>7} {'wait s':>6} {'mfst s':>6}"
    print(head + "".join(cols.format(d) for d in designs))
    for r in rows:
        line = f"{r['nodes']:>6} {r['rack_size']:>4} {r['case']:>8} {r['chunks']:>6} {r['load'][0]:>5.1f}-{r['load'][1]:<5.1f}"
        for d in designs:
            t = r[d]
            line += (f" | {'':>8} {t['completion_over_ideal']:>7.3f} {t['origin_egress_over_size']:>8.3f} "
                     f"{t['cross_rack_in_per_rack_over_size']:>7.3f} {t['busy_503']:>7} "
                     f"{t['plan_cpu_s_per_node']:>7.3f} {t['plan_before_first_chunk_s']:>6.3f} "
                     f"{t['manifest_last_s']:>6.3f}")
        print(line)
    print(f"({out['seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
