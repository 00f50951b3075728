"""The relay core (agent.relaycore), pure: no sockets, no trio, no clock.

A property test over any interleaving of members' answers (accepted, refused, none, an
answer to another part), members leaving, deadlines passing and bundles whose signature
does not verify: every part of a taken bundle ends exactly once -- in its round's one ack
bundle or left out -- and nothing is added after the acks were made. Then the emulator guard:
the fleet emulator drives the shipped relay (agent.relay.Relay) and holds no relay logic of
its own."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.relaycore import Acks, Hand, KeepBlob, Refuse, RelayCore, Taken, WantBlob
from scheduler_link.heartbeat_wire import WireReply
from scheduler_link.messages import Frame, NodeOutcome, NodePart, NodeReport, RackBeatReply, ReportReply
from scheduler_link.msgauth import BundleSigner, BundleSpec, beat_mac, part_bytes

RACK = "z/b/r"
NODES = [f"n{i}" for i in range(6)]   # n0 is the relay's own node
SIGNER = BundleSigner.generate()
OTHER = BundleSigner.generate()


def _payloads(rounds: int, *, deliver_by: float = 0.0, blob: bytes | None = None,
              signer: BundleSigner = SIGNER) -> list[bytes]:
    """``rounds`` bundles of one batch (one signature), each a part for every node."""
    specs = [BundleSpec(RACK, f"blob{k}" if blob is None else "b", [
        part_bytes(NodePart(placement_id=f"p{k}-{n}", node_id=n, job_id="j", attempt=1)) for n in NODES],
        deliver_by, blob) for k in range(rounds)]
    return [msgspec.msgpack.encode(b) for b in signer.bundles_raw(specs)]


def _core(joined: list[str]) -> RelayCore:
    core = RelayCore(node_id="n0", rack=RACK, heartbeat_s=5.0, ack_window_s=0.4)
    for n in joined:
        core.member_opened(n)
    return core


def test_a_bundle_is_handed_to_its_nodes_and_acked_once():
    core = _core(["n1", "n2"])
    got = core.bundle(_payloads(1)[0], SIGNER.public, now=10.0, wall=1000.0)
    assert isinstance(got, Taken) and got.until == 10.4
    want, hands = got.actions[0], got.actions[1:]
    assert want == WantBlob("blob0")
    assert [(h.part.node_id, h.own) for h in hands if isinstance(h, Hand)] == [("n0", True), ("n1", False),
                                                                                ("n2", False)]
    for h in hands:
        assert isinstance(h, Hand) and h.part.proof is not None   # each member checks it itself
    out = [core.answered(h.round_id, h.slot, NodeOutcome(node_id=h.part.node_id, placement_id=h.part.placement_id,
                                                          outcome="accepted", mac=b"m" * 16))
           for h in hands if isinstance(h, Hand)]
    assert out[:2] == [None, None] and isinstance(out[2], Acks)
    acks = out[2].acks   # every one plainly accepted: the rack's aggregate, no outcome of its own
    assert acks.outcomes == [] and acks.accepted_slots() == [0, 1, 2] and acks.accepted == b"\x07"
    assert acks.macs == b"m" * 48                                    # passed through untouched
    assert [o.node_id for o in acks.expanded([h.part for h in hands if isinstance(h, Hand)])] == ["n0", "n1", "n2"]
    assert (core.parts_delivered, core.parts_missed, core.open_rounds) == (3, 3, 0)


def test_deliver_by_bounds_the_round_and_a_carried_blob_is_kept():
    core = _core([])
    got = core.bundle(_payloads(1, deliver_by=1000.1, blob=None)[0], SIGNER.public, now=5.0, wall=1000.0)
    assert isinstance(got, Taken) and abs(got.until - 5.1) < 1e-9
    core2 = _core([])
    from scheduler_link.messages import GangBlob, encode_gang_blob
    bid, raw = encode_gang_blob(GangBlob(job_id="j", attempt=1))
    specs = [BundleSpec(RACK, bid, [part_bytes(NodePart(placement_id="p", node_id="n9", job_id="j", attempt=1))],
                        0.0, raw)]
    got2 = core2.bundle(msgspec.msgpack.encode(SIGNER.bundles_raw(specs)[0]), SIGNER.public, now=0.0, wall=0.0)
    assert isinstance(got2, Taken)
    assert got2.actions[0] == KeepBlob(bid, raw)
    assert isinstance(got2.actions[1], Acks)   # n9 is not ours
    assert got2.actions[1].acks.outcomes == [] and got2.actions[1].acks.accepted == b""


def test_a_bundle_past_its_deliver_by_is_still_handed_with_the_whole_window():
    """The placer's fallback for the rack is under way, but a late answer still counts there
    (and spares the direct pushes not yet made): the parts go out, the round gets the whole
    ack window, and the bundle is counted late."""
    core = _core(["n1", "n2"])
    got = core.bundle(_payloads(1, deliver_by=999.0)[0], SIGNER.public, now=5.0, wall=1000.0)
    assert isinstance(got, Taken)
    assert got.until == 5.0 + core.ack_window_s
    hands = [a for a in got.actions if isinstance(a, Hand)]
    assert hands and core.late_bundles == 1 and core.open_rounds == 1
    acks = None
    for h in hands:
        acks = core.answered(h.round_id, h.slot, None) or acks
    assert acks is not None and core.open_rounds == 0


def test_bad_signatures_and_missing_keys_are_refused_and_nothing_is_acted_on():
    core = _core(["n1"])
    assert isinstance(core.bundle(_payloads(1)[0], None, now=0, wall=0), Refuse)
    bad = core.bundle(_payloads(1, signer=OTHER)[0], SIGNER.public, now=0, wall=0)
    assert isinstance(bad, Refuse) and bad.new_key
    assert (core.bad_bundles, core.bundles, core.open_rounds) == (2, 0, 0)


def test_a_batch_signature_is_verified_once():
    shared: dict = {}
    cores = [RelayCore(node_id="n0", rack=RACK, verifiers=shared) for _ in range(2)]   # one host's relays
    for k, p in enumerate(_payloads(3)):
        assert isinstance(cores[k % 2].bundle(p, SIGNER.public, now=0, wall=0), Taken)
    ((v, seen),) = shared.values()
    assert len(seen) == 1 and v.verified == 1
    other = RelayCore(node_id="n0", rack=RACK, verifiers=shared)   # another key: its own cache
    assert isinstance(other.bundle(_payloads(1, signer=OTHER)[0], OTHER.public, now=0, wall=0), Taken)
    assert len(shared) == 2 and v.verified == 1


def test_reports_empty_answered_content_batched_with_the_beat_first_and_stops_carried():
    core = _core(["n1", "n2"])
    key = b"k" * 32
    empty = NodeReport(node_id="n1", boot_id="b", seq=3, full=False, mac=beat_mac(key, "n1", "b", 3))
    assert core.report("n2", empty, upstream=True).status == 403            # another node's connection
    assert core.report("n1", empty, upstream=False).status == 503           # no connection up
    now = core.report("n1", empty, upstream=True)
    assert isinstance(now, WireReply) and now.status == 200
    from scheduler_link.messages import NodeStop, Victim
    core.beat_answered(RackBeatReply(stop=[NodeStop(node_id="n1", stop=[Victim(workload_id="w", mac=b"s")])]))
    content = NodeReport(node_id="n1", boot_id="b", seq=4, full=True)
    t = core.report("n1", content, upstream=True)
    assert isinstance(t, int)
    batch = core.next_batch(7.0)
    assert batch is not None and batch.beat is not None and batch.beat.seqs == [3]
    assert batch.beat.macs == [empty.mac] and batch.reports == [content]
    ((tt, wr),) = core.batch_answered(batch, [WireReply(status=200, reply=ReportReply(ok=True))])
    assert tt == t and [v.workload_id for v in wr.reply.stop] == ["w"]
    assert core.next_batch(8.0) is None and core.beat(8.0) is None
    t2 = core.report("n2", NodeReport(node_id="n2", boot_id="b", seq=1, full=True), upstream=True)
    assert core.upstream_lost() == [t2]


def test_plain_heartbeat_answers_are_shared_and_follow_the_interval():
    from agent.beats import BeatBook
    from scheduler_link.messages import NodeStop, Victim

    book = BeatBook(RACK, 5.0)
    hb = [NodeReport(node_id=n, boot_id="b", seq=1, full=False) for n in ("n1", "n2")]
    a, b = book.empty(hb[0]), book.empty(hb[1])
    assert a is b and a.heartbeat_interval_s == 5.0 and not a.need_full and a.stop == []
    book.apply(RackBeatReply(heartbeat_interval_s=2.0, need_full=["n1"],
                             stop=[NodeStop(node_id="n2", stop=[Victim(workload_id="w")])]))
    a, b = book.empty(hb[0]), book.empty(hb[1])
    assert a.need_full and not b.need_full and [v.workload_id for v in b.stop] == ["w"]
    assert a.heartbeat_interval_s == b.heartbeat_interval_s == 2.0
    c = book.empty(hb[1])                     # the stop was told once
    assert c.stop == [] and c.heartbeat_interval_s == 2.0 and c is book.empty(hb[1])


# ---------------------------------------------------------------- the property

@dataclass
class Op:
    kind: str      # "answer" | "close" | "tick" | "bundle" | "bad"
    a: int = 0
    b: int = 0


ops = st.lists(st.one_of(
    st.builds(Op, st.just("answer"), st.integers(0, 40), st.integers(0, 4)),   # which hand, how
    st.builds(Op, st.just("close"), st.integers(1, 5)),
    st.builds(Op, st.just("tick"), st.integers(1, 300)),                       # ms
    st.builds(Op, st.just("bundle"), st.integers(0, 1)),
    st.builds(Op, st.just("bad"))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(joined=st.sets(st.sampled_from(NODES[1:])), script=ops)
def test_every_part_ends_exactly_once_in_exactly_one_ack_bundle(joined, script):
    core = _core(sorted(joined))
    here = set(joined)                          # the members with a connection, as the test sees them
    payloads = _payloads(4, deliver_by=0.0)
    now = 0.0
    rounds: dict[int, int] = {}                 # round -> its parts
    state: dict[tuple[int, int], str] = {}      # (round, slot) -> "waiting" | "ok" | "missed"
    parts: dict[tuple[int, int], NodePart] = {}
    acks: dict[int, Acks] = {}
    hands: list[Hand] = []
    macs: dict[tuple[int, int], bytes] = {}     # the MACs members answered with
    used = 0

    def bundle_parts(rid: int) -> list[NodePart]:   # (a bundle's parts, in slot order: one per node)
        return [NodePart(placement_id=f"p{rid}-{n}", node_id=n, job_id="j", attempt=1) for n in NODES]

    def took(a: Acks | None) -> None:
        if a is None:
            return
        assert a.round_id not in acks, "a round acked twice"
        acks[a.round_id] = a
        ok = sorted(parts[k].node_id for k, s in state.items() if k[0] == a.round_id and s == "ok")
        got = a.acks.expanded(bundle_parts(a.round_id))
        assert sorted(o.node_id for o in got) == ok
        agg = a.acks.accepted_slots()
        assert len(a.acks.macs) == 16 * len(agg) and all(state[a.round_id, k] == "ok" for k in agg)
        assert [o.mac for o in got[:len(agg)]] == [macs[a.round_id, k] for k in agg]   # untouched, in order
        for k, s in state.items():
            if k[0] == a.round_id and s == "waiting":
                state[k] = "missed"

    for op in script:
        if op.kind == "bundle" and used < len(payloads):
            got = core.bundle(payloads[used], SIGNER.public, now=now, wall=0.0)
            used += 1
            assert isinstance(got, Taken)
            rounds[got.round_id] = len(NODES)
            handed = {a.part.node_id for a in got.actions if isinstance(a, Hand)}
            assert handed == here | {"n0"}      # every node reachable, and only those
            for act in got.actions:
                if isinstance(act, Hand):
                    state[act.round_id, act.slot] = "waiting"
                    parts[act.round_id, act.slot] = act.part
                    hands.append(act)
                elif isinstance(act, Acks):
                    took(act)
        elif op.kind == "bad":
            assert isinstance(core.bundle(_payloads(1, signer=OTHER)[0], SIGNER.public, now=now, wall=0.0), Refuse)
        elif op.kind == "answer" and hands:
            h = hands[op.a % len(hands)]
            k = (h.round_id, h.slot)
            p = h.part
            mac = bytes([op.a]) * 16
            out = (NodeOutcome(node_id=p.node_id, placement_id=p.placement_id, outcome="accepted", mac=mac),
                   NodeOutcome(node_id=p.node_id, placement_id=p.placement_id, outcome="refused_spec"),
                   None,
                   NodeOutcome(node_id=p.node_id, placement_id="another", outcome="accepted"),
                   NodeOutcome(node_id=p.node_id, placement_id=p.placement_id, outcome="accepted", mac=b"x"),
                   )[op.b]
            before = state[k]
            if before == "waiting":
                state[k] = "ok" if op.b in (0, 1, 4) else "missed"
                macs[k] = mac
            took(core.answered(h.round_id, h.slot, out))
            if before != "waiting":
                assert state[k] == before   # a late answer changes nothing
        elif op.kind == "close":
            nid = NODES[op.a]
            here.discard(nid)
            for k, s in state.items():
                if s == "waiting" and parts[k].node_id == nid:
                    state[k] = "missed"
            for a in core.member_closed(nid):
                took(a)
        elif op.kind == "tick":
            now += op.a / 1000
            for a in core.due(now):
                took(a)
    for rid in list(rounds):
        took(core.expire(rid))
    assert set(acks) == set(rounds) and core.open_rounds == 0
    assert core.parts_delivered + core.parts_missed == sum(rounds.values())
    assert core.parts_delivered == sum(len(a.acks.expanded(bundle_parts(r))) for r, a in acks.items())
    for r, a in acks.items():
        keys = [(o.node_id, o.placement_id) for o in a.acks.expanded(bundle_parts(r))]
        assert len(keys) == len(set(keys))           # one outcome per part
        assert all(pid.startswith(f"p{a.round_id}-") for _, pid in keys)


# ---------------------------------------------------------------- the trio driver, on virtual time

class SlowHop:
    """Members answering after ``delays[node]`` seconds (None: never answering; absent: no
    connection, answered None at once); the relay's own node at once."""

    def __init__(self, delays: dict[str, float | None]) -> None:
        self.delays = delays

    def hand(self, part: NodePart, own: bool) -> Any:
        out = NodeOutcome(node_id=part.node_id, placement_id=part.placement_id, outcome="accepted")
        if own:
            return out
        if part.node_id not in self.delays:
            return None
        return self._later(out, self.delays[part.node_id])

    async def _later(self, out: NodeOutcome, delay: float | None) -> NodeOutcome | None:
        if delay is None:
            await trio.sleep_forever()
        await trio.sleep(delay)
        return out


