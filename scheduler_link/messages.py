"""Wire types shared by the agent and the placer (the only place they live).

Every struct is a frozen msgspec Struct; JSON on the wire by default. Top-level
messages carry ``version`` so either side can refuse a format it does not know.
Fields added later must have defaults so older peers keep decoding.

Conventions:
- GPUs are named by UUID; ``index`` rides alongside for display only.
- Times are unix seconds (float) taken by the sender.
- ``simulated`` is carried everywhere a GPU is shown: a simulated GPU is never
  passed off as a real one.
"""

from __future__ import annotations

from typing import Literal

import msgspec

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

class TopologyPath(msgspec.Struct, frozen=True, kw_only=True):
    """Where a node sits: zone > block > rack > node. Declared in the agent config."""
    zone: str = "zone-a"
    block: str = "block-a"
    rack: str = "rack-a"


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    """A data-plane peer; every member of a gang gets the same list."""
    node_id: str
    data_url: str
    zone: str = ""
    block: str = ""
    rack: str = ""


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


class GpuTelemetry(msgspec.Struct, frozen=True, kw_only=True):
    """Raw counters and gauges as last read (None = not supported / not read)."""
    temperature_c: float | None = None
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    power_w: float | None = None
    fb_used_mib: int | None = None
    fb_free_mib: int | None = None
    util_pct: float | None = None
    last_xid: int | None = None
    xid_counts: dict[str, int] = {}
    ecc_dbe_volatile: int | None = None
    ecc_dbe_aggregate: int | None = None
    ecc_sbe_volatile: int | None = None
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
    telemetry: GpuTelemetry = GpuTelemetry()
    simulated: bool = False


class HostHealth(msgspec.Struct, frozen=True, kw_only=True):
    state: HealthState = "healthy"
    reasons: list[HealthReason] = []
    mem_available_mib: int | None = None
    disk_free_mib: int | None = None
    load1: float | None = None


class GpuSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What a node's GPU backend sees: inventory, topology, health. Reported to the
    placer and served on the agent's status API."""
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


class PlacementAck(msgspec.Struct, frozen=True, kw_only=True):
    placement_id: str
    node_id: str
    accepted: bool
    reason: str | None = None
    workloads: list[str] = []
    version: int = WIRE_VERSION


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
    grace_s: float = 30.0
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


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def decoder(kind: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)
