"""The data plane: every agent serves its chunk store to its peers on its own port.

Routes (all need the cluster token as a bearer token; 401 otherwise):

- ``GET /v1/chunks/{id}[?wait_ms=N]`` the chunk's bytes, sent with ``os.sendfile``
  straight from the chunk file. With ``wait_ms`` the request waits up to N ms for the
  chunk to be present here, whether or not this node has started fetching it (a home
  may get its placement after its peers ask). 404 when absent after the wait.
- ``HEAD /v1/chunks/{id}`` 200 + Content-Length when present, else 404.
- ``GET /v1/chunks?ids=a,b,...`` several chunks in one answer, a frame each
  (:mod:`p2p.batch`): at most ``max_batch_chunks`` ids and ``max_batch_bytes`` of
  chunks. One serving slot for the batch; each chunk counts against
  ``max_serving_per_chunk`` (a chunk over it is framed busy, the rest sent). On plain
  connections a worker thread sends the frames (header with MSG_MORE, then sendfile).
- ``GET /v1/chunks?ids=a,b&sizes=Na,Nb&wait_ms=W`` a batch that can wait (a tree child
  asking its parent for the next chunks the parent is fetching itself): each chunk is
  sent, in order, as soon as it is here, within W ms; the head goes once the first one
  is here (404 if it is not after the whole wait). A chunk being sent to
  ``max_serving_per_chunk`` peers already waits for a copy to finish. A chunk still
  absent (or still busy) at the deadline, or of another size than named, ends the
  answer there (the connection is closed after the frames sent; the asker keeps them). It takes a
  place in the wait budget (``max_waiting``), not a serving slot, for its whole life.
- ``GET /v1/manifests/{id}[?wait_ms=N]`` the manifest's canonical bytes (peers verify
  them by id). With ``wait_ms`` the request waits for the manifest to be stored here, at
  most ``max_manifest_wait_ms`` (2 s: a tree parent gets it within milliseconds or is
  not fetching it), at most ``max_manifest_waiting`` (64) such waits at once (503 +
  Retry-After beyond), holding no serving slot; 404 when absent after the wait.
- ``GET /v1/have/{manifest}`` a bitmap over the manifest's chunk table: bit i (MSB
  first in byte i // 8) is set when chunk i is here. Headers ``x-herd-chunks`` and
  ``x-herd-have`` carry the counts.
- ``GET /v1/stats`` this server's statistics() as JSON.

Reads by membership (``readers``, :mod:`p2p.readers`; with TLS, the agent's default): a
manifest, its have-bitmap and its chunks are served only to a node (the asker's certificate
names it) of a gang here that uses the manifest, or to anyone when the manifest is public;
or to a node that presents the placer's read grant for it (``x-herd-grant``: a contact
serving a gang it is not in, :mod:`infra.grants`); anything else gets 403 with a structured
reason (``x-herd-refused`` and the body's ``reason``: ``not_a_node`` | ``not_a_member`` |
``bad_grant``), counted in ``refused_<reason>``. A request
that waits (``?wait_ms=``) is checked leniently first -- a node whose placement has not come
here yet, or whose gang's manifest is not here yet, may wait -- and strictly once what it
waited for is here (a waiting batch: per chunk, the answer cut at the first refused one).

Why not hypercorn (used by the control APIs): an ASGI server must be handed the body as
bytes, so every chunk would be read into Python and copied again into the socket. This
server is a lean h11 loop on trio sockets: headers go through h11, the body goes from
the page cache to the socket with ``os.sendfile`` on the non-blocking socket
(``wait_writable`` + ``sendfile`` until done), never through Python buffers.

TLS (``ssl_context``, a server context from :mod:`infra.tls`; the URL is then
https://): each connection's handshake must finish within ``head_timeout_s``; bodies go
through the TLS layer (pread + send: no sendfile without kernel TLS), so TLS costs CPU on
both ends (``python -m bench.node`` measures how much). A batch answer's frames are
encrypted and sent by a worker thread with the connection's own TLS session
(:func:`p2p.batch.send_frames_tls`), so encryption runs off the event loop.

Hostile input costs the sender, never this daemon. Bounds (``DataPlaneConfig``), in the
order a request meets them:

- **Connections**: at most ``max_connections`` (default 4 x ``max_concurrent`` = 1024)
  open at once and ``max_connections_per_client`` (2 x ``max_per_client`` = 64) per
  client address (a connection carries one request at a time, so these follow the
  request caps); one over either gets a canned 503 and is closed without a byte read.
- **Idle**: a kept-alive connection with no request for ``idle_timeout_s`` (75 s) is closed.
- **Head**: once its first byte came, a request head must be complete within
  ``head_timeout_s`` (10 s), an absolute deadline that trickled bytes do not reset; at
  most ``max_head_bytes`` (16 KiB), whole or in pieces (431).
- **Bodies**: no route takes one; a request announcing or sending a body is refused
  (413) and its connection closed, nothing is buffered.
- **Authentication** runs on the head, before any work.
- **Serving slots**: ``max_concurrent`` (256) requests being answered at once and
  ``max_per_client`` (32) per address (503 + Retry-After when over); a slot is held
  until the answer has been sent, and ``send_stall_s`` (30 s) without send progress
  drops the connection. ``/v1/stats`` takes no slot: it is always answered.
- **Batches** (``GET /v1/chunks?ids=``): at most ``max_batch_chunks`` (64) ids, all
  well-formed and distinct, naming at most ``max_batch_bytes`` (128 MiB) of chunks here
  (400 / 413 otherwise, before anything is sent); one serving slot per batch, and every
  chunk in it counts against ``max_serving_per_chunk`` until the answer is sent.
- **Waits** (``?wait_ms=``) have their own budget: ``max_waiting`` (256) waiting at
  once and ``max_waiting_per_client`` (64) per address (503 when over), and hold no
  serving slot while they wait, so a wait flood cannot starve serving; ``wait_ms`` is
  capped at ``max_wait_ms`` (120 s). A waiting request whose client goes away (EOF or
  reset) stops waiting and frees its place at once.
- Any error while handling one connection is logged and closes that connection only.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import h11
import msgspec
import trio

from infra.gate import ConnectionGate, turn_away
from infra.grants import HEADER as GRANT_HEADER
from infra.tls import HerdContext, stream_principal

from . import batch as _b
from .batch import (
    BUSY,
    FRAME,
    MISSING,
    OK,
    BatchQuery,
    BatchQueryError,
    Handoff,
    Outgoing,
    Stop,
    frame,
    parse_batch,
    parse_ids,
    send_frames,
)
from .batch import CONTENT_TYPE as BATCH_TYPE
from .errors import StoreError
from .readers import Asker, Readers, ReadRefusal, chunk_refusal, manifest_refusal
from .store import ChunkStore

T = TypeVar("T")

log = logging.getLogger("herd.p2p.dataplane")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SERVER = b"herd-dataplane/1"
_GRANT_KEY = GRANT_HEADER.encode()


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    max_concurrent: int = 256          # requests being served at once, all clients
    max_per_client: int = 32           # ... per client address
    max_waiting: int = 256             # ?wait_ms= requests waiting at once, all clients
    max_waiting_per_client: int = 64   # ... per client address
    max_connections: int | None = None             # open connections; None: 4 x max_concurrent
    max_connections_per_client: int | None = None  # ... per address; None: 2 x max_per_client
    max_wait_ms: int = 120_000         # cap on ?wait_ms=
    head_timeout_s: float = 10.0       # a request head, from its first byte (absolute)
    idle_timeout_s: float = 75.0       # keep-alive idle
    send_stall_s: float = 30.0         # no send progress for this long: drop the connection
    max_head_bytes: int = 16 * 1024
    poll_s: float = 0.25               # re-check the disk while waiting (another process may write)
    # Copies of one chunk being sent at once (0: no cap). The herd's trees bound how many
    # nodes ask a node for a chunk; this bounds how many it feeds at once: one over gets
    # 503 with Retry-After (and x-herd-retry-ms, finer) and asks the next source in its tree.
    max_serving_per_chunk: int = 0
    busy_retry_ms: int = 50
    # ?wait_ms= on manifests: a cap on the wait, and on how many wait at once (all clients
    # / per address), apart from the chunks' wait budget; over either: 503 + Retry-After
    max_manifest_wait_ms: int = 2_000
    max_manifest_waiting: int = 64
    max_manifest_waiting_per_client: int = 16
    # GET /v1/chunks?ids=...: ids per request, and bytes of chunks one answer may carry
    max_batch_chunks: int = 64
    max_batch_bytes: int = 128 << 20
    send_threads: int = 16             # batch answers being sent by worker threads at once
    # reads by membership: a request refused "not_a_member" waits this long for this node's
    # gangs to change (its own placement may come after its peers ask), in the wait budget
    member_wait_ms: int = 1_000


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
    rejected_waits: int = 0
    waits_abandoned: int = 0
    bad_requests: int = 0
    connections: int = 0
    open_connections: int = 0
    rejected_connections: int = 0
    head_timeouts: int = 0
    connection_errors: int = 0
    sendfile_fallbacks: int = 0
    tls_errors: int = 0                # TLS handshakes that failed or timed out
    revoked_closed: int = 0            # open connections closed: their peer was revoked since
    rejected_chunk_busy: int = 0       # 503: the chunk was being sent to max_serving_per_chunk peers
    manifest_waits: int = 0            # manifest requests that waited (?wait_ms=)
    manifest_waits_satisfied: int = 0
    rejected_manifest_waits: int = 0   # 503: max_manifest_waiting were waiting already
    serving_per_chunk_max: int = 0     # the most copies of one chunk ever sent at once
    batches: int = 0                   # GET /v1/chunks?ids= answered with frames
    batch_chunks_busy: int = 0         # chunks of batches framed busy (per-chunk cap)
    batch_chunks_missing: int = 0      # ... framed missing
    wait_batches: int = 0              # batches that could wait (?ids=&sizes=&wait_ms=) answered
    wait_batches_cut: int = 0          # ... ended early (a chunk absent at the deadline, resized, busy)
    refused_not_a_node: int = 0        # 403: reads by membership (p2p.readers), by reason
    refused_not_a_member: int = 0
    refused_bad_grant: int = 0


@dataclass(slots=True)
class _Reply:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    file: Path | None = None          # send this file's bytes with sendfile instead of body
    serving: str = ""                 # chunk id whose per-chunk serving count this reply holds
    frames: list[Outgoing] | None = None   # a batch: these frames (their fds are this reply's)
    serving_many: list[str] = field(default_factory=list)   # a batch's chunk ids counted as being sent
    wait_batch: BatchQuery | None = None   # a batch that can wait: sent by _send_wait_batch
    client: str = ""
    reader: Asker = Asker(None)           # a waiting batch's asker, checked per chunk


class _Len:
    """A stand-in for body bytes: h11 only needs len() to frame it (passthrough)."""
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


_GONE = object()   # _maybe_wait: the client left while its request waited


def _json(status: int, error: str, detail: str | None = None,
          headers: list[tuple[bytes, bytes]] | None = None) -> _Reply:
    return _Reply(status, msgspec.json.encode({"error": error, "detail": detail}), headers=headers or [])


def _refused(reason: ReadRefusal, what: str) -> _Reply:
    return _Reply(403, msgspec.json.encode({"error": "forbidden", "reason": reason, "detail": what}),
                  headers=[(b"x-herd-refused", reason.encode())])


CHUNK_SETS_KEPT = 16   # manifests whose chunk-id sets the membership check keeps (immutable by id)


class DataPlane:
    """Serve ``store`` to peers on ``listen`` ("host:port", port 0 allowed).

    ``token`` is the cluster token peers must present. ``None`` means no request can be
    authenticated (every request gets 401) unless ``insecure_open=True`` is passed
    explicitly (local benchmarks only). ``readers``: reads by membership (see the module
    docstring; askers are named by their TLS certificates, so without TLS only public
    manifests are served); None: any authenticated asker reads everything.
    """

    def __init__(self, store: ChunkStore, *, token: str | None, listen: str = "127.0.0.1:0",
                 config: DataPlaneConfig | None = None, insecure_open: bool = False,
                 ssl_context: ssl.SSLContext | None = None, readers: Readers | None = None) -> None:
        self.store = store
        self.readers = readers
        self._chunk_sets: dict[str, frozenset[str]] = {}   # manifest id -> its chunk ids (a few, recent)
        self._members_changed = trio.Event()
        if readers is not None:
            readers.on_change.append(self._gangs_changed)
        self._ssl = ssl_context
        self._token = token.encode() if token else None
        self._open = insecure_open and token is None
        self.listen = listen
        self.config = config or DataPlaneConfig()
        self.url: str | None = None
        self._stats = _Stats()
        # requests being served, overall and per address (max_concurrent / max_per_client)
        self._active = ConnectionGate(self.config.max_concurrent, self.config.max_per_client)
        # ?wait_ms= requests waiting, counted like connections (overall and per address)
        self._waits = ConnectionGate(self.config.max_waiting, self.config.max_waiting_per_client)
        c = self.config
        self._conns = ConnectionGate(c.max_connections or 4 * c.max_concurrent,
                            c.max_connections_per_client or 2 * c.max_per_client)
        self._waiters: dict[str, list[Any]] = {}  # chunk id -> [Event, waiter count]
        self._mwaits = ConnectionGate(c.max_manifest_waiting, c.max_manifest_waiting_per_client)
        self._manifest_events: dict[str, list[Any]] = {}   # manifest id -> [Event, waiter count]
        self._serving: dict[str, int] = {}         # chunk id -> copies being sent now
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._hook: Callable[[str], None] | None = None
        self._send_threads = trio.CapacityLimiter(max(1, self.config.send_threads))
        self._sending = 0   # chunk-body bytes handed to a send and not sent yet (send_backlog)
        self._changed = trio.Event()   # set, then replaced, at each change next_change names

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        host, _, port_s = self.listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        listeners = await trio.open_tcp_listeners(int(port_s or 0), host=host)
        sock = listeners[0].socket
        bound = sock.getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"{'https' if self._ssl else 'http'}://{shown}:{bound[1]}"
        self._trio_token = trio.lowlevel.current_trio_token()
        self._install_hook()
        log.info("data plane listening url=%s auth=%s tls=%s", self.url,
                 "open" if self._open else ("token" if self._token else "none-configured"),
                 "on" if self._ssl else "off")
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._connection, listeners)
                task_status.started(self.url)
        finally:
            self._remove_hook()

    def send_backlog(self) -> int:
        """Chunk-body bytes this node has committed to send and not sent yet (answers
        being sent now: a batch's frames, one chunk's sendfile): what this node's uplink
        still owes its askers (also ``statistics()["send_backlog"]``)."""
        return self._sending

    def next_change(self) -> trio.Event:
        """An Event set the next time a request is routed, starts or stops waiting for
        a chunk, is held back by the per-chunk cap, or is done (sent, cut or abandoned), or a
        connection is closed: when what :meth:`statistics` counts of them may have
        moved. Wait on it, then look again (``testing.waiting.until``)."""
        return self._changed

    def _poke(self) -> None:
        ev, self._changed = self._changed, trio.Event()
        ev.set()

    def statistics(self) -> dict[str, Any]:
        s = msgspec.structs.asdict(self._stats)
        s["send_backlog"] = self._sending
        s["waiting"] = len(self._waiters)
        s["waiting_requests"] = self._waits.open
        s["url"] = self.url
        if self.readers is not None:
            s["readers"] = self.readers.statistics()
        return s

    # ------------------------------------------------------------------ waking waiters

    def _install_hook(self) -> None:
        hooks = self.store.on_chunk_added
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
        self.store.on_manifest_added.append(self._manifest_hook)

    def _remove_hook(self) -> None:
        hooks = self.store.on_chunk_added
        if self._hook in hooks:
            hooks.remove(self._hook)
        if self._manifest_hook in self.store.on_manifest_added:
            self.store.on_manifest_added.remove(self._manifest_hook)

    def _manifest_hook(self, manifest_id: str) -> None:
        token = self._trio_token
        if token is not None:
            try:
                token.run_sync_soon(self._wake_manifest, manifest_id)
            except trio.RunFinishedError:
                pass

    def _wake_manifest(self, manifest_id: str) -> None:
        w = self._manifest_events.get(manifest_id)
        if w is not None:
            w[0].set()

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
        self._poke()
        try:
            with trio.move_on_after(wait_ms / 1000):
                while not self.store.has_chunk(chunk_id):
                    with trio.move_on_after(self.config.poll_s):
                        await w[0].wait()
        finally:
            w[1] -= 1
            if w[1] == 0 and self._waiters.get(chunk_id) is w:
                del self._waiters[chunk_id]
            self._poke()
        present = bool(self.store.has_chunk(chunk_id))
        if present:
            self._stats.waits_satisfied += 1
        return present

    # ------------------------------------------------------------------ connections

    async def _connection(self, raw: trio.SocketStream) -> None:
        self._stats.connections += 1
        try:
            peer = raw.socket.getpeername()
            client = str(peer[0])
        except OSError:
            client = "?"
        if not self._conns.enter(client):
            self._stats.rejected_connections += 1
            await turn_away(raw)
            return
        self._stats.open_connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.config.max_head_bytes)
        stream: trio.abc.Stream = raw
        try:
            if self._ssl is not None:
                # TLS: the handshake is bounded like a request head; bodies then go through
                # the TLS layer (pread + send), not sendfile.
                tls = trio.SSLStream(raw, self._ssl, server_side=True, https_compatible=True)
                stream = tls
                try:
                    with trio.fail_after(self.config.head_timeout_s):
                        await tls.do_handshake()
                except (trio.TooSlowError, trio.BrokenResourceError) as e:
                    self._stats.tls_errors += 1
                    log.info("data plane TLS handshake failed client=%s err=%s", client,
                             e.__cause__ or e or "timed out")
                    return
            # the deny-list (herd pki revoke) refused revoked peers in the handshake; one revoked
            # after it is caught at its next request (an int compared while the list is unchanged)
            deny = self._ssl.revoked if isinstance(self._ssl, HerdContext) else None
            seen = deny.generation if deny is not None else 0
            # the asker's node id, for reads by membership (its certificate names it)
            who = p.node_id if (p := stream_principal(stream)) is not None and p.kind == "node" else None
            while True:
                req = await self._read_request(stream, conn)
                if req is None:
                    return
                if deny is not None and deny.generation != seen:
                    seen = deny.generation
                    assert isinstance(stream, trio.SSLStream)
                    if (why := deny.refuses(stream.getpeercert())) is not None:
                        self._stats.revoked_closed += 1
                        log.warning("data plane connection closed client=%s: %s", client, why)
                        return
                # the request's slot (503 when over the limits) is held until its
                # answer has been sent: a sendfile in progress counts as busy
                admitted = False
                try:
                    reply, admitted = await self._dispatch(req, client, stream, conn, who)
                    if reply is None:   # the client went away while its request waited
                        return
                    self._poke()
                    ok = await self._send_reply(stream, conn, req, reply)
                finally:
                    if admitted:
                        self._leave(client)
                    self._poke()
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
        except Exception:  # a bug of ours or a broken store: this connection only
            self._stats.connection_errors += 1
            log.exception("data plane connection failed client=%s", client)
        finally:
            self._conns.leave(client)
            self._stats.open_connections -= 1
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await stream.aclose()
            self._poke()

    async def _read_request(self, stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
        """The next request head (and its end), or None when the client is done or idle
        too long. The head must be complete ``head_timeout_s`` after its first byte."""
        cfg = self.config
        req: h11.Request | None = None
        deadline = trio.current_time() + cfg.head_timeout_s if conn.trailing_data[0] else None
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                if deadline is None:
                    with trio.move_on_after(cfg.idle_timeout_s) as cs:
                        data = await stream.receive_some(65536)
                    if cs.cancelled_caught:
                        return None
                    deadline = trio.current_time() + cfg.head_timeout_s
                else:
                    with trio.move_on_at(deadline) as cs:
                        data = await stream.receive_some(65536)
                    if cs.cancelled_caught:
                        self._stats.head_timeouts += 1
                        raise h11.RemoteProtocolError(
                            f"request head not complete within {cfg.head_timeout_s:g} s", error_status_hint=408)
                if not data and conn.their_state is h11.IDLE and req is None:
                    return None
                conn.receive_data(bytes(data))
                continue
            if isinstance(ev, h11.Request):
                # h11 bounds only a head still incomplete; one that came whole is measured here
                head = len(ev.target) + sum(len(k) + len(v) + 4 for k, v in ev.headers)
                if head > cfg.max_head_bytes:
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

    async def _try_send_error(self, stream: trio.abc.Stream, conn: h11.Connection,
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

    def _asker(self, req: h11.Request, node: str | None) -> Asker:
        """The request's asker: its certificate's node id and what its read grants open."""
        if self.readers is None or node is None:
            return Asker(node)
        for k, v in req.headers:
            if k == _GRANT_KEY:
                return self.readers.asker(node, v.decode("ascii", "replace"), time.time())
        return Asker(node)

    def _chunks_of(self, manifest_id: str) -> frozenset[str] | None:
        """The chunk ids ``manifest_id`` lists (None: not held here), kept for a few manifests."""
        got = self._chunk_sets.get(manifest_id)
        if got is not None:
            return got
        if not self.store.has_manifest(manifest_id):
            return None
        try:
            got = frozenset(c.id for c in self.store.get_manifest(manifest_id).chunks)
        except StoreError:
            return None
        while len(self._chunk_sets) >= CHUNK_SETS_KEPT:
            del self._chunk_sets[next(iter(self._chunk_sets))]
        self._chunk_sets[manifest_id] = got
        return got

    def _gangs_changed(self) -> None:
        ev, self._members_changed = self._members_changed, trio.Event()
        ev.set()

    async def _member_wait(self, path: str, query: str, who: Asker, stream: trio.abc.Stream,
                           conn: h11.Connection, ms: int) -> _Reply | object | None:
        """The strict read check, waiting up to ``ms`` for this node's gangs to change while
        the answer is ``not_a_member`` (its placement may be on its way): None (it may read),
        the 403, or ``_GONE`` (the client left meanwhile). The caller holds a wait place. An
        asker whose grants all failed is not held (it relied on them, not on a placement)."""
        refused = self._read_check(path, query, who, strict=True, count=False)
        if refused is None or who.node_id is None or who.bad_grant or ms <= 0:
            return self._read_check(path, query, who, strict=True) if refused is not None else None
        deadline = trio.current_time() + ms / 1000

        async def changed() -> None:
            while self._read_check(path, query, who, strict=True, count=False) is not None:
                with trio.move_on_at(deadline):
                    await self._members_changed.wait()
                if trio.current_time() >= deadline:
                    return

        gone, _ = await self._watched(stream, conn, changed)
        if gone:
            return _GONE
        return self._read_check(path, query, who, strict=True)

    def _read_check(self, path: str, query: str, who: Asker, *, strict: bool,
                    count: bool = True) -> _Reply | None:
        """The 403 for a read ``who`` may not make here (reads by membership), else None."""
        readers = self.readers
        if readers is None:
            return None
        why: ReadRefusal | None = None
        if path.startswith(("/v1/manifests/", "/v1/have/")):
            ident = path.rsplit("/", 1)[1]
            if not _HEX64.match(ident):
                return None   # (the route answers 400)
            why = manifest_refusal(readers, who.node_id, ident, who.granted, bad_grant=who.bad_grant)
            if (why == "not_a_member" and not strict and who.node_id is not None
                    and not readers.manifests_for(who.node_id)):
                why = None    # its placement may not be here yet: it may wait, then it is checked
        elif path.startswith("/v1/chunks/") or path == "/v1/chunks":
            if path == "/v1/chunks":
                ids = [i for i in parse_qs(query).get("ids", [""])[-1].split(",")[:self.config.max_batch_chunks + 1]
                       if _HEX64.match(i)]
            else:
                ids = [path[len("/v1/chunks/"):]]
            for cid in ids:   # a batch is refused whole at its first chunk refused
                if (why := chunk_refusal(readers, who.node_id, cid, self._chunks_of, strict=strict,
                                         granted=who.granted, bad_grant=who.bad_grant)) is not None:
                    break
        else:
            return None
        if why is None:
            return None
        if not count:
            return _refused(why, path[:120])
        if why == "not_a_node":
            self._stats.refused_not_a_node += 1
        elif why == "bad_grant":
            self._stats.refused_bad_grant += 1
        else:
            self._stats.refused_not_a_member += 1
        log.debug("data plane read refused path=%s asker=%s reason=%s", path[:120], who.node_id, why)
        return _refused(why, path[:120])

    async def _dispatch(self, req: h11.Request, client: str, stream: trio.abc.Stream,
                        conn: h11.Connection, node: str | None = None) -> tuple[_Reply | None, bool]:
        """The answer (None: the client went away while waiting), and whether a serving
        slot was taken (the caller leaves it). ``node``: the asker's node id (TLS), for reads
        by membership."""
        self._stats.requests += 1
        method = req.method.decode("ascii", "replace").upper()
        target = urlsplit(req.target.decode("latin-1"))
        path = target.path
        query = target.query
        if not self._authorised(req):
            self._stats.unauthorized += 1
            return _json(401, "unauthorized", "needs the cluster token as a bearer token"), False
        for k, v in req.headers:
            if k == b"content-length" and v.strip() not in (b"0", b""):
                self._stats.bad_requests += 1
                return _json(413, "request bodies are not accepted"), False
        if path == "/v1/stats" and method in ("GET", "HEAD"):   # never starved: takes no slot
            return _Reply(200, msgspec.json.encode(self.statistics())), False
        who = self._asker(req, node)
        if (no := self._read_check(path, query, who, strict=False)) is not None:
            return no, False
        if query and method in ("GET", "HEAD") and path.startswith("/v1/chunks/"):
            # a wait happens here, before (and without) a serving slot
            ident = path[len("/v1/chunks/"):]
            if _HEX64.match(ident):
                waited = await self._maybe_wait(ident, query, client, stream, conn)
                if waited is _GONE:
                    return None, False
                if isinstance(waited, _Reply):
                    return waited, False
                query = ""
        if query and method in ("GET", "HEAD") and path.startswith("/v1/manifests/"):
            ident = path[len("/v1/manifests/"):]
            if _HEX64.match(ident):
                waited = await self._maybe_wait_manifest(ident, query, client, stream, conn)
                if waited is _GONE:
                    return None, False
                if isinstance(waited, _Reply):
                    return waited, False
                query = ""
        if path == "/v1/chunks" and method == "GET" and "&" in query:
            # a batch that can wait: no serving slot (its waits count in the wait budget)
            try:
                bq = parse_batch(query, self.config.max_batch_chunks, self.config.max_wait_ms)
            except BatchQueryError as e:
                self._stats.bad_requests += 1
                return _json(e.status, e.error, e.detail), False
            if bq.sizes is not None and bq.wait_ms > 0:
                if sum(bq.sizes) > self.config.max_batch_bytes:
                    self._stats.bad_requests += 1
                    return _json(413, "batch too large",
                                 f"the chunks named add up to over {self.config.max_batch_bytes} bytes"), False
                return _Reply(200, content_type=BATCH_TYPE, wait_batch=bq, client=client, reader=who), False
            query = "ids=" + ",".join(bq.ids)   # wait_ms=0: an ordinary batch
        if self._read_check(path, query, who, strict=True, count=False) is not None:
            if not self._waits.enter(client):
                self._stats.rejected_waits += 1
                return _json(503, "busy", "too many waiting requests", headers=[(b"retry-after", b"1")]), False
            try:
                checked = await self._member_wait(path, query, who, stream, conn, self.config.member_wait_ms)
            finally:
                self._waits.leave(client)
            if checked is _GONE:
                return None, False
            if isinstance(checked, _Reply):
                return checked, False
        if not self._active.enter(client):
            self._stats.rejected_busy += 1
            return _json(503, "busy", "too many concurrent requests", headers=[(b"retry-after", b"1")]), False
        self._stats.active = self._active.open
        try:
            return await self._route(method, path, query), True
        except Exception:  # a bug or a broken store: answer 500, keep serving
            log.exception("data plane request failed path=%s", path)
            return _json(500, "internal error"), True
        except BaseException:
            self._leave(client)
            raise

    async def _send_in_thread(self, sock: trio.socket.SocketType, send: Callable[..., str]) -> None:
        """A batch answer's frames sent by a worker thread: ``send(dup_fd, stop=event)`` on
        a duplicate of ``sock`` that the thread owns (closes) once it has started."""
        stop = Stop()
        hand = Handoff()
        dup = os.dup(sock.fileno())
        job = partial(hand.run, partial(send, dup, stop=stop))
        try:
            why = await trio.to_thread.run_sync(job, abandon_on_cancel=True, limiter=self._send_threads)
        except BaseException:
            stop.set()
            raise
        finally:
            if hand.keep():   # the thread never started: the duplicate is still ours
                os.close(dup)
        if why:
            raise trio.BrokenResourceError(f"batch send: {why}")

    def _wait_ms(self, query: str, cap: int) -> int | _Reply:
        """A query's ``?wait_ms=``, capped (0: none asked), or the 400 to answer."""
        qs = parse_qs(query, keep_blank_values=True)
        if "wait_ms" not in qs:
            return 0
        raw = qs["wait_ms"][-1]
        if not raw.isdigit() or len(raw) > 12:
            self._stats.bad_requests += 1
            return _json(400, "bad wait_ms", "a non-negative integer of milliseconds")
        return min(int(raw), cap)

    async def _watched(self, stream: trio.abc.Stream, conn: h11.Connection,
                       wait: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """``wait()`` while watching the client: (it left meanwhile, what ``wait`` returned)."""
        out: T | None = None
        with trio.CancelScope() as gone:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_client, stream, conn, gone)
                out = await wait()
                nursery.cancel_scope.cancel()
        return gone.cancelled_caught, out

    async def _maybe_wait(self, chunk_id: str, query: str, client: str, stream: trio.abc.Stream,
                          conn: h11.Connection) -> _Reply | object | None:
        """Carry out ``?wait_ms=`` for an absent chunk under the wait budget. A reply to
        send now (400, 503, 404 after the wait), ``_GONE`` when the client left while
        waiting, or None: the chunk is here, serve it."""
        wait_ms = self._wait_ms(query, self.config.max_wait_ms)
        if not isinstance(wait_ms, int):
            return wait_ms
        if wait_ms <= 0 or self.store.has_chunk(chunk_id):
            return None
        if not self._waits.enter(client):
            self._stats.rejected_waits += 1
            return _json(503, "busy", "too many waiting requests", headers=[(b"retry-after", b"1")])
        try:
            gone, present = await self._watched(stream, conn, partial(self._wait_for_chunk, chunk_id, wait_ms))
        finally:
            self._waits.leave(client)
        if gone:
            self._stats.waits_abandoned += 1
            return _GONE
        if not present:
            self._stats.not_found += 1
            return _json(404, "chunk not here", chunk_id)
        return None

    async def _maybe_wait_manifest(self, manifest_id: str, query: str, client: str, stream: trio.abc.Stream,
                                   conn: h11.Connection) -> _Reply | object | None:
        """``?wait_ms=`` for a manifest not stored here yet: wait (at most
        ``max_manifest_wait_ms``, under the ``max_manifest_waiting`` budget) until the
        store has it. A reply to send now (400, 503, 404 after the wait), ``_GONE`` when the
        client left while waiting, or None: serve it."""
        wait_ms = self._wait_ms(query, self.config.max_manifest_wait_ms)
        if not isinstance(wait_ms, int):
            return wait_ms
        if wait_ms <= 0 or self.store.has_manifest(manifest_id):
            return None
        if not self._mwaits.enter(client):
            self._stats.rejected_manifest_waits += 1
            ms = self.config.busy_retry_ms
            return _json(503, "busy", "too many waiting manifest requests",
                         headers=[(b"retry-after", b"1"), (b"x-herd-retry-ms", str(ms).encode())])
        self._stats.manifest_waits += 1
        try:
            gone, _ = await self._watched(stream, conn, partial(self._wait_for_manifest, manifest_id, wait_ms))
        finally:
            self._mwaits.leave(client)
        if gone:
            self._stats.waits_abandoned += 1
            return _GONE
        if not self.store.has_manifest(manifest_id):
            self._stats.not_found += 1
            return _json(404, "manifest not here", manifest_id)
        self._stats.manifest_waits_satisfied += 1
        return None

    async def _wait_for_manifest(self, manifest_id: str, wait_ms: int) -> None:
        """Until the manifest is stored here (woken by the store's hook; the disk is
        re-checked every ``poll_s``, another process may write it) or ``wait_ms`` passed."""
        w = self._manifest_events.get(manifest_id)
        if w is None or w[0].is_set():
            w = self._manifest_events[manifest_id] = [trio.Event(), 0]
        w[1] += 1
        try:
            with trio.move_on_after(wait_ms / 1000):
                while not self.store.has_manifest(manifest_id):
                    if w[0].is_set():               # stored and gone again: only the disk re-check
                        await trio.sleep(self.config.poll_s)
                        continue
                    with trio.move_on_after(self.config.poll_s):
                        await w[0].wait()
        finally:
            w[1] -= 1
            if w[1] == 0 and self._manifest_events.get(manifest_id) is w:
                del self._manifest_events[manifest_id]

    async def _watch_client(self, stream: trio.abc.Stream, conn: h11.Connection,
                            gone: trio.CancelScope) -> None:
        """While a request waits, notice its client leaving (EOF or reset) and cancel
        ``gone``. Bytes it sends meanwhile (a pipelined request) are kept for h11, up to
        one head's worth."""
        kept = 0
        while True:
            try:
                data = await stream.receive_some(4096)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            kept += len(data)
            if not data or kept > self.config.max_head_bytes:
                gone.cancel()
                return
            conn.receive_data(bytes(data))

    def _leave(self, client: str) -> None:
        self._active.leave(client)
        self._stats.active = self._active.open

    async def _route(self, method: str, path: str, query: str) -> _Reply:
        if path == "/v1/chunks":
            if method != "GET":
                return _json(405, "method not allowed", method, headers=[(b"allow", b"GET")])
            return self._batch(query)
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
        # ?wait_ms= was carried out by _maybe_wait, before this request took a slot
        if not self.store.has_chunk(chunk_id):
            self._stats.not_found += 1
            return _json(404, "chunk not here", chunk_id)
        # Opened (and sized) when sending; a chunk evicted in between becomes a 404 there.
        # Serving it to a peer is a use: keep it warm in the store's LRU.
        self.store.touch(chunk_id)
        path = Path(self.store.chunk_path(chunk_id))
        cap = self.config.max_serving_per_chunk
        now = self._serving.get(chunk_id, 0)
        if cap > 0 and now >= cap:
            self._stats.rejected_chunk_busy += 1
            ms = self.config.busy_retry_ms
            return _json(503, "busy", "this chunk is being sent to enough peers",
                         headers=[(b"retry-after", str(max(1, -(-ms // 1000))).encode()),
                                  (b"x-herd-retry-ms", str(ms).encode())])
        self._serving[chunk_id] = now + 1
        self._stats.serving_per_chunk_max = max(self._stats.serving_per_chunk_max, now + 1)
        return _Reply(200, content_type="application/octet-stream", file=path, serving=chunk_id)

    def _batch(self, query: str) -> _Reply:
        """A multi-chunk answer (:mod:`p2p.batch`): sizes from the store's index (one
        absent now is framed missing); each file is opened only while its frame is sent,
        so a batch holds one chunk file open, not one per id (a chunk evicted before its
        turn drops the connection: the asker keeps the frames before it)."""
        c = self.config
        try:
            ids = parse_ids(query, c.max_batch_chunks)
        except BatchQueryError as e:
            self._stats.bad_requests += 1
            return _json(e.status, e.error, e.detail)
        cap = c.max_serving_per_chunk
        frames: list[Outgoing] = []
        total = 0
        ok = busy = 0
        for cid in ids:
            size = self.store.chunk_size(cid)
            if size is None:
                frames.append(Outgoing(frame(MISSING, 0)))
                continue
            if cap > 0 and self._serving.get(cid, 0) >= cap:
                self._stats.rejected_chunk_busy += 1
                frames.append(Outgoing(frame(BUSY, 0)))
                busy += 1
                continue
            frames.append(Outgoing(frame(OK, size), str(self.store.chunk_path(cid)), size))
            total += size
            ok += 1
            if total > c.max_batch_bytes:
                self._stats.bad_requests += 1
                return _json(413, "batch too large", f"the chunks named add up to over {c.max_batch_bytes} bytes")
        missing = len(ids) - ok - busy
        self._stats.batch_chunks_busy += busy
        self._stats.batch_chunks_missing += missing
        if not ok:
            self._stats.not_found += missing
            if busy:
                ms = c.busy_retry_ms
                return _json(503, "busy", "every chunk named is being sent to enough peers",
                             headers=[(b"retry-after", str(max(1, -(-ms // 1000))).encode()),
                                      (b"x-herd-retry-ms", str(ms).encode())])
            return _json(404, "no chunk named is here", f"{len(ids)} ids")
        served = [cid for cid, f in zip(ids, frames, strict=True) if f.path]
        for cid in served:
            self.store.touch(cid)
            now = self._serving[cid] = self._serving.get(cid, 0) + 1
            self._stats.serving_per_chunk_max = max(self._stats.serving_per_chunk_max, now)
        headers = [(b"x-herd-chunks", str(len(ids)).encode()), (b"x-herd-sent", str(ok).encode())]
        if busy:
            headers.append((b"x-herd-retry-ms", str(c.busy_retry_ms).encode()))
        return _Reply(200, content_type=BATCH_TYPE, headers=headers, frames=frames, serving_many=served)

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

    async def _send_reply(self, stream: trio.abc.Stream, conn: h11.Connection,
                          req: h11.Request, reply: _Reply) -> bool:
        head = req.method.upper() == b"HEAD"
        fd = -1
        size = len(reply.body)
        serving = reply.serving
        if reply.frames is not None:
            return await self._send_batch(stream, conn, head, reply)
        if reply.wait_batch is not None:
            return await self._send_wait_batch(stream, conn, req, reply.wait_batch, reply.client, reply.reader)
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
            if isinstance(stream, trio.SocketStream):
                # MSG_MORE: the head waits for the body's first bytes (one segment, and one
                # wakeup on the peer for head and body rather than two)
                await self._send_head_more(stream, out)
            else:
                await self._send_all(stream, out)
            # h11 frames the body from len() only; the bytes go by sendfile.
            conn.send_with_data_passthrough(h11.Data(data=_Len(size)))  # type: ignore[arg-type]  # h11 wants bytes; _Len stands for a body sent by sendfile (passthrough reads only len())
            self._sending += size
            try:
                if isinstance(stream, trio.SocketStream):
                    await self._sendfile(stream, fd, size)
                else:   # TLS: the bytes must pass through the TLS layer
                    await self._send_plain(stream, fd, 0, size, fallback=False)
            finally:
                self._sending -= size
            tail = conn.send(h11.EndOfMessage()) or b""
            if tail:
                await self._send_all(stream, tail)
            self._stats.chunks_served += 1
            self._stats.bytes_served += size
            return True
        finally:
            if fd >= 0:
                os.close(fd)
            if serving:
                left = self._serving.get(serving, 1) - 1
                if left > 0:
                    self._serving[serving] = left
                else:
                    self._serving.pop(serving, None)

    async def _send_batch(self, stream: trio.abc.Stream, conn: h11.Connection, head: bool,
                          reply: _Reply) -> bool:
        """Send a batch's frames: by a worker thread (plain: sendfile; TLS: with the
        connection's session) that owns a duplicate of the socket's descriptor and each
        chunk file's while it sends it; through the stream here where the TLS session is
        not at hand. The per-chunk serving counts are held until the answer is sent."""
        frames = reply.frames or []
        handed = False
        try:
            size = sum(len(f.header) + f.size for f in frames)
            headers = [(b"content-type", reply.content_type.encode()),
                       (b"content-length", str(size).encode()), (b"server", _SERVER)] + reply.headers
            out = conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
            if head:   # (the route answers HEAD with 405; kept for safety)
                await self._send_all(stream, out + (conn.send(h11.EndOfMessage()) or b""))
                return True
            conn.send_with_data_passthrough(h11.Data(data=_Len(size)))  # type: ignore[arg-type]  # h11 wants bytes; _Len stands for a body sent by sendfile (passthrough reads only len())
            # plain: a worker thread's sendfile; TLS: the thread encrypts with the connection's
            # own session (this task holds it); else through the stream
            await self._send_frames(stream, frames, head=out)
            tail = conn.send(h11.EndOfMessage()) or b""
            if tail:
                await self._send_all(stream, tail)
            sent = [f for f in frames if f.path]
            self._stats.batches += 1
            self._stats.chunks_served += len(sent)
            self._stats.bytes_served += sum(f.size for f in sent)
            return True
        finally:
            if not handed:   # (a file the thread opened is its own to close)
                for f in frames:
                    f.done()
            for cid in reply.serving_many:
                left = self._serving.get(cid, 1) - 1
                if left > 0:
                    self._serving[cid] = left
                else:
                    self._serving.pop(cid, None)

    async def _send_wait_batch(self, stream: trio.abc.Stream, conn: h11.Connection, req: h11.Request,
                               bq: BatchQuery, client: str, reader: Asker = Asker(None)) -> bool:
        """A batch that can wait: the head once the first chunk is here, then each run of
        chunks here now sent by a worker thread (:meth:`_send_frames`), a wait for the next
        (woken by the store, watching the client) between runs. False (close the
        connection) when the answer was cut short or the client left."""
        assert bq.sizes is not None
        c = self.config
        if not self._waits.enter(client):
            self._stats.rejected_waits += 1
            ms = c.busy_retry_ms
            return await self._send_reply(stream, conn, req, _json(
                503, "busy", "too many waiting requests",
                headers=[(b"retry-after", b"1"), (b"x-herd-retry-ms", str(ms).encode())]))
        ids, sizes = bq.ids, bq.sizes
        deadline = trio.current_time() + bq.wait_ms / 1000
        total = sum(FRAME.size + n for n in sizes)
        i = 0
        head_sent = False
        refused: _Reply | None = None
        try:
            delayed = ""
            still_busy = False
            while i < len(ids):
                if not self.store.has_chunk(ids[i]):
                    left = int((deadline - trio.current_time()) * 1000)
                    present = False
                    if left > 0:
                        gone, got = await self._watched(stream, conn, partial(self._wait_for_chunk, ids[i], left))
                        if gone:
                            self._stats.waits_abandoned += 1
                            return False
                        present = bool(got)
                    if not present:
                        break
                if self._read_check(f"/v1/chunks/{ids[i]}", "", reader, strict=True, count=False) is not None:
                    left = int((deadline - trio.current_time()) * 1000)
                    verdict = await self._member_wait(f"/v1/chunks/{ids[i]}", "", reader, stream, conn,
                                                      min(left, c.member_wait_ms))
                    if verdict is _GONE:
                        self._stats.waits_abandoned += 1
                        return False
                    if isinstance(verdict, _Reply):
                        refused = verdict
                        break
                checked = i
                if self._over_cap(ids[i]):
                    # sent to max_serving_per_chunk peers now: wait for a copy to finish (the
                    # cap bounds copies at once; this asker already waits), up to the deadline
                    if delayed != ids[i]:
                        delayed = ids[i]
                        self._stats.rejected_chunk_busy += 1
                        self._poke()
                    if trio.current_time() >= deadline:
                        still_busy = True
                        break
                    await trio.sleep(c.busy_retry_ms / 1000)
                    continue
                frames: list[Outgoing] = []
                served: list[str] = []
                cut = False
                while i < len(ids):
                    cid = ids[i]
                    size = self.store.chunk_size(cid)
                    if size is None or self._over_cap(cid):
                        break
                    if i != checked and self.readers is not None and chunk_refusal(
                            self.readers, reader.node_id, cid, self._chunks_of, granted=reader.granted,
                            bad_grant=reader.bad_grant) is not None:
                        break     # (checked, refused and counted at the top of the next round)
                    if size != sizes[i]:
                        cut = True
                        break
                    self.store.touch(cid)
                    now = self._serving[cid] = self._serving.get(cid, 0) + 1
                    self._stats.serving_per_chunk_max = max(self._stats.serving_per_chunk_max, now)
                    served.append(cid)
                    frames.append(Outgoing(frame(OK, size), str(self.store.chunk_path(cid)), size))
                    i += 1
                try:
                    if frames and not head_sent:
                        headers = [(b"content-type", BATCH_TYPE.encode()), (b"content-length", str(total).encode()),
                                   (b"server", _SERVER), (b"x-herd-chunks", str(len(ids)).encode())]
                        out = conn.send(h11.Response(status_code=200, headers=headers)) or b""
                        conn.send_with_data_passthrough(h11.Data(data=_Len(total)))  # type: ignore[arg-type]  # h11 wants bytes; _Len stands for a body sent by sendfile (passthrough reads only len())
                        await self._send_frames(stream, frames, head=out)
                        head_sent = True
                    elif frames:
                        await self._send_frames(stream, frames)
                finally:
                    for f in frames:
                        f.done()
                    for cid in served:
                        left_ = self._serving.get(cid, 1) - 1
                        if left_ > 0:
                            self._serving[cid] = left_
                        else:
                            self._serving.pop(cid, None)
                self._stats.chunks_served += len(frames)
                self._stats.bytes_served += sum(f.size for f in frames)
                if cut:
                    break
            if not head_sent:   # the first chunk is not here after the whole wait, still busy, or differs
                if refused is not None:
                    return await self._send_reply(stream, conn, req, refused)
                if still_busy:
                    ms = c.busy_retry_ms
                    return await self._send_reply(stream, conn, req, _json(
                        503, "busy", "this chunk is being sent to enough peers",
                        headers=[(b"retry-after", str(max(1, -(-ms // 1000))).encode()),
                                 (b"x-herd-retry-ms", str(ms).encode())]))
                if not self.store.has_chunk(ids[0]):
                    self._stats.not_found += 1
                    return await self._send_reply(stream, conn, req, _json(404, "chunk not here", ids[0]))
                self._stats.bad_requests += 1
                return await self._send_reply(stream, conn, req, _json(409, "chunk not as named", ids[0]))
            self._stats.batches += 1
            self._stats.wait_batches += 1
            if i < len(ids):
                self._stats.wait_batches_cut += 1
                return False
            tail = conn.send(h11.EndOfMessage()) or b""
            if tail:
                await self._send_all(stream, tail)
            return True
        finally:
            self._waits.leave(client)

    def _over_cap(self, chunk_id: str) -> bool:
        cap = self.config.max_serving_per_chunk
        return cap > 0 and self._serving.get(chunk_id, 0) >= cap

    async def _send_frames(self, stream: trio.abc.Stream, frames: list[Outgoing], head: bytes = b"") -> None:
        """``head`` (bytes of the answer's head, may be empty) and ``frames``, for every batch
        answer (plain: a worker thread's sendfile; TLS: the thread encrypts with the
        connection's session; else through the stream). Their bodies count in
        :meth:`send_backlog` until the call returns."""
        owed = sum(f.size for f in frames)
        self._sending += owed
        try:
            await self._send_frames_now(stream, frames, head)
        finally:
            self._sending -= owed

    async def _send_frames_now(self, stream: trio.abc.Stream, frames: list[Outgoing], head: bytes) -> None:
        if isinstance(stream, trio.SocketStream):
            if head:
                await self._send_head_more(stream, head)
            await self._send_in_thread(stream.socket, partial(send_frames, frames=frames,
                                                              stall_s=self.config.send_stall_s))
        elif (session := _b.tls_session(stream)) is not None and isinstance(stream, trio.SSLStream):
            if head:
                await self._send_all(stream, head)
            raw = stream.transport_stream
            assert isinstance(raw, trio.SocketStream)
            await self._send_in_thread(raw.socket, partial(_b.send_frames_tls, session=session, frames=frames,
                                                           stall_s=self.config.send_stall_s))
        else:
            if head:
                await self._send_all(stream, head)
            for f in frames:
                if why := f.open():
                    raise trio.BrokenResourceError(f"batch send: {why}")
                try:
                    await self._send_all(stream, f.header)
                    if f.fd >= 0:
                        await self._send_plain(stream, f.fd, 0, f.size, fallback=False)
                finally:
                    f.done()

    async def _send_all(self, stream: trio.abc.Stream, data: bytes) -> None:
        with trio.fail_after(self.config.send_stall_s):
            await stream.send_all(data)

    async def _send_head_more(self, stream: trio.SocketStream, data: bytes) -> None:
        with trio.fail_after(self.config.send_stall_s):
            sent = 0
            while sent < len(data):
                try:
                    sent += await stream.socket.send(data[sent:], socket.MSG_MORE)
                except OSError as e:
                    raise trio.BrokenResourceError(str(e)) from e

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

    async def _send_plain(self, stream: trio.abc.Stream, fd: int, offset: int, size: int, *,
                          fallback: bool = True) -> None:
        if fallback:
            self._stats.sendfile_fallbacks += 1
        while offset < size:
            data = os.pread(fd, min(1 << 20, size - offset), offset)
            if not data:
                raise trio.BrokenResourceError("chunk file truncated while sending")
            await self._send_all(stream, data)
            offset += len(data)

