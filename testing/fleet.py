"""The fleet emulator: thousands of emulated agents in one process, against the real placer.

What is real and what is not: every emulated node runs the real
:class:`scheduler_link.agent_link.AgentLink` (full reports, heartbeats with boot id and
seq, 409 → full report, the framed channel, workload events at once) and answers real
``POST /v1/placements`` requests with real :class:`PlacementAck` s. Only process spawning
and GPUs are emulated: a fake supervisor acks a placement (``accepted``, or
``refused_gpus`` / ``refused_spec`` for the nodes told to refuse), then reports each pod
accepted → fetching → running after configurable delays, and stops victims
(terminating → preempted|exited); GPU snapshots come from the simulated profiles of
``agent/gpus/simulated.py`` (``dgx-h100`` for the h100 fleet, ``gb200-nvl72`` trays for
gb200), with the node names and topology of ``placer/sim.py``'s fleet shapes. Nothing of
the placer is emulated or imported beyond those shapes.

Relay mode (``--relays``): each rack runs the shipped relay, :class:`agent.relay.Relay` with
its :class:`agent.relaycore.RelayCore`, on the rack's first node: a real frames connection to
the placer per rack, and every decision a relay makes (taking a bundle after its signature
check, which parts go to whom, the one ack bundle per bundle, beat aggregation, report
batches, blob sources and serving) is that code's. **The relay -> member hop is emulated in
process** (:class:`InProcessHop`: a call per part where a relay host calls ``part`` on the
member's frames connection; ``Relay.member_report`` / ``member_blob`` the other way); the
members (:class:`EmulatedRack`) are fakes of hosts, registering directly and reporting to
their relay as AgentLink does. With ``--enroll`` (over TLS) members other than the relay's own
node register *through* their relay instead (scheduler_link.enroll): each makes its Enroll with
its own certificate's key (:class:`~scheduler_link.enroll.EnrollClient`, what AgentLink uses),
hands it to the shipped relay (``Relay.member_enroll_key`` / ``member_enroll``, as the member
connection's frames do), and opens the sealed answer; a refusal falls back to direct
registration. Without it (the baseline) each registers over its own TLS connection. The
relays of one process share what one host's would: the gang blob cache and the batch
signatures already verified (one Ed25519 check per batch per process). With several placers
(``--placer URL,URL,...``: one leading on etcd, the others warm followers) each relay host's own
link is the shipped AgentLink, wired as the agent daemon wires a relay host's: its reports go
over its relay's connection up, its copies to the followers over copy connections its relay
opens (agent.relaycopies: from then on the relay copies every rack beat and report batch
there), and the relay goes up to whichever placer that link reports to.

Sockets, because one process holds up to 20,000 descriptors:
- placements: one HTTP listener per emulator process; a node's ``control_url`` is
  ``http://HOST:PORT/n/<node_id>`` and the listener routes by that prefix (the placer's
  PushPool keeps a bounded set of connections per endpoint, not one per node). In relay
  mode over TLS each node has its own ``https://`` endpoint instead, as an agent's API:
  a listening socket on a loopback address of its own (127.100.0.1 on, so no address runs
  out of ports), presenting the node's own certificate (made when the placer first
  connects) and requiring the placer's. The placer pushes there directly when a rack's
  relay is not connected or does not answer (a listener a node: 16,384 nodes a process
  fit the 20,000 descriptors);
- reports: ``--mux K`` shares K relay-mode framed connections
  (:class:`~scheduler_link.heartbeat_wire.SharedWire`) among all the process's nodes;
  ``--mux 0`` gives each node its own framed connection (as real agents have), spread
  over source addresses 127.0.0.2.. so no (source, destination) pair runs out of ports;
- HTTP reports (registration without a known wire URL, and the fallback) share one
  bounded kept-alive client (``scheduler_link.fanout.PushPool``).

What the emulator itself costs (2 shared cores, measured): ~0.3-0.5 ms of CPU per
registration (most of it trio scheduling and the ~20 KB full report), ~1 ms per placement
with its three events, ~20 KB of RSS per node; at 131,072 nodes on two cores the
emulators, not the placer, set the pace of a registration storm. Snapshots are built before
the ready line and the process ``gc.freeze()``s them, so the collector does not walk them.

Several processes can share one fleet: ``--offset K --nodes N`` emulates nodes K..K+N-1 of
the fleet. The process prints one JSON line when it is ready (``{"ready": true,
"control": ..., ...}``), waits for ``go`` on stdin (or starts at once with ``--go``),
serves ``GET /stats`` on its listener, and exits when stdin closes or ``--seconds`` pass.

    python -m testing.fleet --nodes 4096 --placer http://127.0.0.1:7470 \\
        --wire-url tcp://127.0.0.1:7471 --token-dir /tmp/tokens --mux 8 --go
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import random
import resource
import socket
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import blake3
import h11
import msgspec
import trio
import trio.lowlevel

from agent.blobs import BlobCache
from agent.gpus.simulated import PROFILES, SimulatedBackend
from agent.relay import Relay
from infra import tls
from infra.auth import TokenSet, bearer
from infra.pki import NodeContexts
from infra.tls import Security
from scheduler_link.agent_link import RELAY_HOLD_RETRY_S, RELAY_HOLD_S, AgentLink, ReportChannel, registration
from scheduler_link.enroll import CertOK, EnrollClient, EnrollRefused
from scheduler_link.epochs import Epochs
from scheduler_link.fanout import PushPool
from scheduler_link.heartbeat_wire import (
    UPSTREAM_DOWN,
    HeartbeatClient,
    HeartbeatServer,
    Hello,
    SharedWire,
    WireError,
    WireReply,
    frame,
    parse_wire_url,
)
from scheduler_link.messages import (
    EnrollAnswer,
    GpuInfo,
    GpuSnapshot,
    NodeOutcome,
    NodePart,
    NodeReport,
    Placement,
    PlacementAck,
    ReportReply,
    TopologyPath,
    Victim,
    WorkloadEvent,
    WorkloadStatus,
    for_placer,
    inventory_hash,
)
from scheduler_link.msgauth import (
    MAC_LEN,
    BundleVerifier,
    beat_mac,
    relayed_stops,
    with_outcome_mac,
)
from scheduler_link.relayhold import RelayHold

log = logging.getLogger("herd.testing.fleet")

_placement_dec = msgspec.json.Decoder(Placement)
_enc = msgspec.json.Encoder()
_canon = msgspec.msgpack.Encoder(order="deterministic")   # msgauth's canonical encoding


# ---------------------------------------------------------------- fleet shape

@dataclass(frozen=True, slots=True)
class NodeSlot:
    """One node of the fleet, by its global index (names as placer/sim.py's build_fleet)."""
    node_id: str
    zone: str
    block: str
    rack: str
    nvlink_domain_rack: bool


def fleet_nodes(fleet: str, offset: int, count: int) -> list[NodeSlot]:
    from placer.sim import fleet_shape  # the fleet shapes' one definition

    fs = fleet_shape(fleet)
    racks_per_zone = fs.racks_per_block * fs.blocks_per_zone
    out = []
    p = fleet[0]
    for i in range(offset, offset + count):
        r, n = divmod(i, fs.nodes_per_rack)
        z, rem = divmod(r, racks_per_zone)
        b, rr = divmod(rem, fs.racks_per_block)
        zone, block, rack = f"{p}z{z:02d}", f"b{b:03d}", f"r{rr:02d}"
        out.append(NodeSlot(f"{zone}-{block}-{rack}-n{n:02d}", zone, block, rack, fs.nvlink_rack))
    return out


PROFILE_OF = {"h100": "dgx-h100", "gb200": "gb200-nvl72"}


class SnapshotFactory:
    """GPU snapshots as ``SimulatedBackend(profile, hostname=node, rack=rack)`` discovers them,
    built from one discovery per rack (the per-node parts — UUIDs, serials — replaced), so
    131,072 nodes do not cost 131,072 discoveries."""

    def __init__(self, profile: str) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown simulated profile {profile!r}")
        self.profile = profile
        self._by_rack: dict[str, tuple[Any, list[GpuInfo]]] = {}

    def snapshot(self, node_id: str, rack_path: str) -> GpuSnapshot:
        tpl = self._by_rack.get(rack_path)
        if tpl is None:
            d = SimulatedBackend(self.profile, hostname="template", rack=rack_path).discover()
            tpl = self._by_rack[rack_path] = (d, list(d.gpus))
        d, gpus = tpl
        mine = []
        for g in gpus:
            h = hashlib.blake2b(f"{node_id}/{self.profile}/{g.index}".encode(), digest_size=16).hexdigest()
            u = f"GPU-sim-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            mine.append(msgspec.structs.replace(g, uuid=u, serial=f"sim-{u[8:16]}"))
        return GpuSnapshot(hostname=node_id, backend=d.backend, simulated=True, driver_version=d.driver_version,
                           cuda_version=d.cuda_version, gpus=mine, topology_matrix=d.topology_matrix,
                           nvlink_domain=d.nvlink_domain, taken_at=time.time())


# ---------------------------------------------------------------- one emulated node

@dataclass(frozen=True, slots=True)
class Timing:
    """Delays of the fake supervisor (seconds)."""
    fetch_s: float = 0.05        # accepted -> fetching
    run_s: float = 0.1           # fetching -> running
    stop_s: float = 0.05         # terminating -> preempted|exited


class EmulatedNode:
    """One node: the hooks its AgentLink calls, and a fake supervisor for placements."""

    __slots__ = ("fleet", "slot", "control_url", "refuse", "workloads", "link", "rack", "boot_id", "seq", "registered",
                 "registering", "mac_key", "enroll", "inventory_taken", "sent_inventory",
                 "counted", "_snap", "_placer_snap", "_uuids", "_uuid_list", "_inventory", "_all_slots")

    def __init__(self, fleet: Fleet, slot: NodeSlot, control_url: str, refuse: str | None) -> None:
        self.fleet = fleet
        self.slot = slot
        self.control_url = control_url
        self.refuse = refuse                      # None | "refused_gpus" | "refused_spec"
        self.workloads: dict[str, WorkloadStatus] = {}
        self.link: AgentLink | None = None
        self.rack: EmulatedRack | None = None     # relay mode: reports go through the rack's relay
        self.boot_id = ""
        self.seq = 0
        self.registered = False
        self.registering = False                  # relay mode: a full report of it is under way
        self.mac_key = b""                        # relay mode: from its direct registration (msgauth)
        self.counted = False                      # relay mode: its first registration counted (Fleet)
        self.enroll: EnrollClient | None = None   # relay mode, --enroll: its certificate's key (made before go)
        self.inventory_taken = ""                 # relay mode: the inventory the placer took last (AgentLink's)
        self.sent_inventory = ""                  # ... and the one its last full report sent whole
        self._snap: GpuSnapshot | None = None
        self._placer_snap: GpuSnapshot | None = None   # what of it a full report carries (for_placer, once)
        self._uuids: frozenset[str] = frozenset()
        self._uuid_list: list[str] = []
        self._inventory = ""
        self._all_slots: list[int] = []

    # ---- LinkHooks

    def gpu_snapshot(self) -> GpuSnapshot:
        if self._snap is None:
            s = self.slot
            self._snap = self.fleet.snapshots.snapshot(s.node_id, f"{s.zone}/{s.block}/{s.rack}")
            self._uuid_list = [g.uuid for g in sorted(self._snap.gpus, key=lambda g: g.index)]
            self._uuids = frozenset(self._uuid_list)
            self._inventory = inventory_hash(self._uuid_list)
            self._all_slots = list(range(len(self._uuid_list)))
            self._placer_snap = for_placer(self._snap)
        return self._snap

    def full_report(self) -> NodeReport:
        snap = self.gpu_snapshot()
        s = self.slot
        return NodeReport(node_id=s.node_id, boot_id="", seq=0, full=True, control_url=self.control_url,
                          data_url=f"http://127.0.0.1:9/{s.node_id}",  # no data plane here
                          topology=TopologyPath(zone=s.zone, block=s.block, rack=s.rack),
                          nvlink_domain=snap.nvlink_domain, snapshot=self._for_placer(snap),  # (as AgentLink sends it)
                          workloads=list(self.workloads.values()), manifests=self.fleet.held_by(s.node_id),
                          sent_at=time.time())

    def _for_placer(self, snap: GpuSnapshot) -> GpuSnapshot:
        """``for_placer(snap)``, made with the snapshot (before ``go``, as the snapshot is: a
        real agent makes it on its own CPU) and kept: an emulated node's GPUs never change."""
        if self._placer_snap is None:
            self._placer_snap = for_placer(snap)
        return self._placer_snap

    async def stop_workloads(self, victims: list[Victim]) -> None:
        self.fleet.stats.told(len(victims), time.time(), "report_answer")
        for v in victims:
            self.fleet.spawn(self._stop, v)

    # ---- fake supervisor

    def place(self, p: Placement) -> tuple[int, PlacementAck]:
        nid = self.slot.node_id
        self.gpu_snapshot()
        if self.refuse == "refused_spec" or p.version != 1:
            return 409, PlacementAck(placement_id=p.placement_id, node_id=nid, accepted=False,
                                     outcome="refused_spec", reason="emulated: refusing the spec")
        wanted = [u for pod in p.pods for u in pod.gpus]
        unknown = [u for u in wanted if u not in self._uuids]
        if self.refuse == "refused_gpus" or unknown:
            bad = unknown or wanted[:1]
            return 409, PlacementAck(placement_id=p.placement_id, node_id=nid, accepted=False,
                                     outcome="refused_gpus", refused_gpus=bad,
                                     reason="emulated: GPUs refused")
        now = time.time()
        fresh = []
        for pod in p.pods:
            if pod.workload_id in self.workloads:
                continue  # idempotent by placement (and workload) id
            self.workloads[pod.workload_id] = WorkloadStatus(
                workload_id=pod.workload_id, job_id=p.job_id, placement_id=p.placement_id, rank=pod.rank,
                world_size=p.world_size, gpus=list(pod.gpus), state="accepted", manifest_id=p.manifest_id,
                created_at=now, updated_at=now)
            fresh.append(pod.workload_id)
        self.fleet.stats.told(len(p.victims), now, "placement")
        for v in p.victims:
            self.fleet.spawn(self._stop, v)
        for wid in fresh:
            self._event(wid, "accepted")
        if fresh:
            self.fleet.spawn(self._start, fresh)
        return 200, PlacementAck(placement_id=p.placement_id, node_id=nid, accepted=True, outcome="accepted",
                                 workloads=[pod.workload_id for pod in p.pods])

    def place_part(self, part: NodePart, now: float, later: list[Any]) -> NodeOutcome:
        """A NodePart as the real agent checks it (binding, expiry, inventory hash, slots),
        then the fake supervisor's acceptance."""
        nid = self.slot.node_id
        if self._snap is None:
            self.gpu_snapshot()
        if part.node_id != nid:
            return _outcome(nid, part, "refused_spec", "addressed to another node")
        if part.expires_at and now > part.expires_at:
            return _outcome(nid, part, "expired", "arrived after its expiry")
        if part.boot_id and part.boot_id != self.boot_id:
            return _outcome(nid, part, "expired", "for another boot")
        pods = part.pods
        if pods and part.inventory != self._inventory:
            return _outcome(nid, part, "expired", "inventory changed")
        uu = self._uuid_list
        n = len(uu)
        for pod in pods:
            ix = pod.gpu_indices
            if ix and (min(ix) < 0 or max(ix) >= n):
                return _outcome(nid, part, "refused_spec", f"GPU slot out of range for {pod.workload_id}")
        if self.refuse == "refused_spec":
            return _outcome(nid, part, "refused_spec", "emulated: refusing the spec")
        if self.refuse == "refused_gpus" and pods:
            return NodeOutcome(node_id=nid, placement_id=part.placement_id, outcome="refused_gpus",
                               refused_gpus=[uu[pods[0].gpu_indices[0]]], detail="emulated: GPUs refused")
        fresh = []
        wl = self.workloads
        for pod in pods:
            wid = pod.workload_id
            if wid in wl:
                continue  # idempotent (the same part again, or its HTTP fallback first)
            ix = pod.gpu_indices
            # a whole node's pod (the big gangs' shape) shares the node's UUID list (never mutated)
            gpus = uu if len(ix) == n and ix == self._all_slots else [uu[s] for s in ix]
            wl[wid] = WorkloadStatus(workload_id=wid, job_id=part.job_id, placement_id=part.placement_id,
                                     rank=pod.rank, gpus=gpus, state="accepted", created_at=now, updated_at=now)
            fresh.append(wid)
        if part.victims:
            self.fleet.stats.told(len(part.victims), now, "part")
        if fresh or part.victims:
            later.append((self, fresh, part))
        return NodeOutcome(node_id=nid, placement_id=part.placement_id, outcome="accepted")

    def _event(self, wid: str, state: str, **kw: Any) -> None:
        w = self.workloads.get(wid)
        if w is None:
            return
        now = time.time()
        self.workloads[wid] = msgspec.structs.replace(
            w, state=state, updated_at=now, started_at=now if state == "running" else w.started_at, **kw)
        ev = WorkloadEvent(workload_id=wid, job_id=w.job_id, state=state, at=now,  # type: ignore[arg-type]
                           gpus=w.gpus, placement_id=w.placement_id, **kw)  # (never mutated: shared)
        self.fleet.stats.event(w.job_id, now)
        if self.link is not None:
            self.link.notify(ev)
        elif self.rack is not None:
            self.rack.event(self, ev)

    async def _start(self, wids: list[str]) -> None:
        t = self.fleet.timing
        await trio.sleep(t.fetch_s)
        live = [w for w in wids if self.workloads.get(w) is not None and self.workloads[w].state == "accepted"]
        for wid in live:
            self._event(wid, "fetching")
        await trio.sleep(t.run_s)
        for wid in live:
            if self.workloads.get(wid) is not None and self.workloads[wid].state == "fetching":
                self._event(wid, "running")

    async def _stop(self, v: Victim) -> None:
        w = self.workloads.get(v.workload_id)
        if w is None or w.state in ("exited", "preempted", "failed", "lost", "terminating"):
            return
        self._event(v.workload_id, "terminating")
        await trio.sleep(min(v.grace_s, self.fleet.timing.stop_s))
        final = "preempted" if v.preempted else "exited"  # the placer says which (as agent/supervisor.py)
        self._event(v.workload_id, final, exit_code=None if final == "preempted" else 0, reason=v.reason)


def _outcome(nid: str, part: NodePart, o: str, detail: str) -> NodeOutcome:
    return NodeOutcome(node_id=nid, placement_id=part.placement_id, outcome=o, detail=detail)  # type: ignore[arg-type]


def _with_mac(key: bytes, rep: NodeReport) -> NodeReport:
    """``rep`` (not empty, ``mac`` unset) with its MAC as msgauth.report_mac computes it: one
    canonical encoding, where ``msgauth.with_report_mac`` first round-trips the report to
    normalise number types (an int in a float field). The emulator builds its reports with
    exact types (times from ``time.time()``), so the round trip changes nothing here; it was
    ~2/3 of the cost of a member's event report, the largest per-member cost of a delivery in
    the emulator (tests/test_fleet_relay_events.py checks that the placer's check accepts these)."""
    return msgspec.structs.replace(
        rep, mac=blake3.blake3(b"report\0" + _canon.encode(rep), key=key).digest(MAC_LEN))


# ---------------------------------------------------------------- one emulated rack (relay mode)

class InProcessHop:
    """The one emulated hop of relay mode: the shipped relay (agent.relay.Relay, its
    RelayCore deciding) hands a member its part as a call here, where a relay host calls
    ``part`` on the member's frames connection. The member is a fake (EmulatedNode.place_part:
    the real agent's checks of binding, expiry, inventory and slots, then a fake supervisor);
    it does not check the placer's signature over its part again (the relay checked the
    bundle's; a member's check is measured in bench/msgauth.py). Its outcome carries the
    member's own MAC, which the relay passes up untouched."""

    def __init__(self, rack: EmulatedRack) -> None:
        self.rack = rack
        self._later: list[Any] = []
        self._after: bool = False    # a task will start what this bundle's parts accepted

    def hand(self, part: NodePart, own: bool) -> NodeOutcome | None:
        rack = self.rack
        f = rack.fleet
        m = rack.by_id.get(part.node_id)
        if m is None:
            return None
        if not self._after:   # the first part of a bundle (a relay hands a bundle's parts in one go)
            self._after = True
            f.bundle_seen()
            f.spawn(self._after_parts)
        o = m.place_part(part, time.time(), self._later)   # (its blob id filled in by the relay)
        st = f.stats
        st.acks[o.outcome] = st.acks.get(o.outcome, 0) + 1
        st.parts += 1
        f.cpu_at_last_answer = time.process_time()   # (the bench's lower bound of CPU to acked)
        return with_outcome_mac(m.mac_key, o) if m.mac_key else o

    async def _after_parts(self) -> None:
        """After the acks went out: victims stopped, then the rack's new pods fetch (their
        gang blob from the relay, as a member's ``blob_get``) and run: one task per bundle, not
        per node; no "accepted" event (the ack said it)."""
        await trio.lowlevel.checkpoint()  # the bundle's parts all handed, its acks queued
        later, self._later, self._after = self._later, [], False
        f = self.rack.fleet
        starts: list[tuple[EmulatedNode, list[str]]] = []
        blob_id = ""
        for m, fresh, part in later:
            for v in part.victims:
                f.spawn(m._stop, v)
            if fresh:
                starts.append((m, fresh))
                blob_id = blob_id or part.blob_id
        if not starts:
            return
        t = f.timing
        if blob_id:  # a workload needs its gang's peers before it starts
            if (await self.rack.relay.member_blob(blob_id)).data is None:
                f.blob_failures += 1
        await trio.sleep(t.fetch_s)
        for m, fresh in starts:
            for wid in fresh:
                w = m.workloads.get(wid)
                if w is not None and w.state == "accepted":
                    m._event(wid, "fetching")
        await trio.sleep(t.run_s)
        for m, fresh in starts:
            for wid in fresh:
                w = m.workloads.get(wid)
                if w is not None and w.state == "fetching":
                    m._event(wid, "running")


class EmulatedRack:
    """A rack in relay mode: the shipped relay (:class:`agent.relay.Relay`, on the rack's first
    node, with its real frames connection to the placer and every decision its RelayCore's:
    bundles and their signatures, acks, beat aggregation, report batches, blob sources) and
    its members as AgentLink drives a member behind a relay. Each member registers over a
    direct connection (the fleet's shared framed connections, or over TLS its own: a relay
    may not carry a registration, and the MAC key comes only that way), then sends its empty
    heartbeats (with its beat MAC) and its event reports (with its report MAC) to the relay,
    one report at a time, and acts on the answers (need_full, 409: a full report; stops only
    with the placer's MAC). Only the relay -> member hop is in process (:class:`InProcessHop`,
    and :meth:`Relay.member_report` / :meth:`Relay.member_blob` for the way up).
    ``hung``: the relay takes bundles and never answers (``Relay.stalled``)."""

    def __init__(self, fleet: Fleet, rack: str, members: list[EmulatedNode], source: str | None,
                 hung: bool = False) -> None:
        self.fleet = fleet
        self.rack = rack
        self.members = members
        self.by_id = {m.slot.node_id: m for m in members}
        self.source = source
        self.placer_key: bytes | None = None     # from the relay node's own registration
        host = members[0]
        ctx = fleet.node_context(host.slot.node_id)   # over TLS: the relay node's certificate
        epochs = Epochs()   # the host's one gate, its link's and its relay's (as the agent daemon shares it)
        self.relay = Fleet.relay_type(
            node_id=host.slot.node_id, rack=rack, tokens=fleet.tokens, listen=None, wire_url=self._wire_url,
            blobs=fleet.blob_cache, heartbeat_s=fleet.cfg.heartbeat_s, request_timeout_s=fleet.cfg.request_timeout_s,
            keys=self.keys, security=Security(insecure=ctx is None, client=ctx), connect_timeout_s=WIRE_CONNECT_S,
            hop=InProcessHop(self), local_address=source, verifiers=fleet.verifiers,
            beat_offset_s=random.uniform(0, fleet.cfg.heartbeat_s), epochs=epochs)   # beats spread over the interval
        # Several placers (one leading: placer.ha): the relay host's own link is the shipped
        # AgentLink, wired as the agent daemon wires a relay host's -- its reports over the
        # relay's connection up (Relay.own_channel), its copies to the followers over the relay's
        # copy connections (which the relay opens for it, and from then on copies every beat and
        # report batch there: agent.relaycopies) -- and the relay goes up to the placer that link
        # reports to: which placer leads, and when to move, are that code's decisions.
        self.link: AgentLink | None = None
        if fleet.several_placers:
            hb = fleet.cfg.heartbeat_s
            # (no channel given: it registers over HTTP, is sent to the leader, and takes the
            # channel the leader names, as a host's link does; the placer it reports to is then
            # the leader, and its copies go to every other)
            self.link = host.link = AgentLink(
                fleet.cfg.placer_url, fleet.tokens.cluster, host.slot.node_id, host, heartbeat_s=hb,
                wire_connect=self.relay.own_channel, copy_fold=self.relay.copies.fold,
                copy_leader=self.relay.leader_wire,
                http_pool=fleet.http_for(host.slot.node_id), request_timeout_s=fleet.cfg.request_timeout_s,
                ssl_context=ctx, epochs=epochs, backoff_max_s=max(hb, 1.0))
        self.relay.stalled = hung
        self.registered = 0
        self.reports = 0
        self.failures = 0
        self._pending: dict[str, list[WorkloadEvent]] = {}
        self._flush = trio.Event()
        self._sending: set[str] = set()          # members whose event report is out (one at a time)
        self.reregistrations = 0
        self.full_reports = 0                     # full reports the members built (the host's link: its own)
        self.enrolled = 0                         # members registered through the relay (--enroll)
        self.enroll_refused: dict[str, int] = {}  # ... and enrolments that were not, by outcome
        self.relayed_registrations = 0   # full reports of members taken through the relay (no handshake)
        self.events_superseded = 0  # pending when their member's full report was built (it says them)
        self.events_unsent = 0      # in reports the relay could not forward (a full report follows)

    def _wire_url(self) -> str | None:
        if self.link is not None:   # (the agent daemon's: the channel of the placer its link reports to)
            return self.link.wire_url
        return self.fleet.cfg.wire_url

    def keys(self) -> tuple[bytes | None, bytes | None]:
        if self.link is not None:
            return self.link.mac_key, self.link.placer_key
        return self.members[0].mac_key or None, self.placer_key

    async def run(self) -> None:
        async with trio.open_nursery() as n:
            own = await n.start(self.relay.run)
            if self.link is not None:
                self.link.own_relay_url = own   # (the placer names it as the rack's relay: the link stays up)
                await n.start(self.link.run)
                self.fleet.member_registered()   # (its link registers it: counted for the collector's freeze)
            for m in self.members:
                if m.link is None:
                    n.start_soon(self._register, m)
            n.start_soon(self._heartbeats)
            n.start_soon(self._events)

    def _report(self, m: EmulatedNode, *, full: bool, events: list[WorkloadEvent] | None = None,
                compact: bool = True) -> NodeReport:
        m.seq += 1
        if full:
            self.full_reports += 1
            # as AgentLink: a full report supersedes the events queued before it (its workload
            # list says them); the ones after it wait until it is answered
            self.events_superseded += len(self._pending.pop(m.slot.node_id, ()))
            if not m.boot_id:
                m.boot_id = f"emu-{time.monotonic_ns():x}-{m.slot.node_id}"
            rep = registration(msgspec.structs.replace(m.full_report(), boot_id=m.boot_id, seq=m.seq),
                               m.inventory_taken if compact and self.fleet.cfg.compact else "")
            m.sent_inventory = rep.inventory if rep.snapshot is not None else ""
            return rep
        if not events:   # an empty heartbeat: its MAC is the beat MAC the relay carries up
            return NodeReport(node_id=m.slot.node_id, boot_id=m.boot_id, seq=m.seq, full=False,
                              sent_at=time.time(), mac=beat_mac(m.mac_key, m.slot.node_id, m.boot_id, m.seq)
                              if m.mac_key else b"")
        rep = NodeReport(node_id=m.slot.node_id, boot_id=m.boot_id, seq=m.seq, full=False,
                         events=events, sent_at=time.time())
        return _with_mac(m.mac_key, rep) if m.mac_key else rep

    async def _register(self, m: EmulatedNode) -> None:
        """A member's (and the relay node's) full report: a member that holds its MAC key sends
        it through its relay, keeping the relay while it answers ``upstream_down`` (a placer
        restart) for up to ``hold_s``, as AgentLink does; otherwise, or when the relay gives
        up or refuses it, over its own direct connection."""
        if m.registering:
            return   # one full report at a time (a later one would say nothing newer)
        if m.registered:
            self.reregistrations += 1
        m.registered = False
        m.registering = True
        own = m is self.members[0]
        try:
            if not own and m.mac_key and await self._register_relayed(m):
                return
            self.relay.member_left(m.slot.node_id)   # a full report directly: not through the relay meanwhile
            enrol = m.enroll is not None and not own and not m.mac_key
            while True:
                wr = await self._enroll(m) if enrol else None
                enrol = False   # (refused: directly from now on, as AgentLink falls back)
                if wr is None:
                    wr = await self._register_direct(m)
                if wr is not None and wr.status == 409 and m.inventory_taken:
                    m.inventory_taken = ""   # the placer holds no inventory of it: the snapshot, at once
                    continue
                if wr is not None and wr.status == 200:
                    m.inventory_taken = m.sent_inventory or m.inventory_taken
                    if not m.counted:
                        m.counted = True
                        self.fleet.member_registered()
                    self.registered += 1
                    m.registered = True
                    m.mac_key = wr.reply.mac_key or m.mac_key
                    if own and wr.reply.placer_key:
                        self.placer_key = wr.reply.placer_key
                    self.relay.member_joined(m.slot.node_id)   # it reports to its relay from now on
                    if m.slot.node_id in self._pending:
                        self._flush.set()   # what happened while it registered goes up now
                    self._after(m, wr.reply)
                    return
                await trio.sleep(0.5)
        finally:
            m.registering = False

    async def _enroll(self, m: EmulatedNode) -> WireReply | None:
        """A member's registration through its relay (--enroll): the placer's certificate
        from the relay, an Enroll made with the member's own certificate key, the shipped
        relay's member_enroll, the sealed answer opened (as AgentLink._enroll_through_relay
        does over the member's frames connection). None: not taken (register directly)."""
        assert m.enroll is not None
        relay = self.relay
        pc = await relay.member_enroll_key()
        hold = RelayHold(self.fleet.cfg.relay_hold_s)   # (held on to while it says upstream_down, as AgentLink)
        while not pc.cert and pc.outcome == "upstream_down":
            until = hold.until(trio.current_time(), dialling=pc.dialling)
            if until is None:
                break
            with trio.move_on_at(until):   # (in process: woken when it is up, not polled)
                await relay.upstream_ready.wait()
            pc = await relay.member_enroll_key()
        if not pc.cert:
            why = pc.outcome or "unavailable"
            self.enroll_refused[why] = self.enroll_refused.get(why, 0) + 1
            return None
        rep = self._report(m, full=True, compact=False)
        try:
            e, pending = m.enroll.make(rep, pc.cert, now=time.time())
            got = relay.member_enroll(m.slot.node_id, e)
            a = got if isinstance(got, EnrollAnswer) else await got
            secret = EnrollClient.open(pending, a)
        except EnrollRefused as err:
            self.enroll_refused[err.outcome] = self.enroll_refused.get(err.outcome, 0) + 1
            log.debug("enrolment refused node=%s: %s", m.slot.node_id, err)
            return None
        m.mac_key = secret.mac_key
        self.enrolled += 1
        self.reports += 1
        return WireReply(status=200, reply=a.reply or ReportReply())

    async def _register_relayed(self, m: EmulatedNode) -> bool:
        """A member's full report through its relay, with its MAC (the key outlives a placer
        restart: msgauth.node_key). While the relay has no connection up it is kept (the
        member's hold, ``relay_hold_s``); True once the placer took the report."""
        relay = self.relay
        nid = m.slot.node_id
        hold = RelayHold(self.fleet.cfg.relay_hold_s)
        while True:
            if relay.upstream is None:
                until = hold.until(trio.current_time(), dialling=relay.dialling)
                if until is None:
                    return False
                with trio.move_on_at(until):
                    await relay.upstream_ready.wait()
                continue
            got = relay.member_report(nid, _with_mac(m.mac_key, self._report(m, full=True)))
            wr = got if isinstance(got, WireReply) else await got
            self.reports += 1
            if wr.status == 409 and m.inventory_taken:
                m.inventory_taken = ""   # the placer holds no inventory of it: the snapshot, at once
                continue
            if wr.status == 200:
                m.inventory_taken = m.sent_inventory or m.inventory_taken
                self.relayed_registrations += 1
                self.registered += 1
                m.registered = True
                if nid in self._pending:
                    self._flush.set()
                self._after(m, wr.reply, relayed=True)
                return True
            if wr.status != 503 or wr.reason != UPSTREAM_DOWN or \
                    hold.until(trio.current_time(), dialling=wr.dialling) is None:
                self.failures += 1
                return False
            await trio.sleep(random.uniform(0.5, 1.0) * RELAY_HOLD_RETRY_S)

    async def _register_direct(self, m: EmulatedNode) -> WireReply | None:
        if m is self.members[0]:   # the relay host: over its relay's connection up, as an agent's link does
            return await self._register_own(m)
        if self.fleet.node_tls is not None:
            return await self._register_own_tls(m)
        async with self.fleet.limiter:
            shared = self.fleet.shared
            if not shared:
                return None
            sw = shared[hash(m.slot.node_id) % len(shared)]
            rep = self._report(m, full=True)
            try:
                with trio.fail_after(self.fleet.cfg.request_timeout_s):
                    await sw.wait_connected()
                    wr = await sw.exchange(rep)
            except (WireError, trio.TooSlowError):
                self.failures += 1
                return None
        self.reports += 1
        return wr

    async def _register_own(self, m: EmulatedNode) -> WireReply | None:
        """The relay host's own full report over the relay's frames connection to the placer
        (agent.relay.OwnReports: what the agent daemon gives a relay host's link), once the relay
        is connected: no connection, and over TLS no handshake, of its own."""
        try:
            with trio.fail_after(WIRE_CONNECT_S):
                ch = await self.relay.own_channel("", "", m.slot.node_id)
                wr = await ch.exchange(self._report(m, full=True))
        except (WireError, trio.TooSlowError) as e:
            self.failures += 1
            log.debug("relay host registration failed node=%s err=%s", m.slot.node_id, e)
            return None
        self.reports += 1
        return wr

    async def _register_own_tls(self, m: EmulatedNode) -> WireReply | None:
        """Over mutual TLS a member registers as a real agent does: its own connection to the
        placer's framed channel with its own certificate (a handshake, the full report, its
        MAC key in the answer), closed once it moves to its relay. The connection is driven by
        :func:`_register_blocking` in a worker thread (see there)."""
        f = self.fleet
        ctx = f.node_context(m.slot.node_id)
        assert ctx is not None
        rep = self._report(m, full=True)
        host, port = parse_wire_url(f.cfg.wire_url or "")
        hello = frame(Hello(token="", node_id=m.slot.node_id))
        async with f._tls_connects:   # (the emulator's queue: see Fleet; the node's deadline starts after it)
            try:
                wr = await trio.to_thread.run_sync(_register_blocking, host, port, ctx, self.source, hello,
                                                   frame(rep), WIRE_CONNECT_S, limiter=f._tls_threads)
            except (OSError, WireError, msgspec.DecodeError, tls.TLSError) as e:
                self.failures += 1
                log.debug("member registration failed node=%s err=%s", m.slot.node_id, e)
                return None
        self.reports += 1
        return wr

    def _after(self, m: EmulatedNode, r: ReportReply, *, relayed: bool = False) -> None:
        """What an answer says to a member: stops (relayed: only those with the placer's MAC,
        as an agent checks), need_full (a full report)."""
        stop = list(r.stop)
        full = r.need_full
        if relayed and stop:   # (a stop refused for its binding: named in a full report, as an agent does)
            checked = relayed_stops(m.mac_key or None, m.slot.node_id, m.boot_id, stop, time.time())
            stop, full = checked.ok, full or bool(checked.refused)
        if stop:
            self.fleet.spawn(m.stop_workloads, stop)
        if r.need_full and r.send_inventory:   # (a follower lacks its inventory: the snapshot, as AgentLink)
            m.inventory_taken = ""
        if full:
            self.fleet.spawn(self._register, m)

    def _answered(self, m: EmulatedNode, wr: WireReply) -> None:
        if wr.status == 200:
            self._after(m, wr.reply, relayed=True)
        elif wr.status != 503 or wr.reason == UPSTREAM_DOWN:
            # 409 (sequence), 401 (MAC): a full report, as AgentLink; upstream_down (the placer
            # restarting): a full report through the relay once it is connected again
            self.fleet.spawn(self._register, m)

    def event(self, m: EmulatedNode, ev: WorkloadEvent) -> None:
        self._pending.setdefault(m.slot.node_id, []).append(ev)
        self._flush.set()

    async def _heartbeats(self) -> None:
        """Each registered member's empty heartbeat to the relay, once an interval (the relay
        answers at once and carries them up in its next beat)."""
        hb = self.fleet.cfg.heartbeat_s
        await trio.sleep(random.uniform(0, hb))
        while True:
            relay = self.relay   # (with no connection up it answers upstream_down: the member holds on)
            for m in self.members:
                if m.registered and m.link is None and m.slot.node_id not in self._sending:
                    wr = relay.member_report(m.slot.node_id, self._report(m, full=False))
                    if not isinstance(wr, WireReply):   # (an empty heartbeat is answered at once)
                        continue
                    r = wr.reply
                    if wr.status != 200 or r.stop or r.need_full:
                        self._answered(m, wr)
                    if r.heartbeat_interval_s:
                        hb = r.heartbeat_interval_s
            await trio.sleep(hb)

    async def _events(self) -> None:
        """Members' events go to the relay within a few ms, the rack's together (the relay
        sends what is queued as one ``reports`` frame), and the next ones after their answers:
        a member's reports reach the placer in their sequence order."""
        while True:
            await self._flush.wait()
            self._flush = trio.Event()
            await trio.sleep(0.005)
            await self.fleet.bundles_quiet()   # bundles first (see there)
            pending, self._pending = self._pending, {}
            batch = []
            for nid, evs in pending.items():
                m = self.by_id[nid]
                if m.registered:
                    batch.append((m, evs))
                else:  # registering: its events wait for the answer (never dropped, as AgentLink's)
                    self._pending[nid] = evs
            if batch:
                await self._send_events(batch)   # (what comes meanwhile waits: the next batch)

    async def _send_events(self, batch: list[tuple[EmulatedNode, list[WorkloadEvent]]]) -> None:
        relay = self.relay
        self._sending = {m.slot.node_id for m, _ in batch}   # no heartbeat of theirs meanwhile (order)
        sent = [(m, evs, relay.member_report(m.slot.node_id, self._report(m, full=False, events=evs)))
                for m, evs in batch]   # seqs in send order, queued together: one frame up
        for m, evs, got in sent:
            wr = got if isinstance(got, WireReply) else await got
            self.reports += 1
            if wr.status != 200:
                self.failures += 1
                self.events_unsent += len(evs) if wr.status == 503 else 0
                if wr.status == 503:   # any doubt about what the placer saw: a full report
                    self.fleet.spawn(self._register, m)
            self._answered(m, wr)
        self._sending = set()


# ---------------------------------------------------------------- statistics

@dataclass(slots=True)
class JobEvents:
    count: int = 0
    first_at: float = 0.0
    last_at: float = 0.0


@dataclass(slots=True)
class FleetStats:
    placements: int = 0
    parts: int = 0                      # NodeParts that came through this process's relays
    victims_told: int = 0               # stop orders received (parts, placements, report replies)
    victims_by: dict[str, int] = field(default_factory=dict)   # ... by what carried them
    first_victim_at: float = 0.0
    last_victim_at: float = 0.0

    def told(self, n: int, at: float, by: str) -> None:
        if n <= 0:
            return
        self.victims_by[by] = self.victims_by.get(by, 0) + n
        self.victims_told += n
        if not self.first_victim_at:
            self.first_victim_at = at
        self.last_victim_at = at
    placement_bytes: int = 0
    placement_bytes_max: int = 0
    acks: dict[str, int] = field(default_factory=dict)
    events: int = 0
    first_event_at: float = 0.0
    last_event_at: float = 0.0
    jobs: dict[str, JobEvents] = field(default_factory=dict)

    def event(self, job_id: str, at: float) -> None:
        self.events += 1
        if not self.first_event_at:
            self.first_event_at = at
        self.last_event_at = at
        j = self.jobs.get(job_id)
        if j is None:
            j = self.jobs[job_id] = JobEvents(first_at=at)
        j.count += 1
        j.last_at = at


class GcClock:
    """Seconds this process spent in the cyclic collector, for /stats (the process's main
    appends :meth:`callback` to ``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._t0 = 0.0

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1


# ---------------------------------------------------------------- the fleet

@dataclass(frozen=True, slots=True)
class FleetConfig:
    placer_url: str
    nodes: int
    offset: int = 0
    fleet: str = "h100"
    wire_url: str | None = None        # a known framed channel (as after a placer restart)
    mux: int = 8                       # shared framed connections; 0 = one per node
    sources: int = 16                  # source addresses 127.0.0.2.. for direct connections
    use_wire: bool = True              # False: HTTP reports only (the baseline)
    heartbeat_s: float = 5.0           # until the placer's first reply says otherwise
    http_connections: int = 32
    listen_host: str = "127.0.0.1"
    refuse_gpus: frozenset[str] = frozenset()
    refuse_spec: frozenset[str] = frozenset()
    timing: Timing = Timing()
    request_timeout_s: float = 30.0
    relays: bool = False               # one relay per rack: frames connections, aggregated beats
    hung_relays: frozenset[str] = frozenset()   # racks whose relay takes bundles and never answers
    tls_dir: str | None = None         # a PKI dir with ca.key: each node reports over its own mutual TLS
    tls_threads: int = 8               # relay mode over TLS: members' blocking registrations in flight
    enroll: bool = False               # relay mode over TLS: members register through their relay
    enroll_ecdh: bool = False          # ... by ECDH with their certificate's key, as nodes with no enrolment key
    hold_events: bool = True           # relay mode: members' event reports wait while bundles come (Fleet.bundles_quiet)
    relay_hold_s: float = RELAY_HOLD_S  # relay mode: a member keeps a relay that lost the placer this long
    compact: bool = True               # relay mode: re-register naming the stored GPU inventory (placer.inventories)
    holds: str = ""                    # a manifest id that one node in ``holds_every`` reports holding
    holds_every: int = 0               # (by a hash of its id: contacts a gang of that manifest is given)


class Fleet:
    """``await nursery.start(fleet.run)`` -> the control base URL once the listener is bound;
    :meth:`go` starts every node's link at once. In relay mode each rack runs ``relay_type``,
    the shipped relay (tests/test_relay_core.py checks it is)."""

    relay_type = Relay

    def __init__(self, cfg: FleetConfig, tokens: TokenSet) -> None:
        self.cfg = cfg
        self.tokens = tokens
        self.timing = cfg.timing
        self.snapshots = SnapshotFactory(PROFILE_OF.get(cfg.fleet, cfg.fleet))
        self.stats = FleetStats()
        self.nodes: dict[str, EmulatedNode] = {}
        self.shared: list[SharedWire] = []
        self.started_at: float | None = None
        self.control: str | None = None
        self.several_placers = "," in cfg.placer_url   # several placers, one leading (placer.ha)
        self._http: PushPool | None = None            # HTTP reports: one shared pool (_http_for)
        self._nursery: trio.Nursery | None = None
        self._go = trio.Event()
        # relay mode
        self.racks: list[EmulatedRack] = []
        self.frames_url: str | None = None            # this process's frames listener (other relays' blob_get)
        # What one process's relays share, as one host's would: the gang blobs (one copy per
        # process, agent.blobs.BlobCache: one fetch per id at a time), the placer's verifier and
        # the batch signatures already verified (one Ed25519 check per batch per process: the
        # same check of the same bytes each relay host would make on its own CPU)
        self.blob_cache = BlobCache()
        self.blob_failures = 0                         # members whose relay could not give the gang blob
        self.verifiers: dict[bytes, tuple[BundleVerifier, dict[bytes, bytes]]] = {}
        self.cpu_at_last_answer = 0.0                  # relay mode: process CPU-s when it last handed a part
        self.drop_reasons: dict[str, int] = {}         # relay mode: why relays' connections ended (GET /stats)
        self.limiter = trio.CapacityLimiter(512)       # reports in flight (bounds a registration storm)
        # mutual TLS: one certificate and client context per emulated node, made before it registers
        self.node_tls = NodeContexts(cfg.tls_dir) if cfg.tls_dir else None
        self._node_ctx: dict[str, ssl.SSLContext] = {}
        # relay mode over TLS: each node's own https control endpoint (_serve_control)
        self.tls_control = self.node_tls is not None and cfg.relays and _descriptors_for(cfg.nodes)
        self._server_ctx: dict[str, ssl.SSLContext] = {}
        self.control_handshakes = 0                    # ... TLS connections the placer opened to them
        self._placer_certs: dict[bytes, CertOK] = {}   # --enroll: the placer's certificate, checked once a process
        # Real agents each handshake on their own CPU; thousands at once in this one thread would
        # each finish late (past their deadline, then retry): some at a time, as hosts starting a
        # little apart would. The wait for a turn here is the emulator's, not the node's: a node's
        # connect deadline (WIRE_CONNECT_S, as a real agent's wire_connect_timeout_s) starts
        # with its turn.
        self._tls_connects = trio.CapacityLimiter(128)
        # members' blocking registrations in flight (_register_blocking): ~32 over the emulators
        # keep the placer busy; more only queue at the placer and cost it CPU (16,384 members, 4
        # processes, emulators at +10 nice, consecutive runs: 32 a process 65.2 s, placer 59.3
        # CPU-s; 8 a process 58.0 s, 55.7 CPU-s), fewer leave it idle (4,096 in one process at 8:
        # 25.9 s, the placer 60 % busy)
        self._tls_threads = trio.CapacityLimiter(max(1, cfg.tls_threads))
        self.registered_once = 0                       # relay mode: members registered (first time each)
        self.gc = GcClock()
        self.gc_held_until = 0.0                       # relay mode: the collector is off until then
        self.bundles_until = 0.0                       # relay mode: members' events wait until then (bundles_quiet)
        self._quiet = trio.Event()                     # set: no bundle for EVENTS_HOLD_S (bundle_seen)
        self._quiet.set()

    def member_registered(self) -> None:
        """Once every member has registered, its long-lived state (reports' answers, keys,
        links) is moved out of the cyclic collector's sight, as the snapshots were at start:
        otherwise the collections a delivery's burst of objects sets off walk it all again
        (the emulator's cost, not the placer's)."""
        self.registered_once += 1
        if self.registered_once == len(self.nodes):
            gc.collect(1)
            gc.freeze()

    def hold_gc(self) -> None:
        """A bundle came: the collector stays off while this process's relays are busy with a
        delivery (its burst of young objects would set off collections that walk them all,
        ~25-40 % of the emulator's CPU in a 16,384-node delivery's window, measured with
        /stats' gc_s) and runs once they are quiet (:meth:`_gc_when_idle`). The placer does the
        same during its deliveries; the emulator's CPU stands in for thousands of hosts'."""
        if gc.isenabled():
            gc.disable()
            self.spawn(self._gc_when_idle)
        self.gc_held_until = trio.current_time() + GC_HOLD_S

    async def bundles_quiet(self) -> None:
        """Bundles first: return once no bundle has come for EVENTS_HOLD_S (at most
        EVENTS_HOLD_MAX_S from now). On a fleet each rack's relay and members are their own
        hosts: rack A's members reporting their pods fetching and running takes nothing from
        rack B's relay answering its bundle. Here one process plays hundreds of racks on the
        placer's 2 cores, and those reports (two per member: ~35 % of the emulator's CPU in a
        delivery's window, py-spy) would delay the acks of the racks still waiting their turn,
        a contention no fleet has. So a process's members hold their event reports while its
        relays are handling a round's bundles and send them, in order and all of them, once it
        is quiet (the placer itself holds relayed reports while a delivery is out: acks first).
        ``hold_events = False`` (``--no-hold-events``) reports at once, as before."""
        if not self.cfg.hold_events:
            return
        with trio.move_on_after(EVENTS_HOLD_MAX_S):
            await self._quiet.wait()

    def bundle_seen(self) -> None:
        """A relay of this process is handing out a bundle's parts: the collector stays off
        (:meth:`hold_gc`) and members' events wait (:meth:`bundles_quiet`) until one task here
        (not each relay's) sees the process quiet again."""
        self.hold_gc()
        self.bundles_until = trio.current_time() + EVENTS_HOLD_S
        if self._quiet.is_set():
            self._quiet = trio.Event()
            self.spawn(self._quiet_when_idle, self._quiet)

    async def _quiet_when_idle(self, ev: trio.Event) -> None:
        try:
            while trio.current_time() < self.bundles_until:
                await trio.sleep_until(max(self.bundles_until, trio.current_time() + 0.01))
        finally:
            ev.set()

    async def _gc_when_idle(self) -> None:
        try:
            while trio.current_time() < self.gc_held_until:
                await trio.sleep_until(self.gc_held_until)
        finally:
            gc.enable()

    def held_by(self, node_id: str) -> list[str]:
        """The complete manifests ``node_id`` reports holding: ``cfg.holds`` on one node in
        ``cfg.holds_every`` (chosen by a hash of its id), else none."""
        every = self.cfg.holds_every
        if not every or int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=4).digest()) % every:
            return []
        return [self.cfg.holds]

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    def go(self) -> None:
        self._go.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.cfg
        listeners = await trio.open_tcp_listeners(0, host=cfg.listen_host)
        port = listeners[0].socket.getsockname()[1]
        self.control = f"http://{cfg.listen_host}:{port}"
        own: list[tuple[str, trio.SocketListener]] = []
        for k, slot in enumerate(fleet_nodes(cfg.fleet, cfg.offset, cfg.nodes)):
            refuse = ("refused_gpus" if slot.node_id in cfg.refuse_gpus else
                      "refused_spec" if slot.node_id in cfg.refuse_spec else None)
            url = f"{self.control}/n/{slot.node_id}"
            if self.tls_control:
                lst = _control_listener(_control_address(cfg.offset + k))
                host, lport = lst.socket.getsockname()[:2]
                url = f"https://{host}:{lport}/n/{slot.node_id}"
                own.append((slot.node_id, lst))
            node = self.nodes[slot.node_id] = EmulatedNode(self, slot, url, refuse)
            node.gpu_snapshot()  # a real agent has discovered its GPUs before it registers
            if cfg.enroll and cfg.relays and self.node_tls is not None:
                # ... and holds its certificate (made here, not timed): its key for enrolment
                # (a TLS context only if it falls back to direct registration, or is its rack's relay)
                node.enroll = self.enroll_client(slot.node_id)
            else:
                self.node_context(slot.node_id)  # ... and holds its certificate (made here, not timed)
        # HTTP reports through the lean kept-alive client, bounded per endpoint: an httpx
        # client with thousands of queued requests costs the emulator more than the placer
        http = self._http = PushPool(concurrency=cfg.http_connections, max_per_host=cfg.http_connections,
                                     attempt_timeout_s=cfg.request_timeout_s, retries=0)
        async with trio.open_nursery() as n:
            self._nursery = n
            n.start_soon(trio.serve_listeners, self._handle, listeners)
            for nid, lst in own:
                n.start_soon(self._serve_control, nid, lst)
            if cfg.relays:
                by_rack: dict[str, list[EmulatedNode]] = {}
                for node in self.nodes.values():
                    sl = node.slot
                    by_rack.setdefault(f"{sl.zone}/{sl.block}/{sl.rack}", []).append(node)
                for k, (rack, members) in enumerate(by_rack.items()):
                    r = EmulatedRack(self, rack, members, _source(k, cfg.sources), hung=rack in cfg.hung_relays)
                    for m in members:
                        m.rack = r
                    self.racks.append(r)
                if self.racks:
                    # one frames listener for the process's relays: another relay's blob_get is
                    # served by the shipped relay code (from the shared cache, never a new fetch)
                    server = HeartbeatServer(self.tokens, _no_reports, frames=self.racks[0].relay)
                    self.frames_url = await n.start(server.run, f"{cfg.listen_host}:0")
                    for r in self.racks:
                        r.relay.advertise = self.frames_url
            task_status.started(self.control)
            await self._go.wait()
            self.started_at = time.time()
            if cfg.relays:
                # members register directly (their MAC keys come only that way): over shared
                # framed connections, or over TLS each over its own (a certificate is one node)
                for k in range(max(1, cfg.mux) if self.node_tls is None else 0):
                    sw = SharedWire(cfg.wire_url or "", self.tokens.cluster or "", name=f"emu-{cfg.offset}-{k}",
                                    local_address=_source(k, cfg.sources))
                    self.shared.append(sw)
                    n.start_soon(sw.run)
                for r in self.racks:
                    n.start_soon(r.run)
                return
            connect = await self._connector(n)
            for node in self.nodes.values():
                link = AgentLink(cfg.placer_url, self.tokens.cluster, node.slot.node_id, node,
                                 heartbeat_s=cfg.heartbeat_s, use_wire=cfg.use_wire, wire_url=cfg.wire_url,
                                 wire_connect=connect, http_pool=self._http_for(node.slot.node_id, http),
                                 request_timeout_s=cfg.request_timeout_s,
                                 # the node's own deadline is in `connect` (after the emulator's queue)
                                 wire_connect_timeout_s=3600.0 if self.node_tls else WIRE_CONNECT_S,
                                 backoff_max_s=max(cfg.heartbeat_s, 1.0))
                node.link = link
                n.start_soon(link.run)

    def http_for(self, node_id: str) -> PushPool:
        """A node's HTTP client for its reports (see :meth:`_http_for`)."""
        assert self._http is not None
        return self._http_for(node_id, self._http)

    def _http_for(self, node_id: str, shared: PushPool) -> PushPool:
        """The HTTP fallback for a node's reports: the shared pool, or over TLS the node's own
        (one kept-alive connection, its certificate: a shared pool cannot be every node)."""
        ctx = self.node_context(node_id)
        if ctx is None:
            return shared
        return PushPool(concurrency=1, max_per_host=1, attempt_timeout_s=self.cfg.request_timeout_s, retries=0,
                        ssl_context=ctx)

    def node_context(self, node_id: str) -> ssl.SSLContext | None:
        if self.node_tls is None:
            return None
        ctx = self._node_ctx.get(node_id)
        if ctx is None:
            ctx = self._node_ctx[node_id] = self.node_tls.context(node_id)
        return ctx

    def enroll_client(self, node_id: str) -> EnrollClient:
        """A node's enrolment client: a certificate issued by the PKI dir's CA (in memory), its
        key, and its enrolment key as ``herd pki issue`` gives it (none with --enroll-ecdh, or
        where the PKI dir has no enrolment master: the node enrols by ECDH)."""
        assert self.node_tls is not None
        from cryptography.hazmat.primitives import serialization

        from infra.pki import enrol_key_of
        key, cert = self.node_tls.ca.issue(f"node:{node_id}", days=self.node_tls.days)
        master = None if self.cfg.enroll_ecdh else self.node_tls.enrol_master
        return EnrollClient(self.node_tls.ca.cert, key, cert.public_bytes(serialization.Encoding.DER),
                            placer_certs=self._placer_certs,
                            enrol_key=enrol_key_of(master, cert) if master is not None else None)

    async def _connector(self, n: trio.Nursery) -> Any:
        cfg = self.cfg
        token = self.tokens.cluster or ""
        # Over TLS a node certificate speaks only for its node: no shared connections, each
        # emulated node registers over its own mutual-TLS connection (what is measured).
        if cfg.mux > 0 and cfg.use_wire and cfg.wire_url and self.node_tls is None:
            for k in range(cfg.mux):
                sw = SharedWire(cfg.wire_url, token, name=f"emu-{cfg.offset}-{k}",
                                local_address=_source(k, cfg.sources))
                self.shared.append(sw)
                n.start_soon(sw.run)
            shared = self.shared

            async def via_shared(wire_url: str, tok: str, node_id: str) -> ReportChannel:
                sw = shared[hash(node_id) % len(shared)]
                await sw.wait_connected()
                return sw.handle()
            return via_shared
        counter = 0

        async def direct(wire_url: str, tok: str, node_id: str) -> ReportChannel:
            nonlocal counter
            counter += 1
            ctx = self.node_context(node_id)
            if ctx is None:
                return await HeartbeatClient.connect(wire_url, tok, node_id, local_address=_source(counter, cfg.sources))
            async with self._tls_connects:
                with trio.fail_after(WIRE_CONNECT_S):
                    return await HeartbeatClient.connect(wire_url, tok, node_id,
                                                         local_address=_source(counter, cfg.sources), ssl_context=ctx)
        return direct

    # ---- statistics

    def statistics(self, job: str | None = None) -> dict[str, Any]:
        links = [n.link for n in self.nodes.values() if n.link is not None]
        st = self.stats
        out: dict[str, Any] = {
            "nodes": len(self.nodes), "offset": self.cfg.offset, "started_at": self.started_at,
            "registered": sum(lk.registered for lk in links),
            "reports_sent": sum(lk.reports_sent for lk in links),
            "full_reports": sum(lk.full_reports_sent for lk in links),
            "wire_full_reports": sum(lk.wire_full_reports for lk in links),
            "wire_reports": sum(lk.wire_reports for lk in links),
            "failures": sum(lk.failures for lk in links), "conflicts": sum(lk.conflicts for lk in links),
            "placements": st.placements, "placement_bytes": st.placement_bytes,
            "control_handshakes": self.control_handshakes,
            "placement_bytes_max": st.placement_bytes_max, "acks": dict(st.acks), "events": st.events,
            "victims_told": st.victims_told, "victims_by": dict(st.victims_by), "first_victim_at": st.first_victim_at,
            "last_victim_at": st.last_victim_at,
            "first_event_at": st.first_event_at, "last_event_at": st.last_event_at,
            "shared_wires": [{"connects": s.connects, "breaks": s.breaks, "exchanges": s.exchanges}
                             for s in self.shared],
            "open_fds": _open_fds(), "gc_s": self.gc.seconds, "gc_collections": self.gc.collections,
            # workloads the nodes took (a placement taken again by id, through a relay and then
            # directly, is one)
            "workloads": sum(len(n.workloads) for n in self.nodes.values()),
        }
        if self.racks:
            ks = self.racks
            rs = [k.relay for k in ks]
            cs = [r.core for r in rs]
            reasons: dict[str, int] = {}
            for r in rs:
                for why, c in r.drop_reasons.items():
                    reasons[why] = reasons.get(why, 0) + c
            copies = [r.copies.statistics() for r in rs]
            out.update({
                "relays": len(rs), "relay": "agent.relay.Relay (the relay -> member hop in process)",
                "registered": sum(k.registered for k in ks) + sum(lk.registered for lk in links),
                # full reports: the members' (through the relay, or directly) and the hosts' links'
                "full_reports": sum(k.full_reports for k in ks) + sum(lk.full_reports_sent for lk in links),
                # copies to the placers that follow (agent.relaycopies), the relays' together
                "relay_copies": {"frames": sum(c["frames"] for c in copies), "bytes": sum(c["bytes"] for c in copies),
                                 "drops": sum(c["drops"] for c in copies),
                                 "failures": sum(c["failures"] for c in copies),
                                 "connections": sum(c["followers"] for c in copies)},
                # the hosts' links moved onto a copy channel (their copies in step: no full report)
                "handovers": sum(fc["handovers"] for lk in links
                                 if (fc := lk.statistics()["follower_copies"]) is not None),
                "reports_sent": sum(k.reports for k in ks) + sum(lk.reports_sent for lk in links),
                "beats": sum(r.beats for r in rs),
                "bundles": sum(c.bundles for c in cs), "parts": st.parts,
                "part_bytes_max": max((c.part_bytes_max for c in cs), default=0),
                "bundles_verified": sum(v.verified for v, _ in self.verifiers.values()),
                "bundles_refused": sum(c.bad_bundles for c in cs),
                "parts_missed": sum(c.parts_missed for c in cs), "late_answers": sum(c.late_answers for c in cs), "late_bundles": sum(c.late_bundles for c in cs),
                "relay_failures": sum(r.failures for r in rs) + sum(k.failures for k in ks),
                "blob_fetches": {**self.blob_cache.statistics(), "served": sum(r.blob_serves for r in rs),
                                 "failed": self.blob_failures},
                "relay_connects": sum(r.connects for r in rs), "relay_drops": sum(r.drops for r in rs),
                "relay_drop_reasons": reasons,
                "reregistrations": sum(k.reregistrations for k in ks) + sum(
                    max(0, lk.full_reports_sent - 1) for lk in links),
                "enrolled": sum(k.enrolled for k in ks),
                "enroll_refused": _summed(k.enroll_refused for k in ks),
                "relayed_registrations": sum(k.relayed_registrations for k in ks),
                "relay_held": sum(c.held_answered for c in cs),
                "events_superseded": sum(k.events_superseded for k in ks),
                "events_unsent": sum(k.events_unsent for k in ks),
                "blobs": self.blob_cache.statistics()["blobs"], "cpu_s": time.process_time(),
                "cpu_at_last_answer_s": self.cpu_at_last_answer})
        if job is not None:
            j = st.jobs.get(job)
            states: dict[str, int] = {}
            for node in self.nodes.values():
                for w in node.workloads.values():
                    if w.job_id == job:
                        states[w.state] = states.get(w.state, 0) + 1
            out["job"] = {"job_id": job, "states": states,
                          "events": j.count if j else 0, "first_at": j.first_at if j else 0.0,
                          "last_at": j.last_at if j else 0.0}
        return out

    # ---- the placement listener

    async def _serve_control(self, node_id: str, listener: trio.SocketListener) -> None:
        """A node's own control endpoint over TLS, as an agent's API serves it: its own
        certificate (made when the placer first connects), the placer's required. What the
        placer pushes here directly (a rack whose relay is not connected) is routed as on the
        shared listener, for this node only."""
        while True:
            try:
                tcp = await listener.accept()
            except OSError as e:   # (out of descriptors a moment: the placer retries)
                log.warning("control listener accept failed node=%s err=%s", node_id, e)
                await trio.sleep(0.1)
                continue
            self.spawn(self._handle_tls, node_id, tcp)

    async def _handle_tls(self, node_id: str, tcp: trio.SocketStream) -> None:
        assert self.node_tls is not None
        ctx = self._server_ctx.get(node_id)
        if ctx is None:
            ctx = self._server_ctx[node_id] = self.node_tls.server_context(node_id)
        s = trio.SSLStream(tcp, ctx, server_side=True)
        try:
            with trio.fail_after(WIRE_CONNECT_S):
                await s.do_handshake()
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await trio.aclose_forcefully(tcp)
            return
        self.control_handshakes += 1
        p = tls.stream_principal(s)
        if p is None or p.name != "placer":   # (only the placer places: agent/api.py's rule)
            await trio.aclose_forcefully(s)
            return
        await self._handle(s, only=node_id)

    async def _handle(self, stream: trio.abc.Stream, only: str | None = None) -> None:
        """One connection's requests; ``only``: a node's own endpoint (its requests only)."""
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 << 10)
        body = bytearray()
        req: h11.Request | None = None
        try:
            async with stream:
                while True:
                    ev = conn.next_event()
                    if ev is h11.NEED_DATA:
                        data = await stream.receive_some(1 << 16)
                        conn.receive_data(bytes(data))
                        if not data:
                            return
                        continue
                    if isinstance(ev, h11.Request):
                        req, body = ev, bytearray()
                    elif isinstance(ev, h11.Data):
                        body += ev.data
                        if len(body) > 16 << 20:
                            return
                    elif isinstance(ev, h11.EndOfMessage) and req is not None:
                        status, payload = self._route(req, bytes(body), only)
                        out = conn.send(h11.Response(status_code=status, headers=[
                            ("content-type", "application/json"), ("content-length", str(len(payload)))]))
                        out += conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage())
                        await stream.send_all(out)
                        if conn.our_state is h11.MUST_CLOSE:
                            return
                        conn.start_next_cycle()
                        req = None
                    elif isinstance(ev, h11.ConnectionClosed):
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError, OSError):
            return

    def _route(self, req: h11.Request, body: bytes, only: str | None = None) -> tuple[int, bytes]:
        target = req.target.decode("latin-1")
        u = urlsplit(target)
        method = req.method.decode()
        parts = u.path.split("/")  # "", "n", node, "v1", "placements"
        if only is not None and (len(parts) < 3 or parts[2] != only):
            return 404, b'{"error": "not this node"}'
        if method == "GET" and u.path == "/stats":
            job = parse_qs(u.query).get("job", [None])[0]
            return 200, json.dumps(self.statistics(job)).encode()
        if method == "POST" and u.path == "/relays/hang":  # the bench's failure case (loopback only)
            frac = float(parse_qs(u.query).get("fraction", ["0"])[0])
            every = round(1 / frac) if frac > 0 else 0
            for i, k in enumerate(self.racks):
                k.relay.stalled = bool(every) and i % every == every // 2
            return 200, json.dumps({"hung": sum(k.relay.stalled for k in self.racks)}).encode()
        if method != "POST" or len(parts) != 5 or parts[1] != "n" or parts[3:] != ["v1", "placements"]:
            return 404, b'{"error": "not found"}'
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in req.headers}
        if not self.tokens.check("placer", bearer(headers)):
            return 401, b'{"error": "unauthorized"}'
        node = self.nodes.get(parts[2])
        if node is None:
            return 404, b'{"error": "no such node"}'
        try:
            p = _placement_dec.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return 400, _enc.encode({"error": "malformed placement", "detail": str(e)})
        st = self.stats
        st.placements += 1
        st.placement_bytes += len(body)
        st.placement_bytes_max = max(st.placement_bytes_max, len(body))
        status, ack = node.place(p)
        self.stats.acks[ack.effective_outcome()] = self.stats.acks.get(ack.effective_outcome(), 0) + 1
        return status, _enc.encode(ack)


