"""Keyed enrolment (scheduler_link.enroll, version 2): a node whose certificate came with its
enrolment key K_N (infra.pki.enrol_key) enrols through its relay with no public-key work at
either end, and what a relay or the node itself could change is refused as before: another
node's key, a certificate stretched or moved to another rack, a revoked serial, a downgrade."""

from __future__ import annotations

import datetime as dt
import time

import msgspec
import pytest
import trio
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import certs
from infra import pki
from infra.auth import TokenSet
from infra.pki import CA, enrol_key_of, make_ca
from placer.service import PlacerService
from scheduler_link.enroll import EnrollClient, EnrollDesk, EnrollRefused, client_from_files, desk_from_files
from scheduler_link.messages import ENROLL_KEYED_VERSION, ENROLL_VERSION, EnrollAnswer, ReportReply
from tests.test_enroll_crypto import NOW, _der, report
from tests.test_placer_service import cfg

MASTER = b"m" * 32


class Cluster:
    def __init__(self, master: bytes | None = MASTER) -> None:
        self.ca = CA(*make_ca())
        pk, pc = self.ca.issue("placer")
        self.placer_key, self.placer_cert = pk, _der(pc)
        self.desk = EnrollDesk(self.ca.cert, pk, self.placer_cert, master=master)
        self.certs: dict[str, x509.Certificate] = {}

    def client(self, node: str, *, rack: str | None = None, keyed: bool = True,
               not_before: dt.datetime | None = None, days: int = 30) -> EnrollClient:
        key, cert = self.ca.issue(f"node:{node}", rack=rack, not_before=not_before, days=days)
        self.certs[node] = cert
        return EnrollClient(self.ca.cert, key, _der(cert), enrol_key=enrol_key_of(MASTER, cert) if keyed else None)


def _refused(desk: EnrollDesk, e, outcome: str, **kw) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(EnrollRefused) as ei:
        desk.check(e, now=kw.pop("now", NOW), **kw)
    assert ei.value.outcome == outcome, ei.value


def test_a_keyed_enrolment_costs_no_certificate_check_and_gives_the_member_its_keys() -> None:
    cl = Cluster()
    c = cl.client("n1", rack="z/b/r1")
    e, p = c.make(report("n1"), cl.placer_cert, now=NOW)
    assert e.version == ENROLL_KEYED_VERSION and e.cert == b"" and e.rack == "z/b/r1"
    assert cl.desk.unchecked([e]) == []                     # nothing for the worker processes
    got = cl.desk.check(e, now=NOW)
    assert got.report.node_id == "n1" and got.rack == "z/b/r1"
    assert (cl.desk.cert_checks, cl.desk.keyed, cl.desk.taken) == (0, 1, 1)
    _refused(cl.desk, e, "replay")                               # the same enrolment again
    a = EnrollDesk.answer(got, ReportReply(), b"K" * 32, b"P" * 32)
    s = EnrollClient.open(p, msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=EnrollAnswer))
    assert (s.mac_key, s.placer_key) == (b"K" * 32, b"P" * 32)
    # the same certificate again (a new boot): its key comes from the desk's cache
    e2, _ = c.make(report("n1", boot="b2"), cl.placer_cert, now=NOW)
    cl.desk.check(e2, now=NOW)
    assert cl.desk.keyed == 2 and cl.desk.statistics()["certs_cached"] == 0   # (nothing kept per node)


def test_a_relay_cannot_enrol_another_node_with_its_own_enrolment_key() -> None:
    cl = Cluster()
    relay = cl.client("relay")
    victim = cl.client("victim")
    # the relay's own key and fields, naming the victim: the key derived for the victim differs
    e, _ = relay.make(report("victim"), cl.placer_cert, now=NOW)
    _refused(cl.desk, e, "bad_mac")
    # the victim's fields (its certificate is public) with the relay's enrolment key: the MAC fails
    forged = EnrollClient(cl.ca.cert, relay._key, victim.cert, enrol_key=relay._enrol_key)
    e, _ = forged.make(report("victim"), cl.placer_cert, now=NOW)
    _refused(cl.desk, e, "bad_mac")
    # the victim's real keyed enrolment with its report changed on the way: the MAC fails
    e, _ = victim.make(report("victim"), cl.placer_cert, now=NOW)
    _refused(cl.desk, msgspec.structs.replace(e, report=msgspec.Raw(msgspec.msgpack.encode(report("victim", seq=9)))),
             "bad_mac")
    cl.desk.check(e, now=NOW)   # (and as sent it is taken)


