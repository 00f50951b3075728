"""One delivery round as a state machine with no I/O: events in, actions out (h11's shape).

Theory of operation (DESIGN.md, "Fleet scale"; placer.relays is the trio driver):
- A round delivers one decision's pushes (a gang's start parts and its victims' stops, or a
  round of stops) to ``n`` nodes, numbered 0..n-1 in the order the caller gave them. Nodes
  of a rack with a relay are grouped (``order[bounds[r]:bounds[r+1]]`` is rack ``r``'s
  members); every other node (``direct``) is pushed directly once the round may send.
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

State is plain attributes and numpy arrays over nodes and racks; outcomes are codes into a
small table (0: accepted), so recording a rack's accepted members is one array write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .attempts import ACCEPTED, Outcome

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

    def __init__(self, n: int, order: np.ndarray, bounds: np.ndarray, direct: np.ndarray, *,
                 patience_s: float, cap_s: float, counted: np.ndarray | None = None, durable: bool = True) -> None:
        self.n = n
        self.order = np.asarray(order, dtype=np.int64)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.direct = np.asarray(direct, dtype=np.int64)
        self.n_racks = len(self.bounds) - 1
        if len(self.order) + len(self.direct) != n or self.n_racks < 0:
            raise ValueError("every node is either a rack member or direct, once")
        self.patience_s = patience_s
        self.cap_s = cap_s
        self.counted = np.ones(n, dtype=bool) if counted is None else np.asarray(counted, dtype=bool)
        self.rack_of = np.full(n, -1, dtype=np.int64)
        if self.n_racks:
            self.rack_of[self.order] = np.repeat(np.arange(self.n_racks), np.diff(self.bounds))
        # per node
        self.code = np.full(n, NO_OUTCOME, dtype=np.int32)      # index into ``table``; -1: none yet
        self.via = np.zeros(n, dtype=np.uint8)
        self.pushed = np.zeros(n, dtype=bool)                   # a direct push of it started
        self.table: list[Outcome] = [ACCEPTED]
        self._codes: dict[Outcome, int] = {ACCEPTED: 0}
        # per rack
        self.phase = np.zeros(self.n_racks, dtype=np.uint8)
        self.failed = np.zeros(self.n_racks, dtype=bool)
        self.fell_back = np.zeros(self.n_racks, dtype=bool)
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

    def members(self, r: int) -> np.ndarray:
        return self.order[self.bounds[r]:self.bounds[r + 1]]

    def pending(self, r: int) -> np.ndarray:
        """Rack ``r``'s members with no outcome yet (the ones an ack bundle is checked for)."""
        m = self.members(r)
        return m[self.code[m] == NO_OUTCOME]

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
            raise ValueError(f"rack {r} built twice")
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
        held = np.flatnonzero(self.phase == RACK_HELD)
        self.phase[held] = RACK_SENT
        out: list[Action] = [SendBundle(int(r)) for r in held]
        if self.sending:
            out += self._start_sending(now)
        return out

    def all_built(self, now: float) -> list[Action]:
        """Every rack's bundle was built (and, once durable, sent): direct pushes begin and
        the relays' deadline starts."""
        if (self.phase == RACK_NEW).any():
            raise ValueError("all_built before every rack was built")
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
        idx = np.asarray(idx, dtype=np.int64)
        nbad = len(bad)
        self.bad_macs += nbad
        if len(idx) and (self.rack_of[idx] != r).any():
            raise ValueError(f"an ack of rack {r} names a node of another rack")
        late = self.phase[r] == RACK_SETTLED
        n_new = self._record(idx, outs, VIA_LATE if late else VIA_RELAY)
        self.relayed_nodes += n_new
        out: list[Action] = []
        if late:
            self.late_nodes += n_new
            return self._maybe_done()
        if self.phase[r] != RACK_SENT:
            raise ValueError(f"rack {r} answered before its bundle was sent")
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
        for r in np.flatnonzero(self.phase == RACK_SENT).tolist():
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
        self._record(np.array([i], dtype=np.int64), [outcome], VIA_DIRECT)
        return self._maybe_done()

    # ------------------------------------------------------------ inside

    def _code(self, o: Outcome) -> int:
        c = self._codes.get(o)
        if c is None:
            c = self._codes[o] = len(self.table)
            self.table.append(o)
        return c

    def _record(self, idx: np.ndarray, outs: Sequence[Outcome] | None, via: int) -> int:
        """The first outcome of each node in ``idx`` kept (later ones, and repeats, ignored)."""
        if not len(idx):
            return 0
        _, first = np.unique(idx, return_index=True)
        first.sort()
        fresh = first[self.code[idx[first]] == NO_OUTCOME]
        if not len(fresh):
            return 0
        nodes = idx[fresh]
        if outs is None:
            self.code[nodes] = 0
        else:
            self.code[nodes] = [0 if outs[k] is ACCEPTED else self._code(outs[k]) for k in fresh.tolist()]
        self.via[nodes] = via
        self.left -= len(nodes)
        return len(nodes)

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
        self.fell_back[r] = True
        left = self.pending(r)
        return [PushDirect(left, fallback=True)] if len(left) else []

    def _fail(self, r: int, why: str) -> list[Action]:
        self.failed[r] = True
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
