"""A rack relay's copies to a placer that follows (agent.relaycopies), on loopback against two
small fake placers (tests.test_relay_link.FakePlacer): every beat and report batch the relay
sends its leader goes to the follower too, once the relay host asked for a channel there; the
follower's ``need_full`` makes that member send a full report (through the relay); and when the
follower leads, the copy connection becomes the relay's connection up, without a handshake
and without asking the members for full reports. A follower that lacks a member's GPU
inventory gets the member's snapshot."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import msgspec
import trio
import trio.testing

from agent.gpus.simulated import SimulatedBackend
from agent.relay import Relay
from agent.relaycopies import (
    COPY_BEAT_EVERY,
    COPY_QUEUE,
    COPY_WINDOW,
    CopyConn,
    RelayCopies,
    merged_beat,
    split_beat,
)
from agent.relaycore import RelayCore
from infra.auth import TokenSet
from scheduler_link.agent_link import AgentLink
from scheduler_link.follow import OBSERVED, Copies, answer_beat
from scheduler_link.frames import FrameChannel, FrameError, decode_payload
from scheduler_link.heartbeat_wire import Hello, WireError, WireReply
from scheduler_link.messages import (
    Frame,
    NodeReport,
    RackBeat,
    RackBeatReply,
    RackReports,
    ReportReply,
    Victim,
    WorkloadEvent,
)
from scheduler_link.msgauth import node_key, with_stop_macs
from testing.waiting import poll

from .test_relay_link import FakePlacer, Hooks, _relay


class FakeFollower(FakePlacer):
    """Answers as a follower does: reports 202, beats with the members it lacks (``lacks``,
    once each); counts the relays' hellos."""

    def __init__(self, tokens: TokenSet) -> None:
        super().__init__(tokens)
        self.lacks: set[str] = set()
        self.hellos = 0
        self.leads = False   # (promoted: it answers as the leader does)
        self.epoch = 0       # ... with this epoch in its answers
        self.beat_replies = 0   # answers it sent to beat copies that asked for none

    def opened(self, hello: Hello, channel: FrameChannel):  # noqa: ANN201
        self.hellos += bool(hello.racks)
        return super().opened(hello, channel)

    def _relayed(self, ch: FrameChannel, rep: NodeReport) -> WireReply:
        wr = super()._relayed(ch, rep)
        if wr.status == 200 and self.leads and self.epoch:   # (promoted: its answers carry its epoch)
            return WireReply(status=200, reply=msgspec.structs.replace(wr.reply, epoch=self.epoch))
        return WireReply(status=OBSERVED, reply=wr.reply) if wr.status == 200 and not self.leads else wr

    def _frame(self, ch, f):  # noqa: ANN001, ANN201
        if f.type == "ping":
            return "ping", None
        if f.type != "beat":
            return super()._frame(ch, f)
        b = decode_payload(f, RackBeat)
        if ch.name in b.node_ids:   # (the relay's own entry: its connection names it, no MAC)
            k = b.node_ids.index(ch.name)
            self._log(ch.name, "beat", b.seqs[k], False)
            b = split_beat(b, {ch.name})[1] or RackBeat(rack=b.rack)
            f = msgspec.structs.replace(f, payload=msgspec.Raw(msgspec.msgpack.encode(b)))
        super()._frame(ch, f)
        reply = RackBeatReply()
        if self.leads and self.epoch:
            reply = RackBeatReply(epoch=self.epoch)
        elif self.lacks:
            need, self.lacks = sorted(self.lacks), set()
            reply = RackBeatReply(need_full=need)
        self.beat_replies += not f.id and reply != RackBeatReply()
        return answer_beat(ch, f, reply)   # (a copy wanting no answer: one only when it says something)


class Rack:
    """A leader and a follower on loopback, rack r1's relay up to the leader, and ``members``
    AgentLinks reporting through it. ``up``: where the relay host's own link reports (a test
    moves it: the follower, or "" for no placer named)."""

    def __init__(self, tokens: TokenSet, leader: FakePlacer, follower: FakeFollower, *,
                 request_timeout_s: float = 2.0) -> None:
        self.tokens, self.leader, self.follower = tokens, leader, follower
        self.request_timeout_s = request_timeout_s
        self.up = ""

    async def start(self, n: trio.Nursery, members: int) -> tuple[Relay, list[AgentLink]]:
        leader, follower, tokens = self.leader, self.follower, self.tokens
        leader.url = await n.start(leader.server.run, "127.0.0.1:0")
        follower.url = await n.start(follower.server.run, "127.0.0.1:0")
        follower.master = leader.master   # (the placers of one cluster share the MAC master)
        self.up = leader.url
        relay = _relay(tokens, "r1", leader, [])
        relay.request_timeout_s = relay.copies.timeout_s = self.request_timeout_s
        relay._wire_url = lambda: self.up or None
        leader.relay_url = follower.relay_url = await n.start(relay.run)
        await leader.until(lambda: "r1" in leader.relays, "relay up")
        links = [AgentLink("http://127.0.0.1:9", tokens.cluster, f"m{i}", Hooks(), heartbeat_s=0.2,
                           wire_url=leader.url, request_timeout_s=2.0) for i in range(members)]
        for link in links:
            await n.start(link.run)
        await leader.until(lambda: all(lk.statistics()["relay_url"] for lk in links), "all through r1")
        return relay, links



