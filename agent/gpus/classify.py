"""GPU health classification: a pure function over raw signals.

Theory of operation
-------------------
The monitor keeps, per GPU, the latest poll, a short history of polls (for growth
and "sustained" judgements) and the XID events seen (from NVML's event set, the
kernel-log back-fill at start, or fault injection). :func:`classify_gpu` turns
that into a state and a list of machine-readable reasons. It never touches a
clock, a socket or trio: ``now`` is an argument, so every rule is testable.

The table (``state`` = the worst severity among the reasons; ``application`` and
``info`` reasons never change the state):

=====================================================  ==========  ============  ==========================
signal                                                 severity    reason code   recovers
=====================================================  ==========  ============  ==========================
GPU is lost (any NVML call, or GPU-unavailable event)  fatal       gpu_lost      when calls work again
reset required (any NVML call)                         fatal       reset_required when calls work again
XID in FATAL_XIDS (46 48 61 62 64 74 79 95 119 120     fatal       xid:N         sticky: GPU reset / clear
  140 143 144-150 155)
row-remap failure                                      fatal       row_remap_failure  when the counter clears
volatile uncorrectable ECC > ecc_dbe_volatile_max      fatal       ecc_dbe_volatile   at driver reload / clear
temperature >= shutdown threshold                      fatal       temperature_shutdown  when it cools
NVL72 fabric health "unhealthy" (or registration       fatal       fabric_unhealthy   when the fabric reports ok
  completed with an error status)
recovery action 1/2/4/6/7 (reset, reboot, ...)         fatal       recovery_action:N  when NVML clears it
XID in DEGRADED_XIDS (63, 92)                          degraded    xid:N         after degraded_xid_window_s
unknown XID                                            degraded    xid:N         after degraded_xid_window_s
application XID recurring >= app_xid_recur_count       degraded    xid_recurring:N  when fewer in the window
  times within app_xid_window_s
row remap pending                                      degraded    row_remap_pending  after the reset it asks for
retired pages pending                                  degraded    retired_pages_pending  idem
temperature >= slowdown threshold                      degraded    temperature_slowdown  when it cools
hardware throttling (HW slowdown 0x8, HW thermal 0x40, degraded    throttle_hw        when the window is clean
  HW power brake 0x80) in >= throttle_fraction of the
  polls of throttle_window_s (>= throttle_min_samples)
NVLink CRC/replay/recovery counters grew by more than  degraded    nvlink_errors      when the window is clean
  nvlink_error_growth_max within counter_window_s
NVLink link active at discovery now down               degraded    nvlink_down:L      when the link is back
PCIe replays grew by more than pcie_replay_growth_max  degraded    pcie_replay        when the window is clean
NVL72 fabric "limited_capacity"                        degraded    fabric_limited     when the fabric reports ok
NVL72 fabric registration not complete (state 1/2)     degraded    fabric_not_ready   when it completes
recovery action 3 (drain P2P)                          degraded    recovery_action:3  when NVML clears it
XID in APPLICATION_XIDS (8 13 31 43 45 68 69 94 109    application xid:N        after app_xid_window_s
  137), fewer than the recurrence bound
=====================================================  ==========  ============  ==========================

XID 109 (context switch timeout): NVIDIA's catalog says "reset the GPU", the k8s
device plugin ignores it. We treat it as an **application** XID: a single 109 is
almost always a hung kernel of the workload on that GPU, and it is not sticky.
If it recurs (app_xid_recur_count within app_xid_window_s) the GPU is degraded,
like any recurring application XID — the placer then prefers other GPUs.

Fatal XIDs are sticky: the monitor keeps them until the GPU is reset (a ``reset``
raw event, which fault injection's ``clear`` produces on simulated GPUs) or the
agent restarts after a reboot (the kernel-log back-fill only reads since boot).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from scheduler_link.messages import GpuTelemetry, HealthReason, HealthState

from .backend import GpuSample
from .host import HostHealthConfig

FATAL_XIDS: frozenset[int] = frozenset({46, 48, 61, 62, 64, 74, 79, 95, 119, 120, 140, 143, 155}
                                       | set(range(144, 151)))
DEGRADED_XIDS: frozenset[int] = frozenset({63, 92})
APPLICATION_XIDS: frozenset[int] = frozenset({8, 13, 31, 43, 45, 68, 69, 94, 109, 137})

# Clock event reasons that mean the hardware itself slowed the GPU down.
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_HW_THERMAL = 0x40
THROTTLE_HW_POWER_BRAKE = 0x80
THROTTLE_HW_MASK = THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL | THROTTLE_HW_POWER_BRAKE
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_SW_THERMAL = 0x20

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values.
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                                    4: "drain_and_reset", 6: "bus_reset", 7: "system_reboot"}
RECOVERY_FATAL: frozenset[int] = frozenset({1, 2, 4, 6, 7})

SEVERITY_RANK: dict[str, int] = {"info": 0, "application": 0, "degraded": 1, "fatal": 2}
STATE_OF_RANK: dict[int, HealthState] = {0: "healthy", 1: "degraded", 2: "fatal"}


class HealthConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds of the classification table (defaults follow DCGM / gpud practice)."""
    ecc_dbe_volatile_max: int = 0            # volatile (since driver load) DBE above this -> fatal
    app_xid_recur_count: int = 3
    app_xid_window_s: float = 600.0
    degraded_xid_window_s: float = 3600.0
    throttle_window_s: float = 600.0
    throttle_fraction: float = 0.5
    throttle_min_samples: int = 3
    counter_window_s: float = 300.0
    nvlink_error_growth_max: int = 0
    pcie_replay_growth_max: int = 100
    temp_slowdown_c: float | None = None     # override the GPU's own thresholds
    temp_shutdown_c: float | None = None
    expected_gpus: int | None = None         # fewer GPUs discovered than this -> host fatal (fallen off the bus)
    host: HostHealthConfig = HostHealthConfig()

    def __post_init__(self) -> None:
        if self.app_xid_recur_count < 1 or self.throttle_min_samples < 1:
            raise ValueError("app_xid_recur_count and throttle_min_samples must be >= 1")
        if not 0.0 < self.throttle_fraction <= 1.0:
            raise ValueError("throttle_fraction must be in (0, 1]")
        for name in ("app_xid_window_s", "degraded_xid_window_s", "throttle_window_s", "counter_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


class XidEvent(msgspec.Struct, frozen=True, kw_only=True):
    xid: int
    at: float
    source: str = "nvml"
    detail: str = ""


def xid_class(xid: int) -> str:
    """``fatal`` | ``degraded`` | ``application`` | ``unknown`` (unknown classifies as degraded)."""
    if xid in FATAL_XIDS:
        return "fatal"
    if xid in DEGRADED_XIDS:
        return "degraded"
    if xid in APPLICATION_XIDS:
        return "application"
    return "unknown"


class GpuObservation(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the classifier may look at for one GPU."""
    uuid: str
    sample: GpuSample | None = None
    xids: list[XidEvent] = []                    # fatal ones kept until reset; others by window
    history: list[tuple[float, GpuTelemetry]] = []  # polls within the longest window, oldest first
    nvlinks_expected: list[int] = []             # links active at discovery
    temp_slowdown_c: float | None = None         # the GPU's own thresholds (discovery)
    temp_shutdown_c: float | None = None


def _growth(history: Sequence[tuple[float, GpuTelemetry]], now: float, window: float, field: str) -> int:
    vals = [(t, getattr(tel, field)) for t, tel in history if now - t <= window and getattr(tel, field) is not None]
    if len(vals) < 2:
        return 0
    return max(0, int(vals[-1][1]) - int(vals[0][1]))


def classify_gpu(obs: GpuObservation, cfg: HealthConfig, now: float,
                 prev: Iterable[HealthReason] = ()) -> tuple[HealthState, list[HealthReason]]:
    """Classify one GPU. ``prev`` (the previous reasons) carries each reason's ``since``."""
    uuid = obs.uuid
    out: list[HealthReason] = []

    def add(code: str, severity: str, detail: str = "", since: float | None = None) -> None:
        out.append(HealthReason(code=code, severity=severity, gpu=uuid,  # type: ignore[arg-type]  # severity comes from the classification table, whose values are the Literal's
                                since=now if since is None else since, detail=detail))

    s = obs.sample
    tel = s.telemetry if s is not None else GpuTelemetry()
    if s is not None and s.lost:
        add("gpu_lost", "fatal", "GPU is lost (fallen off the bus or unavailable)")
    if s is not None and s.reset_required:
        add("reset_required", "fatal", "the GPU requires a reset")

    # XIDs
    first: dict[int, float] = {}
    recent_app: dict[int, int] = {}
    for ev in obs.xids:
        kind = xid_class(ev.xid)
        age = now - ev.at
        if kind == "fatal":
            first.setdefault(ev.xid, ev.at)
        elif kind in ("degraded", "unknown") and age <= cfg.degraded_xid_window_s:
            first.setdefault(ev.xid, ev.at)
        elif kind == "application" and age <= cfg.app_xid_window_s:
            first.setdefault(ev.xid, ev.at)
            recent_app[ev.xid] = recent_app.get(ev.xid, 0) + 1
    for xid in sorted(first):
        kind = xid_class(xid)
        if kind == "fatal":
            add(f"xid:{xid}", "fatal", f"XID {xid}", first[xid])
        elif kind == "degraded":
            add(f"xid:{xid}", "degraded", f"XID {xid}", first[xid])
        elif kind == "unknown":
            add(f"xid:{xid}", "degraded", f"XID {xid} (not in our table)", first[xid])
        else:
            n = recent_app[xid]
            if n >= cfg.app_xid_recur_count:
                add(f"xid_recurring:{xid}", "degraded",
                    f"application XID {xid} seen {n} times within {cfg.app_xid_window_s:g}s", first[xid])
            else:
                add(f"xid:{xid}", "application", f"XID {xid} blamed on the workload ({n} in window)", first[xid])

    # memory
    if tel.remap_failure:
        add("row_remap_failure", "fatal", "row remapping failed")
    elif tel.remap_pending:
        add("row_remap_pending", "degraded", "row remap pending: reset the GPU")
    if tel.ecc_dbe_volatile is not None and tel.ecc_dbe_volatile > cfg.ecc_dbe_volatile_max:
        add("ecc_dbe_volatile", "fatal", f"{tel.ecc_dbe_volatile} uncorrectable ECC errors since driver load")
    if tel.retired_pages_pending:
        add("retired_pages_pending", "degraded", "page retirement pending: reset the GPU")

    # temperature
    t = tel.temperature_c
    shut = cfg.temp_shutdown_c if cfg.temp_shutdown_c is not None else (
        obs.temp_shutdown_c if obs.temp_shutdown_c is not None else tel.temp_shutdown_c)
    slow = cfg.temp_slowdown_c if cfg.temp_slowdown_c is not None else (
        obs.temp_slowdown_c if obs.temp_slowdown_c is not None else tel.temp_slowdown_c)
    if t is not None and shut is not None and t >= shut:
        add("temperature_shutdown", "fatal", f"{t:g} C >= shutdown threshold {shut:g} C")
    elif t is not None and slow is not None and t >= slow:
        add("temperature_slowdown", "degraded", f"{t:g} C >= slowdown threshold {slow:g} C")

    # sustained hardware throttling
    window = [tl.throttle_reasons for at, tl in obs.history
              if now - at <= cfg.throttle_window_s and tl.throttle_reasons is not None]
    if len(window) >= cfg.throttle_min_samples:
        hot = sum(1 for r in window if r & THROTTLE_HW_MASK)
        if hot / len(window) >= cfg.throttle_fraction:
            add("throttle_hw", "degraded", f"hardware clock slowdown in {hot}/{len(window)} polls")

    # NVLink
    grow = sum(_growth(obs.history, now, cfg.counter_window_s, f)
               for f in ("nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors"))
    if grow > cfg.nvlink_error_growth_max:
        add("nvlink_errors", "degraded", f"NVLink error counters grew by {grow} within {cfg.counter_window_s:g}s")
    if s is not None and s.nvlinks_active is not None and not s.lost:
        active = set(s.nvlinks_active)
        for link in obs.nvlinks_expected:
            if link not in active:
                add(f"nvlink_down:{link}", "degraded", f"NVLink {link} was active at start, now down")
    pcie = _growth(obs.history, now, cfg.counter_window_s, "pcie_replay")
    if pcie > cfg.pcie_replay_growth_max:
        add("pcie_replay", "degraded", f"PCIe replays grew by {pcie} within {cfg.counter_window_s:g}s")

    # fabric, recovery action
    if s is not None and s.fabric_health == "unhealthy":
        add("fabric_unhealthy", "fatal", "NVLink fabric reports unhealthy")
    elif s is not None and s.fabric_health == "limited_capacity":
        add("fabric_limited", "degraded", "NVLink fabric reports limited capacity")
    elif s is not None and s.fabric_health == "not_ready":
        add("fabric_not_ready", "degraded", "NVLink fabric registration not complete")
    ra = tel.recovery_action
    if ra:
        name = RECOVERY_ACTIONS.get(ra, "unknown")
        add(f"recovery_action:{ra}", "fatal" if ra in RECOVERY_FATAL else "degraded",
            f"driver recommends recovery action {name}")

    return finish(out, prev)


def classify_inventory(found: int, unanswered: Sequence[str], expected: int | None,
                       now: float) -> list[HealthReason]:
    """Host-level reasons about the GPU inventory itself (pure)."""
    out = [HealthReason(code="gpu_unanswered", severity="degraded", gpu=None, since=now,
                        detail=f"GPU {u} at discovery") for u in unanswered]
    if expected is not None and found < expected:
        out.append(HealthReason(code="gpu_count_mismatch", severity="fatal", gpu=None, since=now,
                                detail=f"{found} GPUs usable, {expected} expected"))
    return out


def finish(reasons: list[HealthReason], prev: Iterable[HealthReason] = ()) -> tuple[HealthState, list[HealthReason]]:
    """Carry ``since`` over from the previous reasons with the same code; compute the state."""
    before = {(r.code, r.severity): r.since for r in prev}
    kept: list[HealthReason] = []
    for r in reasons:
        since = before.get((r.code, r.severity))
        if since is not None and since < r.since:
            r = msgspec.structs.replace(r, since=since)
        kept.append(r)
    rank = max((SEVERITY_RANK[r.severity] for r in kept), default=0)
    return STATE_OF_RANK[rank], kept


def reasons_key(reasons: Iterable[HealthReason]) -> frozenset[tuple[str, str, str | None]]:
    """What counts as "the reasons changed" (details carry live numbers and are ignored)."""
    return frozenset((r.code, r.severity, r.gpu) for r in reasons)
