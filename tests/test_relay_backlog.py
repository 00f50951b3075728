"""Relays' frames the placer holds back (issue 12): while a delivery is out, what relays report
waits in the placer's own queue (acks first) and is applied after, in arrival order. Beats held
there must never make a node lost: at 131,072 gb200 nodes under load that queue took tens of
seconds to empty, every node was marked lost (131,071 of them), the cascade re-lost them
again and again, and a job sat in "placing"/"starting" for minutes. Here, in process on a
virtual clock (the placer service's own relay hub, a fake frames connection that records the
answers): beats arrive every second while a delivery is held for 5 s; no node is lost while its
beats wait, each beat counts from when it arrived, and every frame is answered in order."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from infra.auth import TokenSet
from placer.attempts import ACCEPTED, Outcome
from placer.config import PlacerConfig
from placer.records import Push
from placer.relays import BUILD_BATCH, FALLBACK_HOLD_S, RelayConn
from placer.service import PlacerService
from scheduler_link.frames import encode_frame
from scheduler_link.messages import (
    AckBundle,
    Frame,
    GpuInfo,
    GpuSnapshot,
    NodeOutcome,
    NodeReport,
    Placement,
    RackBeat,
    RackBeatReply,
    TopologyPath,
)
from scheduler_link.msgauth import beat_mac, with_outcome_mac
from testing.waiting import poll

RACK = ("z1", "b1", "r1")


class FakeChannel:
    """What RelayHub needs of a frames connection: its owner's info, ``closed``, ``send``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.info: Any = None
        self.closed = trio.Event()
        self.sent: list[tuple[str, Any, int]] = []

    def send(self, type_: str, payload: Any, *, re: int = 0, id: int = 0) -> None:
        self.sent.append((type_, payload, re))

    def forget(self, rid: int) -> None:
        pass


def _frame(type_: str, payload: Any, rid: int) -> Frame:
    return msgspec.msgpack.decode(encode_frame(type_, payload, id=rid)[4:], type=Frame)


def _full(node: str, boot: str) -> NodeReport:
    z, b, r = RACK
    snap = GpuSnapshot(hostname=node, backend="simulated:test", simulated=True,
                       gpus=[GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="sim", memory_total_mib=80000,
                                     pci_bus_id=f"0000:{i:02x}:00.0", simulated=True) for i in range(2)])
    return NodeReport(node_id=node, boot_id=boot, seq=1, full=True, control_url=f"http://127.0.0.1:9/{node}",
                      data_url="http://127.0.0.1:9", topology=TopologyPath(zone=z, block=b, rack=r),
                      snapshot=snap, sent_at=time.time())


async def test_beats_held_back_during_a_delivery_never_make_a_node_lost(tmp_path) -> None:
    now = [100.0]
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, lost_after_missed=3),
                        TokenSet(), clock=lambda: now[0])
    keys = {}
    for node in ("relay0", "n1", "n2"):
        st, reply = svc._ingest(node, _full(node, f"boot-{node}"))  # each over its own connection
        assert st == 200 and reply.mac_key
        keys[node] = reply.mac_key
    ch = FakeChannel("relay0")
    ch.info = RelayConn("relay0", ("/".join(RACK),), None, ch)  # type: ignore[arg-type]
    hub = svc.relays
    hub._delivering = 1   # a delivery is out: relays' reports wait (acks first)
    seqs = {n: 1 for n in keys}
    for k in range(5):    # a beat each second, for 5 s: longer than lost_after (3 s)
        now[0] = 100.0 + 0.9 + k
        ids = list(keys)
        for n in ids:
            seqs[n] += 1
        b = RackBeat(rack="/".join(RACK), node_ids=ids, boot_ids=[f"boot-{n}" for n in ids],
                     seqs=[seqs[n] for n in ids], sent_at=now[0],
                     macs=[beat_mac(keys[n], n, f"boot-{n}", seqs[n]) for n in ids])
        assert hub._handle(ch, _frame("beat", b, k + 1)) is None  # type: ignore[arg-type]  # held back
    now[0] = 105.0
    assert hub.heard_until() == 100.9
    svc._tick(now[0])     # 5 s since registration, 4.1 s since the first held beat arrived
    assert {n: svc.state.nodes[n].state for n in keys} == {n: "up" for n in keys}
    assert ch.sent == [] and svc.state.counters["nodes_lost"] == 0

    hub._delivering = 0   # the delivery is in: the backlog is applied, in order, and answered
    await hub._drain_deferred()
    assert hub.heard_until() is None
    assert [(t, re) for t, _, re in ch.sent] == [("beat_reply", k + 1) for k in range(5)]
    assert all(isinstance(p, RackBeatReply) and not p.need_full for _, p, _ in ch.sent)
    for n in keys:
        assert svc.state.nodes[n].last_seen == 104.9 and svc.state.nodes[n].last_seq == seqs[n]
    svc._tick(now[0])
    assert {n: svc.state.nodes[n].state for n in keys} == {n: "up" for n in keys}
    # and silence is still silence: nothing heard after 104.9, 3 s later they are lost
    svc._tick(108.0)
    assert {n: svc.state.nodes[n].state for n in keys} == {n: "lost" for n in keys}


