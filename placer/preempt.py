"""Preemption: when a gang fits nowhere, find the cheapest room to make for it.

Theory of operation
-------------------
*Eligible victims* are jobs of strictly lower priority than the new job and preemptible.
A slot is *reclaimable* when it is usable and either free or held by an eligible job.

1. Per node, reclaimable slots -> pods that would fit -> capacity per domain at the
   ``within`` level. Domains that cannot hold the gang even then are out; if none is
   left, the job cannot be placed (None).
2. *Estimate* each remaining domain's cost without choosing victims: every eligible
   slot carries a share of its job's cost (cost / min(job GPUs, GPUs needed)), bucketed
   on a log scale and counted per domain (one ``bincount``); the GPUs still needed (gang
   size minus free GPUs) are filled from the cheapest bucket up. The ``CANDIDATES``
   cheapest domains go to the exact step (fewer when domains are big: at most
   ``EXACT_SLOT_BUDGET`` slots are examined exactly, but always at least one domain).
3. *Exact victims* in a domain: the eligible jobs with GPUs there, ordered by cost per
   GPU they free in the domain, where a job's cost is ``(1 + priority rank) x all its
   GPUs`` (a victim gang counts whole, wherever its pods are; the rank is that of its
   priority among the distinct priorities of eligible jobs, so the cost does not
   depend on how priorities are numbered). Every slot gets the position of its owner in
   that order (free slots 0); per node, sorting those positions gives, for the m-th pod,
   the prefix length that makes it fit; the ``pods``-th smallest of those over the domain
   is the shortest prefix of victims that makes room (one ``partition``, no search).
   Then victims are dropped again, most expensive first, while the gang still fits: for
   every victim at once, the pods lost on the nodes it holds if it stayed; those whose
   loss leaves enough are dropped one by one (at most ``PRUNE_CHECKS``), so no victim is
   preempted that is not needed.
4. The domain of least (cost, victim count, GPUs lost, leftover) wins; the gang is placed inside it
   by the same descent as without preemption, on the slots that are free or held by
   victims.

Costs compare as (priority-weighted GPUs lost, number of jobs). Never a job of equal or
higher priority, never a non-preemptible one.
"""

from __future__ import annotations

import numpy as np

from .model import NODE_LEVEL, PREEMPT_BUCKETS, ClusterModel, level_index, row_count
from .place import Decision, JobRequest, assign_slots, choose_domain, descend, make_decision, pods_that_fit

