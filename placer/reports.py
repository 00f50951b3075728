"""Reports and recovery: what agents tell the placer, applied in O(what the report says).

A heartbeat costs a sequence check, a deadline move and its events; each event finds its
pod through the workload-id index (never a scan of the job's pods) and bumps the job's
per-state counters, so "every pod running" is one comparison. A full report costs
O(GPUs + workloads of that node): the "vanished" check walks only the pods placed on
that node. Registration adds the node to the model without rebuilding it: a new node
only marks the model dirty, and the scheduling pass rebuilds once however many nodes
arrived (see :mod:`placer.scheduling` for how often a pass may rebuild).

After a placer restart, jobs come back from the journal (spec only) as *recovering*; for
the recovery window reports adopt their pods (the highest attempt seen wins). Then a job
whose gang is complete runs on, a job with a partial gang has its pods stopped and is
requeued, a job with no pods is placed again.
"""

from __future__ import annotations

import hmac
import logging

from scheduler_link.messages import (
    MAC_LEN,
    TERMINAL_STATES,
    GpuSnapshot,
    NodeReport,
    NodeStop,
    RackBeat,
    RackBeatReply,
    ReportReply,
    Victim,
    WorkloadEvent,
    compact_ok,
    gpu_inventory,
)
from scheduler_link.msgauth import beat_mac, beat_macs, node_key, with_stop_macs
from scheduler_link.validate import validate_report

from .errors import BadRequest, InvalidSpec
from .inventories import Inventory
from .model import NodeSpec
from .records import STALE_PRIORITY, TERMINAL_JOB_STATES, JobRec, NodeRec, PodRec, Push, parse_workload_id
from .relaypolicy import RackPins
from .statebase import StateBase

log = logging.getLogger("herd.placer.state")
REPORT_AGE_MAX_S = 30.0   # a full report built before its pods were acked is believed this long after the ack