async def test_a_beat_answered_late_counts_its_deadline_from_the_answer(tmp_path) -> None:
    """A relay sends its next beat an interval after the answer to its last (agent/relay.py
    awaits it): a beat the placer held back and answered 5 s after it arrived must not make
    its nodes lost before the next one can come (at 131,072 nodes under load, beats held
    ~10 s made 479,786 'node lost' lines right after the delivery). Its nodes were seen when
    it arrived; their deadline runs from the answer."""
    now = [100.0]
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, lost_after_missed=3),
                        TokenSet(), clock=lambda: now[0])
    keys = {}
    for node in ("relay0", "n1"):
        st, reply = svc._ingest(node, _full(node, f"boot-{node}"))
        assert st == 200 and reply.mac_key
        keys[node] = reply.mac_key
    ch = FakeChannel("relay0")
    ch.info = RelayConn("relay0", ("/".join(RACK),), None, ch)  # type: ignore[arg-type]
    hub = svc.relays
    hub._delivering = 1
    now[0] = 100.9
    ids = list(keys)
    b = RackBeat(rack="/".join(RACK), node_ids=ids, boot_ids=[f"boot-{n}" for n in ids], seqs=[2, 2],
                 sent_at=now[0], macs=[beat_mac(keys[n], n, f"boot-{n}", 2) for n in ids])
    assert hub._handle(ch, _frame("beat", b, 1)) is None  # type: ignore[arg-type]  # held back
    now[0] = 106.0        # the delivery is in: the beat is applied and answered 5.1 s after it came
    hub._delivering = 0
    await hub._drain_deferred()
    assert [(t, re) for t, _, re in ch.sent] == [("beat_reply", 1)]
    assert all(svc.state.nodes[n].last_seen == 100.9 for n in ids)   # seen when it arrived
    svc._tick(108.5)      # 7.6 s after it arrived, 2.5 s after its answer: the next may still come
    assert {n: svc.state.nodes[n].state for n in ids} == {n: "up" for n in ids}
    svc._tick(109.5)      # lost_after (3 s) after the answer, nothing since: lost
    assert {n: svc.state.nodes[n].state for n in ids} == {n: "lost" for n in ids}


class HungChannel(FakeChannel):
    """A relay's frames connection that takes its bundle and never answers."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.bundles = 0

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        self.bundles += 1   # (never answered)


def _register_rack(svc: PlacerService) -> dict[str, bytes]:
    """relay0, n1 and n2 registered with full reports: each node's MAC key."""
    keys = {}
    for node in ("relay0", "n1", "n2"):
        st, reply = svc._ingest(node, _full(node, f"boot-{node}"))
        assert st == 200 and reply.mac_key
        keys[node] = reply.mac_key
    return keys