def test_a_node_cannot_stretch_its_certificate_or_move_it_to_another_rack() -> None:
    """A keyed enrolment carries its certificate's fields, and nothing vouches for them but the
    MAC under the key derived from them: the node itself, MACing changed fields with its real
    enrolment key (a relay could not even do that), is refused."""
    cl = Cluster()
    c = cl.client("n2", rack="z/b/r1")
    f = c._fields
    assert f is not None
    for changed in (f._replace(not_after=f.not_after + 3650 * 86400), f._replace(not_before=f.not_before - 86400),
                    f._replace(rack="z/b/r9"), f._replace(rack=None), f._replace(serial="ABC123")):
        c._fields = changed
        e, _ = c.make(report("n2"), cl.placer_cert, now=NOW)
        _refused(cl.desk, e, "bad_mac")
    c._fields = f
    e, _ = c.make(report("n2"), cl.placer_cert, now=NOW)
    _refused(cl.desk, msgspec.structs.replace(e, cert=_der(cl.certs["n2"])), "malformed")   # fields, not a certificate
    _refused(cl.desk, msgspec.structs.replace(e, serial="A" * 65), "oversized")
    _refused(cl.desk, msgspec.structs.replace(e, serial=e.serial.lower()), "malformed")    # one spelling only
    _refused(cl.desk, msgspec.structs.replace(e, serial="0" + e.serial), "malformed")
    _refused(cl.desk, msgspec.structs.replace(cl.client("n2b").make(report("n2b"), cl.placer_cert, now=NOW)[0], rack=""),
             "malformed")                                                       # (no rack is None, not "")
    assert cl.desk.check(e, now=NOW).rack == "z/b/r1"


def test_revoked_expired_and_downgraded_keyed_enrolments_are_refused() -> None:
    cl = Cluster()
    c = cl.client("n3")
    serial = pki.serial_hex(cl.certs["n3"]).lstrip("0")
    e, _ = c.make(report("n3"), cl.placer_cert, now=NOW)
    _refused(cl.desk, e, "revoked", denied=(frozenset(), frozenset({serial})))
    _refused(cl.desk, e, "revoked", denied=(frozenset({"n3"}), frozenset()))
    old = cl.client("n3old", not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=40), days=30)
    _refused(cl.desk, old.make(report("n3old"), cl.placer_cert, now=NOW)[0], "expired")
    # the version changed on the way, either way: refused (no certificate / a certificate where
    # fields belong); with the certificate put back, the MAC fails (another key)
    _refused(cl.desk, msgspec.structs.replace(e, version=ENROLL_VERSION), "bad_certificate")
    _refused(cl.desk, msgspec.structs.replace(e, version=ENROLL_VERSION, cert=_der(cl.certs["n3"])), "bad_mac")
    ecdh = cl.client("n4", keyed=False)
    e4, _ = ecdh.make(report("n4"), cl.placer_cert, now=NOW)
    assert e4.version == ENROLL_VERSION
    _refused(cl.desk, msgspec.structs.replace(e4, version=ENROLL_KEYED_VERSION), "malformed")
    f4 = EnrollClient(cl.ca.cert, ecdh._key, ecdh.cert, enrol_key=b"\0" * 32)._fields
    assert f4 is not None
    _refused(cl.desk, msgspec.structs.replace(e4, version=ENROLL_KEYED_VERSION, cert=b"", serial=f4.serial,
                                               not_before=f4.not_before, not_after=f4.not_after), "bad_mac")
    cl.desk.check(e4, now=NOW)                                   # an ECDH enrolment is taken as before
    assert (cl.desk.cert_checks, cl.desk.keyed) == (2, 0)   # (n3's certificate put back, and n4's: by ECDH)
    # a placer that holds no enrolment master refuses keyed ones with their own outcome
    bare = Cluster(master=None)
    e5, _ = bare.client("n5").make(report("n5"), bare.placer_cert, now=NOW)
    _refused(bare.desk, e5, "no_master")
    # and a desk with another master: the MAC fails
    other = Cluster(master=b"o" * 32)
    e6, _ = other.client("n6").make(report("n6"), other.placer_cert, now=NOW)
    _refused(other.desk, e6, "bad_mac")


