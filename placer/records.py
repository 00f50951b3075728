"""The placer service's records: jobs, pods, nodes, pushes, and workload naming.

Plain mutable records owned by :class:`placer.state.PlacerState` (nothing else mutates
them). Workload ids name ``<job>.<attempt>.<rank>``, so any report can be traced back to
the attempt it belongs to, after a placer restart too.

Indexes kept here so no input costs a scan of the fleet or the gang:
- ``JobRec.table``: the current attempt's pods as columns (:class:`PodTable`: state codes
  in a bytearray, node, slots, GPUs and rank per row); a :class:`PodRec` is a row's view,
  made only when something asks for that pod (a 25,000-pod gang's decision, pushes and
  acks make none);
- ``JobRec.counts``: pods of the current attempt by state, changed only through
  :meth:`JobRec.set_pod_state` and :meth:`JobRec.move_pods` (so "all running" or "all
  exited 0" is one comparison);
- ``NodeRec.gangs``: the jobs with current-attempt pods on that node (one entry a node, not
  a pod); ``NodeRec.pods`` reads that node's pods by workload id through them (a full
  report checks only those, fencing a lost node finds its gangs through them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgspec
import numpy as np

from scheduler_link.messages import (
    TERMINAL_STATES,
    WIRE_VERSION,
    JobSpec,
    NodePart,
    PartPod,
    Peer,
    Placement,
    PlacementOutcome,
    PodAssignment,
    TopologyPath,
    Victim,
    inventory_hash,
    start_placement_id,
)
from scheduler_link.messages import parse_workload_id as parse_workload_id  # re-exported (its parse)
from scheduler_link.messages import workload_id as workload_id  # re-exported (the contract's naming)

from .errors import ContractError, UnknownJob
from .errors import JobError as JobError  # re-exported (defined in errors.py)

_part_enc = msgspec.msgpack.Encoder()   # the frames' (and msgauth.part_bytes') settings
_EMPTY: list[str] = []                  # (encoded only, never mutated)
NO_VICTIMS: list[Victim] = []           # a start push with no victims' (shared: read, never mutated)
# pieces of a part's encoding (GangPushes.parts_bytes): a one-pod list and a pod's 4-item
# array with its empty workload id; an empty list
_POD_HEAD = _part_enc.encode(["", None, None, None])[:2]
_ONE_POD = _part_enc.encode([None])[:1] + _POD_HEAD
_NO_LIST = _part_enc.encode([])


def _list_head(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items."""
    return _part_enc.encode([None] * n)[:-n] if n else _NO_LIST
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "cancelled", "preempted"})
STALE_PRIORITY = 1 << 30


@dataclass(frozen=True, slots=True)
class Outcome:
    """One node's answer to its start placement."""
    outcome: PlacementOutcome
    refused_gpus: tuple[str, ...] = ()
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "accepted"


ACCEPTED = Outcome("accepted")


