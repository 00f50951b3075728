"""`herd agent run|place|stop` and `herd status`: the node agent's command line."""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

import httpx
import msgspec

from cli.main import CliError
from cli.output import emit_json, human_bytes, table
from infra.auth import TokenSet, auth_header
from scheduler_link.client import not_herd_line
from scheduler_link.daemon_client import DaemonClient
from scheduler_link.messages import Placement, PlacementAck, PodAssignment, RestartPolicy, WorkloadStatus


def _agent_url(args: argparse.Namespace) -> str:
    url = args.agent or os.environ.get("HERD_AGENT")
    if not url:
        raise CliError("no agent given: pass --agent URL or set HERD_AGENT")
    return url.rstrip("/")


def _tokens(args: argparse.Namespace) -> TokenSet:
    return TokenSet.load(args.token_dir)


def _read_headers(args: argparse.Namespace) -> dict[str, str]:
    """Reads on the agent need the viewer role (scheduler_link/authz.py); the operator's
    token holds it too. Over https no token goes to an agent: the TLS dir's client
    certificate (operator, viewer or metrics) proves the role instead."""
    if _agent_url(args).startswith("https://"):
        return {}
    t = _tokens(args)
    return auth_header(t.viewer or t.operator)


def _operator_headers(args: argparse.Namespace) -> dict[str, str]:
    """Operator actions on an agent. Over https: the operator's certificate (mutual TLS), never
    the fleet-wide operator token, which a compromised agent could replay against the placer
    and every other agent; over plain http (an insecure lab set-up) the token."""
    if _agent_url(args).startswith("https://"):
        return {}
    tok = _tokens(args).operator
    if not tok:
        raise CliError("no operator token found (use --token-dir or HERD_TOKEN_DIR)")
    return auth_header(tok)


def _check(r: httpx.Response, what: str) -> Any:
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not ("error" in body or "reason" in body):
            raise CliError(f"{what} failed: {not_herd_line(r, 'agent')}")
        msg = str(body.get("error", "")) + (f": {body['detail']}" if body.get("detail") else "")
        if "reason" in body and body.get("accepted") is False:
            msg = f"refused: {body['reason']}"
        raise CliError(f"{what} failed ({r.status_code}): {msg}")
    try:
        return r.json()
    except ValueError:
        raise CliError(f"{what} failed: {not_herd_line(r, 'agent')}") from None


def _request(args: argparse.Namespace, method: str, path: str, what: str, **kw: Any) -> Any:
    with DaemonClient(_agent_url(args), "agent", timeout=args.timeout, expect="node") as c:
        return _check(c.send(method, path, check=False, **kw), what)


# ------------------------------------------------------------------ run

def cmd_run(args: argparse.Namespace) -> int:
    from agent.config import load_config, replace
    from agent.daemon import run_agent
    from agent.errors import ConfigError

    try:
        cfg = load_config(args.config, {
            "node_id": args.node_id, "gpus": args.gpus, "state_dir": args.state_dir, "listen": args.listen,
            "data_listen": args.data_listen, "placer": args.placer, "token_dir": args.token_dir,
            "zone": args.zone, "block": args.block, "rack": args.rack, "heartbeat_s": args.heartbeat_s,
            "gpu_poll_interval_s": args.gpu_poll_interval_s,
            "allowed_origins": tuple(args.allowed_origin) if args.allowed_origin else None,
            "relay_enabled": True if args.relay else None, "relay_listen": args.relay_listen,
        })
        if args.no_data_plane:
            cfg = replace(cfg, data_listen=None)
        run_agent(cfg)
    except ConfigError as e:
        # EX_CONFIG (78): herd-agent.service's RestartPreventExitStatus= stops a restart loop on it
        raise CliError(str(e), code=os.EX_CONFIG) from None
    return 0


# ------------------------------------------------------------------ place

def _parse_restart(text: str) -> RestartPolicy:
    if text == "never":
        return RestartPolicy()
    kind, _, n = text.partition(":")
    if kind == "on-failure" and (n == "" or n.isdigit()):
        return RestartPolicy(kind="on-failure", limit=int(n or 3))
    raise CliError(f"--restart must be never or on-failure:N, not {text!r}")


