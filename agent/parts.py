"""Accepting NodeParts: a node's share of a gang, delivered through its rack relay.

Theory of operation
-------------------
"Acked" (DESIGN.md, Fleet scale) means this agent checked the part's binding, version,
expiry, its inventory hash and GPUs, and wrote it durably; the gang blob (argv, env,
user, peers, the gang's contacts, ...) comes after. So acceptance is two steps:

1. :func:`check_part` (pure) decides: bound to this node, a version we speak, not expired
   (the sender's clock), a stop-only part bound as below, ``inventory`` equal to the hash of
   our GPU UUIDs in index order
   (else ``expired``: the placer's view of us is stale; it says nothing about a GPU),
   slots that exist, then exactly what :func:`agent.placement.check_placement` says of a
   provisional Placement made of the part's pods (UUIDs from the slots) and victims: GPU
   health, GPUs free or held by the part's own victims, workload ids new and well formed.
2. :class:`PartAcceptor` (one owner task) carries it out: an accepted part is written to
   ``<state>/parts/`` (appended to the part log, one fdatasync: agent.partstore) *before* the ``accepted`` outcome
   goes back; its victims are told to stop at once; a task then gets the blob (bounded),
   builds the full Placement and hands it to the supervisor. A refusal there (a user not
   allowed, an origin not allowed) or no blob within the bound: each pod is reported
   ``failed`` through ``notify`` (the placer then fails or requeues the gang as for any
   failed pod).

Identity (scheduler_link.msgauth): a part is acted on only when its proof holds (its bytes
are one of the parts the placer signed, and the signature verifies with the placer's key
this node got at registration); one that does not is neither answered nor kept
(:class:`PartNotAuthentic`: the relay gets an error, the placer reaches this node directly).
Every outcome carries this node's MAC, so its relay cannot change it.

Fencing (scheduler_link.epochs): a part's placer epoch is its bundle's, in the signed header
its proof carries. A part of an epoch older than the highest this node has seen is answered
``stale_epoch`` and nothing of it is acted on (a replaced placer acts on nothing); a newer
epoch is written to the node's epoch file before the part is decided on.

Stop-only parts (a relay may hold and replay what the placer signed, never forge it): one
acts only while all of these hold, else it is refused and nothing is stopped --
- it carries an expiry and names the node's boot (``boot_id``, the boot id of this node's
  link): missing, ``refused_spec``; past the expiry, or for another boot, ``expired`` (the
  placer's view of this node is stale: the new boot's full report shows the placer what runs
  here, and its answer names what it still wants stopped);
- every victim of its own job is of its attempt (``refused_spec``): a stop of attempt 1
  replayed later does not reach attempt 2's pods. Victims of other jobs (the preempted) are
  named by their own attempt's workload ids.
The placer's fallback for a relay that is slow with a stop is a direct push (over its mTLS
connection, no relay to replay it) well inside the part's expiry (placer.relays, stops-only
rounds), so a refused late part costs nothing.

Invariants:
- one placement id, one outcome: a part seen again (over a relay or directly, also after
  the same placement arrived over HTTP) gets the outcome it got the first time; the
  supervisor is idempotent by placement id, so nothing is placed twice;
- an ``accepted`` outcome is on disk first; a restarted agent processes again every
  accepted part it has not handed over yet;
- GPUs of accepted parts not yet handed over count as held (two parts never get one GPU);
- a stop that names a pod of an accepted part not handed over yet (a rollback that came
  before the blob) is written into that part's record before it is answered; that pod is
  then never placed (its end is reported as the supervisor would: ``preempted``/``exited``
  "before start"), also across a restart; a stop that comes during the hand-over is
  applied right after it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import trio

from p2p.origins.allow import origin_refusal
from scheduler_link.epochs import Epochs
from scheduler_link.messages import (
    WIRE_VERSION,
    GangBlob,
    NodeOutcome,
    NodePart,
    Placement,
    PlacementAck,
    PodAssignment,
    Victim,
    WorkloadEvent,
    WorkloadState,
    inventory_hash,
)
from scheduler_link.msgauth import AuthError, BundleVerifier, with_outcome_mac

from .errors import AgentError
from .partstore import PartRecord, PartState, PartStore
from .placement import Refusal, attempt_of, check_placement, replayed
from .state import WorkloadRecord

log = logging.getLogger("herd.agent.parts")

KEEP_DONE = 512          # handed-over parts remembered on disk (idempotency across restarts)
KEEP_REFUSED = 2048      # refusals remembered in memory


# ---------------------------------------------------------------- deciding (pure)

@dataclass(frozen=True, slots=True)
class Verdict:
    """What to answer for a part; ``pods`` (GPU UUIDs filled in) when it is accepted now."""
    outcome: NodeOutcome
    pods: tuple[PodAssignment, ...] = ()
    fresh: bool = False


def _no(part: NodePart, node_id: str, r: Refusal) -> Verdict:
    return Verdict(NodeOutcome(node_id=node_id, placement_id=part.placement_id, outcome=r.outcome,
                               refused_gpus=list(r.gpus), detail=r.detail))


def stop_refusal(part: NodePart | Placement) -> Refusal | None:
    """Why a stop-only part, or a stop-only placement the placer pushed directly, is malformed
    (None: it is not): no expiry, no boot, or its own job's victims of another attempt. (Its
    expiry and boot are checked as any part's: :func:`stop_binding` for a placement.)"""
    if not part.expires_at:
        return Refusal("refused_spec", "a stop must carry an expiry")
    if not part.boot_id:
        return Refusal("refused_spec", "a stop must name the node's boot")
    stray = next((v.workload_id for v in part.victims
                  if attempt_of(v.workload_id, part.job_id) not in (None, part.attempt)), None)
    if stray is not None:
        # a stop of its own job's pods is bound to its attempt: a replay cannot reach a later one
        return Refusal("refused_spec", f"a stop of attempt {part.attempt} names {stray}")
    return None


