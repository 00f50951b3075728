"""infra.tls and .pki: contexts, handshakes over real loopback sockets, principals,
refusals (plain client, another CA, expired certificate), CSRs and bootstrap tokens."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import stat
from pathlib import Path

import pytest
import trio
import trio.testing

from infra import pki, tls
from infra.tls import Principal, TLSError, TLSFiles


@pytest.fixture
def ca(tmp_path: Path) -> pki.ThrowawayPKI:
    return pki.throwaway(tmp_path / "pki", nodes=["n1", "n2"])


def test_parse_principal() -> None:
    assert tls.parse_principal("placer") == Principal("placer")
    assert tls.parse_principal("node:gpu-7") == Principal("node", "gpu-7")
    assert tls.parse_principal("node:") is None
    assert tls.parse_principal("node:a/b") is None
    assert tls.parse_principal("root") is None
    assert tls.parse_principal("operator:x") is None
    assert Principal("operator").roles == {"operator", "viewer", "metrics"}
    assert Principal("node", "x").name == "node:x"


def test_init_writes_keys_0600_and_refuses_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "p"
    pki.init(d)
    for name in ("ca", "placer", "operator"):
        assert stat.S_IMODE(os.stat(d / f"{name}.key").st_mode) == 0o600
        assert (d / f"{name}.crt").exists()
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    with pytest.raises(pki.PKIError, match="already holds a CA"):
        pki.init(d)
    infos = {i.subject: i for i in pki.status(d)}
    assert infos["herd cluster CA"].days_left() > 3640
    assert 364 < infos["placer"].days_left() < 366
    out = pki.issue_node(d, "gpu-1", names=["10.0.0.7"])
    assert stat.S_IMODE(os.stat(out / "node.key").st_mode) == 0o600
    assert {i.subject for i in pki.status(d)} == {"herd cluster CA", "placer", "operator", "node:gpu-1"}


async def _serve_once(ctx: ssl.SSLContext, seen: list[Principal | None | str],
                      task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.fail_after(5):
                s = await tls.accept(stream, ctx)
                seen.append(tls.stream_principal(s))
                await s.send_all(b"hi")
                await s.aclose()
        except (TLSError, trio.BrokenResourceError) as e:
            seen.append(f"refused: {e}")
            await trio.aclose_forcefully(stream)

    task_status.started(port)
    await trio.serve_listeners(handle, listeners)


async def test_mutual_tls_names_the_peer(ca: pki.ThrowawayPKI) -> None:
    seen: list[Principal | None | str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            port = await n.start(_serve_once, tls.server_context(ca.files("placer")), seen)
            ctx = tls.client_context(ca.ca, ca.files("node:n1"))
            s = await tls.connect("127.0.0.1", port, ctx, expect="placer")
            assert await s.receive_some(10) == b"hi"
            await s.aclose()
            # the wrong expectation is refused after the handshake
            with pytest.raises(TLSError, match="the peer is placer, not node:n2"):
                await tls.connect("127.0.0.1", port, ctx, expect="node:n2")
            n.cancel_scope.cancel()
    assert seen[0] == Principal("node", "n1")


async def test_plain_client_and_client_without_cert_are_refused(ca: pki.ThrowawayPKI) -> None:
    seen: list[Principal | None | str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            port = await n.start(_serve_once, tls.server_context(ca.files("placer")), seen)
            plain = await trio.open_tcp_stream("127.0.0.1", port)
            await plain.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            with trio.fail_after(5):
                while await plain.receive_some(100):
                    pass
            await plain.aclose()
            no_cert = tls.client_context(ca.ca)
            with pytest.raises((TLSError, trio.BrokenResourceError)):
                s = await tls.connect("127.0.0.1", port, no_cert)
                await s.receive_some(10)  # TLS 1.3: the server's refusal arrives after the client's finish
            n.cancel_scope.cancel()
    assert all(isinstance(x, str) and x.startswith("refused") for x in seen), seen
    assert "does not speak TLS" in str(seen[0])


async def test_other_ca_and_expired_certs_are_refused(ca: pki.ThrowawayPKI, tmp_path: Path) -> None:
    other = pki.throwaway(tmp_path / "other", nodes=["n1"])
    old = pki.CA.load(ca.dir)
    k, c = old.issue("node:n1", days=1, not_before=pki._now() - dt.timedelta(days=3))
    exp = tmp_path / "expired"
    pki.write_pair(exp, "node", k, c)
    expired = TLSFiles(ca.ca, exp / "node.crt", exp / "node.key")
    seen: list[Principal | None | str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            port = await n.start(_serve_once, tls.server_context(ca.files("placer")), seen)
            # a client from another CA: the server refuses it
            with pytest.raises((TLSError, trio.BrokenResourceError)):
                s = await tls.connect("127.0.0.1", port, tls.client_context(ca.ca, other.files("node:n1")))
                await s.receive_some(10)
            # a client that trusts another CA refuses our server
            with pytest.raises(TLSError, match="not signed by this cluster's CA"):
                await tls.connect("127.0.0.1", port, tls.client_context(other.ca, other.files("node:n1")))
            with pytest.raises((TLSError, trio.BrokenResourceError)):
                s = await tls.connect("127.0.0.1", port, tls.client_context(ca.ca, expired))
                await s.receive_some(10)
            n.cancel_scope.cancel()
    refusals = [x for x in seen if isinstance(x, str)]
    assert any("not signed by this cluster's CA" in x for x in refusals), seen
    assert any("expired" in x for x in refusals), seen


def test_missing_material_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TLSError, match="TLS CA certificate not found"):
        tls.server_context(TLSFiles.in_dir(tmp_path, "placer"))


def test_csr_signing_checks_the_name(ca: pki.ThrowawayPKI) -> None:
    c = pki.CA.load(ca.dir)
    _, csr = pki.make_csr("n9")
    cert = pki.sign_csr(c, csr, "n9")
    cn = cert.subject.get_attributes_for_oid(pki.NameOID.COMMON_NAME)[0].value
    assert tls.parse_principal(str(cn)) == Principal("node", "n9")
    with pytest.raises(pki.PKIError, match="not node:n8"):
        pki.sign_csr(c, csr, "n8")
    with pytest.raises(pki.PKIError, match="not a PEM certificate request"):
        pki.sign_csr(c, b"junk", "n9")


def test_bootstrap_tokens_single_use_expiry_and_restart(tmp_path: Path) -> None:
    path = tmp_path / "bootstrap-tokens.json"
    store = pki.BootstrapTokens(path)
    t = store.create(ttl_s=60, now=1000.0)
    bound = store.create(ttl_s=60, node_id="n2", now=1000.0)
    with pytest.raises(pki.PKIError, match="unknown bootstrap token"):
        store.consume("hb1.nope", "n1", now=1001.0)
    with pytest.raises(pki.PKIError, match="expired"):
        store.consume(t, "n1", now=1061.0)
    with pytest.raises(pki.PKIError, match="for node n2"):
        store.consume(bound, "n1", now=1001.0)
    store.consume(t, "n1", now=1001.0)
    # a fresh store object (a restarted placer) still knows the token is used
    again = pki.BootstrapTokens(path)
    with pytest.raises(pki.PKIError, match="already used"):
        again.consume(t, "n1", now=1002.0)
    assert t not in path.read_text()  # hashes only on disk
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [e["used_by"] for e in again.list()].count("n1") == 1


def test_needs_renewal(ca: pki.ThrowawayPKI) -> None:
    cert = pki.load_cert(ca.files("node:n1").cert)
    assert not pki.needs_renewal(cert)
    assert pki.needs_renewal(cert, now=cert.not_valid_after_utc - dt.timedelta(days=1))


async def test_framed_channel_skips_the_handshake_of_a_client_that_hung_up_while_queued(
        ca: pki.ThrowawayPKI, autojump_clock) -> None:
    """One handshake slot: a silent client holds none; a client holding it with half a
    ClientHello times out; a client that sent its ClientHello and hung up while queued is
    dropped without the handshake's crypto (``gone``); a client queued behind them is then
    served. In virtual time (server and clients over loopback in this process, no worker
    thread): the 0.5 s hello deadline is exact, however slow the handshakes' crypto."""
    import socket

    from infra.auth import TokenSet
    from scheduler_link.heartbeat_wire import HeartbeatClient, HeartbeatServer
    from scheduler_link.messages import ReportReply

    srv = HeartbeatServer(TokenSet(cluster="c"),
                          lambda node_id, rep: (200, ReportReply()), hello_timeout_s=0.5, handshakes=1,
                          ssl_context=tls.server_context(ca.files("placer")), require_certs=True)
    node_ctx = tls.client_context(ca.ca, ca.files("node:n1"))
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            url = await n.start(srv.run, "127.0.0.1:0")
            port = int(url.rpartition(":")[2])
            silent = await trio.open_tcp_stream("127.0.0.1", port)    # says nothing: no slot
            hold = await trio.open_tcp_stream("127.0.0.1", port)      # takes the slot, half a hello
            await hold.send_all(b"\x16\x03\x01")
            await trio.testing.wait_all_tasks_blocked()              # both accepted, the half hello read
            # a real ClientHello, then gone: its bytes wait in the socket behind the hung-up side
            gone = socket.create_connection(("127.0.0.1", port))
            obj = tls.client_context(ca.ca, ca.files("node:n2")).wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
            with pytest.raises(ssl.SSLWantReadError):
                obj.do_handshake()
            gone.sendall(out.read())
            gone.close()
            await trio.testing.wait_all_tasks_blocked()              # accepted, queued for the slot
            t0 = trio.current_time()
            with trio.fail_after(5):
                c = await HeartbeatClient.connect(url, "", "n1", ssl_context=node_ctx)
            assert trio.current_time() - t0 == pytest.approx(0.5)   # served once the half hello's slot timed out
            await c.aclose()
            await hold.aclose()
            await silent.aclose()
            assert srv.tls_refusals.get("gone") == 1, srv.tls_refusals
            assert srv.tls_refusals.get("timeout") == 2, srv.tls_refusals   # the half hello, the silent one
            n.cancel_scope.cancel()


