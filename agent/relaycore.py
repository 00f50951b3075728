"""A rack relay's decisions, with no I/O: events in, actions out (h11's shape).

Theory of operation
-------------------
:class:`RelayCore` is everything a rack relay decides; :class:`agent.relay.Relay` (the agent's
trio driver) and the fleet emulator (``testing.fleet``, which drives that same ``Relay``) carry
out what it returns. It never touches sockets, clocks or trio: ``now`` (the driver's monotonic
clock) and ``wall`` (unix seconds, the placer's ``deliver_by`` clock) are arguments.

- **Bundles.** :meth:`RelayCore.bundle` takes a ``bundle`` frame's payload and the placer's
  public key. Nothing of a bundle is acted on before the placer's signature over it verifies
  (scheduler_link.msgauth: a Merkle path to a batch root, one Ed25519 verification per batch;
  the verified roots are kept in ``seen`` so a relay given several bundles of one batch checks
  the signature once). A bundle whose signed placer epoch is older than the highest this node
  has seen is refused too (``stale_epoch``, counted; scheduler_link.epochs: the node's one
  durable gate, so a bundle replayed after the relay restarted is refused as well; a newer
  epoch is written before the bundle is acted on). A refused bundle is :class:`Refuse`. A taken
  one opens a *round*: the blob is kept (:class:`KeepBlob`) or wanted (:class:`WantBlob`: the driver fetches it unless
  cached), and each part goes to its node (:class:`Hand`: this relay's own node, or a member
  with a connection here, with the signed proof the member checks itself); a part for a node
  that is neither is left out at once (the placer pushes it directly). A bundle that comes past
  its ``deliver_by`` is handed all the same, with the whole ack window: the placer's fallback
  for the rack is under way, but a late answer still counts there and spares the pushes not
  yet made (a relay that drops late bundles turns a slow moment into a storm of direct pushes).
- **Outcomes.** :meth:`answered` records a member's outcome for one handed part (None: not
  answered, e.g. its connection failed); :meth:`member_closed` leaves out every part of that
  member still waiting; :meth:`due` (or :meth:`expire`) closes rounds whose deadline passed
  (``min(deliver_by, now + ack_window_s)``; ``now + ack_window_s`` for a late bundle). A round whose parts are all settled, or whose
  deadline passed, becomes its one :class:`Acks` (an AckBundle for the placer): the members
  that plainly accepted as the rack's aggregate (a bitmap over the bundle's parts and their
  MACs, in part order), any other outcome as the member made it.
- **Reports.** :meth:`report` answers an empty heartbeat at once (agent.beats.BeatBook keeps it
  for the rack's next beat) and queues any other report (a ticket); :meth:`next_batch` takes the
  queue as one batch (with a beat of those members' pending entries, to go first, so the placer
  sees each node's sequence in order) and :meth:`batch_answered` hands each answer back to its
  ticket, with the stops a beat reply left for that member.
- **Enrolments** (scheduler_link.enroll). :meth:`enroll` refuses at once an enrolment for
  another node than the member connection's (``wrong_node``) or while there is no connection
  up (``upstream_down``: the member keeps trying this relay for a while), and queues any other (a ticket); :meth:`next_enrolls` takes the queue
  as one batch (bounded in entries and bytes) and :meth:`enrolls_answered` hands each answer
  back. The relay reads nothing of them but the node id and cannot alter one unnoticed: the
  member's MAC covers it and the keys in the answer are sealed to the member.
- **Blobs.** Which relays a bundle named as a blob's sources (:meth:`blob_sources`), and whether
  a blob request may start a fetch (a member's may; another relay's only reads the cache, so
  relays asking each other never wait on one another in a cycle).

Invariants (tests/test_relay_core.py checks them over any interleaving):
- every part of a round ends exactly once: in the round's one ack bundle (its member's
  outcome, as the member made it, or its bit and MAC in the aggregate: MACs pass through
  untouched) or left out; nothing is added
  to a round after its ack bundle was made (a late answer is dropped and counted);
- an outcome counts only for the part it answers (same node, same placement id);
- a relay can delay or drop, never forge: it makes no outcome, beat MAC or report of its own;
- nothing of a bundle, a beat answer or a report answer older than the highest placer epoch
  seen is handed to anyone.

The epoch gate (:class:`scheduler_link.epochs.Epochs`) is the one thing the core calls that may
write: a newer epoch is made durable before its bundle is acted on (once per placer start).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from scheduler_link.epochs import Epochs
from scheduler_link.heartbeat_wire import UPSTREAM_DOWN, WireReply
from scheduler_link.messages import (
    MAC_LEN,
    AckBundle,
    Enroll,
    EnrollAnswer,
    NodeOutcome,
    NodePart,
    NodeReport,
    NodeStop,
    RackBeat,
    RackBeatReply,
)
from scheduler_link.msgauth import AuthError, BundleVerifier

from .beats import BeatBook, is_empty

log = logging.getLogger("herd.agent.relay")

ACK_WINDOW_S = 0.4           # a bundle's acks go back at most this long after it came
KEEP_SOURCES = 16            # blob ids whose sources (from bundles) are remembered
LATE_MIN_S = 0.05            # a bundle with less of its deliver_by left than this is late
ENROLL_BATCH = 256           # enrolments in one frame up, at most (the placer's rack entry bound)
# ... and their bytes: under what the placer holds back of a connection during a delivery
# (frames.MEMBER_MAX_HELD, 1 MiB, for a relay it has not chosen): ~25 full reports of ~20 KB
ENROLL_BATCH_BYTES = 512 << 10
ENROLL_QUEUE = 1024          # enrolments waiting here, at most (more are answered unavailable)


# ---------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class Refuse:
    """The bundle is not acted on: answer the frame with ``error``. ``new_key``: the signature
    did not verify with the key held (maybe the placer has a new one: report fully). ``reason``
    says why, for counting and deciding (never ``error``'s words)."""
    error: str
    new_key: bool = False
    reason: Literal["no_key", "not_authentic", "stale_epoch", "not_durable"] = "not_authentic"


@dataclass(frozen=True, slots=True)
class KeepBlob:
    blob_id: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class WantBlob:
    """The bundle names a blob it does not carry: fetch it unless cached (members ask soon)."""
    blob_id: str


@dataclass(frozen=True, slots=True)
class Hand:
    """Give ``part`` to its node (``own``: this relay's own node) and report back with
    :meth:`RelayCore.answered` ``(round_id, slot, outcome)``."""
    round_id: int
    slot: int
    part: NodePart
    own: bool


@dataclass(frozen=True, slots=True)
class Acks:
    """A round is over: send ``acks`` as the answer to its bundle frame."""
    round_id: int
    acks: AckBundle


@dataclass(frozen=True, slots=True)
class Taken:
    """A bundle taken: its round, its deadline (driver clock), and what to do now (a
    KeepBlob/WantBlob, then the Hands; an Acks when nothing waits on a member)."""
    round_id: int
    until: float
    actions: list[KeepBlob | WantBlob | Hand | Acks]


@dataclass(frozen=True, slots=True)
class Batch:
    """Members' content reports to send up together, after ``beat`` (their pending entries)."""
    beat: RackBeat | None
    reports: list[NodeReport]
    tickets: list[int]


@dataclass(frozen=True, slots=True)
class EnrollBatch:
    """Members' enrolments to send up together (one ``enrolls`` frame)."""
    enrolls: list[Enroll]
    tickets: list[int]


@dataclass(slots=True)
class _Round:
    rack: str
    blob_id: str
    until: float
    waiting: dict[int, NodePart]                    # slot -> the part handed, not yet settled
    size: int = 0                                   # the bundle's parts
    outcomes: list[NodeOutcome] = field(default_factory=list)     # those not plainly accepted
    accepted: dict[int, bytes] = field(default_factory=dict)      # slot -> its member's MAC (plainly accepted)
    missed: int = 0


# ---------------------------------------------------------------- the core

class RelayCore:
    """One rack relay's state and decisions (see the module docstring)."""

    def __init__(self, *, node_id: str, rack: str, heartbeat_s: float = 5.0, ack_window_s: float = ACK_WINDOW_S,
                 verifiers: dict[bytes, tuple[BundleVerifier, dict[bytes, bytes]]] | None = None,
                 epochs: Epochs | None = None) -> None:
        """``verifiers``: by the placer's public key, its verifier and the batch signatures it
        verified (signature -> root): a cache a host's relays may share (the fleet emulator's
        relays of one process do). ``epochs``: the node's placer-epoch gate (default: one in
        memory; an agent passes its durable one, shared with its parts and its link)."""
        self.epochs = epochs if epochs is not None else Epochs()
        self.node_id = node_id
        self.rack = rack
        self.ack_window_s = ack_window_s
        self.book = BeatBook(rack, heartbeat_s)
        self.members: set[str] = set()
        self._verifiers: dict[bytes, tuple[BundleVerifier, dict[bytes, bytes]]] = {} if verifiers is None else verifiers
        self._sources: OrderedDict[str, list[str]] = OrderedDict()
        self._rounds: dict[int, _Round] = {}
        self._next_round = 0
        self._queue: list[tuple[int, NodeReport]] = []
        self._next_ticket = 0
        self._send_inventory: set[str] = set()   # members a follower asked for their GPU inventory
        # statistics
        self.bundles = 0
        self.bad_bundles = 0
        self.stale_bundles = 0       # signed, but of an older placer epoch than one seen (refused)
        self.parts_delivered = 0
        self.parts_missed = 0
        self.late_answers = 0
        self.late_bundles = 0        # came past (or at) their deliver_by: handed with the whole window
        self.foreign_answers = 0
        self.reports_forwarded = 0
        self.empty_answered = 0
        self.held_answered = 0          # members' reports answered upstream_down (no connection up)
        self.part_bytes_max = 0
        self._enrolls: list[tuple[int, Enroll]] = []
        self.enrolls_forwarded = 0
        self.enrolls_refused: dict[str, int] = {}   # by outcome: this relay's and the placer's

    @property
    def open_rounds(self) -> int:
        return len(self._rounds)

    # ---- members

    def member_opened(self, node_id: str) -> None:
        self.members.add(node_id)

    def member_closed(self, node_id: str) -> list[Acks]:
        """A member's connection ended: its parts still waiting are left out."""
        self.members.discard(node_id)
        self.book.forget(node_id)
        self._send_inventory.discard(node_id)
        out = []
        for rid, r in list(self._rounds.items()):
            gone = [s for s, p in r.waiting.items() if p.node_id == node_id]
            for s in gone:
                del r.waiting[s]
                r.missed += 1
            if gone and not r.waiting:
                out.append(self._close(rid))
        return out

    # ---- bundles

    def bundle(self, payload: bytes, placer_key: bytes | None, *, now: float, wall: float) -> Taken | Refuse:
        if placer_key is None:
            self.bad_bundles += 1
            return Refuse("bundle refused: no placer signing key yet (this relay has not registered directly)",
                          reason="no_key")
        try:
            vs = self._verifiers.get(placer_key)
            if vs is None:
                vs = self._verifiers[placer_key] = (BundleVerifier(placer_key), {})
            view, parts, proofs = vs[0].bundle(payload, seen=vs[1])
        except (AuthError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self.bad_bundles += 1
            log.warning("bundle refused rack=%s: %s", self.rack, e)
            return Refuse(f"bundle refused: {e}", new_key=True)
        try:
            fresh = self.epochs.admit(view.epoch, "bundle")   # (the epoch is in the signed header)
        except OSError as e:   # a newer epoch not durable: not acted on (the placer reaches them directly)
            return Refuse(f"bundle refused: placer epoch {view.epoch} not written: {e}", reason="not_durable")
        if not fresh:
            self.stale_bundles += 1
            return Refuse(f"bundle refused: placer epoch {view.epoch} is older than {self.epochs.highest}",
                          reason="stale_epoch")
        self.bundles += 1
        size = max(map(len, view.parts), default=0)   # what a member receives of it: its signed bytes
        if size > self.part_bytes_max:
            self.part_bytes_max = size
        acts: list[KeepBlob | WantBlob | Hand | Acks] = []
        if view.blob_id:
            self._sources[view.blob_id] = list(view.blob_sources)
            self._sources.move_to_end(view.blob_id)
            while len(self._sources) > KEEP_SOURCES:
                self._sources.popitem(last=False)
            acts.append(KeepBlob(view.blob_id, view.blob) if view.blob is not None else WantBlob(view.blob_id))
        until = now + self.ack_window_s
        if view.deliver_by:
            left = view.deliver_by - wall
            if left >= LATE_MIN_S:
                until = min(until, now + left)
            else:
                # late: the placer's fallback for this rack is under way. Handed all the same,
                # with the whole window: a late answer still counts there (a node it brings is
                # not pushed directly if its push has not started), and a placement is
                # idempotent by id, so one that reaches a node twice is applied once.
                self.late_bundles += 1
        rid = self._next_round
        self._next_round += 1
        r = self._rounds[rid] = _Round(rack=view.rack, blob_id=view.blob_id, until=until, waiting={},
                                       size=len(parts))
        for slot, (p, pr) in enumerate(zip(parts, proofs, strict=True)):
            own = p.node_id == self.node_id
            if not own and p.node_id not in self.members:
                # not one of ours (yet): the placer reaches it directly
                r.missed += 1
                continue
            if p.pods and not p.blob_id:   # inside a bundle a part's blob is the bundle's
                p = msgspec.structs.replace(p, blob_id=view.blob_id, proof=pr)
            else:
                p = msgspec.structs.replace(p, proof=pr)
            r.waiting[slot] = p
            acts.append(Hand(rid, slot, p, own))
        if not r.waiting:
            acts.append(self._close(rid))
        return Taken(rid, until, acts)

    def answered(self, round_id: int, slot: int, outcome: NodeOutcome | None) -> Acks | None:
        """A handed part's answer (None: none came). The round's Acks once it was the last."""
        r = self._rounds.get(round_id)
        p = r.waiting.pop(slot, None) if r is not None else None
        if r is None or p is None:
            self.late_answers += 1
            return None
        if outcome is None:
            r.missed += 1
        elif outcome.node_id != p.node_id or outcome.placement_id != p.placement_id:
            self.foreign_answers += 1   # not an answer to this part: as if none came
            r.missed += 1
        elif (outcome.outcome == "accepted" and not outcome.refused_gpus and outcome.detail is None
              and len(outcome.mac) == MAC_LEN):
            r.accepted[slot] = outcome.mac    # (the common answer: in the rack's aggregate)
        else:
            r.outcomes.append(outcome)
        return self._close(round_id) if not r.waiting else None

    def expire(self, round_id: int) -> Acks | None:
        """The round's deadline passed: its Acks (the parts still waiting left out), or None
        when it was over already."""
        r = self._rounds.get(round_id)
        if r is None:
            return None
        r.missed += len(r.waiting)
        r.waiting.clear()
        return self._close(round_id)

    def due(self, now: float) -> list[Acks]:
        """Every round whose deadline is ``now`` or earlier, over."""
        return [a for rid in [rid for rid, r in self._rounds.items() if r.until <= now]
                if (a := self.expire(rid)) is not None]

    def next_deadline(self) -> float | None:
        return min((r.until for r in self._rounds.values()), default=None)

    def _close(self, round_id: int) -> Acks:
        r = self._rounds.pop(round_id)
        self.parts_delivered += len(r.outcomes) + len(r.accepted)
        self.parts_missed += r.missed
        bits = bytearray((r.size + 7) // 8 if r.accepted else 0)
        slots = sorted(r.accepted)
        for k in slots:
            bits[k >> 3] |= 1 << (k & 7)
        return Acks(round_id, AckBundle(rack=r.rack, blob_id=r.blob_id, outcomes=r.outcomes, accepted=bytes(bits),
                                        macs=b"".join([r.accepted[k] for k in slots])))

    # ---- members' reports

    def report(self, node_id: str, rep: NodeReport, *, upstream: bool, dialling: bool = False) -> WireReply | int:
        """A member's report over its connection (``node_id``: whom the connection is of):
        the answer now, or a ticket for :meth:`batch_answered`. ``dialling``: with no connection
        up, the relay's first dial is under way (said in the answer: the member holds on longer)."""
        if rep.node_id != node_id:
            return WireReply(status=403, error=f"this connection reports for {node_id}, not {rep.node_id}")
        if not upstream:
            self.held_answered += 1
            return WireReply(status=503, reason=UPSTREAM_DOWN, dialling=dialling,
                             error="the relay has no connection to the placer")
        if is_empty(rep):
            self.empty_answered += 1
            reply = self.book.empty(rep)
            if reply.need_full and node_id in self._send_inventory:
                reply = msgspec.structs.replace(reply, send_inventory=True)
            return WireReply(status=200, reply=reply)
        t = self._next_ticket
        self._next_ticket += 1
        self._queue.append((t, rep))
        return t

    @property
    def queued(self) -> int:
        return len(self._queue)

    def next_batch(self, now: float) -> Batch | None:
        if not self._queue:
            return None
        q, self._queue = self._queue, []
        reps = [r for _, r in q]
        beat = self.book.take_some([r.node_id for r in reps], now)
        for r in reps:
            self.book.forwarded(r)
            if r.full and r.snapshot is not None:
                self._send_inventory.discard(r.node_id)
        self.reports_forwarded += len(reps)
        return Batch(beat, reps, [t for t, _ in q])

    def batch_answered(self, batch: Batch, answers: list[WireReply]) -> list[tuple[int, WireReply]]:
        """Each ticket's answer (the placer's, plus stops a beat reply left for its member);
        answers that do not match the batch one to one fail every ticket (503)."""
        if len(answers) != len(batch.reports):
            answers = [WireReply(status=503, error=f"{len(answers)} answers to {len(batch.reports)} reports")
                       ] * len(batch.reports)
        out = []
        for t, r, wr in zip(batch.tickets, batch.reports, answers, strict=True):
            if wr.status == 200 and not self._upstream_fresh(wr.reply.epoch, "reply"):
                # a replaced placer's answer: not passed down (the member reports to the placer itself)
                wr = WireReply(status=503, error=f"the relay's placer is of a stale epoch ({wr.reply.epoch})")
            elif wr.status == 200:
                wr = msgspec.structs.replace(wr, reply=self.book.answer(r.node_id, wr.reply))
            out.append((t, wr))
        return out

    def _upstream_fresh(self, epoch: int, kind: str) -> bool:
        """An answer over the relay's own connection to the placer (its epoch is the placer's):
        of no older epoch than seen (a newer one made durable first)."""
        try:
            return self.epochs.admit(epoch, kind)
        except OSError:
            return False

    def upstream_lost(self) -> list[int]:
        """The connection up is gone: the queued tickets, to be answered 503."""
        q, self._queue = self._queue, []
        return [t for t, _ in q]

    # ---- members' enrolments

    def _enroll_refused(self, node_id: str, outcome: str, detail: str) -> EnrollAnswer:
        self.enrolls_refused[outcome] = self.enrolls_refused.get(outcome, 0) + 1
        return EnrollAnswer(node_id=node_id[:256], outcome=outcome, detail=detail)  # type: ignore[arg-type]  # outcome is one of EnrollOutcome's (the callers' literals)

    def enroll(self, node_id: str, e: Enroll, *, upstream: bool) -> EnrollAnswer | int:
        """A member's enrolment over its connection (``node_id``: whom the connection is of):
        a refusal now, or a ticket for :meth:`enrolls_answered`."""
        if e.node_id != node_id:
            return self._enroll_refused(e.node_id, "wrong_node", f"this connection is of {node_id[:200]}")
        if not upstream:
            return self._enroll_refused(e.node_id, "upstream_down", "the relay has no connection to the placer")
        if len(self._enrolls) >= ENROLL_QUEUE:
            return self._enroll_refused(e.node_id, "unavailable", "the relay's enrolment queue is full")
        t = self._next_ticket
        self._next_ticket += 1
        self._enrolls.append((t, e))
        return t

    @property
    def enrolls_queued(self) -> int:
        return len(self._enrolls)

    def next_enrolls(self) -> EnrollBatch | None:
        """The queued enrolments, oldest first, as much as one frame carries."""
        if not self._enrolls:
            return None
        size = n = 0
        for _, e in self._enrolls:
            size += len(e.report) + len(e.cert) + 256
            if n and (n >= ENROLL_BATCH or size > ENROLL_BATCH_BYTES):
                break
            n += 1
        q, self._enrolls = self._enrolls[:n], self._enrolls[n:]
        self.enrolls_forwarded += n
        return EnrollBatch([e for _, e in q], [t for t, _ in q])

    def enrolls_answered(self, batch: EnrollBatch, answers: list[EnrollAnswer] | None
                         ) -> list[tuple[int, EnrollAnswer]]:
        """Each ticket's answer (None, or answers that do not match the batch one to one:
        every ticket ``unavailable``, and its member registers directly)."""
        if answers is None or len(answers) != len(batch.enrolls) or any(
                a.node_id != e.node_id for a, e in zip(answers, batch.enrolls, strict=True)):
            answers = [EnrollAnswer(node_id=e.node_id[:256], outcome="unavailable",
                                    detail="the placer did not answer the enrolment") for e in batch.enrolls]
        for a in answers:
            if a.outcome != "enrolled":
                self.enrolls_refused[a.outcome] = self.enrolls_refused.get(a.outcome, 0) + 1
        return list(zip(batch.tickets, answers, strict=True))

    def enrolls_lost(self) -> list[int]:
        """The connection up is gone: the queued enrolments' tickets, to be answered unavailable."""
        q, self._enrolls = self._enrolls, []
        return [t for t, _ in q]

    # ---- beats

    def beat(self, now: float) -> RackBeat | None:
        """The interval's beat: every pending empty heartbeat (None when there is none)."""
        return self.book.take_all(now)

    def follower_needs(self, node_ids: list[str], inventories: Sequence[str] = ()) -> None:
        """A placer that follows lacks these members (its answer to a copy: agent.relaycopies):
        each is asked for a full report in its next answer, as when the leader asks. Those in
        ``inventories`` it lacks the GPU inventory of (it refused their compact registration:
        placer.inventories): they are asked whatever went up before, with ``send_inventory``
        (their next full report carries the snapshot). Nothing else of a follower's answer is
        taken (it names no stop and no epoch)."""
        self.book.apply(RackBeatReply(need_full=list(node_ids)))
        if inventories:
            self.book.need_full(list(inventories))
            self._send_inventory.update(inventories)

    def copies_answered(self, reports: list[NodeReport], answers: list[WireReply]) -> None:
        """A placer that follows answered copied reports with its epoch: it leads now (promoted
        while this relay still goes up to the placer before). What it says of a member is taken
        as in a beat answer of the connection up: its epoch checked (a replaced placer's answers
        are dropped), its stops handed on in the member's next answer, its ``need_full`` asked."""
        taken = [(r, a.reply) for r, a in zip(reports, answers, strict=False) if a.status == 200]
        epoch = max((rr.epoch for _, rr in taken), default=0)
        self.beat_answered(RackBeatReply(
            need_full=[r.node_id for r, rr in taken if rr.need_full],
            stop=[NodeStop(node_id=r.node_id, stop=list(rr.stop)) for r, rr in taken if rr.stop], epoch=epoch))

    def beat_answered(self, reply: RackBeatReply) -> None:
        """The placer's answer to the rack's beat (a replaced placer's is dropped and counted)."""
        if self._upstream_fresh(reply.epoch, "reply"):
            self.book.apply(reply)

    # ---- blobs

    def blob_sources(self, blob_id: str, own_url: str) -> list[str]:
        """The relays a bundle named for ``blob_id``, in order, less this one."""
        return [u for u in self._sources.get(blob_id, []) if u != own_url]

    @staticmethod
    def may_fetch(from_relay: bool) -> bool:
        """A member's blob request may start a fetch; another relay's only reads the cache
        (after the fetch in flight here, if any)."""
        return not from_relay
