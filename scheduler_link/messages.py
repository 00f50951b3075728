"""Wire types shared by the agent and the placer (the only place they live).

Every struct is a frozen msgspec Struct; JSON on the wire by default. Top-level
messages carry ``version`` so either side can refuse a format it does not know.
Fields added later must have defaults so older peers keep decoding.

Conventions:
- GPUs are named by UUID; ``index`` rides alongside for display only.
- Times are unix seconds (float) taken by the sender.
- ``simulated`` is carried everywhere a GPU is shown: a simulated GPU is never
  passed off as a real one.
- Fleet scale (the last section): gang blobs, node parts, rack bundles, ack bundles and
  the framed channel's envelope; a placement's outcome is a ``PlacementOutcome``, never
  words in a reason.

It imports nothing of ours but :mod:`infra.peers` (how nodes are named and reached, which the
data plane shares); blake3 is loaded where a blob is hashed.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from operator import attrgetter
from typing import Literal, cast

import msgspec

from infra.peers import Peer as Peer
from infra.peers import PeerTable as PeerTable
from infra.peers import TopologyPath as TopologyPath

WIRE_VERSION = 1

# Workload life cycle (DESIGN.md, Contracts).
WorkloadState = Literal[
    "accepted", "fetching", "starting", "running", "terminating",
    "exited", "preempted", "failed", "lost",
]
TERMINAL_STATES: frozenset[str] = frozenset({"exited", "preempted", "failed", "lost"})

HealthState = Literal["healthy", "degraded", "fatal"]
Within = Literal["any", "zone", "block", "rack", "node", "nvlink"]


# ---------------------------------------------------------------- topology / peers

# ---------------------------------------------------------------- GPUs and health

class HealthReason(msgspec.Struct, frozen=True, kw_only=True):
    """One machine-readable cause of a health state."""
    code: str                       # e.g. "xid:79", "ecc_dbe_volatile", "gpu_lost", "row_remap_failure"
    severity: Literal["fatal", "degraded", "application", "info"]
    gpu: str | None = None          # GPU UUID, None for host-level reasons
    since: float = 0.0
    detail: str = ""


class NvLink(msgspec.Struct, frozen=True, kw_only=True):
    link: int
    active: bool
    remote_pci_bus_id: str | None = None
    remote_type: Literal["gpu", "switch", "unknown"] = "unknown"


class GpuTelemetry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Raw counters and gauges as last read (None = not supported / not read). Fields at their
    default are left off the wire (a decoder fills them in): a full report's snapshot carries
    none (``for_placer``), and a GPU reads a few of these where it reads any."""
    temperature_c: float | None = None
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    power_w: float | None = None
    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    util_pct: float | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    memory_temp_c: float | None = None
    energy_mj: int | None = None            # total since the driver loaded (a counter)
    enc_util_pct: float | None = None
    dec_util_pct: float | None = None
    last_xid: int | None = None
    xid_counts: dict[str, int] = {}
    ecc_dbe_volatile: int | None = None
    ecc_dbe_aggregate: int | None = None
    ecc_sbe_volatile: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    retired_pages: int | None = None
    retired_pages_pending: bool | None = None
    throttle_reasons: int | None = None
    thermal_violation_ns: int | None = None
    power_violation_ns: int | None = None
    pcie_replay: int | None = None
    nvlink_crc_errors: int | None = None
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    recovery_action: int | None = None


# no telemetry (what a full report carries: ``for_placer``); GpuInfo's default, so that a GPU
# without any decodes to this very object
_NO_TELEMETRY = GpuTelemetry()


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    pci_bus_id: str
    serial: str | None = None
    minor_number: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None          # cpulist, e.g. "0-55"
    mig_mode_current: int | None = None
    mig_mode_pending: int | None = None
    nvlinks: list[NvLink] = []
    fabric_cluster_uuid: str | None = None   # NVL72-class: GPUs of one NVLink domain share
    fabric_clique_id: int | None = None      #   cluster uuid + clique id
    fabric_health: str | None = None
    health: HealthState = "healthy"
    reasons: list[HealthReason] = []
    telemetry: GpuTelemetry = _NO_TELEMETRY
    simulated: bool = False


class HostHealth(msgspec.Struct, frozen=True, kw_only=True):
    state: HealthState = "healthy"
    reasons: list[HealthReason] = []
    mem_available_mib: int | None = None
    disk_free_mib: int | None = None
    load1: float | None = None


