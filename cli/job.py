"""`herd job submit|list|show|cancel`, `herd cluster`, `herd nodes`."""

from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from cli.main import CliError
from cli.output import emit_json, table
from scheduler_link.auth import TokenSet
from scheduler_link.client import PlacerClient, placer_url_from_env
from scheduler_link.messages import JobSpec, JobView, RestartPolicy


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("job", help="submit, list, show and cancel jobs on the placer")
    js = p.add_subparsers(dest="job_cmd", metavar="CMD")
    js.required = True
    s = js.add_parser("submit", help="submit a gang job: herd job submit [FILE.toml] [flags] -- ARGV")
    s.add_argument("rest", nargs=argparse.REMAINDER, metavar="[FILE.toml] [flags] -- ARGV",
                   help="job TOML (flags override its keys), then the command after --")
    s.add_argument("--job-id", default=None)
    s.add_argument("--pods", type=int, default=None)
    s.add_argument("--gpus-per-pod", type=int, default=None)
    s.add_argument("--within", default=None, choices=["any", "zone", "block", "rack", "node", "nvlink"])
    s.add_argument("--priority", type=int, default=None)
    s.add_argument("--preemptible", action="store_true", default=None)
    s.add_argument("--not-preemptible", dest="preemptible", action="store_false")
    s.add_argument("--restart", default=None, help="never | on-failure:N | on-preemption")
    s.add_argument("--artifact", default=None, help="ref name:tag (resolved against --origin) or a manifest id")
    s.add_argument("--origin", default=None, help="origin URL (file://, gs://, http://)")
    s.add_argument("--grace", type=float, default=None, help="grace period in seconds")
    s.add_argument("--env", action="append", default=[], metavar="K=V")
    s.add_argument("--wait", default=None, help="wait until the job reaches this state (e.g. running)")
    _common(s)
    s.set_defaults(func=cmd_submit, parser=s, file=None, argv=[])
    ls = js.add_parser("list", help="list jobs")
    ls.add_argument("--state", default=None)
    _common(ls)
    ls.set_defaults(func=cmd_list)
    sh = js.add_parser("show", help="one job: pods, nodes, GPUs, states, timings")
    sh.add_argument("job_id")
    sh.add_argument("--pods", metavar="OFFSET:LIMIT", default=None,
                    help="which page of the job's pods to show (default the first 100)")
    _common(sh)
    sh.set_defaults(func=cmd_show)
    ca = js.add_parser("cancel", help="cancel a job (its workloads stop gracefully)")
    ca.add_argument("job_id")
    _common(ca)
    ca.set_defaults(func=cmd_cancel)
    c = sub.add_parser("cluster", help="capacity and fragmentation per topology level")
    _common(c)
    c.set_defaults(func=cmd_cluster)
    n = sub.add_parser("nodes", help="nodes known to the placer")
    _common(n)
    n.set_defaults(func=cmd_nodes)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placer", default=None, help="placer URL (default $HERD_PLACER)")
    p.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _client(args: argparse.Namespace) -> PlacerClient:
    return PlacerClient(placer_url_from_env(args.placer), TokenSet.load(args.token_dir).operator)


def parse_restart(text: str) -> RestartPolicy:
    if text == "never":
        return RestartPolicy(kind="never")
    if text == "on-preemption":
        return RestartPolicy(kind="on-preemption")
    if text.startswith("on-failure"):
        _, _, n = text.partition(":")
        try:
            limit = int(n) if n else 3
        except ValueError:
            raise CliError(f"bad --restart {text!r}: the limit must be an integer (on-failure:N)") from None
        if limit < 0:
            raise CliError("restart limit must be >= 0")
        return RestartPolicy(kind="on-failure", limit=limit)
    raise CliError(f"bad --restart {text!r}: expected never | on-failure:N | on-preemption")


