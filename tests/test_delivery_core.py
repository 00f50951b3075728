"""The delivery round's core (placer.delivery), pure: any interleaving of bundles built, the
journal's answer, relays' acks (on time, late, repeated, with MACs that fail), closed
connections, deadlines and direct pushes' answers. Every node ends with exactly one outcome
(its first), none is pushed directly once it has one (a relay's accepted ack recorded first),
each node is pushed directly at most once, nothing leaves when the journal says no, and a
rollback reaches every node that accepted (delivered as a round of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.attempts import ACCEPTED, Outcome
from placer.delivery import (
    RACK_HELD,
    RACK_SENT,
    RACK_SETTLED,
    Abort,
    Action,
    DeliveryRound,
    Done,
    PushDirect,
    RackFailed,
    RacksSettled,
    SendBundle,
)
from placer.relays import check_acks
from scheduler_link import msgauth
from scheduler_link.messages import AckBundle, NodeOutcome

REFUSED = Outcome("refused_gpus", ("GPU-x",))
UNREACHABLE = Outcome("unreachable", detail="no answer")
OUTCOMES = [ACCEPTED, ACCEPTED, ACCEPTED, REFUSED, UNREACHABLE]
PATIENCE, CAP = 0.5, 2.0


@dataclass
class Sim:
    """A driver that records everything the core asked for and checks it as it goes."""
    core: DeliveryRound
    now: float = 0.0
    sent: set[int] = field(default_factory=set)
    queued: list[int] = field(default_factory=list)         # direct pushes asked for, not started
    inflight: list[int] = field(default_factory=list)       # direct pushes started, not answered
    asked: dict[int, int] = field(default_factory=dict)     # node -> times a direct push was asked for
    pushed: set[int] = field(default_factory=set)
    first: dict[int, Outcome] = field(default_factory=dict)  # each node's first outcome delivered
    dones: list[Done] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    settled: int = 0
    aborted: bool = False
    built: int = 0
    all_built: bool = False

    def apply(self, actions: list[Action]) -> None:
        core = self.core
        for a in actions:
            assert not self.dones, f"{a} after the round was done"
            if isinstance(a, SendBundle):
                assert not self.aborted and a.rack not in self.sent
                assert core.durable
                self.sent.add(a.rack)
            elif isinstance(a, PushDirect):
                assert not self.aborted
                for i in a.nodes.tolist():
                    assert core.outcome(i) is None, f"node {i} asked to be pushed with an outcome"
                    self.asked[i] = self.asked.get(i, 0) + 1
                    assert self.asked[i] == 1, f"node {i} pushed directly twice"
                    self.queued.append(i)
            elif isinstance(a, RackFailed):
                assert a.rack in self.sent and a.rack not in self.failed
                self.failed.append(a.rack)
            elif isinstance(a, RacksSettled):
                self.settled += 1
                assert self.settled == 1 and core.waiting == 0
            elif isinstance(a, Done):
                self.dones.append(a)
            elif isinstance(a, Abort):
                assert not self.sent and not self.aborted
                self.aborted = True

    def deliver(self, i: int, o: Outcome) -> None:
        """An outcome reaches the core for node ``i`` (the model: the first one is kept)."""
        self.first.setdefault(i, o)

    # ------------------------------------------------------------ events

    def build_next(self) -> None:
        if self.built < self.core.n_racks:
            self.built += 1
            self.apply(self.core.built(self.built - 1))
        if self.built == self.core.n_racks and not self.all_built:
            self.all_built = True
            self.apply(self.core.all_built(self.now))

    def ack(self, r: int, answers: list[tuple[int, Outcome, bool]]) -> None:
        """Rack ``r`` answers: (member, outcome, whether its MAC verifies)."""
        core = self.core
        pending = set(core.pending(r).tolist())
        good = [(i, o) for i, o, mac_ok in answers if mac_ok and i in pending]
        bad = [i for i, _, mac_ok in answers if not mac_ok and i in pending]
        for i, o in good:
            self.deliver(i, o)
        self.apply(core.acked(r, self.now, [i for i, _ in good], [o for _, o in good], bad))

    def start_push(self, k: int) -> None:
        i = self.queued.pop(k)
        had = self.core.outcome(i)
        ok = self.core.direct_starting(i)
        assert ok == (had is None)
        if ok:
            assert i not in self.pushed
            self.pushed.add(i)
            self.inflight.append(i)

    def answer_push(self, k: int, o: Outcome) -> None:
        i = self.inflight.pop(k)
        self.deliver(i, o)
        self.apply(self.core.direct_answered(i, o))

    def finish(self) -> None:
        """Let time run out and every push be answered: the round must end."""
        if self.aborted:
            return
        while not self.all_built:
            self.build_next()
        if not self.core.durable:
            self.apply(self.core.journal(True, self.now))
        for _ in range(4 * self.core.n + 8):
            if self.dones:
                break
            self.now += CAP + 1
            self.apply(self.core.tick(self.now))
            while self.queued:
                self.start_push(0)
            while self.inflight:
                self.answer_push(0, ACCEPTED)
        assert self.dones, "the round did not end"


def _round(rack_sizes: list[int], n_direct: int, counted_bits: list[bool], durable: bool) -> DeliveryRound:
    n = sum(rack_sizes) + n_direct
    bounds = np.concatenate([[0], np.cumsum(rack_sizes)]).astype(np.int64)
    counted = np.array([counted_bits[i % len(counted_bits)] for i in range(n)], dtype=bool)
    return DeliveryRound(n, bounds, patience_s=PATIENCE, cap_s=CAP, counted=counted, durable=durable)


def _check_end(sim: Sim) -> None:
    core = sim.core
    if sim.aborted:
        assert not sim.sent and not sim.asked and not sim.dones
        return
    assert len(sim.dones) == 1 and core.done and core.left == 0
    for i in range(core.n):
        o = core.outcome(i)
        assert o is not None, f"node {i} has no outcome"
        assert o == sim.first[i], f"node {i}: kept {o}, first was {sim.first[i]}"
    # none was pushed directly after its relay's ack was recorded: a relayed outcome's node was
    # never pushed, unless the push started before the (late) ack came
    for i in sim.pushed:
        assert core.via[i] in (3, 2), (i, core.via[i])   # VIA_DIRECT or a late relay answer
    refused = set(core.refused().tolist())
    back = set(core.rollback_nodes().tolist())
    counted = set(np.flatnonzero(core.counted).tolist())
    assert sim.dones[0].rollback == bool(refused)
    assert refused | back == counted and not refused & back
    assert all(ph == RACK_SETTLED for ph in core.phase)


@st.composite
def shapes(draw: st.DrawFn) -> tuple[list[int], int, list[bool], bool]:
    racks = draw(st.lists(st.integers(1, 4), max_size=4))
    n_direct = draw(st.integers(0, 3 if racks else 3))
    if not racks and not n_direct:
        n_direct = 1
    counted = draw(st.lists(st.booleans(), min_size=1, max_size=3))
    return racks, n_direct, counted, draw(st.booleans())


def _play(data: st.DataObject, sim: Sim, steps: int) -> None:
    core = sim.core
    for _ in range(steps):
        if sim.dones or sim.aborted:
            break
        choices = []
        if not sim.all_built:
            choices.append("build")
        if not core.durable and (sim.built or not core.n_racks):
            choices.append("journal")
        if sim.sent:
            choices += ["ack", "ack", "close"]
        choices.append("tick")
        if sim.queued:
            choices.append("start")
        if sim.inflight:
            choices.append("answer")
        what = data.draw(st.sampled_from(choices))
        if what == "build":
            sim.build_next()
        elif what == "journal":
            sim.apply(core.journal(data.draw(st.booleans()), sim.now))
        elif what == "ack":
            r = data.draw(st.sampled_from(sorted(sim.sent)))
            members = core.members(r).tolist()
            answers = data.draw(st.lists(st.tuples(st.sampled_from(members), st.sampled_from(OUTCOMES),
                                                   st.booleans()), max_size=6))
            sim.ack(r, answers)
        elif what == "close":
            r = data.draw(st.sampled_from(sorted(sim.sent)))
            sim.apply(core.closed(r, data.draw(st.sampled_from(["FrameError", "CallFailed"]))))
        elif what == "tick":
            sim.now += data.draw(st.sampled_from([0.0, 0.1, 0.4, 0.6, 2.5]))
            sim.apply(core.tick(sim.now))
        elif what == "start":
            sim.start_push(data.draw(st.integers(0, len(sim.queued) - 1)))
        elif what == "answer":
            sim.answer_push(data.draw(st.integers(0, len(sim.inflight) - 1)), data.draw(st.sampled_from(OUTCOMES)))


@settings(max_examples=300, deadline=None)
@given(shape=shapes(), data=st.data())
def test_any_interleaving_ends_with_one_outcome_per_node_and_a_rollback_reaching_every_node(shape, data) -> None:
    racks, n_direct, counted, durable = shape
    sim = Sim(_round(racks, n_direct, counted, durable))
    _play(data, sim, 60)
    sim.finish()
    _check_end(sim)
    if sim.aborted or not sim.dones[0].rollback:
        return
    # The rollback: a round of stops to every node that accepted, under its own interleaving
    # (relays failing, late, refusing): each of them is reached, exactly once.
    back = sim.core.rollback_nodes()
    if not len(back):
        return
    k = data.draw(st.integers(0, len(back)))
    sizes = [s for s in (k // 2, k - k // 2) if s]
    stop = Sim(_round(sizes, len(back) - k, [True], True))
    _play(data, stop, 40)
    stop.finish()
    _check_end(stop)
    assert stop.core.n == len(back)


def test_a_relays_accepted_ack_saves_its_members_from_the_direct_push() -> None:
    """A rack times out, its members are queued for direct pushes; the relay's late answer
    comes before the pushes start: they are not pushed, and the late outcome is kept."""
    sim = Sim(_round([3], 1, [True], True))
    sim.build_next()
    assert sim.sent == {0}
    assert len(sim.queued) == 1                         # the direct node
    sim.now = CAP + 1
    sim.apply(sim.core.tick(sim.now))
    assert sim.failed == [0] and len(sim.queued) == 4   # the rack's 3 members too
    members = sim.core.members(0).tolist()
    sim.ack(0, [(i, ACCEPTED, True) for i in members])
    assert sim.core.late_nodes == 3
    while sim.queued:
        sim.start_push(0)
    assert len(sim.pushed) == 1 and not set(members) & sim.pushed
    sim.answer_push(0, ACCEPTED)
    _check_end(sim)
    assert not sim.dones[0].rollback


def test_the_deadline_moves_with_progress_up_to_the_cap() -> None:
    core = _round([1, 1, 1, 1, 1], 0, [True], True)
    sim = Sim(core)
    for _ in range(5):
        sim.build_next()
    assert core.wake_at == PATIENCE
    expect = [0.9, 1.35, 1.8, CAP]                       # each answer: patience from then, at most the cap
    for r, (t, wake) in enumerate(zip((0.4, 0.85, 1.3, 1.75), expect, strict=True)):
        sim.now = t
        sim.apply(core.tick(sim.now))
        assert not sim.failed
        sim.ack(r, [] if r == 3 else [(int(core.members(r)[0]), ACCEPTED, True)])
        assert core.wake_at == pytest.approx(wake)
    assert len(sim.queued) == 1                           # rack 3 left its member out: pushed directly
    sim.now = CAP
    sim.apply(core.tick(sim.now))
    assert sim.failed == [4] and core.timed_out           # never later than the cap


def test_nothing_leaves_before_the_journal_and_nothing_at_all_when_it_says_no() -> None:
    core = _round([2, 2], 1, [True], durable=False)
    sim = Sim(core)
    sim.build_next()
    assert core.phase[0] == RACK_HELD and not sim.sent
    sim.apply(core.journal(False, 0.0))
    assert sim.aborted
    sim.build_next()
    assert not sim.sent and not sim.queued and core.wake_at == float("inf")
    core2 = _round([2, 2], 1, [True], durable=False)
    sim2 = Sim(core2)
    sim2.build_next()
    sim2.apply(core2.journal(True, 0.0))
    assert sim2.sent == {0} and core2.phase[0] == RACK_SENT and not sim2.queued
    sim2.build_next()
    assert sim2.sent == {0, 1} and len(sim2.queued) == 1   # direct pushes once all are out


def test_a_mac_failure_is_pushed_directly_and_counted() -> None:
    core = _round([3], 0, [True], True)
    sim = Sim(core)
    sim.build_next()
    a, b, c = core.members(0).tolist()
    sim.ack(0, [(a, ACCEPTED, True), (b, ACCEPTED, False)])
    assert core.bad_macs == 1 and sorted(sim.queued) == sorted([b, c])
    while sim.queued:
        sim.start_push(0)
    sim.answer_push(0, ACCEPTED)
    sim.answer_push(0, REFUSED)
    _check_end(sim)
    assert sim.dones[0].rollback


def test_round_outcomes_name_the_counted_nodes_and_their_refusals() -> None:
    """What the driver hands the state: the counted (start) nodes' outcomes by id, a view over
    the round's arrays; its refusals without a pass over the gang."""
    from placer.delivery import RoundOutcomes

    core = _round([2, 2], 1, [True, True, False], True)   # node 2 (and 5) is a stop, not counted
    sim = Sim(core)
    sim.build_next()
    sim.build_next()
    sim.ack(0, [(0, ACCEPTED, True), (1, REFUSED, True)])
    sim.ack(1, [(2, UNREACHABLE, True), (3, ACCEPTED, True)])
    while sim.queued:
        sim.start_push(0)
    sim.answer_push(0, ACCEPTED)
    _check_end(sim)
    outs = RoundOutcomes([f"n{i}" for i in range(5)], core)   # (the round's node ids, in its order)
    assert dict(outs) == {"n0": ACCEPTED, "n1": REFUSED, "n3": ACCEPTED, "n4": ACCEPTED}
    assert outs.refused() == {"n1": REFUSED} and "n2" not in outs and outs["n4"] is ACCEPTED


