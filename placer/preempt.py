"""Preemption: when a gang fits nowhere, find the cheapest room to make for it.

Theory of operation
-------------------
*Eligible victims* are jobs of strictly lower priority than the new job and preemptible.
A slot is *reclaimable* when it is usable and either free or held by an eligible job.

1. Per node, reclaimable slots -> pods that would fit -> capacity per domain at the
   ``within`` level. Domains that cannot hold the gang even then are out; if none is
   left, the job cannot be placed (None).
2. *Estimate* each remaining domain's cost without choosing victims: per domain, the
   eligible GPUs by priority rank (``bincount`` over slots + ``reduceat``), and the GPUs
   still needed (gang size minus free GPUs) filled from the lowest rank up. The
   ``CANDIDATES`` cheapest domains go to the exact step.
3. *Exact victims* in a domain: the eligible jobs with GPUs there, ordered by cost per
   GPU they free in the domain, where a job's cost is ``(1 + priority rank) x all its
   GPUs`` (a victim gang counts whole, wherever its pods are; the rank is that of its
   priority among the distinct priorities of eligible jobs, so the cost does not
   depend on how priorities are numbered). Every slot gets the position of its owner in
   that order (free slots 0); per node, sorting those positions gives, for the m-th pod,
   the prefix length that makes it fit; the ``pods``-th smallest of those over the domain
   is the shortest prefix of victims that makes room (one ``partition``, no search).
   Then victims are dropped again, most expensive first, while the gang still fits
   (at most ``PRUNE_CHECKS`` tries), so no victim is preempted that is not needed.
4. The domain of least (cost, victim count, GPUs lost, leftover) wins; the gang is placed inside it
   by the same descent as without preemption, on the slots that are free or held by
   victims.

Costs compare as (priority-weighted GPUs lost, number of jobs). Never a job of equal or
higher priority, never a non-preemptible one.
"""

from __future__ import annotations

import numpy as np

from .model import NODE_LEVEL, ClusterModel, level_index
from .place import Decision, JobRequest, assign_slots, choose_domain, descend, make_decision, pods_that_fit

CANDIDATES = 4
PRUNE_CHECKS = 16
_BIG = np.int64(1) << 40


def eligible_jobs(model: ClusterModel, priority: int) -> np.ndarray:
    """Bool per job index: may be preempted by a job of ``priority``."""
    return model.job_active & model.job_preemptible & (model.job_priority < priority)


def place_with_preemption(model: ClusterModel, job: JobRequest, *,
                          exclude: np.ndarray | None = None) -> Decision | None:
    elig = eligible_jobs(model, job.priority)
    if not elig.any():
        return None
    li = level_index(job.within)
    elig_ext = np.append(elig, False)          # owner -1 indexes the extra False
    owner = model.owner
    owned_elig = elig_ext[owner] & model.usable
    reclaim_per_node = model.free + owned_elig.sum(1, dtype=np.int32)
    fits = pods_that_fit(model, job, free=reclaim_per_node, exclude=exclude)
    if choose_domain(model, fits, li, job.pods, reclaim_per_node) is None:
        return None

    # priority ranks and per-job costs
    prios = model.job_priority
    uprio = np.unique(prios[elig])
    rank = np.zeros(prios.size, np.int64)
    rank[elig] = np.searchsorted(uprio, prios[elig])
    job_cost = (1 + rank) * model.job_gpus          # priority-weighted GPUs lost

    need_gpus = job.pods * max(job.gpus_per_pod, 1)
    if li < 0:
        cands = np.array([0])
    else:
        st = model.starts[li]
        cap = np.add.reduceat(fits, st)
        cands = np.flatnonzero(cap >= job.pods)
        if cands.size > CANDIDATES:
            cands = _cheapest_estimates(model, li, cands, owned_elig, rank, need_gpus)

    best: tuple[tuple[int, int, int, int], int, np.ndarray] | None = None
    for dom in cands.tolist():
        lo, hi = _bounds(model, li, dom)
        res = _exact_victims(model, job, lo, hi, elig, elig_ext, job_cost, exclude)
        if res is None:
            continue
        victims, cost = res
        key = (cost, int(victims.size), int(model.job_gpus[victims].sum()), int(reclaim_per_node[lo:hi].sum()))
        if best is None or key < best[0]:
            best = (key, dom, victims)
    if best is None:
        return None
    _, dom, victims = best
    lo, hi = _bounds(model, li, dom)
    vmask = np.zeros(elig_ext.size, bool)
    vmask[victims] = True
    avail = model.usable[lo:hi] & ((owner[lo:hi] == -1) | vmask[owner[lo:hi]])
    if job.whole_nodes:
        n = model.n_gpus[lo:hi]
        sub = ((avail | ~model.slot_exists[lo:hi]).all(1) & (n >= max(job.gpus_per_pod, 1))
               & (n > 0)).astype(np.int64)
    else:
        sub = avail.sum(1, dtype=np.int64) // job.gpus_per_pod
    if exclude is not None:
        sub = np.where(exclude[lo:hi], 0, sub)
    fits_v = np.zeros(model.n_nodes, np.int64)
    fits_v[lo:hi] = sub
    nodes, counts = descend(model, fits_v, li, dom, job.pods)
    pod_nodes, pod_slots = assign_slots(model, job, nodes, counts, avail=avail[nodes - lo])
    names = [model.job_id_of(int(j)) or "" for j in victims.tolist()]
    return make_decision(model, job, li, dom, pod_nodes, pod_slots, names)


