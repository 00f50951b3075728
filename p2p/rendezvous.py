"""Rendezvous (highest-random-weight) hashing and the herd's source choice. Pure.

Theory of operation
-------------------
Every node computes, for a chunk, the same score for every node of the peer set:
``score(chunk, node) = splitmix64(chunk_key ^ node_key)``. Sorting by score (ties by
node id) gives one global *order* for the chunk that every node agrees on without
talking. The first node of the order is the chunk's *home*: it alone fetches the chunk
from the origin. Every other node asks nodes ranked *above* it, waiting on their
in-flight download (``?wait_ms=``).

Rack awareness: the order restricted to one rack is the same order filtered, so the
highest-ranked node of each rack is that rack's home. A rack home asks the nodes above
it in the global order (the global home first); any other node asks its rack-mates
above it first (its rack home first), then the rest of the nodes above it. So each
chunk crosses into a rack about once.

Invariants
----------
- A node's waiting sources are always strictly above it in the global order, so the
  "who waits on whom" graph is acyclic: no deadlock, however homes fail.
- The home's list has no waiting peer source: it goes to the origin (after any peer
  known to hold the chunk already, asked without waiting).
- The origin is always last.
- Penalised nodes: banned ones (sent bad bytes) are dropped; ones cooling down (errors,
  stalls) are moved behind the healthy peers, before the origin.

Everything here is plain data in, plain data out: no sockets, clocks or trio; ``now``
is passed in. This is the flat design (``HerdConfig(tree=False)``); the herd's default is
the bounded fan-in trees of ``p2p.tree``, which reuse ``chunk_key``/``node_key`` and
the same score function, vectorised.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import blake3
import numpy as np

from infra.peers import Peer

_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=65536)
def node_key(node_id: str) -> int:
    """A node's 64-bit rendezvous key (BLAKE3 of its id)."""
    return int.from_bytes(blake3.blake3(node_id.encode()).digest(8), "big")


def chunk_key(chunk_id: str) -> int:
    """A chunk's 64-bit key. Chunk ids are BLAKE3 hex already; other strings are hashed."""
    try:
        if len(chunk_id) >= 16:
            return int(chunk_id[:16], 16)
    except ValueError:
        pass
    return int.from_bytes(blake3.blake3(chunk_id.encode()).digest(8), "big")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def score(ckey: int, nkey: int) -> int:
    return _splitmix64(ckey ^ nkey)


def scores_np(ckey: int, nkeys: np.ndarray) -> np.ndarray:
    """Vectorised :func:`score` over an array of uint64 node keys (same values)."""
    with np.errstate(over="ignore"):
        x = nkeys.astype(np.uint64) ^ np.uint64(ckey)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def order(chunk_id: str, node_ids: Sequence[str]) -> list[str]:
    """The chunk's global order over ``node_ids`` (home first). Duplicates collapse."""
    ck = chunk_key(chunk_id)
    uniq = dict.fromkeys(node_ids)
    return sorted(uniq, key=lambda n: (-score(ck, node_key(n)), n))


def assign_homes(chunks: Sequence[tuple[str, int]], node_ids: Sequence[str], *,
                 choices: int = 2) -> dict[str, str]:
    """Balanced homes for a whole manifest: each chunk, in manifest order, goes to the
    least-loaded (in bytes) of its top ``choices`` rendezvous nodes (ties: the higher
    ranked). Plain rendezvous leaves some homes with ~1.5x the average bytes to pull from
    the origin at small chunk counts, and the last home done is everyone's tail; two
    choices bring the worst home to about the average plus one chunk. Deterministic:
    every node computes the same map from the same manifest and peer set."""
    ids = list(dict.fromkeys(node_ids))
    if not ids:
        return {}
    keys = np.array([node_key(n) for n in ids], dtype=np.uint64)
    load = np.zeros(len(ids), dtype=np.int64)
    out: dict[str, str] = {}
    k = max(1, min(choices, len(ids)))
    for cid, size in chunks:
        if cid in out:
            continue
        sc = scores_np(chunk_key(cid), keys)
        top = np.argsort(sc)[::-1][:k]
        best = min(top.tolist(), key=lambda i: (int(load[i]), -int(sc[i])))
        out[cid] = ids[best]
        load[best] += size
    return out


