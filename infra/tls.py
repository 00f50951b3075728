"""TLS for every control-plane connection: contexts, the handshake, and who the peer is.

Why stdlib ``ssl`` (through ``trio.SSLStream``): it is OpenSSL, already in every Python;
the certificates themselves are made by :mod:`infra.pki` (``cryptography``).

Contexts
--------
* :func:`server_context` -- TLS 1.3 minimum, our certificate, the cluster CA to verify client
  certificates. ``client_cert="required"`` (mutual TLS: the agent's control API, the framed
  channel, relay listeners) or ``"optional"`` (the placer's HTTP API: operators and viewers may
  present a bearer token instead; a certificate, when sent, must still verify).
* :func:`client_context` -- TLS 1.3 minimum, the cluster CA as the only trust anchor, our
  certificate when we have one. Inside the cluster peers are addressed by whatever address a
  node reported, so the host name is not what is checked: the *principal* of the peer's
  certificate is (:func:`expect_peer`: the placer must be ``placer``, a push to node X must reach
  ``node:X``). ``check_hostname=True`` (the operator CLI over httpx) checks the name as well.

Principals
----------
A certificate's subject common name names its holder: ``placer``, ``node:<id>``, ``operator``,
``viewer`` or ``metrics`` (:func:`principal_of`); anything else, or a certificate the CA did not
sign (refused in the handshake already), is no principal. The roles of the route table
(:mod:`scheduler_link.authz`) come from the principal's kind.

Handshakes run under the caller's deadline (:func:`handshake`): a peer that stalls the handshake
holds its slot no longer than a peer that stalls its request head.

Checks inside the handshake
---------------------------
Every context made here is a :class:`HerdContext`, whose TLS objects check the peer's
certificate the moment the handshake completes, before the handshake's last flight is sent
(client side) or any byte of the request is read (server side):

* ``expect`` (client contexts): the peer's principal must be ``placer``, ``node:X`` or a kind
  (``node``: any node). A client therefore sends nothing -- no request, no bearer token, no
  job env -- to a certificate of the wrong principal, whatever library drives the socket
  (httpx sync or async, trio's SSLStream).
* ``revoked`` (every context of a daemon, :class:`Revoked`): a certificate whose node id or
  serial is on the deny-list is refused, on the listeners (control API, framed channel, data
  plane, relay members) and when dialling out.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trio

log = logging.getLogger("herd.link.tls")

KINDS = ("placer", "node", "operator", "viewer", "metrics")
# kind -> the roles of scheduler_link.authz it holds (operator implies viewer and metrics, ...)
ROLES_OF_KIND: dict[str, frozenset[str]] = {
    "placer": frozenset({"placer"}),
    "node": frozenset({"node"}),
    "operator": frozenset({"operator", "viewer", "metrics"}),
    "viewer": frozenset({"viewer", "metrics"}),
    "metrics": frozenset({"metrics"}),
}

ClientCert = Literal["required", "optional", "none"]


class Refusal(enum.StrEnum):
    """Why a TLS handshake failed, as a kind: what callers decide on (a plain-text client is
    answered in plain text; a peer that closed mid-handshake is busy, and asked again
    later) and the label of the refusal counters. Named once, where ``ssl``'s error enters."""
    PLAIN = "plain"              # the peer does not speak TLS
    PEER = "peer"                # the peer closed the connection during the handshake
    CERTIFICATE = "certificate"  # a certificate was refused, by either side
    TIMEOUT = "timeout"          # no ClientHello, or no finished handshake, in time
    QUEUE = "queue"              # no handshake slot in time (the listener is busy)
    OTHER = "other"


class TLSError(Exception):
    """TLS material that cannot be used, or a peer that is not who it must be; ``refusal``
    says why a handshake failed."""

    def __init__(self, message: str, refusal: Refusal = Refusal.OTHER) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass(frozen=True, slots=True)
class HandshakeFailed:
    """An accepted connection's failed handshake: the kind and the one line for the log."""
    refusal: Refusal
    why: str


class PeerRefused(ssl.SSLError):
    """Raised inside the handshake: the peer's verified certificate is not the principal this
    connection expects, or it is revoked. Its text is the one line that says which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why

    def __str__(self) -> str:
        return self.why


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is on the other end: ``kind`` one of :data:`KINDS`; ``node_id`` for ``node``;
    ``via`` says what proved it (``cert``, ``token``, or ``none`` on an insecure set-up);
    ``rack``: the ``zone/block/rack`` a node's certificate pins (its ``herd:rack:`` SAN URI,
    :mod:`infra.pki`), None when it pins none."""
    kind: str
    node_id: str | None = None
    via: str = "cert"
    rack: str | None = None

    @property
    def name(self) -> str:
        return f"node:{self.node_id}" if self.kind == "node" else self.kind

    @property
    def roles(self) -> frozenset[str]:
        return ROLES_OF_KIND.get(self.kind, frozenset())

    def __str__(self) -> str:
        return f"{self.name} ({self.via})"


