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
- its model is rebuilt while it follows (:func:`keep_built`: registrations only mark it dirty,
  as a leader's, and a follower runs no scheduling pass that would rebuild it), spaced as a
  leader's passes space theirs: the promotion's adoption finds it built (a model left dirty
  since the fleet registered was rebuilt inside the adoption, re-applying every held workload
  one by one: 0.36 s of 16,384 nodes' promotion);
- it runs no timers (no node is judged lost by a placer that places nothing), so a rack beat
  (:func:`beat`) costs it the entries' MACs, checked in one comparison as a leader's are, and
  a sequence check and a time an entry: no deadline moved, no stop or push looked for.

On promotion (:func:`adopt`), once the journal's jobs are in (recovering, as after a restart),
every workload it holds stale is adopted by its job when it is that job's current attempt (the
agents' workloads are the truth: a gang running on the fleet stays that gang, never placed a
second time); what no job claims is told to stop in its node's next answer, as a restarted
placer does. The nodes it heard within ``recover_s`` count as reported (:func:`promoted`),
so a promoted follower waits for no re-registration; and no node's silence counts from before
the promotion.

Invariants: an observed report or beat changes nothing but this placer's own state; the
answers carry nothing a node or relay acts on but ``need_full``; after :func:`adopt` no
workload is both a job's pod and a stale workload.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from scheduler_link.follow import OBSERVED, is_empty
from scheduler_link.messages import TERMINAL_STATES, NodeReport, RackBeat, RackBeatReply, ReportReply

from .errors import BadRequest
from .records import STALE_PRIORITY, TERMINAL_JOB_STATES, JobRec, NodeRec, PodRec, parse_workload_id
from .scheduling import REBUILD_SPACING
from .state import PlacerState
from .statebase import MODEL_ERRORS

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


def beat(state: PlacerState, b: RackBeat, now: float, via: str) -> RackBeatReply:
    """A relay's rack beat (its copy to this follower, ``via`` its node) applied to the warm
    model: each entry whose MAC verifies moves its node's sequence and ``last_seen`` (what
    :func:`promoted` reads), nothing else -- the lost deadlines are set on promotion, and a
    follower's answer names no stop. Every entry's MAC is checked in one comparison (as a
    leader's beat: PlacerState._beat_macs_ok); when that fails, entry by entry
    (PlacerState.beat: the forged ones dropped and counted in ``bad_macs``), so no relay makes
    a member look alive here. Answers the nodes it needs a full report of."""
    ids, boots, seqs = b.node_ids, b.boot_ids, b.seqs
    n = len(ids)
    if len(boots) != n or len(seqs) != n or len(b.macs) != n:
        raise BadRequest("a rack beat's columns differ in length")
    recs = list(map(state.nodes.get, ids))
    if not state._beat_macs_ok(b, recs, via):
        return beat_answer(state.beat(b, now, via=via)[0])
    state.counters["reports"] += n
    need: list[str] = []
    for node, nid, boot, seq in zip(recs, ids, boots, seqs, strict=True):
        if node is None or node.boot_id != boot or seq <= node.last_seq:
            need.append(nid)
            continue
        node.last_seq = seq
        node.last_seen = now
        if node.state != "up" or node.silent:   # (what it would push: nothing leaves a follower)
            state._node_back(node, now)
    if not need:
        return _BEAT_OK
    state.counters["conflicts"] += len(need)
    return RackBeatReply(need_full=need)


def keep_built(state: PlacerState, now: float, clock: Callable[[], float]) -> bool:
    """Rebuild a follower's model if registrations left it dirty, no sooner than
    REBUILD_SPACING times the last rebuild's cost after it (``clock``: a monotonic seconds
    clock, timing it), as a leader's scheduling pass does. Whether it rebuilt."""
    if not state.model.needs_rebuild or now < state.rebuild_ok_at:
        return False
    t0 = clock()
    _ = state.model.n_nodes   # (rebuilt now, timed)
    state.last_rebuild_s = clock() - t0
    state.counters["rebuilds"] += 1
    state.rebuild_ok_at = now + REBUILD_SPACING * state.last_rebuild_s
    return True


def beat_answer(reply: RackBeatReply) -> RackBeatReply:
    """What a follower answers a rack beat it applied: the nodes it needs a full report of."""
    return RackBeatReply(need_full=list(reply.need_full)) if reply.need_full else _BEAT_OK


def promoted(state: PlacerState, now: float, recover_s: float) -> list[str]:
    """On promotion, every up node's lost deadline counts from ``now``: a promoted follower judges
    a node's silence only from what it reads as the leader, never from what it missed as a
    follower (a copy dropped, a relay that had not copied to it yet, its own loop away). The
    nodes heard within ``recover_s`` (returned: they count as reported) get twice ``lost_after``
    -- their copies came every other interval at most, and their own links find this placer
    meanwhile, trying the placers they know in turn -- and every other up node ``lost_after``."""
    since = now - recover_s
    lost_after = state.cfg.lost_after_s
    warm_due, cold_due = now + 2 * lost_after, now + lost_after
    timer = state.lost_timer
    warm: list[str] = []
    for nid, n in state.nodes.items():
        if n.state != "up":
            continue
        if n.last_seen >= since:
            warm.append(nid)
            timer.set(nid, warm_due)
        else:
            timer.set(nid, cold_due)
    return warm


# (node, workload id, its GPU slots, its state, (job, attempt, rank))
_Held = tuple[NodeRec, str, tuple[int, ...], str, tuple[str, int, int]]


def adopt(state: PlacerState, now: float) -> tuple[int, int]:
    """Hand the workloads held stale to the jobs just recovered from the journal (see the module
    docstring). Returns (adopted, left stale: told to stop in their node's next answer).

    A recovered gang takes its pods in one step (:func:`_adopt_gang`: its stale holders' GPUs
    released and given to it with one vector operation each, not two model calls a pod: 25,000
    pods one by one held the promotion for seconds); what that step does not take goes one by
    one (PlacerState._adopt), as a restarted placer adopts each node's reported workloads."""
    adopted = told = 0
    by_job: dict[str, list[_Held]] = {}
    for node in state.nodes.values():
        if not node.stale:
            continue
        for wid, slots in node.stale.items():
            st = node.workloads.get(wid)
            if st is None or st in TERMINAL_STATES:
                continue
            parsed = parse_workload_id(wid)
            if parsed is not None and parsed[0] in state.jobs:
                by_job.setdefault(parsed[0], []).append((node, wid, slots, st, parsed))
            else:
                node.tell.add(wid)
                told += 1
    for job_id, held in by_job.items():
        job = state.jobs[job_id]
        took, rest = _adopt_gang(state, job, held)
        adopted += took
        for node, wid, slots, st, _ in rest:
            state._release_quiet(f"stale:{wid}")
            del node.stale[wid]
            uuids = [node.uuids[s] for s in slots if s < len(node.uuids)]
            if state._adopt(node, wid, job_id, slots, uuids, st, now):
                adopted += 1
                continue
            node.stale[wid] = slots
            if slots:
                state._assign(f"stale:{wid}", node.node_id, slots, STALE_PRIORITY, False)
            node.tell.add(wid)
            told += 1
    state.dirty = True
    return adopted, told


def _adopt_gang(state: PlacerState, job: JobRec, held: list[_Held]) -> tuple[int, list[_Held]]:
    """The pods of ``job`` (recovering, holding nothing yet) among ``held``: those of its newest
    attempt reported (not older than the journal's), one a rank within the gang, each with
    GPUs, adopted at once -- what PlacerState._adopt does a pod, with the GPUs moved from the
    stale holders to the job in two vector steps. Returns (adopted, the rest: for the one-by-one
    path, which tells the older attempts and strays to stop)."""
    model = state.model
    if not job.recovering or job.n_pods or job.state in TERMINAL_JOB_STATES or job.job_id in model.jobs:
        return 0, held
    top = max(h[4][1] for h in held)
    if top < job.attempt:
        return 0, held
    take: list[_Held] = []
    rest: list[_Held] = []
    ranks: set[int] = set()
    for h in held:
        node, _, slots, _, (_, attempt, rank) = h
        if attempt == top and rank < job.spec.pods and rank not in ranks and slots and model.has_node(node.node_id):
            ranks.add(rank)
            take.append(h)
        else:
            rest.append(h)
    if not take:
        return 0, held
    model.release_many([f"stale:{h[1]}" for h in take])   # (each held exactly its pod's GPUs)
    rows = np.repeat(np.fromiter((model.node_index(h[0].node_id) for h in take), np.int64, len(take)),
                     [len(h[2]) for h in take])
    gpus = np.fromiter((s for h in take for s in h[2]), np.int64, rows.size)
    try:
        model.assign_arrays(job.job_id, rows, gpus, job.spec.priority, job.spec.preemptible)
    except MODEL_ERRORS as e:   # (a GPU out of range or held twice: each pod judged alone, as before)
        log.warning("gang not adopted at once job=%s pods=%d: %s", job.job_id, len(take), e)
        return 0, held
    job.attempt = top
    for node, wid, slots, st, (_, _, rank) in take:
        del node.stale[wid]
        pod = PodRec(rank=rank, node_id=node.node_id, slots=slots,
                     uuids=[node.uuids[s] for s in slots if s < len(node.uuids)], workload_id=wid, state=st)
        job.add_pod(pod)
        state._index_pod(job, pod)
    return len(take), rest
