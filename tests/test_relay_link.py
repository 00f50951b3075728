"""The relay (agent.relay) and a member's link through it (scheduler_link.agent_link), on
loopback against a small fake placer: a HeartbeatServer whose FramesHost answers what the
real placer's framed channel answers (reports, beats, blob_get) and sends bundles, signed
with its own key; it checks every MAC a relay forwards as the real placer does."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.blobs import BlobCache
from agent.relay import Relay
from infra.auth import TokenSet
from scheduler_link.agent_link import AgentLink
from scheduler_link.frames import CallFailed, FrameChannel, decode_payload
from scheduler_link.heartbeat_wire import HeartbeatServer, Hello, WireReply
from scheduler_link.messages import (
    AckBundle,
    BlobReply,
    BlobRequest,
    Frame,
    GangBlob,
    GpuSnapshot,
    NodeOutcome,
    NodePart,
    NodeReport,
    RackBeat,
    RackBeatReply,
    RackBundle,
    RackReports,
    ReportReply,
    Victim,
    WorkloadEvent,
    encode_gang_blob,
)
from scheduler_link.msgauth import BundleSigner, BundleVerifier, beat_mac, node_key, report_ok, with_stop_macs
from testing.waiting import poll

RACK = "z1/b1/r1"


class FakePlacer:
    """Records what reaches it, per node, in arrival order: ("report"|"beat"|"relayed", seq, full)."""

    def __init__(self, tokens: TokenSet) -> None:
        self.server = HeartbeatServer(tokens, self.ingest, frames=self)
        self.url = ""
        self.relay_url: str | None = None
        self.seen: dict[str, list[tuple[str, int, bool]]] = {}
        self.relays: dict[str, FrameChannel] = {}
        self.blobs: dict[str, bytes] = {}
        self.blob_gets = 0
        self.report_frames = 0
        self.batches = True          # takes 'reports' frames (RackReports)
        self.changed = trio.Event()
        self.signer = BundleSigner.generate()
        self.master = b"k" * 32
        self.bad_macs = 0
        self.stops: list[Victim] = []     # fencing stops for the next relayed answer (as given)

    def _log(self, node: str, kind: str, seq: int, full: bool) -> None:
        self.seen.setdefault(node, []).append((kind, seq, full))
        self.changed.set()
        self.changed = trio.Event()

    def ingest(self, node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
        self._log(node_id, "report", rep.seq, rep.full)
        r = self._reply(rep)
        if rep.full:  # the node's own connection: its keys
            r = ReportReply(wire_url=r.wire_url, relay_url=r.relay_url, heartbeat_interval_s=0.2,
                            mac_key=node_key(self.master, rep.node_id, rep.boot_id), placer_key=self.signer.public)
        return 200, r

    def _reply(self, rep: NodeReport) -> ReportReply:
        if rep.full:
            return ReportReply(wire_url=self.url, relay_url=self.relay_url, heartbeat_interval_s=0.2)
        return ReportReply(heartbeat_interval_s=0.2)

    def _relayed(self, ch: FrameChannel, rep: NodeReport) -> WireReply:
        if rep.node_id != ch.name and not report_ok(node_key(self.master, rep.node_id, rep.boot_id), rep):
            self.bad_macs += 1
            return WireReply(status=401, error="bad MAC")
        self._log(rep.node_id, "relayed", rep.seq, rep.full)
        r = self._reply(rep)
        if self.stops:
            r = ReportReply(heartbeat_interval_s=0.2, stop=self.stops)
            self.stops = []
        return WireReply(status=200, reply=r)

    def bundle(self, **kw: Any) -> Any:
        return self.signer.bundle(**{"rack": RACK, "parts": [], "deliver_by": time.time() + 2, **kw})

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        if hello.racks:
            self.relays[hello.node_id] = channel
            self.changed.set()
            self.changed = trio.Event()
        return self._frame

    def closed(self, channel: FrameChannel) -> None:
        if self.relays.get(channel.name) is channel:
            del self.relays[channel.name]

    def _frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "report":
            self.report_frames += 1
            return "reply", self._relayed(ch, decode_payload(f, NodeReport))
        if f.type == "reports" and self.batches:
            batch = decode_payload(f, RackReports)
            self.report_frames += 1
            return "replies", [self._relayed(ch, rep) for rep in batch.reports]
        if f.type == "beat":
            b = decode_payload(f, RackBeat)
            for nid, boot, seq, mac in zip(b.node_ids, b.boot_ids, b.seqs, b.macs, strict=True):
                if mac != beat_mac(node_key(self.master, nid, boot), nid, boot, seq):
                    self.bad_macs += 1
                    continue
                self._log(nid, "beat", seq, False)
            return "beat_reply", RackBeatReply()
        if f.type == "blob_get":
            req = decode_payload(f, BlobRequest)
            self.blob_gets += 1
            return "blob", BlobReply(blob_id=req.blob_id, data=self.blobs.get(req.blob_id),
                                     error=None if req.blob_id in self.blobs else "unknown blob")
        raise ValueError(f.type)

    async def until(self, pred: Any, what: str) -> None:
        with trio.fail_after(10):
            while not pred():
                await self.changed.wait()


class Hooks:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    def full_report(self) -> NodeReport:
        return NodeReport(node_id="", boot_id="", seq=0, full=True, snapshot=GpuSnapshot())

    async def stop_workloads(self, victims: list[Victim]) -> None:
        self.stopped += [v.workload_id for v in victims]

    def gpu_snapshot(self) -> GpuSnapshot:
        return GpuSnapshot()


def _accepting(node: str, got: list[NodePart], pub: bytes | None = None) -> Any:
    async def handle(part: NodePart) -> NodeOutcome:
        if pub is not None:  # a member checks what its relay handed it (agent.parts does the same)
            part = BundleVerifier(pub).part(part)
        got.append(part)
        return NodeOutcome(node_id=node, placement_id=part.placement_id, outcome="accepted")
    return handle


def _relay(tokens: TokenSet, node: str, placer: FakePlacer, got: list[NodePart], **kw: Any) -> Relay:
    pub = placer.signer.public
    return Relay(node_id=node, rack=RACK, tokens=tokens, listen="127.0.0.1:0", wire_url=lambda: placer.url,
                 own_part=_accepting(node, got, pub), blobs=BlobCache(), heartbeat_s=0.2, request_timeout_s=2.0,
                 keys=lambda: (None, pub), **kw)


def _blob() -> tuple[str, bytes]:
    return encode_gang_blob(GangBlob(job_id="j", attempt=1, argv=["true"]))


def _parts(pid: str, nodes: list[str], blob_id: str) -> list[NodePart]:
    return [NodePart(placement_id=f"{pid}-{n}", node_id=n, job_id="j", attempt=1) for n in nodes]


def _in_order(seen: list[tuple[str, int, bool]]) -> bool:
    seqs = [s for _, s, _ in seen]
    return all(a < b for a, b in zip(seqs, seqs[1:], strict=False))


async def test_a_member_reports_through_the_relay_parts_and_blobs_come_down_and_it_falls_back(tmp_path: Path,
                                                                                               token_dir: Path):
    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    relay_parts: list[NodePart] = []
    member_parts: list[NodePart] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            asked: list[int] = []   # the relay asks its own link for a full report (a placer's new key)
            relay = _relay(tokens, "r1", placer, relay_parts, on_bad_bundle=lambda: asked.append(1))
            relay_scope = trio.CancelScope()

            async def run_relay(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with relay_scope:
                    await relay.run(task_status=task_status)

            placer.relay_url = await n.start(run_relay)
            await placer.until(lambda: "r1" in placer.relays, "relay up")
            link = AgentLink("http://127.0.0.1:9", tokens.cluster, "m1", Hooks(), heartbeat_s=0.2,
                             wire_url=placer.url, on_part=_accepting("m1", member_parts, placer.signer.public),
                             request_timeout_s=2.0,
                             relay_retry_s=0.5)
            await n.start(link.run)

            # registers directly, then moves to the relay; its empty beats come up in rack beats
            await placer.until(lambda: any(k == "beat" for k, _, _ in placer.seen.get("m1", [])), "a beat")
            assert placer.seen["m1"][0] == ("report", 1, True)
            assert link.statistics()["relay_url"] == relay.listen_url

            # events between empty beats: a pending empty entry goes up before the report that
            # follows it, so the placer sees m1's sequence in order whatever the timing
            for i in range(8):
                await trio.sleep(0.03 * i)
                k0 = len(placer.seen["m1"])
                link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=time.time()))
                await placer.until(lambda k0=k0: any(k == "relayed" for k, _, _ in placer.seen["m1"][k0:]), "relayed")
            assert _in_order(placer.seen["m1"]), placer.seen["m1"]
            assert sum(k == "relayed" for k, _, _ in placer.seen["m1"]) == 8

            # a bundle: the relay's own part and the member's are acked; a node it does not hold is left out
            bid, raw = _blob()
            b = placer.bundle(blob_id=bid, blob=raw, parts=_parts("p", ["r1", "m1", "ghost"], bid))
            f = await placer.relays["r1"].call("bundle", b, timeout_s=5)
            acks = decode_payload(f, AckBundle)
            assert sorted(o.node_id for o in acks.outcomes) == ["m1", "r1"]
            assert all(o.outcome == "accepted" for o in acks.outcomes)
            assert [p.node_id for p in relay_parts] == ["r1"] and [p.node_id for p in member_parts] == ["m1"]
            assert placer.bad_macs == 0  # every relayed report and beat carried m1's own MAC

            # a bundle not signed by the placer (a forger's, or one changed on the way): refused whole,
            # nothing delivered to anyone
            forged = RackBundle(rack=RACK, blob_id=bid, parts=_parts("q", ["r1", "m1"], bid), deliver_by=time.time() + 2)
            other = BundleSigner.generate().bundle(rack=RACK, blob_id=bid, parts=_parts("q", ["r1", "m1"], bid),
                                                   deliver_by=time.time() + 2)
            for bad in (forged, other):
                with pytest.raises(CallFailed, match="signature|not signed"):
                    await placer.relays["r1"].call("bundle", bad, timeout_s=5)
            assert len(relay_parts) == 1 and len(member_parts) == 1 and relay.statistics()["bad_bundles"] == 2
            assert len(asked) == 2
            # the member gets the blob from its relay (which had it from the bundle), not the placer
            assert await link.relay_blob(bid) == raw and placer.blob_gets == 0
            assert relay.statistics()["blob_serves"] == 1

            # the relay dies: the member's next report fails and it registers with the placer directly
            placer.relay_url = None
            n_before = len(placer.seen["m1"])
            relay_scope.cancel()
            await placer.until(lambda: any(k == "report" and full for k, _, full in placer.seen["m1"][n_before:]),
                               "fallback full report")
            assert link.statistics()["relay_url"] is None and link.relay_failures >= 1
            assert _in_order(placer.seen["m1"]), placer.seen["m1"]

            # another relay comes up for the rack: after the retry window the member asks again
            # (a full report) and moves to it
            relay2 = _relay(tokens, "r2", placer, [])
            placer.relay_url = await n.start(relay2.run)
            await placer.until(lambda: link.statistics()["relay_url"] == relay2.listen_url, "moved to r2")
            await placer.until(lambda: any(k == "beat" for k, _, _ in placer.seen["m1"][n_before:]), "r2 beats")
            assert _in_order(placer.seen["m1"]), placer.seen["m1"]
            n.cancel_scope.cancel()


async def test_a_relay_gets_the_blob_from_the_relays_a_bundle_names_then_the_placer(tmp_path: Path,
                                                                                   token_dir: Path):
    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            a = _relay(tokens, "ra", placer, [])
            b = _relay(tokens, "rb", placer, [])
            c = _relay(tokens, "rc", placer, [])
            a_url = await n.start(a.run)
            b_url = await n.start(b.run)
            await n.start(c.run)
            await placer.until(lambda: len(placer.relays) == 3, "relays up")
            bid, raw = _blob()
            # a has the blob from its bundle; b is told to ask a; c is told to ask b (which has
            # it by then, or is getting it) -- the placer never serves it
            await placer.relays["ra"].call("bundle", placer.bundle(blob_id=bid, blob=raw), timeout_s=5)
            await placer.relays["rb"].call("bundle", placer.bundle(blob_id=bid, blob_sources=[a_url]),
                                           timeout_s=5)
            await placer.relays["rc"].call("bundle", placer.bundle(blob_id=bid, blob_sources=[b_url]),
                                           timeout_s=5)
            with trio.fail_after(5):
                await poll(lambda: not (b.blobs.cached(bid) is None or c.blobs.cached(bid) is None), 0.01)
            assert placer.blob_gets == 0
            # a blob no listed relay has: the placer's blob_get, last
            bid2, raw2 = encode_gang_blob(GangBlob(job_id="j2", attempt=1))
            placer.blobs[bid2] = raw2
            await placer.relays["rc"].call("bundle", placer.bundle(blob_id=bid2, blob_sources=[a_url]),
                                           timeout_s=5)
            with trio.fail_after(5):
                await poll(lambda: c.blobs.cached(bid2) is not None, 0.01)
            assert placer.blob_gets == 1
            n.cancel_scope.cancel()


@pytest.mark.parametrize("batches", [True, False])
async def test_members_content_reports_go_up_batched_and_in_order(tmp_path: Path, token_dir: Path, batches: bool):
    """Eight members, each with an event at once: their reports reach the placer in fewer
    frames than reports, each member's sequence in order; a placer without 'reports'
    frames gets one frame per report."""
    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    placer.batches = batches
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            relay = _relay(tokens, "r1", placer, [])
            placer.relay_url = await n.start(relay.run)
            await placer.until(lambda: "r1" in placer.relays, "relay up")
            links = [AgentLink("http://127.0.0.1:9", tokens.cluster, f"m{i}", Hooks(), heartbeat_s=0.2,
                               wire_url=placer.url, request_timeout_s=2.0) for i in range(8)]
            for link in links:
                await n.start(link.run)
            await placer.until(lambda: all(lk.statistics()["relay_url"] for lk in links), "all through r1")
            frames0 = placer.report_frames
            for _round in range(3):
                for link in links:
                    link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=time.time()))
                await trio.sleep(0.1)
            await placer.until(lambda: sum(k == "relayed" for lk in links for k, _, _ in placer.seen[lk.node_id])
                               >= 24, "24 relayed")
            frames = placer.report_frames - frames0
            assert frames < 24 if batches else frames >= 24, frames
            for link in links:
                assert _in_order(placer.seen[link.node_id]), placer.seen[link.node_id]
            n.cancel_scope.cancel()


async def test_a_member_applies_only_the_stops_the_placer_macd_for_it(tmp_path: Path, token_dir: Path):
    """Fencing stops in a relayed answer: one MACed by the placer with the member's key is
    applied; one without a MAC, or MACed with another node's key, is refused and counted."""
    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    hooks = Hooks()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            relay = _relay(tokens, "r1", placer, [])
            placer.relay_url = await n.start(relay.run)
            await placer.until(lambda: "r1" in placer.relays, "relay up")
            link = AgentLink("http://127.0.0.1:9", tokens.cluster, "m1", hooks, heartbeat_s=0.2,
                             wire_url=placer.url, request_timeout_s=2.0)
            await n.start(link.run)
            await placer.until(lambda: link.statistics()["relay_url"] == relay.listen_url, "through r1")
            key = node_key(placer.master, "m1", link.boot_id)
            other = node_key(placer.master, "m2", link.boot_id)
            placer.stops = [Victim(workload_id="w-plain"), *with_stop_macs(other, "m1", link.boot_id,
                                                                           [Victim(workload_id="w-other")]),
                            *with_stop_macs(key, "m1", link.boot_id, [Victim(workload_id="w-real")])]
            link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=time.time()))
            await placer.until(lambda: not placer.stops, "answered")
            with trio.fail_after(5):
                await poll(lambda: hooks.stopped, 0.01)
            assert hooks.stopped == ["w-real"]
            assert link.statistics()["stops_refused"] == 2
            n.cancel_scope.cancel()


