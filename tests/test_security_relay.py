"""Who may be a rack's relay (issue 42, finding 1): a node relays only for the rack it is
registered in (placer.relaypolicy); a member follows only the relay the placer named over
its own connection, takes a relayed heartbeat interval only within bounds of the placer's
own, and checks with the placer directly when a relay has passed on nothing the placer
vouched for in a while (scheduler_link.agent_link)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from infra.auth import TokenSet
from placer import relaypolicy
from placer.service import PlacerService
from scheduler_link.agent_link import RELAYED_INTERVAL_FLOOR, relayed_interval
from scheduler_link.frames import FrameChannel, open_frames
from scheduler_link.heartbeat_wire import HeartbeatServer, Hello, WireError, WireReply
from scheduler_link.messages import Frame, NodeReport, RelayHello, ReportReply
from testing.fake_agent import FakeAgent
from testing.waiting import poll

from .test_placer_service import cfg

R0, R1 = "z1/b1/r0", "z1/b1/r1"


def test_a_hello_may_name_only_the_rack_the_node_registered_in():
    assert relaypolicy.check_hello("n", [], "z/b/r0") is None
    assert relaypolicy.check_hello("n", ["z/b/r0"], "z/b/r0") is None
    assert relaypolicy.check_hello("n", ["z/b/r0"], None) is None          # not registered yet: provisional
    r = relaypolicy.check_hello("n", ["z/b/r0"], "z/b/r1")
    assert r is not None and r.code == "rack_mismatch"
    r = relaypolicy.check_hello("n", ["z/b/r1", "z/b/r0"], "z/b/r1")
    assert r is not None and r.code == "racks_many"


class _Rec:
    def __init__(self, rack: str) -> None:
        self.rack_path = rack


def test_a_candidate_is_chosen_only_while_registered_in_that_rack():
    assert relaypolicy.may_relay("z/b/r0", _Rec("z/b/r0"))
    assert not relaypolicy.may_relay("z/b/r0", _Rec("z/b/r1"))
    assert not relaypolicy.may_relay("z/b/r0", None)


async def test_a_node_naming_another_rack_is_refused_and_that_racks_members_stay_put(tmp_path: Path, token_dir):
    """The reproduction: an extra agent registered in rack1 names rack0 in its frames hello.
    It is refused with a reason; rack0 gets no relay, and its members, sending full reports
    meanwhile, keep reporting to the placer."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            members = [FakeAgent(f"n{i}", tokens, rack="r0") for i in range(2)]
            hostile = FakeAgent("evil", tokens, rack="r1")
            for a in [*members, hostile]:
                await n.start(a.run, url)
            await poll(lambda: all(k in svc.state.nodes for k in ("n0", "n1", "evil")), 0.02)
            with pytest.raises(WireError) as e:
                await open_frames(svc.wire_url, tokens.cluster or "", "evil",
                                  relay=RelayHello(racks=[R0], listen_url="tcp://127.0.0.1:9"))
            assert "rack_mismatch" in str(e.value)
            assert svc.wire is not None and svc.wire.frames_refused == {"rack_mismatch": 1}
            assert svc.relays.relay_for(R0) is None
            for a in members:
                assert a.link is not None
                a.link.request_full_report()
            full0 = [a.link.full_reports_sent for a in members if a.link is not None]
            await poll(lambda: all(a.link is not None and a.link.full_reports_sent > f
                                   for a, f in zip(members, full0, strict=True)), 0.02)
            assert [a.link.statistics()["relay_url"] for a in members if a.link is not None] == [None, None]
            assert svc.relays.relay_url_for("n0", R0) is None
            # its own rack it may relay for
            ch = await open_frames(svc.wire_url, tokens.cluster or "", "evil",
                                   relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
            assert svc.relays.relay_for(R1) is not None and svc.relays.relay_for(R0) is None
            await ch.aclose()
            n.cancel_scope.cancel()


async def test_a_candidate_that_registers_in_another_rack_is_not_chosen(tmp_path: Path, token_dir):
    """Admitted before it registered (provisionally, for the rack it named), then registered
    elsewhere: the hub does not choose it for the rack it named."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            ch = await open_frames(svc.wire_url, tokens.cluster or "", "late",
                                   relay=RelayHello(racks=[R0], listen_url="tcp://127.0.0.1:9"))
            late = FakeAgent("late", tokens, rack="r1")
            await n.start(late.run, url)
            await poll(lambda: "late" in svc.state.nodes, 0.02)
            assert svc.relays.relay_for(R0) is None
            await ch.aclose()
            n.cancel_scope.cancel()


# ------------------------------------------------------------------ the member's side


def test_a_relayed_interval_is_clamped_to_the_placers_own():
    assert relayed_interval(0.01, 5.0) == 5.0 * RELAYED_INTERVAL_FLOOR
    assert relayed_interval(3600.0, 5.0) == 5.0
    assert relayed_interval(4.0, 5.0) == 4.0


class _Liar:
    """A hostile relay's members listener: every report is answered 200 by the relay itself,
    with an interval of an hour and another relay named; nothing ever comes from the placer."""

    def __init__(self, names: str = "tcp://127.0.0.1:1") -> None:
        self.reports: list[NodeReport] = []
        self.names = names
        self.opens = 0

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        self.opens += 1
        return self._frame

    def closed(self, channel: FrameChannel) -> None:
        pass

    def _frame(self, ch: FrameChannel, f: Frame) -> Any:
        from scheduler_link.frames import decode_payload
        if f.type == "report":
            self.reports.append(decode_payload(f, NodeReport))
            return "reply", WireReply(status=200, reply=ReportReply(heartbeat_interval_s=3600.0,
                                                                    relay_url=self.names))
        return "ping", None


async def test_a_member_held_by_a_relay_that_passes_nothing_on_goes_to_the_placer(tmp_path: Path, token_dir,
                                                                                   autojump_clock):
    """The placer names a relay (over the member's own connection); the relay answers every
    heartbeat itself, asks for an hour between them and names another relay. The member keeps
    the placer's interval's bounds, does not follow the other relay, and after
    ``relay_trust_intervals`` intervals with nothing from the placer reports to it directly."""
    tokens = TokenSet.load(token_dir)
    other = _Liar()   # the relay the liar names
    other_server = HeartbeatServer(tokens, lambda node, rep: (400, ReportReply(ok=False)), frames=other)
    with trio.fail_after(600):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, heartbeat_s=1.0), tokens, clock=trio.current_time)
            url = await n.start(svc.run)
            liar = _Liar(await n.start(other_server.run, "127.0.0.1:0"))
            server = HeartbeatServer(tokens, lambda node, rep: (400, ReportReply(ok=False)), frames=liar)
            relay_url = await n.start(server.run, "127.0.0.1:0")
            svc.relays.relay_url_for = lambda node_id, rack: relay_url   # type: ignore[method-assign]  # the placer names it
            member = FakeAgent("m0", tokens, rack="r0")
            await n.start(member.run, url)
            link = member.link
            assert link is not None
            link.relay_trust_intervals = 10
            await poll(lambda: link.statistics()["relay_url"] == relay_url, 0.05)
            t0 = trio.current_time()
            await poll(lambda: len(liar.reports) >= 3, 0.05)
            assert link.heartbeat_s <= link.placer_heartbeat_s            # not an hour
            assert link.statistics()["relay_url"] == relay_url
            link.request_full_report()   # answered by the liar, naming the other relay
            await poll(lambda: any(r.full for r in liar.reports), 0.05)
            await trio.sleep(3 * link.placer_heartbeat_s)
            assert other.opens == 0 and link.relay_urls_ignored >= 1   # not followed
            await poll(lambda: link.relay_rechecks >= 1, 0.05)
            assert trio.current_time() - t0 >= 9 * link.placer_heartbeat_s   # (the last vouched: a direct answer)
            assert other.opens == 0
            n.cancel_scope.cancel()


async def test_with_tls_an_agent_with_its_own_certificate_cannot_relay_for_another_rack(tmp_path: Path, token_dir,
                                                                                      tls_pki):
    """The reproduction over mutual TLS: every node holds its own certificate; the extra one,
    registered in rack1, names rack0 in its hello (its certificate matches the hello's node
    id: that check passes) and is refused for the rack; rack0's members stay with the placer."""
    from infra import tls
    from scheduler_link.agent_link import AgentLink

    tokens = TokenSet.load(token_dir)
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir)),
                                tokens)
            url = await n.start(svc.run)
            links = {}
            for node, rack in [("n0", "r0"), ("n1", "r0"), ("evil", "r1")]:
                ctx = tls.client_context(tls_pki.ca, tls_pki.files(f"node:{node}"))
                links[node] = AgentLink(url, None, node, FakeAgent(node, tokens, rack=rack), heartbeat_s=0.1,
                                        ssl_context=ctx)
                await n.start(links[node].run)
            await poll(lambda: all(k in svc.state.nodes for k in links), 0.02)
            evil_ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:evil"))
            with pytest.raises(WireError, match="rack_mismatch"):
                await open_frames(svc.wire_url, "", "evil", relay=RelayHello(racks=[R0], listen_url="tls://127.0.0.1:9"),
                                  ssl_context=evil_ctx, expect="placer")
            assert svc.relays.relay_for(R0) is None
            full0 = {k: links[k].full_reports_sent for k in ("n0", "n1")}
            for k in full0:
                links[k].request_full_report()
            await poll(lambda: all(links[k].full_reports_sent > f for k, f in full0.items()), 0.02)
            assert [links[k].statistics()["relay_url"] for k in full0] == [None, None]
            n.cancel_scope.cancel()
