"""RelayHub's delivery driven against a small honest host, not the placer service: the hub
reaches the service only through placer.relays.RelayHost (anything else it touched would be
an AttributeError here). On a virtual clock: a relay that answers for some members (one
with a MAC that does not verify, one left out) has those two pushed directly; a hung relay's
rack is pushed directly exactly relay_timeout_s after the last bundle left; a closed
connection falls back at once; a placer whose lease ran out mid-round sends no further bundle."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import pytest
import trio

from placer.attempts import ACCEPTED, Outcome
from placer.config import PlacerConfig
from placer.records import NodeRec, Push
from placer.relaypolicy import RackPins
from placer.relays import RelayConn, RelayHost, RelayHub
from scheduler_link import msgauth
from scheduler_link.frames import encode_frame
from scheduler_link.messages import (
    AckBundle,
    Frame,
    NodeOutcome,
    NodeReport,
    Placement,
    RackBeat,
    RackBeatReply,
    ReportReply,
    TopologyPath,
)

RACK = "z1/b1/r1"
MEMBERS = ("relay0", "n1", "n2", "n3")


class Host:
    """What RelayHub may use of a placer: RelayHost's members and nothing else."""

    def __init__(self, tmp: str) -> None:
        self.cfg = PlacerConfig(state_dir=tmp, relay_timeout_s=0.5)
        self.signer = msgauth.BundleSigner.generate()
        self.clock: Callable[[], float] = trio.current_time
        self.master = os.urandom(msgauth.KEY_LEN)
        self._nodes = {n: NodeRec(n, "b1", 1, f"http://127.0.0.1:9/{n}", "http://127.0.0.1:9",
                                  TopologyPath(zone="z1", block="b1", rack="r1"), None, [f"GPU-{n}-0"])
                       for n in MEMBERS}
        self.bad_macs = 0
        self.stale_epoch = 0
        self.epoch = 7
        self.lease_holds = True         # leading(): False once the lease is not known to hold
        self.rack_pins = RackPins()     # nothing pinned: the relays' hellos name their own rack
        self.nursery: trio.Nursery | None = None

    @property
    def nodes(self) -> Mapping[str, NodeRec]:
        return self._nodes

    def leading(self) -> bool:
        return self.lease_holds

    def key(self, node_id: str) -> bytes:
        return msgauth.node_key(self.master, node_id, "b1")

    def gang_blob(self, blob_id: str) -> bytes | None:
        return None

    def mac_key(self, node_id: str, boot_id: str) -> bytes:
        return msgauth.node_key(self.master, node_id, boot_id)

    def count_bad_macs(self, n: int) -> None:
        self.bad_macs += n

    def count_stale_epoch(self, n: int) -> None:
        self.stale_epoch += n

    def apply_beat(self, beat: RackBeat, at: float, *, via: str, answered: float | None) -> RackBeatReply:
        raise AssertionError("no beats here")

    def ingest_relayed(self, rep: NodeReport, via: str) -> tuple[int, ReportReply]:
        raise AssertionError("no reports here")

    def ingest_relayed_many(self, reps: list[NodeReport], via: str) -> list[tuple[int, ReportReply]]:
        raise AssertionError("no reports here")

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(fn)


class Relay:
    """A relay's frames connection: answers each bundle with ``answer(part node ids)`` after
    ``after`` seconds (None: never), or closes at once."""

    def __init__(self, answer: Callable[[list[str]], list[NodeOutcome] | AckBundle] | None, nursery: trio.Nursery,
                 after: float = 0.01, close: bool = False) -> None:
        self.name = "relay0"
        self.info: Any = None
        self.closed = trio.Event()
        self.answer, self.after, self.close, self.nursery = answer, after, close, nursery
        self.bundles: list[bytes] = []
        self.term = 0

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1, term=self.term)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        self.bundles.append(data)
        if self.close:
            self.closed.set()
            fn(None)
            return
        answer = self.answer
        if answer is None:
            return
        ids = list(MEMBERS)

        async def later() -> None:
            await trio.sleep(self.after)
            got = answer(ids)
            ab = got if isinstance(got, AckBundle) else AckBundle(rack=RACK, blob_id="", outcomes=got)
            raw = encode_frame("acks", ab, re=rid)
            fn(msgspec.msgpack.decode(raw[4:], type=Frame))
        self.nursery.start_soon(later)

    def forget(self, rid: int) -> None:
        pass


