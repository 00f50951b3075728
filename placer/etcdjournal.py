"""The placer's jobs journal in etcd, fenced by the leader's epoch: the HA form of placer.journal.

What it holds is what the file journal holds: jobs (spec, which carries the priority and the
restart policy; the attempt and restart counters) and operators' cordons (a drain is a cordon
with its reason); never allocations, never heartbeats (soft state: the agents' reports rebuild
it). One key per job, ``<prefix>jobs/<job id>``, and per cordoned node,
``<prefix>cordons/<node id>``, each a versioned JSON value; a job that ends, or a node
uncordoned, is deleted. Jobs come back in submission order (their keys' create revisions).
An ended job's attempt counter stays, as the file journal's does (placer.journal,
``KEEP_ENDED_ATTEMPTS`` of the most recently ended, ``<prefix>ended/<job id>``): a job submitted
again under its id continues it, so its workload ids never name an earlier incarnation's.

Writes are queued in memory (the last write of a key wins: a job submitted then ended in one
batch is one delete) and committed by :meth:`EtcdJournal.flush` (group commit: concurrent
callers share the transactions) or by the writer task :meth:`EtcdJournal.run`. Every
transaction compares the leader key's create revision with the epoch this journal was opened
with (:class:`Fence`): once that key is gone (the lease expired or was revoked: another placer
leads or will), etcd refuses the whole transaction, nothing of it lands, and the journal says
:class:`~placer.errors.Deposed` from then on. A batch is split into transactions under etcd's
request limits (1.5 MiB and 128 operations by default; ``max_txn_bytes`` leaves a margin); a
caller of :meth:`flush` returns only once every transaction holding its writes committed, so
a submission is acknowledged after its transaction, as the file journal acknowledges after its
fsync. Keys are independent, so a batch split across transactions needs no atomicity between
them; a transaction that failed is queued again unless a newer write of its key came since.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from scheduler_link.messages import JobSpec

from .errors import Deposed, EtcdError, JournalError
from .etcd import TXN_OPS_LIMIT, Compare, EtcdClient, KeyValue, Op, prefix_end
from .journal import keep_ended

if TYPE_CHECKING:
    from .journal import Journal

log = logging.getLogger("herd.placer.etcdjournal")

JOURNAL_VERSION = 1
MAX_TXN_BYTES = 1280 * 1024   # etcd refuses requests over 1.5 MiB (--max-request-bytes); a margin kept
LOAD_PAGE = 1000              # keys per range when loading
RETRY_S = 0.5                 # the writer's pause after a failed commit


class JobJournal(Protocol):
    """What the placer service uses of a journal: placer.journal.Journal (one placer, a file)
    and EtcdJournal (placers in HA) both are one."""
    attempts: dict[str, int]
    cordons: dict[str, str]

    def jobs(self) -> list[JobSpec]: ...
    def submitted(self, spec: JobSpec, at: float, *, sync: bool = True) -> int: ...
    async def flush(self) -> None: ...
    def attempt(self, job_id: str, attempt: int, at: float) -> None: ...
    def cordon(self, node_id: str, on: bool, at: float, reason: str = "") -> None: ...
    def ended(self, job_id: str, state: str, at: float) -> None: ...
    def ended_many(self, ends: list[tuple[str, str, float]]) -> None: ...
    def close(self) -> None: ...


class JobEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = JOURNAL_VERSION
    spec: JobSpec
    at: float = 0.0          # when it was submitted (or its spec last replaced)
    attempt: int = 0
    restarts: int = 0


class EndedEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """An ended job's last attempt (``<prefix>ended/<job id>``)."""
    v: int = JOURNAL_VERSION
    attempt: int = 0
    at: float = 0.0


class CordonEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = JOURNAL_VERSION
    reason: str = ""
    at: float = 0.0


class Fence(msgspec.Struct, frozen=True):
    """The leader key and its create revision (the epoch): every write compares them."""
    key: bytes
    epoch: int


_job_dec = msgspec.json.Decoder(JobEntry)
_cordon_dec = msgspec.json.Decoder(CordonEntry)
_ended_dec = msgspec.json.Decoder(EndedEntry)


def plan_txns(writes: Iterable[tuple[bytes, bytes | None]], *, max_bytes: int = MAX_TXN_BYTES,
              max_ops: int = TXN_OPS_LIMIT) -> list[list[Op]]:
    """Split writes (a value, or None: delete) into transactions of at most ``max_ops``
    operations and ``max_bytes`` (the fence's compare included). A write larger than a
    transaction alone is an error: etcd would refuse it whole."""
    txns: list[list[Op]] = []
    cur: list[Op] = []
    size = 0
    for key, value in writes:
        op = Op.delete(key) if value is None else Op.put(key, value)
        n = op.size()
        if n > max_bytes:
            raise JournalError(f"a journal record of {n} bytes ({key.decode(errors='replace')[:80]}) is over "
                               f"etcd's request limit ({max_bytes} bytes here)")
        if cur and (size + n > max_bytes or len(cur) >= max_ops):
            txns.append(cur)
            cur, size = [], 0
        cur.append(op)
        size += n
    if cur:
        txns.append(cur)
    return txns


