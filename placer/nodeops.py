"""Node operations: cordon, uncordon, drain (operators taking a node out of service).

Theory of operation
-------------------
A *cordoned* node stays up and keeps what runs on it, but the core places nothing new
there: the model's ``node_draining`` bit is set (``set_node_state(..., draining=True)``),
which takes every slot of the node out of ``usable``. ``cordons`` (node id -> reason) is
the truth; ``NodeRec.cordoned`` mirrors it for a node the placer knows, and a full report
(which rebuilds the record) carries it over. Cordons are journaled by the service, so
after a restart they are applied again, also to nodes that have not reported yet.

A *drain* is a cordon, then: the current attempts of the preemptible gangs with live pods
on the node end as ``preempted`` (their restart policy decides: on-preemption requeues
them, placed elsewhere since this node is cordoned); the non-preemptible ones are listed
and left running unless ``force``. The stop pushes may carry the drain's own grace.

Invariants: an uncordoned node's model bit is whatever health says; a cordon never frees
or moves a GPU by itself; every method here is synchronous and takes ``now``.

Rack approvals (``herd node approve NODE --rack zone/block/rack``) pin the rack of a node
whose certificate pins none (placer.relaypolicy): ``rack_pins`` holds them with the
certificates' pins, and :class:`ApprovalFile` keeps them durable in the state dir (written
whole, fsynced, renamed, before the approval is acknowledged; read back at start).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from infra.durable import atomic_write
from infra.tls import parse_rack

from .errors import JournalError
from .records import JobError, JobRec, NodeRec, Push
from .relaypolicy import RackPins
from .statebase import StateBase

log = logging.getLogger("herd.placer.nodeops")


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    """What a drain did: the jobs whose attempts it ended (stopping), the jobs it left
    because they are not preemptible (``left``), and the live workloads still on the node."""
    node_id: str
    stopped: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    workloads: int = 0


class NodeOps(StateBase):
    """Mixin of :class:`placer.state.PlacerState` (first in its bases: it owns ``cordons``)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]  # a mixin passes its bases' arguments through unchanged
        self.cordons: dict[str, str] = {}
        # the racks nodes may register and relay in (placer.relaypolicy)
        self.rack_pins = RackPins(self.counters, require=self.cfg.require_pinned_racks)

    def approve_rack(self, node_id: str, rack: str) -> str | None:
        """Pin ``node_id`` to ``rack`` (an operator's approval; a node need not have reported
        yet). Returns the rack its registration in force names when that differs (it relays
        there no more; its next full report is refused), else None."""
        if (why := approval_problem(node_id, rack)) is not None:
            raise JobError(why)
        self.rack_pins.approve(node_id, rack)
        node = self.nodes.get(node_id)
        log.info("node rack approved node=%s rack=%s registered=%s", node_id, rack,
                 node.rack_path if node is not None else "-")
        return node.rack_path if node is not None and node.rack_path != rack else None

    def _node(self, node_id: str) -> NodeRec:
        node = self.nodes.get(node_id)
        if node is None:
            raise JobError(f"no node {node_id!r}", status=404)
        return node

    def _apply_cordon(self, node: NodeRec) -> None:
        """Make the model agree with ``cordons`` for this node (health kept as it is)."""
        node.cordoned = node.node_id in self.cordons
        if not node.cordoned:
            node.draining = False
        self.model.set_node_state(node.node_id, healthy=node.state == "up" and not node.host_fatal,
                                  draining=node.cordoned)
        self.dirty = True

    def cordon(self, node_id: str, now: float, *, reason: str | None = None, known: bool = True) -> None:
        """Nothing new is placed on the node. ``known=False`` (journal replay) accepts a node
        not reported yet: the cordon applies when it registers."""
        node = self.nodes.get(node_id)
        if node is None and known:
            raise JobError(f"no node {node_id!r}", status=404)
        self.cordons[node_id] = reason or "cordoned"
        if node is not None:
            self._apply_cordon(node)
        log.info("node cordoned node=%s reason=%s", node_id, reason)

    def uncordon(self, node_id: str, now: float, *, known: bool = True) -> None:
        node = self.nodes.get(node_id)
        if node is None and known:
            raise JobError(f"no node {node_id!r}", status=404)
        self.cordons.pop(node_id, None)
        if node is not None:
            self._apply_cordon(node)
        log.info("node uncordoned node=%s", node_id)

    def node_workloads(self, node: NodeRec) -> int:
        """Live workloads on the node: current pods not ended, and stale holders."""
        return sum(1 for _, p in node.pods.values() if not p.terminal) + len(node.stale)

    def drain(self, node_id: str, now: float, *, grace_s: float | None = None, force: bool = False,
              reason: str | None = None) -> tuple[DrainOutcome, list[Push]]:
        """Cordon, then end the attempts of the gangs with live pods here (preemptible ones,
        or all with ``force``). Returns what it did and the stop pushes to carry out."""
        node = self._node(node_id)
        if grace_s is not None and not 0 <= grace_s <= 3600:
            raise JobError("grace_s must be within 0..3600")
        why = reason or f"node {node_id} drained"
        self.cordon(node_id, now, reason=why)
        node.draining = True
        jobs: dict[str, JobRec] = {}
        for job, p in node.pods.values():
            if not p.terminal and job.state in ("placing", "starting", "running"):
                jobs.setdefault(job.job_id, job)
        stopped: list[str] = []
        left: list[str] = []
        pushes: list[Push] = []
        for job in sorted(jobs.values(), key=lambda j: j.job_id):
            if not (job.spec.preemptible or force):
                left.append(job.job_id)
                continue
            stopped.append(job.job_id)
            pushes += self._end_attempt(job, "preempted", now, reason=why)
        if grace_s is not None:
            pushes = [_with_grace(p, grace_s) for p in pushes]
        log.info("node drained node=%s stopped=%d left=%d force=%s", node_id, len(stopped), len(left), force)
        return DrainOutcome(node_id=node_id, stopped=tuple(stopped), left=tuple(left),
                            workloads=self.node_workloads(node)), pushes


