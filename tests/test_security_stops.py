"""Issue 42, finding 8, as an attack: a relay (or anyone on the path) holds a stop part the
placer signed and replays it later -- after the node's agent restarted (a new boot), after the
part's expiry, or naming a later attempt of its job. The stop is built by the placer's own state
(a job placed and cancelled), signed as a rack bundle is, and handed to a real part acceptor
over a real supervisor running the pod: the replays are refused with a structured outcome
(``expired``, ``refused_spec``) and the pod keeps running; the stop as the placer meant it, in
time and for the node's boot, stops it."""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
import trio

from agent.blobs import BlobUnavailable
from agent.parts import PartAcceptor, check_part
from agent.supervisor import Supervisor, SupervisorConfig
from placer.config import PlacerConfig
from placer.state import ACCEPTED, PlacerState
from scheduler_link.frames import FrameChannel, decode_payload
from scheduler_link.heartbeat_wire import Hello, WireReply
from scheduler_link.messages import (
    Frame,
    GangBlob,
    GpuInfo,
    GpuSnapshot,
    JobSpec,
    NodeOutcome,
    NodePart,
    NodeReport,
    PartProof,
    Placement,
    PodAssignment,
    ReportReply,
    TopologyPath,
    Victim,
)
from scheduler_link.msgauth import BundleSigner, digest, node_key, outcome_ok, part_bytes

SIGNER = BundleSigner.generate()
NOW = 1_000_000.0
UUIDS = [f"a-g{i}" for i in range(8)]
HEALTH = dict.fromkeys(UUIDS, "healthy")
MAC_KEY = node_key(b"m" * 32, "a", "boot-a")


def _signed(part: NodePart) -> NodePart:
    """``part`` as a relay hands it over: with the placer's signed proof of its bundle."""
    raw = part_bytes(part)
    sig = SIGNER.sign_parts("z/b/r", part.blob_id, NOW + 5, [raw])
    return msgspec.structs.replace(part, proof=PartProof(rack="z/b/r", blob_id=part.blob_id, deliver_by=NOW + 5,
                                                         digests=[digest(raw)], sig=sig, raw=raw))


def _placer_stop() -> NodePart:
    """The placer's stop part for job j's pod on node a: placed, acked, then cancelled."""
    st = PlacerState(PlacerConfig(heartbeat_s=1.0, placement_ttl_s=30.0), started_at=0.0)
    st.recover_until = 0.0
    snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=u, name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True) for i, u in enumerate(UUIDS)])
    code, _, _ = st.ingest("a", NodeReport(node_id="a", boot_id="boot-a", seq=1, full=True, control_url="http://a",
                                           topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=snap), NOW)
    assert code == 200
    st.submit(JobSpec(job_id="j", pods=1, gpus_per_pod=1, argv=["x"]), NOW)
    (job, pushes), = st.schedule(NOW)
    st.on_acks("j", job.attempt, {"a": ACCEPTED}, NOW, pushes)
    stops = [p for p in st.cancel("j", NOW) if p.kind == "stop"]
    assert [p.node_id for p in stops] == ["a"]
    return stops[0].part(NOW + 30.0)


class Node:
    """Node a's clock and its link's boot id, as the acceptor reads them."""

    def __init__(self) -> None:
        self.now = NOW
        self.boot = "boot-a"

    def clock(self) -> float:
        return self.now

    def boot_id(self) -> str | None:
        return self.boot


