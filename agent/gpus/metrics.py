"""Prometheus families for GPU and host health (through ``prometheus_client``:
:mod:`infra.metrics`).

``DCGM_*`` series reuse dcgm-exporter's names and labels (``gpu``, ``UUID``, ``pci_bus_id``,
``device``, ``modelName``, ``Hostname``) so existing dashboards work, plus ``node`` (as on
every herd series), ``workload`` and ``job`` (the GPU's current holder, empty when free:
dcgm-exporter's pod/namespace attribution) and ``simulated="true|false"``. Our ``herd_gpu_*``
series carry the same facts in snake_case (``uuid``, ``model_name``; no ``Hostname``: ``node``
says it), so ``promtool check metrics`` has nothing to say about them; the two join on
``gpu`` and ``node``.
``herd_gpu_simulated`` says it once more, so a simulated GPU is never mistaken for a real
one. A value the backend did not read is no series at all, never a made-up 0. dcgm-exporter's
counters keep their exact names and are exposed untyped (the module docstring of
:mod:`infra.metrics` says why). Our own series are ``herd_gpu_*`` and ``herd_host_*``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.metrics_core import Metric

from infra.metrics import dcgm_counter, family, text_of
from scheduler_link.messages import GpuInfo, GpuSnapshot, GpuTelemetry

_STATES = ("healthy", "degraded", "fatal")

Getter = Callable[[GpuTelemetry], float | int | bool | None]

# (name, kind, help, getter); kind "gauge" or "dcgm_counter"
_GPU_SERIES: list[tuple[str, str, str, Getter]] = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (MHz).", lambda t: t.sm_clock_mhz),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (MHz).", lambda t: t.mem_clock_mhz),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (C).", lambda t: t.memory_temp_c),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (C).", lambda t: t.temperature_c),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (W).", lambda t: t.power_w),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "dcgm_counter", "Total energy consumption since the driver loaded (mJ).",
     lambda t: t.energy_mj),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (MiB).", lambda t: t.fb_used_mib),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (MiB).", lambda t: t.fb_free_mib),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (%).", lambda t: t.util_pct),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (%).", lambda t: t.enc_util_pct),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (%).", lambda t: t.dec_util_pct),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error seen (0: none).",
     lambda t: t.last_xid if t.last_xid is not None else 0),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "dcgm_counter", "Uncorrectable ECC errors since driver load.",
     lambda t: t.ecc_dbe_volatile),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "dcgm_counter", "Uncorrectable ECC errors, lifetime.",
     lambda t: t.ecc_dbe_aggregate),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "dcgm_counter", "Correctable ECC errors since driver load.",
     lambda t: t.ecc_sbe_volatile),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "dcgm_counter", "Rows remapped for correctable errors.",
     lambda t: t.remapped_rows_correctable),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "dcgm_counter", "Rows remapped for uncorrectable errors.",
     lambda t: t.remapped_rows_uncorrectable),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Row remapping failed (1) or not (0).", lambda t: t.remap_failure),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Row remap pending (1) or not (0).", lambda t: t.remap_pending),
    ("DCGM_FI_DEV_RETIRED_PENDING", "gauge", "Page retirement pending (1) or not (0).",
     lambda t: t.retired_pages_pending),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "dcgm_counter", "PCIe replays.", lambda t: t.pcie_replay),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "dcgm_counter", "Time throttled for thermal reasons (ns).",
     lambda t: t.thermal_violation_ns),
    ("DCGM_FI_DEV_POWER_VIOLATION", "dcgm_counter", "Time throttled for power reasons (ns).",
     lambda t: t.power_violation_ns),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock event reasons (bitmask).",
     lambda t: t.throttle_reasons),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "dcgm_counter", "NVLink CRC errors, all links.",
     lambda t: t.nvlink_crc_errors),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "dcgm_counter", "NVLink replay errors, all links.",
     lambda t: t.nvlink_replay_errors),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "dcgm_counter", "NVLink recovery errors, all links.",
     lambda t: t.nvlink_recovery_errors),
    ("herd_gpu_recovery_action", "gauge", "Driver's recommended recovery action (0 none).",
     lambda t: t.recovery_action),
]

# GPU UUID -> (workload id, job id) of its current holder
Holders = Mapping[str, tuple[str, str]]


def _num(v: float | int | bool) -> float:
    return float(v)


def gpu_labels(g: GpuInfo, hostname: str, node: str, holders: Holders | None = None) -> dict[str, str]:
    """dcgm-exporter's label names (for ``DCGM_*`` series) plus ours."""
    wl, job = (holders or {}).get(g.uuid, ("", ""))
    return {"gpu": str(g.index), "UUID": g.uuid, "pci_bus_id": g.pci_bus_id,
            "device": f"nvidia{g.minor_number if g.minor_number is not None else g.index}",
            "modelName": g.name, "Hostname": hostname, "node": node,
            "workload": wl, "job": job, "simulated": "true" if g.simulated else "false"}