def parse_principal(common_name: str) -> Principal | None:
    """``placer`` | ``node:<id>`` | ``operator`` | ``viewer`` | ``metrics`` -> a Principal."""
    kind, sep, rest = common_name.partition(":")
    if kind == "node":
        if not sep or not rest or "/" in rest:
            return None
        return Principal("node", rest)
    if sep or kind not in KINDS:
        return None
    return Principal(kind)


_RACK_URI = "herd:rack:"     # (infra.pki.RACK_URI: the SAN URI that pins a node's rack)
_RACK_LEVEL_MAX = 128


def parse_rack(path: str) -> str | None:
    """``path`` when it is a ``zone/block/rack`` a certificate or an operator may pin: three
    non-empty levels of printable ASCII without spaces or ``/``, each at most 128 characters
    (what a report's topology allows: scheduler_link.validate); else None."""
    levels = path.split("/")
    if len(levels) != 3:
        return None
    for v in levels:
        if not 0 < len(v) <= _RACK_LEVEL_MAX or not v.isascii() or not v.isprintable() or " " in v:
            return None
    return path


def principal_of(peercert: dict[str, Any] | None) -> Principal | None:
    """The principal of a *verified* peer certificate (``SSLObject.getpeercert()``'s dict);
    None when there is none or its subject names no principal. A node's carries the rack its
    certificate pins; a certificate naming more than one rack, or a malformed one, names no
    principal (the CA does not make those)."""
    if not peercert:
        return None
    cns = [v for rdn in peercert.get("subject", ()) for k, v in rdn if k == "commonName"]
    if len(cns) != 1:
        return None
    p = parse_principal(cns[0])
    if p is None or p.kind != "node":
        return p
    racks = [v[len(_RACK_URI):] for k, v in peercert.get("subjectAltName", ())
             if k == "URI" and v.startswith(_RACK_URI)]
    if not racks:
        return p
    if len(racks) > 1 or parse_rack(racks[0]) is None:
        return None
    return Principal("node", p.node_id, rack=racks[0])


def stream_principal(stream: Any) -> Principal | None:
    """The principal of a handshaken :class:`trio.SSLStream` (None for a plain stream)."""
    if not isinstance(stream, trio.SSLStream):
        return None
    try:
        return principal_of(stream.getpeercert())
    except (ValueError, ssl.SSLError):
        return None


def norm_serial(serial: str) -> str:
    """A certificate serial as the deny-list holds it: upper-case hex without leading zeros
    (``getpeercert()`` writes whole bytes, so it may lead with one)."""
    return serial.strip().upper().lstrip("0") or "0"


class Revoked:
    """The deny-list one daemon's handshakes consult: node ids and certificate serials
    (:func:`norm_serial`). One owner replaces the sets whole
    (:meth:`replace`); handshakes only read them."""

    __slots__ = ("nodes", "serials", "generation")

    def __init__(self, nodes: frozenset[str] = frozenset(), serials: frozenset[str] = frozenset()) -> None:
        self.nodes = nodes
        self.serials = serials
        self.generation = 0

    def replace(self, nodes: frozenset[str] | set[str] | list[str],
                serials: frozenset[str] | set[str] | list[str]) -> bool:
        """Take a new deny-list; True when it differs from the one held."""
        n, s = frozenset(nodes), frozenset(norm_serial(x) for x in serials)
        if n == self.nodes and s == self.serials:
            return False
        self.nodes, self.serials = n, s
        self.generation += 1
        return True

    def refuses(self, peercert: dict[str, Any] | None) -> str | None:
        """Why a verified peer certificate is refused, or None."""
        if not peercert or not (self.nodes or self.serials):
            return None
        serial = norm_serial(str(peercert.get("serialNumber", "")))
        if serial in self.serials:
            return f"the peer's certificate (serial {serial}) is revoked"
        p = principal_of(peercert)
        if p is not None and p.node_id is not None and p.node_id in self.nodes:
            return f"the peer's certificate is of node:{p.node_id}, which is revoked"
        return None