def _pushes() -> list[Push]:
    return [Push(n, f"http://127.0.0.1:9/{n}", Placement(placement_id=f"start:j:1:{n}", job_id="j"), "j", 1, "start")
            for n in MEMBERS]


async def _round(tmp: str, make: Callable[[Host, trio.Nursery], Relay], *, push_concurrency: int | None = None,
                 tasks: list[int] | None = None) -> tuple[Any, list[tuple[str, float]], Host, RelayHub]:
    """One round of MEMBERS' pushes; ``tasks``: for each direct push, the tasks then in the
    round's nursery (the pushes' own)."""
    host = Host(tmp)
    if push_concurrency is not None:
        host.cfg = msgspec.structs.replace(host.cfg, push_concurrency=push_concurrency)
    host_: RelayHost = host          # (the protocol is all the hub gets)
    hub = RelayHub(host_)
    pushed: list[tuple[str, float]] = []

    async def push_direct(p: Push) -> Outcome:
        pushed.append((p.node_id, trio.current_time()))
        if tasks is not None:
            parent = trio.lowlevel.current_task().parent_nursery
            assert parent is not None
            tasks.append(len(parent.child_tasks))
        await trio.sleep(0.05)
        return ACCEPTED

    async with trio.open_nursery() as n:
        host.nursery = n
        ch = make(host, n)
        conn = RelayConn("relay0", (RACK,), None, ch)  # type: ignore[arg-type]
        ch.info = conn
        hub._cands[RACK] = {"relay0": conn}
        acks = await hub.deliver("j", None, _pushes(), push_direct)
        n.cancel_scope.cancel()
    return acks, pushed, host, hub


async def test_members_left_out_or_with_a_bad_mac_are_pushed_directly(tmp_path, autojump_clock) -> None:
    def answer(host: Host) -> Callable[[list[str]], list[NodeOutcome]]:
        def outs(ids: list[str]) -> list[NodeOutcome]:
            good = [msgauth.with_outcome_mac(host.key(n), NodeOutcome(node_id=n, placement_id=f"start:j:1:{n}",
                                                                    outcome="accepted")) for n in ("n1", "relay0")]
            forged = NodeOutcome(node_id="n2", placement_id="start:j:1:n2", outcome="accepted", mac=b"x" * 16)
            return [*good, forged]   # (n3 left out)
        return outs

    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(answer(h), n))
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert sorted(n for n, _ in pushed) == ["n2", "n3"]
    assert host.bad_macs == 1 and hub.stats.relayed_nodes == 2 and hub.stats.fallback_nodes == 2
    assert hub.stats.bundle_failures == 0


async def test_a_hung_relays_rack_is_pushed_directly_at_its_deadline(tmp_path, autojump_clock) -> None:
    t0 = trio.current_time()
    acks, pushed, _, hub = await _round(str(tmp_path), lambda h, n: Relay(None, n))
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert sorted(n for n, _ in pushed) == sorted(MEMBERS)
    assert {round(t - t0, 6) for _, t in pushed} == {0.5}       # relay_timeout_s after the bundle left
    assert hub.stats.bundle_failures == 1 and hub.stats.last_delivery["fallback_nodes"] == 4


async def test_a_fallback_is_push_concurrency_workers_not_a_task_a_member(tmp_path, autojump_clock) -> None:
    """A rack whose relay hung: its members are pushed directly by at most push_concurrency
    workers (two here) taking them in turn, never a task a member (a round whose every relay
    ran late would make one for each of its 25,000 nodes)."""
    t0 = trio.current_time()
    tasks: list[int] = []
    acks, pushed, _, hub = await _round(str(tmp_path), lambda h, n: Relay(None, n), push_concurrency=2, tasks=tasks)
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS} and hub.stats.last_delivery["fallback_nodes"] == 4
    assert [n for n, _ in pushed] == list(MEMBERS) and max(tasks) == 2
    assert [round(t - t0, 6) for _, t in pushed] == [0.5, 0.5, 0.55, 0.55]   # two at a time, 0.05 s each


async def test_a_closed_connection_falls_back_at_once(tmp_path, autojump_clock) -> None:
    t0 = trio.current_time()
    acks, pushed, _, hub = await _round(str(tmp_path), lambda h, n: Relay(None, n, close=True))
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert {round(t - t0, 6) for _, t in pushed} == {0.0}
    assert hub.stats.bundle_failures == 1 and RACK not in hub._active


