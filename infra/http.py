"""A small ASGI routing layer and the hypercorn (trio worker) server both daemons use.

Why hypercorn: it is a maintained, trio-native ASGI server (HTTP/1.1 keep-alive,
graceful shutdown); the control APIs are small JSON endpoints where its per-request
cost (~0.3 ms) is far below our latency targets. The bulk data plane (p2p) does not use
it: it needs ``os.sendfile`` and has its own lean h11 server. We drive hypercorn's
per-connection ``TCPServer`` from our own accept loop so that connections can be
counted and capped before hypercorn sees them.

Handlers are ``async def handler(req: Request) -> Response``. Errors a client
caused are raised as :class:`HTTPError` and become one JSON line
``{"error": ..., "detail": ...}``; msgspec decode/validation errors become 400 with the
reason; any other handler error is logged and answered 500; an error of the server
itself while handling one connection closes that connection only.

Hostile input costs the sender, never the daemon (DESIGN.md, Security model). Bounds,
in the order a request meets them:

- **Connections**: at most ``ServerLimits.max_connections`` (default 1024) at once and
  ``max_per_client`` (64) per client address; one over either is answered a canned 503
  and closed without reading anything.
- **Idle and head deadline**: a connection that has not delivered a complete request
  head within ``head_timeout_s`` (10 s) of opening, or of its previous response, is
  closed. The clock is absolute: trickling bytes does not reset it (it is hypercorn's
  keep-alive timer, which only a complete head stops). So this one figure is both the
  idle keep-alive timeout and the head deadline.
- **Head size**: 16 KiB (``max_head_bytes``), whether it arrives in pieces or whole: 431.
- **Authentication before the body**: a route's auth policy runs on the head alone (the
  ``Request`` it sees has ``body == b""``); a refused request is answered 401 with
  ``connection: close`` and its body is never read.
- **Body size per route** (``App.route(max_body=)``; default 1 MiB): a declared
  Content-Length over it is refused at once (413), a chunked body as soon as it passes it.
  Fleet-scale figures: a placement or a full node report is at most a few MB (4 MiB is
  the ceiling we use for them), everything else is small (4-256 KiB).
- **Body deadline**: the whole body must arrive within ``App.body_timeout_s`` (30 s) of
  the head, absolute, not reset per byte: 408 and close.
- **Send stall**: a client that stops reading its answer for ``send_stall_s`` (30 s) is
  dropped.

Every refusal before the handler ran carries ``connection: close``, so a refused
sender's remaining bytes are never read.

TLS (``serve(..., ssl_context=)``, :mod:`infra.tls`): the accepted stream is wrapped
in ``trio.SSLStream`` and handshaken *before* hypercorn sees a byte, inside the same
``head_timeout_s`` deadline (and after the connection gate: a slow handshake holds one slot
no longer than a slow head; at most ``max_handshakes`` at once, taken once the client has
sent its first bytes, so silent connections wait out their deadline holding none). The verified client certificate's principal rides on the
connection (ASGI ``scope["state"]["herd.principal"]``) into every request as
``Request.principal``. A client that speaks plain HTTP to a TLS port gets one plain-text
``400`` that says so, then the connection is closed.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import parse_qs

import msgspec
import trio

from . import tls
from .auth import TokenSet, bearer
from .errors import HTTPError as HTTPError  # re-exported: callers import it from here
from .gate import ConnectionGate, turn_away
from .tls import Principal

log = logging.getLogger("herd.http")

DEFAULT_MAX_BODY = 1 << 20          # 1 MiB: any route that names no bound of its own
LARGE_BODY = 4 << 20                # placements and full node reports at fleet scale
DEFAULT_BODY_TIMEOUT_S = 30.0       # the whole body, absolute
MAX_HEAD_BYTES = 16 << 10           # request line + headers
MAX_HEADERS = 100


def _has_body(raw_headers: list[tuple[bytes, bytes]]) -> bool:
    for k, v in raw_headers:
        k = k.lower()
        if k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0"):
            return True
    return False


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    client: str | None
    params: dict[str, str] = field(default_factory=dict)
    # who proved what: the connection's verified client certificate, else (set by the
    # route's policy, scheduler_link.authz) the bearer token's role; None when neither
    principal: Principal | None = None

    def decode(self, kind: type[Any]) -> Any:
        """Decode the JSON body into ``kind``; a bad body is a 400 with the reason."""
        try:
            return msgspec.json.decode(self.body, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise HTTPError(400, "malformed request body", str(e)) from None

    @property
    def is_loopback(self) -> bool:
        c = self.client or ""
        return c.startswith("127.") or c == "::1" or c == "localhost"


@dataclass(slots=True)
class Response:
    """An answer. With ``stream`` (a function returning an async generator of byte pieces)
    the body is sent as it comes (chunked, no content-length) after ``body``, until the
    generator ends or the client goes away (the generator is then closed)."""
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: Callable[[], AsyncGenerator[bytes, None]] | None = None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status=status, body=msgspec.json.encode(obj))


def text_response(text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status=status, body=text.encode(), content_type=content_type)


Handler = Callable[[Request], Awaitable[Response]]


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """Every 4xx/5xx answer of both APIs: one JSON line."""
    error: str
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Text:
    """A response (or request) body that is text, not JSON (logs, Prometheus)."""
    content_type: str = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Param:
    """A query parameter: ``schema`` a type msgspec describes (str, int, Literal[...])."""
    name: str
    schema: Any = str
    description: str = ""
    required: bool = False


# A body: a type msgspec can describe (a Struct, list[Struct], dict[str, Struct]), a JSON
# Schema dict (answers built as dicts), a Text, or None (no body).
Body = Any


@dataclass(frozen=True, slots=True)
class RouteDoc:
    """What :meth:`App.openapi` says about a route beyond its path and policy: its request
    body, its answers by status (errors other than the generic ones a route's policy and
    body bound imply), its query parameters."""
    summary: str = ""
    body: Body = None
    body_required: bool = True
    responses: Mapping[int, Body] = field(default_factory=dict)
    errors: Mapping[int, str] = field(default_factory=dict)      # status -> when
    query: tuple[Param, ...] = ()
# An auth policy: given the request, return None when allowed, else raise HTTPError(401).
AuthPolicy = Callable[[Request], None]


def require_role(tokens: TokenSet, *roles: str) -> AuthPolicy:
    def check(req: Request) -> None:
        tok = bearer(req.headers)
        for role in roles:
            if tokens.check(role, tok):
                return
        raise HTTPError(401, "unauthorized", f"needs a valid bearer token for: {', '.join(roles)}")
    return check


@dataclass(slots=True)
class _Route:
    method: str
    pattern: re.Pattern[str]
    template: str
    handler: Handler
    auth: AuthPolicy | None
    max_body: int
    doc: RouteDoc | None = None
    roles: tuple[str, ...] = ()


class App:
    """A tiny ASGI app: exact-method routes with ``{name}`` path parameters."""

    def __init__(self, *, max_body: int = DEFAULT_MAX_BODY, name: str = "herd",
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.routes: list[_Route] = []
        self.max_body = max_body
        self.name = name
        self.body_timeout_s = body_timeout_s
        self.gate: ConnectionGate | None = None   # set by serve(): open connection counts
        self.tls = False                            # set by serve(): the listener speaks TLS
        self.tls_refused = 0                        # handshakes that failed or ran out of time
        self.tls_handshakes = 0                     # handshakes completed
        self.handshakes: trio.CapacityLimiter | None = None   # set by serve(): handshakes in progress

    def route(self, method: str, template: str, *, auth: AuthPolicy | None = None,
              max_body: int | None = None, doc: RouteDoc | None = None,
              roles: tuple[str, ...] = ()) -> Callable[[Handler], Handler]:
        regex = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template) + "$"

        def deco(fn: Handler) -> Handler:
            self.routes.append(_Route(method.upper(), re.compile(regex), template, fn, auth,
                                      self.max_body if max_body is None else max_body, doc, roles))
            return fn
        return deco

    def add(self, method: str, template: str, fn: Handler, *, auth: AuthPolicy | None = None,
            max_body: int | None = None, doc: RouteDoc | None = None, roles: tuple[str, ...] = ()) -> None:
        self.route(method, template, auth=auth, max_body=max_body, doc=doc, roles=roles)(fn)

    def _match(self, method: str, path: str) -> tuple[_Route | None, dict[str, str], bool]:
        path_known = False
        for r in self.routes:
            m = r.pattern.match(path)
            if m:
                path_known = True
                if r.method == method or (method == "HEAD" and r.method == "GET"):
                    return r, m.groupdict(), True
        return None, {}, path_known

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        resp, close = await self._handle(scope, receive)
        if resp.stream is not None and scope["method"] != "HEAD" and not close:
            await _send_stream(resp, receive, send)
            return
        headers = [(b"content-type", resp.content_type.encode()),
                   (b"content-length", str(len(resp.body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in resp.headers]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else resp.body
        await send({"type": "http.response.body", "body": body})

    async def _read_body(self, receive: Any, limit: int) -> bytes:
        """The whole body, at most ``limit`` bytes, within ``body_timeout_s`` (absolute)."""
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(self.body_timeout_s) as cs:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise HTTPError(400, "client disconnected")
                data = msg.get("body", b"")
                size += len(data)
                if size > limit:
                    raise HTTPError(413, "request body too large", f"limit {limit} bytes")
                chunks.append(data)
                if not msg.get("more_body", False):
                    return b"".join(chunks)
        assert cs.cancelled_caught
        raise HTTPError(408, "request body too slow", f"the body must arrive within {self.body_timeout_s:g} s")

    async def _handle(self, scope: dict[str, Any], receive: Any) -> tuple[Response, bool]:
        """The answer, and whether the connection must close after it (the request's body
        was not read to its end, so the connection cannot carry another request)."""
        method = scope["method"].upper()
        path = scope["path"]
        body_read = not _has_body(scope["headers"])
        try:
            route, params, known = self._match(method, path)
            if route is None:
                raise HTTPError(405 if known else 404, "method not allowed" if known else "not found", path)
            raw_headers = scope["headers"]
            head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
                len(k) + len(v) + 4 for k, v in raw_headers)
            if head > MAX_HEAD_BYTES or len(raw_headers) > MAX_HEADERS:
                raise HTTPError(431, "request head too large", f"limit {MAX_HEAD_BYTES} bytes, {MAX_HEADERS} headers")
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
            qs = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            client = scope.get("client")
            state = scope.get("state") or {}
            req = Request(method=method, path=path, query={k: v[-1] for k, v in qs.items()},
                          headers=headers, body=b"", client=client[0] if client else None, params=params,
                          principal=state.get("herd.principal"))
            # Authentication sees the head only: a refused sender's body is never read.
            if route.auth is not None:
                route.auth(req)
            declared = headers.get("content-length")
            if declared is not None:
                if not declared.strip().isdigit():
                    raise HTTPError(400, "bad content-length")
                if int(declared) > route.max_body:
                    raise HTTPError(413, "request body too large", f"limit {route.max_body} bytes")
            req.body = await self._read_body(receive, route.max_body)
            body_read = True
            return await route.handler(req), False
        except HTTPError as e:
            return json_response({"error": e.error, "detail": e.detail}, status=e.status), not body_read
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return json_response({"error": "malformed request body", "detail": str(e)}, status=400), not body_read
        except Exception:  # a bug of ours: log it, answer 500, keep serving
            log.exception("handler failed path=%s", path)
            return json_response({"error": "internal error"}, status=500), not body_read

    def openapi(self, title: str, version: str = "1") -> dict[str, Any]:
        """This API's OpenAPI 3.1 document, generated from the route table (paths, methods,
        path parameters, policies) and each route's :class:`RouteDoc` (bodies, answers,
        query parameters), with the msgspec Structs' JSON Schemas as components, so it
        cannot drift from what is served."""
        return openapi_document(self.routes, title, version)

def split_hostport(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port or 0)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Connection-level bounds of :func:`serve` (the module docstring says why each)."""
    max_connections: int = 1024        # open connections, all clients
    max_per_client: int = 64           # ... per client address
    head_timeout_s: float = 10.0       # idle keep-alive and head deadline in one (absolute)
    send_stall_s: float = 30.0         # no progress sending an answer: drop the connection
    graceful_timeout_s: float = 2.0
    # TLS handshakes in progress at once (tls.server_handshake's slots; the framed channel has
    # its own): a connection storm's crypto a few at a time; a silent connection holds none
    max_handshakes: int = 64