class Push:
    """One placement for one node (new pods and/or victims). A decision's start pushes are
    made with :meth:`start`: their Placement or NodePart is built from the decision's
    :class:`GangStart` when first read (by the sender, as it goes), so a decision's
    bookkeeping does not build 25,000 messages before the first one can leave."""

    __slots__ = ("node_id", "control_url", "job_id", "attempt", "kind", "_placement", "placement_id",
                 "_gang", "_node", "_pods_", "_t", "_rows", "_victims", "boot_id")

    def __init__(self, node_id: str, control_url: str, placement: Placement, job_id: str, attempt: int,
                 kind: str, *, boot_id: str = "") -> None:
        self.node_id = node_id
        self.boot_id = boot_id    # a stop's: the node's boot it is meant for (its part names it)
        self.control_url = control_url
        self.job_id = job_id
        self.attempt = attempt
        self.kind = kind  # "start" (carries the gang's pods) or "stop"
        self._placement: Placement | None = placement
        self.placement_id = placement.placement_id
        self._gang: GangStart | None = None
        self._node: NodeRec | None = None
        self._pods_: list[PodRec] | None = []
        self._t: PodTable | None = None
        self._rows: list[int] | int = []     # the node's rows of ``_t`` (an int: its one row)
        self._victims: list[Victim] = []

    @classmethod
    def start(cls, gang: GangStart, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> Push:
        """One node's start push of a decision: nothing per node is built until it is read
        (its NodePart by the relays, or its Placement by a direct push)."""
        p = cls._started(gang, node, victims)
        p._pods_, p._t, p._rows = pods, None, []
        return p

    @classmethod
    def _started(cls, gang: GangStart, node: NodeRec, victims: list[Victim]) -> Push:
        """What every start push of a decision shares (built without __init__: a hot path)."""
        p = cls.__new__(cls)
        p.node_id = node.node_id
        p.control_url = node.control_url
        p.job_id = gang.job_id
        p.attempt = gang.attempt
        p.kind = "start"
        p.boot_id = ""
        p._placement = None
        p.placement_id = gang.prefix + node.node_id
        p._gang, p._node, p._victims = gang, node, victims
        return p

    @property
    def _pods(self) -> list[PodRec]:
        pods = self._pods_
        if pods is None:
            t = self._t
            assert t is not None
            rows = self._rows
            pods = self._pods_ = [t.view(rows)] if isinstance(rows, int) else [t.view(i) for i in rows]
        return pods

    def part(self, expires_at: float) -> NodePart:
        """This push as a rack relay carries it (a start push names GPU slots and the node's
        inventory hash; a stop push is its victims, bound to the node's boot, its job's attempt
        and ``expires_at``)."""
        if self._gang is not None and self._node is not None:
            return self._gang.part(self.placement_id, self._node, self._pods, self._victims)
        pl = self.placement
        return NodePart(placement_id=pl.placement_id, node_id=self.node_id, job_id=self.job_id,
                        attempt=self.attempt, victims=pl.victims, issued_at=pl.issued_at, expires_at=expires_at,
                        boot_id=self.boot_id)

    def direct(self, expires_at: float, epoch: int) -> Placement:
        """This push as a direct push (``POST /v1/placements``) sends it: bound to its node and
        its job's attempt, expiring at ``expires_at``, of placer ``epoch``; a stop names the
        node's boot too (the agent refuses it in another boot or past the expiry, as a stop
        part: a stop replayed later stops nothing)."""
        pl = self.placement
        if not pl.node_id:
            pl = msgspec.structs.replace(pl, node_id=self.node_id, attempt=self.attempt, expires_at=expires_at,
                                         boot_id="" if pl.pods else self.boot_id)
        if pl.epoch != epoch:
            pl = msgspec.structs.replace(pl, epoch=epoch)
        return pl

    def part_bytes(self, expires_at: float) -> bytes:
        """``msgauth.part_bytes(self.part(expires_at))``, the bytes a bundle carries, made
        without the NodePart (a start push's, from its gang: see GangStart.part_bytes)."""
        if self._gang is not None and self._node is not None:
            return self._gang.part_bytes(self.placement_id, self._node, self._pods, self._victims)
        return _part_enc.encode(self.part(expires_at))

    @property
    def placement(self) -> Placement:
        if self._placement is None:
            assert self._gang is not None and self._node is not None
            self._placement = self._gang.placement(self.placement_id, self._node, self._pods, self._victims)
        return self._placement

    def __repr__(self) -> str:
        return f"Push({self.kind} {self.job_id}#{self.attempt} -> {self.node_id})"


def parts_bytes(pushes: Sequence[Push], expires_at: float) -> list[bytes]:
    """``[p.part_bytes(expires_at) for p in pushes]``, byte for byte, with what a gang's start
    pushes share read once (a rack's bundle is a slice of a round's pushes; its parts are
    encoded in one pass over it, one small encode each: cutting them from one encoding of
    the slice, through ``list[msgspec.Raw]``, measured slower, 0.79 against 0.47 us a part).
    A decision's :class:`GangPushes` encode from their columns (:meth:`GangPushes.parts_bytes`)."""
    if isinstance(pushes, GangPushes):
        return pushes.parts_bytes(range(len(pushes)), expires_at)
    enc = _part_enc.encode
    out: list[bytes] = []
    gang: GangStart | None = None
    job_id, attempt, now, expires, n_gang = "", 0, 0.0, 0.0, 0
    for p in pushes:
        g = p._gang
        node = p._node
        if g is None or node is None:
            out.append(p.part_bytes(expires_at))
            continue
        if g is not gang:
            gang = g
            job_id, attempt, now, expires, n_gang = g.job_id, g.attempt, g.now, g.expires, g.n_gang
        t = p._t
        if t is not None:   # (rows of the job's table: no pod view made)
            rows = p._rows
            if rows.__class__ is int:   # (one pod on the node)
                out.append(enc([
                    "", node.node_id, job_id, attempt, "", WIRE_VERSION,
                    [["", t.ranks[rows], t.slots[rows], _EMPTY]],
                    p._victims, now, expires, node._inventory, n_gang, _EMPTY, _EMPTY, b"", None, ""]))
                continue
            ranks, slots = t.ranks, t.slots
            out.append(enc([
                "" if rows else p.placement_id, node.node_id, job_id, attempt, "", WIRE_VERSION,
                [["", ranks[i], slots[i], _EMPTY] for i in rows],   # type: ignore[union-attr]  # (a list here)
                p._victims, now, expires, node._inventory, n_gang, _EMPTY, _EMPTY, b"", None, ""]))
            continue
        pods = p._pods
        out.append(enc([
            "" if pods else p.placement_id, node.node_id, job_id, attempt, "", WIRE_VERSION,
            [["", q.rank, q.slots, _EMPTY] for q in pods],
            p._victims, now, expires, node._inventory, n_gang, _EMPTY, _EMPTY, b"", None, ""]))
    return out


class _Pushes(Sequence[Push]):
    """A read-only sequence of pushes kept as columns: a Push is made (and kept) only for an
    index that is read (:meth:`_at`, given 0 <= i < len)."""

    __slots__ = ()

    @overload
    def __getitem__(self, i: int) -> Push: ...
    @overload
    def __getitem__(self, i: slice) -> list[Push]: ...

    def __getitem__(self, i: int | slice) -> Push | list[Push]:
        if isinstance(i, slice):
            return [self._at(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self._at(i)

    def _at(self, i: int) -> Push:
        raise NotImplementedError


class StopPushes(_Pushes):
    """A decision's stops on nodes given no pod (its victims elsewhere) as columns: each node's
    record, victims and stop placement id. No Placement or Push is made for one unless it is
    read by index or iteration (a direct push); the relays read the columns
    (:meth:`part_bytes`, ``node_ids``, ``placement_ids``). Read only, never changed."""

    __slots__ = ("job_id", "attempt", "issued_at", "recs", "victims", "node_ids", "placement_ids", "_made")

    def __init__(self, job_id: str, attempt: int, issued_at: float, recs: list[NodeRec],
                 victims: list[list[Victim]], placement_ids: list[str]) -> None:
        self.job_id = job_id
        self.attempt = attempt
        self.issued_at = issued_at
        self.recs = recs
        self.victims = victims
        self.node_ids = [n.node_id for n in recs]
        self.placement_ids = placement_ids
        self._made: dict[int, Push] = {}

    def __len__(self) -> int:
        return len(self.recs)

    def _at(self, i: int) -> Push:
        p = self._made.get(i)
        if p is None:
            node = self.recs[i]
            pl = Placement(placement_id=self.placement_ids[i], job_id=self.job_id, victims=self.victims[i],
                           issued_at=self.issued_at)
            p = self._made[i] = Push(node.node_id, node.control_url, pl, self.job_id, self.attempt, "stop",
                                     boot_id=node.boot_id)
        return p

    def part_bytes(self, k: int, expires_at: float) -> bytes:
        """Stop ``k``'s part, byte for byte ``self[k].part_bytes(expires_at)``: a NodePart is
        ``array_like`` (every field, in order, defaults included), so it is the array of its
        fields' values."""
        node = self.recs[k]
        return _part_enc.encode([self.placement_ids[k], node.node_id, self.job_id, self.attempt, "", WIRE_VERSION,
                                 _EMPTY, self.victims[k], self.issued_at, expires_at, "", 0, _EMPTY, _EMPTY, b"",
                                 None, node.boot_id])


class GangPushes(_Pushes):
    """A decision's pushes as columns: its start pushes first (one a node of the gang: the
    node records, the job's table and each node's rows, each node's victims), then ``extra``
    pushes (its victims' stops on nodes given no pod, as :class:`StopPushes`, or any pushes wrapped
    by :meth:`of`).
    No Push is made for a column unless it is read by index or iteration (a direct push, a
    test): the relays read the columns (:meth:`parts_bytes`, ``node_ids``,
    :meth:`placement_ids`, :meth:`counted`). ``runs``: when the start pushes are in topology
    order, their racks (each rack's path and the position where it begins), so a round is
    split by rack without a look at each node. Read only, never changed."""

    __slots__ = ("gang", "recs", "table", "rows", "victims", "extra", "n_cols", "runs", "node_ids", "_made")

    def __init__(self, gang: GangStart | None, recs: list[NodeRec], table: PodTable | None,
                 rows: list[list[int]] | None, victims: list[list[Victim]] | None, extra: Sequence[Push], *,
                 node_ids: list[str] | None = None, runs: tuple[list[str], list[int]] | None = None) -> None:
        self.gang = gang
        self.recs = recs
        self.table = table
        self.rows = rows             # node k's rows of ``table`` (None: one pod a node, node k's in row k)
        self.victims = victims       # node k's victims (None: no victim anywhere)
        self.extra = extra
        self.n_cols = len(recs)
        self.runs = runs
        ids = node_ids if node_ids is not None else [n.node_id for n in recs]
        self.node_ids: list[str] = (ids + (extra.node_ids if isinstance(extra, StopPushes) else [q.node_id for q in extra])
                                    if extra else ids)
        self._made: dict[int, Push] = {}

    @classmethod
    def of(cls, pushes: Sequence[Push]) -> GangPushes:
        """``pushes`` as a GangPushes (a list of Push objects becomes its ``extra``)."""
        return pushes if isinstance(pushes, GangPushes) else cls(None, [], None, None, None, list(pushes))

    def __len__(self) -> int:
        return len(self.node_ids)

    def _at(self, i: int) -> Push:
        if i >= self.n_cols:
            return self.extra[i - self.n_cols]
        p = self._made.get(i)
        if p is None:
            p = self._made[i] = self._make(i)
        return p

    def __iter__(self) -> Iterator[Push]:
        return (self._at(i) for i in range(len(self)))

    def _make(self, k: int) -> Push:
        gang = self.gang
        assert gang is not None
        node = self.recs[k]
        p = Push._started(gang, node, NO_VICTIMS if self.victims is None else self.victims[k])
        p._pods_, p._t, p._rows = None, self.table, k if self.rows is None else self.rows[k]
        return p

    def kind(self, i: int) -> str:
        return "start" if i < self.n_cols else self.extra[i - self.n_cols].kind

    def counted(self) -> np.ndarray:
        """Whether each push is a start push (its outcome decides a round)."""
        out = np.ones(len(self), dtype=bool)
        extra = self.extra
        if isinstance(extra, StopPushes):
            out[self.n_cols:] = False
        elif extra:
            out[self.n_cols:] = [q.kind == "start" for q in extra]
        return out

    def placement_ids(self, idx: Sequence[int]) -> list[str]:
        """The placement ids of pushes ``idx``, from the columns (no Push is made)."""
        n, ids = self.n_cols, self.node_ids
        if self.gang is None:
            return [self[i].placement_id for i in idx]
        prefix = self.gang.prefix   # (a start push's id is the gang's prefix and its node)
        if isinstance(idx, range) and idx.stop <= n and idx.step == 1:
            return [prefix + nid for nid in ids[idx.start:idx.stop]]
        extra = self.extra
        if isinstance(extra, StopPushes):
            stop_ids = extra.placement_ids
            return [prefix + ids[i] if i < n else stop_ids[i - n] for i in idx]
        return [prefix + ids[i] if i < n else extra[i - n].placement_id for i in idx]

    def parts_bytes(self, idx: Sequence[int], expires_at: float) -> list[bytes]:
        """The parts of pushes ``idx`` (a rack's bundle), byte for byte ``parts_bytes`` of those
        pushes: a start push's is its gang's constant pieces around its node's own (id,
        inventory and whole-node slots encoded once at registration, NodeRec), its ranks and
        slots and its victims, joined (no list of 17 fields made and encoded a node)."""
        n = self.n_cols
        gang, t = self.gang, self.table
        if gang is None or t is None:
            return parts_bytes([self[i] for i in idx], expires_at)
        c0, c1, c2, c3 = gang.pieces()
        enc = _part_enc.encode
        ranks, slots, rows_of, victims, recs = t.ranks, t.slots, self.rows, self.victims, self.recs
        join = b"".join
        if rows_of is None and isinstance(idx, range) and idx.step == 1 and idx.stop <= n:
            # a rack of a gang of one pod a node (the common bundle): one comprehension over its
            # slice of the columns
            lo, hi = idx.start, idx.stop
            c1p = c1 + _ONE_POD
            if victims is None:
                c2p = _NO_LIST + _NO_LIST + c2   # (the pod's workload ids, then no victims)
                return [join((c0, r._mp_id, c1p, enc(k), r._mp_slots if sl is r.all_slots else enc(sl), c2p,
                              r._mp_inv, c3))
                        for r, k, sl in zip(recs[lo:hi], ranks[lo:hi], slots[lo:hi], strict=True)]
            return [join((c0, r._mp_id, c1p, enc(k), r._mp_slots if sl is r.all_slots else enc(sl), _NO_LIST,
                          enc(v) if v else _NO_LIST, c2, r._mp_inv, c3))
                    for r, k, sl, v in zip(recs[lo:hi], ranks[lo:hi], slots[lo:hi], victims[lo:hi], strict=True)]
        out: list[bytes] = []
        append = out.append
        extra = self.extra
        stop = extra.part_bytes if isinstance(extra, StopPushes) else None
        for i in idx:
            if i >= n:
                append(stop(i - n, expires_at) if stop is not None else extra[i - n].part_bytes(expires_at))
                continue
            node = recs[i]
            if rows_of is None:
                sl = slots[i]
                pods = _ONE_POD + enc(ranks[i]) + (node._mp_slots if sl is node.all_slots else enc(sl)) + _NO_LIST
            else:
                rows = rows_of[i]
                pods = _list_head(len(rows)) + join([_POD_HEAD + enc(ranks[r]) + enc(slots[r]) + _NO_LIST
                                                     for r in rows])
            append(join((c0, node._mp_id, c1, pods, _NO_LIST if victims is None else enc(victims[i]), c2,
                         node._mp_inv, c3)))
        return out


class GangStart:
    """What every start push of one decision shares (one object, not two closures a node):
    a node's NodePart (rack relays) or Placement (direct push) is made from it on demand."""

    __slots__ = ("spec", "job_id", "attempt", "prefix", "blob_id", "peers_of", "n_gang", "now",
                 "expires", "argv", "env", "read_grant", "_pieces")

    def __init__(self, spec: JobSpec, attempt: int, *, blob_id: str, peers_of: Callable[[NodeRec], list[Peer]],
                 n_gang: int, now: float, expires: float, read_grant: bytes = b"") -> None:
        self.spec = spec
        self.job_id = spec.job_id
        self.attempt = attempt
        self.prefix = start_placement_id(spec.job_id, attempt, "")
        self.blob_id = blob_id
        self.peers_of = peers_of
        self.n_gang = n_gang
        self.now = now
        self.expires = expires
        self.argv = list(spec.argv)
        self.env = dict(spec.env)
        self.read_grant = read_grant   # (in the blob too; a direct push carries it for small gangs)
        self._pieces: tuple[bytes, bytes, bytes, bytes] | None = None

    def pieces(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The encoded pieces every start part of this decision shares, around its node's id,
        its pods and victims, and its inventory (:meth:`part_bytes`' array, cut there): a
        msgpack array is its header then its items' encodings, one after another."""
        p = self._pieces
        if p is None:
            enc = _part_enc.encode
            p = self._pieces = (
                _list_head(17) + enc(""),
                enc(self.job_id) + enc(self.attempt) + enc("") + enc(WIRE_VERSION),
                enc(self.now) + enc(self.expires),
                enc(self.n_gang) + enc(_EMPTY) + enc(_EMPTY) + enc(b"") + enc(None) + enc(""))
        return p

    def part(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> NodePart:
        # blob_id, the placement id and the workload ids left empty: the bundle's blob, and
        # derived from the job, attempt, node and ranks (scheduler_link.messages.expand_part)
        return NodePart(placement_id="" if pods else placement_id, node_id=node.node_id, job_id=self.job_id,
                        attempt=self.attempt,
                        pods=[PartPod(workload_id="", rank=p.rank, gpu_indices=list(p.slots)) for p in pods],
                        victims=victims, issued_at=self.now, expires_at=self.expires, inventory=node.inventory,
                        gang_nodes=self.n_gang)

    def part_bytes(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> bytes:
        """The encoding of :meth:`part`'s NodePart, byte for byte, without making it: NodePart
        and PartPod are ``array_like`` (every field, in order, defaults included), so the
        part is the array of its fields' values. A 25,000-node gang's parts were ~4 us each as
        structs (the PartPods, the NodePart, then encoding them), ~a fifth of the placer's
        CPU in building the round's bundles (tests/test_relay_parts.py checks the bytes)."""
        return _part_enc.encode([
            "" if pods else placement_id, node.node_id, self.job_id, self.attempt, "", WIRE_VERSION,
            [["", p.rank, p.slots, _EMPTY] for p in pods],
            victims, self.now, self.expires, node.inventory, self.n_gang, _EMPTY, _EMPTY, b"", None, ""])

    def placement(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> Placement:
        s = self.spec
        return Placement(
            placement_id=placement_id, job_id=s.job_id,
            pods=[PodAssignment(workload_id=p.workload_id, rank=p.rank, gpus=p.uuids, gpu_indices=list(p.slots))
                  for p in pods],
            victims=victims, world_size=s.pods, argv=self.argv, env=self.env, manifest_id=s.manifest_id,
            origin=s.origin, peers=self.peers_of(node), grace_s=s.grace_s, restart=s.restart, issued_at=self.now,
            gang_blob_id=self.blob_id, gang_nodes=self.n_gang, user=s.user, limits=s.limits,
            env_from_files=s.env_from_files, read_grant=self.read_grant)


# A pod's state as a code (one byte in its job's table). The codes are fixed: "placing",
# "cancelled" and the wire's workload states; any other name is given the next code.
_STATE: list[str] = ["placing", "accepted", "fetching", "starting", "running", "terminating", "exited",
                     "preempted", "failed", "lost", "cancelled"]
_CODE: dict[str, int] = {s: i for i, s in enumerate(_STATE)}
_TERMINAL_CODES = bytes(sorted(_CODE[s] for s in TERMINAL_STATES))


def state_code(state: str) -> int:
    c = _CODE.get(state)
    if c is None:
        if len(_STATE) >= 256:
            raise ContractError(f"too many pod states ({state!r})")
        c = _CODE[state] = len(_STATE)
        _STATE.append(state)
    return c


class PodRec:
    """One pod. A job's current pods live in its :class:`PodTable` (columns, state codes);
    a PodRec is the table's view of one row, made when first asked for (a gang's decision,
    pushes, acks and running events make none). A PodRec made by its constructor stands
    alone until :meth:`JobRec.add_pod` puts it in a table (recovery's adopted pods)."""

    __slots__ = ("rank", "node_id", "slots", "uuids", "workload_id", "exit_code", "reason", "timings", "fetch",
                 "stop_sent", "_t", "_i", "_own")

    def __init__(self, rank: int, node_id: str, slots: tuple[int, ...], uuids: list[str], workload_id: str,
                 state: str = "placing", exit_code: int | None = None, reason: str | None = None,
                 timings: dict[str, float] | None = None, fetch: dict[str, int] | None = None,
                 stop_sent: bool = False) -> None:
        self.rank = rank
        self.node_id = node_id
        self.slots = slots
        self.uuids = uuids            # never mutated: whole-node pods share their node's list
        self.workload_id = workload_id
        self.exit_code = exit_code
        self.reason = reason
        self.timings = timings        # made on the first timed event (most pods: few)
        self.fetch = fetch
        self.stop_sent = stop_sent    # the placer told it to stop (its end is then no news)
        self._t: PodTable | None = None
        self._i = 0
        self._own = state

    @property
    def state(self) -> str:
        t = self._t
        return _STATE[t.codes[self._i]] if t is not None else self._own

    @state.setter
    def state(self, state: str) -> None:
        t = self._t
        if t is None:
            self._own = state
        else:
            t.codes[self._i] = state_code(state)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def __repr__(self) -> str:
        return f"PodRec({self.workload_id} on {self.node_id} {self.state})"


class PodTable:
    """A job's current pods as columns, one row a pod: node, slots, GPUs, rank, and the state
    as a code in a bytearray (so a gang's acks move every pod with one replace, and a count is
    ``bytearray.count``). A decision's table is in rank order (row == rank); recovery's grows
    as pods are adopted, then is sorted. Rows are read as :class:`PodRec` views on demand."""

    __slots__ = ("prefix", "node_ids", "slots", "uuids", "ranks", "codes", "views", "_pos", "_on_node")

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix                        # "<job>.<attempt>." (a decision's workload ids)
        self.node_ids: list[str] = []
        self.slots: list[tuple[int, ...]] = []
        self.uuids: list[list[str]] = []
        self.ranks: list[int] = []
        self.codes = bytearray()
        self.views: list[PodRec | None] = []
        self._pos: dict[int, int] | None = {}      # rank -> row (None: row == rank)
        self._on_node: dict[str, list[int]] | None = None   # node -> rows, made when first asked

    @classmethod
    def decided(cls, prefix: str, node_ids: list[str], slots: list[tuple[int, ...]],
                uuids: list[list[str]]) -> PodTable:
        """A decision's pods, rank r in row r, all "placing": a few list copies, no object a pod."""
        t = cls(prefix)
        n = len(node_ids)
        t.node_ids, t.slots, t.uuids = node_ids, slots, uuids
        t.ranks = list(range(n))
        t.codes = bytearray(n)          # (0: "placing")
        t.views = [None] * n
        t._pos = None
        return t

    def __len__(self) -> int:
        return len(self.codes)

    def view(self, i: int) -> PodRec:
        v = self.views[i]
        if v is None:
            v = PodRec.__new__(PodRec)
            v.rank, v.node_id, v.slots, v.uuids = self.ranks[i], self.node_ids[i], self.slots[i], self.uuids[i]
            v.workload_id = self.prefix + str(v.rank)
            v.exit_code = v.reason = v.timings = v.fetch = None
            v.stop_sent = False
            v._t, v._i, v._own = self, i, ""
            self.views[i] = v
        return v

    def all_views(self) -> list[PodRec]:
        views = self.views
        if None in views:
            view = self.view
            return [v if v is not None else view(i) for i, v in enumerate(views)]
        return views  # type: ignore[return-value]  # (no None left)

    def page(self, offset: int, limit: int) -> list[PodRec]:
        """Rows ``offset`` .. ``offset + limit - 1`` as views (rank order once placed): only
        those rows' views are made, whatever the gang's size (a job's view, its page of pods)."""
        view = self.view
        return [view(i) for i in range(max(0, offset), min(len(self.codes), offset + max(0, limit)))]

    def n_nodes(self) -> int:
        """How many distinct nodes the pods are on (a pass over the node column, no view made)."""
        return len(set(self.node_ids))

    def n_gpus(self) -> int:
        """How many GPUs the pods hold (a pass over the slots column, no view made)."""
        return sum(map(len, self.slots))

    def row_of(self, rank: int) -> int | None:
        pos = self._pos
        if pos is None:
            return rank if 0 <= rank < len(self.codes) else None
        return pos.get(rank)

    def on_node(self, node_id: str) -> list[int]:
        """The rows of the pods on ``node_id`` (the index is made once, on the first ask)."""
        idx = self._on_node
        if idx is None:
            idx = self._on_node = {}
            for i, nid in enumerate(self.node_ids):
                lst = idx.get(nid)
                if lst is None:
                    idx[nid] = [i]
                else:
                    lst.append(i)
        return idx.get(node_id, [])

    def append(self, pod: PodRec) -> None:
        """A standalone pod becomes this table's next row (recovery's adoption)."""
        i = len(self.codes)
        self.node_ids.append(pod.node_id)
        self.slots.append(pod.slots)
        self.uuids.append(pod.uuids)
        self.ranks.append(pod.rank)
        self.codes.append(state_code(pod._own))
        self.views.append(pod)
        if self._pos is None:
            self._pos = {r: k for k, r in enumerate(self.ranks[:-1])}
        self._pos[pod.rank] = i
        idx = self._on_node
        if idx is not None:   # kept, not dropped: a restart adopts one row per report, and every
            lst = idx.get(pod.node_id)   # report reads its node's rows (O(gang) per report, O(gang^2)
            if lst is None:              # a recovery: 131,072 nodes did not re-register in 150 s)
                idx[pod.node_id] = [i]
            else:
                lst.append(i)
        pod._t, pod._i = self, i

    def sort_by_rank(self) -> None:
        views = sorted(self.all_views(), key=lambda p: p.rank)
        self.node_ids = [p.node_id for p in views]
        self.slots = [p.slots for p in views]
        self.uuids = [p.uuids for p in views]
        self.ranks = [p.rank for p in views]
        self.codes = bytearray(self.codes[p._i] for p in views)
        for i, p in enumerate(views):
            p._i = i
        self.views = list(views)
        self._pos = {r: i for i, r in enumerate(self.ranks)}
        self._on_node = None


@dataclass(slots=True)
class JobRec:
    spec: JobSpec
    order: int
    state: str = "pending"
    attempt: int = 0
    restarts: int = 0
    failures: int = 0
    reason: str | None = None
    table: PodTable = field(default_factory=PodTable)       # the current attempt's pods
    timings: dict[str, float] = field(default_factory=dict)
    recovering: bool = False
    counts: Counter[str] = field(default_factory=Counter)    # current pods by state
    ok_exits: int = 0                                         # pods exited with code 0
    blob_id: str | None = None                                # the current attempt's gang blob
    read_grant: bytes = b""                                   # ... and its read grant (infra.grants)
    rollbacks: int = 0                                        # refused placements so far

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def pods(self) -> list[PodRec]:
        """The current pods (by rank once placed), as views of the table: made on this call
        if not yet (not on a gang's hot path: it reads the table). Read it, never change it."""
        return self.table.all_views()

    @property
    def n_pods(self) -> int:
        return len(self.table.codes)

    def set_pods(self, pods: list[PodRec]) -> None:
        """Standalone pods become the job's table (in this order)."""
        t = PodTable(self.table.prefix)
        for p in pods:
            t.append(p)
        self.table = t
        self.counts = Counter(p.state for p in pods)
        self.ok_exits = sum(1 for p in pods if p.state == "exited" and p.exit_code == 0) if self.counts["exited"] else 0

    def set_table(self, table: PodTable) -> None:
        """A decision's table: every pod "placing" (counted without a pass)."""
        self.table = table
        n = len(table.codes)
        self.counts = Counter({"placing": n}) if n else Counter()
        self.ok_exits = 0

    def add_pod(self, pod: PodRec) -> None:
        self.table.append(pod)
        self.counts[pod.state] += 1
        if pod.state == "exited" and pod.exit_code == 0:
            self.ok_exits += 1

    def set_pod_state(self, pod: PodRec, state: str, exit_code: int | None = None) -> None:
        """The one way a current pod changes state (keeps ``counts`` and ``ok_exits`` true)."""
        t = pod._t
        old = _STATE[t.codes[pod._i]] if t is not None else pod._own
        if old == "exited" and pod.exit_code == 0:
            self.ok_exits -= 1
        counts = self.counts
        counts[old] -= 1
        if t is not None:
            t.codes[pod._i] = _CODE[state] if state in _CODE else state_code(state)
        else:
            pod._own = state
        pod.exit_code = exit_code
        counts[state] += 1
        if state == "exited" and exit_code == 0:
            self.ok_exits += 1

    def move_pods(self, old: str, new: str) -> int:
        """Every current pod in state ``old`` goes to ``new`` (neither "exited"): one replace
        over the state codes, the counts moved once. Returns how many moved."""
        if old == "exited" or new == "exited":
            raise ContractError("exits carry a code: set_pod_state")
        t = self.table
        oc, nc = state_code(old), state_code(new)
        n = t.codes.count(oc)
        if n:
            t.codes = t.codes.replace(bytes((oc,)), bytes((nc,)))
            self.counts[old] -= n
            self.counts[new] += n
        return n

    def stop_live(self) -> list[int]:
        """Every live pod of the current attempt (not in a terminal state) moves to
        "terminating", or "cancelled" if it was still "placing", as :meth:`set_pod_state` would
        move them one by one: one translate over the state codes, the counts moved once (a
        preemption over a full fleet stops tens of thousands of pods). Returns their rows."""
        t = self.table
        codes = t.codes
        term = _TERMINAL_CODES
        rows = [i for i, c in enumerate(codes) if c not in term]
        if not rows:
            return rows
        placing, cancelled, terminating = _CODE["placing"], _CODE["cancelled"], _CODE["terminating"]
        table = bytearray(range(256))
        for c in range(len(_STATE)):
            if c not in term:
                table[c] = cancelled if c == placing else terminating
        t.codes = codes.translate(table)
        counts = self.counts
        was_placing = counts["placing"]
        for st in [st for st, n in counts.items() if n and st not in TERMINAL_STATES]:
            counts[st] = 0
        counts["cancelled"] += was_placing
        counts["terminating"] += len(rows) - was_placing
        return rows

    @property
    def all_running(self) -> bool:
        n = len(self.table.codes)
        return n > 0 and n == self.spec.pods and self.counts["running"] == n

    @property
    def all_succeeded(self) -> bool:
        n = len(self.table.codes)
        return n > 0 and self.ok_exits == n

    def live_pods(self) -> list[PodRec]:
        t = self.table
        view, term = t.view, _TERMINAL_CODES
        return [view(i) for i, c in enumerate(t.codes) if c not in term]

    def pod_counts(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self.counts.items()) if v}


class NodePods(Mapping[str, "tuple[JobRec, PodRec]"]):
    """A node's current pods by workload id, read from the tables of the gangs placed on it
    (``NodeRec.gangs``): no entry a pod is kept."""

    __slots__ = ("_node",)

    def __init__(self, node: NodeRec) -> None:
        self._node = node

    def get(self, wid: str, default: Any = None) -> Any:  # (Mapping.get, without a raise and catch)
        node = self._node
        job = node.gangs.get(wid.partition(".")[0])
        if job is not None:   # (a job id has no dot: a decision's rows are found by the prefix)
            t = job.table
            prefix = t.prefix
            if t._pos is None and prefix and wid.startswith(prefix):
                r = wid[len(prefix):]
                if not r.isdigit():
                    return default
                i = int(r)
                if i >= len(t.codes) or t.node_ids[i] != node.node_id:
                    return default
                v = t.views[i]
                if v is None:
                    v = t.view(i)
                return (job, v) if v.workload_id == wid else default
        parsed = parse_workload_id(wid)
        if parsed is None:
            return default
        job = node.gangs.get(parsed[0])
        if job is None or job.attempt != parsed[1]:
            return default
        t = job.table
        row = t.row_of(parsed[2])
        if row is None or t.node_ids[row] != node.node_id:
            return default
        v = t.view(row)
        return (job, v) if v.workload_id == wid else default

    def __getitem__(self, wid: str) -> tuple[JobRec, PodRec]:
        hit = self.get(wid)
        if hit is None:
            raise UnknownJob(f"no current pod {wid} on {self._node.node_id}")
        return hit

    def __contains__(self, wid: object) -> bool:
        return isinstance(wid, str) and self.get(wid) is not None

    def _entries(self) -> list[tuple[JobRec, PodRec]]:
        nid = self._node.node_id
        out = []
        for job in self._node.gangs.values():
            t = job.table
            out += [(job, t.view(i)) for i in t.on_node(nid)]
        return out

    def __iter__(self) -> Iterator[str]:
        return iter([p.workload_id for _, p in self._entries()])

    def __len__(self) -> int:
        nid = self._node.node_id
        return sum(len(job.table.on_node(nid)) for job in self._node.gangs.values())

    def values(self) -> list[tuple[JobRec, PodRec]]:  # type: ignore[override]  # (a list: a snapshot)
        return self._entries()

    def items(self) -> list[tuple[str, tuple[JobRec, PodRec]]]:  # type: ignore[override]
        return [(p.workload_id, (job, p)) for job, p in self._entries()]


@dataclass(slots=True)
class NodeRec:
    node_id: str
    boot_id: str
    last_seq: int
    control_url: str
    data_url: str
    topology: TopologyPath
    nvlink_domain: str | None
    uuids: list[str]
    fatal: set[int] = field(default_factory=set)      # slots the agent reports fatal
    refused: set[int] = field(default_factory=set)    # slots marked unhealthy after a refusal
    host_fatal: bool = False
    degraded: frozenset[int] = frozenset()            # slots the agent reports degraded (the dashboard)
    health_reasons: tuple[str, ...] = ()              # the last snapshot's reason codes (the dashboard)
    simulated: bool = False
    state: str = "up"                                 # up | lost
    silent: bool = False                              # up, silent in a mass silence: no new work (Attempts.tick)
    cordoned: bool = False                            # taken out of service (placer.nodeops)
    draining: bool = False                            # cordoned by a drain
    last_seen: float = 0.0
    lost_since: float | None = None
    manifests: set[str] = field(default_factory=set)
    workloads: dict[str, str] = field(default_factory=dict)   # workload id -> last reported state
    stale: dict[str, tuple[int, ...]] = field(default_factory=dict)  # workload -> slots, to stop
    tell: set[str] = field(default_factory=set)       # stale workloads to name in the next reply
    gangs: dict[str, JobRec] = field(default_factory=dict)   # jobs with current pods here, by id
    _peer: Peer | None = None
    _inventory: str = ""
    all_slots: tuple[int, ...] = ()                   # (0..n-1), shared by whole-node pods
    all_slots_list: list[int] = field(default_factory=list)

    rack_path: str = ""                               # "zone/block/rack", the relays' key
    mac: bytes = b""                                  # its MAC key for boot_id, once derived (Reports.mac_key)
    # its id, inventory hash and whole-node slots as a part encodes them (GangPushes.parts_bytes)
    _mp_id: bytes = b""
    _mp_inv: bytes = b""
    _mp_slots: bytes = b""

    def __post_init__(self) -> None:
        # Made once at registration (a node's topology and GPUs change only by registering
        # again, which makes a new record), so a 25,000-node delivery computes none of them.
        self.all_slots = tuple(range(len(self.uuids)))
        self.all_slots_list = list(self.all_slots)
        t = self.topology
        self.rack_path = t.zone + "/" + t.block + "/" + t.rack
        self._inventory = inventory_hash(self.uuids)
        self._mp_id = _part_enc.encode(self.node_id)
        self._mp_inv = _part_enc.encode(self._inventory)
        self._mp_slots = _slots_bytes(self.all_slots)
        self._peer = Peer(node_id=self.node_id, data_url=self.data_url, zone=t.zone, block=t.block, rack=t.rack)

    @property
    def pods(self) -> NodePods:
        """The current pods placed on this node, by workload id (through ``gangs``)."""
        return NodePods(self)

    def slot_of(self, uuid: str) -> int | None:
        try:
            return self.uuids.index(uuid)
        except ValueError:
            return None

    def peer(self) -> Peer:
        assert self._peer is not None
        return self._peer

    @property
    def inventory(self) -> str:
        """The hash a NodePart's GPU slots are checked against (``inventory_hash``)."""
        return self._inventory


_SLOTS_BYTES: dict[tuple[int, ...], bytes] = {}


def _slots_bytes(slots: tuple[int, ...]) -> bytes:
    """``slots`` encoded, one bytes object per distinct tuple (every 8-GPU node shares one)."""
    b = _SLOTS_BYTES.get(slots)
    if b is None:
        b = _SLOTS_BYTES[slots] = _part_enc.encode(slots)
    return b