def principal_mismatch(p: Principal | None, want: str) -> str | None:
    """Why principal ``p`` is not ``want`` (``placer``, ``node:X``, or a kind: ``node`` for any
    node), or None when it is."""
    if p is None:
        return f"the peer's certificate names no herd principal (wanted {want})"
    if p.name != want and not (want == p.kind and ":" not in want):
        return f"the peer is {p.name}, not {want}"
    return None


def _check_handshake(obj: ssl.SSLObject | ssl.SSLSocket) -> None:
    ctx = obj.context
    if not isinstance(ctx, HerdContext):
        return
    deny = ctx.revoked if ctx.revoked is not None and (ctx.revoked.nodes or ctx.revoked.serials) else None
    want = None if obj.server_side else ctx.expect
    if deny is None and want is None:
        return      # (an empty deny-list costs a handshake nothing: the certificate is not decoded)
    cert = obj.getpeercert()
    if deny is not None and (why := deny.refuses(cert)) is not None:
        raise PeerRefused(why)
    if want is not None and (why := principal_mismatch(principal_of(cert), want)) is not None:
        raise PeerRefused(why)


class _CheckedObject(ssl.SSLObject):
    """trio's and anyio's TLS object: the peer checked when the handshake completes."""

    def do_handshake(self) -> None:
        super().do_handshake()
        _check_handshake(self)


class _CheckedSocket(ssl.SSLSocket):
    """A blocking TLS socket (httpx's sync transport): the same check."""

    def do_handshake(self, block: bool = False) -> None:
        super().do_handshake(block)
        _check_handshake(self)


class HerdContext(ssl.SSLContext):
    """An :class:`ssl.SSLContext` whose handshakes check the peer (see the module docstring):
    ``expect`` the principal a client must reach, ``revoked`` the deny-list."""

    sslobject_class = _CheckedObject
    sslsocket_class = _CheckedSocket
    expect: str | None = None
    revoked: Revoked | None = None


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """Where one daemon's TLS material is: the cluster CA, its certificate and key (PEM)."""
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, d: str | os.PathLike[str], name: str) -> TLSFiles:
        """The layout ``herd pki`` writes: ``DIR/ca.crt``, ``DIR/<name>.crt``, ``DIR/<name>.key``."""
        p = Path(d)
        return cls(p / "ca.crt", p / f"{name}.crt", p / f"{name}.key")

    def check(self) -> None:
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert), ("key", self.key)):
            if not p.is_file():
                raise TLSError(f"TLS {what} not found: {p} (make one with `herd pki init` / `herd pki issue`)")
            if p.stat().st_size <= 1:   # systemd's SetCredential= default for an absent file
                raise TLSError(f"TLS {what} {p} is empty (no such file where the unit's LoadCredential= "
                               "looks: /etc/herd/tls)")


# ---------------------------------------------------------------- the leaf only, no chain
# A context given its certificate without a chain (ours: the cluster CA signs every leaf) has
# OpenSSL build the chain it sends from the context's verify store (SSL_MODE_NO_AUTO_CHAIN
# unset): every handshake, on each side, it verifies its own certificate against the CA once
# more and sends the CA's certificate along, which the peer decodes (OpenSSL 3.0's decoder
# set-up, ~1.5 M instructions a certificate) only to find it is its own trust anchor (RFC 8446
# 4.4.2 lets the root be left out). That is ~30 % of a mutual handshake's instructions, both
# sides together (callgrind over bench/tls_handshake.py --memory-only). Python's ssl has no switch
# for the mode, so it is set with libssl's SSL_CTX_ctrl on the context's SSL_CTX: CPython keeps
# that pointer as the first field after the object header, and it is used only after
# SSL_CTX_get_options on it returns the options Python reports for the context, from the one
# libssl in this process whose version is the one the ssl module was built with.

_SSL_CTRL_MODE = 33
_SSL_MODE_NO_AUTO_CHAIN = 0x8
_libssl: Any = None
_libssl_checked = False


def _find_libssl() -> Any:
    global _libssl, _libssl_checked
    if _libssl_checked:
        return _libssl
    _libssl_checked = True
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libssl.so" in line}
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths.pop())
        lib.OpenSSL_version_num.restype = ctypes.c_ulong
        if lib.OpenSSL_version_num() != ssl.OPENSSL_VERSION_NUMBER:
            return None
        lib.SSL_CTX_get_options.restype = ctypes.c_uint64
        lib.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
        lib.SSL_CTX_ctrl.restype = ctypes.c_long
        lib.SSL_CTX_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    except (OSError, AttributeError, IndexError):
        return None
    _libssl = lib
    return lib


