"""Typed HTTP clients for the placer's API (used by the CLI, tests and benches).

Every failure becomes :class:`ClientError` with one clear line: the placer's own
``{"error", "detail"}`` when it answered, the transport's reason when it did not.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import msgspec

from .auth import auth_header
from .messages import ArtifactUpdate, DefragRequest, JobSpec, JobView, NodeView, PrefetchFanout


class JobPage(msgspec.Struct, frozen=True, kw_only=True):
    jobs: list[JobView] = []
    total: int = 0
    offset: int = 0


class NodePage(msgspec.Struct, frozen=True, kw_only=True):
    nodes: list[NodeView] = []
    total: int = 0
    offset: int = 0


_job = msgspec.json.Decoder(JobView)
_jobs = msgspec.json.Decoder(JobPage)
_nodes = msgspec.json.Decoder(NodePage)


class ClientError(Exception):
    """A request to a herd service failed (unreachable, refused, or an error answer)."""


def placer_url_from_env(explicit: str | None = None) -> str:
    url = explicit or os.environ.get("HERD_PLACER")
    if not url:
        raise ClientError("no placer URL: pass --placer URL or set HERD_PLACER")
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"placer URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def _check(r: httpx.Response) -> bytes:
    if r.status_code < 400:
        return r.content
    try:
        body = r.json()
        msg = body.get("error", "") + (f": {body['detail']}" if body.get("detail") else "")
    except ValueError:
        msg = r.text[:200]
    raise ClientError(f"placer answered {r.status_code}: {msg}")


class PlacerClient:
    """Synchronous client (the CLI is synchronous)."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._c = httpx.Client(base_url=self.url, headers=auth_header(token), timeout=timeout)

    def __enter__(self) -> PlacerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._c.close()

    def _req(self, method: str, path: str, **kw: Any) -> bytes:
        try:
            return _check(self._c.request(method, path, **kw))
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach the placer at {self.url}: {e or type(e).__name__}") from None

    def submit(self, spec: JobSpec) -> JobView:
        return _job.decode(self._req("POST", "/v1/jobs", content=msgspec.json.encode(spec)))

    def jobs(self, state: str | None = None, page: str | None = None) -> list[JobView]:
        """Jobs without pods (counts by pod state instead); one page (default the first 1000)."""
        params = {k: v for k, v in (("state", state), ("page", page)) if v}
        return _jobs.decode(self._req("GET", "/v1/jobs", params=params or None)).jobs

    def job(self, job_id: str, *, wait: str | None = None, timeout_ms: int = 10000,
            pods: str | None = None) -> JobView:
        """One job with one page of pods (``pods="OFFSET:LIMIT"``, default the first 100)."""
        params = {"wait": wait, "timeout_ms": str(timeout_ms)} if wait else {}
        if pods:
            params["pods"] = pods
        return _job.decode(self._req("GET", f"/v1/jobs/{job_id}", params=params or None))

    def cancel(self, job_id: str) -> JobView:
        return _job.decode(self._req("DELETE", f"/v1/jobs/{job_id}"))

    def update_artifact(self, job_id: str, manifest_id: str, origin: str | None = None) -> JobView:
        body = msgspec.json.encode(ArtifactUpdate(manifest_id=manifest_id, origin=origin))
        return _job.decode(self._req("POST", f"/v1/jobs/{job_id}/artifact", content=body))

    def nodes(self, page: str | None = None) -> list[NodeView]:
        """One page of nodes in id order (default the first 1000); see :meth:`nodes_page`."""
        return self.nodes_page(page).nodes

    def nodes_page(self, page: str | None = None) -> NodePage:
        return _nodes.decode(self._req("GET", "/v1/nodes", params={"page": page} if page else None))

    def cluster(self) -> dict[str, Any]:
        return msgspec.json.decode(self._req("GET", "/v1/cluster"))

    def defrag(self, max_moves: int = 8, apply: bool = False) -> dict[str, Any]:
        body = msgspec.json.encode(DefragRequest(max_moves=max_moves, apply=apply))
        return msgspec.json.decode(self._req("POST", "/v1/defrag", content=body))

    def prefetch(self, req: PrefetchFanout) -> dict[str, Any]:
        return msgspec.json.decode(self._req("POST", "/v1/prefetch", content=msgspec.json.encode(req)))
