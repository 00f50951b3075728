"""The pending-job queue: strict priority, FIFO within a priority, backfill, reservations.

Theory of operation
-------------------
``schedule(model, now)`` walks the pending jobs in order (priority high to low, then
submission order) and tries to place each one, applying every decision to the model at
once so later jobs see it. A job that does not fit stays pending and the walk goes on:
smaller jobs behind it that fit are placed (backfill), so one large job never blocks the
queue. To keep the large job from starving, once it has waited ``reserve_after_rounds``
scheduling rounds (or ``reserve_after_s`` of the passed-in ``now``) it gets a
*reservation*: the domain at its ``within`` level that is closest to holding it (for
``any``: every node that has room) is closed to every job after it in the walk. As
running jobs in that domain end, it drains toward the reserved job, which then fits.
Jobs ahead of a reservation (higher priority, or earlier) are never held back by it.

Preemption (when ``allow_preemption``) is tried by ``place`` for each job in the walk, so
a high-priority job makes room by preempting strictly lower-priority preemptible ones.
Rounds are bounded: at most ``max_tries`` place attempts per call.

Pure: no clocks (``now`` is passed in), no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import Conflict, UnknownJob
from .model import ClusterModel, level_index, row_count
from .place import Decision, JobRequest, place, pods_that_fit
from .preempt import eligible_jobs

# Why a pending job did not fit the last round that looked at it (read by the dashboard's
# "why pending?"): decided here, where the round skips or fails it, never parsed from text.
WAIT_NOT_TRIED = "not_tried"        # no round has looked at it yet (or a round's tries ran out first)
WAIT_TOO_FEW_FREE = "too_few_free"  # it asks more GPUs than are free and may preempt nothing
WAIT_NO_DOMAIN = "no_domain"        # no domain at its within level can take it (preemption counted if allowed)


@dataclass(frozen=True, slots=True)
class Waiting:
    """The structured outcome of a round for a job it could not place."""
    code: str = WAIT_NOT_TRIED
    may_preempt: bool = False       # lower-priority preemptible GPUs existed (and preemption is on)
    behind_reservation: bool = False  # nodes held for an earlier job's reservation were out of reach
    free_gpus: int = 0              # free GPUs in the fleet when it was looked at


@dataclass(slots=True)
class Pending:
    """A job waiting in the queue."""
    request: JobRequest
    submitted_at: float
    seq: int
    rounds: int = 0
    reserved: bool = False
    last_attempt_epoch: int = field(default=-1)
    waiting: Waiting = field(default_factory=Waiting)


class JobQueue:
    """Pending jobs. ``schedule`` applies what it decides to the model and returns it."""

    def __init__(self, *, reserve_after_rounds: int = 8, reserve_after_s: float | None = None,
                 allow_preemption: bool = True, max_tries: int = 1024,
                 place_fn: Callable[..., Decision | None] = place) -> None:
        self.place_fn = place_fn            # a wrapper may time it (the simulator does)
        self.reserve_after_rounds = reserve_after_rounds
        self.reserve_after_s = reserve_after_s
        self.allow_preemption = allow_preemption
        self.max_tries = max_tries
        self._jobs: dict[str, Pending] = {}
        self._order: list[tuple[int, int, str]] = []      # (-priority, seq, job_id), sorted
        self._seq = 0
        self.rounds = 0
        self.placed = 0
        self.preemptions = 0

    # ------------------------------------------------------------------ contents

    def submit(self, job: JobRequest, now: float) -> None:
        """Queue a job (validated). A job id already pending is a :class:`Conflict`."""
        job.validate()
        if job.job_id in self._jobs:
            raise Conflict(f"job {job.job_id!r} is already pending")
        self._seq += 1
        p = Pending(job, float(now), self._seq)
        self._jobs[job.job_id] = p
        bisect.insort(self._order, (-job.priority, p.seq, job.job_id))

    def cancel(self, job_id: str) -> JobRequest:
        """Remove a pending job (a running one is released from the model by the caller)."""
        p = self._jobs.pop(job_id, None)
        if p is None:
            raise UnknownJob(f"job {job_id!r} is not pending")
        key = (-p.request.priority, p.seq, job_id)
        i = bisect.bisect_left(self._order, key)
        del self._order[i]
        return p.request

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def get(self, job_id: str) -> Pending | None:
        """The pending entry of ``job_id`` (its ``waiting`` says why it waits), or None."""
        return self._jobs.get(job_id)

    def pending(self) -> list[Pending]:
        """Pending jobs in scheduling order."""
        return [self._jobs[k[2]] for k in self._order]

    # ------------------------------------------------------------------ scheduling

    def _due_for_reservation(self, p: Pending, now: float) -> bool:
        if p.rounds >= self.reserve_after_rounds:
            return True
        return self.reserve_after_s is not None and now - p.submitted_at >= self.reserve_after_s

    def schedule(self, model: ClusterModel, now: float) -> list[Decision]:
        """Try pending jobs in order; apply and return the decisions made this round.
        Victims of a decision are released from the model here; requeueing them (restart
        policy) is the caller's business."""
        self.rounds += 1
        out: list[Decision] = []
        exclude: np.ndarray | None = None
        tries = 0
        free_total = int(model.free.sum()) if model.n_nodes else 0
        # Within a round capacity only shrinks (allocations, growing reservations) unless a
        # decision preempts, so a shape that failed fails again until then: skip the search.
        failed: dict[tuple[int, int, str, int, bool], str] = {}
        for key in list(self._order):
            if tries >= self.max_tries:
                break
            p = self._jobs[key[2]]
            job = p.request
            gpus = job.pods * max(job.gpus_per_pod, 1)
            may_preempt = self.allow_preemption and bool(eligible_jobs(model, job.priority).any())
            shape = (job.pods, job.gpus_per_pod, job.within if job.prefer is None else f"{job.within}/{job.prefer}",
                     job.priority, job.whole_nodes)
            if gpus > free_total and not may_preempt:
                d, why = None, WAIT_TOO_FEW_FREE          # cannot fit anywhere: skip the search
            elif shape in failed:
                d, why = None, failed[shape]
            else:
                tries += 1
                d = self.place_fn(model, job, allow_preemption=self.allow_preemption, exclude=exclude)
                why = WAIT_NO_DOMAIN
            if d is not None:
                model.allocate(d)
                out.append(d)
                self.placed += 1
                self.preemptions += len(d.victims)
                if d.victims:
                    failed.clear()
                free_total = int(model.free.sum())
                self._jobs.pop(job.job_id)
                self._order.remove(key)
                continue
            failed[shape] = why
            p.waiting = Waiting(why, may_preempt, exclude is not None, free_total)
            p.rounds += 1
            if self._due_for_reservation(p, now):
                p.reserved = True
                mask = reservation_mask(model, job)
                exclude = mask if exclude is None else (exclude | mask)
        return out

    def statistics(self) -> dict[str, Any]:
        by_prio: dict[int, int] = {}
        for p in self._jobs.values():
            by_prio[p.request.priority] = by_prio.get(p.request.priority, 0) + 1
        return {"pending": len(self._jobs), "reserved": sum(p.reserved for p in self._jobs.values()),
                "rounds": self.rounds, "placed": self.placed, "preemptions": self.preemptions,
                "pending_by_priority": by_prio}


def reservation_mask(model: ClusterModel, job: JobRequest) -> np.ndarray:
    """Nodes to hold for ``job``: the domain at its ``within`` level closest to holding it
    (most pods placeable now, then most free GPUs, among domains big enough when empty);
    for ``any``, every node with room for one of its pods. Bool per node."""
    N = model.n_nodes
    mask = np.zeros(N, bool)
    fits = pods_that_fit(model, job)
    li = level_index(job.within)
    if li < 0:
        mask[fits > 0] = True
        return mask
    g = max(job.gpus_per_pod, 1)
    st = model.starts[li]
    empty_cap = np.add.reduceat(row_count(model.usable) // g, st)
    cap = np.add.reduceat(fits, st)
    free = np.add.reduceat(model.free.astype(np.int64), st)
    big = np.flatnonzero(empty_cap >= job.pods)
    if big.size == 0:
        return mask
    # most pods placeable now, then most free GPUs (the domain that drains soonest)
    dom = int(big[np.lexsort((-free[big], -cap[big]))[0]])
    mask[model.starts[li][dom]:model.ends[li][dom]] = True
    return mask