def send_leaf_only(ctx: ssl.SSLContext) -> bool:
    """Have ``ctx`` send its own certificate without the chain OpenSSL would build (see above);
    False where that cannot be done safely here (then OpenSSL's default stands)."""
    lib = _find_libssl()
    if lib is None or not isinstance(ctx, ssl.SSLContext):
        return False
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not ptr or lib.SSL_CTX_get_options(ptr) != int(ctx.options):
        return False
    mode = lib.SSL_CTX_ctrl(ptr, _SSL_CTRL_MODE, _SSL_MODE_NO_AUTO_CHAIN, None)
    return bool(mode & _SSL_MODE_NO_AUTO_CHAIN)


def sends_leaf_only(ctx: ssl.SSLContext) -> bool:
    """Whether :func:`send_leaf_only` took on ``ctx`` (its SSL_CTX's mode)."""
    lib = _find_libssl()
    if lib is None:
        return False
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if not ptr or lib.SSL_CTX_get_options(ptr) != int(ctx.options):
        return False
    return bool(lib.SSL_CTX_ctrl(ptr, _SSL_CTRL_MODE, 0, None) & _SSL_MODE_NO_AUTO_CHAIN)


def _base(purpose: ssl.Purpose, ca: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if ca is not None:
        ctx.load_verify_locations(cafile=str(ca))
    return ctx


def _load_chain(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    try:
        ctx.load_cert_chain(str(files.cert), str(files.key))
    except (ssl.SSLError, OSError) as e:
        raise TLSError(f"cannot load the certificate {files.cert} with key {files.key}: {e}") from None


def server_context(files: TLSFiles, *, client_cert: ClientCert = "required",
                   revoked: Revoked | None = None) -> HerdContext:
    """A server's context: our certificate; client certificates verified against ``files.ca``
    and refused when ``revoked`` lists them."""
    files.check()
    try:
        ctx = HerdContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.revoked = revoked
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cafile=str(files.ca))
    except (ssl.SSLError, OSError) as e:
        raise TLSError(f"cannot load the CA certificate {files.ca}: {e}") from None
    _load_chain(ctx, files)
    send_leaf_only(ctx)
    ctx.verify_mode = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL,
                       "none": ssl.CERT_NONE}[client_cert]
    # No TLS 1.3 session tickets: no client of ours resumes (trio's SSLStream is given no
    # session), and a placer restart, the storm that resumption would shorten, loses the
    # ticket keys anyway (Python's ssl cannot set them). Two tickets a handshake cost the
    # server ~0.3 ms of its ~1.5 ms (bench.tls_handshake).
    ctx.num_tickets = 0
    return ctx


def client_context(ca: str | os.PathLike[str], files: TLSFiles | None = None, *,
                   check_hostname: bool = False, expect: str | None = None,
                   revoked: Revoked | None = None) -> HerdContext:
    """A client's context: the cluster CA only; our certificate when ``files`` (mutual TLS);
    every peer must be ``expect`` (``placer``, ``node:X``, ``node``) when given, and not on
    ``revoked`` -- checked inside the handshake, before anything is sent."""
    try:
        ctx = HerdContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.expect = expect
        ctx.revoked = revoked
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as e:
        raise TLSError(f"cannot load the CA certificate {ca}: {e}") from None
    ctx.check_hostname = check_hostname
    ctx.verify_mode = ssl.CERT_REQUIRED
    if files is not None:
        files.check()
        _load_chain(ctx, files)
        send_leaf_only(ctx)
    return ctx


def reload(ctx: ssl.SSLContext, files: TLSFiles) -> None:
    """Load a renewed certificate into a live context: new handshakes present it."""
    _load_chain(ctx, files)


