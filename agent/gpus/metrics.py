"""Prometheus text for GPU and host health.

GPU series reuse dcgm-exporter's names and labels (``gpu``, ``UUID``,
``pci_bus_id``, ``device``, ``modelName``, ``Hostname``) so existing dashboards
work; every GPU series also carries ``simulated="true|false"`` and
``herd_gpu_simulated`` says it once more, so a simulated GPU is never mistaken
for a real one. Our own series are ``herd_gpu_*`` and ``herd_host_*``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from scheduler_link.messages import GpuInfo, GpuSnapshot, GpuTelemetry

_STATES = ("healthy", "degraded", "fatal")

# (name, type, help, getter)
_GPU_SERIES: list[tuple[str, str, str, Callable[[GpuTelemetry], float | int | bool | None]]] = [
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (C).", lambda t: t.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (W).", lambda t: t.power_w),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (MiB).", lambda t: t.fb_used_mib),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (MiB).", lambda t: t.fb_free_mib),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (%).", lambda t: t.util_pct),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error seen (0: none).",
     lambda t: t.last_xid if t.last_xid is not None else 0),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Uncorrectable ECC errors since driver load.",
     lambda t: t.ecc_dbe_volatile),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "Uncorrectable ECC errors, lifetime.", lambda t: t.ecc_dbe_aggregate),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Correctable ECC errors since driver load.",
     lambda t: t.ecc_sbe_volatile),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Rows remapped for uncorrectable errors.",
     lambda t: t.remapped_rows_uncorrectable),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Row remapping failed (1) or not (0).", lambda t: t.remap_failure),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Row remap pending (1) or not (0).", lambda t: t.remap_pending),
    ("DCGM_FI_DEV_RETIRED_PENDING", "gauge", "Page retirement pending (1) or not (0).",
     lambda t: t.retired_pages_pending),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "PCIe replays.", lambda t: t.pcie_replay),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "Time throttled for thermal reasons (ns).",
     lambda t: t.thermal_violation_ns),
    ("DCGM_FI_DEV_POWER_VIOLATION", "counter", "Time throttled for power reasons (ns).",
     lambda t: t.power_violation_ns),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock event reasons (bitmask).",
     lambda t: t.throttle_reasons),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "NVLink CRC errors, all links.",
     lambda t: t.nvlink_crc_errors),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "NVLink replay errors, all links.",
     lambda t: t.nvlink_replay_errors),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "NVLink recovery errors, all links.",
     lambda t: t.nvlink_recovery_errors),
    ("herd_gpu_recovery_action", "gauge", "Driver's recommended recovery action (0 none).",
     lambda t: t.recovery_action),
]


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(d: Mapping[str, object]) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in d.items()) + "}"


def _num(v: float | int | bool) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(float(v))


def _gpu_labels(g: GpuInfo, hostname: str) -> dict[str, object]:
    return {"gpu": g.index, "UUID": g.uuid, "pci_bus_id": g.pci_bus_id,
            "device": f"nvidia{g.minor_number if g.minor_number is not None else g.index}",
            "modelName": g.name, "Hostname": hostname, "simulated": "true" if g.simulated else "false"}


def render_metrics(snapshot: GpuSnapshot, hostname: str) -> str:
    """Prometheus text exposition (version 0.0.4) of a GPU snapshot and host health."""
    out: list[str] = []
    labels = [(g, _gpu_labels(g, hostname)) for g in snapshot.gpus]

    def family(name: str, typ: str, help_: str) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {typ}")

    for name, typ, help_, get in _GPU_SERIES:
        rows = [(lb, v) for g, lb in labels if (v := get(g.telemetry)) is not None]
        if not rows:
            continue
        family(name, typ, help_)
        out.extend(f"{name}{_labels(lb)} {_num(v)}" for lb, v in rows)

    if labels:
        family("DCGM_EXP_XID_ERRORS_COUNT", "gauge", "XID errors seen since agent start (or last reset), by XID.")
        for g, lb in labels:
            for xid, n in sorted(g.telemetry.xid_counts.items(), key=lambda kv: int(kv[0])):
                out.append(f"DCGM_EXP_XID_ERRORS_COUNT{_labels({**lb, 'xid': xid})} {n}")
        family("herd_gpu_health", "gauge", "GPU health state (1 for the current state).")
        for g, lb in labels:
            for st in _STATES:
                out.append(f"herd_gpu_health{_labels({**lb, 'state': st})} {1 if g.health == st else 0}")
        family("herd_gpu_health_reason", "gauge", "Active health reasons (1 each), by code and severity.")
        for g, lb in labels:
            for r in g.reasons:
                out.append(f"herd_gpu_health_reason{_labels({**lb, 'code': r.code, 'severity': r.severity})} 1")
        family("herd_gpu_simulated", "gauge", "1 if this GPU is simulated (never a real device), else 0.")
        for g, lb in labels:
            out.append(f"herd_gpu_simulated{_labels(lb)} {1 if g.simulated else 0}")
        family("herd_gpu_info", "gauge", "GPU inventory and topology facts (always 1).")
        for g, lb in labels:
            extra = {"numa_node": "" if g.numa_node is None else g.numa_node,
                     "nvlinks": sum(1 for ln in g.nvlinks if ln.active),
                     "fabric_clique": "" if g.fabric_clique_id is None else g.fabric_clique_id,
                     "backend": snapshot.backend, "driver": snapshot.driver_version or ""}
            out.append(f"herd_gpu_info{_labels({**lb, **extra})} 1")

    h = snapshot.host
    hl = {"Hostname": hostname}
    family("herd_host_health", "gauge", "Host health state (1 for the current state).")
    for st in _STATES:
        out.append(f"herd_host_health{_labels({**hl, 'state': st})} {1 if h.state == st else 0}")
    for name, help_, v in (
            ("herd_host_mem_available_bytes", "Memory available to new processes (bytes).",
             None if h.mem_available_mib is None else h.mem_available_mib << 20),
            ("herd_host_state_disk_free_bytes", "Free disk of the agent's state dir (bytes).",
             None if h.disk_free_mib is None else h.disk_free_mib << 20),
            ("herd_host_load1", "1-minute load average.", h.load1)):
        if v is not None:
            family(name, "gauge", help_)
            out.append(f"{name}{_labels(hl)} {_num(v)}")
    return "\n".join(out) + "\n"
