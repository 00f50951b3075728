"""The placer enforces pinned racks (issue 42, finding 1): a registration into a rack other than
the node's pinned one (its certificate's, else an operator's approval) is refused and counted,
whichever path it came by; a relay hello naming another rack is refused even before the node
registered; with ``require_pinned_racks`` an unpinned node may register but not relay; and
``herd node approve`` round-trips through the real CLI and outlives a placer restart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from infra import pki, tls
from infra.auth import TokenSet, auth_header
from placer.service import PlacerService
from scheduler_link import enroll
from scheduler_link.frames import open_frames
from scheduler_link.heartbeat_wire import WireError
from scheduler_link.messages import NodeReport, RelayHello, TopologyPath

from .test_cli_job import herd, one_line
from .test_placer_service import cfg
from .test_placer_service_state import full, new_state

R0, R1 = "z1/b1/r0", "z1/b1/r1"


def _report(node: str, rack: str) -> bytes:
    z, b, r = rack.split("/")
    return msgspec.json.encode(NodeReport(node_id=node, boot_id="b", seq=0, full=True,
                                          control_url="https://127.0.0.1:1", topology=TopologyPath(zone=z, block=b,
                                                                                                  rack=r)))


def test_an_approval_pins_the_rack_of_every_registration_path() -> None:
    """On the state alone: whatever path a full report came by (it is applied by ``ingest``),
    it registers only into the approved rack; heartbeats of a node registered before are not
    touched, and the refusal is counted by its code."""
    st = new_state()
    assert st.approve_rack("a", "z/b/r2") is None          # not reported yet: nothing differs
    code, reply, _ = st.ingest("a", full("a"), 0.0)          # (full() reports z/b/r)
    assert (code, reply.ok, reply.error) == (403, False, "rack_mismatch")
    assert "a" not in st.nodes and st.counters["rack_refused_rack_mismatch"] == 1
    st.ingest("b", full("b"), 0.0)
    assert st.approve_rack("b", "z/b/r2") == "z/b/r"        # registered elsewhere: said, applies next time
    assert st.approve_rack("a", "z/b/r") is None
    assert st.ingest("a", full("a"), 1.0)[0] == 200
    code, reply, _ = st.ingest("b", full("b", seq=2), 1.0)
    assert (code, reply.error) == (403, "rack_mismatch")
    with pytest.raises(Exception, match="not a rack path"):
        st.approve_rack("c", "r0")


def _client(ca: pki.ThrowawayPKI, principal: str, url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=tls.client_context(ca.ca, ca.files(principal)), timeout=10, base_url=url)


async def test_a_certificate_pins_registration_and_relay_hello(tmp_path: Path, token_dir, tls_pki) -> None:
    """Mutual TLS, loopback: node n1's certificate pins rack r0. Its report into r1 is refused
    (403, ``rack_mismatch``) and counted, into r0 accepted. Node n2 (pinned to r0, not
    registered yet: before, a hello of an unregistered node was admitted provisionally for any
    rack) is refused as relay of r1; as relay of r0 it is admitted."""
    tokens = TokenSet.load(token_dir)
    for node in ("n1", "n2"):
        pki.issue_node(tls_pki.dir, node, days=30, rack=R0)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False), tokens)
            url = await n.start(svc.run)
            async with _client(tls_pki, "node:n1", url) as n1:
                r = await n1.post("/v1/nodes/n1/report", content=_report("n1", R1))
                assert r.status_code == 403 and r.json()["error"] == "rack_mismatch", r.text
                assert "n1" not in svc.state.nodes
                assert svc.state.counters["rack_refused_rack_mismatch"] == 1
                r = await n1.post("/v1/nodes/n1/report", content=_report("n1", R0))
                assert r.status_code == 200, r.text
            assert svc.state.nodes["n1"].rack_path == R0
            ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:n2"))
            with pytest.raises(WireError, match="rack_mismatch"):
                await open_frames(svc.wire_url or "", "", "n2", ssl_context=ctx, expect="placer",
                                  relay=RelayHello(racks=[R1], listen_url="tls://127.0.0.1:9"))
            assert svc.wire is not None and svc.wire.frames_refused == {"rack_mismatch": 1}
            assert svc.state.counters["rack_refused_rack_mismatch"] == 2
            ch = await open_frames(svc.wire_url or "", "", "n2", ssl_context=ctx, expect="placer",
                                   relay=RelayHello(racks=[R0], listen_url="tls://127.0.0.1:9"))
            await ch.aclose()
            n.cancel_scope.cancel()


async def test_require_pinned_racks_keeps_unpinned_nodes_from_relaying(tmp_path: Path, token_dir,
                                                                        tls_pki) -> None:
    """``require_pinned_racks``: n3 (a certificate without a rack) registers, but its relay
    hello is refused (``rack_unpinned``) until an operator approves its rack; an approval of
    another rack later ends its relaying."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, require_pinned_racks=True),
                                tokens)
            url = await n.start(svc.run)
            async with _client(tls_pki, "node:n3", url) as n3:
                assert (await n3.post("/v1/nodes/n3/report", content=_report("n3", R0))).status_code == 200
            ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:n3"))
            hello = RelayHello(racks=[R0], listen_url="tls://127.0.0.1:9")
            with pytest.raises(WireError, match="rack_unpinned"):
                await open_frames(svc.wire_url or "", "", "n3", ssl_context=ctx, expect="placer", relay=hello)
            assert svc.state.counters["rack_refused_rack_unpinned"] == 1
            async with _client(tls_pki, "operator", url) as op:
                r = await op.post("/v1/nodes/n3/approve", content=msgspec.json.encode({"rack": R0}))
                assert r.status_code == 200 and r.json()["pinned"] == {"rack": R0, "by": "approval"}, r.text
            ch = await open_frames(svc.wire_url or "", "", "n3", ssl_context=ctx, expect="placer", relay=hello)
            assert svc.relays.relay_for(R0) is not None
            # an approval of another rack stops the choice at once (its registration is in r0 still)
            async with _client(tls_pki, "operator", url) as op:
                r = await op.post("/v1/nodes/n3/approve", content=msgspec.json.encode({"rack": R1}))
                assert r.status_code == 200 and r.json()["registered_rack"] == R0, r.text
            assert svc.relays.relay_for(R0) is None
            await ch.aclose()
            n.cancel_scope.cancel()


