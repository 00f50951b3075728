"""`herd node cordon|uncordon|drain NODE`: take a node out of service and back;
`herd node approve NODE --rack Z/B/R` (or `--list`): pin a node's rack.

cordon: nothing new is placed there. drain: cordon, then the preemptible gangs on it stop
(gracefully; their restart policy places them elsewhere) and the non-preemptible ones are
listed and left, unless ``--force``. ``--wait`` waits until no workload is left there.
approve: the node registers and relays in that rack only, where its certificate pins none
(placer.relaypolicy; a certificate's rack comes first).
"""

from __future__ import annotations

import argparse
import time

import msgspec

from cli.job import _client, _common
from cli.main import CliError
from cli.output import emit_json, table
from scheduler_link.client import PlacerClient
from scheduler_link.messages import NodeOp, NodeView

_view = msgspec.convert


def _wait_empty(c: PlacerClient, node_id: str, timeout_s: float) -> NodeView:
    """Poll the node's view (every 0.2 s, bounded) until no live workload is left on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = c.node(node_id)
        if v is None:
            raise CliError(f"node {node_id} is no longer known to the placer")
        if v.workloads == 0:
            return v
        if time.monotonic() >= deadline:
            raise CliError(f"node {node_id} still has {v.workloads} workload(s) after {timeout_s:g}s")
        time.sleep(0.2)


def cmd_approve(args: argparse.Namespace) -> int:
    if args.list:
        if args.node or args.rack:
            raise CliError("--list takes no NODE or --rack")
        with _client(args) as c:
            rows = c.approvals()
        if args.json:
            emit_json({"approvals": rows})
            return 0
        if not rows:
            print("no rack approvals")
            return 0
        print(table(["NODE", "APPROVED RACK", "REGISTERED RACK", "CERTIFICATE RACK"],
                    [[r["node_id"], r["rack"], r["registered_rack"] or "-", r["certificate_rack"] or "-"]
                     for r in rows]))
        return 0
    if not args.node or not args.rack:
        raise CliError("give NODE and --rack ZONE/BLOCK/RACK (or --list)")
    with _client(args) as c:
        out = c.approve_rack(args.node, args.rack)
    if args.json:
        emit_json(out)
        return 0
    pinned = out.get("pinned") or {}
    print(f"node {args.node}: rack {args.rack} approved", end="")
    if pinned.get("by") == "certificate" and pinned.get("rack") != args.rack:
        print(f"; its certificate pins rack {pinned.get('rack')}, which comes first", end="")
    if out.get("registered_rack"):
        print(f"; it is registered in rack {out['registered_rack']} now: it relays there no more and its next registration there is refused",
              end="")
    print()
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    op: str = args.node_cmd
    if op == "drain" and args.grace is not None and not 0 <= args.grace <= 3600:
        raise CliError("--grace must be within 0..3600 seconds")
    body = NodeOp(reason=args.reason, grace_s=getattr(args, "grace", None), force=getattr(args, "force", False))
    with _client(args) as c:
        out = c.node_op(args.node, op, body)
        view = _view(out["node"], NodeView)
        if op == "drain" and args.wait:
            view = _wait_empty(c, args.node, args.wait_timeout)
    if args.json:
        emit_json({**out, "node": view})
        return 0
    state = "draining" if view.draining else "cordoned" if view.cordoned else "schedulable"
    print(f"node {view.node_id}: {state} ({view.workloads} workload(s) on it)")
    if op == "drain":
        for j in out.get("stopped", []):
            print(f"  stopping {j}")
        for j in out.get("left", []):
            print(f"  left running {j} (not preemptible; --force stops it)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("node", help="cordon, drain and uncordon nodes on the placer")
    ns = p.add_subparsers(dest="node_cmd", metavar="CMD")
    ns.required = True
    for name, what in (("cordon", "place nothing new on NODE (what runs there stays)"),
                       ("uncordon", "put NODE back in service"),
                       ("drain", "cordon NODE, then stop its preemptible workloads so they are placed elsewhere")):
        s = ns.add_parser(name, help=what)
        s.add_argument("node", help="node id")
        s.add_argument("--reason", default=None, help="why (shown in the jobs' reasons and the log)")
        if name == "drain":
            s.add_argument("--grace", type=float, default=None, metavar="S",
                           help="seconds each workload gets between SIGTERM and SIGKILL (default its job's)")
            s.add_argument("--force", action="store_true",
                           help="stop the workloads of non-preemptible jobs too")
            s.add_argument("--wait", action="store_true", help="wait until no workload is left on the node")
            s.add_argument("--wait-timeout", type=float, default=300.0, metavar="S",
                           help="how long --wait waits, seconds (default 300)")
        _common(s)
        s.set_defaults(func=cmd_node)
    a = ns.add_parser("approve", help="pin NODE's rack (where its certificate pins none): it registers and "
                                      "relays there only")
    a.add_argument("node", nargs="?", default=None, help="node id")
    a.add_argument("--rack", default=None, metavar="ZONE/BLOCK/RACK", help="the rack NODE is in")
    a.add_argument("--list", action="store_true", help="list the approvals")
    _common(a)
    a.set_defaults(func=cmd_approve)
