"""Enrolment through the rack relay: a member with no MAC key registers without a TLS handshake
with the placer, and its relay can neither make an enrolment up for another node nor read the
keys in the answer.

Theory of operation (DESIGN.md, Security model; docs/security.md, "Enrolment through the relay")
------------------------------------------------------------------------------------------------
Without it a node's MAC key K_X (scheduler_link.msgauth) reaches it only in the answer to a
full report over its *own* TLS connection to the placer: one mutual handshake per node into
one placer core (2.5-5.6 ms of placer CPU a node), the bottleneck of a cold registration. Here
the node's full report goes up through its rack's relay instead, and what the TLS handshake
proved is proved per message:

- **The placer's static key** is the key of its TLS certificate (ECDSA P-256, signed by the
  cluster CA, subject ``placer``). The relay hands the certificate down (``enroll_key`` ->
  ``placer_cert``, fetched once over its own connection to the placer); the member checks it
  against its CA, its validity and its principal (:meth:`EnrollClient.placer_public`), so a
  relay that hands down another key is refused by the member.
- **E_X**, the enrolment's key, is what only the holder of the member's certificate key and
  the placer can compute: ``S = ECDH(member certificate key, placer certificate key)`` (P-256,
  static-static: the member proves it holds its certificate's key, as its handshake did), then
  ``E = BLAKE3-derive-key("herd enrol v1", S || node || boot || nonce || H(member cert) ||
  H(placer cert))``, split into a MAC key and a sealing key (keyed BLAKE3 of "mac"/"seal").
  The nonce (16 random bytes) makes E fresh for every enrolment.
- **Keyed enrolment** (``version`` ENROLL_KEYED_VERSION): a node whose certificate was issued
  with its enrolment key ``K_N = BLAKE3(key=master, node || serial || validity || rack)``
  (infra.pki.enrol_key; ``node.enrol`` beside its key) uses K_N where the ECDH secret would be
  (another KDF context, and the digest of the certificate's fields where the certificate's
  would be): no public-key work at either end. Such an enrolment carries those fields
  (serial, validity, rack) instead of the certificate; the placer derives K_N from the master
  (``enrol.secret`` beside its key) and exactly the fields it then trusts: any of them changed
  gives another key, so the MAC fails. Certificates issued without a key enrol by ECDH.
- **The enrolment** (:class:`~scheduler_link.messages.Enroll`: certificate DER, node, boot,
  nonce, the member's time, the full report's msgpack bytes) carries a 32-byte keyed-BLAKE3
  MAC under E's MAC key over all of it. The placer (:class:`EnrollDesk`) checks, cheapest
  first and before decoding the report: bounds, the time window, the certificate (issued by
  the CA, subject ``node:<node_id>``, valid now, not on the deny-list), the MAC, the nonce
  not seen; then decodes the report (it must be a full report of that node and boot). A relay
  that makes one up for another node has no key of that node's certificate: its MAC fails.
- **The answer** carries K_X and the placer's Ed25519 signing key sealed under E's sealing key
  (ChaCha20-Poly1305, a random 96-bit nonce, the node, boot and enrolment nonce as associated
  data): the relay passes bytes it cannot open or alter unnoticed. The rest of the answer
  (heartbeat interval, relay URL, stops) is read as a relayed answer always is.
- **Replays**: the placer keeps the nonces it took for ``WINDOW_S`` (+ skew) and refuses an
  enrolment older than the window; a full report of a boot the placer already knows must
  have a newer sequence. What remains: after a placer restart, an enrolment a relay recorded
  in the last ``WINDOW_S`` can be replayed once to the new process; it registers that node's recent full report
  of that boot (its later heartbeats move it on, or a 409 asks it for a fresh one), and the
  answer is sealed to the node, so the relay learns nothing.

Cost at the placer per enrolment (by ECDH; a keyed one: a certificate parse and BLAKE3
instead of the CA check and the ECDH): one CA signature check and one ECDH, both cached per
certificate (a member that enrols again with the same certificate costs neither; a batch's
new certificates are checked ahead in worker processes, :func:`check_members`,
placer.enrollpool), a few BLAKE3 calls and one AEAD seal: ~0.2 ms, against a TLS handshake's 2.5-5.6 ms
(``python -m bench.fleet --tls --relays`` measures the whole path against direct registration).
A check costs that even when it fails: each connection has an :class:`EnrollBudget`.

Nothing here touches sockets, clocks or trio (``now`` is an argument); nonces and AEAD nonces
are random, and only :func:`desk_from_files` / :func:`client_from_files` read files.
"""

