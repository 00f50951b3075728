"""Attacks at the message level (issue 17 §1, §3), against a real placer process and a real
agent, through a relay: the attacker holds node A's identity (A's tokens and the MAC key A
got at its direct registration) and is the rack's relay, so node B reports through it.
Whatever it makes up for B -- reports, heartbeats, acks going up; parts and fencing stops
going down -- is refused: by the placer (counted in ``bad_macs``; nothing changes in its model
for B; a forged ack costs only a direct push to B) and by B (a part without the placer's
signature is not acted on; a stop without the placer's MAC is not applied). B's own reports,
which it forwards untouched, still count. Placements it replays to B are refused by B (bound
to another node, expired). With TLS (infra.tls) it could not push B a placement at
all: a node certificate is not the placer's role; here the cluster runs insecure (shared
tokens), so the checks shown are the message-level ones."""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import pytest
import trio

from infra.auth import TokenSet, auth_header
from scheduler_link.frames import CallFailed, FrameChannel, FrameError, decode_payload, open_frames
from scheduler_link.heartbeat_wire import HeartbeatClient, HeartbeatServer, Hello, WireReply
from scheduler_link.messages import (
    AckBundle,
    Frame,
    GpuInfo,
    GpuSnapshot,
    HostHealth,
    NodeOutcome,
    NodePart,
    NodeReport,
    PartPod,
    Placement,
    PlacementAck,
    PodAssignment,
    RackBeat,
    RackBeatReply,
    RackReports,
    RelayHello,
    ReportReply,
    TopologyPath,
    Victim,
    WorkloadEvent,
)
from scheduler_link.msgauth import BundleVerifier, beat_mac, with_outcome_mac, with_report_mac

from .test_relay_agents import Api, RelayCluster

pytestmark = pytest.mark.slow
RACK = "z1/b1/rack0"


def _snapshot(prefix: str, health: str = "healthy") -> GpuSnapshot:
    return GpuSnapshot(hostname=prefix, backend="simulated:attacker", simulated=True,
                       gpus=[GpuInfo(index=i, uuid=f"GPU-{prefix}-{i}", name="sim", memory_total_mib=80000,
                                     pci_bus_id=f"0000:{i:02x}:00.0", health=health, simulated=True)  # type: ignore[arg-type]
                             for i in range(8)], host=HostHealth())