# ---------------------------------------------------------------- a rack's aggregate ack

_AGG_NODES = [f"m{i}" for i in range(12)]
_AGG_KEYS = {n: bytes([i + 1]) * 32 for i, n in enumerate(_AGG_NODES)}


@dataclass
class _Ids:
    """A round's nodes as check_acks reads them (placer.relays.RoundIds): ids, placement ids."""
    ids: list[str]
    placement_ids: list[str]

    def pids(self, lo: int, hi: int) -> list[str]:
        return self.placement_ids[lo:hi]


@dataclass
class _Node:
    """What check_acks reads of a node's record: its MAC key (or its boot to derive one)."""
    mac: bytes
    boot_id: str = "b"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_an_aggregate_ack_names_exactly_the_members_whose_own_mac_verifies(data) -> None:
    """Any aggregate a relay may send for a rack (each part's bit set or not, its MAC the
    member's own, forged, or one over another placement; members already answered; the
    relay's own part; a bitmap or MAC string of the wrong size): a member counts accepted only
    when its bit is set, it still waits and its MAC is its own over its own placement (the
    relay's own excepted); one whose bit is set but MAC fails is ``bad``; nobody else is named.
    A malformed aggregate names nobody."""
    size = data.draw(st.integers(1, len(_AGG_NODES)))
    _aggregate_case(size, data.draw(st.sampled_from(_AGG_NODES[:size])), data.draw(st.sets(st.integers(0, size - 1))),
                    data.draw(st.lists(st.sampled_from(["none", "own", "forged", "replay"]), min_size=size,
                                       max_size=size)),
                    data.draw(st.sampled_from(["", "short", "past"])))