def herd_gpu_labels(dcgm: Mapping[str, str]) -> dict[str, str]:
    """The same facts in Prometheus's snake_case, for our ``herd_gpu_*`` series (``gpu`` and
    ``node`` are on both, so the two kinds join on them)."""
    return {"gpu": dcgm["gpu"], "uuid": dcgm["UUID"], "pci_bus_id": dcgm["pci_bus_id"], "device": dcgm["device"],
            "model_name": dcgm["modelName"], "node": dcgm["node"], "workload": dcgm["workload"],
            "job": dcgm["job"], "simulated": dcgm["simulated"]}


def gpu_families(snapshot: GpuSnapshot, node: str, *, hostname: str | None = None,
                 holders: Holders | None = None) -> Iterator[Metric]:
    """The GPU and host families of ``snapshot`` (``hostname`` defaults to ``node``)."""
    host = hostname if hostname is not None else node
    dcgm = [(g, gpu_labels(g, host, node, holders)) for g in snapshot.gpus]
    labels = [(g, herd_gpu_labels(lb)) for g, lb in dcgm]

    for name, kind, help_, get in _GPU_SERIES:
        which = labels if name.startswith("herd_") else dcgm
        rows = [(lb, _num(v)) for g, lb in which if (v := get(g.telemetry)) is not None]
        if not rows:
            continue
        yield dcgm_counter(name, help_, rows) if kind == "dcgm_counter" else family(kind, name, help_, rows)

    if labels:
        xids = [({**lb, "xid": xid}, float(n)) for g, lb in dcgm
                for xid, n in sorted(g.telemetry.xid_counts.items(), key=lambda kv: int(kv[0]))]
        yield family("gauge", "DCGM_EXP_XID_ERRORS_COUNT",
                     "XID errors seen since agent start (or last reset), by XID.", xids)
        yield family("gauge", "herd_gpu_health", "GPU health state (1 for the current state).",
                     [({**lb, "state": st}, 1.0 if g.health == st else 0.0) for g, lb in labels for st in _STATES])
        yield family("gauge", "herd_gpu_health_reason", "Active health reasons (1 each), by code and severity.",
                     [({**lb, "code": r.code, "severity": r.severity}, 1.0) for g, lb in labels for r in g.reasons])
        yield family("gauge", "herd_gpu_simulated", "1 if this GPU is simulated (never a real device), else 0.",
                     [(lb, 1.0 if g.simulated else 0.0) for g, lb in labels])
        yield family("gauge", "herd_gpu_info", "GPU inventory and topology facts (always 1).",
                     [({**lb, "numa_node": "" if g.numa_node is None else str(g.numa_node),
                        "nvlinks": str(sum(1 for ln in g.nvlinks if ln.active)),
                        "fabric_clique": "" if g.fabric_clique_id is None else str(g.fabric_clique_id),
                        "backend": snapshot.backend, "driver": snapshot.driver_version or ""}, 1.0)
                      for g, lb in labels])

    h = snapshot.host
    hl = {"node": node}     # ours: no dcgm-exporter label to match
    yield family("gauge", "herd_host_health", "Host health state (1 for the current state).",
                 [({**hl, "state": st}, 1.0 if h.state == st else 0.0) for st in _STATES])
    for name, help_, v in (
            ("herd_host_mem_available_bytes", "Memory available to new processes (bytes).",
             None if h.mem_available_mib is None else h.mem_available_mib << 20),
            ("herd_host_state_disk_free_bytes", "Free disk of the agent's state dir (bytes).",
             None if h.disk_free_mib is None else h.disk_free_mib << 20),
            ("herd_host_load1", "1-minute load average.", h.load1)):
        if v is not None:
            yield family("gauge", name, help_, [(hl, float(v))])


def render_metrics(snapshot: GpuSnapshot, hostname: str, holders: Holders | None = None) -> str:
    """Prometheus text (0.0.4) of a GPU snapshot and host health (``hostname`` is the node)."""
    return text_of(gpu_families(snapshot, hostname, holders=holders))
