"""Bounded fan-in chunk trees, computed once per manifest, vectorised. Pure.

Theory of operation
-------------------
Inputs are columnar (a :class:`PeerView`, built from the gang's ``PeerTable`` or from a
list of ``Peer``): node ids, their rack index, 64-bit keys. Nothing here depends on the
order of the rows, only on keys and on the manifest's chunk order, so every node
computes the same trees from the same membership and manifest.

For one chunk (key ``ck``, index ``i`` in the manifest's chunk table):

- **Rack order**: racks ranked by ``score(ck, rack_key)`` (rendezvous over racks). The
  rack at position ``q`` has parent rack at position ``(q - 1) // k``: a k-ary tree over
  racks in the chunk's order. Position 0 is the root rack.
- **Member order** inside a rack: the rack's members sorted by node key, rotated by the
  chunk's index in the manifest (plus a per-rack offset): rank ``j`` of chunk ``i`` is
  member ``(off_r + i + j) mod size``. Rank 0 is the rack home. A rotation, not
  rendezvous, on purpose: every member is rack home for the same number of chunks (+-1),
  so no rack home's uplink is the herd's tail (rendezvous leaves the busiest of 25,000
  nodes with ~1.7x the mean at 256 chunks). Member rank ``j > 0`` has in-rack parent
  rank ``(j - 1) // m`` (``m`` =
  ``rack_fanout``: with racks of at most ``m + 1`` nodes every member hangs off the rack
  home; bigger racks get a second small tree). The default is ``m = k``
  (:data:`RACK_FANOUT` = :data:`TREE_K`): a rack home sends a chunk to as many
  rack-mates as child racks, at most 2k copies in all (the data plane's serving cap),
  and racks of more than k + 1 nodes get the in-rack tree. Why: a node sends its
  children their copies one after another (store and forward), so the last of them
  waits its parent's whole fan-out; with m = 32 a rack home of a 32-node rack sent
  31 + 8 copies per chunk, the herd's tail at 50,000 nodes. ``bench.herd_sim``, every
  row, m = 32 (cap 40) against m = 8 (cap 24) in one run: 50,000 nodes in racks of 32
  1.305 -> 1.205 x ideal, every row without failures as good or better (<= 1.21);
  with failures racks of 32 within +-0.08, racks of 18 0.1-0.2 worse (a dead node's
  inner duty falls on fewer rack-mates; worst 1.466 at 50,000, 1 % dead), all <= 1.6.
- The root rack's home is the chunk's **global home**: the only node that reads the
  chunk from the origin. A rack home's parent is the home of its parent rack.
- **Successors**: ranks 1.. ``successors`` of the root rack. When the global home is
  dead, the first live successor reads the origin; every other node lists the
  successors after its ancestors, so the herd re-roots on them.
- **Stand-ins**: a node whose parent is dead asks the parent's stand-in next (a
  rack-mate of the parent, :func:`standin_rank`: for a rack home, one of its in-rack
  children picked by the chunk's key, shared by all its children; for a deeper
  parent, a rack-mate ranked below the asker picked by the chunk's key and the
  asker's rank), then the ancestors above. A dead rack home's children (its
  rack-mates and up to k child-rack homes) thus move to its rack-mates, spread over
  its chunks, instead of all to the next rack's home (which would then be asked by
  ~2x its serving cap and answer 503s); the cap leaves room for that
  (:func:`serving_cap`: k + 2m).

Invariants
----------
- The "waits on" relation is acyclic: a node waits (``?wait_ms=``) only on its
  ancestors in the tree, its parent's stand-in and successors; successor ``s_j`` waits
  only on the global home and ``s_1 .. s_{j-1}``; a successor's ancestors are the
  global home alone; a stand-in is a child of the rack home (waiting on it and up
  only) or ranks below the asker.
- Fan-in per chunk is bounded: a node is asked (with wait) by at most ``k`` child-rack
  homes plus ``m`` rack-mates, whatever the gang size; the data plane caps how many of
  them it serves at once (503 + Retry-After beyond that).
- Each chunk crosses into each rack once (to its rack home) when nobody fails.
- Work per node: O(chunks x racks) numpy for the rack order (one argsort per block of
  chunks, never a sort of the peer list per chunk), O(chunks x depth x rack size) for
  the homes of its ancestor racks. No per-chunk Python loop over peers.

``bench/herd_sim.py`` calls :func:`all_parents` (every node's parent for every chunk,
built from the same primitives as :func:`plan_node`); a test checks they agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from infra.peers import Peer, PeerTable

from .rendezvous import ORIGIN, Source, chunk_key, rack_label

_U = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 over a uint64 array (the same function as rendezvous.score)."""
    return _mix_inplace(x + _U(0))


