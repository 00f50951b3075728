"""Deciding whether a placement can be honoured: a pure function over plain data.

Invariants it enforces (DESIGN.md, Contracts; issue 4 §1):
- every GPU a pod names is in this node's inventory and not fatal-unhealthy;
- no GPU is given to two live workloads: a GPU held by a non-terminal workload is
  free only when that workload is one of this same placement's victims;
- no two pods of the placement share a GPU, and workload ids are new and well formed;
- a placement that starts pods has an argv.

:func:`check_binding` (identity issue): a placement bound to another node is refused
(``refused_spec``); one past its ``expires_at`` or one that replays an attempt this node has
seen superseded (``expired``: an older attempt of the job than one whose workloads are here,
or the same attempt placed here under another placement id) is refused too. Neither says
anything about a GPU. A placement id already accepted is answered again before these checks
(idempotent), so a late duplicate of an accepted placement is never a refusal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler_link.messages import WIRE_VERSION, Placement, PlacementOutcome

from .state import WorkloadRecord

WORKLOAD_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_NAME_MAX = 256


def under_prefix(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in prefixes if p)


def env_files_problem(files: dict[str, str], prefixes: tuple[str, ...]) -> str | None:
    """Why ``files`` (NAME -> host path) cannot be honoured here (None: they can, as far as
    names and paths go; the files are read at start). Pure."""
    if not files:
        return None
    if not prefixes:
        return "env_from_files: this agent allows none (workloads.env_files_prefixes is empty)"
    for name, path in files.items():
        if not name or len(name) > ENV_NAME_MAX or "=" in name or "\0" in name:
            return f"env_from_files: bad variable name {name[:40]!r}"
        if not os.path.isabs(path) or "\0" in path or os.path.normpath(path) != path:
            return f"env_from_files: {name}: {path[:200]!r} is not an absolute, normal path"
        if not under_prefix(path, prefixes):
            return f"env_from_files: {name}: {path[:200]} is not under an allowed prefix ({', '.join(prefixes)})"
    return None


def gpus_in_use(records: Iterable[WorkloadRecord]) -> dict[str, str]:
    """GPU UUID -> id of the live (non-terminal) workload holding it."""
    return {g: r.workload_id for r in records if not r.terminal for g in r.gpus}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a placement is refused, as the placer reads it: ``refused_gpus`` names the GPUs
    at fault (the placer marks those unhealthy); ``refused_spec`` says the placement itself
    is wrong and says nothing about any GPU. ``detail`` is for people."""
    outcome: PlacementOutcome
    detail: str
    gpus: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        return self.detail


def _spec(detail: str) -> Refusal:
    return Refusal("refused_spec", detail)


def _gpu(detail: str, *gpus: str) -> Refusal:
    return Refusal("refused_gpus", detail, tuple(gpus))


def attempt_of(workload_id: str, job_id: str) -> int | None:
    """The attempt a placer-made workload id (``<job>.<attempt>.<rank>``) names, else None."""
    if not workload_id.startswith(job_id + "."):
        return None
    rest = workload_id[len(job_id) + 1:].split(".")
    if len(rest) != 2 or not rest[0].isdigit() or not rest[1].isdigit():
        return None
    return int(rest[0])


def replayed(job_id: str, attempt: int | None, placement_id: str,
             records: Mapping[str, WorkloadRecord]) -> Refusal | None:
    """Why starting pods of ``job_id``'s ``attempt`` under ``placement_id`` is a replay (None: it is not)."""
    if attempt is None or attempt < 0:
        return None
    for r in records.values():
        if r.job_id != job_id:
            continue
        seen = attempt_of(r.workload_id, job_id)
        if seen is None:
            continue
        if seen > attempt:
            return Refusal("expired", f"attempt {attempt} of job {job_id} is older than attempt {seen} "
                                      f"already placed on this node (a replay)")
        if seen == attempt and r.placement_id and r.placement_id != placement_id:
            return Refusal("expired", f"attempt {attempt} of job {job_id} was already placed on this node "
                                      f"by {r.placement_id} (a replay)")
    return None


def check_binding(p: Placement, *, node_id: str, now: float,
                  records: Mapping[str, WorkloadRecord]) -> Refusal | None:
    """None when ``p`` is for this node, unexpired and not a replay (see the module docstring)."""
    if p.node_id and p.node_id != node_id:
        return _spec(f"placement is bound to node {p.node_id!r}, not {node_id!r}")
    if p.expires_at and now > p.expires_at and p.pods:  # (stops only: late is still right)
        return Refusal("expired", f"placement expired {now - p.expires_at:.3f}s ago")
    if not p.pods:
        return None
    attempt = p.attempt if p.attempt >= 0 else attempt_of(p.pods[0].workload_id, p.job_id)
    return replayed(p.job_id, attempt, p.placement_id, records)


def check_placement(p: Placement, records: Mapping[str, WorkloadRecord],
                    gpu_health: Mapping[str, str] | None, *,
                    env_prefixes: tuple[str, ...] | None = None) -> Refusal | None:
    """None when ``p`` may be accepted, else why it is refused.

    ``gpu_health`` maps every GPU UUID of this node to healthy|degraded|fatal
    (None: the inventory is not known yet, so any GPU is refused).
    """
    if p.version != WIRE_VERSION:
        return _spec(f"unsupported placement version {p.version} (this agent speaks {WIRE_VERSION})")
    if not p.placement_id or not p.job_id:
        return _spec("placement_id and job_id are required")
    if p.pods and not p.argv:
        return _spec("a placement that starts pods needs argv")
    if p.grace_s < 0 or any(v.grace_s < 0 for v in p.victims):
        return _spec("grace periods must be >= 0")
    if (why := p.limits.problem()) is not None:
        return _spec(f"limits: {why}")
    if p.env_from_files and env_prefixes is not None and (why := env_files_problem(p.env_from_files,
                                                                                     env_prefixes)) is not None:
        return _spec(why)
    victim_ids = {v.workload_id for v in p.victims}
    busy = gpus_in_use(records.values())
    seen_gpus: dict[str, str] = {}
    seen_ids: set[str] = set()
    for pod in p.pods:
        wid = pod.workload_id
        if not WORKLOAD_ID_RE.match(wid):
            return _spec(f"bad workload id {wid!r} (letters, digits, . _ -; at most 128)")
        if wid in records or wid in seen_ids:
            return _spec(f"workload {wid} already exists on this node")
        seen_ids.add(wid)
        if len(set(pod.gpus)) != len(pod.gpus):
            return _spec(f"workload {wid} names a GPU twice")
        for g in pod.gpus:
            if gpu_health is None:
                return _gpu("GPU inventory not discovered yet", *pod.gpus)
            health = gpu_health.get(g)
            if health is None:
                return _spec(f"unknown GPU {g} (not on this node)")
            if health == "fatal":
                return _gpu(f"GPU {g} is fatal-unhealthy", g)
            if g in seen_gpus:
                return _spec(f"GPU {g} given to both {seen_gpus[g]} and {wid}")
            seen_gpus[g] = wid
            holder = busy.get(g)
            if holder is not None and holder not in victim_ids:
                return _gpu(f"GPU {g} is in use by workload {holder}", g)
    return None
