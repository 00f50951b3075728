"""The agent's persisted state: every workload record and the acks of accepted placements.

Two files under ``<state-dir>`` (both 0600: they hold every workload's env):

- ``state.json``, a snapshot of every record and ack, rewritten atomically (temp file, fsync,
  rename, fsync of the directory: :func:`infra.durable.atomic_write`);
- ``state.log``, what changed since that snapshot: one :class:`StateDelta` per frame (the
  records that changed, whole; the acks added; the ids forgotten), written and
  ``fdatasync``'d by the supervisor's owner task after each batch of events, before any
  answer that depends on the batch.

Why a log: a batch touches one or a few records, and a placement's ack waits for its write.
Rewriting the whole state (up to ``keep_terminal`` records and 2,000 acks) on every batch
cost milliseconds of encoding and a file plus a directory fsync on that path; writing the
changed records is one small write and one ``fdatasync``.

Why pre-allocated: the log is made as a file of zeros (:data:`PREALLOC_BYTES`, written and
synced with the snapshot, off the ack path) and deltas are written over the zeros in place.
An ``fdatasync`` after an append that grows a file must commit the filesystem's journal (the
file's size changed: on ext4 a journal write and a second device flush, and every other
fsync on the disk queues behind that commit); over blocks already written it flushes the
data alone (the mtime it changes is not needed to read the data back). A delta that runs
past the zeros grows the file by another :data:`PREALLOC_BYTES` of them in the same write.

Format: frames of ``length`` (4 bytes, big-endian, of what follows the header), ``crc32``
(4 bytes, of the kind byte and the body), a kind byte (1: a delta), the delta's JSON
(:func:`frame`; the part log's format, agent.partstore). Reading stops at the first frame
that is short, zero or fails its checksum: the zeros after the last delta, or a write a
crash cut short (never acknowledged: its fdatasync had not returned, and no later write
started before it returned, so nothing acknowledged lies beyond it). A log of JSON lines
(the earlier layout: one delta per line, a torn last line dropped) is still read.

Every delta carries a sequence number greater than every earlier one; the snapshot names the
last one it contains (``AgentState.seq``). Loading reads the snapshot and applies the log's
deltas with a greater number, in order, so a crash between a snapshot and the log's reset
(old deltas left behind) replays nothing twice. The log is compacted into a new snapshot when
its deltas outgrow ``max(COMPACT_MIN_BYTES, COMPACT_RATIO x the last snapshot)`` and at every
start. A snapshot, or a frame whose checksum holds, that does not decode sets both files
aside (``*.bad-<time>``) and the agent starts empty rather than trusting half of them.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from pathlib import Path

import msgspec

# re-exported: the agent's callers import it from here
from infra.durable import atomic_write as atomic_write
from infra.durable import write_all_at as write_all_at
from scheduler_link.messages import TERMINAL_STATES, Peer, PlacementAck, RestartPolicy, WorkloadStatus

log = logging.getLogger("herd.agent.state")

STATE_VERSION = 1


class WorkloadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the agent must remember about one workload across restarts."""
    workload_id: str
    job_id: str
    placement_id: str = ""
    rank: int = 0
    world_size: int = 1
    gpus: list[str] = []
    gpu_indices: list[int] = []
    argv: list[str] = []
    env: dict[str, str] = {}
    manifest_id: str | None = None
    origin: str | None = None
    peers: list[Peer] = []
    gang_blob_id: str | None = None      # the gang's blob (its whole peer table), when it has more peers
    gang_nodes: int = 0
    grace_s: float = 30.0
    restart: RestartPolicy = RestartPolicy()
    direct: bool = False
    wait_for: list[str] = []             # victims that must be gone before this starts
    state: str = "accepted"
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    updated_at: float = 0.0
    # identity of the running process (see agent.procs)
    pid: int | None = None
    start_time: int | None = None
    boot_id: str | None = None
    shim_pid: int | None = None
    shim_start_time: int | None = None
    restarts: int = 0
    # graceful stop, persisted so a restarted agent resumes the countdown
    stop_reason: str | None = None
    stop_preempted: bool = False         # the stop is a preemption: it ends "preempted", else "exited"
    stop_deadline: float | None = None
    term_sent: bool = False
    fetch: dict[str, int] = {}           # this workload's artifact fetch: bytes by source
    limits: dict[str, str] = {}          # the job's cgroup limits (cgroup file -> value)
    user: str | None = None              # the user the placement asked for (None: the default)
    env_from_files: dict[str, str] = {}  # NAME -> host path, read at each start (values never stored)
    run_as: str | None = None            # the user it runs as (resolved at start)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def status(self) -> WorkloadStatus:
        return WorkloadStatus(
            workload_id=self.workload_id, job_id=self.job_id, placement_id=self.placement_id,
            rank=self.rank, world_size=self.world_size, gpus=list(self.gpus), state=self.state,  # type: ignore[arg-type]  # the record's state is a str on disk; every value written is a WorkloadState
            exit_code=self.exit_code, reason=self.reason, manifest_id=self.manifest_id,
            pid=self.pid if not self.terminal else None, created_at=self.created_at,
            started_at=self.started_at, updated_at=self.updated_at, fetch=dict(self.fetch))


