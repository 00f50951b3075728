"""`herd placer run|status|defrag`."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import trio

from cli.main import CliError
from cli.output import emit_json, table
from infra.auth import TokenSet
from scheduler_link.client import ClientError, PlacerClient, placer_url_from_env
from scheduler_link.placers import placer_urls_from_env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("placer", help="run the placer service, or ask it to defragment")
    ps = p.add_subparsers(dest="placer_cmd", metavar="CMD")
    ps.required = True
    r = ps.add_parser("run", help="run the placer (HTTP API for agents and operators)")
    r.add_argument("--listen", default=None, help="HOST:PORT (port 0 allowed; default 127.0.0.1:7470)")
    r.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    r.add_argument("--config", default=None, help="TOML config file ([placer] table)")
    r.add_argument("--state-dir", default=None, help="journal and endpoints.json (default /var/lib/herd-placer)")
    r.add_argument("--heartbeat", type=float, default=None, help="heartbeat interval told to agents (s)")
    r.add_argument("--fence-after", type=float, default=None, help="delay before a lost node's gangs move (s)")
    r.set_defaults(func=cmd_run)
    st = ps.add_parser("status", help="who leads the placers, the epoch, each placer's role, when it started, recover_s left, nodes heard")
    st.add_argument("--placer", action="append", default=None, metavar="URL",
                    help="a placer URL (repeat, or comma-separate; default $HERD_PLACER, comma-separated)")
    st.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    st.add_argument("--timeout", type=float, default=5.0, metavar="S",
                    help="seconds to wait for each placer's answer (default 5)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=cmd_status)
    d = ps.add_parser("defrag", help="plan defragmentation moves (and apply them with --apply)")
    d.add_argument("--placer", default=None, help="placer URL (default $HERD_PLACER)")
    d.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    d.add_argument("--max-moves", type=int, default=8, help="most jobs to move (default 8)")
    d.add_argument("--apply", action="store_true", help="requeue the moved jobs so they are placed again")
    d.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for the placer's answer (default 10)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_defrag)


def cmd_run(args: argparse.Namespace) -> int:
    from infra.errors import LinkError, single_cause
    from infra.tls import TLSError
    from placer.config import PlacerConfigError, load_config
    from placer.errors import PlacerError
    from placer.service import run_placer
    try:
        cfg = load_config(args.config, listen=args.listen, token_dir=args.token_dir, state_dir=args.state_dir,
                          heartbeat_s=args.heartbeat, fence_after_s=args.fence_after)
    except PlacerConfigError as e:
        # EX_CONFIG (78): herd-placer.service's RestartPreventExitStatus= stops a restart loop
        raise CliError(str(e), code=os.EX_CONFIG) from None
    try:
        trio.run(run_placer, cfg)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as eg:
        # a start-up failure (a corrupt journal, a port in use) is one line, not a traceback
        leaf = single_cause(eg)
        if isinstance(leaf, PlacerConfigError):
            raise CliError(str(leaf), code=os.EX_CONFIG) from None
        if isinstance(leaf, (PlacerError, LinkError, TLSError)):
            raise CliError(str(leaf)) from None
        if isinstance(leaf, OSError):
            where = f" ({leaf.filename})" if leaf.filename else f" (listen {cfg.listen}, wire_listen {cfg.wire_listen or '-'})"
            raise CliError(f"placer failed: {leaf.strerror or leaf}{where}") from None
        raise
    return 0


def cmd_defrag(args: argparse.Namespace) -> int:
    if args.max_moves < 0:
        raise CliError("--max-moves must be >= 0")
    tokens = TokenSet.load(args.token_dir)
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    with PlacerClient(placer_url_from_env(args.placer), tokens.operator, timeout=args.timeout) as c:
        out = c.defrag(args.max_moves, args.apply)
    if args.json:
        emit_json(out)
        return 0
    rows = [(m["job_id"], ",".join(m["from_nodes"]), ",".join(m["to_nodes"])) for m in out["moves"]]
    print(table(["JOB", "FROM", "TO"], rows) if rows else "no moves proposed")
    if args.apply:
        print(f"applied: {len(out['applied'])} job(s) requeued")
    return 0


def placer_status(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    """One placer's view (its /healthz): role, the leader it knows, the epoch; this start's
    (``started_at``, ``recover_s_left``, ``nodes_reported``); an error line when it did not answer."""
    try:
        with PlacerClient(url, token, timeout=timeout, failover_s=0) as c:
            h = c.healthz()
    except ClientError as e:
        return {"url": url, "role": "unreachable", "leader": None, "epoch": 0, "error": str(e)}
    ha = h.get("ha")
    start = {"started_at": h.get("started_at"), "recover_s_left": h.get("recover_s_left", 0.0),
             "nodes_reported": h.get("nodes_reported", 0)}
    if not isinstance(ha, dict):   # a placer alone (no etcd): it leads itself
        return {"url": url, "role": "leader", "leader": url, "epoch": h.get("epoch", 0), "ha": False,
                "recovering": h.get("recovering", False), **start}
    return {"url": url, "role": ha.get("role"), "leader": ha.get("leader"), "epoch": ha.get("epoch", 0),
            "placing": ha.get("placing", False), "ha": True, "recovering": h.get("recovering", False), **start,
            **({"why": ha["why"]} if ha.get("why") else {})}


def _since(started_at: float | None) -> str:
    """How long ago a placer started ("-" when it did not say)."""
    if not started_at:
        return "-"
    s = max(0, int(time.time() - started_at))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def cmd_status(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    urls = placer_urls_from_env(args.placer)
    tokens = TokenSet.load(args.token_dir)
    token = tokens.viewer or tokens.operator
    placers = [placer_status(u, token, args.timeout) for u in urls]
    leaders = {(p["leader"], p["epoch"]) for p in placers if p["leader"]}
    best = max(leaders, key=lambda le: le[1]) if leaders else None   # the newest epoch any of them knows
    out = {"leader": best[0] if best else None, "epoch": best[1] if best else 0, "placers": placers}
    if args.json:
        emit_json(out)
    else:
        print(f"leader: {out['leader'] or 'none known'}  epoch: {out['epoch']}")
        rows = [(p["url"], p["role"], p["leader"] or "-", p["epoch"],
                 "yes" if p.get("placing") or (not p.get("ha", True) and p["role"] == "leader") else "no",
                 _since(p.get("started_at")), f"{p.get('recover_s_left') or 0:.1f}", p.get("nodes_reported", 0),
                 p.get("why") or p.get("error") or "") for p in placers]
        print(table(["PLACER", "ROLE", "LEADER", "EPOCH", "PLACING", "UP", "RECOVER_S", "NODES", "NOTE"], rows))
    return 0 if best is not None else 1
