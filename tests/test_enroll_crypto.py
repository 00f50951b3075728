"""The enrolment's pure crypto (scheduler_link.enroll): what a relay can and cannot do with it."""

from __future__ import annotations

import datetime as dt
import time

import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.pki import CA, make_ca
from scheduler_link.enroll import (
    MAC_LEN,
    EnrollBudget,
    EnrollClient,
    EnrollDesk,
    EnrollRefused,
    NonceGuard,
    answer_ad,
    derive,
    digest,
    enroll_mac,
    open_sealed,
    seal,
)
from scheduler_link.messages import EnrollAnswer, EnrollSecret, NodeReport, ReportReply, TopologyPath

# the tests' clock: an hour on from the import, so every certificate the module's fixture issues
# later (a loaded xdist worker may run this module many minutes after collecting it: a whole
# suite on two loaded cores takes ~20) is valid at NOW
NOW = time.time() + 3600


def _der(cert) -> bytes:  # type: ignore[no-untyped-def]
    return cert.public_bytes(serialization.Encoding.DER)


class Cluster:
    def __init__(self) -> None:
        self.ca = CA(*make_ca())
        pk, pc = self.ca.issue("placer")
        self.placer_key, self.placer_cert = pk, _der(pc)
        self.desk = EnrollDesk(self.ca.cert, pk, self.placer_cert)
        self.serials: dict[str, str] = {}

    def client(self, node: str, *, ca: CA | None = None, principal: str | None = None,
               not_before: dt.datetime | None = None, days: int = 30) -> EnrollClient:
        key, cert = (ca or self.ca).issue(principal or f"node:{node}", not_before=not_before, days=days)
        self.serials[node] = format(cert.serial_number, "X")
        return EnrollClient(self.ca.cert, key, _der(cert))


def report(node: str, boot: str = "b1", seq: int = 1, full: bool = True) -> NodeReport:
    return NodeReport(node_id=node, boot_id=boot, seq=seq, full=full, control_url=f"http://{node}",
                      topology=TopologyPath(zone="z", block="b", rack="r1"), sent_at=NOW)


@pytest.fixture(scope="module")
def cl() -> Cluster:
    return Cluster()


def test_round_trip_gives_the_member_its_keys(cl: Cluster) -> None:
    c = cl.client("n1")
    e, p = c.make(report("n1"), cl.placer_cert, now=NOW)
    got = cl.desk.check(e, now=NOW)
    assert got.report.node_id == "n1" and got.report.full
    a = EnrollDesk.answer(got, ReportReply(mac_key=b"k" * 32, placer_key=b"p" * 32), b"K" * 32, b"P" * 32)
    assert a.reply is not None and a.reply.mac_key is None and a.reply.placer_key is None   # keys only sealed
    s = EnrollClient.open(p, msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=EnrollAnswer))
    assert (s.mac_key, s.placer_key, s.node_id, s.boot_id) == (b"K" * 32, b"P" * 32, "n1", "b1")


def test_the_certificate_check_and_ecdh_are_cached_per_certificate(cl: Cluster) -> None:
    c = cl.client("n2")
    before = cl.desk.cert_checks
    for k in range(3):
        e, _ = c.make(report("n2", seq=k + 1), cl.placer_cert, now=NOW)
        cl.desk.check(e, now=NOW)
    assert cl.desk.cert_checks == before + 1


def _refused(cl: Cluster, e, outcome: str, **kw) -> None:  # type: ignore[no-untyped-def]
    n0 = cl.desk.refused.get(outcome, 0)
    with pytest.raises(EnrollRefused) as ei:
        cl.desk.check(e, now=kw.pop("now", NOW), **kw)
    assert ei.value.outcome == outcome
    assert cl.desk.refused[outcome] == n0 + 1


def test_a_relay_cannot_make_one_up_for_another_node(cl: Cluster) -> None:
    relay = cl.client("relay")
    victim = cl.client("victim")
    # the relay with its own certificate, naming the victim: the certificate is not the victim's
    e, _ = relay.make(report("victim"), cl.placer_cert, now=NOW)
    _refused(cl, e, "bad_certificate")
    # the victim's certificate (a relay sees it go by) with the relay's key: the MAC fails
    forged = EnrollClient(cl.ca.cert, relay._key, victim.cert)
    e, _ = forged.make(report("victim"), cl.placer_cert, now=NOW)
    _refused(cl, e, "bad_mac")
    # a real enrolment of the victim with its report changed by the relay: the MAC fails
    e, _ = victim.make(report("victim"), cl.placer_cert, now=NOW)
    other = msgspec.msgpack.encode(report("victim", seq=99))
    _refused(cl, msgspec.structs.replace(e, report=msgspec.Raw(other)), "bad_mac")


