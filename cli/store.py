"""`herd store ls|evict --agent URL`: the manifests an agent's chunk store holds, and
evicting them (one by id, or every one no fetch or workload uses)."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from typing import Any

import msgspec

from cli.agent import _common, _read_headers, _request, _tokens
from cli.main import CliError
from cli.output import emit_json, human_age, human_bytes, table
from infra.auth import auth_header


def cmd_ls(args: argparse.Namespace) -> int:
    doc = _request(args, "GET", "/v1/store", "store listing", headers=_read_headers(args))
    if args.json:
        emit_json(doc)
        return 0
    rows = []
    now = time.time()
    for m in sorted(doc["manifests"], key=lambda m: m["last_used"], reverse=True):
        state = "complete" if m["complete"] else (
            "fetching" if m["manifest_id"] in doc.get("fetching", []) else
            f"partial {m['present_bytes'] * 100 // max(1, m['chunk_bytes'])}%")
        rows.append([m["manifest_id"][:16], human_bytes(m["bytes"]), human_bytes(m["present_bytes"]), state,
                     "yes" if m["pinned"] else "no", "yes" if m["materialised"] else "no",
                     f"{human_age(now - m['last_used'])} ago ("
                     f"{datetime.datetime.fromtimestamp(m['last_used'], datetime.UTC):%Y-%m-%d %H:%MZ})"])
    if not rows:
        print(f"node {doc['node_id']}: no manifests in the store")
        return 0
    print(f"node {doc['node_id']}: {len(rows)} manifests, "
          f"{human_bytes(sum(m['present_bytes'] for m in doc['manifests']))} held")
    print(table(["MANIFEST", "SIZE", "HELD", "STATE", "PINNED", "TREE", "LAST USED"], rows))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    if (args.manifest is None) == (not args.unused):
        raise CliError("give a MANIFEST id or --unused (one of them)", code=2)
    tok = _tokens(args).operator
    if not tok:
        raise CliError("no operator token found (use --token-dir or HERD_TOKEN_DIR)")
    mid = args.manifest
    if mid is not None and len(mid) < 64:  # a prefix as `herd store ls` prints it
        doc = _request(args, "GET", "/v1/store", "store listing", headers=auth_header(tok))
        found = [m["manifest_id"] for m in doc["manifests"] if m["manifest_id"].startswith(mid)]
        if len(found) != 1:
            raise CliError(f"manifest {mid!r} is {'ambiguous' if found else 'not in the store'} on this agent")
        mid = found[0]
    body: dict[str, Any] = {"manifest_id": mid} if mid else {"unused": True}
    rep = _request(args, "POST", "/v1/store/evict", "evict", content=msgspec.json.encode(body),
                   headers={**auth_header(tok), "content-type": "application/json"})
    if args.json:
        emit_json(rep)
        return 0
    for m in rep["manifests"]:
        print(f"evicted manifest {m}")
    print(f"evicted {len(rep['manifests'])} manifests and {rep['chunks']} chunks: {human_bytes(rep['bytes_freed'])} freed")
    for m, why in sorted(rep.get("refused", {}).items()):
        print(f"kept {m}: {why}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    st = sub.add_parser("store", help="an agent's chunk store: list its manifests, evict them")
    ssub = st.add_subparsers(dest="store_command", metavar="ACTION")
    ssub.required = True
    ls = ssub.add_parser("ls", help="manifests held: sizes, bytes held, pinned, last used")
    _common(ls)
    ls.set_defaults(func=cmd_ls)
    ev = ssub.add_parser("evict", help="evict MANIFEST (its tree and the chunks no other manifest needs), "
                                       "or --unused: every manifest no fetch or workload uses")
    ev.add_argument("manifest", nargs="?", help="a manifest id (or a unique prefix, as `herd store ls` prints)")
    ev.add_argument("--unused", action="store_true", help="every manifest not in use, and chunks none names")
    _common(ev)
    ev.set_defaults(func=cmd_evict)
