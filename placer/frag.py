"""Fragmentation score and a defragmentation planner.

Theory of operation
-------------------
The score is adapted from FGD (Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC 2023). FGD calls
the free GPUs of a node that cannot host a task of a typical shape "fragmented" for that
shape and weighs shapes by how often they occur. We lift it from nodes to topology
domains: a shape is ``(gpus, within)``; a domain at the ``within`` level can host a copy
if its nodes can take the shape's pods (pods of ``min(gpus, node size)`` GPUs). The free
GPUs of domains that cannot host a copy are fragmented for that shape. The score of a
level is the frequency-weighted fragmented share of all free GPUs over the shapes whose
``within`` is that level (0 = every free GPU is useful, 1 = none is); ``overall`` weighs
every shape. Shapes no empty domain of the cluster could host are left out (that is lack
of capacity, not fragmentation).

The planner proposes at most ``max_moves`` moves of small preemptible jobs out of partly
used domains (``level``, default rack) so those domains become wholly free. Jobs move
only into other partly used domains (never into wholly free ones, which would just swap
which domain is free). Domains are tried fewest-used-GPUs first; a domain's moves are kept only if every job in it found a
place elsewhere (in a scratch copy of the model, so the moves are valid applied in order:
``release(job_id)`` then ``allocate(move.to_decision)``). It never changes the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidSpec
from .model import LEVELS, NODE_LEVEL, ClusterModel, level_index, row_count
from .place import Decision, JobRequest, place


@dataclass(frozen=True, slots=True)
class Shape:
    gpus: int
    within: str
    freq: float


DEFAULT_SHAPES: tuple[Shape, ...] = (
    Shape(1, "node", 0.15), Shape(2, "node", 0.10), Shape(4, "node", 0.15), Shape(8, "node", 0.15),
    Shape(72, "nvlink", 0.05), Shape(64, "rack", 0.10), Shape(256, "rack", 0.05),
    Shape(1024, "block", 0.10), Shape(4096, "block", 0.05), Shape(32768, "zone", 0.05),
    Shape(131072, "any", 0.05),
)


def _shape_pods(model: ClusterModel, shape: Shape) -> tuple[int, int]:
    G = int(model.n_gpus.max()) if model.n_nodes else 0
    g = min(shape.gpus, G) if G else 0
    if g <= 0:
        return 0, 0
    return -(-shape.gpus // g), g


def fragmentation(model: ClusterModel, shapes: tuple[Shape, ...] | list[Shape] = DEFAULT_SHAPES) -> dict[str, float]:
    """Fragmented share of free GPUs per level (plus ``overall``); see the module docstring."""
    model._ensure()
    out: dict[str, float] = {}
    total_free = int(model.free.sum()) if model.n_nodes else 0
    acc: dict[str, list[float]] = {}
    cap_per_node = row_count(model.usable)
    for sh in shapes:
        if sh.freq < 0 or sh.gpus < 1:
            raise InvalidSpec(f"bad shape {sh!r}")
        li = level_index(sh.within)
        pods, g = _shape_pods(model, sh)
        if pods == 0:
            continue
        fits = (model.free // g).astype(np.int64)
        if li < 0:
            if int((cap_per_node // g).sum()) < pods:
                continue
            frag_free = total_free if int(fits.sum()) < pods else 0
        else:
            st = model.starts[li]
            if li == NODE_LEVEL:
                cap, empty, fd = fits, cap_per_node // g, model.free.astype(np.int64)
            else:
                cap = np.add.reduceat(fits, st)
                empty = np.add.reduceat(cap_per_node // g, st)
                fd = np.add.reduceat(model.free.astype(np.int64), st)
            if not (empty >= pods).any():
                continue
            frag_free = int(fd[cap < pods].sum())
        share = frag_free / total_free if total_free else 0.0
        a = acc.setdefault(sh.within, [0.0, 0.0])
        a[0] += sh.freq * share
        a[1] += sh.freq
    wsum = sum(a[1] for a in acc.values())
    for lv in ("any", *LEVELS):
        got = acc.get(lv)
        if got is not None and got[1] > 0:
            out[lv] = got[0] / got[1]
    out["overall"] = (sum(a[0] for a in acc.values()) / wsum) if wsum > 0 else 0.0
    return out


def largest_placeable(model: ClusterModel, gpus_per_pod: int | None = None) -> dict[str, int]:
    """Largest gang, in GPUs, placeable now inside one domain of each level (and ``any``),
    with pods of ``gpus_per_pod`` GPUs (default: the largest node size, i.e. whole-node pods)."""
    model._ensure()
    if model.n_nodes == 0:
        return {lv: 0 for lv in ("any", *LEVELS)}
    g = gpus_per_pod or int(model.n_gpus.max()) or 1
    per_node = (model.free // g).astype(np.int64) * g
    out = {"any": int(per_node.sum())}
    for li, lv in enumerate(LEVELS):
        out[lv] = int(per_node.max()) if li == NODE_LEVEL else int(np.add.reduceat(per_node, model.starts[li]).max())
    return out


@dataclass(frozen=True, slots=True)
class Move:
    """Move ``job_id`` off ``from_nodes``: release it, then allocate ``to_decision``."""
    job_id: str
    from_nodes: tuple[str, ...]
    to_decision: Decision


def plan_defrag(model: ClusterModel, max_moves: int, *, level: str = "rack",
                max_job_gpus: int = 64, max_domains: int = 64) -> list[Move]:
    """Propose at most ``max_moves`` moves that turn partly used ``level`` domains into wholly
    free ones. Only preemptible jobs of at most ``max_job_gpus`` GPUs with a known gang
    shape move; each move is valid when the previous ones are applied. Pure."""
    if max_moves < 0:
        raise InvalidSpec("max_moves must be >= 0")
    li = level_index(level)
    if li < 0:
        raise InvalidSpec("defragmentation needs a topology level, not 'any'")
    model._ensure()
    if max_moves == 0 or model.n_nodes == 0:
        return []
    st = model.starts[li]
    owner = model.owner
    owned = owner >= 0
    movable_job = (model.job_active & model.job_preemptible & (model.job_gpus <= max_job_gpus)
                   & (model.job_gpus > 0))
    shaped = np.zeros(movable_job.size, bool)
    for rec in model.jobs.values():
        if rec.pods > 0 and (rec.gpus_per_pod > 0 or rec.whole_nodes):
            shaped[rec.index] = True
    movable_job &= shaped
    movable_ext = np.append(movable_job, False)
    blocking = owned & ~movable_ext[owner]                         # owned by something that stays
    used = np.add.reduceat(row_count(owned), st)
    blocked = np.add.reduceat(row_count(blocking), st)
    all_usable = np.add.reduceat((model.usable | ~model.slot_exists).all(1).astype(np.int64), st) == \
        (model.ends[li] - st)
    cand = np.flatnonzero((used > 0) & (blocked == 0) & all_usable)
    if cand.size == 0:
        return []
    cand = cand[np.argsort(used[cand], kind="stable")][:max_domains]

    scratch = model.copy()
    # nothing moves into a wholly free domain (that would only swap which one is free) nor
    # into one being emptied
    frozen = np.repeat((used == 0) & all_usable, model.ends[li] - st)
    moves: list[Move] = []
    for dom in cand.tolist():
        lo, hi = int(st[dom]), int(model.ends[li][dom])
        jobs = np.unique(owner[lo:hi][owned[lo:hi]])
        if len(moves) + jobs.size > max_moves:
            continue
        trial = scratch.copy()
        ex = frozen.copy()
        ex[lo:hi] = True
        dom_moves: list[Move] = []
        ok = True
        for j in jobs.tolist():
            jid = model.job_id_of(j)
            if jid is None:
                ok = False
                break
            rec = trial.jobs[jid]
            from_nodes = tuple(sorted(rec.gpus_by_node))
            req = JobRequest(jid, rec.pods, rec.gpus_per_pod, within=rec.within, priority=rec.priority,
                             preemptible=rec.preemptible, whole_nodes=rec.whole_nodes)
            trial.release(jid)
            d = place(trial, req, allow_preemption=False, exclude=ex)
            if d is None:
                ok = False
                break
            trial.allocate(d)
            dom_moves.append(Move(jid, from_nodes, d))
        if ok:
            scratch = trial
            frozen[lo:hi] = True
            moves.extend(dom_moves)
        if len(moves) >= max_moves:
            break
    return moves
