"""The cluster model: every node and GPU of the fleet in a handful of numpy arrays.

Theory of operation
-------------------
Nodes are sorted by their topology path ``(zone, block, rack, nvlink domain, node)``, so
every domain at every level is a contiguous slice of node indices (:mod:`placer.topology`
builds the slices). For each level we keep
the start index of each domain (``starts[level]``, ready for ``np.add.reduceat``), the
domain of each node, and, for each domain, the range of its children one level finer.
Levels, coarse to fine, are ``zone > block > rack > nvlink > node``; the ``nvlink`` domain
is the NVLink clique (the rack of an NVL72 tray, whose spec carries ``nvlink_domain``)
or the node itself (an 8-GPU HGX node, ``nvlink_domain=None``).

Per (node, slot) we hold the owner (int32 job index, -1 free) and a ``usable`` mask
(slot exists, GPU healthy, node healthy and not draining). ``free[node]`` counts usable
free slots. Jobs live in a table (``jobs``: id -> :class:`Allocation`) and in small
parallel arrays indexed by job index (priority, preemptible, GPU count) that the
vectorised preemption path reads.

Invariants (checked by :meth:`ClusterModel.check_invariants`, used by the tests):

- ``owner[n, s] >= 0`` only for existing slots; each owned slot is listed exactly once,
  in its job's record; ``free == ((owner == -1) & usable).sum(1)``.
- domain slices are contiguous, nested and cover all nodes.

Mutations
---------
Incremental (O(touched GPUs)): :meth:`allocate`, :meth:`release`, :meth:`assign`,
:meth:`set_node_state`, :meth:`set_gpu_health`, and :meth:`upsert_node` of a known
node whose topology and GPU count are unchanged.
Rebuild (O(nodes log nodes), deferred): :meth:`upsert_node` of a new node or one that
moved or changed GPU count, :meth:`remove_node`. Those only mark the model dirty; the
rebuild runs once, at the next read, so registering 100,000 nodes one by one costs one
rebuild. Allocations, health and drain marks survive a rebuild.

While a rebuild is pending, per-node mutations of nodes already in the arrays (whose spec
did not change) apply to their current rows at once, and health or drain marks of nodes not
in the arrays are only remembered (the rebuild reads them): allocations are carried over by node
id, so they survive the rebuild. An ``assign`` to a node not yet in the arrays (a node
registering with workloads, after a placer restart) is checked against the node's spec and
the other pending assigns, and applied by the rebuild. So a fleet registering all at once,
workloads and all, costs one rebuild, not one per node.

One owner at a time: the model keeps reusable scratch arrays for the preemption path, so
two threads must not run ``place`` on the same model at once (copies are independent).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import Conflict, InvalidSpec, UnknownJob, UnknownNode
from .topology import (
    LEVELS,
    MAX_GPUS_PER_NODE,
    NODE_LEVEL,
    PREEMPT_BUCKETS,
    WITHIN,
    NodeSpec,
    build_domains,
    level_index,
    row_count,
)

__all__ = [
    "LEVELS", "MAX_GPUS_PER_NODE", "NODE_LEVEL", "PREEMPT_BUCKETS", "WITHIN", "Allocation", "ClusterModel",
    "NodeSpec", "level_index", "row_count",
]

log = logging.getLogger("herd.placer.model")

@dataclass(slots=True, eq=False)
class Allocation:
    """A job holding GPUs. ``nodes``/``slots`` are parallel arrays of node index and slot
    (node indices are those of the model's current order; a rebuild remaps them)."""

    job_id: str
    index: int
    priority: int
    preemptible: bool
    nodes: np.ndarray
    slots: np.ndarray
    node_ids: list[str] = field(repr=False, default_factory=list)
    # gang shape, when known (placed by this placer, or told by set_job_shape); defrag needs it
    pods: int = 0
    gpus_per_pod: int = 0
    within: str = "any"
    whole_nodes: bool = False
    # (buffer of nodes, of slots, the views of them last made ``nodes``/``slots``): see :meth:`extend`
    _room: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    def extend(self, nodes: np.ndarray, slots: np.ndarray) -> None:
        """Append GPUs, amortised: ``nodes``/``slots`` become prefix views of buffers with room
        (doubled when full), so a job given its GPUs node by node (a warm model's gang adopted
        pod by pod on promotion, a restarted placer's from each report) costs O(GPUs), not
        O(GPUs^2) of copies. Views handed out earlier keep their length and contents."""
        n, k = self.nodes.size, nodes.size
        room = self._room
        if room is not None and self.nodes is room[2] and self.slots is room[3] and room[0].size >= n + k:
            bn, bs = room[0], room[1]   # (still the views made last: nothing replaced them)
        else:   # (room to grow once it grew; a job given its GPUs in one step gets no more than those)
            cap = 2 * (n + k) if n else k
            bn, bs = np.empty(cap, np.int64), np.empty(cap, np.int64)
            bn[:n], bs[:n] = self.nodes, self.slots
        bn[n:n + k], bs[n:n + k] = nodes, slots
        self.nodes, self.slots = bn[:n + k], bs[:n + k]
        self._room = (bn, bs, self.nodes, self.slots)

    @property
    def n_gpus(self) -> int:
        return int(self.nodes.size)

    @property
    def gpus_by_node(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        for n, s in zip(self.nodes.tolist(), self.slots.tolist(), strict=True):
            out.setdefault(self.node_ids[n], []).append(s)
        return {k: tuple(sorted(v)) for k, v in out.items()}


class ClusterModel:
    """The fleet in numpy arrays. Build with :meth:`build`; see the module docstring."""

    def __init__(self) -> None:
        self._specs: dict[str, NodeSpec] = {}
        self._dirty = True
        self.epoch = 0
        self.rebuilds = 0
        # node state that survives rebuilds, by id
        self._node_healthy: dict[str, bool] = {}
        self._node_draining: dict[str, bool] = {}
        self._gpu_bad: dict[str, set[int]] = {}
        # arrays (filled by _rebuild)
        self._node_ids: list[str] = []
        self._index: dict[str, int] = {}
        self.G = 1
        self.n_gpus = np.zeros(0, np.int32)
        self.owner = np.full((0, 1), -1, np.int32)
        self.slot_exists = np.zeros((0, 1), bool)
        self.gpu_healthy = np.zeros((0, 1), bool)
        self.node_healthy = np.zeros(0, bool)
        self.node_draining = np.zeros(0, bool)
        self.usable = np.zeros((0, 1), bool)
        self.free = np.zeros(0, np.int32)
        self._unusable: int | None = None
        # reusable work arrays of the hot paths (never state: contents are scratch)
        self._scratch: dict[tuple[str, tuple[int, ...], str], np.ndarray] = {}
        self.starts: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        self.dom_of_node: list[np.ndarray] = []
        self.child_lo: list[np.ndarray] = []
        self.child_hi: list[np.ndarray] = []
        self.max_span: list[int] = []            # most nodes in one domain, per level
        self.dom_names: list[list[str]] = []
        # jobs
        self._jobs: dict[str, Allocation] = {}
        self._job_cap = 0
        self.job_priority = np.zeros(0, np.int64)
        self.job_preemptible = np.zeros(0, bool)
        self.job_gpus = np.zeros(0, np.int64)
        self.job_active = np.zeros(0, bool)
        self._job_ids: list[str | None] = []
        self._free_job_idx: list[int] = []
        self._grow_jobs(64)
        self._built: list[NodeSpec] = []          # spec of each row, as of the last rebuild
        # assigns to nodes not yet in the arrays: applied by the next rebuild
        self._pending: list[tuple[str, str, tuple[int, ...], int, bool]] = []
        self._pending_slots: dict[str, dict[int, str]] = {}
        self._pending_jobs: set[str] = set()

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, nodes: Iterable[NodeSpec]) -> ClusterModel:
        """A model of ``nodes`` (any order; duplicates are an error), all healthy and free."""
        m = cls()
        for spec in nodes:
            spec.validate()
            if spec.node_id in m._specs:
                raise InvalidSpec(f"duplicate node id {spec.node_id!r}")
            m._specs[spec.node_id] = spec
        m._dirty = True
        m._ensure()
        return m

    def _ensure(self) -> None:
        if self._dirty:
            self._rebuild()

    def _rebuild(self) -> None:
        specs = sorted(self._specs.values(), key=NodeSpec.sort_key)
        N = len(specs)
        G = max([s.n_gpus for s in specs], default=1) or 1
        old_ids, old_owner = self._node_ids, self.owner
        old_index = self._index
        node_ids = [s.node_id for s in specs]
        index = {nid: i for i, nid in enumerate(node_ids)}
        n_gpus = np.fromiter((s.n_gpus for s in specs), np.int32, N)
        slot_exists = np.arange(G)[None, :] < n_gpus[:, None]
        owner = np.full((N, G), -1, np.int32)
        # carry allocations over by node id
        if old_ids:
            new_rows = np.fromiter((old_index.get(nid, -1) for nid in node_ids), np.int64, N)
            keep = new_rows >= 0
            w = min(G, old_owner.shape[1])
            owner[keep, :w] = old_owner[new_rows[keep], :w]
            owner[~slot_exists] = -1
        gpu_healthy = slot_exists.copy()
        for nid, bad in self._gpu_bad.items():
            i = index.get(nid)
            if i is not None:
                for s in bad:
                    if s < G:
                        gpu_healthy[i, s] = False
        node_healthy = np.fromiter((self._node_healthy.get(n, True) for n in node_ids), bool, N)
        node_draining = np.fromiter((self._node_draining.get(n, False) for n in node_ids), bool, N)

        dom = build_domains(specs)
        self._node_ids, self._index, self.G = node_ids, index, G
        self.n_gpus, self.slot_exists, self.owner = n_gpus, slot_exists, owner
        self.gpu_healthy, self.node_healthy, self.node_draining = gpu_healthy, node_healthy, node_draining
        self.starts, self.ends, self.dom_of_node, self.dom_names = dom.starts, dom.ends, dom.dom_of_node, dom.names
        self.child_lo, self.child_hi, self.max_span = dom.child_lo, dom.child_hi, dom.max_span
        self._built = specs
        self._recompute_usable()
        self._rebuild_job_positions()
        self._dirty = False
        self.epoch += 1
        self.rebuilds += 1
        self._scratch = {}
        self._warm_scratch()
        pending, self._pending = self._pending, []
        self._pending_slots, self._pending_jobs = {}, set()
        for job_id, node_id, slots, priority, preemptible in pending:
            try:
                self.assign(job_id, node_id, slots, priority, preemptible)
            except (Conflict, InvalidSpec, UnknownNode) as e:  # checked when queued: cannot happen
                log.error("pending assign dropped job=%s node=%s: %s", job_id, node_id, e)
        log.debug("rebuilt nodes=%d gpus=%d jobs=%d", N, int(n_gpus.sum()), len(self._jobs))

    def scratch(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A reusable uninitialised work array (fresh large allocations page-fault on every
        call; reusing one does not). Callers own it only until their call returns."""
        key = (name, shape, np.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None:
            for k in [k for k in self._scratch if k[0] == name]:
                del self._scratch[k]
            buf = self._scratch[key] = np.empty(shape, dtype)
        return buf

    def _warm_scratch(self) -> None:
        """Allocate and touch the preemption path's work arrays now (after a rebuild or a
        copy) rather than in the first decision: fresh pages fault, and on some VMs that
        alone costs tens of milliseconds."""
        N, G = self.owner.shape
        for name, shape, dt in (("preempt.sb", (N, G), np.int8), ("preempt.eq", (N, G), np.bool_),
                                ("preempt.counts", (PREEMPT_BUCKETS + 2, N), np.uint8)):
            self.scratch(name, shape, dt).fill(0)

    def unusable_slots(self) -> int:
        """Existing-or-not slots that are not usable (cached until a health/drain change)."""
        if self._unusable is None:
            self._unusable = int(self.usable.size - np.count_nonzero(self.usable))
        return self._unusable

    def _recompute_usable(self, rows: np.ndarray | slice | None = None) -> None:
        self._unusable = None
        if rows is None:
            self.usable = (self.slot_exists & self.gpu_healthy
                           & (self.node_healthy & ~self.node_draining)[:, None])
            self.free = row_count((self.owner == -1) & self.usable).astype(np.int32)
        else:
            self.usable[rows] = (self.slot_exists[rows] & self.gpu_healthy[rows]
                                 & (self.node_healthy[rows] & ~self.node_draining[rows])[..., None])
            self.free[rows] = row_count((self.owner[rows] == -1) & self.usable[rows])

    def _rebuild_job_positions(self) -> None:
        """Re-derive every job's (nodes, slots) from the owner array (after a rebuild)."""
        nodes, slots = np.nonzero(self.owner >= 0)
        owners = self.owner[nodes, slots]
        order = np.argsort(owners, kind="stable")
        owners, nodes, slots = owners[order], nodes[order], slots[order]
        bounds = np.searchsorted(owners, np.arange(self._job_cap + 1))
        self.job_gpus[:] = 0
        for rec in self._jobs.values():
            a, b = bounds[rec.index], bounds[rec.index + 1]
            rec.nodes = nodes[a:b].astype(np.int64)
            rec.slots = slots[a:b].astype(np.int64)
            rec.node_ids = self._node_ids
            self.job_gpus[rec.index] = b - a

    # ------------------------------------------------------------------ node mutations

    def upsert_node(self, spec: NodeSpec) -> None:
        """Add a node or update one. Incremental when the node is known and its topology and
        GPU count are unchanged; otherwise a (deferred) rebuild."""
        spec.validate()
        old = self._specs.get(spec.node_id)
        self._specs[spec.node_id] = spec
        if old != spec:
            self._dirty = True

    def upsert_nodes(self, specs: Iterable[NodeSpec]) -> None:
        for s in specs:
            self.upsert_node(s)

    def remove_node(self, node_id: str) -> list[str]:
        """Remove a node (deferred rebuild). Jobs holding GPUs there lose those GPUs (they
        stay in the table with what is left). Returns the ids of those jobs."""
        self._ensure()
        i = self._idx(node_id)
        owners = np.unique(self.owner[i][self.owner[i] >= 0])
        # its GPUs leave with it: a node re-added before the rebuild must not inherit them
        self.owner[i, :] = -1
        del self._specs[node_id]
        self._node_healthy.pop(node_id, None)
        self._node_draining.pop(node_id, None)
        self._gpu_bad.pop(node_id, None)
        self._dirty = True
        return [self._job_ids[j] for j in owners.tolist() if self._job_ids[j] is not None]

    def set_node_state(self, node_id: str, healthy: bool, draining: bool = False) -> None:
        """Mark a node healthy/unhealthy and draining or not (incremental). Allocations stay;
        an unhealthy or draining node is never used for new placements."""
        i = self._row(node_id)
        if i is None and self._dirty and node_id in self._specs:
            # not in the arrays (yet, or as it is now): the next rebuild reads these marks
            self._node_healthy[node_id] = bool(healthy)
            self._node_draining[node_id] = bool(draining)
            return
        i = self._ensure_row(node_id)
        self._node_healthy[node_id] = bool(healthy)
        self._node_draining[node_id] = bool(draining)
        if self.node_healthy[i] == bool(healthy) and self.node_draining[i] == bool(draining):
            return   # (unchanged: a node heard again, the common case; its usable GPUs stand)
        self.node_healthy[i] = bool(healthy)
        self.node_draining[i] = bool(draining)
        self._recompute_usable(np.array([i]))

    def set_gpu_health(self, node_id: str, slot: int, healthy: bool) -> None:
        """Mark one GPU healthy or not (incremental). Its owner, if any, keeps it."""
        i = self._row(node_id)
        if i is None and self._dirty and node_id in self._specs:
            n = self._specs[node_id].n_gpus  # not in the arrays yet: the next rebuild reads the mark
            if not isinstance(slot, int) or not (0 <= slot < n):
                raise InvalidSpec(f"node {node_id} has no GPU slot {slot!r} (it has {n})")
            bad = self._gpu_bad.setdefault(node_id, set())
            if healthy:
                bad.discard(slot)
            else:
                bad.add(slot)
            return
        i = self._ensure_row(node_id)
        if not isinstance(slot, int) or not (0 <= slot < int(self.n_gpus[i])):
            raise InvalidSpec(f"node {node_id} has no GPU slot {slot!r} (it has {int(self.n_gpus[i])})")
        bad = self._gpu_bad.setdefault(node_id, set())
        if healthy:
            bad.discard(slot)
        else:
            bad.add(slot)
        self.gpu_healthy[i, slot] = bool(healthy)
        self._recompute_usable(np.array([i]))

    # ------------------------------------------------------------------ queries

    def _row(self, node_id: str) -> int | None:
        """The node's row if it is valid without a rebuild (present, spec unchanged)."""
        i = self._index.get(node_id)
        if i is not None and (not self._dirty or self._built[i] == self._specs.get(node_id)):
            return i
        return None

    def _ensure_row(self, node_id: str) -> int:
        i = self._row(node_id)
        if i is None:
            self._ensure()
            i = self._idx(node_id)
        return i

    @property
    def needs_rebuild(self) -> bool:
        return self._dirty

    def _idx(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise UnknownNode(f"unknown node {node_id!r}") from None

    def node_index(self, node_id: str) -> int:
        self._ensure()
        return self._idx(node_id)

    def rack_runs(self, idx: np.ndarray) -> tuple[list[str], list[int], list[int]]:
        """Nodes ``idx`` (indices of this model, ascending: topology order) by rack: (each
        rack's path "zone/block/rack", in order; the position in ``idx`` where each begins;
        each node's rack, as an index into the first list). Array passes, no loop a node."""
        self._ensure()
        d = self.dom_of_node[LEVELS.index("rack")][idx]
        new = np.diff(d, prepend=-1) != 0
        starts = np.flatnonzero(new)
        names = self.dom_names[LEVELS.index("rack")]
        return [names[r] for r in d[starts].tolist()], starts.tolist(), (np.cumsum(new) - 1).tolist()

    @property
    def node_ids(self) -> list[str]:
        """Node ids in topology order (do not mutate)."""
        self._ensure()
        return self._node_ids

    @property
    def gpus_per_node(self) -> np.ndarray:
        self._ensure()
        return self.n_gpus

    @property
    def n_nodes(self) -> int:
        self._ensure()
        return len(self._node_ids)

    def spec(self, node_id: str) -> NodeSpec:
        try:
            return self._specs[node_id]
        except KeyError:
            raise UnknownNode(f"unknown node {node_id!r}") from None

    def has_node(self, node_id: str) -> bool:
        return node_id in self._specs

    def free_gpus(self, node_id: str) -> list[int]:
        """Usable free slots of a node."""
        i = self._ensure_row(node_id)
        return np.flatnonzero((self.owner[i] == -1) & self.usable[i]).tolist()

    def domain_of(self, node_id: str, level: str) -> str:
        self._ensure()
        li = level_index(level)
        if li < 0:
            return "any"
        return self.dom_names[li][int(self.dom_of_node[li][self._idx(node_id)])]

    @property
    def jobs(self) -> dict[str, Allocation]:
        """Job id -> record (read only; mutate through allocate/assign/release)."""
        self._ensure()
        return self._jobs

    def job(self, job_id: str) -> Allocation:
        self._ensure()
        try:
            return self._jobs[job_id]
        except KeyError:
            raise UnknownJob(f"unknown job {job_id!r}") from None

    def owner_of(self, node_id: str, slot: int) -> str | None:
        self._ensure()
        j = int(self.owner[self._idx(node_id), slot])
        return None if j < 0 else self._job_ids[j]

    def job_id_of(self, index: int) -> str | None:
        return self._job_ids[index] if 0 <= index < len(self._job_ids) else None

    # ------------------------------------------------------------------ jobs

    def _grow_jobs(self, cap: int) -> None:
        old = self._job_cap
        if cap <= old:
            return

        def grow(a: np.ndarray, fill: Any) -> np.ndarray:
            b = np.full(cap, fill, a.dtype)
            b[:old] = a[:old]
            return b
        self.job_priority = grow(self.job_priority, 0)
        self.job_preemptible = grow(self.job_preemptible, False)
        self.job_gpus = grow(self.job_gpus, 0)
        self.job_active = grow(self.job_active, False)
        self._job_ids.extend([None] * (cap - old))
        self._free_job_idx.extend(range(cap - 1, old - 1, -1))
        self._job_cap = cap

    def _new_job(self, job_id: str, priority: int, preemptible: bool) -> Allocation:
        if not isinstance(job_id, str) or not job_id:
            raise InvalidSpec(f"job id must be a non-empty string, got {job_id!r}")
        if not self._free_job_idx:
            self._grow_jobs(self._job_cap * 2)
        j = self._free_job_idx.pop()
        self._job_ids[j] = job_id
        self.job_priority[j] = int(priority)
        self.job_preemptible[j] = bool(preemptible)
        self.job_gpus[j] = 0
        self.job_active[j] = True
        rec = Allocation(job_id, j, int(priority), bool(preemptible),
                        np.zeros(0, np.int64), np.zeros(0, np.int64), self._node_ids)
        self._jobs[job_id] = rec
        return rec

    def allocate(self, decision: Any) -> None:
        """Apply a :class:`placer.place.Decision`: release its victims, then give its pods'
        GPUs to the job. Checked first: the job id must be new, every target GPU usable
        and free (or held by a victim). On any failure nothing changes (:class:`Conflict`)."""
        self._ensure()
        if decision.job_id in self._jobs:
            raise Conflict(f"job {decision.job_id!r} already holds GPUs")
        nodes, slots = decision.gpu_arrays(self)
        victims = [v for v in decision.victims if v in self._jobs]
        if nodes.size:
            own = self.owner[nodes, slots]
            ok = own == -1
            if victims:
                vmask = np.zeros(self._job_cap + 1, bool)
                vmask[[self._jobs[v].index for v in victims]] = True
                ok |= vmask[own]
            if not ok.all():
                raise Conflict(f"decision for {decision.job_id!r} is stale: some GPUs are no longer free")
            if not self.usable[nodes, slots].all():
                raise Conflict(f"decision for {decision.job_id!r} is stale: some GPUs are no longer usable")
            if self._named_twice(nodes, slots):
                raise Conflict(f"decision for {decision.job_id!r} names a GPU twice")
        self.release_many(victims)   # (one vector step over every victim's GPUs, not one a victim)
        rec = self._new_job(decision.job_id, decision.priority, decision.preemptible)
        rec.pods = len(decision.pod_nodes)
        rec.gpus_per_pod = int(getattr(decision, "gpus_per_pod", 0))
        rec.within = decision.level
        rec.whole_nodes = bool(getattr(decision, "whole_nodes", False))
        self._give(rec, nodes, slots)

    def set_job_shape(self, job_id: str, pods: int, gpus_per_pod: int, within: str = "any",
                      whole_nodes: bool = False) -> None:
        """Record a job's gang shape (after a restart, when allocations came from reports)."""
        rec = self.job(job_id)
        level_index(within)
        rec.pods, rec.gpus_per_pod, rec.within, rec.whole_nodes = int(pods), int(gpus_per_pod), within, bool(whole_nodes)

    def _named_twice(self, nodes: np.ndarray, slots: np.ndarray) -> bool:
        """Does (nodes, slots) name a GPU more than once? O(n), via a scratch mask."""
        # write each pair's position; with a repeat the later write wins, so some pair
        # reads back a position that is not its own (only the cells just written are read)
        stamp = self.scratch("model.stamp", self.owner.shape, np.int32)
        pos = np.arange(nodes.size, dtype=np.int32)
        stamp[nodes, slots] = pos
        return bool((stamp[nodes, slots] != pos).any())

    def _give(self, rec: Allocation, nodes: np.ndarray, slots: np.ndarray) -> None:
        self.owner[nodes, slots] = rec.index
        rec.extend(nodes, slots)
        self.job_gpus[rec.index] = rec.nodes.size
        np.subtract.at(self.free, nodes, self.usable[nodes, slots].astype(np.int32))

    def assign(self, job_id: str, node_id: str, slots: Sequence[int], priority: int,
               preemptible: bool) -> None:
        """Record that ``job_id`` holds ``slots`` on ``node_id`` (rebuilding allocations from
        agents' reports). Creates the job if new; idempotent for slots it already holds;
        a slot held by another job is a :class:`Conflict`. Unhealthy GPUs may be assigned
        (the report is the truth); missing slots may not."""
        i = self._row(node_id)
        if i is None and self._dirty and node_id not in self._index and node_id in self._specs:
            self._queue_assign(job_id, node_id, tuple(int(s) for s in slots), priority, preemptible)
            return
        if i is None:
            self._ensure()
            i = self._idx(node_id)
        sl = np.asarray(list(slots), np.int64)
        if sl.size and (sl.min() < 0 or sl.max() >= int(self.n_gpus[i])):
            raise InvalidSpec(f"node {node_id} has no GPU slot among {list(slots)}")
        if np.unique(sl).size != sl.size:
            raise InvalidSpec(f"slots for job {job_id!r} on {node_id} repeat: {list(slots)}")
        rec = self._jobs.get(job_id)
        own = self.owner[i, sl]
        mine = rec.index if rec is not None else -2
        if ((own != -1) & (own != mine)).any():
            holders = {self._job_ids[j] for j in own.tolist() if j not in (-1, mine)}
            raise Conflict(f"GPUs {list(slots)} of {node_id} are held by {sorted(h for h in holders if h)}")
        if rec is None:
            rec = self._new_job(job_id, priority, preemptible)
        else:
            rec.priority, rec.preemptible = int(priority), bool(preemptible)
            self.job_priority[rec.index] = int(priority)
            self.job_preemptible[rec.index] = bool(preemptible)
        new = sl[own == -1]
        if new.size:
            self._give(rec, np.full(new.size, i, np.int64), new)

    def _queue_assign(self, job_id: str, node_id: str, slots: tuple[int, ...], priority: int,
                      preemptible: bool) -> None:
        """An assign to a node the next rebuild adds: checked now, applied then."""
        n = self._specs[node_id].n_gpus
        if any(s < 0 or s >= n for s in slots):
            raise InvalidSpec(f"node {node_id} has no GPU slot among {list(slots)}")
        if len(set(slots)) != len(slots):
            raise InvalidSpec(f"slots for job {job_id!r} on {node_id} repeat: {list(slots)}")
        held = self._pending_slots.setdefault(node_id, {})
        others = {held[s] for s in slots if s in held and held[s] != job_id}
        if others:
            raise Conflict(f"GPUs {list(slots)} of {node_id} are held by {sorted(others)}")
        for s in slots:
            held[s] = job_id
        self._pending.append((job_id, node_id, slots, priority, preemptible))
        self._pending_jobs.add(job_id)

    def assign_arrays(self, job_id: str, nodes: np.ndarray, slots: np.ndarray, priority: int,
                      preemptible: bool) -> None:
        """Give a new job the GPUs at (node index, slot) pairs in one vectorised step (simulators
        and bulk loads). Every GPU must exist and be free, none named twice (else :class:`Conflict`)."""
        self._ensure()
        if job_id in self._jobs:
            raise Conflict(f"job {job_id!r} already holds GPUs")
        nodes = np.asarray(nodes, np.int64)
        slots = np.asarray(slots, np.int64)
        if nodes.shape != slots.shape or nodes.ndim != 1:
            raise InvalidSpec("nodes and slots must be 1-d arrays of one length")
        if nodes.size:
            if nodes.min() < 0 or nodes.max() >= len(self._node_ids) or slots.min() < 0 or \
                    (slots >= self.n_gpus[nodes]).any():
                raise InvalidSpec(f"job {job_id!r}: GPU out of range")
            if (self.owner[nodes, slots] != -1).any():
                raise Conflict(f"job {job_id!r}: some GPUs are not free")
            if self._named_twice(nodes, slots):
                raise Conflict(f"job {job_id!r}: a GPU is named twice")
        rec = self._new_job(job_id, priority, preemptible)
        self._give(rec, nodes, slots)

    def release(self, job_id: str) -> int:
        """Free every GPU of a job and forget it (incremental). Returns the GPUs freed."""
        if job_id in self._pending_jobs or job_id not in self._jobs:
            self._ensure()
        rec = self._jobs.pop(job_id, None)
        if rec is None:
            raise UnknownJob(f"unknown job {job_id!r}")
        n = rec.nodes.size
        if n:
            self.owner[rec.nodes, rec.slots] = -1
            np.add.at(self.free, rec.nodes, self.usable[rec.nodes, rec.slots].astype(np.int32))
        j = rec.index
        self._job_ids[j] = None
        self.job_active[j] = False
        self.job_gpus[j] = 0
        self.job_preemptible[j] = False
        self._free_job_idx.append(j)
        return int(n)

    def release_many(self, job_ids: Iterable[str]) -> int:
        """:meth:`release` of each job, in one vector step over all their GPUs (a promoted
        follower's stale holders handed to their gang at once). Unknown ids are skipped.
        Returns the GPUs freed."""
        self._ensure()
        recs = [r for r in (self._jobs.pop(j, None) for j in job_ids) if r is not None]
        if not recs:
            return 0
        nodes = np.concatenate([r.nodes for r in recs])
        sl = np.concatenate([r.slots for r in recs])
        if nodes.size:
            self.owner[nodes, sl] = -1
            np.add.at(self.free, nodes, self.usable[nodes, sl].astype(np.int32))
        idx = np.fromiter((r.index for r in recs), np.int64, len(recs))
        for j in idx.tolist():
            self._job_ids[j] = None
        self.job_active[idx] = False
        self.job_gpus[idx] = 0
        self.job_preemptible[idx] = False
        self._free_job_idx.extend(idx.tolist())
        return int(nodes.size)

    def hold_many(self, holders: Sequence[tuple[str, str, Sequence[int]]], priority: int) -> int:
        """Give each ``(holder id, node id, slots)`` those of its slots that are still free and
        usable, as a new non-preemptible job of ``priority`` (stopped pods keeping their GPUs
        until their node reports them gone): what :meth:`free_gpus` then :meth:`assign` do
        holder by holder, with one vector step over every GPU instead of several a holder.
        In ``holders`` order, so a GPU named twice goes to the first. Unknown
        nodes and out-of-range slots are skipped; a holder id that already holds GPUs goes
        through :meth:`assign`. Returns the GPUs given."""
        self._ensure()
        rows: list[int] = []
        counts: list[int] = []
        flat: list[int] = []
        ids: list[str] = []
        given = 0
        for hid, node_id, slots in holders:
            i = self._index.get(node_id)
            if i is None or not slots:
                continue
            if hid in self._jobs:   # (rare: held before) the one-by-one path, idempotent
                mine = self._jobs[hid].index
                own = self.owner[i]
                keep = [s for s in slots if 0 <= s < own.size and self.usable[i, s] and own[s] in (-1, mine)]
                if keep:
                    given += sum(1 for s in keep if own[s] == -1)
                    self.assign(hid, node_id, keep, priority, False)
                continue
            ids.append(hid)
            rows.append(i)
            counts.append(len(slots))
            flat.extend(slots)
        if not ids:
            return given
        cnt = np.asarray(counts, np.int64)
        nodes = np.repeat(np.asarray(rows, np.int64), cnt)
        sl = np.asarray(flat, np.int64)
        who = np.repeat(np.arange(len(ids), dtype=np.int64), cnt)
        ok = (sl >= 0) & (sl < self.n_gpus[nodes])
        nodes, sl, who = nodes[ok], sl[ok], who[ok]
        ok = (self.owner[nodes, sl] == -1) & self.usable[nodes, sl]
        nodes, sl, who = nodes[ok], sl[ok], who[ok]
        # a GPU named by two holders: the first keeps it
        _, first = np.unique(nodes * self.owner.shape[1] + sl, return_index=True)
        if first.size != nodes.size:
            first.sort()
            nodes, sl, who = nodes[first], sl[first], who[first]
        if not nodes.size:
            return given
        per = np.bincount(who, minlength=len(ids))
        ends = np.cumsum(per)
        index = np.empty(len(ids), np.int64)
        # the holders' job records, their table rows set in one vector step each (a preemption
        # holds every victim pod's GPUs: thousands of holders, no scalar store a holder)
        ks = np.flatnonzero(per)
        m = len(ks)
        while len(self._free_job_idx) < m:
            self._grow_jobs(self._job_cap * 2)
        free_idx = self._free_job_idx
        js = free_idx[len(free_idx) - m:][::-1]   # (what m pops would take, in their order)
        del free_idx[len(free_idx) - m:]
        ja = np.asarray(js, np.int64)
        self.job_priority[ja] = int(priority)
        self.job_preemptible[ja] = False
        self.job_gpus[ja] = per[ks]
        self.job_active[ja] = True
        index[ks] = ja
        job_ids, jobs, node_ids, prio = self._job_ids, self._jobs, self._node_ids, int(priority)
        for j, k, hi, cnt in zip(js, ks.tolist(), ends[ks].tolist(), per[ks].tolist(), strict=True):
            hid = ids[k]
            job_ids[j] = hid
            jobs[hid] = Allocation(hid, j, prio, False, nodes[hi - cnt:hi], sl[hi - cnt:hi], node_ids)
        self.owner[nodes, sl] = index[who]
        self.free -= np.bincount(nodes, minlength=self.free.size).astype(self.free.dtype)
        return given + int(nodes.size)

    # ------------------------------------------------------------------ copies, stats, checks

    def copy(self) -> ClusterModel:
        """An independent copy (arrays copied; used by planners that try moves)."""
        self._ensure()
        m = ClusterModel.__new__(ClusterModel)
        for k, v in self.__dict__.items():
            if isinstance(v, np.ndarray):
                setattr(m, k, v.copy())
            elif k in ("_node_healthy", "_node_draining", "_specs"):
                setattr(m, k, dict(v))
            elif k == "_gpu_bad":
                setattr(m, k, {a: set(b) for a, b in v.items()})
            elif k == "_scratch":
                setattr(m, k, {})
            elif k in ("_job_ids", "_free_job_idx"):
                setattr(m, k, list(v))
            elif k == "_jobs":
                setattr(m, k, {jid: Allocation(r.job_id, r.index, r.priority, r.preemptible,
                                              r.nodes, r.slots, r.node_ids, r.pods, r.gpus_per_pod,
                                              r.within, r.whole_nodes) for jid, r in v.items()})
            else:
                setattr(m, k, v)
        m._warm_scratch()
        return m

    def statistics(self) -> dict[str, Any]:
        """Capacity, usable, free and allocated GPUs, and per level: domains, wholly free
        domains, the largest free count in one domain."""
        self._ensure()
        cap = int(self.n_gpus.sum())
        usable = int(self.usable.sum())
        free = int(self.free.sum())
        usable_per_node = row_count(self.usable)
        levels: dict[str, Any] = {}
        for li, lv in enumerate(LEVELS):
            st = self.starts[li]
            if len(self._node_ids):
                fd = np.add.reduceat(self.free.astype(np.int64), st)
                cd = np.add.reduceat(self.n_gpus.astype(np.int64), st)
                ud = np.add.reduceat(usable_per_node, st)
                whole = int(((fd == cd) & (cd > 0) & (ud == cd)).sum())
                largest = int(fd.max())
            else:
                whole = largest = 0
            levels[lv] = {"domains": int(st.size), "wholly_free": whole, "largest_free": largest}
        return {
            "nodes": len(self._node_ids),
            "gpus": cap,
            "usable": usable,
            "free": free,
            "allocated": int((self.owner >= 0).sum()),
            "unhealthy_gpus": int((self.slot_exists & ~self.gpu_healthy).sum()),
            "unhealthy_nodes": int((~self.node_healthy).sum()),
            "draining_nodes": int(self.node_draining.sum()),
            "jobs": len(self._jobs),
            "levels": levels,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant is broken (O(cluster); tests and debugging)."""
        self._ensure()
        N = len(self._node_ids)
        assert self.owner.shape == (N, self.G)
        assert not ((self.owner >= 0) & ~self.slot_exists).any(), "owned slot that does not exist"
        exp_free = ((self.owner == -1) & self.usable).sum(1)
        assert np.array_equal(exp_free, self.free), "free counts out of date"
        exp_usable = self.slot_exists & self.gpu_healthy & (self.node_healthy & ~self.node_draining)[:, None]
        assert np.array_equal(exp_usable, self.usable), "usable mask out of date"
        seen = np.zeros((N, self.G), np.int64)
        for rec in self._jobs.values():
            assert self._job_ids[rec.index] == rec.job_id
            assert np.all(self.owner[rec.nodes, rec.slots] == rec.index), f"job {rec.job_id} lost a GPU"
            np.add.at(seen, (rec.nodes, rec.slots), 1)
            assert self.job_gpus[rec.index] == rec.nodes.size
        assert np.array_equal(seen > 0, self.owner >= 0), "owner array and job table disagree"
        assert seen.max(initial=0) <= 1, "a GPU is listed twice"
        for li in range(len(LEVELS)):
            st, en = self.starts[li], self.ends[li]
            if N:
                assert st[0] == 0 and en[-1] == N and np.all(st[1:] == en[:-1]) and np.all(en > st)
            if li + 1 < len(LEVELS) and N:
                cst = self.starts[li + 1]
                assert np.all(cst[self.child_lo[li]] == st), "child ranges misaligned"
                # every child domain lies inside exactly one parent
                parent_of_child = self.dom_of_node[li][cst]
                parent_of_child_end = self.dom_of_node[li][self.ends[li + 1] - 1]
                assert np.array_equal(parent_of_child, parent_of_child_end), "domains not nested"
