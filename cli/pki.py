"""`herd pki init|issue|bootstrap-token|revoke|status`: the cluster's certificates (infra.pki)."""

from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path

from cli.main import CliError
from cli.output import emit_json, table
from infra import pki


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pki", help="the cluster CA and certificates (TLS between placer, agents, operators)")
    ps = p.add_subparsers(dest="pki_cmd", metavar="CMD")
    ps.required = True
    i = ps.add_parser("init", help="make a cluster CA with the placer's and the operator's certificates")
    i.add_argument("dir", help="the PKI dir (created 0700; keys 0600)")
    i.add_argument("--ca-days", type=int, default=pki.CA_DAYS, help=f"CA validity (default {pki.CA_DAYS})")
    i.add_argument("--days", type=int, default=pki.NODE_DAYS,
                   help=f"placer/operator validity (default {pki.NODE_DAYS})")
    i.add_argument("--san", action="append", default=[], metavar="NAME",
                   help="another DNS name or IP the placer is reached at (repeatable)")
    i.add_argument("--force", action="store_true", help="replace an existing CA (every old certificate stops verifying)")
    i.set_defaults(func=cmd_init)
    s = ps.add_parser("issue", help="issue a node's certificate (or a viewer/metrics/operator client certificate)")
    s.add_argument("dir", help="the PKI dir (holding ca.key)")
    who = s.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", metavar="NODE_ID", help="a node: writes DIR/nodes/NODE_ID/{ca.crt,node.crt,node.key}")
    who.add_argument("--role", choices=("viewer", "metrics", "operator", "placer"),
                     help="a client certificate, or the placer's (a re-issue): DIR/ROLE.crt")
    s.add_argument("--san", action="append", default=[], metavar="NAME",
                   help="the host's DNS names or IPs (repeatable)")
    s.add_argument("--days", type=int, default=pki.NODE_DAYS, help=f"validity (default {pki.NODE_DAYS})")
    s.add_argument("--rack", default=None, metavar="ZONE/BLOCK/RACK",
                   help="pin the node's rack in its certificate: the placer lets it register and relay "
                        "in that rack only (renewal keeps it; issue again to move it)")
    s.set_defaults(func=cmd_issue)
    b = ps.add_parser("bootstrap-token", help="a short-lived single-use token a new agent trades for its certificate")
    b.add_argument("dir", help="the PKI dir the placer's ca_dir names")
    b.add_argument("--ttl", type=float, default=pki.TOKEN_TTL_S, metavar="S",
                   help=f"seconds the token is valid (default {pki.TOKEN_TTL_S:g})")
    bn = b.add_mutually_exclusive_group(required=True)
    bn.add_argument("--node", metavar="NODE_ID", default=None, help="the node that may use it")
    bn.add_argument("--any-node", action="store_true",
                    help="an unbound token: whoever holds it picks the node id (a node id with a live "
                         "certificate is still refused)")
    b.add_argument("--rack", default=None, metavar="ZONE/BLOCK/RACK",
                   help="the rack the certificate it buys pins (see herd pki issue --rack)")
    b.set_defaults(func=cmd_token)
    r = ps.add_parser("revoke", help="deny a node (and every certificate issued to it) at every TLS handshake")
    r.add_argument("dir", help="the PKI dir the placer's ca_dir names")
    r.add_argument("node", nargs="?", default=None, metavar="NODE_ID", help="the node to deny")
    r.add_argument("--serial", action="append", default=[], metavar="HEX",
                   help="deny one certificate by its serial (repeatable)")
    r.add_argument("--undo", action="store_true",
                   help="take NODE_ID off the deny-list (its revoked certificates stay revoked: it needs a new one)")
    r.set_defaults(func=cmd_revoke)
    t = ps.add_parser("status", help="what expires when; bootstrap tokens; token-authenticated agents")
    t.add_argument("dir", nargs="?", default=None, help="the PKI dir")
    t.add_argument("--placer", default=None, help="also ask this placer (https://...) which agents still use tokens")
    t.add_argument("--tls-dir", default=None, help="CA and client certificate for --placer (default $HERD_TLS_DIR)")
    t.add_argument("--token-dir", default=None, help="token dir for --placer (default $HERD_TOKEN_DIR)")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=cmd_status)


def _positive(v: float, what: str) -> None:
    if v <= 0:
        raise CliError(f"{what} must be > 0")


def cmd_init(args: argparse.Namespace) -> int:
    _positive(args.ca_days, "--ca-days")
    _positive(args.days, "--days")
    ca = pki.init(args.dir, ca_days=args.ca_days, days=args.days, names=args.san, force=args.force)
    print(f"CA {args.dir}/ca.crt (until {ca.cert.not_valid_after_utc:%Y-%m-%d}); placer.crt, operator.crt; "
          f"keys 0600. Next: herd pki issue --node NODE_ID {args.dir}")
    return 0


