"""Enrolment through the rack relay, end to end under mutual TLS: the real placer service, the
real relay (agent.relay.Relay) and members' AgentLinks. A member with no key registers through
its relay with no handshake at the placer, and its later relayed reports verify; bad
enrolments are refused with a structured outcome, counted, and nothing of them is ingested."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from agent.blobs import BlobCache
from agent.relay import Relay
from infra import tls
from infra.auth import TokenSet
from infra.pki import CA, Revocations, ThrowawayPKI, make_ca
from placer.service import PlacerService
from scheduler_link.agent_link import AgentLink
from scheduler_link.enroll import BUDGET_BURST, BUDGET_PER_S, EnrollClient, client_from_files
from scheduler_link.frames import FrameChannel, decode_payload, open_frames
from scheduler_link.messages import (
    Enroll,
    EnrollAnswer,
    Frame,
    NodeReport,
    RackEnrolls,
    TopologyPath,
    WorkloadStatus,
)
from testing.fake_agent import FakeAgent
from testing.waiting import poll

from .test_placer_service import cfg

RACK = "z1/b1/r0"


@dataclass
class Rig:
    svc: PlacerService
    url: str
    relay: Relay
    relay_url: str
    relay_link: AgentLink
    pki: ThrowawayPKI
    tokens: TokenSet
    nursery: trio.Nursery

    @property
    def handshakes(self) -> int:
        """TLS handshakes the placer completed (its API and its framed channel)."""
        assert self.svc.wire is not None
        return int(self.svc.wire.statistics()["tls_handshakes"]) + self.svc.app.tls_handshakes

    def refused(self, outcome: str) -> int:
        desk = self.svc.relays.enroll_desk()
        assert desk is not None
        return desk.refused.get(outcome, 0)

    async def member(self, node: str, *, relay_url: str | None = None, kept: list[str] | None = None,
                     nursery: trio.Nursery | None = None, agent: FakeAgent | None = None) -> AgentLink:
        ctx = tls.client_context(self.pki.ca, self.pki.files(f"node:{node}"))
        agent = agent or FakeAgent(node, self.tokens, rack="r0")
        link = AgentLink(self.url, None, node, agent, heartbeat_s=0.1,
                         ssl_context=ctx, enroll=client_from_files(self.pki.files(f"node:{node}")),
                         enroll_relay_url=relay_url or self.relay_url,
                         on_relay=kept.append if kept is not None else None)
        agent.link = link
        await (nursery or self.nursery).start(link.run)
        return link

    def client(self, node: str, *, keyed: bool = True) -> EnrollClient:
        """``node``'s client from its files: keyed (its node.enrol), or by ECDH as a node whose
        certificate came with no enrolment key."""
        c = client_from_files(self.pki.files(f"node:{node}"))
        return c if keyed else EnrollClient(c.ca, c._key, c.cert)

    async def enrol(self, e: Enroll, *, conn: str | None = None) -> EnrollAnswer:
        """``e`` through the relay as a member's connection of ``conn`` (default: its node) sends it."""
        got = self.relay.member_enroll(conn or e.node_id, e)
        return got if isinstance(got, EnrollAnswer) else await got

    async def placer_cert(self) -> bytes:
        pc = await self.relay.member_enroll_key()
        assert pc.cert, pc.error
        return pc.cert


def _report(node: str, boot: str = "b1", seq: int = 1) -> NodeReport:
    return NodeReport(node_id=node, boot_id=boot, seq=seq, full=True, control_url="http://127.0.0.1:9",
                      topology=TopologyPath(zone="z1", block="b1", rack="r0"))