async def _relay_host(n: trio.Nursery, tokens: TokenSet, relay: Relay, leader: FakePlacer, http: httpx.AsyncClient,
                      placers: str = "http://placer-a,http://placer-b", *, folded: bool = True) -> AgentLink:
    """The relay host's own link as the agent daemon wires it (over Relay.own_channel; with
    ``folded``, its heartbeat copies riding in the relay's beat copies and its relay asked who
    leads), started, no periodic full report in the test's window."""
    host = AgentLink(placers, tokens.cluster, "r1", Hooks(), heartbeat_s=0.2, wire_url=leader.url,
                     wire_connect=relay.own_channel, http=http, own_relay_url=relay.listen_url,
                     request_timeout_s=5.0, copy_fold=relay.copies.fold if folded else None,
                     copy_leader=relay.leader_wire if folded else None)
    host.full_every = 0
    await n.start(host.run)
    return host

async def test_the_relay_copies_to_the_follower_then_goes_up_to_it(tmp_path: Path, token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    leader, follower = FakePlacer(tokens), FakeFollower(tokens)
    rack = Rack(tokens, leader, follower)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            relay, links = await rack.start(n, 3)
            # the relay host's link asks for a channel to the follower (its copies): the rack follows
            own = await relay.own_channel(follower.url, tokens.cluster or "", "r1")
            assert (await own.exchange(NodeReport(node_id="r1", boot_id="b", seq=1))).status == OBSERVED
            assert follower.hellos == 1 and "r1" in follower.relays
            for link in links:
                link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=time.time()))
            await follower.until(lambda: all(any(k == "relayed" for k, _, _ in follower.seen.get(lk.node_id, []))
                                             and any(k == "beat" for k, _, _ in follower.seen.get(lk.node_id, []))
                                             for lk in links), "the rack copied")
            for lk in links:   # the follower sees each member's sequence as the leader does, in order
                seqs = [s for _, s, _ in follower.seen[lk.node_id]]
                assert seqs == sorted(seqs)
            # the follower lacks m0: m0 sends a full report, through the relay, to both
            fulls = sum(full for _, _, full in leader.seen["m0"])
            follower.lacks = {"m0"}
            await follower.until(lambda: any(k == "relayed" and full for k, _, full in follower.seen["m0"]),
                                 "m0's full report copied")
            assert sum(full for _, _, full in leader.seen["m0"]) == fulls + 1
            st = relay.statistics()["copies"]
            assert st["followers"] == 1 and st["frames"] > 0 and st["bytes"] > 0 and st["drops"] == 0
            # the follower leads: the relay's connection up becomes the copy connection (no hello)
            connects, hellos = relay.connects, follower.hellos
            rack.up = follower.url
            follower.leads = True
            await leader.relays["r1"].aclose()
            with trio.fail_after(10):
                await poll(lambda: relay.connects > connects and relay.upstream is not None, 0.05)
            assert follower.hellos == hellos and relay.statistics()["copies"]["followers"] == 0
            beats = {lk.node_id: len(follower.seen[lk.node_id]) for lk in links}
            await follower.until(lambda: all(len(follower.seen[lk.node_id]) > beats[lk.node_id] + 1 for lk in links),
                                 "the rack goes on at the new leader")
            # (a member whose heartbeat came while the relay had no connection up sends a full
            # report through it: never directly, never a handshake)
            assert all(lk.statistics()["relay_url"] for lk in links) and follower.hellos == hellos
            assert all(k != "report" for lk in links for k, _, _ in follower.seen[lk.node_id])
            n.cancel_scope.cancel()


def test_a_follower_that_lacks_a_members_inventory_gets_its_snapshot() -> None:
    """A follower refused a member's compact registration (409: it lacks the GPU inventory the
    leader holds): the member is asked for a full report with ``send_inventory`` -- whatever went
    up before -- until a full report carrying its snapshot has gone up; a plain ``need_full``
    from a follower does not ask for the snapshot."""
    core = RelayCore(node_id="r", rack="r1", heartbeat_s=1.0)
    core.member_opened("m")
    core.member_opened("k")

    def beat(nid: str, seq: int) -> ReportReply:
        wr = core.report(nid, NodeReport(node_id=nid, boot_id="b", seq=seq, full=False), upstream=True)
        assert isinstance(wr, WireReply) and wr.status == 200
        return wr.reply

    assert not beat("m", 1).need_full
    compact = NodeReport(node_id="m", boot_id="b", seq=2, full=True, inventory="inv")
    assert compact.compact and isinstance(core.report("m", compact, upstream=True), int)
    batch = core.next_batch(0.0)
    assert batch is not None and batch.reports == [compact]
    core.follower_needs(["m", "k"], ["m"])
    r = beat("m", 3)
    assert r.need_full and r.send_inventory
    r = beat("k", 1)
    assert r.need_full and not r.send_inventory
    snap = SimulatedBackend("dgx-h100", hostname="m").discover()
    full = NodeReport(node_id="m", boot_id="b", seq=4, full=True, snapshot=snap, inventory="inv")
    assert isinstance(core.report("m", full, upstream=True), int)
    assert core.next_batch(0.0) is not None
    r = beat("m", 5)
    assert not r.need_full and not r.send_inventory