async def test_a_member_that_cannot_take_a_relayed_part_registers_directly_then_comes_back(tmp_path: Path,
                                                                                           token_dir: Path):
    """The member holds an older placer key than the one its relay's bundle is signed with (the
    placer came back with a new one): the part is refused (an error to the relay, which leaves
    the member out), and the member reports a full report directly -- where the placer's keys
    are given -- then returns to the relay after relay_retry_s."""
    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    stale = BundleSigner.generate().public
    got: list[NodePart] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            relay = _relay(tokens, "r1", placer, [])
            placer.relay_url = await n.start(relay.run)
            await placer.until(lambda: "r1" in placer.relays, "relay up")
            link = AgentLink("http://127.0.0.1:9", tokens.cluster, "m1", Hooks(), heartbeat_s=0.2,
                             wire_url=placer.url, on_part=_accepting("m1", got, stale), request_timeout_s=2.0,
                             relay_retry_s=0.5)
            await n.start(link.run)
            await placer.until(lambda: link.statistics()["relay_url"] == relay.listen_url, "through r1")
            k0 = len(placer.seen["m1"])
            bid, raw = _blob()
            f = await placer.relays["r1"].call("bundle", placer.bundle(blob_id=bid, blob=raw,
                                                                       parts=_parts("p", ["m1"], bid)), timeout_s=5)
            assert decode_payload(f, AckBundle).outcomes == [] and got == []   # left out: pushed directly
            await placer.until(lambda: any(k == "report" and full for k, _, full in placer.seen["m1"][k0:]),
                               "a direct full report")
            assert link.relay_failures >= 1
            await placer.until(lambda: link.statistics()["relay_url"] == relay.listen_url, "back through r1")
            n.cancel_scope.cancel()


async def test_a_relay_waits_for_a_placer_that_answers_its_hello_late(token_dir: Path):
    """A placer in a registration storm answers a relay's hello after more than a request's
    timeout: the relay waits (connect_timeout_s) instead of giving up and dialling again."""
    from tests.test_wire_channel import _StallThenForward

    tokens = TokenSet.load(token_dir)
    placer = FakePlacer(tokens)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            placer.url = await n.start(placer.server.run, "127.0.0.1:0")
            front = _StallThenForward(placer.url, 0, delay_s=1.0)
            front_url = await n.start(front.run)
            relay = Relay(node_id="r1", rack=RACK, tokens=tokens, listen="127.0.0.1:0", wire_url=lambda: front_url,
                          own_part=_accepting("r1", [], placer.signer.public), blobs=BlobCache(), heartbeat_s=0.2,
                          request_timeout_s=0.3, connect_timeout_s=5.0, keys=lambda: (None, placer.signer.public))
            await n.start(relay.run)
            await placer.until(lambda: "r1" in placer.relays, "relay up")
            with trio.fail_after(5):
                await poll(lambda: relay.connects != 0, 0.02)  # (its hello answered: open_frames returns)
            assert front.accepted == 1 and relay.connects == 1
            n.cancel_scope.cancel()
