"""The placer service's records: jobs, pods, nodes, pushes, and workload naming.

Plain mutable records owned by :class:`placer.state.PlacerState` (nothing else mutates
them). Workload ids name ``<job>.<attempt>.<rank>``, so any report can be traced back to
the attempt it belongs to, after a placer restart too.

Indexes kept here so no input costs a scan of the fleet or the gang:
- ``JobRec.counts``: pods of the current attempt by state, changed only through
  :meth:`JobRec.set_pod_state` (so "all running" or "all exited 0" is one comparison);
- ``NodeRec.pods``: the current-attempt pods placed on that node, by workload id (a full
  report checks only those, fencing a lost node finds its gangs through them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

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
from scheduler_link.messages import workload_id as workload_id  # re-exported (the contract's naming)

from .errors import JobError as JobError  # re-exported (defined in errors.py)

_part_enc = msgspec.msgpack.Encoder()   # the frames' (and msgauth.part_bytes') settings
_EMPTY: list[str] = []                  # (encoded only, never mutated)
JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
TERMINAL_JOB_STATES = frozenset({"succeeded", "failed", "cancelled", "preempted"})
STALE_PRIORITY = 1 << 30


def parse_workload_id(wid: str) -> tuple[str, int, int] | None:
    parts = wid.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


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

    __slots__ = ("node_id", "control_url", "job_id", "attempt", "kind", "_placement", "_pid",
                 "_gang", "_node", "_pods", "_victims")

    def __init__(self, node_id: str, control_url: str, placement: Placement, job_id: str, attempt: int,
                 kind: str) -> None:
        self.node_id = node_id
        self.control_url = control_url
        self.job_id = job_id
        self.attempt = attempt
        self.kind = kind  # "start" (carries the gang's pods) or "stop"
        self._placement: Placement | None = placement
        self._pid = placement.placement_id
        self._gang: GangStart | None = None
        self._node: NodeRec | None = None
        self._pods: list[PodRec] = []
        self._victims: list[Victim] = []

    @classmethod
    def start(cls, gang: GangStart, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> Push:
        """One node's start push of a decision: nothing per node is built until it is read
        (its NodePart by the relays, or its Placement by a direct push)."""
        p = cls.__new__(cls)
        p.node_id = node.node_id
        p.control_url = node.control_url
        p.job_id = gang.job_id
        p.attempt = gang.attempt
        p.kind = "start"
        p._placement = None
        p._pid = gang.prefix + node.node_id
        p._gang, p._node, p._pods, p._victims = gang, node, pods, victims
        return p

    @property
    def placement_id(self) -> str:
        return self._pid

    def part(self, expires_at: float) -> NodePart:
        """This push as a rack relay carries it (a start push names GPU slots and the node's
        inventory hash; a stop push is its victims)."""
        if self._gang is not None and self._node is not None:
            return self._gang.part(self._pid, self._node, self._pods, self._victims)
        pl = self.placement
        return NodePart(placement_id=pl.placement_id, node_id=self.node_id, job_id=self.job_id,
                        attempt=self.attempt, victims=pl.victims, issued_at=pl.issued_at, expires_at=expires_at)

    def part_bytes(self, expires_at: float) -> bytes:
        """``msgauth.part_bytes(self.part(expires_at))``, the bytes a bundle carries, made
        without the NodePart (a start push's, from its gang: see GangStart.part_bytes)."""
        if self._gang is not None and self._node is not None:
            return self._gang.part_bytes(self._pid, self._node, self._pods, self._victims)
        return _part_enc.encode(self.part(expires_at))

    @property
    def placement(self) -> Placement:
        if self._placement is None:
            assert self._gang is not None and self._node is not None
            self._placement = self._gang.placement(self._pid, self._node, self._pods, self._victims)
        return self._placement

    def __repr__(self) -> str:
        return f"Push({self.kind} {self.job_id}#{self.attempt} -> {self.node_id})"


def parts_bytes(pushes: list[Push], expires_at: float) -> list[bytes]:
    """``[p.part_bytes(expires_at) for p in pushes]``, byte for byte, with what a gang's start
    pushes share read once (a rack's bundle is a slice of a round's pushes; its parts are
    encoded in one pass over it, one small encode each: cutting them from one encoding of
    the slice, through ``list[msgspec.Raw]``, measured slower, 0.79 against 0.47 us a part)."""
    enc = _part_enc.encode
    out: list[bytes] = []
    gang: GangStart | None = None
    job_id, attempt, now, expires, n_gang = "", 0, 0.0, 0.0, 0
    contacts: list[Peer] = []
    for p in pushes:
        g = p._gang
        node = p._node
        if g is None or node is None:
            out.append(p.part_bytes(expires_at))
            continue
        if g is not gang:
            gang = g
            job_id, attempt, now, expires, n_gang, contacts = g.job_id, g.attempt, g.now, g.expires, g.n_gang, g.contacts
        pods = p._pods
        out.append(enc([
            "" if pods else p._pid, node.node_id, job_id, attempt, "", WIRE_VERSION,
            [["", q.rank, q.slots, _EMPTY] for q in pods],
            p._victims, now, expires, node._inventory, n_gang, _EMPTY, contacts, b"", None]))
    return out


class GangStart:
    """What every start push of one decision shares (one object, not two closures a node):
    a node's NodePart (rack relays) or Placement (direct push) is made from it on demand."""

    __slots__ = ("spec", "job_id", "attempt", "prefix", "blob_id", "peers_of", "contacts", "n_gang", "now",
                 "expires", "argv", "env")

    def __init__(self, spec: JobSpec, attempt: int, *, blob_id: str, peers_of: Callable[[NodeRec], list[Peer]],
                 contacts: list[Peer], n_gang: int, now: float, expires: float) -> None:
        self.spec = spec
        self.job_id = spec.job_id
        self.attempt = attempt
        self.prefix = start_placement_id(spec.job_id, attempt, "")
        self.blob_id = blob_id
        self.peers_of = peers_of
        self.contacts = contacts
        self.n_gang = n_gang
        self.now = now
        self.expires = expires
        self.argv = list(spec.argv)
        self.env = dict(spec.env)

    def part(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> NodePart:
        # blob_id, the placement id and the workload ids left empty: the bundle's blob, and
        # derived from the job, attempt, node and ranks (scheduler_link.messages.expand_part)
        return NodePart(placement_id="" if pods else placement_id, node_id=node.node_id, job_id=self.job_id,
                        attempt=self.attempt,
                        pods=[PartPod(workload_id="", rank=p.rank, gpu_indices=list(p.slots)) for p in pods],
                        victims=victims, issued_at=self.now, expires_at=self.expires, inventory=node.inventory,
                        gang_nodes=self.n_gang, contacts=self.contacts)

    def part_bytes(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> bytes:
        """The encoding of :meth:`part`'s NodePart, byte for byte, without making it: NodePart
        and PartPod are ``array_like`` (every field, in order, defaults included), so the
        part is the array of its fields' values. A 25,000-node gang's parts were ~4 us each as
        structs (the PartPods, the NodePart, then encoding them), ~a fifth of the placer's
        CPU in building the round's bundles (tests/test_relay_parts.py checks the bytes)."""
        return _part_enc.encode([
            "" if pods else placement_id, node.node_id, self.job_id, self.attempt, "", WIRE_VERSION,
            [["", p.rank, p.slots, _EMPTY] for p in pods],
            victims, self.now, self.expires, node.inventory, self.n_gang, _EMPTY, self.contacts, b"", None])

    def placement(self, placement_id: str, node: NodeRec, pods: list[PodRec], victims: list[Victim]) -> Placement:
        s = self.spec
        return Placement(
            placement_id=placement_id, job_id=s.job_id,
            pods=[PodAssignment(workload_id=p.workload_id, rank=p.rank, gpus=p.uuids, gpu_indices=list(p.slots))
                  for p in pods],
            victims=victims, world_size=s.pods, argv=self.argv, env=self.env, manifest_id=s.manifest_id,
            origin=s.origin, peers=self.peers_of(node), grace_s=s.grace_s, restart=s.restart, issued_at=self.now,
            gang_blob_id=self.blob_id, gang_nodes=self.n_gang, user=s.user, limits=s.limits,
            env_from_files=s.env_from_files)


@dataclass(slots=True)
class PodRec:
    rank: int
    node_id: str
    slots: tuple[int, ...]
    uuids: list[str]            # never mutated: whole-node pods share their node's list
    workload_id: str
    state: str = "placing"
    exit_code: int | None = None
    reason: str | None = None
    timings: dict[str, float] | None = None      # made on the first timed event (most pods: few)
    fetch: dict[str, int] | None = None
    stop_sent: bool = False                      # the placer told it to stop (its end is then no news)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(slots=True)
class JobRec:
    spec: JobSpec
    order: int
    state: str = "pending"
    attempt: int = 0
    restarts: int = 0
    failures: int = 0
    reason: str | None = None
    pods: list[PodRec] = field(default_factory=list)        # by rank once placed
    timings: dict[str, float] = field(default_factory=dict)
    recovering: bool = False
    counts: Counter[str] = field(default_factory=Counter)    # current pods by state
    ok_exits: int = 0                                         # pods exited with code 0
    blob_id: str | None = None                                # the current attempt's gang blob
    rollbacks: int = 0                                        # refused placements so far

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    def set_pods(self, pods: list[PodRec], *, placing: bool = False) -> None:
        """``placing``: every pod is new, in state "placing" (a decision's: counted at once)."""
        self.pods = pods
        if placing:
            self.counts = Counter({"placing": len(pods)}) if pods else Counter()
            self.ok_exits = 0
            return
        self.counts = Counter(p.state for p in pods)
        self.ok_exits = sum(1 for p in pods if p.state == "exited" and p.exit_code == 0) if self.counts["exited"] else 0

    def add_pod(self, pod: PodRec) -> None:
        self.pods.append(pod)
        self.counts[pod.state] += 1
        if pod.state == "exited" and pod.exit_code == 0:
            self.ok_exits += 1

    def set_pod_state(self, pod: PodRec, state: str, exit_code: int | None = None) -> None:
        """The one way a current pod changes state (keeps ``counts`` and ``ok_exits`` true)."""
        if pod.state == "exited" and pod.exit_code == 0:
            self.ok_exits -= 1
        self.counts[pod.state] -= 1
        pod.state, pod.exit_code = state, exit_code
        self.counts[state] += 1
        if state == "exited" and exit_code == 0:
            self.ok_exits += 1

    def move_pods(self, old: str, new: str) -> int:
        """Every current pod in state ``old`` goes to ``new`` (neither "exited"): one pass, the
        counts moved once. Returns how many moved."""
        if old == "exited" or new == "exited":
            raise ValueError("exits carry a code: set_pod_state")
        n = 0
        for p in self.pods:
            if p.state == old:
                p.state = new
                n += 1
        if n:
            self.counts[old] -= n
            self.counts[new] += n
        return n

    @property
    def all_running(self) -> bool:
        return bool(self.pods) and len(self.pods) == self.spec.pods and self.counts["running"] == len(self.pods)

    @property
    def all_succeeded(self) -> bool:
        return bool(self.pods) and self.ok_exits == len(self.pods)

    def live_pods(self) -> list[PodRec]:
        return [p for p in self.pods if p.state not in TERMINAL_STATES]

    def pod_counts(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self.counts.items()) if v}


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
    cordoned: bool = False                            # taken out of service (placer.nodeops)
    draining: bool = False                            # cordoned by a drain
    last_seen: float = 0.0
    lost_since: float | None = None
    manifests: set[str] = field(default_factory=set)
    workloads: dict[str, str] = field(default_factory=dict)   # workload id -> last reported state
    stale: dict[str, tuple[int, ...]] = field(default_factory=dict)  # workload -> slots, to stop
    tell: set[str] = field(default_factory=set)       # stale workloads to name in the next reply
    pods: dict[str, tuple[JobRec, PodRec]] = field(default_factory=dict)  # current pods placed here
    _peer: Peer | None = None
    _inventory: str = ""
    all_slots: tuple[int, ...] = ()                   # (0..n-1), shared by whole-node pods
    all_slots_list: list[int] = field(default_factory=list)

    rack_path: str = ""                               # "zone/block/rack", the relays' key

    def __post_init__(self) -> None:
        # Made once at registration (a node's topology and GPUs change only by registering
        # again, which makes a new record), so a 25,000-node delivery computes none of them.
        self.all_slots = tuple(range(len(self.uuids)))
        self.all_slots_list = list(self.all_slots)
        t = self.topology
        self.rack_path = t.zone + "/" + t.block + "/" + t.rack
        self._inventory = inventory_hash(self.uuids)
        self._peer = Peer(node_id=self.node_id, data_url=self.data_url, zone=t.zone, block=t.block, rack=t.rack)

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
