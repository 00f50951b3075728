"""The workload supervisor: accepts placements, runs workloads under shims, stops them.

Theory of operation
-------------------
One owner task (:meth:`Supervisor.run`) holds every :class:`WorkloadRecord`. Everyone
else -- HTTP handlers, the scheduler link, the per-workload tasks -- sends it frozen
events over a memory channel; the owner applies a batch, appends what it changed to the
state log (the changed records whole, fdatasync'd: :mod:`agent.state`), and only then
answers and starts what needs durability. So an ack is never ahead of what is on disk.

Per workload, one life-cycle task (in the owner's nursery) walks
accepted -> fetching -> starting -> running, then waits for the shim to exit and
reads the exit status it recorded. A stop (operator, victim, fencing) persists
``terminating`` with an absolute deadline first, then a killer task writes the
notice file, SIGTERMs the process group and SIGKILLs it at the deadline. A
restarted agent re-adopts a live workload only when (pid, start time, boot id) of
the workload or of its shim match what was recorded, and resumes a countdown from
the recorded deadline (no new SIGTERM if one was sent, no fresh grace period).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import stat
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import trio

from infra.backoff import Backoff
from infra.metrics import LatencyHistogram
from scheduler_link.messages import (
    TERMINAL_STATES,
    PeerTable,
    Placement,
    PlacementAck,
    RestartPolicy,
    WorkloadEvent,
    WorkloadStatus,
)

from . import environment, procs
from .errors import AgentError, ConfigError, ShimError, UnknownWorkload
from .events import Batch, Change, Place, Runtime, Stop
from .isolation import Identities, Isolation, WorkloadUser, detect, reachable
from .launcher import EnvFileError, LaunchCommand, ShimPool, read_env_files, wait_identity
from .logs import read_tail
from .peersfile import PEERS_FILE, BlobFetcher, gang_peers, lines_from_peers
from .peersfile import write_file as write_peers_file
from .placement import check_placement, gpus_in_use
from .state import AgentState, StateDelta, StateFile, WorkloadRecord, atomic_write

log = logging.getLogger("herd.agent.supervisor")

_KEEP_ACKS = 2000
INLINE_WRITE_MAX = 64 << 10   # a peers file this small goes with the pod's command (its leader writes it)
_GC_MIN_AGE_S = 60.0
# (manifest_id, origin, peers) -> (materialised tree, fetch figures by source)
ArtifactFetcher = Callable[[str, str | None, Any], Awaitable[tuple[Path, dict[str, int]]]]  # peers: list or PeerTable


class SupervisorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[workloads]`` of the agent config."""

    shim_pool: int = 8  # one per GPU of an 8-GPU node: a gang's pods there all start warm
    log_max_bytes: int = 16 << 20
    log_keep: int = 2
    keep_terminal: int = 200
    default_grace_s: float = 30.0
    blob_timeout_s: float = 10.0         # fetching a gang's blob for its peers file (then: partial list)
    # isolation (agent.isolation): who workloads run as, and where their cgroups live
    user: str = "herd-workload"          # name or numeric uid; ignored when the agent is unprivileged
    allowed_users: tuple[str, ...] = ()  # users a placement may name (Placement.user)
    allow_root: bool = False             # workloads as uid 0 are refused unless this is true
    cgroup: str = "auto"                 # auto | off | an absolute cgroup v2 dir to hold workload cgroups
    rlimit_core: int = 0                 # RLIMIT_CORE of workloads (bytes)
    # per-workload cgroup limits in cgroup v2 syntax ("" = none), cgroup mode only
    memory_max: str = ""                 # memory.max, e.g. "64G"
    cpu_max: str = ""                    # cpu.max, e.g. "800000 100000" (8 CPUs)
    pids_max: str = ""                   # pids.max, e.g. "4096"
    # JobSpec.env_from_files: host paths a job may name (absolute prefixes; empty: none), and
    # the size bound of each file (agent.launcher.read_env_files)
    env_files_prefixes: tuple[str, ...] = ()
    env_file_max_bytes: int = 64 << 10


KILL_EVERY_S = 1.0   # past the deadline, SIGKILL what is left this often until the workload is gone


def on_trio_clock(wall_deadline: float, wall_now: float, trio_now: float) -> float:
    """A recorded (wall-clock) deadline as a time on trio's clock; one already past is now. Pure."""
    return trio_now + max(0.0, wall_deadline - wall_now)


RESTART_BACKOFF_CAP_S = 300.0   # the longest wait between restarts of an on-failure policy


def restart_delay_s(policy: RestartPolicy, attempt: int) -> float:
    """The wait before restart ``attempt`` (1, 2, ...) of an on-failure policy: doubling up
    to :data:`RESTART_BACKOFF_CAP_S`, no jitter (one process on one node, exact times). Pure."""
    return Backoff(policy.backoff_s, RESTART_BACKOFF_CAP_S, jitter=0.0).window(attempt)


async def kill_after_deadline(deadline: float, gone: trio.Event, kill: Callable[[], Awaitable[None]], *,
                              every_s: float = KILL_EVERY_S) -> int:
    """A stop's countdown on trio's clock: wait until ``gone`` or ``deadline`` (trio time); past
    it, ``kill()`` every ``every_s`` until ``gone``. Returns how many times it killed."""
    with trio.move_on_at(deadline):
        await gone.wait()
    kills = 0
    while not gone.is_set():
        await kill()
        kills += 1
        with trio.move_on_after(every_s):
            await gone.wait()
    return kills