async def test_stops_in_a_promoted_followers_answers_to_copied_reports_reach_the_member(
        tmp_path: Path, token_dir: Path) -> None:
    """A follower promoted while the relay still goes up to the placer before answers a copied
    report batch with its epoch and a stop for a member (a workload no job of its claims): the
    stop reaches the member in its next answer, as a beat answer's would; a stop the member's key
    did not MAC is not acted on."""
    tokens = TokenSet.load(token_dir)
    leader, follower = FakePlacer(tokens), FakeFollower(tokens)
    hooks = Hooks()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            leader.url = await n.start(leader.server.run, "127.0.0.1:0")
            follower.url = await n.start(follower.server.run, "127.0.0.1:0")
            follower.master = leader.master
            relay = _relay(tokens, "r1", leader, [])
            leader.relay_url = follower.relay_url = await n.start(relay.run)
            await leader.until(lambda: "r1" in leader.relays, "relay up")
            link = AgentLink("http://127.0.0.1:9", tokens.cluster, "m0", hooks, heartbeat_s=0.2,
                             wire_url=leader.url, request_timeout_s=2.0)
            await n.start(link.run)
            await leader.until(lambda: bool(link.statistics()["relay_url"]), "m0 through r1")
            await relay.own_channel(follower.url, tokens.cluster or "", "r1")   # the rack copies to it
            # promoted: its answer to the next copied report names a stop for m0, MACed in m0's key
            key = node_key(leader.master, "m0", link.boot_id)
            follower.leads, follower.epoch = True, 7
            follower.stops = [*with_stop_macs(key, "m0", link.boot_id, [Victim(workload_id="w-orphan")]),
                              Victim(workload_id="w-forged")]
            link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=time.time()))
            with trio.fail_after(10):
                await poll(lambda: hooks.stopped, 0.02)
            assert hooks.stopped == ["w-orphan"] and not follower.stops
            assert relay.core.epochs.highest == 7   # (its epoch taken, as a leader's)
            n.cancel_scope.cancel()


class PausedPlacer(FakePlacer):
    """A leader paused (SIGSTOP): its connections stay open, nothing is answered."""

    def __init__(self, tokens: TokenSet) -> None:
        super().__init__(tokens)
        self.paused = False

    def _frame(self, ch, f):  # noqa: ANN001, ANN201
        if self.paused:
            return _silent()
        return super()._frame(ch, f)


async def _silent() -> None:
    await trio.sleep_forever()


async def test_the_relay_leaves_a_paused_leader_for_the_follower_that_answers_as_leader(
        tmp_path: Path, token_dir: Path) -> None:
    """The leader paused (its connection open, silent), a follower promoted: once the follower
    answers the host's own report over the copy connection at a newer epoch, the relay goes up
    there over that connection -- no hello, no member asked for a full report -- rather than
    staying on the silent connection; the members' heartbeats go on at the new leader."""
    tokens = TokenSet.load(token_dir)
    leader, follower = PausedPlacer(tokens), FakeFollower(tokens)
    rack = Rack(tokens, leader, follower)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            relay, links = await rack.start(n, 2)
            own = await relay.own_channel(follower.url, tokens.cluster or "", "r1")
            assert (await own.exchange(NodeReport(node_id="r1", boot_id="b", seq=1, full=False))).status == OBSERVED
            await follower.until(lambda: all(any(k == "beat" for k, _, _ in follower.seen.get(lk.node_id, []))
                                             for lk in links), "the rack copied")
            # paused; the follower leads (epoch 9), and the host's link, told so, reports there
            leader.paused = True
            follower.leads, follower.epoch = True, 9
            rack.up = follower.url
            hellos, fulls = follower.hellos, {lk.node_id: lk.full_reports_sent for lk in links}
            assert (await own.exchange(NodeReport(node_id="r1", boot_id="b", seq=2, full=False))).status == 200
            with trio.fail_after(5):
                await poll(lambda: relay.upstream is not None and relay._up_url == follower.url, 0.02)
            assert relay.statistics()["leader_moves"] == 1 and follower.hellos == hellos
            beats = {lk.node_id: len(follower.seen[lk.node_id]) for lk in links}
            await follower.until(lambda: all(len(follower.seen[lk.node_id]) > beats[lk.node_id] + 1 for lk in links),
                                 "the rack goes on at the new leader")
            assert {lk.node_id: lk.full_reports_sent for lk in links} == fulls
            n.cancel_scope.cancel()


