"""A small ASGI routing layer and the hypercorn (trio worker) server both daemons use.

Why hypercorn: it is a maintained, trio-native ASGI server (HTTP/1.1 keep-alive,
h2, graceful shutdown, ``task_status`` with the bound addresses, so port 0 works);
the control APIs are small JSON endpoints where its per-request cost (~0.3 ms) is
far below our latency targets. The bulk data plane (p2p) does not use it: it
needs ``os.sendfile`` and has its own lean h11 server.

Handlers are ``async def handler(req: Request) -> Response``. Errors a client
caused are raised as :class:`HTTPError` and become one JSON line
``{"error": ..., "detail": ...}``; request bodies are bounded (413); msgspec
decode/validation errors become 400 with the reason.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import msgspec
import trio

from .auth import TokenSet, bearer

log = logging.getLogger("herd.http")

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB


class HTTPError(Exception):
    def __init__(self, status: int, error: str, detail: str | None = None) -> None:
        super().__init__(f"{status} {error}")
        self.status = status
        self.error = error
        self.detail = detail


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    client: str | None
    params: dict[str, str] = field(default_factory=dict)

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
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status=status, body=msgspec.json.encode(obj))


def text_response(text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status=status, body=text.encode(), content_type=content_type)


Handler = Callable[[Request], Awaitable[Response]]
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


class App:
    """A tiny ASGI app: exact-method routes with ``{name}`` path parameters."""

    def __init__(self, *, max_body: int = DEFAULT_MAX_BODY, name: str = "herd") -> None:
        self.routes: list[_Route] = []
        self.max_body = max_body
        self.name = name

    def route(self, method: str, template: str, *, auth: AuthPolicy | None = None,
              max_body: int | None = None) -> Callable[[Handler], Handler]:
        regex = "^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", template) + "$"

        def deco(fn: Handler) -> Handler:
            self.routes.append(_Route(method.upper(), re.compile(regex), template, fn, auth,
                                      self.max_body if max_body is None else max_body))
            return fn
        return deco

    def add(self, method: str, template: str, fn: Handler, *, auth: AuthPolicy | None = None,
            max_body: int | None = None) -> None:
        self.route(method, template, auth=auth, max_body=max_body)(fn)

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
        resp = await self._handle(scope, receive)
        headers = [(b"content-type", resp.content_type.encode()),
                   (b"content-length", str(len(resp.body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in resp.headers]
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        body = b"" if scope["method"] == "HEAD" else resp.body
        await send({"type": "http.response.body", "body": body})

    async def _handle(self, scope: dict[str, Any], receive: Any) -> Response:
        method = scope["method"].upper()
        path = scope["path"]
        try:
            route, params, known = self._match(method, path)
            if route is None:
                raise HTTPError(405 if known else 404, "method not allowed" if known else "not found", path)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            declared = headers.get("content-length")
            if declared is not None:
                try:
                    if int(declared) > route.max_body:
                        raise HTTPError(413, "request body too large", f"limit {route.max_body} bytes")
                except ValueError:
                    raise HTTPError(400, "bad content-length") from None
            chunks: list[bytes] = []
            size = 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise HTTPError(400, "client disconnected")
                data = msg.get("body", b"")
                size += len(data)
                if size > route.max_body:
                    raise HTTPError(413, "request body too large", f"limit {route.max_body} bytes")
                chunks.append(data)
                if not msg.get("more_body", False):
                    break
            qs = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            client = scope.get("client")
            req = Request(method=method, path=path, query={k: v[-1] for k, v in qs.items()},
                          headers=headers, body=b"".join(chunks),
                          client=client[0] if client else None, params=params)
            if route.auth is not None:
                route.auth(req)
            return await route.handler(req)
        except HTTPError as e:
            return json_response({"error": e.error, "detail": e.detail}, status=e.status)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return json_response({"error": "malformed request body", "detail": str(e)}, status=400)
        except Exception:  # a bug of ours: log it, answer 500, keep serving
            log.exception("handler failed path=%s", path)
            return json_response({"error": "internal error"}, status=500)

    def openapi(self, title: str, version: str = "1") -> dict[str, Any]:
        """A minimal OpenAPI 3.1 description generated from the route table, so it
        cannot drift from what is served."""
        paths: dict[str, Any] = {}
        for r in self.routes:
            op: dict[str, Any] = {
                "operationId": f"{r.method.lower()}_{re.sub(r'[^a-zA-Z0-9]+', '_', r.template).strip('_')}",
                "summary": (r.handler.__doc__ or "").strip().splitlines()[0] if r.handler.__doc__ else "",
                "responses": {"200": {"description": "OK"}},
            }
            names = re.findall(r"\{(\w+)\}", r.template)
            if names:
                op["parameters"] = [{"name": n, "in": "path", "required": True,
                                     "schema": {"type": "string"}} for n in names]
            if r.auth is not None:
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = {"description": "missing or wrong bearer token"}
            if r.method in ("POST", "PUT", "PATCH"):
                op["responses"]["400"] = {"description": "malformed body"}
                op["responses"]["413"] = {"description": f"body over {r.max_body} bytes"}
            paths.setdefault(r.template, {})[r.method.lower()] = op
        return {
            "openapi": "3.1.0",
            "info": {"title": title, "version": version},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "paths": paths,
        }


def split_hostport(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port or 0)


async def serve(app: App, listen: str, *, task_status: Any = trio.TASK_STATUS_IGNORED,
                shutdown_trigger: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve ``app`` on ``listen`` ("host:port", port 0 allowed) until cancelled.

    ``task_status.started(url)`` reports the bound base URL, e.g. ``http://127.0.0.1:41234``.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hc_serve

    host, port = split_hostport(listen)
    cfg = Config()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("herd.http.server")
    cfg.keep_alive_timeout = 75
    cfg.graceful_timeout = 2
    cfg.h11_max_incomplete_size = 64 * 1024

    class _Started:
        def started(self, binds: Any = None) -> None:
            url = binds[0] if binds else f"http://{host}:{port}"
            task_status.started(url)

    await hc_serve(app, cfg, shutdown_trigger=shutdown_trigger, task_status=_Started())  # type: ignore[arg-type]