@asynccontextmanager
async def rig(tmp_path: Path, token_dir: Path, pki: ThrowawayPKI) -> AsyncIterator[Rig]:
    tokens = TokenSet.load(token_dir)
    async with trio.open_nursery() as n:
        svc = PlacerService(cfg(tmp_path, tls_dir=str(pki.dir), insecure=False, ca_dir=str(pki.dir)), tokens)
        url = await n.start(svc.run)
        # the relay node registers directly (its own connection: its keys), then relays
        rctx = tls.client_context(pki.ca, pki.files("node:r0n0"))
        rlink = AgentLink(url, None, "r0n0", FakeAgent("r0n0", tokens, rack="r0"), heartbeat_s=0.1, ssl_context=rctx)
        await n.start(rlink.run)
        await poll(lambda: rlink.mac_key is not None, 0.02)
        sec = tls.daemon_security(pki.node_dir("r0n0"), "node", insecure=False)
        relay = Relay(node_id="r0n0", rack=RACK, tokens=tokens, listen="127.0.0.1:0", wire_url=lambda: svc.wire_url,
                      blobs=BlobCache(), heartbeat_s=0.1, keys=lambda: (rlink.mac_key, rlink.placer_key),
                      security=sec)
        relay_url = await n.start(relay.run)
        await relay.upstream_ready.wait()
        r = Rig(svc, url, relay, relay_url, rlink, pki, tokens, n)
        assert r.handshakes >= 2      # the relay node's registration, the relay's connection up
        yield r
        n.cancel_scope.cancel()


async def test_a_member_enrols_through_its_relay_without_a_handshake_at_the_placer(tmp_path: Path, token_dir,
                                                                                    tls_pki):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            await poll(lambda: r.svc.relays.relay_for(RACK) is not None, 0.02)
            before = r.handshakes
            kept: list[str] = []
            link = await r.member("m1", kept=kept)
            await poll(lambda: link.registered, 0.02)
            assert link.enrolled == 1 and link.enroll_failures == 0
            assert link.mac_key == r.svc.state.mac_key("m1", link.boot_id)      # the key, sealed to it
            assert link.placer_key == r.svc.signer.public
            assert r.svc.epoch >= 1 and link.epochs.highest == r.svc.epoch   # the epoch, under its MAC
            assert "m1" in r.svc.state.nodes and r.svc.state.nodes["m1"].boot_id == link.boot_id
            assert r.handshakes == before                                          # no handshake for it
            assert r.relay.statistics()["enrolls_forwarded"] == 1
            # its later reports go through the relay with its MAC, and verify
            seq = r.svc.state.nodes["m1"].last_seq
            link.request_full_report()
            await poll(lambda: r.svc.state.nodes["m1"].last_seq > seq + 2, 0.02)
            assert r.svc.state.counters["bad_macs"] == 0
            assert link.statistics()["relay_url"] == r.relay_url and link.full_reports_sent >= 2
            assert r.handshakes == before
            assert kept == [] and link.enrolled == 1   # (the relay it came through is the one remembered)


async def test_a_member_remembers_its_relay_and_falls_back_when_enrolment_fails(tmp_path: Path, token_dir,
                                                                                   tls_pki):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            await poll(lambda: r.svc.relays.relay_for(RACK) is not None, 0.02)
            kept: list[str] = []
            link = await r.member("m2", relay_url="tls://127.0.0.1:1", kept=kept)   # nothing there
            await poll(lambda: link.registered and link.mac_key is not None, 0.02)
            assert link.enrolled == 0 and link.enroll_refusals == {"unavailable": 1}
            await poll(lambda: link.statistics()["relay_url"] == r.relay_url, 0.02)
            assert kept == [r.relay_url]      # the relay the placer named, for the next boot


