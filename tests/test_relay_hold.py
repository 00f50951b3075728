"""A member's hold on a rack relay with no connection to the placer, in virtual time
(``autojump_clock``): the shipped relay (agent.relay.Relay) and a member's AgentLink, joined by
in-memory streams; the placer is httpx's MockTransport (no sockets). A relay making its first
dial is kept ``DIAL_HOLD_FACTOR`` times longer than one that lost the placer, over one
connection to it; past the bound the member registers directly. The hold itself
(scheduler_link.relayhold) is checked pure."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import trio
import trio.testing

from agent.blobs import BlobCache
from agent.relay import Relay
from infra.auth import TokenSet
from scheduler_link.agent_link import AgentLink
from scheduler_link.enroll import client_from_files
from scheduler_link.frames import FrameChannel
from scheduler_link.heartbeat_wire import UPSTREAM_DOWN, Hello
from scheduler_link.messages import NodeReport, ReportReply
from scheduler_link.relayhold import DIAL_HOLD_FACTOR, RelayHold
from testing.waiting import poll
from tests.link_hooks import Hooks

HOLD_S = 30.0


# ---------------------------------------------------------------- the hold, pure

def test_a_dialling_relay_is_kept_longer_and_a_lost_one_as_long_as_configured() -> None:
    h = RelayHold(HOLD_S)
    assert h.until(100.0, dialling=True) == 100.0 + DIAL_HOLD_FACTOR * HOLD_S
    assert h.keep(100.0 + HOLD_S + 1, dialling=True)                 # past the lost bound: still kept
    assert not h.keep(100.0 + DIAL_HOLD_FACTOR * HOLD_S, dialling=True)
    h.clear()
    assert h.until(200.0, dialling=False) == 200.0 + HOLD_S and not h.keep(200.0 + HOLD_S, dialling=False)


def test_each_answer_is_held_to_its_own_bound_from_the_first_answer() -> None:
    """A relay that lost the placer and is dialling it again (a large fleet's placer restart:
    its turn in the handshake queue) is kept to the dialling bound; an answer between its dials
    to the lost one -- both counted from the hold's first answer, never from a later one."""
    h = RelayHold(HOLD_S)
    assert h.until(0.0, dialling=False) == HOLD_S         # lost: between dials
    assert h.until(20.0, dialling=True) == DIAL_HOLD_FACTOR * HOLD_S   # dialling again
    assert h.keep(HOLD_S + 10, dialling=True)             # past the lost bound, getting through: kept
    assert not h.keep(HOLD_S + 11, dialling=False)        # between dials past it: go directly
    h.clear()
    assert h.until(0.0, dialling=True) == DIAL_HOLD_FACTOR * HOLD_S
    assert not h.keep(DIAL_HOLD_FACTOR * HOLD_S, dialling=True)   # never past the dialling bound


def test_no_hold_configured_holds_nothing_and_a_stated_dial_bound_is_never_below_the_lost_one() -> None:
    assert not RelayHold(0.0).keep(5.0, dialling=True)
    assert RelayHold(HOLD_S, dialling_s=1.0).dialling_s == HOLD_S


# ---------------------------------------------------------------- a member and the shipped relay


class Placer:
    """The placer's HTTP route, as MockTransport calls it: the direct full reports, by time."""

    def __init__(self) -> None:
        self.direct: list[float] = []

    def __call__(self, req: httpx.Request) -> httpx.Response:
        rep = msgspec.json.decode(req.content, type=NodeReport)
        if rep.full:
            self.direct.append(trio.current_time())
        return httpx.Response(200, content=msgspec.json.encode(ReportReply(ok=True)))