async def _send_stream(resp: Response, receive: Any, send: Any) -> None:
    """Send ``resp.body`` then every piece ``resp.stream()`` yields; a client that goes
    away (``http.disconnect``) ends it, and the generator is closed either way."""
    assert resp.stream is not None
    headers = [(b"content-type", resp.content_type.encode())]
    headers += [(k.encode(), v.encode()) for k, v in resp.headers]
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    if resp.body:
        await send({"type": "http.response.body", "body": resp.body, "more_body": True})
    pieces = resp.stream()
    try:
        async with trio.open_nursery() as n:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                n.cancel_scope.cancel()  # the client left: stop producing for it
            n.start_soon(watch)
            async for piece in pieces:
                if piece:
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            n.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await pieces.aclose()




EOF_GRACE_S = 1.0   # after a client's EOF, the connection task ends this much later at the latest


class _GuardedStream(trio.abc.HalfCloseableStream):
    """The accepted socket stream, with a stall bound on every send (hypercorn shields
    its sends from cancellation, so a client that never reads would hold the
    connection for ever), and an end: once hypercorn closes the stream, ``scope`` (around
    its connection task) is cancelled. Without that, a connection answered with
    ``connection: close`` before its body was read could stay parked for ever in
    hypercorn, handing body pieces to an app that has already returned."""

    def __init__(self, inner: trio.abc.Stream, sock: Any, send_stall_s: float, scope: trio.CancelScope) -> None:
        self._inner = inner
        self._stall = send_stall_s
        self._scope = scope
        self.socket = sock   # hypercorn reads the addresses from it

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            with trio.move_on_after(self._stall) as cs:
                await self._inner.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._scope.cancel()     # the client is gone: hypercorn may not notice, end the task
            raise
        if cs.cancelled_caught:   # the connection is done for: end its task too
            self._scope.cancel()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._inner)
            raise trio.BrokenResourceError("client stopped reading its answer")

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._inner.receive_some(max_bytes)
        if not data:
            # The client closed its side. hypercorn would keep the connection task (and its
            # slot in the gate) until its keep-alive timer fires; end it shortly, once any
            # answer still being written (hypercorn shields its sends) is out.
            self._scope.deadline = min(self._scope.deadline, trio.current_time() + EOF_GRACE_S)
        return data

    async def send_eof(self) -> None:
        if isinstance(self._inner, trio.abc.HalfCloseableStream):
            await self._inner.send_eof()

    async def aclose(self) -> None:
        self._scope.cancel()
        await trio.aclose_forcefully(self._inner)


