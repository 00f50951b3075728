"""The placer service's bookkeeping: nodes, jobs, pods, and what to push next.

Theory of operation
-------------------
``PlacerState`` is the one owner of the service's mutable state. It is plain,
synchronous code (no sockets, no trio, ``now`` passed in): every method applies one
input — an agent report, a submission, a cancel, the acks of a push, a clock tick —
and returns the pushes the service must carry out (:class:`Push`: a Placement for
one node). The trio service calls these methods between awaits, so no two inputs
ever interleave, and performs the returned pushes outside.

Soft state. Allocations live only in the numpy model (placer core, helper E) and are
rebuilt from the agents' full reports: a report lists every workload a node runs;
its ``workload_id`` names ``<job>.<attempt>.<rank>``. After a restart, jobs come back
from the journal (spec only) as *recovering*; for ``recover_window_s`` reports adopt
their pods (the highest attempt seen wins). Then a job whose gang is complete runs on,
a job with a partial gang has its pods stopped and is requeued, a job with no pods is
placed again. Nothing is placed twice: recovered jobs are not placed before the window
ends, and any workload that is not the current attempt of a live job is told to stop.

Invariants:
- A GPU slot is held in the model by at most one job (the core guarantees it; we only
  ever ``assign`` slots a report shows in use, or ``allocate`` a core decision).
- A job's pods all belong to one attempt; a pod of an older attempt is *stale* and is
  only ever stopped (victims are never resurrected).
- Slots held by stale workloads stay taken (pseudo-job ``stale:<workload>``) until the
  agent reports them terminal.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import msgspec

from scheduler_link.messages import (
    TERMINAL_STATES,
    JobSpec,
    NodeReport,
    NodeView,
    Peer,
    Placement,
    PodAssignment,
    ReportReply,
    Victim,
    WorkloadEvent,
    WorkloadStatus,
)

from .config import PlacerConfig
from .records import (  # noqa: F401  (re-exported for the service)
    JOB_ID_RE,
    STALE_PRIORITY,
    TERMINAL_JOB_STATES,
    JobError,
    JobRec,
    NodeRec,
    PodRec,
    Push,
    parse_workload_id,
    workload_id,
)

log = logging.getLogger("herd.placer.state")


class PlacerState:
    """See the module docstring. ``core`` is the placer core module (helper E's API)."""

    def __init__(self, config: PlacerConfig, core: Any, *, started_at: float) -> None:
        self.cfg = config
        self.core = core
        self.model = core.ClusterModel.build([])
        self._clock: Any = None
        self.queue = core.JobQueue(place_fn=self._timed_place)
        self.nodes: dict[str, NodeRec] = {}
        self.jobs: dict[str, JobRec] = {}
        self._order = 0
        self._pid = 0
        self.recover_until = started_at
        self._recovering = False                    # some job still waits for _finish_recovery
        self.counters: dict[str, int] = {
            "reports": 0, "full_reports": 0, "conflicts": 0, "decisions": 0, "preemptions": 0,
            "rollbacks": 0, "requeues": 0, "nodes_lost": 0, "fenced_stops": 0,
        }
        self.decision_s: list[float] = []
        self._ended: list[tuple[str, str, float]] = []
        self.node_jobs: dict[str, set[str]] = {}   # node -> jobs that placed pods there (pruned lazily)
        self.dirty = True                           # capacity or the queue changed since schedule()

    def drain_ended(self) -> list[tuple[str, str, float]]:
        """Jobs that reached a terminal state since the last call (for the journal)."""
        out, self._ended = self._ended, []
        return out

    def _assign(self, job_id: str, node_id: str, slots: Iterable[int], priority: int, preemptible: bool) -> bool:
        try:
            self.model.assign(job_id, node_id, list(slots), priority, preemptible)
            return True
        except (KeyError, ValueError, self.core.Conflict) as e:
            log.warning("cannot record allocation job=%s node=%s slots=%s: %s", job_id, node_id, list(slots), e)
            return False

    # ------------------------------------------------------------ jobs

    def validate(self, spec: JobSpec) -> None:
        if not JOB_ID_RE.match(spec.job_id):
            raise JobError("job id must be 1-63 characters of [A-Za-z0-9_-], starting alphanumeric")
        if spec.pods < 1 or spec.gpus_per_pod < 1:
            raise JobError("pods and gpus_per_pod must be >= 1")
        if spec.pods * spec.gpus_per_pod > 1 << 22:
            raise JobError("job asks for more GPUs than any cluster has")
        if spec.grace_s < 0 or spec.grace_s > 86400:
            raise JobError("grace_s must be within 0..86400")
        if not spec.argv:
            raise JobError("argv must not be empty")
        if spec.restart.kind == "on-failure" and spec.restart.limit < 0:
            raise JobError("restart limit must be >= 0")
        for k in spec.env:
            if not k or "=" in k or "\0" in k:
                raise JobError(f"bad environment variable name {k!r}")
        if not -STALE_PRIORITY < spec.priority < STALE_PRIORITY:
            raise JobError(f"priority must be within +-{STALE_PRIORITY - 1}")
        try:
            self._request_of(spec).validate()
        except ValueError as e:  # the core's InvalidSpec
            raise JobError(str(e)) from None
        if spec.job_id in self.jobs:
            raise JobError(f"job {spec.job_id} already exists", status=409)

    def submit(self, spec: JobSpec, now: float, *, recovering: bool = False) -> JobRec:
        self.validate(spec)
        self._order += 1
        job = JobRec(spec=spec, order=self._order, recovering=recovering,
                     state="pending", timings={"submitted": now})
        self._recovering |= recovering
        self.jobs[spec.job_id] = job
        self.dirty = True
        self._enqueue(job, now)
        return job

    def _enqueue(self, job: JobRec, now: float) -> None:
        """A pending job waits in the core's queue (priority, FIFO, backfill, reservations);
        recovering jobs join it only when the recovery window ends."""
        job.state = "pending"
        if not job.recovering and job.job_id not in self.queue:
            self.queue.submit(self._request(job), now)
        self.dirty = True

    def _dequeue(self, job: JobRec) -> None:
        if job.job_id in self.queue:
            self.queue.cancel(job.job_id)

    def cancel(self, job_id: str, now: float) -> list[Push]:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no such job {job_id}", status=404)
        if job.state in TERMINAL_JOB_STATES:
            return []
        return self._end_attempt(job, "cancelled", now, reason="cancelled by operator")

    def update_artifact(self, job_id: str, manifest_id: str, origin: str | None) -> JobRec:
        """Point a live job at another manifest. Pods already placed keep theirs; the next
        attempt (a requeue after preemption, a restart) runs the new one."""
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no such job {job_id}", status=404)
        if job.state in TERMINAL_JOB_STATES:
            raise JobError(f"job {job_id} has ended ({job.state})", status=409)
        if not re.fullmatch(r"[0-9a-f]{64}", manifest_id):
            raise JobError("manifest_id must be 64 lowercase hex characters (a manifest id, not a ref)")
        job.spec = msgspec.structs.replace(job.spec, manifest_id=manifest_id,
                                           origin=origin if origin is not None else job.spec.origin)
        return job

    def requeue(self, job_id: str, now: float, *, reason: str) -> list[Push] | None:
        """Stop a placed job and put it back in the queue whatever its policy (defrag moves)."""
        job = self.jobs.get(job_id)
        if job is None or job.state not in ("starting", "running"):
            return None
        pushes = self._end_attempt(job, "preempted", now, reason=reason)
        if job.state != "pending":  # its policy would end it: a move never ends a job
            self._ended = [e for e in self._ended if e[0] != job_id]
            job.reason = reason
            self._enqueue(job, now)
            job.timings.pop("ended", None)
        return pushes

    def live_jobs(self) -> list[JobRec]:
        return [j for j in self.jobs.values() if j.state not in TERMINAL_JOB_STATES]

    # ------------------------------------------------------------ reports

    def ingest(self, node_id: str, rep: NodeReport, now: float) -> tuple[int, ReportReply, list[Push]]:
        """Apply one report. Returns (HTTP status, reply, pushes)."""
        self.counters["reports"] += 1
        if rep.node_id != node_id:
            return 400, ReportReply(ok=False), []
        node = self.nodes.get(node_id)
        if not rep.full:
            if node is None or node.boot_id != rep.boot_id or rep.seq != node.last_seq + 1:
                self.counters["conflicts"] += 1
                return 409, ReportReply(ok=False, need_full=True), []
            node.last_seq = rep.seq
            node.last_seen = now
            pushes = self._node_back(node, now)
            if rep.snapshot is not None:
                self._apply_snapshot(node, rep.snapshot)
            if rep.manifests is not None:
                node.manifests = set(rep.manifests)
            for ev in rep.events:
                pushes += self._apply_event(node, ev, now)
            return 200, self._reply(node), pushes
        return self._register(rep, now)

    def _reply(self, node: NodeRec, *, need_full: bool = False) -> ReportReply:
        stop = [Victim(workload_id=w, grace_s=self._grace_of(w), reason="fenced: gang placed elsewhere")
                for w in sorted(node.tell) if w in node.stale and node.workloads.get(w) not in TERMINAL_STATES]
        node.tell.clear()
        return ReportReply(ok=True, need_full=need_full or bool(node.refused), stop=stop,
                           heartbeat_interval_s=self.cfg.heartbeat_s)

    def _grace_of(self, wid: str) -> float:
        parsed = parse_workload_id(wid)
        job = self.jobs.get(parsed[0]) if parsed else None
        return job.spec.grace_s if job else 10.0

    def _register(self, rep: NodeReport, now: float) -> tuple[int, ReportReply, list[Push]]:
        self.counters["full_reports"] += 1
        snap = rep.snapshot
        gpus = sorted(snap.gpus, key=lambda g: g.index) if snap else []
        uuids = [g.uuid for g in gpus]
        old = self.nodes.get(rep.node_id)
        nvd = rep.nvlink_domain or (snap.nvlink_domain if snap else None)
        node = NodeRec(node_id=rep.node_id, boot_id=rep.boot_id, last_seq=rep.seq,
                       control_url=rep.control_url, data_url=rep.data_url, topology=rep.topology,
                       nvlink_domain=nvd, uuids=uuids, simulated=bool(snap and snap.simulated),
                       last_seen=now, manifests=set(rep.manifests or ()))
        pushes: list[Push] = []
        if old is not None:
            pushes += self._node_back(old, now)
        spec = self.core.NodeSpec(node_id=rep.node_id, zone=rep.topology.zone, block=rep.topology.block,
                                  rack=rep.topology.rack, n_gpus=len(uuids), nvlink_domain=nvd)
        # Forget what we believed about this node's GPUs: the report is the truth.
        self._release_node_holdings(rep.node_id)
        self.model.upsert_node(spec)
        self.nodes[rep.node_id] = node
        if snap is not None:
            if old is not None and old.uuids == uuids:
                prev_bad, prev_fatal = old.fatal | old.refused, old.host_fatal
            else:  # a new node: all healthy in the model
                prev_bad, prev_fatal = set(), False
            self._apply_snapshot(node, snap, prev_bad=prev_bad, prev_host_fatal=prev_fatal)
            if old is not None and old.uuids != uuids:  # a changed inventory: say everything
                for i in range(len(uuids)):
                    self.model.set_gpu_health(rep.node_id, i, i not in node.fatal)
                self.model.set_node_state(rep.node_id, healthy=not node.host_fatal)
        reported: set[str] = set()
        ended: list[WorkloadStatus] = []
        for w in rep.workloads:
            node.workloads[w.workload_id] = w.state
            if w.state in TERMINAL_STATES:
                ended.append(w)
                continue
            reported.add(w.workload_id)
            slots = tuple(s for s in (node.slot_of(u) for u in w.gpus) if s is not None)
            if not self._adopt(node, w.workload_id, w.job_id, slots, w.gpus, w.state, now):
                node.stale[w.workload_id] = slots
                node.tell.add(w.workload_id)
                if slots:
                    self._assign(f"stale:{w.workload_id}", rep.node_id, slots, STALE_PRIORITY, False)
        # Pods we placed on this node that the agent does not know (lost with its state,
        # or a push that never landed): the gang is broken.
        self.dirty = True
        # Events riding on a full report: the workload list above is the state; keep what only
        # the events carry (when each state was reached, the fetch figures).
        for ev in rep.events:
            self._note_event(node, ev)
        # Workloads the report shows ended: their end is news if its event has not come yet
        # (a full report can overtake the event); apply it as one, never call them vanished.
        for w in ended:
            pushes += self._apply_event(node, WorkloadEvent(
                workload_id=w.workload_id, job_id=w.job_id, state=w.state, at=w.updated_at or now,
                exit_code=w.exit_code, reason=w.reason, gpus=list(w.gpus), placement_id=w.placement_id), now)
        for job_id in sorted(self.node_jobs.get(rep.node_id, ())):
            job = self.jobs.get(job_id)
            if job is None or job.recovering or job.state in TERMINAL_JOB_STATES:
                continue
            for p in job.pods:
                if (p.node_id == rep.node_id and p.workload_id not in reported and p.state not in TERMINAL_STATES
                        and p.state != "placing" and now - job.timings.get("acked", now) > 1.0):
                    p.state, p.reason = "lost", "not reported by its node"
                    pushes += self._end_attempt(job, "lost", now, reason=f"pod {p.rank} vanished from {rep.node_id}")
                    break
        return 200, self._reply(node), pushes

    def _release_node_holdings(self, node_id: str) -> None:
        old = self.nodes.get(node_id)
        if old is not None:
            for wid in old.stale:
                self._release_quiet(f"stale:{wid}")

    def _release_quiet(self, job_id: str) -> None:
        try:
            self.model.release(job_id)
        except (KeyError, ValueError):
            pass

    def _adopt(self, node: NodeRec, wid: str, job_id: str, slots: tuple[int, ...], uuids: list[str],
               state: str, now: float) -> bool:
        """A reported live workload: is it the current attempt of a live job (adopt it)?"""
        parsed = parse_workload_id(wid)
        job = self.jobs.get(job_id)
        if parsed is None or job is None or parsed[0] != job_id or job.state in TERMINAL_JOB_STATES:
            return False
        _, attempt, rank = parsed
        if job.recovering and attempt >= job.attempt:
            if attempt > job.attempt:
                old = list(job.pods)  # an older attempt adopted first: it is stale now
                for p in old:
                    self._mark_stale(p)
                    if p.node_id in self.nodes:
                        self.nodes[p.node_id].tell.add(p.workload_id)
                job.pods = []
                self._release_quiet(job_id)
                self._hold(old)
                job.attempt = attempt
            if any(p.rank == rank for p in job.pods) or rank >= job.spec.pods:
                return False
            if not self._assign(job_id, node.node_id, slots, job.spec.priority, job.spec.preemptible):
                return False
            job.pods.append(PodRec(rank=rank, node_id=node.node_id, slots=slots, uuids=list(uuids),
                                   workload_id=wid, state=state))
            self.node_jobs.setdefault(node.node_id, set()).add(job_id)
            job.pods.sort(key=lambda p: p.rank)
            return True
        if attempt != job.attempt:
            return False
        for p in job.pods:
            if p.workload_id == wid and p.node_id == node.node_id:
                if p.state not in TERMINAL_STATES:
                    p.state = state
                    self._assign(job_id, node.node_id, p.slots, job.spec.priority, job.spec.preemptible)
                    self._maybe_running(job, now)
                    return True
        return False

    def _mark_stale(self, p: PodRec) -> None:
        n = self.nodes.get(p.node_id)
        if n is not None and p.state not in TERMINAL_STATES:
            n.stale[p.workload_id] = p.slots

    def _apply_snapshot(self, node: NodeRec, snap: Any, *, prev_bad: set[int] | None = None,
                        prev_host_fatal: bool | None = None) -> None:
        """Health from a snapshot. Only what changed is pushed into the model, so a node
        registering healthy costs no model call (its rebuild stays deferred: registering
        a whole fleet after a restart costs one rebuild, not one per node)."""
        gpus = sorted(snap.gpus, key=lambda g: g.index)
        if [g.uuid for g in gpus] != node.uuids:
            return  # inventory changed: the next full report rebuilds the node
        self.dirty = True
        before = (node.fatal | node.refused) if prev_bad is None else prev_bad
        was_fatal = node.host_fatal if prev_host_fatal is None else prev_host_fatal
        node.refused.clear()  # the agent has spoken about every GPU again
        node.fatal = {i for i, g in enumerate(gpus) if g.health == "fatal"}
        node.host_fatal = snap.host.state == "fatal"
        for i in sorted(before ^ node.fatal):
            if i < len(gpus):
                self.model.set_gpu_health(node.node_id, i, i not in node.fatal)
        if node.host_fatal != was_fatal:
            self.model.set_node_state(node.node_id, healthy=node.state == "up" and not node.host_fatal)

    def _node_back(self, node: NodeRec, now: float) -> list[Push]:
        if node.state == "lost":
            self.dirty = True
            log.info("node back node=%s after=%.1fs", node.node_id, now - (node.lost_since or now))
            node.state, node.lost_since = "up", None
            self.model.set_node_state(node.node_id, healthy=not node.host_fatal)
        return []

    def _apply_event(self, node: NodeRec, ev: WorkloadEvent, now: float) -> list[Push]:
        node.workloads[ev.workload_id] = ev.state
        if ev.state in TERMINAL_STATES and ev.workload_id in node.stale:
            node.stale.pop(ev.workload_id)
            self._release_quiet(f"stale:{ev.workload_id}")
            self.dirty = True
            return []
        parsed = parse_workload_id(ev.workload_id)
        job = self.jobs.get(ev.job_id)
        if job is None or parsed is None or parsed[1] != job.attempt or job.state in TERMINAL_JOB_STATES:
            return []
        pod = next((p for p in job.pods if p.workload_id == ev.workload_id and p.node_id == node.node_id), None)
        if pod is None or pod.state in TERMINAL_STATES:
            return []
        told_to_stop = pod.state in ("terminating", "cancelled") or job.state in ("pending", "preempted")
        pod.state, pod.exit_code, pod.reason = ev.state, ev.exit_code, ev.reason
        self._note_pod(pod, ev)
        if ev.state == "running":
            self._maybe_running(job, now)
            return []
        if ev.state not in TERMINAL_STATES:
            return []
        if told_to_stop:
            # the attempt already ended (preempted and requeued, cancelled): this pod's end is
            # the stop we asked for, not a failure of the job's next attempt
            return []
        if ev.state == "exited" and ev.exit_code == 0:
            if all(p.state == "exited" and p.exit_code == 0 for p in job.pods):
                return self._end_attempt(job, "succeeded", now, reason=None)
            return []
        if ev.state == "preempted" and job.state in ("preempted",):
            return []
        why = f"pod {pod.rank} on {node.node_id} {ev.state}" + (
            f" (code {ev.exit_code})" if ev.exit_code is not None else "") + (f": {ev.reason}" if ev.reason else "")
        return self._end_attempt(job, "failed", now, reason=why)

    def _note_event(self, node: NodeRec, ev: WorkloadEvent) -> None:
        job = self.jobs.get(ev.job_id)
        if job is None:
            return
        pod = next((p for p in job.pods if p.workload_id == ev.workload_id and p.node_id == node.node_id), None)
        if pod is not None:
            self._note_pod(pod, ev)

    @staticmethod
    def _note_pod(pod: PodRec, ev: WorkloadEvent) -> None:
        pod.timings.setdefault(ev.state, ev.at)
        if ev.bytes_from_origin is not None or ev.bytes_from_peers is not None:
            pod.fetch = {"bytes_from_origin": ev.bytes_from_origin or 0,
                         "bytes_from_peers": ev.bytes_from_peers or 0, "bytes_local": ev.bytes_local or 0}

    def _maybe_running(self, job: JobRec, now: float) -> None:
        if job.state != "running" and job.pods and len(job.pods) == job.spec.pods and all(
                p.state == "running" for p in job.pods):
            job.state = "running"
            job.timings.setdefault("running", now)

    # ------------------------------------------------------------ ending an attempt

    def _end_attempt(self, job: JobRec, cause: str, now: float, *, reason: str | None,
                     hold: bool = True) -> list[Push]:
        """Stop every live pod of the job's current attempt, free its GPUs, then decide by
        cause and restart policy: requeue (new attempt) or a terminal state. With ``hold``
        the stopped pods keep their GPUs (as stale holders) until their node reports them
        gone, so nothing new is pushed onto a GPU still in its grace period."""
        self.dirty = True
        self._dequeue(job)
        live = [p for p in job.pods if p.state not in TERMINAL_STATES]
        pushes = self._stop_pods(job, live, reason=cause if cause != "lost" else "gang broken: node lost")
        self._release_quiet(job.job_id)
        if hold:
            self._hold(live)
        pol = job.spec.restart
        requeue = False
        if cause == "failed" or cause == "lost":
            job.failures += 1
            requeue = (pol.kind == "on-failure" and job.failures <= pol.limit) or (
                cause == "lost" and pol.kind == "on-preemption")
        elif cause == "preempted":
            requeue = pol.kind == "on-preemption"
        job.reason = reason
        if requeue:
            self.counters["requeues"] += 1
            job.restarts += 1
            self._enqueue(job, now)
            job.timings["requeued"] = now
            for k in ("decided", "pushed", "acked", "running"):
                job.timings.pop(k, None)
        else:
            job.state = {"lost": "failed"}.get(cause, cause)
            job.timings["ended"] = now
            self._ended.append((job.job_id, job.state, now))
        log.info("job attempt ended job=%s attempt=%d cause=%s next=%s reason=%s",
                 job.job_id, job.attempt, cause, job.state, reason)
        return pushes

    def _hold(self, pods: Iterable[PodRec]) -> None:
        for p in pods:
            if p.node_id not in self.nodes or not p.slots:
                continue
            try:
                free = set(self.model.free_gpus(p.node_id))
            except (KeyError, ValueError):
                continue
            slots = [s for s in p.slots if s in free]
            if slots:
                self._assign(f"stale:{p.workload_id}", p.node_id, slots, STALE_PRIORITY, False)

    def _stop_pods(self, job: JobRec, pods: Iterable[PodRec], *, reason: str) -> list[Push]:
        by_node: dict[str, list[Victim]] = {}
        for p in pods:
            self._mark_stale(p)
            p.state = "terminating" if p.state != "placing" else "cancelled"
            by_node.setdefault(p.node_id, []).append(
                Victim(workload_id=p.workload_id, grace_s=job.spec.grace_s, reason=reason))
        out = []
        for node_id, victims in by_node.items():
            node = self.nodes.get(node_id)
            if node is None:
                continue
            if node.state != "up":  # a lost node hears about it when it comes back
                node.tell.update(v.workload_id for v in victims)
                continue
            self._pid += 1
            pl = Placement(placement_id=f"stop:{job.job_id}:{job.attempt}:{node_id}:{self._pid}",
                           job_id=job.job_id, victims=victims, grace_s=job.spec.grace_s)
            out.append(Push(node_id, node.control_url, pl, job.job_id, job.attempt, "stop"))
        return out

    # ------------------------------------------------------------ deciding

    def schedule(self, now: float, *, clock: Any = None) -> list[tuple[JobRec, list[Push]]]:
        """Try every pending job (strict priority, FIFO within one; a job that does not fit
        does not block smaller ones). Returns, per decided job, its pushes (victim stops
        folded into the same per-node placement as the new pods)."""
        if now < self.recover_until or not self.dirty:
            return []
        self.dirty = False
        self._finish_recovery(now)
        self._clock = clock
        try:
            decisions = self.queue.schedule(self.model, now)
        except Exception:  # a core bug: keep serving; the next change tries again
            log.exception("scheduling round failed")
            return []
        out = []
        for decision in decisions:
            job = self.jobs.get(decision.job_id)
            if job is None or job.state != "pending":  # cannot happen; never leak GPUs if it does
                self._release_quiet(decision.job_id)
                continue
            out.append((job, self._apply_decision(job, decision, now)))
        return out

    def _timed_place(self, model: Any, req: Any, **kw: Any) -> Any:
        t0 = self._clock() if self._clock else 0.0
        try:
            return self.core.place(model, req, **kw)
        finally:
            if self._clock:
                self.decision_s.append(self._clock() - t0)
                del self.decision_s[:-1000]

    def _request(self, job: JobRec) -> Any:
        return self._request_of(job.spec)

    def _request_of(self, s: JobSpec) -> Any:
        return self.core.JobRequest(job_id=s.job_id, pods=s.pods, gpus_per_pod=s.gpus_per_pod, within=s.within,
                                    priority=s.priority, preemptible=s.preemptible, whole_nodes=s.whole_nodes)

    def _apply_decision(self, job: JobRec, decision: Any, now: float) -> list[Push]:
        """A decision the queue already applied to the model (victims released, GPUs given)."""
        self.counters["decisions"] += 1
        # Victims first: their attempts end (never resurrected), their stops ride along.
        victim_stops: dict[str, list[Victim]] = {}
        victim_pods: list[PodRec] = []
        for vid in decision.victims:
            vjob = self.jobs.get(vid)
            if vjob is None:
                continue
            self.counters["preemptions"] += 1
            victim_pods += [p for p in vjob.pods if p.state not in TERMINAL_STATES]
            for push in self._end_attempt(vjob, "preempted", now, reason=f"preempted by {job.job_id}",
                                          hold=False):
                victim_stops.setdefault(push.node_id, []).extend(push.placement.victims)
        self._hold(victim_pods)  # victims' GPUs the new gang does not take stay held until gone
        job.attempt += 1
        job.state = "placing"
        job.reason = None
        job.timings["decided"] = now
        job.pods = []
        for pp in decision.pods:
            node = self.nodes[pp.node_id]
            slots = tuple(int(s) for s in pp.slots)
            self.node_jobs.setdefault(pp.node_id, set()).add(job.job_id)
            job.pods.append(PodRec(rank=int(pp.rank), node_id=pp.node_id, slots=slots,
                                   uuids=[node.uuids[s] for s in slots],
                                   workload_id=workload_id(job.job_id, job.attempt, int(pp.rank))))
        job.pods.sort(key=lambda p: p.rank)
        return self._start_pushes(job, victim_stops)

    def _peers(self, job: JobRec) -> list[Peer]:
        gang = list(dict.fromkeys(p.node_id for p in job.pods))
        peers = [self.nodes[n].peer() for n in gang]
        mid = job.spec.manifest_id
        if mid:
            extra = [n for n in self.nodes.values()
                     if n.state == "up" and mid in n.manifests and n.node_id not in set(gang)]
            peers += [n.peer() for n in extra[: self.cfg.max_peers]]
        return peers

    def _start_pushes(self, job: JobRec, victim_stops: dict[str, list[Victim]]) -> list[Push]:
        s = job.spec
        peers = self._peers(job)
        by_node: dict[str, list[PodAssignment]] = {}
        for p in job.pods:
            by_node.setdefault(p.node_id, []).append(
                PodAssignment(workload_id=p.workload_id, rank=p.rank, gpus=list(p.uuids), gpu_indices=list(p.slots)))
        out = []
        for node_id, pods in by_node.items():
            node = self.nodes[node_id]
            pl = Placement(placement_id=f"start:{job.job_id}:{job.attempt}:{node_id}", job_id=job.job_id,
                           pods=pods, victims=victim_stops.pop(node_id, []), world_size=s.pods,
                           argv=list(s.argv), env=dict(s.env), manifest_id=s.manifest_id, origin=s.origin,
                           peers=peers, grace_s=s.grace_s, restart=s.restart)
            out.append(Push(node_id, node.control_url, pl, job.job_id, job.attempt, "start"))
        for node_id, victims in victim_stops.items():  # victims on nodes that get no new pod
            node = self.nodes[node_id]
            self._pid += 1
            pl = Placement(placement_id=f"stop:{job.job_id}:{job.attempt}:{node_id}:{self._pid}",
                           job_id=job.job_id, victims=victims)
            out.append(Push(node_id, node.control_url, pl, job.job_id, job.attempt, "stop"))
        return out

    def on_acks(self, job_id: str, attempt: int, acks: dict[str, tuple[bool, str | None]],
                now: float, starts: Iterable[Push] = ()) -> list[Push]:
        """Results of a job's start pushes: node -> (accepted, reason). All-or-nothing.
        If the attempt ended while its pushes were in flight (cancelled, preempted), the
        nodes that accepted are told again to stop it: a stop that overtook its start
        found nothing to stop."""
        job = self.jobs.get(job_id)
        if job is None or job.attempt != attempt or job.state not in ("placing", "starting", "running"):
            late = []
            for push in starts:
                if push.kind != "start" or not acks.get(push.node_id, (False, None))[0]:
                    continue
                node = self.nodes.get(push.node_id)
                if node is None or node.state != "up":
                    continue
                for pod in push.placement.pods:
                    node.stale.setdefault(pod.workload_id, tuple(pod.gpu_indices))
                self._pid += 1
                pl = Placement(placement_id=f"stop:{job_id}:{attempt}:{push.node_id}:{self._pid}", job_id=job_id,
                               victims=[Victim(workload_id=pod.workload_id, grace_s=push.placement.grace_s,
                                               reason="attempt ended while it was being placed")
                                        for pod in push.placement.pods])
                late.append(Push(push.node_id, node.control_url, pl, job_id, attempt, "stop"))
            return late
        job.timings.setdefault("acked", now)  # (events may have raced ahead of the acks)
        refused = {n: r for n, (ok, r) in acks.items() if not ok}
        if not refused:
            if job.state == "placing":
                job.state = "starting"
            for p in job.pods:
                if p.state == "placing":
                    p.state = "accepted"
            self._maybe_running(job, now)
            return []
        self.counters["rollbacks"] += 1
        self.dirty = True
        for node_id, why in refused.items():
            node = self.nodes.get(node_id)
            if node is None:
                continue
            named = {i for i, u in enumerate(node.uuids) if why and u in why}
            suspects = named or {s for p in job.pods if p.node_id == node_id for s in p.slots}
            if why and ("unreachable" in why or "no answer" in why):
                suspects = set()  # a transport failure says nothing about the GPUs
            for s in suspects:
                node.refused.add(s)
                self.model.set_gpu_health(node_id, s, False)
            for p in job.pods:
                if p.node_id == node_id:
                    p.state, p.reason = "failed", f"refused: {why}"
        log.warning("gang refused job=%s attempt=%d refusals=%s", job_id, attempt, refused)
        accepted = [p for p in job.pods if p.node_id not in refused]
        pushes = self._stop_pods(job, accepted, reason="gang rolled back: a node refused its part")
        self._release_quiet(job_id)
        self._hold(accepted)  # their GPUs stay taken until those pods are gone
        self._enqueue(job, now)
        job.reason = "; ".join(f"{n}: {r}" for n, r in refused.items())
        for k in ("decided", "pushed", "acked"):
            job.timings.pop(k, None)
        return pushes

    # ------------------------------------------------------------ time

    def tick(self, now: float) -> list[Push]:
        """Lost nodes (missed heartbeats), then fencing: after ``fence_after_s`` more, the
        gangs with pods on a lost node end their attempt (requeued by policy)."""
        pushes: list[Push] = []
        for node in self.nodes.values():
            if node.state == "up" and now - node.last_seen > self.cfg.lost_after_s:
                node.state, node.lost_since = "lost", now
                self.dirty = True
                self.counters["nodes_lost"] += 1
                self.model.set_node_state(node.node_id, healthy=False)
                log.warning("node lost node=%s silent=%.1fs", node.node_id, now - node.last_seen)
        fenced = {n.node_id for n in self.nodes.values()
                  if n.state == "lost" and n.lost_since is not None and now - n.lost_since >= self.cfg.fence_after_s}
        if fenced:
            for job in self.live_jobs():
                bad = [p for p in job.pods if p.node_id in fenced and p.state not in TERMINAL_STATES]
                if bad and job.state in ("placing", "starting", "running"):
                    for p in bad:
                        self._mark_stale(p)
                        p.state, p.reason = "lost", "node lost (fenced)"
                        self.counters["fenced_stops"] += 1
                    pushes += self._end_attempt(job, "lost", now, reason=f"node {bad[0].node_id} lost")
        return pushes

    def _finish_recovery(self, now: float) -> None:
        # every schedule round comes here: scan the jobs only while some are still recovering
        if not self._recovering:
            return
        for job in self.jobs.values():
            if not job.recovering:
                continue
            job.recovering = False
            ranks = {p.rank for p in job.pods}
            if job.pods and ranks == set(range(job.spec.pods)):
                job.state = "starting"
                self._maybe_running(job, now)
                log.info("job recovered from reports job=%s attempt=%d", job.job_id, job.attempt)
            elif job.pods:
                # a partial gang cannot run: its survivors are told to stop in their node's
                # next reply and keep their GPUs until they are gone
                survivors = list(job.pods)
                for p in survivors:
                    self._mark_stale(p)
                    if p.node_id in self.nodes:
                        self.nodes[p.node_id].tell.add(p.workload_id)
                self._release_quiet(job.job_id)
                self._hold(survivors)
                job.pods = []
                job.reason = "partial gang after placer restart"
                self._enqueue(job, now)
            else:
                self._enqueue(job, now)
        self._recovering = False

    # ------------------------------------------------------------ views

    def stop_failed(self, node_id: str, victims: Iterable[Victim]) -> None:
        """A stop push got no answer: name those workloads in the node's next reply."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.tell.update(v.workload_id for v in victims)

    def node_view(self, n: NodeRec) -> NodeView:
        unhealthy = sorted(n.fatal | n.refused)
        try:
            free = len(self.model.free_gpus(n.node_id)) if n.state == "up" else 0
        except (KeyError, ValueError):
            free = 0
        live = sum(1 for s in n.workloads.values() if s not in TERMINAL_STATES)
        return NodeView(node_id=n.node_id, state=n.state, control_url=n.control_url, data_url=n.data_url,
                        topology=n.topology, nvlink_domain=n.nvlink_domain, gpus=len(n.uuids),
                        free_gpus=free, unhealthy_gpus=unhealthy, workloads=live, simulated=n.simulated,
                        last_seen=n.last_seen)
