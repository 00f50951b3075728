"""Leader election among placers on etcd: etcd's election recipe, a pure core and a trio driver.

Theory of operation (etcd's ``concurrency.Election``): each candidate grants a lease (TTL a few
seconds) and creates ``<prefix><lease id>`` on it. Keys under the prefix are ordered by create
revision; the lowest leads. A candidate that does not lead watches only its predecessor (the key
created just before its own) and looks again when that key is deleted, so a leader's death wakes
one candidate, not all. A key goes when its lease is revoked (resign) or expires (its owner died,
paused or lost etcd): TTL after the last renewal at most.

Invariants:
- The **epoch** of a leader is its key's create revision. etcd revisions only grow, so every
  later leader has a greater epoch, and a key once deleted is never recreated with the same one.
- A leader believes it leads only until ``sent + TTL``, where ``sent`` is when it *sent* the last
  renewal etcd acknowledged: etcd started that TTL on receipt, later, so the candidate's belief
  ends before etcd's lease does (clocks advance at the same rate; no clock is compared across
  machines). Past that it places nothing until a renewal lands.
- The lease is renewed on an OS thread of its own (placer.renewal), not on the event loop: a
  loop busy past the TTL keeps its lease. :meth:`Election.leading` reads the renewal thread's
  known expiry against the monotonic clock at the moment it is asked, so a loop that was
  stalled past the expiry (the thread could not renew either) learns it on waking, before it
  acts; what it published before (:attr:`Election.view`) is only for status.
- Every etcd write of a leader compares its key's create revision with its epoch
  (``placer.etcdjournal``): a deposed leader, whatever it believes, writes nothing.

:class:`ElectionCore` decides (no I/O; ``now`` passed in); :class:`Election` carries it out.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import trio

from .errors import EtcdError, LeaseNotFound
from .etcd import Compare, EtcdClient, KeyValue, Op, prefix_end
from .renewal import LeaseExpiry, Renewer

log = logging.getLogger("herd.placer.election")

DEFAULT_TTL_S = 3
KEEPALIVES_PER_TTL = 3   # renew this often in a TTL: two renewals may be lost before it runs out


class Role(enum.Enum):
    IDLE = "idle"            # no lease (starting, or lost it)
    WAITING = "waiting"      # a key under the prefix, not the lowest
    LEADER = "leader"


class Leadership(msgspec.Struct, frozen=True):
    """What a candidate knows: its role, its epoch when it leads, and who leads (that
    leader's value, e.g. its URL, and epoch; empty/0 when unknown). ``fenced``: a leader
    whose lease went a whole TTL without a renewal etcd acknowledged (etcd has no quorum, or
    this placer cannot reach it): it acts on nothing until a renewal lands (it leads again,
    same epoch) or etcd says the lease is gone (the round ends)."""
    role: Role = Role.IDLE
    epoch: int = 0
    leader: str = ""
    leader_epoch: int = 0
    fenced: bool = False

    @property
    def leading(self) -> bool:
        return self.role is Role.LEADER and not self.fenced


class Turn(msgspec.Struct, frozen=True):
    """The ranking of the keys under the prefix, as this candidate sees it."""
    lost: bool                       # our key is gone: campaign again with a new lease
    predecessor: bytes = b""         # empty when we lead
    leader: KeyValue | None = None


class ElectionCore:
    """One candidate's election state, without I/O. ``now`` is the driver's clock (monotonic
    seconds). The lease's expiry is a :class:`~placer.renewal.LeaseExpiry`, which the renewal
    thread updates; everything else is the event loop's alone."""

    def __init__(self, ttl_s: int, value: bytes = b"") -> None:
        self.ttl_s = ttl_s
        self.value = value           # ours: what the others learn of us when we lead
        self.role = Role.IDLE
        self.lease_id = 0
        self.key = b""
        self.revision = 0            # our key's create revision: the epoch if we lead
        self.lease = LeaseExpiry()
        self.leader_value = b""
        self.leader_epoch = 0

    # lease
    def granted(self, lease_id: int, ttl: int, sent_at: float) -> None:
        self.lease_id, self.ttl_s = lease_id, ttl
        self.lease = LeaseExpiry(sent_at + ttl)

    def renewed(self, ttl: int, sent_at: float) -> bool:
        """A keepalive sent at ``sent_at`` came back with ``ttl`` (0: the lease is gone).
        False when the lease is lost."""
        if not self.lease.renewed(ttl, sent_at):
            self.lost()
            return False
        return True

    @property
    def valid_until(self) -> float:
        return self.lease.until

    def keepalive_every(self) -> float:
        return self.ttl_s / KEEPALIVES_PER_TTL

    def expired(self, now: float) -> bool:
        """No renewal landed for a whole TTL: etcd may have let the lease go."""
        return not self.lease.holds(now)

    # campaign
    def joined(self, key: bytes, revision: int) -> None:
        self.key, self.revision = key, revision
        self.role = Role.WAITING

    def rank(self, kvs: Sequence[KeyValue]) -> Turn:
        """Given the keys under the prefix: are we still in, who leads, whom do we wait for."""
        mine = [kv for kv in kvs if kv.key == self.key]
        if not mine:
            return Turn(lost=True)
        order = sorted(kvs, key=lambda kv: kv.create_revision)
        leader = order[0]
        self.leader_value, self.leader_epoch = leader.value, leader.create_revision
        before = [kv for kv in order if kv.create_revision < self.revision]
        return Turn(lost=False, predecessor=before[-1].key if before else b"", leader=leader)

    def predecessor_gone(self, turn: Turn) -> bool:
        """The key ``turn`` had us wait behind was deleted. True when it was the leader's: then
        no key older than ours is left (a key created later has a greater revision), so we are
        the lowest without reading the keys again -- and the leader the others learn of is us."""
        if turn.leader is None or not turn.predecessor or turn.predecessor != turn.leader.key:
            return False
        self.leader_value, self.leader_epoch = self.value, self.revision
        return True

    def lead(self, now: float) -> bool:
        """Our key is the lowest: lead, if the lease still holds."""
        if self.expired(now):
            return False
        self.role = Role.LEADER
        self.leader_epoch = self.revision
        return True

    def observed(self, leader: KeyValue | None) -> None:
        if self.role is not Role.LEADER:
            self.leader_value = leader.value if leader is not None else b""
            self.leader_epoch = leader.create_revision if leader is not None else 0

    def lost(self) -> None:
        self.role = Role.IDLE
        self.key, self.revision, self.lease_id = b"", 0, 0
        self.lease = LeaseExpiry()
        self.leader_value, self.leader_epoch = b"", 0

    def leading(self, now: float) -> bool:
        return self.role is Role.LEADER and not self.expired(now)

    def view(self, now: float) -> Leadership:
        role = self.role
        return Leadership(role, self.revision if role is Role.LEADER else 0,
                          self.leader_value.decode(errors="replace"), self.leader_epoch,
                          fenced=role is Role.LEADER and self.expired(now))


class Election:
    """Campaign for leadership under ``prefix`` with ``value`` (what followers learn of the
    leader: its URL). ``await nursery.start(election.run)`` campaigns until cancelled or
    :meth:`resign`; :attr:`view` is the current :class:`Leadership`, :meth:`wait_change` waits
    for the next one, :meth:`leading` says whether to act now. Times are ``clock``'s (monotonic
    seconds, read by the renewal thread too). :attr:`renewer` is the current lease's renewal
    thread (None between leases). ``on_step`` is told each step of a campaign as it happens:
    ``joined`` (our key is in, a new round), ``predecessor_gone`` (the key we waited behind was deleted: its lease expired or was
    revoked) and ``elected`` (our key is the lowest and our lease holds: we lead)."""

    def __init__(self, client: EtcdClient, prefix: bytes, value: str, *, ttl_s: int = DEFAULT_TTL_S,
                 retry_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_step: Callable[[str], None] = lambda step: None) -> None:
        self.client = client
        self.clock = clock
        self.on_step = on_step       # a campaign's steps as they happen (placer.ha's promotion timeline)
        self.renewer: Renewer | None = None
        self._renewal_errors = 0          # of the renewal threads of rounds that ended
        self._renewal_slowest_s = 0.0     # ... and the longest any went between two answers
        self._lease_news = trio.Event()   # set (from the renewal thread, via the loop) on each answer
        self.prefix = prefix
        self.value = value.encode()
        self.core = ElectionCore(ttl_s, self.value)
        self.retry_s = retry_s if retry_s is not None else ttl_s / KEEPALIVES_PER_TTL
        self.view = Leadership()
        self._changed = trio.Event()
        self._resigned = False
        self._round: trio.CancelScope | None = None
        self._why = ""
        self.promotions = 0
        self.losses = 0
        self.errors = 0
        self.failovers = 0           # the leader this candidate knows replaced by another
        self.fencings = 0            # times this leader went a TTL without a renewal (fenced)
        self._known_leader = 0       # the last leader epoch seen (0: none yet)

    # -------------------------------------------------------------- what others read

    @property
    def epoch(self) -> int:
        return self.view.epoch

    def leading(self) -> bool:
        """Whether to act as the leader now: the lease is known to hold at this very moment
        (the renewal thread's expiry against the clock now, however long the loop was away)."""
        return self.core.leading(self.clock())

    @property
    def leader_key(self) -> bytes:
        """The key whose create revision fences our writes (empty unless we lead)."""
        return self.core.key if self.core.role is Role.LEADER else b""

    async def wait_change(self, seen: Leadership) -> Leadership:
        while self.view == seen:
            await self._changed.wait()
        return self.view

    def holds(self) -> bool:
        """Still the leader's round: leading, or fenced while etcd does not answer."""
        return self.view.role is Role.LEADER

    async def wait_leading(self) -> Leadership:
        while not self.view.leading:
            await self._changed.wait()
        return self.view

    def statistics(self) -> dict[str, Any]:
        v = self.view
        return {"role": v.role.value, "epoch": v.epoch, "leader": v.leader, "leader_epoch": v.leader_epoch,
                "promotions": self.promotions, "losses": self.losses, "errors": self.errors,
                "failovers": self.failovers, "fencings": self.fencings,
                "renewal_errors": self.renewal_errors,
                "renewal_slowest_s": round(max(self._renewal_slowest_s,
                                               self.renewer.slowest_s if self.renewer is not None else 0.0), 3),
                "collector_longest_s": round(self.renewer.collector.longest_s, 3) if self.renewer is not None
                else None}

    @property
    def renewal_errors(self) -> int:
        """Lease renewals no etcd member answered (or etcd refused), every round's."""
        return self._renewal_errors + (self.renewer.errors if self.renewer is not None else 0)

    def _publish(self) -> None:
        v = self.core.view(self.clock())
        if v != self.view:
            if v.leading and not self.view.leading:
                self.promotions += 1
                log.info("leading epoch=%d", v.epoch)
            elif self.view.leading and not v.leading:
                self.losses += 1
                log.warning("no longer leading epoch=%d", self.view.epoch)
            if v.fenced and not self.view.fenced:
                self.fencings += 1
            if v.leader_epoch:
                if self._known_leader and v.leader_epoch != self._known_leader:
                    self.failovers += 1
                self._known_leader = v.leader_epoch
            self.view = v
            self._changed.set()
            self._changed = trio.Event()

    # -------------------------------------------------------------- driver

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign, lead or wait, and campaign again after losing the lease; until cancelled
        or resigned. ``started()`` once the first campaign is in: we wait in line (the view says
        who leads) or lead already."""
        ready = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(self._signal_started, ready, task_status)
            while not self._resigned:
                await self._one_round(ready)
                if self._why:
                    log.warning("election round ended: %s", self._why)
                if not self._resigned:
                    await trio.sleep(self.retry_s)
            n.cancel_scope.cancel()

    @staticmethod
    async def _signal_started(ready: trio.Event, task_status: Any) -> None:
        await ready.wait()
        task_status.started()

    async def resign(self) -> None:
        """Stop campaigning; our key and lease go at once, so the next candidate leads
        without waiting out the TTL."""
        self._resigned = True
        if self._round is not None:
            self._round.cancel()

    def _end_round(self, why: str) -> None:
        self._why = why
        if self._round is not None:
            self._round.cancel()

    async def _one_round(self, ready: trio.Event) -> None:
        """One lease: join, wait our turn, lead; until the lease is lost or we resign."""
        self._why = ""
        try:
            with trio.CancelScope() as scope:
                self._round = scope
                sent = self.clock()
                try:
                    lease = await self.client.grant(self.core.ttl_s)
                except EtcdError as e:
                    self.errors += 1
                    self._why = str(e)
                    return
                self.core.granted(lease.id, lease.ttl, sent)
                self.renewer = self._renewer(lease.id, self.core.lease)
                self.renewer.start()
                async with trio.open_nursery() as n:
                    n.start_soon(self._watch_lease)
                    n.start_soon(self._contend, ready)
        finally:
            self._round = None
            renewer, self.renewer = self.renewer, None
            if renewer is not None:
                renewer.stop()
                self._renewal_errors += renewer.errors
                self._renewal_slowest_s = max(self._renewal_slowest_s, renewer.slowest_s)
            lease_id = self.core.lease_id
            self.core.lost()
            self._publish()
            with trio.move_on_after(self.client.attempt_timeout_s) as cs:
                cs.shield = True
                if lease_id:
                    try:
                        await self.client.revoke(lease_id)   # our key goes now, not after a TTL
                    except EtcdError:
                        pass
                if renewer is not None:   # its last request ends within one attempt
                    await trio.to_thread.run_sync(renewer.join, abandon_on_cancel=True)

    def _renewer(self, lease_id: int, expiry: LeaseExpiry) -> Renewer:
        token = trio.lowlevel.current_trio_token()

        def wake() -> None:   # on the renewal thread: never blocks, whatever the loop is doing
            try:
                token.run_sync_soon(self._lease_answered)
            except trio.RunFinishedError:
                pass

        return Renewer(self.client.endpoints, lease_id, expiry, self.core.keepalive_every(),
                       ssl_context=self.client.ssl_context, attempt_timeout_s=self.client.attempt_timeout_s,
                       wake=wake, clock=self.clock)

    def _lease_answered(self) -> None:
        self._lease_news.set()

    async def _contend(self, ready: trio.Event) -> None:
        try:
            key = self.prefix + b"%016x" % self.core.lease_id
            # create our key once (a retried request finds it there and reads it back)
            r = await self.client.txn([Compare.created(key, 0)],
                                      [Op.put(key, self.value, lease=self.core.lease_id)], [Op.get(key)])
            self.core.joined(key, r.revision if r.succeeded else r.ranges[0][0].create_revision)
            self.on_step("joined")
            await self._rank()   # who leads, known before started()
            ready.set()
            await self._wait_turn()
            if not self.core.lead(self.clock()):
                self._end_round("the lease ran out before our turn came")
                return
            self.on_step("elected")
            self._publish()
            while True:   # keep the leader's identity fresh for followers' status; check our key
                await trio.sleep(self.core.keepalive_every())
                try:
                    await self._rank()
                except LeaseNotFound:
                    raise      # our key is gone: the round ends
                except EtcdError as e:
                    self.errors += 1
                    log.warning("election: cannot read the candidates: %s", e)
        except EtcdError as e:
            self.errors += not isinstance(e, LeaseNotFound)
            self._end_round(str(e))

    async def _rank(self) -> tuple[Turn, int]:
        r = await self.client.range(self.prefix, prefix_end(self.prefix))
        turn = self.core.rank(r.kvs)
        if turn.lost:
            raise LeaseNotFound("our election key is gone (its lease expired or was revoked)")
        self._publish()
        return turn, r.revision

    async def _wait_turn(self) -> None:
        """Until no key under the prefix is older than ours: watch the predecessor's deletion,
        and look again every TTL/3 (who leads may change ahead of the predecessor). The
        leader's key deleted while it was our predecessor: we lead at once, without reading
        the keys again (ElectionCore.predecessor_gone). etcd not answering costs nothing
        here: the lease decides (the keepalive ends the round)."""
        waited = False   # behind a predecessor at least once (else we led from the start)
        while True:
            try:
                turn, rev = await self._rank()
                if not turn.predecessor:
                    if waited:
                        self.on_step("predecessor_gone")
                    return
                waited = True
                with trio.move_on_after(self.core.keepalive_every()):
                    async with self.client.watch(turn.predecessor, start_revision=rev + 1) as batches:
                        async for b in batches:
                            if any(e.type == "DELETE" for e in b.events):
                                self.on_step("predecessor_gone")
                                if self.core.predecessor_gone(turn):
                                    return
                                break
            except LeaseNotFound:
                raise      # our key is gone: the round ends
            except EtcdError as e:
                self.errors += 1
                log.warning("election: waiting for our turn: %s", e)
                await trio.sleep(self.retry_s)

    async def _watch_lease(self) -> None:
        """What the renewal thread learns, told to the loop (it renews; this only publishes).
        etcd says the lease is gone: the round ends. None renewed for a whole TTL: a candidate
        that was waiting its turn ends the round (it campaigns again); a leader is fenced (it
        acts on nothing) while the thread keeps asking: etcd keeps a lease while it has no
        quorum (its leader renews every lease on election), so when the cluster answers again
        the lease either holds (the same epoch leads again: no other could have been elected
        meanwhile) or is gone (the round ends)."""
        every = self.core.keepalive_every()
        fenced = False
        while True:
            self._lease_news = trio.Event()
            lease = self.core.lease
            if lease.is_gone:
                self._end_round("the lease expired or was revoked")
                return
            now = self.clock()
            if self.core.expired(now):
                if self.core.role is not Role.LEADER:
                    self._end_round(f"lease not renewed for {self.core.ttl_s}s; campaigning again")
                    return
                if not fenced:
                    log.warning("lease not renewed for %ds: fenced, placing nothing until etcd answers",
                                self.core.ttl_s)
                fenced = True
                wait = every
            else:
                fenced = False
                wait = min(every, lease.until - now)
            self._publish()
            with trio.move_on_after(max(0.01, wait)):
                await self._lease_news.wait()