def stop_binding(p: Placement, *, now: float, boot_id: str | None) -> Refusal | None:
    """Why the placer's stop-only placement ``p`` (pushed directly) may not act here (None: it
    may): held to a stop part's binding -- an expiry and this node's boot (``boot_id``: its
    link's) named, not past the expiry (no late window), this boot (else ``expired``), its own
    job's victims of its attempt only (else ``refused_spec``). So a direct stop replayed to a
    restarted agent, or after its expiry, stops nothing; the placer names what it still wants
    stopped in its answer to the node's next report."""
    if (why := stop_refusal(p)) is not None:
        return why
    if now > p.expires_at:
        return Refusal("expired", f"stop expired {now - p.expires_at:.3f}s ago")
    if p.boot_id != boot_id:
        return Refusal("expired", f"stop is for boot {p.boot_id[:16]}, not this node's {(boot_id or 'none')[:16]}")
    return None


def check_part(part: NodePart, *, node_id: str, now: float, inventory: Sequence[str],
               gpu_health: Mapping[str, str] | None, records: Mapping[str, WorkloadRecord],
               known: NodeOutcome | None = None, boot_id: str | None = None) -> Verdict:
    """Decide on ``part`` (see the module docstring). ``inventory``: this node's GPU UUIDs
    in index order; ``records``: every live workload, those of accepted parts included;
    ``known``: the outcome this placement id already got (answered again); ``boot_id``: this
    node's current boot (a stop-only part must name it)."""
    if part.node_id != node_id:
        return _no(part, node_id, Refusal("refused_spec", f"part is bound to node {part.node_id!r}, not {node_id!r}"))
    if known is not None:
        return Verdict(known)
    if part.version != WIRE_VERSION:
        return _no(part, node_id, Refusal("refused_spec", f"unsupported part version {part.version} "
                                                          f"(this agent speaks {WIRE_VERSION})"))
    if not part.pods and (why := stop_refusal(part)) is not None:
        return _no(part, node_id, why)
    if part.expires_at and now > part.expires_at:   # (a stop too: no late window, see above)
        return _no(part, node_id, Refusal("expired", f"part expired {now - part.expires_at:.3f}s ago"))
    if part.boot_id and part.boot_id != boot_id:
        return _no(part, node_id, Refusal("expired", f"part is for boot {part.boot_id[:16]}, not this node's "
                                                     f"{(boot_id or 'none')[:16]}"))
    if part.pods and not part.blob_id:
        return _no(part, node_id, Refusal("refused_spec", "a part that starts pods needs a gang blob"))
    if part.pods and (why := replayed(part.job_id, part.attempt, part.placement_id, records)) is not None:
        return _no(part, node_id, why)
    pods: list[PodAssignment] = []
    if part.inventory:
        if inventory_hash(list(inventory)) != part.inventory:
            return _no(part, node_id, Refusal("expired", "inventory changed"))
        for pod in part.pods:
            if any(s < 0 or s >= len(inventory) for s in pod.gpu_indices):
                return _no(part, node_id, Refusal("refused_spec", f"workload {pod.workload_id} names a GPU slot "
                                                                  f"this node does not have"))
            pods.append(PodAssignment(workload_id=pod.workload_id, rank=pod.rank,
                                      gpus=[inventory[s] for s in pod.gpu_indices],
                                      gpu_indices=list(pod.gpu_indices)))
    else:
        pods = [PodAssignment(workload_id=pod.workload_id, rank=pod.rank, gpus=list(pod.gpus),
                              gpu_indices=list(pod.gpu_indices))
                for pod in part.pods]  # GPUs named by UUID (checked below like any placement's)
    provisional = Placement(placement_id=part.placement_id, job_id=part.job_id, pods=pods,
                            victims=list(part.victims), argv=["(from the gang blob)"] if pods else [])
    why = check_placement(provisional, records, gpu_health)
    if why is not None:
        return _no(part, node_id, why)
    return Verdict(NodeOutcome(node_id=node_id, placement_id=part.placement_id, outcome="accepted"),
                   pods=tuple(pods), fresh=True)


