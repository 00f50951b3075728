"""The node agent daemon: one place builds it, one nursery tree runs it.

::

    Agent.run
    ├── signal watcher        SIGTERM/SIGINT -> STOPPING=1, cancel the tree (workloads live on)
    ├── GpuMonitor.run        discovery, polling, events, health           (agent.gpus)
    ├── Supervisor.run        state owner; per-workload life-cycle and killer tasks
    │   └── ShimPool.run      pre-started workload shims
    ├── DataPlane.run         peers fetch chunks from our store            (p2p.dataplane; --data-listen)
    ├── serve(app)            the operator/control HTTP API                (agent.api)
    ├── PartAcceptor.run      NodeParts from the rack relay: check, persist, ack, place  (agent.parts)
    ├── Relay.run             [relay] enabled: members listener + frames connection up   (agent.relay)
    ├── AgentLink.run         reports to the placer (or through the rack relay)  (scheduler_link; --placer)
    ├── Notifier.watchdog     WATCHDOG=1 at WATCHDOG_USEC/2 from this loop
    ├── status loop           STATUS= one-line summary
    └── prefetch tasks        POST /v1/prefetch

READY=1 goes out once the GPUs are discovered, the supervisor has recovered its
state and the API is bound; ``endpoints.json`` (control_url, data_url) is written
just before.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

from infra.auth import ROLES, TokenSet, token_dir_from_env
from infra.errors import single_cause
from infra.grants import decode_grant, prove
from infra.http import serve
from infra.pki import PKIError
from infra.tls import Security
from p2p.dataplane import DataPlane, DataPlaneConfig
from p2p.fetch import fetch_artifact
from p2p.herd import Herd, HerdConfig
from p2p.herd import render_metrics as render_p2p_metrics
from p2p.origins import open_origin
from p2p.readers import Readers
from p2p.store import ChunkStore
from p2p.tree import serving_cap
from scheduler_link.agent_link import AgentLink, ReportChannel
from scheduler_link.enroll import client_from_files
from scheduler_link.epochs import Epochs
from scheduler_link.heartbeat_wire import WireError
from scheduler_link.messages import (
    GangBlob,
    GpuSnapshot,
    NodeOutcome,
    NodePart,
    NodeReport,
    PeerTable,
    Placement,
    PrefetchRequest,
    Victim,
    WorkloadEvent,
)

from . import certs, procs
from .api import build_app
from .blobs import BlobCache, BlobSource
from .config import AgentConfig
from .errors import AgentError, UnknownWorkload
from .gpus import GpuMonitor, open_backend
from .gpus import render_metrics as render_gpu_metrics
from .isolation import Isolation, detect
from .launcher import ShimPool
from .metrics import render_agent_metrics
from .parts import PartAcceptor
from .readers import GangReaders
from .relay import Relay
from .sdnotify import Notifier
from .state import atomic_write
from .supervisor import Supervisor, trees_to_remove
from .tenants import Tenancy

MAX_BLOB_BYTES = 64 << 20   # a 200,000-node gang's peer table is ~10 MB

RELAY_URL_FILE = "relay-url"   # the rack relay this node last reported through (it enrols there after a restart)
log = logging.getLogger("herd.agent")

# Start steps the placer already knows of, or that a report follows within milliseconds: a
# pod is "accepted" in the placement's own answer (the ack), and "starting" lasts from its last
# set-up to its process running (or failing). Their events ride on the next report that goes
# anyway instead of one report each, so the report that says the gang's pods run is not queued
# behind them on the link (one report in flight) nor behind them in the placer's loop.
QUIET_STATES = frozenset({"accepted", "starting"})


def reported_at_once(state: str) -> bool:
    """Whether a workload event in ``state`` makes the link report at once (else it goes with
    the next report: the next event that does, or the heartbeat). Pure."""
    return state not in QUIET_STATES


class Agent:
    """The daemon. Also the ``hooks`` object the scheduler link calls."""

    def __init__(self, config: AgentConfig, *, env: Mapping[str, str] | None = None,
                 handle_signals: bool = True) -> None:
        self.config = config
        self.node_id = config.node_id
        self.state_dir = Path(config.state_dir)
        self.tokens = TokenSet.load(config.token_dir)
        # TLS (agent.certs): None while a bootstrap is pending (run() obtains the certificate)
        self.security: Security | None = certs.security_for(config)
        if config.dataplane.tls and self.security is not None and self.security.insecure:
            raise AgentError("[dataplane] tls = true needs the agent's certificates, and the agent is insecure")
        if (config.dataplane.tls is False and config.data_listen and not config.dataplane.insecure_reads
                and "*" not in config.dataplane.public and not (self.security is not None and self.security.insecure)):
            raise AgentError("[dataplane] tls = false serves every artifact to any holder of cluster.token (no "
                             "certificate names the asker, so reads by membership cannot hold): say "
                             "[dataplane] insecure_reads = true to run it so, or public = [\"*\"]")
        self.notifier = Notifier(env)
        self.handle_signals = handle_signals
        self.ready = False
        self.control_url = ""
        self.data_url = ""
        # the parts run() opens (None before it, or when not configured: no placer, no data plane, no relay)
        self.monitor: GpuMonitor | None = None
        self.store: ChunkStore | None = None
        self.herd: Herd | None = None
        self.dataplane: DataPlane | None = None
        self.link: AgentLink | None = None
        self._nursery: trio.Nursery | None = None
        self._prefetching: set[str] = set()
        self.relay: Relay | None = None
        self.blobs = BlobCache(on_blob=self._blob_grant)
        self.gang_readers: GangReaders | None = None   # reads by membership, with data-plane TLS
        # the highest placer epoch this node has seen (scheduler_link.epochs), durable next to its
        # part store: one gate for its parts, the placer's placements, its link and its relay
        try:
            self.epochs = Epochs.in_state_dir(self.state_dir)
        except ValueError as e:
            raise AgentError(str(e)) from None
        # tenants apart (agent.tenants): a uid per workload, its own /proc and GPU device nodes
        iso = Isolation(*detect(config.workloads.cgroup), tenancy=Tenancy(config.isolation, gpu_minors=self._gpu_minors))
        self.supervisor = Supervisor(self.state_dir, node_id=self.node_id, gpu_health=self._gpu_health,
                                     config=config.workloads, fetcher=self._fetch, base_env=env,
                                     blob_fetcher=self._blob_bytes if config.placer else None, isolation=iso,
                                     pool=ShimPool(config.workloads.shim_pool, prepare=iso.for_launch))
        self.parts = PartAcceptor(self.state_dir, node_id=self.node_id, supervisor=self.supervisor,
                                  inventory=self._inventory, blob=self._gang_blob, notify=self._notify,
                                  keys=self._msg_keys, boot=self.link_boot_id, allowed_origins=config.allowed_origins,
                                  blob_timeout_s=config.workloads.blob_timeout_s, epochs=self.epochs)

    # ------------------------------------------------------------ wiring

    def _blob_sources(self, blob_id: str) -> list[BlobSource]:
        """Where this node gets a gang blob, in order: as a relay, the relays its bundle named
        and the placer's frames connection; as a member, its relay; last, the placer over HTTP."""
        out: list[BlobSource] = []
        if self.relay is not None:
            out += self.relay.blob_sources(blob_id)
        if self.link is not None:
            out.append(self.link.relay_blob)
        if self.config.placer:
            out.append(self._fetch_blob)
        return out

    async def _gang_blob(self, blob_id: str) -> GangBlob:
        got = (await self.blobs.get(blob_id, self._blob_sources(blob_id)))[1]
        self._readers_changed()
        return got

    async def _blob_bytes(self, blob_id: str) -> bytes:
        """The supervisor's peers-file step: the cached blob (verified again there)."""
        got = (await self.blobs.get(blob_id, self._blob_sources(blob_id)))[0]
        self._readers_changed()
        return got

    def _open_readers(self) -> Readers:
        """The data plane's read policy, kept equal to this node's gangs (agent.readers)."""
        # read grants (infra.grants) are checked with the placer's bundle key, from registration
        readers = Readers(self.config.dataplane.public,
                          grant_key=lambda: self.link.placer_key if self.link is not None else None)
        self.gang_readers = GangReaders(readers, self.supervisor.records_view, self._cached_blob,
                                        want=self._want_blob)
        self.supervisor.add_listener(self._readers_changed)
        self.gang_readers.refresh()
        return readers

    def _want_blob(self, blob_id: str) -> None:
        """A live workload's gang blob this agent does not hold (it restarted): fetched in the
        background, for the data plane's readers (agent.readers)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._blob_for_readers, blob_id)

    async def _blob_for_readers(self, blob_id: str) -> None:
        try:
            await self._gang_blob(blob_id)
        except Exception as e:   # (BlobUnavailable, a source's error): the placement's peers stay its readers
            log.info("gang blob not had for the data plane's readers blob=%s err=%s", blob_id[:16], e)

    def _blob_grant(self, blob: GangBlob) -> None:
        if blob.read_grant:
            self._take_grant(blob.read_grant, blob.peers.node_ids)

    def take_grant(self, p: Placement) -> None:
        """A placement's read grant (infra.grants): from now on this node's peer requests
        carry its proof, so the contacts outside its gang serve it the gang's manifest. A
        small gang's placement lists the members first; a big gang's proof needs the blob
        (taken when the blob comes: ``_blob_grant``)."""
        if not p.read_grant:
            return
        if 0 < p.gang_nodes <= len(p.peers):
            self._take_grant(p.read_grant, [q.node_id for q in p.peers[:p.gang_nodes]])
        elif p.gang_blob_id and (got := self.blobs.cached(p.gang_blob_id)) is not None:
            self._take_grant(p.read_grant, got[1].peers.node_ids)

    def _take_grant(self, raw: bytes, node_ids: list[str]) -> None:
        if self.herd is None:
            return
        proof = prove(raw, node_ids, self.node_id)
        if proof is None:   # not for this node (a relay holds its rack's blobs), or not for that table
            return
        g = decode_grant(raw)
        self.herd.client.set_grant(g.manifest_id, proof, g.expires_at)

    def _cached_blob(self, blob_id: str) -> GangBlob | None:
        got = self.blobs.cached(blob_id)
        return got[1] if got is not None else None

    def _readers_changed(self, ev: WorkloadEvent | None = None) -> None:
        if self.gang_readers is not None:
            self.gang_readers.refresh()

    def _inventory(self) -> tuple[list[str], Mapping[str, str] | None]:
        snap = self.gpu_snapshot()
        return [g.uuid for g in sorted(snap.gpus, key=lambda g: g.index)], self._gpu_health()

    def _notify(self, ev: WorkloadEvent) -> None:
        if self.link is not None:
            self.link.notify(ev, at_once=reported_at_once(ev.state))

    def _msg_keys(self) -> tuple[bytes | None, bytes | None]:
        """(this node's MAC key, the placer's signing key): from the link's registration."""
        link = self.link
        return (link.mac_key, link.placer_key) if link is not None else (None, None)

    def link_boot_id(self) -> str | None:
        """This node's boot as the placer knows it (its link's ``boot_id``); stop parts name it."""
        return self.link.boot_id if self.link is not None else None

    async def handle_part(self, part: NodePart) -> NodeOutcome:
        """A NodePart from the rack relay (or, as the relay, this node's own)."""
        return await self.parts.handle(part)

    async def _fetch_blob(self, blob_id: str) -> bytes:
        """A gang's blob from the placer (``GET /v1/gangs/{id}``, cluster token), bounded; the
        caller checks it against its id."""
        import httpx

        assert self.config.placer is not None
        url = f"{(self.link.placer_url if self.link else self.config.placer).rstrip('/')}/v1/gangs/{blob_id}"
        out = bytearray()
        verify = self.security.client if self.security is not None and self.security.client else True
        async with httpx.AsyncClient(timeout=10.0, verify=verify) as c, c.stream(
                "GET", url, headers={"authorization": f"Bearer {self.tokens.cluster}"}) as r:
            if r.status_code != 200:
                raise AgentError(f"placer answered {r.status_code} for gang blob {blob_id[:16]}")
            async for piece in r.aiter_bytes():
                out += piece
                if len(out) > MAX_BLOB_BYTES:
                    raise AgentError(f"gang blob {blob_id[:16]} is over {MAX_BLOB_BYTES} bytes")
        return bytes(out)

    def _open_gpus(self) -> GpuMonitor:
        backend = open_backend(self.config.gpus, hostname=self.node_id, rack=self.config.topology.rack)
        self.monitor = GpuMonitor(backend, poll_interval_s=self.config.gpu_poll_interval_s,
                                  state_dir=self.state_dir)
        return self.monitor

    def _dataplane_tls(self, sec: Security) -> bool:
        """``[dataplane] tls``: on with the agent's certificates unless set false (asking for it
        on an insecure agent was refused in ``__init__``)."""
        if sec.insecure:
            return False
        if self.config.dataplane.tls is False:
            log.warning("data plane is plain TCP ([dataplane] tls = false): chunks travel in the clear and any "
                        "holder of cluster.token reads every artifact here")
            return False
        return True

    def _open_store(self) -> ChunkStore:
        self.store = ChunkStore(self.config.store_dir, quota_bytes=self.config.store.quota_bytes)
        # One herd fetcher for the agent's life: single flight across concurrent fetches,
        # peer penalties that outlive one fetch, counters for /metrics and /v1/status.
        self.herd = Herd(self.store, node_id=self.node_id, token=self.tokens.cluster)
        return self.store

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (or SIGTERM/SIGINT); ``started(control_url)`` once READY."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._check_token_dir()
        monitor = self._open_gpus()
        store = self._open_store()
        try:
            async with trio.open_nursery() as n:
                self._nursery = n
                if self.handle_signals:
                    await n.start(self._signals, n.cancel_scope)
                await n.start(monitor.run)
                await n.start(self.supervisor.run)
                if self.security is None:
                    self.security = await certs.bootstrap_security(self.config)
                sec = self.security
                dp_tls = self._dataplane_tls(sec)
                if dp_tls and self.herd is not None:  # peers' chunks over mutual TLS too (https:// data URLs)
                    self.herd.client.use_tls(sec.client)
                if self.config.data_listen:
                    hc = HerdConfig()
                    # no node serves one chunk to more than its tree children at once (k racks, m
                    # rack-mates, and a dead rack home's m - 1 when it stands in: p2p.tree.serving_cap)
                    cap = serving_cap(hc.tree_k, hc.rack_fanout)
                    # reads by membership (p2p.readers): peers are named by their certificates
                    readers = self._open_readers() if dp_tls else None
                    self.dataplane = DataPlane(store, token=self.tokens.cluster, listen=self.config.data_listen,
                                               config=DataPlaneConfig(max_serving_per_chunk=cap),
                                               ssl_context=sec.channel if dp_tls else None, readers=readers)
                    self.data_url = await n.start(self.dataplane.run)
                self.control_url = await n.start(partial(serve, ssl_context=sec.api), build_app(self),
                                                 self.config.listen)
                self._write_endpoints()
                if self.config.placer:
                    link = self._start_link(self.config.placer)
                    await n.start(self.parts.run)
                    if self.config.relay.enabled:
                        await self._start_relay(n, link)
                    await n.start(link.run)
                    if sec.files is not None:  # renew before expiry, over the current certificate
                        n.start_soon(certs.renew_loop, sec, self.config.placer, self.node_id, self.state_dir)
                self.ready = True
                self.notifier.ready(self.summary())
                log.info("agent ready node=%s control=%s data=%s gpus=%s", self.node_id, self.control_url,
                         self.data_url or "-", self.config.gpus)
                await n.start(self.notifier.watchdog)
                n.start_soon(self._status_loop)
                task_status.started(self.control_url)
        finally:
            self.ready = False  # the monitor closes its backend itself
            if self.herd is not None:
                with trio.CancelScope(shield=True):
                    await self.herd.aclose()

    def _check_token_dir(self) -> None:
        """Tokens readable by anyone but their owner reach workloads: say so at start."""
        d = token_dir_from_env(self.config.token_dir)
        for p in [d, *(d / f"{r}.token" for r in ROLES)]:
            try:
                mode = os.stat(p).st_mode & 0o777
            except OSError:
                continue
            if mode & 0o077:
                log.warning("token path readable or writable by others path=%s mode=%o (want 0700 dir, 0600 files)",
                            p, mode)
    def _start_link(self, placer: str) -> AgentLink:
        self.link = link = AgentLink(placer, self.tokens.cluster, self.node_id, self, placers=self.config.placers,
                                     heartbeat_s=self.config.heartbeat_s, on_part=self.handle_part,
                                     relay_trust_intervals=self.config.relay.trust_intervals,
                                     relay_hold_s=self.config.relay.hold_s, epochs=self.epochs,
                                     wire_connect=self._own_wire if self.config.relay.enabled else None,
                                     copy_fold=self._fold_copy if self.config.relay.enabled else None,
                                     copy_leader=self._copy_leader if self.config.relay.enabled else None,
                                     ssl_context=self.security.client if self.security is not None else None,
                                     **self._enroll_args())
        self.supervisor.add_listener(self._notify)
        return link

    async def _own_wire(self, wire_url: str, token: str, node_id: str) -> ReportChannel:
        """A relay host reports over its relay's connection up (agent.relay.OwnReports)."""
        if self.relay is None:
            raise WireError("the relay has not started yet")
        return await self.relay.own_channel(wire_url, token, node_id)

    def _fold_copy(self, wire_url: str, rep: NodeReport) -> bool:
        """A relay host's empty heartbeat copied to a follower rides in its relay's beat copy there."""
        return self.relay is not None and self.relay.copies.fold(wire_url, rep)

    async def _copy_leader(self, wait_s: float) -> str | None:
        """Which placer the relay goes up to, or is about to (agent.relay.Relay.leader_wire)."""
        return None if self.relay is None else await self.relay.leader_wire(wait_s)

    def _enroll_args(self) -> dict[str, Any]:
        """Enrolment through the rack relay (scheduler_link.enroll): this node's certificate
        key, and the relay it last reported through (kept in the state dir across restarts)."""
        sec = self.security
        if sec is None or sec.insecure or sec.files is None:
            return {}
        try:
            client = client_from_files(sec.files)
        except PKIError as e:
            log.warning("no enrolment through the relay: %s", e)
            return {}
        try:
            url = (self.state_dir / RELAY_URL_FILE).read_text().strip() or None
        except OSError:
            url = None
        return {"enroll": client, "enroll_relay_url": url, "on_relay": self._keep_relay_url}

    def _keep_relay_url(self, url: str) -> None:
        atomic_write(self.state_dir / RELAY_URL_FILE, url.encode(), 0o644)

    async def _start_relay(self, n: trio.Nursery, link: AgentLink) -> None:
        t = self.config.topology
        self.relay = Relay(node_id=self.node_id, rack=f"{t.zone}/{t.block}/{t.rack}", tokens=self.tokens,
                           listen=self.config.relay.listen, advertise=self.config.relay.advertise,
                           wire_url=lambda: link.wire_url, own_part=self.handle_part, blobs=self.blobs,
                           placer_blob=self._fetch_blob, heartbeat_s=self.config.heartbeat_s, keys=self._msg_keys,
                           on_bad_bundle=link.request_full_report, security=self.security, epochs=self.epochs)
        link.own_relay_url = await n.start(self.relay.run)

    async def _signals(self, scope: trio.CancelScope, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            task_status.started()
            async for sig in sigs:
                log.info("signal %s: stopping the agent (workloads keep running)", signal.Signals(sig).name)
                self.notifier.stopping()
                scope.cancel()
                return

    async def _status_loop(self) -> None:
        last = ""
        while True:
            s = self.summary()
            if s != last:
                self.notifier.status(s)
                last = s
            await self._collect_trees()
            await trio.sleep(5)

    async def _collect_trees(self) -> None:
        """Remove materialised trees no live workload uses, beyond ``store.keep_trees``
        (their chunks become evictable under the quota)."""
        if self.store is None:
            return
        doomed = trees_to_remove(self.store.materialised(), self.supervisor.workloads(),
                                 self.config.store.keep_trees)
        for mid in doomed:
            try:
                await trio.to_thread.run_sync(self.store.remove_artifact, mid)
                log.info("artifact tree removed manifest=%s", mid)
            except Exception as e:  # pinned again meanwhile, or a disk error: try next round
                log.warning("artifact tree not removed manifest=%s err=%s", mid, e)

    def _write_endpoints(self) -> None:
        doc = {"node_id": self.node_id, "control_url": self.control_url, "data_url": self.data_url or None,
               "pid": os.getpid(), "boot_id": procs.boot_id(), "written_at": time.time()}
        atomic_write(self.state_dir / "endpoints.json", msgspec.json.encode(doc), mode=0o644)

    # ------------------------------------------------------------ views

    def gpu_snapshot(self) -> GpuSnapshot:
        return self.monitor.snapshot() if self.monitor is not None else GpuSnapshot()

    def _gpu_minors(self) -> dict[str, int]:
        """GPU UUID -> the minor number of its /dev/nvidiaN node."""
        return {g.uuid: g.index if g.minor_number is None else g.minor_number for g in self.gpu_snapshot().gpus}

    def _gpu_health(self) -> dict[str, str] | None:
        snap = self.gpu_snapshot()
        if not snap.gpus and self.monitor is None:
            return None
        return {g.uuid: g.health for g in snap.gpus}

    def summary(self) -> str:
        snap = self.gpu_snapshot()
        healthy = sum(1 for g in snap.gpus if g.health == "healthy")
        by = self.supervisor.statistics()["workloads_by_state"]
        sim = " simulated" if snap.simulated else ""
        return (f"{len(snap.gpus)}{sim} GPUs ({healthy} healthy), {by.get('running', 0)} workloads running, "
                f"{by.get('terminating', 0)} terminating")

    def store_statistics(self) -> dict[str, Any] | None:
        if self.store is None:
            return None
        st = self.store.statistics()
        return msgspec.structs.asdict(st) if isinstance(st, msgspec.Struct) else dict(st)

    def status_json(self) -> bytes:
        snap = self.gpu_snapshot()
        doc = {
            "node_id": self.node_id, "ready": self.ready, "control_url": self.control_url,
            "data_url": self.data_url or None, "topology": self.config.topology,
            "nvlink_domain": snap.nvlink_domain, "backend": snap.backend, "simulated": snap.simulated,
            "isolation": self.supervisor.isolation.mode, "workload_user": self.supervisor.identities.default.name,
            "tenants": self.supervisor.isolation.statistics()["tenants"],
            "gpus": snap, "gpu_holders": self.supervisor.gpu_holders(),
            "workloads": self.supervisor.workloads(), "supervisor": self.supervisor.statistics(),
            "store": self.store_statistics(),
            "data_plane": self.dataplane.statistics() if self.dataplane is not None else None,
            "herd": self.herd.statistics() if self.herd is not None else None,
            "link": self.link.statistics() if self.link is not None else None,
            "relay": self.relay.statistics() if self.relay is not None else None,
            "parts": self.parts.statistics(), "blobs": self.blobs.statistics(),
            "placer_epoch": self.epochs.statistics(),
            "security": self.security.status() if self.security is not None else None,
            "gpu_monitor": self.monitor.statistics() if self.monitor is not None else None,
        }
        return msgspec.json.encode(doc)

    def metrics_text(self) -> str:
        gpu = render_gpu_metrics(self.gpu_snapshot(), self.node_id) if self.monitor is not None else ""
        own = render_agent_metrics(self.node_id, self.supervisor.statistics(), self.store_statistics(), self.ready)
        p2p = ""
        if self.herd is not None:
            p2p = render_p2p_metrics(self.node_id, self.herd.statistics(),
                                     self.dataplane.statistics() if self.dataplane is not None else None)
        parts = [x if x.endswith("\n") else x + "\n" for x in (gpu, own, p2p) if x]
        return "".join(parts)

    def inject(self, uuid: str, fault: Any) -> None:
        if self.monitor is None:
            raise AgentError("no GPU monitor")
        self.monitor.inject(uuid, fault)

    # ------------------------------------------------------------ link hooks

    def full_report(self) -> NodeReport:
        snap = self.gpu_snapshot()
        return NodeReport(node_id=self.node_id, boot_id="", seq=0, full=True, control_url=self.control_url,
                          data_url=self.data_url, topology=self.config.topology,
                          nvlink_domain=snap.nvlink_domain, snapshot=snap,
                          workloads=self.supervisor.workloads(),
                          manifests=self.store.complete_manifests() if self.store is not None else [],
                          sent_at=time.time())

    async def stop_workloads(self, victims: list[Victim]) -> None:
        for v in victims:
            try:
                await self.supervisor.stop(v.workload_id, reason=v.reason, grace_s=v.grace_s, preempted=v.preempted)
            except UnknownWorkload:
                log.info("asked to stop unknown workload id=%s (already gone)", v.workload_id)

    # ------------------------------------------------------------ artifacts

    async def _fetch_into_store(self, manifest_id: str, origin_url: str | None,
                                peers: list[Any] | PeerTable) -> dict[str, int]:
        if self.store is None:
            raise AgentError("this agent has no artifact store")
        if not origin_url:
            raise AgentError(f"manifest {manifest_id} needs an origin URL")
        # retries=0: the herd's origin call (at most HerdConfig.origin_tries requests a chunk, counted in
        # herd_p2p_origin_retries_total) is the one retry layer; the origin's transport retrying
        # inside it would multiply the attempts and hide them from the counter
        origin = open_origin(origin_url, retries=0)
        try:
            # a PeerTable (the gang's blob) goes as it is: the herd plans its trees over it
            peers = peers if isinstance(peers, PeerTable) else list(peers)
            stats = await fetch_artifact(self.store, manifest_id, origin, peers=peers, node_id=self.node_id,
                                         token=self.tokens.cluster, herd=self.herd)
            if self.link is not None:
                self.link.request_full_report()  # the placer learns at once that we hold it
        finally:
            with trio.CancelScope(shield=True):
                await origin.aclose()
        return {"bytes_from_origin": stats.bytes_from_origin, "bytes_from_peers": stats.bytes_from_peers,
                "bytes_local": stats.bytes_local}

    async def _fetch(self, manifest_id: str, origin_url: str | None,
                     peers: list[Any] | PeerTable) -> tuple[Path, dict[str, int]]:
        figures = await self._fetch_into_store(manifest_id, origin_url, peers)
        assert self.store is not None  # _fetch_into_store refuses without one
        path = await trio.to_thread.run_sync(self.store.materialise, manifest_id)
        return Path(path), figures

    def prefetch(self, req: PrefetchRequest) -> None:
        if self.store is None or self._nursery is None:
            raise AgentError("this agent has no artifact store")
        if req.manifest_id in self._prefetching:
            return
        self._prefetching.add(req.manifest_id)

        async def go() -> None:
            try:
                figures = await self._fetch_into_store(req.manifest_id, req.origin, list(req.peers))
                for k, v in figures.items():
                    self.supervisor.fetch_bytes[k] += v
                log.info("prefetched manifest=%s %s", req.manifest_id, figures)
            except Exception as e:
                log.warning("prefetch failed manifest=%s err=%s", req.manifest_id, e)
            finally:
                self._prefetching.discard(req.manifest_id)
        self._nursery.start_soon(go)


def run_agent(config: AgentConfig) -> None:
    """Blocking entry point for ``herd agent run``. A start-up failure (a port in use, a
    state dir that cannot be written) is one :class:`AgentError` line, not a traceback."""
    try:
        trio.run(Agent(config).run)
    except BaseExceptionGroup as eg:
        leaf = single_cause(eg)
        if isinstance(leaf, OSError):
            where = f" ({leaf.filename})" if leaf.filename else (
                f" (listen {config.listen}, data_listen {config.data_listen or '-'})"
                if leaf.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES) else "")
            raise AgentError(f"agent failed: {leaf.strerror or leaf}{where}") from eg
        if isinstance(leaf, AgentError):
            raise leaf from eg
        raise
