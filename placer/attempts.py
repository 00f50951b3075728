"""Attempts and outcomes: how a job's attempt ends, what the nodes' answers to its
placement mean, and time (lost nodes, fencing).

Outcomes are structured (``PlacementOutcome``), never read from words: only
``refused_gpus`` marks GPUs unhealthy (the ones the node named); ``refused_spec`` fails
the attempt (its restart policy may requeue it); ``expired`` and ``unreachable`` roll the
gang back and place it again without touching health. Any refusal rolls the whole gang
back: all-or-nothing.

Time comes from two deadline heaps (:mod:`placer.timers`): a node's "lost" deadline moves
with each heartbeat; a lost node's "fence" deadline fires ``fence_after_s`` later and ends
the attempts of the gangs with pods on it (found through the node's pod index). A tick
costs O(nodes that came due), not O(nodes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from scheduler_link.messages import Placement, RackBeatReply, ReportReply, RevokedList, Victim

from .delivery import RoundOutcomes
from .records import ACCEPTED as ACCEPTED  # re-exported (defined with the records)
from .records import TERMINAL_JOB_STATES, JobError, JobRec, NodeRec, PodRec, Push
from .records import Outcome as Outcome  # re-exported
from .statebase import StateBase

log = logging.getLogger("herd.placer.state")

# a mass silence needs at least this many nodes (a rack or a few dying together is a failure)
MASS_SILENCE_MIN = 64


ROLLBACK_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def rollback_delay(rollbacks: int) -> float:
    """Seconds a gang waits before it is placed again after its ``rollbacks``-th refusal:
    at once the first time (a refused GPU is marked, the next try avoids it), then longer."""
    return ROLLBACK_BACKOFF_S[min(rollbacks, len(ROLLBACK_BACKOFF_S)) - 1]


class Attempts(StateBase):
    def cancel(self, job_id: str, now: float) -> list[Push]:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobError(f"no such job {job_id}", status=404)
        if job.state in TERMINAL_JOB_STATES:
            return []
        self.requeue_timer.cancel(job_id)
        return self._end_attempt(job, "cancelled", now, reason="cancelled by operator")

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

    def _end_attempt(self, job: JobRec, cause: str, now: float, *, reason: str | None,
                     hold: bool = True, victims_of: dict[str, list[Victim]] | None = None,
                     held: list[tuple[str, str, tuple[int, ...]]] | None = None) -> list[Push]:
        """Stop every live pod of the job's current attempt, free its GPUs, then decide by
        cause and restart policy: requeue (new attempt) or a terminal state. With ``hold``
        the stopped pods keep their GPUs (as stale holders) until their node reports them
        gone, so nothing new is pushed onto a GPU still in its grace period. ``victims_of``:
        the stops are added there by node, not made into pushes (a preemption's, which ride
        in the new gang's placements), and the stopped pods' holders are added to ``held``
        for the caller to hold (:meth:`_hold_many`, once the decision's GPUs are given)."""
        self.dirty = True
        self._dequeue(job)
        pushes: list[Push] = []
        live: list[PodRec] = []
        if victims_of is not None:   # (a preemption's victims: columns, no pod view made)
            self._stop_victims(job, cause, victims_of, held if held is not None else [])
        else:
            live = job.live_pods()
            pushes = self._stop_pods(job, live, reason=cause if cause != "lost" else "gang broken: node lost",
                                     preempted=cause == "preempted")
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
        if job.blob_id is not None:
            self.blobs.pop(job.blob_id, None)
            job.blob_id = None
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

    def _dequeue(self, job: JobRec) -> None:
        self.requeue_timer.cancel(job.job_id)
        if job.job_id in self.queue:
            self.queue.cancel(job.job_id)

    def _stop_pods(self, job: JobRec, pods: Iterable[PodRec], *, reason: str, preempted: bool = False) -> list[Push]:
        """The pods told to stop: one stop push a node that is up; a lost node hears at its
        next word (a preemption's victims: :meth:`_stop_victims`)."""
        by_node: dict[str, list[Victim]] = {}
        for p in pods:
            self._mark_stale(p)
            p.stop_sent = True
            job.set_pod_state(p, "terminating" if p.state != "placing" else "cancelled", p.exit_code)
            by_node.setdefault(p.node_id, []).append(
                Victim(workload_id=p.workload_id, grace_s=job.spec.grace_s, reason=reason, preempted=preempted))
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
            out.append(Push(node_id, node.control_url, pl, job.job_id, job.attempt, "stop", boot_id=node.boot_id))
        return out

    def _stop_victims(self, job: JobRec, reason: str, into: dict[str, list[Victim]],
                      held: list[tuple[str, str, tuple[int, ...]]]) -> None:
        """A preempted job's live pods told to stop, read from its table's columns (no pod view
        made: a preemption over a full fleet stops tens of thousands of pods): each marked stale
        on its node and moved to "terminating" (:meth:`JobRec.stop_live`), its Victim added to
        ``into`` by node (up nodes; a lost one hears at its next word), its holder
        (``stale:<workload>``, node, slots) to ``held``. What :meth:`_stop_pods` does pod by
        pod, but ``stop_sent``: the job's state says they were told (it is pending or preempted
        until a new attempt's table replaces this one, which no report of theirs then finds)."""
        t = job.table
        rows = job.stop_live()
        if not rows:
            return
        views, prefix, ranks, node_ids, slots = t.views, t.prefix, t.ranks, t.node_ids, t.slots
        nodes = self.nodes
        grace = job.spec.grace_s
        last_id: str | None = None
        node: NodeRec | None = None
        told: list[Victim] | None = None   # the node's victims (None: it is not up)
        for i in rows:
            v = views[i]
            wid = v.workload_id if v is not None else prefix + str(ranks[i])
            if v is not None:
                v.stop_sent = True
            nid = node_ids[i]
            if nid != last_id:   # (a job's pods come by node: one look a node)
                last_id = nid
                node = nodes.get(nid)
                told = None
                if node is not None and node.state == "up":
                    told = into.get(nid)
                    if told is None:
                        told = into[nid] = []
            if node is None:
                continue
            sl = slots[i]
            node.stale[wid] = sl
            if sl:
                held.append(("stale:" + wid, nid, sl))
            if told is None:   # a lost node hears about it when it comes back
                node.tell.add(wid)
            else:
                told.append(Victim(workload_id=wid, grace_s=grace, reason=reason, preempted=True))

    def stop_failed(self, node_id: str, victims: Iterable[Victim]) -> None:
        """A stop push got no answer: name those workloads in the node's next reply."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.tell.update(v.workload_id for v in victims)

    def on_acks(self, job_id: str, attempt: int, acks: Mapping[str, Outcome],
                now: float, starts: Iterable[Push] = ()) -> list[Push]:
        """Outcomes of a job's start pushes, by node (a delivery round's :class:`RoundOutcomes`
        names its refusals without a pass over the gang). All-or-nothing.
        If the attempt ended while its pushes were in flight (cancelled, preempted), the
        nodes that accepted are told again to stop it: a stop that overtook its start
        found nothing to stop."""
        job = self.jobs.get(job_id)
        if job is None or job.attempt != attempt or job.state not in ("placing", "starting", "running"):
            return self._late_stops(job_id, attempt, acks, starts)
        job.timings.setdefault("acked", now)  # (events may have raced ahead of the acks)
        refused = acks.refused() if isinstance(acks, RoundOutcomes) else {n: o for n, o in acks.items() if not o.ok}
        if not refused:
            if job.state == "placing":
                job.state = "starting"
            job.move_pods("placing", "accepted")
            self._maybe_running(job, now)
            return []
        self.counters["rollbacks"] += 1
        self.dirty = True
        by_node: dict[str, list[PodRec]] = {}
        for p in job.pods:
            if p.node_id in refused:
                by_node.setdefault(p.node_id, []).append(p)
        spec_refusal: str | None = None
        for node_id, o in refused.items():
            node = self.nodes.get(node_id)
            if node is None:
                continue
            if o.outcome == "refused_gpus":
                named = {s for s in (node.slot_of(u) for u in o.refused_gpus) if s is not None}
                for s in sorted(named):
                    node.refused.add(s)
                    self.model.set_gpu_health(node_id, s, False)
            elif o.outcome == "refused_spec" and spec_refusal is None:
                spec_refusal = f"{node_id}: {o.detail or 'placement refused'}"
            for p in by_node.get(node_id, ()):
                job.set_pod_state(p, "failed")
                p.reason = f"{o.outcome}: {o.detail}" if o.detail else o.outcome
        log.warning("gang refused job=%s attempt=%d refusals=%s", job_id, attempt,
                    {n: o.outcome for n, o in list(refused.items())[:8]})
        summary = "; ".join(f"{n}: {o.outcome}" + (f" ({o.detail})" if o.detail else "")
                            for n, o in list(refused.items())[:8])
        if len(refused) > 8:
            summary += f"; and {len(refused) - 8} more"
        if spec_refusal is not None:
            # the placement itself is wrong: placing it again would be refused again
            return self._end_attempt(job, "failed", now, reason=f"placement refused: {spec_refusal}")
        accepted = [p for p in job.pods if p.node_id not in refused]
        pushes = self._stop_pods(job, accepted, reason="gang rolled back: a node refused its part")
        self._release_quiet(job_id)
        self._hold(accepted)  # their GPUs stay taken until those pods are gone
        if job.blob_id is not None:
            self.blobs.pop(job.blob_id, None)
            job.blob_id = None
        job.rollbacks += 1
        delay = rollback_delay(job.rollbacks)
        if delay <= 0:
            self._enqueue(job, now)
        else:  # refused again and again: back off, so a gang does not storm the fleet
            job.state = "pending"
            self.requeue_timer.set(job.job_id, now + delay)
            job.timings["retry_at"] = now + delay
        job.reason = summary
        for k in ("decided", "pushed", "acked"):
            job.timings.pop(k, None)
        return pushes

    def _late_stops(self, job_id: str, attempt: int, acks: Mapping[str, Outcome],
                    starts: Iterable[Push]) -> list[Push]:
        late = []
        for push in starts:
            o = acks.get(push.node_id)
            if push.kind != "start" or o is None or not o.ok:
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
            late.append(Push(push.node_id, node.control_url, pl, job_id, attempt, "stop", boot_id=node.boot_id))
        return late

    # ------------------------------------------------------------ revocation

    def set_revoked(self, denied: tuple[frozenset[str], frozenset[str]], newly: list[str], now: float,
                    signed: RevokedList | None = None) -> None:
        """The deny-list (node ids, serials) goes out in every heartbeat answer, and ``signed``
        (the same list, signed by the placer) in every answer and rack beat answer too, for the
        members behind relays; the nodes ``newly`` denied are fenced like lost ones, at once:
        lost now, fenced at the next tick."""
        nodes, serials = sorted(denied[0]), sorted(denied[1])
        # None until a list was ever held (an empty list after that: a lifted node is heard of)
        known = bool(nodes or serials) or self._ok_reply.revoked_nodes is not None
        self._ok_reply = ReportReply(ok=True, heartbeat_interval_s=self.cfg.heartbeat_s,
                                     revoked_nodes=nodes if known else None,
                                     revoked_serials=serials if known else None,
                                     revoked_signed=signed if known else None)
        self._ok_beat = RackBeatReply(revoked_signed=signed if known else None)
        for nid in newly:
            node = self.nodes.get(nid)
            if node is None:
                continue
            if node.state == "up":
                self._lose(node, now)
            self.fence_timer.set(nid, now)

    def _lose(self, node: NodeRec, now: float) -> None:
        if node.silent:
            node.silent = False
            self.silent_nodes -= 1
        self._set_node_state(node, "lost")
        node.lost_since = now
        self.dirty = True
        self.counters["nodes_lost"] += 1
        self.model.set_node_state(node.node_id, healthy=False, draining=node.cordoned)
        self.fence_timer.set(node.node_id, now + self.cfg.fence_after_s)

    # ------------------------------------------------------------ time

    def _judge_silent(self, due: list[NodeRec], now: float) -> None:
        """Nodes past their lost deadline: lost -- unless, with the nodes declared lost within
        the last lost window, they are more than ``lost_mass_fraction`` of the fleet (and at
        least MASS_SILENCE_MIN). So many hosts do not die at once; an overloaded placer (its
        reads behind) or a partition silences them (Kubernetes' node lifecycle controller
        stops evicting in a full zone disruption for the same reason). Then none is declared
        lost or fenced: each is held *silent* (no new work: unhealthy in the model), judged
        again a lost window later, and back at its next word; once the silence narrows below
        the fraction, the ones still silent are declared lost as usual."""
        window = self.cfg.lost_after_s
        recent = self._recent_lost
        while recent and recent[0][0] <= now - window:
            recent.popleft()
        lately = sum(n for _, n in recent)
        fleet = self.node_states["up"] + lately
        frac = self.cfg.lost_mass_fraction
        if frac > 0 and len(due) + lately >= MASS_SILENCE_MIN and len(due) + lately > frac * fleet:
            if self.mass_silence_since is None:
                self.mass_silence_since = now
                self.counters["mass_silences"] += 1
                log.warning("mass silence: %d nodes silent at once (%.0f%% of %d, lost lately %d): taken as the "
                            "placer's or the network's silence; none declared lost until it narrows below %.0f%%",
                            len(due), 100 * (len(due) + lately) / max(fleet, 1), fleet, lately, 100 * frac)
            for node in due:
                self.lost_timer.set(node.node_id, now + window)
                if not node.silent:
                    node.silent = True
                    self.silent_nodes += 1
                    self.dirty = True
                    self.model.set_node_state(node.node_id, healthy=False, draining=node.cordoned)
            return
        if self.mass_silence_since is not None:
            log.warning("mass silence over after %.1fs: %d nodes still silent are declared lost", now -
                        self.mass_silence_since, len(due))
            self.mass_silence_since = None
        for node in due:
            self._lose(node, now)
        recent.append((now, len(due)))
        if len(due) <= 16:
            for node in due:
                log.warning("node lost node=%s silent=%.1fs", node.node_id, now - node.last_seen)
        else:   # (one line for a burst, never one per node)
            log.warning("nodes lost count=%d first=%s silent>=%.1fs", len(due), due[0].node_id, window)

    def tick(self, now: float) -> list[Push]:
        """Lost nodes (missed heartbeats), then fencing: after ``fence_after_s`` more, the
        gangs with pods on a lost node end their attempt (requeued by policy); rolled-back
        gangs whose back-off ended go back to the queue."""
        pushes: list[Push] = []
        for job_id in self.requeue_timer.pop_due(now):
            job = self.jobs.get(job_id)
            if job is not None and job.state == "pending":
                job.timings.pop("retry_at", None)
                self._enqueue(job, now)
        due: list[NodeRec] = []
        for nid in self.lost_timer.pop_due(now):
            node = self.nodes.get(nid)
            if node is None or node.state != "up":
                continue
            if now - node.last_seen < self.cfg.lost_after_s:  # (a clock step): file it again
                self.lost_timer.set(nid, node.last_seen + self.cfg.lost_after_s)
                continue
            due.append(node)
        if due:
            self._judge_silent(due, now)
        elif self.mass_silence_since is not None and not self.silent_nodes:
            log.warning("mass silence over after %.1fs: every node held silent spoke again", now - self.mass_silence_since)
            self.mass_silence_since = None
        for nid in self.fence_timer.pop_due(now):
            node = self.nodes.get(nid)
            if node is None or node.state != "lost":
                continue
            by_job: dict[str, tuple[JobRec, list[PodRec]]] = {}
            for job, p in node.pods.values():
                if not p.terminal and job.state in ("placing", "starting", "running"):
                    by_job.setdefault(job.job_id, (job, []))[1].append(p)
            for job, bad in by_job.values():
                if job.state not in ("placing", "starting", "running"):
                    continue  # ended by an earlier node of this tick
                for p in bad:
                    self._mark_stale(p)
                    node.tell.add(p.workload_id)  # told to stop at its first word, if it comes back
                    job.set_pod_state(p, "lost")
                    p.reason = "node lost (fenced)"
                    self.counters["fenced_stops"] += 1
                pushes += self._end_attempt(job, "lost", now, reason=f"node {nid} lost")
        return pushes
