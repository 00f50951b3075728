"""`herd version` and `herd --version`: this package's version, the wire version and
Python's; with a placer or agent URL (flags or $HERD_PLACER / $HERD_AGENT), theirs as
their ``/healthz`` says (a daemon too old to say is reported as such, an unreachable one
or a server that is not herd in one line, and the exit status is 1)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

from cli.output import emit_json
from infra.version import package_version as _package_version
from scheduler_link.client import ClientError
from scheduler_link.daemon_client import DaemonClient
from scheduler_link.messages import WIRE_VERSION


def package_version() -> str:
    return _package_version("unknown (not installed)")


def local_versions() -> dict[str, Any]:
    return {"herd": package_version(), "wire": WIRE_VERSION, "python": platform.python_version()}


def version_line() -> str:
    v = local_versions()
    return f"herd {v['herd']} (wire {v['wire']}, Python {v['python']})"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_line` and exit 0 (no daemon is asked)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, default: str = argparse.SUPPRESS,
                 help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(version_line() + "\n")
        parser.exit(0)


def remote_version(url: str, who: str, timeout: float) -> dict[str, Any]:
    """``{"url", "version", "wire"}`` from a daemon's public ``/healthz``; ``{"url", "error"}``
    when it cannot say."""
    try:
        with DaemonClient(url, who, timeout=timeout) as c:
            body = c.json("GET", "/healthz")
    except ClientError as e:
        return {"url": url, "error": str(e)}
    if not isinstance(body, dict) or "ok" not in body:
        return {"url": url, "error": f"{who} at {url} answered /healthz with something else: not a herd server"}
    return {"url": url, "version": body.get("version") or "unknown (too old to say)",
            "wire": body.get("wire_version")}


def cmd_version(args: argparse.Namespace) -> int:
    out: dict[str, Any] = local_versions()
    failed = False
    for who, url in (("placer", args.placer or os.environ.get("HERD_PLACER")),
                     ("agent", args.agent or os.environ.get("HERD_AGENT"))):
        if url:
            out[who] = remote_version(url, who, args.timeout)
            failed |= "error" in out[who]
    if args.json:
        emit_json(out)
    else:
        print(version_line())
        for who in ("placer", "agent"):
            if who in out:
                d = out[who]
                print(f"{who} {d['url']}: " + (d["error"] if "error" in d else
                                               f"herd {d['version']} (wire {d['wire'] or 'unknown'})"))
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("version", help="herd's version, the wire version, Python's, and a placer's/agent's")
    v.add_argument("--placer", default=None, help="also ask this placer (default $HERD_PLACER, if set)")
    v.add_argument("--agent", default=None, help="also ask this agent (default $HERD_AGENT, if set)")
    v.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each daemon (default 10)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=cmd_version)