async def test_through_a_failover_the_rack_beats_to_the_followers_and_goes_up_to_the_one_that_leads(
        tmp_path: Path, token_dir: Path) -> None:
    """The leader gone and none named yet: the relay keeps taking its members' heartbeats and
    beats them to the follower each interval (its model keeps them heard); the follower's answer
    to such a beat at a newer epoch (it leads now) moves the relay up there over the copy
    connection, with no member sending a full report."""
    tokens = TokenSet.load(token_dir)
    leader, follower = FakePlacer(tokens), FakeFollower(tokens)
    rack = Rack(tokens, leader, follower)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            relay, links = await rack.start(n, 2)
            await relay.own_channel(follower.url, tokens.cluster or "", "r1")
            fulls = {lk.node_id: lk.full_reports_sent for lk in links}
            # the leader goes; no placer is named yet
            rack.up = ""
            await leader.relays["r1"].aclose()
            with trio.fail_after(5):
                await poll(lambda: relay.upstream is None, 0.02)
            beats = {lk.node_id: len(follower.seen.get(lk.node_id, [])) for lk in links}
            await follower.until(lambda: all(len(follower.seen.get(lk.node_id, [])) > beats[lk.node_id] + 1
                                             for lk in links), "the rack beats to the follower meanwhile")
            assert relay.upstream is None
            # promoted: its answer to the next beat moves the relay up there
            hellos = follower.hellos
            follower.leads, follower.epoch = True, 9
            with trio.fail_after(5):
                await poll(lambda: relay.upstream is not None and relay._up_url == follower.url, 0.02)
            assert relay.statistics()["leader_moves"] == 1 and follower.hellos == hellos
            assert {lk.node_id: lk.full_reports_sent for lk in links} == fulls
            n.cancel_scope.cancel()


class BusyFollower(FakeFollower):
    """A follower whose first answer to the relay host's own report once it leads comes only
    after ``busy_s`` (its loop busy taking over: a promotion adopting the fleet)."""

    def __init__(self, tokens: TokenSet) -> None:
        super().__init__(tokens)
        self.busy_s = 0.0

    def _frame(self, ch, f):  # noqa: ANN001, ANN201
        if f.type == "report" and self.leads and self.busy_s and decode_payload(f, NodeReport).node_id == ch.name:
            busy, self.busy_s = self.busy_s, 0.0
            return self._later(busy, ch, f)
        return super()._frame(ch, f)

    async def _later(self, busy: float, ch, f):  # noqa: ANN001, ANN202
        await trio.sleep(busy)
        return super()._frame(ch, f)


def _placers_http(follower: FakeFollower, other: FakeFollower | None = None) -> httpx.MockTransport:
    """The two placers' HTTP side as the relay host's link sees it: placer-b, a follower, names
    its framed channel in its 307 (where the link's copies go); no /healthz answers (no probe
    finds a leader); a report over HTTP is answered as the new leader's (naming its channel)."""
    def handle(req: httpx.Request) -> httpx.Response:
        if req.url.path.endswith("/report") and req.content == b"{}":
            if req.url.host == "placer-b":
                return httpx.Response(307, json={"error": "not the leader", "leader": "http://placer-a",
                                                 "wire": follower.url})
            if req.url.host == "placer-c" and other is not None:
                return httpx.Response(307, json={"error": "not the leader", "leader": "http://placer-a",
                                                 "wire": other.url})
            return httpx.Response(400, json={"error": "malformed report"})
        if req.url.path.endswith("/report"):   # (as the leader after the failover: ``other`` when given)
            new = other or follower
            return httpx.Response(200, content=msgspec.json.encode(ReportReply(
                epoch=new.epoch, heartbeat_interval_s=0.2, wire_url=new.url)))
        return httpx.Response(503, json={"error": "no leader"})
    return httpx.MockTransport(handle)


async def test_the_relay_hosts_own_link_moves_to_a_busy_new_leader_with_no_full_report(
        tmp_path: Path, token_dir: Path) -> None:
    """The relay host's own link (the shipped AgentLink over Relay.own_channel, its copies to
    the follower over the relay's copy connection) loses the leader; the follower leads, and
    its answer to the copy the link flushes before moving takes 3 s (its loop busy taking
    over, longer than two heartbeat intervals): the link waits for it as for any report and
    moves over the copy connection -- no full report from the host, none from its members."""
    tokens = TokenSet.load(token_dir)
    leader, follower = FakePlacer(tokens), BusyFollower(tokens)
    rack = Rack(tokens, leader, follower, request_timeout_s=5.0)
    http = httpx.AsyncClient(transport=_placers_http(follower))
    with trio.fail_after(40):
        async with http, trio.open_nursery() as n:
            relay, links = await rack.start(n, 2)
            host = await _relay_host(n, tokens, relay, leader, http, folded=False)

            def copied() -> bool:   # the host's copies to placer-b in step, over the relay's copy connection
                st = host.statistics()["follower_copies"]
                return (st is not None and bool(st["placers"]) and st["placers"][0]["taken"] >= 3
                        and st["placers"][0]["wire"] == follower.url)
            with trio.fail_after(10):
                await poll(copied, 0.02)
            assert host.registered and host.placer_url == "http://placer-a" and relay.copies.conns
            fulls = host.full_reports_sent
            members = {lk.node_id: lk.full_reports_sent for lk in links}
            # the leader goes; the follower leads, busy for 3 s before it answers the host's copy
            follower.leads, follower.epoch, follower.busy_s = True, 9, 3.0
            rack.up = follower.url
            await leader.relays["r1"].aclose()
            with trio.fail_after(15):
                await poll(lambda: host.placer_url == "http://placer-b" and host.registered
                           and host.epochs.highest == 9 and relay._up_url == follower.url, 0.02)
            seen = len(follower.seen["r1"])
            await follower.until(lambda: len(follower.seen["r1"]) > seen + 2, "the host goes on at the new leader")
            assert host.full_reports_sent == fulls, host.statistics()
            assert host.statistics()["follower_copies"]["handovers"] == 1
            assert not any(full for _, _, full in follower.seen["r1"][seen:])
            assert {lk.node_id: lk.full_reports_sent for lk in links} == members
            n.cancel_scope.cancel()