def _final_state(rec: WorkloadRecord) -> str:
    """How a stopped workload ends: by what the stop was (a preemption or not), not by its words."""
    return "preempted" if rec.stop_preempted else "exited"


class Supervisor:
    def __init__(self, state_dir: str | os.PathLike[str], *, node_id: str,
                 gpu_health: Callable[[], Mapping[str, str] | None],
                 config: SupervisorConfig = SupervisorConfig(),
                 fetcher: ArtifactFetcher | None = None,
                 base_env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.time,
                 pool: ShimPool | None = None,
                 isolation: Isolation | None = None,
                 identities: Identities | None = None,
                 blob_fetcher: BlobFetcher | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.wl_dir = self.state_dir / "workloads"
        self.node_id = node_id
        self.config = config
        self._gpu_health = gpu_health
        self._fetcher = fetcher
        self._blob_fetcher = blob_fetcher
        self._said: set[str] = set()  # limits this host cannot enforce, said once each
        self._clock = clock
        self._base_env = environment.base_env(base_env if base_env is not None else os.environ)
        self.pool = pool or ShimPool(config.shim_pool)
        self.identities = identities or Identities(config.user, allowed=config.allowed_users,
                                                   allow_root=config.allow_root)
        self.isolation = isolation or Isolation(*detect(config.cgroup))
        self._limits, self._limit_notes = _limits(config, self.isolation)
        self._file = StateFile(self.state_dir)
        self._send, self._recv = trio.open_memory_channel[Any](10_000)
        self._records: dict[str, WorkloadRecord] = {}
        self._acks: dict[str, PlacementAck] = {}
        self._rt: dict[str, Runtime] = {}
        self._listeners: list[Callable[[WorkloadEvent], None]] = []
        self._nursery: trio.Nursery | None = None
        self._dirty = False
        # what the batches since the last commit changed (the next StateDelta)
        self._touched: dict[str, None] = {}      # workload ids, in order
        self._new_acks: dict[str, None] = {}     # placement ids
        self._forgot: set[str] = set()
        self._forgot_acks: set[str] = set()
        self._gen = 0
        self._saved_gen = 0
        self._pending: list[StateDelta] = []     # committed, not yet written
        self._need_snapshot = False              # a failed append: the next write is a snapshot
        self._waiters: list[tuple[int, list[Callable[[], None]]]] = []
        self._applied = trio.Event()   # set, then replaced, after each applied batch (next_change)
        self._wrote = trio.Event()     # the writer's: set, then replaced, after each write (next_saved)
        self._wake_writer = trio.Event()
        self.ready = False
        self.counters: Counter[str] = Counter()
        self._start_s: deque[float] = deque(maxlen=1024)
        # /metrics histograms (cumulative): accepted -> running of every first start, by
        # whether it fetched an artifact first; and each artifact fetch's own duration
        self.start_hist = {"false": LatencyHistogram(), "true": LatencyHistogram()}
        self.fetch_hist = LatencyHistogram()
        self.fetch_bytes: Counter[str] = Counter()

    # ------------------------------------------------------------ public API (any task)

    def add_listener(self, fn: Callable[[WorkloadEvent], None]) -> None:
        """``fn(event)`` is called (synchronously, must not block) on every state change."""
        self._listeners.append(fn)

    async def place(self, placement: Placement, *, direct: bool = False) -> PlacementAck:
        """Accept or refuse ``placement`` (idempotent by placement id); returns at once."""
        send, recv = trio.open_memory_channel[Any](1)
        await self._send.send(Place(placement, direct, send))
        return await recv.receive()

    async def stop(self, workload_id: str, *, reason: str = "stopped", grace_s: float | None = None,
                   preempted: bool = False) -> WorkloadStatus:
        """Begin a graceful stop; returns the workload's status right after (terminating).
        ``preempted``: the workload ends ``preempted``, else ``exited``."""
        send, recv = trio.open_memory_channel[Any](1)
        await self._send.send(Stop(workload_id, reason, grace_s, send, preempted))
        res = await recv.receive()
        if isinstance(res, Exception):
            raise res
        return res

    def next_change(self) -> trio.Event:
        """Set once the owner has applied its next batch of changes (any field of any record,
        not only a state change): wait on it, then look at the records again. Tests wait on
        this instead of polling."""
        return self._applied

    def next_saved(self) -> trio.Event:
        """Set once the writer has written the state file next."""
        return self._wrote

    def saved(self) -> bool:
        """Everything applied so far is in the state file (a restart would find it)."""
        return self._saved_gen >= self._gen

    async def wait_terminal(self, workload_id: str) -> WorkloadStatus:
        rt = self._rt.get(workload_id)
        if rt is None:
            raise UnknownWorkload(workload_id)
        await rt.gone.wait()
        return self._records[workload_id].status()

    def workloads(self) -> list[WorkloadStatus]:
        return [r.status() for r in self._records.values()]

    def record(self, workload_id: str) -> WorkloadRecord:
        try:
            return self._records[workload_id]
        except KeyError:
            raise UnknownWorkload(f"no workload {workload_id!r} on this node") from None

    def records_view(self) -> Mapping[str, WorkloadRecord]:
        """Every record, read-only (the parts acceptor checks a part against them)."""
        return self._records

    def known_ack(self, placement_id: str) -> PlacementAck | None:
        """The ack of a placement already accepted (``place`` answers it again, once durable)."""
        return self._acks.get(placement_id)

    def workload_dir(self, workload_id: str) -> Path:
        return self.wl_dir / self.record(workload_id).workload_id

    def statistics(self) -> dict[str, Any]:
        by_state = Counter(r.state for r in self._records.values())
        return {"workloads_by_state": dict(by_state), "starts": self.counters["starts"],
                "restarts": self.counters["restarts"], "preemptions": self.counters["preemptions"],
                "refused": self.counters["refused"], "state_writes": self._file.writes,
                "state_appends": self._file.appends,
                "start_seconds": _quantiles(self._start_s),
                "fetch_bytes": dict(self.fetch_bytes), "shim_pool": self.pool.statistics(),
                "isolation": self.isolation.mode, "isolation_reason": self.isolation.reason,
                "workload_user": self.identities.default.name, "workload_user_notes": list(self.identities.notes)}

    # ------------------------------------------------------------ the owner task

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.wl_dir.mkdir(parents=True, exist_ok=True)
        # root-owned, traverse-only: a workload reaches its own scratch by path, lists
        # nothing, and every file here is 0600 (state.json, run.json, logs)
        for d in (self.state_dir, self.wl_dir):
            os.chmod(d, 0o711)
        for note in self.identities.notes:  # said once (INFO: the unit runs at INFO; tests stay quiet)
            log.info("%s", note)
        log.info("workload isolation=%s (%s) user=%s", self.isolation.mode, self.isolation.reason,
                 self.identities.default.name)
        for note in self._limit_notes:
            log.warning("%s", note)
        blocked = reachable(self.wl_dir, self.identities.default)
        if blocked is not None:
            log.error("workloads run as %s cannot reach %s: %s is not traversable for them; their "
                      "scratch dirs and artifact trees will be out of reach", self.identities.default.name,
                      self.wl_dir, blocked)
        st = await trio.to_thread.run_sync(self._file.load)
        self._records = {r.workload_id: r for r in st.records}
        self._acks = {a.placement_id: a for a in st.acks}
        self._gen = self._saved_gen = st.seq
        try:
            await self._serve(task_status)
        finally:
            self._file.close()

    async def _serve(self, task_status: Any) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.pool.run)
            batch = Batch()
            self._recover(batch)
            # a fresh snapshot at every start: the log begins empty (a torn tail is gone)
            await trio.to_thread.run_sync(self._file.save, self._snapshot())
            self._clear_changes()
            for fn in batch.now + batch.durable:
                fn()
            nursery.start_soon(self._writer)
            self.ready = True
            task_status.started()
            async for msg in self._recv:
                batch = Batch()
                self._handle(msg, batch)
                while True:
                    try:
                        msg = self._recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self._handle(msg, batch)
                self._commit(batch.durable)
                for fn in batch.now:
                    fn()
                self._applied.set()
                self._applied = trio.Event()

    # Group commit: the owner never waits for the disk. Each applied batch bumps a
    # generation and hands the writer task a delta (the records it changed, frozen, whole);
    # the writer appends every pending delta at once and fdatasyncs; callbacks that need
    # durability (acks, the start of a kill countdown) run once a write that includes their
    # generation has completed. Starting a process does not wait: the launcher writes the
    # workload's record into run.json (atomically) before the command leaves, so a restarted
    # agent finds a started workload even if the state log lagged behind.

    def _snapshot(self) -> AgentState:
        return AgentState(node_id=self.node_id, records=list(self._records.values()),
                          acks=list(self._acks.values()), seq=self._gen)

    def _touch(self, wid: str) -> None:
        self._touched[wid] = None
        self._forgot.discard(wid)
        self._dirty = True

    def _ack_added(self, placement_id: str) -> None:
        self._new_acks[placement_id] = None
        self._forgot_acks.discard(placement_id)
        self._dirty = True

    def _clear_changes(self) -> None:
        self._dirty = False
        self._touched, self._new_acks = {}, {}
        self._forgot, self._forgot_acks = set(), set()

    def _delta(self) -> StateDelta:
        """What changed since the last commit, as of now (generation ``self._gen``)."""
        d = StateDelta(seq=self._gen, records=[self._records[w] for w in self._touched if w in self._records],
                       acks=[self._acks[a] for a in self._new_acks if a in self._acks],
                       forget=sorted(self._forgot), forget_acks=sorted(self._forgot_acks))
        self._clear_changes()
        return d

    def _gc(self, after: list[Callable[[], None]]) -> None:
        """Forget the oldest terminal workloads beyond ``keep_terminal`` (and their dirs,
        once the state without them is on disk); keep the newest acks."""
        terminal = [r for r in self._records.values() if r.terminal]
        excess = len(terminal) - self.config.keep_terminal
        if excess > 0:
            # never the just-finished: their tasks and waiters still read them
            cutoff = self._clock() - _GC_MIN_AGE_S
            terminal = [r for r in terminal if r.updated_at < cutoff]
            excess = min(excess, len(terminal))
        if excess > 0:
            for r in sorted(terminal, key=lambda r: r.updated_at)[:excess]:
                del self._records[r.workload_id]
                self._rt.pop(r.workload_id, None)
                self._touched.pop(r.workload_id, None)
                self._forgot.add(r.workload_id)
                after.append(functools.partial(self._spawn_thread, shutil.rmtree, self.wl_dir / r.workload_id, True))
            self._dirty = True
        if len(self._acks) > _KEEP_ACKS:
            for k in list(self._acks)[: len(self._acks) - _KEEP_ACKS]:
                del self._acks[k]
                self._new_acks.pop(k, None)
                self._forgot_acks.add(k)
            self._dirty = True

    def _spawn_thread(self, fn: Callable[..., Any], *args: Any) -> None:
        async def go() -> None:
            await trio.to_thread.run_sync(fn, *args)
        assert self._nursery is not None
        self._nursery.start_soon(go)

    def gpu_holders(self) -> dict[str, str]:
        """GPU UUID -> the live workload holding it."""
        return gpus_in_use(self._records.values())

    def _commit(self, durable: list[Callable[[], None]]) -> None:
        if self._dirty:
            self._gc(durable)
            self._gen += 1
            self._pending.append(self._delta())
            self._wake_writer.set()
        if durable:
            if self._saved_gen >= self._gen:
                for fn in durable:
                    fn()
            else:
                self._waiters.append((self._gen, durable))

    async def _writer(self) -> None:
        while True:
            await self._wake_writer.wait()
            self._wake_writer = trio.Event()
            gen = self._gen
            if gen > self._saved_gen:
                # every delta pending is in this write (the owner runs between our awaits only)
                deltas, self._pending = self._pending, []
                try:
                    if self._need_snapshot or self._file.wants_snapshot():
                        await trio.to_thread.run_sync(self._file.save, self._snapshot())
                    else:
                        await trio.to_thread.run_sync(self._file.append, deltas)
                except OSError as e:  # disk full or gone: keep running, retry on the next change
                    # the log may end in a partial line now: the retry writes a whole snapshot
                    log.error("state write failed err=%s", e)
                    self._need_snapshot = True
                    await trio.sleep(1)
                    self._wake_writer.set()
                    continue
                self._need_snapshot = False
                self._saved_gen = gen
                self._wrote.set()
                self._wrote = trio.Event()
            ready = [fns for g, fns in self._waiters if g <= self._saved_gen]
            self._waiters = [(g, fns) for g, fns in self._waiters if g > self._saved_gen]
            for fns in ready:
                for fn in fns:
                    fn()

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> Callable[[], None]:
        def go() -> None:
            assert self._nursery is not None
            self._nursery.start_soon(fn, *args)
        return go

    # ------------------------------------------------------------ applying events (owner only)

    def _handle(self, msg: Any, after: Batch) -> None:
        if isinstance(msg, Place):
            self._on_place(msg, after)
        elif isinstance(msg, Stop):
            self._on_stop(msg, after)
        elif isinstance(msg, Change):
            self._on_change(msg, after)

    def _update(self, wid: str, after: Batch, *, fetch: Mapping[str, int] | None = None,
                **fields: Any) -> WorkloadRecord:
        old = self._records[wid]
        now = self._clock()
        if fetch:  # kept on the record too: a full report (which supersedes lost events) carries them
            fields["fetch"] = {k: int(v) for k, v in fetch.items() if v is not None}
        new = msgspec.structs.replace(old, updated_at=now, **fields)
        self._records[wid] = new
        self._touch(wid)
        if new.state != old.state:
            self._on_state(old, new, now, fetch)
            if new.terminal:
                rt = self._rt.setdefault(wid, Runtime())
                after.now.append(rt.gone.set)
        return new

    def _on_state(self, old: WorkloadRecord | None, new: WorkloadRecord, now: float,
                  fetch: Mapping[str, int] | None) -> None:
        if new.state == "running":
            self.counters["starts"] += 1
            if old is not None and old.restarts == new.restarts:
                self.start_hist["true" if new.manifest_id else "false"].observe(max(0.0, now - new.created_at))
                if not new.manifest_id and not new.wait_for:
                    self._start_s.append(max(0.0, now - new.created_at))  # accepted -> running, no fetch/victims
        if new.state == "preempted":
            self.counters["preemptions"] += 1
        log.info("workload state id=%s job=%s state=%s exit_code=%s reason=%s", new.workload_id, new.job_id,
                 new.state, new.exit_code, new.reason)
        fetch = fetch or {}
        ev = WorkloadEvent(workload_id=new.workload_id, job_id=new.job_id, state=new.state,  # type: ignore[arg-type]  # the record's state is a str on disk; every value written is a WorkloadState
                           at=now, exit_code=new.exit_code, reason=new.reason, gpus=list(new.gpus),
                           placement_id=new.placement_id, bytes_from_origin=fetch.get("bytes_from_origin"),
                           bytes_from_peers=fetch.get("bytes_from_peers"), bytes_local=fetch.get("bytes_local"))
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:
                log.exception("event listener failed")

    def _on_place(self, msg: Place, after: Batch) -> None:
        p = msg.placement
        known = self._acks.get(p.placement_id)
        if known is not None:
            after.durable.append(lambda: msg.reply.send_nowait(known))
            return
        reason = check_placement(p, self._records, self._gpu_health(), env_prefixes=self.config.env_files_prefixes)
        if reason is not None:
            self.counters["refused"] += 1
            log.warning("placement refused placement=%s job=%s reason=%s", p.placement_id, p.job_id, reason)
            ack = PlacementAck(placement_id=p.placement_id, node_id=self.node_id, accepted=False,
                               reason=reason.detail, outcome=reason.outcome, refused_gpus=list(reason.gpus))
            after.now.append(lambda: msg.reply.send_nowait(ack))
            return
        if p.pods:
            try:
                user = self.identities.resolve(p.user)
            except ConfigError as e:
                self.counters["refused"] += 1
                ack = PlacementAck(placement_id=p.placement_id, node_id=self.node_id, accepted=False,
                                   reason=str(e), outcome="refused_spec")
                after.now.append(lambda: msg.reply.send_nowait(ack))
                return
        now = self._clock()
        live_victims = [v for v in p.victims if v.workload_id in self._records
                        and not self._records[v.workload_id].terminal]
        wait_for = [v.workload_id for v in live_victims]
        for pod in p.pods:
            rec = WorkloadRecord(
                workload_id=pod.workload_id, job_id=p.job_id, placement_id=p.placement_id, rank=pod.rank,
                world_size=p.world_size, gpus=list(pod.gpus), gpu_indices=list(pod.gpu_indices),
                argv=list(p.argv), env=dict(p.env), manifest_id=p.manifest_id, origin=p.origin,
                peers=list(p.peers), gang_blob_id=p.gang_blob_id, gang_nodes=p.gang_nodes,
                limits=p.limits.as_files(), env_from_files=dict(p.env_from_files),
                grace_s=p.grace_s, restart=p.restart, direct=msg.direct,
                wait_for=wait_for, created_at=now, updated_at=now, user=p.user, run_as=user.name)
            self._records[rec.workload_id] = rec
            self._touch(rec.workload_id)
            self._rt[rec.workload_id] = Runtime()
            self._on_state(None, rec, now, None)
            after.now.append(self._spawn(self._lifecycle, rec.workload_id))
        ack = PlacementAck(placement_id=p.placement_id, node_id=self.node_id, accepted=True, outcome="accepted",
                           workloads=[pod.workload_id for pod in p.pods])
        self._acks[p.placement_id] = ack
        self._ack_added(p.placement_id)
        for v in live_victims:
            self._begin_stop(v.workload_id, v.reason, v.grace_s, after, preempted=v.preempted)
        after.durable.append(lambda: msg.reply.send_nowait(ack))

    def _on_stop(self, msg: Stop, after: Batch) -> None:
        if msg.workload_id not in self._records:
            err = UnknownWorkload(f"no workload {msg.workload_id!r} on this node")
            if msg.reply is not None:
                after.now.append(functools.partial(msg.reply.send_nowait, err))
            return
        self._begin_stop(msg.workload_id, msg.reason, msg.grace_s, after, preempted=msg.preempted)
        if msg.reply is not None:
            after.durable.append(functools.partial(msg.reply.send_nowait, self._records[msg.workload_id].status()))

    def _begin_stop(self, wid: str, reason: str, grace_s: float | None, after: Batch, *,
                    preempted: bool) -> None:
        rec = self._records[wid]
        rt = self._rt.setdefault(wid, Runtime())
        if rec.terminal or rec.state == "terminating":
            return  # already going: keep the first deadline
        grace = rec.grace_s if grace_s is None else grace_s
        rt.stop.set()
        if rec.pid is None:
            # not started (or a launch is in flight): the life-cycle task finishes it
            self._update(wid, after, stop_reason=reason, stop_preempted=preempted,
                         stop_deadline=self._clock() + grace)
            rt.pre_start.cancel()
            return
        self._update(wid, after, state="terminating", stop_reason=reason, stop_preempted=preempted,
                     stop_deadline=self._clock() + grace, reason=reason)
        self._start_killer(wid, after)

    def _start_killer(self, wid: str, after: Batch) -> None:
        rt = self._rt[wid]
        if not rt.killer_started:
            rt.killer_started = True
            after.durable.append(self._spawn(self._killer, wid))

    def _on_change(self, msg: Change, after: Batch) -> None:
        if msg.workload_id in self._records:
            rec = self._update(msg.workload_id, after, fetch=msg.fetch, **msg.fields)
            if rec.state == "running" and rec.stop_reason is not None:
                # a stop arrived while the launch was in flight: now there is a process to stop
                self._update(rec.workload_id, after, state="terminating", reason=rec.stop_reason,
                             stop_deadline=max(rec.stop_deadline or 0.0, self._clock()))
                self._start_killer(rec.workload_id, after)
        if msg.done is not None:
            (after.durable if msg.durable else after.now).append(msg.done.set)

    async def _starting(self, wid: str, fetch: Mapping[str, int] | None) -> WorkloadRecord:
        """Tell the owner the workload is starting, without waiting for it to apply that: the
        launch goes on at once (the owner applies the change before the launch's outcome, which
        comes after it on the same channel; a stop applied before it leaves ``stop_reason``, and
        a launch that races a stop is stopped once running). Returns the record as the owner
        will make it, for the launch command (its copy in ``run.json``)."""
        fields: dict[str, Any] = {"state": "starting", "pid": None, "exit_code": None}
        try:
            self._send.send_nowait(Change(wid, fields, None, fetch))
        except trio.WouldBlock:   # (a full channel: wait for room, as any change does)
            await self._send.send(Change(wid, fields, None, fetch))
        mine = {**fields, "fetch": {k: int(v) for k, v in fetch.items() if v is not None}} if fetch else fields
        return msgspec.structs.replace(self._records[wid], updated_at=self._clock(), **mine)

    async def _change(self, wid: str, fetch: Mapping[str, int] | None = None, durable: bool = False,
                      **fields: Any) -> WorkloadRecord:
        done = trio.Event()
        await self._send.send(Change(wid, fields, done, fetch, durable))
        await done.wait()
        return self._records[wid]

    # ------------------------------------------------------------ recovery (owner, before ready)

    def _adopt_orphans(self) -> None:
        """Workloads whose run.json was written while state.json had not caught up yet (the
        agent died right after a launch): rebuild their records from the copy in run.json."""
        try:
            dirs = list(self.wl_dir.iterdir())
        except FileNotFoundError:
            return
        for d in dirs:
            if d.name in self._records:
                continue
            ident = _read_json(d / "run.json")
            if not ident or not isinstance(ident.get("record"), dict):
                continue
            try:
                rec = msgspec.convert(ident["record"], WorkloadRecord)
            except msgspec.ValidationError as e:
                log.error("unreadable record in run.json dir=%s err=%s", d, e)
                continue
            if rec.workload_id != d.name:
                continue
            log.warning("recovered workload from its run.json id=%s", rec.workload_id)
            self._records[rec.workload_id] = msgspec.structs.replace(rec, state="starting", pid=None)
            self._touch(rec.workload_id)
            if rec.placement_id and rec.placement_id not in self._acks:
                self._acks[rec.placement_id] = PlacementAck(
                    placement_id=rec.placement_id, node_id=self.node_id, accepted=True, outcome="accepted",
                    workloads=[r.workload_id for r in self._records.values() if r.placement_id == rec.placement_id])
                self._ack_added(rec.placement_id)

    def _recover(self, after: Batch) -> None:
        self._adopt_orphans()
        for wid, rec in list(self._records.items()):
            rt = self._rt.setdefault(wid, Runtime())
            if rec.terminal:
                rt.gone.set()
                continue
            wdir = self.wl_dir / wid
            if rec.pid is None:
                ident = _read_json(wdir / "run.json")
                if ident is not None and ident.get("boot_id") == procs.boot_id():
                    rec = self._update(wid, after, pid=ident["pid"], start_time=ident.get("start_time"),
                                       boot_id=ident.get("boot_id"), shim_pid=ident.get("shim_pid"),
                                       shim_start_time=ident.get("shim_start_time"),
                                       started_at=ident.get("started_at"))
                elif rec.state == "starting":
                    self._update(wid, after, state="lost", reason="agent restarted while the workload was starting")
                    continue
                else:
                    if rec.stop_reason is not None:
                        self._update(wid, after, state=_final_state(rec), reason=rec.stop_reason)
                    else:
                        log.info("resuming workload id=%s from state=%s", wid, rec.state)
                        after.now.append(self._spawn(self._lifecycle, wid))
                    continue
            shim_alive = procs.same_process(rec.shim_pid, rec.shim_start_time, rec.boot_id)
            wl_alive = procs.same_process(rec.pid, rec.start_time, rec.boot_id)
            if shim_alive or wl_alive:
                log.info("re-adopted workload id=%s pid=%s shim=%s", wid, rec.pid, rec.shim_pid)
                if rec.state not in ("running", "terminating"):
                    rec = self._update(wid, after, state="running")
                if rec.state == "terminating" or rec.stop_reason is not None:
                    if rec.state != "terminating":
                        self._update(wid, after, state="terminating")
                    rt.stop.set()
                    self._start_killer(wid, after)
                after.now.append(self._spawn(self._watch, wid))
                continue
            ex = _read_json(wdir / "exit.json")
            if ex is not None and ex.get("pid") == rec.pid:
                state = _final_state(rec) if rec.stop_reason else "exited"
                self._update(wid, after, state=state, exit_code=ex.get("code"),
                             reason=rec.stop_reason or _exit_reason(ex))
            else:
                self._update(wid, after, state="lost",
                             reason="process gone (or PID reused) and no exit status recorded")

    # ------------------------------------------------------------ per-workload tasks

    async def _lifecycle(self, wid: str) -> None:
        rt = self._rt[wid]
        rec = self._records[wid]
        wdir = self.wl_dir / wid
        fetch: dict[str, int] | None = None
        cwd: Path | None = None
        files: dict[str, str] = {}
        try:
            with rt.pre_start:
                user = self.identities.resolve(rec.user)
                _workload_dirs(wdir, user)  # a few µs: not worth a thread
                table: PeerTable | None = None
                if rec.peers or rec.gang_blob_id:
                    with trio.move_on_after(self.config.blob_timeout_s) as cs:
                        data, source, table = await gang_peers(rec.gang_blob_id, rec.gang_nodes, rec.peers,
                                                               self._blob_fetcher)
                    if cs.cancelled_caught:
                        data, source, table = lines_from_peers(rec.peers, partial=True), "partial", None
                    # not synced: a small gang's list comes with the pod's command (its leader
                    # writes it, each pod in its own process, not one after another on the loop);
                    # a big gang's (MBs) in a thread, off the loop
                    if len(data) <= INLINE_WRITE_MAX:
                        files[PEERS_FILE] = data.decode()
                    else:
                        await trio.to_thread.run_sync(write_peers_file, wdir / PEERS_FILE, data)
                    self.counters[f"peers_from_{source}"] += 1
                if rec.manifest_id:
                    await self._change(wid, state="fetching")
                    if self._fetcher is None:
                        raise AgentError("this agent has no artifact store to fetch into")
                    # the gang's whole table when we have it (every node then plans the same trees)
                    t0 = time.monotonic()
                    cwd, fetch = await self._fetcher(rec.manifest_id, rec.origin,
                                                     table if table is not None else list(rec.peers))
                    self.fetch_hist.observe(time.monotonic() - t0)
                    for k, n in fetch.items():
                        self.fetch_bytes[k] += n
                for victim in rec.wait_for:
                    vrt = self._rt.get(victim)
                    if vrt is not None:
                        await vrt.gone.wait()
        except Exception as e:
            log.warning("workload preparation failed id=%s err=%s", wid, e)
            await self._change(wid, state="failed", reason=f"{type(e).__name__}: {e}")
            return
        attempt = 0
        while True:
            rec = self._records[wid]
            if rec.stop_reason is not None:
                await self._change(wid, state=_final_state(rec), reason=f"{rec.stop_reason} before start")
                return
            rec = await self._starting(wid, fetch)
            fetch = None
            for name in ("run.json", "exit.json"):
                with contextlib.suppress(FileNotFoundError):
                    (wdir / name).rename(wdir / f"{name}.prev")
            try:
                limits, unenforced = workload_limits(self._limits, rec.limits, self.isolation)
                if unenforced and unenforced not in self._said:
                    self._said.add(unenforced)
                    log.warning("%s (job %s asked)", unenforced, rec.job_id)
                cgroup = self.isolation.prepare(wid, limits)
            except (OSError, ValueError) as e:
                await self._change(wid, state="failed", reason=f"cannot create the workload's cgroup: {e}")
                return
            env = environment.workload_env(self._base_env, rec, wdir)
            if rec.env_from_files:  # secrets from host files: read now, by the agent, into this start only
                try:
                    env.update(await trio.to_thread.run_sync(
                        read_env_files, rec.env_from_files, self.config.env_files_prefixes,
                        self.config.env_file_max_bytes))
                except EnvFileError as e:
                    self.isolation.remove(wid)
                    await self._change(wid, state="failed", reason=str(e))
                    return
            if user.uid != os.geteuid():
                # the agent's HOME and TMPDIR are not the workload user's to write
                env.update({"HOME": str(wdir / "scratch"), "TMPDIR": str(wdir / "scratch"),
                            "USER": user.name, "LOGNAME": user.name})
            cmd = LaunchCommand(dir=str(wdir), argv=list(rec.argv), env=env,
                                cwd=str(cwd or wdir / "scratch"), log_max_bytes=self.config.log_max_bytes,
                                log_keep=self.config.log_keep, record=msgspec.to_builtins(rec),
                                user={"uid": user.uid, "gid": user.gid, "groups": list(user.groups)},
                                cgroup=cgroup, rlimit_core=self.config.rlimit_core, grace_s=rec.grace_s,
                                files=files)
            try:
                ln = await self.pool.launch(cmd)
            except ShimError as e:
                self.isolation.remove(wid)
                await self._change(wid, state="failed", reason=f"launch failed: {e}")
                return
            rec = await self._change(wid, state="running", pid=ln.pid, start_time=ln.start_time,
                                     boot_id=ln.boot_id, shim_pid=ln.shim_pid,
                                     shim_start_time=ln.shim_start_time, started_at=ln.started_at)
            code, reason = await self._wait_exit(wid)
            rec = self._records[wid]
            pol = rec.restart
            if (rec.stop_reason is None and rec.direct and pol.kind == "on-failure" and code != 0
                    and attempt < pol.limit):
                attempt += 1
                self.counters["restarts"] += 1
                await self._change(wid, state="starting", pid=None, restarts=rec.restarts + 1, exit_code=code,
                                   reason=f"restarting after exit code {code}" + (f" ({reason})" if reason else ""))
                with trio.move_on_after(restart_delay_s(pol, attempt)):
                    await rt.stop.wait()
                continue
            await self._finish(wid, code, reason)
            return

    async def _watch(self, wid: str) -> None:
        """An adopted workload: wait for its exit, then record the final state."""
        code, reason = await self._wait_exit(wid)
        await self._finish(wid, code, reason)

    async def _finish(self, wid: str, code: int | None, reason: str | None) -> None:
        rec = self._records[wid]
        if rec.stop_reason is not None:
            await self._change(wid, state=_final_state(rec), exit_code=code, reason=rec.stop_reason)
        else:
            await self._change(wid, state="exited", exit_code=code, reason=reason)

    async def _wait_exit(self, wid: str) -> tuple[int | None, str | None]:
        rec = self._records[wid]
        wdir = self.wl_dir / wid
        await wait_identity(rec.shim_pid, rec.shim_start_time, rec.boot_id)
        procs.reap(rec.shim_pid or 0)  # our child when we launched it: no zombie left behind
        ex = await trio.to_thread.run_sync(_read_json, wdir / "exit.json")
        if ex is not None and ex.get("pid") == rec.pid:
            await self._wait_empty(wid)
            return ex.get("code"), _exit_reason(ex)
        # The shim died without recording an exit (killed): the workload may still run and
        # hold its GPUs, so wait for it too before calling it gone.
        if await wait_identity(rec.pid, rec.start_time, rec.boot_id):
            log.warning("shim gone, waited for the workload itself id=%s pid=%s", wid, rec.pid)
        await self._wait_empty(wid)
        return None, "exit status unknown (the shim is gone)"

    def _members(self, wid: str) -> list[int]:
        rec = self._records[wid]
        return self.isolation.members(wid, (rec.shim_pid, rec.shim_start_time, rec.boot_id),
                                      (rec.pid, rec.start_time, rec.boot_id))

    async def _wait_empty(self, wid: str) -> None:
        """GPUs are free only when no process of the workload is left: wait for its cgroup
        (or, without one, its leader) to be empty, then remove the cgroup."""
        n = 0
        while await trio.to_thread.run_sync(self._members, wid):
            if n % 50 == 0:
                log.info("workload exited but processes remain id=%s", wid)
            n += 1
            await trio.sleep(0.1)
        self.isolation.remove(wid)

    async def _killer(self, wid: str) -> None:
        rec = self._records[wid]
        rt = self._rt[wid]
        wdir = self.wl_dir / wid
        deadline = rec.stop_deadline if rec.stop_deadline is not None else self._clock()
        # the recorded deadline is wall time (it outlives this process); wait for it on trio's clock
        kill_at = on_trio_clock(deadline, self._clock(), trio.current_time())
        shim = (rec.shim_pid, rec.shim_start_time, rec.boot_id)
        leader = (rec.pid, rec.start_time, rec.boot_id)

        # members come from a /proc scan (subreaper mode) or cgroup files: off the event loop
        members: list[int] = await trio.to_thread.run_sync(self._members, wid) if rec.pid else []
        if not rec.term_sent and members:
            notice = {"reason": rec.stop_reason, "deadline": deadline, "grace_s": max(0.0, deadline - self._clock()),
                      "workload_id": wid}
            await trio.to_thread.run_sync(atomic_write, wdir / "preempt-notice.json", json.dumps(notice).encode(), 0o644)
            n = await trio.to_thread.run_sync(self.isolation.signal_all, wid, procs.SIGTERM, shim, leader)
            log.info("SIGTERM sent id=%s processes=%d deadline_in=%.1fs", wid, n, deadline - self._clock())
            await self._change(wid, term_sent=True)

        async def kill() -> None:  # every process still there, whether or not the leader has exited
            n = await trio.to_thread.run_sync(self.isolation.signal_all, wid, procs.SIGKILL, shim, leader)
            if n:
                log.warning("grace period over, SIGKILL id=%s processes=%d", wid, n)

        await kill_after_deadline(kill_at, rt.gone, kill)

    def read_log(self, workload_id: str, *, stream: str = "stdout", tail: int = 100) -> str:
        """The last ``tail`` lines of a workload's stdout or stderr (current file, then rotations)."""
        if stream not in ("stdout", "stderr"):
            raise AgentError("stream must be stdout or stderr")
        wdir = self.wl_dir / self.record(workload_id).workload_id
        return read_tail(wdir, stream, tail, self.config.log_keep)


