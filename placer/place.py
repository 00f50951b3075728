"""Gang placement: a job of ``pods x gpus_per_pod`` onto the cluster, all or nothing.

Theory of operation
-------------------
1. *Pods that fit per node*: ``fits = free // gpus_per_pod`` (whole-node jobs: 1 where the
   node is entirely free and usable, else 0), zero on excluded nodes. One numpy pass.
2. *Capacity per domain* at the ``within`` level: ``np.add.reduceat(fits, starts)``.
   Feasible domains hold at least ``pods`` pods. (Pods are independent once a domain is
   chosen, so this test is exact: the placer finds a placement whenever one exists.)
3. *Best-fit domain*: least leftover free GPUs, then fewest partly used nodes left behind
   (a proxy for the fragmentation the placement adds), then topology order.
4. *Descend* from that domain level by level: if one child can hold the remaining pods,
   go into the tightest such child (least leftover pods); otherwise take the largest
   children whole until one more child suffices, and go into the tightest child that
   can hold the remainder. At the node level the tightest node wins. Only one child per
   level is partly used, so a gang spans as few sub-domains as possible and leaves whole
   sub-domains free. The loop runs over levels (at most five), never over nodes.
5. *Slots*: on each chosen node the lowest free usable slots, ``gpus_per_pod`` per pod.

Preemption is in :mod:`placer.preempt`; ``place`` calls it when nothing fits and
``allow_preemption`` is set. ``place`` is pure: it reads the model and returns a
:class:`Decision`; ``model.allocate(decision)`` applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .errors import Conflict, InvalidSpec
from .model import LEVELS, MAX_GPUS_PER_NODE, NODE_LEVEL, ClusterModel, level_index, row_count

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A gang to place. ``whole_nodes``: each pod takes one entire node (every GPU of it,
    which must all be usable and free; the node must have at least ``gpus_per_pod`` GPUs,
    0 meaning any size). ``prefer``: a level to try first (soft packing), finer than
    ``within``; falls back to ``within`` when it cannot be met without preemption."""

    job_id: str
    pods: int
    gpus_per_pod: int
    within: str = "any"
    priority: int = 0
    preemptible: bool = True
    prefer: str | None = None
    whole_nodes: bool = False

    def validate(self) -> None:
        if not isinstance(self.job_id, str) or not self.job_id:
            raise InvalidSpec(f"job id must be a non-empty string, got {self.job_id!r}")
        if not _is_int(self.pods) or self.pods < 1:
            raise InvalidSpec(f"job {self.job_id}: pods must be an int >= 1, got {self.pods!r}")
        lo = 0 if self.whole_nodes else 1
        if not _is_int(self.gpus_per_pod) or not (lo <= self.gpus_per_pod <= MAX_GPUS_PER_NODE):
            raise InvalidSpec(f"job {self.job_id}: gpus_per_pod must be an int in {lo}..{MAX_GPUS_PER_NODE}, "
                              f"got {self.gpus_per_pod!r}")
        if not _is_int(self.priority):
            raise InvalidSpec(f"job {self.job_id}: priority must be an int, got {self.priority!r}")
        wi = level_index(self.within)
        if self.prefer is not None:
            pi = level_index(self.prefer)
            if pi >= 0 and wi >= 0 and pi < wi:
                raise InvalidSpec(f"job {self.job_id}: prefer={self.prefer!r} is coarser than within={self.within!r}")

    @property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod


def _is_int(v: Any) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool)


class PodPlacement(msgspec.Struct, frozen=True):
    """Pod ``rank`` of a gang on ``node_id``, GPU ``slots`` (a msgspec Struct: a 25,000-pod
    gang materialises in milliseconds)."""
    rank: int
    node_id: str
    slots: tuple[int, ...]


