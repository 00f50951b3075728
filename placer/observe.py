"""A follower's warm model (placers on etcd, placer.ha): what the fleet reports, applied, acted on never.

Theory of operation
-------------------
Relays and agents send their reports and rack beats to every placer they know
(scheduler_link.follow, agent.relay). A follower applies them to its own state as a leader
does -- registrations into the model, beats moving each node's sequence and deadline, events
moving workloads -- so that on promotion it already holds the fleet. It *observes*:

- it holds no jobs (the jobs journal is the leader's until it leads): every live workload a
  node reports -- in a full report's list, or first heard of in an event (:func:`note_events`)
  -- is kept as that node's *stale* workload (its GPUs held in the model), never adopted,
  never stopped;
- nothing it computes leaves: the pushes the state asks for are dropped, and what it answers
  (:func:`report_answer`, :func:`beat_answer`) says only whether it needs the node's full
  report (a sequence gap, an unknown boot): no stop, no relay, no keys, no epoch;
- it runs no timers (no node is judged lost by a placer that places nothing).

On promotion (:func:`adopt`), once the journal's jobs are in (recovering, as after a restart),
every workload it holds stale is adopted by its job when it is that job's current attempt (the
agents' workloads are the truth: a gang running on the fleet stays that gang, never placed a
second time); what no job claims is told to stop in its node's next answer, as a restarted
placer does. The nodes it heard within ``recover_s`` count as reported (:func:`heard_within`),
so a promoted follower waits for no re-registration.

Invariants: an observed report or beat changes nothing but this placer's own state; the
answers carry nothing a node or relay acts on but ``need_full``; after :func:`adopt` no
workload is both a job's pod and a stale workload.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from scheduler_link.follow import OBSERVED, is_empty
from scheduler_link.messages import TERMINAL_STATES, NodeReport, RackBeatReply, ReportReply

from .records import STALE_PRIORITY, parse_workload_id
from .state import PlacerState

log = logging.getLogger("herd.placer.observe")

_NEED_FULL = ReportReply(ok=True, need_full=True)
_TAKEN = ReportReply(ok=True)
_BEAT_OK = RackBeatReply()


def report_answer(status: int, reply: ReportReply) -> tuple[int, ReportReply]:
    """What a follower answers a report it applied (``status``/``reply``: the state's): 202 with
    ``need_full`` only when taken (a sequence gap and the like stay 409, a refusal its status)."""
    if status == 200:
        return OBSERVED, (_NEED_FULL if reply.need_full else _TAKEN)
    return status, ReportReply(ok=False, need_full=reply.need_full, error=reply.error)


def note_events(state: PlacerState, rep: NodeReport) -> None:
    """A follower holds no jobs, so an event of a workload it has not heard of (a pod the leader
    placed since the node's last full report) finds no pod: it is held as the node's stale
    workload -- its GPUs, named in the event, taken in the model -- as a full report's would be,
    for :func:`adopt` to hand to its job on promotion."""
    node = state.nodes.get(rep.node_id)
    if node is None:
        return
    for ev in rep.events:
        wid = ev.workload_id
        if ev.state in TERMINAL_STATES or wid in node.stale or wid in node.pods:
            continue
        slots = tuple(s for s in (node.slot_of(u) for u in ev.gpus) if s is not None)
        node.stale[wid] = slots
        if slots:
            state._assign(f"stale:{wid}", node.node_id, slots, STALE_PRIORITY, False)


def skip_to(state: PlacerState, rep: NodeReport) -> None:
    """For a follower, and for a follower just promoted until each node reported once: an empty
    heartbeat past a gap in its node's sequence is taken as a rack beat's entry is -- a node's
    copies carry the newest empty heartbeat only, each report with news in order, so the
    heartbeats skipped said nothing. Any other gap stays a 409 (a leader's rule: a gap in what
    a node sends its leader may have lost news)."""
    node = state.nodes.get(rep.node_id)
    if node is not None and is_empty(rep) and node.boot_id == rep.boot_id and rep.seq > node.last_seq + 1:
        node.last_seq = rep.seq - 1


def beat_answer(reply: RackBeatReply) -> RackBeatReply:
    """What a follower answers a rack beat it applied: the nodes it needs a full report of."""
    return RackBeatReply(need_full=list(reply.need_full)) if reply.need_full else _BEAT_OK


def heard_within(state: PlacerState, now: float, recover_s: float) -> Iterator[str]:
    """The up nodes heard from within ``recover_s`` before ``now``."""
    since = now - recover_s
    return (nid for nid, n in state.nodes.items() if n.state == "up" and n.last_seen >= since)


def heard_now(state: PlacerState, nodes: list[str], now: float) -> None:
    """The nodes heard within ``recover_s`` get twice ``lost_after`` from the promotion: their
    copies came every other interval at most, and their own links find this placer meanwhile,
    trying the placers they know in turn (a node is not lost for the time that takes)."""
    due = now + 2 * state.cfg.lost_after_s
    for nid in nodes:
        state.lost_timer.set(nid, due)


def adopt(state: PlacerState, now: float) -> tuple[int, int]:
    """Hand the workloads held stale to the jobs just recovered from the journal (see the module
    docstring). Returns (adopted, left stale: told to stop in their node's next answer)."""
    adopted = told = 0
    for node in state.nodes.values():
        if not node.stale:
            continue
        for wid, slots in list(node.stale.items()):
            st = node.workloads.get(wid)
            if st is None or st in TERMINAL_STATES:
                continue
            parsed = parse_workload_id(wid)
            job = state.jobs.get(parsed[0]) if parsed is not None else None
            if job is not None:
                state._release_quiet(f"stale:{wid}")
                del node.stale[wid]
                uuids = [node.uuids[s] for s in slots if s < len(node.uuids)]
                if state._adopt(node, wid, job.job_id, slots, uuids, st, now):
                    adopted += 1
                    continue
                node.stale[wid] = slots
                if slots:
                    state._assign(f"stale:{wid}", node.node_id, slots, STALE_PRIORITY, False)
            node.tell.add(wid)
            told += 1
    state.dirty = True
    return adopted, told