class AgentState(msgspec.Struct, frozen=True, kw_only=True):
    version: int = STATE_VERSION
    node_id: str = ""
    records: list[WorkloadRecord] = []
    acks: list[PlacementAck] = []
    seq: int = 0                         # the last delta this snapshot contains (state.log)


class StateDelta(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One batch's changes, one line of ``state.log``: records whole (the newest wins),
    acks added, then the workload ids and placement ids forgotten."""
    seq: int
    records: list[WorkloadRecord] = []
    acks: list[PlacementAck] = []
    forget: list[str] = []
    forget_acks: list[str] = []


COMPACT_MIN_BYTES = 1 << 20   # the log is folded into a new snapshot past this size ...
COMPACT_RATIO = 4             # ... and past this many times the last snapshot's size
PREALLOC_BYTES = 1 << 20      # zeros the log is made of, and grown by when a delta runs past them
KIND_DELTA = 1
MAX_FRAME = 16 << 20          # a length beyond this is a torn or damaged header
_HEAD = struct.Struct(">II")


def frame(kind: int, body: bytes) -> bytes:
    """One log frame: length, crc32, kind, body (the module docstring; agent.partstore's too)."""
    tail = bytes((kind,)) + body
    return _HEAD.pack(len(tail), zlib.crc32(tail)) + tail


def read_frames(data: bytes) -> tuple[list[tuple[int, bytes]], int]:
    """The whole frames at the start of ``data`` as (kind, body), and where they end (a torn,
    damaged or zero frame, and all after it, is left out). Pure."""
    out: list[tuple[int, bytes]] = []
    pos, n = 0, len(data)
    view = memoryview(data)
    while pos + _HEAD.size <= n:
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if length < 1 or length > MAX_FRAME or end > n:
            break
        tail = view[pos + _HEAD.size:end]
        if zlib.crc32(tail) != crc:
            break
        out.append((tail[0], bytes(tail[1:])))
        pos = end
    return out, pos

_decoder = msgspec.json.Decoder(AgentState)
_delta_decoder = msgspec.json.Decoder(StateDelta)
_encoder = msgspec.json.Encoder()


class StateCorrupt(ValueError):
    """A state file or a log line (not the last) that does not decode."""


def apply_delta(records: dict[str, WorkloadRecord], acks: dict[str, PlacementAck], d: StateDelta) -> None:
    """Apply one delta to the records and acks (in place; insertion order kept for acks, the
    oldest first, as the supervisor forgets the oldest). Pure but for the two dicts."""
    for r in d.records:
        records[r.workload_id] = r
    for a in d.acks:
        acks[a.placement_id] = a
    for wid in d.forget:
        records.pop(wid, None)
    for pid in d.forget_acks:
        acks.pop(pid, None)


def read_state(state_dir: str | os.PathLike[str]) -> AgentState:
    """The state as a restarted agent would find it: the snapshot with the log's later deltas
    applied. Read-only (nothing set aside; a torn last line ignored); raises
    :class:`StateCorrupt` when a file does not decode."""
    d = Path(state_dir)
    try:
        data = (d / "state.json").read_bytes()
    except FileNotFoundError:
        st = AgentState()
    else:
        try:
            st = _decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise StateCorrupt(f"state.json: {e}") from None
        if st.version != STATE_VERSION:
            raise StateCorrupt(f"state version {st.version} != {STATE_VERSION}")
    try:
        raw = (d / "state.log").read_bytes()
    except FileNotFoundError:
        return st
    records = {r.workload_id: r for r in st.records}
    acks = {a.placement_id: a for a in st.acks}
    seq = st.seq
    for delta in _log_deltas(raw, d / "state.log"):
        if delta.seq <= seq:
            continue   # already in the snapshot (a crash before the log was reset)
        apply_delta(records, acks, delta)
        seq = delta.seq
    return msgspec.structs.replace(st, records=list(records.values()), acks=list(acks.values()), seq=seq)


def _log_deltas(raw: bytes, path: Path) -> list[StateDelta]:
    """The log's deltas in order (module docstring); raises :class:`StateCorrupt`."""
    if raw[:1] == b"{":
        return _line_deltas(raw, path)
    frames, end = read_frames(raw)
    if raw.count(0, end) != len(raw) - end:
        log.warning("state log: dropping a torn tail path=%s", path)
    out: list[StateDelta] = []
    for i, (kind, body) in enumerate(frames):
        try:
            if kind != KIND_DELTA:
                raise msgspec.ValidationError(f"kind {kind}")
            out.append(_delta_decoder.decode(body))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:   # its checksum held: not a torn write
            raise StateCorrupt(f"state.log frame {i + 1}: {e}") from None
    return out


def _line_deltas(raw: bytes, path: Path) -> list[StateDelta]:
    """The earlier layout: one JSON delta per line, a torn last line dropped."""
    out: list[StateDelta] = []
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(_delta_decoder.decode(line))
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            if i == len(lines) - 1:   # no newline after it: an append a crash cut short
                log.warning("state log: dropping a torn last line path=%s", path)
                break
            raise StateCorrupt(f"state.log line {i + 1}: {e}") from None
    return out


class StateFile:
    """The snapshot and its log (module docstring). One writer: the supervisor's owner task,
    from one worker thread at a time."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir)
        self.path = self.dir / "state.json"
        self.log_path = self.dir / "state.log"
        self.writes = 0          # snapshots written
        self.appends = 0         # deltas appended (each fdatasync'd)
        self.log_bytes = 0       # the log's size since the last snapshot
        self.snapshot_bytes = 0
        self._alloc = 0          # the log's size: its deltas, then zeros
        self._fd: int | None = None

    def load(self) -> AgentState:
        try:
            return read_state(self.dir)
        except StateCorrupt as e:
            stamp = int(time.time())
            for p in (self.path, self.log_path):
                if p.exists():
                    os.replace(p, p.with_name(f"{p.name}.bad-{stamp}"))
            log.error("state unreadable, set aside dir=%s err=%s", self.dir, e)
            return AgentState()

    def save(self, st: AgentState) -> None:
        """A new snapshot (``st.seq``: the last delta it contains), then an empty log: a file
        of zeros, synced, its blocks written (module docstring)."""
        data = _encoder.encode(st)
        atomic_write(self.path, data)
        self.writes += 1
        self.snapshot_bytes = len(data)
        self.close()
        atomic_write(self.log_path, bytes(PREALLOC_BYTES))   # (a crash before this: the old deltas are <= st.seq)
        self._fd = os.open(self.log_path, os.O_WRONLY | os.O_CLOEXEC)
        self.log_bytes = 0
        self._alloc = PREALLOC_BYTES

    def append(self, deltas: list[StateDelta]) -> None:
        """Write ``deltas`` (one frame each) over the log's zeros and ``fdatasync``: durable
        when this returns. Only after :meth:`save` (which makes the log)."""
        assert self._fd is not None, "save() a snapshot first"
        buf = bytearray()
        for d in deltas:
            buf += frame(KIND_DELTA, _encoder.encode(d))
        end = self.log_bytes + len(buf)
        if end > self._alloc:   # past the zeros: more of them after it, in the same write
            grown = end + PREALLOC_BYTES
            buf += bytes(grown - end)
        write_all_at(self._fd, buf, self.log_bytes)
        os.fdatasync(self._fd)
        if end > self._alloc:
            self._alloc = self.log_bytes + len(buf)
        self.appends += len(deltas)
        self.log_bytes = end

    def wants_snapshot(self) -> bool:
        """The log has outgrown its bound (module docstring): fold it into a snapshot next."""
        return self.log_bytes > max(COMPACT_MIN_BYTES, COMPACT_RATIO * self.snapshot_bytes)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