def _relay(delays: dict[str, float | None]) -> Any:
    from agent.blobs import BlobCache
    from agent.relay import Relay
    from infra.auth import TokenSet

    relay = Relay(node_id="n0", rack=RACK, tokens=TokenSet(), listen=None, wire_url=lambda: None,
                  blobs=BlobCache(), keys=lambda: (None, SIGNER.public), hop=SlowHop(delays),
                  clock=lambda: 1000.0)
    for n in NODES[1:]:
        relay.member_joined(n)
    return relay


async def test_the_driver_answers_at_the_last_answer_or_the_ack_window(autojump_clock):
    relay = _relay({"n1": 0.1, "n2": 0.25, "n3": 2.0, "n4": None})   # n5: no connection
    t0 = trio.current_time()
    kind, acks = await relay._bundle(_payloads(1)[0])
    assert kind == "acks" and trio.current_time() - t0 == pytest.approx(0.4)   # the ack window
    assert [o.node_id for o in acks.outcomes] == ["n0", "n1", "n2"]   # (no MACs: not the aggregate)
    assert (relay.core.parts_delivered, relay.core.parts_missed, relay.core.open_rounds) == (3, 3, 0)

    relay = _relay({"n1": 0.1, "n2": 0.05, "n3": 0.2, "n4": 0.15, "n5": 0.01})
    t0 = trio.current_time()
    kind, acks = await relay._bundle(_payloads(1)[0])
    assert trio.current_time() - t0 == pytest.approx(0.2)                      # the last answer
    assert sorted(o.node_id for o in acks.outcomes) == NODES

    relay = _relay({n: None for n in NODES[1:]})      # every member connected, none answers ...
    async with trio.open_nursery() as n:
        async def leave() -> None:
            await trio.sleep(0.1)
            for m in NODES[1:]:
                relay.member_left(m)                  # ... and all leave: the round is over then
        n.start_soon(leave)
        t0 = trio.current_time()
        kind, acks = await relay._bundle(_payloads(1)[0])
    assert [o.node_id for o in acks.outcomes] == ["n0"] and relay.core.parts_missed == 5
    assert trio.current_time() - t0 == pytest.approx(0.1)

    relay = _relay({})                                # nothing to wait for: answered at once
    kind, acks = relay._bundle(_payloads(1)[0])
    assert kind == "acks" and [o.node_id for o in acks.outcomes] == ["n0"]
    relay.stalled = True                              # a frozen host: the bundle is never answered
    assert relay._upstream_frame(None, Frame(type="bundle", payload=_payloads(1)[0])) is None


