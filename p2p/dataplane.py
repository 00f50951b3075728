"""The data plane: every agent serves its chunk store to its peers on its own port.

Routes (all need the cluster token as a bearer token; 401 otherwise):

- ``GET /v1/chunks/{id}[?wait_ms=N]`` the chunk's bytes, sent with ``os.sendfile``
  straight from the chunk file. With ``wait_ms`` the request waits up to N ms for the
  chunk to be present here, whether or not this node has started fetching it (a home
  may get its placement after its peers ask). 404 when absent after the wait.
- ``HEAD /v1/chunks/{id}`` 200 + Content-Length when present, else 404.
- ``GET /v1/manifests/{id}`` the manifest's canonical bytes (peers verify them by id).
- ``GET /v1/have/{manifest}`` a bitmap over the manifest's chunk table: bit i (MSB
  first in byte i // 8) is set when chunk i is here. Headers ``x-herd-chunks`` and
  ``x-herd-have`` carry the counts.
- ``GET /v1/stats`` this server's statistics() as JSON.

Why not hypercorn (used by the control APIs): an ASGI server must be handed the body as
bytes, so every chunk would be read into Python and copied again into the socket. This
server is a lean h11 loop on trio sockets: headers go through h11, the body goes from
the page cache to the socket with ``os.sendfile`` on the non-blocking socket
(``wait_writable`` + ``sendfile`` until done), never through Python buffers.

Limits: request head size (h11 ``max_incomplete_event_size``), no request bodies,
concurrent requests per client address and overall (503 + Retry-After when over),
an idle keep-alive timeout, a head-read timeout, a send-stall timeout, and a cap on
``wait_ms``.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import msgspec
import trio

from .errors import StoreError

log = logging.getLogger("herd.p2p.dataplane")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SERVER = b"herd-dataplane/1"


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    max_concurrent: int = 256          # requests being served at once, all clients
    max_per_client: int = 32           # ... per client address
    max_wait_ms: int = 120_000         # cap on ?wait_ms=
    head_timeout_s: float = 10.0       # to read a request head once bytes started coming
    idle_timeout_s: float = 75.0       # keep-alive idle
    send_stall_s: float = 30.0         # no send progress for this long: drop the connection
    max_head_bytes: int = 16 * 1024
    poll_s: float = 0.25               # re-check the disk while waiting (another process may write)


class _Stats(msgspec.Struct, kw_only=True):
    requests: int = 0
    active: int = 0
    chunks_served: int = 0
    bytes_served: int = 0
    not_found: int = 0
    waits: int = 0
    waits_satisfied: int = 0
    unauthorized: int = 0
    rejected_busy: int = 0
    bad_requests: int = 0
    connections: int = 0
    sendfile_fallbacks: int = 0


@dataclass(slots=True)
class _Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    file: Path | None = None          # send this file's bytes with sendfile instead of body


class _Len:
    """A stand-in for body bytes: h11 only needs len() to frame it (passthrough)."""
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _json(status: int, error: str, detail: str | None = None,
          headers: list[tuple[bytes, bytes]] | None = None) -> _Reply:
    return _Reply(status, msgspec.json.encode({"error": error, "detail": detail}), headers=headers or [])


class DataPlane:
    """Serve ``store`` to peers on ``listen`` ("host:port", port 0 allowed).

    ``token`` is the cluster token peers must present. ``None`` means no request can be
    authenticated (every request gets 401) unless ``insecure_open=True`` is passed
    explicitly (local benchmarks only).
    """

    def __init__(self, store: Any, *, token: str | None, listen: str = "127.0.0.1:0",
                 config: DataPlaneConfig | None = None, insecure_open: bool = False) -> None:
        self.store = store
        self._token = token.encode() if token else None
        self._open = insecure_open and token is None
        self.listen = listen
        self.config = config or DataPlaneConfig()
        self.url: str | None = None
        self._stats = _Stats()
        self._per_client: dict[str, int] = {}
        self._waiters: dict[str, list[Any]] = {}  # chunk id -> [Event, waiter count]
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._hook: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        host, _, port_s = self.listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        listeners = await trio.open_tcp_listeners(int(port_s or 0), host=host)
        sock = listeners[0].socket
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"http://{shown}:{bound[1]}"
        self._trio_token = trio.lowlevel.current_trio_token()
        self._install_hook()
        log.info("data plane listening url=%s auth=%s", self.url,
                 "open" if self._open else ("token" if self._token else "none-configured"))
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._connection, listeners)
                task_status.started(self.url)
        finally:
            self._remove_hook()

    def statistics(self) -> dict[str, Any]:
        s = msgspec.structs.asdict(self._stats)
        s["waiting"] = len(self._waiters)
        s["url"] = self.url
        return s

    # ------------------------------------------------------------------ waking waiters

    def _install_hook(self) -> None:
        hooks = getattr(self.store, "on_chunk_added", None)
        if hooks is None:
            return
        token = self._trio_token

        def hook(chunk_id: str) -> None:
            # put_chunk may run in a worker thread or in the trio thread: run_sync_soon
            # is safe from both.
            if token is not None:
                try:
                    token.run_sync_soon(self._wake, chunk_id)
                except trio.RunFinishedError:
                    pass

        self._hook = hook
        hooks.append(hook)

    def _remove_hook(self) -> None:
        hooks = getattr(self.store, "on_chunk_added", None)
        if hooks is not None and self._hook in hooks:
            hooks.remove(self._hook)

    def _wake(self, chunk_id: str) -> None:
        w = self._waiters.get(chunk_id)
        if w is not None:
            w[0].set()

    async def _wait_for_chunk(self, chunk_id: str, wait_ms: int) -> bool:
        """Wait until the chunk is here (woken by the store's hook; the disk is re-checked
        every ``poll_s`` in case it arrives another way) or ``wait_ms`` passes."""
        self._stats.waits += 1
        w = self._waiters.get(chunk_id)
        if w is None or w[0].is_set():
            w = self._waiters[chunk_id] = [trio.Event(), 0]
        w[1] += 1
        try:
            with trio.move_on_after(wait_ms / 1000):
                while not self.store.has_chunk(chunk_id):
                    with trio.move_on_after(self.config.poll_s):
                        await w[0].wait()
        finally:
            w[1] -= 1
            if w[1] == 0 and self._waiters.get(chunk_id) is w:
                del self._waiters[chunk_id]
        present = bool(self.store.has_chunk(chunk_id))
        if present:
            self._stats.waits_satisfied += 1
        return present

    # ------------------------------------------------------------------ connections

    async def _connection(self, stream: trio.SocketStream) -> None:
        self._stats.connections += 1
        try:
            peer = stream.socket.getpeername()
            client = str(peer[0])
        except OSError:
            client = "?"
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.max_head_bytes)
        try:
            while True:
                req = await self._read_request(stream, conn)
                if req is None:
                    return
                # the request's slot (503 when over the limits) is held until its
                # answer has been sent: a sendfile in progress counts as busy
                admitted = False
                try:
                    reply, admitted = await self._dispatch(req, client)
                    ok = await self._send_reply(stream, conn, req, reply)
                finally:
                    if admitted:
                        self._leave(client)
                if not ok or conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            return
        except h11.RemoteProtocolError as e:
            self._stats.bad_requests += 1
            await self._try_send_error(stream, conn, e.error_status_hint, str(e))
        finally:
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()

    async def _read_request(self, stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
        timeout = self.config.idle_timeout_s
        req: h11.Request | None = None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                with trio.move_on_after(timeout) as cs:
                    data = await stream.receive_some(65536)
                if cs.cancelled_caught:
                    return None
                if not data and conn.their_state is h11.IDLE and req is None:
                    return None
                conn.receive_data(data)
                timeout = self.config.head_timeout_s
                continue
            if isinstance(ev, h11.Request):
                # h11 bounds only a head still incomplete; one that came whole is measured here
                head = len(ev.target) + sum(len(k) + len(v) + 4 for k, v in ev.headers)
                if head > self.config.max_head_bytes:
                    raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
                req = ev
                continue
            if isinstance(ev, h11.Data):
                # No route takes a body: refuse rather than buffer it.
                raise h11.RemoteProtocolError("request bodies are not accepted", error_status_hint=413)
            if isinstance(ev, h11.EndOfMessage):
                return req
            if isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
                return None

    async def _try_send_error(self, stream: trio.SocketStream, conn: h11.Connection,
                              status: int, detail: str) -> None:
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = msgspec.json.encode({"error": "bad request", "detail": detail})
        try:
            data = conn.send(h11.Response(status_code=status, headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), (b"server", _SERVER)]))
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
            with trio.move_on_after(2):
                await stream.send_all(data)
        except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    # ------------------------------------------------------------------ routing

    def _authorised(self, req: h11.Request) -> bool:
        if self._open:
            return True
        if self._token is None:
            return False
        for k, v in req.headers:
            if k == b"authorization":
                scheme, _, tok = v.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(tok.strip(), self._token)
        return False

    async def _dispatch(self, req: h11.Request, client: str) -> tuple[_Reply, bool]:
        """The answer, and whether a concurrency slot was taken (the caller leaves it)."""
        self._stats.requests += 1
        method = req.method.decode("ascii", "replace").upper()
        target = urlsplit(req.target.decode("latin-1"))
        path = target.path
        if not self._authorised(req):
            self._stats.unauthorized += 1
            return _json(401, "unauthorized", "needs the cluster token as a bearer token"), False
        for k, v in req.headers:
            if k == b"content-length" and v.strip() not in (b"0", b""):
                self._stats.bad_requests += 1
                return _json(413, "request bodies are not accepted"), False
        cfg = self.config
        if self._stats.active >= cfg.max_concurrent or self._per_client.get(client, 0) >= cfg.max_per_client:
            self._stats.rejected_busy += 1
            return _json(503, "busy", "too many concurrent requests", headers=[(b"retry-after", b"1")]), False
        self._stats.active += 1
        self._per_client[client] = self._per_client.get(client, 0) + 1
        try:
            return await self._route(method, path, target.query), True
        except Exception:  # a bug or a broken store: answer 500, keep serving
            log.exception("data plane request failed path=%s", path)
            return _json(500, "internal error"), True
        except BaseException:
            self._leave(client)
            raise

    def _leave(self, client: str) -> None:
        self._stats.active -= 1
        n = self._per_client[client] - 1
        if n:
            self._per_client[client] = n
        else:
            del self._per_client[client]

    async def _route(self, method: str, path: str, query: str) -> _Reply:
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "v1":
            if path == "/v1/stats" and method in ("GET", "HEAD"):
                return _Reply(200, msgspec.json.encode(self.statistics()))
            return _json(404, "not found", path)
        _, kind, ident = parts
        if kind not in ("chunks", "manifests", "have"):
            return _json(404, "not found", path)
        if method not in ("GET", "HEAD"):
            return _json(405, "method not allowed", method, headers=[(b"allow", b"GET, HEAD")])
        if not _HEX64.match(ident):
            self._stats.bad_requests += 1
            return _json(400, "bad id", "ids are 64 lower-case hex characters")
        if kind == "chunks":
            return await self._chunk(ident, query)
        if kind == "manifests":
            return self._manifest(ident)
        return self._have(ident)

    async def _chunk(self, chunk_id: str, query: str) -> _Reply:
        wait_ms = 0
        if query:
            qs = parse_qs(query, keep_blank_values=True)
            if "wait_ms" in qs:
                raw = qs["wait_ms"][-1]
                if not raw.isdigit():
                    self._stats.bad_requests += 1
                    return _json(400, "bad wait_ms", "a non-negative integer of milliseconds")
                wait_ms = min(int(raw), self.config.max_wait_ms)
        present = self.store.has_chunk(chunk_id)
        if not present and wait_ms > 0:
            present = await self._wait_for_chunk(chunk_id, wait_ms)
        if not present:
            self._stats.not_found += 1
            return _json(404, "chunk not here", chunk_id)
        # Opened (and sized) when sending; a chunk evicted in between becomes a 404 there.
        # Serving it to a peer is a use: keep it warm in the store's LRU.
        self.store.touch(chunk_id)
        path = Path(self.store.chunk_path(chunk_id))
        return _Reply(200, content_type="application/octet-stream", file=path)

    def _manifest_bytes(self, manifest_id: str) -> bytes | None:
        try:
            return bytes(self.store.manifest_bytes(manifest_id))
        except StoreError:
            return None

    def _manifest(self, manifest_id: str) -> _Reply:
        data = self._manifest_bytes(manifest_id)
        if data is None:
            self._stats.not_found += 1
            return _json(404, "manifest not here", manifest_id)
        return _Reply(200, data, content_type="application/octet-stream")

    def _have(self, manifest_id: str) -> _Reply:
        try:
            manifest = self.store.get_manifest(manifest_id)
        except StoreError:
            self._stats.not_found += 1
            return _json(404, "manifest not here", manifest_id)
        ids = [c.id for c in manifest.chunks]
        bits = bytearray((len(ids) + 7) // 8)
        have = 0
        for i, cid in enumerate(ids):
            if self.store.has_chunk(cid):
                bits[i >> 3] |= 0x80 >> (i & 7)
                have += 1
        return _Reply(200, bytes(bits), content_type="application/octet-stream",
                      headers=[(b"x-herd-chunks", str(len(ids)).encode()),
                               (b"x-herd-have", str(have).encode())])

    # ------------------------------------------------------------------ sending

    async def _send_reply(self, stream: trio.SocketStream, conn: h11.Connection,
                          req: h11.Request, reply: _Reply) -> bool:
        head = req.method.upper() == b"HEAD"
        fd = -1
        size = len(reply.body)
        if reply.file is not None:
            try:
                fd = os.open(reply.file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                size = os.fstat(fd).st_size
            except FileNotFoundError:
                reply = _json(404, "chunk not here")
                size = len(reply.body)
        try:
            headers = [(b"content-type", reply.content_type.encode()),
                       (b"content-length", str(size).encode()), (b"server", _SERVER)]
            headers += reply.headers
            out = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
            if head:
                out += conn.send(h11.EndOfMessage()) or b""
                await self._send_all(stream, out)
                return True
            if fd < 0:
                if reply.body:
                    out += conn.send(h11.Data(data=reply.body)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await self._send_all(stream, out)
                return True
            await self._send_all(stream, out)
            # h11 frames the body from len() only; the bytes go by sendfile.
            conn.send_with_data_passthrough(h11.Data(data=_Len(size)))  # type: ignore[arg-type]
            await self._sendfile(stream, fd, size)
            tail = conn.send(h11.EndOfMessage()) or b""
            if tail:
                await self._send_all(stream, tail)
            self._stats.chunks_served += 1
            self._stats.bytes_served += size
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    async def _send_all(self, stream: trio.SocketStream, data: bytes) -> None:
        with trio.fail_after(self.config.send_stall_s):
            await stream.send_all(data)

    async def _sendfile(self, stream: trio.SocketStream, fd: int, size: int) -> None:
        sock = stream.socket
        out_fd = sock.fileno()
        offset = 0
        stall = self.config.send_stall_s
        while offset < size:
            try:
                n = os.sendfile(out_fd, fd, offset, size - offset)
            except BlockingIOError:
                with trio.move_on_after(stall) as cs:
                    await trio.lowlevel.wait_writable(sock)
                if cs.cancelled_caught:
                    raise trio.BrokenResourceError("peer stopped reading") from None
                continue
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    await self._send_plain(stream, fd, offset, size)
                    return
                raise trio.BrokenResourceError(str(e)) from e
            if n == 0:  # the file shrank under us: the framing is now wrong, drop it
                raise trio.BrokenResourceError("chunk file truncated while sending")
            offset += n
            await trio.lowlevel.checkpoint_if_cancelled()

    async def _send_plain(self, stream: trio.SocketStream, fd: int, offset: int, size: int) -> None:
        self._stats.sendfile_fallbacks += 1
        while offset < size:
            data = os.pread(fd, min(1 << 20, size - offset), offset)
            if not data:
                raise trio.BrokenResourceError("chunk file truncated while sending")
            await self._send_all(stream, data)
            offset += len(data)