def assign_rack_homes(chunks: Sequence[tuple[str, int]], members: Sequence[str],
                      global_homes: Mapping[str, str], *, n_racks: int = 1,
                      choices: int = 2) -> dict[str, str]:
    """Balanced rack homes for one rack's ``members``, the same way as
    :func:`assign_homes`: a chunk whose global home is in this rack has it as rack home;
    any other goes to the member with the least upload work among its top ``choices``.
    Upload work counts both roles: a global home sends each of its chunks to the other
    ``n_racks - 1`` racks, a rack home to its ``len(members) - 1`` rack-mates. The rack
    home feeds every rack-mate, so an overloaded one is the rack's bottleneck."""
    ids = list(dict.fromkeys(members))
    if not ids:
        return {}
    pos = {n: i for i, n in enumerate(ids)}
    keys = np.array([node_key(n) for n in ids], dtype=np.uint64)
    load = np.zeros(len(ids), dtype=np.int64)
    fan = max(len(ids) - 1, 0)
    for cid, size in dict(chunks).items():
        g = global_homes.get(cid)
        if g is not None and g in pos:
            load[pos[g]] += size * max(n_racks - 1, 0)
    out: dict[str, str] = {}
    k = max(1, min(choices, len(ids)))
    for cid, size in chunks:
        if cid in out:
            continue
        g = global_homes.get(cid)
        if g is not None and g in pos:
            best = pos[g]
        else:
            sc = scores_np(chunk_key(cid), keys)
            top = np.argsort(sc)[::-1][:k]
            best = min(top.tolist(), key=lambda i: (int(load[i]), -int(sc[i])))
        out[cid] = ids[best]
        load[best] += size * fan
    return out


def home(chunk_id: str, node_ids: Sequence[str]) -> str:
    return order(chunk_id, node_ids)[0]


def rack_homes(chunk_id: str, peers: Sequence[Peer]) -> dict[str, str]:
    """rack label -> the node that is that rack's home for the chunk."""
    by_id = {p.node_id: p for p in peers}
    out: dict[str, str] = {}
    for n in order(chunk_id, list(by_id)):
        out.setdefault(rack_label(by_id[n]), n)
    return out


def rack_label(p: Peer) -> str:
    """A rack is only unique inside its zone and block."""
    return f"{p.zone}/{p.block}/{p.rack}"


@dataclass(frozen=True, slots=True)
class Source:
    """Where to try a chunk next. ``wait``: ask with ``?wait_ms=`` (the node is fetching
    it or will), else ask once without waiting."""
    kind: Literal["peer", "origin"]
    node_id: str = ""
    url: str = ""
    wait: bool = False


ORIGIN = Source(kind="origin")


def plan_sources(chunk_id: str, self_id: str, peers: Sequence[Peer], *,
                 penalties: Mapping[str, float] | None = None, now: float = 0.0,
                 rack_aware: bool = True, holders: Collection[str] = (),
                 home: str | None = None, rack_home: str | None = None) -> list[Source]:
    """Ranked sources for one chunk as seen from ``self_id`` (see the module doc).

    ``penalties`` maps node id -> penalised-until time (``math.inf`` = banned for good);
    entries with until <= ``now`` are ignored. ``peers`` may or may not include this
    node; its rack is taken from its own entry when present. ``holders`` are nodes known
    to hold the chunk already (their have-bitmaps): they go first, asked without
    waiting; nodes ranked below us are asked only when they are holders. ``home``
    (from :func:`assign_homes`) moves that node to the front of the order, and
    ``rack_home`` (from :func:`assign_rack_homes`, for this node's rack) right after it.
    """
    by_id: dict[str, Peer] = {}
    for p in peers:
        by_id.setdefault(p.node_id, p)
    me = by_id.get(self_id)
    ids = list(by_id)
    if self_id not in by_id:
        ids.append(self_id)
    ranked = order(chunk_id, ids)
    for i, h in enumerate((home, rack_home if rack_home != home else None)):
        if h is not None and h in ranked:
            ranked.remove(h)
            ranked.insert(i, h)
    pos = ranked.index(self_id)
    above = [n for n in ranked[:pos]]
    below = [n for n in ranked[pos + 1:] if n in holders]

    topo = rack_aware and me is not None and any(p.rack for p in by_id.values())
    if topo and me is not None:
        my_rack = rack_label(me)

        def local(n: str) -> bool:
            return rack_label(by_id[n]) == my_rack
    else:
        def local(n: str) -> bool:
            return True

    # Same-rack holders, same-rack nodes above (waiting), then the other racks' holders
    # and nodes above: a chunk only leaves its rack when the rack cannot supply it.
    cands: list[tuple[str, bool]] = []
    for is_local in (True, False):
        cands += [(n, False) for n in above + below if local(n) == is_local and n in holders]
        cands += [(n, True) for n in above if local(n) == is_local and n not in holders]
    pen = penalties or {}
    good: list[Source] = []
    cooling: list[Source] = []
    for n, wait in cands:
        until = pen.get(n, 0.0)
        if until == math.inf:
            continue
        src = Source(kind="peer", node_id=n, url=by_id[n].data_url, wait=wait)
        (cooling if until > now else good).append(src)
    return good + cooling + [ORIGIN]


def is_home(chunk_id: str, self_id: str, peers: Sequence[Peer]) -> bool:
    """True when this node should fetch the chunk from the origin itself."""
    return all(s.kind == "origin" or not s.wait
               for s in plan_sources(chunk_id, self_id, peers))