def _der(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return bytes(cert.public_bytes(serialization.Encoding.DER))


def _forged_by_the_relay(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """The relay makes one up for another node with its own certificate (by ECDH)."""
    return r.client("r0n0", keyed=False).make(_report("victim"), cert, now=time.time())[0], "victim"


def _forged_by_the_relay_keyed(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """... or keyed, with its own enrolment key and certificate fields."""
    return r.client("r0n0").make(_report("victim"), cert, now=time.time())[0], "victim"


def _victims_certificate_relays_key(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """... or with the victim's certificate (it saw it go by) and its own key."""
    vic = r.client("victim")
    return EnrollClient(vic.ca, r.client("r0n0")._key, vic.cert).make(_report("victim"), cert, now=time.time())[0], \
        "victim"


def _report_changed(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """A real enrolment whose report the relay changed: a wrong MAC."""
    e, _ = r.client("victim").make(_report("victim"), cert, now=time.time())
    return msgspec.structs.replace(e, report=msgspec.Raw(msgspec.msgpack.encode(_report("victim", seq=7)))), "victim"


def _not_from_the_ca(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    key, rogue = CA(*make_ca()).issue("node:m3")
    return EnrollClient(r.client("m3").ca, key, _der(rogue)).make(_report("m3"), cert, now=time.time())[0], "m3"


def _another_nodes_certificate(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """A member's enrolment naming itself, with another node's certificate and key (by ECDH)."""
    return r.client("m4b", keyed=False).make(_report("m4"), cert, now=time.time())[0], "m4"


def _another_nodes_enrolment_key(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """... or keyed, with another node's enrolment key and certificate fields."""
    return r.client("m4b").make(_report("m4"), cert, now=time.time())[0], "m4"


def _revoked(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    Revocations(r.pki.dir).revoke("m5", now=time.time())
    r.svc._refresh_revoked(time.time())
    return r.client("m5").make(_report("m5"), cert, now=time.time())[0], "m5"


def _malformed(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    e, _ = r.client("m6").make(_report("m6"), cert, now=time.time())
    return msgspec.structs.replace(e, nonce=b"x"), "m6"


def _oversized(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    e, _ = r.client("m6").make(_report("m6"), cert, now=time.time())
    return msgspec.structs.replace(e, cert=b"x" * 8000), "m6"


def _too_old(r: Rig, cert: bytes) -> tuple[Enroll, str]:
    """Made an hour ago (refused on its time, before anything else is looked at)."""
    e, _ = r.client("m7").make(_report("m7"), cert, now=time.time())
    return msgspec.structs.replace(e, at=e.at - 3600), "m7"


@pytest.mark.parametrize("bad, outcome", [
    (_forged_by_the_relay, "bad_certificate"), (_forged_by_the_relay_keyed, "bad_mac"),
    (_victims_certificate_relays_key, "bad_mac"), (_another_nodes_enrolment_key, "bad_mac"),
    (_report_changed, "bad_mac"), (_not_from_the_ca, "not_from_ca"), (_another_nodes_certificate, "bad_certificate"),
    (_revoked, "revoked"), (_malformed, "malformed"), (_oversized, "oversized"), (_too_old, "replay")],
    ids=lambda x: getattr(x, "__name__", x).strip("_"))
async def test_a_bad_enrolment_is_refused_counted_and_not_ingested(tmp_path: Path, token_dir, tls_pki, bad: Any,
                                                                   outcome: str):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            cert = await r.placer_cert()
            e, node = bad(r, cert)
            got = await r.enrol(e, conn=node)
            assert got.outcome == outcome and not got.sealed and got.reply is None
            assert r.refused(outcome) == 1 and r.svc.relays.enrolled == 0
            assert node not in r.svc.state.nodes                         # nothing ingested
            assert r.relay.statistics()["enrolls_refused"] == {outcome: 1}
            good, _ = r.client("ok").make(_report("ok"), cert, now=time.time())
            assert (await r.enrol(good)).outcome == "enrolled"         # nothing crashed: the next is taken


async def test_a_member_connection_enrolling_another_node_is_refused_by_the_relay(tmp_path: Path, token_dir,
                                                                                 tls_pki):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            e, _ = r.client("m8").make(_report("m8"), await r.placer_cert(), now=time.time())
            assert (await r.enrol(e, conn="m9")).outcome == "wrong_node"
            assert r.relay.statistics()["enrolls_refused"] == {"wrong_node": 1}
            assert r.relay.statistics()["enrolls_forwarded"] == 0 and "m8" not in r.svc.state.nodes


async def test_a_replayed_enrolment_is_refused_and_changes_nothing(tmp_path: Path, token_dir, tls_pki):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            e, _ = r.client("m10").make(_report("m10", seq=3), await r.placer_cert(), now=time.time())
            assert (await r.enrol(e)).outcome == "enrolled"
            rec = r.svc.state.nodes["m10"]
            rec.last_seq = 9                     # (the node has reported on since)
            assert (await r.enrol(e)).outcome == "replay"
            assert r.refused("replay") == 1 and r.svc.state.nodes["m10"] is rec and rec.last_seq == 9
            e2, _ = r.client("m10").make(_report("m10", seq=3), await r.placer_cert(), now=time.time())
            assert (await r.enrol(e2)).outcome == "replay"     # a fresh nonce, but not newer than its boot's
            assert r.refused("replay") == 2 and r.svc.state.nodes["m10"] is rec
            # the node restarted (a new boot): the old boot's enrolment replayed is refused by its nonce
            e3, _ = r.client("m10").make(_report("m10", boot="b2"), await r.placer_cert(), now=time.time())
            assert (await r.enrol(e3)).outcome == "enrolled"
            rec = r.svc.state.nodes["m10"]
            assert (await r.enrol(e)).outcome == "replay"
            assert r.refused("replay") == 3 and r.svc.state.nodes["m10"] is rec and rec.boot_id == "b2"


async def test_an_oversized_or_malformed_enrolment_frame_costs_its_sender_only(tmp_path: Path, token_dir, tls_pki):
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:m7"))
            # to the relay: a member's frame over its bound closes that connection, nothing else
            ch = await open_frames(r.relay_url, "", "m7", ssl_context=ctx, expect="node")
            async with trio.open_nursery() as n:
                n.start_soon(ch.run, _none)
                with pytest.raises(Exception):  # noqa: B017  (the connection is closed under the call)
                    await ch.call("enroll", {"node_id": "m7", "junk": b"x" * (200 << 10)}, timeout_s=5)
                n.cancel_scope.cancel()
            await ch.aclose()
            # a malformed enrolment is answered with an error; the relay keeps serving
            ch = await open_frames(r.relay_url, "", "m7", ssl_context=ctx, expect="node")
            async with trio.open_nursery() as n:
                n.start_soon(ch.run, _none)
                with pytest.raises(Exception):  # noqa: B017  (CallFailed: the payload does not decode)
                    await ch.call("enroll", {"node_id": 7}, timeout_s=5)
                pc = await ch.call("enroll_key", {}, timeout_s=5)
                assert pc.type == "placer_cert"
                n.cancel_scope.cancel()
            await ch.aclose()
            # to the placer: a batch over the connection's entry bound ends that connection only
            up = r.relay.upstream
            assert up is not None
            cert = await r.placer_cert()
            e, _ = r.client("m8").make(_report("m8"), cert, now=time.time())
            with pytest.raises(Exception):  # noqa: B017
                await up.call("enrolls", RackEnrolls(rack=RACK, enrolls=[e] * 300), timeout_s=5)
            assert "m8" not in r.svc.state.nodes
            await poll(lambda: r.relay.upstream is not None and r.relay.upstream is not up, 0.02)
            got = await r.enrol(e)            # the relay is back up, the same enrolment is taken
            assert got.outcome == "enrolled"
            link_ok = decode_payload(Frame(type="enrolled", payload=msgspec.Raw(msgspec.msgpack.encode(got))),
                                     EnrollAnswer)
            assert link_ok.sealed


def _none(ch: FrameChannel, f: Frame) -> None:
    raise ValueError("no requests expected")


async def test_a_restarted_agent_enrols_its_new_boot_through_its_relay(tmp_path: Path, token_dir, tls_pki):
    """An agent restarted (a new boot, the relay remembered): its new boot registers through
    the relay with no handshake, replacing the old boot's record; its new key verifies."""
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            await poll(lambda: r.svc.relays.relay_for(RACK) is not None, 0.02)
            async with trio.open_nursery() as first:     # the agent before its restart
                old = await r.member("m9", nursery=first)
                await poll(lambda: old.registered and old.enrolled == 1, 0.02)
                first.cancel_scope.cancel()
            old_boot = r.svc.state.nodes["m9"].boot_id
            before = r.handshakes
            link = await r.member("m9")
            await poll(lambda: link.registered and r.svc.state.nodes["m9"].boot_id == link.boot_id, 0.02)
            assert link.boot_id != old_boot and link.enrolled == 1
            assert link.mac_key == r.svc.state.mac_key("m9", link.boot_id)
            seq = r.svc.state.nodes["m9"].last_seq
            await poll(lambda: r.svc.state.nodes["m9"].last_seq > seq + 2, 0.02)
            assert r.handshakes == before and r.svc.state.counters["bad_macs"] == 0



async def test_a_connection_over_its_enrolment_budget_is_answered_busy(tmp_path: Path, token_dir, tls_pki):
    """Each check costs the placer a CA signature and an ECDH: one connection sending
    enrolments without end gets ``busy`` past its burst, each counted, none checked."""
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            up = r.relay.upstream
            assert up is not None
            e, _ = r.client("m10").make(_report("m10"), await r.placer_cert(), now=time.time())
            outcomes: list[str] = []
            t0 = time.monotonic()
            for _ in range(3):
                f = await up.call("enrolls", RackEnrolls(rack=RACK, enrolls=[e] * 256), timeout_s=10)
                outcomes += [a.outcome for a in decode_payload(f, list[EnrollAnswer])]
            elapsed = time.monotonic() - t0
            assert outcomes[0] == "enrolled" and set(outcomes[1:512]) == {"replay"}
            busy = outcomes.count("busy")
            # the bucket holds BUDGET_BURST and refills BUDGET_PER_S a second: on a loaded host the
            # three batches take seconds, so the bound counts what refilled meanwhile
            assert busy >= 3 * 256 - BUDGET_BURST - math.ceil(BUDGET_PER_S * elapsed) and busy > 0
            assert set(outcomes[-busy:]) == {"busy"}
            assert outcomes.count("replay") == len(outcomes) - 1 - busy   # every one checked but the first
            assert r.refused("busy") == busy and r.refused("replay") == len(outcomes) - 1 - busy


async def test_fencing_stops_in_an_enrolment_answer_carry_the_placers_mac(tmp_path: Path, token_dir, tls_pki):
    """A restarted agent still running a workload whose gang the placer does not know: the
    answer to its enrolment tells it to stop it, and the stop passes the relay with the
    placer's MAC in the member's new key (a stop without one would be refused)."""
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            agent = FakeAgent("m11", r.tokens, rack="r0")
            agent.workloads["ghost-w"] = WorkloadStatus(workload_id="ghost-w", job_id="ghost", state="running",
                                                        gpus=[agent.uuids[0]])
            link = await r.member("m11", agent=agent)
            await poll(lambda: agent.workloads["ghost-w"].state == "preempted", 0.02)
            assert link.enrolled == 1 and link.stops_received == 1 and link.stops_refused == 0


class _Upstream:
    """Where a relay finds the placer (None: not yet)."""

    def __init__(self) -> None:
        self.url: str | None = None

    def __call__(self) -> str | None:
        return self.url


async def test_a_member_holds_on_to_a_relay_without_the_placer_then_enrols_through_it(tmp_path: Path, token_dir,
                                                                                       tls_pki):
    """The relay it kept has no connection to the placer yet (the placer restarting): the
    member neither handshakes with the placer nor gives the relay up; once the relay is
    connected the member enrols through it."""
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            upstream = _Upstream()
            relay = Relay(node_id="r0n1", rack=RACK, tokens=r.tokens, listen="127.0.0.1:0", wire_url=upstream,
                          blobs=BlobCache(), heartbeat_s=0.1, keys=lambda: (None, None), backoff_max_s=0.1,
                          security=tls.daemon_security(tls_pki.node_dir("r0n1"), "node", insecure=False))
            url = await r.nursery.start(relay.run)
            before = r.handshakes
            link = await r.member("m12", relay_url=url)
            await poll(lambda: link.relay_holds >= 3, 0.02)
            assert not link.registered and link.enrolled == 0 and r.handshakes == before
            upstream.url = r.svc.wire_url
            await poll(lambda: link.registered, 0.02)
            assert link.enrolled == 1 and link.enroll_refusals["upstream_down"] >= 3
            assert "unavailable" not in link.enroll_refusals
            assert r.handshakes == before + 1          # the relay's own connection up, none for the member


async def test_enrolments_wait_while_a_delivery_is_out_then_are_answered(tmp_path: Path, token_dir, tls_pki):
    """Acks first: while the placer delivers, a relay's enrolments are held back with its
    reports and applied, in order, once the delivery is in."""
    with trio.fail_after(30):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            cert = await r.placer_cert()
            hub = r.svc.relays
            hub._defer_reports()          # (a delivery out, as _RoundDriver.run marks it)
            answers: list[EnrollAnswer] = []

            async def enrol(node: str) -> None:
                e, _ = r.client(node).make(_report(node), cert, now=time.time())
                answers.append(await r.enrol(e))
            async with trio.open_nursery() as n:
                for node in ("m13", "m14"):
                    n.start_soon(enrol, node)
                await poll(lambda: len(hub._deferred) >= 1, 0.01)
                await trio.sleep(0.2)
                assert answers == [] and not {"m13", "m14"} & set(r.svc.state.nodes)
                hub._release_reports()        # the delivery is in
            assert sorted(a.node_id for a in answers) == ["m13", "m14"]
            assert {a.outcome for a in answers} == {"enrolled"} and {"m13", "m14"} <= set(r.svc.state.nodes)


async def test_a_relays_other_frames_are_answered_while_its_enrolment_batch_is_worked_on(tmp_path: Path, token_dir,
                                                                                          tls_pki):
    """A batch of enrolments is worked on in slices with the event loop let go between them: a
    ping the relay sends right after a batch of 48 fresh enrolments (a CA check and an ECDH
    each) is answered before the batch is (the answers' order as the relay reads them).
    Worked on in one go, the batch held the loop and the relays' beats behind it (nodes marked
    lost in a 131,072-node storm)."""
    with trio.fail_after(60):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            up = r.relay.upstream
            assert up is not None
            cert = await r.placer_cert()
            batch = [r.client(f"s{i}").make(_report(f"s{i}"), cert, now=time.time())[0] for i in range(48)]
            order: list[str] = []
            done = trio.Event()

            def answered(what: str) -> Any:
                def fn(f: Any) -> None:
                    order.append(what if f is not None and f.type != "error" else f"{what}:failed")
                    if len(order) == 2:
                        done.set()
                return fn
            rid, data = up.prepare("enrolls", RackEnrolls(rack=RACK, enrolls=batch))
            up.call_cb(rid, data, answered("enrolls"))
            rid, data = up.prepare("ping", {})
            up.call_cb(rid, data, answered("ping"))
            await done.wait()
            assert order == ["ping", "enrolls"], order


async def test_enrolment_batches_are_worked_on_one_at_a_time_first_come_first_served(tmp_path: Path, token_dir,
                                                                                       tls_pki):
    """Three relays' batches in flight at once (the hub's handler, as three connections' frames
    start it): each is done before the next is begun, in arrival order. Worked on by turns
    (each a 10 ms slice at a time), every batch of a storm ended with the storm, later than
    relays and members waited, and they registered directly: a handshake each (45,771 in one
    131,072-node cold start)."""
    with trio.fail_after(60):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            hub = r.svc.relays
            desk = hub.enroll_desk()
            assert desk is not None
            cert = await r.placer_cert()
            batches = [[r.client(f"q{b}-{i}").make(_report(f"q{b}-{i}"), cert, now=time.time())[0]
                        for i in range(64)] for b in range(3)]
            taken0 = desk.taken
            done: list[tuple[int, int]] = []

            async def one(b: int) -> None:
                kind, answers = await hub._enroll_batch(batches[b], len(batches[b]), "r0n0")
                assert kind == "enrolls_reply" and all(a.outcome == "enrolled" for a in answers), answers
                done.append((b, desk.taken - taken0))
            assert hub.heard_until() is None
            async with trio.open_nursery() as n:
                async with hub._enroll_turn:   # (held here: all three come and wait their turn)
                    before = r.svc.clock()
                    for b in range(3):
                        n.start_soon(one, b)
                        await trio.lowlevel.checkpoint()   # (in this order)
                    await trio.testing.wait_all_tasks_blocked()   # (all three waiting their turn)
                    assert len(hub._enroll_waiting) == 3
                    # while batches wait, no node is judged silent past the oldest one's arrival
                    first = hub.heard_until()
                    assert first is not None and before <= first <= r.svc.clock(), (before, first)
                    assert done == []
            assert done == [(0, 64), (1, 128), (2, 192)], done
            assert hub.heard_until() is None
