"""The agent's side of the scheduler link: register, heartbeat, report events at once.

Theory of operation
-------------------
One task (``run``) owns the link. It keeps a ``(boot_id, seq)`` pair: ``boot_id`` is
fresh for every AgentLink (one per agent process start), ``seq`` grows by one per
report sent. The first report, and every report after anything went wrong, is a
*full* report built by ``hooks.full_report()`` (topology, GPU snapshot, every
workload, manifests held); otherwise the link sends *heartbeats* that carry only
what changed: the workload events queued by :meth:`AgentLink.notify` since the last
report and the GPU snapshot when its health picture changed. The manifests a node holds
travel in full reports only: one every ``full_every`` beats (60: five minutes at the default
interval, to heal any drift), and one as soon as the agent asks (``request_full_report``: it
does when a manifest becomes complete in its store, so the placer soon knows it as a source).

Invariants:
- ``notify`` never blocks and never raises; events are delivered in order.
- Any doubt about what the placer has seen (a transport error, a 409, a reply with
  ``need_full``) is answered with a full report, which supersedes every event lost
  in between: the placer never needs a lost delta back.
- Reconnects back off exponentially (jittered) up to ``backoff_max_s`` and never beyond
  one heartbeat interval: a restarted placer waits a few intervals for every agent's
  full report before it places recovered jobs again, so no agent may be slower than that.
- Transports are pluggable (:class:`ReportChannel`): the framed channel is used for every
  report once open — full reports too — and HTTP is the fallback when the channel is refused
  or unreachable. A channel that is merely slow to answer (a restarted placer handshakes a
  storm of reconnecting agents a few hundred at a time, and queues the rest) is waited for up
  to ``wire_connect_timeout_s`` and then tried again after a jittered back-off, up to
  ``WIRE_BUSY_TRIES`` times in a row, before HTTP: a report over HTTP then would cost the busy
  placer one more handshake, on a listener with no queue, and feed the storm. The link remembers the
  last ``wire_url`` the placer announced (or the one it was built with), so after a placer
  restart (every agent re-registering at once) the full reports go over framed channels.
  ``wire_connect`` lets many links share a few multiplexed connections
  (:class:`~scheduler_link.heartbeat_wire.SharedWire`: the fleet emulator, rack relays) and
  ``http`` (an httpx client) or ``http_pool`` (the lean kept-alive client of
  :mod:`scheduler_link.fanout`) lets them share one HTTP client.
- ``ReportReply.stop`` (fencing: the placer placed those gangs elsewhere) is handed to
  ``hooks.stop_workloads`` at once, in a task of the link's nursery, so a slow stop
  never delays a heartbeat.
- Rack relays (DESIGN.md, Fleet scale): when the answer to a full report names
  ``relay_url`` (and it is not this agent's own members listener), the link opens a
  frames connection to that relay and uses it as its report channel (closing its own
  connection to the placer); the relay's ``part`` frames go to ``on_part``. The answer to
  a later full report that names no relay (or another) moves the link back (or on). A
  relay that breaks, refuses or does not answer in time is a transport error like any
  other -- the channel is closed and a full report goes to the placer's framed channel
  or HTTP -- and the same relay is not tried again for ``relay_retry_s``; then a full
  report asks the placer again where the rack's relay is.
- Identity through relays (scheduler_link.msgauth): the answer to a full report sent over this
  node's own connection (never one through a relay) carries its MAC key and the placer's
  signing key; every report sent through a relay carries this node's MAC. Stops in a relayed
  answer are applied only with the placer's MAC; a part from the relay that the node does not
  take (not signed with the key it holds: the placer may have a new one) sends its next full
  report directly, and it returns to the relay after ``relay_retry_s``.
- Enrolment through the relay (scheduler_link.enroll): a link with no MAC key yet (a new boot)
  that knows its rack's relay (``enroll_relay_url``: remembered from its last registration in
  the agent's state dir, ``on_relay`` keeps it there) and holds its certificate's key
  (``enroll``) registers *through the relay*: the placer's certificate from the relay,
  checked against the CA; an Enroll with the full report, MACed under a key only this node
  and the placer can derive; the keys come back sealed to it. No handshake with the placer.
  A relay with no connection to the placer (``upstream_down``) is held on to as for reports
  (below), asked again every second or so over the one connection to it the link keeps
  meanwhile; a relay that is unreachable, refuses, or answers anything but a sealed answer
  that opens: the full report goes directly, as before, and enrolment is tried again after
  ``relay_retry_s``.
- What a relay may not decide for its members (issue 42): which relay they use -- a member
  follows ``relay_url`` only from an answer over its own connection (a relayed answer that
  names no relay, or another, sends it back to the placer, which says again); how often they
  report -- a relayed ``heartbeat_interval_s`` is clamped to [half, all] of the interval the
  placer gave over the member's own connection (:func:`relayed_interval`); and whether they
  are heard -- a member that has had nothing the placer vouched for (an answer over its own
  connection, a part with the placer's signature, a stop with its MAC) for
  ``relay_trust_intervals`` intervals (``[relay] trust_intervals``; 0, the default, never) sends
  one full report directly, and the answer says
  which relay to use (a relay that answers every heartbeat itself cannot hold it for good).
- Fencing (scheduler_link.epochs): an answer over this node's own connection older than the
  highest placer epoch seen is not acted on (its stops dropped and counted, its relay, keys,
  channel and interval not taken; the next placer known is asked); a newer one is made durable
  first. Through a relay an answer's epoch is taken and checked the same way only under the
  placer's MAC in this node's key (``epoch_mac``; a relay could write any epoch), and each
  stop's epoch (under its MAC) too.
- Several placers, the one asked silent (paused, cut off): a registered node's report over its
  own connection unanswered for ``leader_probe_after_s`` (1-1.5 s) asks the other placers who leads
  (scheduler_link.leaderprobe, their ``/healthz``), every second until it is answered; one
  named with an epoch above the highest seen ends the wait and the link moves to it (a full
  report follows), instead of waiting out ``request_timeout_s``. A leader named at the epoch
  already known is only slow, and is waited for.
- A relay with no connection to the placer (scheduler_link.relayhold): it answers
  ``upstream_down`` (503; to an enrolment, ``PlacerCert.outcome``) and says, structured
  (``dialling``), whether it is getting through (never connected since it started, or a dial
  to the placer in flight now: a cold start or a large fleet's restart, every relay
  handshaking with the placer at once) or is between dials (the placer refused or did not
  answer its last one). The link keeps that relay (trying it every second or so, a full report
  pending) instead of handshaking with the placer itself, so the placer hears the rack's
  members through their relay (one handshake per relay), for a bound from the first such
  answer in a row that the link keeps, not the relay: ``relay_hold_s`` on an answer between
  dials, ``DIAL_HOLD_FACTOR`` (4) times that on one that says dialling (a relay stuck dialling
  still lets its members go). Past the bound it reports directly as after any relay failure.
"""

from __future__ import annotations

import logging
import math
import random
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol

import httpx
import msgspec
import trio

from infra import tls
from infra.auth import auth_header
from infra.backoff import Backoff, Retry

from . import leaderprobe
from .client import ClientError, check_peer
from .enroll import ENROLL_WAIT_S, EnrollClient, EnrollRefused
from .epochs import Epochs
from .fanout import PushPool
from .follow import OBSERVED, Copies
from .frames import CallFailed, FrameChannel, FrameError, decode_payload, open_frames
from .heartbeat_wire import UPSTREAM_DOWN, HeartbeatClient, WireError, WireReply
from .messages import (
    BlobReply,
    BlobRequest,
    EnrollAnswer,
    Frame,
    GpuSnapshot,
    NodeOutcome,
    NodePart,
    NodeReport,
    PlacerCert,
    ReportReply,
    Victim,
    WorkloadEvent,
    compact_ok,
    for_placer,
    gpu_inventory,
)
from .msgauth import BundleVerifier, epoch_ok, relayed_stops, with_report_mac
from .placers import NO_LEADER, Placers, leader_of, leader_wire_of, not_leading
from .relayhold import RelayHold