async def test_bundles_carry_the_placers_epoch_signed_and_stale_epoch_answers_are_counted(
        tmp_path, autojump_clock) -> None:
    def answer(host: Host) -> Callable[[list[str]], list[NodeOutcome]]:
        def outs(ids: list[str]) -> list[NodeOutcome]:
            return [msgauth.with_outcome_mac(host.key(n), NodeOutcome(
                node_id=n, placement_id=f"start:j:1:{n}", outcome="stale_epoch" if n == "n1" else "accepted"))
                for n in ids]
        return outs

    made: list[Relay] = []

    def relay(h: Host, n: trio.Nursery) -> Relay:
        made.append(Relay(answer(h), n))
        return made[-1]

    acks, pushed, host, _ = await _round(str(tmp_path), relay)
    assert acks["n1"].outcome == "stale_epoch" and host.stale_epoch == 1 and not pushed
    f = msgspec.msgpack.decode(made[0].bundles[0][4:], type=Frame)
    view = msgspec.msgpack.decode(f.payload, type=msgauth.BundleView)
    assert view.epoch == host.epoch == 7 and f.term == 7
    msgauth.BundleVerifier(host.signer.public).bundle(bytes(f.payload))   # signed with it
    forged = msgspec.structs.replace(view, epoch=8)
    with pytest.raises(msgauth.AuthError):
        msgauth.BundleVerifier(host.signer.public).bundle(msgspec.msgpack.encode(forged))


def _aggregate(macs: dict[int, bytes], outcomes: list[NodeOutcome] | None = None) -> AckBundle:
    """The shipped relay's answer for the members plainly accepted (agent.relaycore): bit k of
    ``accepted`` for the bundle's k-th part, the MACs in part order."""
    bits = bytearray(1)
    for k in macs:
        bits[0] |= 1 << k
    return AckBundle(rack=RACK, blob_id="", outcomes=outcomes or [], accepted=bytes(bits),
                     macs=b"".join(macs[k] for k in sorted(macs)))


def _mac(host: Host, n: str, pid: str | None = None) -> bytes:
    return msgauth.outcome_mac(host.key(n), NodeOutcome(node_id=n, placement_id=pid or f"start:j:1:{n}",
                                                        outcome="accepted"))


async def test_a_racks_aggregate_ack_is_checked_member_by_member_identity(tmp_path, autojump_clock) -> None:
    """The aggregate (a bitmap and the members' MACs) counts a member only with its own MAC over
    its own placement: n2's forged MAC and n3's MAC of another placement (a replay) do not
    verify, n1's does, the relay's own needs none; those two are pushed directly, as is n3...
    and nothing of a member whose bit is not set is taken."""
    def answer(host: Host) -> Callable[[list[str]], AckBundle]:
        return lambda ids: _aggregate({0: b"r" * 16, 1: _mac(host, "n1"), 2: b"x" * 16,
                                       3: _mac(host, "n3", "start:j:0:n3")})

    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(answer(h), n))
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert sorted(n for n, _ in pushed) == ["n2", "n3"]
    assert host.bad_macs == 2 and hub.stats.relayed_nodes == 2 and hub.stats.fallback_nodes == 2

    def left_out(host: Host) -> Callable[[list[str]], AckBundle]:
        return lambda ids: _aggregate({1: _mac(host, "n1"), 3: _mac(host, "n3")})
    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(left_out(h), n))
    assert sorted(n for n, _ in pushed) == ["n2", "relay0"] and host.bad_macs == 0


async def test_a_whole_racks_aggregate_naming_a_member_no_longer_registered(tmp_path, autojump_clock) -> None:
    """Every member's bit set and every MAC its own, but n2's record went away before the answer
    came (deregistered, say): the whole-rack check does not take the rack, n2 counts as a MAC
    that does not verify and is pushed directly, the others are taken from the aggregate."""
    def answer(host: Host) -> Callable[[list[str]], AckBundle]:
        def make(ids: list[str]) -> AckBundle:
            macs = {k: _mac(host, n) for k, n in enumerate(MEMBERS)}
            del host._nodes["n2"]
            return _aggregate(macs)
        return make

    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(answer(h), n))
    assert dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert [n for n, _ in pushed] == ["n2"] and host.bad_macs == 1 and hub.stats.relayed_nodes == 3


