"""A small etcd v3 client for the placer: etcd's JSON gateway over httpx, on trio.

Why not a maintained client: none fits trio. ``etcd3`` (gRPC) is synchronous and unmaintained
since 2020; ``etcd3gw`` (the same JSON gateway) is synchronous over ``requests``;
``async-etcd3gw`` (aiohttp), ``aetcd`` and ``etcd3aio`` (grpc.aio) are asyncio-only, and
``txaioetcd`` is Twisted. Each would need a second event loop or a thread per call in a
trio daemon, and the placer uses eight RPCs, so it speaks the gateway itself (etcd >= 3.4
serves it as ``/v3/...`` on the client port, beside gRPC): JSON bodies with base64 keys and
values and int64s written as strings (decoded here with msgspec's lax mode), errors as
``{"error", "message", "code"}`` with gRPC codes. Watches are newline-delimited JSON
streams; a lease keepalive is one request per renewal (the gateway answers one
``{"result": ...}`` and closes). The leader renews its lease on a thread of its own
(placer.renewal) with :class:`BlockingLeaseClient`, the same call over a blocking httpx
client, so that a busy event loop cannot starve the renewal.

Failover: the client keeps the endpoint that answered last and, on a transport failure,
a timeout or an "unavailable" answer (no leader, member stopping), tries the next, once
each, before giving up with :class:`EtcdUnavailable` naming every endpoint's cause. A
retried put or transaction may have landed on the member that timed out; every write the
placer makes is idempotent (the same value, or a create guarded by a compare), so landing
twice is harmless.

Errors (placer.errors): :class:`EtcdUnavailable` (the cluster did not answer: retry later),
:class:`EtcdRefused` (etcd refused the request itself: too large, too many operations;
retrying cannot help), :class:`LeaseNotFound` (the lease expired or was revoked), each one
line naming the endpoint and etcd's message.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Literal, TypeVar

import httpx
import msgspec
import trio

from .errors import EtcdError, EtcdRefused, EtcdUnavailable, LeaseNotFound

log = logging.getLogger("herd.placer.etcd")

_T = TypeVar("_T")

__all__ = ["EtcdClient", "BlockingLeaseClient", "tls_context", "KeyValue", "Compare", "Op", "RangeResult", "TxnResult", "WatchEvent",
           "WatchBatch", "Lease", "prefix_end", "REQUEST_LIMIT", "TXN_OPS_LIMIT"]

# etcd's defaults (--max-request-bytes, --max-txn-ops): a request over either is refused
REQUEST_LIMIT = 1536 * 1024
TXN_OPS_LIMIT = 128

# gRPC status codes the gateway answers with (google.golang.org/grpc/codes)
_INVALID_ARGUMENT, _DEADLINE, _NOT_FOUND, _EXHAUSTED, _FAILED_PRECONDITION = 3, 4, 5, 8, 9
_OUT_OF_RANGE, _UNAVAILABLE = 11, 14
_FAILOVER_CODES = frozenset({_DEADLINE, _UNAVAILABLE})


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"  # every key


# ------------------------------------------------------------------ wire types (the gateway's JSON)

class _Header(msgspec.Struct, frozen=True):
    revision: int = 0
    raft_term: int = 0
    member_id: int = 0


class KeyValue(msgspec.Struct, frozen=True):
    key: bytes = b""
    value: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    lease: int = 0


class _RangeResp(msgspec.Struct, frozen=True):
    header: _Header = _Header()
    kvs: list[KeyValue] = []
    count: int = 0
    more: bool = False


class _PutResp(msgspec.Struct, frozen=True):
    header: _Header = _Header()


class _DeleteResp(msgspec.Struct, frozen=True):
    header: _Header = _Header()
    deleted: int = 0


class _ResponseOp(msgspec.Struct, frozen=True):
    response_range: _RangeResp | None = None
    response_put: _PutResp | None = None
    response_delete_range: _DeleteResp | None = None


class _TxnResp(msgspec.Struct, frozen=True):
    header: _Header = _Header()
    succeeded: bool = False
    responses: list[_ResponseOp] = []


class _LeaseResp(msgspec.Struct, frozen=True):
    header: _Header = _Header()
    ID: int = 0
    TTL: int = 0


class _KeepaliveResp(msgspec.Struct, frozen=True):
    result: _LeaseResp = _LeaseResp()


class WatchEvent(msgspec.Struct, frozen=True):
    type: Literal["PUT", "DELETE"] = "PUT"
    kv: KeyValue = KeyValue()


class WatchBatch(msgspec.Struct, frozen=True):
    """One message of a watch stream: events at ``revision`` (none on the ``created`` answer)."""
    header: _Header = _Header()
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[WatchEvent] = []

    @property
    def revision(self) -> int:
        return self.header.revision


class _StreamError(msgspec.Struct, frozen=True):
    message: str = ""
    grpc_code: int = 0
    http_code: int = 0


class _WatchLine(msgspec.Struct, frozen=True):
    result: WatchBatch | None = None
    error: _StreamError | None = None


class _ErrorBody(msgspec.Struct, frozen=True):
    error: str = ""
    message: str = ""
    code: int = 0


# requests: zero fields are left out, as protobuf's JSON mapping does

class _RangeReq(msgspec.Struct, frozen=True, omit_defaults=True):
    key: bytes
    range_end: bytes = b""
    limit: int = 0
    revision: int = 0
    sort_order: str = "NONE"
    sort_target: str = "KEY"
    keys_only: bool = False
    count_only: bool = False
    max_create_revision: int = 0


class _PutReq(msgspec.Struct, frozen=True, omit_defaults=True):
    key: bytes
    value: bytes = b""
    lease: int = 0


class _DeleteReq(msgspec.Struct, frozen=True, omit_defaults=True):
    key: bytes
    range_end: bytes = b""


class Op(msgspec.Struct, frozen=True, omit_defaults=True):
    """One operation of a transaction; build with :meth:`put`, :meth:`get`, :meth:`delete`."""
    request_put: _PutReq | None = None
    request_range: _RangeReq | None = None
    request_delete_range: _DeleteReq | None = None

    @classmethod
    def put(cls, key: bytes, value: bytes, *, lease: int = 0) -> Op:
        return cls(request_put=_PutReq(key, value, lease))

    @classmethod
    def get(cls, key: bytes, range_end: bytes = b"") -> Op:
        return cls(request_range=_RangeReq(key, range_end))

    @classmethod
    def delete(cls, key: bytes, range_end: bytes = b"") -> Op:
        return cls(request_delete_range=_DeleteReq(key, range_end))

    def size(self) -> int:
        """What the op weighs in etcd's request-size limit (its protobuf size, within a few bytes)."""
        if self.request_put is not None:
            return len(self.request_put.key) + len(self.request_put.value) + 24
        r = self.request_range or self.request_delete_range
        assert r is not None
        return len(r.key) + len(r.range_end) + 24