log = logging.getLogger("herd.link.agent")

_reply_decoder = msgspec.json.Decoder(ReportReply)

# Intervals a member reports through its relay with nothing the placer vouched for, before a
# full report goes directly (one per member per this many intervals: ~10 minutes at 5 s).
RELAY_TRUST_INTERVALS = 0   # off unless configured ([relay] trust_intervals): each re-check is a handshake
RELAY_HOLD_S = 30.0         # how long a member keeps a relay that has lost the placer
RELAY_HOLD_RETRY_S = 1.0       # ... and how often it tries it meanwhile (at most one interval)
RELAYED_INTERVAL_FLOOR = 0.5   # of the placer's own interval: a relayed answer may ask for no more often


def relayed_interval(value: float, own: float) -> float:
    """A relayed answer's ``heartbeat_interval_s``, clamped: at most the interval the placer
    gave over our own connection (a relay cannot make us fall silent) and at least half of it
    (nor make us flood)."""
    return min(own, max(own * RELAYED_INTERVAL_FLOOR, value))


class ReportChannel(Protocol):
    """One way to hand a report to the placer and get its answer (the framed channel)."""

    async def exchange(self, report: NodeReport) -> WireReply: ...

    async def aclose(self) -> None: ...


# (wire_url, token, node_id) -> an open channel; raises OSError/WireError when it cannot.
WireConnect = Callable[[str, str, str], Awaitable[ReportChannel]]


async def direct_wire(wire_url: str, token: str, node_id: str, *,
                      ssl_context: ssl.SSLContext | None = None) -> ReportChannel:
    """The default: this node's own framed connection (mutual TLS to the ``placer`` with a context)."""
    return await HeartbeatClient.connect(wire_url, token, node_id, ssl_context=ssl_context)


# A part delivered by the rack relay -> this node's outcome (the agent's parts acceptor).
PartHandler = Callable[[NodePart], Awaitable[NodeOutcome]]


class RelayChannel:
    """A member's report channel through its rack relay: a frames connection whose
    ``report`` calls answer a WireReply, and on which the relay sends ``part`` requests.
    ``run`` must be running (in the link's nursery) for answers to arrive."""

    def __init__(self, channel: FrameChannel, url: str, on_part: PartHandler | None,
                 on_refused: Callable[[RelayChannel], None] | None = None) -> None:
        self.channel = channel
        self.url = url
        self._on_part = on_part
        self._on_refused = on_refused
        self.parts = 0
        self.refused = 0
        self.vouched_at = -math.inf   # trio time of the last part taken (signed by the placer)

    async def run(self) -> None:
        await self.channel.run(self._frame)

    def _frame(self, ch: FrameChannel, f: Frame) -> Any:
        if f.type == "part" and self._on_part is not None:
            return self._part(decode_payload(f, NodePart))
        if f.type == "ping":
            return ("ping", {})
        raise ValueError(f"a member does not take {f.type} frames")

    async def _part(self, part: NodePart) -> tuple[str, NodeOutcome]:
        assert self._on_part is not None
        self.parts += 1
        try:
            out = await self._on_part(part)
            self.vouched_at = trio.current_time()   # taken: it carried the placer's signature
            return "ack", out
        except Exception:
            # not taken (not signed by the placer we know, or not durable): the relay gets an error
            # and the placer reaches us directly; we re-register directly (a placer with a new
            # signing key gives it only there), and come back to the relay after relay_retry_s
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused(self)
            raise

    async def exchange(self, report: NodeReport) -> WireReply:
        try:
            f = await self.channel.call("report", report)
            return decode_payload(f, WireReply)
        except (FrameError, CallFailed, msgspec.ValidationError) as e:
            raise WireError(f"relay {self.url}: {e}") from None

    async def blob(self, blob_id: str, timeout_s: float) -> bytes | None:
        f = await self.channel.call("blob_get", BlobRequest(blob_id=blob_id), timeout_s=timeout_s)
        r: BlobReply = decode_payload(f, BlobReply)
        return r.data

    async def aclose(self) -> None:
        await self.channel.aclose()


# (relay_url, token, node_id) -> an open frames connection (not yet running)
RelayConnect = Callable[[str, str, str], Awaitable[FrameChannel]]


async def direct_relay(url: str, token: str, node_id: str, *,
                       ssl_context: ssl.SSLContext | None = None) -> FrameChannel:
    """A frames connection to the rack's relay (mutual TLS: the relay must hold a node certificate)."""
    return await open_frames(url, token, node_id, ssl_context=ssl_context, expect="node")


class LinkHooks(Protocol):
    """What the agent daemon offers the link."""

    def full_report(self) -> NodeReport: ...

    async def stop_workloads(self, victims: list[Victim]) -> None: ...

    def gpu_snapshot(self) -> GpuSnapshot: ...


def registration(base: NodeReport, taken: str) -> NodeReport:
    """A full report as it goes to the placer: the snapshot as the placer reads it
    (``for_placer``) and the digest of its GPU inventory; with no snapshot at all (a *compact*
    registration, placer.inventories) when the placer took that inventory last (``taken``:
    its digest, "" for none) and nothing about health is to be said."""
    snap = for_placer(base.snapshot) if base.snapshot else None
    digest = gpu_inventory(snap)[1] if snap is not None else ""
    if snap is not None and taken and digest == taken and compact_ok(snap):
        snap = None
    return msgspec.structs.replace(base, full=True, snapshot=snap, inventory=digest)


def health_signature(snap: GpuSnapshot | None) -> Any:
    """What, in a snapshot, is worth a report when it changes: inventory and health
    (telemetry values move all the time and are not)."""
    if snap is None:
        return None
    return (
        tuple((g.index, g.uuid, g.health, tuple(r.code for r in g.reasons)) for g in snap.gpus),
        snap.host.state, tuple(r.code for r in snap.host.reasons), snap.nvlink_domain,
    )