def build_placement(part: NodePart, pods: Sequence[PodAssignment], blob: GangBlob) -> Placement:
    """The full Placement a part and its gang's blob make (what a direct push carries). Its
    peers: the part's own (none from a placer that lists the gang's contacts in the blob),
    then the blob's contacts (the part refers to them by its blob id, which the placer signed)."""
    return Placement(placement_id=part.placement_id, job_id=part.job_id, pods=list(pods),
                     victims=list(part.victims), world_size=blob.world_size, argv=list(blob.argv),
                     env=dict(blob.env), manifest_id=blob.manifest_id, origin=blob.origin,
                     peers=[*part.rack_members, *part.contacts, *blob.contacts], grace_s=blob.grace_s, restart=blob.restart,
                     issued_at=part.issued_at, user=blob.user, gang_blob_id=part.blob_id,
                     gang_nodes=part.gang_nodes or len(blob.peers), limits=blob.limits,
                     env_from_files=dict(blob.env_from_files))


def blob_problem(part: NodePart, blob: GangBlob, allowed_origins: tuple[str, ...] | None) -> str | None:
    """Why a verified blob cannot serve this part (None: it can)."""
    if blob.job_id != part.job_id or blob.attempt != part.attempt:
        return f"gang blob is for {blob.job_id} attempt {blob.attempt}, not {part.job_id} attempt {part.attempt}"
    if blob.origin is not None and (why := origin_refusal(blob.origin, allowed_origins)):
        return why
    return None


# ---------------------------------------------------------------- carrying it out (trio)

class PartNotDurable(AgentError):
    """An accepted part could not be written: it must not be acked."""


class PartNotAuthentic(AgentError):
    """A part whose placer signature does not hold (or cannot be checked yet): never acted on."""


class PartSupervisor(Protocol):
    async def place(self, placement: Placement, *, direct: bool = False) -> PlacementAck: ...

    async def stop(self, workload_id: str, *, reason: str = ..., grace_s: float | None = ...,
                   preempted: bool = ...) -> Any: ...

    def records_view(self) -> Mapping[str, WorkloadRecord]: ...

    def known_ack(self, placement_id: str) -> PlacementAck | None: ...