def test_certificates_not_from_the_ca_expired_or_revoked_are_refused(cl: Cluster) -> None:
    rogue = CA(*make_ca())
    e, _ = cl.client("n3", ca=rogue).make(report("n3"), cl.placer_cert, now=NOW)
    _refused(cl, e, "not_from_ca")
    old = cl.client("n4", not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=40), days=30)
    e, _ = old.make(report("n4"), cl.placer_cert, now=NOW)
    _refused(cl, e, "expired")
    e, _ = cl.client("n5").make(report("n5"), cl.placer_cert, now=NOW)
    _refused(cl, e, "revoked", denied=(frozenset({"n5"}), frozenset()))
    e, _ = cl.client("n6").make(report("n6"), cl.placer_cert, now=NOW)
    _refused(cl, e, "revoked", denied=(frozenset(), frozenset({cl.serials["n6"].lstrip("0")})))
    op = cl.client("op", principal="operator")
    e, _ = op.make(report("op"), cl.placer_cert, now=NOW)
    _refused(cl, e, "bad_certificate")
    _refused(cl, msgspec.structs.replace(e, cert=b"\x30\x03junk"), "bad_certificate")


def test_replays_are_refused(cl: Cluster) -> None:
    c = cl.client("n7")
    e, _ = c.make(report("n7", seq=5), cl.placer_cert, now=NOW)
    cl.desk.check(e, now=NOW)
    _refused(cl, e, "replay", now=NOW + 1)                        # the same nonce again
    e2, _ = c.make(report("n7", seq=5), cl.placer_cert, now=NOW)
    _refused(cl, e2, "replay", now=NOW + 400)                     # older than the window
    _refused(cl, e2, "replay", now=NOW - 100)                     # from the future
    e4, _ = c.make(report("n7", seq=5), cl.placer_cert, now=NOW)
    _refused(cl, e4, "replay", known=("b1", 5))                  # not newer than the boot's last report
    cl.desk.check(e4, now=NOW, known=("b0", 9))                   # another boot: taken


def test_malformed_and_oversized_enrolments_are_refused(cl: Cluster) -> None:
    c = cl.client("n8")
    e, _ = c.make(report("n8"), cl.placer_cert, now=NOW)
    _refused(cl, msgspec.structs.replace(e, nonce=b"short"), "malformed")
    _refused(cl, msgspec.structs.replace(e, cert=b"x" * 5000), "oversized")
    _refused(cl, msgspec.structs.replace(e, report=msgspec.Raw(b"\xc1" * (70 << 10))), "oversized")
    _refused(cl, msgspec.structs.replace(e, node_id=""), "malformed")
    _refused(cl, msgspec.structs.replace(e, version=3), "malformed")
    # a MAC that verifies over a report that does not decode, or is of another boot / not full
    shared = c._key.exchange(ec.ECDH(), cl.placer_key.public_key())
    keys = derive(shared, "n8", "b1", e.nonce, digest(c.cert), digest(cl.placer_cert))
    for raw in (b"\x93junk", msgspec.msgpack.encode(report("n8", boot="b2")),
                msgspec.msgpack.encode(report("n8", full=False))):
        bad = msgspec.structs.replace(e, report=msgspec.Raw(raw))
        _refused(cl, msgspec.structs.replace(bad, mac=enroll_mac(keys.mac, bad)), "malformed")


def test_a_member_checks_the_placer_certificate_it_is_handed(cl: Cluster) -> None:
    c = cl.client("n9")
    _, node_cert = cl.ca.issue("node:evil")
    with pytest.raises(EnrollRefused) as ei:
        c.make(report("n9"), _der(node_cert), now=NOW)            # a node's, not the placer's
    assert ei.value.outcome == "bad_certificate"
    _, rogue = CA(*make_ca()).issue("placer")
    with pytest.raises(EnrollRefused) as ei:
        c.make(report("n9"), _der(rogue), now=NOW)
    assert ei.value.outcome == "not_from_ca"