PLAIN_TO_TLS = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: 96\r\n\r\n"
                b'{"error":"plain HTTP to a TLS port","detail":"this server speaks TLS only: use an https:// URL"}')
assert len(PLAIN_TO_TLS.split(b"\r\n\r\n", 1)[1]) == 96


async def _tls_accept(app: App, stream: trio.SocketStream, ctx: ssl.SSLContext,
                      deadline_s: float, slots: trio.CapacityLimiter) -> trio.SSLStream[trio.SocketStream] | None:
    """The handshake of one accepted connection within ``deadline_s`` (one of ``slots``);
    None (the connection closed, a plain-HTTP client told so in plain text) when it fails."""
    s = await tls.server_handshake(stream, ctx, deadline_s, slots=slots)
    if not isinstance(s, tls.HandshakeFailed):
        app.tls_handshakes += 1
        return s
    app.tls_refused += 1
    log.info("TLS handshake refused client=%s: %s", tls.peer_address(stream), s.why)
    await tls.refuse(stream, s, PLAIN_TO_TLS)
    return None


async def serve(app: App, listen: str, *, limits: ServerLimits | None = None,
                task_status: Any = trio.TASK_STATUS_IGNORED,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
                ssl_context: ssl.SSLContext | None = None) -> None:
    """Serve ``app`` on ``listen`` ("host:port", port 0 allowed) until cancelled (or until
    ``shutdown_trigger`` returns: open connections then get ``graceful_timeout_s``).
    With ``ssl_context`` (:func:`infra.tls.server_context`) every connection is TLS.

    ``task_status.started(url)`` reports the bound base URL, e.g. ``http://127.0.0.1:41234``
    (``https://`` with TLS).
    """
    from hypercorn.config import Config
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import wrap_app

    lim = limits or ServerLimits()
    host, port = split_hostport(listen)
    cfg = Config()
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("herd.http.server")
    # hypercorn's keep-alive timer runs from a connection's start (or its previous
    # answer) until a request head is complete: bytes do not reset it.
    cfg.keep_alive_timeout = lim.head_timeout_s
    cfg.graceful_timeout = lim.graceful_timeout_s
    cfg.h11_max_incomplete_size = MAX_HEAD_BYTES
    cfg.max_app_queue_size = 4         # body pieces buffered ahead of the app, per connection
    context = WorkerContext(None)
    wrapped = wrap_app(app, cfg.wsgi_max_body_size, "asgi")  # type: ignore[arg-type]  # hypercorn types the app with its own ASGI event types; ours is a plain ASGI callable
    gate = ConnectionGate(lim.max_connections, lim.max_per_client)
    app.gate = gate
    app.handshakes = handshakes = trio.CapacityLimiter(max(1, lim.max_handshakes))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"{'https' if ssl_context else 'http'}://{shown}:{bound[1]}"
    app.tls = ssl_context is not None

    async def connection(stream: trio.SocketStream) -> None:
        try:
            client = str(stream.socket.getpeername()[0])
        except OSError:
            await trio.aclose_forcefully(stream)
            return
        if not gate.enter(client):
            await turn_away(stream, plain=ssl_context is None)
            return
        try:
            inner: trio.abc.Stream = stream
            conn_state: dict[str, Any] = {}
            if ssl_context is not None:
                tls_stream = await _tls_accept(app, stream, ssl_context, lim.head_timeout_s, handshakes)
                if tls_stream is None:
                    return
                inner = tls_stream
                conn_state["herd.principal"] = tls.stream_principal(tls_stream)
            with trio.CancelScope() as scope:
                server = TCPServer(wrapped, cfg, context, ConnectionState(conn_state),
                                   _GuardedStream(inner, stream.socket, lim.send_stall_s, scope))  # type: ignore[arg-type]  # TCPServer is typed for an SSLStream; _GuardedStream has the stream interface it uses
                await server.run()
        except Exception:  # contained to this connection: log it, close it, keep serving
            log.exception("connection failed client=%s", client)
            await trio.aclose_forcefully(stream)
        finally:
            gate.leave(client)

    async with trio.open_nursery() as conns:
        async with trio.open_nursery() as accept:
            await accept.start(partial(trio.serve_listeners, connection, listeners, handler_nursery=conns))
            task_status.started(url)
            if shutdown_trigger is None:
                await trio.sleep_forever()
            await shutdown_trigger()
            accept.cancel_scope.cancel()
        await context.terminated.set()
        conns.cancel_scope.deadline = trio.current_time() + lim.graceful_timeout_s


