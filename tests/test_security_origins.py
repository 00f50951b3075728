"""Issue 42, finding 8, as attacks: an allowed origin that redirects an agent to a metadata
server, an allowed name whose DNS points at link-local or loopback, and an origin whose
error answer carries a secret into a pod's reason. Origins are real servers on loopback
(named by their loopback address, the explicit way to allow one); DNS is a fake resolver
(trio's resolver hook), since the test machine has no hostile DNS of its own."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import time

import blake3
import pytest
import trio

from p2p.errors import OriginError
from p2p.origins import open_origin
from p2p.origins.addresses import address_refusal


class Server:
    """A raw HTTP/1.1 server on loopback: answers every request with ``answer`` (status line,
    headers and body bytes) and records each request's first line."""

    def __init__(self, answer: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.url = ""
        self.host, self.port = host, port

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        task_status.started(self.url)
        await trio.serve_listeners(self._one, listeners)

    async def _one(self, stream: trio.SocketStream) -> None:
        buf = b""
        with trio.move_on_after(5):
            while b"\r\n\r\n" not in buf:
                data = await stream.receive_some(4096)
                if not data:
                    break
                buf += data
        if buf:
            self.requests.append(buf.split(b"\r\n", 1)[0])
            try:
                await stream.send_all(self.answer)
            except trio.BrokenResourceError:
                pass
        await stream.aclose()


def _answer(status: str, body: bytes, **headers: str) -> bytes:
    head = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return f"HTTP/1.1 {status}\r\n{head}content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


async def test_an_allowed_origins_redirect_is_not_followed():
    """The allowed origin answers 302 to the 'metadata server' (another loopback address here):
    no request reaches it, and the fetch fails with the status, not what is behind it."""
    metadata = Server(_answer("200 OK", b"AKIA-CREDENTIALS-OF-THE-NODE"))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            meta_url = await n.start(metadata.run)
            origin = Server(_answer("302 Found", b"", location=f"{meta_url}/latest/meta-data/iam"))
            url = await n.start(origin.run)
            cid = blake3.blake3(b"x").hexdigest()
            async with open_origin(url, retries=0) as o:
                with pytest.raises(OriginError) as e:
                    await o.get_chunk(cid, 28)
                with pytest.raises(OriginError):
                    await o.resolve("trainer:v1")
            assert "HTTP 302 (redirect, not followed)" in str(e.value)
            assert "AKIA" not in str(e.value)
            assert len(origin.requests) == 2 and metadata.requests == []
            n.cancel_scope.cancel()


async def test_an_origins_error_body_is_not_echoed():
    secret = b"internal-token=s3cr3t <html>stack trace</html>"
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(Server(_answer("403 Forbidden", secret, content_type="text/html")).run)
            async with open_origin(url, retries=0) as o:
                with pytest.raises(OriginError) as e:
                    await o.get_manifest("ab" * 32)
            assert "HTTP 403 (access denied)" in str(e.value)
            assert "s3cr3t" not in str(e.value) and "stack trace" not in str(e.value)
            n.cancel_scope.cancel()


class FakeDNS(trio.abc.HostnameResolver):
    """Names to addresses, as a hostile or careless DNS would answer: an address, several in
    one answer (a tuple), or one answer per lookup (a list: the last one repeats -- a name
    rebound after its first lookup)."""

    def __init__(self, names: dict[str, str | tuple[str, ...] | list[str]]) -> None:
        self.names = names
        self.asked: list[str] = []

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        name = host.decode() if isinstance(host, bytes) else host
        self.asked.append(name)
        got = self.names.get(name)
        if got is None:
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        if isinstance(got, list):
            got = got[min(self.asked.count(name), len(got)) - 1]
        out = []
        for addr in (got,) if isinstance(got, str) else got:
            fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sa = (addr, port or 80, 0, 0) if fam == socket.AF_INET6 else (addr, port or 80)
            out.append((fam, socket.SOCK_STREAM, 6, "", sa))
        return out

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


async def test_link_local_and_unnamed_loopback_addresses_are_refused_before_connecting():
    dns = FakeDNS({"mirror.example": "169.254.169.254", "selfie.example": "127.0.0.1",
                   "v6.example": "fe80::1", "mapped.example": "::ffff:169.254.169.254",
                   "imds6.example": "fd00:ec2::254", "ali.example": "100.100.100.200",
                   "mixed.example": ("10.1.2.3", "169.254.169.254")})
    trio.socket.set_custom_hostname_resolver(dns)
    with trio.fail_after(20):
        for url, why in (("http://mirror.example/bucket", "link-local"), ("http://selfie.example:8470", "own address"),
                         ("https://v6.example/x", "link-local"), ("http://mapped.example/x", "link-local"),
                         ("http://169.254.169.254/latest", "link-local"), ("http://[fe80::1]:80/x", "link-local"),
                         ("http://0.0.0.0:8470/x", "own address"),
                         ("https://imds6.example/x", "metadata"), ("http://ali.example/x", "metadata"),
                         ("http://mixed.example/x", "link-local")):
            t0 = time.monotonic()
            async with open_origin(url, retries=0) as o:
                with pytest.raises(OriginError, match=why):
                    await o.resolve("trainer:v1")
            assert time.monotonic() - t0 < 1.0, url      # refused, not tried
    assert {"mirror.example", "selfie.example"} <= set(dns.asked)
    # loopback named explicitly (the allow-list had to say it) stays readable
    assert address_refusal(ipaddress.ip_address("127.0.0.1"), loopback_ok=True) is None
    assert address_refusal(ipaddress.ip_address("169.254.1.1"), loopback_ok=True) is not None
    assert address_refusal(ipaddress.ip_address("10.1.2.3"), loopback_ok=False) is None


async def test_a_name_rebound_after_its_check_is_never_connected_to():
    """DNS answers the origin's address to the check, then (rebound) another address where
    something else listens (here 127.0.0.2, standing in for a metadata server or the agent's
    own APIs): every request -- the lean client's GET and httpx's HEAD -- goes to the address
    the check saw, with the URL's Host, and the name is looked up once."""
    origin = Server(_answer("200 OK", b"ab" * 32))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(origin.run)
            metadata = Server(_answer("200 OK", b"cd" * 32), host="127.0.0.2", port=origin.port)
            await n.start(metadata.run)
            dns = FakeDNS({"localhost": ["127.0.0.1", "127.0.0.2"]})
            trio.socket.set_custom_hostname_resolver(dns)
            async with open_origin(f"http://localhost:{origin.port}", retries=0) as o:
                assert await o.resolve("trainer:v1") == "ab" * 32            # GET: the lean client
                assert await o.missing(["ef" * 32]) == set()                   # HEAD: httpx (200: present)
                assert await o.resolve("trainer:v2") == "ab" * 32              # a second connection
            assert metadata.requests == [] and len(origin.requests) == 3
            assert dns.asked.count("localhost") == 1
            # an answer of several checked addresses: the next one when the first takes no connection
            trio.socket.set_custom_hostname_resolver(FakeDNS({"localhost": ("127.0.0.3", "127.0.0.1")}))
            async with open_origin(f"http://localhost:{origin.port}", retries=0) as o:
                assert await o.resolve("trainer:v1") == "ab" * 32
                assert await o.missing(["ef" * 32]) == set()
            assert len(origin.requests) == 5
            n.cancel_scope.cancel()


class TLSServer(Server):
    """:class:`Server` over TLS with ``ctx``; the SNI names clients sent are kept."""

    def __init__(self, answer: bytes, ctx: ssl.SSLContext, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(answer, host, port)
        self.sni: list[str | None] = []
        ctx.sni_callback = lambda sock, name, c: self.sni.append(name)  # type: ignore[assignment,misc,return-value]
        self.ctx = ctx

    async def _one(self, stream: trio.SocketStream) -> None:  # type: ignore[override]
        tls = trio.SSLStream(stream, self.ctx, server_side=True)
        try:
            with trio.move_on_after(5):
                await tls.do_handshake()
        except trio.BrokenResourceError:
            return
        await Server._one(self, tls)  # type: ignore[arg-type]


async def test_an_https_origin_keeps_its_name_for_sni_and_the_certificate(tls_pki, monkeypatch):
    """https: the connection goes to the checked address, and TLS speaks the URL's name (SNI
    ``localhost``; the certificate is checked against it), the rebound address never reached."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_pki.ca))

    def ctx() -> ssl.SSLContext:
        c = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        files = tls_pki.files("placer")          # (its certificate names localhost)
        c.load_cert_chain(files.cert, files.key)
        return c

    origin = TLSServer(_answer("200 OK", b"ab" * 32), ctx())
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            await n.start(origin.run)
            metadata = TLSServer(_answer("200 OK", b"cd" * 32), ctx(), host="127.0.0.2", port=origin.port)
            await n.start(metadata.run)
            dns = FakeDNS({"localhost": ["127.0.0.1", "127.0.0.2"]})
            trio.socket.set_custom_hostname_resolver(dns)
            async with open_origin(f"https://localhost:{origin.port}", retries=0) as o:
                assert await o.resolve("trainer:v1") == "ab" * 32
                assert await o.missing(["ef" * 32]) == set()
            assert metadata.requests == [] and len(origin.requests) == 2
            assert set(origin.sni) == {"localhost"} and dns.asked.count("localhost") == 1
            n.cancel_scope.cancel()

