"""`herd logs WORKLOAD` (from an agent) and `herd job logs JOB` (through the placer: the
job's pods page names the node holding a rank, the node's view its control URL).

``--follow`` asks the agent to stream (``?follow=1``, chunked) and copies what arrives to
stdout until the agent ends the answer (the workload ended) or the user interrupts; an
agent that does not stream answers the tail and the command ends there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from cli.main import CliError
from infra.auth import TokenSet, auth_header
from scheduler_link.client import ClientError, PlacerClient, placer_url_from_env
from scheduler_link.daemon_client import DaemonClient


class AgentViewer:
    """Reads on one agent: its workloads and their logs (the viewer token, or the operator's)."""

    def __init__(self, url: str, token_dir: str | None, timeout: float, *, node_id: str | None = None) -> None:
        if timeout <= 0:
            raise CliError("--timeout must be > 0")
        t = TokenSet.load(token_dir)
        self.url = url.rstrip("/")
        # over https the token is not sent (DaemonClient): the TLS dir's client certificate speaks
        self._c = DaemonClient(self.url, "agent", headers=auth_header(t.viewer or t.operator), timeout=timeout,
                               expect=f"node:{node_id}" if node_id else "node")
        self._send = self._c.send

    def close(self) -> None:
        self._c.close()

    def resolve(self, given: str) -> str:
        """The workload id as given, or the one the agent knows that starts with it."""
        try:
            self._send("GET", f"/v1/workloads/{given}")
            return given
        except ClientError as e:
            if e.status != 404:
                raise
            unknown = e
        body = self._c.json("GET", "/v1/workloads")
        if not isinstance(body, list):
            raise CliError(f"agent at {self.url} answered /v1/workloads with something else: not a herd server")
        ids = sorted({str(w.get("workload_id")) for w in body if isinstance(w, dict)})
        found = [w for w in ids if w.startswith(given)]
        if not found:
            raise CliError(f"{unknown} (nor a workload whose id starts with it)")
        if len(found) > 1:
            raise CliError(f"workload id {given!r} is ambiguous: {', '.join(found[:5])}"
                           + (" …" if len(found) > 5 else ""))
        return found[0]

    def copy(self, wid: str, *, tail: int, stderr: bool, follow: bool, out: Any) -> None:
        params = {"tail": str(tail), "stream": "stderr" if stderr else "stdout"}
        if not follow:
            out.write(self._send("GET", f"/v1/workloads/{wid}/logs", params=params).text)
            out.flush()
            return
        params["follow"] = "1"
        # a follow has no overall deadline; each wait for the next bytes is bounded by the
        # read timeout the agent's keep-alive lines stay under
        r = self._send("GET", f"/v1/workloads/{wid}/logs", params=params, stream=True, unbounded_read=True)
        for chunk in self._c.iter_bytes(r):
            out.write(chunk.decode(errors="replace"))
            out.flush()


def _tail(v: int) -> int:
    if not 0 <= v <= 100_000:
        raise CliError("--tail must be within 0..100000")
    return v


def cmd_logs(args: argparse.Namespace) -> int:
    url = args.agent or os.environ.get("HERD_AGENT")
    if not url:
        raise CliError("no agent given: pass --agent URL or set HERD_AGENT")
    a = AgentViewer(url, args.token_dir, args.timeout)
    try:
        a.copy(a.resolve(args.workload), tail=_tail(args.tail), stderr=args.stderr, follow=args.follow,
               out=sys.stdout)
    finally:
        a.close()
    return 0


def cmd_job_logs(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise CliError("--timeout must be > 0")
    with PlacerClient(placer_url_from_env(args.placer), TokenSet.load(args.token_dir).operator,
                      timeout=args.timeout) as c:
        job_id = c.resolve_job(args.job_id)
        v = c.job(job_id, pods=f"{args.rank}:1")
        pod = next((p for p in v.pods if p.rank == args.rank), None)
        if pod is None:
            raise CliError(f"job {job_id} (attempt {v.attempt}, {v.state}) has no pod of rank {args.rank}"
                           + (f" (it has {v.pods_total})" if v.pods_total else ""))
        node = c.node(pod.node_id)
        if node is None or not node.control_url:
            raise CliError(f"rank {args.rank} of job {job_id} is on node {pod.node_id}, which the placer "
                           "no longer knows")
    a = AgentViewer(node.control_url, args.token_dir, args.timeout, node_id=node.node_id)
    try:
        a.copy(pod.workload_id, tail=_tail(args.tail), stderr=args.stderr, follow=args.follow, out=sys.stdout)
    finally:
        a.close()
    return 0


def _log_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing new output until the workload ends (Ctrl-C stops)")
    p.add_argument("--tail", type=int, default=100, metavar="N", help="start with the last N lines (default 100)")
    p.add_argument("--stderr", action="store_true", help="the workload's stderr instead of its stdout")


def add_job_logs(js: argparse._SubParsersAction,
                 common: Callable[[argparse.ArgumentParser], None]) -> None:
    lg = js.add_parser("logs", help="a job's pod logs, read from the node that runs the rank")
    lg.add_argument("job_id", help="job id, or a unique prefix of one")
    lg.add_argument("--rank", type=int, default=0, help="which pod (default rank 0)")
    _log_flags(lg)
    common(lg)
    lg.set_defaults(func=cmd_job_logs)


def register(sub: argparse._SubParsersAction) -> None:
    lg = sub.add_parser("logs", help="a workload's logs from an agent")
    lg.add_argument("workload", help="workload id, or a unique prefix of one")
    lg.add_argument("--agent", default=None, help="agent control URL (default $HERD_AGENT)")
    lg.add_argument("--token-dir", default=None, help="token dir (default $HERD_TOKEN_DIR or /etc/herd/tokens)")
    lg.add_argument("--timeout", type=float, default=10.0, metavar="S",
                    help="seconds to wait for the agent's answer (default 10)")
    _log_flags(lg)
    lg.set_defaults(func=cmd_logs)