async def test_herd_node_approve_round_trip_and_restart(tmp_path: Path, token_dir) -> None:
    """The real `herd` entry point against an in-process placer: approve, list, a refused
    registration into another rack, a bad rack as one line, and the approval after a restart."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        for round_ in range(2):
            async with trio.open_nursery() as n:
                svc = PlacerService(cfg(tmp_path), tokens)
                url = await n.start(svc.run)
                env = {"HERD_PLACER": url, "HERD_TOKEN_DIR": str(token_dir)}
                if round_ == 0:
                    rc, out, err = await herd(["node", "approve", "n9", "--rack", R0], env)
                    assert rc == 0 and out.startswith(f"node n9: rack {R0} approved"), (out, err)
                    rc, out, err = await herd(["node", "approve", "n9", "--rack", "r0"], env)
                    assert rc == 1 and "not a rack path" in one_line(err), err
                    rc, out, err = await herd(["node", "approve", "n9"], env)
                    assert rc == 1, err
                rc, out, err = await herd(["node", "approve", "--list", "--json"], env)
                assert rc == 0, err
                assert json.loads(out)["approvals"] == [{"node_id": "n9", "rack": R0, "registered_rack": None,
                                                         "certificate_rack": None}]
                async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.cluster), timeout=10) as c:
                    r = await c.post("/v1/nodes/n9/report", content=_report("n9", R1))
                    assert r.status_code == 403 and r.json()["error"] == "rack_mismatch", r.text
                    assert (await c.post("/v1/nodes/n9/report", content=_report("n9", R0))).status_code == 200
                rc, out, err = await herd(["node", "approve", "--list"], env)
                assert rc == 0 and out.splitlines()[2].split() == ["n9", R0, R0, "-"], out
                n.cancel_scope.cancel()


def test_an_enrolment_is_pinned_by_the_members_certificate(tmp_path: Path, token_dir, tls_pki) -> None:
    """A member enrolling through a relay (no handshake of its own with the placer): the
    certificate its enrolment carries pins its rack, so its full report into another rack is
    refused (``rack_mismatch``, nothing registered, no key in the answer); into its own, taken."""
    tokens = TokenSet.load(token_dir)
    pki.issue_node(tls_pki.dir, "m1", days=30, rack=R0)
    svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False), tokens)
    desk = svc.relays.enroll_desk()
    assert desk is not None
    member = enroll.client_from_files(tls_pki.files("node:m1"))
    now = time.time()

    def report(rack: str, seq: int) -> NodeReport:
        z, b, r = rack.split("/")
        return NodeReport(node_id="m1", boot_id="b", seq=seq, full=True, control_url="https://127.0.0.1:1",
                          topology=TopologyPath(zone=z, block=b, rack=r))
    e, _ = member.make(report(R1, 1), desk.cert, now=now)
    a = svc.relays.enroll_one(e, "relay0")
    assert (a.outcome, a.detail, a.sealed) == ("refused", "rack_mismatch", b""), a
    assert "m1" not in svc.state.nodes and svc.state.counters["rack_refused_rack_mismatch"] == 1
    e, p = member.make(report(R0, 2), desk.cert, now=now)
    a = svc.relays.enroll_one(e, "relay0")
    assert a.outcome == "enrolled" and member.open(p, a).node_id == "m1", a
    assert svc.state.nodes["m1"].rack_path == R0


async def test_an_approval_ends_a_provisional_relay_of_another_rack(tmp_path: Path, token_dir) -> None:
    """A relay admitted before it registered is offered to its rack's members provisionally;
    an approval of another rack ends that at once."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            await n.start(svc.run)
            ch = await open_frames(svc.wire_url or "", tokens.cluster or "", "early",
                                   relay=RelayHello(racks=[R0], listen_url="tcp://127.0.0.1:9"))
            assert svc.relays.provisional_url(R0, "early") == "tcp://127.0.0.1:9"
            assert svc.state.approve_rack("early", R1) is None
            assert svc.relays.provisional_url(R0, "early") is None
            await ch.aclose()
            n.cancel_scope.cancel()