async def _fallback_round(tmp_path, push_s: float) -> tuple[list[tuple[str, int, int]], FakeChannel, PlacerService]:
    """A start round over a rack whose relay hangs, while the rack's beat arrives and is held:
    what each direct push saw when it ended (node, frames still held, answers sent)."""
    now = [100.0]
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, lost_after_missed=30,
                                     relay_timeout_s=0.5), TokenSet(), clock=lambda: now[0])
    keys = _register_rack(svc)
    hub = svc.relays
    relay_ch = HungChannel("relay0")
    conn = RelayConn("relay0", ("/".join(RACK),), None, relay_ch)  # type: ignore[arg-type]
    relay_ch.info = conn
    hub._cands["/".join(RACK)] = {"relay0": conn}
    beats_ch = FakeChannel("relay0-beats")
    beats_ch.info = conn
    seen: list[tuple[str, int, int]] = []

    async def push_direct(p: Push) -> Outcome:
        await trio.sleep(push_s)            # a slow agent
        seen.append((p.node_id, len(hub._deferred), len(beats_ch.sent)))
        return ACCEPTED

    pushes = [Push(n, f"http://127.0.0.1:9/{n}", Placement(placement_id=f"start:j:1:{n}", job_id="j"), "j", 1, "start")
              for n in ("n1", "n2")]
    async with trio.open_nursery() as nursery:
        svc._nursery = nursery
        async def beat_meanwhile() -> None:
            await trio.sleep(0.1)           # while the bundle is out: held (acks first)
            ids = list(keys)
            b = RackBeat(rack="/".join(RACK), node_ids=ids, boot_ids=[f"boot-{n}" for n in ids],
                         seqs=[2] * len(ids), sent_at=now[0], macs=[beat_mac(keys[n], n, f"boot-{n}", 2) for n in ids])
            assert hub._handle(beats_ch, _frame("beat", b, 7)) is None  # type: ignore[arg-type]
        nursery.start_soon(beat_meanwhile)
        acks = await hub.deliver("j", None, pushes, push_direct)
        assert acks == {"n1": ACCEPTED, "n2": ACCEPTED} and relay_ch.bundles == 1
        with trio.fail_after(5):
            await poll(lambda: not (hub._deferred or not beats_ch.sent), 0.01)
    return seen, beats_ch, svc


async def test_reports_stay_held_while_a_hung_relays_rack_is_pushed_directly(tmp_path, autojump_clock) -> None:
    """Past the relay's deadline its members are pushed directly. The reports held back for
    the round stay held until those pushes are done (bounded by FALLBACK_HOLD_S): applied
    at once, their CPU ran between the pushes' steps, and at 32,768 nodes 192 fallback
    pushes took 0.6 s instead of 0.06 (bench.delivery, hung phase)."""
    seen, beats_ch, svc = await _fallback_round(tmp_path, push_s=0.2)
    assert sorted(n for n, _, _ in seen) == ["n1", "n2"]
    assert all(held == 1 and answered == 0 for _, held, answered in seen), seen   # still held
    assert [(t, re) for t, _, re in beats_ch.sent] == [("beat_reply", 7)]        # then applied, answered
    assert svc.state.nodes["n1"].last_seq == 2


async def test_a_long_fallback_does_not_hold_reports_past_the_bound(tmp_path, autojump_clock) -> None:
    """A direct push slower than FALLBACK_HOLD_S: the held reports are applied meanwhile (a long
    fallback must not starve heartbeats)."""
    seen, beats_ch, _ = await _fallback_round(tmp_path, push_s=FALLBACK_HOLD_S + 2.0)
    assert sorted(n for n, _, _ in seen) == ["n1", "n2"]
    assert all(held == 0 and answered == 1 for _, held, answered in seen), seen


class CountingChannel(FakeChannel):
    """A relay (its own rack's only member) that answers at once, recording how many bundles of
    the round had been built (prepared) when its own left."""

    built = 0

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        super().__init__(name)
        self.log = log

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        CountingChannel.built += 1
        return 1, encode_frame(type_, payload, id=1)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        self.log.append((self.name, CountingChannel.built))
        ack = AckBundle(rack=self.info.racks[0], blob_id="", outcomes=[
            NodeOutcome(node_id=self.name, placement_id=f"start:j:1:{self.name}", outcome="accepted")])
        fn(_frame("acks", ack, 1))   # (answered at once: the round must not mind)


async def _streamed_round(tmp_path, ready_says: bool) -> tuple[Any, list[tuple[str, int]], list[int]]:
    n_racks = 6 * BUILD_BATCH + 5
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, relay_timeout_s=0.5), TokenSet())
    hub = svc.relays
    log: list[tuple[str, int]] = []
    CountingChannel.built = 0
    pushes = []
    for i in range(n_racks):
        node = f"n{i:03d}"
        rep = _full(node, f"boot-{node}")
        rep = msgspec.structs.replace(rep, topology=TopologyPath(zone="z1", block="b1", rack=f"r{i:03d}"))
        assert svc._ingest(node, rep)[0] == 200
        ch = CountingChannel(node, log)
        conn = RelayConn(node, (f"z1/b1/r{i:03d}",), None, ch)  # type: ignore[arg-type]
        ch.info = conn
        hub._cands[f"z1/b1/r{i:03d}"] = {node: conn}
        pushes.append(Push(node, f"http://127.0.0.1:9/{node}", Placement(placement_id=f"start:j:1:{node}", job_id="j"),
                           "j", 1, "start"))
    ready_at: list[int] = []

    async def ready() -> bool:
        ready_at.append(len(log))          # bundles already sent when the journal is asked
        await trio.lowlevel.checkpoint()
        return ready_says

    async def push_direct(p: Push) -> Outcome:
        raise AssertionError(f"{p.node_id} pushed directly: its relay answered")

    async with trio.open_nursery() as nursery:
        svc._nursery = nursery
        acks = await hub.deliver("j", None, pushes, push_direct, ready=ready)
        nursery.cancel_scope.cancel()
    return acks, log, ready_at