def _mix_inplace(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` computed in ``x`` itself (uint64, overwritten, returned): one
    temporary instead of six, which matters at [chunks x racks]."""
    with np.errstate(over="ignore"):
        x += _U(0x9E3779B97F4A7C15)
        t = x >> _U(30)
        x ^= t
        x *= _U(0xBF58476D1CE4E5B9)
        np.right_shift(x, _U(27), out=t)
        x ^= t
        x *= _U(0x94D049BB133111EB)
        np.right_shift(x, _U(31), out=t)
        x ^= t
    return x


def id_keys(ids: Sequence[str]) -> np.ndarray:
    """A 64-bit key per node id (splitmix64 folded over its UTF-8 bytes, 8 at a time,
    and its length), vectorised: what orders a rack's members. Not the rendezvous key
    (``rendezvous.node_key``, BLAKE3 per id: ~1 us an id, 60 ms at 50,000 peers, before
    anything can be planned); any function every node computes alike will do here."""
    if not ids:
        return np.zeros(0, np.uint64)
    fast = _ascii_words(ids)
    if fast is not None:
        lens, w = fast
        h = _mix(lens ^ _U(0x6E6F64652D6B6579))
        for j in range(w.shape[1]):
            h = _mix_inplace(h ^ w[:, j])
        return h
    raw = [s.encode() for s in ids]
    lens = np.fromiter((len(b) for b in raw), np.uint64, len(raw))
    arr = np.array(raw, dtype=bytes)
    width = -(-max(arr.dtype.itemsize, 1) // 8) * 8
    words = np.zeros((len(raw), width), np.uint8)
    words[:, :arr.dtype.itemsize] = arr.view(np.uint8).reshape(len(raw), arr.dtype.itemsize)
    w = words.view("<u8")
    h = _mix(lens ^ _U(0x6E6F64652D6B6579))                   # "node-key"
    for j in range(w.shape[1]):
        h = _mix(h ^ w[:, j])
    return h


def _ascii_words(ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """ASCII ids as (lengths [N] uint64, little-endian words [N, W/8] of their bytes,
    zero-padded to W, a multiple of 8): what :func:`id_keys` folds, without a Python
    object per id. Ids of one length (the usual gang) are one join and a reshape; others
    are padded with ``ljust``. None: some id is not ASCII (the caller's general path)."""
    n = len(ids)
    first = len(ids[0])
    joined = "\0".join(ids)
    if len(joined) == n * (first + 1) - 1:             # maybe all of one length
        raw = joined.encode()
        if len(raw) != len(joined):
            return None
        buf = np.frombuffer(raw + b"\0", np.uint8).reshape(n, first + 1)
        if not buf[:, first].any() and int(np.count_nonzero(buf[:, :first])) == n * first:
            width = -(-max(first, 1) // 8) * 8
            words = np.zeros((n, width), np.uint8)
            words[:, :first] = buf[:, :first]
            return np.full(n, first, np.uint64), words.view("<u8")
    lens = np.fromiter(map(len, ids), np.uint64, n)
    width = -(-max(int(lens.max()), 1) // 8) * 8
    raw = "".join([s.ljust(width, "\0") for s in ids]).encode()
    if len(raw) != n * width:
        return None
    return lens, np.frombuffer(raw, np.uint8).reshape(n, width).view("<u8")


TREE_K = 8            # child racks per rack in a chunk's rack tree
RACK_FANOUT = TREE_K  # rack-mates under one member (see the module doc: m = k)


def serving_cap(k: int, m: int) -> int:
    """Copies of one chunk a node serves at once (the data plane's
    ``max_serving_per_chunk``): its tree children (k child racks' homes, m rack-mates)
    and, when it stands in for a dead rack home, that home's other m - 1 rack-mates
    (the rack-mates and the child racks share one stand-in per chunk:
    :func:`standin_rank`): k + 2m. With k + m the stand-in answered 503 to ~m askers,
    each back after Retry-After (50 ms, half the whole transfer at 50,000 nodes)."""
    return k + 2 * max(1, m)


def rack_key(label: str) -> int:
    """A rack's 64-bit rendezvous key: :func:`rack_keys` of one label."""
    return int(rack_keys([label])[0])


def rack_keys(labels: Sequence[str]) -> np.ndarray:
    """The racks' 64-bit rendezvous keys: :func:`id_keys` of ``"rack:" + label``,
    vectorised (BLAKE3 per label cost 2 ms at 1,563 racks, before the manifest could be
    asked for; any function every node computes alike will do)."""
    return id_keys(["rack:" + r for r in labels])


@dataclass(frozen=True, slots=True)
class PeerView:
    """A gang's peers, column by column (rows in any order; racks need not be contiguous).

    ``grid[r]`` holds rack r's rows, padded with -1 to the widest rack."""
    node_ids: list[str]
    urls: list[str]
    rack_of: np.ndarray          # row -> rack index (int64)
    racks: list[str]
    nkeys: np.ndarray            # row -> uint64 node key
    rkeys: np.ndarray            # rack -> uint64 rack key
    grid: np.ndarray             # [R, W] rows by node key, -1 padded
    index: Mapping[str, int]
    sizes: np.ndarray            # rack -> members
    offsets: np.ndarray          # rack -> rotation offset (from its key)

    def __len__(self) -> int:
        return len(self.node_ids)

    @classmethod
    def build(cls, node_ids: Sequence[str], urls: Sequence[str], rack_labels: Sequence[str]) -> PeerView:
        if not len(node_ids) == len(urls) == len(rack_labels):
            raise ValueError("PeerView.build: node_ids, urls and rack_labels differ in length")
        ids, us, labels = list(node_ids), list(urls), list(rack_labels)
        if len(set(ids)) < len(ids):            # repeated ids: the first row of each counts
            seen: set[str] = set()
            ids, us, labels = [], [], []
            for n, u, r in zip(node_ids, urls, rack_labels, strict=True):
                if n in seen:
                    continue
                seen.add(n)
                ids.append(n)
                us.append(u)
                labels.append(r)
        racks = sorted(set(labels))
        rpos = {r: i for i, r in enumerate(racks)}
        rack_of = np.array([rpos[r] for r in labels], dtype=np.int64)
        return cls._columns(ids, us, rack_of, racks)

    @classmethod
    def _columns(cls, ids: list[str], us: list[str], rack_of: np.ndarray, racks: list[str],
                 nkeys: np.ndarray | None = None) -> PeerView:
        """The view of unique ``ids`` whose racks are ``racks[rack_of]`` (``racks`` sorted,
        each used; ``nkeys``: :func:`id_keys` of ``ids`` when known): what :meth:`build` and
        :meth:`from_table` share."""
        counts = np.bincount(rack_of, minlength=len(racks)) if ids else np.zeros(0, np.int64)
        width = int(counts.max()) if len(counts) else 0
        grid = np.full((len(racks), max(width, 1)), -1, dtype=np.int64)
        order = np.argsort(rack_of, kind="stable")
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts
        col = np.arange(len(ids)) - starts[rack_of[order]] if ids else np.zeros(0, np.int64)
        grid[rack_of[order], col] = order
        if nkeys is None:
            nkeys = id_keys(ids)
        # each rack's members by node key (row order must not matter)
        gk = np.where(grid >= 0, nkeys[np.maximum(grid, 0)], np.uint64(np.iinfo(np.uint64).max))
        grid = np.take_along_axis(grid, np.argsort(gk, axis=1, kind="stable"), axis=1)
        rkeys = rack_keys(racks)
        return cls(ids, us, rack_of, racks, nkeys, rkeys, grid, _RowIndex(ids),
                   counts.astype(np.int64), (rkeys % np.maximum(counts, 1).astype(np.uint64)).astype(np.int64))

    def row_of(self, node_id: str) -> int:
        """``node_id``'s row (KeyError when absent), without building the id -> row map
        of every peer for one lookup."""
        return self.index.row(node_id) if isinstance(self.index, _RowIndex) else self.index[node_id]

    @classmethod
    def from_peers(cls, peers: Sequence[Peer], self_id: str | None = None,
                   self_rack: str | None = None) -> PeerView:
        ids = [p.node_id for p in peers]
        urls = [p.data_url for p in peers]
        labels = [rack_label(p) for p in peers]
        if self_id is not None and self_id not in ids:
            ids.append(self_id)
            urls.append("")
            labels.append(self_rack if self_rack is not None else "//")
        return cls.build(ids, urls, labels)

    @classmethod
    def from_table(cls, table: PeerTable, self_id: str | None = None, self_rack: str = "//") -> PeerView:
        """The view of a gang's ``PeerTable`` (``self_id`` appended in ``self_rack`` when the
        table lacks it): the same view as :meth:`build` over its rows and rack labels,
        without a label per row (the table's racks are already indexes)."""
        ids, urls, labels = list(table.node_ids), list(table.data_urls), list(table.racks)
        n = len(ids)
        if not len(urls) == len(table.rack_of) == n:
            raise ValueError("PeerTable: node_ids, data_urls and rack_of differ in length")
        rack_of = np.fromiter(table.rack_of, np.int64, n)
        if n and (int(rack_of.min()) < 0 or int(rack_of.max()) >= len(labels)):
            raise ValueError(f"PeerTable: rack_of must index its {len(labels)} racks")
        if self_id is not None and self_id not in ids:
            ids.append(self_id)
            urls.append("")
            if self_rack in labels:
                rack_of = np.append(rack_of, labels.index(self_rack))
            else:
                rack_of = np.append(rack_of, len(labels))
                labels.append(self_rack)
        # repeated ids or labels: what build() merges. Ids are checked by their keys first
        # (a sort of n uint64: 0.4 ms at 50,000, a set of the strings 2.6 ms); equal keys
        # only may be equal ids
        nkeys = id_keys(ids)
        sk = np.sort(nkeys)
        if ((sk[1:] == sk[:-1]).any() and len(set(ids)) < len(ids)) or len(set(labels)) < len(labels):
            return cls.build(ids, urls, [labels[r] for r in rack_of])
        used = np.flatnonzero(np.bincount(rack_of, minlength=len(labels)))
        by_label = sorted(used.tolist(), key=labels.__getitem__)
        remap = np.full(len(labels), -1, np.int64)
        remap[by_label] = np.arange(len(by_label))
        return cls._columns(ids, urls, remap[rack_of], [labels[i] for i in by_label], nkeys)


class _RowIndex(Mapping[str, int]):
    """node id -> row, built on first use (a dict of 50,000 ids costs ~5 ms, and the
    planner needs only this node's own row)."""
    __slots__ = ("_ids", "_map")

    def __init__(self, ids: list[str]) -> None:
        self._ids = ids
        self._map: dict[str, int] | None = None

    def _m(self) -> dict[str, int]:
        if self._map is None:
            self._map = dict(zip(self._ids, range(len(self._ids)), strict=True))
        return self._map

    def row(self, node_id: str) -> int:
        if self._map is not None:
            return self._map[node_id]
        try:
            return self._ids.index(node_id)
        except ValueError:
            raise KeyError(node_id) from None

    def __getitem__(self, node_id: str) -> int:
        return self._m()[node_id]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._m()

    def __iter__(self) -> Iterator[str]:
        return iter(self._m())

    def __len__(self) -> int:
        return len(self._ids)


def chunk_keys(chunk_ids: Sequence[str]) -> np.ndarray:
    return np.array([chunk_key(c) for c in chunk_ids], dtype=np.uint64)


# ---------------------------------------------------------------- primitives

def rack_positions(view: PeerView, ckeys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order [C, R]: the rack at each position, pos [C, R]: each rack's position)."""
    sc = _mix(ckeys[:, None] ^ view.rkeys[None, :])
    order = np.argsort(~sc, axis=1, kind="stable")          # descending score
    pos = np.empty_like(order)
    rows = np.arange(len(ckeys))[:, None]
    pos[rows, order] = np.arange(order.shape[1])[None, :]
    return order, pos


class Rotations:
    """Each rack's rotation index per chunk, over the manifest in order: a rack's chunks
    are of two duties — *feeding* (the root, or an inner rack of the rack tree: its
    home sends k copies across the spine) and *leaf* — and each duty's chunks are dealt
    round-robin over the rack's members, so every member gets the same share of each
    (+-1). Blocks must be fed in manifest order (the counts carry over)."""

    def __init__(self, view: PeerView, k: int) -> None:
        self.k = k
        self.counts = np.zeros((2, len(view.racks)), np.int64)
        self.half = view.sizes // 2
        self.offsets = view.offsets

    def block(self, pos: np.ndarray) -> np.ndarray:
        """[C, R] rotation index for a block of chunks, given their rack positions."""
        return self.block_feeding(pos * self.k + 1 < pos.shape[1])

    def block_at(self, feeding: np.ndarray, racks: np.ndarray) -> np.ndarray:
        """The rotation index of ``racks`` ([C, X] rack indexes) only, from the [C, R]
        feeding mask: what :meth:`block_feeding` gives at those racks, without the
        [C, R] arithmetic (one cumulative sum, then gathers)."""
        fe = np.take_along_axis(feeding, racks, axis=1)
        # feeding chunks of each needed rack before each chunk: a running count row by
        # row (R-wide adds in int32: cheaper than a [C, R] cumulative sum down columns)
        before = np.empty(racks.shape, np.int64)
        acc = np.zeros(feeding.shape[1], np.int32)
        for c in range(len(feeding)):
            before[c] = acc[racks[c]]
            acc += feeding[c]
        i = np.arange(len(feeding), dtype=np.int64)[:, None]
        out = np.where(fe, before + self.counts[1][racks] + self.half[racks],
                       i - before + self.counts[0][racks]) + self.offsets[racks]
        self.counts[1] += acc
        self.counts[0] += len(feeding) - acc
        return out

    def block_feeding(self, feeding: np.ndarray) -> np.ndarray:
        """The same from the [C, R] feeding mask (position * k + 1 < racks)."""
        f = feeding.astype(np.int64)
        before = np.cumsum(f, axis=0) - f                       # feeding chunks before this one
        i = np.arange(len(f), dtype=np.int64)[:, None]
        out = np.where(feeding, before + self.counts[1] + self.half, i - before + self.counts[0]) + self.offsets
        n_feed = f.sum(axis=0)
        self.counts[1] += n_feed
        self.counts[0] += len(f) - n_feed
        return out


def member_order(view: PeerView, rot: np.ndarray, racks: np.ndarray) -> np.ndarray:
    """Rows of each rack in ``racks`` ([C, D] rack indexes) ranked for its chunk, given
    the rack's rotation index ``rot`` ([C, D]): [C, D, W], -1 padded at the end.
    Column 0: the rack home."""
    rows = view.grid[racks]                                   # [C, D, W]
    w = np.maximum(view.sizes[racks], 1)[..., None]
    j = np.arange(rows.shape[2])[None, None, :]
    cols = (rot[..., None] + j) % w
    out = np.take_along_axis(rows, cols, axis=2)
    return np.where(j < view.sizes[racks][..., None], out, -1)


def rack_homes(view: PeerView, rot: np.ndarray, racks: np.ndarray) -> np.ndarray:
    """The home row of each rack in ``racks`` ([C, D]) given their rotation ``rot``."""
    rows = view.grid[racks]
    col = rot % np.maximum(view.sizes[racks], 1)
    return np.take_along_axis(rows, col[..., None], axis=2)[..., 0]


def depth_bound(n_racks: int, k: int) -> int:
    """Positions on the path from the deepest rack to the root, inclusive."""
    d, reach, level = 1, 1, 1
    while reach < n_racks:
        level *= k
        reach += level
        d += 1
    return d


# ---------------------------------------------------------------- one node's plan

@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node's sources for every chunk of a manifest (rows into ``view``).

    ``chain[c]``: rows to ask with wait, nearest first (the parent, its stand-in, the
    other in-rack ancestors, the rack homes of the ancestor racks up to the global home,
    then successors); -1 padded. ``standin[c]``: a rack-mate of the parent
    (:func:`standin_rank`; not this node), -1 when none: asked when the parent is dead,
    so a dead rack home's children move to a rack-mate of it, not all to the next rack
    up (which would be over its serving cap).
    ``siblings[c]``: rack-mates under the same parent, asked without waiting after a
    busy or missing parent. ``origin_rank[c]``: 0 for the global home, j for successor
    j, -1 for everyone else (the origin only once the tree above is exhausted)."""
    view: PeerView
    me: int
    home: np.ndarray
    parent: np.ndarray
    chain: np.ndarray
    siblings: np.ndarray
    origin_rank: np.ndarray
    standin: np.ndarray

    def is_home(self, c: int) -> bool:
        return bool(self.origin_rank[c] == 0)

    def sources(self, c: int, penalties: Mapping[str, float] | None = None, now: float = 0.0, *,
                last_round: bool = False) -> list[Source]:
        """Ranked sources for chunk ``c``: the live tree above, then — for the home, a
        successor whose predecessors are all dead, anyone whose every tree source is
        dead, or in the last round — the origin."""
        pen = penalties or {}
        v = self.view
        if self.origin_rank[c] == 0:
            return [ORIGIN]
        out: list[Source] = []
        cooling: list[Source] = []
        dead_above = 0
        first = True
        asked: set[int] = set()
        for row in self.chain[c]:
            if row < 0:
                break
            if row in asked:                   # the stand-in was a sibling already
                continue
            n = v.node_ids[row]
            until = pen.get(n, 0.0)
            if until > now:
                dead_above += 1
                if until != math.inf:
                    cooling.append(Source(kind="peer", node_id=n, url=v.urls[row], wait=True))
                continue
            out.append(Source(kind="peer", node_id=n, url=v.urls[row], wait=True))
            if first:
                first = False
                for srow in self.siblings[c]:
                    if srow < 0:
                        break
                    sn = v.node_ids[srow]
                    if pen.get(sn, 0.0) <= now:
                        asked.add(int(srow))
                        out.append(Source(kind="peer", node_id=sn, url=v.urls[srow], wait=False))
        tail = cooling + [ORIGIN] if (not out or last_round) else []
        return out + tail


class Planner:
    """One node's :class:`NodePlan`, filled block by block in manifest order, so a fetch
    can start on the first chunks while the rest is planned (the rotation counts carry
    from block to block, so the blocks' sizes do not change the result). ``done``:
    chunks planned so far (rows ``< done`` of the plan are final)."""

    CACHE_CELLS = 1 << 18          # chunks x racks scored at once (2 MiB of uint64)

    def __init__(self, view: PeerView, me: int, ckeys: np.ndarray, *, k: int = TREE_K, rack_fanout: int = RACK_FANOUT,
                 successors: int = 2, siblings: int = 2) -> None:
        C = len(ckeys)
        R = len(view.racks)
        self.view, self.me, self.ckeys = view, me, ckeys
        self.k, self.m, self.successors, self.siblings = k, max(1, rack_fanout), successors, siblings
        self.D = depth_bound(R, k)
        self.Din = depth_bound(view.grid.shape[1], self.m) - 1          # in-rack ancestors at most
        self.L = self.D + self.Din + 2 + successors
        self.plan = NodePlan(view, me, np.full(C, -1, np.int64), np.full(C, -1, np.int64),
                             np.full((C, self.L), -1, np.int64), np.full((C, max(siblings, 1)), -1, np.int64),
                             np.full(C, -1, np.int64), np.full(C, -1, np.int64))
        self.rots = Rotations(view, k)
        self.done = 0

    def __len__(self) -> int:
        return len(self.ckeys)

    def is_home(self, c: int) -> bool:
        """This node reads chunk ``c`` from the origin (``c`` planned already)."""
        return self.plan.is_home(c)

    def step(self, n: int) -> int:
        """Plan the next ``n`` chunks (fewer at the end); returns ``done``."""
        lo = self.done
        hi = min(len(self.ckeys), lo + max(1, n))
        # in sub-blocks whose [chunks x racks] scores fit in a core's cache (the same
        # result: the rotation counts carry over; ~2x faster at 2,800 racks than one
        # [1024 x R] pass through memory)
        sub = max(8, self.CACHE_CELLS // max(len(self.view.racks), 1))
        while lo < hi:
            top = min(hi, lo + sub)
            self._block(lo, top)
            self.done = lo = top
        return self.done

    def run(self, block: int = 1024) -> NodePlan:
        while self.done < len(self.ckeys):
            self.step(block)
        return self.plan

    def _block(self, lo: int, hi: int) -> None:
        view, me, k, m, D = self.view, self.me, self.k, self.m, self.D
        R = len(view.racks)
        ck = self.ckeys[lo:hi]
        n = len(ck)
        rows_n = np.arange(n)
        # Only the racks at the top of each chunk's order are needed in order (every
        # ancestor position is < F, the feeding positions): a partition, not a sort.
        nsc = _mix_inplace(ck[:, None] ^ view.rkeys[None, :])
        np.invert(nsc, out=nsc)                                 # ascending = best first
        feed_n = -(-(R - 1) // k) if R > 1 else 0
        top_n = max(feed_n, 1)
        my_rack = int(view.rack_of[me])
        p = (nsc < nsc[:, my_rack:my_rack + 1]).sum(axis=1)     # my rack's position
        order = _top_order(nsc, top_n)                          # [n, top_n]: racks at positions 0..
        feeding = np.zeros((n, R), dtype=bool)
        if feed_n:
            np.put_along_axis(feeding, order[:, :feed_n], True, axis=1)
        # ancestor positions of my rack: p, (p-1)//k, ... 0 (padded with -1)
        anc = np.full((n, D), -1, np.int64)
        for d in range(D):
            anc[:, d] = p
            p = np.where(p > 0, (p - 1) // k, -1)
        anc_racks = np.where(anc >= 0, np.take_along_axis(order, np.clip(anc, 0, top_n - 1), axis=1), 0)
        anc_racks[:, 0] = my_rack
        # rotations of just the racks this node needs: its ancestors' and the root's
        rot = self.rots.block_at(feeding, np.concatenate([anc_racks, order[:, :1]], axis=1))
        homes = rack_homes(view, rot[:, :D], anc_racks)                               # [n, D]
        homes = np.where(anc >= 0, homes, -1)
        mine = member_order(view, rot[:, :1], anc_racks[:, :1])[:, 0, :]               # [n, W]
        root = member_order(view, rot[:, D:], order[:, :1])[:, 0, :]
        jrank = np.argmax(mine == me, axis=1)
        g = root[:, 0]
        # in-rack ancestors: ranks (j-1)//m, ... up to the rack home (-1 once there)
        inrack = np.full((n, self.Din), -1, np.int64)
        j = jrank.copy()
        for d in range(self.Din):
            up = j > 0
            j = np.where(up, (j - 1) // m, j)
            inrack[:, d] = np.where(up, mine[rows_n, j], -1)
        S = self.successors
        succ = root[:, 1:1 + S]
        if succ.shape[1] < S:
            succ = np.concatenate([succ, np.full((n, S - succ.shape[1]), -1, np.int64)], axis=1)
        W = mine.shape[1]
        # the stand-in (see standin_rank): of my parent in my rack (not me); a rack
        # home's parent is the parent rack's home: its stand-in is in that rack
        sr = standin_rank(ck, (jrank - 1) // m, view.sizes[my_rack], m, rank=jrank)
        standin = np.where((jrank > 0) & (sr > 0) & (sr != jrank), mine[rows_n, np.clip(sr, 0, W - 1)], -1)
        if D > 1:
            prack = anc_racks[:, 1]
            psz = view.sizes[prack]
            q = standin_rank(ck, np.zeros(n, np.int64), psz, m)
            other = view.grid[prack, (rot[:, 1] + q) % np.maximum(psz, 1)]
            standin = np.where(jrank == 0, np.where((anc[:, 1] >= 0) & (q > 0), other, -1), standin)
        above = _compact(np.concatenate([inrack, homes[:, 1:]], axis=1))   # in-rack, then ancestor racks' homes
        above = np.concatenate([above[:, :1], np.where(above[:, :1] >= 0, standin[:, None], -1), above[:, 1:]],
                               axis=1)
        dup = (succ[:, :, None] == above[:, None, :]).any(axis=2)
        chain = np.concatenate([above, np.where(dup, -1, succ)], axis=1)
        # a successor waits on the home and the successors before it, nothing else
        is_succ = succ == me
        srank = np.where(is_succ.any(axis=1), np.argmax(is_succ, axis=1), -1)
        s_chain = np.concatenate([g[:, None], np.where(np.arange(S)[None, :] < srank[:, None], succ, -1)], axis=1)
        s_chain = np.concatenate([s_chain, np.full((n, chain.shape[1] - s_chain.shape[1]), -1, np.int64)],
                                 axis=1) if s_chain.shape[1] < chain.shape[1] else s_chain[:, :chain.shape[1]]
        chain = np.where((srank >= 0)[:, None], s_chain, chain)
        chain = np.where((g == me)[:, None], -1, chain)
        chain = _compact(chain)[:, :self.L]
        pl = self.plan
        pl.standin[lo:hi] = np.where((srank >= 0) | (g == me), -1, standin)
        pl.home[lo:hi] = g
        pl.chain[lo:hi, :chain.shape[1]] = chain
        pl.parent[lo:hi] = chain[:, 0] if chain.shape[1] else -1
        pl.origin_rank[lo:hi] = np.where(g == me, 0, np.where(srank >= 0, srank + 1, -1))
        if self.siblings > 0:
            par = (jrank - 1) // m
            cands = jrank[:, None] + np.array([-1, 1, -2, 2])[None, :]
            cc = np.clip(cands, 0, W - 1)
            vals = mine[rows_n[:, None], cc]
            ok = (jrank[:, None] > 0) & (cands > 0) & (cands < W) & (vals >= 0) & ((cands - 1) // m == par[:, None])
            sib = _compact(np.where(ok, vals, -1))[:, :self.siblings]
            pl.siblings[lo:hi, :sib.shape[1]] = sib


def standin_rank(ckeys: np.ndarray, parent_rank: np.ndarray, size: np.ndarray | int, m: int,
                 rank: np.ndarray | None = None) -> np.ndarray:
    """The rank (in its rack's order for the chunk) of the stand-in of a parent ranked
    ``parent_rank`` (r), 0 for none: a rank in 1 .. min(size - 1, m * max(r, 1)) chosen
    by the chunk's key (the next one when that is r itself). A rack home's (r = 0): one
    of its in-rack children; a deeper parent's: any rack-mate ranked below its children.
    A deeper parent's children (``rank``: theirs) each pick their own, so its copies
    too are spread: the dead node's upload falls on many rack-mates, not on one
    (a rack home's children share one stand-in, one of them, which keeps waits acyclic).
    So the chunks of a dead node are taken over by many rack-mates, not all by one
    (whose uplink would then carry two nodes' share: with rank r + 1 as a deeper
    parent's stand-in, a dead node's successor in the rotation took its inner duty for
    every chunk, 1.75x the mean upload at 64 nodes in racks of 32, m = 8).
    Waits stay acyclic: a rack home's children's stand-in is one of them, waiting on the
    rack home and up only; a deeper parent's stand-in ranks below the asker, and in-rack
    waits of nodes ranked above m go to lower ranks only."""
    size = np.asarray(size, np.int64)
    parent_rank = np.asarray(parent_rank, np.int64)
    span = np.maximum(np.minimum(size - 1, m * np.maximum(parent_rank, 1)), 0)
    # a key's high 32 bits scaled to [0, span): no 64-bit modulo per entry
    key = np.asarray(ckeys, np.uint64)
    if rank is not None:
        rank = np.asarray(rank, np.int64)
        span = np.where(parent_rank >= 1, np.minimum(size - 1, rank - 1), span)
        key = np.where(parent_rank >= 1, _mix(key ^ rank.astype(np.uint64)), key)
    pick = 1 + ((key >> _U(32)) * span.astype(np.uint64) >> _U(32)).astype(np.int64)
    pick = np.where(pick == parent_rank, pick % np.maximum(span, 1) + 1, pick)
    ok = (span >= 1) & (parent_rank >= 0) & (pick != parent_rank)
    return np.where(ok, pick, 0)


def _top_order(nsc: np.ndarray, top_n: int) -> np.ndarray:
    """The columns of each row's ``top_n`` smallest values, ascending, ties by column:
    exactly ``np.argsort(nsc, axis=1, kind="stable")[:, :top_n]``, faster. Each score
    keeps its high bits and carries its column in the low ones, so a partition and a
    plain sort of values (no argsort) order them; a row where two of its top_n + 1
    smallest scores share those high bits (odds ~ top_n x 2^-(64 - bits)) is ordered
    the exact way instead."""
    n, R = nsc.shape
    if top_n >= R:
        return np.argsort(nsc, axis=1, kind="stable")[:, :top_n]
    bits = max(int(R - 1).bit_length(), 1)
    low = _U((1 << bits) - 1)
    packed = nsc & ~low
    packed |= np.arange(R, dtype=np.uint64)[None, :]
    part = np.partition(packed, top_n, axis=1)           # [:, :top_n] the smallest, [:, top_n] the next
    top = np.sort(part[:, :top_n], axis=1)
    hi = top >> _U(bits)
    tie = (hi[:, 1:] == hi[:, :-1]).any(axis=1) if top_n > 1 else np.zeros(n, bool)
    tie |= hi[:, -1] == (part[:, top_n] >> _U(bits))
    order = (top & low).astype(np.int64)
    for r in np.flatnonzero(tie):
        order[r] = np.argsort(nsc[r], kind="stable")[:top_n]
    return order


def _compact(x: np.ndarray) -> np.ndarray:
    """Each row's non-negative entries moved to the front, in order; -1 after."""
    return np.take_along_axis(x, np.argsort(x < 0, axis=1, kind="stable"), axis=1)


def plan_node(view: PeerView, me: int, ckeys: np.ndarray, *, k: int = TREE_K, rack_fanout: int = RACK_FANOUT,
              successors: int = 2, siblings: int = 2, block: int = 1024) -> NodePlan:
    """Row ``me``'s plan for every chunk in ``ckeys``: the manifest's whole chunk table,
    in its order (the index is part of the tree; see the module doc). The same as a
    :class:`Planner` stepped in blocks of any size."""
    return Planner(view, me, ckeys, k=k, rack_fanout=rack_fanout, successors=successors,
                   siblings=siblings).run(block)


def all_parents(view: PeerView, ckeys: np.ndarray, *, k: int = TREE_K, rack_fanout: int = RACK_FANOUT,
                rotations: Rotations | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`all_parents_standins` without the stand-ins."""
    parent, home, root, _ = all_parents_standins(view, ckeys, k=k, rack_fanout=rack_fanout, rotations=rotations,
                                                 standins=False)
    return parent, home, root


def all_parents_standins(view: PeerView, ckeys: np.ndarray, *, k: int = TREE_K, rack_fanout: int = RACK_FANOUT,
                         rotations: Rotations | None = None, standins: bool = True
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every node's tree parent for every chunk, vectorised over chunks and nodes:
    (parent [C, N] rows, -1 for the global home; home [C]; the root rack's member order
    [C, W] (successors = columns 1..); stand-in [C, N], -1 for none: :func:`standin_rank`;
    ``standins`` False: [C, 0], not computed). ``ckeys``: the
    manifest's whole chunk table, or successive blocks of it sharing one ``rotations``.
    The same rules as :func:`plan_node`'s ``parent`` and ``standin`` (the simulator uses
    this; a test checks agreement).

    Computed over the members that are not rack homes only ([C, N - R], never
    [C, R, W]): which (rack, rank) slots exist does not depend on the chunk, a member at
    rank j of a rack rotated by ``rot`` is ``grid[r, (rot + j) mod size]`` (a doubled
    grid row: no modulo per member), and every rank-dependent rule (parent rank
    ``(j - 1) // m``, the deeper stand-in) is a table over slots."""
    C, N, R = len(ckeys), len(view), len(view.racks)
    m = max(1, rack_fanout)
    order, pos = rack_positions(view, ckeys)
    rot = (rotations or Rotations(view, k)).block(pos)
    sizes = view.sizes
    W = view.grid.shape[1]
    # the doubled grid: row r = its members, then its members again ([R, 2W], -1 padded)
    j2 = np.arange(2 * W)
    g2 = view.grid[np.arange(R)[:, None], j2[None, :] % np.maximum(sizes, 1)[:, None]]
    g2 = np.where(j2[None, :] < 2 * sizes[:, None], g2, -1).ravel()
    base = np.arange(R, dtype=np.int64) * (2 * W) + rot % np.maximum(sizes, 1)[None, :]     # [C, R]
    rhome = g2[base]                                                                          # [C, R]
    # slots (rack r, rank j >= 1) that exist
    jr = np.arange(W)
    slot = (jr[None, :] >= 1) & (jr[None, :] < sizes[:, None])
    rv, jv = np.nonzero(slot)
    prank = (jv - 1) // m
    brv = base[:, rv]                                                                         # [C, S]
    mem = g2[brv + jv[None, :]]                                                               # [C, S]
    ci = np.arange(C)[:, None]
    flat = (ci * N + mem).ravel()                   # each chunk's members that are not rack homes
    parent = np.full((C, N), -1, np.int64)
    parent.ravel()[flat] = g2[brv + prank[None, :]].ravel()
    # rack homes: parent = home of the parent rack
    ppos = np.where(pos > 0, (pos - 1) // k, 0)
    prack = np.take_along_axis(order, ppos, axis=1)                               # [C, R]
    phome = np.take_along_axis(rhome, prack, axis=1)
    c2 = np.broadcast_to(ci, (C, R))
    parent[c2, rhome] = np.where(pos > 0, phome, -1)
    o0 = order[:, 0]
    home = rhome[np.arange(C), o0]
    root = np.where(jr[None, :] < sizes[o0][:, None], g2[base[np.arange(C), o0][:, None] + jr[None, :]], -1)
    if not standins:
        return parent, home, root, np.zeros((C, 0), np.int64)
    # stand-ins (standin_rank): in-rack, of each node's parent (not the node itself); a
    # rack home's: of its parent rack's home
    q = standin_rank(np.broadcast_to(ckeys[:, None], (C, R)), np.zeros((C, R), np.int64), sizes[None, :], m)
    # a slot's stand-in rank depends on the chunk, its rank and its rack's size only:
    # computed once per distinct (rank, size), then gathered to the slots
    pair, inv = np.unique(jv * (W + 1) + sizes[rv], return_inverse=True)
    uj, us = pair // (W + 1), pair % (W + 1)
    sr = standin_rank(ckeys[:, None], ((uj - 1) // m)[None, :], us[None, :], m, rank=uj[None, :])[:, inv]   # [C, S]
    ok = (sr > 0) & (sr != jv[None, :])
    standin = np.full((C, N), -1, np.int64)
    standin.ravel()[flat] = np.where(ok, g2[brv + sr], -1).ravel()
    other = g2[base + q]                                                          # [C, R]: member at rank q
    other_p = np.take_along_axis(other, prack, axis=1)
    okh = (pos > 0) & (np.take_along_axis(q, prack, axis=1) > 0) & (other_p >= 0)
    standin[c2[okh], rhome[okh]] = other_p[okh]
    return parent, home, root, standin