class GpuSnapshot(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """What a node's GPU backend sees: inventory, topology, health. Reported to the
    placer and served on the agent's status API.

    A snapshot is a value: never changed once made (a new reading is a new object). What is
    derived from it for a full report (:func:`for_placer`, :func:`gpu_inventory`,
    :func:`compact_ok`) is computed once per object and kept on it (``dict=True``: off the
    wire), so an agent that reports the same snapshot again recomputes none of it."""
    version: int = WIRE_VERSION
    hostname: str = ""
    backend: str = "nvml"                    # "nvml" or "simulated:PROFILE"
    simulated: bool = False
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[GpuInfo] = []
    # matrix[i][j] as `nvidia-smi topo -m` prints it: "X", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"
    topology_matrix: list[list[str]] = []
    nvlink_domain: str | None = None         # "<clusterUuid>/<cliqueId>" on NVL72-class hosts
    host: HostHealth = HostHealth()
    taken_at: float = 0.0


def for_placer(snap: GpuSnapshot) -> GpuSnapshot:
    """What of a node's snapshot the placer reads: inventory, health, fabric domains. NVLink
    lists, telemetry and the topology matrix stay on the node (its status API serves them): a
    DGX H100's full report is ~3.4 KB of msgpack where its whole snapshot would be ~12 KB
    (and telemetry at its defaults is left off the wire: ``GpuTelemetry``); 131,072 full
    reports after a placer restart are that much less to read, MAC and decode. Idempotent;
    computed once per snapshot object (the same object each time after)."""
    d = snap.__dict__
    view = d.get("_for_placer")
    if view is None:
        if not snap.topology_matrix and all(not g.nvlinks and g.telemetry == _NO_TELEMETRY for g in snap.gpus):
            view = d["_for_placer"] = _ITSELF   # (a marker, not the object: no reference cycle)
        else:
            gpus = [msgspec.structs.replace(g, nvlinks=[], telemetry=_NO_TELEMETRY) for g in snap.gpus]
            view = d["_for_placer"] = msgspec.structs.replace(snap, gpus=gpus, topology_matrix=[])
            view.__dict__["_for_placer"] = _ITSELF
    return snap if view is _ITSELF else cast(GpuSnapshot, view)


_ITSELF = object()


_BY_INDEX = attrgetter("index")


def gpu_inventory(snap: GpuSnapshot) -> tuple[list[str], str]:
    """A snapshot's GPU inventory as the placer keeps it: the UUIDs in index order, and their
    digest (BLAKE2b-128, hex) with the NVLink domain and whether they are simulated. Equal
    digests: the same GPUs, the same way; what a compact registration names
    (:func:`compact_ok`, ``NodeReport.inventory``). Computed once per snapshot object (the
    list returned is the caller's own)."""
    d = snap.__dict__
    got: tuple[tuple[str, ...], str] | None = d.get("_inventory")
    if got is None:
        uuids = tuple(g.uuid for g in sorted(snap.gpus, key=_BY_INDEX))
        text = "\n".join(uuids) + "\0" + (snap.nvlink_domain or "") + "\0" + ("sim" if snap.simulated else "")
        got = d["_inventory"] = (uuids, hashlib.blake2b(text.encode(), digest_size=16).hexdigest())
    return list(got[0]), got[1]


def compact_ok(snap: GpuSnapshot) -> bool:
    """Whether a full report may leave ``snap`` out and name its inventory instead: every GPU
    and the host healthy with nothing to say (the placer then records them so); anything else
    travels whole. Computed once per snapshot object."""
    d = snap.__dict__
    ok: bool | None = d.get("_compact_ok")
    if ok is None:
        h = snap.host
        ok = d["_compact_ok"] = h.state == "healthy" and not h.reasons and all(
            g.health == "healthy" and not g.reasons for g in snap.gpus)
    return ok


# ---------------------------------------------------------------- workloads

class WorkloadStatus(msgspec.Struct, frozen=True, kw_only=True):
    workload_id: str
    job_id: str
    placement_id: str = ""
    rank: int = 0
    world_size: int = 1
    gpus: list[str] = []                     # UUIDs
    state: WorkloadState = "accepted"
    exit_code: int | None = None
    reason: str | None = None
    manifest_id: str | None = None
    pid: int | None = None
    created_at: float = 0.0
    started_at: float | None = None
    updated_at: float = 0.0
    # its artifact fetch by source (bytes_from_origin, bytes_from_peers, bytes_local), once done:
    # a full report supersedes the events it replaces, so it carries what they did
    fetch: dict[str, int] = {}


class WorkloadEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A state change, reported to the placer at once."""
    workload_id: str
    job_id: str
    state: WorkloadState
    at: float
    exit_code: int | None = None
    reason: str | None = None
    gpus: list[str] = []
    placement_id: str = ""
    # Fetch figures ride on the event that ends "fetching" (bytes by source).
    bytes_from_origin: int | None = None
    bytes_from_peers: int | None = None
    bytes_local: int | None = None


# ---------------------------------------------------------------- placements

class PodAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """One pod of a gang on this node."""
    workload_id: str
    rank: int
    gpus: list[str]                          # UUIDs, checked against the agent's inventory
    gpu_indices: list[int] = []              # display only


class Victim(msgspec.Struct, frozen=True, kw_only=True):
    """A workload to stop before (or while) the new pods start."""
    workload_id: str
    grace_s: float = 30.0
    reason: str = "preempted"
    preempted: bool = False   # a preemption: the workload ends "preempted" (else "exited"); reason is for people
    # a fencing stop that reaches a node through its relay carries the placer's MAC with that
    # node's key (scheduler_link.msgauth.stop_mac): a relay cannot make one up
    mac: bytes = b""
    # the placer epoch that asked for the stop (scheduler_link.epochs; covered by ``mac``): a
    # node that has seen a higher one does not act on it. 0: a placer without epochs
    epoch: int = 0
    # the attempt of the workload's job that the stop is for (the one its id names) and when
    # the stop expires (unix seconds), both covered by ``mac``: an epoch-aware placer sets them on
    # every stop in an answer, and a member refuses a relayed stop past its expiry, for another
    # attempt or without them (scheduler_link.msgauth.stop_binding). 0: not set
    attempt: int = 0
    expires_at: float = 0.0


class ResourceLimits(msgspec.Struct, frozen=True, kw_only=True):
    """A job's per-workload cgroup v2 limits, in cgroup syntax ("" = the agent's default).
    Enforced where the agent runs workloads in cgroups with the controller enabled; elsewhere
    the agent says once that it cannot (DESIGN.md, Security model)."""
    memory_max: str = ""                     # memory.max: bytes with an optional K/M/G/T suffix, or "max"
    cpu_max: str = ""                        # cpu.max: "QUOTA PERIOD" or "max PERIOD" (microseconds)
    pids_max: str = ""                       # pids.max: a count, or "max"

    def problem(self) -> str | None:
        """None when every value is well formed, else what is wrong (one line)."""
        if self.memory_max and not _MEM.fullmatch(self.memory_max):
            return f"memory_max {self.memory_max[:40]!r} is not bytes (e.g. 64G) or 'max'"
        if self.cpu_max and not _CPU.fullmatch(self.cpu_max):
            return f"cpu_max {self.cpu_max[:40]!r} is not 'QUOTA PERIOD' or 'max PERIOD' (microseconds)"
        if self.pids_max and not _PIDS.fullmatch(self.pids_max):
            return f"pids_max {self.pids_max[:40]!r} is not a count or 'max'"
        return None

    def as_files(self) -> dict[str, str]:
        return {k: v for k, v in (("memory.max", self.memory_max), ("cpu.max", self.cpu_max),
                                  ("pids.max", self.pids_max)) if v}


_MEM = re.compile(r"max|[1-9][0-9]{0,18}[KMGT]?")
_CPU = re.compile(r"(max|[1-9][0-9]{0,9}) [1-9][0-9]{0,9}")
_PIDS = re.compile(r"max|[1-9][0-9]{0,9}")


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """never | on-failure(limit) | on-preemption. The agent applies it only to direct placements."""
    kind: Literal["never", "on-failure", "on-preemption"] = "never"
    limit: int = 0
    backoff_s: float = 1.0


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Placer (or operator) -> agent: start pods and/or stop victims, idempotent by placement_id."""
    placement_id: str
    job_id: str
    version: int = WIRE_VERSION
    pods: list[PodAssignment] = []
    victims: list[Victim] = []
    world_size: int = 1
    argv: list[str] = []
    env: dict[str, str] = {}
    manifest_id: str | None = None
    origin: str | None = None
    peers: list[Peer] = []
    grace_s: float = 30.0
    restart: RestartPolicy = RestartPolicy()
    issued_at: float = 0.0
    # the user the pods run as (None: the agent's workloads.user); an agent accepts only
    # users in its workloads.allowed_users (refused_spec otherwise)
    user: str | None = None
    # Fleet scale: the gang's shared part as a GangBlob (id = BLAKE3 of its canonical bytes,
    # served by the placer at GET /v1/gangs/{id}). ``peers`` then lists this node's rack
    # and a few contacts; gangs of up to 64 nodes still list every member.
    gang_blob_id: str | None = None
    gang_nodes: int = 0                      # nodes in the gang (peers may list fewer)
    limits: ResourceLimits = ResourceLimits()  # per-workload cgroup limits (the job's)
    # Binding (identity issue): the node it is for, the job's attempt, and when it stops being
    # valid (the sender's clock). An agent refuses one bound to another node (refused_spec), one
    # past ``expires_at`` or one replaying an attempt it has seen superseded (expired). Empty /
    # -1 / 0: unbound (an operator's direct placement, or an older placer).
    node_id: str = ""
    attempt: int = -1
    expires_at: float = 0.0
    # names of env variables whose values the agent reads at start from files on the host
    # (JobSpec.env_from_files): {NAME: absolute path}; never sent back by any read API
    env_from_files: dict[str, str] = {}
    # the sending placer's epoch (scheduler_link.epochs): a placement from the placer older than
    # the highest epoch the agent has seen is refused ``stale_epoch``. 0: a placer without epochs
    # (refused too once the agent has seen one); an operator's direct placement is not checked
    epoch: int = 0
    # the gang's read grant (GangBlob.read_grant), so that a small gang's node, whose peers list
    # every member, can prove its membership to the contacts without the blob
    read_grant: bytes = b""
    # a stop-only placement from the placer: the boot of the node it is meant for (the boot id of
    # the node's link). The agent acts on it only in that boot and before ``expires_at``, as on a
    # stop part (agent.parts.stop_refusal); an operator's direct placement is not checked
    boot_id: str = ""