class Reports(StateBase):
    # the secret node MAC keys derive from (scheduler_link.msgauth); the service sets it
    mac_master: bytes = b""
    rack_pins: RackPins          # the racks nodes are pinned to (placer.nodeops.NodeOps owns it)

    def set_mac_master(self, master: bytes) -> None:
        self.mac_master = master
        self._unrecorded_key = ("", "", b"")
        for n in self.nodes.values():
            n.mac = b""

    # the last key derived for a (node, boot) no record holds: a relayed registration's MAC is
    # checked with it before the node is registered, and the record made then takes it over
    # (the answer's epoch MAC and stops use it) instead of deriving it again
    _unrecorded_key: tuple[str, str, bytes] = ("", "", b"")

    def mac_key(self, node_id: str, boot_id: str) -> bytes:
        """Node ``node_id``'s MAC key for ``boot_id``: derived once per node record (its
        ``mac``, for the record's boot) and kept there; any other is derived each time (the
        last one kept for the record its registration makes)."""
        node = self.nodes.get(node_id)
        if node is not None and node.boot_id == boot_id:
            k = node.mac
            if not k:
                k = node.mac = node_key(self.mac_master, node_id, boot_id)
            return k
        nid, boot, k = self._unrecorded_key
        if nid != node_id or boot != boot_id or not k:
            k = node_key(self.mac_master, node_id, boot_id)
            self._unrecorded_key = (node_id, boot_id, k)
        return k

    def ingest(self, node_id: str, rep: NodeReport, now: float) -> tuple[int, ReportReply, list[Push]]:
        """Apply one report. Returns (HTTP status, reply, pushes)."""
        self.counters["reports"] += 1
        if rep.node_id != node_id:
            return 400, ReportReply(ok=False, error="node id in the path and the report differ"), []
        why = validate_report(rep)
        if why is not None:
            self.counters["refused_reports"] += 1
            log.warning("report refused node=%s: %s", node_id, why)
            return 400, ReportReply(ok=False, error=why), []
        node = self.nodes.get(node_id)
        if not rep.full:
            if node is None or node.boot_id != rep.boot_id or rep.seq != node.last_seq + 1:
                self.counters["conflicts"] += 1
                return 409, ReportReply(ok=False, need_full=True), []
            if rep.snapshot is not None and [g.uuid for g in sorted(rep.snapshot.gpus, key=lambda g: g.index)] \
                    != node.uuids:
                # an inventory change rides only on a full report (the node is rebuilt then)
                return 409, ReportReply(ok=False, need_full=True), []
            node.last_seq = rep.seq
            node.last_seen = now
            self.lost_timer.set(node_id, now + self.cfg.lost_after_s)
            pushes = self._node_back(node, now)
            if rep.snapshot is not None:
                self._apply_snapshot(node, rep.snapshot)
            if rep.manifests is not None:
                self._set_manifests(node, set(rep.manifests))
            for ev in rep.events:
                pushes += self._apply_event(node, ev, now)
            return 200, self._reply(node), pushes
        t = rep.topology   # a registration (whichever path it came by) only into the node's pinned rack
        if (off := self.rack_pins.registration(node_id, f"{t.zone}/{t.block}/{t.rack}")) is not None:
            log.warning("registration refused node=%s code=%s: %s", node_id[:200], off.code, off.detail)
            return 403, ReportReply(ok=False, error=off.code), []
        if rep.compact:   # "the GPUs you stored for this boot, all healthy" (placer.inventories)
            inv = self.inventories.match(node_id, rep.boot_id, rep.inventory)
            if inv is None:
                self.counters["inventory_misses"] += 1
                return 409, ReportReply(ok=False, need_full=True, error="unknown_inventory"), []
            self.counters["compact_registrations"] += 1
            return self._register(rep, now, inv)
        snap = rep.snapshot
        if snap is None:
            return self._register(rep, now, None)
        uuids, digest = gpu_inventory(snap)
        return self._register(rep, now, Inventory(node_id=node_id, boot_id=rep.boot_id, digest=digest, uuids=uuids,
                                                  simulated=snap.simulated, nvlink_domain=snap.nvlink_domain))

    def beat(self, b: RackBeat, now: float, *, via: str | None = None,
             answered: float | None = None) -> tuple[RackBeatReply, list[Push]]:
        """A relay's aggregated empty heartbeats: per entry a boot check, a sequence that
        moved forward, a deadline move. Only the exceptions are answered.

        ``via``: the relay node that sent it. Every entry for another node must carry that
        node's MAC (``macs``, scheduler_link.msgauth.beat_mac); one that does not verify is
        dropped and counted (``bad_macs``), never applied, and not answered either.

        ``answered``: when a beat the placer held back (``now``: when it arrived) is answered.
        A relay sends its next beat an interval after the answer to the last, so the nodes'
        deadlines count from the answer (held 10 s in a loaded 131,072-node delivery, their
        next beats came after the deadline counted from arrival: 479,786 'node lost' lines)."""
        need: list[str] = []
        stops: list[NodeStop] = []
        pushes: list[Push] = []
        nodes = self.nodes
        due = max(now, answered or now) + self.cfg.lost_after_s
        timer = self.lost_timer
        n = len(b.node_ids)
        if len(b.boot_ids) != n or len(b.seqs) != n or (via is not None and len(b.macs) != n):
            raise BadRequest("a rack beat's columns differ in length")
        self.counters["reports"] += n
        recs = list(map(nodes.get, b.node_ids))
        # Every entry's MAC checked in one comparison (the common beat: all verify); entry by
        # entry only when that fails. The relay's own entry needs none (its connection's owner).
        check = via is not None and not self._beat_macs_ok(b, recs, via)
        bad = 0
        macs = b.macs if check else [b""] * n
        for node, nid, boot, seq, mac in zip(recs, b.node_ids, b.boot_ids, b.seqs, macs, strict=True):
            if check and nid != via and not (
                    len(mac) == 16 and hmac.compare_digest(mac, beat_mac(self.mac_key(nid, boot), nid, boot, seq))):
                self.counters["bad_macs"] = self.counters.get("bad_macs", 0) + 1
                bad += 1   # (logged once for the beat, below: never a line per entry)
                continue
            if node is None or node.boot_id != boot or seq <= node.last_seq:
                self.counters["conflicts"] += 1
                need.append(nid)
                continue
            node.last_seq = seq
            node.last_seen = now
            timer.set(nid, due)
            if node.state != "up" or node.silent:
                pushes += self._node_back(node, now)
            if node.tell or node.refused:
                r = self._reply(node)
                if r.stop:  # through the relay: each stop with the placer's MAC in the member's key
                    stop = with_stop_macs(self.mac_key(nid, boot), nid, boot, r.stop) if via is not None else r.stop
                    stops.append(NodeStop(node_id=nid, stop=stop))
                if r.need_full:
                    need.append(nid)
        if bad:
            log.warning("rack beat entries refused: MAC does not verify count=%d of=%d relay=%s", bad, n, via)
        if not need and not stops:
            return self._ok_beat, pushes
        return RackBeatReply(need_full=need, stop=stops, heartbeat_interval_s=self.cfg.heartbeat_s,
                             revoked_signed=self._ok_beat.revoked_signed), pushes

    def _beat_macs_ok(self, b: RackBeat, recs: list[NodeRec | None], via: str) -> bool:
        """Whether every entry of ``b`` but the relay's own (it needs none) carries its node's
        MAC (``recs``: the entries' records, None where unknown), in one comparison over the
        joined MACs. False: the entries are checked one by one. (MACs whose joined bytes are
        the right ones pass whatever their split: a relay that holds them all forges nothing.)"""
        ids, boots, macs = b.node_ids, b.boot_ids, b.macs
        keys = [r.mac if r is not None and r.boot_id == bt and r.mac else self.mac_key(nid, bt)
                for r, nid, bt in zip(recs, ids, boots, strict=True)]
        want = beat_macs(keys, ids, boots, b.seqs)
        if via in ids:   # (the relay's own entry: left out of both sides)
            k = ids.index(via)
            macs = macs[:k] + macs[k + 1:]
            want = want[:k * MAC_LEN] + want[(k + 1) * MAC_LEN:]
        got = b"".join(macs)
        return len(got) == len(want) and hmac.compare_digest(want, got)

    def _reply(self, node: NodeRec, *, need_full: bool = False) -> ReportReply:
        if not node.tell and not need_full and not node.refused:
            return self._ok_reply  # the common answer: one shared object (the wire may cache its bytes)
        stop: list[Victim] = []
        if node.tell:
            stop = [Victim(workload_id=w, grace_s=self._grace_of(w), reason="fenced: gang placed elsewhere")
                    for w in sorted(node.tell) if w in node.stale and node.workloads.get(w) not in TERMINAL_STATES]
            node.tell.clear()
        return ReportReply(ok=True, need_full=need_full or bool(node.refused), stop=stop,
                           heartbeat_interval_s=self.cfg.heartbeat_s, revoked_nodes=self._ok_reply.revoked_nodes,
                           revoked_serials=self._ok_reply.revoked_serials,
                           revoked_signed=self._ok_reply.revoked_signed)

    def _grace_of(self, wid: str) -> float:
        parsed = parse_workload_id(wid)
        job = self.jobs.get(parsed[0]) if parsed else None
        return job.spec.grace_s if job else 10.0

    def _set_manifests(self, node: NodeRec, held: set[str]) -> None:
        for m in node.manifests - held:
            holders = self.manifest_holders.get(m)
            if holders is not None:
                holders.discard(node.node_id)
                if not holders:
                    del self.manifest_holders[m]
        for m in held - node.manifests:
            self.manifest_holders.setdefault(m, set()).add(node.node_id)
        node.manifests = held

    def _register(self, rep: NodeReport, now: float, inv: Inventory | None) -> tuple[int, ReportReply, list[Push]]:
        """A full report (``inv``: its GPU inventory; None: it has no GPUs) or a compact one
        (``inv`` from the stored inventories; no snapshot: every GPU and the host healthy)."""
        snap = rep.snapshot
        uuids = list(inv.uuids) if inv is not None else []
        nvd = rep.nvlink_domain or (inv.nvlink_domain if inv is not None else None)
        spec = NodeSpec(node_id=rep.node_id, zone=rep.topology.zone, block=rep.topology.block,
                        rack=rep.topology.rack, n_gpus=len(uuids), nvlink_domain=nvd)
        # Refuse what the model cannot hold before anything changes.
        try:
            spec.validate()
        except InvalidSpec as e:
            self.counters["refused_reports"] += 1
            log.warning("report refused node=%s: %s", rep.node_id, e)
            return 400, ReportReply(ok=False, error=str(e)), []
        if len(set(uuids)) != len(uuids):
            self.counters["refused_reports"] += 1
            return 400, ReportReply(ok=False, error="a GPU UUID appears twice"), []
        owner = self.uuid_owner   # (a new node's GPUs: none known, one set operation in C)
        taken = [] if owner.keys().isdisjoint(uuids) else [u for u in uuids if owner.get(u, rep.node_id) != rep.node_id]
        if taken:
            self.counters["refused_reports"] += 1
            return 400, ReportReply(ok=False, error=f"GPU {taken[0]} is already reported by node "
                                                     f"{self.uuid_owner[taken[0]]}"), []
        self.counters["full_reports"] += 1
        old = self.nodes.get(rep.node_id)
        node = NodeRec(node_id=rep.node_id, boot_id=rep.boot_id, last_seq=rep.seq,
                       control_url=rep.control_url, data_url=rep.data_url, topology=rep.topology,
                       nvlink_domain=nvd, uuids=uuids, simulated=bool(inv and inv.simulated), last_seen=now)
        nid, boot, key = self._unrecorded_key
        if nid == rep.node_id and boot == rep.boot_id:   # (derived for this registration's MAC)
            node.mac = key
            self._unrecorded_key = ("", "", b"")
        node.cordoned = rep.node_id in self.cordons   # a cordon outlives the record (placer.nodeops)
        node.draining = node.cordoned and old is not None and old.draining
        pushes: list[Push] = []
        if old is not None:
            pushes += self._node_back(old, now)
            self._set_manifests(old, set())
            node.gangs = old.gangs
            self.node_states[old.state] -= 1
            self.fence_timer.cancel(rep.node_id)
            # Forget what we believed about this node's stale holders: the report is the truth.
            for wid in old.stale:
                self._release_quiet(f"stale:{wid}")
        self.node_states[node.state] += 1
        if old is not None:
            for u in old.uuids:
                self.uuid_owner.pop(u, None)
        for u in uuids:
            self.uuid_owner[u] = rep.node_id
        if old is None or self.model.spec(rep.node_id) != spec:
            self.dirty = True   # new capacity (or moved): worth a scheduling pass
        self.model.upsert_node(spec)
        self.nodes[rep.node_id] = node
        self.simulated_nodes += node.simulated - (old.simulated if old is not None else False)
        if old is None or old.state != node.state:
            self.membership_changes += 1
        self.lost_timer.set(rep.node_id, now + self.cfg.lost_after_s)
        if rep.manifests:   # (a new record holds none)
            self._set_manifests(node, set(rep.manifests))
        if inv is not None and snap is not None:
            self.inventories.note(inv)
        if inv is not None:
            if old is not None and old.uuids == uuids:
                prev_bad, prev_fatal = old.fatal | old.refused, old.host_fatal
            else:  # a new node: all healthy in the model
                prev_bad, prev_fatal = set(), False
            if snap is not None and not compact_ok(snap):   # (its UUIDs are ``uuids``: inv is of it)
                self._apply_snapshot(node, snap, prev_bad=prev_bad, prev_host_fatal=prev_fatal)
            elif old is None:   # a new record says all healthy already, as the model does: nothing changes
                self.degraded_nodes.discard(rep.node_id)
            else:   # compact, or a snapshot that says so: every GPU and the host healthy
                self._apply_health(node, set(), False, frozenset(), (), prev_bad=prev_bad, prev_host_fatal=prev_fatal)
            if old is not None and old.uuids != uuids:  # a changed inventory: say everything
                for i in range(len(uuids)):
                    self.model.set_gpu_health(rep.node_id, i, i not in node.fatal)
                self.model.set_node_state(rep.node_id, healthy=not node.host_fatal, draining=node.cordoned)
        if node.cordoned:
            self.model.set_node_state(rep.node_id, healthy=not node.host_fatal, draining=True)
        reported: set[str] = set()
        ended = []
        for w in rep.workloads:
            node.workloads[w.workload_id] = w.state
            if w.state in TERMINAL_STATES:
                ended.append(w)
                continue
            reported.add(w.workload_id)
            slots = tuple(s for s in (node.slot_of(u) for u in w.gpus) if s is not None)
            if self._adopt(node, w.workload_id, w.job_id, slots, w.gpus, w.state, now):
                if w.fetch:
                    hit = node.pods.get(w.workload_id)
                    if hit is not None and not hit[1].fetch:
                        hit[1].fetch = {k: int(v) for k, v in w.fetch.items()
                                        if k in ("bytes_from_origin", "bytes_from_peers", "bytes_local")}
            else:
                node.stale[w.workload_id] = slots
                node.tell.add(w.workload_id)
                if slots:
                    self._assign(f"stale:{w.workload_id}", rep.node_id, slots, STALE_PRIORITY, False)
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
        # Pods we placed on this node that the agent does not know (lost with its state, or a
        # push that never landed): the gang is broken. Only this node's pods are looked at. A
        # report built before its pods were acked cannot list them: within a second of the ack
        # as it arrives, or (its sent_at, the node's clock) as it was built while it waited in a
        # loaded placer's queues, up to REPORT_AGE_MAX_S after the ack (clocks a fleet keeps)
        for wid, (job, p) in list(node.pods.items()) if node.gangs else ():
            acked = job.timings.get("acked", now)
            if (wid in reported or p.terminal or p.state == "placing" or job.recovering
                    or job.state in TERMINAL_JOB_STATES or now - acked <= 1.0
                    or (rep.sent_at and rep.sent_at - acked <= 1.0 and now - acked <= REPORT_AGE_MAX_S)):
                continue
            if self.pods.get(wid, (None, None))[1] is not p:
                continue
            job.set_pod_state(p, "lost")
            p.reason = "not reported by its node"
            pushes += self._end_attempt(job, "lost", now, reason=f"pod {p.rank} vanished from {rep.node_id}")
        return 200, self._reply(node), pushes

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
                self._replace_pods(job, [])
                self._release_quiet(job_id)
                self._hold(old)
                job.attempt = attempt
            if wid in self.pods:
                # adopted already: this node's earlier full report (a node may send several while
                # the placer recovers); the same pod, never a stale one to stop
                hit = node.pods.get(wid)
                if hit is None or hit[0] is not job:
                    return False
                if not hit[1].terminal and hit[1].state != state:
                    job.set_pod_state(hit[1], state, hit[1].exit_code)
                return True
            if rank >= job.spec.pods:
                return False
            if not self._assign(job_id, node.node_id, slots, job.spec.priority, job.spec.preemptible):
                return False
            pod = PodRec(rank=rank, node_id=node.node_id, slots=slots, uuids=list(uuids), workload_id=wid,
                         state=state)
            job.add_pod(pod)
            self._index_pod(job, pod)
            return True
        if attempt != job.attempt:
            return False
        hit = node.pods.get(wid)
        if hit is None or hit[0] is not job:
            return False
        p = hit[1]
        if p.state in ("terminating", "cancelled") or job.state not in ("placing", "starting", "running"):
            return False  # told to stop and still there: it is stale, and told again
        if not p.terminal and p.state != state:
            # the model has held its GPUs since the decision: only the state is news
            job.set_pod_state(p, state, p.exit_code)
            self._maybe_running(job, now)
        return True

    def _apply_snapshot(self, node: NodeRec, snap: GpuSnapshot, *, prev_bad: set[int] | None = None,
                        prev_host_fatal: bool | None = None) -> None:
        """Health from a snapshot. Only what changed is pushed into the model, so a node
        registering healthy costs no model call (its rebuild stays deferred)."""
        gpus = sorted(snap.gpus, key=lambda g: g.index)
        if [g.uuid for g in gpus] != node.uuids:
            return  # inventory changed: the next full report rebuilds the node
        self._apply_health(
            node, {i for i, g in enumerate(gpus) if g.health == "fatal"}, snap.host.state == "fatal",
            frozenset(i for i, g in enumerate(gpus) if g.health == "degraded"),
            tuple(f"gpu{g.index}:{r.code}" for g in gpus for r in g.reasons)[:32] + tuple(
                f"host:{r.code}" for r in snap.host.reasons)[:8],
            prev_bad=prev_bad, prev_host_fatal=prev_host_fatal)

    def _apply_health(self, node: NodeRec, fatal: set[int], host_fatal: bool, degraded: frozenset[int],
                      reasons: tuple[str, ...], *, prev_bad: set[int] | None,
                      prev_host_fatal: bool | None) -> None:
        before = (node.fatal | node.refused) if prev_bad is None else prev_bad
        was_fatal = node.host_fatal if prev_host_fatal is None else prev_host_fatal
        node.refused.clear()  # the agent has spoken about every GPU again
        node.fatal = fatal
        node.host_fatal = host_fatal
        node.degraded = degraded
        node.health_reasons = reasons
        (self.degraded_nodes.add if node.degraded else self.degraded_nodes.discard)(node.node_id)
        changed = before ^ node.fatal
        for i in sorted(changed):
            if i < len(node.uuids):
                self.model.set_gpu_health(node.node_id, i, i not in node.fatal)
        if node.host_fatal != was_fatal:
            self.model.set_node_state(node.node_id, healthy=node.state == "up" and not node.host_fatal,
                                      draining=node.cordoned)
        if changed or node.host_fatal != was_fatal:
            self.dirty = True

    def _node_back(self, node: NodeRec, now: float) -> list[Push]:
        if node.silent:   # held silent in a mass silence (placer.attempts): it takes work again
            node.silent = False
            self.silent_nodes -= 1
            self.dirty = True
            self.model.set_node_state(node.node_id, healthy=not node.host_fatal, draining=node.cordoned)
        if node.state == "lost":
            self.dirty = True
            log.info("node back node=%s after=%.1fs", node.node_id, now - (node.lost_since or now))
            self._set_node_state(node, "up")
            node.lost_since = None
            self.fence_timer.cancel(node.node_id)
            self.model.set_node_state(node.node_id, healthy=not node.host_fatal, draining=node.cordoned)
        return []

    def _apply_event(self, node: NodeRec, ev: WorkloadEvent, now: float) -> list[Push]:
        node.workloads[ev.workload_id] = ev.state
        hit = node.pods.get(ev.workload_id)
        if ev.state in TERMINAL_STATES and ev.workload_id in node.stale:
            node.stale.pop(ev.workload_id)
            self._release_quiet(f"stale:{ev.workload_id}")
            if hit is not None and not hit[1].terminal:  # a stopped pod of a live record: say it ended
                self._record_end(hit[0], hit[1], ev)
            return []
        if ev.workload_id in node.stale and ev.state != "terminating":
            # told to stop, and it says it lives: its stop was lost, or overtook the start it was
            # meant to undo and found nothing to stop. The answer to this report names it again.
            node.tell.add(ev.workload_id)
        if hit is None:
            return []
        job, pod = hit
        if job.job_id != ev.job_id or pod.terminal:
            return []
        if job.state in TERMINAL_JOB_STATES:
            if ev.state in TERMINAL_STATES:
                self._record_end(job, pod, ev)  # the job has ended; its pod's end is only news
            return []
        # did *we* stop it (its attempt ended, it was rolled back)? A pod an operator stopped on
        # the agent also passes through "terminating", but its end is the job's news.
        told_to_stop = pod.stop_sent or job.state in ("pending", "preempted")
        job.set_pod_state(pod, ev.state, ev.exit_code)
        pod.reason = ev.reason
        self._note_pod(pod, ev)
        if ev.state == "running":
            self._maybe_running(job, now)
            return []
        if ev.state not in TERMINAL_STATES:
            return []
        self.dirty = True  # a pod ended: its GPUs may come free
        if told_to_stop:
            # the attempt already ended (preempted and requeued, cancelled): this pod's end is
            # the stop we asked for, not a failure of the job's next attempt
            return []
        if ev.state == "exited" and ev.exit_code == 0:
            if job.all_succeeded:
                return self._end_attempt(job, "succeeded", now, reason=None)
            return []
        if ev.state == "preempted" and job.state in ("preempted",):
            return []
        why = f"pod {pod.rank} on {node.node_id} {ev.state}" + (
            f" (code {ev.exit_code})" if ev.exit_code is not None else "") + (f": {ev.reason}" if ev.reason else "")
        return self._end_attempt(job, "failed", now, reason=why)

    def _record_end(self, job: JobRec, pod: PodRec, ev: WorkloadEvent) -> None:
        job.set_pod_state(pod, ev.state, ev.exit_code)
        pod.reason = ev.reason or pod.reason
        self._note_pod(pod, ev)

    def _note_event(self, node: NodeRec, ev: WorkloadEvent) -> None:
        hit = node.pods.get(ev.workload_id)
        if hit is not None:
            self._note_pod(hit[1], ev)

    @staticmethod
    def _note_pod(pod: PodRec, ev: WorkloadEvent) -> None:
        if pod.timings is None:
            pod.timings = {}
        pod.timings.setdefault(ev.state, ev.at)
        if ev.bytes_from_origin is not None or ev.bytes_from_peers is not None:
            pod.fetch = {"bytes_from_origin": ev.bytes_from_origin or 0,
                         "bytes_from_peers": ev.bytes_from_peers or 0, "bytes_local": ev.bytes_local or 0}

    def _maybe_running(self, job: JobRec, now: float) -> None:
        if job.state != "running" and job.all_running:
            job.state = "running"
            job.timings.setdefault("running", now)

    def recovered_complete(self) -> bool:
        """Every job still recovering has all its pods reported: placing it again would double
        it, so a restarted placer may end its recovery (placer.fleetsnap.Recovery)."""
        return not self._recovering or all(job.n_pods == job.spec.pods for job in self.jobs.values()
                                           if job.recovering)

    def _finish_recovery(self, now: float) -> None:
        # every schedule round comes here: scan the jobs only while some are still recovering
        if not self._recovering:
            return
        for job in self.jobs.values():
            if not job.recovering:
                continue
            job.recovering = False
            job.table.sort_by_rank()
            if job.pods and len(job.pods) == job.spec.pods:  # ranks are unique (indexed by workload id)
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
                self._replace_pods(job, [])
                job.reason = "partial gang after placer restart"
                self._enqueue(job, now)
            else:
                self._enqueue(job, now)
        self._recovering = False