def resolve_artifact(ref: str, origin: str | None) -> str:
    """A manifest id (64 hex) stays; a ``name:tag`` ref is resolved against the origin."""
    if len(ref) == 64 and all(c in "0123456789abcdef" for c in ref):
        return ref
    if not origin:
        raise CliError(f"--artifact {ref!r} is a ref: --origin is needed to resolve it")
    try:
        from p2p.origins import open_origin
    except ImportError:
        raise CliError("artifact refs need the p2p origins module, which is not installed") from None
    import trio

    async def go() -> str:
        o = open_origin(origin)
        try:
            return str(await o.resolve(ref))
        finally:
            close = getattr(o, "aclose", None)
            if close is not None:
                await close()
    return trio.run(go)


def build_spec(args: argparse.Namespace) -> JobSpec:
    data: dict[str, Any] = {}
    if args.file:
        try:
            raw = tomllib.loads(Path(args.file).read_text())
        except FileNotFoundError:
            raise CliError(f"job file not found: {args.file}") from None
        except tomllib.TOMLDecodeError as e:
            raise CliError(f"job file {args.file} is not valid TOML: {e}") from None
        data = dict(raw.get("job", raw))
        if isinstance(data.get("restart"), str):
            data["restart"] = msgspec.to_builtins(parse_restart(data["restart"]))
        if "grace" in data:
            data["grace_s"] = data.pop("grace")
        if "artifact" in data:
            args.artifact = args.artifact or data.pop("artifact")
    for flag, key in (("job_id", "job_id"), ("pods", "pods"), ("gpus_per_pod", "gpus_per_pod"),
                      ("within", "within"), ("priority", "priority"), ("preemptible", "preemptible"),
                      ("origin", "origin"), ("grace", "grace_s")):
        v = getattr(args, flag)
        if v is not None:
            data[key] = v
    if args.restart:
        data["restart"] = msgspec.to_builtins(parse_restart(args.restart))
    env = dict(data.get("env", {}))
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise CliError(f"bad --env {kv!r}: expected K=V")
        env[k] = v
    data["env"] = env
    argv = list(args.argv)
    if argv:
        data["argv"] = argv
    if not data.get("argv"):
        raise CliError("nothing to run: give the command after -- (or argv in the job file)")
    if args.artifact:
        data["manifest_id"] = resolve_artifact(args.artifact, data.get("origin"))
    try:
        return msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as e:
        raise CliError(f"bad job: {e}") from None


def _timing(v: JobView, key: str) -> str:
    t0 = v.timings.get("submitted")
    t = v.timings.get(key)
    return "" if t is None or t0 is None else f"{(t - t0) * 1000:.1f}ms"


def _print_job(v: JobView) -> None:
    s = v.spec
    print(f"job {v.job_id}: {v.state} (attempt {v.attempt}, restarts {v.restarts})"
          + (f" — {v.reason}" if v.reason else ""))
    print(f"  {s.pods} pod(s) x {s.gpus_per_pod} GPU(s) within {s.within}, priority {s.priority}, "
          f"{'preemptible' if s.preemptible else 'not preemptible'}, restart {s.restart.kind}")
    if v.timings:
        print("  timings: " + ", ".join(f"{k} +{_timing(v, k)}" for k in v.timings if k != "submitted"))
    if v.pod_counts:
        print(f"  pods: {v.pods_total} on {v.nodes_total} node(s), {v.gpus_total} GPU(s) — "
              + ", ".join(f"{k} {n}" for k, n in v.pod_counts.items()))
    if v.pods:
        print(table(["RANK", "NODE", "GPUS", "STATE", "WORKLOAD"],
                    [(p.rank, p.node_id, ",".join(map(str, p.gpu_indices)), p.state
                      + (f"({p.exit_code})" if p.exit_code is not None else ""), p.workload_id) for p in v.pods]))
        rest = v.pods_total - v.pods_offset - len(v.pods)
        if rest > 0:
            print(f"  … {rest} more pod(s): --pods {v.pods_offset + len(v.pods)}:100 shows the next page")


