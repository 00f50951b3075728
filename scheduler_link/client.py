"""Typed HTTP clients for the placer's API (used by the CLI, tests and benches).

Every failure becomes :class:`ClientError` with one clear line: the placer's own
``{"error", "detail"}`` when it answered, the transport's reason when it did not.

TLS: an ``https://`` URL is verified against the cluster CA only (``verify=`` an
:func:`infra.tls.client_context`), with the operator's (or viewer's) client
certificate when the TLS dir holds one; the TLS dir is ``tls_dir=``, else ``$HERD_TLS_DIR``,
else ``/etc/herd/tls``. The peer must hold a certificate whose principal is ``placer``: the
context checks it inside the TLS handshake (``expect="placer"``, :class:`infra.tls.HerdContext`),
so no request, bearer token or job env leaves for anyone else -- a node certificate that happens
to carry the placer host's address is not the placer. A context the caller passes in is checked
after the answer instead (:func:`check_peer`), unless it expects ``placer`` itself.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from infra import tls
from infra.auth import auth_header
from infra.errors import ClientError as ClientError  # re-exported: callers import it from here

from . import leaderprobe
from .messages import (
    ArtifactUpdate,
    DefragRequest,
    JobSpec,
    JobView,
    NodeOp,
    NodeView,
    PrefetchFanout,
    RackApproval,
)
from .placers import Placers, leader_of, not_leading, placer_urls, placer_urls_from_env, retry_after_s


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


def placer_url_from_env(explicit: str | None = None) -> str:
    """``--placer`` else ``$HERD_PLACER``: one URL, or several comma-separated (several placers,
    one leading: :class:`PlacerClient` fails over between them)."""
    return ",".join(placer_urls_from_env(explicit))


def error_line(r: httpx.Response, who: str) -> str:
    """One line for an error answer: a herd daemon's ``{"error", "detail"}``, or, when the
    answer is not one (an HTML page, a proxy's text), that the server is not herd."""
    try:
        body = msgspec.json.decode(r.content)
    except msgspec.DecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        msg = body["error"] + (f": {body['detail']}" if body.get("detail") else "")
        return f"{who} answered {r.status_code}: {msg}"
    return not_herd_line(r, who)


def not_herd_line(r: httpx.Response, who: str) -> str:
    ctype = r.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    return (f"{who} at {r.request.url.copy_with(query=None)} answered HTTP {r.status_code} with "
            f"{ctype} ({len(r.content)} bytes): not a herd server (wrong URL or port?)")


def _check(r: httpx.Response, who: str = "placer") -> bytes:
    if r.status_code < 400:
        return r.content
    raise ClientError(error_line(r, who), status=r.status_code)


def decode_answer(dec: msgspec.json.Decoder[Any], r: httpx.Response, who: str) -> Any:
    """Decode a 2xx answer; one that is not the JSON a herd daemon sends is 'not a herd server'."""
    try:
        return dec.decode(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise ClientError(not_herd_line(r, who)) from None


_any = msgspec.json.Decoder()

DEFAULT_TLS_DIR = "/etc/herd/tls"
CLIENT_CERTS = ("operator", "viewer", "metrics")   # the first the TLS dir holds is presented


def tls_dir_from_env(explicit: str | os.PathLike[str] | None = None) -> Path:
    return Path(explicit or os.environ.get("HERD_TLS_DIR") or DEFAULT_TLS_DIR)


def operator_context(tls_dir: str | os.PathLike[str] | None = None, *,
                     cert: str | None = None, expect: str | None = None) -> ssl.SSLContext:
    """The CLI's TLS context: the cluster CA of the TLS dir, with ``cert`` (or the first of
    :data:`CLIENT_CERTS` the dir holds) as the client certificate, none when it holds none;
    the peer must be ``expect`` (``placer``, ``node:X``, ``node``), checked in the handshake."""
    d = tls_dir_from_env(tls_dir)
    ca = d / "ca.crt"
    if not ca.is_file():
        raise ClientError(f"no cluster CA at {ca}: pass --tls-dir DIR or set HERD_TLS_DIR "
                          "(the dir `herd pki init` wrote), or use an http:// URL on an insecure set-up")
    names = (cert,) if cert else CLIENT_CERTS
    files = next((f for f in (tls.TLSFiles.in_dir(d, n) for n in names) if f.cert.is_file() and f.key.is_file()),
                 None)
    try:
        return tls.client_context(ca, files, expect=expect)
    except tls.TLSError as e:
        raise ClientError(str(e)) from None


def verify_for(url: str, tls_dir: str | os.PathLike[str] | None = None, *,
               expect: str | None = None) -> ssl.SSLContext | bool:
    """httpx's ``verify=`` for ``url``: the CLI's TLS context for https (the peer must be
    ``expect``), True (unused) for http."""
    return operator_context(tls_dir, expect=expect) if url.startswith("https://") else True


def check_peer(r: httpx.Response, want: str) -> None:
    """An https answer must come from a certificate of principal ``want``."""
    if r.request.url.scheme != "https":
        return
    stream = r.extensions.get("network_stream")
    obj = stream.get_extra_info("ssl_object") if stream is not None else None
    p = tls.principal_of(obj.getpeercert()) if obj is not None else None
    if p is None or p.name != want:
        raise ClientError(f"{r.request.url.host} answered with the certificate of "
                          f"{p.name if p else 'no herd principal'}, not of the {want}")


def transport_line(e: httpx.HTTPError, who: str, url: str) -> str:
    """One line for a request that got no answer; TLS failures named for what they are."""
    text = str(e) or type(e).__name__
    cause = tls.ssl_cause(e)
    if cause is not None or "SSL" in text or "certificate" in text.lower():
        return f"TLS to the {who} at {url} failed: {tls.describe_ssl_error(cause or e)}"
    return f"cannot reach the {who} at {url}: {text}"


def transport_error(e: httpx.HTTPError, who: str, url: str) -> ClientError:
    """httpx's failure of a request that got no (whole) answer, as one ClientError line."""
    if isinstance(e, httpx.TimeoutException):
        return ClientError(f"the {who} at {url} did not answer in time ({type(e).__name__}; "
                           "--timeout S waits longer)")
    return ClientError(transport_line(e, who, url))


class _Moved(Exception):
    """The placer asked stayed silent and another leads at a newer epoch (PlacerClient._request)."""

    def __init__(self, claim: leaderprobe.Claim) -> None:
        super().__init__(claim.url)
        self.claim = claim


class _Call:
    """One request of a synchronous client in a daemon thread: its answer or its error, once ``done``."""

    def __init__(self, client: httpx.Client, method: str, url: str, kw: dict[str, Any]) -> None:
        self.done = threading.Event()
        self._response: httpx.Response | None = None
        self._error: BaseException | None = None
        self._args = (client, method, url, kw)
        threading.Thread(target=self._run, name="herd-placer-request", daemon=True).start()

    def _run(self) -> None:
        client, method, url, kw = self._args
        try:
            self._response = client.request(method, url, **kw)
        except BaseException as e:   # (raised again in the caller's thread by result())
            self._error = e
        finally:
            self.done.set()

    def result(self) -> httpx.Response:
        if self._error is not None:
            raise self._error
        assert self._response is not None
        return self._response


class PlacerClient:
    """Synchronous client (the CLI is synchronous). ``timeout`` bounds each request.

    ``url``: one placer, or several (a list, or comma-separated: several placers, one leading).
    A request follows a follower's 307 to the leader it names, moves to the next address when
    one cannot be connected to (nothing was sent: safe for a submit), and asks again after a
    503 with ``Retry-After`` (the placers are electing a leader), within ``failover_s``. An
    answer that was cut off is not sent again (a submit may have landed).

    A placer that is asked and stays silent (a paused leader keeps its connections open and
    answers nothing): with several placers known, while a request goes unanswered past
    ``leaderprobe.PROBE_AFTER_S`` the others' ``/healthz`` are asked who leads, every
    ``PROBE_EVERY_S``; a leader named at an epoch above the one the others give the placer asked
    (so that placer's lease has lapsed: its etcd writes are refused, the request cannot land
    there) is asked instead, within ``failover_s``, rather than waiting out ``timeout``."""

    def __init__(self, url: str | list[str], token: str | None = None, *, timeout: float = 30.0,
                 ssl_context: ssl.SSLContext | None = None, tls_dir: str | os.PathLike[str] | None = None,
                 failover_s: float = 15.0) -> None:
        urls = placer_urls(url)
        if not urls:
            raise ClientError("no placer URL: pass --placer URL or set HERD_PLACER")
        self.placers = Placers(urls)
        self.request_timeout = timeout
        self.failover_s = failover_s
        verify = ssl_context if ssl_context is not None else verify_for(urls[0], tls_dir, expect="placer")
        self._c = httpx.Client(headers=auth_header(token), timeout=timeout, verify=verify)
        # who leads, asked of the other placers while the one asked is silent (/healthz: public)
        self._probe_c = httpx.Client(timeout=leaderprobe.PROBE_TIMEOUT_S, verify=verify) if len(urls) > 1 else None
        self.leader_moves = 0

    @property
    def url(self) -> str:
        """The placer this client talks to now (the leader, once one answered)."""
        return self.placers.current

    def __enter__(self) -> PlacerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._c.close()
        if self._probe_c is not None:
            self._probe_c.close()

    def _resp(self, method: str, path: str, **kw: Any) -> httpx.Response:
        deadline = time.monotonic() + self.failover_s
        misses = 0
        while True:
            url = self.placers.current
            try:
                r = self._request(method, url, path, deadline, kw)
            except _Moved as m:
                self.leader_moves += 1
                self.placers.failed(url, time.monotonic())
                self.placers.learned(m.claim.url, time.monotonic())
                continue
            except httpx.ConnectError as e:   # not connected: nothing was sent, another placer may lead
                misses += 1
                if len(self.placers) > 1 and time.monotonic() < deadline:
                    self.placers.failed(url, time.monotonic())
                    if misses >= len(self.placers):   # (a follower may still name the dead leader)
                        time.sleep(min(0.5, 0.05 * misses))
                    continue
                raise transport_error(e, "placer", url) from None
            except httpx.HTTPError as e:
                raise transport_error(e, "placer", url) from None
            check_peer(r, "placer")
            leader = leader_of(r.status_code, r.content)
            if leader is not None and leader != url and time.monotonic() < deadline:
                self.placers.learned(leader, time.monotonic())
                continue
            wait = retry_after_s(r.status_code, r.headers.get("retry-after"))
            if wait is not None and time.monotonic() + wait < deadline:
                time.sleep(wait)
                if len(self.placers) > 1 and not_leading(r.status_code, r.content):   # (not a busy leader)
                    self.placers.failed(url)   # the leader may be another, and this one may not know it yet
                continue
            _check(r)
            return r

    def _request(self, method: str, url: str, path: str, deadline: float, kw: dict[str, Any]) -> httpx.Response:
        """One request to ``url``. With several placers known, it runs in a thread of its own
        while this one asks the others who leads each time it has gone unanswered a while
        (see the class docstring): :class:`_Moved` when one names a newer leader before
        ``deadline``. The abandoned request ends by its own timeout (a daemon thread)."""
        if self._probe_c is None:
            return self._c.request(method, url + path, **kw)
        call = _Call(self._c, method, url + path, kw)
        known = 0
        wait = leaderprobe.PROBE_AFTER_S
        while not call.done.wait(wait):
            others = [u for u in self.placers.urls if u != url]
            claims = leaderprobe.probe_blocking(self._probe_c, others)
            known = max(known, leaderprobe.epoch_named(claims, url))
            found = leaderprobe.newer_leader(claims, known, url)
            if found is not None and not call.done.is_set() and time.monotonic() < deadline:
                raise _Moved(found)
            wait = leaderprobe.PROBE_EVERY_S
        return call.result()

    def _get(self, dec: msgspec.json.Decoder[Any], method: str, path: str, **kw: Any) -> Any:
        return decode_answer(dec, self._resp(method, path, **kw), "placer")

    def _req(self, method: str, path: str, **kw: Any) -> bytes:
        return self._resp(method, path, **kw).content

    def healthz(self) -> dict[str, Any]:
        out = self._get(_any, "GET", "/healthz")
        if not isinstance(out, dict) or "ok" not in out:
            raise ClientError(f"placer at {self.url} answered /healthz with something else: not a herd server")
        return out

    def submit(self, spec: JobSpec) -> JobView:
        """Submit a job. A job without an id gets one here, so that a submit resent to the next
        placer (its answer lost with a leader that had committed it) is the same job, answered
        as the first was, never a second one."""
        if not spec.job_id:
            spec = msgspec.structs.replace(spec, job_id=f"job-{int(time.time() * 1000):x}-{os.urandom(3).hex()}")
        return self._get(_job, "POST", "/v1/jobs", content=msgspec.json.encode(spec))

    def jobs(self, state: str | None = None, page: str | None = None) -> list[JobView]:
        """Jobs without pods (counts by pod state instead); one page (default the first 1000)."""
        return self.jobs_page(state, page).jobs

    def jobs_page(self, state: str | None = None, page: str | None = None) -> JobPage:
        params = {k: v for k, v in (("state", state), ("page", page)) if v}
        return self._get(_jobs, "GET", "/v1/jobs", params=params or None)

    def job(self, job_id: str, *, wait: str | None = None, timeout_ms: int = 10000,
            pods: str | None = None) -> JobView:
        """One job with one page of pods (``pods="OFFSET:LIMIT"``, default the first 100)."""
        params = {"wait": wait, "timeout_ms": str(timeout_ms)} if wait else {}
        if pods:
            params["pods"] = pods
        return self._get(_job, "GET", f"/v1/jobs/{job_id}", params=params or None)

    def resolve_job(self, given: str, *, max_jobs: int = 100_000) -> str:
        """A job id as given, or the one job whose id starts with it (ids as the CLI prints
        them). Pages through the job list only when the id itself is unknown."""
        try:
            return self.job(given, pods="0:0").job_id
        except ClientError as e:
            if e.status != 404:
                raise
            unknown = e
        found: list[str] = []
        off = 0
        while off < max_jobs:
            page = self.jobs_page(page=f"{off}:1000")
            found += [j.job_id for j in page.jobs if j.job_id.startswith(given)]
            off += len(page.jobs)
            if not page.jobs or off >= page.total or len(found) > 1:
                break
        if not found:
            raise ClientError(f"{unknown} (nor a job whose id starts with it)", status=404)
        if len(found) > 1:
            raise ClientError(f"job id {given!r} is ambiguous: {', '.join(found[:5])}"
                              + (" …" if len(found) > 5 else ""))
        return found[0]

    def cancel(self, job_id: str) -> JobView:
        return self._get(_job, "DELETE", f"/v1/jobs/{job_id}")

    def update_artifact(self, job_id: str, manifest_id: str, origin: str | None = None) -> JobView:
        body = msgspec.json.encode(ArtifactUpdate(manifest_id=manifest_id, origin=origin))
        return self._get(_job, "POST", f"/v1/jobs/{job_id}/artifact", content=body)

    def nodes(self, page: str | None = None) -> list[NodeView]:
        """One page of nodes in id order (default the first 1000); see :meth:`nodes_page`."""
        return self.nodes_page(page).nodes

    def nodes_page(self, page: str | None = None, state: str | None = None) -> NodePage:
        params = {k: v for k, v in (("state", state), ("page", page)) if v}
        return self._get(_nodes, "GET", "/v1/nodes", params=params or None)

    def node(self, node_id: str) -> NodeView | None:
        """One node's view, found by bisecting the id-ordered pages (one node a request,
        O(log N) requests, whatever the fleet's size); None when the placer does not know it."""
        lo, hi = 0, self.nodes_page("0:1").total
        while lo < hi:
            mid = (lo + hi) // 2
            page = self.nodes_page(f"{mid}:1").nodes
            if not page:
                break
            if page[0].node_id == node_id:
                return page[0]
            if page[0].node_id < node_id:
                lo = mid + 1
            else:
                hi = mid
        return None

    def node_op(self, node_id: str, op: str, body: NodeOp | None = None) -> dict[str, Any]:
        """``op`` in cordon | uncordon | drain: the node's view and, for a drain, what it did."""
        enc = msgspec.json.encode(body or NodeOp())
        return self._get(_any, "POST", f"/v1/nodes/{node_id}/{op}", content=enc)

    def approve_rack(self, node_id: str, rack: str) -> dict[str, Any]:
        """``herd node approve``: pin the node's rack (placer.approvals)."""
        return self._get(_any, "POST", f"/v1/nodes/{node_id}/approve",
                         content=msgspec.json.encode(RackApproval(rack=rack)))

    def approvals(self) -> list[dict[str, Any]]:
        """Every rack approval, with the node's registered and certificate rack."""
        return list(self._get(_any, "GET", "/v1/approvals")["approvals"])

    def status(self) -> dict[str, Any]:
        """Transport security: TLS or insecure, accept_tokens, token-authenticated agents."""
        return self._get(_any, "GET", "/v1/status")

    def cluster(self) -> dict[str, Any]:
        return self._get(_any, "GET", "/v1/cluster")

    def defrag(self, max_moves: int = 8, apply: bool = False) -> dict[str, Any]:
        body = msgspec.json.encode(DefragRequest(max_moves=max_moves, apply=apply))
        return self._get(_any, "POST", "/v1/defrag", content=body)

    def prefetch(self, req: PrefetchFanout) -> dict[str, Any]:
        return self._get(_any, "POST", "/v1/prefetch", content=msgspec.json.encode(req))
