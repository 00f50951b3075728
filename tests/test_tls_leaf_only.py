"""Our TLS contexts send their own certificate only, not the chain OpenSSL would build.

OpenSSL's default (SSL_MODE_NO_AUTO_CHAIN unset) builds the chain from the context's verify
store on every handshake and sends the cluster CA's certificate along; the peer decodes it and
finds its own trust anchor (infra.tls, "the leaf only"). Counted here with the
``openssl s_client`` CLI against a real loopback listener: one certificate from our server
context, two from a context made without :func:`tls.send_leaf_only` (the check can tell).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from infra import pki, tls

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _serve_once(ctx: ssl.SSLContext) -> tuple[int, threading.Thread]:
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]

    def run() -> None:
        with ls:
            ls.settimeout(20)
            conn, _ = ls.accept()
            conn.settimeout(20)
            try:
                with ctx.wrap_socket(conn, server_side=True) as s:
                    s.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return port, t


def _certs_sent(ctx: ssl.SSLContext, ca: Path, client: tls.TLSFiles) -> int:
    port, t = _serve_once(ctx)
    out = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-showcerts", "-CAfile", str(ca),
         "-cert", str(client.cert), "-key", str(client.key), "-tls1_3"],
        input=b"", capture_output=True, timeout=30)
    t.join(20)
    text = out.stdout.decode(errors="replace")
    assert "Verify return code: 0 (ok)" in text, text[-2000:]
    chain = text.split("Certificate chain", 1)[1].split("\n---\n", 1)[0]
    return chain.count("-----BEGIN CERTIFICATE-----")


def test_server_sends_its_leaf_only(tmp_path: Path) -> None:
    ca = pki.throwaway(tmp_path)
    node = ca.files("node:n1")
    ours = tls.server_context(ca.files("placer"))
    assert tls.sends_leaf_only(ours)
    assert _certs_sent(ours, ca.ca, node) == 1

    # the same material in a context left at OpenSSL's default: the CA goes along too
    files = ca.files("placer")
    default = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    default.load_verify_locations(cafile=str(files.ca))
    default.load_cert_chain(str(files.cert), str(files.key))
    default.verify_mode = ssl.CERT_REQUIRED
    assert not tls.sends_leaf_only(default)
    assert _certs_sent(default, ca.ca, node) == 2


def test_client_contexts_send_leaf_only_and_still_verify(tmp_path: Path) -> None:
    """Every client context we make (an agent's, an emulated node's) sends its leaf only, and
    a mutual handshake between them verifies both ways (in memory, no sockets needed)."""
    ca = pki.throwaway(tmp_path)
    server = tls.server_context(ca.files("placer"))
    for client in (tls.client_context(ca.ca, ca.files("node:n1")), pki.NodeContexts(tmp_path).context("n2")):
        assert tls.sends_leaf_only(client)
        ci, co, si, so = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
        c = client.wrap_bio(ci, co, server_side=False)
        s = server.wrap_bio(si, so, server_side=True)
        done_c = done_s = False
        for _ in range(10):
            for side, out, peer_in in ((c, co, si), (s, so, ci)):
                try:
                    side.do_handshake()
                    if side is c:
                        done_c = True
                    else:
                        done_s = True
                except ssl.SSLWantReadError:
                    pass
                data = out.read()
                if data:
                    peer_in.write(data)
            if done_c and done_s:
                break
        assert done_c and done_s
        peer = tls.principal_of(s.getpeercert())
        assert peer is not None and peer.kind == "node"
        assert tls.principal_of(c.getpeercert()) == tls.Principal("placer")


def test_a_plain_context_is_left_alone_where_unsafe() -> None:
    """A context with no certificate loaded still takes the mode; an object that is not an
    SSLContext is refused, never written through."""
    assert tls.send_leaf_only(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
    assert not tls.send_leaf_only(object())  # type: ignore[arg-type]
