"""`herd artifact publish|fetch|prefetch|show|diff|refs|gc|verify` (refs and gc: cli/origin_gc.py).

Human output by default (progress on a TTY, on stderr); ``--json`` prints exactly one
JSON object on stdout. Failures are one line on stderr and a non-zero exit (cli.main).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import trio

from cli.main import CliError
from cli.output import emit_json, human_bytes, parse_size, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("artifact", help="publish, fetch, inspect and verify content-addressed artifacts")
    a = p.add_subparsers(dest="artifact_cmd", metavar="CMD")
    a.required = True

    s = a.add_parser("publish", help="chunk DIR, upload what the origin lacks, move ref NAME to it")
    s.add_argument("dir", help="directory to publish")
    _origin_arg(s)
    s.add_argument("--name", required=True, help="ref to move, e.g. trainer:v42")
    s.add_argument("--avg-chunk", default=None, metavar="SIZE",
                   help="average chunk size (e.g. 1MiB; min = avg/4, max = avg*4)")
    s.add_argument("--dedup-refs", type=int, default=None, metavar="N",
                   help="take the chunks the manifests of the name's last N refs name as present "
                        "(default 4; 0: ask the origin about every chunk)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_publish)

    f = a.add_parser("fetch", help="fetch REF into a local store and make DIR hold its tree")
    f.add_argument("ref", help="a ref name (name:tag) or a 64-hex manifest id")
    _origin_arg(f)
    f.add_argument("--store", required=True, help="chunk store directory")
    f.add_argument("--into", required=True,
                   help="path that ends up holding the tree (a symlink to the store's read-only tree)")
    f.add_argument("--quota", default=None, metavar="SIZE", help="store quota (LRU eviction), e.g. 50GiB")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="a peer's data-plane URL to fetch from (repeatable; herd protocol, origin last)")
    f.add_argument("--node-id", default=None, help="this node's id in the herd (default the hostname)")
    f.add_argument("--token-dir", default=None, help="token dir holding cluster.token (env HERD_TOKEN_DIR)")
    f.set_defaults(func=cmd_fetch)

    pf = a.add_parser("prefetch", help="preheat REF on nodes through the placer (fetch, start nothing)")
    pf.add_argument("ref", help="a ref name (name:tag) or a 64-hex manifest id")
    _origin_arg(pf)
    pf.add_argument("--placer", default=os.environ.get("HERD_PLACER"), help="placer URL (env HERD_PLACER)")
    g = pf.add_mutually_exclusive_group(required=True)
    g.add_argument("--nodes", help="comma-separated node ids")
    g.add_argument("--within", metavar="LEVEL:NAME", help="a topology domain, e.g. rack:r12 (zone|block|rack)")
    pf.add_argument("--token-dir", default=None, help="token dir holding operator.token (env HERD_TOKEN_DIR)")
    pf.add_argument("--timeout", type=float, default=10.0, metavar="S",
                    help="seconds to wait for the placer's answer (default 10)")
    pf.add_argument("--wait", action="store_true",
                    help="wait until every node holds the manifest complete (progress over the nodes); "
                         "exit non-zero naming the nodes that failed")
    pf.add_argument("--wait-timeout", type=float, default=1800.0, metavar="S",
                    help="with --wait: seconds before nodes not done yet count as failed (default 1800)")
    pf.add_argument("--json", action="store_true", help="print one JSON object")
    pf.set_defaults(func=cmd_prefetch)

    sh = a.add_parser("show", help="describe the manifest REF names")
    sh.add_argument("ref", help="a ref name (name:tag) or a 64-hex manifest id")
    _origin_arg(sh)
    sh.add_argument("--json", action="store_true", help="print one JSON object")
    sh.set_defaults(func=cmd_show)

    d = a.add_parser("diff", help="files added, removed and changed from REF_A to REF_B; bytes new")
    d.add_argument("ref_a", help="the older ref or manifest id")
    d.add_argument("ref_b", help="the newer ref or manifest id")
    _origin_arg(d)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=cmd_diff)

    from cli import origin_gc
    origin_gc.register(a, _origin_arg)

    v = a.add_parser("verify", help="re-hash every chunk and manifest of a store; drop bad ones")
    v.add_argument("--store", required=True, help="chunk store directory")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=cmd_verify)


def _origin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--origin", default=os.environ.get("HERD_ORIGIN"),
                   help="origin URL: file:///dir, gs://bucket/prefix, https://mirror (env HERD_ORIGIN)")
    p.add_argument("--retries", type=int, default=5,
                   help="retries of a failing origin request (default 5; fetch: each chunk asked at most N+1 times)")


def _open(args: argparse.Namespace, *, retries: int | None = None) -> Any:
    """The origin ``--origin`` names, its transport retrying ``--retries`` times (or
    ``retries``: 0 where the caller is the retry layer, as the herd is for a fetch)."""
    from p2p.origins import open_origin

    if not args.origin:
        raise CliError("--origin URL is required (or set HERD_ORIGIN)")
    if args.retries < 0:
        raise CliError("--retries must be >= 0")
    return open_origin(args.origin, retries=args.retries if retries is None else retries)


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0
        self._t0 = time.monotonic()
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        rate = done / max(now - self._t0, 1e-6)
        sys.stderr.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% {human_bytes(done)}/{human_bytes(total)}"
                         f" {human_bytes(rate)}/s ")
        sys.stderr.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _params(avg: str | None) -> Any:
    from manifests import ChunkerParams

    if avg is None:
        return ChunkerParams()
    try:
        size = parse_size(avg)
    except ValueError:
        raise CliError(f"--avg-chunk: not a size: {avg!r}") from None
    return ChunkerParams(min_size=max(64, size // 4), avg_size=size, max_size=size * 4)


# ------------------------------------------------------------------------------------ publish

def cmd_publish(args: argparse.Namespace) -> int:
    from p2p.publish import DEDUP_REFS, publish

    params = _params(args.avg_chunk)
    dedup = DEDUP_REFS if args.dedup_refs is None else args.dedup_refs
    if dedup < 0:
        raise CliError(f"--dedup-refs must be >= 0 (got {dedup})")
    if not Path(args.dir).is_dir():
        raise CliError(f"not a directory: {args.dir}")
    progress = Progress("upload", not args.json)
    if progress.enabled:
        sys.stderr.write(f"scanning {args.dir} ...\n")
        sys.stderr.flush()

    async def main() -> Any:
        async with _open(args) as origin:
            return await publish(args.dir, origin, args.name, params, progress=progress, dedup_refs=dedup)

    try:
        stats = trio.run(main)
    finally:
        progress.close()
    if args.json:
        emit_json(stats)
    else:
        print(f"published {stats.name} -> {stats.manifest}")
        print(f"  {stats.files} files, {human_bytes(stats.bytes)}, {stats.chunks} chunks; uploaded "
              f"{stats.chunks_uploaded} chunks ({human_bytes(stats.bytes_uploaded)}) in {stats.seconds:.2f}s")
        if stats.dedup_refs:
            print(f"  {stats.chunks_known} chunks known from {', '.join(stats.dedup_refs)}; "
                  f"{stats.chunks_checked} checked at the origin")
    return 0


# -------------------------------------------------------------------------------------- fetch

def _point_into(into: Path, tree: Path) -> None:
    """Make ``into`` a symlink to ``tree``, atomically replacing an earlier symlink (or an
    empty directory). Anything else at ``into`` is left alone and refused."""
    if into.is_symlink():
        pass
    elif into.is_dir():
        if any(into.iterdir()):
            raise CliError(f"--into {into} is a non-empty directory; give a new path or an earlier --into symlink")
        into.rmdir()
    elif into.exists():
        raise CliError(f"--into {into} exists and is not a directory or symlink")
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp = into.parent / f".{into.name}.{uuid.uuid4().hex[:8]}"
    os.symlink(tree.resolve(), tmp)
    try:
        os.replace(tmp, into)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cmd_fetch(args: argparse.Namespace) -> int:
    from p2p.fetch import fetch_artifact
    from p2p.store import ChunkStore

    quota = None
    if args.quota:
        try:
            quota = parse_size(args.quota)
        except ValueError:
            raise CliError(f"--quota: not a size: {args.quota!r}") from None
    into = Path(args.into)
    if into.exists() and not into.is_symlink() and not into.is_dir():
        raise CliError(f"--into {into} exists and is not a directory or symlink")
    if into.is_dir() and not into.is_symlink() and any(into.iterdir()):
        raise CliError(f"--into {into} is a non-empty directory; give a new path or an earlier --into symlink")
    store = ChunkStore(args.store, quota_bytes=quota)
    progress = Progress("fetch", not args.json)

    async def main() -> Any:
        async with _open(args) as control:
            mid = await control.resolve(args.ref)
        # One retry layer, with or without --peer: the herd's origin call asks a chunk at
        # most --retries + 1 times; the origin it reads through does not retry (retries=0)
        async with _open(args, retries=0) as origin:
            stats = await fetch_artifact(store, mid, origin, progress=progress, peers=args.peer,
                                         node_id=args.node_id, token=_cluster_token(args),
                                         origin_tries=args.retries + 1)
        tree = await trio.to_thread.run_sync(store.materialise, mid)
        return stats, tree

    try:
        stats, tree = trio.run(main)
    finally:
        progress.close()
    _point_into(into, tree)
    if args.json:
        emit_json(stats)
    else:
        print(f"fetched {stats.manifest} into {into} -> {tree}")
        print(f"  {human_bytes(stats.bytes)}: {human_bytes(stats.bytes_from_origin)} from origin, "
              f"{human_bytes(stats.bytes_from_peers)} from peers, {human_bytes(stats.bytes_local)} already local; "
              f"{stats.chunks_fetched} chunks in {stats.seconds:.2f}s")
    return 0


def _cluster_token(args: argparse.Namespace) -> str | None:
    if not args.peer:
        return None
    from infra.auth import TokenSet, token_dir_from_env

    tok = TokenSet.load(args.token_dir).cluster
    if tok is None:
        raise CliError(f"--peer needs the cluster token: no cluster.token in {token_dir_from_env(args.token_dir)}")
    return tok


def cmd_prefetch(args: argparse.Namespace) -> int:
    from infra.auth import TokenSet
    from scheduler_link.client import PlacerClient, placer_url_from_env
    from scheduler_link.messages import PrefetchFanout

    if not args.placer:
        raise CliError("--placer URL is required (or set HERD_PLACER)")
    level = domain = None
    nodes: list[str] = []
    if args.within:
        level, sep, domain = args.within.partition(":")
        if not sep or level not in ("zone", "block", "rack") or not domain:
            raise CliError(f"--within: want LEVEL:NAME with LEVEL zone|block|rack, got {args.within!r}")
    else:
        nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
        if not nodes:
            raise CliError("--nodes: give at least one node id")

    async def resolve_sized() -> tuple[str, int]:
        from manifests import decode_manifest

        async with _open(args) as origin:
            mid = await origin.resolve(args.ref)
            if not args.wait:
                return mid, 0
            m = decode_manifest(await origin.get_manifest(mid), mid)
            return mid, sum(c.size for c in m.chunks)

    mid, unique_bytes = trio.run(resolve_sized)
    req = PrefetchFanout(manifest_id=mid, origin=args.origin, nodes=nodes, level=level, domain=domain)
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    if args.wait and args.wait_timeout <= 0:
        raise CliError("--wait-timeout must be > 0")
    tokens = TokenSet.load(args.token_dir)
    with PlacerClient(placer_url_from_env(args.placer), tokens.operator, timeout=args.timeout) as c:
        res = c.prefetch(req)
        per = {k: _why(v) for k, v in res.get("nodes", {}).items()}
        urls = _control_urls(c, [k for k, v in per.items() if v.get("ok")]) if args.wait else {}
    if args.wait:
        per = _wait(args, mid, unique_bytes, per, urls, tokens.viewer or tokens.operator)
    failed = sorted(k for k, v in per.items() if not v.get("ok"))
    if args.json:
        emit_json({"manifest": mid, **res, "nodes": per, "waited": bool(args.wait), "failed": failed})
    else:
        print(f"prefetch {mid} on {len(per)} nodes" + (" (complete on every node)" if args.wait and not failed else ""))
        rows = [[k, "ok" if v.get("ok") else "failed", v.get("error") or ""] for k, v in sorted(per.items())]
        if rows:
            print(table(["node", "result", "error"], rows))
    if failed:
        print(f"herd: error: prefetch failed on {len(failed)} of {len(per)} nodes: {', '.join(failed[:20])}"
              + (" …" if len(failed) > 20 else ""), file=sys.stderr)
        return 1
    return 0


def _why(v: dict[str, Any]) -> dict[str, Any]:
    """The placer passes on an agent's status, not always its reason: a 403 from an agent's
    ``POST /v1/prefetch`` means the origin is not among its allowed origins (agent/api.py)."""
    if not v.get("ok") and not v.get("error") and v.get("status") == 403:
        return {**v, "error": "the agent refused the origin: not among its allowed origins (herd agent run "
                              "--allowed-origin URL)"}
    return v


def _control_urls(c: Any, want: list[str]) -> dict[str, str]:
    """Each node's agent URL, from the placer's node pages (1000 a request)."""
    need = set(want)
    out: dict[str, str] = {}
    off = 0
    while need - set(out):
        page = c.nodes_page(f"{off}:1000")
        for n in page.nodes:
            if n.node_id in need and n.control_url:
                out[n.node_id] = n.control_url
        off += len(page.nodes)
        if not page.nodes or off >= page.total:
            break
    return out


def _wait(args: argparse.Namespace, mid: str, unique_bytes: int, per: dict[str, Any], urls: dict[str, str],
          token: str | None) -> dict[str, Any]:
    from cli.prefetch_wait import NodeWait, wait_nodes

    waits = [NodeWait(node=k, url=urls[k]) for k in sorted(per) if per[k].get("ok") and k in urls]
    out = {k: dict(v) for k, v in per.items()}
    for k, v in per.items():
        if v.get("ok") and k not in urls:
            out[k] = {"ok": False, "error": "the placer does not know this node's agent URL"}
    bar = Progress("prefetch", not args.json)

    def draw(nodes: list[NodeWait], total: int) -> None:
        bar.label = f"prefetch {sum(n.complete for n in nodes)}/{len(nodes)} nodes"
        bar(sum(total if n.complete else n.done for n in nodes), total * len(nodes))

    try:
        trio.run(lambda: wait_nodes(waits, mid, unique_bytes, token=token, request_timeout=args.timeout,
                                    deadline_s=args.wait_timeout, progress=draw))
    finally:
        bar.close()
    for w in waits:
        out[w.node] = {"ok": w.complete, "error": w.error, "complete": w.complete,
                       "bytes_done": unique_bytes if w.complete else w.done, "bytes_total": unique_bytes}
    return out


# ---------------------------------------------------------------------------------- show/diff

async def _manifest(origin: Any, ref: str) -> Any:
    from manifests import decode_manifest

    mid = await origin.resolve(ref)
    return decode_manifest(await origin.get_manifest(mid), mid)


def cmd_show(args: argparse.Namespace) -> int:
    from manifests import to_json_view

    async def main() -> Any:
        async with _open(args) as origin:
            return await _manifest(origin, args.ref)

    m = trio.run(main)
    view = to_json_view(m)
    if args.json:
        emit_json({"manifest": m.id, "ref": args.ref, **{k: v for k, v in view.items() if k != "id"}})
        return 0
    c = m.chunker
    print(f"manifest {m.id}  ({args.ref})")
    print(f"  {view['files']} files, {human_bytes(view['bytes'])}, {view['unique_chunks']} unique chunks "
          f"({human_bytes(view['unique_bytes'])}); chunker {c.name} {c.version} "
          f"{human_bytes(c.min_size)}/{human_bytes(c.avg_size)}/{human_bytes(c.max_size)}")
    rows = []
    for e in view["entries"]:
        extra = f"-> {e['target']}" if e["kind"] == "symlink" else ""
        size = human_bytes(e["size"]) if e["kind"] == "file" else ""
        rows.append((e["mode"], e["kind"], size, e["path"] + (" " + extra if extra else "")))
    print(table(["MODE", "KIND", "SIZE", "PATH"], rows))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from manifests.plan import diff

    async def main() -> Any:
        async with _open(args) as origin:
            return await _manifest(origin, args.ref_a), await _manifest(origin, args.ref_b)

    a, b = trio.run(main)
    d = diff(a, b)
    if args.json:
        emit_json({"a": a.id, "b": b.id, **msgspec.structs.asdict(d)})
        return 0
    print(f"{args.ref_a} ({a.id[:12]}) -> {args.ref_b} ({b.id[:12]})")
    for mark, paths in (("+", d.added), ("-", d.removed), ("~", d.changed)):
        for p in paths:
            print(f"  {mark} {p}")
    print(f"{len(d.added)} added, {len(d.removed)} removed, {len(d.changed)} changed; "
          f"{human_bytes(d.bytes_new)} in {d.chunks_new} new chunks")
    return 0


# ------------------------------------------------------------------------------------- verify

def cmd_verify(args: argparse.Namespace) -> int:
    from p2p.store import ChunkStore

    if not Path(args.store).is_dir():
        raise CliError(f"no store at {args.store}")
    report = ChunkStore(args.store).verify()
    if args.json:
        emit_json({**msgspec.structs.asdict(report), "ok": report.ok})
    else:
        print(f"checked {report.chunks_checked} chunks ({human_bytes(report.bytes_checked)}) and "
              f"{report.manifests_checked} manifests in {report.seconds:.2f}s")
    if not report.ok:
        print(f"herd: error: store {args.store} had {len(report.bad_chunks)} bad chunks and "
              f"{len(report.bad_manifests)} bad manifests (dropped; fetch again to repair)", file=sys.stderr)
        return 1
    return 0