class Decision:
    """Where a gang goes (and whom it preempts). Pods are held as arrays; :attr:`pods`
    materialises :class:`PodPlacement` objects on first use (cached).

    ``pod_nodes[r]`` is the node index of pod ``r`` in the model of ``epoch``;
    ``pod_slots[r]`` its slots (``-1`` padding for whole-node pods on smaller nodes).
    """

    __slots__ = ("job_id", "priority", "preemptible", "victims", "domain", "level",
                 "pod_nodes", "pod_slots", "epoch", "_node_ids", "_pods", "gpus_per_pod", "whole_nodes")

    def __init__(self, job_id: str, priority: int, preemptible: bool, victims: list[str],
                 domain: str | None, level: str, pod_nodes: np.ndarray, pod_slots: np.ndarray,
                 epoch: int, node_ids: list[str], gpus_per_pod: int = 0, whole_nodes: bool = False) -> None:
        self.gpus_per_pod = gpus_per_pod
        self.whole_nodes = whole_nodes
        self.job_id = job_id
        self.priority = priority
        self.preemptible = preemptible
        self.victims = victims
        self.domain = domain
        self.level = level
        self.pod_nodes = pod_nodes
        self.pod_slots = pod_slots
        self.epoch = epoch
        self._node_ids = node_ids
        self._pods: list[PodPlacement] | None = None

    @property
    def pods(self) -> list[PodPlacement]:
        if self._pods is None:
            ids = self._node_ids
            rows = self.pod_slots.tolist()
            if (self.pod_slots < 0).any():                 # whole-node pods on smaller nodes
                slots = [tuple(s for s in row if s >= 0) for row in rows]
            else:
                slots = list(map(tuple, rows))
            names = [ids[n] for n in self.pod_nodes.tolist()]
            self._pods = list(map(PodPlacement, range(len(names)), names, slots))
        return self._pods

    @property
    def n_gpus(self) -> int:
        return int((self.pod_slots >= 0).sum())

    @property
    def node_ids(self) -> list[str]:
        """The distinct nodes of the gang, in rank order."""
        seen: dict[str, None] = {}
        for n in self.pod_nodes.tolist():
            seen.setdefault(self._node_ids[n], None)
        return list(seen)

    def gpu_arrays(self, model: ClusterModel) -> tuple[np.ndarray, np.ndarray]:
        """Flat (node index, slot) arrays in ``model``'s current node order."""
        nodes = np.repeat(self.pod_nodes, self.pod_slots.shape[1]) if self.pod_slots.size else \
            np.zeros(0, np.int64)
        slots = self.pod_slots.reshape(-1)
        keep = slots >= 0
        nodes, slots = nodes[keep].astype(np.int64), slots[keep].astype(np.int64)
        if self.epoch != model.epoch:
            ids = self._node_ids
            try:
                nodes = np.fromiter((model.node_index(ids[n]) for n in nodes.tolist()), np.int64, nodes.size)
            except KeyError as e:
                raise Conflict(f"decision for {self.job_id!r} names a node that is gone: {e}") from None
        return nodes, slots

    def __repr__(self) -> str:
        return (f"Decision(job_id={self.job_id!r}, pods={len(self.pod_nodes)}, gpus={self.n_gpus}, "
                f"victims={self.victims!r}, domain={self.domain!r}, level={self.level!r})")


# ---------------------------------------------------------------------- the fast path

def pods_that_fit(model: ClusterModel, job: JobRequest, free: np.ndarray | None = None,
                  exclude: np.ndarray | None = None) -> np.ndarray:
    """Pods of ``job`` each node can take now (int64, one per node). ``free`` overrides the
    per-node free counts (the preemption path passes free + reclaimable)."""
    f = model.free if free is None else free
    if job.whole_nodes:
        fits = ((f == model.n_gpus) & (model.n_gpus >= max(job.gpus_per_pod, 1))).astype(np.int64)
    else:
        fits = f // job.gpus_per_pod
        fits = fits.astype(np.int64, copy=False)
    if exclude is not None:
        fits = np.where(exclude, 0, fits)
    return fits


def choose_domain(model: ClusterModel, fits: np.ndarray, li: int, pods: int,
                  free: np.ndarray) -> int | None:
    """Best-fit domain at level ``li`` (``-1``: the whole cluster) for ``pods`` pods, or None."""
    if li < 0:
        return 0 if int(fits.sum()) >= pods else None
    st = model.starts[li]
    per_node = st.size == fits.size          # this level's domains are single nodes
    cap = fits if per_node else np.add.reduceat(fits, st)
    cand = np.flatnonzero(cap >= pods)
    if cand.size == 0:
        return None
    if cand.size == 1:
        return int(cand[0])
    if per_node:
        # a node's leftover is its free GPUs minus what the pods take: the fewest free wins
        fc = free[cand]
        return int(cand[int(np.argmin(fc))])
    fd = np.add.reduceat(free.astype(np.int64), st)[cand]
    best = cand[fd == fd.min()]
    if best.size == 1:
        return int(best[0])
    # tie: fewest partly used nodes left behind
    partial = ((free > 0) & (free < model.n_gpus)).astype(np.int64)
    pd = np.add.reduceat(partial, st)[best]
    return int(best[int(np.argmin(pd))])


