"""`herd job submit|list|show|cancel|logs`, `herd cluster`, `herd nodes`."""

from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path
from typing import Any, get_args

import msgspec

from cli.main import CliError
from cli.output import emit_json, table
from infra.auth import TokenSet
from scheduler_link.client import PlacerClient, placer_url_from_env
from scheduler_link.messages import JobSpec, JobState, JobView, NodeView, RestartPolicy, Within

JOB_STATES: tuple[str, ...] = get_args(JobState)
WITHIN: tuple[str, ...] = get_args(Within)
TERMINAL = ("succeeded", "failed", "cancelled", "preempted")
# states a job passes through in this order on its way to running (a job seen later in
# the order has reached the earlier ones)
_PROGRESS = ("pending", "placing", "starting", "running")
# keys a job file may hold: JobSpec's fields (less the wire version) and the CLI's spellings
_FILE_KEYS = frozenset(f for f in JobSpec.__struct_fields__ if f != "version") | {"grace", "artifact"}


def _submit_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--job-id", default=None, help="the job's id (default: the placer names it)")
    s.add_argument("--pods", type=int, default=None, help="number of pods in the gang (default 1)")
    s.add_argument("--gpus-per-pod", type=int, default=None, help="GPUs each pod gets (default 1)")
    s.add_argument("--within", default=None, choices=WITHIN,
                   help="topology domain all pods must share: " + " | ".join(WITHIN) + " (default any)")
    s.add_argument("--priority", type=int, default=None,
                   help="higher preempts lower preemptible jobs (default 0)")
    s.add_argument("--preemptible", action="store_true", default=None,
                   help="the job may be preempted by higher-priority jobs (the default)")
    s.add_argument("--not-preemptible", dest="preemptible", action="store_false",
                   help="the job is never preempted (nor stopped by a drain without --force)")
    s.add_argument("--restart", default=None, metavar="POLICY",
                   help="never | on-failure[:N] | on-preemption (default never)")
    s.add_argument("--artifact", default=None, help="ref name:tag (resolved against --origin) or a manifest id")
    s.add_argument("--origin", default=None, help="origin URL (file://, gs://, http://)")
    s.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL (default 30)")
    s.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment for the pods (repeatable; read APIs show the names only)")
    s.add_argument("--env-from-file", action="append", default=[], metavar="K=PATH",
                   help="set K from the file PATH on each host, read by the agent at start (for secrets: "
                        "the value never travels in the job; PATH under the agent's env_files_prefixes)")
    s.add_argument("--wait", default=None, choices=JOB_STATES, metavar="STATE",
                   help="wait until the job reaches STATE; exit 1 with its reason if it ends otherwise "
                        "or --wait-timeout passes (" + " | ".join(JOB_STATES) + ")")
    _wait_timeout(s)
    _common(s)


def _wait_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait-timeout", type=float, default=300.0, metavar="S",
                   help="how long --wait waits, seconds (default 300)")