from __future__ import annotations

import hmac
import os
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

import blake3
import msgspec
from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.utils import CryptographyDeprecationWarning
from cryptography.x509.oid import NameOID

from infra.errors import AuthError
from infra.pki import cert_rack, enrol_key, enrol_master, load_cert, load_enrol_key, load_key
from infra.tls import TLSFiles, norm_serial, parse_principal

from .messages import (
    ENROLL_KEYED_VERSION,
    ENROLL_VERSION,
    Enroll,
    EnrollAnswer,
    EnrollOutcome,
    EnrollSecret,
    NodeReport,
    ReportReply,
)

NONCE_LEN = 16
MAC_LEN = 32
KEY_LEN = 32
WINDOW_S = 300.0             # an enrolment older than this (by its own time) is refused
SKEW_S = 60.0                # nor one this far ahead of the placer's clock
MAX_CERT_BYTES = 4096        # a node certificate is ~600 bytes DER
MAX_REPORT_BYTES = 60 << 10  # under a member frame's bound (frames.MEMBER_MAX_FRAME, 64 KiB)
MAX_ID_LEN = 256
SEEN_CAP = 1 << 18           # nonces kept (more than a 131,072-node fleet's cold registration)
CERT_CACHE = 1 << 18         # checked certificates (and their ECDH secret) kept: a fleet's, ~450 B each
BUDGET_BURST = 512.0         # enrolments one connection may send at once (twice the rack entry bound)
BUDGET_PER_S = 8.0           # ... and then per second

_KDF_CONTEXT = "herd enrol v1 (scheduler_link.enroll)"
_KDF_KEYED_CONTEXT = "herd enrol keyed v1 (scheduler_link.enroll)"
_MAC_PREFIX = b"herd enrol mac v1\0"
_AD_PREFIX = b"herd enrol answer v1\0"
_canon = msgspec.msgpack.Encoder(order="deterministic")
_enc = msgspec.msgpack.Encoder()
_report_dec = msgspec.msgpack.Decoder(NodeReport)
_secret_dec = msgspec.msgpack.Decoder(EnrollSecret)
# what cryptography's certificate parsing raises on bytes it does not take (InvalidVersion is
# not a ValueError)
_UNPARSED: tuple[type[Exception], ...] = (ValueError, TypeError, x509.InvalidVersion, UnsupportedAlgorithm,
                                          CryptographyDeprecationWarning)
_UNVERIFIED: tuple[type[Exception], ...] = (*_UNPARSED, InvalidSignature)


class EnrollRefused(AuthError):
    """An enrolment (or its answer) not taken: ``outcome`` says why, structured (never words)."""

    def __init__(self, outcome: EnrollOutcome, detail: str, *, dialling: bool = False) -> None:
        super().__init__(f"{outcome}: {detail}")
        self.outcome: EnrollOutcome = outcome
        self.detail = detail
        self.dialling = dialling   # upstream_down: the relay said its first dial is under way


# ---------------------------------------------------------------- the primitives

def digest(raw: bytes) -> bytes:
    return blake3.blake3(raw).digest()


class Keys(NamedTuple):
    mac: bytes
    seal: bytes


