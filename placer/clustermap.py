"""The fleet map: every node's state and main job in a few bytes each, for the dashboard.

Theory of operation
-------------------
The model holds the fleet in topology order (zone, block, rack, ...), so a map is the
model's rows as they are: one state byte per node, one job index per node, and the
start row of each zone, block and rack. Everything is computed over whole arrays:

- the state of a node (:data:`STATES`, one byte) comes from the model's masks, in this
  precedence: ``lost`` > ``cordoned`` (cordoned or draining) > ``fatal`` (an unhealthy GPU,
  or the host itself) > ``degraded`` (a GPU the agent reports degraded) > ``full`` >
  ``partial`` > ``free`` (by GPUs allocated to any holder, stale ones included). Lost and
  degraded are not in the model's arrays: the caller names those rows (few; a loop over
  them is O(failures), never O(fleet));
- the job of a node is the holder of most of its GPUs: each row of the owner array is
  sorted, run lengths come from running max/min of run starts and ends, and ``argmax``
  picks the longest run (ties: the lowest job index). O(N * G log G), no loop per node;
- job indexes point into the map's job table (the caller's rows, then one row for every
  other holder of GPUs the model knows, such as ``stale:`` holders), so every index
  resolves.

Wire format (version 1, little endian): ``b"HMAP"``, u32 version, u32 header length, the
header (UTF-8 JSON: counts by state, the job table as columns, level names, and where each
array lies), then the arrays, each at a 4-byte aligned offset (a browser views them as typed
arrays without copying): ``state`` u8[N], ``job`` u16[N] (u32 when the table has 65,535 rows
or more; the type's largest value is "no job"), and ``zone``/``block``/``rack`` u32 start rows.
At 131,072 nodes in ~7,000 racks this is ~0.5 MB.

Pure: numpy arrays and plain values in, bytes out; no clocks, no I/O.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np

from .errors import ContractError
from .model import ClusterModel, row_count

__all__ = [
    "MAGIC", "MAP_LEVELS", "STATES", "VERSION", "ClusterMap", "JobRow", "decode", "encode", "fingerprint",
    "node_jobs", "node_states",
]

MAGIC = b"HMAP"
VERSION = 1
STATES: tuple[str, ...] = ("free", "partial", "full", "degraded", "fatal", "lost", "cordoned")
FREE, PARTIAL, FULL, DEGRADED, FATAL, LOST, CORDONED = range(len(STATES))
MAP_LEVELS: tuple[str, ...] = ("zone", "block", "rack")   # the model's first three levels
_HEAD = struct.Struct("<4sII")


@dataclass(frozen=True, slots=True)
class JobRow:
    """One row of the map's job table (what the jobs table of the page shows).
    ``timings``: ms after ``submitted`` by event (decided, pushed, acked, running...);
    ``waiting``: the structured reason a pending job waits (placer.queue), else None."""
    job_id: str
    state: str
    priority: int = 0
    gpus: int = 0                       # asked: pods x gpus_per_pod
    pods: int = 0
    within: str = "any"
    attempt: int = 0
    submitted: float = 0.0              # unix seconds
    timings: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, Any] | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterMap:
    """A decoded map (tests, benchmarks; the page decodes the same bytes in JavaScript)."""
    header: dict[str, Any]
    state: np.ndarray                   # u8 per node, indexes STATES
    job: np.ndarray                     # u16/u32 per node, index into header["jobs"]; none_job: no job
    starts: dict[str, np.ndarray]       # level -> first row of each domain
    none_job: int

    @property
    def job_ids(self) -> list[str]:
        return list(self.header["jobs"]["id"])

    def counts(self) -> dict[str, int]:
        return dict(zip(STATES, np.bincount(self.state, minlength=len(STATES)).tolist(), strict=True))


def node_states(model: ClusterModel, *, lost_rows: Iterable[int] = (), degraded_rows: Iterable[int] = ()
                ) -> np.ndarray:
    """One state byte per node (see the module docstring for the precedence)."""
    n_gpus = model.n_gpus
    N = n_gpus.size
    held = row_count(model.owner >= 0)
    out = np.full(N, PARTIAL, np.uint8)
    out[held == 0] = FREE
    out[(held >= n_gpus) & (n_gpus > 0)] = FULL
    rows = np.fromiter(degraded_rows, np.int64)
    out[rows[(rows >= 0) & (rows < N)]] = DEGRADED
    bad_gpu = (model.slot_exists & ~model.gpu_healthy).any(1)
    out[bad_gpu | ~model.node_healthy] = FATAL
    out[model.node_draining] = CORDONED
    rows = np.fromiter(lost_rows, np.int64)
    out[rows[(rows >= 0) & (rows < N)]] = LOST
    return out


def node_jobs(owner: np.ndarray) -> np.ndarray:
    """Per row of ``owner`` (N x G, -1 free), the owner holding most of the row's slots
    (ties: the lowest index), or -1 where nothing is held. int32, no loop per row. Rows
    held by one owner (or free) are read off at once; only mixed rows are sorted."""
    N, G = owner.shape
    if N == 0 or G == 0:
        return np.full(N, -1, np.int32)
    job = owner[:, 0].astype(np.int32)
    mixed = np.flatnonzero((owner != owner[:, :1]).any(1))
    if mixed.size:
        job[mixed] = _most_held(owner[mixed])
    return job


def _most_held(owner: np.ndarray) -> np.ndarray:
    """:func:`node_jobs` for any rows: sort each row, measure runs, take the longest."""
    N, G = owner.shape
    s = np.sort(owner, axis=1)
    idx = np.arange(G, dtype=np.int32)
    start = np.ones((N, G), bool)
    start[:, 1:] = s[:, 1:] != s[:, :-1]
    end = np.ones((N, G), bool)
    end[:, :-1] = start[:, 1:]
    first = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    last = np.minimum.accumulate(np.where(end, idx, G)[:, ::-1], axis=1)[:, ::-1]
    runs = last - first + 1
    runs[s < 0] = 0
    best = runs.argmax(1)
    rows = np.arange(N)
    job = s[rows, best].astype(np.int32)
    job[runs[rows, best] == 0] = -1
    return job


def _short(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _aligned(parts: list[bytes], size: int) -> int:
    pad = -size % 4
    if pad:
        parts.append(b"\0" * pad)
    return size + pad


def fingerprint(model: ClusterModel, rows: Sequence[JobRow], *, lost_rows: Iterable[int] = (),
                degraded_rows: Iterable[int] = (), extra: Mapping[str, Any] | None = None) -> str:
    """A digest of everything :func:`encode` reads: equal digests, equal maps (the cache key)."""
    h = blake3.blake3()
    h.update(struct.pack("<qq", model.epoch, model.n_gpus.size))
    for a in (model.owner, model.gpu_healthy, model.node_healthy, model.node_draining):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(np.fromiter(lost_rows, np.int64).tobytes())
    h.update(b"|")
    h.update(np.fromiter(degraded_rows, np.int64).tobytes())
    h.update(json.dumps([_row_cols(r) for r in rows], separators=(",", ":")).encode())
    h.update(json.dumps(extra or {}, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()[:16]


def _row_cols(r: JobRow) -> list[Any]:
    return [r.job_id, r.state, r.priority, r.gpus, r.pods, r.within, r.attempt, r.submitted,
            dict(r.timings), dict(r.waiting) if r.waiting is not None else None, r.reason]


_COLS = ("id", "state", "priority", "gpus", "pods", "within", "attempt", "submitted", "timings", "waiting",
         "reason")


def encode(model: ClusterModel, rows: Sequence[JobRow], *, lost_rows: Iterable[int] = (),
           degraded_rows: Iterable[int] = (), extra: Mapping[str, Any] | None = None,
           generation: str = "") -> bytes:
    """The map of ``model`` (which must be built: ``model.needs_rebuild`` false) with the
    job table ``rows`` (holders of GPUs the rows do not name are appended). ``extra``:
    more header fields (fragmentation, the placer's identity), JSON values."""
    lost_rows = list(lost_rows)
    degraded_rows = list(degraded_rows)
    N = model.n_gpus.size
    state = node_states(model, lost_rows=lost_rows, degraded_rows=degraded_rows)
    main = node_jobs(model.owner)
    # the job table: the caller's rows, then every other holder the model knows; the
    # ``stale:<job>.<attempt>.<rank>`` holders of a stopping gang (one per pod: 25,000 after a
    # big preemption) share one row per job, ``stale:<job>``
    table = list(rows)
    by_id = {r.job_id: i for i, r in enumerate(table)}
    lut = np.full(max(int(model.job_active.size), 1), -1, np.int64)
    extra_rows: dict[str, list[int]] = {}           # holder row id -> [table index, priority, GPUs]
    for jid, rec in model.jobs.items():
        i = by_id.get(jid)
        if i is None:
            key = "stale:" + jid[6:].split(".", 1)[0] if jid.startswith("stale:") else jid
            acc = extra_rows.get(key)
            if acc is None:
                acc = extra_rows[key] = [len(table) + len(extra_rows), rec.priority, 0]
            acc[2] += rec.n_gpus
            i = acc[0]
        lut[rec.index] = i
    for key, (_, prio, gpus) in extra_rows.items():
        table.append(JobRow(job_id=key, state="stopping" if key.startswith("stale:") else "holding",
                            priority=prio, gpus=gpus))
    jt = np.uint16 if len(table) < 0xFFFF else np.uint32
    none_job = int(np.iinfo(jt).max)
    job = np.full(N, none_job, jt)
    held = main >= 0
    job[held] = lut[main[held]].astype(jt)
    held_nodes = np.bincount(job[held].astype(np.int64), minlength=len(table))[:len(table)]
    cols: dict[str, list[Any]] = {c: [] for c in _COLS}
    for r in table:
        for c, v in zip(_COLS, _row_cols(r), strict=True):
            cols[c].append(v)
    cols["nodes"] = held_nodes.tolist()           # nodes where the job holds most GPUs
    header: dict[str, Any] = {
        **(extra or {}),                              # (never over the map's own fields)
        "version": VERSION, "generation": generation, "model_epoch": model.epoch, "nodes": N,
        "gpus": int(model.n_gpus.sum()), "gpus_per_node": int(model.n_gpus.max()) if N else 0,
        "states": list(STATES), "counts": np.bincount(state, minlength=len(STATES)).tolist(),
        "jobs": cols, "levels": {}, "arrays": {},
    }
    arrays: list[tuple[str, np.ndarray]] = [("state", state), ("job", job)]
    for li, lv in enumerate(MAP_LEVELS):
        header["levels"][lv] = [_short(n) for n in model.dom_names[li]] if N else []
        arrays.append((lv, np.asarray(model.starts[li] if N else np.zeros(0), np.uint32)))
    # where each array lies: the header's own length moves them, so place them after it;
    # offsets are written with a fixed width so the header's length does not depend on them
    dtypes = {np.dtype(np.uint8): "u1", np.dtype(np.uint16): "u2", np.dtype(np.uint32): "u4"}
    for name, a in arrays:
        header["arrays"][name] = [dtypes[a.dtype], int(a.size), 0]
    first = json.dumps(header, separators=(",", ":")).encode()
    hdr_len = len(first) + len(arrays) * 10 + 8      # an offset has at most 10 digits (u32)
    off = _HEAD.size + hdr_len
    off += -off % 4
    for name, a in arrays:
        header["arrays"][name][2] = off
        off += a.nbytes
        off += -off % 4
    body = json.dumps(header, separators=(",", ":")).encode()
    assert len(body) <= hdr_len, "header estimate too small"
    body += b" " * (hdr_len - len(body))          # JSON allows trailing white space
    parts = [_HEAD.pack(MAGIC, VERSION, len(body)), body]
    size = _aligned(parts, _HEAD.size + len(body))
    for _name, a in arrays:
        parts.append(np.ascontiguousarray(a).tobytes())
        size = _aligned(parts, size + a.nbytes)
    return b"".join(parts)


def decode(raw: bytes) -> ClusterMap:
    """The inverse of :func:`encode` (ValueError on bytes that are not a map)."""
    if len(raw) < _HEAD.size:
        raise ContractError("not a cluster map: too short")
    magic, version, hlen = _HEAD.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise ContractError(f"not a version {VERSION} cluster map")
    header = json.loads(raw[_HEAD.size:_HEAD.size + hlen])
    types = {"u1": np.uint8, "u2": np.uint16, "u4": np.uint32}
    arrays = {}
    for name, (dt, count, off) in header["arrays"].items():
        a = np.frombuffer(raw, types[dt], count, off)
        arrays[name] = a
    jt = arrays["job"].dtype
    return ClusterMap(header, arrays["state"], arrays["job"], {lv: arrays[lv] for lv in MAP_LEVELS},
                      int(np.iinfo(jt).max))