class AgentLink:
    """Keeps one agent registered with the placer (see the module docstring)."""

    def __init__(self, placer_url: str, token: str | None, node_id: str, hooks: Any, *,
                 heartbeat_s: float = 5.0, backoff_min_s: float = 0.05, backoff_max_s: float = 5.0,
                 request_timeout_s: float = 10.0, full_every: int = 60, use_wire: bool = True,
                 wire_url: str | None = None, wire_connect: WireConnect | None = None,
                 http: httpx.AsyncClient | None = None, http_pool: PushPool | None = None,
                 on_part: PartHandler | None = None, own_relay_url: str | None = None,
                 relay_connect: RelayConnect | None = None, relay_retry_s: float | None = None,
                 ssl_context: ssl.SSLContext | None = None, wire_connect_timeout_s: float = 60.0,
                 wire_busy_backoff_s: float = 1.0, relay_trust_intervals: int = RELAY_TRUST_INTERVALS,
                 relay_hold_s: float = RELAY_HOLD_S, placers: Sequence[str] = (),
                 epochs: Epochs | None = None, enroll: EnrollClient | None = None,
                 enroll_relay_url: str | None = None, on_relay: Callable[[str], None] | None = None,
                 copies: bool = True, copy_fold: Callable[[str, NodeReport], bool] | None = None,
                 copy_leader: Callable[[float], Awaitable[str | None]] | None = None) -> None:
        # every placer known (placer_url may list several, comma-separated): failed over (scheduler_link.placers)
        self.placers = Placers([*placer_url.split(","), *placers])
        self.placer_url = self.placers.current
        # copies of every report to the other placers (scheduler_link.follow): their warm models
        self.copy_to_followers = copies
        self._copy_fold = copy_fold   # a relay host: its empty heartbeats' copies ride in the relay's beat copies
        self._copy_leader = copy_leader   # ... and its relay names the placer that leads (Relay.leader_wire)
        self._copies: Copies | None = None
        self._moved_to: str | None = None      # the placer moved to, whose copy connection may be taken
        self._client: httpx.AsyncClient | None = None
        self._headers: dict[str, str] = {}
        self._copies_from: float | None = None   # trio time the copies begin (after registering, spread)
        self.ssl_context = ssl_context       # mutual TLS (this node's certificate) on every connection
        # the deny-list this node's handshakes consult (shared by its contexts): the placer's answers fill it
        self.revoked = ssl_context.revoked if isinstance(ssl_context, tls.HerdContext) else None
        self.token = token
        self.node_id = node_id
        self.hooks = hooks
        self.epochs = epochs if epochs is not None else Epochs()   # the node's placer-epoch gate
        self.heartbeat_s = heartbeat_s
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.request_timeout_s = request_timeout_s
        # several placers: a report unanswered this long asks the others who leads (_post_or_move)
        self.leader_probe_after_s = leaderprobe.PROBE_AFTER_S
        self.leader_moves = 0
        self.full_every = full_every  # a periodic full report heals any drift (manifests held, ...)
        self._since_full = 0
        self.boot_id = uuid.uuid4().hex
        self.seq = 0
        self._events_send, self._events_recv = trio.open_memory_channel[WorkloadEvent](math.inf)
        self._wake = trio.Event()
        self._urgent = 0   # events queued to be sent at once (notify) since the last report took them
        self._need_full = True
        self._last_health: Any = None
        self.use_wire = use_wire
        self._wire: ReportChannel | None = None
        self._wire_url = wire_url            # the last framed channel the placer announced
        self._wire_retry_at = 0.0            # trio time before which a failed channel is not retried
        # longer than the placer's handshake queue bound (45 s) plus its hello deadline: a
        # connection the placer still means to serve is not given up on
        self.wire_connect_timeout_s = wire_connect_timeout_s
        self.wire_busy_backoff_s = wire_busy_backoff_s   # the first busy back-off; it doubles
        self._rng = random.Random()          # the jitter of every back-off here
        self._wire_busy = 0                  # framed-channel connects in a row that timed out
        self.wire_busy = 0                   # ... all of them, and connects that found it busy
        self._wire_connect: WireConnect = wire_connect or partial(direct_wire, ssl_context=ssl_context)
        self._http = http                    # shared HTTP client (not closed here) or None
        self._http_pool = http_pool          # or a shared PushPool (not closed here)
        self.wire_reports = 0
        self.wire_full_reports = 0
        # rack relay (member side)
        self.on_part = on_part
        self.own_relay_url = own_relay_url   # this agent's own members listener, when it is a relay
        self._relay_connect: RelayConnect = relay_connect or partial(direct_relay, ssl_context=ssl_context)
        self.relay_retry_s = relay_retry_s
        self._relay: RelayChannel | None = None   # the report channel, when it goes through a relay
        self._relay_failed: dict[str, float] = {}  # relay url -> trio time before which it is not retried
        self._relay_ask_at: float | None = None     # trio time of the full report that asks again
        self._nursery: trio.Nursery | None = None
        self.relay_switches = 0
        self.relay_failures = 0
        # identity: from the answer to a full report over this node's own connection only
        self.mac_key: bytes | None = None
        self.placer_key: bytes | None = None
        self._leave_relay: RelayChannel | None = None   # a relay whose part we could not take
        # what a relay may not decide for us (module docstring): the interval the placer gave
        # over our own connection, and when the placer last vouched for what we heard
        self.placer_heartbeat_s = heartbeat_s
        self.relay_trust_intervals = relay_trust_intervals   # 0: never re-checked directly
        self._vouched_at = -math.inf
        self.relay_rechecks = 0              # full reports sent directly after a relay held us too long
        #                                      (or passed on a stop refused for its binding)
        self._stop_bounced = False           # a relayed stop was refused: the next report directly
        self._bounce_direct_at = -math.inf   # ... not again before this (trio time)
        self.relay_urls_ignored = 0          # relayed answers naming another relay (not followed)
        # enrolment through the relay (module docstring): this node's certificate key, the relay
        # it last reported through, and where that is kept
        self._enroll = enroll
        self._enroll_url = enroll_relay_url
        self._on_relay = on_relay
        self._enroll_retry_at = -math.inf
        self.enrolled = 0
        self.enroll_failures = 0
        self.enroll_refusals: dict[str, int] = {}
        # a relay with no connection to the placer (upstream_down: dialling it, or between dials
        # while the placer restarts) is kept for a bounded time from its first such answer
        # (scheduler_link.relayhold), retried every RELAY_HOLD_RETRY_S (jittered)
        self.relay_hold_s = relay_hold_s
        self._hold = RelayHold(relay_hold_s)
        self.relay_holds = 0                 # answers upstream_down while the relay was kept
        self.relay_dial_holds = 0            # ... of them, from a relay that said it is dialling
        self._enroll_channel: RelayChannel | None = None   # the relay held on to for an enrolment
        self.relayed_full_reports = 0        # full reports the placer took through a relay (no handshake)
        self.compact_registrations = 0       # full reports taken that named the inventory (placer.inventories)
        self.inventory_misses = 0            # ... answered 409: the placer held none (the snapshot went next)
        self._inventory_taken = ""           # the digest of the GPU inventory the placer took last
        self._revoked_at = 0.0               # issued_at of the signed deny-list taken last
        self._verifier: BundleVerifier | None = None
        self.revoked_refused = 0             # signed deny-lists that did not verify (a relay's forgery)
        # statistics
        self.reports_sent = 0
        self.full_reports_sent = 0
        self.failures = 0
        self.conflicts = 0
        self.stops_received = 0
        self.stops_refused = 0               # stops through a relay without the placer's valid MAC
        self.registered = False
        self.last_ok_at: float | None = None
        self.last_error: str | None = None

    # ------------------------------------------------------------ daemon-facing API

    def notify(self, event: WorkloadEvent, *, at_once: bool = True) -> None:
        """Queue a workload state change for the next report: sent at once, or with
        ``at_once=False`` carried by the next report that goes anyway (the next change sent at
        once, or the heartbeat). Never blocks, never raises."""
        try:
            self._events_send.send_nowait(event)
            if at_once:
                self._urgent += 1
                self._wake.set()
        except Exception:  # a closed link drops events; a later full report carries the truth
            log.debug("event dropped node=%s workload=%s", self.node_id, getattr(event, "workload_id", "?"))

    def request_full_report(self) -> None:
        """Ask for a full report on the next round (e.g. after a local recovery)."""
        self._need_full = True
        self._wake.set()

    def statistics(self) -> dict[str, Any]:
        return {
            "placer_url": self.placer_url, "placers": list(self.placers.urls), "placer_switches": self.placers.switches,
            "leader_moves": self.leader_moves,
            "registered": self.registered, "boot_id": self.boot_id,
            "seq": self.seq, "reports_sent": self.reports_sent, "full_reports_sent": self.full_reports_sent,
            "failures": self.failures, "conflicts": self.conflicts, "stops_received": self.stops_received,
            "stops_refused": self.stops_refused,
            "last_ok_at": self.last_ok_at, "last_error": self.last_error, "heartbeat_s": self.heartbeat_s,
            "framed_channel": self._wire is not None, "wire_reports": self.wire_reports,
            "wire_full_reports": self.wire_full_reports, "wire_url": self._wire_url, "wire_busy": self.wire_busy,
            "relay_url": self._relay.url if self._relay is not None else None,
            "relay_switches": self.relay_switches, "relay_failures": self.relay_failures,
            "relay_rechecks": self.relay_rechecks, "relay_urls_ignored": self.relay_urls_ignored,
            "relay_parts": self._relay.parts if self._relay is not None else 0,
            "enrolled": self.enrolled, "enroll_failures": self.enroll_failures,
            "enroll_refusals": dict(self.enroll_refusals),
            "relay_holds": self.relay_holds, "relay_dial_holds": self.relay_dial_holds,
            "relayed_full_reports": self.relayed_full_reports,
            "compact_registrations": self.compact_registrations, "inventory_misses": self.inventory_misses,
            "revoked_at": self._revoked_at, "revoked_refused": self.revoked_refused,
            "follower_copies": self._copies.statistics() if self._copies is not None else None,
        }

    @property
    def wire_url(self) -> str | None:
        """The placer's framed channel as this agent dials it (None: not known yet)."""
        return wire_endpoint(self._wire_url, self.placer_url) if self._wire_url else None

    async def relay_blob(self, blob_id: str) -> bytes | None:
        """A gang blob from this node's relay (None: no relay, or it has none)."""
        r = self._relay
        if r is None:
            return None
        try:
            return await r.blob(blob_id, self.request_timeout_s)
        except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("relay did not give the gang blob node=%s blob=%s err=%s", self.node_id, blob_id[:16], e)
            return None

    # ------------------------------------------------------------ the loop

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        headers = {"content-type": "application/json", **auth_header(self.token)}
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
        url = f"{self.placer_url}/v1/nodes/{self.node_id}/report"
        try:
            await self._run(url, headers, limits, task_status)
        finally:
            await self._close_wire()
            if self._enroll_channel is not None:
                with trio.CancelScope(shield=True):
                    await self._enroll_channel.aclose()
            if self._copies is not None:
                await self._copies.aclose()

    async def _run(self, url: str, headers: dict[str, str], limits: httpx.Limits, task_status: Any) -> None:
        if self._http is not None or self._http_pool is not None:
            async with trio.open_nursery() as nursery:
                await self._loop(self._http, url, headers, nursery, task_status)
            return
        verify: ssl.SSLContext | bool = self.ssl_context if self.ssl_context is not None else True
        async with httpx.AsyncClient(headers=headers, limits=limits, verify=verify,
                                     timeout=self.request_timeout_s) as client, trio.open_nursery() as nursery:
            await self._loop(client, url, {}, nursery, task_status)

    async def _loop(self, client: httpx.AsyncClient | None, url: str, headers: dict[str, str], nursery: trio.Nursery,
                    task_status: Any) -> None:
        self._nursery = nursery
        self._client, self._headers = client, headers
        if self.copy_to_followers and len(self.placers) > 1:
            self._copies = Copies(self, nursery, self._rng)
        task_status.started()
        retry = Retry(self._report_backoff(), self._rng)
        next_beat = trio.current_time()
        while True:
            if not self._need_full:
                with trio.move_on_at(next_beat):
                    await self._wait_for_events()
            if self._leave_relay is not None:
                await self._leave(self._leave_relay)
            if self._relay_ask_at is not None and trio.current_time() >= self._relay_ask_at:
                self._relay_ask_at = None
                self._need_full = True  # where is the rack's relay now?
            if self._relay is None:
                self._stop_bounced = False   # (the next report goes to the placer anyway)
            elif self._stop_bounced or self._relay_untrusted(trio.current_time()):
                await self._recheck_relay()
            if self._enroll_due():
                enrolled = await self._enroll_through_relay(nursery)
                if enrolled is None:   # the relay has no connection to the placer yet: held on to
                    await trio.sleep(self._rng.uniform(0.5, 1.0) * min(RELAY_HOLD_RETRY_S, self.heartbeat_s))
                    continue
                if enrolled:
                    next_beat = trio.current_time() + self.heartbeat_s * random.uniform(0.8, 1.0)
                    continue
            if self._moved_to is not None:
                await self._take_copy(self._moved_to)
            if self._wire is None and self._wire_url and self.use_wire \
                    and trio.current_time() >= self._wire_retry_at:
                await self._open_wire(self._wire_url)
                if self._wire is None and 0 < self._wire_busy < WIRE_BUSY_TRIES:
                    await trio.sleep_until(self._wire_retry_at)  # the channel again, not HTTP
                    continue
            at = self.placer_url   # (it changes when this placer does not lead: _placer_answered)
            url = f"{at}/v1/nodes/{self.node_id}/report"
            report = self._build_report()
            relayed = self._relay is not None
            if self._copies is not None and not relayed:
                self._copies.offer(report, self.placers.urls)
            try:
                reply = await self._post_or_move(client, url, report, headers)
            except _Conflict:
                self.conflicts += 1
                self._need_full = True
                if report.compact:   # the placer holds no inventory of ours: the snapshot, at once
                    self._inventory_taken = ""
                    self.inventory_misses += 1
                    continue
                if report.full:  # a placer that refuses even a full report: back off
                    retry.backoff = self._report_backoff()
                    await trio.sleep(retry.failed(trio.current_time()))
                continue
            except (httpx.HTTPError, OSError, _PlacerError, msgspec.DecodeError, WireError,
                    trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                if isinstance(e, _RelayHolding) and self._holding(trio.current_time(), e.dialling):
                    self.registered = False
                    self.last_error = str(e)
                    self._need_full = True   # what the placer saw is in doubt: a full report, through the relay
                    await trio.sleep(self._rng.uniform(0.5, 1.0) * min(RELAY_HOLD_RETRY_S, self.heartbeat_s))
                    continue
                if self._relay is not None:  # the relay failed us (or held us past its bound): the placer directly
                    self._hold.clear()
                    self._relay_gone(self._relay.url)
                    log.warning("relay failed, reporting to the placer node=%s relay=%s err=%s", self.node_id,
                                self._relay.url, e)
                elif not relayed and not isinstance(e, _PlacerError) and not await self._leader_by_relay(at):
                    self._placer_answered(None, used=at)   # no answer: another placer may lead
                if isinstance(e, _Observed) and self._copies is not None and self._wire is not None:
                    self._copies.give_back(e.url, self._wire)
                    self._wire = None
                await self._close_wire()
                self.failures += 1
                self.registered = False
                self.last_error = f"{type(e).__name__}: {e}"
                self._need_full = True
                retry.backoff = self._report_backoff()
                pause = retry.failed(trio.current_time())
                if isinstance(e, _PlacerError) and e.retry_after_s:   # the placer said when: spread out below it
                    pause = max(pause, self._rng.uniform(0.5, 1.0) * min(e.retry_after_s, RETRY_AFTER_MAX_S))
                log.warning("report failed node=%s err=%s backoff=%.2fs", self.node_id, self.last_error, pause)
                await trio.sleep(pause)
                continue
            if not (self._fresh_relayed(reply) if relayed else self._fresh(reply, at)):
                await trio.sleep(retry.failed(trio.current_time()))
                continue
            retry.succeeded()
            self._hold.clear()
            self.registered = True
            self.last_ok_at = time.time()
            if report.full:
                log.info("registered node=%s boot=%s seq=%d relayed=%s", self.node_id, self.boot_id, report.seq,
                         relayed)
                self.relayed_full_reports += relayed
                self.compact_registrations += report.compact
                if report.snapshot is not None:   # the placer holds this inventory now (placer.inventories)
                    self._inventory_taken = report.inventory
                if not relayed:  # keys only from our own connection: a relay's answer could be anything
                    self.mac_key = reply.mac_key or self.mac_key
                    self.placer_key = reply.placer_key or self.placer_key
            if reply.need_full and reply.send_inventory:   # (a follower lacks it: agent.relaycopies)
                self._inventory_taken = ""
            self._take_revoked(reply, relayed)
            if not relayed:
                self._vouched_at = trio.current_time()
            if reply.heartbeat_interval_s and not relayed:
                self.placer_heartbeat_s = self.heartbeat_s = max(0.01, reply.heartbeat_interval_s)
            elif reply.heartbeat_interval_s:
                self.heartbeat_s = relayed_interval(reply.heartbeat_interval_s, self.placer_heartbeat_s)
            if reply.need_full:
                self._need_full = True
            if reply.wire_url and not relayed:  # (a relay's answer must not move our placer channel)
                self._wire_url = reply.wire_url
            if report.full or (reply.relay_url and not relayed and self._relay is None):
                # (a node that registered before its rack had a relay hears of it in the
                # answer to a direct heartbeat, and moves over at once)
                await self._follow_relay(self._relay_named(reply.relay_url, relayed))
            if report.full and reply.wire_url and self.use_wire and self._wire is None:
                await self._open_wire(reply.wire_url)
            stop = list(reply.stop)
            if stop and relayed:  # through a relay: only stops the placer MACed with our key, of no older
                # epoch, unexpired and for the attempt their workload names
                stop = self._relayed_stops(stop)
                if stop:
                    self._vouched_at = trio.current_time()   # the placer's MAC, in our key
            if stop:
                self.stops_received += len(stop)
                nursery.start_soon(self._stop, stop)
            next_beat = trio.current_time() + self.heartbeat_s * random.uniform(0.8, 1.0)

    def _take_revoked(self, reply: ReportReply, relayed: bool) -> None:
        """The deny-list into this node's handshakes (its data plane refuses revoked peers): the
        placer-signed list from any answer, a relay's too, when it verifies with the placer's key
        and is newer than the one taken; an unsigned list only over this node's own connection."""
        if self.revoked is None:
            return
        rl = reply.revoked_signed
        if rl is not None:
            if rl.issued_at <= self._revoked_at or not self.placer_key:
                return
            if self._verifier is None or self._verifier.public != self.placer_key:
                self._verifier = BundleVerifier(self.placer_key)
            if not self._verifier.revoked_ok(rl):
                self.revoked_refused += 1
                log.warning("a deny-list that the placer did not sign refused node=%s relayed=%s", self.node_id,
                            relayed)
                return
            self._revoked_at = rl.issued_at
            self.revoked.replace(rl.nodes, rl.serials)
        elif reply.revoked_nodes is not None and not relayed:
            self.revoked.replace(reply.revoked_nodes, reply.revoked_serials or [])

    def _fresh(self, reply: ReportReply, at: str) -> bool:
        """An answer over our own connection of no older placer epoch (a newer one made durable);
        else nothing in it is acted on, and the next placer known is asked."""
        try:
            if self.epochs.admit(reply.epoch, "reply"):
                return True
        except OSError:
            return False   # (not durable: not acted on; the same report goes again)
        self.stops_refused += len(reply.stop)
        log.warning("answer of a replaced placer ignored node=%s placer=%s epoch=%d highest=%d stops=%d",
                    self.node_id, at, reply.epoch, self.epochs.highest, len(reply.stop))
        self._placer_answered(None, used=at)
        self._need_full = True
        return False

    def _fresh_relayed(self, reply: ReportReply) -> bool:
        """An answer through the relay: its epoch is taken (and checked) only under the placer's
        MAC in our key (a relay could write any epoch there); one without is left to its stops'."""
        if not epoch_ok(self.mac_key, self.node_id, self.boot_id, reply.epoch, reply.epoch_mac):
            return True
        try:
            if self.epochs.admit(reply.epoch, "reply"):
                return True
        except OSError:
            return False
        self.stops_refused += len(reply.stop)
        log.warning("relayed answer of a replaced placer ignored node=%s epoch=%d highest=%d", self.node_id,
                    reply.epoch, self.epochs.highest)
        self._need_full = True
        return False

    def _relayed_stops(self, stop: list[Victim]) -> list[Victim]:
        """The stops a relay carried that this node acts on: the placer's MAC in our key, bound
        (unexpired, for the attempt their workload names: msgauth.stop_binding), of no older
        epoch. A stop refused for its binding is named in the next report: a full one, which
        lists the workload, so the placer's answer tells us again; over our own connection, with
        no relay in the way (as the answer to the next report does when a direct stop is
        refused), at most once in ``BOUNCE_DIRECT_INTERVALS`` (a relay that keeps replaying
        stops costs the placer that many handshakes at most), else through the relay."""
        checked = relayed_stops(self.mac_key, self.node_id, self.boot_id, stop, time.time())
        if checked.forged:
            self.stops_refused += checked.forged
            log.warning("stops from the relay refused (no valid placer MAC) node=%s count=%d",
                        self.node_id, checked.forged)
        if checked.refused:
            self.stops_refused += len(checked.refused)
            self._need_full = True
            now = trio.current_time()
            if now >= self._bounce_direct_at:
                self._stop_bounced = True
                self._bounce_direct_at = now + BOUNCE_DIRECT_INTERVALS * self.placer_heartbeat_s
            log.warning("stops from the relay refused node=%s count=%d workloads=%s first=%s", self.node_id,
                        len(checked.refused), ",".join(f"{r.workload_id}:{r.outcome}" for r in checked.refused[:20]),
                        checked.refused[0].detail)
        return [v for v in checked.ok if self._fresh_stop(v)]

    def _fresh_stop(self, v: Victim) -> bool:
        try:
            ok = self.epochs.admit(v.epoch, "stop")
        except OSError:
            ok = False
        if not ok:
            self.stops_refused += 1
        return ok

    def _holding(self, now: float, dialling: bool) -> bool:
        """Keep the relay after an ``upstream_down`` answer (``dialling``: it said it is getting
        through)? Yes until the hold's bound passed since the first of them in a row
        (scheduler_link.relayhold: ``relay_hold_s``, longer while the relay is dialling)."""
        first = not self._hold.holding
        keep = self._hold.keep(now, dialling=dialling)
        if first:
            log.info("the relay has no connection to the placer: holding on to it for up to %.0fs node=%s "
                     "dialling=%s", self._hold.dialling_s if dialling else self._hold.lost_s, self.node_id, dialling)
        if keep:
            self.relay_holds += 1
            self.relay_dial_holds += dialling
        return keep

    def _relay_gone(self, url: str) -> None:
        """The relay at ``url`` failed us: not tried again for a while, and a full report then
        asks the placer where the rack's relay is."""
        self.relay_failures += 1
        self._relay_failed[url] = trio.current_time() + self._relay_retry()
        self._relay_ask_at = trio.current_time() + self._relay_retry()

    def _report_backoff(self) -> Backoff:
        """Capped at the heartbeat interval (the placer may change it): a failing node
        never waits longer to report than a healthy one."""
        return Backoff(self.backoff_min_s, max(self.backoff_min_s, min(self.backoff_max_s, self.heartbeat_s)))

    async def _wait_for_events(self) -> None:
        # Anything already queued goes out now; otherwise sleep until notify() or the deadline.
        while True:
            if self._urgent or self._need_full:
                return
            self._wake = trio.Event()
            await self._wake.wait()

    def _drain_events(self) -> list[WorkloadEvent]:
        self._urgent = 0
        out: list[WorkloadEvent] = []
        while True:
            try:
                out.append(self._events_recv.receive_nowait())
            except trio.WouldBlock:
                return out

    def _build_report(self, *, compact: bool = True) -> NodeReport:
        """The next report: full when one is due (``compact``: naming the GPU inventory the
        placer took last instead of sending it, when nothing about health is to be said), else
        a heartbeat with the events and any health change."""
        self.seq += 1
        now = time.time()
        self._since_full += 1
        if self.full_every and self._since_full >= self.full_every:
            self._need_full = True
        if self._need_full:
            self._since_full = 0
            self._drain_events()  # superseded by the full workload list
            base: NodeReport = self.hooks.full_report()
            self._last_health = health_signature(base.snapshot)
            self._need_full = False
            return registration(msgspec.structs.replace(base, node_id=self.node_id, boot_id=self.boot_id,
                                                        seq=self.seq, sent_at=now),
                                self._inventory_taken if compact else "")
        events = self._drain_events()
        snap: GpuSnapshot | None = None
        try:
            cur = self.hooks.gpu_snapshot()
            sig = health_signature(cur)
            if sig != self._last_health:
                snap, self._last_health = for_placer(cur), sig
        except Exception:
            log.exception("gpu_snapshot hook failed node=%s", self.node_id)
        return NodeReport(node_id=self.node_id, boot_id=self.boot_id, seq=self.seq, full=False,
                          snapshot=snap, events=events, sent_at=now)

    def _relay_named(self, url: str | None, relayed: bool) -> str | None:
        """The relay to use after an answer naming ``url``: only the placer names one (an
        answer over our own connection); a relayed answer may keep us where we are or send
        us to the placer, never to another relay."""
        if not relayed:
            return url
        cur = self._relay.url if self._relay is not None else None
        if url is not None and url != cur:
            self.relay_urls_ignored += 1
            log.warning("a relayed answer named another relay: asking the placer directly node=%s relay=%s named=%s",
                        self.node_id, cur, url[:200])
        return cur if url == cur else None

    def _relay_untrusted(self, now: float) -> bool:
        """Nothing the placer vouched for has come for ``relay_trust_intervals`` intervals."""
        if not self.relay_trust_intervals:
            return False
        heard = max(self._vouched_at, self._relay.vouched_at if self._relay is not None else -math.inf)
        return now - heard > self.relay_trust_intervals * self.placer_heartbeat_s

    async def _recheck_relay(self) -> None:
        """One full report over our own connection: the placer's answer says which relay to use."""
        self.relay_rechecks += 1
        why = "a stop it passed on was refused" if self._stop_bounced else \
            f"nothing from the placer through the relay for {self.relay_trust_intervals} intervals"
        self._stop_bounced = False
        log.info("%s: reporting directly node=%s relay=%s", why, self.node_id,
                 self._relay.url if self._relay is not None else None)
        await self._close_wire()
        self._vouched_at = trio.current_time()   # (not again before the direct answer had its chance)
        self._need_full = True

    def _relay_retry(self) -> float:
        now = trio.current_time()
        for u in [u for u, t in self._relay_failed.items() if t <= now]:  # bounded: only live marks stay
            del self._relay_failed[u]
        return self.relay_retry_s if self.relay_retry_s is not None else 3 * self.heartbeat_s

    def _part_refused(self, r: RelayChannel) -> None:
        if self._relay is r:
            self._leave_relay = r
            self._need_full = True
            self._wake.set()

    async def _leave(self, r: RelayChannel) -> None:
        """Report directly for a while (a full report: fresh keys) after a part from ``r`` was not taken."""
        self._leave_relay = None
        if self._relay is not r:
            return
        self._relay_gone(r.url)
        log.warning("a part from the relay was not taken: registering directly node=%s relay=%s", self.node_id, r.url)
        await self._close_wire()
        self._need_full = True

    async def _follow_relay(self, url: str | None) -> None:
        """After a full report: report through ``url`` (the rack's relay), or directly (None)."""
        if url is not None and url == self.own_relay_url:
            url = None
        cur = self._relay.url if self._relay is not None else None
        if url == cur:
            return
        if url is None:
            log.info("reporting to the placer directly node=%s (was relay %s)", self.node_id, cur)
            await self._close_wire()  # the loop reopens the placer's framed channel
            return
        if trio.current_time() < self._relay_failed.get(url, -math.inf) or self._nursery is None:
            return
        try:
            with trio.fail_after(self.request_timeout_s):
                ch = await self._relay_connect(url, self.token or "", self.node_id)
        except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError,
                tls.TLSError) as e:
            self._relay_gone(url)
            log.warning("relay unreachable, reporting to the placer node=%s relay=%s err=%s", self.node_id, url, e)
            return
        await self._close_wire()
        r = RelayChannel(ch, url, self.on_part, self._part_refused)
        self._nursery.start_soon(r.run)
        self._relay = r
        self._wire = r
        self.relay_switches += 1
        self._relay_failed.pop(url, None)
        log.info("reporting through the rack relay node=%s relay=%s", self.node_id, url)
        self._remember_relay(url)

    # ------------------------------------------------------------ enrolment through the relay

    def _remember_relay(self, url: str) -> None:
        """The relay this node reports through: where it enrols after its next restart."""
        if url == self._enroll_url:
            return
        self._enroll_url = url
        if self._on_relay is not None:
            try:
                self._on_relay(url)
            except OSError as e:
                log.warning("could not keep the relay's address node=%s err=%s", self.node_id, e)

    def _enroll_due(self) -> bool:
        """No key yet, a full report due, a relay known, and no enrolment failed lately."""
        return (self._enroll is not None and self.mac_key is None and self._need_full and self._relay is None
                and self._enroll_url is not None and self._enroll_url != self.own_relay_url
                and trio.current_time() >= self._enroll_retry_at)

    def _enroll_failed(self, outcome: str, why: object) -> None:
        self.enroll_failures += 1
        self.enroll_refusals[outcome] = self.enroll_refusals.get(outcome, 0) + 1
        self._enroll_retry_at = trio.current_time() + self._relay_retry()
        self._need_full = True
        log.warning("enrolment through the relay failed, registering directly node=%s relay=%s outcome=%s err=%s",
                    self.node_id, self._enroll_url, outcome, why)

    async def _enroll_through_relay(self, nursery: trio.Nursery) -> bool | None:
        """Register through the remembered relay (module docstring). True when this node is
        registered and reports through that relay now; False: register directly; None: the
        relay has no connection to the placer (dialling it, or between dials while the placer
        restarts) and is held on to (scheduler_link.relayhold: ``relay_hold_s`` from the first
        such answer, as for reports, longer while it says it is dialling): try again soon, on the
        same connection to the relay (no new handshake with it per try)."""
        assert self._enroll is not None and self._enroll_url is not None
        url = self._enroll_url
        r, self._enroll_channel = self._enroll_channel, None
        if r is not None and (r.url != url or r.channel.closed.is_set()):
            await r.aclose()
            r = None
        if r is None:
            try:
                with trio.fail_after(self.request_timeout_s):
                    conn = await self._relay_connect(url, self.token or "", self.node_id)
            except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError,
                    tls.TLSError) as e:
                self._hold.clear()
                self._enroll_failed("unavailable", e)
                return False
            r = RelayChannel(conn, url, self.on_part, self._part_refused)
            nursery.start_soon(r.run)
        ch = r.channel
        try:
            # an enrolment is a registration: the placer may be working through a storm of them
            with trio.fail_after(max(self.request_timeout_s, self.wire_connect_timeout_s, ENROLL_WAIT_S)):
                pc = decode_payload(await ch.call("enroll_key", {}), PlacerCert)
                if not pc.cert:
                    raise EnrollRefused(pc.outcome or "unavailable", pc.error or "the relay has no placer certificate",
                                        dialling=pc.dialling)
                report = self._build_report(compact=False)   # (a new key: the placer may hold nothing of ours)
                enrolment, pending = self._enroll.make(report, pc.cert, now=time.time())
                answer = decode_payload(await ch.call("enroll", enrolment), EnrollAnswer)
            secret = EnrollClient.open(pending, answer)
        except EnrollRefused as err:
            if err.outcome == "upstream_down" and self._holding(trio.current_time(), err.dialling):
                self.enroll_refusals["upstream_down"] = self.enroll_refusals.get("upstream_down", 0) + 1
                self._need_full = True
                self._enroll_channel = r   # (kept: the next try asks on it)
                return None
            await r.aclose()
            self._hold.clear()
            self._enroll_failed(err.outcome, err.detail)
            return False
        except (FrameError, CallFailed, trio.TooSlowError, msgspec.DecodeError, msgspec.ValidationError) as err:
            await r.aclose()
            self._enroll_failed("unavailable", err)
            return False
        reply = answer.reply or ReportReply()
        self.mac_key, self.placer_key = secret.mac_key, secret.placer_key
        if not self._fresh_relayed(reply):   # (its epoch, under the placer's MAC in the key it sealed)
            self.mac_key = self.placer_key = None
            await r.aclose()
            self._enroll_failed("refused", "the answer of a replaced placer")
            return False
        await self._close_wire()
        self._hold.clear()
        self._relay = self._wire = r
        self.enrolled += 1
        self.reports_sent += 1
        self.full_reports_sent += 1
        self._inventory_taken = report.inventory
        self.registered = True
        self.last_ok_at = time.time()
        self._vouched_at = trio.current_time()   # the sealed keys are the placer's word
        log.info("registered through the rack relay node=%s boot=%s relay=%s", self.node_id, self.boot_id, url)
        self._take_revoked(reply, True)
        if reply.heartbeat_interval_s:   # a relayed answer, but for its keys: clamped as one
            self.heartbeat_s = relayed_interval(reply.heartbeat_interval_s, self.placer_heartbeat_s)
        if reply.need_full:
            self._need_full = True
        stop = self._relayed_stops(list(reply.stop))
        if stop:
            self.stops_received += len(stop)
            nursery.start_soon(self._stop, stop)
        return True

    async def _open_wire(self, wire_url: str) -> None:
        wire_url = wire_endpoint(wire_url, self.placer_url)
        await self._close_wire()
        try:
            # registered (the placer answering), a channel that is slow is not a storm: the
            # short deadline, so a firewalled channel port never holds up a heartbeat for long
            limit = self.request_timeout_s if self.registered else self.wire_connect_timeout_s
            with trio.fail_after(limit):
                self._wire = await self._wire_connect(wire_url, self.token or "", self.node_id)
            self._wire_busy = 0
            log.debug("reports on the framed channel node=%s url=%s", self.node_id, wire_url)
            return
        except (OSError, WireError, trio.TooSlowError, trio.BrokenResourceError, msgspec.DecodeError,
                tls.TLSError) as e:
            self._wire = None
            if _busy(e) and self._wire_busy + 1 < WIRE_BUSY_TRIES:
                self._wire_busy += 1
                self.wire_busy += 1
                # full jitter over a doubling window: a storm's retries spread out, not in waves
                wait = Backoff(self.wire_busy_backoff_s, WIRE_BUSY_BACKOFF_MAX_S).pause(self._wire_busy, self._rng)
                self._wire_retry_at = trio.current_time() + wait
                log.warning("framed channel busy, trying it again in %.1fs node=%s tries=%d err=%s", wait,
                            self.node_id, self._wire_busy, e or type(e).__name__)
                return
            self._wire_busy = 0
            log.warning("framed channel unavailable, using HTTP node=%s err=%s", self.node_id, e or type(e).__name__)
            self._wire_retry_at = trio.current_time() + self.heartbeat_s

    async def _close_wire(self) -> None:
        w, self._wire = self._wire, None
        self._relay = None
        if w is not None:
            with trio.CancelScope(shield=True):
                await w.aclose()

    async def _post(self, client: httpx.AsyncClient | None, url: str, report: NodeReport,
                    headers: dict[str, str]) -> ReportReply:
        if self._relay is not None and self.mac_key:
            report = with_report_mac(self.mac_key, report)
        # Registering (a full report while not registered) directly: the placer may be
        # working through a storm of them (a restart: every agent at once), in arrival order.
        # A report given up on is still worked through there, and sent again it queues once
        # more: at 131,072 emulated nodes and a 30 s deadline, ~85,000 such retries a process
        # and 13,567 nodes registered in 200 s. Waited for as long as a busy channel, it is
        # worked through once.
        registering = report.full and not self.registered and self._relay is None
        limit = max(self.request_timeout_s, self.wire_connect_timeout_s) if registering else self.request_timeout_s
        if self._wire is not None:
            # through a relay: an empty heartbeat is answered by the relay at once, so a relay
            # that is silent for two intervals is dead to us (before the placer thinks us lost)
            if self._relay is not None:
                limit = min(self.request_timeout_s, max(2.0, 2 * self.heartbeat_s))
            with trio.fail_after(limit):
                wr = await self._wire.exchange(report)
            if self._copies is not None and self._relay is None and wr.status in (200, OBSERVED):
                self._copies.delivered(self.placer_url, report.seq)
            self.reports_sent += 1
            self.wire_reports += 1
            if report.full:
                self.full_reports_sent += 1
                self.wire_full_reports += 1
            if wr.status == 409:
                raise _Conflict()
            if wr.status != 200:
                if wr.status == 503 and wr.reason == UPSTREAM_DOWN and self._relay is not None:
                    raise _RelayHolding(f"the relay has no connection to the placer: {wr.error}", dialling=wr.dialling)
                if wr.status in (NO_LEADER, OBSERVED) and self._relay is None:   # a placer that does not lead (placer.ha)
                    used = self.placer_url
                    self._placer_answered(wr.status, used=used)
                    if wr.status == OBSERVED:   # a follower took it: the connection stays its copies'
                        raise _Observed(used)
                raise _PlacerError(f"placer answered {wr.status} on the framed channel: {wr.error or wr.reply.error}",
                                   wr.reply.retry_after_s)
            return wr.reply
        body = msgspec.json.encode(report)
        if client is None:
            assert self._http_pool is not None
            with trio.fail_after(limit):
                res = await self._http_pool.post(self.placer_url, f"/v1/nodes/{self.node_id}/report", body,
                                                 token=self.token, key=self.node_id, expect="placer")
            if res.status is None:
                self._placer_answered(None, used=self.placer_url)
                raise _PlacerError(f"placer unreachable: {res.error}")
            status, content = res.status, res.body
        else:
            r = await client.post(url, content=body, headers=headers or None,
                                  timeout=limit if registering else httpx.USE_CLIENT_DEFAULT)
            try:
                check_peer(r, "placer")   # over TLS the answer must be the placer's certificate's
            except ClientError as e:
                raise _PlacerError(str(e)) from None
            status, content = r.status_code, r.content
        if report.full:
            self.full_reports_sent += 1
        self.reports_sent += 1
        if status == 409:
            raise _Conflict()
        if status != 200:
            if not_leading(status, content):
                self._placer_answered(status, content, used=self.placer_url)
            raise _PlacerError(f"placer answered {status}: {content[:200].decode(errors='replace')}",
                               _retry_after(content))
        if self._copies is not None and self._relay is None:
            self._copies.delivered(self.placer_url, report.seq)
        return _reply_decoder.decode(content)

    async def _post_or_move(self, client: httpx.AsyncClient | None, url: str, report: NodeReport,
                            headers: dict[str, str]) -> ReportReply:
        """:meth:`_post`; and, with several placers known, registered, over this node's own
        connection, while it goes unanswered past ``leader_probe_after_s``: who leads, asked of the other placers
        (scheduler_link.leaderprobe). One named with an epoch above the highest seen ends the
        wait: the link moves to it (:class:`_PlacerMoved`; a full report follows) instead of
        waiting out the request timeout on a paused or cut-off leader."""
        if client is None or self._relay is not None or len(self.placers) < 2 or not self.registered:
            # (registering, a slow answer is the placer's storm of registrations, not silence:
            # probing then would only add a storm of probes to the followers)
            return await self._post(client, url, report, headers)
        race = _Race(self.placer_url)
        async with trio.open_nursery() as n:
            n.start_soon(self._race_report, race, n.cancel_scope, client, url, report, headers)
            n.start_soon(self._race_probe, race, n.cancel_scope, client)
        if race.reply is not None:   # answered after all (as the probe found a newer leader): kept
            return race.reply
        if race.moved_to is not None:
            now = trio.current_time()
            self.placers.failed(race.used, now)
            self._switch(self.placers.learned(race.moved_to.url, now), race.moved_to.wire or None)
            self.leader_moves += 1
            raise _PlacerMoved(f"placer {race.used} silent for {self.leader_probe_after_s:g}s or more and "
                               f"{race.moved_to.url} leads at a newer epoch ({race.moved_to.epoch})")
        assert race.error is not None
        raise race.error

    async def _race_report(self, race: _Race, scope: trio.CancelScope, client: httpx.AsyncClient, url: str,
                           report: NodeReport, headers: dict[str, str]) -> None:
        try:
            race.reply = await self._post(client, url, report, headers)
        except Exception as e:   # (raised again by _post_or_move, outside the nursery)
            race.error = e
        scope.cancel()

    async def _race_probe(self, race: _Race, scope: trio.CancelScope, client: httpx.AsyncClient) -> None:
        # jittered: a fleet whose leader went silent at one moment does not probe in step
        await trio.sleep(self.leader_probe_after_s * self._rng.uniform(1.0, 1.5))
        while True:
            others = [u for u in self.placers.urls if u != race.used]
            found = leaderprobe.newer_leader(await leaderprobe.probe(client, others), self.epochs.highest,
                                             race.used)
            if found is not None:
                race.moved_to = found
                scope.cancel()
                return
            await trio.sleep(leaderprobe.PROBE_EVERY_S * self._rng.uniform(0.75, 1.25))

    def _placer_answered(self, status: int | None, body: bytes = b"", *, used: str) -> None:
        """Several placers: a follower's 307 names the leader, which is asked next; a placer
        that does not lead and names none moves on to the next; no answer (``status`` None)
        moves on too, and passes over that placer for a while. The new one announces its own
        framed channel."""
        leader = leader_of(status, body) if status is not None else None
        now = trio.current_time()
        new = (self.placers.learned(leader, now) if leader
               else self.placers.failed(used, now if status is None else None))
        # the leader's framed channel when the follower named it (registered over it at once)
        self._switch(new, leader_wire_of(status, body) if leader and status is not None else None)

    def _switch(self, new: str, wire_url: str | None) -> None:
        if new != self.placer_url:
            log.info("reporting to another placer node=%s placer=%s (was %s)", self.node_id, new, self.placer_url)
            self.placer_url = new
            self._moved_to = new
            self._wire_url = wire_url
            self._wire_retry_at = 0.0

    # ------------------------------------------------------------ copies to the followers (follow.CopyHost)

    def copies_on(self) -> bool:
        """Copies go out once this node has been registered a while: a fleet registering at
        once (a cold start, a restart) registers with its leader first, and its copies to the
        followers come after, spread over COPY_SPREAD heartbeat intervals."""
        if self._relay is not None or self.last_ok_at is None:
            return False
        now = trio.current_time()
        if self._copies_from is None:
            self._copies_from = now + self._rng.uniform(*COPY_SPREAD) * self.heartbeat_s
        return now >= self._copies_from

    def full_copy(self, seq: int) -> NodeReport:
        base: NodeReport = self.hooks.full_report()
        return registration(msgspec.structs.replace(base, node_id=self.node_id, boot_id=self.boot_id, seq=seq,
                                                    sent_at=time.time()), "")

    async def ask_redirect(self, url: str) -> tuple[int, bytes] | None:
        """An empty report posted to ``url``: a follower answers 307 naming its framed channel
        (a leader 400: it reads the body; the copy is asked for again later)."""
        path = f"/v1/nodes/{self.node_id}/report"
        try:
            with trio.fail_after(self.request_timeout_s):
                if self._client is not None:
                    r = await self._client.post(url + path, content=b"{}", headers=self._headers or None)
                    return r.status_code, r.content
                assert self._http_pool is not None
                res = await self._http_pool.post(url, path, b"{}", token=self.token, key=self.node_id,
                                                 expect="placer")
        except (httpx.HTTPError, OSError, trio.TooSlowError) as e:
            log.debug("follower not asked for its channel node=%s placer=%s err=%r", self.node_id, url, e)
            return None
        return (res.status, res.body) if res.status is not None else None

    async def connect(self, wire_url: str, placer_url: str) -> ReportChannel:
        return await self._wire_connect(wire_endpoint(wire_url, placer_url), self.token or "", self.node_id)

    async def _leader_by_relay(self, used: str) -> bool:
        """A relay host whose placer went silent asks its relay which placer leads (waiting
        through a failover: the relay hears the promoted follower first) instead of trying the
        placers it knows in turn; True when the relay named one this node copies to (moved
        there, or stays)."""
        if self._copy_leader is None or self._copies is None:
            return False
        wire = await self._copy_leader(self.request_timeout_s)
        if wire is not None and self._wire_url and wire == wire_endpoint(self._wire_url, used):
            return True   # (the relay is up again to the placer this node reports to: it stays)
        url = next((u for u, f in self._copies.copies.items() if f.wire and wire_endpoint(f.wire, u) == wire), None)
        if url is None:
            return False
        if url != used:
            self.placers.failed(used, trio.current_time())
        self._switch(self.placers.learned(url, trio.current_time()), None)
        return True

    def fold_copy(self, wire_url: str, placer_url: str, rep: NodeReport) -> bool:
        return self._copy_fold is not None and self._copy_fold(wire_endpoint(wire_url, placer_url), rep)

    async def _take_copy(self, url: str) -> None:
        """Moved to the placer at ``url``: when this node's copies there were in step, its next
        heartbeat goes over the copy's connection (no full report, no handshake)."""
        self._moved_to = None
        if self._copies is None or self._relay is not None or url != self.placer_url:
            return
        # Waited for as long as a report is: the copy in flight is answered by the placer that a
        # full report would wait on, busy taking over (a promotion adopting the fleet holds its
        # loop for a second or more at 16,384 relayed nodes); a copy that fails ends the wait.
        ch = await self._copies.take(url, self.request_timeout_s)
        if ch is None:
            return
        await self._close_wire()
        self._wire = ch
        self._wire_url = self._copies.copies[url].wire
        self._need_full = False
        log.info("moved to a placer that holds this node's reports: no full report node=%s placer=%s",
                 self.node_id, url)

    async def _stop(self, victims: list[Victim]) -> None:
        try:
            log.info("placer asked to stop node=%s workloads=%s", self.node_id,
                     ",".join(v.workload_id for v in victims))
            await self.hooks.stop_workloads(list(victims))
        except Exception:
            log.exception("stop_workloads hook failed node=%s", self.node_id)