class Compare(msgspec.Struct, frozen=True, omit_defaults=True):
    """A transaction's guard. ``Compare.created(key, rev)``: the key exists with that create
    revision (0: the key does not exist)."""
    key: bytes
    target: Literal["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]
    result: Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"] = "EQUAL"
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    value: bytes = b""

    @classmethod
    def created(cls, key: bytes, revision: int) -> Compare:
        return cls(key=key, target="CREATE", create_revision=revision)


class _TxnReq(msgspec.Struct, frozen=True, omit_defaults=True):
    compare: list[Compare] = []
    success: list[Op] = []
    failure: list[Op] = []


# ------------------------------------------------------------------ results

class RangeResult(msgspec.Struct, frozen=True):
    revision: int
    kvs: list[KeyValue]
    count: int
    more: bool


class TxnResult(msgspec.Struct, frozen=True):
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]]   # the kvs of each range op of the branch that ran, in order


class Lease(msgspec.Struct, frozen=True):
    id: int
    ttl: int          # seconds etcd granted (it may raise a TTL below its minimum)


_range_dec = msgspec.json.Decoder(_RangeResp, strict=False)   # lax: int64s come as strings
_put_dec = msgspec.json.Decoder(_PutResp, strict=False)
_delete_dec = msgspec.json.Decoder(_DeleteResp, strict=False)
_txn_dec = msgspec.json.Decoder(_TxnResp, strict=False)
_lease_dec = msgspec.json.Decoder(_LeaseResp, strict=False)
_keepalive_dec = msgspec.json.Decoder(_KeepaliveResp, strict=False)
_watch_dec = msgspec.json.Decoder(_WatchLine, strict=False)
_err_dec = msgspec.json.Decoder(_ErrorBody)