class CopyLink:
    """What follow.Copies needs of a node's link (follow.CopyHost), with no I/O: the follower at
    ``B`` names its channel in its 307; the channel is ``chan``."""

    def __init__(self, chan: SlowChannel) -> None:
        self.placer_url = "http://a"
        self.heartbeat_s = 1.0
        self.request_timeout_s = 10.0
        self.chan = chan
        self.fold = False             # empty heartbeats ride in the relay's beat copies (a relay host)
        self.folded: list[int] = []

    def copies_on(self) -> bool:
        return True

    def full_copy(self, seq: int) -> NodeReport:
        return NodeReport(node_id="n", boot_id="b", seq=seq, full=True)

    async def ask_redirect(self, url: str) -> tuple[int, bytes] | None:
        return 307, b'{"wire": "tcp://127.0.0.1:1"}'

    async def connect(self, wire_url: str, placer_url: str) -> SlowChannel:
        return self.chan

    def fold_copy(self, wire_url: str, placer_url: str, rep: NodeReport) -> bool:
        if self.fold:
            self.folded.append(rep.seq)
        return self.fold


class SlowChannel:
    """A follower's framed connection: each answer takes ``busy_s`` (its loop busy), or the
    connection breaks (``broken``) once that time has passed."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.broken = False
        self.seen: list[int] = []

    async def exchange(self, report: NodeReport) -> WireReply:
        await trio.sleep(self.busy_s)
        if self.broken:
            raise WireError("connection reset")
        self.seen.append(report.seq)
        return WireReply(status=OBSERVED)

    async def aclose(self) -> None:
        return None


async def test_a_move_waits_for_the_copy_in_flight_and_no_longer_than_it_lives(autojump_clock) -> None:  # noqa: ANN001
    """The node moves to the follower its copies went to (it leads now): the move takes the copy
    connection once the last report built is taken there -- 3 s later when the follower's
    answer takes that long (well within the wait: a full report would wait for the same busy
    placer) -- and gives up at once, not at the end of the wait, when that copy fails."""
    for broken in (False, True):
        chan = SlowChannel()
        link = CopyLink(chan)
        async with trio.open_nursery() as n:
            copies = Copies(link, n, random.Random(1))
            copies.offer(NodeReport(node_id="n", boot_id="b", seq=1, full=True), ["http://a", "http://b"])
            with trio.fail_after(5):
                await poll(lambda c=chan: c.seen == [1], 0.01)
            # the node's next report went to the leader, which is gone; the copy of it is slow
            chan.busy_s, chan.broken = 3.0, broken
            copies.offer(NodeReport(node_id="n", boot_id="b", seq=2, events=[
                WorkloadEvent(workload_id="w", job_id="j", state="running", at=0.0)]), ["http://a", "http://b"])
            link.placer_url = "http://b"
            t0 = trio.current_time()
            ch = await copies.take("http://b", link.request_timeout_s)
            if broken:
                assert ch is None and trio.current_time() - t0 == 3.0   # (ended by the failure, not the wait)
            else:
                assert ch is chan and chan.seen == [1, 2] and trio.current_time() - t0 == 3.0
                assert copies.handovers == 1
            n.cancel_scope.cancel()


class RefusingLink(CopyLink):
    """A link whose first ``closes`` copy connections end during their hello, as a follower (or
    the relay it dials through) closes a connection it cannot take yet."""

    def __init__(self, chan: SlowChannel, closes: int) -> None:
        super().__init__(chan)
        self.closes = closes

    async def connect(self, wire_url: str, placer_url: str) -> SlowChannel:
        if self.closes:
            self.closes -= 1
            raise FrameError("frames connection r1 closed before the answer")
        return self.chan


async def test_a_copy_connection_closed_in_its_hello_is_tried_again(autojump_clock) -> None:  # noqa: ANN001
    """A follower's copy connection that closes before its hello is answered is a failed
    connect like any other: tried again after a pause, the copies then go on -- the node's link
    (whose nursery the copies run in) never ends on it."""
    chan = SlowChannel()
    link = RefusingLink(chan, closes=2)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            copies = Copies(link, n, random.Random(1))
            copies.offer(NodeReport(node_id="n", boot_id="b", seq=1, full=True), ["http://a", "http://b"])
            await poll(lambda: chan.seen == [1], 0.01)
            assert link.closes == 0 and copies.failures == 2
            n.cancel_scope.cancel()


def _rack_beat(entries: dict[str, int]) -> RackBeat:
    return RackBeat(rack="z/b/r1", node_ids=list(entries), boot_ids=[f"boot-{m}" for m in entries],
                    seqs=list(entries.values()), macs=[f"{m}@{s}".encode() for m, s in entries.items()])


def _entries(b: RackBeat) -> dict[str, tuple[int, bytes]]:
    assert b.boot_ids == [f"boot-{m}" for m in b.node_ids]
    return dict(zip(b.node_ids, zip(b.seqs, b.macs, strict=True), strict=True))


async def test_a_follower_gets_every_other_beat_merged_and_each_at_once_while_no_connection_is_up() -> None:
    """What waits for a follower: one beat copy every COPY_BEAT_EVERY beats, each member's newest
    entry with its own MAC; the held entries of a report batch's members go before it (each
    member's sequence in order there), the others stay held; and a beat goes at once while the
    relay has no connection up (a failover)."""
    assert COPY_BEAT_EVERY == 2
    copies = RelayCopies(open_conn=None, handler=None, need_full=None, leader_beat=None,  # type: ignore[arg-type]
                         leader_reports=None, timeout_s=1.0)
    a, _ = trio.testing.memory_stream_pair()
    c = copies.conns["tcp://f"] = CopyConn("tcp://f", FrameChannel(a))
    up = "tcp://leader"
    copies.copy("beat", _rack_beat({"m0": 1, "m1": 1}), up)
    assert not c.queue                                        # held
    copies.copy("beat", _rack_beat({"m0": 2, "m2": 1}), up)
    [(kind, b)] = c.queue
    assert kind == "beat" and _entries(b) == {"m0": (2, b"m0@2"), "m1": (1, b"m1@1"), "m2": (1, b"m2@1")}
    c.queue.clear()
    copies.copy("beat", _rack_beat({"m0": 3, "m1": 2}), up)
    batch = RackReports(rack="z/b/r1", reports=[NodeReport(node_id="m1", boot_id="boot-m1", seq=3)])
    copies.copy("reports", batch, up)   # (m1's held entry before its report; m0's stays held)
    assert [(k, _entries(p) if k == "beat" else p) for k, p in c.queue] == [("beat", {"m1": (2, b"m1@2")}),
                                                                           ("reports", batch)]
    c.queue.clear()
    copies.copy("beat", _rack_beat({"m1": 4}), up)
    assert [(k, _entries(p)) for k, p in c.queue] == [("beat", {"m0": (3, b"m0@3"), "m1": (4, b"m1@4")})]
    c.queue.clear()
    copies.copy("beat", _rack_beat({"m0": 3}), None)          # no connection up: at once
    assert [(k, _entries(p)) for k, p in c.queue] == [("beat", {"m0": (3, b"m0@3")})]
    c.queue.clear()
    copies.copy("beat", _rack_beat({"m0": 4}), "tcp://f")     # (to the placer it went up to: no copy)
    copies.copy("beat", _rack_beat({"m0": 5}), "tcp://f")
    assert not c.queue and c.beat is None
    # a beat whose columns differ in length (the placer refuses it) is never merged into: no relay's end
    bad = RackBeat(rack="z/b/r1", node_ids=["m0", "m1"], boot_ids=["boot-m0"], seqs=[1, 1], macs=[])
    good = _rack_beat({"m2": 1})
    assert merged_beat(bad, good) is good and split_beat(bad, {"m0"}) == (bad, None)


class FarEnd:
    """A follower's end of a copy connection, in process: records the frames it gets, answers a
    ping (unless ``silent``: never), a report batch with 202s, a beat copy with ``reply`` the way
    a follower does (scheduler_link.follow.answer_beat)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, int]] = []
        self.beats: list[RackBeat] = []
        self.silent = False
        self.reply = RackBeatReply()

    def handle(self, ch: FrameChannel, f: Frame):  # noqa: ANN201
        self.got.append((f.type, f.id))
        if f.type == "ping":
            return _silent() if self.silent else ("ping", None)
        if f.type == "reports":
            return "replies", [WireReply(status=OBSERVED)] * len(decode_payload(f, RackReports).reports)
        if f.type == "beat":
            self.beats.append(decode_payload(f, RackBeat))
        return answer_beat(ch, f, self.reply)

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.got)


