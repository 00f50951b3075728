"""The rack a node may register and relay in is pinned (issue 42, finding 1): in its certificate
(a ``herd:rack:`` SAN URI that renewal keeps) or by an operator's approval, never self-declared.
Here: the certificate side (issue, parse, the principal of a real handshake, bootstrap and
renewal through a placer) and the pure policy (placer.relaypolicy)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from hypothesis import given
from hypothesis import strategies as st

from infra import pki, tls
from infra.auth import TokenSet, auth_header
from infra.tls import Principal
from placer import relaypolicy
from placer.relaypolicy import Pin, RackPins
from placer.service import PlacerService

from .test_placer_service import cfg
from .test_tls import _serve_once

R0, R1 = "z1/b1/r0", "z1/b1/r1"


# ------------------------------------------------------------------ the certificate


def test_a_node_certificate_pins_its_rack(tmp_path: Path) -> None:
    ca = pki.throwaway(tmp_path / "pki")
    d = pki.issue_node(ca.dir, "n1", days=30, rack=R0)
    cert = pki.load_cert(d / "node.crt")
    assert pki.cert_rack(cert) == R0
    assert pki.cert_rack(pki.load_cert(ca.node_dir("n2") / "node.crt")) is None   # none asked, none pinned
    # issuing again is how an operator moves it
    assert pki.cert_rack(pki.load_cert(pki.issue_node(ca.dir, "n1", days=30, rack=R1) / "node.crt")) == R1
    for bad in ("z/b", "z/b/r/x", "z//r", "z/b/r 1", "z/b/" + "r" * 129, "z/b/ré"):
        with pytest.raises(pki.PKIError, match="not a rack path"):
            pki.issue_node(ca.dir, "n3", days=30, rack=bad)
    with pytest.raises(pki.PKIError, match="only a node's certificate"):
        ca_ = pki.CA.load(ca.dir)
        ca_.issue("operator", rack=R0)


def test_the_principal_reads_the_rack_and_refuses_a_certificate_with_two() -> None:
    base = {"subject": ((("commonName", "node:n1"),),)}
    assert tls.principal_of(base) == Principal("node", "n1")
    one = {**base, "subjectAltName": (("DNS", "localhost"), ("URI", "herd:node:n1"), ("URI", "herd:rack:" + R0))}
    assert tls.principal_of(one) == Principal("node", "n1", rack=R0)
    two = {**base, "subjectAltName": (("URI", "herd:rack:" + R0), ("URI", "herd:rack:" + R1))}
    assert tls.principal_of(two) is None
    assert tls.principal_of({**base, "subjectAltName": (("URI", "herd:rack:z/b"),)}) is None
    # only a node's certificate pins anything
    assert tls.principal_of({"subject": ((("commonName", "operator"),),),
                             "subjectAltName": (("URI", "herd:rack:" + R0),)}) == Principal("operator")


async def test_a_handshake_names_the_pinned_rack(tmp_path: Path) -> None:
    ca = pki.throwaway(tmp_path / "pki")
    pki.issue_node(ca.dir, "n1", days=30, rack=R0)
    seen: list[Principal | None | str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            port = await n.start(_serve_once, tls.server_context(ca.files("placer")), seen)
            s = await tls.connect("127.0.0.1", port, tls.client_context(ca.ca, ca.files("node:n1")), expect="placer")
            assert await s.receive_some(10) == b"hi"
            await s.aclose()
            n.cancel_scope.cancel()
    assert seen == [Principal("node", "n1", rack=R0)]


def _csr_asking_for(node: str, rack: str) -> str:
    """A CSR that asks for a rack of its own choosing (a SAN the signer must not copy)."""
    key = pki.new_key()
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, f"node:{node}")]))
           .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier("herd:rack:" + rack)]),
                          critical=False)
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM).decode()


async def test_bootstrap_takes_the_tokens_rack_and_renewal_keeps_the_certificates(tmp_path: Path, token_dir,
                                                                                    tls_pki) -> None:
    """A bootstrap token made with a rack buys a certificate pinning it; renewing over that
    certificate keeps it whatever the request asks for; a certificate without a rack renews
    without one (a node cannot pin itself either)."""
    tokens = TokenSet.load(token_dir)
    store = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json")
    token = store.create(ttl_s=600, node_id="nb", rack=R0, now=time.time())
    with pytest.raises(pki.PKIError, match="not a rack path"):
        store.create(ttl_s=600, node_id="nb", rack="r0", now=time.time())
    pki.issue_node(tls_pki.dir, "np", days=30, rack=R1)

    def body(node: str, rack: str) -> bytes:
        return msgspec.json.encode({"node_id": node, "csr": _csr_asking_for(node, rack)})

    def rack_of(r: httpx.Response) -> str | None:
        assert r.status_code == 200, r.text
        return pki.cert_rack(x509.load_pem_x509_certificate(r.json()["cert"].encode()))

    def client(principal: str | None, url: str, **kw) -> httpx.AsyncClient:
        ctx = tls.client_context(tls_pki.ca, tls_pki.files(principal) if principal else None)
        return httpx.AsyncClient(verify=ctx, timeout=10, base_url=url, **kw)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir)),
                                tokens)
            url = await n.start(svc.run)
            async with client(None, url) as anon:
                assert rack_of(await anon.post("/v1/pki/bootstrap", content=body("nb", R1),
                                               headers=auth_header(token))) == R0
            async with client("node:np", url) as np_:
                assert rack_of(await np_.post("/v1/pki/renew", content=body("np", R0))) == R1
            async with client("node:nq", url) as nq:          # issued without a rack
                assert rack_of(await nq.post("/v1/pki/renew", content=body("nq", R0))) is None
            n.cancel_scope.cancel()


# ------------------------------------------------------------------ the pure policy

racks = st.sampled_from([R0, R1, "z2/b1/r0"])
pins = st.one_of(st.none(), st.builds(Pin, racks, st.sampled_from(["certificate", "approval"])))


@given(rack=racks, pin=pins)
def test_registration_is_refused_exactly_outside_the_pin(rack: str, pin: Pin | None) -> None:
    why = relaypolicy.check_registration("n", rack, pin)
    if pin is None or pin.rack == rack:
        assert why is None
    else:
        assert why is not None and why.code == "rack_mismatch"


@given(rack=racks, registered=st.one_of(st.none(), racks), pin=pins, require=st.booleans())
def test_a_hello_is_admitted_only_for_the_pinned_and_registered_rack(rack: str, registered: str | None,
                                                                     pin: Pin | None, require: bool) -> None:
    why = relaypolicy.check_hello("n", [rack], registered, pin, require_pinned=require)
    if pin is None and require:
        assert why is not None and why.code == "rack_unpinned"
    elif (pin is not None and pin.rack != rack) or (registered is not None and registered != rack):
        assert why is not None and why.code == "rack_mismatch"
    else:
        assert why is None
    # a plain frames connection (no racks named) is no relay: never refused here
    assert relaypolicy.check_hello("n", [], registered, pin, require_pinned=require) is None


class _Rec:
    def __init__(self, node_id: str, rack: str) -> None:
        self.node_id = node_id
        self.rack_path = rack


def test_a_candidate_is_chosen_only_within_its_pin() -> None:
    pins = RackPins()
    assert relaypolicy.may_relay(R0, _Rec("n", R0), pins)               # no pin, not required
    pins.require = True
    assert not relaypolicy.may_relay(R0, _Rec("n", R0), pins)           # no pin, required
    pins.approve("n", R0)
    assert relaypolicy.may_relay(R0, _Rec("n", R0), pins)
    pins.approve("n", R1)                                                # moved after it registered
    assert not relaypolicy.may_relay(R0, _Rec("n", R0), pins)
    assert not relaypolicy.may_relay(R1, _Rec("n", R0), pins)            # and not registered in r1


def test_the_certificate_pins_before_the_approval_and_an_older_certificate_lifts_nothing() -> None:
    counters: dict[str, int] = {}
    p = RackPins(counters, approved={"n": R1})
    assert p.pin("n") == Pin(R1, "approval")
    p.saw(Principal("node", "n", rack=R0))
    assert p.pin("n") == Pin(R0, "certificate")
    p.saw(Principal("node", "n"))                    # a certificate that pins nothing
    p.saw(Principal("node", "n", via="token"))
    assert p.pin("n") == Pin(R0, "certificate")
    assert p.registration("n", R0) is None
    why = p.registration("n", R1)
    assert why is not None and why.code == "rack_mismatch"
    assert counters == {"rack_refused_rack_mismatch": 1}
    assert p.pin("other") is None and p.registration("other", R1) is None


async def test_herd_pki_issue_rack_and_status(tmp_path: Path) -> None:
    """`herd pki issue --rack` through the real entry point; `herd pki status` shows the pin."""
    from .test_cli_job import herd, one_line

    d = tmp_path / "pki"
    with trio.fail_after(60):
        rc, out, err = await herd(["pki", "init", str(d)])
        assert rc == 0, err
        rc, out, err = await herd(["pki", "issue", str(d), "--node", "n1", "--rack", R0])
        assert rc == 0 and f"pinned to rack {R0}" in out, (out, err)
        rc, out, err = await herd(["pki", "issue", str(d), "--role", "viewer", "--rack", R0])
        assert rc == 1 and "goes with --node" in one_line(err), err
        rc, out, err = await herd(["pki", "issue", str(d), "--node", "n2", "--rack", "r0"])
        assert rc == 1 and "not a rack path" in one_line(err), err
        rc, out, err = await herd(["pki", "status", str(d), "--json"])
        assert rc == 0, err
    racks = {c["subject"]: c["rack"] for c in json.loads(out)["certificates"]}
    assert racks["node:n1"] == R0 and racks["placer"] is None


async def test_the_agent_installs_a_renewal_only_if_it_keeps_the_pin(tmp_path: Path, token_dir, tls_pki) -> None:
    """agent.certs.renew against the real placer: the renewed certificate pins the same rack and
    is installed. Against a placer that drops the pin (an older version: a small stand-in that
    signs the CSR as it comes), the answer is refused and the current certificate stays."""
    from agent.certs import renew
    from agent.errors import AgentError
    from infra.http import App, Request, Response, json_response, serve
    from scheduler_link.pki_api import CertReply, CSRRequest

    tokens = TokenSet.load(token_dir)
    pki.issue_node(tls_pki.dir, "n5", days=30, rack=R0)
    ca = pki.CA.load(tls_pki.dir)

    async def older_renew(req: Request) -> Response:
        body = req.decode(CSRRequest)
        cert = pki.sign_csr(ca, body.csr.encode(), body.node_id, days=30)      # (no rack)
        return json_response(CertReply(cert=pki.cert_pem(cert).decode(), ca=pki.cert_pem(ca.cert).decode(),
                                       not_after=cert.not_valid_after_utc.isoformat()))
    older = App(name="older-placer")
    older.add("POST", "/v1/pki/renew", older_renew)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir)),
                                tokens)
            url = await n.start(svc.run)
            sec = tls.daemon_security(tls_pki.node_dir("n5"), "node", insecure=False)
            assert await renew(sec, url, "n5", tmp_path / "state")
            assert sec.files is not None and pki.cert_rack(pki.load_cert(sec.files.cert)) == R0
            installed = sec.files
            old_url = await n.start(lambda **kw: serve(older, "127.0.0.1:0", **kw, ssl_context=tls.server_context(
                tls_pki.files("placer"), client_cert="optional")))
            with pytest.raises(AgentError, match="kept the current one"):
                await renew(sec, old_url, "n5", tmp_path / "state")
            assert sec.files == installed and pki.cert_rack(pki.load_cert(installed.cert)) == R0
            n.cancel_scope.cancel()