def test_a_stop_part_acts_only_in_its_boot_before_its_expiry_and_on_its_attempt():
    stop = _placer_stop()
    assert (stop.boot_id, stop.attempt, stop.expires_at) == ("boot-a", 1, NOW + 30.0)
    assert [v.workload_id for v in stop.victims] == ["j.1.0"]

    def outcome(part: NodePart, *, now: float = NOW, boot: str | None = "boot-a") -> NodeOutcome:
        return check_part(part, node_id="a", now=now, inventory=UUIDS, gpu_health=HEALTH, records={},
                          boot_id=boot).outcome

    assert outcome(stop).outcome == "accepted"
    assert outcome(stop, now=NOW + 30.5).outcome == "expired"            # past its expiry: no late window
    assert outcome(stop, boot="boot-a2").outcome == "expired"            # the node's agent restarted since
    assert outcome(stop, boot=None).outcome == "expired"                 # no link yet: not this boot
    for unbound in (msgspec.structs.replace(stop, boot_id=""), msgspec.structs.replace(stop, expires_at=0.0)):
        assert outcome(unbound).outcome == "refused_spec"
    later = msgspec.structs.replace(stop, victims=[Victim(workload_id="j.2.0")])
    assert outcome(later).outcome == "refused_spec"                      # attempt 1's stop names attempt 2
    preempted = msgspec.structs.replace(stop, victims=[Victim(workload_id="other.4.0")])
    assert outcome(preempted).outcome == "accepted"                      # another job's pod: its own attempt


async def test_a_replayed_stop_does_not_stop_the_pod_and_the_placers_stop_does(tmp_path):
    """Replayed in the node's boot past the expiry, then to the restarted agent (a new boot, its
    remembered outcomes gone) inside the expiry: refused both times, each decided afresh."""
    stop = _signed(_placer_stop())
    sup = Supervisor(tmp_path / "state", node_id="a", gpu_health=lambda: HEALTH,
                     config=SupervisorConfig(shim_pool=1), base_env={"PATH": os.environ["PATH"]})

    async def no_blob(blob_id: str) -> GangBlob:
        raise BlobUnavailable("a stop needs no blob")

    def acceptor(node: Node) -> PartAcceptor:
        return PartAcceptor(tmp_path / "state", node_id="a", supervisor=sup, inventory=lambda: (UUIDS, HEALTH),
                            blob=no_blob, notify=lambda ev: None, keys=lambda: (MAC_KEY, SIGNER.public),
                            boot=node.boot_id, clock=node.clock)

    first, restarted = Node(), Node()
    restarted.boot = "boot-a2"
    acc, acc2 = acceptor(first), acceptor(restarted)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            ack = await sup.place(Placement(placement_id="start:j:1:a", job_id="j", argv=["sleep", "30"],
                                            pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["a-g0"])]))
            assert ack.accepted
            await n.start(acc.run)
            first.now = NOW + 31.0
            out = await acc.handle(stop)
            assert out.outcome == "expired" and outcome_ok(MAC_KEY, out)
            await n.start(acc2.run)
            restarted.now = NOW + 1.0
            assert (await acc2.handle(stop)).outcome == "expired"
            await trio.sleep(0.3)
            assert sup.record("j.1.0").state not in ("terminating", "exited", "preempted", "failed")
            assert (acc.counters.refused, acc2.counters.refused) == (1, 1)
            # the placer's stop, in time, for this boot
            first.now = NOW + 1.0
            fresh = _signed(msgspec.structs.replace(stop, placement_id="stop:j:1:a:99", proof=None))
            assert (await acc.handle(fresh)).outcome == "accepted"
            st = await sup.wait_terminal("j.1.0")
            assert st.state == "exited"
            n.cancel_scope.cancel()