class Heard:
    """What a relay's copies hand on (RelayCopies' callbacks)."""

    def __init__(self) -> None:
        self.need: list[str] = []
        self.leader: list[int] = []
        self.leads: list[tuple[str, int]] = []

    def copies(self, a: trio.abc.Stream, timeout_s: float = 2.0) -> RelayCopies:
        async def open_conn(url: str) -> FrameChannel:
            return FrameChannel(a, name="r")
        return RelayCopies(open_conn=open_conn, handler=lambda ch, f: None,
                           need_full=lambda ids, inv: self.need.extend(ids),
                           leader_beat=lambda r: self.leader.append(r.epoch), leader_reports=lambda reps, ans: None,
                           leads=lambda url, epoch: self.leads.append((url, epoch)), timeout_s=timeout_s)


def _beats(copies: RelayCopies, copies_n: int, seq0: int = 1) -> None:
    """``copies_n`` beat copies' worth of rack beats (COPY_BEAT_EVERY each), sent up elsewhere."""
    for s in range(seq0, seq0 + copies_n * COPY_BEAT_EVERY):
        copies.copy("beat", _rack_beat({"m0": s, "m1": s}), "tcp://leader")


async def test_beat_copies_want_no_answer_and_a_follower_answers_only_what_it_must(autojump_clock) -> None:  # noqa: ANN001
    """Beat copies go as frames that want no answer, COPY_WINDOW at most before a ping asks
    whether the follower reads: a follower with nothing to say sends back only the pings'
    answers. What it must say comes in a beat answer of its own: the members it lacks (asked
    for), its epoch once it leads (taken as a leader's answer)."""
    a, b = trio.testing.memory_stream_pair()
    heard, far = Heard(), FarEnd()
    async with trio.open_nursery() as n:
        copies = heard.copies(a)
        copies.start(n)
        ch = await copies.channel("tcp://f")
        fch = FrameChannel(b, name="f")
        n.start_soon(fch.run, far.handle)
        _beats(copies, 2 * COPY_WINDOW)
        await trio.testing.wait_all_tasks_blocked()
        assert far.count("beat") == 2 * COPY_WINDOW and far.count("ping") == 2 == copies.pings
        assert all(rid == 0 for k, rid in far.got if k == "beat")
        assert ch.frames_in == 2 and fch.frames_out == 2   # (the pings' answers, nothing else)
        assert [bt.seqs for bt in far.beats[:2]] == [[2, 2], [4, 4]]
        far.reply = RackBeatReply(need_full=["m1"])
        _beats(copies, 1, 100)
        await trio.testing.wait_all_tasks_blocked()
        assert heard.need == ["m1"] and not heard.leader
        far.reply = RackBeatReply(epoch=5)
        _beats(copies, 1, 200)
        await trio.testing.wait_all_tasks_blocked()
        assert heard.leader == [5] and heard.leads == [("tcp://f", 5)] and heard.need == ["m1"]
        assert copies.stuck == 0 and "tcp://f" in copies.conns
        n.cancel_scope.cancel()