def derive(shared: bytes, node_id: str, boot_id: str, nonce: bytes, member_cert: bytes, placer_cert: bytes,
           *, keyed: bool = False) -> Keys:
    """E's MAC and sealing keys from the ECDH secret (``keyed``: the node's enrolment key
    K_N instead) and what binds them to one enrolment (the certificates as their BLAKE3
    digests)."""
    if keyed:   # (one call: both keys from the derivation's output)
        both = blake3.blake3(shared + _canon.encode([node_id, boot_id, nonce, member_cert, placer_cert]),
                             derive_key_context=_KDF_KEYED_CONTEXT).digest(2 * KEY_LEN)
        return Keys(both[:KEY_LEN], both[KEY_LEN:])
    e = blake3.blake3(shared + _canon.encode([node_id, boot_id, nonce, member_cert, placer_cert]),
                      derive_key_context=_KDF_CONTEXT).digest(KEY_LEN)
    return Keys(blake3.blake3(b"mac", key=e).digest(KEY_LEN), blake3.blake3(b"seal", key=e).digest(KEY_LEN))


def enroll_mac(key: bytes, e: Enroll, cert_digest: bytes | None = None) -> bytes:
    """Over every field but the MAC: the header canonically, then the report's bytes as sent.
    ``cert_digest``: :func:`digest` of ``e.cert``, where the caller has it already."""
    head = _canon.encode([e.version, e.node_id, e.boot_id, e.nonce, float(e.at),
                          digest(e.cert) if cert_digest is None else cert_digest])
    h = blake3.blake3(_MAC_PREFIX, key=key)
    h.update(len(head).to_bytes(4, "big") + head)
    h.update(e.report)   # (a Raw is a buffer: hashed where it lies)
    return h.digest(MAC_LEN)


def answer_ad(node_id: str, boot_id: str, nonce: bytes) -> bytes:
    return _AD_PREFIX + _canon.encode([node_id, boot_id, nonce])


def seal(key: bytes, secret: EnrollSecret, ad: bytes) -> bytes:
    """ChaCha20-Poly1305 under ``key``: a random 96-bit nonce, then the ciphertext and tag."""
    n = os.urandom(12)
    return n + ChaCha20Poly1305(key).encrypt(n, _enc.encode(secret), ad)


def open_sealed(key: bytes, sealed: bytes, ad: bytes) -> EnrollSecret:
    """The secret ``sealed`` holds; EnrollRefused (``bad_mac``) if it was not sealed under
    ``key`` with ``ad``, or was changed at all."""
    if len(sealed) < 12 + 16:
        raise EnrollRefused("malformed", "a sealed answer is too short")
    try:
        raw = ChaCha20Poly1305(key).decrypt(sealed[:12], sealed[12:], ad)
    except InvalidTag:
        raise EnrollRefused("bad_mac", "the sealed answer does not open with this enrolment's key") from None
    try:
        return _secret_dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise EnrollRefused("malformed", f"the sealed answer does not decode: {e}") from None


# ---------------------------------------------------------------- certificates

@dataclass(frozen=True, slots=True)
class CertOK:
    """A certificate the CA signed, as checked: its principal, key, serial and validity, and
    the rack it pins (infra.pki.cert_rack; None: none)."""
    principal: str
    node_id: str | None
    key: ec.EllipticCurvePublicKey
    serial: str
    not_before: float
    not_after: float
    rack: str | None = None


def check_cert(der: bytes, ca: x509.Certificate) -> CertOK:
    """Parse ``der`` and check the CA signed it (its validity and the deny-list are the
    caller's: they change with time; this does not). Whatever the bytes, the answer is a
    CertOK or EnrollRefused (a parser's own exceptions, and the deprecation warnings it gives
    for what RFC 5280 forbids, are mapped here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CryptographyDeprecationWarning)
        return _check_cert(der, ca)


def _check_cert(der: bytes, ca: x509.Certificate | None) -> CertOK:
    try:
        cert = x509.load_der_x509_certificate(der)
    except _UNPARSED as e:
        raise EnrollRefused("bad_certificate", f"not a DER certificate: {e}") from None
    if ca is not None:
        try:
            cert.verify_directly_issued_by(ca)
        except _UNVERIFIED:
            raise EnrollRefused("not_from_ca", "the certificate is not signed by the cluster CA") from None
    try:   # (parsed lazily: a field may fail here)
        cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        p = parse_principal(str(cns[0].value)) if cns else None
        key = cert.public_key()
        serial = norm_serial(format(cert.serial_number, "X"))
        valid = (cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp())
        rack = cert_rack(cert) if p is not None and p.node_id is not None else None
    except _UNPARSED as e:
        raise EnrollRefused("bad_certificate", f"the certificate does not parse: {e}") from None
    if p is None:
        raise EnrollRefused("bad_certificate", "the certificate names no herd principal")
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise EnrollRefused("bad_certificate", "the certificate's key is not ECDSA P-256")
    return CertOK(p.name, p.node_id, key, serial, *valid, rack=rack)


def cert_fields(der: bytes) -> CertOK:
    """``der``'s fields, its signature *not* checked: what a keyed enrolment's MAC vouches
    for (the key it verifies under is derived from exactly these). EnrollRefused as
    :func:`check_cert` for bytes that do not parse."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", CryptographyDeprecationWarning)
        return _check_cert(der, None)