class Upstream:
    """The relay's dial: refused while ``url`` is None or the placer is ``down``; else a frames
    connection over in-memory streams whose placer end the test closes (``lose``)."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.down = False
        self.queued: trio.Event | None = None   # set: a dial waits for it (the placer's handshake queue)
        self._placer_end: trio.abc.Stream | None = None

    def __call__(self) -> str | None:
        return self.url

    async def dial(self, url: str) -> FrameChannel:
        if self.queued is not None:
            await self.queued.wait()
        if self.down:
            raise OSError("connection refused")
        a, self._placer_end = trio.testing.memory_stream_pair()
        return FrameChannel(a, name="placer")

    async def lose(self) -> None:
        assert self._placer_end is not None
        await self._placer_end.aclose()
        self.down = True


class Members:
    """Members' connections to the relay, in memory: the relay's end served as its members
    listener serves one (``Relay.opened``), counted."""

    def __init__(self, relay: Relay, nursery: trio.Nursery) -> None:
        self.relay = relay
        self.nursery = nursery
        self.connects = 0

    async def connect(self, url: str, token: str, node_id: str) -> FrameChannel:
        self.connects += 1
        a, b = trio.testing.memory_stream_pair()
        theirs = FrameChannel(b, name=node_id)
        self.nursery.start_soon(theirs.run, self.relay.opened(Hello(token="", node_id=node_id), theirs))
        return FrameChannel(a, name="relay")


def _relay(token_dir: Path, upstream: Upstream) -> Relay:
    return Relay(node_id="r0n0", rack="z/b/r0", tokens=TokenSet.load(token_dir), listen=None, wire_url=upstream,
                 blobs=BlobCache(), heartbeat_s=1.0, keys=lambda: (None, None), backoff_max_s=1.0, dial=upstream.dial)


def _member(tls_pki, http: httpx.AsyncClient, members: Members) -> AgentLink:  # noqa: ANN001
    return AgentLink("http://placer", None, "m1", Hooks("m1"), heartbeat_s=1.0, use_wire=False, http=http,
                     enroll=client_from_files(tls_pki.files("node:m1")), enroll_relay_url="tcp://relay:1",
                     relay_connect=members.connect, relay_hold_s=HOLD_S)


@pytest.mark.parametrize("lost", [False, True])
async def test_a_member_keeps_a_dialling_relay_longer_than_one_that_lost_the_placer(
        token_dir: Path, tls_pki, autojump_clock, lost: bool) -> None:  # noqa: ANN001
    """A relay that has not been connected since it started (its first dial under way) is kept
    DIAL_HOLD_FACTOR x ``relay_hold_s`` from its first ``upstream_down``; one that was connected
    and lost the placer, ``relay_hold_s``. Held, the member neither registers with the placer nor
    opens a second connection to the relay; past the bound it registers directly at once."""
    placer, upstream = Placer(), Upstream()
    async with httpx.AsyncClient(transport=httpx.MockTransport(placer)) as http, trio.open_nursery() as n:
        relay = _relay(token_dir, upstream)
        await n.start(relay.run)
        if lost:   # connected once, then the placer went away (and refuses every dial since)
            upstream.url = "tcp://placer:1"
            await relay.upstream_ready.wait()
            await upstream.lose()
            await poll(lambda: relay.upstream is None, 0.01)
        assert relay.dialling is not lost
        members = Members(relay, n)
        link = _member(tls_pki, http, members)
        t0 = trio.current_time()
        await n.start(link.run)
        bound = HOLD_S if lost else DIAL_HOLD_FACTOR * HOLD_S
        await trio.sleep(bound - 1.0)
        assert placer.direct == [] and not link.registered and members.connects == 1
        assert link.relay_holds >= bound - 2 and link.relay_dial_holds == (0 if lost else link.relay_holds)
        await poll(lambda: link.registered, 0.01)
        assert len(placer.direct) == 1 and bound <= placer.direct[0] - t0 <= bound + 1.0
        assert link.enroll_refusals[UPSTREAM_DOWN] == link.relay_holds + 1 and link.enrolled == 0
        n.cancel_scope.cancel()


async def test_a_relay_dialling_again_after_a_loss_says_so_while_its_dial_is_in_flight(
        token_dir: Path, tls_pki, autojump_clock) -> None:  # noqa: ANN001
    """A relay that lost the placer says dialling while a dial to it is in flight (the restarted
    placer's handshake queue) and lost between dials: its member is kept past ``relay_hold_s``
    while the relay is getting through, up to the dialling bound, then registers directly."""
    placer, upstream = Placer(), Upstream()
    async with httpx.AsyncClient(transport=httpx.MockTransport(placer)) as http, trio.open_nursery() as n:
        relay = _relay(token_dir, upstream)
        await n.start(relay.run)
        upstream.url = "tcp://placer:1"
        await relay.upstream_ready.wait()
        await upstream.lose()
        await poll(lambda: relay.upstream is None, 0.01)
        await trio.sleep(0.5)   # (refused: between dials)
        assert not relay.dialling
        upstream.queued = trio.Event()   # the placer is back; the relay's dial waits its turn
        await poll(lambda: relay.dialling, 0.01)
        members = Members(relay, n)
        link = _member(tls_pki, http, members)
        t0 = trio.current_time()
        await n.start(link.run)
        await trio.sleep(HOLD_S + 10.0)
        assert placer.direct == [] and not link.registered and members.connects == 1   # past hold_s: kept
        await poll(lambda: link.registered, 0.01)
        assert len(placer.direct) == 1
        assert DIAL_HOLD_FACTOR * HOLD_S <= placer.direct[0] - t0 <= DIAL_HOLD_FACTOR * HOLD_S + 1.0
        upstream.queued.set()   # its turn: refused (the placer still down in this test): between dials again
        await poll(lambda: not relay.dialling, 0.01)
        n.cancel_scope.cancel()
