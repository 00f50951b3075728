"""Several placers, one leading: the placer service's side of etcd (``[placer] etcd = [...]``).

Every placer serves its API and campaigns (placer.election). The leader loads the jobs journal
from etcd (placer.etcdjournal, fenced by its epoch) and, beside it, the last leader's fleet
snapshot (whom it waits for: placer.fleetsnap), recovers its jobs as a restarted placer does,
and places; the others place nothing and answer the routes of :data:`LOCAL_ROUTES`
themselves (health with who leads, status, metrics, certificate bootstrap), redirecting every
other request to the leader (307 with its URL and the follower's own framed channel; 503 while
none is known). What reaches a follower's framed channel -- the copies of reports and rack beats
the fleet sends every placer it knows -- goes into its warm model (placer.observe), which a
promoted follower places from without waiting for the fleet to register again. A leader that loses
its lease (etcd says so: it was paused or cut off past its TTL and another may lead) drops
everything it knew and serves again on the same address as a follower with a fresh state
(:func:`run_rejoining`; :class:`~placer.errors.LeadershipLost` ends the old service), and
meanwhile etcd refuses any journal write it still attempts (each compares its epoch).

Quorum loss: a leader whose lease goes a TTL without a renewal etcd acknowledged (no quorum,
or etcd out of its reach) is *fenced*: it places, pushes and journals nothing, answers reports
and writes 503 (``Retry-After``), and says so in ``/healthz``, ``/v1/status`` (``role:
fenced`` with ``why``) and ``/metrics`` (``herd_placer_leader`` 0, ``herd_placer_fenced`` 1).
It stops nothing: the agents keep their workloads running. When etcd answers again its lease
either still holds (etcd keeps leases while it has no quorum) and it places again, the same
epoch, within a keepalive interval, or is gone and it rejoins as a follower.

One identity for all: the MAC master secret (nodes' MAC keys derive from it) and the bundle
signing key live in etcd under ``<prefix>keys``, so that what one leader handed the nodes
verifies at the next. The first placer to start stores its own (from its state dir) with a
create-if-absent transaction; every other, and every later start, loads those. A placer
campaigns only once it holds them. etcd then holds secrets: reach it over TLS with client
certificates (docs/operations.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

import msgspec
import trio

from infra.http import Handler, Request, Response
from scheduler_link import msgauth

from .config import PlacerConfig
from .election import Election, Role
from .errors import EtcdError, JournalError, LeadershipLost
from .etcd import Compare, EtcdClient, Op, tls_context
from .etcdjournal import EtcdJournal, Fence
from .fleetsnap import EtcdFleetSnapshot, FleetSnapshot
from .state import PlacerState

log = logging.getLogger("herd.placer.ha")

# what a follower answers itself; everything else goes to the leader
LOCAL_ROUTES = frozenset({("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                          ("GET", "/v1/status"), ("POST", "/v1/pki/bootstrap"), ("POST", "/v1/pki/renew")})


class _LeaderValue(msgspec.Struct, frozen=True):
    url: str
    wire: str | None = None


_leader_dec = msgspec.json.Decoder(_LeaderValue)


def leader_of(value: str) -> tuple[str, str]:
    """(URL, framed channel) of the leader's election value: a JSON ``{"url", "wire"}``, or a
    plain URL (empty when none)."""
    if value.startswith("{"):
        try:
            v = _leader_dec.decode(value)
            return v.url, v.wire or ""
        except (msgspec.DecodeError, msgspec.ValidationError):
            return "", ""
    return value, ""


class PromotionTimeline:
    """When each step of this placer's latest campaign happened, in unix seconds (so that
    ``bench.failover`` measures each from the moment it killed the leader, on the same machine):
    ``joined`` (a new round: the earlier steps are forgotten), ``predecessor_gone`` (the key it
    waited behind was deleted: the old leader's lease expired), ``elected``, ``journal_read``
    (the jobs journal loaded from etcd), ``model_adopted`` (its warm model's workloads handed to
    their jobs: placer.observe), ``placing`` (recovery over: it places) and ``first_decision``.
    Each step is logged once as it happens; once it places, one line names them all."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.at: dict[str, float] = {}

    def mark(self, step: str) -> None:
        if step == "joined":
            self.at = {}
        elif step in self.at or (step in ("placing", "first_decision") and "elected" not in self.at):
            return
        t = self.at[step] = self.wall()
        gone = self.at.get("predecessor_gone")
        log.info("campaign step=%s%s", step, f" after_predecessor_gone={t - gone:.3f}s" if gone is not None else "")
        if step == "placing" and gone is not None:
            log.warning("promoted: %s", " ".join(f"{k}=+{v - gone:.3f}s" for k, v in self.at.items()
                                                 if k not in ("joined", "predecessor_gone")))

    def statistics(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.at.items()}


class HighAvailability:
    """``await nursery.start(ha.run, url, on_promoted)`` once the API listens."""

    def __init__(self, cfg: PlacerConfig) -> None:
        self.cfg = cfg
        # one try of one member well inside a TTL, so that a hung member leaves time for the next
        self.client = EtcdClient(cfg.etcd, ssl_context=tls_context(cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key),
                                 attempt_timeout_s=max(1.0, cfg.etcd_lease_ttl_s / 2))
        self.prefix = cfg.etcd_prefix.encode()
        self.election: Election | None = None
        self.journal: EtcdJournal | None = None
        self.url = ""
        self.wire_url = ""   # this placer's own framed channel (where nodes and relays send it copies)
        self.keys_loaded = False   # the cluster's MAC master and signing key are this placer's now
        self._fencings = 0   # fencings of our lease answered (on_resumed ran): none pending, we may place
        self.promotion = PromotionTimeline()
        # the last leader's fleet snapshot, read beside the journal on promotion (_read_fleet)
        self.fleet: FleetSnapshot | None = None
        self.fleet_read = False

    def leading(self) -> bool:
        """Place now: we lead, our lease holds, and our journal is loaded."""
        e = self.election
        return self.journal is not None and e is not None and e.leading() and e.fencings == self._fencings

    def observing(self) -> bool:
        """Apply what the fleet sends to a warm model and act on nothing (placer.observe): a
        follower or candidate, or a leader still loading the journal, holding the cluster's keys
        (relayed reports verify with them). A leader whose lease is in doubt (fenced, or stalled
        past it) hears nothing: it answers 503 (see the module docstring)."""
        e = self.election
        if not self.keys_loaded or e is None or e.view.fenced:
            return False
        return e.view.role is not Role.LEADER or (self.journal is None and not self.leading())

    def epoch(self) -> int:
        """Our epoch (our leader key's create revision) while we lead (fenced too: what we still
        send is of that epoch), else 0: a follower or a candidate has no epoch of its own and
        sends nothing that acts."""
        e = self.election
        return e.view.epoch if e is not None else 0

    def why_not_placing(self) -> str:
        v = self.election.view if self.election is not None else None
        if v is not None and v.fenced:
            return (f"this placer leads (epoch {v.epoch}) but has not renewed its etcd lease for a TTL "
                    "(no etcd quorum, or etcd out of reach): placing nothing until etcd answers")
        if not self.client.reachable:
            return "etcd does not answer (no quorum?): no leader can be elected until it does"
        if v is None or v.role is Role.IDLE:
            return "the placers are electing a leader; try again shortly"
        if v.role is Role.WAITING:
            return f"this placer follows {leader_of(v.leader)[0] or 'a leader it has not named yet'}"
        return "this placer leads but is loading the jobs journal; try again shortly"

    def health(self) -> dict[str, Any]:
        """Who leads and this placer's role, for /healthz, /v1/status, /metrics and
        ``herd placer status``: ``placing`` is whether it places now."""
        e = self.election
        if e is None:
            return {"role": "starting", "leader": None, "epoch": 0, "placing": False, "url": self.url,
                    "failovers": 0, "etcd_errors": self.client.errors}
        v = e.view
        role = ("follower" if v.role is Role.WAITING else "candidate" if v.role is Role.IDLE
                else "fenced" if v.fenced else "leader" if self.leading() else "promoting")   # promoting: loading the journal
        placing = self.leading()
        leader, wire = leader_of(v.leader)
        return {"role": role, "leader": leader or None, "leader_wire": wire or None, "epoch": v.leader_epoch,
                "placing": placing, "observing": self.observing(), "wire": self.wire_url or None,
                "fenced": v.fenced, "etcd_reachable": self.client.reachable, "url": self.url,
                **({} if placing else {"why": self.why_not_placing()}),
                "failovers": e.failovers, "etcd_errors": self.client.errors + e.renewal_errors,
                "etcd": self.client.statistics(), "election": e.statistics(),
                "promotion": self.promotion.statistics()}

    async def run(self, url: str, on_promoted: Callable[[EtcdJournal], None],
                  on_resumed: Callable[[], None] = lambda: None, wire_url: str | None = None, *,
                  keys: tuple[bytes, msgauth.BundleSigner] | None = None,
                  on_keys: Callable[[bytes, msgauth.BundleSigner], None] = lambda m, s: None,
                  task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign; on promotion load the journal, hand it to ``on_promoted`` and keep it
        written; raise :class:`LeadershipLost` when the lease goes. ``started()`` at once: the
        placer serves (as a candidate) while etcd is out of reach. A leader fenced (no renewal
        for a TTL) and then renewed calls ``on_resumed`` before it places again (the nodes'
        silence meanwhile was the placer's deafness: see :func:`forgive_silence`). ``keys``: this
        placer's own MAC master and signing key; before campaigning, the cluster's (these, if
        none were stored yet) are handed to ``on_keys`` (:meth:`shared_keys`)."""
        self.url = self.cfg.etcd_advertise or url
        self.wire_url = wire_url or ""
        # what followers learn of the leader: its URL, and its framed channel (agents that move to
        # it register over that at once, as they do with a placer restarted on its address)
        value = msgspec.json.encode(_LeaderValue(self.url, wire_url)).decode() if wire_url else self.url
        self.election = Election(self.client, self.prefix + b"election/", value,
                                 ttl_s=self.cfg.etcd_lease_ttl_s, on_step=self.promotion.mark)
        try:
            async with trio.open_nursery() as n:
                task_status.started()
                if keys is not None:
                    on_keys(*await self.shared_keys(keys))
                self.keys_loaded = True
                n.start_soon(self.election.run)
                log.info("campaigning url=%s etcd=%s", self.url, ",".join(self.cfg.etcd))
                view = await self.election.wait_leading()
                fence = Fence(self.election.leader_key, view.epoch)
                async with trio.open_nursery() as reads:   # (the fleet snapshot beside the journal)
                    reads.start_soon(self._read_fleet, fence)
                    journal = await EtcdJournal.load(self.client, self.prefix, fence)
                self.promotion.mark("journal_read")
                # taken before the writer starts (what it queues waits for it), with no checkpoint
                # between the reads and the model: a loaded loop's turn costs tenths of a second
                self.journal = journal
                on_promoted(journal)
                self.promotion.mark("model_adopted")
                n.start_soon(journal.run)
                log.info("leading epoch=%d jobs=%d", view.epoch, len(journal.jobs()))
                self._fencings = self.election.fencings
                while self.election.holds():   # leading, or fenced while etcd does not answer
                    seen = await self.election.wait_change(self.election.view)
                    if not seen.fenced and seen.leading and self.election.fencings != self._fencings:
                        on_resumed()
                        self._fencings = self.election.fencings
                        log.info("etcd answers again: leading epoch=%d", seen.epoch)
                raise LeadershipLost(f"placer {self.url} lost the leadership (epoch {view.epoch}); "
                                     "serving again as a follower with a fresh state")
        finally:
            await self.client.aclose()

    async def _read_fleet(self, fence: Fence) -> None:
        """The last leader's fleet snapshot (whom a promoted placer waits for: placer.fleetsnap),
        into :attr:`fleet` with :attr:`fleet_read` set; left unset when etcd did not answer (the
        service reads it again)."""
        try:
            self.fleet = await EtcdFleetSnapshot(self.client, self.prefix, fence).load()
            self.fleet_read = True
        except (EtcdError, JournalError) as e:
            log.warning("fleet snapshot not read from etcd beside the journal: %s", e)

    async def shared_keys(self, own: tuple[bytes, msgauth.BundleSigner]) -> tuple[bytes, msgauth.BundleSigner]:
        """The cluster's MAC master and signing key from etcd; ``own`` stored there first when
        none are (one transaction: create if absent, else read), so that every placer holds the
        same. Asked again every retry interval until etcd answers."""
        key = self.prefix + b"keys"
        value = msgauth.encode_placer_keys(*own)
        retry_s = max(0.2, self.cfg.etcd_lease_ttl_s / 3)
        while True:
            try:
                r = await self.client.txn([Compare.created(key, 0)], [Op.put(key, value)], [Op.get(key)])
            except EtcdError as e:
                log.warning("cannot read the placers' keys from etcd (retrying in %.1fs): %s", retry_s, e)
                await trio.sleep(retry_s)
                continue
            if r.succeeded or (r.ranges and r.ranges[0] and r.ranges[0][0].value == value):
                log.info("the placers' MAC master and signing key are this placer's (stored in etcd)")
                return own
            stored = r.ranges[0][0].value if r.ranges and r.ranges[0] else b""
            master, signer = msgauth.decode_placer_keys(stored, f"etcd key {key.decode()}")
            log.info("the placers' MAC master and signing key loaded from etcd")
            return master, signer

    def guard(self, handlers: Mapping[tuple[str, str], Handler]) -> dict[tuple[str, str], Handler]:
        """The handlers, each but :data:`LOCAL_ROUTES`'s answering only while we lead."""
        return {k: h if k in LOCAL_ROUTES else self._leader_only(h) for k, h in handlers.items()}

    def _leader_only(self, handler: Handler) -> Handler:
        async def h(req: Request) -> Response:
            if self.leading():
                return await handler(req)
            leader, wire = leader_of(self.election.view.leader if self.election is not None else "")
            if not leader or leader == self.url:   # Retry-After: clients ask again (scheduler_link.placers)
                return Response(status=503, headers=[("retry-after", "1")], body=msgspec.json.encode(
                    {"error": "no leader", "detail": self.why_not_placing(), "leader": None}))
            where = leader.rstrip("/") + req.path + (f"?{urlencode(req.query)}" if req.query else "")
            return Response(status=307, body=msgspec.json.encode({"error": "not the leader", "leader": leader,
                                                                  "leader_wire": wire or None,
                                                                  "wire": self.wire_url or None}),
                            headers=[("location", where)])
        return h


async def run_rejoining(config: PlacerConfig, make: Callable[[PlacerConfig], Any]) -> None:
    """Run ``make(config)``'s service (a :class:`placer.service.PlacerService`) until
    cancelled; each time it loses the leadership, a fresh one on the same addresses (the
    port it bound, the URL other placers redirect to), as a follower: nothing of the old
    model, queue or pushes survives into it."""
    while True:
        svc = make(config)
        try:
            async with trio.open_nursery() as n:
                await n.start(svc.run)
        except BaseExceptionGroup as eg:
            lost, rest = eg.split(LeadershipLost)
            if lost is None or rest is not None:
                raise
            log.warning("%s", _first(lost))
        else:
            return
        config = msgspec.structs.replace(config, listen=_bound(config.listen, svc.url),
                                          wire_listen=_bound(config.wire_listen, svc.wire_url),
                                          etcd_advertise=config.etcd_advertise or (svc.ha.url if svc.ha else None))
        log.warning("serving again as a follower listen=%s", config.listen)


def _first(eg: BaseException) -> BaseException:
    while isinstance(eg, BaseExceptionGroup):
        eg = eg.exceptions[0]
    return eg


def _bound(listen: str | None, url: str | None) -> str | None:
    """``listen`` with the port the service bound (``127.0.0.1:0`` -> ``127.0.0.1:41234``)."""
    if listen is None or not url:
        return listen
    host = listen.rpartition(":")[0]
    return f"{host}:{url.rstrip('/').rpartition(':')[2]}"


def forgive_silence(state: PlacerState, now: float, recover_s: float) -> None:
    """A leader that was fenced heard no report meanwhile (it answered them 503): its nodes
    count as heard now, and it waits ``recover_s`` for their reports before placing, as a
    restarted placer does; nothing is declared lost or fenced for the placer's own deafness."""
    for nid, node in state.nodes.items():
        if node.state == "up":
            node.last_seen = max(node.last_seen, now)
            state.lost_timer.set(nid, now + state.cfg.lost_after_s)
    state.recover_until = max(state.recover_until, now + recover_s)