async def test_an_aggregate_and_outcomes_together_and_a_malformed_aggregate(tmp_path, autojump_clock) -> None:
    def mixed(host: Host) -> Callable[[list[str]], AckBundle]:
        stale = msgauth.with_outcome_mac(host.key("n1"), NodeOutcome(node_id="n1", placement_id="start:j:1:n1",
                                                                     outcome="stale_epoch"))
        return lambda ids: _aggregate({0: b"r" * 16, 2: _mac(host, "n2"), 3: _mac(host, "n3")}, [stale])

    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(mixed(h), n))
    assert acks["n1"].outcome == "stale_epoch" and host.stale_epoch == 1 and not pushed
    assert [n for n in MEMBERS if acks[n] is ACCEPTED] == ["relay0", "n2", "n3"] and hub.stats.relayed_nodes == 4

    def malformed(host: Host) -> Callable[[list[str]], AckBundle]:   # a MAC short: nobody is named
        return lambda ids: msgspec.structs.replace(_aggregate({1: _mac(host, "n1"), 2: _mac(host, "n2")}),
                                                   macs=_mac(host, "n1") + b"x")
    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(malformed(h), n))
    assert sorted(n for n, _ in pushed) == sorted(MEMBERS) and dict(acks) == {n: ACCEPTED for n in MEMBERS}
    assert hub.stats.relayed_nodes == 0 and hub.stats.bundle_failures == 0

    def past_the_parts(host: Host) -> Callable[[list[str]], AckBundle]:   # a bit for a part not sent
        return lambda ids: _aggregate({1: _mac(host, "n1"), 5: b"y" * 16})
    acks, pushed, host, hub = await _round(str(tmp_path), lambda h, n: Relay(past_the_parts(h), n))
    assert sorted(n for n, _ in pushed) == sorted(MEMBERS) and hub.stats.relayed_nodes == 0


class _Silent:
    """A relay's frames connection that takes bundles and never answers; the ``after``-th
    bundle sent on any of them ends the host's lease (``Host.leading`` is False from then)."""

    def __init__(self, name: str, host: Host, sent: list[str], after: int) -> None:
        self.name, self.host, self.sent, self.after = name, host, sent, after
        self.info: Any = None
        self.closed = trio.Event()
        self.term = 0

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1, term=self.term)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        self.sent.append(self.name)
        if len(self.sent) == self.after:
            self.host.lease_holds = False

    def forget(self, rid: int) -> None:
        pass


async def test_a_placer_whose_lease_ran_out_mid_round_sends_no_further_bundle(tmp_path, autojump_clock) -> None:
    """40 racks of one node each (two build batches): the lease ends as the 5th bundle leaves;
    the other 35 racks' bundles are not sent (withheld, their relays not counted as failed),
    and every node ends with the direct push (which the service refuses to send as well)."""
    host = Host(str(tmp_path))
    racks = [f"r{i}" for i in range(40)]
    host._nodes = {f"relay-{r}": NodeRec(f"relay-{r}", "b1", 1, f"http://127.0.0.1:9/{r}", "http://127.0.0.1:9",
                                         TopologyPath(zone="z1", block="b1", rack=r), None, [f"GPU-{r}-0"])
                   for r in racks}
    hub = RelayHub(host)
    sent: list[str] = []
    pushed: list[str] = []

    async def push_direct(p: Push) -> Outcome:
        pushed.append(p.node_id)
        return ACCEPTED

    pushes = [Push(n, f"http://127.0.0.1:9/{n}", Placement(placement_id=f"start:j:1:{n}", job_id="j"), "j", 1,
                   "start") for n in host._nodes]
    async with trio.open_nursery() as n:
        host.nursery = n
        for r in racks:
            ch = _Silent(f"relay-{r}", host, sent, after=5)
            conn = RelayConn(ch.name, (f"z1/b1/{r}",), None, ch)  # type: ignore[arg-type]
            ch.info = conn
            hub._cands[f"z1/b1/{r}"] = {ch.name: conn}
        acks = await hub.deliver("j", None, pushes, push_direct)
        n.cancel_scope.cancel()
    assert sent == [f"relay-r{i}" for i in range(5)]
    assert hub.stats.bundles == 5 and hub.stats.bundles_withheld == 35
    assert hub.stats.bundle_failures == 5          # (the 5 sent, never answered: given up at the deadline)
    assert sorted(pushed) == sorted(host._nodes) and len(acks) == 40