async def test_a_follower_that_reads_nothing_is_closed_after_one_window_and_its_queue_stays_bounded(
        autojump_clock) -> None:  # noqa: ANN001
    """A follower that answers no ping (stuck, its connection open): COPY_WINDOW beat copies go,
    then one ping; what the relay copies meanwhile waits, COPY_QUEUE frames at most (the oldest
    dropped and counted); the ping unanswered for the relay's request timeout, the connection
    is closed and counted ``stuck``, and nothing more is copied there."""
    a, b = trio.testing.memory_stream_pair()
    heard, far = Heard(), FarEnd()
    far.silent = True
    async with trio.open_nursery() as n:
        copies = heard.copies(a, timeout_s=2.0)
        copies.start(n)
        await copies.channel("tcp://f")
        n.start_soon(FrameChannel(b, name="f").run, far.handle)
        t0 = trio.current_time()
        _beats(copies, COPY_WINDOW)
        await trio.testing.wait_all_tasks_blocked()
        _beats(copies, COPY_QUEUE + 5, 1000)
        c = copies.conns["tcp://f"]
        assert far.count("beat") == COPY_WINDOW and far.count("ping") == 1
        assert len(c.queue) == COPY_QUEUE and copies.drops == 5
        await trio.sleep(2.0)
        await trio.testing.wait_all_tasks_blocked()
        assert copies.stuck == 1 and "tcp://f" not in copies.conns and trio.current_time() - t0 == 2.0
        assert c.ch.close_code == "stuck"
        _beats(copies, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert far.count("beat") == COPY_WINDOW
        n.cancel_scope.cancel()


async def test_the_relay_hosts_own_heartbeats_ride_in_its_beat_copies(autojump_clock) -> None:  # noqa: ANN001
    """The relay host's own empty heartbeat, copied to a follower, rides in the next beat copy
    there as the relay's own entry (no MAC); one not carried yet goes on its own when the next
    comes, and before a report of the host's (the follower sees its sequence in order); the
    follower's asking for the host's full report makes the next heartbeat go as a report."""
    a, b = trio.testing.memory_stream_pair()
    heard, far = Heard(), FarEnd()
    async with trio.open_nursery() as n:
        copies = heard.copies(a)
        copies.start(n)
        await copies.channel("tcp://f")
        n.start_soon(FrameChannel(b, name="f").run, far.handle)

        def own(seq: int) -> NodeReport:
            return NodeReport(node_id="r", boot_id="br", seq=seq, full=False)
        assert not copies.fold("tcp://other", own(1))   # (no copy connection there: the link sends it)
        assert copies.fold("tcp://f", own(1))
        _beats(copies, 1)
        await trio.testing.wait_all_tasks_blocked()
        [bt] = far.beats
        assert bt.node_ids == ["m0", "m1", "r"] and bt.seqs == [2, 2, 1] and bt.macs[-1] == b""
        assert copies.fold("tcp://f", own(2)) and copies.fold("tcp://f", own(3))   # (2 goes at once, alone)
        copies.flush_own("tcp://f")                                               # (3 before a report)
        await trio.testing.wait_all_tasks_blocked()
        assert [(x.node_ids, x.seqs) for x in far.beats[1:]] == [(["r"], [2]), (["r"], [3])]
        assert far.beats[1].rack == "z/b/r1" and copies.folded == 3
        far.reply = RackBeatReply(need_full=["m0", "r"])
        assert copies.fold("tcp://f", own(4))
        _beats(copies, 1, 10)
        await trio.testing.wait_all_tasks_blocked()
        assert heard.need == ["m0"]                       # (the host's own is its link's to send)
        assert not copies.fold("tcp://f", own(5)) and copies.fold("tcp://f", own(6))
        n.cancel_scope.cancel()


async def test_a_relay_hosts_link_hands_its_empty_heartbeat_copies_to_the_relay(autojump_clock) -> None:  # noqa: ANN001
    """A node whose relay carries its empty heartbeats to a follower (CopyHost.fold_copy) sends
    them no report: each counts as taken; a report with news goes as a report; and the last copy
    before a move there goes as a report (it must be taken there before the node goes on)."""
    chan = SlowChannel()
    link = CopyLink(chan)
    link.fold = True
    async with trio.open_nursery() as n:
        copies = Copies(link, n, random.Random(1), empty_every_s=1.0)
        urls = ["http://a", "http://b"]
        copies.offer(NodeReport(node_id="n", boot_id="b", seq=1, full=True), urls)
        await trio.testing.wait_all_tasks_blocked()
        assert chan.seen == [1]
        for seq in (2, 3, 4):
            copies.offer(NodeReport(node_id="n", boot_id="b", seq=seq, full=False), urls)
            await trio.sleep(1.5)
        assert chan.seen == [1] and link.folded == [2, 3, 4] and copies.copies["http://b"].taken == 4
        copies.offer(NodeReport(node_id="n", boot_id="b", seq=5, events=[
            WorkloadEvent(workload_id="w", job_id="j", state="running", at=0.0)]), urls)
        await trio.testing.wait_all_tasks_blocked()
        assert chan.seen == [1, 5]
        copies.offer(NodeReport(node_id="n", boot_id="b", seq=6, full=False), urls)
        link.placer_url = "http://b"
        assert await copies.take("http://b", 5.0) is chan
        assert chan.seen == [1, 5, 6] and link.folded == [2, 3, 4]
        n.cancel_scope.cancel()


async def test_the_relay_hosts_own_link_asks_its_relay_who_leads_and_moves_once(
        tmp_path: Path, token_dir: Path) -> None:
    """Three placers: the leader (placer-a) goes, placer-c is promoted, placer-b still follows.
    The relay host's own link, its placer gone, asks its relay who leads rather than trying the
    placers in turn (placer-b next): the relay hears it first (placer-c answers its beat copy
    with its epoch) and names it, and the link moves there once, over its copy connection -- no
    handover to placer-b, no full report."""
    tokens = TokenSet.load(token_dir)
    leader, fb, fc = FakePlacer(tokens), FakeFollower(tokens), FakeFollower(tokens)
    rack = Rack(tokens, leader, fb, request_timeout_s=5.0)
    http = httpx.AsyncClient(transport=_placers_http(fb, fc))
    with trio.fail_after(40):
        async with http, trio.open_nursery() as n:
            fc.url = await n.start(fc.server.run, "127.0.0.1:0")
            relay, _ = await rack.start(n, 2)
            fc.master, fc.relay_url = leader.master, relay.listen_url
            host = await _relay_host(n, tokens, relay, leader, http,
                                     "http://placer-a,http://placer-b,http://placer-c")

            def copied() -> bool:
                st = host.statistics()["follower_copies"]
                return (st is not None and len(st["placers"]) == 2 and all(p["taken"] >= 3 for p in st["placers"])
                        and relay.copies.folded >= 2)   # (its empty heartbeats ride in the relay's beat copies)
            with trio.fail_after(10):
                await poll(copied, 0.02)
            assert len(relay.copies.conns) == 2
            fulls = host.full_reports_sent
            # the leader goes, none named yet; placer-c is promoted
            fc.leads, fc.epoch = True, 9
            rack.up = ""
            await leader.relays["r1"].aclose()
            with trio.fail_after(15):
                await poll(lambda: host.placer_url == "http://placer-c" and host.registered
                           and relay._up_url == fc.url, 0.02)
            seen = len(fc.seen["r1"])
            await fc.until(lambda: len(fc.seen["r1"]) > seen + 2, "the host goes on at the new leader")
            assert host.statistics()["follower_copies"]["handovers"] == 1, host.statistics()
            assert host.full_reports_sent == fulls
            n.cancel_scope.cancel()


async def test_the_relay_hosts_own_link_stays_when_its_relay_reconnects_to_the_same_leader(
        tmp_path: Path, token_dir: Path) -> None:
    """The relay's connection up breaks and comes back to the same leader (no failover): the
    relay host's own link, whose report over it failed, asks its relay, hears the same placer
    named and stays with it -- no move to a follower."""
    tokens = TokenSet.load(token_dir)
    leader, fb = FakePlacer(tokens), FakeFollower(tokens)
    rack = Rack(tokens, leader, fb, request_timeout_s=5.0)
    http = httpx.AsyncClient(transport=_placers_http(fb))
    with trio.fail_after(40):
        async with http, trio.open_nursery() as n:
            relay, _ = await rack.start(n, 1)
            host = await _relay_host(n, tokens, relay, leader, http)
            with trio.fail_after(10):
                await poll(lambda: relay.copies.folded >= 2, 0.02)
            failures, connects = host.failures, relay.connects
            await leader.relays["r1"].aclose()   # (the leader stays: the relay dials it again)
            with trio.fail_after(10):
                await poll(lambda: host.failures > failures and relay.connects > connects and host.registered, 0.02)
            assert host.placer_url == "http://placer-a"
            assert host.statistics()["follower_copies"]["handovers"] == 0
            n.cancel_scope.cancel()