def classify_ssl_error(e: BaseException) -> tuple[Refusal, str]:
    """A failed handshake's kind and one line naming the likely cause. The one place that
    reads ``ssl``'s error (OpenSSL's reason codes and messages): the rest decides on the kind."""
    s = str(e)
    if "CERTIFICATE_VERIFY_FAILED" in s or "certificate verify failed" in s:
        if "expired" in s:
            return Refusal.CERTIFICATE, f"the peer's certificate has expired ({s})"
        return Refusal.CERTIFICATE, f"the peer's certificate is not signed by this cluster's CA ({s})"
    if "WRONG_VERSION_NUMBER" in s or "wrong version number" in s or "http request" in s.lower():
        return Refusal.PLAIN, f"the peer does not speak TLS (a plain-HTTP/TCP peer or an insecure set-up?) ({s})"
    if "certificate required" in s.lower() or "CERTIFICATE_REQUIRED" in s:
        return Refusal.CERTIFICATE, f"the peer requires a client certificate ({s})"
    if "UNEXPECTED_EOF" in s or "EOF occurred" in s or isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return Refusal.PEER, ("the peer closed the connection during the handshake: it is busy, gave up, or "
                              f"refused our certificate ({s or type(e).__name__})")
    if "unknown ca" in s.lower() or "UNKNOWN_CA" in s:
        return Refusal.CERTIFICATE, f"the peer refused our certificate: another CA's? ({s})"
    if "CERTIFICATE_EXPIRED" in s or "certificate expired" in s.lower():
        return Refusal.CERTIFICATE, f"the peer found our certificate expired ({s})"
    return Refusal.OTHER, s or type(e).__name__


def describe_ssl_error(e: BaseException) -> str:
    """One line for a failed handshake, naming the likely cause."""
    return classify_ssl_error(e)[1]