BOUNCE_DIRECT_INTERVALS = 3   # a relayed stop refused: a direct full report at most once in this many intervals
COPY_SPREAD = (1.0, 4.0)       # copies begin this many intervals after the first registration (uniform)
WIRE_BUSY_TRIES = 4            # connects that find the framed channel busy before HTTP is tried
WIRE_BUSY_BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 300.0      # the longest a placer's retry_after_s holds a node back


def _retry_after(content: bytes) -> float | None:
    """A refusal's ``retry_after_s``, if its body is a ReportReply that says one."""
    try:
        return _reply_decoder.decode(content).retry_after_s
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _busy(e: BaseException) -> bool:
    """A framed-channel connect that failed because the placer is busy, not because the
    channel is refused: no answer in time, over its connection cap (503), or closed before
    the TLS handshake answered (its handshake queue's bound)."""
    if isinstance(e, trio.TooSlowError):
        return True
    if isinstance(e, WireError):
        return e.status == 503
    return isinstance(e, tls.TLSError) and e.refusal is tls.Refusal.PEER


class _Conflict(Exception):
    pass


class _PlacerError(Exception):
    def __init__(self, msg: str, retry_after_s: float | None = None) -> None:
        super().__init__(msg)
        self.retry_after_s = retry_after_s   # the placer's ReportReply.retry_after_s, when it said one