# ---------------------------------------------------------------- OpenAPI

_REF = "#/components/schemas/{name}"
_STATUS_TEXT = {200: "OK", 201: "Created", 202: "Accepted", 400: "Bad request", 401: "Unauthorized",
                403: "Forbidden", 404: "Not found", 408: "Request body too slow", 409: "Conflict",
                413: "Request body too large", 431: "Request head too large", 503: "Unavailable"}


def _is_type(b: Body) -> bool:
    return b is not None and not isinstance(b, dict | list | str | int | float | bool | Text)


def _types_in(b: Body) -> list[Any]:
    """The types in a body: itself, or those inside a JSON Schema dict's values."""
    if isinstance(b, dict):
        return [t for v in b.values() for t in _types_in(v)]
    return [b] if _is_type(b) else []


def openapi_document(routes: list[_Route], title: str, version: str) -> dict[str, Any]:
    types: list[Any] = [ErrorBody]
    for r in routes:
        d = r.doc or RouteDoc()
        for b in (d.body, *d.responses.values()):
            types += _types_in(b)
        types += [p.schema for p in d.query]
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    by_type = {id(t): sc for t, sc in zip(types, schemas, strict=True)}

    def schema(b: Body) -> Any:
        if isinstance(b, dict):
            return {k: schema(v) for k, v in b.items()}
        return by_type[id(b)] if _is_type(b) else b

    def content(b: Body) -> dict[str, Any]:
        if isinstance(b, Text):
            return {b.content_type: {"schema": {"type": "string"}}}
        return {"application/json": {"schema": schema(b)}}

    error = {"description": "", "content": content(ErrorBody)}

    def err(status: int, why: str) -> dict[str, Any]:
        return {**error, "description": why or _STATUS_TEXT.get(status, "error")}

    paths: dict[str, Any] = {}
    for r in routes:
        d = r.doc or RouteDoc()
        summary = d.summary or ((r.handler.__doc__ or "").strip().splitlines() or [""])[0]
        op: dict[str, Any] = {
            "operationId": f"{r.method.lower()}_{re.sub(r'[^a-zA-Z0-9]+', '_', r.template).strip('_')}",
            "summary": summary,
        }
        if r.handler.__doc__:
            op["description"] = " ".join(r.handler.__doc__.split())
        params: list[dict[str, Any]] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                        for n in re.findall(r"\{(\w+)\}", r.template)]
        params += [{"name": p.name, "in": "query", "required": p.required, "description": p.description,
                    "schema": by_type[id(p.schema)]} for p in d.query]
        if params:
            op["parameters"] = params
        if d.body is not None:
            op["requestBody"] = {"required": d.body_required, "content": content(d.body)}
        responses: dict[str, Any] = {}
        for status, b in sorted((d.responses or {200: None}).items()):
            resp: dict[str, Any] = {"description": _STATUS_TEXT.get(status, "answer")}
            if b is not None:
                resp["content"] = content(b)
            responses[str(status)] = resp
        if d.body is not None or r.method in ("POST", "PUT", "PATCH"):
            responses.setdefault("400", err(400, "malformed or invalid request body"))
            responses.setdefault("408", err(408, "the body did not arrive in time"))
            responses.setdefault("413", err(413, f"body over {r.max_body} bytes"))
        elif d.query:
            responses.setdefault("400", err(400, "a bad query parameter"))
        for status, why in sorted(d.errors.items()):
            responses.setdefault(str(status), err(status, why))
        if r.auth is not None:
            op["security"] = [{"bearer": []}]
            responses.setdefault("401", err(401, "missing or wrong bearer token"))
            responses.setdefault("403", err(403, "the credential lacks the role: " + ", ".join(r.roles)))
        else:
            op["security"] = []
        if r.roles:
            op["x-herd-roles"] = list(r.roles)
        responses.setdefault("431", err(431, "request head too large"))
        responses["default"] = err(500, "an error of the server")
        op["responses"] = responses
        paths.setdefault(r.template, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
                       "schemas": components},
        "paths": paths,
    }
