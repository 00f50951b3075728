"""Scheduling: submissions, the queue, one pass of decisions, and the placements they make.

A pass (``schedule``) runs when something that could let a pending job fit has changed
(``dirty``). It costs nothing while the queue is empty, and it rebuilds the model at most
once (node arrivals only mark the model dirty). A pass that would rebuild waits until
``rebuild_ok_at``: after each rebuild the next one may come no sooner than four times
its cost, so a fleet registering all at once spends at most a fifth of the placer's time
rebuilding and converges, whatever the arrival rate.

A decided gang's placements are compact (DESIGN.md, Fleet scale): its shared part is a
gang blob (:class:`scheduler_link.messages.GangBlob`, columnar peer table, id = BLAKE3 of
its canonical bytes) encoded once and held here for the attempt; each node's Placement
carries its pods and victims, the blob id, and peers bounded by its rack plus a few
contacts in other racks (small gangs, up to ``FULL_PEERS_UP_TO`` nodes, still list
every member). The post-decision bookkeeping is O(pods) with small constants: the pods
are a table of columns (placer.records.PodTable) and the pushes columns too
(placer.records.GangPushes: no Push or Placement a node unless one is read), per-rack peer
lists shared.
"""

from __future__ import annotations

import itertools
import logging
import operator
import re
from collections.abc import Callable

import msgspec
import numpy as np

from scheduler_link.messages import (
    GangBlob,
    JobSpec,
    Peer,
    PeerTable,
    Victim,
    encode_gang_blob,
)

from .model import ClusterModel
from .place import Decision, JobRequest, place
from .records import (
    JOB_ID_RE,
    NO_VICTIMS,
    STALE_PRIORITY,
    TERMINAL_JOB_STATES,
    GangPushes,
    GangStart,
    JobError,
    JobRec,
    NodeRec,
    PodTable,
    StopPushes,
)
from .statebase import StateBase

log = logging.getLogger("herd.placer.state")

_all_slots = operator.attrgetter("all_slots")
_node_id = operator.attrgetter("node_id")
_data_url = operator.attrgetter("data_url")
_uuids = operator.attrgetter("uuids")

FULL_PEERS_UP_TO = 64      # gangs of at most this many nodes list every member to every node
CONTACTS = 4               # bigger gangs: this many members of other racks per node
REBUILD_SPACING = 4.0      # a rebuild waits this many times the previous one's cost
READ_GRANT_TTL_S = 3600.0  # a gang's read grant lets its nodes read from its contacts this long