# blob_id -> the verified blob (raises when it cannot be had)
GangBlobGetter = Callable[[str], Awaitable[GangBlob]]
# () -> (GPU UUIDs in index order, uuid -> health or None when not discovered yet)
Inventory = Callable[[], tuple[list[str], Mapping[str, str] | None]]
# () -> (this node's MAC key, the placer's signing key), None until registered directly
Keys = Callable[[], tuple[bytes | None, bytes | None]]
# () -> this node's current boot id (its link's), None before it has a link
Boot = Callable[[], str | None]


@dataclass(frozen=True, slots=True)
class _Accept:
    part: NodePart
    reply: trio.MemorySendChannel[NodeOutcome | None]     # None: no answer can be given (not durable)


@dataclass(frozen=True, slots=True)
class _Stops:
    victims: tuple[Victim, ...]
    done: trio.Event


@dataclass(frozen=True, slots=True)
class _Done:
    placement_id: str
    state: PartState
    detail: str | None = None


@dataclass
class _Counters:
    accepted: int = 0
    refused: int = 0
    repeated: int = 0
    placed: int = 0
    failed: int = 0
    not_authentic: int = 0
    stale_epoch: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)


class PartAcceptor:
    """The agent's part handler: ``await acceptor.handle(part) -> NodeOutcome``."""

    def __init__(self, state_dir: str | os.PathLike[str], *, node_id: str, supervisor: PartSupervisor,
                 inventory: Inventory, blob: GangBlobGetter, notify: Callable[[WorkloadEvent], None],
                 keys: Keys, boot: Boot, allowed_origins: tuple[str, ...] | None = None,
                 blob_timeout_s: float = 10.0, clock: Callable[[], float] = time.time,
                 epochs: Epochs | None = None) -> None:
        self.node_id = node_id
        self._boot = boot
        self.supervisor = supervisor
        self._inventory = inventory
        self._blob = blob
        self._notify = notify
        self.allowed_origins = allowed_origins
        self.blob_timeout_s = blob_timeout_s
        self._clock = clock
        self._keys = keys
        self.epochs = epochs if epochs is not None else Epochs()   # the node's placer-epoch gate
        self._verifier: BundleVerifier | None = None
        self._seen_sigs: dict[bytes, bytes] = {}
        self._store = PartStore(state_dir)
        self._send, self._recv = trio.open_memory_channel[_Accept | _Done | _Stops](math.inf)
        self._recs: dict[str, PartRecord] = {}            # accepted parts (pending and done), by placement id
        self._refused: OrderedDict[str, NodeOutcome] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self.counters = _Counters()

    def statistics(self) -> dict[str, Any]:
        c = self.counters
        return {"accepted": c.accepted, "refused": c.refused, "repeated": c.repeated, "placed": c.placed,
                "failed": c.failed, "not_authentic": c.not_authentic, "stale_epoch": c.stale_epoch,
                "pending": sum(r.state == "accepted" for r in self._recs.values()), "writes": self._store.writes,
                "syncs": self._store.syncs}

    async def handle(self, part: NodePart) -> NodeOutcome:
        """Decide on a part and answer once the answer holds (an acceptance is on disk).
        Raises :class:`PartNotDurable` when it cannot be written, :class:`PartNotAuthentic` when
        the placer's signature does not hold: the sender then says nothing for this node and the
        placer pushes it directly."""
        mac_key, pub = self._keys()
        epoch = part.proof.epoch if part.proof is not None else 0   # (checked with the proof, next)
        part = self._authentic(part, pub)
        try:
            fresh = self.epochs.admit(epoch, "part")
        except OSError as e:
            raise PartNotDurable(f"part {part.placement_id}: placer epoch {epoch} not written: {e}") from None
        if not fresh:
            self.counters.stale_epoch += 1
            log.warning("part refused, stale placer epoch placement=%s epoch=%d highest=%d", part.placement_id,
                        epoch, self.epochs.highest)
            stale = NodeOutcome(node_id=self.node_id, placement_id=part.placement_id, outcome="stale_epoch",
                                detail=f"placer epoch {epoch} is older than {self.epochs.highest}")
            return with_outcome_mac(mac_key, stale) if mac_key else stale
        send, recv = trio.open_memory_channel[NodeOutcome | None](1)
        await self._send.send(_Accept(part, send))
        out = await recv.receive()
        if out is None:
            raise PartNotDurable(f"part {part.placement_id} could not be written to the state dir")
        return with_outcome_mac(mac_key, out) if mac_key else out

    def _authentic(self, part: NodePart, pub: bytes | None) -> NodePart:
        """The signed part (its proof checked), or PartNotAuthentic."""
        try:
            if pub is None:
                raise AuthError("no placer signing key yet (this node has not registered directly)")
            if self._verifier is None or self._verifier.public != pub:
                self._verifier = BundleVerifier(pub)
            return self._verifier.part(part, seen=self._seen_sigs)
        except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters.not_authentic += 1
            log.warning("part refused, not authentic placement=%s err=%s", part.placement_id, e)
            raise PartNotAuthentic(f"part {part.placement_id}: {e}") from None

    async def hold_stops(self, victims: Sequence[Victim]) -> None:
        """Stops that came another way (a victims-only placement over HTTP): those naming pods
        of accepted parts not handed over yet are kept with them (durably) before this returns,
        so such a pod never starts. Call before the supervisor applies the same stops."""
        if not victims or not any(r.state == "accepted" for r in self._recs.values()):
            return
        done = trio.Event()
        await self._send.send(_Stops(tuple(victims), done))
        await done.wait()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        recs = await trio.to_thread.run_sync(self._store.recover)
        self._recs = {r.part.placement_id: r for r in recs}
        try:
            await self._serve(recs, task_status)
        finally:
            self._store.close()

    async def _serve(self, recs: list[PartRecord], task_status: Any) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            for r in recs:
                if r.state == "accepted":
                    log.info("accepted part processed again placement=%s", r.part.placement_id)
                    n.start_soon(self._hand_over, r)
            task_status.started()
            async for msg in self._recv:
                batch = [msg]
                while True:
                    try:
                        batch.append(self._recv.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._apply(batch)

    # ------------------------------------------------------------ the owner

    def _held(self) -> dict[str, WorkloadRecord]:
        """Supervisor records plus the pods of accepted parts not handed over yet."""
        records = dict(self.supervisor.records_view())
        for r in self._recs.values():
            if r.state != "accepted":
                continue
            for pod in r.pods:
                records.setdefault(pod.workload_id, WorkloadRecord(
                    workload_id=pod.workload_id, job_id=r.part.job_id, placement_id=r.part.placement_id,
                    gpus=list(pod.gpus), state="accepted"))
        return records

    def _known(self, pid: str) -> NodeOutcome | None:
        if pid in self._recs:
            return NodeOutcome(node_id=self.node_id, placement_id=pid, outcome="accepted")
        return self._refused.get(pid)

    async def _apply(self, batch: list[_Accept | _Done | _Stops]) -> None:
        now = self._clock()
        fresh: list[tuple[PartRecord, _Accept]] = []
        done: list[PartRecord] = []
        answers: list[tuple[_Accept, NodeOutcome]] = []
        stops_only: list[_Accept] = []
        held: list[trio.Event] = []
        touched: dict[str, PartRecord] = {}       # pending records that got stops
        records: dict[str, WorkloadRecord] | None = None
        uuids, health = self._inventory()
        boot = self._boot()
        for msg in batch:
            if isinstance(msg, _Stops):
                for t in self._pending_of(msg.victims):
                    touched[t.part.placement_id] = t
                held.append(msg.done)
                continue
            if isinstance(msg, _Done):
                r = self._recs.get(msg.placement_id)
                if r is not None:
                    r = msgspec.structs.replace(r, state=msg.state, detail=msg.detail)
                    self._recs[msg.placement_id] = r
                    done.append(r)
                continue
            part = msg.part
            pid = part.placement_id
            if part.node_id == self.node_id and self.supervisor.known_ack(pid) is not None \
                    and pid not in self._recs:
                # the same placement came first over HTTP: the supervisor's answer, once durable
                assert self._nursery is not None
                self._nursery.start_soon(self._answer_from_supervisor, msg)
                continue
            if records is None:
                records = self._held()
            v = check_part(part, node_id=self.node_id, now=now, inventory=uuids, gpu_health=health,
                           records=records, known=self._known(pid), boot_id=boot)
            if v.fresh and not part.pods:
                # only stops: the supervisor's placement of the victims is durable and idempotent
                # itself; a victim that is a pod of a part not handed over yet is kept with that part
                for r in self._pending_of(part.victims):
                    touched[r.part.placement_id] = r
                stops_only.append(msg)
                continue
            if v.fresh:
                rec = PartRecord(part=part, pods=list(v.pods), accepted_at=now)
                self._recs[pid] = rec
                for pod in v.pods:  # held from now on, for the rest of this batch too
                    records[pod.workload_id] = WorkloadRecord(workload_id=pod.workload_id, job_id=part.job_id,
                                                              placement_id=pid, gpus=list(pod.gpus))
                fresh.append((rec, msg))
                self.counters.accepted += 1
            else:
                if v.outcome.outcome == "accepted":
                    self.counters.repeated += 1
                elif part.node_id == self.node_id:
                    self.counters.refused += 1
                    self._refused[pid] = v.outcome
                    while len(self._refused) > KEEP_REFUSED:
                        self._refused.popitem(last=False)
                    log.warning("part refused placement=%s outcome=%s detail=%s", pid, v.outcome.outcome,
                                v.outcome.detail)
                answers.append((msg, v.outcome))
        # each changed record once, as it stands now (a record may be touched and done in one batch)
        changed = dict.fromkeys([r.part.placement_id for r, _ in fresh] + [r.part.placement_id for r in done]
                                + list(touched))
        writes = [self._recs[pid] for pid in changed if pid in self._recs]
        if writes:
            try:
                await trio.to_thread.run_sync(self._store.save, writes)
            except OSError as e:
                # not durable: no acceptance may be answered (the placer pushes those nodes
                # directly); a record's end state stays in memory
                log.error("part records not written err=%s", e)
                lost = {r.part.placement_id for r, _ in fresh}
                for r, a in fresh:
                    del self._recs[r.part.placement_id]
                    a.reply.send_nowait(None)
                for a, out in answers:
                    a.reply.send_nowait(None if a.part.placement_id in lost else out)
                for a in stops_only:
                    a.reply.send_nowait(None)
                for ev in held:  # the stops then apply as they come (best we can do without a disk)
                    ev.set()
                return
        for a, out in answers:  # after the write: a repeat of a part accepted in this batch too
            a.reply.send_nowait(out)
        assert self._nursery is not None
        for a in stops_only:
            self._nursery.start_soon(self._victims_only, a)
        for ev in held:
            ev.set()
        for r, a in fresh:
            a.reply.send_nowait(NodeOutcome(node_id=self.node_id, placement_id=r.part.placement_id,
                                            outcome="accepted"))
            self._nursery.start_soon(self._hand_over, r)
        if done:
            self._prune()

    def _pending_of(self, victims: Sequence[Victim]) -> list[PartRecord]:
        """Pending (accepted, not handed over) records naming any of ``victims`` as a pod,
        updated (in ``_recs``) with those stops."""
        want = {v.workload_id: v for v in victims}
        out: list[PartRecord] = []
        for pid, r in self._recs.items():
            if r.state != "accepted":
                continue
            hit = [want[p.workload_id] for p in r.pods if p.workload_id in want
                   and all(s.workload_id != p.workload_id for s in r.stopped)]
            if hit:
                r = msgspec.structs.replace(r, stopped=[*r.stopped, *hit])
                self._recs[pid] = r
                out.append(r)
        return out

    def _prune(self) -> None:
        finished = [r for r in self._recs.values() if r.state != "accepted"]
        excess = len(finished) - KEEP_DONE
        if excess > 0:
            gone = [r.part.placement_id for r in finished[:excess]]  # insertion order: oldest first
            for pid in gone:
                del self._recs[pid]
            assert self._nursery is not None
            self._nursery.start_soon(trio.to_thread.run_sync, self._store.remove, gone)

    async def _answer_from_supervisor(self, msg: _Accept) -> None:
        p = msg.part
        ack = await self.supervisor.place(Placement(placement_id=p.placement_id, job_id=p.job_id))
        self.counters.repeated += 1
        msg.reply.send_nowait(_outcome_of(ack, self.node_id))

    async def _victims_only(self, msg: _Accept) -> None:
        p = msg.part
        ack = await self.supervisor.place(Placement(placement_id=p.placement_id, job_id=p.job_id,
                                                    victims=list(p.victims)))
        msg.reply.send_nowait(_outcome_of(ack, self.node_id))

    # ------------------------------------------------------------ after the ack

    def _stopped(self, r: PartRecord) -> dict[str, Victim]:
        """Stops that named this part's pods so far (the owner's latest record)."""
        return {v.workload_id: v for v in self._recs.get(r.part.placement_id, r).stopped}

    async def _hand_over(self, r: PartRecord) -> None:
        part = r.part
        for v in part.victims:  # victims go now, not after the blob: the stops and the parts go out together
            try:
                await self.supervisor.stop(v.workload_id, reason=v.reason, grace_s=v.grace_s, preempted=v.preempted)
            except Exception as e:  # already gone (UnknownWorkload): nothing to stop
                log.debug("victim not stopped workload=%s err=%s", v.workload_id, e)
        why: str | None = None
        blob: GangBlob | None = None
        with trio.move_on_after(self.blob_timeout_s) as cs:
            try:
                blob = await self._blob(part.blob_id)
            except Exception as e:
                why = f"gang blob unavailable: {e}"
        if cs.cancelled_caught:
            why = f"gang blob not had within {self.blob_timeout_s:g}s"
        if blob is not None:
            why = blob_problem(part, blob, self.allowed_origins)
        early = self._stopped(r)
        pods = [p for p in r.pods if p.workload_id not in early]  # stopped before start: never started
        if why is None and blob is not None and pods:
            ack = await self.supervisor.place(build_placement(part, pods, blob))
            if not ack.accepted:
                why = ack.reason or f"refused ({ack.effective_outcome()})"
        now = self._clock()
        if why is None:
            for wid, v in self._stopped(r).items():
                if wid in early:  # not placed: its end is ours to report (as the supervisor would)
                    state: WorkloadState = "preempted" if v.preempted else "exited"
                    pod = next(p for p in r.pods if p.workload_id == wid)
                    self._notify(WorkloadEvent(workload_id=wid, job_id=part.job_id, state=state, at=now,
                                               reason=f"{v.reason} before start", gpus=list(pod.gpus),
                                               placement_id=part.placement_id))
                    continue
                try:  # came while the placement was being handed over
                    await self.supervisor.stop(wid, reason=v.reason, grace_s=v.grace_s, preempted=v.preempted)
                except Exception as e:
                    log.debug("early stop not applied workload=%s err=%s", wid, e)
            self.counters.placed += 1
            await self._send.send(_Done(part.placement_id, "placed"))
            return
        self.counters.failed += 1
        log.warning("accepted part failed placement=%s job=%s reason=%s", part.placement_id, part.job_id, why)
        for pod in r.pods:
            self._notify(WorkloadEvent(workload_id=pod.workload_id, job_id=part.job_id, state="failed", at=now,
                                       reason=why, gpus=list(pod.gpus), placement_id=part.placement_id))
        await self._send.send(_Done(part.placement_id, "failed", why))


def _outcome_of(ack: PlacementAck, node_id: str) -> NodeOutcome:
    return NodeOutcome(node_id=node_id, placement_id=ack.placement_id, outcome=ack.effective_outcome(),
                       refused_gpus=list(ack.refused_gpus), detail=ack.reason)