def test_the_common_aggregate_every_member_its_own_mac() -> None:
    """(One comparison for the whole rack; then the same with one forged MAC, the relay's own
    or a member's.)"""
    for size in (1, 8, 9, 12):
        _aggregate_case(size, _AGG_NODES[size - 1], set(), ["own"] * size, "")
        _aggregate_case(size, _AGG_NODES[0], set(), ["own"] * (size - 1) + ["forged"], "")
        _aggregate_case(size, _AGG_NODES[size - 1], set(), ["own"] * (size - 1) + ["forged"], "")


def _aggregate_case(size: int, relay: str, answered: set[int], kinds: list[str], broken: str) -> None:
    ids = _AGG_NODES[:size]
    pushes = _Ids(ids, [f"s:{n}" for n in ids])
    core = DeliveryRound(size, [0, size], patience_s=PATIENCE, cap_s=CAP)
    for k in answered:
        core.code[k] = 0

    def mac(k: int, pid: str) -> bytes:
        return msgauth.outcome_mac(_AGG_KEYS[ids[k]], NodeOutcome(node_id=ids[k], placement_id=pid, outcome="accepted"))
    bits = bytearray((size + 7) // 8)
    macs = b""
    for k, kind in enumerate(kinds):
        if kind == "none":
            continue
        bits[k >> 3] |= 1 << (k & 7)
        macs += {"own": mac(k, f"s:{ids[k]}"), "forged": b"f" * 16, "replay": mac(k, "s:earlier")}[kind]
    if broken == "short" and macs:
        macs = macs[:-1]          # MACs that do not match the bits in number
    elif broken == "past":
        bits.append(1)            # a bit for a part the bundle did not have
    malformed = broken == "past" or (broken == "short" and any(k != "none" for k in kinds))
    ab = AckBundle(rack="r", blob_id="", accepted=bytes(bits), macs=macs)
    nodes = {n: _Node(_AGG_KEYS[n]) for n in ids}
    idx, outs, bad = check_acks(ab, core, 0, pushes, relay, nodes,  # type: ignore[arg-type]  # (what it reads of a NodeRec)
                                lambda n, b: _AGG_KEYS[n])
    assert outs is None
    if malformed:
        assert idx == [] and bad == []
        return
    waiting = [k for k in range(size) if k not in answered and kinds[k] != "none"]
    assert sorted(idx) == [k for k in waiting if kinds[k] == "own" or ids[k] == relay]
    assert sorted(bad) == [k for k in waiting if kinds[k] != "own" and ids[k] != relay]