class Scheduling(StateBase):
    rebuild_ok_at: float = 0.0
    last_rebuild_s: float = 0.0
    _pass_t0: float = 0.0
    # (manifest id, the gang's node ids, expiry) -> a read grant signed with the bundle key
    # (msgauth.BundleSigner.read_grant), set by the service; None: gangs get no grant
    read_grants: Callable[[str, list[str], float], bytes] | None = None

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
        if (why := spec.limits.problem()) is not None:
            raise JobError(f"limits: {why}")
        if spec.restart.kind == "on-failure" and spec.restart.limit < 0:
            raise JobError("restart limit must be >= 0")
        for k in spec.env:
            if not k or "=" in k or "\0" in k:
                raise JobError(f"bad environment variable name {k!r}")
        if len(spec.env_from_files) > 256 or any(not k or "=" in k or "\0" in k or not p.startswith("/")
                                                 for k, p in spec.env_from_files.items()):
            raise JobError("env_from_files: at most 256 NAME -> absolute host path entries")
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
            self.queue.submit(self._request_of(job.spec), now)
        self.dirty = True

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

    def live_jobs(self) -> list[JobRec]:
        return [j for j in self.jobs.values() if j.state not in TERMINAL_JOB_STATES]

    def _request_of(self, s: JobSpec) -> JobRequest:
        return JobRequest(job_id=s.job_id, pods=s.pods, gpus_per_pod=s.gpus_per_pod, within=s.within,
                          priority=s.priority, preemptible=s.preemptible, whole_nodes=s.whole_nodes)

    # ------------------------------------------------------------ deciding

    def schedule(self, now: float, *, clock: Callable[[], float] | None = None) -> list[tuple[JobRec, GangPushes]]:
        """Try every pending job (strict priority, FIFO within one; a job that does not fit
        does not block smaller ones). Returns, per decided job, its pushes (victim stops
        folded into the same per-node placement as the new pods). ``clock`` (a monotonic
        seconds clock) times decisions and rebuilds; ``now`` is the placer's time."""
        if now < self.recover_until or not self.dirty:
            return []
        self._finish_recovery(now)
        if not len(self.queue):
            self.dirty = False
            return []
        if self.model.needs_rebuild and now < self.rebuild_ok_at:
            self.counters["passes_deferred"] += 1
            return []   # stays dirty: the service's next tick tries again
        self.dirty = False
        self.counters["passes"] += 1
        self._clock = clock
        self._pass_t0 = clock() if clock else 0.0
        if self.model.needs_rebuild:
            t0 = clock() if clock else 0.0
            _ = self.model.n_nodes  # rebuild now, timed
            self.last_rebuild_s = (clock() - t0) if clock else 0.0
            self.counters["rebuilds"] += 1
            self.rebuild_ok_at = now + REBUILD_SPACING * self.last_rebuild_s
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
            t0 = clock() if clock else 0.0
            pushes = self._apply_decision(job, decision, now)
            if clock:
                self.bookkeeping_s.append(clock() - t0)
                del self.bookkeeping_s[:-1000]
            out.append((job, pushes))
        return out

    def _timed_place(self, model: ClusterModel, req: JobRequest, *, allow_preemption: bool = True,
                     exclude: np.ndarray | None = None) -> Decision | None:
        t0 = self._clock() if self._clock else 0.0
        try:
            return place(model, req, allow_preemption=allow_preemption, exclude=exclude)
        finally:
            if self._clock:
                dt = self._clock() - t0
                self.decision_hist.observe(dt)
                self.decision_s.append(dt)
                del self.decision_s[:-1000]

    def _apply_decision(self, job: JobRec, decision: Decision, now: float) -> GangPushes:
        """A decision the queue already applied to the model (victims released, GPUs given)."""
        self.counters["decisions"] += 1
        # Victims first: their attempts end (never resurrected), their stops ride along.
        victim_stops: dict[str, list[Victim]] = {}
        held: list[tuple[str, str, tuple[int, ...]]] = []
        for vid in decision.victims:
            vjob = self.jobs.get(vid)
            if vjob is None:
                continue
            self.counters["preemptions"] += 1
            self._end_attempt(vjob, "preempted", now, reason=f"preempted by {job.job_id}", hold=False,
                              victims_of=victim_stops, held=held)   # (no stop push made: they ride in the gang's)
        self._hold_many(held)  # victims' GPUs the new gang does not take stay held until gone
        job.attempt += 1   # (its previous attempt's pods stop being current in _replace_pods)
        job.state = "placing"
        job.reason = None
        # when the decision was made: the pass's ``now`` plus the time the pass took so far
        job.timings["decided"] = now + (self._clock() - self._pass_t0) if self._clock else now
        ids = decision._node_ids
        node_idx = decision.pod_nodes
        slots_arr = decision.pod_slots
        width = slots_arr.shape[1] if slots_arr.ndim == 2 else 0
        P = len(node_idx)
        # whole-node pods (slots 0..width-1 of a node with width GPUs) share their node's
        # slot tuple and GPU list: found for the whole gang at once, a row is read only if not
        whole_rows = (slots_arr == np.arange(width)).all(axis=1) if width else np.zeros(P, dtype=bool)
        nodes = self.nodes
        names = list(map(ids.__getitem__, node_idx.tolist()))   # (C-level passes: no Python frame a pod)
        recs = list(map(nodes.__getitem__, names))
        slots: list[tuple[int, ...]] = list(map(_all_slots, recs))
        if not (whole_rows.all() and set(map(len, slots)) == {width}):   # (else: every pod a whole node)
            whole = whole_rows.tolist()
            slots = [n.all_slots if w and len(n.uuids) == width else () for n, w in zip(recs, whole, strict=True)]
        uuids: list[list[str]] = list(map(_uuids, recs))
        for r in [r for r, sl in enumerate(slots) if not sl]:   # (the rows that are not whole nodes)
            n = recs[r]
            slots[r] = tuple(s for s in slots_arr[r].tolist() if s >= 0)
            uuids[r] = [n.uuids[s] for s in slots[r]]
        table = PodTable.decided(f"{job.job_id}.{job.attempt}.", names, slots, uuids)
        # the pushes: the gang's nodes in rank order of their first pod, each with its rows
        uniq, first = np.unique(node_idx, return_index=True)
        self._replace_pods(job, table, recs if len(uniq) == P else None)   # (one pod a node: each record once)
        rows: list[list[int]] | None
        in_order = False     # the pushes' order (the ranks') is the topology's
        if len(uniq) == P:   # one pod a node (whole-node gangs): row r is node r's
            gang = recs
            rows = None
            in_order = P < 2 or bool((node_idx[1:] > node_idx[:-1]).all())
        else:
            groups: dict[str, list[int]] = {}
            for r, nid in enumerate(names):
                lst = groups.get(nid)
                if lst is None:
                    groups[nid] = [r]
                else:
                    lst.append(r)
            gang = [nodes[nid] for nid in groups]
            rows = list(groups.values())
        # the model's node indices are in topology order: the gang's, sorted, are too
        order = gang if in_order else [nodes[ids[n]] for n in uniq.tolist()]
        runs = self.model.rack_runs(uniq) if ids is self.model.node_ids else None   # (the decision's model)
        return self._start_pushes(job, victim_stops, now, order, gang, rows, runs,
                                  node_ids=names if rows is None else None)

    def _start_pushes(self, job: JobRec, victim_stops: dict[str, list[Victim]], now: float,
                      order: list[NodeRec], gang: list[NodeRec], rows: list[list[int]] | None,
                      runs: tuple[list[str], list[int], list[int]] | None = None, *,
                      node_ids: list[str] | None = None) -> GangPushes:
        """``order``: the gang's nodes in topology order; ``gang``: the same nodes in the order
        of their first pod's rank, ``rows[k]`` the table rows of ``gang[k]``'s pods (None: one
        pod a node, ``gang[k]``'s in row ``k``); ``runs``: ``order`` by rack, if known
        (ClusterModel.rack_runs); ``node_ids``: ``gang``'s ids, if at hand. The pushes are
        columns (:class:`GangPushes`), by rack when ``gang is order``."""
        s = job.spec
        nodes = self.nodes
        blob_id, peers_of = self._gang_blob(job, gang, order, runs, now)
        # (the gang's contacts are in its blob: scheduler_link.messages.GangBlob)
        gs = GangStart(s, job.attempt, blob_id=blob_id, peers_of=peers_of, n_gang=len(gang),
                       now=now, expires=now + self.cfg.placement_ttl_s, read_grant=job.read_grant)
        # (a node's victims are taken out of victim_stops: what is left is on nodes given no pod)
        victims = [victim_stops.pop(n.node_id, NO_VICTIMS) for n in gang] if victim_stops else None
        # victims on nodes that get no new pod: a stop each, as columns (no Placement made)
        stop_ids = list(victim_stops)
        pid0, self._pid = self._pid, self._pid + len(stop_ids)
        head = f"stop:{job.job_id}:{job.attempt}:"
        extra = StopPushes(job.job_id, job.attempt, now, list(map(nodes.__getitem__, stop_ids)),
                           list(victim_stops.values()),
                           [f"{head}{nid}:{pid0 + k}" for k, nid in enumerate(stop_ids, 1)])
        return GangPushes(gs, gang, job.table, rows, victims, extra, node_ids=node_ids,
                          runs=runs[:2] if runs is not None and gang is order else None)

    def _gang_blob(self, job: JobRec, gang: list[NodeRec], order: list[NodeRec] | None = None,
                   runs: tuple[list[str], list[int], list[int]] | None = None, now: float = 0.0
                   ) -> tuple[str, Callable[[NodeRec], list[Peer]]]:
        """Encode the gang's blob once; return its id and each node's bounded peer list.
        ``runs``: ``order`` by rack (racks, where each begins, each node's rack), if known."""
        s = job.spec
        if order is None:
            order = sorted(gang, key=lambda n: (n.topology.zone, n.topology.block, n.topology.rack, n.node_id))
        if runs is not None:
            racks, rack_start, rack_of = runs
        else:
            racks, rack_start, rack_of = [], [], []
            last = None
            for i, n in enumerate(order):
                path = n.rack_path
                if path != last:
                    racks.append(path)
                    rack_start.append(i)
                    last = path
                rack_of.append(len(racks) - 1)
        table = PeerTable(node_ids=list(map(_node_id, order)), data_urls=list(map(_data_url, order)),
                          rack_of=rack_of, racks=racks, rack_start=rack_start)
        extra = self._holders(s.manifest_id, {n.node_id for n in gang} if s.manifest_id else set())
        # contacts are in no gang of theirs with these nodes: the grant says who may read
        grant = (self.read_grants(s.manifest_id, table.node_ids, now + READ_GRANT_TTL_S)
                 if extra and s.manifest_id and self.read_grants is not None else b"")
        blob = GangBlob(job_id=job.job_id, attempt=job.attempt, argv=list(s.argv), env=dict(s.env),
                        manifest_id=s.manifest_id, origin=s.origin, grace_s=s.grace_s, restart=s.restart,
                        world_size=s.pods, peers=table, user=s.user, limits=s.limits,
                        env_from_files=dict(s.env_from_files), read_grant=grant, contacts=extra)
        blob_id, raw = encode_gang_blob(blob)
        if job.blob_id is not None:
            self.blobs.pop(job.blob_id, None)
        job.blob_id = blob_id
        job.read_grant = grant
        self.blobs[blob_id] = raw
        if len(gang) <= FULL_PEERS_UP_TO:
            everyone = [n.peer() for n in order] + extra
            return blob_id, lambda node: everyone
        # each rack's list, computed once and only if asked (a direct push's Placement; the
        # relays' NodeParts carry none): its members, then one member of each of the racks at
        # distance 1, 2, 4, 8 in rack order (so any two racks are a few hops apart)
        R = len(racks)
        per_rack: dict[str, list[Peer]] = {}

        def build() -> None:
            bounds = rack_start + [len(order)]
            members = {path: [n.peer() for n in order[bounds[r]:bounds[r + 1]]] for r, path in enumerate(racks)}
            for r, path in enumerate(racks):
                contacts = []
                for k in range(CONTACTS):
                    r2 = (r + (1 << k)) % R
                    if r2 == r:
                        break
                    other = members[racks[r2]]
                    contacts.append(other[r % len(other)])
                per_rack[path] = members[path] + contacts + extra

        def peers_of(node: NodeRec) -> list[Peer]:
            if not per_rack:
                build()
            return per_rack[node.rack_path]
        return blob_id, peers_of

    def _holders(self, manifest_id: str | None, gang: set[str]) -> list[Peer]:
        """Up to ``max_peers`` up nodes outside the gang that hold the manifest already."""
        if not manifest_id:
            return []
        holders = self.manifest_holders.get(manifest_id, set())
        out = []
        for nid in itertools.islice((h for h in holders if h not in gang), self.cfg.max_peers):
            n = self.nodes.get(nid)
            if n is not None and n.state == "up":
                out.append(n.peer())
        return out