def _control_address(i: int) -> str:
    """Node ``i``'s loopback address for its own control endpoint: 127.100.0.1 on, one a node,
    so that no address runs out of ports however many nodes the emulators hold."""
    i += 1
    return f"127.{100 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}"


def _control_listener(host: str) -> trio.SocketListener:
    """A listening socket on ``host`` (a numeric address: bound at once, no resolver)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(16)
    except OSError:
        sock.close()
        raise
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


def _descriptors_for(nodes: int) -> bool:
    """Whether this process may hold a listening socket per node (and its other ~2,000
    descriptors): the soft limit raised to the hard one if need be. False: the nodes keep the
    shared plain listener (the placer's direct pushes over TLS then do not reach them)."""
    want = nodes + 2048
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != inf and soft < want and (hard == inf or hard >= want):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft != inf and soft < want:
        log.warning("no own TLS control endpoint per node: %d nodes need %d descriptors, the limit is %d",
                    nodes, want, soft)
        return False
    return True


def _no_reports(node_id: str, rep: NodeReport) -> tuple[int, ReportReply]:
    return 400, ReportReply(ok=False, error="an emulator's frames listener takes no reports")


WIRE_CONNECT_S = 60.0   # an emulated node's framed-channel connect deadline (AgentLink's default)
GC_HOLD_S = 2.0         # relay mode: the collector stays off this long after the last bundle (Fleet.hold_gc)
EVENTS_HOLD_S = 0.05    # relay mode: members' event reports wait until no bundle came for this long ...
EVENTS_HOLD_MAX_S = 2.0  # ... but never longer than this (a steady stream of small rounds)

_wire_reply = msgspec.json.Decoder(WireReply)


def _read_reply(s: ssl.SSLSocket, buf: bytearray, deadline: float) -> WireReply:
    while True:
        if len(buf) >= 4:
            ln = int.from_bytes(buf[:4], "big")
            if ln > 1 << 20:
                raise WireError(f"reply frame of {ln} bytes")
            if len(buf) - 4 >= ln:
                body = bytes(buf[4:4 + ln])
                del buf[:4 + ln]
                return _wire_reply.decode(body)
        s.settimeout(max(0.001, deadline - time.monotonic()))
        data = s.recv(1 << 16)
        if not data:
            raise WireError("placer closed the heartbeat channel")
        buf += data


def _register_blocking(host: str, port: int, ctx: ssl.SSLContext, source: str | None, hello: bytes,
                       report: bytes, timeout_s: float) -> WireReply:
    """One member's registration over its own mutual-TLS connection, in a worker thread: the
    real wire (TCP, a TLS 1.3 handshake with the member's certificate, the hello, its full
    report, the answer with its MAC key, close_notify), driven with blocking stdlib ``ssl``
    sockets, whose handshake and record loops run in C. A real agent drives the same exchange
    from trio (AgentLink: ``SSLStream``) on its own host's CPU; here thousands of members share
    two cores with the placer, and trio's userspace TLS loop cost the emulator ~2.5 ms a member
    on top of OpenSSL's own work (py-spy, 4,096 members), which the placer does not see."""
    deadline = time.monotonic() + timeout_s
    raw = socket.create_connection((host, port), timeout=timeout_s,
                                   source_address=(source, 0) if source else None)
    try:
        s = ctx.wrap_socket(raw, server_side=False, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    with s:
        try:
            s.do_handshake()   # (the GIL released in OpenSSL)
        except ssl.SSLError as e:
            raise tls.TLSError(tls.describe_ssl_error(e)) from None
        p = tls.principal_of(s.getpeercert())
        if p is None or p.name != "placer":
            raise tls.TLSError(f"the peer is {p.name if p else 'no herd principal'}, not placer")
        buf = bytearray()
        try:
            s.sendall(hello)
            r = _read_reply(s, buf, deadline)
            if r.status != 200:
                raise WireError(f"placer refused the heartbeat channel: {r.status} {r.error}", status=r.status)
            s.sendall(report)
            wr = _read_reply(s, buf, deadline)
        except ssl.SSLError as e:
            raise WireError(f"the framed channel closed: {tls.describe_ssl_error(e)}", status=503) from None
        try:
            s.settimeout(max(0.001, min(1.0, deadline - time.monotonic())))
            s.unwrap()   # our close_notify, and the placer's
        except (OSError, ValueError):
            pass
        return wr


def _source(k: int, sources: int) -> str | None:
    if sources <= 1:
        return None
    return f"127.0.0.{2 + k % min(sources, 250)}"


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


# ---------------------------------------------------------------- the process

async def _main(cfg: FleetConfig, tokens: TokenSet, go_now: bool, seconds: float) -> None:
    fleet = Fleet(cfg, tokens)
    async with trio.open_nursery() as n:
        control = await n.start(fleet.run)
        # Thousands of nodes' snapshots are millions of long-lived objects: keep the cyclic
        # collector from walking them on every burst (the emulator's cost is not the placer's).
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
        gc.callbacks.append(fleet.gc.callback)
        sys.stdout.write(json.dumps({"ready": True, "control": control, "nodes": cfg.nodes,
                                     "offset": cfg.offset, "pid": _pid()}) + "\n")
        sys.stdout.flush()

        async def stdin_lines() -> None:
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                if not line:  # the parent went away: stop
                    n.cancel_scope.cancel()
                    return
                if line.strip() == "go":
                    fleet.go()

        n.start_soon(stdin_lines)
        if go_now:
            fleet.go()
        await trio.sleep(seconds)
        n.cancel_scope.cancel()


def _summed(counts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _pid() -> int:
    return os.getpid()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testing.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--placer", required=True, help="the placer's base URL (http://127.0.0.1:PORT)")
    ap.add_argument("--wire-url", default=None, help="tcp://HOST:PORT of the placer's framed channel, if known")
    ap.add_argument("--token-dir", required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--fleet", choices=sorted(PROFILE_OF), default="h100")
    ap.add_argument("--mux", type=int, default=8, help="shared framed connections (0: one per node)")
    ap.add_argument("--sources", type=int, default=16, help="source addresses 127.0.0.2.. to spread over")
    ap.add_argument("--http-only", action="store_true", help="report over HTTP only (the baseline)")
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument("--fetch-delay", type=float, default=0.05)
    ap.add_argument("--run-delay", type=float, default=0.1)
    ap.add_argument("--stop-delay", type=float, default=0.05)
    ap.add_argument("--refuse-gpus", default="", help="comma-separated node ids that refuse with refused_gpus")
    ap.add_argument("--refuse-spec", default="", help="comma-separated node ids that refuse with refused_spec")
    ap.add_argument("--relays", action="store_true",
                    help="relay mode: one relay per rack (frames connection, aggregated beats, bundles)")
    ap.add_argument("--hung-relays", default="", help="comma-separated racks whose relay never answers bundles")
    ap.add_argument("--no-hold-events", action="store_true",
                    help="relay mode: members report events at once, even while bundles are being handled")
    ap.add_argument("--relay-hold", type=float, default=RELAY_HOLD_S,
                    help="relay mode: seconds a member keeps a relay that lost the placer (0: directly at once)")
    ap.add_argument("--no-compact", action="store_true",
                    help="relay mode: full reports always carry the GPU snapshot (no compact registration)")
    ap.add_argument("--holds", default="", metavar="MANIFEST_ID",
                    help="a manifest id that one node in --holds-every reports holding (contacts for a gang of it)")
    ap.add_argument("--holds-every", type=int, default=256)
    ap.add_argument("--go", action="store_true", help="start at once instead of waiting for 'go' on stdin")
    ap.add_argument("--seconds", type=float, default=3600.0, help="exit after this long (bound)")
    ap.add_argument("--tls-dir", default=None,
                    help="a PKI dir with ca.key: every node reports over its own mutual-TLS connection")
    ap.add_argument("--tls-threads", type=int, default=8,
                    help="relay mode over TLS: members' registrations in flight in this process")
    ap.add_argument("--enroll", action="store_true",
                    help="relay mode over TLS: members register through their relay (no handshake with the placer)")
    ap.add_argument("--enroll-ecdh", action="store_true",
                    help="--enroll: members hold no enrolment key (certificates issued before them): they enrol by ECDH")
    ap.add_argument("--log-level", default=os.environ.get("HERD_EMU_LOG", "ERROR"),
                    help="the emulator's log level (default ERROR; env HERD_EMU_LOG)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if os.environ.get("HERD_FLEET_DEBUG"):  # diagnosis: this module's debug lines (connections, lost events)
        log.setLevel(logging.DEBUG)
    tokens = TokenSet.load(a.token_dir)
    cfg = FleetConfig(
        placer_url=a.placer, nodes=a.nodes, offset=a.offset, fleet=a.fleet, wire_url=a.wire_url, mux=a.mux,
        sources=a.sources, use_wire=not a.http_only, heartbeat_s=a.heartbeat,
        refuse_gpus=frozenset(x for x in a.refuse_gpus.split(",") if x),
        refuse_spec=frozenset(x for x in a.refuse_spec.split(",") if x),
        timing=Timing(fetch_s=a.fetch_delay, run_s=a.run_delay, stop_s=a.stop_delay), relays=a.relays,
        hung_relays=frozenset(x for x in a.hung_relays.split(",") if x), tls_dir=a.tls_dir,
        tls_threads=a.tls_threads, hold_events=not a.no_hold_events, relay_hold_s=a.relay_hold, enroll=a.enroll,
        enroll_ecdh=a.enroll_ecdh,
        compact=not a.no_compact, holds=a.holds, holds_every=a.holds_every if a.holds else 0)
    try:
        trio.run(_main, cfg, tokens, a.go, min(a.seconds, math.inf))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