class _Miss(msgspec.Struct, frozen=True):
    """An endpoint did not answer usefully (why): try the next one."""
    cause: str


class EtcdClient:
    """Several endpoints of one etcd cluster, failed over in order.

    ``async with EtcdClient([...]) as c:`` or :meth:`aclose` when done. ``attempt_timeout_s``
    bounds one request to one endpoint (a member cut off from its quorum answers nothing);
    a caller's cancel scope bounds the whole call.
    """

    def __init__(self, endpoints: Sequence[str], *, ssl_context: ssl.SSLContext | None = None,
                 attempt_timeout_s: float = 2.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not endpoints:
            raise EtcdError("no etcd endpoints configured")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.attempt_timeout_s = attempt_timeout_s
        self.ssl_context = ssl_context
        self._current = 0
        # no httpx timeouts: every attempt runs under a trio cancel scope (attempt_timeout_s)
        self._http = httpx.AsyncClient(verify=ssl_context if ssl_context is not None else True,
                                       timeout=httpx.Timeout(None), transport=transport,
                                       limits=httpx.Limits(max_connections=32, max_keepalive_connections=8))
        self.requests = 0
        self.failovers = 0
        self.errors = 0
        self.reachable = True       # the last call found a member that answered

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self._http.aclose()

    def statistics(self) -> dict[str, int | str]:
        return {"endpoint": self.endpoints[self._current], "requests": self.requests,
                "failovers": self.failovers, "errors": self.errors, "reachable": self.reachable}

    # -------------------------------------------------------------- transport

    async def _call(self, path: str, body: bytes, dec: msgspec.json.Decoder[_T]) -> _T:
        causes: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            idx = (self._current + i) % n
            url = self.endpoints[idx]
            out = await self._attempt(url, path, body, dec)
            if isinstance(out, _Miss):
                causes.append(f"{url}: {out.cause}")
                self.failovers += 1
                continue
            if idx != self._current:
                log.info("etcd failover endpoint=%s", url)
                self._current = idx
            self.reachable = True
            return out
        self.errors += 1
        self.reachable = False
        raise EtcdUnavailable("etcd unavailable (" + "; ".join(causes) + ")")

    async def _attempt(self, url: str, path: str, body: bytes, dec: msgspec.json.Decoder[_T]) -> _T | _Miss:
        self.requests += 1
        r: httpx.Response | None = None
        with trio.move_on_after(self.attempt_timeout_s):
            try:
                r = await self._http.post(url + path, content=body,
                                          headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                return _Miss(_describe(e))
        if r is None:
            return _Miss(f"no answer in {self.attempt_timeout_s:g}s")
        if r.status_code >= 400:
            return self._answer_error(url, r)
        try:
            return dec.decode(r.content)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return _Miss(f"not an etcd answer ({e})")

    def _answer_error(self, url: str, r: httpx.Response) -> _Miss:
        """An error answer: a miss when another member may do better, else raised as ours."""
        out = _classify(url, r)
        if isinstance(out, _Miss):
            return out
        self.errors += 1
        raise out

    # -------------------------------------------------------------- KV

    async def range(self, key: bytes, range_end: bytes = b"", *, limit: int = 0, revision: int = 0,
                     sort_target: Literal["KEY", "CREATE", "MOD", "VERSION", "VALUE"] = "KEY",
                     sort_order: Literal["NONE", "ASCEND", "DESCEND"] = "NONE",
                     max_create_revision: int = 0, keys_only: bool = False) -> RangeResult:
        """Keys in ``[key, range_end)`` (just ``key`` when ``range_end`` is empty)."""
        req = _RangeReq(key, range_end, limit, revision, sort_order, sort_target, keys_only,
                        max_create_revision=max_create_revision)
        r = await self._call("/v3/kv/range", msgspec.json.encode(req), _range_dec)
        return RangeResult(r.header.revision, r.kvs, r.count, r.more)

    async def get(self, key: bytes) -> KeyValue | None:
        r = await self.range(key)
        return r.kvs[0] if r.kvs else None

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Write one key; the revision it landed at."""
        r = await self._call("/v3/kv/put", msgspec.json.encode(_PutReq(key, value, lease)), _put_dec)
        return r.header.revision

    async def delete(self, key: bytes, range_end: bytes = b"") -> int:
        """Delete ``key`` (or ``[key, range_end)``); how many keys went."""
        r = await self._call("/v3/kv/deleterange", msgspec.json.encode(_DeleteReq(key, range_end)), _delete_dec)
        return r.deleted

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op],
                  failure: Sequence[Op] = ()) -> TxnResult:
        """If every compare holds, run ``success``, else ``failure``; atomically."""
        body = msgspec.json.encode(_TxnReq(list(compare), list(success), list(failure)))
        r = await self._call("/v3/kv/txn", body, _txn_dec)
        ranges = [o.response_range.kvs for o in r.responses if o.response_range is not None]
        return TxnResult(r.succeeded, r.header.revision, ranges)

    # -------------------------------------------------------------- leases

    async def grant(self, ttl: int) -> Lease:
        r = await self._call("/v3/lease/grant", msgspec.json.encode({"TTL": ttl}), _lease_dec)
        return Lease(r.ID, r.TTL)

    async def keepalive(self, lease_id: int) -> int:
        """Renew a lease once; the TTL it has now, 0 when it has expired or was revoked."""
        r = await self._call("/v3/lease/keepalive", msgspec.json.encode({"ID": lease_id}), _keepalive_dec)
        return r.result.TTL

    async def revoke(self, lease_id: int) -> None:
        """End a lease and delete every key attached to it (a lease already gone is not an error)."""
        try:
            await self._call("/v3/lease/revoke", msgspec.json.encode({"ID": lease_id}), _lease_dec)
        except LeaseNotFound:
            pass

    # -------------------------------------------------------------- watch

    @asynccontextmanager
    async def watch(self, key: bytes, range_end: bytes = b"", *,
                    start_revision: int = 0) -> AsyncIterator[AsyncIterator[WatchBatch]]:
        """``async with c.watch(k, start_revision=r) as batches: async for b in batches:``
        the changes of ``[key, range_end)`` from ``start_revision`` on. The stream ends with
        :class:`EtcdUnavailable` when the connection breaks and :class:`EtcdRefused` when etcd
        cancels the watch (its start revision was compacted): the caller reads again and
        watches from there."""
        body = msgspec.json.encode({"create_request": {
            "key": _b64(key), "range_end": _b64(range_end), "start_revision": start_revision}})
        causes: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            idx = (self._current + i) % n
            url = self.endpoints[idx]
            self.requests += 1
            try:
                with trio.fail_after(self.attempt_timeout_s):
                    req = self._http.build_request("POST", url + "/v3/watch", content=body,
                                                   headers={"content-type": "application/json"})
                    resp = await self._http.send(req, stream=True)
            except (httpx.HTTPError, trio.TooSlowError) as e:
                causes.append(f"{url}: {_describe(e)}")
                self.failovers += 1
                continue
            try:
                if resp.status_code >= 400:
                    await resp.aread()
                    causes.append(f"{url}: {self._answer_error(url, resp).cause}")
                    continue
                self._current = idx
                yield self._batches(url, resp)
                return
            finally:
                with trio.CancelScope(shield=True):
                    await resp.aclose()
        self.errors += 1
        raise EtcdUnavailable("etcd watch unavailable (" + "; ".join(causes) + ")")

    async def _batches(self, url: str, resp: httpx.Response) -> AsyncIterator[WatchBatch]:
        try:
            async for line in resp.aiter_lines():
                if not line.strip():
                    continue
                try:
                    msg = _watch_dec.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise EtcdError(f"etcd {url}: a watch message that is not etcd's ({e})") from None
                if msg.error is not None:
                    raise EtcdUnavailable(f"etcd {url}: watch ended: {msg.error.message}")
                if msg.result is None:
                    continue
                if msg.result.canceled:
                    raise EtcdRefused(f"etcd {url} cancelled the watch: "
                                      f"{msg.result.cancel_reason or 'compacted'} "
                                      f"(compact revision {msg.result.compact_revision})")
                yield msg.result
        except httpx.HTTPError as e:
            raise EtcdUnavailable(f"etcd {url}: watch broke: {_describe(e)}") from None
        raise EtcdUnavailable(f"etcd {url}: the watch stream ended")


def _classify(url: str, r: httpx.Response) -> _Miss | EtcdError:
    """An error answer of one member: a miss when another member may do better (no leader,
    stopping, a proxy's 5xx), else the error it is."""
    try:
        err = _err_dec.decode(r.content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        if r.status_code in (502, 503, 504):
            return _Miss(f"HTTP {r.status_code}")
        return EtcdError(f"etcd {url}: HTTP {r.status_code}: {r.text[:200]!r}")
    msg = err.message or err.error or f"HTTP {r.status_code}"
    if err.code in _FAILOVER_CODES or r.status_code == 503:
        return _Miss(msg)
    if err.code == _NOT_FOUND:   # the one NotFound the KV and lease calls answer: a lease's
        return LeaseNotFound(f"etcd {url}: {msg}")
    if err.code in (_INVALID_ARGUMENT, _EXHAUSTED, _OUT_OF_RANGE, _FAILED_PRECONDITION):
        return EtcdRefused(f"etcd {url} refused the request: {msg}")
    return EtcdError(f"etcd {url}: {msg} (code {err.code})")


class BlockingLeaseClient:
    """Lease renewal without an event loop, for a thread of its own (placer.renewal): a
    blocking httpx client over the same endpoints, failed over in the same order, with the
    same answers mapped to the same errors as :class:`EtcdClient`. One request to one member
    is bounded by ``attempt_timeout_s``."""

    def __init__(self, endpoints: Sequence[str], *, ssl_context: ssl.SSLContext | None = None,
                 attempt_timeout_s: float = 2.0, transport: httpx.BaseTransport | None = None) -> None:
        if not endpoints:
            raise EtcdError("no etcd endpoints configured")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0
        self._http = httpx.Client(verify=ssl_context if ssl_context is not None else True,
                                  timeout=httpx.Timeout(attempt_timeout_s), transport=transport,
                                  limits=httpx.Limits(max_connections=2, max_keepalive_connections=2))
        self.requests = 0

    def close(self) -> None:
        self._http.close()

    def keepalive(self, lease_id: int) -> int:
        """Renew a lease once; the TTL it has now, 0 when it has expired or was revoked.
        :class:`EtcdUnavailable` when no member answered."""
        body = msgspec.json.encode({"ID": lease_id})
        causes: list[str] = []
        n = len(self.endpoints)
        for i in range(n):
            idx = (self._current + i) % n
            url = self.endpoints[idx]
            self.requests += 1
            try:
                r = self._http.post(url + "/v3/lease/keepalive", content=body,
                                    headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                causes.append(f"{url}: {_describe(e)}")
                continue
            if r.status_code >= 400:
                out = _classify(url, r)
                if isinstance(out, _Miss):
                    causes.append(f"{url}: {out.cause}")
                    continue
                raise out
            try:
                ttl = _keepalive_dec.decode(r.content).result.TTL
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                causes.append(f"{url}: not an etcd answer ({e})")
                continue
            self._current = idx
            return ttl
        raise EtcdUnavailable("etcd unavailable (" + "; ".join(causes) + ")")


def tls_context(ca: str | None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext | None:
    """Client TLS to etcd: verify its certificate (name included) against ``ca`` (else the
    system's roots), and present ``cert``/``key`` where etcd asks for a client certificate.
    None when nothing is configured (https:// endpoints then use the system's roots)."""
    from pathlib import Path

    from infra.tls import TLSError, TLSFiles, client_context

    if ca is None and cert is None:
        return None
    try:
        if ca is None:
            ctx = ssl.create_default_context()
            if cert is not None and key is not None:
                ctx.load_cert_chain(cert, key)
            return ctx
        files = TLSFiles(Path(ca), Path(cert), Path(key)) if cert is not None and key is not None else None
        return client_context(ca, files, check_hostname=True)
    except (TLSError, ssl.SSLError, OSError) as e:
        raise EtcdError(f"etcd client TLS: {e}") from None


def _b64(b: bytes) -> str:
    import base64

    return base64.b64encode(b).decode()


def _describe(e: BaseException) -> str:
    if isinstance(e, trio.TooSlowError):
        return "no answer in time"
    cause = e.__cause__ or e.__context__
    text = str(e) or type(e).__name__
    if isinstance(cause, ssl.SSLError):
        return f"TLS: {cause.reason or cause}"
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect: {text}"
    return text