class _Observed(_PlacerError):
    """The placer asked follows: it took the report into its warm model (202, scheduler_link.follow)."""

    def __init__(self, url: str) -> None:
        super().__init__(f"placer {url} follows (202): it took the report, another leads")
        self.url = url


class _PlacerMoved(_PlacerError):
    """The placer asked did not answer in time and another leads at a newer epoch: the link
    has moved to it (AgentLink._post_or_move)."""


class _Race:
    """A report to the placer ``used`` against probes of the others: how it ended."""

    __slots__ = ("used", "reply", "error", "moved_to")

    def __init__(self, used: str) -> None:
        self.used = used
        self.reply: ReportReply | None = None
        self.error: Exception | None = None
        self.moved_to: leaderprobe.Claim | None = None


class _RelayHolding(_PlacerError):
    """The relay answered ``upstream_down``: it has no connection to the placer (``dialling``:
    it is getting through -- never connected yet, or a dial in flight now)."""

    def __init__(self, msg: str, *, dialling: bool) -> None:
        super().__init__(msg)
        self.dialling = dialling


def wire_endpoint(wire_url: str, placer_url: str) -> str:
    """The framed channel's address as this agent must dial it: a placer listening on all
    addresses (0.0.0.0 / ::) announces that; the agent then uses the host it reached the
    placer's HTTP API on."""
    scheme = "tls" if wire_url.startswith("tls://") else "tcp"
    hostport = wire_url.removeprefix("tcp://").removeprefix("tls://")
    host, _, port = hostport.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        from urllib.parse import urlsplit
        phost = urlsplit(placer_url).hostname or "127.0.0.1"
        host = f"[{phost}]" if ":" in phost else phost
    return f"{scheme}://{host}:{port}"
