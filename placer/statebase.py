"""What every part of :class:`placer.state.PlacerState` shares: its data, its indexes, and
the small helpers over the model. The parts (reports, attempts, scheduling, views) are
mixins over this base; the cross-part methods are declared here so each module can be
read, and type-checked, alone.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from infra.metrics import LatencyHistogram
from scheduler_link.messages import JobSpec, RackBeatReply, ReportReply, Victim, WorkloadEvent

from .config import PlacerConfig
from .errors import Conflict, InvalidSpec, UnknownJob, UnknownNode
from .inventories import InventoryBook
from .model import ClusterModel
from .place import Decision, JobRequest
from .queue import JobQueue
from .records import STALE_PRIORITY, JobRec, NodeRec, PodRec, PodTable, Push, parse_workload_id
from .timers import Deadlines, DenseDeadlines

log = logging.getLogger("herd.placer.state")

MODEL_ERRORS = (KeyError, ValueError, Conflict, InvalidSpec, UnknownJob, UnknownNode)


class CurrentPods(Mapping[str, "tuple[JobRec, PodRec]"]):
    """The current attempts' pods by workload id, read from the jobs' tables (a workload id
    names its job, attempt and rank): no entry a pod is kept."""

    __slots__ = ("_jobs",)

    def __init__(self, jobs: dict[str, JobRec]) -> None:
        self._jobs = jobs

    def get(self, wid: str, default: Any = None) -> Any:  # (Mapping.get, without a raise and catch)
        parsed = parse_workload_id(wid)
        if parsed is None:
            return default
        job = self._jobs.get(parsed[0])
        if job is None or job.attempt != parsed[1]:
            return default
        i = job.table.row_of(parsed[2])
        if i is None:
            return default
        v = job.table.view(i)
        return (job, v) if v.workload_id == wid else default

    def __getitem__(self, wid: str) -> tuple[JobRec, PodRec]:
        hit = self.get(wid)
        if hit is None:
            raise UnknownJob(f"no current pod {wid}")
        return hit

    def __contains__(self, wid: object) -> bool:
        return isinstance(wid, str) and self.get(wid) is not None

    def __iter__(self) -> Iterator[str]:
        return iter([p.workload_id for j in list(self._jobs.values()) for p in j.pods])

    def __len__(self) -> int:
        return sum(j.n_pods for j in self._jobs.values())


class StateBase:
    cordons: dict[str, str]  # node id -> why it is cordoned (owned by placer.nodeops)

    def __init__(self, config: PlacerConfig, *, started_at: float,
                 place_fn: Callable[..., Decision | None] | None = None) -> None:
        self.cfg = config
        self.model = ClusterModel.build([])
        self._clock: Callable[[], float] | None = None
        self.queue = JobQueue(place_fn=place_fn or self._timed_place)
        self.nodes: dict[str, NodeRec] = {}
        self.jobs: dict[str, JobRec] = {}
        self.pods = CurrentPods(self.jobs)                  # current-attempt pods by workload id
        self.node_states: Counter[str] = Counter()          # up / lost
        self.silent_nodes = 0                               # up, held silent in a mass silence (placer.attempts)
        self.mass_silence_since: float | None = None
        self._recent_lost: deque[tuple[float, int]] = deque()   # (when, how many) declared lost lately
        self.membership_changes = 0                         # nodes added, up <-> lost (placer.fleetsnap's trigger)
        self.simulated_nodes = 0                            # of self.nodes, with simulated GPUs (O(1) for /v1/cluster)
        self.uuid_owner: dict[str, str] = {}                # GPU UUID -> the node reporting it
        self.manifest_holders: dict[str, set[str]] = {}     # manifest id -> up nodes holding it
        self.degraded_nodes: set[str] = set()               # nodes with a GPU reported degraded
        self.inventories = InventoryBook()                  # GPU inventories registered (placer.inventories)
        self.blobs: dict[str, bytes] = {}                   # gang blob id -> canonical bytes
        self.lost_timer: DenseDeadlines[str] = DenseDeadlines()  # every up node, moved by each beat
        self.fence_timer: Deadlines[str] = Deadlines()
        self.requeue_timer: Deadlines[str] = Deadlines()    # rolled-back gangs, backing off
        self._order = 0
        # stop placement ids count on from this start's time (us): a restarted placer never reuses one an
        # agent remembers as done (it would answer the new stop from memory and not act)
        self._pid = int(started_at * 1_000_000)
        self.recover_until = started_at
        self._recovering = False                    # some job still waits for _finish_recovery
        self.counters: dict[str, int] = {
            "reports": 0, "full_reports": 0, "conflicts": 0, "decisions": 0, "preemptions": 0,
            "rollbacks": 0, "requeues": 0, "nodes_lost": 0, "fenced_stops": 0, "refused_reports": 0,
            "rebuilds": 0, "passes": 0, "passes_deferred": 0, "compact_registrations": 0, "inventory_misses": 0,
            "mass_silences": 0, "direct_refusals": 0,
        }
        self.decision_s: list[float] = []
        self.decision_hist = LatencyHistogram()             # every decision since start (metrics)
        self.bookkeeping_s: list[float] = []
        self._ended: list[tuple[str, str, float]] = []
        self.dirty = True                           # capacity or the queue changed since schedule()
        # the answer to almost every heartbeat: one shared object, so the wire can reuse its bytes
        self._ok_reply = ReportReply(ok=True, heartbeat_interval_s=config.heartbeat_s)
        self._ok_beat = RackBeatReply()

    # ------------------------------------------------------------ declared by the parts

    def _end_attempt(self, job: JobRec, cause: str, now: float, *, reason: str | None,
                     hold: bool = True, victims_of: dict[str, list[Victim]] | None = None,
                     held: list[tuple[str, str, tuple[int, ...]]] | None = None) -> list[Push]:
        raise NotImplementedError

    def _apply_event(self, node: NodeRec, ev: WorkloadEvent, now: float) -> list[Push]:
        raise NotImplementedError

    def _enqueue(self, job: JobRec, now: float) -> None:
        raise NotImplementedError

    def _request_of(self, s: JobSpec) -> JobRequest:
        raise NotImplementedError

    def _finish_recovery(self, now: float) -> None:
        raise NotImplementedError

    def _timed_place(self, model: ClusterModel, req: JobRequest, *, allow_preemption: bool = True,
                     exclude: np.ndarray | None = None) -> Decision | None:
        raise NotImplementedError

    def _maybe_running(self, job: JobRec, now: float) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ shared helpers

    def drain_ended(self) -> list[tuple[str, str, float]]:
        """Jobs that reached a terminal state since the last call (for the journal)."""
        out, self._ended = self._ended, []
        return out

    def _assign(self, job_id: str, node_id: str, slots: Iterable[int], priority: int, preemptible: bool) -> bool:
        try:
            self.model.assign(job_id, node_id, list(slots), priority, preemptible)
            return True
        except MODEL_ERRORS as e:
            log.warning("cannot record allocation job=%s node=%s slots=%s: %s", job_id, node_id, list(slots), e)
            return False

    def _release_quiet(self, job_id: str) -> None:
        try:
            if self.model.release(job_id):
                self.dirty = True
        except MODEL_ERRORS:
            pass

    def _index_pod(self, job: JobRec, pod: PodRec) -> None:
        node = self.nodes.get(pod.node_id)
        if node is not None:
            node.gangs[job.job_id] = job

    def _unindex_pods(self, job: JobRec) -> None:
        """The job's current pods stop being current (a new attempt, or recovery gave up)."""
        jid, nodes = job.job_id, self.nodes
        for nid in dict.fromkeys(job.table.node_ids):
            node = nodes.get(nid)
            if node is not None and node.gangs.get(jid) is job:
                del node.gangs[jid]

    def _replace_pods(self, job: JobRec, pods: list[PodRec] | PodTable, recs: list[NodeRec] | None = None) -> None:
        """The job's current pods become ``pods`` (standalone pods, or a decision's table);
        ``recs``: the records of the nodes they are on, each once, if at hand (a decision's)."""
        self._unindex_pods(job)
        if isinstance(pods, PodTable):
            job.set_table(pods)
        else:
            job.set_pods(pods)
        jid = job.job_id
        if recs is not None:
            for rec in recs:
                rec.gangs[jid] = job
            return
        nodes = self.nodes
        for nid in dict.fromkeys(job.table.node_ids):   # (one entry a node: 25,000 a big gang)
            node = nodes.get(nid)
            if node is not None:
                node.gangs[jid] = job

    def _mark_stale(self, p: PodRec) -> None:
        n = self.nodes.get(p.node_id)
        if n is not None and not p.terminal:
            n.stale[p.workload_id] = p.slots

    def _hold(self, pods: Iterable[PodRec]) -> None:
        """Stopped pods keep their GPUs (as ``stale:`` holders) until their node reports them gone."""
        nodes = self.nodes
        self._hold_many([(f"stale:{p.workload_id}", p.node_id, p.slots) for p in pods if p.slots and p.node_id in nodes])

    def _hold_many(self, holders: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """:meth:`_hold` of holders made already: (``stale:<workload>``, node, slots)."""
        if holders:
            try:
                self.model.hold_many(holders, STALE_PRIORITY)
            except MODEL_ERRORS as e:
                log.warning("cannot hold the GPUs of %d stopped pods: %s", len(holders), e)

    def _set_node_state(self, node: NodeRec, state: str) -> None:
        if node.state != state:
            self.node_states[node.state] -= 1
            self.node_states[state] += 1
            node.state = state
            self.membership_changes += 1