# What became of one node's part of a placement. The placer decides on this, never on the
# words of ``reason``: only ``refused_gpus`` marks GPUs unhealthy (those named in
# ``refused_gpus``); ``refused_spec`` (the placement itself is wrong: version, argv, ids)
# and ``expired`` (it arrived after ``expires_at``) fail or requeue the job and never touch
# health; ``unreachable`` (no answer; set by the sender, never by the agent) says nothing
# about the GPUs either; ``stale_epoch`` (it came from a placer older than one the node has
# heard from: a replaced placer) says nothing about the job, the node or its GPUs.
PlacementOutcome = Literal["accepted", "refused_gpus", "refused_spec", "expired", "unreachable", "stale_epoch"]


class PlacementAck(msgspec.Struct, frozen=True, kw_only=True):
    placement_id: str
    node_id: str
    accepted: bool
    reason: str | None = None                # for people; never parsed
    workloads: list[str] = []
    version: int = WIRE_VERSION
    # structured outcome (None from agents older than the contract: read as accepted/refused_spec)
    outcome: PlacementOutcome | None = None
    refused_gpus: list[str] = []             # UUIDs, with outcome == "refused_gpus"

    def effective_outcome(self) -> PlacementOutcome:
        if self.outcome is not None:
            return self.outcome
        return "accepted" if self.accepted else "refused_spec"


class PrefetchRequest(msgspec.Struct, frozen=True, kw_only=True):
    manifest_id: str
    origin: str
    peers: list[Peer] = []
    version: int = WIRE_VERSION


# ---------------------------------------------------------------- reports

class NodeReport(msgspec.Struct, frozen=True, kw_only=True):
    """Agent -> placer. ``full`` at registration (and when the placer asks with 409);
    otherwise a heartbeat carrying only what changed since the last report."""
    node_id: str
    boot_id: str
    seq: int
    full: bool = True
    version: int = WIRE_VERSION
    control_url: str = ""
    data_url: str = ""
    topology: TopologyPath = TopologyPath()
    nvlink_domain: str | None = None
    snapshot: GpuSnapshot | None = None      # full reports, or when GPU health changed
    workloads: list[WorkloadStatus] = []     # full reports: every workload the agent knows
    events: list[WorkloadEvent] = []         # state changes since the last report
    manifests: list[str] | None = None       # complete manifests held (None = unchanged)
    sent_at: float = 0.0
    # the node's keyed-BLAKE3 MAC (scheduler_link.msgauth.report_mac) when a relay forwards it;
    # empty on the node's own connection
    mac: bytes = b""
    # the digest of the node's GPU inventory (gpu_inventory) on a full report. A full report
    # with no ``snapshot`` and a digest is a *compact* registration: "the GPUs you stored under
    # this digest for this boot, all healthy" (placer.inventories); a placer that holds no such
    # inventory answers 409 and the node sends its snapshot. A few hundred bytes instead of ~3.4 KB
    inventory: str = ""

    @property
    def compact(self) -> bool:
        return self.full and self.snapshot is None and bool(self.inventory)