def _with_grace(p: Push, grace_s: float) -> Push:
    pl = p.placement
    if not pl.victims:
        return p
    victims = [msgspec.structs.replace(v, grace_s=grace_s) for v in pl.victims]
    return Push(p.node_id, p.control_url, msgspec.structs.replace(pl, victims=victims), p.job_id, p.attempt,
                p.kind, boot_id=p.boot_id)


def approval_problem(node_id: str, rack: str) -> str | None:
    """Why ``rack`` cannot be approved for ``node_id`` (None: it can). Pure."""
    if not node_id or "/" in node_id or len(node_id) > 256:
        return f"bad node id {node_id[:200]!r}"
    if parse_rack(rack) is None:
        return f"not a rack path: {rack[:200]!r} (want zone/block/rack)"
    return None


class _Approvals(msgspec.Struct, frozen=True, kw_only=True):
    version: int = 1
    racks: dict[str, str] = {}          # node id -> zone/block/rack


class ApprovalFile:
    """``<state_dir>/rack-approvals.json``: the operators' rack approvals, one small versioned
    JSON file rewritten whole (temp file, fsync, rename) on each approval."""

    NAME = "rack-approvals.json"

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / self.NAME

    def load(self) -> dict[str, str]:
        try:
            data = msgspec.json.decode(self.path.read_bytes(), type=_Approvals)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise JournalError(f"rack approvals {self.path} are unreadable: {e}") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise JournalError(f"rack approvals {self.path} are unreadable: {e}") from None
        if data.version != 1:
            raise JournalError(f"rack approvals {self.path} have an unknown version {data.version}")
        return {k: v for k, v in data.racks.items() if parse_rack(v) is not None}

    def save(self, racks: dict[str, str]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, msgspec.json.encode(_Approvals(racks=dict(sorted(racks.items())))), 0o600)
        except OSError as e:
            raise JournalError(f"rack approvals not stored in {self.path}: {e}") from None