def _pick_gpus(status: dict[str, Any], n: int | None, ids: str | None) -> list[dict[str, Any]]:
    gpus = status["gpus"]["gpus"]
    holders = status.get("gpu_holders", {})
    by_index = {g["index"]: g for g in gpus}
    if ids is not None:
        out = []
        for part in filter(None, (p.strip() for p in ids.split(","))):
            if part.isdigit():
                g = by_index.get(int(part))
            else:
                g = next((x for x in gpus if x["uuid"] == part), None)
            if g is None:
                raise CliError(f"no GPU {part} on this agent (has {len(gpus)})")
            out.append(g)
        return out
    free = [g for g in sorted(gpus, key=lambda g: g["index"])
            if g["health"] != "fatal" and g["uuid"] not in holders]
    healthy = [g for g in free if g["health"] == "healthy"] + [g for g in free if g["health"] != "healthy"]
    if n is None or n < 0:
        raise CliError("--gpus must be >= 0")
    if len(healthy) < n:
        raise CliError(f"only {len(healthy)} free usable GPUs on this agent, {n} asked")
    return healthy[:n]


def cmd_place(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise CliError("nothing to run: give the workload's command after --")
    if (args.artifact is None) != (args.origin is None):
        raise CliError("--artifact and --origin go together")
    env: dict[str, str] = {}
    for kv in args.env or []:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise CliError(f"--env takes KEY=VALUE, not {kv!r}")
        env[k] = v
    restart = _parse_restart(args.restart)
    manifest_id = None
    if args.artifact is not None:
        manifest_id = _resolve(args.artifact, args.origin)
    auth = _operator_headers(args)
    status = _request(args, "GET", "/v1/status", "reading agent status", headers=auth)
    gpus = _pick_gpus(status, args.gpus, args.gpu_ids)
    wid = args.workload_id or f"w-{uuid.uuid4().hex[:12]}"
    p = Placement(placement_id=f"direct-{uuid.uuid4().hex}", job_id=args.job_id or wid,
                  pods=[PodAssignment(workload_id=wid, rank=0, gpus=[g["uuid"] for g in gpus],
                                      gpu_indices=[g["index"] for g in gpus])],
                  argv=argv, env=env, manifest_id=manifest_id, origin=args.origin, grace_s=args.grace,
                  restart=restart)
    body = _request(args, "POST", "/v1/placements", "placement", content=msgspec.json.encode(p),
                    headers={**auth, "content-type": "application/json"})
    ack = msgspec.convert(body, PlacementAck)
    if not ack.accepted:
        raise CliError(f"placement refused: {ack.reason}")
    st = _request(args, "GET", f"/v1/workloads/{wid}", "reading the workload", headers=auth)
    if args.json:
        emit_json({"workload": wid, "gpus": [g["uuid"] for g in gpus], "state": st["state"],
                   "gpu_indices": [g["index"] for g in gpus], "manifest_id": manifest_id})
    else:
        print(wid)
    return 0


def _resolve(ref: str, origin_url: str) -> str:
    import trio

    from p2p.origins import open_origin
    from p2p.origins.base import is_manifest_id

    if is_manifest_id(ref):
        return ref

    async def go() -> str:
        async with open_origin(origin_url) as o:
            return await o.resolve(ref)
    return trio.run(go)


# ------------------------------------------------------------------ stop / status

def cmd_stop(args: argparse.Namespace) -> int:
    auth = _operator_headers(args)
    body: dict[str, Any] = {"reason": args.reason}
    if args.grace is not None:
        body["grace_s"] = args.grace
    from cli.logs import AgentViewer
    viewer = AgentViewer(_agent_url(args), args.token_dir, args.timeout)
    try:
        wid = viewer.resolve(args.workload)  # ids as printed, or a unique prefix
    finally:
        viewer.close()
    st = _request(args, "POST", f"/v1/workloads/{wid}/stop", "stop",
                  content=msgspec.json.encode(body), headers=auth)
    if args.json:
        emit_json(st)
    else:
        print(f"{st['workload_id']} {st['state']}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    st = _request(args, "GET", "/v1/status", "status", headers=_read_headers(args))
    if args.json:
        emit_json(st)
        return 0
    snap = st["gpus"]
    holders = st.get("gpu_holders", {})
    sim = " (SIMULATED GPUs)" if snap.get("simulated") else ""
    topo = st.get("topology", {})
    print(f"node {st['node_id']}  ready={st['ready']}  backend={snap.get('backend')}{sim}  "
          f"zone={topo.get('zone')} block={topo.get('block')} rack={topo.get('rack')}")
    print(f"control {st['control_url']}  data {st.get('data_url') or '-'}  "
          f"nvlink_domain {st.get('nvlink_domain') or '-'}")
    print()
    rows = [[g["index"], g["uuid"], g["name"], g["health"],
             ",".join(r["code"] for r in g.get("reasons", [])) or "-", holders.get(g["uuid"], "-")]
            for g in snap.get("gpus", [])]
    print(table(["GPU", "UUID", "NAME", "HEALTH", "REASONS", "WORKLOAD"], rows))
    print()
    wls = [msgspec.convert(w, WorkloadStatus) for w in st.get("workloads", [])]
    rows = [[w.workload_id, w.job_id, w.state, "" if w.exit_code is None else w.exit_code, len(w.gpus),
             w.pid or "-", w.reason or ""] for w in wls]
    print(table(["WORKLOAD", "JOB", "STATE", "EXIT", "GPUS", "PID", "REASON"], rows) if rows else "no workloads")
    store = st.get("store")
    if store:
        print(f"\nstore: {human_bytes(store.get('bytes', 0))} in {store.get('chunks', 0)} chunks, "
              f"{store.get('complete_manifests', 0)} complete manifests")
    return 0


# ------------------------------------------------------------------ registration

def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", help="agent control URL (default $HERD_AGENT)")
    p.add_argument("--token-dir", help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    p.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout in seconds (default 10)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")


def register(sub: Any) -> None:
    ag = sub.add_parser("agent", help="the node agent: run it, place and stop workloads")
    asub = ag.add_subparsers(dest="agent_command", metavar="ACTION")
    asub.required = True

    r = asub.add_parser("run", help="run the node agent daemon")
    r.add_argument("--config", help="TOML config file (see systemd/agent.toml)")
    r.add_argument("--node-id", help="node id (default: hostname)")
    r.add_argument("--gpus", help="nvml | simulated:PROFILE (default nvml)")
    r.add_argument("--state-dir", help="state directory (default /var/lib/herd)")
    r.add_argument("--listen", help="control API HOST:PORT (port 0 allowed; default 127.0.0.1:8470)")
    r.add_argument("--data-listen", help="data plane HOST:PORT (default 127.0.0.1:0)")
    r.add_argument("--no-data-plane", action="store_true", help="serve no data plane")
    r.add_argument("--placer", action="append", help="placer URL to register with (repeat for several placers)")
    r.add_argument("--token-dir", help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    r.add_argument("--zone", help="topology: this node's zone")
    r.add_argument("--block", help="topology: this node's block (within the zone)")
    r.add_argument("--rack", help="topology: this node's rack (within the block)")
    r.add_argument("--heartbeat-s", type=float, help="heartbeat interval to the placer")
    r.add_argument("--gpu-poll-interval-s", type=float, help="GPU polling interval")
    r.add_argument("--allowed-origin", action="append", metavar="URL",
                   help="an origin placements and prefetches may name (repeatable; a URL prefix: gs://bucket/prefix, "
                        "file:///dir, https://host/path); replaces agent.allowed_origins; default: none allowed")
    r.add_argument("--relay", action="store_true",
                   help="offer to relay for this node's rack (relay.enabled): the placer picks one relay per rack")
    r.add_argument("--relay-listen", metavar="HOST:PORT",
                   help="where this rack's members reach the relay (relay.listen; port 0 allowed)")
    r.set_defaults(func=cmd_run)

    p = asub.add_parser("place", help="place a workload directly on one agent")
    _common(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpus", type=int, help="number of free healthy GPUs to use")
    g.add_argument("--gpu-ids", help="GPU indices or UUIDs, comma-separated")
    p.add_argument("--artifact", help="artifact ref name:tag or manifest id (needs --origin)")
    p.add_argument("--origin", help="origin URL the artifact lives in")
    p.add_argument("--grace", type=float, default=30.0, help="grace period in seconds (default 30)")
    p.add_argument("--restart", default="never", help="never | on-failure:N (default never)")
    p.add_argument("--env", action="append", metavar="KEY=VALUE", help="extra environment (repeatable)")
    p.add_argument("--workload-id", help="workload id (default: generated)")
    p.add_argument("--job-id", help="job id (default: the workload id)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    p.set_defaults(func=cmd_place)

    s = asub.add_parser("stop", help="stop a workload gracefully")
    _common(s)
    s.add_argument("workload", help="workload id, or a unique prefix of one")
    s.add_argument("--grace", type=float, help="grace period in seconds (default: the workload's)")
    s.add_argument("--reason", default="stopped", help="reason recorded (default 'stopped')")
    s.set_defaults(func=cmd_stop)

    st = sub.add_parser("status", help="an agent's GPUs and workloads")
    _common(st)
    st.set_defaults(func=cmd_status)