class EtcdJournal:
    """Open with :meth:`load` once this placer leads (``fence``: its leader key and epoch)."""

    def __init__(self, client: EtcdClient, prefix: bytes, fence: Fence, *,
                 max_txn_bytes: int = MAX_TXN_BYTES, max_txn_ops: int = TXN_OPS_LIMIT) -> None:
        self.client = client
        self.prefix = prefix
        self.fence = fence
        self.max_txn_bytes = max_txn_bytes - (len(fence.key) + 48)   # the compare rides along
        self.max_txn_ops = max_txn_ops
        self._live: dict[str, JobEntry] = {}
        self.attempts: dict[str, int] = {}
        self.restarts: dict[str, int] = {}
        self.ended_attempts: OrderedDict[str, int] = OrderedDict()   # ended jobs' last attempts, the newest last
        self.cordons: dict[str, str] = {}     # node id -> reason, for the nodes cordoned now
        self._pending: dict[bytes, bytes | None] = {}
        self._lock = trio.Lock()
        self._dirty = trio.Event()
        self.deposed = False
        self.appends = 0     # writes queued
        self.synced = 0      # writes known committed
        self.txns = 0
        self.txn_bytes_max = 0
        self.loaded_revision = 0

    # -------------------------------------------------------------- load

    @classmethod
    async def load(cls, client: EtcdClient, prefix: bytes, fence: Fence, **kw: Any) -> EtcdJournal:
        """Read every job and cordon under ``prefix`` (one snapshot, paged)."""
        j = cls(client, prefix, fence, **kw)
        try:
            jobs, rev = await _read_all(client, prefix + b"jobs/", 0)
            cordons, _ = await _read_all(client, prefix + b"cordons/", rev)
            ended, _ = await _read_all(client, prefix + b"ended/", rev)
        except EtcdError as e:
            raise JournalError(f"cannot load the journal from etcd: {e}") from None
        j.loaded_revision = rev
        for kv in sorted(jobs, key=lambda kv: kv.create_revision):   # submission order
            ent = _decode(_job_dec, kv)
            j._live[ent.spec.job_id] = ent
            if ent.attempt:
                j.attempts[ent.spec.job_id] = ent.attempt
            if ent.restarts:
                j.restarts[ent.spec.job_id] = ent.restarts
        for kv in cordons:
            j.cordons[kv.key[len(prefix) + len(b"cordons/"):].decode()] = _decode(_cordon_dec, kv).reason
        for kv in sorted(ended, key=lambda kv: kv.mod_revision):   # the order they ended in
            jid = kv.key[len(prefix) + len(b"ended/"):].decode()
            if jid not in j._live:
                for gone in keep_ended(j.ended_attempts, jid, _decode(_ended_dec, kv).attempt):
                    j._queue(j._ended_key(gone), None)
        log.info("journal loaded from etcd jobs=%d cordons=%d revision=%d epoch=%d",
                 len(j._live), len(j.cordons), rev, fence.epoch)
        return j

    # -------------------------------------------------------------- reads

    def jobs(self) -> list[JobSpec]:
        return [e.spec for e in self._live.values()]

    def statistics(self) -> dict[str, int | bool]:
        return {"appends": self.appends, "synced": self.synced, "pending": len(self._pending),
                "txns": self.txns, "txn_bytes_max": self.txn_bytes_max, "deposed": self.deposed,
                "epoch": self.fence.epoch}

    # -------------------------------------------------------------- writes (queued)

    def _queue(self, key: bytes, value: bytes | None) -> None:
        self._pending[key] = value
        self.appends += 1
        self._dirty.set()

    def _job_key(self, job_id: str) -> bytes:
        return self.prefix + b"jobs/" + job_id.encode()

    def _ended_key(self, job_id: str) -> bytes:
        return self.prefix + b"ended/" + job_id.encode()

    def _put_job(self, ent: JobEntry) -> None:
        data = msgspec.json.encode(ent)
        key = self._job_key(ent.spec.job_id)
        plan_txns([(key, data)], max_bytes=self.max_txn_bytes)   # too large alone: refused now
        self._live[ent.spec.job_id] = ent
        self._queue(key, data)

    def submitted(self, spec: JobSpec, at: float, *, sync: bool = True) -> int:
        """Queue a submission (or a replaced spec); :meth:`flush` returns once it committed.
        (``sync`` is the file journal's; here every write waits for a flush or the writer.)
        Returns the attempts its id used before (placer.journal.Journal.submitted)."""
        old = self._live.get(spec.job_id)
        before = old.attempt if old else self.ended_attempts.get(spec.job_id, 0)
        self._put_job(JobEntry(spec=spec, at=at, attempt=before, restarts=old.restarts if old else 0))
        if self.ended_attempts.pop(spec.job_id, None) is not None:
            self._queue(self._ended_key(spec.job_id), None)
        if before:
            self.attempts[spec.job_id] = before
        return before

    def attempt(self, job_id: str, attempt: int, at: float, *, restarts: int | None = None) -> None:
        """Record a job's attempt (and restart) counters."""
        old = self._live.get(job_id)
        if old is None or (attempt <= old.attempt and (restarts is None or restarts == old.restarts)):
            return
        ent = msgspec.structs.replace(old, attempt=max(attempt, old.attempt),
                                      restarts=old.restarts if restarts is None else restarts)
        self._put_job(ent)
        self.attempts[job_id] = ent.attempt
        if ent.restarts:
            self.restarts[job_id] = ent.restarts

    def cordon(self, node_id: str, on: bool, at: float, reason: str = "") -> None:
        """Record a cordon (``on``) or an uncordon."""
        key = self.prefix + b"cordons/" + node_id.encode()
        if on:
            self._queue(key, msgspec.json.encode(CordonEntry(reason=reason, at=at)))
            self.cordons[node_id] = reason
        else:
            self._queue(key, None)
            self.cordons.pop(node_id, None)

    def ended(self, job_id: str, state: str, at: float) -> None:
        self.ended_many([(job_id, state, at)])

    def ended_many(self, ends: list[tuple[str, str, float]]) -> None:
        for job_id, _state, at in ends:
            if (old := self._live.pop(job_id, None)) is not None:
                self.attempts.pop(job_id, None)
                self.restarts.pop(job_id, None)
                self._queue(self._job_key(job_id), None)
                if old.attempt:   # (never placed: no id of it was used)
                    self._queue(self._ended_key(job_id), msgspec.json.encode(EndedEntry(attempt=old.attempt, at=at)))
                    for gone in keep_ended(self.ended_attempts, job_id, old.attempt):
                        self._queue(self._ended_key(gone), None)

    def close(self) -> None:
        """Nothing to release (the client belongs to the caller); unflushed writes are dropped."""
        if self._pending:
            log.warning("journal closed with %d writes not committed", len(self._pending))

    # -------------------------------------------------------------- commit

    async def flush(self) -> None:
        """Group commit: return once every write queued before the call committed.
        :class:`Deposed` when etcd refused it for the fence; :class:`JournalError` when etcd
        did not answer (the writes stay queued for the next flush)."""
        target = self.appends
        async with self._lock:
            if self.synced >= target:
                return   # a flush that started after our write covered it
            if self.deposed:
                raise self._deposed()
            upto = self.appends
            batch, self._pending = self._pending, {}
            txns = plan_txns(batch.items(), max_bytes=self.max_txn_bytes, max_ops=self.max_txn_ops)
            done = 0
            try:
                for ops in txns:
                    r = await self.client.txn([Compare.created(self.fence.key, self.fence.epoch)], ops)
                    if not r.succeeded:
                        self.deposed = True
                        raise self._deposed()
                    done += 1
                    self.txns += 1
                    self.txn_bytes_max = max(self.txn_bytes_max, sum(op.size() for op in ops))
            except EtcdError as e:
                raise JournalError(f"journal write to etcd failed: {e}") from None
            finally:
                if done < len(txns):   # what did not land goes back, unless written again since
                    for ops in txns[done:]:
                        for op in ops:
                            key, value = _write_of(op)
                            self._pending.setdefault(key, value)
            self.synced = max(self.synced, upto)

    def _deposed(self) -> Deposed:
        return Deposed(f"this placer no longer leads (epoch {self.fence.epoch}): etcd refused its journal write")

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: commit queued writes soon after they are made (attempts, ends and
        cordons need no caller to flush). Ends when deposed."""
        task_status.started()
        while not self.deposed:
            await self._dirty.wait()
            self._dirty = trio.Event()
            try:
                await self.flush()
            except Deposed as e:
                log.error("%s", e)
                return
            except JournalError as e:
                log.warning("%s; retrying", e)
                self._dirty.set()
                await trio.sleep(RETRY_S)


def _write_of(op: Op) -> tuple[bytes, bytes | None]:
    if op.request_put is not None:
        return op.request_put.key, op.request_put.value
    assert op.request_delete_range is not None
    return op.request_delete_range.key, None


async def _read_all(client: EtcdClient, prefix: bytes, revision: int) -> tuple[list[KeyValue], int]:
    """Every key under ``prefix`` at one revision (``revision`` or the current one), paged."""
    end = prefix_end(prefix)
    out: list[KeyValue] = []
    start = prefix
    while True:
        r = await client.range(start, end, limit=LOAD_PAGE, revision=revision)
        revision = revision or r.revision
        out += r.kvs
        if not r.more or not r.kvs:
            return out, revision
        start = r.kvs[-1].key + b"\0"


def _decode(dec: msgspec.json.Decoder[Any], kv: KeyValue) -> Any:
    try:
        ent = dec.decode(kv.value)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise JournalError(f"journal record {kv.key.decode(errors='replace')!r} in etcd is corrupt: {e}") from None
    if ent.v != JOURNAL_VERSION:
        raise JournalError(f"journal record {kv.key.decode(errors='replace')!r}: unknown version {ent.v}")
    return ent


if TYPE_CHECKING:   # both journals are a JobJournal (mypy checks it)
    def _conforms(file: Journal, etcd: EtcdJournal) -> tuple[JobJournal, JobJournal]:
        return file, etcd
