"""Accepted NodeParts on disk: one append-only log under ``<state>/parts`` (agent.parts).

Every batch of part records the acceptor changes is appended as framed records and made
durable with one ``fdatasync`` before an acceptance is answered; records are rewritten whole
(the newest frame of a placement id wins) when a part is handed over or fails, and read back
at start so a restarted agent hands over what it accepted.

Why a log: an ``accepted`` outcome waits for its write. One small file per part written
atomically (temp file, fsync, rename, fsync of the directory) cost two disk flushes per
acceptance, and a rack's members share their hosts' disks with everything else; appending
the batch's frames costs one. A pre-allocated file rewritten in place would also need one
flush, but its slots bound the records and a torn slot loses the record it held; a log only
ever tears its unacknowledged tail.

Format (``parts/parts.log``): frames of ``length`` (4 bytes, big-endian, of what follows
the header), ``crc32`` (4 bytes, of the kind byte and the body), a kind byte (1: a
:class:`PartRecord`, 2: placement ids forgotten, a list of strings), the msgpack body.
Loading stops at the first frame that is short or fails its checksum: a crash mid-append
(never acknowledged, its fdatasync had not returned); :meth:`PartStore.recover` cuts the
file there before anything is appended after it. The log is compacted (every live record
once, written atomically) at start and when it outgrows ``max(COMPACT_MIN_BYTES,
COMPACT_RATIO x the live records' bytes)``. Forgetting (records of parts long handed over)
is appended without a flush of its own: a forgotten record that comes back after a crash is
a finished one, forgotten again. One file per part (``*.part``, the earlier layout) is
still read, and folded into the log by :meth:`PartStore.recover`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import msgspec

from infra.durable import fsync_dir, write_all
from scheduler_link.messages import NodePart, PodAssignment, Victim

from .state import atomic_write, frame, read_frames

log = logging.getLogger("herd.agent.parts")

PART_VERSION = 1

PartState = Literal["accepted", "placed", "failed"]

LOG_NAME = "parts.log"
COMPACT_MIN_BYTES = 256 << 10   # the log is compacted past this size ...
COMPACT_RATIO = 4               # ... and past this many times its live records' bytes
KIND_RECORD, KIND_FORGET = 1, 2


class PartRecord(msgspec.Struct, frozen=True, kw_only=True):
    version: int = PART_VERSION
    part: NodePart
    pods: list[PodAssignment] = []       # with UUIDs
    state: PartState = "accepted"
    accepted_at: float = 0.0
    detail: str | None = None
    # stops that named this part's pods before they were handed over (a rollback that
    # overtook the blob): applied right after the hand-over, so nothing starts again
    stopped: list[Victim] = []


_rec_dec = msgspec.msgpack.Decoder(PartRecord)
_ids_dec = msgspec.msgpack.Decoder(list[str])
_enc = msgspec.msgpack.Encoder()


class PartStore:
    """The part log under ``<state>/parts`` (module docstring). :meth:`load` reads it (any
    time, from any process); the owner calls :meth:`recover` once at start, then
    :meth:`save` and :meth:`remove` (from worker threads: a lock keeps them one at a time)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir) / "parts"
        self.path = self.dir / LOG_NAME
        self.writes = 0          # records written
        self.syncs = 0           # fdatasyncs (one per save)
        self.compactions = 0
        self._fd: int | None = None
        self._size = 0           # the log's bytes
        self._live: dict[str, bytes] = {}   # placement id -> its newest frame
        self._lock = threading.RLock()   # (close() is called inside save and compaction too)

    # ------------------------------------------------------------ reading

    def _read(self) -> tuple[dict[str, tuple[PartRecord, bytes]], int, int, list[Path]]:
        """(live records by placement id with their frames, the log's valid end, its size,
        the legacy per-part files read)."""
        recs: dict[str, tuple[PartRecord, bytes]] = {}
        legacy: list[Path] = []
        if not self.dir.is_dir():
            return recs, 0, 0, legacy
        for p in sorted(self.dir.glob("*.part")):   # the earlier layout, one file per part
            legacy.append(p)
            try:
                r = self._check(_rec_dec.decode(p.read_bytes()))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("part record unreadable, ignored path=%s err=%s", p, e)
                continue
            recs[r.part.placement_id] = (r, frame(KIND_RECORD, _enc.encode(r)))
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return recs, 0, 0, legacy
        frames, end = read_frames(data)
        if end < len(data):
            log.warning("part log: dropping a torn tail path=%s bytes=%d", self.path, len(data) - end)
        for kind, body in frames:
            try:
                if kind == KIND_RECORD:
                    r = self._check(_rec_dec.decode(body))
                    recs[r.part.placement_id] = (r, frame(KIND_RECORD, body))
                elif kind == KIND_FORGET:
                    for pid in _ids_dec.decode(body):
                        recs.pop(pid, None)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:   # (its checksum held: a bug)
                log.error("part log record unreadable, ignored path=%s err=%s", self.path, e)
        return recs, end, len(data), legacy

    @staticmethod
    def _check(r: PartRecord) -> PartRecord:
        if r.version != PART_VERSION:
            raise msgspec.ValidationError(f"part record version {r.version}")
        return r

    def load(self) -> list[PartRecord]:
        """Every live record, the oldest accepted first. Read-only."""
        recs, _, _, _ = self._read()
        return sorted((r for r, _ in recs.values()), key=lambda r: r.accepted_at)

    # ------------------------------------------------------------ writing (the owner's)

    def recover(self) -> list[PartRecord]:
        """At start: :meth:`load`, then the log compacted (a torn tail and the earlier
        layout's files folded away) and opened for appends."""
        with self._lock:
            recs, end, size, legacy = self._read()
            self._live = {pid: f for pid, (_, f) in recs.items()}
            if legacy or end < size or (size and size > sum(len(f) for f in self._live.values())):
                self._compact()
                for p in legacy:
                    p.unlink(missing_ok=True)
            return sorted((r for r, _ in recs.values()), key=lambda r: r.accepted_at)

    def _open(self) -> int:
        """The log's descriptor for appends; a log found with a torn tail (no :meth:`recover`
        ran) is cut at its last whole frame first."""
        if self._fd is not None:
            return self._fd
        created = not self.dir.is_dir()
        self.dir.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if new:   # the file's name durable once (later appends change only its data)
                fsync_dir(self.dir)
                if created:
                    fsync_dir(self.dir.parent)
                self._size = 0
            else:
                recs, end, size, _ = self._read()
                if end < size:
                    os.ftruncate(fd, end)
                    os.fsync(fd)
                self._live.update({pid: f for pid, (_, f) in recs.items() if pid not in self._live})
                self._size = end
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return fd

    def save(self, recs: Sequence[PartRecord]) -> None:
        """Append ``recs`` (each whole) and ``fdatasync``: durable when this returns; raises
        OSError when they could not be written (nothing of them may then be answered)."""
        with self._lock:
            fd = self._open()
            frames = [(r.part.placement_id, frame(KIND_RECORD, _enc.encode(r))) for r in recs]
            buf = b"".join(f for _, f in frames)
            try:
                write_all(fd, buf)
                os.fdatasync(fd)
            except OSError:
                self.close()   # (whatever landed is cut at the next open if it is torn)
                raise
            self._size += len(buf)
            self._live.update(frames)
            self.writes += len(recs)
            self.syncs += 1
            self._maybe_compact()

    def remove(self, placement_ids: Sequence[str]) -> None:
        """Forget these records (appended, not flushed: see the module docstring)."""
        with self._lock:
            gone = [pid for pid in placement_ids if self._live.pop(pid, None) is not None]
            if not gone:
                return
            fd = self._open()
            data = frame(KIND_FORGET, _enc.encode(gone))
            try:
                write_all(fd, data)
            except OSError as e:
                log.error("part log: forgetting not written err=%s", e)
                self.close()
                return
            self._size += len(data)
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        live = sum(len(f) for f in self._live.values())
        if self._size > max(COMPACT_MIN_BYTES, COMPACT_RATIO * live):
            self._compact()

    def _compact(self) -> None:
        """Every live record once, written atomically over the log; appends go on there."""
        self.close()
        data = b"".join(self._live.values())
        atomic_write(self.path, data)   # temp, fsync, rename, fsync of the directory
        self._size = len(data)
        self.compactions += 1
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
