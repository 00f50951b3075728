"""`herd artifact prefetch --wait`: poll each named node's agent (``GET /v1/store?manifest=``)
until it holds the manifest complete, drawing progress over the nodes (bytes done / total).

A node has failed when its agent no longer fetches the manifest and does not hold it
complete (the agent's log says why), when it refused the prefetch, or when its agent did
not answer before the deadline. Polls are concurrent (bounded) and each bounded by the
request timeout; the whole wait by ``--wait-timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from cli.output import human_bytes
from infra.errors import ClientError
from scheduler_link.client import verify_for
from scheduler_link.daemon_client import get_json

POLL_S = 0.5
CONCURRENCY = 64


@dataclass
class NodeWait:
    node: str
    url: str
    done: int = 0
    complete: bool = False
    error: str | None = None
    seen: bool = False           # the agent answered at least once
    last_error: str | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None


def _verdict(n: NodeWait, doc: dict[str, Any], manifest: str) -> None:
    """Apply one answer of the agent's store listing (plain: no I/O)."""
    n.seen = True
    held = [m for m in doc.get("manifests", []) or [] if isinstance(m, dict) and m.get("manifest_id") == manifest]
    fetching = manifest in (doc.get("fetching") or [])
    if held:
        n.done = int(held[0].get("present_bytes", 0))
        n.complete = bool(held[0].get("complete"))
    if not n.complete and not fetching:
        n.error = "its fetch ended without the manifest complete (see the agent's log)"


async def wait_nodes(nodes: list[NodeWait], manifest: str, total_per_node: int, *, token: str | None,
                     request_timeout: float, deadline_s: float,
                     progress: Callable[[list[NodeWait], int], None] | None = None) -> None:
    """Poll until every node finished or ``deadline_s`` passed (then the rest fail)."""
    limiter = trio.CapacityLimiter(CONCURRENCY)
    t_end = time.monotonic() + deadline_s
    # https agents are verified against the cluster CA (the TLS dir), as every CLI request is,
    # must hold a node certificate, and get no bearer token (the TLS dir's client certificate
    # proves the role: a token an agent saw could be replayed against the fleet)
    https = next((n.url for n in nodes if n.url.startswith("https://")), None)
    verify = verify_for(https, expect="node") if https else True
    headers = {"authorization": f"Bearer {token}"} if token and not https else {}
    async with httpx.AsyncClient(timeout=request_timeout, headers=headers, verify=verify) as c:
        async def poll(n: NodeWait) -> None:
            async with limiter:
                try:
                    status, doc = await get_json(c, f"{n.url.rstrip('/')}/v1/store", "agent",
                                                 params={"manifest": manifest})
                except ClientError as e:
                    n.last_error = str(e)
                    return
                if status != 200 or not isinstance(doc, dict):
                    n.last_error = (f"agent answered HTTP {status}" if status != 200 else
                                    "agent answered /v1/store with something else: not a herd server")
                    if status in (401, 403, 404):
                        n.error = n.last_error + " to GET /v1/store"
                    return
                _verdict(n, doc, manifest)

        while True:
            todo = [n for n in nodes if not n.finished]
            if todo:
                async with trio.open_nursery() as nursery:
                    for n in todo:
                        nursery.start_soon(poll, n)
            if progress is not None:
                progress(nodes, total_per_node)
            if all(n.finished for n in nodes):
                return
            if time.monotonic() >= t_end:
                for n in nodes:
                    if not n.finished:
                        n.error = (f"not complete after {deadline_s:.0f}s"
                                   f" ({human_bytes(n.done)} of {human_bytes(total_per_node)}"
                                   f"{'; ' + n.last_error if n.last_error else ''})")
                return
            await trio.sleep(POLL_S)