def split_submit_args(args: argparse.Namespace) -> None:
    """argparse stops at the first positional (FILE or the command); split the rest at
    ``--`` into FILE + flags (parsed again with the same parser) and the command."""
    rest = list(args.rest or [])
    if "--" in rest:
        i = rest.index("--")
        pre, args.argv = rest[:i], rest[i + 1:]
    else:
        pre, args.argv = [], rest  # no "--": everything from the first positional on is the command
        if rest and rest[0].endswith(".toml"):
            pre, args.argv = rest[:1], rest[1:]
    if pre and not pre[0].startswith("-"):
        args.file, pre = pre[0], pre[1:]
    if pre:
        args.parser.parse_args(pre, namespace=args)


def cmd_submit(args: argparse.Namespace) -> int:
    split_submit_args(args)
    spec = build_spec(args)
    with _client(args) as c:
        v = c.submit(spec)
        if args.wait:
            deadline = time.monotonic() + 600
            while v.state != args.wait and v.state not in ("succeeded", "failed", "cancelled", "preempted"):
                if time.monotonic() > deadline:
                    raise CliError(f"job {v.job_id} did not reach {args.wait} in time (now {v.state})")
                v = c.job(v.job_id, wait=args.wait, timeout_ms=30000)
    if args.json:
        emit_json(v)
    else:
        print(f"submitted {v.job_id} ({v.state})")
        if args.wait:
            _print_job(v)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = c.jobs(args.state)
    if args.json:
        emit_json({"jobs": jobs})
        return 0
    print(table(["JOB", "STATE", "PODS", "GPUS", "PRIO", "ATTEMPT", "NODES"],
                [(j.job_id, j.state, j.spec.pods, j.spec.pods * j.spec.gpus_per_pod, j.spec.priority, j.attempt,
                  j.nodes_total) for j in jobs]) if jobs else "no jobs")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        v = c.job(args.job_id, pods=args.pods)
    if args.json:
        emit_json(v)
    else:
        _print_job(v)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        v = c.cancel(args.job_id)
    if args.json:
        emit_json(v)
    else:
        print(f"job {v.job_id}: {v.state}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.cluster()
    if args.json:
        emit_json(out)
        return 0
    m = out["model"]
    print(f"nodes: {out['nodes']['up']} up, {out['nodes']['lost']} lost ({out['nodes']['simulated']} simulated)")
    print(f"GPUs: {m['gpus']} total, {m['usable']} usable, {m['free']} free, {m['allocated']} allocated, "
          f"{m['unhealthy_gpus']} unhealthy")
    frag = out.get("fragmentation") or {}
    largest = out.get("largest_placeable") or {}
    rows = [(lv, d["domains"], d["wholly_free"], d["largest_free"],
             f"{frag[lv]:.3f}" if lv in frag else "-", largest.get(lv, ""))
            for lv, d in m["levels"].items()]
    print(table(["LEVEL", "DOMAINS", "WHOLLY FREE", "LARGEST FREE", "FRAGMENTATION", "LARGEST PLACEABLE"], rows))
    if "overall" in frag:
        print(f"fragmentation overall {frag['overall']:.3f} (share of free GPUs that typical job shapes cannot use; "
              "'-': no typical shape of that level fits this cluster)")
    print("jobs: " + (", ".join(f"{k} {v}" for k, v in sorted(out["jobs"].items())) or "none"))
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as c:
        nodes = c.nodes()
    if args.json:
        emit_json({"nodes": nodes})
        return 0
    print(table(["NODE", "STATE", "ZONE/BLOCK/RACK", "GPUS", "FREE", "UNHEALTHY", "WORKLOADS", "SIM"],
                [(n.node_id, n.state, f"{n.topology.zone}/{n.topology.block}/{n.topology.rack}", n.gpus, n.free_gpus,
                  ",".join(map(str, n.unhealthy_gpus)), n.workloads, "yes" if n.simulated else "")
                 for n in nodes]) if nodes else "no nodes")
    return 0
