"""The order the tree planner deals a manifest's chunks in: homes balanced by bytes.

Why: :class:`p2p.tree.Rotations` deals a rack's chunks round-robin over its members, so
every member is rack home for the same number of chunks (+-1) -- not the same bytes.
Content-defined chunks vary (256 KiB to 4 MiB, standard deviation about half the mean
here), so with few chunks per member the busiest home of a rack of 8 holds ~1.2x the
mean bytes of a 256 MiB artifact (26 to 38 MiB), and its uplink, which sends each of its
chunks to every rack-mate, is the herd's tail (the namespace bench, ``python -m
bench.herd``: one home uploading alone for the last ~4 s). The relative spread falls as
1/sqrt(chunks per member): a few % at 10 GiB.

:func:`balanced_order` is a permutation of the chunk table to plan in: blocks of ``w``
consecutive chunks (``w`` = the rack's size: a round-robin deals each member exactly one
chunk of each block), each block's chunks handed out biggest first to the members with
the fewest bytes so far (longest processing time first, block by block). The planner
then deals them by count as before and each member ends within about one chunk's size
of the mean. Chunks move at most ``w - 1`` places, so the fetch still goes about in
manifest order. Pure and deterministic: every node computes the same order from the
same manifest and rack size, so the trees still agree.

Exact for the leaf duty of a rack of ``w`` members (a single-rack gang, the common
small herd); racks of another size, and the feeding duty of racks that feed others
(dealt apart), see another but no worse order in expectation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def balanced_order(sizes: Sequence[int] | np.ndarray, w: int) -> np.ndarray:
    """Positions to plan the chunks in (``order[p]`` = the manifest index planned at
    position ``p``), so that a round-robin by position over ``w`` members deals each about
    the same bytes. ``w`` <= 1 or no more than ``w`` chunks: the manifest's order."""
    s = np.asarray(sizes, dtype=np.int64)
    n = len(s)
    if w <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    out = np.empty(n, np.int64)
    load = np.zeros(w, np.int64)              # bytes dealt so far to residue class r = position mod w
    for b in range(0, n, w):
        k = min(w, n - b)
        blk = np.arange(b, b + k)
        biggest = blk[np.argsort(-s[blk], kind="stable")]
        free = (b + np.arange(k)) % w         # the residue classes this block's positions cover
        lightest = free[np.argsort(load[free], kind="stable")]
        out[b + (lightest - b) % w] = biggest
        load[lightest] += s[biggest]
    return out


__all__ = ["balanced_order"]