def ssl_cause(e: BaseException) -> ssl.SSLError | None:
    """The TLS failure under a transport's exception (httpx and trio wrap it: an async
    client's error may say nothing itself), or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ssl.SSLError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


async def handshake(stream: trio.SSLStream[Any]) -> None:
    """Run the handshake (under the caller's deadline); a failure is a :class:`TLSError`
    carrying its :class:`Refusal`."""
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as e:
        refusal, why = classify_ssl_error(e.__cause__ or e)
        raise TLSError(why, refusal) from None


async def server_handshake(stream: trio.SocketStream, ctx: ssl.SSLContext, deadline_s: float, *,
                           slots: trio.CapacityLimiter | None = None
                           ) -> trio.SSLStream[trio.SocketStream] | HandshakeFailed:
    """An accepted connection's handshake within ``deadline_s``: the TLS stream, or why it
    failed. Both listeners (the HTTP layer, the framed channel) use it.
    ``slots`` bounds the handshakes in progress (their crypto); a connection takes one only
    once its client has sent something, so idle connections (connected, silent) hold none."""
    s = trio.SSLStream(stream, ctx, server_side=True)
    with trio.move_on_after(deadline_s):
        try:
            if slots is None:
                await handshake(s)
            else:
                await trio.lowlevel.wait_readable(stream.socket)
                async with slots:
                    await handshake(s)
            return s
        except TLSError as e:
            return HandshakeFailed(e.refusal, str(e))
    return HandshakeFailed(Refusal.TIMEOUT, "handshake timed out")


async def refuse(stream: trio.SocketStream, failed: HandshakeFailed, plain_answer: bytes) -> None:
    """Close a connection whose handshake failed; a client that spoke plain text is first
    told so in its own protocol (``plain_answer``)."""
    if failed.refusal is Refusal.PLAIN:
        with trio.move_on_after(0.5):
            try:
                await stream.send_all(plain_answer)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
    await trio.aclose_forcefully(stream)


def expect_peer(stream: Any, want: str) -> Principal:
    """Check the peer of a handshaken stream is ``want`` (``placer``, ``node:X``, or a kind:
    ``node`` for any node); :class:`TLSError` otherwise."""
    p = stream_principal(stream)
    why = principal_mismatch(p, want)
    if why is not None or p is None:
        raise TLSError(why or "no principal")
    return p


async def connect(host: str, port: int, ctx: ssl.SSLContext | None, *, expect: str | None = None,
                  local_address: str | None = None) -> trio.abc.Stream:
    """A TCP connection, wrapped in TLS (handshaken, peer checked against ``expect``) when
    ``ctx``; the caller bounds the whole with its deadline."""
    tcp = await trio.open_tcp_stream(host, port, local_address=local_address)
    if ctx is None:
        return tcp
    s = trio.SSLStream(tcp, ctx, server_hostname=host if ctx.check_hostname else None)
    try:
        await handshake(s)
        if expect is not None:
            expect_peer(s, expect)
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(tcp)
        raise
    return s


async def accept(stream: trio.abc.Stream, ctx: ssl.SSLContext | None) -> trio.abc.Stream:
    """Server side: wrap an accepted stream and handshake (caller's deadline); a plain
    stream comes back as it is when ``ctx`` is None."""
    if ctx is None:
        return stream
    s = trio.SSLStream(stream, ctx, server_side=True)
    await handshake(s)
    return s


_TCP_CLOSE_WAIT = 8   # Linux's tcpi_state: the peer has closed its side


def peer_hung_up(stream: trio.SocketStream) -> bool:
    """Whether the client of an accepted, not yet handshaken connection has closed its side
    (Linux ``TCP_INFO``; False where that is not known)."""
    try:
        info = stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except (OSError, AttributeError):
        return False
    return bool(info) and info[0] == _TCP_CLOSE_WAIT


def peer_address(stream: Any) -> str | None:
    """The peer's IP of a socket stream, or of the socket stream under a TLS one."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if not isinstance(inner, trio.SocketStream):
        return None
    try:
        return str(inner.socket.getpeername()[0])
    except OSError:
        return None


# ---------------------------------------------------------------- one daemon's TLS set-up

DEFAULT_TLS_DIR = "/etc/herd/tls"


def insecure_from_env(explicit: bool | None) -> bool:
    """``insecure`` as configured; unset, ``HERD_INSECURE=1`` in the environment says it (the
    same explicit switch for daemons started by scripts and test harnesses)."""
    if explicit is not None:
        return explicit
    return os.environ.get("HERD_INSECURE", "") == "1"


@dataclass(slots=True)
class Security:
    """What one daemon uses: its server contexts (HTTP API: client certificate optional;
    framed listeners: required), its client context (mutual TLS to its peers), or none of
    them when ``insecure``. One owner (the daemon) swaps ``files`` on renewal, then
    :meth:`reload`."""
    insecure: bool
    files: TLSFiles | None = None
    api: ssl.SSLContext | None = None
    channel: ssl.SSLContext | None = None
    client: ssl.SSLContext | None = None
    accept_tokens: bool = False
    revoked: Revoked = field(default_factory=Revoked)   # shared by every context above

    @property
    def require_certs(self) -> bool:
        """The placer and node roles are proved by certificates only."""
        return not self.insecure and not self.accept_tokens

    def flags(self) -> dict[str, bool]:
        return {"require_certs": self.require_certs}

    def reload(self) -> None:
        """Load the (renewed) certificate files into every live context."""
        if self.files is not None:
            for ctx in (self.api, self.channel, self.client):
                if ctx is not None:
                    reload(ctx, self.files)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"insecure": self.insecure, "tls": not self.insecure,
                               "accept_tokens": self.accept_tokens}
        if self.files is not None:
            out["certificate"] = str(self.files.cert)
            try:
                from cryptography import x509
                c = x509.load_pem_x509_certificate(self.files.cert.read_bytes())
                out["not_after"] = c.not_valid_after_utc.isoformat()
            except (OSError, ValueError):
                out["not_after"] = None
        return out


def daemon_security(tls_dir: str | os.PathLike[str] | None, name: str, *, insecure: bool | None,
                    accept_tokens: bool = False, what: str = "daemon",
                    files: TLSFiles | None = None) -> Security:
    """The TLS set-up of a daemon whose certificate is ``<tls_dir>/<name>.crt`` (``files``
    overrides the layout); insecure (a warning logged) only when asked explicitly."""
    if insecure_from_env(insecure):
        # A warning however it was asked (a config's insecure = true, or HERD_INSECURE=1, which
        # an environment can carry into a daemon unnoticed), once per daemon; /v1/status shows it too.
        log.warning("%s is INSECURE: plain HTTP/TCP, bearer tokens only, no certificates (%s; run "
                    "`herd pki init` and set tls_dir for TLS)", what,
                    "insecure = true" if insecure else "HERD_INSECURE=1 in the environment")
        return Security(insecure=True, accept_tokens=accept_tokens)
    if files is None:
        d = Path(tls_dir or os.environ.get("HERD_TLS_DIR") or DEFAULT_TLS_DIR)
        files = TLSFiles.in_dir(d, name)
    try:
        files.check()
    except TLSError as e:
        raise TLSError(f"{e}; or set insecure = true for plain HTTP (a lab set-up only)") from None
    revoked = Revoked()
    sec = Security(insecure=False, files=files, accept_tokens=accept_tokens, revoked=revoked,
                   api=server_context(files, client_cert="optional", revoked=revoked),
                   # a migration's token-authenticated agents open framed channels without one
                   channel=server_context(files, client_cert="optional" if accept_tokens else "required",
                                          revoked=revoked),
                   client=client_context(files.ca, files, revoked=revoked))
    if accept_tokens:
        log.warning("%s accepts token-authenticated agents (accept_tokens = true: a migration set-up); "
                    "each is logged", what)
    return sec
