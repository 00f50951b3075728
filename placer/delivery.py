"""One delivery round as a state machine with no I/O: events in, actions out (h11's shape).

Theory of operation (DESIGN.md, "Fleet scale"; placer.relays is the trio driver):
- A round delivers one decision's pushes (a gang's start parts and its victims' stops, or a
  round of stops) to ``n`` nodes, numbered 0..n-1 in rack order: rack ``r``'s members are
  the slice ``bounds[r]:bounds[r+1]`` (its bundle is that slice of the round's parts), and
  the nodes from ``bounds[-1]`` on have no relay: they are pushed directly once the round
  may send.
- Events: a rack's bundle was built (:meth:`built`), the journal said the job is durable or
  not (:meth:`journal`), every bundle was built (:meth:`all_built`), a relay's ack bundle
  arrived, its outcomes already checked (:meth:`acked`; MACs that did not verify come as
  ``bad``), a relay's connection closed or answered an error (:meth:`closed`), time passed
  (:meth:`tick`), a direct push is about to start (:meth:`direct_starting`) or was answered
  (:meth:`direct_answered`).
- Actions: :class:`SendBundle`, :class:`PushDirect`, :class:`RackFailed`,
  :class:`RacksSettled` (every relay's wait is over: reports held back may flow again),
  :class:`Done` (every node has its outcome; ``rollback``: a start was refused, so the gang
  is rolled back: :meth:`rollback_nodes` are the nodes that must then be told to stop) and
  :class:`Abort` (the journal said no: nothing was sent).

Invariants (tests/test_delivery_core.py checks them over any interleaving of events):
- Every node ends with exactly one outcome, its first: what comes after is ignored.
- A node is pushed directly only while it has no outcome (:meth:`direct_starting` says no
  to a queued push once a relay's late answer recorded one), and each rack falls back once.
- A rack's wait ends once (answered, failed, or given up on at the deadline); an answer
  after that still records the outcomes it brings (``late``).
- A relay has failed when it has not answered ``patience_s`` after the round last made
  progress (the last bundle left, or any relay of the round answered), and never later than
  ``cap_s`` after the last bundle left.

State is plain attributes: numpy arrays over nodes, bytearrays over racks (read and written
one rack at a time); outcomes are codes into a small table (0: accepted), so recording a
rack's accepted members is a slice write. A finished round's result is :class:`RoundOutcomes`,
a mapping view over those arrays that names its refusals without a pass over the gang.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import ContractError
from .records import ACCEPTED, Outcome

# how a node's outcome came (``via``)
VIA_NONE, VIA_RELAY, VIA_LATE, VIA_DIRECT = 0, 1, 2, 3
# a rack's phase
RACK_NEW, RACK_HELD, RACK_SENT, RACK_SETTLED = 0, 1, 2, 3
NO_OUTCOME = -1


@dataclass(frozen=True, slots=True)
class SendBundle:
    rack: int


@dataclass(frozen=True, slots=True)
class PushDirect:
    nodes: np.ndarray      # node indices, none with an outcome when this was returned
    fallback: bool         # members of a rack its relay did not reach (else: nodes with no relay)


@dataclass(frozen=True, slots=True)
class RackFailed:
    rack: int
    why: str               # "FrameError" | "CallFailed" | "TooSlowError"


@dataclass(frozen=True, slots=True)
class RacksSettled:
    timed_out: bool        # some rack was given up on at the deadline (its members are being pushed)


@dataclass(frozen=True, slots=True)
class Done:
    rollback: bool         # a counted node's outcome is not "accepted": the gang is rolled back


@dataclass(frozen=True, slots=True)
class Abort:
    pass


Action = SendBundle | PushDirect | RackFailed | RacksSettled | Done | Abort


class DeliveryRound:
    """See the module docstring. ``counted``: the nodes whose outcome decides the round
    (a gang's start pushes; None: every node); ``durable``: whether the round may send at
    once (else :meth:`journal` says when)."""

    def __init__(self, n: int, bounds: np.ndarray | Sequence[int], *, patience_s: float, cap_s: float,
                 counted: np.ndarray | None = None, durable: bool = True) -> None:
        self.n = n
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.n_racks = len(self.bounds) - 1
        if self.n_racks < 0 or self.bounds[0] != 0 or self.bounds[-1] > n or (np.diff(self.bounds) < 0).any():
            raise ContractError("racks are consecutive slices of the nodes, from 0")
        self._lo = self.bounds[:-1].tolist()
        self._hi = self.bounds[1:].tolist()
        self.direct = np.arange(int(self.bounds[-1]), n, dtype=np.int64)
        self.patience_s = patience_s
        self.cap_s = cap_s
        self.counted = np.ones(n, dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
        self.rack_of = np.full(n, -1, dtype=np.int64)
        if self.n_racks:
            self.rack_of[:self.bounds[-1]] = np.repeat(np.arange(self.n_racks), np.diff(self.bounds))
        # per node
        self.code = np.full(n, NO_OUTCOME, dtype=np.int32)      # index into ``table``; -1: none yet
        self.via = np.zeros(n, dtype=np.uint8)
        self.pushed = np.zeros(n, dtype=bool)                   # a direct push of it started
        self.table: list[Outcome] = [ACCEPTED]
        self._codes: dict[Outcome, int] = {ACCEPTED: 0}
        # per rack
        # per rack, read and written one rack at a time: bytes (np.frombuffer views them whole)
        self.phase = bytearray(self.n_racks)
        self.failed = bytearray(self.n_racks)
        self.fell_back = bytearray(self.n_racks)
        self.rack_left = np.diff(self.bounds).tolist()          # members without an outcome, per rack
        # counts and time
        self.left = n                      # nodes without an outcome
        self.waiting = self.n_racks        # racks whose wait is not over
        self.durable = durable
        self.sending = False               # every bundle built (and the journal said yes)
        self.deadline = math.inf
        self.cap = math.inf
        self.sent_at: float | None = None
        self.first_ack = math.inf
        self.last_ack = -math.inf
        self.timed_out = False
        self.done = False
        self.aborted = False
        self._settled_told = False
        self.late_nodes = 0
        self.relayed_nodes = 0
        self.fallback_nodes = 0            # rack members whose direct push started
        self.bad_macs = 0

    # ------------------------------------------------------------ reading

    @property
    def wake_at(self) -> float:
        """When :meth:`tick` next has something to do (inf: nothing)."""
        return min(self.deadline, self.cap) if self.waiting and self.sending else math.inf

    def rack_slice(self, r: int) -> tuple[int, int]:
        """Rack ``r``'s members: nodes ``lo`` .. ``hi - 1``."""
        return self._lo[r], self._hi[r]

    def members(self, r: int) -> np.ndarray:
        return np.arange(self._lo[r], self._hi[r], dtype=np.int64)

    def pending(self, r: int) -> np.ndarray:
        """Rack ``r``'s members with no outcome yet (the ones an ack bundle is checked for)."""
        lo = self._lo[r]
        return np.flatnonzero(self.code[lo:self._hi[r]] == NO_OUTCOME) + lo

    def outcome(self, i: int) -> Outcome | None:
        c = int(self.code[i])
        return None if c == NO_OUTCOME else self.table[c]

    def refused(self) -> np.ndarray:
        """Counted nodes whose outcome is not "accepted" (or none yet)."""
        return np.flatnonzero(self.counted & (self.code != 0))

    def rollback_nodes(self) -> np.ndarray:
        """Counted nodes that accepted: what a rollback must stop."""
        return np.flatnonzero(self.counted & (self.code == 0))

    # ------------------------------------------------------------ events

    def built(self, r: int) -> list[Action]:
        """Rack ``r``'s bundle is built (encoded and signed)."""
        if self.phase[r] != RACK_NEW:
            raise ContractError(f"rack {r} built twice")
        if self.aborted or not self.durable:
            self.phase[r] = RACK_HELD   # (for good, if the journal said no)
            return []
        self.phase[r] = RACK_SENT
        return [SendBundle(r)]

    def journal(self, ok: bool, now: float) -> list[Action]:
        """The journal's sync ended: the bundles held go out (or nothing ever does)."""
        if self.durable or self.aborted:
            return []
        if not ok:
            self.aborted = True
            return [Abort()]
        self.durable = True
        phase = np.frombuffer(self.phase, dtype=np.uint8)
        held = np.flatnonzero(phase == RACK_HELD)
        phase[held] = RACK_SENT
        out: list[Action] = [SendBundle(r) for r in held.tolist()]
        if self.sending:
            out += self._start_sending(now)
        return out

    def all_built(self, now: float) -> list[Action]:
        """Every rack's bundle was built (and, once durable, sent): direct pushes begin and
        the relays' deadline starts."""
        if RACK_NEW in self.phase:
            raise ContractError("all_built before every rack was built")
        self.sending = True
        if not self.durable or self.aborted:
            return []
        return self._start_sending(now)

    def _start_sending(self, now: float) -> list[Action]:
        self.sent_at = now
        self.deadline = now + self.patience_s
        self.cap = now + self.cap_s
        out: list[Action] = []
        if len(self.direct):
            out.append(PushDirect(self.direct.copy(), fallback=False))
        out += self._maybe_settled()
        out += self._maybe_done()
        return out

    def acked(self, r: int, now: float, idx: np.ndarray | Sequence[int], outs: Sequence[Outcome] | None = None,
              bad: np.ndarray | Sequence[int] = ()) -> list[Action]:
        """Rack ``r``'s relay answered: ``idx`` its members whose outcome checked (``outs`` in
        the same order; None: all accepted), ``bad`` those whose MAC did not verify (left
        out: they are pushed directly). Members not named are left out too."""
        self.bad_macs += len(bad)
        late = self.phase[r] == RACK_SETTLED
        n_new = self._record_rack(r, idx, outs, VIA_LATE if late else VIA_RELAY)
        self.relayed_nodes += n_new
        out: list[Action] = []
        if late:
            self.late_nodes += n_new
            return self._maybe_done()
        if self.phase[r] != RACK_SENT:
            raise ContractError(f"rack {r} answered before its bundle was sent")
        if self.sending:  # the round progresses: the relays still waiting get longer
            self.deadline = max(self.deadline, min(self.cap, now + self.patience_s))
        self.first_ack = min(self.first_ack, now)
        self.last_ack = max(self.last_ack, now)
        out += self._fall_back(r)
        out += self._settle(r)
        out += self._maybe_done()
        return out

    def closed(self, r: int, why: str = "FrameError") -> list[Action]:
        """Rack ``r``'s relay will not answer (its connection closed, it answered an error,
        or the bundle could not be sent)."""
        if self.phase[r] != RACK_SENT:
            return []
        return self._fail(r, why) + self._maybe_done()

    def tick(self, now: float) -> list[Action]:
        """Time passed: past the deadline, every rack still waiting has failed."""
        if now < self.wake_at:
            return []
        out: list[Action] = []
        self.timed_out = True
        for r in np.flatnonzero(np.frombuffer(self.phase, dtype=np.uint8) == RACK_SENT).tolist():
            out += self._fail(r, "TooSlowError")
        return out + self._maybe_done()

    def direct_starting(self, i: int) -> bool:
        """A queued direct push of node ``i`` is about to start: False if an outcome came
        first (a relay's late answer), and then it must not be pushed."""
        if self.code[i] != NO_OUTCOME or self.aborted:
            return False
        self.pushed[i] = True
        if self.rack_of[i] >= 0:
            self.fallback_nodes += 1
        return True

    def direct_answered(self, i: int, outcome: Outcome) -> list[Action]:
        if self.code[i] == NO_OUTCOME:
            self.code[i] = 0 if outcome is ACCEPTED else self._code(outcome)
            self.via[i] = VIA_DIRECT
            self.left -= 1
            r = int(self.rack_of[i])
            if r >= 0:
                self.rack_left[r] -= 1
        return self._maybe_done()

    # ------------------------------------------------------------ inside

    def _code(self, o: Outcome) -> int:
        c = self._codes.get(o)
        if c is None:
            c = self._codes[o] = len(self.table)
            self.table.append(o)
        return c

    def _record_rack(self, r: int, idx: np.ndarray | Sequence[int], outs: Sequence[Outcome] | None,
                     via: int) -> int:
        """Rack ``r``'s members ``idx`` answered: the first outcome of each node kept (later
        ones, and repeats, ignored). Array writes over the rack's slice, whatever its size."""
        if not len(idx):
            return 0
        lo, hi = self._lo[r], self._hi[r]
        size = hi - lo
        if outs is None and len(idx) == size == self.rack_left[r] and not isinstance(idx, np.ndarray):
            # every member answered at once, accepted (the common answer): two slice writes
            if min(idx) == lo and max(idx) == hi - 1 and len(set(idx)) == size:
                self.code[lo:hi] = 0
                self.via[lo:hi] = via
                self.left -= size
                self.rack_left[r] = 0
                return size
        pos = np.asarray(idx, dtype=np.int64) - lo
        if pos.min() < 0:
            raise ContractError(f"an ack of rack {r} names a node of another rack")
        seg = self.code[lo:hi]
        if outs is None:   # all accepted (the common answer)
            got = np.zeros(hi - lo, dtype=bool)
            try:
                got[pos] = True
            except IndexError:
                raise ContractError(f"an ack of rack {r} names a node of another rack") from None
            fresh = got & (seg == NO_OUTCOME)
            seg[fresh] = 0
        else:
            if pos.max() >= hi - lo:
                raise ContractError(f"an ack of rack {r} names a node of another rack")
            new = np.full(hi - lo, NO_OUTCOME, dtype=np.int32)
            for k, o in zip(pos.tolist(), outs, strict=True):   # (in order: a repeat's first is kept)
                if new[k] == NO_OUTCOME:
                    new[k] = 0 if o is ACCEPTED else self._code(o)
            fresh = (new != NO_OUTCOME) & (seg == NO_OUTCOME)
            seg[fresh] = new[fresh]
        n_new = int(np.count_nonzero(fresh))
        self.via[lo:hi][fresh] = via
        self.left -= n_new
        self.rack_left[r] -= n_new
        return n_new

    def _settle(self, r: int) -> list[Action]:
        self.phase[r] = RACK_SETTLED
        self.waiting -= 1
        return self._maybe_settled()

    def _maybe_settled(self) -> list[Action]:
        if self.waiting or not self.sending or self._settled_told or self.aborted:
            return []
        self._settled_told = True
        return [RacksSettled(timed_out=self.timed_out)]

    def _fall_back(self, r: int) -> list[Action]:
        """Rack ``r``'s members without an outcome: pushed directly (once per rack)."""
        if self.fell_back[r]:
            return []
        self.fell_back[r] = 1
        if not self.rack_left[r]:
            return []
        left = self.pending(r)
        return [PushDirect(left, fallback=True)] if len(left) else []

    def _fail(self, r: int, why: str) -> list[Action]:
        self.failed[r] = 1
        out: list[Action] = [RackFailed(r, why)]
        # (fallback first, then the settle: a driver that lets reports flow on RacksSettled
        # has the fallback pushes queued already)
        fb = self._fall_back(r)
        return out + fb + self._settle(r)

    def _maybe_done(self) -> list[Action]:
        if self.done or self.left or self.aborted or not self.sending or not self.durable:
            return []
        self.done = True
        return [Done(rollback=bool((self.counted & (self.code != 0)).any()))]


class RoundOutcomes(Mapping[str, Outcome]):
    """A finished round's counted nodes' outcomes, by node id: a view over the round's arrays.
    No dict of the whole gang is made unless a node is looked up; :meth:`refused` costs
    O(refusals)."""

    __slots__ = ("_ids", "_code", "_table", "_counted", "_rows", "_index")

    def __init__(self, node_ids: Sequence[str], round_: DeliveryRound) -> None:
        self._ids = node_ids       # (the round's nodes' ids, in its order)
        self._code = round_.code
        self._table = round_.table
        self._counted = round_.counted
        self._rows = np.flatnonzero(round_.counted & (round_.code != NO_OUTCOME))
        self._index: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[str]:
        ids = self._ids
        return (ids[i] for i in self._rows.tolist())

    def __getitem__(self, node_id: str) -> Outcome:
        if self._index is None:
            ids = self._ids
            self._index = {ids[i]: i for i in self._rows.tolist()}
        return self._table[int(self._code[self._index[node_id]])]

    def refused(self) -> dict[str, Outcome]:
        """The counted nodes whose outcome is not "accepted"."""
        bad = self._rows[self._code[self._rows] != 0]
        return {self._ids[i]: self._table[int(self._code[i])] for i in bad.tolist()}



# what a rack's members get, in the order a round builds and sends its racks
RACK_STOPS, RACK_VICTIMS, RACK_STARTS = 0, 1, 2


def victims_first(kinds: Sequence[int]) -> list[int]:
    """The order a round builds and sends its racks in, by what their members get (``kinds``):
    racks of stops only (RACK_STOPS: a preemption's victims on nodes given no pod), then the
    gang's racks with a victim among their members (RACK_VICTIMS), then the rest (RACK_STARTS),
    each group in the order it came (topology order). A victim's grace period starts when its
    stop lands, and the gang's pods wait for it, so the victims are told first: over a full
    fleet they were told as the gang's bundles were built, in topology order, the last ones
    ~0.8 s after the decision at 131,072 nodes."""
    return sorted(range(len(kinds)), key=kinds.__getitem__)


def blob_tree(starts: Sequence[bool], seeds: int, fanout: int) -> tuple[list[bool], list[int]]:
    """The gang blob's distribution over the racks whose bundle names it (``starts``), in the
    round's order: per rack, whether its bundle carries the blob's bytes (the first ``seeds``
    of them) and its parent (-1: none), a rack earlier in that order (seeded or fetching) in a
    tree of ``fanout``. A rack of stops only is in no tree: it fetches nothing, so it is no
    one's parent."""
    carry = [False] * len(starts)
    parent = [-1] * len(starts)
    tree = [r for r, s in enumerate(starts) if s]
    for k, r in enumerate(tree):
        if k < seeds:
            carry[r] = True
        else:
            parent[r] = tree[(k - seeds) // fanout]
    return carry, parent
