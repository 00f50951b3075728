"""Prometheus text for the agent's own ``herd_*`` series.

The GPU series (dcgm-exporter names) come from :func:`agent.gpus.render_metrics`;
this module adds workloads by state, starts, restarts, preemptions, refusals, store
bytes and fetch bytes by source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler_link.messages import WorkloadState

STATES: tuple[str, ...] = WorkloadState.__args__  # type: ignore[attr-defined]


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_agent_metrics(node_id: str, sup: Mapping[str, Any], store: Mapping[str, Any] | None,
                         ready: bool) -> str:
    """``sup`` is Supervisor.statistics(); ``store`` the chunk store's statistics as a dict."""
    n = f'node="{_esc(node_id)}"'
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = n + ("," + labels if labels else "")
            out.append(f"{name}{{{lab}}} {value:g}")

    by_state = sup.get("workloads_by_state", {})
    metric("herd_agent_ready", "gauge", "1 once GPUs are discovered, state recovered and the API listens",
           [("", 1 if ready else 0)])
    metric("herd_workloads", "gauge", "Workloads known to this agent, by state",
           [(f'state="{s}"', by_state.get(s, 0)) for s in STATES])
    metric("herd_workload_starts_total", "counter", "Workload processes started (restarts included)",
           [("", sup.get("starts", 0))])
    metric("herd_workload_restarts_total", "counter", "Restarts by the agent's own restart policy",
           [("", sup.get("restarts", 0))])
    metric("herd_workload_preemptions_total", "counter", "Workloads that ended preempted",
           [("", sup.get("preemptions", 0))])
    metric("herd_placements_refused_total", "counter", "Placements refused by this agent",
           [("", sup.get("refused", 0))])
    fb = sup.get("fetch_bytes", {})
    metric("herd_fetch_bytes_total", "counter", "Artifact bytes fetched for workloads, by source",
           [(f'source="{src}"', fb.get(f"bytes_from_{src}", fb.get(f"bytes_{src}", 0)))
            for src in ("origin", "peers", "local")])
    qs = sup.get("start_seconds", {})
    if qs:
        metric("herd_workload_start_seconds", "gauge",
               "Accepted -> running (process started and recorded by its shim), last 1024 starts without fetch or victims",
               [(f'quantile="{q}"', v) for q, v in sorted(qs.items())])
    pool = sup.get("shim_pool", {})
    metric("herd_shim_pool_idle", "gauge", "Pre-started idle workload shims", [("", pool.get("idle", 0))])
    if store:
        samples = [(f'kind="{k}"', float(v)) for k, v in sorted(store.items())
                   if isinstance(v, int | float) and not isinstance(v, bool) and "bytes" in k]
        if samples:
            metric("herd_store_bytes", "gauge", "Chunk store figures in bytes, by kind", samples)
    return "\n".join(out) + "\n"