def test_an_answer_changed_or_for_another_enrolment_does_not_open(cl: Cluster) -> None:
    c = cl.client("n10")
    e, p = c.make(report("n10"), cl.placer_cert, now=NOW)
    a = EnrollDesk.answer(cl.desk.check(e, now=NOW), ReportReply(), b"K" * 32, b"P" * 32)
    _, p2 = c.make(report("n10"), cl.placer_cert, now=NOW)
    with pytest.raises(EnrollRefused) as ei:
        EnrollClient.open(p2, a)
    assert ei.value.outcome == "bad_mac"
    with pytest.raises(EnrollRefused) as ei:
        EnrollClient.open(p, msgspec.structs.replace(a, outcome="revoked", sealed=b""))
    assert ei.value.outcome == "revoked"


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.binary(max_size=64), st.data())
def test_seal_round_trips_and_any_flipped_bit_fails(key: bytes, extra: bytes, data: st.DataObject) -> None:
    secret = EnrollSecret(node_id="n", boot_id="b", mac_key=key, placer_key=extra.ljust(32, b"\0")[:32])
    ad = answer_ad("n", "b", extra[:16].ljust(16, b"\0"))
    s = seal(key, secret, ad)
    assert open_sealed(key, s, ad) == secret
    bit = data.draw(st.integers(0, len(s) * 8 - 1))
    flipped = bytearray(s)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(EnrollRefused):
        open_sealed(key, bytes(flipped), ad)
    abit = data.draw(st.integers(0, len(ad) * 8 - 1))
    bad_ad = bytearray(ad)
    bad_ad[abit // 8] ^= 1 << (abit % 8)
    with pytest.raises(EnrollRefused):
        open_sealed(key, s, bytes(bad_ad))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_flipped_bit_of_an_enrolment_is_refused(cl: Cluster, data: st.DataObject) -> None:
    c = cl.client("flip") if not hasattr(cl, "flip") else cl.flip  # type: ignore[attr-defined]
    cl.flip = c  # type: ignore[attr-defined]
    e, _ = c.make(report("flip"), cl.placer_cert, now=NOW)
    field = data.draw(st.sampled_from(["mac", "nonce", "report", "cert", "boot_id", "at"]))
    if field == "at":
        bad = msgspec.structs.replace(e, at=e.at + data.draw(st.sampled_from([1e-3, -1.0, 7.0])))
    else:
        raw = bytearray(bytes(getattr(e, field)) if field != "boot_id" else e.boot_id.encode())
        bit = data.draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        val: object = bytes(raw)
        if field == "report":
            val = msgspec.Raw(bytes(raw))
        elif field == "boot_id":
            val = bytes(raw).decode(errors="replace")
        bad = msgspec.structs.replace(e, **{field: val})
    with pytest.raises(EnrollRefused):
        cl.desk.check(bad, now=NOW)
    assert len(e.mac) == MAC_LEN


def test_nonce_guard_is_bounded_and_raises_its_floor() -> None:
    g = NonceGuard(window_s=10.0, cap=3)
    assert all(g.take(bytes([i]) * 16, at=100.0 + i, now=100.0 + i) for i in range(3))
    assert not g.take(bytes([1]) * 16, at=101.0, now=104.0)
    assert g.take(bytes([9]) * 16, at=105.0, now=105.0)          # over the cap: the oldest goes
    assert len(g) == 3 and g.floor == 100.0
    assert not g.take(bytes([8]) * 16, at=100.0, now=105.0)     # no newer than a dropped one
    assert g.take(bytes([0]) * 16, at=120.0, now=120.0)          # the window passed: all expired
    assert len(g) == 1


def test_the_enrolment_budget_allows_a_burst_then_its_rate() -> None:
    b = EnrollBudget(burst=10, per_s=2, now=0.0)
    assert b.take(8, 0.0) == 8 and b.take(8, 0.0) == 2 and b.take(1, 0.0) == 0
    assert b.take(5, 1.0) == 2                 # two a second
    assert b.take(50, 100.0) == 10             # never more than the burst


def test_every_flipped_bit_of_a_certificate_is_a_refusal_never_a_parser_error(cl: Cluster) -> None:
    """Whatever cryptography's parser makes of the bytes (an invalid version, a negative
    serial, a key it does not support), the desk answers a structured refusal."""
    c = cl.client("bits")
    e, _ = c.make(report("bits"), cl.placer_cert, now=NOW)
    seen: dict[str, int] = {}
    for bit in range(len(e.cert) * 8):
        raw = bytearray(e.cert)
        raw[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(EnrollRefused) as ei:
            cl.desk.check(msgspec.structs.replace(e, cert=bytes(raw)), now=NOW)
        seen[ei.value.outcome] = seen.get(ei.value.outcome, 0) + 1
    # (a flip the signature does not cover leaves the key as it was: the MAC, over the
    # certificate's digest, refuses it)
    assert {"bad_certificate", "not_from_ca"} <= set(seen) <= {"bad_certificate", "not_from_ca", "bad_mac"}