def test_issued_nodes_hold_their_certificates_enrolment_key(tmp_path, tls_pki) -> None:
    """``herd pki issue`` writes node.enrol beside node.key; the agent's client is keyed with it
    and the placer's desk (enrol.secret beside placer.key) takes its enrolment. One bound to
    another certificate is not used: the node enrols by ECDH."""
    files = tls_pki.files("node:n7")
    assert files.key.with_suffix(".enrol").stat().st_mode & 0o777 == 0o600
    c = client_from_files(files)
    master = pki.enrol_master(tls_pki.dir)
    assert master is not None and c._enrol_key == enrol_key_of(master, pki.load_cert(files.cert))
    desk = desk_from_files(tls_pki.files("placer"))
    e, _ = c.make(report("n7"), desk.cert, now=time.time())
    desk.check(e, now=time.time())
    assert desk.keyed == 1 and desk.cert_checks == 0
    # the node's certificate issued again (its node.enrol replaced too); an old node.enrol kept is not used
    old = files.key.with_suffix(".enrol").read_bytes()
    pki.issue_node(tls_pki.dir, "n7", days=30)
    assert client_from_files(files)._enrol_key is not None
    files.key.with_suffix(".enrol").write_bytes(old)
    assert client_from_files(files)._enrol_key is None
    # systemd passes an absent credential as an empty file: no key, no master (by ECDH / refused no_master)
    files.key.with_suffix(".enrol").write_bytes(b"\n")
    assert client_from_files(files)._enrol_key is None
    (tmp_path / "placer-tls").mkdir()
    (tmp_path / "placer-tls" / pki.ENROL_SECRET).write_bytes(b"\n")
    assert pki.enrol_master(tmp_path / "placer-tls") is None
    (tmp_path / "placer-tls" / pki.ENROL_SECRET).write_bytes(b"short")
    with pytest.raises(pki.PKIError):
        pki.enrol_master(tmp_path / "placer-tls")


async def test_a_bootstrapped_node_gets_its_enrolment_key_over_the_pki_api(tmp_path, token_dir, tls_pki) -> None:
    tokens = TokenSet.load(token_dir)
    token = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json").create(ttl_s=600, node_id="n8", now=time.time())
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir)),
                                tokens)
            url = await n.start(svc.run)
            files = await certs.bootstrap(url, "n8", token, configured_dir=str(tls_pki.dir), state_dir=tmp_path / "st")
            n.cancel_scope.cancel()
    c = client_from_files(files)
    master = pki.enrol_master(tls_pki.dir)
    assert master is not None and c._enrol_key == enrol_key_of(master, pki.load_cert(files.cert))
    desk = desk_from_files(tls_pki.files("placer"))
    e, _ = c.make(report("n8"), desk.cert, now=time.time())
    assert desk.check(e, now=time.time()).node_id == "n8" and desk.keyed == 1


_FLIP = Cluster()
_FLIP_CLIENT = _FLIP.client("flip", rack="z/b/r1")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_bit_of_a_keyed_enrolment_is_refused(data: st.DataObject) -> None:
    e, _ = _FLIP_CLIENT.make(report("flip"), _FLIP.placer_cert, now=NOW)
    field = data.draw(st.sampled_from(["mac", "nonce", "report", "serial", "rack", "boot_id", "not_before",
                                       "not_after"]))
    val: object
    if field in ("not_before", "not_after"):
        val = getattr(e, field) ^ (1 << data.draw(st.integers(0, 40)))
    else:
        cur = getattr(e, field)
        raw = bytearray(cur.encode() if isinstance(cur, str) else bytes(cur))
        bit = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        val = bytes(raw).decode(errors="replace") if isinstance(cur, str) else bytes(raw)
        if field == "report":
            val = msgspec.Raw(bytes(raw))
    with pytest.raises(EnrollRefused):
        _FLIP.desk.check(msgspec.structs.replace(e, **{field: val}), now=NOW)