def workload_limits(agent: dict[str, str], job: dict[str, str], iso: Isolation) -> tuple[dict[str, str], str | None]:
    """One workload's cgroup limits: the agent's, with the job's on top where this host can
    enforce them; and what it cannot enforce (said once per kind by the caller). Pure."""
    if not job:
        return agent, None
    if iso.tree is None:
        return agent, f"job limits {sorted(job)} not enforced: isolation is {iso.mode} (no cgroup)"
    have = {k: v for k, v in job.items() if k.split(".")[0] in iso.tree.controllers}
    missing = sorted(set(job) - set(have))
    return {**agent, **have}, (f"job limits {missing} not enforced: controller not enabled for {iso.tree.parent}"
                               if missing else None)


def _limits(config: SupervisorConfig, iso: Isolation) -> tuple[dict[str, str], list[str]]:
    """The cgroup limits every workload gets, and what cannot be enforced here (pure)."""
    want = {"memory.max": config.memory_max, "cpu.max": config.cpu_max, "pids.max": config.pids_max}
    want = {k: v for k, v in want.items() if v}
    if not want:
        return {}, []
    if iso.tree is None:
        return {}, [f"workload limits {sorted(want)} not enforced: isolation is {iso.mode} (no cgroup)"]
    have = {k: v for k, v in want.items() if k.split(".")[0] in iso.tree.controllers}
    missing = sorted(set(want) - set(have))
    return have, ([f"workload limits {missing} not enforced: controller not enabled for {iso.tree.parent}"]
                  if missing else [])