def cmd_issue(args: argparse.Namespace) -> int:
    _positive(args.days, "--days")
    if args.node:
        out = pki.issue_node(args.dir, args.node, days=args.days, names=args.san, rack=args.rack)
        pin = f", pinned to rack {args.rack}" if args.rack else ""
        print(f"{out}/node.crt for node:{args.node}{pin} (copy {out}/ to the host's tls_dir, e.g. /etc/herd/tls)")
    else:
        if args.rack:
            raise CliError("--rack pins a node's rack: it goes with --node")
        crt = pki.issue_role(args.dir, args.role, days=args.days, names=args.san)
        print(f"{crt} for {args.role}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    _positive(args.ttl, "--ttl")
    if not (Path(args.dir) / "ca.key").exists():
        raise CliError(f"no CA in {args.dir} (ca.key missing): run `herd pki init {args.dir}` first")
    token = pki.BootstrapTokens(Path(args.dir) / "bootstrap-tokens.json").create(
        ttl_s=args.ttl, node_id=None if args.any_node else args.node, rack=args.rack, now=time.time())
    print(token)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    if not (Path(args.dir) / "ca.crt").exists():
        raise CliError(f"no CA in {args.dir} (ca.crt missing)")
    rev = pki.Revocations(args.dir)
    if args.undo:
        if not args.node or args.serial:
            raise CliError("--undo takes a NODE_ID only")
        if not rev.lift(args.node):
            raise CliError(f"node {args.node} is not revoked")
        print(f"node {args.node} is no longer denied; its revoked certificates stay revoked "
              f"(herd pki bootstrap-token --node {args.node} {args.dir} for a new one)")
        return 0
    if not args.node and not args.serial:
        raise CliError("give a NODE_ID, --serial HEX, or both")
    if args.node is not None and (not args.node or "/" in args.node):
        raise CliError(f"node id must be non-empty without '/': {args.node!r}")
    denied = rev.revoke(args.node, serials=args.serial, now=time.time())
    who = f"node {args.node}" if args.node else "certificates"
    print(f"revoked {who}: serials {', '.join(denied) or '-'} ({rev.path}); the placer loads it within a tick "
          "and its agents within a heartbeat")
    return 0


def _when(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def cmd_status(args: argparse.Namespace) -> int:
    if not args.dir and not args.placer:
        raise CliError("give a PKI dir, --placer URL, or both")
    out: dict[str, object] = {}
    now = time.time()
    if args.dir:
        if not Path(args.dir).is_dir():
            raise CliError(f"no such PKI dir: {args.dir}")
        certs = pki.status(args.dir)
        out["certificates"] = [{"subject": c.subject, "path": c.path, "not_after": c.not_after.isoformat(),
                                "days_left": round(c.days_left(), 1), "rack": c.rack} for c in certs]
        tokens = pki.BootstrapTokens(Path(args.dir) / "bootstrap-tokens.json").list()
        out["bootstrap_tokens"] = [
            {"id": t["id"], "node": t["node_id"], "expires": _when(float(t["expires"])),  # type: ignore[arg-type]  # the token listing's values are JSON (typed object); expires is a number
             "state": "used" if t["used_by"] else "expired" if float(t["expires"]) <= now else "unused",  # type: ignore[arg-type]  # the token listing's values are JSON (typed object); expires is a number
             "used_by": t["used_by"]} for t in tokens]
        nodes, serials = pki.Revocations(args.dir).load()
        out["revoked"] = {"nodes": sorted(nodes), "serials": sorted(serials)}
    if args.placer:
        from infra.auth import TokenSet
        from scheduler_link.client import PlacerClient
        toks = TokenSet.load(args.token_dir)
        with PlacerClient(args.placer, toks.viewer or toks.operator, tls_dir=args.tls_dir) as c:
            out["placer"] = c.status()
    if args.json:
        emit_json(out)
        return 0
    if "certificates" in out:
        print(table(["SUBJECT", "EXPIRES", "DAYS LEFT", "RACK", "PATH"],
                    [[c["subject"], c["not_after"][:19], c["days_left"], c["rack"] or "-", c["path"]]
                     for c in out["certificates"]]))  # type: ignore[attr-defined]  # out is a dict of JSON-ready values (typed object); this key holds a list
        toks_out = out["bootstrap_tokens"]
        if toks_out:
            print()
            print(table(["TOKEN", "STATE", "NODE", "EXPIRES", "USED BY"],
                        [[t["id"], t["state"], t["node"] or "any", t["expires"], t["used_by"] or "-"]
                         for t in toks_out]))  # type: ignore[attr-defined]  # out is a dict of JSON-ready values (typed object); this key holds a list
        rev = out["revoked"]
        assert isinstance(rev, dict)
        if rev["nodes"] or rev["serials"]:
            print(f"\nrevoked: nodes {', '.join(rev['nodes']) or '-'}; {len(rev['serials'])} certificate serials")
    if "placer" in out:
        st = out["placer"]
        assert isinstance(st, dict)
        print(f"\nplacer {args.placer}: {'INSECURE (plain HTTP)' if st.get('insecure') else 'TLS'}; "
              f"accept_tokens={'on' if st.get('accept_tokens') else 'off'}; "
              f"certificate until {st.get('not_after') or '-'}")
        agents = st.get("token_agents") or {}
        if agents:
            print(f"token-authenticated agents ({st.get('token_agents_total', len(agents))}):")
            print(table(["NODE", "REQUESTS"], [[k, v] for k, v in agents.items()]))
        else:
            print("no token-authenticated agents")
    return 0
