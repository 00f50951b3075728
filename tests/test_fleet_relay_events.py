"""The fleet emulator's relay mode keeps its members' workload events as AgentLink does
(issue 12, the jobs acked but stuck in "starting" at 131,072 nodes): an event that happens while
its member is registering again is not dropped but waits for the answer; a full report
supersedes the events queued before it (its workload list says them), never the ones after; a
report the relay could not forward, or one answered with anything but 200, is followed by a
full report. The reports go through the shipped relay (agent.relay.Relay, the rack's one
``reports`` frame), in process, on trio's virtual clock, with a fake frames connection up that
records what the relay sends."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from infra.auth import TokenSet
from scheduler_link.frames import CallFailed, encode_frame
from scheduler_link.heartbeat_wire import WireReply
from scheduler_link.messages import Frame, RackBeatReply, RackReports, ReportReply, WorkloadStatus
from testing.fleet import EmulatedNode, EmulatedRack, Fleet, FleetConfig, fleet_nodes


class FakeChannel:
    """A relay's frames connection to the placer: ``reports`` calls answered with ``status``
    per report (or failing when ``fail``), each recorded; beats answered with nothing to say.
    ``sequence``: (node, seq, "beat"|"report") in the order they went up."""

    def __init__(self) -> None:
        self.closed = trio.Event()
        self.calls: list[RackReports] = []
        self.sequence: list[tuple[str, int, str]] = []
        self.status = 200
        self.fail = False

    async def call(self, type_: str, payload: Any, *, timeout_s: float | None = None) -> Frame:
        if type_ == "beat":
            self.sequence += [(nid, seq, "beat") for nid, seq in zip(payload.node_ids, payload.seqs, strict=True)]
            return msgspec.msgpack.decode(encode_frame("beat_reply", RackBeatReply())[4:], type=Frame)
        if type_ == "report":   # (one report alone goes in its own frame)
            payload = RackReports(rack="r", reports=[payload])
        assert type_ in ("reports", "report"), type_
        self.calls.append(payload)
        self.sequence += [(r.node_id, r.seq, "report") for r in payload.reports]
        if self.fail:
            raise CallFailed("the placer said no")
        body = [WireReply(status=self.status, reply=ReportReply(ok=self.status == 200)) for _ in payload.reports]
        if type_ == "report":
            return msgspec.msgpack.decode(encode_frame("reply", body[0])[4:], type=Frame)
        return msgspec.msgpack.decode(encode_frame("replies", body)[4:], type=Frame)


def _relay() -> tuple[Fleet, EmulatedRack]:
    fleet = Fleet(FleetConfig(placer_url="http://127.0.0.1:9", nodes=2, relays=True), TokenSet())
    members = [EmulatedNode(fleet, s, f"http://127.0.0.1:9/n/{s.node_id}", None) for s in fleet_nodes("h100", 0, 2)]
    rack = EmulatedRack(fleet, "hz00/b000/r00", members, None)
    for m in members:
        m.rack = rack
        m.registered, m.boot_id, m.seq = True, f"boot-{m.slot.node_id}", 1
        rack.relay.member_joined(m.slot.node_id)
        m.workloads["j.1.0"] = WorkloadStatus(workload_id="j.1.0", job_id="j", state="accepted", gpus=[])
    return fleet, rack


def _up(n: trio.Nursery, rack: EmulatedRack, ch: Any) -> None:
    """The relay's connection up is ``ch``: its forwarder sends the members' reports there."""
    rack.relay._up = ch
    n.start_soon(rack.relay._forwarder, ch)
    n.start_soon(rack._events)


def _events(ch: FakeChannel) -> list[tuple[str, int, list[str]]]:
    return [(r.node_id, r.seq, [e.state for e in r.events]) for c in ch.calls for r in c.reports]


async def test_events_while_a_member_registers_wait_and_a_full_report_supersedes_only_older_ones(autojump_clock):
    fleet, rack = _relay()
    ch = FakeChannel()
    m, other = rack.members
    registered: list[int] = []

    async def register_direct(node: Any) -> WireReply:   # its own connection
        rack._report(node, full=True)
        registered.append(node.seq)
        await trio.sleep(1.0)
        return WireReply(status=200, reply=ReportReply(ok=True))

    rack._register_direct = register_direct  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        fleet._nursery = n
        _up(n, rack, ch)
        m._event("j.1.0", "fetching")          # registered: goes up within a few ms
        await trio.sleep(0.1)
        assert _events(ch) == [(m.slot.node_id, 2, ["fetching"])]
        m._event("j.1.0", "running")           # queued before the full report: superseded by it
        n.start_soon(rack._register, m)
        await trio.testing.wait_all_tasks_blocked()
        assert registered == [3] and rack.events_superseded == 1 and not m.registered
        m._event("j.1.0", "exited", exit_code=0)   # after the full report was built: waits for the answer
        other._event("j.1.0", "fetching")          # another member's still goes at once
        await trio.sleep(0.1)
        assert _events(ch)[1:] == [(other.slot.node_id, 2, ["fetching"])]
        await trio.sleep(1.0)                  # registered again: the waiting event goes up, after it
        assert m.registered and _events(ch)[2:] == [(m.slot.node_id, 4, ["exited"])]
        # the relay could not forward (503), then a 409: each followed by a full report
        ch.fail = True
        other._event("j.1.0", "running")
        await trio.sleep(0.1)
        assert registered == [3, 4] and rack.events_unsent == 1
        await trio.sleep(1.5)
        ch.fail, ch.status = False, 409
        other._event("j.1.0", "exited", exit_code=0)
        await trio.sleep(0.1)
        assert registered == [3, 4, 6] and rack.reregistrations == 3
        n.cancel_scope.cancel()


class HeldChannel(FakeChannel):
    """Its first ``hold`` report calls wait until ``release`` is set (the placer holding its answers)."""

    def __init__(self, hold: int) -> None:
        super().__init__()
        self.hold = hold
        self.release = trio.Event()

    async def call(self, type_: str, payload: Any, *, timeout_s: float | None = None) -> Frame:
        if self.hold > 0 and type_ != "beat":
            self.hold -= 1
            await self.release.wait()
        return await super().call(type_, payload, timeout_s=timeout_s)


async def test_a_members_heartbeats_and_reports_reach_the_placer_in_its_sequence_order(autojump_clock):
    """Heartbeats every interval (the relay's beats) and event reports (its report batches)
    of the same member, while the placer holds an answer: each goes up with a higher seq than
    the one before it (the relay sends a member's pending beat entry before its report)."""
    for _ in range(6):
        fleet, rack = _relay()
        ch = HeldChannel(hold=1)
        m, other = rack.members
        async with trio.open_nursery() as n:
            fleet._nursery = n
            _up(n, rack, ch)
            n.start_soon(rack.relay._beats, ch)
            n.start_soon(rack._heartbeats)
            other._event("j.1.0", "fetching")      # its report's answer is held
            await trio.sleep(0.05)
            m._event("j.1.0", "fetching")          # waits for the rack's next batch
            await trio.sleep(12.0)                 # two intervals of heartbeats meanwhile
            m._event("j.1.0", "running")
            ch.release.set()
            await trio.sleep(12.0)
            m._event("j.1.0", "exited", exit_code=0)
            await trio.sleep(3.0)
            n.cancel_scope.cancel()
        for node in (m, other):
            mine = [(seq, kind) for nid, seq, kind in ch.sequence if nid == node.slot.node_id]
            assert [s for s, _ in mine] == sorted({s for s, _ in mine}), mine
            assert {k for _, k in mine} == {"beat", "report"}, mine
        states = [st for r in (rr for c in ch.calls for rr in c.reports) if r.node_id == m.slot.node_id
                  for st in (e.state for e in r.events)]
        assert states == ["fetching", "running", "exited"]


def test_event_reports_carry_the_mac_the_placer_checks():
    """The emulator MACs its members' event reports with one canonical encoding (no
    normalising round trip): the placer's check (msgauth.report_ok, after the frame's decode)
    accepts every kind of event it sends, and refuses one changed after its MAC."""
    from scheduler_link.messages import NodeReport, WorkloadEvent
    from scheduler_link.msgauth import node_key, report_ok
    from testing.fleet import _with_mac

    key = node_key(b"m" * 32, "hz00-b000-r00-n00", "boot-1")
    evs = [WorkloadEvent(workload_id="j.1.0", job_id="j", state="fetching", at=1_700_000_000.25, gpus=["GPU-a"],
                         placement_id="start:j:1:hz00-b000-r00-n00"),
           WorkloadEvent(workload_id="j.1.0", job_id="j", state="exited", at=1_700_000_001.5, exit_code=0,
                         reason="preempted by big", gpus=[])]
    for events in ([evs[0]], evs):
        rep = _with_mac(key, NodeReport(node_id="hz00-b000-r00-n00", boot_id="boot-1", seq=7, full=False,
                                        events=events, sent_at=1_700_000_002.0))
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(RackReports(rack="r", reports=[rep])), type=RackReports)
        assert report_ok(key, wire.reports[0])
        forged = msgspec.structs.replace(wire.reports[0], seq=8)
        assert not report_ok(key, forged)


def test_place_part_checks_slots_and_names_the_gpus_it_was_given():
    """A whole node's part and a part of two slots: the workloads hold exactly the UUIDs of
    their slots; a slot out of range and a stale inventory are refused, nothing recorded."""
    from scheduler_link.messages import NodePart, PartPod

    fleet, rack = _relay()
    m = rack.members[0]
    m.workloads.clear()
    m.gpu_snapshot()
    uu = m._uuid_list

    def part(pid: str, slots: list[int], inventory: str | None = None) -> NodePart:
        return NodePart(placement_id=pid, node_id=m.slot.node_id, job_id="g", attempt=1,
                        pods=[PartPod(workload_id=f"{pid}.w", rank=0, gpu_indices=slots)],
                        expires_at=2e9, inventory=m._inventory if inventory is None else inventory)
    later: list[Any] = []
    assert m.place_part(part("a", list(range(len(uu)))), 1e9, later).outcome == "accepted"
    assert m.place_part(part("b", [5, 2]), 1e9, later).outcome == "accepted"
    assert m.workloads["a.w"].gpus == uu and m.workloads["b.w"].gpus == [uu[5], uu[2]]
    bad = m.place_part(part("c", [0, len(uu)]), 1e9, later)
    assert (bad.outcome, "c.w" in m.workloads) == ("refused_spec", False)
    assert m.place_part(part("d", [-1]), 1e9, later).outcome == "refused_spec"
    assert m.place_part(part("e", [0], inventory="other"), 1e9, later).outcome == "expired"
    assert m.place_part(part("a", list(range(len(uu)))), 1e9, later).outcome == "accepted"  # idempotent
    assert [w for _, fresh, _ in later for w in fresh] == ["a.w", "b.w"]


async def test_the_collector_is_off_while_bundles_come_and_back_once_they_stop(autojump_clock):
    import gc

    from testing.fleet import GC_HOLD_S

    fleet, _ = _relay()
    assert gc.isenabled()
    try:
        async with trio.open_nursery() as n:
            fleet._nursery = n
            fleet.hold_gc()
            assert not gc.isenabled()
            await trio.sleep(GC_HOLD_S * 0.75)
            fleet.hold_gc()                      # another bundle: the hold starts again
            await trio.sleep(GC_HOLD_S * 0.75)
            assert not gc.isenabled()
            await trio.sleep(GC_HOLD_S * 0.5)
            assert gc.isenabled()
    finally:
        gc.enable()


async def test_members_events_wait_while_their_process_hands_out_a_rounds_bundles(autojump_clock):
    """Bundles first (Fleet.bundles_quiet): a member's event report waits while this process's
    relays are handing out bundles, and goes up EVENTS_HOLD_S after the last one; never later
    than EVENTS_HOLD_MAX_S; at once with hold_events off."""
    import gc

    from testing.fleet import EVENTS_HOLD_MAX_S, EVENTS_HOLD_S

    fleet, rack = _relay()
    ch = FakeChannel()
    m = rack.members[0]
    try:
        async with trio.open_nursery() as n:
            fleet._nursery = n
            _up(n, rack, ch)
            fleet.bundle_seen()                    # a round's bundle is being handed out
            m._event("j.1.0", "fetching")
            await trio.sleep(EVENTS_HOLD_S / 2)
            assert _events(ch) == []               # held while bundles come ...
            await trio.sleep(EVENTS_HOLD_S)
            assert _events(ch) == [(m.slot.node_id, 2, ["fetching"])]   # ... and goes once they stopped
            t0 = trio.current_time()
            m._event("j.1.0", "running")
            while len(ch.calls) < 2:               # bundles that never stop: held at most so long
                fleet.bundle_seen()
                await trio.sleep(0.01)
            assert EVENTS_HOLD_MAX_S <= trio.current_time() - t0 <= EVENTS_HOLD_MAX_S + 0.1
            n.cancel_scope.cancel()
        fleet, rack = _relay()
        fleet = rack.fleet = Fleet(FleetConfig(placer_url="http://127.0.0.1:9", nodes=2, relays=True,
                                                hold_events=False), TokenSet())
        ch = FakeChannel()
        async with trio.open_nursery() as n:
            fleet._nursery = n
            _up(n, rack, ch)
            fleet.bundle_seen()
            rack.members[0]._event("j.1.0", "fetching")
            await trio.sleep(0.1)
            assert len(ch.calls) == 1              # not held
            n.cancel_scope.cancel()
    finally:
        gc.enable()
