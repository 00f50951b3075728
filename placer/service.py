"""The placer service: HTTP API, report ingest, the decide-and-push loop.

Shape: :class:`placer.state.PlacerState` decides (synchronously, ``now`` passed in);
this module carries out what it returns. Every state call happens between awaits, so
the state has one owner: the trio task running at that moment (trio never preempts
inside synchronous code). Pushes run in the service's nursery through one
:class:`scheduler_link.fanout.PushPool` (kept-alive connections, bounded concurrency,
per-attempt deadlines, retries).

A decided job's start placements go out together; when every ack is in, the state
decides what follows (all accepted: starting; a refusal: roll back and place again).
Through the rack relays, :class:`placer.relays.RelayHub` drives the round
(:mod:`placer.delivery` decides it); the hub sees this service only as a
:class:`placer.relays.RelayHost` (the methods under "what the relay hub uses").
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio
import trio.lowlevel

from infra.auth import TokenSet
from infra.durable import atomic_write
from infra.http import (
    LARGE_BODY,
    App,
    Handler,
    HTTPError,
    Request,
    Response,
    json_response,
    serve,
)
from infra.tls import Security, daemon_security
from infra.version import PACKAGE_VERSION as _VERSION
from scheduler_link import authz, msgauth
from scheduler_link.epochs import EPOCH_FILE, EpochFile
from scheduler_link.fanout import PushPool, PushResult
from scheduler_link.heartbeat_wire import HeartbeatServer
from scheduler_link.messages import (
    WIRE_VERSION,
    ArtifactUpdate,
    DefragRequest,
    JobSpec,
    NodeOp,
    NodeReport,
    NodeStop,
    PlacementAck,
    PrefetchFanout,
    PrefetchRequest,
    RackBeat,
    RackBeatReply,
    ReportReply,
    Victim,
)
from scheduler_link.pki_api import PLACER_DOCS, PKIRoutes

from . import fleetsnap, inventories, observe
from .approvals import APPROVAL_DOCS, ApprovalRoutes, EtcdApprovals
from .config import PlacerConfig
from .dashboard import DASHBOARD_DOCS, Dashboard
from .enrollpool import default_workers
from .errors import EtcdError
from .etcdjournal import EtcdJournal, JobJournal
from .frag import fragmentation, largest_placeable, plan_defrag
from .ha import HighAvailability
from .inventories import InventoryBook
from .journal import Journal, JournalError
from .membership import Membership
from .nodeops import ApprovalFile
from .relays import RelayHub
from .state import ACCEPTED, TERMINAL_JOB_STATES, JobError, JobRec, NodeRec, Outcome, PlacerState, Push
from .views import DEFAULT_PODS, parse_page

log = logging.getLogger("herd.placer.service")
DIRECT_RETRY_S = 30.0   # a node refused past direct_max_nodes tries again after 15-30 s

_report_dec = msgspec.json.Decoder(NodeReport)
_ack_dec = msgspec.json.Decoder(PlacementAck)

DEFAULT_NODES_PAGE = 1000
# The collector walks every tracked object on a full collection; after a burst that grew
# the heap (a fleet registering, a big gang's records) the survivors are frozen so it
# stops walking them (gc.freeze, as CPython's docs suggest for long-lived state).
FREEZE_EVERY_S = 2.0
# A decision's delivery runs with the collector off (its records are young and live on): the
# first collection after a 25,000-node pass walks ~100k young objects (~150-400 ms measured
# with py-spy in the real placer, with the event loop held), and it would land between the
# decision and the first bundle. It runs after the round's acks are recorded instead, and the
# survivors are frozen; never later than this after the decision.
GC_HOLD_MAX_S = 5.0
WIRE_HOLD_LOST_AFTERS = 4  # a shared connection's read backlog holds the lost check back this many lost_after_s at most
RELAYED_STOPS_FROM = 32  # this many stops at once (a gang's rollback, a cancel) go through the relays
_Answer = TypeVar("_Answer", ReportReply, RackBeatReply)


class PlacerService:
    """``await nursery.start(service.run)`` -> the bound base URL."""

    def __init__(self, config: PlacerConfig, tokens: TokenSet | None = None, *,
                 clock: Callable[[], float] = time.time, security: Security | None = None) -> None:
        self.cfg = config
        self.tokens = tokens if tokens is not None else TokenSet.load(config.token_dir)
        self.clock = clock
        # TLS (infra.tls): the API, the framed channel and the pushes; or insecure
        self.security = security or daemon_security(config.tls_dir, "placer", insecure=config.insecure,
                                                    accept_tokens=config.accept_tokens, what="placer")
        self.token_use = authz.TokenUse() if self.security.accept_tokens else None
        self.pki = PKIRoutes(config.ca_dir, days=config.node_cert_days, clock=clock)
        self.state = PlacerState(config, started_at=clock())
        self.signer = msgauth.BundleSigner.generate()
        # gangs' read grants, signed with whichever bundle key is current (infra.grants)
        self.state.read_grants = lambda m, ids, until: self.signer.read_grant(m, ids, until)
        self.wire: HeartbeatServer | None = None
        self._refresh_revoked(clock())   # the deny-list (herd pki revoke) before any handshake
        self.mac_key: Callable[[str, str], bytes] = self.state.mac_key   # (relays.RelayHost: the state's own)
        self.rack_pins = self.state.rack_pins   # (relays.RelayHost: the racks nodes are pinned to)
        self.approvals = ApprovalRoutes(self.state, ApprovalFile(config.state_dir))   # herd node approve
        self.approvals.load()
        self.pool = PushPool(concurrency=config.push_concurrency, attempt_timeout_s=config.ack_timeout_s,
                             retries=config.push_retries, ssl_context=self.security.client)
        self.journal: JobJournal | None = None
        self.ha = HighAvailability(config) if config.etcd else None   # several placers, one leads (placer.ha)
        self.url: str | None = None
        self.wire_url: str | None = None
        self._nursery: trio.Nursery | None = None
        self._kick = trio.Event()
        self._changed = trio.Event()
        self.dashboard = Dashboard(self)
        self.app = self._build_app()
        self.relays = RelayHub(self, enroll_workers=default_workers() if config.enroll_workers is None
                               else config.enroll_workers)
        self.membership = Membership(self.state.nodes, self.state.blobs, self.state.counters, self.relays)  # (reads by membership)
        # message-level identity (scheduler_link.msgauth): ephemeral until run() loads the state
        # dir's (so a restarted placer keeps verifying what relays forward, and agents' pinned key holds)
        self.mac_master = os.urandom(msgauth.KEY_LEN)
        self.state.set_mac_master(self.mac_master)
        self.state.counters["bad_macs"] = 0
        self.state.counters["replays"] = 0
        self.push_counts = {"start": 0, "stop": 0, "failed": 0, "refused": 0}
        self.freezes = 0
        self._frozen_at = -math.inf
        self._gc_holds = 0                 # decisions being delivered with the collector off
        self._gc_hold_until = -math.inf
        self._nodes_at_freeze = 0
        # fencing (scheduler_link.epochs): a single placer's epoch, taken from its state dir in
        # run() before anything listens; with etcd the leader's is its leader key's revision
        self.own_epoch = 0
        self.started_at = clock()
        self.stale_epoch_acks = 0          # outcomes "stale_epoch": a node has heard from a newer placer
        # by answer type: the last answer stamped with the epoch, and its stamped copy
        self._stamps: dict[type, tuple[ReportReply | RackBeatReply, ReportReply | RackBeatReply]] = {}
        # whom a restarted placer waits for (placer.fleetsnap): set by _recover, None once over
        self.recovery: fleetsnap.Recovery | None = None
        self._snap_at = -math.inf          # monotonic time of the last snapshot written
        self._snap_seen = -1               # the state's membership_changes it was written at
        self._snap_writing = False
        self._etcd_snap: fleetsnap.EtcdFleetSnapshot | None = None   # on etcd, once this placer leads
        self._inv_at = -math.inf           # monotonic time inventories were last written
        self._inv_writing = False
        # promoted from a follower: the nodes its warm model held, whose next report may be the
        # copy of an empty heartbeat past a gap (placer.observe.skip_to), until each reported once
        self._warm: set[str] = set()
        self._direct_warned = -math.inf   # when direct_limit was last logged

    # ------------------------------------------------------------ epochs (fencing)

    @property
    def epoch(self) -> int:
        """This placer's epoch, on everything it sends that makes a node act (0: it may send
        nothing that acts: a follower, a candidate, or before ``run``)."""
        if self.ha is not None:
            return self.ha.epoch()
        return self.own_epoch

    def leading(self) -> bool:   # (placer.relays.RelayHost: asked before each bundle leaves)
        return self.ha is None or self.ha.leading()

    def recover_s_left(self, now: float) -> float:
        """Seconds left before it places recovered jobs (0 once placing)."""
        if self.ha is not None and not self.ha.leading():
            return 0.0
        return max(0.0, self.state.recover_until - now)

    def restart_status(self) -> dict[str, Any]:
        """This start: its epoch, when it started (unix), ``recover_s`` left, nodes heard since;
        and nodes held silent in a mass silence (placer.attempts), since when (None: none)."""
        now = self.clock()
        st = self.state
        return {"epoch": self.epoch, "started_at": self.started_at,
                "recover_s_left": round(self.recover_s_left(now), 3), "nodes_reported": len(st.nodes),
                "nodes_silent": st.silent_nodes, "mass_silence_since": st.mass_silence_since}

    def _stamped(self, reply: _Answer) -> _Answer:
        """``reply`` with this placer's epoch. The state's shared common answer is copied once
        per epoch, not per report (the framed channel caches an answer's bytes by identity)."""
        ep = self.epoch
        if reply.epoch == ep:
            return reply
        src, out = self._stamps.get(type(reply), (None, None))
        if reply is src and out is not None and out.epoch == ep:
            return out  # type: ignore[return-value]  # (kept by type: the same type as reply)
        stamped = msgspec.structs.replace(reply, epoch=ep)
        if _common(reply):   # (answers made for one node are not kept: they would push the common one out)
            self._stamps[type(reply)] = (reply, stamped)
        return stamped

    async def _approvals_from_etcd(self, etcd: EtcdApprovals) -> None:
        await self.approvals.promoted(etcd)

    def _fenced_stops(self, stop: list[Victim]) -> list[Victim]:
        # of this epoch, for the attempt its workload names, expiring: under the member's MAC
        # when a relay carries it (a replay after the expiry stops nothing)
        ep, expires = self.epoch, self.clock() + self.cfg.placement_ttl_s
        return [msgauth.bound_stop(v, ep, expires) for v in stop]

    # ------------------------------------------------------------ life cycle

    def _recover(self, journal: JobJournal) -> None:
        """Take the journal's jobs and cordons (at start, or on promotion to leader)."""
        self.journal = journal
        now = self.clock()
        recovered = self.journal.jobs()
        for spec in recovered:
            try:
                job = self.state.submit(spec, now, recovering=True)
                job.attempt = self.journal.attempts.get(spec.job_id, 0)
            except JobError as e:  # a journal from an older placer with rules this one refuses
                log.warning("journal job dropped job=%s reason=%s", spec.job_id, e)
                self.journal.ended(spec.job_id, "failed", now)
        for node_id, reason in self.journal.cordons.items():  # before any report can register it
            self.state.cordon(node_id, now, reason=reason or None, known=False)
        warm: list[str] = []
        if self.state.nodes:   # a follower promoted: its warm model's workloads go to their jobs (placer.observe)
            adopted, told = observe.adopt(self.state, now)
            warm = observe.promoted(self.state, now, self.cfg.recover_window_s)
            self._warm = set(warm)
            log.info("promoted with a warm model: nodes=%d heard within recover_s=%d workloads adopted=%d "
                     "left to stop=%d", len(self.state.nodes), len(warm), adopted, told)
        if isinstance(journal, EtcdJournal):   # promoted with etcd: the fleet's rack approvals are there
            self.spawn(partial(self._approvals_from_etcd, EtcdApprovals(journal.client, journal.prefix, journal.fence)))
        self.state.recover_until = now + self.cfg.recover_window_s
        # whom it waits for: a single placer's fleet snapshot is its own file; a placer promoted
        # on etcd reads the last leader's from etcd (its own file is not the fleet's latest)
        snap = fleetsnap.load(self.cfg.state_dir) if self.ha is None else None
        on_etcd = isinstance(journal, EtcdJournal)
        self.recovery = fleetsnap.Recovery(snap.nodes if snap is not None else None, started=now,
                                           window_s=self.cfg.recover_window_s, max_s=self.cfg.recover_max_s,
                                           pending=on_etcd)
        for node_id in warm:
            self.recovery.heard(node_id)
        if isinstance(journal, EtcdJournal):
            self._etcd_snap = fleetsnap.EtcdFleetSnapshot(journal.client, journal.prefix, journal.fence)
            if self.ha is not None and self.ha.fleet_read:   # (read beside the journal: placer.ha)
                self._fleet_expected(self.ha.fleet, self.recovery)
            else:
                self.spawn(partial(self._fleet_from_etcd, self._etcd_snap, self.recovery))
        if recovered or snap is not None:
            log.info("recovering: jobs from the journal=%d, nodes of the fleet snapshot=%d; placing once they "
                     "reported (at least %.1fs, at most %.1fs while a recovered job lacks pods)", len(recovered),
                     self.recovery.expected, self.cfg.recover_window_s, self.recovery.max_s)
        self.kick()

    async def _fleet_from_etcd(self, store: fleetsnap.EtcdFleetSnapshot, recovery: fleetsnap.Recovery) -> None:
        """The last leader's fleet snapshot, for a placer promoted on etcd: whom it waits for."""
        try:
            snap = await store.load()
        except (EtcdError, JournalError) as e:
            log.warning("fleet snapshot not read from etcd (waiting recover_s as without one): %s", e)
            snap = None
        self._fleet_expected(snap, recovery)

    def _fleet_expected(self, snap: fleetsnap.FleetSnapshot | None, recovery: fleetsnap.Recovery) -> None:
        recovery.expect(snap.nodes if snap is not None else None)
        log.info("fleet snapshot from etcd: nodes=%d (the last leader's up nodes)", recovery.expected)
        self.kick()

    def _recovery_gate(self, now: float) -> None:
        """While recovering: when it ends, as known now (placer.fleetsnap.Recovery)."""
        r = self.recovery
        if r is None:
            return
        self.state.recover_until = r.until(now, jobs_complete=self.state.recovered_complete())
        if now >= self.state.recover_until:
            log.info("recovery over after %.2fs: %d of the %d nodes of the fleet snapshot reported",
                     now - r.started, r.expected - r.unheard, r.expected)
            self.recovery = None
            if self.ha is not None:
                self.ha.promotion.mark("placing")

    def _maybe_snapshot(self) -> None:
        """The set of up nodes to the state dir (placer.fleetsnap), when it changed, at most every
        SNAPSHOT_EVERY_S, never while recovering (the model is partial then), off the event loop."""
        t = time.monotonic()
        changes = self.state.membership_changes
        if self.recovery is not None or self._snap_writing or changes == self._snap_seen \
                or t - self._snap_at < fleetsnap.SNAPSHOT_EVERY_S or self._nursery is None:
            return
        if self.ha is not None and (self._etcd_snap is None or not self.ha.leading()):
            return   # (on etcd only the leader writes it, there; a follower's model is not the fleet's)
        self._snap_at = t
        self._snap_seen = changes
        ids = fleetsnap.snapshot_ids(self.state.nodes)
        self._snap_writing = True
        self._nursery.start_soon(self._write_snapshot, fleetsnap.encode(ids, time.time()))

    async def _write_snapshot(self, data: bytes) -> None:
        try:
            if self.ha is not None and self._etcd_snap is not None:
                await self._etcd_snap.save(data)
            elif fleetsnap.WRITE_IN_THREAD:
                await trio.to_thread.run_sync(fleetsnap.write, self.cfg.state_dir, data)
            else:
                fleetsnap.write(self.cfg.state_dir, data)
        except (OSError, EtcdError, JournalError) as e:   # the next restart waits the window, nothing else is lost
            log.warning("fleet snapshot not written: %s", e)
            self._snap_seen = -1
        finally:
            self._snap_writing = False

    def _maybe_write_inventories(self) -> None:
        """The GPU inventories registered since the last write, appended to the state dir
        (placer.inventories) at most every FLUSH_EVERY_S, off the event loop."""
        book = self.state.inventories
        t = time.monotonic()
        if not book.pending or self._inv_writing or t - self._inv_at < inventories.FLUSH_EVERY_S \
                or self._nursery is None:
            return
        self._inv_at = t
        self._inv_writing = True
        data, whole = book.take()
        self._nursery.start_soon(self._write_inventories, data, whole)

    async def _write_inventories(self, data: bytes, whole: bool) -> None:
        try:
            if inventories.WRITE_IN_THREAD:
                await trio.to_thread.run_sync(inventories.write, self.cfg.state_dir, data, whole)
            else:
                inventories.write(self.cfg.state_dir, data, whole)
            log.debug("inventories written bytes=%d whole=%s", len(data), whole)
        except OSError as e:   # a full disk: those nodes send their snapshots after a restart
            log.warning("inventories not written: %s", e)
            self.state.inventories.rewrite = True   # the next write replaces the file whole
        finally:
            self._inv_writing = False

    def _set_keys(self, master: bytes, signer: msgauth.BundleSigner) -> None:
        """The MAC master and signing key every placer of the cluster shares (placer.ha)."""
        self.mac_master, self.signer = master, signer
        self.state.set_mac_master(master)
        self._publish_revoked([], self.clock())   # (signed with the shared key)

    def _resumed(self) -> None:
        """A leader's lease renewed after it was fenced (placer.ha): place again, fairly."""
        from .ha import forgive_silence
        forgive_silence(self.state, self.clock(), self.cfg.recover_window_s)
        self.kick()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.mac_master, self.signer = msgauth.load_placer_keys(self.cfg.state_dir)
        self._publish_revoked([], self.clock())   # (signed with the key the agents hold)
        self.state.set_mac_master(self.mac_master)
        t0 = time.perf_counter()
        self.state.inventories = InventoryBook.load(self.cfg.state_dir)
        log.info("inventories ready nodes=%d in=%.3fs", len(self.state.inventories.by_node), time.perf_counter() - t0)
        self.started_at = self.clock()
        if self.ha is None:
            # greater than any earlier start's, durable before anything listens or is sent
            self.own_epoch = EpochFile(Path(self.cfg.state_dir) / EPOCH_FILE).next()
            log.info("placer epoch=%d", self.own_epoch)
            self._recover(Journal.open(self.cfg.state_dir))
        try:
            async with trio.open_nursery() as n:
                self._nursery = n
                # the framed channel listens before the API: an agent that finds the API up after
                # a restart finds its channel up too, so its full report goes over the channel
                if self.cfg.wire_listen:
                    self.wire = HeartbeatServer(self.tokens, self._ingest, frames=self.relays, clock=self.clock,
                                                ssl_context=self.security.channel,
                                                require_certs=self.security.require_certs, token_use=self.token_use)
                    self.wire_url = await n.start(self.wire.run, self.cfg.wire_listen)
                self.url = await n.start(partial(serve, ssl_context=self.security.api), self.app, self.cfg.listen)
                self._write_endpoints()
                if self.ha is not None:  # campaign; on promotion the journal comes from etcd
                    await n.start(partial(self.ha.run, keys=(self.mac_master, self.signer), on_keys=self._set_keys),
                                  self.url, self._recover, self._resumed, self.wire_url)
                n.start_soon(self._loop)
                n.start_soon(self.dashboard.warm)   # while the dashboard is watched, its next map is ready
                log.info("placer serving url=%s", self.url)
                task_status.started(self.url)
        finally:
            self.relays.close()
            with trio.CancelScope(shield=True):
                await self.pool.aclose()
            if self.journal is not None:
                self.journal.close()

    def _write_endpoints(self) -> None:
        atomic_write(Path(self.cfg.state_dir) / "endpoints.json", json.dumps(
            {"control_url": self.url, "placer_url": self.url, "wire_url": self.wire_url, "pid": os.getpid()}).encode(),
            0o644)

    def kick(self) -> None:
        self._kick.set()

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _loop(self) -> None:
        while True:
            with trio.move_on_after(self.cfg.tick_s):
                await self._kick.wait()
            self._kick = trio.Event()
            if self.ha is not None and not self.ha.leading():
                # a follower places nothing; its warm model's records live long, and its model
                # is kept built for the promotion (placer.observe)
                observe.keep_built(self.state, self.clock(), time.perf_counter)
                if len(self.state.nodes) > self._nodes_at_freeze * 1.1 + 100:
                    self._maybe_freeze()
                continue
            now = self.clock()
            self._tick(now)
            self._recovery_gate(now)
            self._maybe_snapshot()
            self._maybe_write_inventories()
            rebuilds = self.state.counters["rebuilds"]
            # A pass makes long-lived records (a 25,000-pod gang's); collecting while it runs
            # would walk them again and again for nothing: collect later, and freeze them.
            gc.disable()
            decided = []
            try:
                decided = self.state.schedule(now, clock=time.perf_counter)
            finally:
                if decided:
                    self._gc_holds += len(decided)
                    self._gc_hold_until = time.monotonic() + GC_HOLD_MAX_S
                elif self._gc_holds and time.monotonic() > self._gc_hold_until:
                    log.warning("a delivery held the collector off for %.0fs; collecting now", GC_HOLD_MAX_S)
                    self._gc_holds = 0
                if not self._gc_holds:
                    gc.enable()
            if decided and self.ha is not None:
                self.ha.promotion.mark("first_decision")
            for job, pushes in decided:
                if self.journal is not None:
                    self.journal.attempt(job.job_id, job.attempt, now)
                job.timings["pushed"] = self.clock()
                assert self._nursery is not None
                self._nursery.start_soon(self._dispatch, job.job_id, job.attempt, pushes)
            grown = len(self.state.nodes) > self._nodes_at_freeze * 1.1 + 100  # a registration burst
            if not self._gc_holds and (grown or rebuilds != self.state.counters["rebuilds"]):
                self._maybe_freeze()
            self._after_change()
            await trio.lowlevel.checkpoint()  # let reports in between passes

    def _tick(self, now: float) -> None:
        """Timers (lost nodes, fencing, retries) as of ``now``, but never past what the placer
        has heard: while relays' frames wait in its own queue (a delivery's acks first, then
        the backlog), their beats count from when they arrived, and no node is judged silent
        beyond the oldest of them (RelayHub.heard_until); while a multi-node connection has
        more to read than the placer has read (a registration storm over shared connections),
        no node is judged silent beyond when it was last caught up (HeartbeatServer.heard_until)."""
        until = now
        relayed = self.relays.heard_until()
        if relayed is not None:
            until = min(until, relayed)
        direct = self.wire.heard_until() if self.wire is not None else None
        if direct is not None:  # (a connection that is always behind holds the check back so long at most)
            until = min(until, max(direct, now - WIRE_HOLD_LOST_AFTERS * self.cfg.lost_after_s))
        self._refresh_revoked(now)
        self._carry_out(self.state.tick(until))

    def _refresh_revoked(self, now: float) -> None:
        """The deny-list into every handshake (infra.tls.Revoked) and the heartbeat answers;
        newly revoked nodes are fenced like lost ones."""
        newly = self.pki.refresh(self.security.revoked)
        if newly is not None:
            self._publish_revoked(newly, now)

    def _publish_revoked(self, newly: list[str], now: float) -> None:
        """The deny-list into the heartbeat answers, signed with the placer's bundle key (members
        behind a relay take it from there), and ``newly`` denied nodes fenced."""
        nodes, serials = sorted(self.pki.denied[0]), sorted(self.pki.denied[1])
        self.state.set_revoked(self.pki.denied, newly, now, signed=self.signer.revoked(time.time(), nodes, serials))
        if newly and self.wire is not None:   # their framed connections opened before: closed now
            self.wire.close_nodes(newly)

    def _maybe_freeze(self) -> None:
        """After a pass that rebuilt the model or decided (the records it made live long),
        at most every ``FREEZE_EVERY_S``: collect the young generations (bounded work) and
        move every survivor out of the collector's sight (``gc.freeze``, O(1))."""
        t = time.monotonic()
        if t - self._frozen_at < FREEZE_EVERY_S:
            return
        self._frozen_at = t
        gc.collect(1)
        gc.freeze()
        self.freezes += 1
        self._nodes_at_freeze = len(self.state.nodes)

    def _after_change(self) -> None:
        if self.journal is not None:
            ended = self.state.drain_ended()
            if ended:
                self.journal.ended_many(ended)
                if isinstance(self.journal, Journal):   # (its fsync in a worker, off the loop; etcd's writer commits its own)
                    self.spawn(self._flush_journal)
        self._changed_now()

    async def _flush_journal(self) -> None:
        """Make the journal's appends so far durable (group commit, off the event loop)."""
        if self.journal is None:
            return
        try:
            await self.journal.flush()
        except JournalError as e:
            log.error("journal sync failed (ended jobs not yet durable): %s", e)

    # ------------------------------------------------------------ what the relay hub uses (relays.RelayHost)

    @property
    def nodes(self) -> Mapping[str, NodeRec]:
        return self.state.nodes

    def gang_blob(self, blob_id: str) -> bytes | None:
        return self.state.blobs.get(blob_id)

    def count_bad_macs(self, n: int) -> None:
        self.state.counters["bad_macs"] += n

    def count_stale_epoch(self, n: int) -> None:
        """``n`` nodes answered ``stale_epoch``: they heard from a placer of a newer epoch, so this
        one has been replaced. Counted and logged; the gang is rolled back with back-off, as for
        any refusal, and nothing is pushed to those nodes again because of it."""
        self.stale_epoch_acks += n
        log.error("nodes refused this placer's epoch as stale (a newer placer has spoken to them) "
                  "count=%d epoch=%d", n, self.epoch)

    def apply_beat(self, beat: RackBeat, at: float, *, via: str, answered: float | None) -> RackBeatReply:
        if self.ha is not None and not self.ha.leading():   # as for reports: a follower applies it to its
            if not self.ha.observing():                     # warm model and asks for nothing but full
                return RackBeatReply()                      # reports (placer.observe); else nothing
            return observe.beat(self.state, beat, at, via)
        reply, pushes = self.state.beat(beat, at, via=via, answered=answered)
        self._carry_out(pushes)
        if reply.stop:   # each stop carries the epoch, under the member's MAC (a relay cannot change it)
            reply = msgspec.structs.replace(reply, stop=[self._beat_stops(s, via) for s in reply.stop])
        return self._stamped(reply)

    def _beat_stops(self, s: NodeStop, via: str) -> NodeStop:
        stop = self._fenced_stops(s.stop)
        node = self.state.nodes.get(s.node_id)
        if s.node_id != via and node is not None:
            stop = msgauth.with_stop_macs(self.state.mac_key(s.node_id, node.boot_id), s.node_id, node.boot_id, stop)
        return NodeStop(node_id=s.node_id, stop=stop)

    def ingest_relayed(self, rep: NodeReport, via: str) -> tuple[int, ReportReply]:
        return self._ingest(rep.node_id, rep, via)

    def ingest_relayed_many(self, reps: list[NodeReport], via: str) -> list[tuple[int, ReportReply]]:
        return self._ingest_many(reps, via)

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn)

    # ------------------------------------------------------------ carrying out

    def _carry_out(self, pushes: list[Push]) -> None:
        """Stops (and late stops) the state asks for: through the rack relays when there are
        many (a 25,000-node gang rolled back), else one push each."""
        if pushes and self._nursery is not None:
            if self.cfg.relays and len(pushes) >= RELAYED_STOPS_FROM:
                self._nursery.start_soon(self.relays.deliver, "", None, pushes, self._push_one)
            else:
                for p in pushes:
                    self._nursery.start_soon(self._push_one, p)
        if pushes:
            self.kick()

    async def _push_one(self, p: Push) -> Outcome:
        self.push_counts[p.kind] += 1
        # bound to its node and attempt, expiring (its expiry set as it leaves), a stop to the
        # node's boot: the agent checks them
        pl = p.direct(self.clock() + self.cfg.placement_ttl_s, self.epoch)
        if self.ha is not None and not self.ha.leading():
            # the lease is not known to hold now (a loop stalled past it learns so here, before
            # sending): nothing leaves, as if the node were unreachable
            res = PushResult(p.node_id, None, error="this placer does not lead now (its etcd lease is not known to hold)")
        else:
            res = await self.pool.post(p.control_url, "/v1/placements", msgspec.json.encode(pl),
                                       token=self.tokens.placer, key=p.node_id, expect=f"node:{p.node_id}")
        if res.status is None:
            self.push_counts["failed"] += 1
            log.warning("push failed node=%s placement=%s err=%s", p.node_id, p.placement.placement_id, res.error)
            if p.kind == "stop":
                self.state.stop_failed(p.node_id, p.placement.victims)
            return Outcome("unreachable", detail=str(res.error))
        ack: PlacementAck | None = None
        try:  # an agent refuses with a 4xx that still carries its PlacementAck
            ack = _ack_dec.decode(res.body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            ack = None
        if ack is not None and ack.placement_id != p.placement.placement_id:
            ack = None  # not an answer to this placement
        if ack is not None and ack.effective_outcome() == "accepted":
            return ACCEPTED
        self.push_counts["refused"] += 1
        if ack is not None and ack.effective_outcome() == "stale_epoch":
            self.count_stale_epoch(1)
        if ack is not None:
            out = Outcome(ack.effective_outcome(), tuple(ack.refused_gpus), ack.reason)
        else:  # not an agent's answer (a 413, a proxy's page): says nothing about the GPUs
            try:
                why = json.loads(res.body).get("detail") or res.body.decode()[:200]
            except (ValueError, AttributeError):
                why = res.body.decode(errors="replace")[:200]
            out = Outcome("unreachable", detail=f"HTTP {res.status}: {why}")
        log.warning("placement refused node=%s placement=%s status=%s outcome=%s detail=%s",
                    p.node_id, p.placement.placement_id, res.status, out.outcome, out.detail)
        if p.kind == "stop":   # (another boot, say): the node's next reply names them
            self.state.stop_failed(p.node_id, p.placement.victims)
        return out

    async def _dispatch(self, job_id: str, attempt: int, pushes: Sequence[Push]) -> None:
        try:
            await self._deliver(job_id, attempt, pushes)
        finally:
            self._gc_holds = max(0, self._gc_holds - 1)
            if not self._gc_holds and not gc.isenabled():
                gc.enable()
                self._maybe_freeze()   # the round's records survive: collect once and freeze them

    async def _deliver(self, job_id: str, attempt: int, pushes: Sequence[Push]) -> None:
        acks: Mapping[str, Outcome] | None = {}
        # A job's placements leave only once the job (and this attempt) is durable; the relays'
        # bundles are built while the journal syncs.
        synced = trio.Event()
        failed: list[JournalError] = []

        async def sync() -> None:
            try:
                if self.journal is not None:
                    await self.journal.flush()
            except JournalError as e:
                failed.append(e)
            finally:
                synced.set()

        async def durable() -> bool:
            await synced.wait()
            return not failed

        assert self._nursery is not None
        self._nursery.start_soon(sync)
        job = self.state.jobs.get(job_id)
        if self.cfg.relays:
            acks = await self.relays.deliver(job_id, job.blob_id if job else None, pushes, self._push_one,
                                             ready=durable)
        elif await durable():
            direct: dict[str, Outcome] = {}
            acks = direct

            async def one(p: Push) -> None:
                o = await self._push_one(p)
                if p.kind == "start":
                    direct[p.node_id] = o

            async with trio.open_nursery() as n:
                for p in pushes:
                    n.start_soon(one, p)
        if acks is None or failed:
            log.error("journal sync failed; not pushing job=%s: %s", job_id, failed[0] if failed else "?")
            self._carry_out(self.state.on_acks(job_id, attempt, {
                p.node_id: Outcome("unreachable", detail="placer journal not durable")
                for p in pushes if p.kind == "start"}, self.clock(), pushes))
            self._after_change()
            return
        if job is not None and job.attempt == attempt:
            job.timings.setdefault("delivered", self.clock())
        self._carry_out(self.state.on_acks(job_id, attempt, acks, self.clock(), pushes))
        self._after_change()

    # ------------------------------------------------------------ HTTP

    def _build_app(self) -> App:
        """Routes, their roles (scheduler_link.authz, the one table) and their body bounds:
        reports as large as a full report gets at fleet scale, everything else small."""
        app = App(name="herd-placer", max_body=4096)
        handlers: dict[tuple[str, str], Handler] = {
            ("GET", "/healthz"): self.h_healthz, ("GET", "/metrics"): self.h_metrics,
            ("GET", "/openapi.json"): self.h_openapi, ("POST", "/v1/nodes/{node_id}/report"): self.h_report,
            ("GET", "/v1/nodes"): self.h_nodes, ("GET", "/v1/cluster"): self.h_cluster,
            ("GET", "/v1/gangs/{blob_id}"): self.h_gang_blob, ("POST", "/v1/jobs"): self.h_submit,
            ("GET", "/v1/jobs"): self.h_jobs, ("GET", "/v1/jobs/{job_id}"): self.h_job,
            ("DELETE", "/v1/jobs/{job_id}"): self.h_cancel,
            ("POST", "/v1/jobs/{job_id}/artifact"): self.h_update_artifact,
            ("POST", "/v1/defrag"): self.h_defrag, ("POST", "/v1/prefetch"): self.h_prefetch,
            ("POST", "/v1/nodes/{node_id}/cordon"): self.h_cordon,
            ("POST", "/v1/nodes/{node_id}/uncordon"): self.h_uncordon,
            ("POST", "/v1/nodes/{node_id}/drain"): self.h_drain,
            ("POST", "/v1/nodes/{node_id}/approve"): self.approvals.h_approve,
            ("GET", "/v1/approvals"): self.approvals.h_list,
            ("GET", "/v1/status"): self.h_status,
            ("POST", "/v1/pki/bootstrap"): self.pki.h_bootstrap, ("POST", "/v1/pki/renew"): self.pki.h_renew,
            **self.dashboard.handlers(),
        }
        if self.ha is not None:  # a follower answers health and status; the rest goes to the leader
            handlers = self.ha.guard(handlers)
        authz.install(app, authz.PLACER_ROUTES, handlers, self.tokens, token_use=self.token_use,
                      docs={**PLACER_DOCS, **DASHBOARD_DOCS, **APPROVAL_DOCS},
                      flags={"open_reads": self.cfg.open_reads, "open_metrics": self.cfg.open_metrics,
                             **self.security.flags()},
                      max_body={("POST", "/v1/nodes/{node_id}/report"): LARGE_BODY,
                                ("POST", "/v1/jobs"): 1 << 20, ("POST", "/v1/jobs/{job_id}/artifact"): 16 << 10,
                                ("POST", "/v1/defrag"): 4096, ("POST", "/v1/prefetch"): 256 << 10,
                                ("POST", "/v1/pki/bootstrap"): 16 << 10, ("POST", "/v1/pki/renew"): 16 << 10,
                                **{("POST", f"/v1/nodes/{{node_id}}/{op}"): 4096
                                   for op in ("cordon", "uncordon", "drain", "approve")}})
        return app

    async def h_healthz(self, req: Request) -> Response:
        """Liveness: 200 while the service runs; the package and wire versions; this start's
        epoch, when it started, ``recover_s`` left and the nodes heard since."""
        return json_response({"ok": True, "recovering": self.clock() < self.state.recover_until,
                              "service": "herd-placer", "version": _VERSION, "wire_version": WIRE_VERSION,
                              **self.restart_status(),
                              **({"ha": self.ha.health()} if self.ha is not None else {})})

    async def h_status(self, req: Request) -> Response:
        """Transport security (TLS or insecure, token-authenticated agents under accept_tokens),
        certificates issued by bootstrap and renewal, the caller's principal; this start's epoch,
        when it started, ``recover_s`` left and the nodes heard since."""
        tu = self.token_use
        return json_response({"service": "herd-placer", "version": _VERSION, **self.restart_status(),
                              **self.security.status(),
                              "token_agents": dict(sorted(tu.nodes.items())[:1000]) if tu else {},
                              "token_agents_total": len(tu.nodes) if tu else 0,
                              "certificates_issued": self.pki.issued,
                              "you": str(req.principal) if req.principal else None,
                              **({"ha": self.ha.health()} if self.ha is not None else {})})

    async def h_openapi(self, req: Request) -> Response:
        """This API's OpenAPI description, generated from the route table."""
        return json_response(self.app.openapi("herd-placer"))

    async def h_report(self, req: Request) -> Response:
        """An agent's report (full at registration, then heartbeats with events)."""
        if (refused := self._direct_limit(req.params["node_id"])) is not None:   # (before its body is decoded)
            return json_response(refused, status=503)
        try:
            rep = _report_dec.decode(req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise HTTPError(400, "malformed report", str(e)) from None
        self.state.rack_pins.saw(req.principal)   # (a certificate's rack pins the node's: placer.relaypolicy)
        status, reply = self._ingest(req.params["node_id"], rep)
        if status == 400:
            raise HTTPError(400, "report refused", reply.error)
        if self.wire_url and status == 200:
            reply = msgspec.structs.replace(reply, wire_url=self.wire_url)
        return json_response(reply, status=status)

    def _apply_report(self, node_id: str, rep: NodeReport, via: str | None = None) -> tuple[int, ReportReply, bool]:
        """One report applied to the state: (status, reply, whether it is news the loop and the
        waiters must hear of). A report the state cannot apply is that report's error, never the
        service's. The answer to a registration names the rack's relay.

        ``via``: the relay that forwarded it (None: the node's own connection). A report a relay
        forwards for another node is applied only if it carries that node's MAC (401 otherwise,
        counted in ``bad_macs``: the member then registers directly); the answer to a full report
        over the node's own connection carries its MAC key and the placer's signing key."""
        observing = self.ha is not None and not self.ha.leading()
        if self.ha is not None and observing and not self.ha.observing():  # (a fenced leader, or keys not loaded yet) applies nothing
            return 503, ReportReply(ok=False, error="this placer does not lead"), False
        relayed = via is not None and via != rep.node_id
        if via is None and rep.full and (refused := self._direct_limit(rep.node_id)) is not None:
            return 503, refused, False
        if rep.node_id in self.pki.denied[0] or (via is not None and via in self.pki.denied[0]):
            # revoked (herd pki revoke): its handshakes are refused; a connection opened before is
            # answered this until the node goes away (it is fenced like a lost one meanwhile)
            return 403, ReportReply(ok=False, error="this node is revoked"), False
        if relayed and not msgauth.report_ok(self.state.mac_key(rep.node_id, rep.boot_id), rep):
            self.state.counters["bad_macs"] += 1
            log.warning("relayed report refused: MAC does not verify node=%s relay=%s", rep.node_id, via)
            return 401, ReportReply(ok=False, need_full=True, error="the report's MAC does not verify: "
                                    "register over this node's own connection for a key"), False
        known = self.state.nodes.get(rep.node_id) if relayed and rep.full else None
        if known is not None and (rep.boot_id != known.boot_id or rep.seq <= known.last_seq):
            # a relay replaying an older full report of the node (its MAC was valid once): the node
            # registers a new boot over its own connection, and its sequence only moves forward
            self.state.counters["replays"] = self.state.counters.get("replays", 0) + 1
            log.warning("relayed full report refused as a replay node=%s relay=%s seq=%d", rep.node_id, via, rep.seq)
            return 409, ReportReply(ok=False, need_full=True, error="a relayed report must continue the node's "
                                    "current boot and sequence"), False
        if not relayed and rep.node_id == node_id and (observing or rep.node_id in self._warm):
            observe.skip_to(self.state, rep)   # (a node's copies carry the newest empty heartbeat only)
        if self._warm and not observing:
            self._warm.discard(rep.node_id)
        if observing:   # a follower's warm model (placer.observe): applied, acted on never
            status, reply, _ = self._apply_checked(node_id, rep, via, observe=True)
            if status == 200 and rep.events and not rep.full:
                observe.note_events(self.state, rep)
            return (*observe.report_answer(status, reply), False)
        status, reply, news = self._apply_checked(node_id, rep, via)
        if reply.stop:  # each stop carries the epoch; through the relay under the member's MAC too
            stop = self._fenced_stops(reply.stop)
            if relayed:
                stop = msgauth.with_stop_macs(self.state.mac_key(rep.node_id, rep.boot_id), rep.node_id,
                                              rep.boot_id, stop)
            reply = msgspec.structs.replace(reply, stop=stop)
        reply = self._stamped(reply)
        if relayed and reply.epoch:   # the member may take the epoch its relay carried: under its MAC
            reply = msgspec.structs.replace(reply, epoch_mac=msgauth.epoch_mac(
                self.state.mac_key(rep.node_id, rep.boot_id), rep.node_id, rep.boot_id, reply.epoch))
        if rep.full and status == 200 and not relayed:
            reply = msgspec.structs.replace(reply, mac_key=self.state.mac_key(rep.node_id, rep.boot_id),
                                            placer_key=self.signer.public)
        return status, reply, news

    def _direct_limit(self, node_id: str) -> ReportReply | None:
        """A new node registering over its own connection while no relay is connected (or
        relays are off), with ``direct_max_nodes`` nodes registered already: refused. One
        connection and one report stream a node do not hold on one placer at fleet scale
        (docs/operations.md, "Rack relays"); the node tries again, and is taken once a relay
        connects."""
        cap = self.cfg.direct_max_nodes
        nodes = self.state.nodes
        if not cap or len(nodes) < cap or node_id in nodes or (self.cfg.relays and self.relays.has_candidates()):
            return None
        c = self.state.counters
        c["direct_refusals"] += 1
        now = self.clock()
        if now - self._direct_warned >= 10.0:
            self._direct_warned = now
            log.warning("registration refused: %d nodes registered, the most this placer serves without a rack "
                        "relay ([placer] direct_max_nodes); enable [relay] on one agent a rack "
                        "(refused so far: %d)", len(nodes), c["direct_refusals"])
        return ReportReply(ok=False, retry_after_s=DIRECT_RETRY_S,
                           error=f"direct_limit: this placer serves at most {cap} nodes without rack relays; "
                                 "enable [relay] on one agent a rack, or raise [placer] direct_max_nodes")

    def _apply_checked(self, node_id: str, rep: NodeReport, via: str | None = None, *, observe: bool = False
                       ) -> tuple[int, ReportReply, bool]:
        try:
            status, reply, pushes = self.state.ingest(node_id, rep, self.clock())
        except Exception:
            log.exception("report could not be applied node=%s full=%s", node_id, rep.full)
            self.state.counters["refused_reports"] += 1
            return 500, ReportReply(ok=False, need_full=True), False
        if observe:   # (what the state would have pushed: nothing leaves a follower)
            return status, reply, False
        self._carry_out(pushes)
        if status == 200 and rep.full and self.recovery is not None:
            self.recovery.heard(node_id)
        if status == 200 and (rep.full or via is None):   # (a node reporting directly hears of its relay)
            reply = self._with_relay(node_id, reply, via)
        return status, reply, rep.full or bool(rep.events) or rep.snapshot is not None

    def _ingest_many(self, reps: list[NodeReport], via: str | None = None) -> list[tuple[int, ReportReply]]:
        """Reports a relay sent together: each applied as :meth:`_ingest` does, the loop kicked
        and waiters woken once for all of them."""
        out = []
        changed = False
        for rep in reps:
            status, reply, news = self._apply_report(rep.node_id, rep, via)
            changed = changed or news
            out.append((status, reply))
        if changed:
            self.kick()
            self._after_change()
        return out

    def _with_relay(self, node_id: str, reply: ReportReply, via: str | None = None) -> ReportReply:
        """The rack's relay named in ``reply``; for a report a relay forwarded, that relay while
        the rack has no chosen one yet (a restarted placer hears members through their relay
        before the relay's own node has registered: they stay where they are)."""
        node = self.state.nodes.get(node_id)
        if node is None:
            return reply
        url = self.relays.relay_url_for(node_id, node.rack_path)
        if url is None and via is not None and via != node_id:
            url = self.relays.provisional_url(node.rack_path, via)
        return msgspec.structs.replace(reply, relay_url=url) if url else reply

    def _ingest(self, node_id: str, rep: NodeReport, via: str | None = None) -> tuple[int, ReportReply]:
        """One report, from HTTP or the framed channel (synchronous: one owner of state);
        ``via``: the relay that forwarded it."""
        status, reply, news = self._apply_report(node_id, rep, via)
        if news:
            self.kick()
            self._after_change()
        return status, reply

    async def h_submit(self, req: Request) -> Response:
        """Submit a job (JobSpec); 201 with the job's view."""
        spec = req.decode(JobSpec)
        if not spec.job_id:
            spec = msgspec.structs.replace(spec, job_id=f"job-{int(time.time() * 1000):x}-{os.urandom(3).hex()}")
        now = self.clock()
        assert self.journal is not None
        if (again := await self._resubmitted(spec)) is not None:
            return again
        try:
            self.state.validate(spec)
        except JobError as e:
            raise HTTPError(e.status, "job refused", str(e)) from None
        # Decide while the journal syncs: the job is in the queue at once, but nothing of it is
        # pushed (_dispatch waits on the same group commit) and the 201 waits until it is durable.
        used = self.journal.submitted(spec, now, sync=False)
        job = self.state.submit(spec, now)
        job.attempt = used   # an id submitted again continues its attempts (placer.journal)
        self.kick()
        self._changed_now()
        try:
            await self.journal.flush()  # one fsync for a burst of submissions, in a worker thread
        except JournalError as e:
            log.error("job not durable, taking it back job=%s: %s", spec.job_id, e)
            self._carry_out(self.state.cancel(spec.job_id, self.clock()))
            raise HTTPError(503, "job not stored", str(e)) from None
        job.timings["durable"] = self.clock()  # "submitted" -> "durable" is the journal's fsync
        return json_response(self.state.job_view(job), status=201)

    async def _resubmitted(self, spec: JobSpec) -> Response | None:
        """The answer to a submit of a job this placer already holds with this very spec: the
        original's (201, the job's view) once that job is durable. A client resends a submit
        whose answer it lost (its placer died or stopped leading after committing it, and the
        next leader read it from the journal); a different spec under a taken id stays a 409."""
        job = self.state.jobs.get(spec.job_id)
        if job is None or job.spec != spec:
            return None
        if not job.recovering and "durable" not in job.timings:
            assert self.journal is not None
            try:   # the first submit is still syncing: answer once it is durable, as it is
                await self.journal.flush()
            except JournalError as e:
                raise HTTPError(503, "job not stored", str(e)) from None
            job = self.state.jobs.get(spec.job_id)
            if job is None or job.spec != spec:
                return None
        return json_response(self.state.job_view(job), status=201)

    def _job(self, job_id: str) -> JobRec:
        job = self.state.jobs.get(job_id)
        if job is None:
            raise HTTPError(404, "no such job", job_id)
        return job

    async def h_jobs(self, req: Request) -> Response:
        """Jobs in submission order, without pods (counts by pod state instead); ``?state=``
        filters, ``?page=OFFSET:LIMIT`` pages (default the first 1000)."""
        want = req.query.get("state")
        try:
            off, lim = parse_page(req.query.get("page"), DEFAULT_NODES_PAGE)
        except ValueError as e:
            raise HTTPError(400, "bad page", str(e)) from None
        jobs = [j for j in self.state.jobs.values() if not want or j.state == want]  # dicts keep submission order
        return json_response({"jobs": [self.state.job_view(j, limit=0) for j in jobs[off:off + lim]],
                              "total": len(jobs), "offset": off})

    async def h_job(self, req: Request) -> Response:
        """One job: spec, state, timings, its pods' counts by state, and one page of pods
        (``?pods=OFFSET:LIMIT``, default the first 100). ``?wait=STATE&timeout_ms=N``
        waits (bounded) until the job reaches STATE or a terminal state."""
        try:
            off, lim = parse_page(req.query.get("pods"), DEFAULT_PODS)
        except ValueError as e:
            raise HTTPError(400, "bad pods page", str(e)) from None
        job = self._job(req.params["job_id"])
        want = req.query.get("wait")
        if want:
            try:
                timeout = min(60.0, float(req.query.get("timeout_ms", "10000")) / 1000)
            except ValueError:
                raise HTTPError(400, "timeout_ms must be a number") from None
            with trio.move_on_after(timeout):
                while not (job.state == want or job.state in TERMINAL_JOB_STATES):
                    await self._changed.wait()
                    job = self._job(req.params["job_id"])
        return json_response(self.state.job_view(job, offset=off, limit=lim))

    async def h_cancel(self, req: Request) -> Response:
        """Cancel a job: its workloads are stopped gracefully."""
        try:
            pushes = self.state.cancel(req.params["job_id"], self.clock())
        except JobError as e:
            raise HTTPError(e.status, "cannot cancel", str(e)) from None
        self._carry_out(pushes)
        self._after_change()
        await self._flush_journal()   # (answered once its end is durable)
        return json_response(self.state.job_view(self.state.jobs[req.params["job_id"]]))

    async def h_update_artifact(self, req: Request) -> Response:
        """Run the job's next attempt on another manifest (body ArtifactUpdate)."""
        upd = req.decode(ArtifactUpdate)
        try:
            job = self.state.update_artifact(req.params["job_id"], upd.manifest_id, upd.origin)
        except JobError as e:
            raise HTTPError(e.status, "cannot update the artifact", str(e)) from None
        assert self.journal is not None
        self.journal.submitted(job.spec, self.clock())  # the newer spec wins on replay
        self._after_change()
        return json_response(self.state.job_view(job))

    async def h_nodes(self, req: Request) -> Response:
        """Nodes in id order: state, addresses, topology, GPUs free and unhealthy.
        ``?page=OFFSET:LIMIT`` (default the first 1000), ``?state=up|lost``."""
        try:
            off, lim = parse_page(req.query.get("page"), DEFAULT_NODES_PAGE)
        except ValueError as e:
            raise HTTPError(400, "bad page", str(e)) from None
        total, page = self.state.node_page(off, lim, state=req.query.get("state"))
        return json_response({"nodes": page, "total": total, "offset": off})

    def _node_op(self, req: Request) -> tuple[str, NodeOp]:
        body = req.decode(NodeOp) if req.body.strip() else NodeOp()
        node_id = req.params["node_id"]
        if node_id not in self.state.nodes:
            raise HTTPError(404, "no such node", node_id[:200])
        return node_id, body

    def _journal_cordon(self, node_id: str, on: bool, reason: str) -> None:
        assert self.journal is not None
        self.journal.cordon(node_id, on, self.clock(), reason)  # fsynced, as an artifact update is

    def _node_answer(self, node_id: str, **extra: Any) -> Response:
        return json_response({"node": self.state.node_view(self.state.nodes[node_id]), **extra})

    async def h_cordon(self, req: Request) -> Response:
        """Cordon a node: nothing new is placed there; what runs stays (journaled)."""
        node_id, body = self._node_op(req)
        reason = body.reason or "cordoned by operator"
        self._journal_cordon(node_id, True, reason)  # durable before it is acknowledged
        self.state.cordon(node_id, self.clock(), reason=reason)
        self._after_change()
        return self._node_answer(node_id)

    async def h_uncordon(self, req: Request) -> Response:
        """Put a cordoned (or drained) node back in service (journaled)."""
        node_id, _ = self._node_op(req)
        self._journal_cordon(node_id, False, "")
        self.state.uncordon(node_id, self.clock())
        self.kick()
        self._after_change()
        return self._node_answer(node_id)

    async def h_drain(self, req: Request) -> Response:
        """Cordon a node, then stop the preemptible gangs on it (their restart policy places
        them elsewhere); the non-preemptible ones are listed and left unless ``force``."""
        node_id, body = self._node_op(req)
        reason = body.reason or f"node {node_id} drained by operator"
        if body.grace_s is not None and not 0 <= body.grace_s <= 3600:
            raise HTTPError(400, "bad grace_s", "grace_s must be within 0..3600")
        self._journal_cordon(node_id, True, reason)
        try:
            out, pushes = self.state.drain(node_id, self.clock(), grace_s=body.grace_s, force=body.force,
                                           reason=reason)
        except JobError as e:
            raise HTTPError(e.status, "cannot drain", str(e)) from None
        self._carry_out(pushes)
        self.kick()
        self._after_change()
        return self._node_answer(node_id, stopped=list(out.stopped), left=list(out.left))

    async def h_cluster(self, req: Request) -> Response:
        """Capacity, free GPUs and fragmentation per topology level (``?detail=0``: counts only,
        without the fragmentation scores, which cost a pass over the model)."""
        st = self.state
        out: dict[str, Any] = {"model": st.model.statistics() if req.query.get("detail") != "0" else {}}
        if req.query.get("detail") != "0":
            out["fragmentation"] = {k: float(v) for k, v in fragmentation(st.model).items()}
            out["largest_placeable"] = {k: int(v) for k, v in largest_placeable(st.model).items()}
        out["nodes"] = {"up": st.node_states["up"], "lost": st.node_states["lost"], "total": len(st.nodes),
                        "simulated": st.simulated_nodes}
        if req.query.get("detail") != "0":  # nodes by the dashboard map's states (its cached build)
            out["nodes"]["by_state"] = self.dashboard.counts()
        out["jobs"] = st.job_counts()
        out["queue"] = st.queue.statistics()
        out["placer"] = {**{k: v for k, v in st.counters.items()}, "model_rebuilds": st.model.rebuilds,
                         "gc_freezes": self.freezes, "blobs": len(st.blobs)}
        out["placer"]["relays"] = self.relays.statistics()
        if self.wire is not None:
            out["framed_channel"] = self.wire.statistics()
        return json_response(out)

    async def h_gang_blob(self, req: Request) -> Response:
        """A live gang's blob (canonical msgpack; its BLAKE3 is the id in the URL)."""
        raw = self.state.blobs.get(req.params["blob_id"])
        if raw is None:
            raise HTTPError(404, "no such gang blob", req.params["blob_id"][:64])
        self.membership.check_http(req)   # a node reads only its gangs' blobs (a 403 with a reason code)
        self.relays.stats.blob_serves += 1
        return Response(status=200, body=raw, content_type="application/msgpack")

    async def h_defrag(self, req: Request) -> Response:
        """Plan defragmentation moves; with ``apply`` the moved jobs are requeued so the core
        places them again (best fit packs them into partly used domains)."""
        body = req.decode(DefragRequest) if req.body else DefragRequest()
        if body.max_moves < 0 or body.max_moves > 10_000:
            raise HTTPError(400, "max_moves must be within 0..10000")
        moves = plan_defrag(self.state.model, body.max_moves)
        out = [{"job_id": m.job_id, "from_nodes": sorted(m.from_nodes),
                "to_nodes": sorted({p.node_id for p in m.to_decision.pods})} for m in moves]
        applied: list[str] = []
        if body.apply:
            now = self.clock()
            for m in moves:
                pushes = self.state.requeue(m.job_id, now, reason="moved by defragmentation")
                if pushes is not None:
                    applied.append(m.job_id)
                    self._carry_out(pushes)
            self._after_change()
        return json_response({"moves": out, "applied": applied})

    async def h_prefetch(self, req: Request) -> Response:
        """Fan a preheat (manifest id, origin) out to nodes named or in a topology domain."""
        body = req.decode(PrefetchFanout)
        nodes = [n for n in self.state.nodes.values() if n.state == "up"]
        if body.nodes:
            unknown = sorted(set(body.nodes) - {n.node_id for n in nodes})
            if unknown:
                raise HTTPError(404, "unknown or lost nodes", ",".join(unknown))
            nodes = [n for n in nodes if n.node_id in set(body.nodes)]
        elif body.level:
            if body.level not in ("zone", "block", "rack") or not body.domain:
                raise HTTPError(400, "level must be zone|block|rack, with a domain name")
            level = body.level
            nodes = [n for n in nodes if (n.topology.zone if level == "zone" else n.topology.block
                                          if level == "block" else n.topology.rack) == body.domain]
        if not nodes:
            raise HTTPError(404, "no node matches")
        peers = [n.peer() for n in nodes][: max(self.cfg.max_peers, len(nodes))]
        pr = msgspec.json.encode(PrefetchRequest(manifest_id=body.manifest_id, origin=body.origin, peers=peers))
        res = await self.pool.post_many([(n.node_id, n.control_url, "/v1/prefetch", pr) for n in nodes],
                                        token=self.tokens.placer, expect_node=True)
        return json_response({"nodes": {k: {"ok": r.ok, "status": r.status, "error": r.error}
                                        for k, r in sorted(res.items())}})

    async def h_metrics(self, req: Request) -> Response:
        """Prometheus text: nodes, jobs, GPUs, counters, latency histograms, process (placer.metrics)."""
        from .metrics import PlacerMetrics
        return PlacerMetrics.of(self).response()

def _common(reply: ReportReply | RackBeatReply) -> bool:
    """An answer that says nothing of one node (the state's shared "ok")."""
    if reply.stop or reply.need_full:
        return False
    return not isinstance(reply, ReportReply) or (reply.ok and reply.error is None and reply.mac_key is None
                                                  and reply.relay_url is None and reply.wire_url is None)


async def run_placer(config: PlacerConfig) -> None:
    """Run a placer until cancelled (the CLI's entry point). With ``etcd``: a leader that
    loses its lease serves again as a follower, fresh (placer.ha.run_rejoining)."""
    if config.etcd:
        from .ha import run_rejoining
        await run_rejoining(config, PlacerService)
        return
    svc = PlacerService(config)
    async with trio.open_nursery() as n:
        await n.start(svc.run)