def descend(model: ClusterModel, fits: np.ndarray, li: int, dom: int, pods: int) -> tuple[np.ndarray, np.ndarray]:
    """Pick ``pods`` pods inside domain ``dom`` of level ``li`` (``-1``: the whole cluster).
    Returns (node indices, pods per node), nodes ascending."""
    full_ranges: list[tuple[np.ndarray, np.ndarray]] = []
    R = pods
    level = li
    leaf = -1
    while True:
        if level == NODE_LEVEL:
            leaf = dom
            break
        cl = level + 1
        if level < 0:
            c0, c1 = 0, model.starts[0].size
        else:
            c0, c1 = int(model.child_lo[level][dom]), int(model.child_hi[level][dom])
        cst = model.starts[cl][c0:c1]
        lo = int(cst[0])
        hi = int(model.ends[cl][c1 - 1])
        if cl == NODE_LEVEL:
            caps = fits[lo:hi]
        else:
            caps = np.add.reduceat(fits[lo:hi], cst - lo)
        ok = np.flatnonzero(caps >= R)
        if ok.size:
            j = int(ok[int(np.argmin(caps[ok]))])
            dom, level = c0 + j, cl
            continue
        order = np.argsort(-caps, kind="stable")
        cs = np.cumsum(caps[order])
        k = int(np.searchsorted(cs, R, side="left"))
        taken = int(cs[k - 1]) if k > 0 else 0
        R -= taken
        full = order[:k] + c0
        full_ranges.append((model.starts[cl][full], model.ends[cl][full]))
        rest = order[k:]
        rc = caps[rest]
        okr = np.flatnonzero(rc >= R)
        j = int(rest[int(okr[int(np.argmin(rc[okr]))])])
        dom, level = c0 + j, cl
    parts = []
    for a, b in full_ranges:
        if a.size == 0:
            continue
        lens = b - a
        idx = np.repeat(a - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(int(lens.sum()))
        parts.append(idx)
    if parts:
        nodes = np.concatenate(parts)
        nodes = nodes[fits[nodes] > 0]
        counts = fits[nodes]
        nodes = np.append(nodes, leaf)
        counts = np.append(counts, R)
        order = np.argsort(nodes, kind="stable")
        return nodes[order], counts[order]
    return np.array([leaf], np.int64), np.array([R], np.int64)


def assign_slots(model: ClusterModel, job: JobRequest, nodes: np.ndarray, counts: np.ndarray,
                 avail: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(pod node indices, pod slots) for ``counts[i]`` pods on ``nodes[i]``. ``avail``
    (rows for ``nodes``) overrides which slots may be taken."""
    if avail is None:
        avail = (model.owner[nodes] == -1) & model.usable[nodes]
    pod_nodes = np.repeat(nodes, counts)
    if job.whole_nodes:
        G = model.G
        slots = np.broadcast_to(np.arange(G), (nodes.size, G))
        slots = np.where(slots < model.n_gpus[nodes][:, None], slots, -1)
        return pod_nodes, slots.astype(np.int32)
    g = job.gpus_per_pod
    rank = np.cumsum(avail, axis=1)
    sel = avail & (rank <= (counts * g)[:, None])
    _, cols = np.nonzero(sel)
    return pod_nodes, cols.astype(np.int32).reshape(-1, g)


def place(model: ClusterModel, job: JobRequest, *, allow_preemption: bool = True,
          exclude: np.ndarray | None = None) -> Decision | None:
    """Place ``job`` or return None. Pure: ``model`` is not changed (a pending deferred
    rebuild may run). ``exclude``: bool per node (model order) of nodes not to use (the
    queue's reservations). With ``allow_preemption``, when nothing fits, victims of strictly
    lower priority and preemptible are chosen (see :mod:`placer.preempt`)."""
    job.validate()
    model._ensure()
    if model.n_nodes == 0:
        return None
    if job.prefer is not None and level_index(job.prefer) > level_index(job.within):
        d = _place_free(model, job, level_index(job.prefer), exclude)
        if d is not None:
            return d
    d = _place_free(model, job, level_index(job.within), exclude)
    if d is not None or not allow_preemption:
        return d
    from .preempt import place_with_preemption
    return place_with_preemption(model, job, exclude=exclude)


def fits_when_empty(model: ClusterModel, job: JobRequest) -> bool:
    """Could ``job`` ever be placed on this cluster as it stands (every usable GPU free)?
    False means it waits forever: a caller may refuse it at submission."""
    job.validate()
    model._ensure()
    if model.n_nodes == 0:
        return False
    cap = row_count(model.usable).astype(np.int32)
    fits = pods_that_fit(model, job, free=cap)
    return choose_domain(model, fits, level_index(job.within), job.pods, cap) is not None


def _place_free(model: ClusterModel, job: JobRequest, li: int, exclude: np.ndarray | None) -> Decision | None:
    fits = pods_that_fit(model, job, exclude=exclude)
    dom = choose_domain(model, fits, li, job.pods, model.free)
    if dom is None:
        return None
    nodes, counts = descend(model, fits, li, dom, job.pods)
    pod_nodes, pod_slots = assign_slots(model, job, nodes, counts)
    return make_decision(model, job, li, dom, pod_nodes, pod_slots, [])


def make_decision(model: ClusterModel, job: JobRequest, li: int, dom: int, pod_nodes: np.ndarray,
                  pod_slots: np.ndarray, victims: list[str]) -> Decision:
    level = "any" if li < 0 else LEVELS[li]
    domain = None if li < 0 else model.dom_names[li][dom]
    return Decision(job.job_id, job.priority, job.preemptible, victims, domain, level,
                    pod_nodes, pod_slots, model.epoch, model.node_ids, job.gpus_per_pod, job.whole_nodes)


def __getattr__(name: str) -> Any:
    # The fragmentation score and the defragmentation planner live in placer.frag (which
    # imports this module); reachable from here too for callers that look them up by name.
    if name in ("fragmentation", "largest_placeable", "plan_defrag", "DEFAULT_SHAPES"):
        from . import frag
        return getattr(frag, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