async def test_a_replayed_direct_stop_does_not_stop_the_pod_and_the_placers_stop_does(tmp_path, token_dir, tls_pki):
    """The placer's stops pushed directly (``POST /v1/placements`` over mutual TLS, no relay) are
    bound as stop parts are: a real placer and a real agent; stops for the pod's job as the
    placer sends them (its certificate, its epoch, the node's link boot) but past their expiry,
    for an earlier boot of the node, with no boot or expiry, or naming a later attempt's pod from
    an earlier one's stop, are refused with a structured outcome and the pod keeps running; the
    placer's own stop (the job cancelled) stops it."""

    import httpx

    from agent.config import AgentConfig
    from agent.daemon import Agent
    from infra import tls
    from infra.auth import TokenSet
    from placer.service import PlacerService
    from tests.test_placer_service import cfg, wait_for

    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False), tokens)
            url = await n.start(svc.run)
            agent = Agent(AgentConfig(node_id="a1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "a1"),
                                      listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                                      placer=url, heartbeat_s=0.2, tls_dir=str(tls_pki.node_dir("a1")),
                                      insecure=False, workloads=SupervisorConfig(shim_pool=0)),
                          env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)
            control = await n.start(agent.run)
            op = httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, tls_pki.files("operator"), expect="placer"),
                                   base_url=url, timeout=10)
            placer = httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, tls_pki.files("placer")),
                                       base_url=control, timeout=10)

            async def up() -> bool:
                return any(x["state"] == "up" for x in (await op.get("/v1/nodes")).json()["nodes"])
            await wait_for(up)
            r = await op.post("/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="j", pods=1, gpus_per_pod=1, argv=["sleep", "30"])))
            assert r.status_code == 201, r.text
            r = await op.get("/v1/jobs/j", params={"wait": "running", "timeout_ms": "20000"})
            assert r.json()["state"] == "running", r.text
            (wid,) = [w for w in agent.supervisor.records_view() if w.startswith("j.")]
            attempt = int(wid.split(".")[1])
            boot = agent.link_boot_id()
            assert boot
            now = time.time()
            ok = Placement(placement_id=f"stop:j:{attempt}:a1:1", job_id="j", node_id="a1", attempt=attempt,
                           victims=[Victim(workload_id=wid, grace_s=0.1)], issued_at=now, expires_at=now + 30,
                           boot_id=boot, epoch=svc.epoch)
            replays = {
                "expired": [msgspec.structs.replace(ok, placement_id="stop:j:1:a1:2", issued_at=now - 60,
                                                    expires_at=now - 30),
                            msgspec.structs.replace(ok, placement_id="stop:j:1:a1:3", boot_id="an-earlier-boot")],
                "refused_spec": [msgspec.structs.replace(ok, placement_id="stop:j:1:a1:4", boot_id="", expires_at=0.0),
                                 msgspec.structs.replace(ok, placement_id="stop:j:1:a1:5", attempt=attempt - 1)],
            }
            for outcome, stops in replays.items():
                for stop in stops:
                    r = await placer.post("/v1/placements", content=msgspec.json.encode(stop))
                    assert r.status_code == 409 and r.json()["outcome"] == outcome, (stop, r.text)
            assert agent.supervisor.record(wid).state == "running"
            # the placer's own stop: the job cancelled, pushed directly, for this boot, in time
            r = await op.delete("/v1/jobs/j")
            assert r.status_code in (200, 202), r.text
            st = await agent.supervisor.wait_terminal(wid)
            assert st.state in ("exited", "preempted")
            await op.aclose()
            await placer.aclose()
            n.cancel_scope.cancel()


def test_a_relayed_stop_is_bound_to_its_attempt_and_expiry_under_its_mac(tmp_path):
    """Stops in answers a relay carries: the placer's service (its ingest, no sockets) sets
    the attempt its workload id names and an expiry on each, under the member's MAC; the
    member (msgauth.relayed_stops) acts on one only before its expiry, refuses one altered in
    either (its MAC), one for another attempt or, from an epoch-aware placer, without them;
    a stop of a placer without epochs acts as before."""
    from infra.auth import TokenSet
    from placer.service import PlacerService
    from scheduler_link.messages import WorkloadEvent, WorkloadStatus
    from scheduler_link.msgauth import bound_stop, relayed_stops, with_report_mac, with_stop_macs

    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), placement_ttl_s=30.0), TokenSet(), clock=lambda: NOW)
    svc.own_epoch = 7   # (as run sets it from its epoch file)
    snap = GpuSnapshot(gpus=[GpuInfo(index=i, uuid=u, name="x", memory_total_mib=1, pci_bus_id=str(i))
                             for i, u in enumerate(UUIDS)])
    full = NodeReport(node_id="a", boot_id="boot-a", seq=1, full=True, topology=TopologyPath(rack="r"),
                      snapshot=snap, workloads=[WorkloadStatus(workload_id="gone.3.0", job_id="gone",
                                                               state="running", gpus=[UUIDS[0]])])
    st, reply = svc._ingest("a", full)            # over its own connection: the key; told to stop gone.3.0
    assert st == 200 and reply.mac_key
    key = reply.mac_key
    svc.state.nodes["a"].tell.add("gone.3.0")     # (told once already; again, through the relay)
    ev = WorkloadEvent(workload_id="gone.3.0", job_id="gone", state="running", at=1.0)
    st, r = svc._ingest("a", with_report_mac(key, NodeReport(node_id="a", boot_id="boot-a", seq=2, full=False,
                                                                      events=[ev])),
                        via="relay-x")
    assert st == 200
    (stop,) = r.stop
    assert (stop.workload_id, stop.attempt, stop.expires_at, stop.epoch) == ("gone.3.0", 3, NOW + 30.0, 7)

    def check(v: Victim, now: float = NOW + 1.0) -> tuple[list[str], int, list[str]]:
        c = relayed_stops(key, "a", "boot-a", [v], now)
        return [x.workload_id for x in c.ok], c.forged, [x.outcome for x in c.refused]

    assert check(stop) == (["gone.3.0"], 0, [])
    assert check(stop, now=NOW + 30.5) == ([], 0, ["expired"])             # replayed past its expiry
    for altered in (msgspec.structs.replace(stop, expires_at=NOW + 3600.0),   # a relay moves the expiry on
                    msgspec.structs.replace(stop, attempt=4),                 # or the attempt
                    msgspec.structs.replace(stop, attempt=0, expires_at=0.0),  # or strips both
                    msgspec.structs.replace(stop, workload_id="gone.4.0", attempt=4)):  # or names a later pod
        assert check(altered) == ([], 1, [])
    # what the placer's MAC could cover but the binding refuses: another attempt, no expiry
    other = with_stop_macs(key, "a", "boot-a", [msgspec.structs.replace(stop, workload_id="gone.4.0", mac=b"")])[0]
    assert check(other) == ([], 0, ["refused_spec"])
    bare = with_stop_macs(key, "a", "boot-a", [Victim(workload_id="gone.3.0", epoch=7)])[0]
    assert check(bare) == ([], 0, ["refused_spec"])
    # a placer without epochs (epoch 0): its MAC over the node, boot and workload binds it
    old = with_stop_macs(key, "a", "boot-a", [Victim(workload_id="gone.3.0")])[0]
    assert check(old, now=NOW + 86400.0) == (["gone.3.0"], 0, [])
    assert bound_stop(Victim(workload_id="w-plain"), 7, NOW).attempt == 0   # an id that names no attempt