CANDIDATES = 4
PRUNE_CHECKS = 64
EXACT_SLOT_BUDGET = 1 << 18
_BUCKETS = PREEMPT_BUCKETS
_BIG32 = np.int32(np.iinfo(np.int32).max)     # "never": a slot no victim set frees


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

    # priority ranks and per-job costs
    prios = model.job_priority
    rank = _priority_ranks(prios, elig)
    job_cost = (1 + rank) * model.job_gpus          # priority-weighted GPUs lost
    need_gpus = job.pods * max(job.gpus_per_pod, 1)

    # One pass over the slots: each slot's cost bucket (int8), then per-node counts by popcount.
    # Buckets (base-4 log of the cost share) are renumbered to the few in use: column 0
    # free, 1..U eligible by increasing share, U+1 not reclaimable.
    share = job_cost / np.maximum(np.minimum(model.job_gpus, need_gpus), 1)
    bucket = np.clip((np.log2(np.maximum(share, 1.0)) * 0.5).astype(np.int64), 0, _BUCKETS - 1)
    holding = elig & (model.job_gpus > 0)
    hb = bucket[holding]
    present = np.bincount(hb, minlength=_BUCKETS) > 0
    used = np.flatnonzero(present)
    U = used.size
    compact = np.full(elig.size + 1, U + 1, np.int8)
    compact[:-1][holding] = np.cumsum(present, dtype=np.int8)[hb]       # 1..U
    compact[-1] = 0                                  # owner -1: free
    N, G = owner.shape
    sb = np.take(compact, owner, out=model.scratch("preempt.sb", (N, G), np.int8))
    if model.unusable_slots():
        np.copyto(sb, np.int8(U + 1), where=~model.usable)
    eq = model.scratch("preempt.eq", (N, G), np.bool_)
    counts = model.scratch("preempt.counts", (_BUCKETS + 2, N), np.uint8)[: U + 2]
    row_count(np.equal(sb, U + 1, out=eq), out=counts[U + 1])
    reclaim_per_node = G - counts[U + 1].astype(np.int32)
    fits = pods_that_fit(model, job, free=reclaim_per_node, exclude=exclude)
    if choose_domain(model, fits, li, job.pods, reclaim_per_node) is None:
        return None

    if li < 0:
        cands = np.array([0])
    else:
        st = model.starts[li]
        cap = fits if st.size == model.n_nodes else np.add.reduceat(fits, st)
        cands = np.flatnonzero(cap >= job.pods)
        # exact victim choice costs a few passes over a domain's slots: bound the total
        span = model.max_span[li] * model.G
        n_exact = max(1, min(CANDIDATES, EXACT_SLOT_BUDGET // max(span, 1)))
        if cands.size > n_exact:
            weights = 2 * np.power(4, used.astype(np.int64))
            for k in range(U + 1):
                row_count(np.equal(sb, k, out=eq), out=counts[k])
            cands = _cheapest_estimates(model, li, cands, counts, weights, need_gpus)[:n_exact]

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
        sub = row_count(avail) // job.gpus_per_pod
    if exclude is not None:
        sub = np.where(exclude[lo:hi], 0, sub)
    fits_v = np.zeros(model.n_nodes, np.int64)
    fits_v[lo:hi] = sub
    nodes, counts = descend(model, fits_v, li, dom, job.pods)
    pod_nodes, pod_slots = assign_slots(model, job, nodes, counts, avail=avail[nodes - lo])
    names = [model.job_id_of(int(j)) or "" for j in victims.tolist()]
    return make_decision(model, job, li, dom, pod_nodes, pod_slots, names)


def _priority_ranks(prios: np.ndarray, elig: np.ndarray) -> np.ndarray:
    """Rank of each eligible job's priority among the distinct eligible priorities (0 =
    lowest); 0 elsewhere. Linear when the priorities span a small range."""
    p = prios[elig]
    rank = np.zeros(prios.size, np.int64)
    lo, hi = int(p.min()), int(p.max())
    if hi - lo < 4096:
        present = np.zeros(hi - lo + 1, np.int64)
        present[p - lo] = 1
        rank[elig] = (np.cumsum(present) - 1)[p - lo]
    else:
        rank[elig] = np.searchsorted(np.unique(p), p)
    return rank


def _bounds(model: ClusterModel, li: int, dom: int) -> tuple[int, int]:
    if li < 0:
        return 0, model.n_nodes
    return int(model.starts[li][dom]), int(model.ends[li][dom])


def _cheapest_estimates(model: ClusterModel, li: int, cands: np.ndarray, counts: np.ndarray,
                        weights: np.ndarray, need_gpus: int) -> np.ndarray:
    """The CANDIDATES domains of least estimated victim cost.

    Each eligible slot carries a share of its job's cost: ``cost / min(job GPUs, GPUs
    needed)`` -- exact when the whole job lies in the domain and is needed whole, and
    when only ``need`` of a bigger gang's GPUs would be taken. Shares are bucketed on a
    base-4 log scale (``counts[k]``: per node, row 0 free, 1..U the buckets in use, whose
    representative shares are ``weights``); per domain the GPUs needed are filled from the
    free GPUs and then the cheapest buckets up."""
    st = model.starts[li]
    U = weights.size
    per_node = st.size == counts.shape[1]
    if per_node:
        rows = [counts[k] for k in range(U + 1)]
    else:
        agg = np.add.reduceat(counts[: U + 1], st, axis=1, dtype=np.int32)
        rows = [agg[k] for k in range(U + 1)]
    D = rows[0].size
    remaining = np.subtract(need_gpus, rows[0], dtype=np.int32)
    np.maximum(remaining, 0, out=remaining)
    est = np.zeros(D, np.int64)
    t = np.empty(D, np.int32)
    for k in range(1, U + 1):
        np.minimum(remaining, rows[k], out=t)
        remaining -= t
        est += t.astype(np.int64) * int(weights[k - 1])
        if not remaining.any():
            break
    if cands.size < D:
        keep = np.zeros(D, bool)
        keep[cands] = True
        est[~keep] = np.iinfo(np.int64).max
    order = np.lexsort((-rows[0].astype(np.int64), est))[:CANDIDATES]
    return order[np.isin(order, cands)] if cands.size < D else order


def _pod_thresholds(job: JobRequest, slot_pos: np.ndarray, n_gpus: np.ndarray,
                    exists: np.ndarray) -> np.ndarray:
    """For each node row of ``slot_pos`` (position of the slot's owner in the victim order,
    0 when free, _BIG32 when unusable) the prefix length at which each pod fits (flat)."""
    if job.whole_nodes:
        t = np.where(exists, slot_pos, 0).max(1)
        ok = (n_gpus >= max(job.gpus_per_pod, 1)) & (n_gpus > 0)
        return np.where(ok, t, _BIG32)
    g = job.gpus_per_pod
    G = slot_pos.shape[1]
    if g > G:
        return np.zeros(0, np.int64)
    if g == 1:
        return slot_pos.reshape(-1)
    if 2 * g > G:                                   # one pod per node at most: g-th smallest
        if g == G:
            return slot_pos.max(1)
        return np.partition(slot_pos, g - 1, axis=1)[:, g - 1]
    s = np.sort(slot_pos, axis=1)
    return s[:, g - 1::g][:, : G // g].reshape(-1)


def _node_pods(job: JobRequest, avail: np.ndarray, n_gpus: np.ndarray) -> np.ndarray:
    """Pods per node given ``avail`` usable free-or-reclaimed GPUs per node."""
    if job.whole_nodes:
        return ((avail == n_gpus) & (n_gpus >= max(job.gpus_per_pod, 1)) & (n_gpus > 0)).astype(np.int64)
    return avail // job.gpus_per_pod


def _exact_victims(model: ClusterModel, job: JobRequest, lo: int, hi: int, elig: np.ndarray,
                   elig_ext: np.ndarray, job_cost: np.ndarray,
                   exclude: np.ndarray | None) -> tuple[np.ndarray, int] | None:
    owner = model.owner[lo:hi]
    usable = model.usable[lo:hi]
    if exclude is not None:
        usable = usable & ~exclude[lo:hi, None]
    e = usable & elig_ext[owner]
    ids = owner[e]
    if ids.size == 0:
        return None
    # victims are numbered locally (0..C-1, the sorted candidate ids); a big domain counts
    # by bincount over the job table, a small one by sorting its few owners
    big = ids.size * 8 > elig.size
    if big:
        per_job = np.bincount(ids, minlength=elig.size)
        cand = np.flatnonzero(per_job)
        indom = per_job[cand]
    else:
        cand, indom = np.unique(ids, return_counts=True)
    C = cand.size
    key = job_cost[cand] / indom
    rank_order = np.lexsort((model.job_gpus[cand], key))     # local ids, cheapest first
    posc = np.empty(C, np.int32)
    posc[rank_order] = np.arange(1, C + 1, dtype=np.int32)
    if big:
        # gathers through job-table-sized maps beat a binary search per slot
        table = np.full(elig.size + 1, C - 1, np.int32)
        table[cand] = np.arange(C, dtype=np.int32)
        loc = table[owner]
    else:
        loc = np.minimum(np.searchsorted(cand, owner), C - 1).astype(np.int32)
    slot_pos = np.where((owner == -1) & usable, np.int32(0), _BIG32)
    np.copyto(slot_pos, posc[loc], where=e)
    n_gpus = model.n_gpus[lo:hi].astype(np.int64)
    thr = _pod_thresholds(job, slot_pos, n_gpus, model.slot_exists[lo:hi])
    P = job.pods
    if thr.size < P:
        return None
    k = int(np.partition(thr, P - 1)[P - 1])
    if k >= _BIG32:
        return None
    chosen = _prune(job, loc, e, usable, slot_pos, n_gpus, rank_order[:k], k, job_cost[cand], C)
    victims = np.sort(cand[chosen])
    return victims, int(job_cost[victims].sum())


def _run_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_counts=True)`` for keys already sorted but for short runs
    (node-major, a node's few slots in any order): timsort is linear on such input."""
    k = np.sort(keys, kind="stable")
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    cnt = np.diff(np.append(starts, k.size))
    return k[starts], cnt


def _prune(job: JobRequest, loc: np.ndarray, e: np.ndarray, usable: np.ndarray, slot_pos: np.ndarray,
           n_gpus: np.ndarray, chosen: np.ndarray, k: int, cost: np.ndarray, C: int) -> np.ndarray:
    """Drop victims the gang does not need, most expensive first (bounded). ``chosen``,
    ``loc`` and ``cost`` use local victim ids.

    With the chosen set, per node: GPUs available and pods that fit. Removing victim v
    loses, on each node where it holds c GPUs, ``pods(avail) - pods(avail - c)`` pods; v
    can go if the total stays >= pods. Computed for every victim at once, then applied one
    by one (each removal changes the nodes it touched)."""
    P = job.pods
    sel = usable & (slot_pos <= k)                        # free or held by a chosen victim
    avail = row_count(sel)
    fits = _node_pods(job, avail, n_gpus)
    total = int(fits.sum())
    rn, rc = np.nonzero(sel & e)
    if rn.size == 0:
        return chosen
    keys, cnt = _run_counts(rn * C + loc[rn, rc])
    pn, pj = keys // C, keys % C
    lost = fits[pn] - _node_pods(job, avail[pn] - cnt, n_gpus[pn])
    delta = np.bincount(pj, weights=lost, minlength=C)
    maybe = chosen[total - delta[chosen] >= P]
    if maybe.size == 0:
        return chosen
    maybe = maybe[np.argsort(-cost[maybe], kind="stable")][:PRUNE_CHECKS]
    drop: list[int] = []
    for v in maybe.tolist():
        m = pj == v
        n_v, c_v = pn[m], cnt[m]
        new_fit = _node_pods(job, avail[n_v] - c_v, n_gpus[n_v])
        d = int((fits[n_v] - new_fit).sum())
        if total - d >= P:
            avail[n_v] -= c_v
            fits[n_v] = new_fit
            total -= d
            drop.append(v)
    if not drop:
        return chosen
    return chosen[~np.isin(chosen, drop)]


__all__ = ["place_with_preemption", "eligible_jobs", "NODE_LEVEL"]