async def test_https_over_its_connection_cap_closes_instead_of_answering_in_plain_text(
        ca: pki.ThrowawayPKI) -> None:
    """Past the cap a plain listener answers a canned 503; a TLS listener only closes (a
    plain-text answer reached TLS clients as "the peer does not speak TLS"): the client
    learns the server closed during its handshake, which agents treat as busy."""
    from infra.http import App, ServerLimits, serve

    app = App()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            url = await n.start(lambda task_status: serve(
                app, "127.0.0.1:0", limits=ServerLimits(max_connections=2, max_per_client=2), task_status=task_status,
                ssl_context=tls.server_context(ca.files("placer"), client_cert="optional")))
            port = int(url.rpartition(":")[2])
            held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
            await trio.testing.wait_all_tasks_blocked()              # both accepted: the cap is reached
            with pytest.raises(TLSError, match="closed the connection during the handshake"):
                await tls.connect("127.0.0.1", port, tls.client_context(ca.ca, ca.files("node:n1")))
            for s in held:
                await s.aclose()
            n.cancel_scope.cancel()


@pytest.mark.parametrize("err,refusal", [
    (ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number"), "plain"),
    (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), "peer"),
    (ConnectionResetError(104, "reset"), "peer"),
    (ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca"), "certificate"),
    (ssl.SSLError(1, "[SSL: SOMETHING_ELSE] other"), "other"),
])
def test_a_handshake_failure_is_classified_once_and_decided_on_by_kind(err: BaseException, refusal: str) -> None:
    from scheduler_link.agent_link import _busy

    kind, why = tls.classify_ssl_error(err)
    assert kind == refusal and why == tls.describe_ssl_error(err)
    # the agent link's "busy" is the kind, whatever the line says
    assert _busy(tls.TLSError(why, kind)) is (kind is tls.Refusal.PEER)
    assert not _busy(tls.TLSError("the peer closed the connection during the handshake"))
