"""``herd gpus``: the GPU table, the topology matrix and health; ``herd gpus inject``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import msgspec

from cli.main import CliError
from cli.output import emit_json, table

_FAULT_FLAGS = ("xid", "ecc_dbe", "ecc_sbe", "temperature_c", "throttle", "lost", "reset_required", "remap",
                "retired_pages_pending", "nvlink_down", "nvlink_errors", "pcie_replay", "recovery_action",
                "fabric_health", "clear")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpus", help="show GPUs, topology and health; inject faults into simulated GPUs",
                       description="Discover this host's GPUs (NVML or a simulated profile) and print a table, "
                                   "the topology matrix (as `nvidia-smi topo -m`) and health with reasons.")
    p.add_argument("--gpus", default=os.environ.get("HERD_GPUS", "nvml"), metavar="BACKEND",
                   help="nvml (default) or simulated:PROFILE (dgx-h100, hgx-b200, gb200-nvl72, l40s-pcie)")
    p.add_argument("--hostname", default=None, help="hostname for simulated UUIDs (default: this host)")
    p.add_argument("--state-dir", default=None, type=Path, help="state dir whose free disk host health reports")
    p.add_argument("--no-kernel-log", action="store_true", help="do not back-fill XIDs from the kernel log")
    p.add_argument("--json", action="store_true", help="print the snapshot as one JSON object")
    p.set_defaults(func=cmd_show)
    gsub = p.add_subparsers(dest="gpus_command", metavar="SUBCOMMAND")
    i = gsub.add_parser("inject", help="inject a fault into a simulated GPU of a running agent",
                        description="POST raw fault signals to the agent's /v1/gpus/{uuid}/inject "
                                    "(simulated GPUs only; needs the operator token).")
    i.add_argument("--agent", default=os.environ.get("HERD_AGENT"), help="agent URL (default $HERD_AGENT)")
    i.add_argument("--gpu", required=True, help="GPU UUID")
    i.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    i.add_argument("--timeout", type=float, default=10.0, help="request timeout, seconds")
    g = i.add_argument_group("faults (raw signals; combine freely, except --clear)")
    g.add_argument("--xid", type=int, help="raise XID N")
    g.add_argument("--ecc-dbe", type=int, help="N more uncorrectable ECC errors")
    g.add_argument("--ecc-sbe", type=int, help="N more correctable ECC errors")
    g.add_argument("--temperature", dest="temperature_c", type=float, help="temperature now reads C")
    g.add_argument("--throttle", choices=["none", "hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal",
                                          "sw_power_cap"], help="clock event reason now reported")
    g.add_argument("--lost", action="store_true", default=None, help="the GPU falls off the bus")
    g.add_argument("--reset-required", action="store_true", default=None, help="NVML reports reset required")
    g.add_argument("--remap", choices=["none", "pending", "failure"], help="row remapper state")
    g.add_argument("--retired-pages-pending", action="store_true", default=None, help="page retirement pending")
    g.add_argument("--nvlink-down", type=int, metavar="LINK", help="NVLink LINK goes down")
    g.add_argument("--nvlink-errors", type=int, metavar="N", help="N more NVLink CRC errors")
    g.add_argument("--pcie-replay", type=int, metavar="N", help="N more PCIe replays")
    g.add_argument("--recovery-action", type=int, metavar="N", help="driver's recovery action field reads N")
    g.add_argument("--fabric-health", choices=["healthy", "unhealthy", "limited_capacity"],
                   help="NVL72 fabric health summary (gb200-nvl72)")
    g.add_argument("--clear", action="store_true", default=None,
                   help="back to baseline signals, as after a GPU reset")
    i.add_argument("--json", action="store_true", help="print the agent's answer as JSON")
    i.set_defaults(func=cmd_inject)


# ---------------------------------------------------------------- show

def cmd_show(args: argparse.Namespace) -> int:
    import trio

    from agent.gpus import open_backend, snapshot_once

    backend = open_backend(args.gpus, hostname=args.hostname)
    snap = trio.run(lambda: snapshot_once(backend, state_dir=args.state_dir, kernel_log=not args.no_kernel_log))
    if args.json:
        emit_json(snap)
        return 0
    sys.stdout.write(render_text(snap) + "\n")
    return 0


def render_text(snap: msgspec.Struct) -> str:
    from scheduler_link.messages import GpuSnapshot
    assert isinstance(snap, GpuSnapshot)
    out: list[str] = []
    sim = "  [SIMULATED: not real GPUs]" if snap.simulated else ""
    out.append(f"host {snap.hostname}  backend {snap.backend}  driver {snap.driver_version or '-'}  "
               f"cuda {snap.cuda_version or '-'}{sim}")
    if snap.nvlink_domain:
        out.append(f"NVLink domain {snap.nvlink_domain}")
    out.append("")
    rows = []
    for g in snap.gpus:
        t = g.telemetry
        mig = "-" if g.mig_mode_current is None else ("on" if g.mig_mode_current else "off")
        if g.mig_mode_pending is not None and g.mig_mode_pending != g.mig_mode_current:
            mig += "*"
        rows.append([g.index, g.uuid, g.name, f"{g.memory_total_mib} MiB", g.pci_bus_id,
                     "-" if g.numa_node is None else g.numa_node, g.cpu_affinity or "-",
                     sum(1 for ln in g.nvlinks if ln.active), mig,
                     "-" if t.temperature_c is None else f"{t.temperature_c:g}C",
                     "-" if t.power_w is None else f"{t.power_w:.0f}W", g.health.upper() if g.health != "healthy"
                     else g.health])
    out.append(table(["GPU", "UUID", "NAME", "MEMORY", "PCI", "NUMA", "CPU AFFINITY", "NVLINKS", "MIG",
                      "TEMP", "POWER", "HEALTH"], rows))
    out.append("")
    n = len(snap.gpus)
    head = [""] + [f"GPU{g.index}" for g in snap.gpus] + ["CPU Affinity", "NUMA Affinity"]
    mrows: list[list[object]] = []
    for i, g in enumerate(snap.gpus):
        row = snap.topology_matrix[i] if i < len(snap.topology_matrix) else ["?"] * n
        mrows.append([f"GPU{g.index}"] + list(row) + [g.cpu_affinity or "N/A",
                                                       "N/A" if g.numa_node is None else g.numa_node])
    out.append(table(head, mrows))
    out.append("")
    out.append("Legend: X = self, NV# = # NVLinks, PIX = one PCIe switch, PXB = several PCIe switches, "
               "PHB = PCIe host bridge, NODE = within a NUMA node, SYS = across NUMA nodes")
    out.append("")
    reasons = [(g.index, r) for g in snap.gpus for r in g.reasons]
    if not reasons:  # said of the GPUs even when the host has reasons (a loaded machine)
        out.append("health: all GPUs healthy" + ("" if snap.host.reasons else ", no reasons"))
    if reasons or snap.host.reasons:
        rrows = [[f"GPU{i}", r.severity, r.code, r.detail] for i, r in reasons]
        rrows += [["host", r.severity, r.code, r.detail] for r in snap.host.reasons]
        out.append(table(["WHERE", "SEVERITY", "CODE", "DETAIL"], rrows))
    h = snap.host
    out.append(f"host health {h.state}: mem available {h.mem_available_mib if h.mem_available_mib is not None else '-'}"
               f" MiB, state-dir disk free {h.disk_free_mib if h.disk_free_mib is not None else '-'} MiB, "
               f"load1 {'-' if h.load1 is None else f'{h.load1:.2f}'}")
    return "\n".join(out)


# ---------------------------------------------------------------- inject

def fault_from_args(args: argparse.Namespace) -> msgspec.Struct:
    from agent.gpus import Fault, FaultError

    fields = {f: getattr(args, f) for f in _FAULT_FLAGS if getattr(args, f, None) is not None}
    if not fields:
        raise CliError("say which fault to inject: --xid N, --ecc-dbe N, --temperature C, --throttle R, "
                       "--lost, --remap pending|failure, --nvlink-down L, --clear, ...")
    try:
        return Fault(**fields)
    except FaultError as e:
        raise CliError(str(e)) from None


def cmd_inject(args: argparse.Namespace) -> int:
    from infra.auth import TokenSet, auth_header
    from scheduler_link.daemon_client import DaemonClient

    if not args.agent:
        raise CliError("no agent URL: give --agent URL or set HERD_AGENT")
    fault = fault_from_args(args)
    tokens = TokenSet.load(args.token_dir)
    tls_agent = args.agent.startswith("https://")   # the operator's certificate, never the token
    if not tokens.operator and not tls_agent:
        raise CliError("no operator token: put operator.token in --token-dir or $HERD_TOKEN_DIR")
    from urllib.parse import quote
    with DaemonClient(args.agent, "agent", timeout=args.timeout, expect="node",
                      headers={**({} if tls_agent else auth_header(tokens.operator)),
                               "content-type": "application/json"}) as c:
        # an error answer is "agent answered 4xx: error: detail"; a page that is not herd's says so
        body = c.json("POST", f"/v1/gpus/{quote(args.gpu, safe='')}/inject", content=msgspec.json.encode(fault))
    if args.json:
        emit_json(body)
    else:
        sys.stdout.write(f"injected into {args.gpu}: {fault.describe()}\n")  # type: ignore[attr-defined]  # fault is one of the fault Structs, each of which has describe()
    return 0
