"""The placer service's records: jobs, pods, nodes, pushes, and workload naming.

Plain mutable records owned by :class:`placer.state.PlacerState` (nothing else mutates
them); views (``JobRec.view``) turn them into wire structs. Workload ids name
``<job>.<attempt>.<rank>``, so any report can be traced back to the attempt it
belongs to, after a placer restart too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from scheduler_link.messages import JobSpec, JobView, Peer, Placement, PodView, TopologyPath

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "cancelled", "preempted"})
STALE_PRIORITY = 1 << 30


class JobError(Exception):
    """A job request the placer refuses (bad spec, unknown job, wrong state)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def workload_id(job_id: str, attempt: int, rank: int) -> str:
    return f"{job_id}.{attempt}.{rank}"


def parse_workload_id(wid: str) -> tuple[str, int, int] | None:
    parts = wid.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


@dataclass(frozen=True, slots=True)
class Push:
    """One placement for one node (new pods and/or victims)."""
    node_id: str
    control_url: str
    placement: Placement
    job_id: str
    attempt: int
    kind: str  # "start" (carries the gang's pods) or "stop"


@dataclass(slots=True)
class PodRec:
    rank: int
    node_id: str
    slots: tuple[int, ...]
    uuids: list[str]
    workload_id: str
    state: str = "placing"
    exit_code: int | None = None
    reason: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    fetch: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class JobRec:
    spec: JobSpec
    order: int
    state: str = "pending"
    attempt: int = 0
    restarts: int = 0
    failures: int = 0
    reason: str | None = None
    pods: list[PodRec] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    recovering: bool = False

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def view(self) -> JobView:
        return JobView(job_id=self.job_id, spec=self.spec, state=self.state, attempt=self.attempt,
                       restarts=self.restarts, reason=self.reason, timings=dict(self.timings),
                       pods=[PodView(rank=p.rank, node_id=p.node_id, workload_id=p.workload_id,
                                     gpus=list(p.uuids), gpu_indices=list(p.slots), state=p.state,
                                     exit_code=p.exit_code, reason=p.reason, timings=dict(p.timings),
                                     fetch=dict(p.fetch)) for p in self.pods])


@dataclass(slots=True)
class NodeRec:
    node_id: str
    boot_id: str
    last_seq: int
    control_url: str
    data_url: str
    topology: TopologyPath
    nvlink_domain: str | None
    uuids: list[str]
    fatal: set[int] = field(default_factory=set)      # slots the agent reports fatal
    refused: set[int] = field(default_factory=set)    # slots marked unhealthy after a refusal
    host_fatal: bool = False
    simulated: bool = False
    state: str = "up"                                 # up | lost
    last_seen: float = 0.0
    lost_since: float | None = None
    manifests: set[str] = field(default_factory=set)
    workloads: dict[str, str] = field(default_factory=dict)   # live workload id -> state
    stale: dict[str, tuple[int, ...]] = field(default_factory=dict)  # workload -> slots, to stop
    tell: set[str] = field(default_factory=set)       # stale workloads to name in the next reply

    def slot_of(self, uuid: str) -> int | None:
        try:
            return self.uuids.index(uuid)
        except ValueError:
            return None

    def peer(self) -> Peer:
        t = self.topology
        return Peer(node_id=self.node_id, data_url=self.data_url, zone=t.zone, block=t.block, rack=t.rack)