async def test_bundles_leave_as_they_are_built_once_the_journal_says_yes(tmp_path) -> None:
    """A round's bundles go out in batches while the rest is built (relays are other hosts:
    they work meanwhile), never before the journal's sync says yes."""
    acks, log, ready_at = await _streamed_round(tmp_path, True)
    n = 6 * BUILD_BATCH + 5
    assert acks is not None and len(acks) == n and set(acks.values()) == {ACCEPTED}
    assert ready_at == [0]                                  # asked once, before anything left
    assert len(log) == n
    # The first batch left before the rest was built: a batch is sent by the builder itself as
    # soon as it is built (no task per rack in between).
    assert log[0][1] == BUILD_BATCH < n


async def test_nothing_leaves_when_the_journal_says_no(tmp_path) -> None:
    acks, log, ready_at = await _streamed_round(tmp_path, False)
    assert acks is None and log == [] and ready_at == [0]


class LateChannel(FakeChannel):
    """A relay that answers its bundle ``after`` seconds late (with its members' MACs)."""

    def __init__(self, name: str, keys: dict[str, bytes], after: float, nursery: trio.Nursery) -> None:
        super().__init__(name)
        self.keys, self.after, self.nursery = keys, after, nursery
        self.forgotten: list[int] = []

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        async def later() -> None:
            await trio.sleep(self.after)
            outs = [with_outcome_mac(self.keys[n], NodeOutcome(node_id=n, placement_id=f"start:j:1:{n}",
                                                                outcome="accepted")) for n in ("n1", "n2")]
            fn(_frame("acks", AckBundle(rack="/".join(RACK), blob_id="", outcomes=outs), 1))
        self.nursery.start_soon(later)

    def forget(self, rid: int) -> None:
        self.forgotten.append(rid)


async def test_a_late_relay_answer_saves_the_direct_pushes_still_under_way(tmp_path, autojump_clock) -> None:
    """Past relay_timeout_s the rack's members are pushed directly; the relay's answer that
    comes while those pushes are under way still counts (late), each member's first outcome is
    kept, the pushes it made needless are cancelled, and nothing waits for the answer after."""
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), heartbeat_s=1.0, lost_after_missed=30,
                                     relay_timeout_s=0.5), TokenSet())
    keys = _register_rack(svc)
    hub = svc.relays
    started: list[str] = []
    finished: list[str] = []

    async def push_direct(p: Push) -> Outcome:
        started.append(p.node_id)
        await trio.sleep(5.0)               # a slow agent: the relay's late answer comes first
        finished.append(p.node_id)
        return Outcome("unreachable", detail="too slow")

    pushes = [Push(n, f"http://127.0.0.1:9/{n}", Placement(placement_id=f"start:j:1:{n}", job_id="j"), "j", 1, "start")
              for n in ("n1", "n2")]
    async with trio.open_nursery() as nursery:
        svc._nursery = nursery
        ch = LateChannel("relay0", keys, after=1.0, nursery=nursery)
        conn = RelayConn("relay0", ("/".join(RACK),), None, ch)  # type: ignore[arg-type]
        ch.info = conn
        hub._cands["/".join(RACK)] = {"relay0": conn}
        t0 = trio.current_time()
        acks = await hub.deliver("j", None, pushes, push_direct)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert acks == {"n1": ACCEPTED, "n2": ACCEPTED}
    assert sorted(started) == ["n1", "n2"] and finished == []    # pushed, then cancelled by the answer
    assert hub.stats.bundle_failures == 1 and hub.stats.late_nodes == 2 and hub.stats.fallback_nodes == 2
    assert ch.forgotten == [1] and abs(took - 1.0) < 0.01