class KeyedFields(NamedTuple):
    """What a keyed enrolment carries of its certificate: the fields its enrolment key is
    bound to (infra.pki.enrol_key), besides the node."""
    serial: str
    not_before: int
    not_after: int
    rack: str | None

    def digest(self) -> bytes:
        """What the enrolment's key derivation and MAC bind in place of the certificate's digest."""
        return digest(_canon.encode(["herd keyed certificate v1", self.serial, self.not_before, self.not_after,
                                     self.rack or ""]))


def keyed_fields(der: bytes) -> KeyedFields:
    """A node's own certificate's fields, as its keyed enrolments carry them."""
    c = cert_fields(der)
    return KeyedFields(c.serial, int(c.not_before), int(c.not_after), c.rack)


def member_known(der: bytes, ca: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> KnownCert:
    """A member's certificate checked (:func:`check_cert`; a node's) with the ECDH secret of
    ``key`` (the placer's) and the certificate's key: what the desk keeps of it."""
    c = check_cert(der, ca)
    if c.node_id is None:
        raise EnrollRefused("bad_certificate", f"the certificate is {c.principal}'s, not a node's")
    return KnownCert(c.principal, c.node_id, c.serial, c.not_before, c.not_after, key.exchange(ec.ECDH(), c.key), c.rack)


def check_members(ca_der: bytes, key_der: bytes, ders: list[bytes]) -> list[KnownCert | None]:
    """:func:`member_known` of each of ``ders`` (None: refused; the desk refuses it again,
    with its outcome, when its enrolment is checked). Plain data in and out: it runs in a
    worker process (placer.enrollpool)."""
    ca = x509.load_der_x509_certificate(ca_der)
    key = serialization.load_der_private_key(key_der, None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TypeError("the placer's key is not an EC key")
    out: list[KnownCert | None] = []
    for der in ders:
        try:
            out.append(member_known(der, ca, key))
        except EnrollRefused:
            out.append(None)
    return out


def _valid(c: CertOK | KnownCert, now: float) -> None:
    if not c.not_before <= now <= c.not_after:
        raise EnrollRefused("expired", f"the certificate of {c.principal} is not valid now")


class KnownCert(NamedTuple):
    """A member certificate the desk checked, as it keeps it: what its later checks read, and
    the ECDH secret with it (not its key object); for a keyed enrolment (never kept), the
    enrolment key."""
    principal: str
    node_id: str
    serial: str
    not_before: float
    not_after: float
    shared: bytes
    rack: str | None         # the rack the certificate pins (placer.relaypolicy)


# ---------------------------------------------------------------- replays

class NonceGuard:
    """The nonces taken in the last window (by the placer's clock): one that comes again is a
    replay. Bounded: past ``cap`` the oldest is dropped and the floor rises to its time, so an
    enrolment no newer than a dropped one is refused too (it could be that one, replayed)."""

    def __init__(self, *, window_s: float = WINDOW_S + SKEW_S, cap: int = SEEN_CAP) -> None:
        self.window_s = window_s
        self.cap = cap
        self._seen: dict[bytes, float] = {}
        self._order: deque[tuple[float, bytes, float]] = deque()   # (taken at, nonce, its own time)
        self.floor = -float("inf")

    def __len__(self) -> int:
        return len(self._seen)

    def take(self, nonce: bytes, at: float, now: float) -> bool:
        """False when ``nonce`` (made at ``at``) may be a replay; else it is remembered."""
        self._expire(now)
        if nonce in self._seen or at <= self.floor:
            return False
        self._seen[nonce] = at
        self._order.append((now, nonce, at))
        while len(self._seen) > self.cap:
            _, old, old_at = self._order.popleft()
            del self._seen[old]
            self.floor = max(self.floor, old_at)
        return True

    def _expire(self, now: float) -> None:
        o = self._order
        while o and o[0][0] < now - self.window_s:
            del self._seen[o.popleft()[1]]


# How long an enrolment's answer is waited for, by the relay (its batch) and by the member: the
# placer works through a storm's enrolment batches one at a time, first come first served
# (placer.relays), ~0.5 ms a member on one core -- a whole 131,072-node fleet's in about a minute,
# longer on a loaded host. Given up sooner, the member registers directly: a TLS handshake of its
# own, ten times the placer's cost of its enrolment, in the middle of the storm (measured: 45,771
# handshakes in one 131,072-node cold start with a 60 s wait).
ENROLL_WAIT_S = 300.0


class EnrollBudget:
    """A token bucket: how many enrolments one connection may have checked now. A check
    costs the placer a CA signature check and an ECDH (~0.15 ms) even when it fails, so a
    hostile holder of a node certificate may not have it make them without end; a rack's
    members enrolling at once (a cold start: up to a rack's size) fit in the burst."""

    def __init__(self, *, burst: float = BUDGET_BURST, per_s: float = BUDGET_PER_S, now: float) -> None:
        self.burst = burst
        self.per_s = per_s
        self._tokens = burst
        self._at = now

    def take(self, n: int, now: float) -> int:
        """How many of ``n`` may go now (taken from the bucket)."""
        self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.per_s)
        self._at = now
        got = min(n, int(self._tokens))
        self._tokens -= got
        return got


# ---------------------------------------------------------------- the placer's desk

class Checked(NamedTuple):
    """An enrolment the desk took: its report (a full report of that node and boot) and
    what sealing its answer needs."""
    report: NodeReport
    node_id: str
    boot_id: str
    seal_key: bytes
    ad: bytes
    rack: str | None = None   # the rack the member's certificate pins


class EnrollDesk:
    """The placer's side (no I/O): checks enrolments and seals their answers.

    ``ca``: the cluster CA's certificate; ``key``/``cert``: the placer's TLS key and
    certificate (DER), whose key is the static key of the ECDH; ``master``: the enrolment
    master (infra.pki.enrol_master) that keyed enrolments' keys derive from (None: those are
    refused ``no_master``)."""

    def __init__(self, ca: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert: bytes, *,
                 window_s: float = WINDOW_S, skew_s: float = SKEW_S, cache: int = CERT_CACHE,
                 master: bytes | None = None) -> None:
        self.ca = ca
        self._key = key
        self._master = master
        self.cert = cert
        self._cert_digest = digest(cert)
        self.window_s = window_s
        self.skew_s = skew_s
        self.guard = NonceGuard(window_s=window_s + skew_s)
        self._cache: OrderedDict[bytes, KnownCert] = OrderedDict()   # cert digest -> it, with the ECDH secret
        self._cache_cap = cache
        self._pool_args: tuple[bytes, bytes] | None = None
        # statistics
        self.taken = 0
        self.keyed = 0             # ... of them keyed (no public-key work)
        self.refused: dict[str, int] = {}
        self.cert_checks = 0       # CA signature checks and ECDHs done (the rest were cached)

    def refuse(self, outcome: EnrollOutcome) -> None:
        """Count a refusal (the desk's own, or one its caller decided)."""
        self.refused[outcome] = self.refused.get(outcome, 0) + 1

    def _member(self, der: bytes) -> tuple[KnownCert, bytes]:
        """The member certificate ``der`` checked (the CA's signature, a node's), with the
        ECDH secret, and its digest: from the cache, or checked now and kept."""
        d = digest(der)
        hit = self._cache.get(d)
        if hit is not None:
            self._cache.move_to_end(d)
            return hit, d
        k = member_known(der, self.ca, self._key)
        self.cert_checks += 1
        self._keep(d, k)
        return k, d

    def _keyed_member(self, e: Enroll) -> tuple[KnownCert, bytes]:
        """The certificate fields a keyed enrolment carries, with the K_N derived from them and
        the master (one BLAKE3 call: nothing is parsed or kept). Nothing vouches for the fields
        but the MAC under that key, checked next: a field changed is another key."""
        if self._master is None:
            raise EnrollRefused("no_master", "this placer holds no enrolment master: enrol by ECDH or directly")
        if e.cert:
            raise EnrollRefused("malformed", "a keyed enrolment carries its certificate's fields, not the certificate")
        if len(e.serial) > 64 or (e.rack is not None and len(e.rack) > MAX_ID_LEN):
            raise EnrollRefused("oversized", "a field of the enrolment is over its bound")
        if e.serial != norm_serial(e.serial) or e.rack == "":   # (one spelling each: the deny-list's; no rack is None)
            raise EnrollRefused("malformed", "a keyed enrolment's serial is upper-case hex without leading zeros, "
                                             "and its rack None or a rack")
        f = KeyedFields(e.serial, e.not_before, e.not_after, e.rack)
        k = enrol_key(self._master, e.node_id, f.serial, f.not_before, f.not_after, f.rack)
        return KnownCert(f"node:{e.node_id}", e.node_id, f.serial, float(f.not_before), float(f.not_after), k,
                         f.rack), f.digest()

    def _keep(self, d: bytes, k: KnownCert) -> None:
        self._cache[d] = k
        while len(self._cache) > self._cache_cap:
            self._cache.popitem(last=False)

    # ---- the certificate checks of a batch, done elsewhere first (placer.enrollpool)

    def unchecked(self, enrolls: list[Enroll]) -> list[bytes]:
        """The member certificates of ``enrolls`` not checked yet (each once, none over its
        bound): what a batch would check one by one in :meth:`check`."""
        out: list[bytes] = []
        seen: set[bytes] = set()
        for e in enrolls:
            der = e.cert
            if len(der) > MAX_CERT_BYTES or e.version == ENROLL_KEYED_VERSION:   # (a keyed one needs none)
                continue
            d = digest(der)
            if d not in seen and d not in self._cache:
                seen.add(d)
                out.append(der)
        return out

    def learn(self, ders: list[bytes], got: list[KnownCert | None]) -> None:
        """What :func:`check_members` found for ``ders``, kept as if :meth:`check` had checked
        them (a None is left to it: it refuses that certificate itself, counted)."""
        for der, k in zip(ders, got, strict=True):
            if k is not None:
                self.cert_checks += 1
                self._keep(digest(der), k)

    def pool_args(self) -> tuple[bytes, bytes]:
        """What :func:`check_members` needs besides the certificates: the CA's certificate and
        the placer's key, DER."""
        if self._pool_args is None:
            self._pool_args = (self.ca.public_bytes(serialization.Encoding.DER),
                               self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
        return self._pool_args

    def check(self, e: Enroll, *, now: float, denied: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset()),
              known: tuple[str, int] | None = None) -> Checked:
        """The enrolment, taken (its nonce remembered), or EnrollRefused (counted).
        ``denied``: the deny-list (node ids, serials); ``known``: the (boot, last sequence)
        the placer holds for the node, if any."""
        try:
            got = self._check(e, now, denied, known)
        except EnrollRefused as r:
            self.refuse(r.outcome)
            raise
        self.taken += 1
        self.keyed += e.version == ENROLL_KEYED_VERSION
        return got

    def _check(self, e: Enroll, now: float, denied: tuple[frozenset[str], frozenset[str]],
               known: tuple[str, int] | None) -> Checked:
        if e.version not in (ENROLL_VERSION, ENROLL_KEYED_VERSION):
            raise EnrollRefused("malformed", f"enrolment version {e.version} is not {ENROLL_VERSION} or "
                                             f"{ENROLL_KEYED_VERSION}")
        if len(e.nonce) != NONCE_LEN:
            raise EnrollRefused("malformed", f"a nonce is {NONCE_LEN} bytes, not {len(e.nonce)}")
        if len(e.cert) > MAX_CERT_BYTES or len(e.report) > MAX_REPORT_BYTES or len(e.node_id) > MAX_ID_LEN \
                or len(e.boot_id) > MAX_ID_LEN or len(e.mac) > 64:
            raise EnrollRefused("oversized", "a field of the enrolment is over its bound")
        if not e.node_id or not e.boot_id:
            raise EnrollRefused("malformed", "an enrolment names its node and boot")
        if not now - self.window_s <= e.at <= now + self.skew_s:
            raise EnrollRefused("replay", f"made at {e.at:.0f}, outside the window around {now:.0f}")
        keyed = e.version == ENROLL_KEYED_VERSION
        c, cd = self._keyed_member(e) if keyed else self._member(e.cert)
        if c.node_id != e.node_id:
            raise EnrollRefused("bad_certificate", f"the certificate is {c.principal}'s, not node:{e.node_id[:200]}'s")
        _valid(c, now)
        if c.node_id in denied[0] or c.serial in denied[1]:
            raise EnrollRefused("revoked", f"{c.principal} or its certificate {c.serial} is revoked")
        keys = derive(c.shared, e.node_id, e.boot_id, e.nonce, cd, self._cert_digest, keyed=keyed)
        if len(e.mac) != MAC_LEN or not hmac.compare_digest(e.mac, enroll_mac(keys.mac, e, cd)):
            raise EnrollRefused("bad_mac", "the MAC does not verify with the certificate's key"
                                + (" (its enrolment key)" if keyed else ""))
        try:
            rep = _report_dec.decode(e.report)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise EnrollRefused("malformed", f"the report does not decode: {err}") from None
        if rep.node_id != e.node_id or rep.boot_id != e.boot_id or not rep.full:
            raise EnrollRefused("malformed", "the report is not a full report of the enrolling node and boot")
        if known is not None and known[0] == e.boot_id and rep.seq <= known[1]:
            raise EnrollRefused("replay", f"sequence {rep.seq} is not newer than {known[1]}")
        if not self.guard.take(e.nonce, e.at, now):
            raise EnrollRefused("replay", "this enrolment's nonce was taken before")
        return Checked(rep, e.node_id, e.boot_id, keys.seal, answer_ad(e.node_id, e.boot_id, e.nonce), c.rack)

    @staticmethod
    def answer(c: Checked, reply: ReportReply, mac_key: bytes, placer_key: bytes) -> EnrollAnswer:
        """The registration's answer: the keys sealed to the member, the rest without them."""
        sealed = seal(c.seal_key, EnrollSecret(node_id=c.node_id, boot_id=c.boot_id, mac_key=mac_key,
                                               placer_key=placer_key), c.ad)
        return EnrollAnswer(node_id=c.node_id, sealed=sealed,
                            reply=msgspec.structs.replace(reply, mac_key=None, placer_key=None))

    def statistics(self) -> dict[str, object]:
        return {"taken": self.taken, "keyed": self.keyed, "refused": dict(self.refused),
                "cert_checks": self.cert_checks, "certs_cached": len(self._cache),
                "nonces": len(self.guard)}


# ---------------------------------------------------------------- the member's side

class Pending(NamedTuple):
    """An enrolment sent: what opening its answer needs."""
    node_id: str
    boot_id: str
    seal_key: bytes
    ad: bytes


class EnrollClient:
    """A member's side (no I/O): makes enrolments with its certificate's key and opens their
    answers. ``placer_certs`` may be shared by the members of one process (checked once).
    ``enrol_key``: the enrolment key issued with ``cert`` (infra.pki.load_enrol_key): its
    enrolments are keyed, no ECDH (None: by ECDH with the certificate's key)."""

    def __init__(self, ca: x509.Certificate, key: ec.EllipticCurvePrivateKey, cert: bytes, *,
                 placer_certs: dict[bytes, CertOK] | None = None, enrol_key: bytes | None = None) -> None:
        self.ca = ca
        self._key = key
        self._enrol_key = enrol_key
        self._fields = keyed_fields(cert) if enrol_key is not None else None
        self.cert = cert
        self._cert_digest = digest(cert)
        self._placer_certs: dict[bytes, CertOK] = {} if placer_certs is None else placer_certs

    def placer_public(self, der: bytes, now: float) -> CertOK:
        """The placer's certificate as the relay handed it down, checked: the CA signed it,
        it is the placer's, and valid now (EnrollRefused otherwise: do not enrol through it)."""
        c = self._placer_certs.get(der)
        if c is None:
            if len(der) > MAX_CERT_BYTES:
                raise EnrollRefused("oversized", "the placer's certificate is over its bound")
            c = check_cert(der, self.ca)
            if c.principal != "placer":
                raise EnrollRefused("bad_certificate", f"the certificate handed down is {c.principal}'s, not the placer's")
            if len(self._placer_certs) >= 16:
                self._placer_certs.clear()
            self._placer_certs[der] = c
        _valid(c, now)
        return c

    def make(self, report: NodeReport, placer_cert: bytes, *, now: float) -> tuple[Enroll, Pending]:
        """An enrolment of ``report`` (a full report; its node and boot are the enrolment's)."""
        pc = self.placer_public(placer_cert, now)
        nonce = os.urandom(NONCE_LEN)
        raw = msgspec.Raw(_enc.encode(report))
        if self._enrol_key is not None and self._fields is not None:   # keyed: the fields, no ECDH
            f = self._fields
            cd = f.digest()
            keys = derive(self._enrol_key, report.node_id, report.boot_id, nonce, cd, digest(placer_cert), keyed=True)
            e = Enroll(node_id=report.node_id, boot_id=report.boot_id, nonce=nonce, at=float(now), cert=b"",
                       report=raw, version=ENROLL_KEYED_VERSION, serial=f.serial, not_before=f.not_before,
                       not_after=f.not_after, rack=f.rack)
        else:
            cd = self._cert_digest
            shared = self._key.exchange(ec.ECDH(), pc.key)
            keys = derive(shared, report.node_id, report.boot_id, nonce, cd, digest(placer_cert))
            e = Enroll(node_id=report.node_id, boot_id=report.boot_id, nonce=nonce, at=float(now), cert=self.cert,
                       report=raw)
        e = msgspec.structs.replace(e, mac=enroll_mac(keys.mac, e, cd))
        return e, Pending(report.node_id, report.boot_id, keys.seal, answer_ad(report.node_id, report.boot_id, nonce))

    @staticmethod
    def open(p: Pending, a: EnrollAnswer) -> EnrollSecret:
        """The keys an answer carries for this enrolment; EnrollRefused when it was refused,
        or its sealed part does not open (a relay changed it), or names another node or boot."""
        if a.outcome != "enrolled":
            raise EnrollRefused(a.outcome, a.detail or "refused")
        s = open_sealed(p.seal_key, a.sealed, p.ad)
        if s.node_id != p.node_id or s.boot_id != p.boot_id or len(s.mac_key) != KEY_LEN or len(s.placer_key) != 32:
            raise EnrollRefused("malformed", "the sealed answer is for another node or boot")
        return s


# ---------------------------------------------------------------- from a daemon's TLS files

def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def desk_from_files(files: TLSFiles) -> EnrollDesk:
    """The placer's desk from its TLS files (``placer.crt``/``placer.key`` and the CA), and the
    enrolment master beside its key (``enrol.secret``), if there is one."""
    return EnrollDesk(load_cert(files.ca), load_key(files.key), _der(load_cert(files.cert)),
                      master=enrol_master(files.key.parent))


def client_from_files(files: TLSFiles, *, placer_certs: dict[bytes, CertOK] | None = None) -> EnrollClient:
    """A node's client from its TLS files (``node.crt``/``node.key`` and the CA), keyed when
    the enrolment key beside its key (``node.enrol``) is its certificate's."""
    cert = load_cert(files.cert)
    return EnrollClient(load_cert(files.ca), load_key(files.key), _der(cert), placer_certs=placer_certs,
                        enrol_key=load_enrol_key(files.key, cert))