# ---------------------------------------------------------------- the emulator drives the shipped relay

FRAME_TYPES = {"bundle", "acks", "beat", "beat_reply", "reports", "report", "part", "blob_get", "blob"}


def test_the_fleet_emulator_runs_the_shipped_relay_and_has_no_relay_logic_of_its_own():
    from agent.relay import Relay
    from infra.auth import TokenSet
    from testing import fleet

    assert fleet.Fleet.relay_type is Relay
    fl = fleet.Fleet(fleet.FleetConfig(placer_url="http://127.0.0.1:9", nodes=1, relays=True), TokenSet())
    node = fleet.EmulatedNode(fl, fleet.fleet_nodes("h100", 0, 1)[0], "http://127.0.0.1:9/n/x", None)
    assert type(fleet.EmulatedRack(fl, "z/b/r", [node], None).relay) is Relay
    tree = ast.parse(inspect.getsource(fleet))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        handles = [n for n in ast.walk(cls) if isinstance(n, ast.Compare)
                   and any(isinstance(c, ast.Constant) and c.value in FRAME_TYPES
                           for c in [*n.comparators, n.left])
                   and any(isinstance(x, ast.Attribute) and x.attr == "type" for x in ast.walk(n))]
        assert not handles, f"testing/fleet.py's {cls.name} handles frame types itself"
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    for name in ("RackBeat", "RackBeatReply", "AckBundle", "RackBundle", "BundleView", "RackReports", "Frame",
                 "expand_part"):
        assert name not in imported, f"testing/fleet.py handles {name} itself: that is the relay's (agent.relaycore)"
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "BundleVerifier" not in calls, "testing/fleet.py checks bundle signatures itself: RelayCore does"