def _workload_dirs(wdir: Path, user: WorkloadUser) -> None:
    """``<wid>/`` root-owned 0711 (the shim's files in it are 0600); ``<wid>/scratch``
    owned by the workload's user, 0700. Each directory is made with its mode and changed
    only where it differs (a umask, a directory left by an earlier start): on a host whose
    disk is busy with fsyncs every metadata change waits on the filesystem's journal, and
    this runs on the event loop once per pod, before the pod's launch."""
    _dir_with_mode(wdir, 0o711, follow_symlinks=True)
    scratch = wdir / "scratch"
    st = _dir_with_mode(scratch, 0o700, follow_symlinks=False)
    if user.uid != os.geteuid() and (st.st_uid, st.st_gid) != (user.uid, user.gid):
        os.chown(scratch, user.uid, user.gid, follow_symlinks=False)


def _dir_with_mode(path: Path, mode: int, *, follow_symlinks: bool) -> os.stat_result:
    """``path`` a directory with permission bits ``mode`` (made if missing, its parents too); its stat."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    except FileNotFoundError:
        path.mkdir(mode, parents=True, exist_ok=True)
    st = os.stat(path, follow_symlinks=follow_symlinks)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode, follow_symlinks=follow_symlinks)
    return st


def _quantiles(xs: deque[float]) -> dict[str, float]:
    if not xs:
        return {}
    v = sorted(xs)
    return {q: v[min(len(v) - 1, round(f * (len(v) - 1)))] for q, f in (("0.5", 0.5), ("0.9", 0.9), ("0.99", 0.99))}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _exit_reason(ex: Mapping[str, Any]) -> str | None:
    sig = ex.get("signal")
    return f"killed by signal {sig}" if sig else None


def trees_to_remove(materialised: Iterable[str], workloads: Iterable[WorkloadStatus], keep: int) -> list[str]:
    """Which materialised trees to remove (pure). Trees of live workloads (accepted up to
    terminating: their cwd, or about to be) stay; of the others, the ``keep`` most recently
    used by any workload stay; the rest go, oldest first."""
    live: set[str] = set()
    last_use: dict[str, float] = {}
    for w in workloads:
        if not w.manifest_id:
            continue
        if w.state not in TERMINAL_STATES:
            live.add(w.manifest_id)
        last_use[w.manifest_id] = max(last_use.get(w.manifest_id, 0.0), w.updated_at)
    idle = sorted((m for m in materialised if m not in live), key=lambda m: last_use.get(m, 0.0), reverse=True)
    return list(reversed(idle[keep:]))