def _bounds(model: ClusterModel, li: int, dom: int) -> tuple[int, int]:
    if li < 0:
        return 0, model.n_nodes
    return int(model.starts[li][dom]), int(model.ends[li][dom])


def _cheapest_estimates(model: ClusterModel, li: int, cands: np.ndarray, owned_elig: np.ndarray,
                        rank: np.ndarray, need_gpus: int) -> np.ndarray:
    """The CANDIDATES domains of least estimated victim cost (see module docstring)."""
    R = int(rank.max()) + 1
    nodes, slots = np.nonzero(owned_elig)
    r = rank[model.owner[nodes, slots]]
    per_node = np.bincount(nodes * R + r, minlength=model.n_nodes * R).reshape(model.n_nodes, R)
    per_dom = np.add.reduceat(per_node, model.starts[li], axis=0)[cands]        # (C, R)
    free_dom = np.add.reduceat(model.free.astype(np.int64), model.starts[li])[cands]
    need = np.maximum(need_gpus - free_dom, 0)
    cum = np.cumsum(per_dom, axis=1)
    before = cum - per_dom
    take = np.clip(need[:, None] - before, 0, per_dom)
    est = take @ (1 + np.arange(R))
    order = np.lexsort((free_dom, est))
    return cands[order[:CANDIDATES]]


def _pod_thresholds(job: JobRequest, slot_pos: np.ndarray, n_gpus: np.ndarray,
                    exists: np.ndarray) -> np.ndarray:
    """For each node row of ``slot_pos`` (position of the slot's owner in the victim order,
    0 when free, _BIG when unusable) the prefix length at which each pod fits (flat)."""
    if job.whole_nodes:
        t = np.where(exists, slot_pos, 0).max(1)
        ok = (n_gpus >= max(job.gpus_per_pod, 1)) & (n_gpus > 0)
        return np.where(ok, t, _BIG)
    g = job.gpus_per_pod
    G = slot_pos.shape[1]
    if g > G:
        return np.zeros(0, np.int64)
    s = np.sort(slot_pos, axis=1)
    return s[:, g - 1::g][:, : G // g].reshape(-1)


def _exact_victims(model: ClusterModel, job: JobRequest, lo: int, hi: int, elig: np.ndarray,
                   elig_ext: np.ndarray, job_cost: np.ndarray,
                   exclude: np.ndarray | None) -> tuple[np.ndarray, int] | None:
    owner = model.owner[lo:hi]
    usable = model.usable[lo:hi]
    if exclude is not None:
        usable = usable & ~exclude[lo:hi, None]
    e = usable & elig_ext[owner]
    J = elig.size
    indom = np.bincount(owner[e], minlength=J)
    cand = np.flatnonzero(indom)
    if cand.size == 0:
        return None
    key = job_cost[cand] / indom[cand]
    order = cand[np.lexsort((model.job_gpus[cand], key))]
    pos = np.full(J + 1, _BIG, np.int64)
    pos[order] = np.arange(1, order.size + 1)
    pos[J] = _BIG  # owner -1 maps here; replaced below
    slot_pos = np.where(owner == -1, 0, pos[owner])
    slot_pos = np.where(usable, slot_pos, _BIG)
    n_gpus = model.n_gpus[lo:hi]
    exists = model.slot_exists[lo:hi]
    thr = _pod_thresholds(job, slot_pos, n_gpus, exists)
    P = job.pods
    if thr.size < P:
        return None
    k = int(np.partition(thr, P - 1)[P - 1])
    if k >= _BIG:
        return None
    chosen = list(order[:k].tolist())
    # prune: drop the most expensive victims that turn out not to be needed
    checks = 0
    for v in sorted(chosen, key=lambda j: -int(job_cost[j])):
        if checks >= PRUNE_CHECKS:
            break
        checks += 1
        trial = [c for c in chosen if c != v]
        pos2 = np.full(J + 1, _BIG, np.int64)
        pos2[trial] = 1
        sp = np.where(owner == -1, 0, pos2[owner])
        sp = np.where(usable, sp, _BIG)
        t2 = _pod_thresholds(job, sp, n_gpus, exists)
        if int((t2 <= 1).sum()) >= P:
            chosen = trial
    victims = np.asarray(sorted(chosen), np.int64)
    return victims, int(job_cost[victims].sum())


__all__ = ["place_with_preemption", "eligible_jobs", "NODE_LEVEL"]