class _HoldingRelay:
    """A hostile rack relay (node r0n0, its own certificate, relaying for its own rack): it
    passes its members' reports to the placer and their answers back, but holds back the first
    answer that carries stops (passing it on without them), and hands that answer, as the
    placer made it, to the member in place of a later one once ``replay`` is set."""

    def __init__(self) -> None:
        self.upstream: FrameChannel | None = None
        self.held: WireReply | None = None
        self.replay = False
        self.replayed = 0

    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        return self._member

    def closed(self, channel: FrameChannel) -> None:
        pass

    def _member(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "report":
            return self._forward(decode_payload(f, NodeReport))
        return "error", {"error": "not here"}

    async def _forward(self, rep: NodeReport) -> tuple[str, WireReply]:
        assert self.upstream is not None
        wr = decode_payload(await self.upstream.call("report", rep, timeout_s=10), WireReply)
        if self.replay and self.held is not None and not wr.reply.stop:
            self.replay = False
            self.replayed += 1
            return "reply", self.held
        if self.held is None and wr.reply.stop:
            self.held = wr
            return "reply", msgspec.structs.replace(wr, reply=msgspec.structs.replace(wr.reply, stop=[]))
        return "reply", wr


async def test_a_replayed_relayed_stop_does_not_stop_the_pod_and_the_placers_stop_does(tmp_path, token_dir, tls_pki):
    """Over mutual TLS: a real placer, a member's real link (its host faked: it runs pod
    ``ghost.3.0`` of a job the placer does not know), and a hostile relay of its rack. The
    placer's stop reaches the member only in an answer through the relay, and the relay holds
    it back until past its expiry, then replays it: the member refuses it (``expired``), the
    pod keeps running, and the member's next report (a full one, over its own connection)
    names the pod, so the placer's answer tells it again, and the pod stops."""
    from infra import tls
    from infra.auth import TokenSet
    from placer.service import PlacerService
    from scheduler_link.agent_link import AgentLink
    from scheduler_link.frames import open_frames
    from scheduler_link.heartbeat_wire import HeartbeatServer
    from scheduler_link.messages import RelayHello, WorkloadStatus
    from testing.fake_agent import FakeAgent
    from testing.waiting import poll
    from tests.test_placer_service import cfg

    rack = "z1/b1/r0"
    tokens = TokenSet.load(token_dir)
    hostile = _HoldingRelay()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir),
                                    placement_ttl_s=1.0), tokens)
            url = await n.start(svc.run)
            # the relay node registers in its rack over its own connection, then offers to relay
            rlink = AgentLink(url, None, "r0n0", FakeAgent("r0n0", tokens, rack="r0"), heartbeat_s=0.1,
                              ssl_context=tls.client_context(tls_pki.ca, tls_pki.files("node:r0n0")))
            await n.start(rlink.run)
            await poll(lambda: rlink.mac_key is not None, 0.02)
            rlink_ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:r0n0"))
            server = HeartbeatServer(tokens, lambda node, rep: (400, ReportReply(ok=False)), frames=hostile,
                                     ssl_context=tls.server_context(tls_pki.files("node:r0n0")), require_certs=True)
            listen = await n.start(server.run, "127.0.0.1:0")
            hostile.upstream = await open_frames(svc.wire_url, "", "r0n0", ssl_context=rlink_ctx,
                                                 relay=RelayHello(racks=[rack], listen_url=listen), expect="placer")
            n.start_soon(hostile.upstream.run, _no_frames)
            await poll(lambda: svc.relays.relay_for(rack) is not None, 0.02)
            # the member registers directly (its key), and the placer names the relay
            member = FakeAgent("m1", tokens, rack="r0")
            link = AgentLink(url, None, "m1", member, heartbeat_s=0.1, full_every=0,   # (no periodic full report)
                             ssl_context=tls.client_context(tls_pki.ca, tls_pki.files("node:m1")))
            member.link = link
            await n.start(link.run)
            await poll(lambda: link.statistics()["relay_url"] == listen, 0.02)
            member.workloads["ghost.3.0"] = WorkloadStatus(workload_id="ghost.3.0", job_id="ghost", state="running",
                                                           gpus=[member.uuids[0]])
            link.request_full_report()      # through the relay: the answer tells it to stop ghost.3.0
            await poll(lambda: hostile.held is not None, 0.02)
            (held,) = hostile.held.reply.stop if hostile.held is not None else ()
            assert (held.workload_id, held.attempt, held.epoch) == ("ghost.3.0", 3, svc.epoch)
            assert 0 < held.expires_at - time.time() <= 1.0
            assert member.workloads["ghost.3.0"].state == "running"
            await trio.sleep(max(0.0, held.expires_at - time.time()) + 0.2)
            refused0, full0 = link.stops_refused, link.full_reports_sent
            rechecks_at_stop: list[int] = []   # the member's rechecks when a stop reached its workloads
            stop_workloads = member.stop_workloads

            async def counted_stop(victims: list[Victim]) -> None:
                rechecks_at_stop.append(link.relay_rechecks)
                await stop_workloads(victims)

            member.stop_workloads = counted_stop  # type: ignore[method-assign]
            hostile.replay = True
            await poll(lambda: hostile.replayed == 1, 0.02)
            await poll(lambda: link.stops_refused > refused0, 0.02)     # the replay refused: it stops nothing
            # named in the member's next report, a full one over its own connection (sent at once on
            # the refusal: it may be answered within one poll), the placer's answer tells it again,
            # with no relay in the way, and that stops it: one stop taken, after one recheck
            await poll(lambda: member.workloads["ghost.3.0"].state == "preempted", 0.02)
            assert link.full_reports_sent > full0 and link.relay_rechecks == 1 and link.stops_received == 1
            assert rechecks_at_stop == [1]   # the stop taken came after the recheck: the replay stopped nothing
            n.cancel_scope.cancel()


def _no_frames(ch: FrameChannel, f: Frame) -> Any:
    return "error", {"error": "no"}
