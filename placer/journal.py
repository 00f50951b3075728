"""The placer's job journal: an append-only, synced file of job submissions and ends.

It holds jobs (spec, priority, restart policy), never allocations: after a restart
the allocations come back only from the agents' reports (see ``placer.state``).

Format: one JSON object per line, ``{"v": 1, "op": "submit", "at": T, "spec": {...}}``
or ``{"v": 1, "op": "end", "at": T, "job_id": ..., "state": ...}`` (appended without fsync
of its own and made durable by the next :meth:`Journal.flush`, which the placer starts at
once, off its event loop), or
``{"v": 1, "op": "cordon", "node_id": ..., "on": true, "reason": ...}`` (an operator's
cordon or uncordon, synced; the last one per node wins), or
``{"v": 1, "op": "attempt", "job_id": ..., "attempt": N}`` — the attempt counter only
(never where it runs), appended without fsync of its own (the placer flushes the journal
before an attempt's placements leave): after a crash it keeps a re-placed job from reusing
the workload ids of an attempt that may still be running somewhere. A submission stands for
its first attempt too (:data:`FIRST_ATTEMPT`): replayed, a live job's attempt counter is at
least 1, so attempt 1 needs no record of its own and a job's first placement leaves after
one fsync, its submission's.

Attempt counters outlive a job's end (:data:`KEEP_ENDED_ATTEMPTS` of the most recently ended
jobs): a job submitted again under the same id starts after the attempts the id already used
(its submission record carries the attempt it stands for, ``"attempt": N`` when N > 1), so
its workload ids (``job.attempt.rank``) and the stops and placements bound to them never
name an earlier incarnation's: an agent that ran the earlier one does not refuse the new
placement as a replay, and a stop bound to an earlier attempt cannot reach the new pods.
Compaction keeps them as ``attempt`` records of jobs that are not live. A torn last line
(a crash mid-append) is ignored on load; a corrupt line elsewhere is an error, since it
means the file was edited or damaged and silently dropping jobs would lose work.
On open, a journal whose ended jobs dominate is compacted (temp file, fsync, rename).

Pre-allocated, like the agent's state log (agent.state): the records are followed by zeros
(:data:`PREALLOC_BYTES`, written and synced at open, off the submit path) and each record is
written over them in place, made durable with ``fdatasync``. A sync after an append that grows
the file must commit the filesystem's journal (the size changed: on ext4 a journal write and
a second device flush, with every other fsync on the disk queued behind the commit), and a
job's placements wait for that sync; over blocks already written it flushes the data alone
(the mtime it leaves behind is not needed to read the records back). A record that runs past
the zeros grows the file by another :data:`PREALLOC_BYTES` of them in the same write. Reading
stops at the first zero byte (JSON text holds none): what lies beyond is zeros or the rest of
a write a crash cut short, never acknowledged (its sync had not returned, and no later write
began before it did); open writes zeros over such a rest, so later records never run into
it. A placer of the earlier layout reads the zeros as a torn last line and drops them.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

import msgspec

from infra.durable import atomic_write, write_all_at
from scheduler_link.messages import JobSpec

from .errors import JournalError

log = logging.getLogger("herd.placer.journal")

JOURNAL_VERSION = 1
# The attempt a submission record stands for: a replayed live job never counts below it, so
# re-placed after a crash it uses attempt 2 or later, never the ids of an attempt 1 that a
# silent node may still run.
FIRST_ATTEMPT = 1
# Ended jobs whose attempt counters are kept (the most recently ended): a resubmission under
# one of their ids continues the counter. Bounded by count, not time: each is a few dozen
# bytes, and an agent remembers a job's placements (its acks and terminal records) by count too.
KEEP_ENDED_ATTEMPTS = 10_000
# zeros the journal is made of past its records, and grown by when a record runs past them
PREALLOC_BYTES = 256 << 10


def keep_ended(ended: OrderedDict[str, int], job_id: str, attempt: int) -> list[str]:
    """Remember that ``job_id`` ended at ``attempt`` (the newest last); returns the ids
    forgotten to keep at most :data:`KEEP_ENDED_ATTEMPTS` (the oldest). Pure but for ``ended``."""
    ended.pop(job_id, None)
    ended[job_id] = attempt
    gone: list[str] = []
    while len(ended) > KEEP_ENDED_ATTEMPTS:
        gone.append(ended.popitem(last=False)[0])
    return gone


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = JOURNAL_VERSION
    op: Literal["submit", "end", "attempt", "cordon"]
    at: float
    spec: JobSpec | None = None
    job_id: str = ""
    state: str = ""
    attempt: int = 0
    node_id: str = ""     # cordon: the node, whether the cordon is on, and why
    on: bool = False
    reason: str = ""


_dec = msgspec.json.Decoder(Record)


class Journal:
    """Open with :meth:`open`; :meth:`jobs` gives the live jobs in submission order."""

    # Group-commit fsyncs run in a worker thread. Tests in virtual time turn this off: trio's
    # autojump clock cannot see a worker thread, so while a slow fsync runs it would jump the
    # clock past every deadline (HTTP timeouts included) and fail the test on a slow disk.
    sync_in_thread: bool = True

    def __init__(self, path: Path, live: dict[str, JobSpec], fd: int,
                 attempts: dict[str, int] | None = None, cordons: dict[str, str] | None = None,
                 ended: OrderedDict[str, int] | None = None, *, end: int = 0, alloc: int = 0) -> None:
        self.path = path
        self._live = live
        self.attempts = attempts or {}
        self.ended_attempts: OrderedDict[str, int] = ended if ended is not None else OrderedDict()  # job id -> last attempt
        self.cordons = cordons or {}   # node id -> reason, for the nodes cordoned now
        self._fd = fd
        self._end = end       # where the next record goes: the records, then zeros ...
        self._alloc = alloc   # ... up to here (the file's size)
        self.appends = 0
        self.synced = 0       # appends known durable (group commit)
        self.fsyncs = 0
        self._lock: Any = None

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str]) -> Journal:
        d = Path(state_dir)
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise JournalError(f"cannot create state dir {d}: {e.strerror}") from None
        path = d / "jobs.journal"
        live: dict[str, JobSpec] = {}
        attempts: dict[str, int] = {}
        ended: OrderedDict[str, int] = OrderedDict()   # ended jobs' last attempts (bounded)
        cordons: dict[str, str] = {}
        total = 0
        raw = b""
        end = 0   # where the records end (a torn last one left out)
        if path.exists():
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise JournalError(f"cannot read journal {path}: {e.strerror}") from None
            zero = raw.find(0)
            body = raw if zero < 0 else raw[:zero]
            end = len(body)
            lines = body.split(b"\n")
            for i, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    rec = _dec.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    if i == len(lines) - 1:
                        log.warning("journal: dropping a torn last line path=%s", path)
                        end = len(body) - len(line)
                        continue
                    raise JournalError(f"journal {path} line {i + 1} is corrupt: {e}") from None
                if rec.v != JOURNAL_VERSION:
                    raise JournalError(f"journal {path} line {i + 1}: unknown version {rec.v}")
                total += 1
                if rec.op == "submit" and rec.spec is not None:
                    jid = rec.spec.job_id
                    live[jid] = rec.spec
                    ended.pop(jid, None)
                    attempts[jid] = max(attempts.get(jid, 0), rec.attempt or FIRST_ATTEMPT)
                elif rec.op == "end":
                    if live.pop(rec.job_id, None) is not None:
                        keep_ended(ended, rec.job_id, attempts.pop(rec.job_id, FIRST_ATTEMPT))
                elif rec.op == "attempt":
                    if rec.job_id in live:
                        attempts[rec.job_id] = max(attempts.get(rec.job_id, 0), rec.attempt)
                    else:   # an ended job's counter, as compaction keeps it
                        keep_ended(ended, rec.job_id, max(ended.get(rec.job_id, 0), rec.attempt))
                elif rec.op == "cordon" and rec.node_id:
                    if rec.on:
                        cordons[rec.node_id] = rec.reason
                    else:
                        cordons.pop(rec.node_id, None)
            attempts = {k: max(attempts.get(k, 0), FIRST_ATTEMPT) for k in live}
            # (an ended job's kept counter is one small line after compaction: counted once)
            if total > 64 and total > 4 * (len(live) + len(cordons)) + len(ended):
                # rewritten whole, followed by its zeros: nothing torn is left
                raw = cls._compact(path, live, attempts, cordons, ended)
                end = len(raw) - PREALLOC_BYTES

        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                end, alloc = cls._prepare_tail(fd, raw, end)
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:
            raise JournalError(f"cannot open journal {path}: {e.strerror}") from None
        return cls(path, live, fd, attempts, cordons, ended, end=end, alloc=alloc)

    @staticmethod
    def _prepare_tail(fd: int, raw: bytes, end: int) -> tuple[int, int]:
        """Make the file past its records (``raw[:end]``) zeros, written and synced (module
        docstring): the zeros already there are kept; stale bytes of a torn write are written
        over; a file with none gets :data:`PREALLOC_BYTES`. Returns (where the next record goes,
        the file's size). A complete last record that lost only its newline gets it back."""
        wrote = False
        if end and raw[end - 1:end] != b"\n":
            write_all_at(fd, b"\n", end)
            end += 1
            wrote = True
        tail = raw[end:]
        if tail and tail.count(0) == len(tail):
            if wrote:
                os.fdatasync(fd)
            return end, len(raw)
        alloc = end + max(len(tail), PREALLOC_BYTES)
        write_all_at(fd, bytes(alloc - end), end)   # over a torn rest too: nothing stale stays
        os.fsync(fd)
        return end, alloc

    @staticmethod
    def _compact(path: Path, live: dict[str, JobSpec], attempts: dict[str, int],
                 cordons: dict[str, str] | None = None, ended: OrderedDict[str, int] | None = None) -> bytes:
        """The journal rewritten with only what is live (and its zeros); returns its bytes."""
        out = bytearray()
        for node_id, reason in sorted((cordons or {}).items()):
            out += msgspec.json.encode(Record(op="cordon", at=0.0, node_id=node_id, on=True, reason=reason)) + b"\n"
        for job_id, attempt in (ended or {}).items():   # the oldest first, as they ended
            out += msgspec.json.encode(Record(op="attempt", at=0.0, job_id=job_id, attempt=attempt)) + b"\n"
        for spec in live.values():
            out += msgspec.json.encode(Record(op="submit", at=0.0, spec=spec)) + b"\n"
            if attempts.get(spec.job_id, 0) > FIRST_ATTEMPT:
                out += msgspec.json.encode(Record(op="attempt", at=0.0, job_id=spec.job_id,
                                                  attempt=attempts[spec.job_id])) + b"\n"
        out += bytes(PREALLOC_BYTES)
        atomic_write(path, out)   # temp, fsync, rename, fsync of the directory
        log.info("journal compacted path=%s live=%d", path, len(live))
        return bytes(out)

    def jobs(self) -> list[JobSpec]:
        return list(self._live.values())

    def _append(self, rec: Record, *, sync: bool = True) -> None:
        """One record over the zeros (grown by more of them in the same write when it runs
        past them), ``fdatasync``'d unless ``sync=False`` (module docstring)."""
        data = msgspec.json.encode(rec) + b"\n"
        end = self._end + len(data)
        if end > self._alloc:
            data += bytes(PREALLOC_BYTES)
        try:
            write_all_at(self._fd, data, self._end)
            if sync:
                os.fdatasync(self._fd)
        except OSError as e:
            raise JournalError(f"cannot append to journal {self.path}: {e.strerror}") from None
        self._alloc = max(self._alloc, self._end + len(data))
        self._end = end
        self.appends += 1
        if sync:
            self.synced = self.appends
            self.fsyncs += 1

    def submitted(self, spec: JobSpec, at: float, *, sync: bool = True) -> int:
        """Append a submission (synced unless ``sync=False``: then :meth:`flush` makes it
        durable, one fdatasync for every append before it). Returns the attempts its id used
        before (0: a new id; an ended job's kept counter; a live job's own, when its spec is
        replaced): its first placement is that attempt + 1."""
        jid = spec.job_id
        before = self.attempts.get(jid, 0) if jid in self._live else self.ended_attempts.get(jid, 0)
        stands = 0 if jid in self._live or not before else before + FIRST_ATTEMPT
        self._append(Record(op="submit", at=at, spec=spec, attempt=stands), sync=sync)
        self._live[jid] = spec
        self.ended_attempts.pop(jid, None)
        self.attempts[jid] = max(self.attempts.get(jid, 0), stands or FIRST_ATTEMPT)
        return before

    async def flush(self) -> None:
        """Group commit: make every append so far durable. Concurrent callers share one
        fdatasync, run in a worker thread so the event loop keeps serving."""
        import trio

        target = self.appends
        if self._lock is None:
            self._lock = trio.Lock()
        async with self._lock:
            if self.synced >= target:
                return  # a flush that started after our append covered it
            upto = self.appends
            try:
                if self.sync_in_thread:
                    await trio.to_thread.run_sync(os.fdatasync, self._fd)
                else:
                    os.fdatasync(self._fd)
            except OSError as e:
                raise JournalError(f"cannot sync journal {self.path}: {e.strerror}") from None
            self.synced = max(self.synced, upto)
            self.fsyncs += 1

    def attempt(self, job_id: str, attempt: int, at: float) -> None:
        """Record a job's attempt counter (not fsynced; see the module docstring). Attempt 1
        is its submission's: nothing is appended for it."""
        if job_id in self._live and attempt > self.attempts.get(job_id, 0):
            self._append(Record(op="attempt", at=at, job_id=job_id, attempt=attempt), sync=False)
            self.attempts[job_id] = attempt

    def cordon(self, node_id: str, on: bool, at: float, reason: str = "") -> None:
        """Record a cordon (``on``) or an uncordon, synced: it must outlive a restart."""
        self._append(Record(op="cordon", at=at, node_id=node_id, on=on, reason=reason))
        if on:
            self.cordons[node_id] = reason
        else:
            self.cordons.pop(node_id, None)

    def ended(self, job_id: str, state: str, at: float) -> None:
        """One job's end, synced before this returns (recovery's dropped jobs)."""
        if job_id in self._live:
            self._append(Record(op="end", at=at, job_id=job_id, state=state))
            self._live.pop(job_id, None)
            keep_ended(self.ended_attempts, job_id, self.attempts.pop(job_id, FIRST_ATTEMPT))

    def ended_many(self, ends: list[tuple[str, str, float]]) -> None:
        """Jobs that ended, appended together without an fsync of their own: the caller makes
        them durable with :meth:`flush` (group commit, in a worker thread), so a job's end
        costs the event loop a write, not a disk flush. Until then a crash may replay such a
        job as live (as the etcd journal's ends wait for its writer): its nodes' reports say
        its pods are gone, and an operator's cancel answers only after its flush."""
        ends = [e for e in ends if e[0] in self._live]
        for job_id, state, at in ends:
            self._append(Record(op="end", at=at, job_id=job_id, state=state), sync=False)
            self._live.pop(job_id, None)
            keep_ended(self.ended_attempts, job_id, self.attempts.pop(job_id, FIRST_ATTEMPT))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