class RevokedList(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The deny-list as the placer signs it (its Ed25519 bundle key, msgauth.revoked_bytes), so
    that a member behind a relay may take it from its relay: the relay cannot add to it, drop
    from it or hand down an older one (``issued_at``: a member takes only a newer list)."""
    issued_at: float
    nodes: list[str] = []
    serials: list[str] = []
    sig: bytes = b""


class ReportReply(msgspec.Struct, frozen=True, kw_only=True):
    """Placer -> agent answer to a report. ``stop`` lists workloads the agent must stop
    (fencing: their gang was placed elsewhere while this node was lost)."""
    ok: bool = True
    need_full: bool = False
    stop: list[Victim] = []
    heartbeat_interval_s: float | None = None
    version: int = WIRE_VERSION
    # tcp://host:port of the placer's framed heartbeat channel, when it serves one
    wire_url: str | None = None
    error: str | None = None                 # why a report was refused (with ok=False)
    # with ok=False: report again no sooner than this (the node waits between half of it and all
    # of it, so a refused crowd comes back spread out); None: its own back-off
    retry_after_s: float | None = None
    # tcp://host:port of this node's rack relay (its members' frames listener), in the answer
    # to a full report, when the rack has one and this node is not it; None: report directly
    relay_url: str | None = None
    # Identity (only in the answer to a full report that came over the node's own connection,
    # never through a relay): the node's MAC key for what relays forward for it (32 bytes),
    # and the placer's Ed25519 public key (32 raw bytes) that signs rack bundles
    mac_key: bytes | None = None
    placer_key: bytes | None = None
    # The deny-list (``herd pki revoke``): node ids and certificate serials (upper-case hex)
    # whose TLS handshakes this node's listeners and clients refuse from now on. None: no
    # news (the node keeps the list it holds); taken only from the node's own connection.
    revoked_nodes: list[str] | None = None
    revoked_serials: list[str] | None = None
    # the answering placer's epoch (scheduler_link.epochs): an answer older than the highest epoch
    # the node has seen is not acted on (its stops dropped, its relay and keys not taken)
    epoch: int = 0
    # in an answer through a relay: the placer's MAC over ``epoch`` in the node's key
    # (scheduler_link.msgauth.epoch_mac), so the member may take the epoch a relay carried
    epoch_mac: bytes = b""
    # the deny-list signed (taken from any answer, a relay's too, when it verifies and is newer);
    # a relay hands down the latest it had from the placer in its answers to members' heartbeats
    revoked_signed: RevokedList | None = None
    # with ``need_full``, from a relay: a placer that follows lacks this node's GPU inventory (it
    # refused a compact registration copied to it), so the next full report carries the snapshot
    send_inventory: bool = False


# ---------------------------------------------------------------- placer API (jobs, nodes, cluster)

JobState = Literal["pending", "placing", "starting", "running", "succeeded", "failed", "cancelled", "preempted"]


class JobSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Operator -> placer ``POST /v1/jobs``: a gang of ``pods x gpus_per_pod``."""
    job_id: str = ""                         # empty: the placer names it
    pods: int = 1
    gpus_per_pod: int = 1
    within: Within = "any"
    priority: int = 0
    preemptible: bool = True
    whole_nodes: bool = False
    manifest_id: str | None = None
    origin: str | None = None
    argv: list[str] = []
    env: dict[str, str] = {}
    # {NAME: absolute path on the host}: the agent reads each file at start into NAME (paths
    # under its workloads.env_files_prefixes, bounded size); for secrets that must not sit in
    # the job (read APIs show env names only, values redacted)
    env_from_files: dict[str, str] = {}
    grace_s: float = 30.0
    user: str | None = None                  # run as this user (agents must list it in allowed_users)
    limits: ResourceLimits = ResourceLimits()  # each pod's cgroup limits (memory.max, cpu.max, pids.max)
    restart: RestartPolicy = RestartPolicy()
    version: int = WIRE_VERSION


class PodView(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    node_id: str
    workload_id: str
    gpus: list[str] = []
    gpu_indices: list[int] = []
    state: str = "placing"
    exit_code: int | None = None
    reason: str | None = None
    # unix seconds by workload state as the agent reported it (accepted, fetching, running, ...)
    timings: dict[str, float] = {}
    # bytes of this pod's artifact fetch by source: bytes_from_origin, bytes_from_peers, bytes_local
    fetch: dict[str, int] = {}


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    """Placer -> operator: a job, its pods and its timings (unix seconds by event name:
    submitted, decided, pushed, acked, running, ended)."""
    job_id: str
    spec: JobSpec
    state: str
    attempt: int = 0
    restarts: int = 0
    reason: str | None = None
    pods: list[PodView] = []
    timings: dict[str, float] = {}
    version: int = WIRE_VERSION
    # Bounded views: ``pods`` is one page (``?pods=offset:limit``); these say what the whole is.
    pod_counts: dict[str, int] = {}          # current attempt's pods by state
    pods_total: int = 0
    pods_offset: int = 0
    nodes_total: int = 0                     # nodes the current attempt's pods are on
    gpus_total: int = 0


class ArtifactUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """Operator -> placer ``POST /v1/jobs/{id}/artifact``: run the job's next attempt on
    another manifest (running pods keep theirs; a preempted or pending job comes back on it)."""
    manifest_id: str
    origin: str | None = None
    version: int = WIRE_VERSION


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    state: str                               # up | lost | fenced
    control_url: str = ""
    data_url: str = ""
    topology: TopologyPath = TopologyPath()
    nvlink_domain: str | None = None
    gpus: int = 0
    free_gpus: int = 0
    unhealthy_gpus: list[int] = []
    workloads: int = 0
    simulated: bool = False
    last_seen: float = 0.0
    cordoned: bool = False                   # an operator took it out of service: nothing new lands here
    draining: bool = False                   # cordoned by a drain whose workloads are not all gone yet


class NodeOp(msgspec.Struct, frozen=True, kw_only=True):
    """Operator -> placer ``POST /v1/nodes/{id}/cordon|uncordon|drain``."""
    reason: str | None = None
    grace_s: float | None = None             # drain: the stop grace (default each job's own)
    force: bool = False                      # drain: stop workloads of non-preemptible jobs too
    version: int = WIRE_VERSION


class RackApproval(msgspec.Struct, frozen=True, kw_only=True):
    """Operator -> placer ``POST /v1/nodes/{id}/approve`` (``herd node approve``): pin the node's
    rack (``zone/block/rack``) where its certificate pins none (placer.relaypolicy)."""
    rack: str
    version: int = WIRE_VERSION


class DefragRequest(msgspec.Struct, frozen=True, kw_only=True):
    max_moves: int = 8
    apply: bool = False


class PrefetchFanout(msgspec.Struct, frozen=True, kw_only=True):
    """Operator -> placer ``POST /v1/prefetch``: preheat a manifest on some nodes, named
    directly or by a topology domain (``level`` in zone|block|rack, ``domain`` its name)."""
    manifest_id: str
    origin: str
    nodes: list[str] = []
    level: str | None = None
    domain: str | None = None
    version: int = WIRE_VERSION


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    error: str
    detail: str | None = None


# ---------------------------------------------------------------- fleet-scale delivery (contracts)
#
# DESIGN.md, "Fleet scale": nothing a node receives grows with the gang, and delivery is a
# tree (placer -> one relay per rack -> the rack's members). These types are that contract;
# control plane II implements the relays on them, the data plane reads the peer table.
#
# - A gang's shared part is a GangBlob, encoded once in canonical msgpack (struct fields
#   in declaration order, map keys sorted: ``encode_gang_blob``), zlib-compressed behind a
#   marker when that is larger than 4 KiB (a 50,000-peer table: ~3 MB -> ~0.3 MB). Its id is
#   the BLAKE3 of the bytes as carried (hex), so any holder can serve it and any receiver
#   verifies it like a chunk; a receiver also checks the decompressed bytes are canonical.
# - Its peer table is columnar and in topology order (zone, block, rack, node): rack r's
#   members are the contiguous rows ``rack_start[r] : rack_start[r+1]``; one row per node of
#   the gang. Column storage keeps a 25,000-node table a few hundred kB and cheap to decode.
# - A node gets a NodePart: its own pods and victims, the blob id, an expiry. A NodePart never
#   grows with the gang. The gang's contacts (up nodes outside it that hold its manifest, the
#   same for every node) are in the blob (version 2), listed once for the whole gang, not in
#   each part; a part refers to them through its blob id, which the bundle's signed header
#   covers, so a relay cannot change them (the blob is verified by its id).
# - A relay receives a RackBundle (the rack's NodeParts, the blob itself or only its id
#   when the relay holds it) and answers one AckBundle with every member's outcome; ``sig``
#   is the placer's Ed25519 signature over the bundle's header (scheduler_link.msgauth).
# - On the framed channel every message travels in a Frame: ``type`` names the payload,
#   ``term`` is the sending placer's epoch (scheduler_link.epochs; 0 from anyone else), ``sig``
#   is empty until identities land. What a receiver acts on is fenced by the authenticated epoch
#   inside the payload (a bundle's signed header, a stop's MAC), which a relay cannot change.

# Version 2 lists the gang's contacts (GangBlob.contacts); the placer makes a version-1 blob,
# byte for byte as before, for a gang with none, so agents that read only version 1 run it. An
# agent refuses a blob of a version it does not read (decode_gang_blob: the part's pods are
# reported failed, naming the version) rather than run it without its contacts.
GANG_BLOB_VERSION = 2
GANG_BLOB_VERSIONS = (1, 2)     # the versions this tree reads
FRAME_VERSION = 1


class _GangBlobV1(msgspec.Struct, frozen=True, kw_only=True):
    """A version-1 gang blob's fields (:class:`GangBlob` without its contacts): what such a
    blob is encoded and checked as."""
    job_id: str
    attempt: int
    version: int = 1
    argv: list[str] = []
    env: dict[str, str] = {}
    manifest_id: str | None = None
    origin: str | None = None
    grace_s: float = 30.0
    restart: RestartPolicy = RestartPolicy()
    world_size: int = 1
    peers: PeerTable = PeerTable()
    user: str | None = None                  # the pods' user (JobSpec.user), checked by each agent
    limits: ResourceLimits = ResourceLimits()  # each pod's cgroup limits (JobSpec.limits)
    env_from_files: dict[str, str] = {}      # JobSpec.env_from_files (names -> host paths)
    # the placer's read grant for the gang's nodes (infra.grants: manifest, expiry, the root
    # over peers.node_ids, signed with its bundle key); empty when no node outside the gang
    # was named to it as a holder of the manifest
    read_grant: bytes = b""


class GangBlob(_GangBlobV1, frozen=True, kw_only=True):
    """The gang-wide part of a placement, shared by every node of the gang. Its ``contacts``
    (version 2; none in a version-1 blob) are up nodes outside the gang that hold its
    manifest, bounded by the placer's ``max_peers``: once here for the whole gang, not in each
    node's part (a node's Placement lists them after its part's own peers:
    agent.parts.build_placement)."""
    version: int = GANG_BLOB_VERSION
    contacts: list[Peer] = []


class PartPod(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """One pod of a NodePart: its rank and GPU slots (UUIDs only where a part has no
    ``inventory``). Positional on the wire: a 25,000-node gang's parts are 25,000 of these.
    ``workload_id`` empty in a bundle: it is :func:`workload_id` of the part's job, attempt
    and this rank (:func:`expand_part` fills it in once the part's signature is checked)."""
    workload_id: str
    rank: int
    gpu_indices: list[int] = []              # slots: positions in the node's inventory, index order
    gpus: list[str] = []                     # UUIDs (only without an inventory hash)


class NodePart(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """What one node of a gang receives. Bounded whatever the gang's size.

    GPUs are named by *slot* (``PartPod.gpu_indices``: positions in the node's inventory in
    GPU index order) plus ``inventory``, a hash of the UUIDs the node last reported in that
    order (:func:`inventory_hash`); ``PartPod.gpus`` is then empty.
    The agent refuses a part whose inventory hash is not its own (``expired``: the placer's
    view of the node is stale, nothing about a GPU is implied), so a slot can never mean a
    GPU the placer did not see. Slots keep a 25,000-node gang's parts under 6 MB where
    UUIDs would take ~15 MB. A part with no pods only stops its victims: it names the node's
boot (``boot_id``) and carries an expiry, and the node acts on it only in that boot, before
then, and only on its own job's pods of its attempt (agent.parts.check_part). Inside a RackBundle a
    part's ``blob_id`` is left empty: it is the bundle's (the relay fills it in for its members).
    A start part (one with pods) may leave ``placement_id`` and its pods' ``workload_id`` empty
    too: they are :func:`start_placement_id` and :func:`workload_id` of its job, attempt, node
    and ranks, fixed by the fields the signature covers (:func:`expand_part`, applied by the
    verifier; ~50 bytes a part, ~2.5 MB of a 50,000-node gang's bundles).
    Positional on the wire (``array_like``): fields are only ever added at the end, with defaults.
    """
    placement_id: str
    node_id: str
    job_id: str
    attempt: int
    blob_id: str = ""                        # BLAKE3 hex of the GangBlob's canonical bytes
    version: int = WIRE_VERSION
    pods: list[PartPod] = []                 # ranks and GPU slots
    victims: list[Victim] = []
    issued_at: float = 0.0
    expires_at: float = 0.0                  # refused as "expired" after this (sender's clock)
    inventory: str = ""                      # inventory_hash of the node's UUIDs the slots index
    gang_nodes: int = 0                      # nodes in the gang
    rack_members: list[Peer] = []            # unused on the relay path: the blob's table has the rack
    contacts: list[Peer] = []                # bounded: a few nodes of other racks (holders of the manifest)
    mac: bytes = b""                         # unused (kept for position: parts are signed, not MACed)
    # set by the relay when it hands the part to a member: what the member needs to check the
    # placer's signature over the bundle the part came in (scheduler_link.msgauth)
    proof: PartProof | None = None
    # a stop-only part: the boot (its link's boot id) of the node the placer meant; the node
    # refuses it in any other boot (agent.parts). Empty in start parts (bound by inventory).
    boot_id: str = ""


class PartProof(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A rack bundle's signed header: the bundle's header is the canonical bytes of
    (rack, blob_id, deliver_by, digests), ``digests`` being the BLAKE3 of each part's canonical
    bytes as it sits in the bundle; the placer signs (Ed25519) the root of a Merkle tree over
    the headers of the bundles it built together (``sig_path``: the header's sibling hashes,
    leaf first; ``sig_index``: its leaf's position). A member checks its part's digest is
    listed, the path leads to a root and the signature over that root holds: one
    verification per batch of bundles, bytes bounded by the rack (scheduler_link.msgauth)."""
    rack: str
    blob_id: str
    deliver_by: float
    digests: list[bytes]
    sig: bytes
    raw: bytes = b""                         # this part's bytes exactly as the bundle carried them
    sig_path: list[bytes] = []
    sig_index: int = 0
    epoch: int = 0                           # the bundle's placer epoch (in the signed header)


def workload_id(job_id: str, attempt: int, rank: int) -> str:
    """The id of rank ``rank``'s pod of a job's attempt (the placer's naming, parsed back by
    :func:`parse_workload_id`)."""
    return f"{job_id}.{attempt}.{rank}"


def parse_workload_id(wid: str) -> tuple[str, int, int] | None:
    """(job id, attempt, rank) of a placer-made workload id; None for any other id."""
    parts = wid.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2])


def start_placement_id(job_id: str, attempt: int, node_id: str) -> str:
    """The placement id of a node's start push of a job's attempt."""
    return f"start:{job_id}:{attempt}:{node_id}"


def expand_part(part: NodePart) -> NodePart:
    """``part`` with the ids a bundle leaves out filled in (a start part's ``placement_id``,
    its pods' ``workload_id``), as a receiver acts on it. Call after checking the signature
    over the part's bytes as carried. A part with no pods must name its placement
    (``msgspec.ValidationError``: nothing in it may be acted on)."""
    if part.placement_id and all(p.workload_id for p in part.pods):
        return part
    if not part.pods:
        raise msgspec.ValidationError("a part without pods must name its placement")
    pods = [p if p.workload_id else msgspec.structs.replace(p, workload_id=workload_id(part.job_id, part.attempt, p.rank))
            for p in part.pods]
    return msgspec.structs.replace(part, placement_id=part.placement_id or start_placement_id(
        part.job_id, part.attempt, part.node_id), pods=pods)


def inventory_hash(uuids: list[str]) -> str:
    """BLAKE2b-64 (hex) of a node's GPU UUIDs in index order: what a NodePart's slots index.
    A consistency check against a stale view (a GPU that fell off the bus, a swapped board),
    not a security boundary: 64 bits are plenty and it costs ~1 us."""
    return hashlib.blake2b("\n".join(uuids).encode(), digest_size=8).hexdigest()


class RackBundle(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Placer -> a rack's relay: the rack's parts of one placement round. The relay answers
    with one AckBundle naming every member it reached before ``deliver_by`` (unix seconds,
    the placer's clock); a member it did not name the placer reaches directly. The blob's
    bytes ride only in the first few bundles of a gang; the others name ``blob_sources``
    (frames listeners of relays that have or are getting it: ask them with ``blob_get``,
    in order, the placer last)."""
    rack: str                                # "zone/block/rack"
    blob_id: str                             # "" when every part only stops victims
    version: int = WIRE_VERSION
    blob: bytes | None = None                # the GangBlob's canonical bytes, unless the relay has it
    blob_sources: list[str] = []             # tcp://host:port of relays to fetch the blob from
    parts: list[NodePart] = []
    deliver_by: float = 0.0
    sig: bytes = b""                         # the placer's Ed25519 signature (scheduler_link.msgauth)
    sig_path: list[bytes] = []               # this bundle's header's Merkle path to the signed root
    sig_index: int = 0                       # and its leaf's position in that tree
    # the placer's epoch, in the signed header: a relay or member that has seen a higher one
    # refuses the bundle (stale_epoch); every part of it is of this epoch
    epoch: int = 0


MAC_LEN = 16   # bytes of a node's MAC (scheduler_link.msgauth)


class NodeOutcome(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    node_id: str
    placement_id: str
    outcome: PlacementOutcome
    refused_gpus: list[str] = []
    detail: str | None = None                # for people; never parsed
    mac: bytes = b""                         # the node's MAC over its outcome (scheduler_link.msgauth)


class AckBundle(msgspec.Struct, frozen=True, kw_only=True):
    """A relay -> the placer: every member's outcome for one RackBundle. The common answer,
    a member that accepted its part as it was (``outcome`` "accepted", no refused GPUs, no
    detail, a MAC), travels as the rack's aggregate: bit ``k`` of ``accepted`` (byte ``k // 8``,
    least significant bit first) says the bundle's ``k``-th part was so accepted, and
    ``macs`` holds those members' MACs (``MAC_LEN`` bytes each, in part order), exactly as
    each member made it over its own outcome (the placer rebuilds that outcome from its own
    part: node, placement id). Any other outcome is a :class:`NodeOutcome` in ``outcomes``."""
    rack: str
    blob_id: str
    version: int = WIRE_VERSION
    outcomes: list[NodeOutcome] = []
    accepted: bytes = b""
    macs: bytes = b""

    def accepted_slots(self) -> list[int]:
        """The parts' positions ``accepted`` names, in order."""
        bits = int.from_bytes(self.accepted, "little")
        out = []
        while bits:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out

    def expanded(self, parts: Sequence[NodePart]) -> list[NodeOutcome]:
        """Every outcome this answer carries for a bundle of ``parts``, as NodeOutcomes (the
        aggregate's first, in part order; positions past the parts are left out)."""
        macs = self.macs
        return [NodeOutcome(node_id=parts[k].node_id, placement_id=parts[k].placement_id, outcome="accepted",
                            mac=macs[j * MAC_LEN:(j + 1) * MAC_LEN])
                for j, k in enumerate(self.accepted_slots()) if k < len(parts)] + list(self.outcomes)


class RackBeat(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A relay -> the placer: its members' empty heartbeats of one interval, in one frame
    (columns). An entry means "alive, nothing to say": a report with events, a snapshot or
    manifests travels as its own ``report`` frame, after the relay has sent that node's
    pending entry, so the placer sees each node's sequence in order. An entry's ``seq`` may
    skip (the relay keeps a member's latest empty heartbeat only: skipped ones said nothing)."""
    rack: str
    node_ids: list[str] = []
    boot_ids: list[str] = []
    seqs: list[int] = []
    sent_at: float = 0.0
    macs: list[bytes] = []                   # each entry's node MAC (msgauth.beat_mac), same order


class RackReports(msgspec.Struct, frozen=True, kw_only=True):
    """A relay -> the placer: several members' content reports in one frame (applied in
    order, answered by one ``replies`` frame: a list of WireReply in the same order)."""
    rack: str
    reports: list[NodeReport] = []


# ---------------------------------------------------------------- enrolment through the rack relay
# (scheduler_link/enroll.py: a member with no MAC key registers through its relay; the relay can
# neither make one up for another node nor read the keys in the answer)

ENROLL_VERSION = 1
ENROLL_KEYED_VERSION = 2   # an Enroll whose key derives from the node's enrolment key, not an ECDH

# Why an enrolment was not taken: a structured outcome, counted by the placer and the relay
EnrollOutcome = Literal[
    "enrolled",          # registered; the answer's ``sealed`` holds the keys
    "malformed",         # did not decode, or its fields do not agree (report of another node/boot)
    "oversized",         # a field over its bound
    "wrong_node",        # the relay's member connection is of another node
    "bad_certificate",   # not a certificate, not a node's, or of another node than it enrols
    "not_from_ca",       # not signed by the cluster CA
    "expired",           # outside its validity period
    "revoked",           # the node or the certificate is on the deny-list
    "bad_mac",           # the MAC does not verify (not made by the holder of the certificate's key)
    "replay",            # its nonce was seen, it is older than the window, or its report is not newer
    "no_tls",            # the placer runs without TLS: no identities to check (register directly)
    "upstream_down",     # the relay has no connection to the placer (it may be restarting): try again
    "unavailable",       # the relay lost its connection meanwhile, or the placer did not answer
    "busy",              # over the connection's enrolment budget at the placer: register directly
    "refused",           # the placer did not take the report (its answer says why)
    "no_master",         # a keyed enrolment to a placer that holds no enrolment master: register directly
]


class PlacerCert(msgspec.Struct, frozen=True, kw_only=True):
    """The placer's TLS certificate (DER), which the cluster CA signed: its public key is the
    placer's static key of the enrolment's ECDH. A relay hands it down; the member checks it."""
    cert: bytes = b""
    error: str | None = None
    outcome: EnrollOutcome | None = None     # why there is no certificate (``upstream_down``, ``no_tls``)
    version: int = ENROLL_VERSION
    dialling: bool = False                   # upstream_down: the relay's first dial is under way (relayhold)


class Enroll(msgspec.Struct, frozen=True, kw_only=True):
    """A member -> its relay -> the placer: register ``node_id`` (boot ``boot_id``) with its
    full report, authenticated by the holder of ``cert``'s private key (a MAC under a key
    derived from ECDH with the placer's static key; scheduler_link.enroll) or, ``version``
    ENROLL_KEYED_VERSION, of the enrolment key issued with the certificate whose fields it
    carries instead (``serial`` .. ``rack``). ``report`` is the
    encoded full report (msgpack) as the member made it: MACed byte for byte, decoded only
    once the MAC verifies."""
    node_id: str
    boot_id: str
    nonce: bytes
    at: float                                # the member's unix time when it made it
    cert: bytes                              # the member's certificate, DER
    report: msgspec.Raw = msgspec.Raw(b"\xc0")
    mac: bytes = b""
    version: int = ENROLL_VERSION
    # keyed (ENROLL_KEYED_VERSION): no ``cert``, but the fields of it that its enrolment key is
    # bound to (infra.pki.enrol_key): a relay or the node that changes one changes the key
    serial: str = ""
    not_before: int = 0
    not_after: int = 0
    rack: str | None = None


class EnrollAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """The placer -> the relay -> the member. ``sealed``: the member's MAC key and the
    placer's signing key, sealed (ChaCha20-Poly1305) under a key only the member and the
    placer can derive; ``reply``: the rest of the registration's answer, without keys (read
    as a relayed answer: nothing in it is trusted beyond what a relay may change)."""
    node_id: str
    outcome: EnrollOutcome = "enrolled"
    detail: str | None = None
    sealed: bytes = b""
    reply: ReportReply | None = None
    version: int = ENROLL_VERSION


class EnrollSecret(msgspec.Struct, frozen=True, kw_only=True):
    """What ``EnrollAnswer.sealed`` opens to (msgpack inside the AEAD)."""
    node_id: str
    boot_id: str
    mac_key: bytes
    placer_key: bytes
    version: int = ENROLL_VERSION


class RackEnrolls(msgspec.Struct, frozen=True, kw_only=True):
    """A relay -> the placer: several members' enrolments in one frame (answered by one
    ``enrolls_reply`` frame: a list of EnrollAnswer in the same order)."""
    rack: str
    enrolls: list[Enroll] = []
    version: int = ENROLL_VERSION


class NodeStop(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    stop: list[Victim] = []


class RackBeatReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The placer's answer to a RackBeat: only the exceptions. ``need_full``: members whose
    entry did not fit (unknown node, another boot, an old seq) and must send a full report;
    ``stop``: fencing stops for members (what a ReportReply's ``stop`` would carry)."""
    need_full: list[str] = []
    stop: list[NodeStop] = []
    heartbeat_interval_s: float | None = None
    epoch: int = 0                           # the answering placer's epoch (scheduler_link.epochs)
    revoked_signed: RevokedList | None = None   # the deny-list, for the relay to hand to its members


class BlobRequest(msgspec.Struct, frozen=True, kw_only=True):
    blob_id: str


class BlobReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    blob_id: str
    data: bytes | None = None                # canonical bytes (the receiver checks the id)
    error: str | None = None


class RelayHello(msgspec.Struct, frozen=True, kw_only=True):
    """What a node says when it opens a frames connection (inside the framed channel's
    hello): the racks it may relay for, and where its members reach it."""
    racks: list[str] = []                    # "zone/block/rack" paths ([] : a plain member)
    listen_url: str | None = None            # tcp://host:port of its members' frames listener


FrameType = Literal["hello", "report", "reply", "bundle", "acks", "placement", "ack", "blob", "error",
                    "beat", "beat_reply", "part", "blob_get", "ping", "reports", "replies",
                    "enroll_key", "placer_cert", "enroll", "enrolled", "enrolls", "enrolls_reply"]


class Frame(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The framed channel's envelope (both directions; msgpack on frames connections).
    ``id`` numbers a request that wants an answer (0: none wanted); an answer carries the
    request's number in ``re``. Either side may send requests."""
    type: FrameType
    payload: msgspec.Raw = msgspec.Raw(b"\xc0")
    term: int = 0                            # the sending placer's epoch (0: none, or not a placer)
    sig: bytes = b""                         # empty until identities land
    version: int = FRAME_VERSION
    id: int = 0
    re: int = 0


_blob_encoder = msgspec.msgpack.Encoder(order="deterministic")
_blob_decoder = msgspec.msgpack.Decoder(GangBlob)


BLOB_ZLIB_MAGIC = b"\x00herd-blob-zlib\x00"  # (a canonical msgpack GangBlob, a map, never starts with 0x00)
BLOB_COMPRESS_MIN = 4096                    # smaller blobs travel as plain canonical msgpack
MAX_BLOB_BYTES = 256 << 20                  # a decompressed blob's bound (a 1M-GPU gang's is ~25 MB)


def encode_gang_blob(blob: GangBlob) -> tuple[str, bytes]:
    """(id, bytes): the canonical msgpack, zlib-compressed (level 1: ~3 ms a MB here, once per
    gang; ~8x on a peer table's regular names and addresses) behind ``BLOB_ZLIB_MAGIC`` when
    it is at least ``BLOB_COMPRESS_MIN`` bytes. The id is the BLAKE3 hex of exactly these bytes.
    A blob with no contacts is encoded as version 1 (the bytes it had before version 2)."""
    import blake3

    raw = _blob_encoder.encode(msgspec.structs.replace(blob, version=GANG_BLOB_VERSION) if blob.contacts
                               else _as_v1(blob))
    if len(raw) >= BLOB_COMPRESS_MIN:
        raw = BLOB_ZLIB_MAGIC + zlib.compress(raw, 1)
    return blake3.blake3(raw).hexdigest(), raw


def decode_gang_blob(raw: bytes, blob_id: str | None = None) -> GangBlob:
    """Decode a gang blob (version 1 or 2, as this version's GangBlob); with ``blob_id``,
    refuse bytes that do not hash to it and blobs that are not canonical (re-encoding the
    msgpack, decompressed first where it is compressed, must give it back exactly). A
    compressed blob that inflates past ``MAX_BLOB_BYTES`` or has bytes after its zlib stream
    is refused before it is decoded."""
    import blake3

    if blob_id is not None and blake3.blake3(raw).hexdigest() != blob_id:
        raise ValueError(f"gang blob does not match its id {blob_id[:16]}")
    body = raw
    if raw[:1] == b"\x00":
        if not raw.startswith(BLOB_ZLIB_MAGIC):
            raise ValueError("gang blob has an unknown encoding marker")
        z = zlib.decompressobj()
        try:
            body = z.decompress(memoryview(raw)[len(BLOB_ZLIB_MAGIC):], MAX_BLOB_BYTES)
        except zlib.error as e:
            raise ValueError(f"gang blob does not decompress: {e}") from None
        if z.unconsumed_tail:
            raise ValueError(f"gang blob inflates past {MAX_BLOB_BYTES} bytes")
        if not z.eof or z.unused_data:
            raise ValueError("gang blob's zlib stream is truncated or has trailing bytes")
    blob = _blob_decoder.decode(body)
    if blob.version not in GANG_BLOB_VERSIONS:
        raise ValueError(f"unsupported gang blob version {blob.version} (versions read: "
                         f"{', '.join(map(str, GANG_BLOB_VERSIONS))})")
    if blob.version == 1 and blob.contacts:
        raise ValueError("a version-1 gang blob lists no contacts")
    if _blob_encoder.encode(_as_v1(blob) if blob.version == 1 else blob) != body:
        raise ValueError("gang blob is not in canonical form")
    # (a version-1 blob is a version-2 one without contacts: it decodes as that, so a blob
    # decodes back to what was encoded whichever version its bytes took)
    return blob if blob.version == GANG_BLOB_VERSION else msgspec.structs.replace(blob, version=GANG_BLOB_VERSION)


_V1_FIELDS = _GangBlobV1.__struct_fields__


def _as_v1(blob: GangBlob) -> _GangBlobV1:
    """``blob`` as a version-1 blob (its contacts left out: the caller checks it has none)."""
    fields = {f: getattr(blob, f) for f in _V1_FIELDS}
    fields["version"] = 1
    return _GangBlobV1(**fields)


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def decoder(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)
