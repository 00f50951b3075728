"""`herd artifact refs` and `herd artifact gc`: an origin over time (p2p/gc.py decides).

``refs`` lists every ref with its manifest, the artifact's size and the ref's date. ``gc``
marks from the refs it keeps and sweeps the rest older than the grace; it prints one line
per ref and manifest it removes (chunks: with ``--json``, every id), then the bytes freed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from typing import Any

import trio

from cli.main import CliError
from cli.output import emit_json, human_age, human_bytes, parse_duration, table


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def cmd_refs(args: argparse.Namespace) -> int:
    from cli.artifact import _open
    from p2p.gc import ref_table

    async def main() -> list[dict[str, Any]]:
        async with _open(args) as origin:
            return await ref_table(origin)

    rows = trio.run(main)
    if args.json:
        emit_json({"origin": args.origin, "refs": rows})
        return 0
    if not rows:
        print(f"no refs at {args.origin}")
        return 0
    print(table(["REF", "MANIFEST", "SIZE", "FILES", "UPDATED"],
                [[r["ref"], (r["manifest"] or "(not a manifest id)")[:16],
                  human_bytes(r["bytes"]) if r["ok"] else "missing", r["files"] if r["ok"] else "",
                  _when(float(r["updated"]))] for r in rows]))
    bad = [r["ref"] for r in rows if not r["ok"]]
    if bad:
        print(f"herd: warning: {len(bad)} refs name a manifest the origin does not hold: {', '.join(bad[:5])}",
              file=sys.stderr)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from cli.artifact import _open
    from p2p.gc import GcPolicy, GcReport, check_policy, collect

    try:
        grace = parse_duration(args.grace)
    except ValueError:
        raise CliError(f"--grace: not a duration: {args.grace!r} (e.g. 7d, 12h, 30m, 0)") from None
    policy = GcPolicy(keep_last=args.keep_last, keep=tuple(args.keep or ()), grace_s=grace)
    try:
        check_policy(policy)
    except ValueError as e:
        raise CliError(str(e), code=2) from None

    async def main() -> GcReport:
        async with _open(args) as origin:
            return await collect(origin, policy, dry_run=args.dry_run)

    rep = trio.run(main)
    if args.json:
        emit_json(rep)
        return 0
    verb = "would remove" if rep.dry_run else "removed"
    for r in rep.removed_refs:
        print(f"{verb} ref {r}")
    for m in rep.removed_manifests:
        print(f"{verb} manifest {m}")
    print(f"{verb} {len(rep.removed_refs)} refs, {len(rep.removed_manifests)} manifests, "
          f"{len(rep.removed_chunks)} chunks: {human_bytes(rep.bytes_freed)} "
          f"{'would be ' if rep.dry_run else ''}freed")
    print(f"kept {len(rep.kept_refs)} refs, {rep.manifests_kept} manifests, {rep.chunks_kept} chunks "
          f"({human_bytes(rep.bytes_kept)}); grace {human_age(rep.grace_s)}, last {rep.keep_last} of each name")
    if rep.restored:
        print(f"put back {len(rep.restored)} objects a publish named while gc ran")
    if rep.dangling_refs:
        print(f"herd: warning: kept refs naming a manifest the origin does not hold: "
              f"{', '.join(rep.dangling_refs[:5])}", file=sys.stderr)
    return 0


def register(a: Any, origin_arg: Any) -> None:
    """Add ``refs`` and ``gc`` to the ``herd artifact`` sub-commands."""
    from p2p.publish import DEDUP_REFS

    r = a.add_parser("refs", help="list an origin's refs: manifest ids, sizes, dates")
    origin_arg(r)
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_refs)

    g = a.add_parser("gc", help="remove refs, manifests and chunks no kept ref needs (older than the grace)")
    origin_arg(g)
    g.add_argument("--keep-last", type=int, default=DEDUP_REFS, metavar="N",
                   help=f"refs kept per name, newest first (default and minimum {DEDUP_REFS}: publish's dedup window)")
    g.add_argument("--keep", nargs="+", action="extend", metavar="REF",
                   help="refs kept whatever their age (repeatable)")
    g.add_argument("--grace", default=os.environ.get("HERD_GC_GRACE", "7d"), metavar="DURATION",
                   help="only objects older than this go; every manifest younger is kept (default 7d)")
    g.add_argument("--dry-run", action="store_true", help="print what would go; remove nothing")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_gc)