def _no_reports(node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
    return 400, ReportReply(ok=False, error="frames only")


class Attacker:
    """Node A ("node0"): registered directly (so it holds A's MAC key), then the rack's relay:
    a members listener B reports through (forwarded up untouched, the answers tampered with
    when ``forge_stop`` names a workload), and bundles answered with B's outcome forged."""

    def __init__(self, wire_url: str, tokens: TokenSet) -> None:
        self.wire_url = wire_url
        self.tokens = tokens
        self.mac_key = b""
        self.placer_key = b""
        self.bundles: list[Any] = []
        self.ch: FrameChannel | None = None
        self.victim = ""
        self.victim_gpu = ""
        self.forge_stop: str | None = None
        self.forged_stops = 0
        self.members: dict[str, FrameChannel] = {}
        self.forwarded = 0
        self.listen_url = ""

    async def register(self) -> None:
        c = await HeartbeatClient.connect(self.wire_url, self.tokens.cluster or "", "node0")
        rep = NodeReport(node_id="node0", boot_id="attacker-boot", seq=1, full=True, control_url="http://127.0.0.1:9",
                         data_url="http://127.0.0.1:9", topology=TopologyPath(zone="z1", block="b1", rack="rack0"),
                         snapshot=_snapshot("A"), sent_at=time.time())
        wr = await c.exchange(rep)
        assert wr.status == 200 and wr.reply.mac_key and wr.reply.placer_key, wr
        self.mac_key, self.placer_key = wr.reply.mac_key, wr.reply.placer_key
        self.client = c  # kept open (and beating) so node0 stays up
        self.seq = 1

    async def beat(self) -> None:
        self.seq += 1
        await self.client.exchange(NodeReport(node_id="node0", boot_id="attacker-boot", seq=self.seq, full=False))

    async def beat_loop(self) -> None:
        """Node A stays up (its own heartbeats, on its own connection)."""
        while True:
            await trio.sleep(0.2)
            await self.beat()

    async def relay(self, n: trio.Nursery) -> None:
        server = HeartbeatServer(self.tokens, _no_reports, frames=self)
        self.listen_url = await n.start(server.run, "127.0.0.1:0")
        self.ch = await open_frames(self.wire_url, self.tokens.cluster or "", "node0",
                                    relay=RelayHello(racks=[RACK], listen_url=self.listen_url))
        n.start_soon(self.ch.run, self._frame)

    # the members listener (FramesHost)
    def opened(self, hello: Hello, channel: FrameChannel) -> Any:
        self.members[hello.node_id] = channel
        return self._member

    def closed(self, channel: FrameChannel) -> None:
        self.members.pop(channel.name, None)

    def _member(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "report":
            return self._forward(decode_payload(f, NodeReport))
        return "error", {"error": "no"}

    async def _forward(self, rep: NodeReport) -> tuple[str, WireReply]:
        assert self.ch is not None
        wr = decode_payload(await self.ch.call("report", rep, timeout_s=5), WireReply)
        self.forwarded += 1
        if self.forge_stop and wr.status == 200:  # "the placer says: stop it" (with A's MAC: all it has)
            from scheduler_link.msgauth import with_stop_macs
            fake = [Victim(workload_id=self.forge_stop, grace_s=0.5, reason="fenced: forged")]
            fake = fake + with_stop_macs(self.mac_key, rep.node_id, rep.boot_id, fake)
            wr = WireReply(status=200, reply=ReportReply(ok=True, stop=fake, heartbeat_interval_s=0.5))
            self.forged_stops += 1
        return "reply", wr

    def _frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type != "bundle":
            return "error", {"error": "no"}
        view, parts, _ = BundleVerifier(self.placer_key).bundle(f.payload)  # it can read what it carries
        self.bundles.append(view)
        out = []
        for p in parts:
            if p.node_id == "node0":
                out.append(NodeOutcome(node_id="node0", placement_id=p.placement_id, outcome="accepted"))
            else:  # B's part dropped, its outcome made up: "its GPU is broken", with A's MAC (A has no other)
                self.victim = p.node_id
                out.append(with_outcome_mac(self.mac_key, NodeOutcome(
                    node_id=p.node_id, placement_id=p.placement_id, outcome="refused_gpus",
                    refused_gpus=[self.victim_gpu])))
        return "acks", AckBundle(rack=view.rack, blob_id=view.blob_id, outcomes=out)


async def test_a_node_with_another_nodes_identity_cannot_report_ack_or_place_for_it(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays=set(), heartbeat_s=0.5,
                                            recover_s=0.5) as c:
        api = Api(c, tokens)
        assert c.placer is not None
        atk = Attacker(c.placer.info["wire_url"], tokens)
        await atk.register()
        async with trio.open_nursery() as n:
            n.start_soon(atk.beat_loop)
            await atk.relay(n)
            await api.until(lambda: _candidates(api))
            b = await trio.to_thread.run_sync(c.start_agent, 1)    # node B: a real agent, told A is its relay

            async def both_up() -> bool:
                ns = await api.nodes()
                return ns.get("node1", {}).get("state") == "up" and ns.get("node0", {}).get("state") == "up" \
                    and "node1" in atk.members and atk.forwarded > 2

            await api.until(both_up)
            before = (await api.nodes())["node1"]
            st = await api.agent("node1", "/v1/status")
            b_boot, b_seq = st["link"]["boot_id"], st["link"]["seq"]
            atk.victim_gpu = st["gpus"]["gpus"][0]["uuid"]
            conflicts0 = st["link"]["conflicts"]
            bad0 = (await api.get("/v1/cluster"))["placer"]["bad_macs"]
            assert atk.ch is not None

            # 1. reports for B through the relay connection: a full report that would move B's
            # control_url to the attacker and call every GPU fatal; with A's MAC, with none
            forged = NodeReport(node_id="node1", boot_id=b_boot, seq=b_seq + 1000, full=True,
                                control_url="http://127.0.0.1:1/attacker", data_url="http://127.0.0.1:1/",
                                topology=TopologyPath(zone="z1", block="b1", rack="rack0"),
                                snapshot=_snapshot("B", health="fatal"), sent_at=time.time())
            for rep in (with_report_mac(atk.mac_key, forged), forged):
                wr = decode_payload(await atk.ch.call("report", rep, timeout_s=5), WireReply)
                assert wr.status == 401 and "MAC does not verify" in (wr.error or ""), wr
            ev = with_report_mac(atk.mac_key, NodeReport(
                node_id="node1", boot_id=b_boot, seq=b_seq + 1001, full=False,
                events=[WorkloadEvent(workload_id="x.1.0", job_id="x", state="failed", at=time.time())]))
            replies = decode_payload(await atk.ch.call("reports", RackReports(rack=RACK, reports=[ev]), timeout_s=5),
                                     list[WireReply])
            assert [r.status for r in replies] == [401]
            # 2. a heartbeat entry for B far ahead in its sequence (would make B's own beats
            # conflicts), MAC'd with A's key: dropped, not even answered
            beat = RackBeat(rack=RACK, node_ids=["node1"], boot_ids=[b_boot], seqs=[b_seq + 5000],
                            macs=[beat_mac(atk.mac_key, "node1", b_boot, b_seq + 5000)])
            br = decode_payload(await atk.ch.call("beat", beat, timeout_s=5), RackBeatReply)
            assert br.need_full == [] and br.stop == []
            assert (await api.get("/v1/cluster"))["placer"]["bad_macs"] == bad0 + 4

            # nothing changed for B, and B's own reports still fit (no conflict from a jumped seq)
            after = (await api.nodes())["node1"]
            for k in ("state", "control_url", "data_url", "unhealthy_gpus", "free_gpus", "gpus"):
                assert after[k] == before[k], (k, before[k], after[k])
            await trio.sleep(1.5)  # three of B's heartbeats, forwarded by the attacker untouched
            st = await api.agent("node1", "/v1/status")
            assert st["link"]["conflicts"] == conflicts0 and st["link"]["registered"]
            assert st["link"]["relay_url"] == atk.listen_url

            # a part pushed to B by the relay that the placer never signed: B does not act on it
            bch = atk.members["node1"]
            uuids = [g["uuid"] for g in st["gpus"]["gpus"]]
            fake = NodePart(placement_id="start:evil:1:node1", node_id="node1", job_id="evil", attempt=1,
                            blob_id="ab" * 32, pods=[PartPod(workload_id="evil.1.0", rank=0, gpus=uuids[:1])],
                            expires_at=time.time() + 30)
            with pytest.raises((CallFailed, FrameError)):  # an error answer, or B already left (below)
                await bch.call("part", fake, timeout_s=5)
            st = await api.agent("node1", "/v1/status")
            assert st["parts"]["not_authentic"] == 1 and st["parts"]["accepted"] == 0
            # B does not trust this relay for a while: it registers directly, then asks again
            assert st["link"]["relay_failures"] >= 1

            # 3. an ack for B changed on the way ("its GPU is broken", A's MAC): dropped; B is
            # pushed directly and runs its pod; B's GPUs stay healthy
            await api.submit(job_id="g", pods=2, gpus_per_pod=8, within="rack", argv=["sleep", "60"], grace_s=1.0)

            async def b_runs() -> bool:
                ws = await api.workloads("node1")
                return any(w["job_id"] == "g" and w["state"] == "running" for w in ws)
            await api.until(b_runs)
            wid = next(w["workload_id"] for w in await api.workloads("node1") if w["job_id"] == "g")
            assert atk.bundles and atk.victim == "node1"
            rs = await api.relays()
            assert rs["fallback_nodes"] >= 1, rs
            assert (await api.get("/v1/cluster"))["placer"]["bad_macs"] == bad0 + 5
            node_b = (await api.nodes())["node1"]
            assert node_b["unhealthy_gpus"] == [] and node_b["state"] == "up"

            # 4. a fencing stop made up by the relay in its answers to B (unMACed, and MACed with
            # A's key): B does not stop its workload
            atk.forge_stop = wid
            await api.until(lambda: _forged(atk, 3))
            st = await api.agent("node1", "/v1/status")
            assert st["link"]["stops_refused"] >= 6 and st["link"]["stops_received"] == 0, st["link"]
            assert [w["state"] for w in await api.workloads("node1") if w["workload_id"] == wid] == ["running"]
            atk.forge_stop = None

            # 5. placements to B that A could replay or make: bound to A, expired -- refused by B
            # (a real placer push to B carries node_id=node1, an expiry and the placer's epoch; shown accepted above)
            epoch = st["placer_epoch"]["epoch"]
            async with httpx.AsyncClient(base_url=b.url, headers=auth_header(tokens.placer), timeout=10) as cl:
                for p, outcome in (
                        (Placement(placement_id="start:x:1:node0", job_id="x", argv=["true"], node_id="node0",
                                   attempt=1, expires_at=time.time() + 30, epoch=epoch,
                                   pods=[PodAssignment(workload_id="x.1.0", rank=0, gpus=uuids[:1])]), "refused_spec"),
                        (Placement(placement_id="start:x:1:node1", job_id="x", argv=["true"], node_id="node1",
                                   attempt=1, expires_at=time.time() - 60, epoch=epoch,
                                   pods=[PodAssignment(workload_id="x.1.0", rank=0, gpus=uuids[:1])]), "expired")):
                    r = await cl.post("/v1/placements", content=msgspec.json.encode(p))
                    ack = msgspec.convert(r.json(), PlacementAck)
                    assert r.status_code == 409 and ack.outcome == outcome, ack
            assert not [w for w in await api.workloads("node1") if w["job_id"] == "x"]
            n.cancel_scope.cancel()


async def _candidates(api: Api) -> bool:
    return (await api.relays())["candidates"] == 1


async def _forged(atk: Attacker, n: int) -> bool:
    return atk.forged_stops >= n