def register(sub: argparse._SubParsersAction) -> None:
    from cli.logs import add_job_logs
    p = sub.add_parser("job", help="submit, list, show, cancel jobs on the placer and read their logs")
    js = p.add_subparsers(dest="job_cmd", metavar="CMD")
    js.required = True
    s = js.add_parser("submit", help="submit a gang job: herd job submit [FILE.toml] [flags] [-- ARGV]",
                      description="Submit a gang job. FILE.toml (keys as JobSpec's, optionally under [job]) "
                                  "and flags go in any order before --; flags override the file's keys; the "
                                  "command after -- overrides the file's argv.")
    s.add_argument("rest", nargs=argparse.REMAINDER, metavar="[FILE.toml] [flags] [-- ARGV]",
                   help="job TOML and flags in any order, then the command after --")
    _submit_flags(s)
    s.set_defaults(func=cmd_submit, file=None, argv=[])
    ls = js.add_parser("list", help="list jobs")
    ls.add_argument("--state", default=None, choices=JOB_STATES, metavar="STATE",
                    help="only jobs in STATE: " + " | ".join(JOB_STATES))
    _common(ls)
    ls.set_defaults(func=cmd_list)
    sh = js.add_parser("show", help="one job: pods, nodes, GPUs, states, timings")
    sh.add_argument("job_id", help="job id, or a unique prefix of one")
    sh.add_argument("--pods", metavar="OFFSET:LIMIT", default=None,
                    help="which page of the job's pods to show (default the first 100)")
    _common(sh)
    sh.set_defaults(func=cmd_show)
    ca = js.add_parser("cancel", help="cancel a job (its workloads stop gracefully)")
    ca.add_argument("job_id", help="job id, or a unique prefix of one")
    ca.add_argument("--wait", action="store_true",
                    help="wait until the job is cancelled; exit 1 with its reason if it ends otherwise")
    _wait_timeout(ca)
    _common(ca)
    ca.set_defaults(func=cmd_cancel)
    add_job_logs(js, _common)
    c = sub.add_parser("cluster", help="capacity and fragmentation per topology level")
    _common(c)
    c.set_defaults(func=cmd_cluster)
    n = sub.add_parser("nodes", help="nodes known to the placer (cordoned and draining ones say so)")
    n.add_argument("--state", default=None, choices=("up", "lost"), help="only nodes up | lost")
    n.add_argument("--page", default=None, metavar="OFFSET:LIMIT", help="which page (default the first 1000)")
    _common(n)
    n.set_defaults(func=cmd_nodes)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placer", default=None, help="placer URL (default $HERD_PLACER)")
    p.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds to wait for each answer from the placer (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _client(args: argparse.Namespace) -> PlacerClient:
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    return PlacerClient(placer_url_from_env(args.placer), TokenSet.load(args.token_dir).operator,
                        timeout=args.timeout)


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
        data = _file_keys(args.file, raw)
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
    files = dict(data.get("env_from_files", {}))
    for kv in getattr(args, "env_from_file", []):
        k, sep, v = kv.partition("=")
        if not sep or not k or not v:
            raise CliError(f"bad --env-from-file {kv!r}: expected K=PATH")
        files[k] = v
    data["env_from_files"] = files
    argv = list(args.argv)
    if argv:
        data["argv"] = argv  # -- ARGV wins over the file's argv
    if "within" in data and data["within"] not in WITHIN:
        raise CliError(f"bad within {data['within']!r}: expected one of " + " | ".join(WITHIN))
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
    if s.env:
        print("  env: " + ", ".join(sorted(s.env)) + " (values not shown)")
    if s.env_from_files:
        print("  env from host files: " + ", ".join(f"{k}={p}" for k, p in sorted(s.env_from_files.items())))
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


def _file_keys(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The job table of a job file (top level, or under ``[job]``); a key herd does not know
    is an error naming it (a typo must not be silently dropped)."""
    if "job" in raw:
        extra = sorted(set(raw) - {"job"})
        if extra:
            raise CliError(f"job file {path}: unknown top-level key {extra[0]!r} (only [job] is read)")
        if not isinstance(raw["job"], dict):
            raise CliError(f"job file {path}: 'job' must be a table")
        raw = raw["job"]
    unknown = sorted(set(raw) - _FILE_KEYS)
    if unknown:
        raise CliError(f"job file {path}: unknown key {unknown[0]!r}"
                       + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                       + "; known: " + ", ".join(sorted(_FILE_KEYS)))
    return dict(raw)


def _flags_parser() -> argparse.ArgumentParser:
    """The submit flags with FILE as an optional positional: parses what came before ``--``."""
    from cli.main import Parser
    p = Parser(prog="herd job submit", usage="herd job submit [FILE.toml] [flags] [-- ARGV]",
               description="Submit a gang job (FILE.toml and flags in any order before --).")
    p.add_argument("file", nargs="?", default=None, metavar="FILE.toml", help="job file (keys as JobSpec's)")
    _submit_flags(p)
    return p


def split_submit_args(args: argparse.Namespace) -> None:
    """argparse stops at the first positional (FILE or the command) and hands the rest over
    in ``args.rest``. What precedes ``--`` is FILE and flags in any order (parsed again, over
    the flags already parsed); what follows is the command. Without ``--``, a rest starting
    with a ``.toml`` file is FILE and flags (the file's argv runs); otherwise it is the
    command itself (``herd job submit --pods 2 python train.py``)."""
    rest = list(args.rest or [])
    if "--" in rest:
        i = rest.index("--")
        pre, args.argv = rest[:i], rest[i + 1:]
    elif rest and rest[0].endswith(".toml"):
        pre, args.argv = rest, []
    else:
        pre, args.argv = [], rest
    if pre:
        _flags_parser().parse_args(pre, namespace=args)


def _reached(v: JobView, want: str) -> bool:
    """Has the job reached ``want``? Passing states count once a later one is seen."""
    if v.state == want:
        return True
    if want in _PROGRESS and v.state in _PROGRESS:
        return _PROGRESS.index(v.state) > _PROGRESS.index(want)
    return want == "running" and v.state == "succeeded" and "running" in v.timings


def wait_for(c: PlacerClient, v: JobView, want: str, timeout_s: float) -> JobView:
    """Poll (the placer's bounded long-poll) until the job reached ``want``; a
    :class:`CliError` with the job's reason when it ended otherwise or time ran out."""
    deadline = time.monotonic() + timeout_s
    while not _reached(v, want):
        if v.state in TERMINAL:
            raise CliError(f"job {v.job_id} ended {v.state}, not {want}"
                           + (f": {v.reason}" if v.reason else ""))
        left = deadline - time.monotonic()
        if left <= 0:
            raise CliError(f"job {v.job_id} did not reach {want} within {timeout_s:g}s (now {v.state}"
                           + (f": {v.reason}" if v.reason else "") + ")")
        # the long-poll must end before the per-request --timeout does
        poll_ms = int(max(0.05, min(left, c.request_timeout * 0.8, 30.0)) * 1000)
        v = c.job(v.job_id, wait=want, timeout_ms=poll_ms, pods="0:100")
    return v


def cmd_submit(args: argparse.Namespace) -> int:
    split_submit_args(args)
    spec = build_spec(args)
    with _client(args) as c:
        v = c.submit(spec)
        if not args.json:
            print(f"submitted {v.job_id} ({v.state})", flush=True)
        if args.wait:
            v = wait_for(c, v, args.wait, args.wait_timeout)
    if args.json:
        emit_json(v)
    elif args.wait:
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
        v = c.job(c.resolve_job(args.job_id), pods=args.pods)
    if args.json:
        emit_json(v)
    else:
        _print_job(v)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        v = c.cancel(c.resolve_job(args.job_id))
        if args.wait:
            v = wait_for(c, v, "cancelled", args.wait_timeout)
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


def node_flags(n: NodeView) -> str:
    return "draining" if n.draining else "cordoned" if n.cordoned else ""


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as c:
        page = c.nodes_page(args.page, state=args.state)
    if args.json:
        emit_json({"nodes": page.nodes, "total": page.total, "offset": page.offset})
        return 0
    nodes = page.nodes
    print(table(["NODE", "STATE", "SCHED", "ZONE/BLOCK/RACK", "GPUS", "FREE", "UNHEALTHY", "WORKLOADS", "SIM"],
                [(n.node_id, n.state, node_flags(n) or "ok", f"{n.topology.zone}/{n.topology.block}/{n.topology.rack}",
                  n.gpus, n.free_gpus, ",".join(map(str, n.unhealthy_gpus)), n.workloads,
                  "yes" if n.simulated else "") for n in nodes]) if nodes else "no nodes")
    rest = page.total - page.offset - len(nodes)
    if rest > 0:
        print(f"… {rest} more node(s): --page {page.offset + len(nodes)}:1000 shows the next page")
    return 0
