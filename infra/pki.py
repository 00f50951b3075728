"""The cluster's certificates: a CA, the placer's, the operator's and one per node (``cryptography``).

Keys are ECDSA P-256: every TLS stack verifies it (browsers and curl do not accept Ed25519
certificates, and operators reach the placer with both); OpenSSL's P-256 is constant-time and
fast enough that the handshake's cost is the round trips and the certificate checks, not the
signature (bench/fleet.py --tls measures it).

Layout of a PKI dir (``herd pki init DIR``)::

    DIR/ca.crt  ca.key          the cluster CA (10 years by default); ca.key never leaves this dir
    DIR/placer.crt  placer.key  the placer (server + client: it dials agents and relays)
    DIR/operator.crt  operator.key
    DIR/nodes/<id>/{ca.crt,node.crt,node.key}   one node's (``herd pki issue --node ID DIR``),
                                 the directory to copy to that host (its ``tls_dir``)
    DIR/bootstrap-tokens.json   single-use bootstrap tokens (hashes only; see BootstrapTokens)
    DIR/enrol.secret            the enrolment master (32 random bytes, 0600): whoever issues node
                                 certificates derives each one's enrolment key from it, and the
                                 placer checks keyed enrolments with it (copy it with placer.key)
    DIR/nodes/<id>/node.enrol   that node's enrolment key, bound to its certificate (0600)

Keys are written 0600 (dirs 0700), via a temp file renamed into place. A certificate's subject
common name is its principal (``placer``, ``node:<id>``, ``operator``, ``viewer``, ``metrics``;
:mod:`infra.tls`); a node's also has a SAN URI ``herd:node:<id>`` and SANs for its
addresses.

A node's rack (``zone/block/rack``) may be pinned in its certificate: a second SAN URI,
``herd:rack:<zone>/<block>/<rack>`` (:data:`RACK_URI`; ``herd pki issue --node ID --rack
Z/B/R``, or a bootstrap token made with ``--rack``). The placer then lets the node register
and relay in that rack only (placer.relaypolicy). Why a SAN URI and not a private extension:
the stdlib's ``getpeercert()``, which every handshake of ours already reads for the principal,
lists SAN URIs but not private extensions, so the rack comes with the principal at no extra
parse of the certificate (:func:`infra.tls.principal_of`); and ``openssl x509 -text`` shows it
to an operator as it is. Renewal keeps it (:func:`sign_csr` takes it from the certificate
presented, never from the request); only the operator changes it, by issuing again.

Bootstrap (kubelet TLS bootstrap): ``herd pki bootstrap-token --node ID`` stores the hash of a
fresh random token with its expiry and the node it is for (an unbound token takes ``--any-node``);
a new agent posts a CSR with the token once; the placer checks it without a lock or the CA key
(:meth:`BootstrapTokens.check`), then *consumes* it under a file lock (the store is rewritten and
fsynced before the certificate is returned), so a token works once even across placer restarts.
A node id that holds a live certificate (unexpired, not revoked: :class:`Issued`) is refused a
bootstrap: renewal over that certificate is the way to a new one.

Enrolment keys (scheduler_link.enroll, keyed enrolment): every node certificate issued here (by
``herd pki issue`` or the placer's bootstrap and renewal routes) comes with
``K_N = BLAKE3(key=master, "herd node enrol key v1" || node || serial || not_before ||
not_after || rack)`` (:func:`enrol_key`), kept beside the node's key as ``node.enrol`` with the
serial it is bound to. With it a node enrols through its relay with no public-key operation at
either end; the placer derives the same key from the enrolment's certificate fields and the master.

Revocation (:class:`Revocations`, ``DIR/revoked.json``): ``herd pki revoke NODE`` puts the node id
and the serials of every certificate issued to it on a deny-list that the placer loads into its
handshakes (:class:`infra.tls.Revoked`) and hands to the agents in its heartbeat answers.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import blake3
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .durable import atomic_write
from .tls import TLSFiles, norm_serial, parse_principal, parse_rack, send_leaf_only

NODE_DAYS = 365
CA_DAYS = 3650
TOKEN_TTL_S = 3600.0
_ORG = "herd"
RACK_URI = "herd:rack:"        # + zone/block/rack: the SAN URI that pins a node's rack


class PKIError(Exception):
    """A PKI operation that cannot be done: one line that says why."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(*, days: int = CA_DAYS, name: str = "herd cluster CA",
            not_before: dt.datetime | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = new_key()
    start = not_before or _now() - dt.timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def check_rack(rack: str) -> str:
    """``rack`` when it is a pinnable ``zone/block/rack`` (:func:`infra.tls.parse_rack`), else PKIError."""
    if parse_rack(rack) is None:
        raise PKIError(f"not a rack path: {rack[:200]!r} (want zone/block/rack: three non-empty levels of "
                       f"printable ASCII without spaces or '/', each at most 128 characters)")
    return rack


def cert_rack(cert: x509.Certificate) -> str | None:
    """The rack a certificate pins (its ``herd:rack:`` SAN URI), or None."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    racks = [u[len(RACK_URI):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
             if u.startswith(RACK_URI)]
    return racks[0] if len(racks) == 1 and parse_rack(racks[0]) is not None else None


def _sans(principal: str, names: Iterable[str], rack: str | None = None) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    if principal.startswith("node:"):
        out.append(x509.UniformResourceIdentifier(f"herd:{principal}"))
        if rack is not None:
            out.append(x509.UniformResourceIdentifier(RACK_URI + check_rack(rack)))
    elif rack is not None:
        raise PKIError(f"only a node's certificate pins a rack, not {principal}'s")
    seen: set[str] = set()
    for n in names:
        if not n or n in seen:
            continue
        seen.add(n)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def default_names() -> list[str]:
    """SANs every certificate gets so loopback and this host's name verify."""
    return ["localhost", "127.0.0.1", "::1", socket.gethostname()]


def sign(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, public_key: ec.EllipticCurvePublicKey,
         principal: str, *, days: int = NODE_DAYS, names: Iterable[str] = (),
         not_before: dt.datetime | None = None, rack: str | None = None) -> x509.Certificate:
    """A certificate for ``principal`` (its subject CN), usable as TLS server and client;
    ``rack`` (nodes only): the ``zone/block/rack`` it pins."""
    if parse_principal(principal) is None:
        raise PKIError(f"not a herd principal: {principal!r} (placer, node:<id>, operator, viewer, metrics)")
    if len(principal) > 64:
        raise PKIError(f"principal {principal!r} is over 64 characters (a certificate CN's limit)")
    start = not_before or _now() - dt.timedelta(minutes=5)
    end = min(start + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    b = (x509.CertificateBuilder().subject_name(_name(principal)).issuer_name(ca_cert.subject)
         .public_key(public_key).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                      content_commitment=False, key_encipherment=False,
                                      data_encipherment=False, key_agreement=False,
                                      encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                               ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]  # public_key() is typed as every key kind; a CA of ours is always EC, which it takes
                        critical=False))
    sans = _sans(principal, names, rack)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(ca_key, hashes.SHA256())


# ---------------------------------------------------------------- files

def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_pair(d: Path, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    atomic_write(d / f"{name}.key", key_pem(key), 0o600)
    atomic_write(d / f"{name}.crt", cert_pem(cert), 0o644)


# ---------------------------------------------------------------- enrolment keys

ENROL_SECRET = "enrol.secret"   # the enrolment master, beside ca.key (and placer.key)
ENROL_SUFFIX = ".enrol"         # a node's enrolment key: beside <name>.key as <name>.enrol
ENROL_KEY_LEN = 32
_ENROL_KDF = b"herd node enrol key v1\0"


def enrol_master(d: str | os.PathLike[str], *, create: bool = False) -> bytes | None:
    """The enrolment master in ``d`` (None: there is none, or the file is empty as systemd
    passes an absent credential; ``create``: made now, 0600)."""
    p = Path(d) / ENROL_SECRET
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raw = b""
    if len(raw) <= 1:
        if not create:
            return None
        raw = secrets.token_bytes(ENROL_KEY_LEN)
        atomic_write(p, raw, 0o600)
    if len(raw) != ENROL_KEY_LEN:
        raise PKIError(f"{p} is not a {ENROL_KEY_LEN}-byte enrolment master")
    return raw


def enrol_key(master: bytes, node_id: str, serial: str, not_before: float, not_after: float,
              rack: str | None) -> bytes:
    """K_N: a node certificate's enrolment key, bound to everything of it the placer reads
    (node, serial, validity, pinned rack), so that its holder cannot make it speak for another
    certificate: the placer derives it from the certificate an enrolment carries."""
    fields = [f.encode() for f in (node_id, norm_serial(serial), str(int(not_before)), str(int(not_after)), rack or "")]
    return blake3.blake3(_ENROL_KDF + b"".join(len(b).to_bytes(4, "big") + b for b in fields),
                         key=master).digest(ENROL_KEY_LEN)


def enrol_key_of(master: bytes, cert: x509.Certificate) -> bytes:
    """:func:`enrol_key` of a node certificate (as issued)."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    p = parse_principal(str(cns[0].value)) if cns else None
    if p is None or p.node_id is None:
        raise PKIError("an enrolment key is a node certificate's")
    return enrol_key(master, p.node_id, serial_hex(cert), cert.not_valid_before_utc.timestamp(),
                     cert.not_valid_after_utc.timestamp(), cert_rack(cert))


def write_enrol_key(key_path: str | os.PathLike[str], cert: x509.Certificate, key: bytes) -> Path:
    """``key`` (K_N of ``cert``) beside the node's private key ``key_path`` (0600), with the
    serial it is bound to."""
    p = Path(key_path).with_suffix(ENROL_SUFFIX)
    atomic_write(p, json.dumps({"serial": norm_serial(serial_hex(cert)), "key": key.hex()}).encode(), 0o600)
    return p


def load_enrol_key(key_path: str | os.PathLike[str], cert: x509.Certificate) -> bytes | None:
    """The enrolment key beside ``key_path`` if it is ``cert``'s (None: none, or one bound to
    another certificate: the node then enrols with its certificate's key, by ECDH)."""
    p = Path(key_path).with_suffix(ENROL_SUFFIX)
    try:
        raw = p.read_bytes()
        if len(raw) <= 1:   # (systemd's empty credential for an absent file)
            return None
        d = json.loads(raw)
        key = bytes.fromhex(d["key"])
        ok = d["serial"] == norm_serial(serial_hex(cert)) and len(key) == ENROL_KEY_LEN
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PKIError(f"{p} is not an enrolment key: {e}") from None
    return key if ok else None


def load_cert(path: str | os.PathLike[str]) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except FileNotFoundError:
        raise PKIError(f"certificate not found: {path}") from None
    except ValueError as e:
        raise PKIError(f"{path} is not a PEM certificate: {e}") from None


def load_key(path: str | os.PathLike[str]) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise PKIError(f"key not found: {path}") from None
    except (ValueError, TypeError) as e:
        raise PKIError(f"{path} is not an unencrypted PEM key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{path}: herd keys are ECDSA P-256")
    return key


@dataclass(frozen=True, slots=True)
class CA:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def load(cls, d: str | os.PathLike[str]) -> CA:
        p = Path(d)
        if not (p / "ca.key").exists():
            raise PKIError(f"no CA in {p} (ca.key missing): run `herd pki init {p}` first")
        return cls(load_key(p / "ca.key"), load_cert(p / "ca.crt"))

    def issue(self, principal: str, *, days: int = NODE_DAYS, names: Iterable[str] = (),
              not_before: dt.datetime | None = None,
              rack: str | None = None) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = new_key()
        return key, sign(self.key, self.cert, key.public_key(), principal, days=days, names=names,
                         not_before=not_before, rack=rack)


def init(d: str | os.PathLike[str], *, ca_days: int = CA_DAYS, days: int = NODE_DAYS,
         names: Iterable[str] = (), force: bool = False) -> CA:
    """``herd pki init``: the CA, ``placer`` (server names: ``names`` + loopback + hostname)
    and ``operator``. An existing CA is never overwritten unless ``force``."""
    p = Path(d)
    if (p / "ca.key").exists() and not force:
        raise PKIError(f"{p} already holds a CA (ca.key); refusing to overwrite it (--force replaces it, "
                       "and every certificate it signed stops verifying)")
    p.mkdir(parents=True, exist_ok=True)
    os.chmod(p, 0o700)
    for stale in ("issued.json", "revoked.json"):   # about the certificates of the CA replaced
        (p / stale).unlink(missing_ok=True)
    ca_key, ca_cert = make_ca(days=ca_days)
    write_pair(p, "ca", ca_key, ca_cert)
    (p / ENROL_SECRET).unlink(missing_ok=True)   # (the keys of the CA replaced go with it)
    enrol_master(p, create=True)
    ca = CA(ca_key, ca_cert)
    all_names = [*names, *default_names()]
    for principal in ("placer", "operator"):
        k, c = ca.issue(principal, days=days, names=all_names if principal == "placer" else ())
        write_pair(p, principal, k, c)
    return ca


def issue_node(d: str | os.PathLike[str], node_id: str, *, days: int = NODE_DAYS,
               names: Iterable[str] = (), rack: str | None = None) -> Path:
    """``herd pki issue --node ID [--rack Z/B/R]``: ``DIR/nodes/<id>/`` with ca.crt, node.crt,
    node.key; ``rack``: the rack the certificate pins (issuing again is how an operator moves it)."""
    ca = CA.load(d)
    if not node_id or "/" in node_id:
        raise PKIError(f"node id must be non-empty without '/': {node_id!r}")
    if rack is not None:
        check_rack(rack)
    out = Path(d) / "nodes" / node_id
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    k, c = ca.issue(f"node:{node_id}", days=days, names=[*names, *default_names()], rack=rack)
    Issued(Path(d)).record(node_id, c, now=_now().timestamp())
    write_pair(out, "node", k, c)
    master = enrol_master(d, create=True)
    assert master is not None
    write_enrol_key(out / "node.key", c, enrol_key_of(master, c))
    atomic_write(out / "ca.crt", cert_pem(ca.cert), 0o644)
    return out


def issue_role(d: str | os.PathLike[str], principal: str, *, days: int = NODE_DAYS,
               names: Iterable[str] = ()) -> Path:
    """A certificate for ``viewer`` / ``metrics`` / ``operator`` (client) or ``placer`` (a
    re-issue; server names ``names`` + loopback + hostname) into ``DIR/<kind>.{crt,key}``."""
    ca = CA.load(d)
    k, c = ca.issue(principal, days=days, names=[*names, *default_names()] if principal == "placer" else ())
    name = principal.replace(":", "-")
    write_pair(Path(d), name, k, c)
    return Path(d) / f"{name}.crt"


# ---------------------------------------------------------------- CSRs (bootstrap, renewal)

def make_csr(node_id: str, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[ec.EllipticCurvePrivateKey, bytes]:
    key = key or new_key()
    csr = (x509.CertificateSigningRequestBuilder().subject_name(_name(f"node:{node_id}"))
           .sign(key, hashes.SHA256()))
    return key, csr.public_bytes(serialization.Encoding.PEM)


def sign_csr(ca: CA, csr_pem: bytes, node_id: str, *, days: int = NODE_DAYS,
             names: Iterable[str] = (), rack: str | None = None) -> x509.Certificate:
    """Sign a node's CSR; it must be self-signed correctly and name ``node:<node_id>`` (the CSR
    asks, the caller decides which node it may be: the token's node or the renewing cert's).
    ``rack``: the rack the certificate pins, the caller's too (the bootstrap token's, or the
    renewing certificate's); whatever the CSR carries besides its subject is not copied."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise PKIError(f"not a PEM certificate request: {e}") from None
    try:
        ok = csr.is_signature_valid
    except InvalidSignature:
        ok = False
    if not ok:
        raise PKIError("the certificate request's signature does not verify")
    cns = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    want = f"node:{node_id}"
    if len(cns) != 1 or cns[0].value != want:
        raise PKIError(f"the certificate request names {[c.value for c in cns]}, not {want}")
    pub = csr.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.name != "secp256r1":
        raise PKIError("herd node keys are ECDSA P-256")
    return sign(ca.key, ca.cert, pub, want, days=days, names=names, rack=rack)


# ---------------------------------------------------------------- bootstrap tokens

def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class BootstrapTokens:
    """Single-use, short-lived tokens in one JSON file (hashes only), under an exclusive file
    lock for every read-modify-write: the CLI adds while the placer consumes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def _locked(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _read(self) -> dict[str, dict[str, object]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except ValueError as e:
            raise PKIError(f"bootstrap token store {self.path} is corrupt: {e}") from None
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("tokens"), dict):
            raise PKIError(f"bootstrap token store {self.path} has an unknown format")
        return data["tokens"]

    def _save(self, tokens: dict[str, dict[str, object]]) -> None:
        atomic_write(self.path, json.dumps({"version": 1, "tokens": tokens}, sort_keys=True).encode(), 0o600)

    def create(self, *, ttl_s: float = TOKEN_TTL_S, node_id: str | None = None, rack: str | None = None,
               now: float) -> str:
        """A fresh token valid ``ttl_s`` (for ``node_id`` only, when given); ``rack``: the rack
        the certificate it buys pins (:data:`RACK_URI`)."""
        if rack is not None:
            check_rack(rack)
        token = "hb1." + secrets.token_urlsafe(24)
        fd = self._locked()
        try:
            tokens = self._read()
            # forget tokens long dead (used or expired more than a day ago)
            tokens = {k: v for k, v in tokens.items() if float(v["expires"]) > now - 86400}  # type: ignore[arg-type]  # the token file's values are JSON (typed object); expires is a number we wrote
            tokens[_digest(token)] = {"expires": now + ttl_s, "node_id": node_id, "used_by": None,
                                      "used_at": None, "created": now, "rack": rack}
            self._save(tokens)
        finally:
            os.close(fd)
        return token

    @staticmethod
    def _entry_refusal(tokens: dict[str, dict[str, object]], token: str, node_id: str,
                       now: float) -> tuple[dict[str, object] | None, str | None]:
        d = _digest(token)
        entry = next((v for k, v in tokens.items() if hmac.compare_digest(k, d)), None)
        if entry is None:
            return None, "unknown bootstrap token"
        if entry["used_by"] is not None:
            return entry, f"bootstrap token already used (by node {entry['used_by']})"
        if float(entry["expires"]) <= now:  # type: ignore[arg-type]  # the token file's values are JSON (typed object); expires is a number we wrote
            return entry, "bootstrap token expired"
        if entry["node_id"] is not None and entry["node_id"] != node_id:
            return entry, f"bootstrap token is for node {entry['node_id']}, not {node_id}"
        return entry, None

    def check(self, token: str, node_id: str, *, now: float) -> None:
        """:meth:`consume`'s checks without its lock or its write: the store is replaced by
        rename, so a reader sees a whole version. A caller checks first and consumes after,
        so an unknown token costs neither the lock nor the CA key."""
        _, why = self._entry_refusal(self._read(), token, node_id, now)
        if why is not None:
            raise PKIError(why)

    def consume(self, token: str, node_id: str, *, now: float) -> str | None:
        """Use ``token`` for ``node_id`` (once); :class:`PKIError` when unknown, expired, used,
        or bound to another node. The use is on disk before this returns. Returns the rack the
        token's certificate pins (None: none)."""
        fd = self._locked()
        try:
            tokens = self._read()
            entry, why = self._entry_refusal(tokens, token, node_id, now)
            if why is not None or entry is None:
                raise PKIError(why or "unknown bootstrap token")
            entry["used_by"], entry["used_at"] = node_id, now
            self._save(tokens)
        finally:
            os.close(fd)
        rack = entry.get("rack")
        return rack if isinstance(rack, str) else None

    def list(self) -> list[dict[str, object]]:
        fd = self._locked()
        try:
            return [dict(v, id=k[:12]) for k, v in sorted(self._read().items())]
        finally:
            os.close(fd)


# ---------------------------------------------------------------- issued certificates, revocation

def serial_hex(cert: x509.Certificate) -> str:
    """A certificate's serial in the deny-list's form (:func:`infra.tls.norm_serial`)."""
    return format(cert.serial_number, "X")


class _LockedJSON:
    """One small JSON file of the PKI dir, rewritten whole (temp file, fsync, rename) under an
    exclusive lock file; readers need no lock (they see one whole version)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")

    def read(self) -> dict[str, object]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": 1}
        except ValueError as e:
            raise PKIError(f"{self.path} is corrupt: {e}") from None
        if not isinstance(data, dict) or data.get("version") != 1:
            raise PKIError(f"{self.path} has an unknown format")
        return data

    def update(self, change: Callable[[dict[str, object]], None]) -> dict[str, object]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self.read()
            change(data)
            atomic_write(self.path, json.dumps(data, sort_keys=True).encode(), 0o600)
            return data
        finally:
            os.close(fd)


class Issued:
    """``DIR/issued.json``: per node id, the serials and expiry of the certificates the CA
    issued to it (``herd pki issue``, bootstrap, renewal), expired ones pruned on each write.
    Read at bootstrap (a node holding a live certificate is refused) and by ``herd pki revoke``
    (which serials to deny)."""

    def __init__(self, d: str | os.PathLike[str]) -> None:
        self.file = _LockedJSON(Path(d) / "issued.json")

    def record(self, node_id: str, cert: x509.Certificate, *, now: float,
               unless_live: tuple[frozenset[str], frozenset[str]] | None = None) -> list[str]:
        """Record ``cert`` as issued to ``node_id``. With ``unless_live`` (the deny-list), only
        when the node holds no live certificate, checked under the same lock (two bootstraps
        of one node at once: one wins): the live serials found instead, nothing recorded."""
        entry = {"serial": serial_hex(cert), "not_after": cert.not_valid_after_utc.timestamp()}
        found: list[str] = []

        def change(data: dict[str, object]) -> None:
            nodes = data.setdefault("nodes", {})
            assert isinstance(nodes, dict)
            for nid in list(nodes):
                nodes[nid] = [e for e in nodes[nid] if float(e["not_after"]) > now]
                if not nodes[nid]:
                    del nodes[nid]
            if unless_live is not None and node_id not in unless_live[0]:
                found.extend(str(e["serial"]) for e in nodes.get(node_id, [])
                             if str(e["serial"]) not in unless_live[1])
                if found:
                    return
            nodes.setdefault(node_id, []).append(entry)
        self.file.update(change)
        return found

    def of(self, node_id: str, *, now: float) -> list[tuple[str, float]]:
        """(serial, not_after) of the node's certificates that have not expired."""
        nodes = self.file.read().get("nodes", {})
        assert isinstance(nodes, dict)
        return [(str(e["serial"]), float(e["not_after"])) for e in nodes.get(node_id, [])
                if float(e["not_after"]) > now]

    def live(self, node_id: str, revoked: tuple[frozenset[str], frozenset[str]], *, now: float) -> list[str]:
        """Serials of the node's unexpired certificates that are not revoked (``revoked``:
        the (nodes, serials) of :meth:`Revocations.load`)."""
        if node_id in revoked[0]:
            return []
        return [s for s, _ in self.of(node_id, now=now) if s not in revoked[1]]


class Revocations:
    """``DIR/revoked.json``: the deny-list, node ids and certificate serials. Durable (temp
    file, fsync, rename) before :meth:`revoke` returns."""

    def __init__(self, d: str | os.PathLike[str]) -> None:
        self.dir = Path(d)
        self.file = _LockedJSON(self.dir / "revoked.json")

    @property
    def path(self) -> Path:
        return self.file.path

    def load(self) -> tuple[frozenset[str], frozenset[str]]:
        data = self.file.read()
        nodes, serials = data.get("nodes", {}), data.get("serials", {})
        assert isinstance(nodes, dict) and isinstance(serials, dict)
        return frozenset(nodes), frozenset(norm_serial(s) for s in serials)

    def revoke(self, node_id: str | None = None, *, serials: Iterable[str] = (), now: float) -> list[str]:
        """Deny ``node_id`` (and every certificate issued to it that has not expired) and/or
        the given serials. Returns the serials denied by this call."""
        denied = [norm_serial(s) for s in serials]
        if node_id is not None:
            denied += [s for s, _ in Issued(self.dir).of(node_id, now=now)]

        def change(data: dict[str, object]) -> None:
            nodes = data.setdefault("nodes", {})
            sers = data.setdefault("serials", {})
            assert isinstance(nodes, dict) and isinstance(sers, dict)
            if node_id is not None:
                nodes[node_id] = {"at": now}
            for s in denied:
                sers.setdefault(s, {"node": node_id, "at": now})
        self.file.update(change)
        return denied

    def lift(self, node_id: str) -> bool:
        """Take ``node_id`` off the deny-list (its revoked serials stay revoked: the node needs
        a new certificate). False when it was not on it."""
        if node_id not in self.load()[0]:
            return False

        def change(data: dict[str, object]) -> None:
            nodes = data.setdefault("nodes", {})
            assert isinstance(nodes, dict)
            nodes.pop(node_id, None)
        self.file.update(change)
        return True


# ---------------------------------------------------------------- status

@dataclass(frozen=True, slots=True)
class CertInfo:
    path: str
    subject: str
    not_before: dt.datetime
    not_after: dt.datetime
    rack: str | None = None          # the rack a node's certificate pins

    def days_left(self, now: dt.datetime | None = None) -> float:
        return (self.not_after - (now or _now())).total_seconds() / 86400


def cert_info(path: Path) -> CertInfo:
    c = load_cert(path)
    cns = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return CertInfo(str(path), str(cns[0].value) if cns else c.subject.rfc4514_string(),
                    c.not_valid_before_utc, c.not_valid_after_utc, cert_rack(c))


def status(d: str | os.PathLike[str]) -> list[CertInfo]:
    """Every certificate under a PKI dir, soonest expiry first."""
    p = Path(d)
    found = sorted(p.glob("*.crt")) + sorted(p.glob("nodes/*/node.crt"))
    return sorted((cert_info(f) for f in found), key=lambda i: i.not_after)


def needs_renewal(cert: x509.Certificate, *, fraction: float = 1 / 3, now: dt.datetime | None = None) -> bool:
    """True once less than ``fraction`` of the certificate's lifetime is left."""
    now = now or _now()
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - now < life * fraction


# ---------------------------------------------------------------- a throwaway CA for tests and demos

@dataclass(frozen=True, slots=True)
class ThrowawayPKI:
    """A PKI dir made by :func:`throwaway`: :meth:`files` for a principal's TLS material."""
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def files(self, principal: str) -> TLSFiles:
        if principal.startswith("node:"):
            node = principal.removeprefix("node:")
            if not (self.dir / "nodes" / node / "node.crt").exists():
                issue_node(self.dir, node, days=30)
            return TLSFiles.in_dir(self.dir / "nodes" / node, "node")
        name = principal.replace(":", "-")
        if not (self.dir / f"{name}.crt").exists():
            issue_role(self.dir, principal, days=30)
        return TLSFiles.in_dir(self.dir, name)

    def node_dir(self, node_id: str) -> Path:
        self.files(f"node:{node_id}")
        return self.dir / "nodes" / node_id


def throwaway(d: str | os.PathLike[str], *, nodes: Iterable[str] = ()) -> ThrowawayPKI:
    """A fresh CA with placer and operator certificates in ``d`` (30-day certs), plus nodes."""
    init(d, ca_days=30, days=30, force=True)
    t = ThrowawayPKI(Path(d))
    for n in nodes:
        t.files(f"node:{n}")
    return t


class NodeContexts:
    """Client TLS contexts for many emulated nodes of one process (the fleet emulator): each
    node's certificate issued in memory from the PKI dir's CA when first asked for, its key
    and chain passed to OpenSSL through a private temp file removed at once."""

    def __init__(self, d: str | os.PathLike[str], *, days: int = 30) -> None:
        import tempfile

        self.ca = CA.load(d)
        self.days = days
        self.enrol_master = enrol_master(d)   # (None: the nodes enrol by ECDH)
        self._ca_pem = cert_pem(self.ca.cert).decode()
        self._tmp = Path(tempfile.mkdtemp(prefix="herd-node-ctx-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                          else None))

    def context(self, node_id: str) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        return self._with_identity(ctx, node_id)

    def server_context(self, node_id: str) -> ssl.SSLContext:
        """The node's side of its control API (``https://``, as an agent serves it): its own
        certificate; the client's (the placer's) required and checked against the CA."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.num_tickets = 0
        return self._with_identity(ctx, node_id)

    def _with_identity(self, ctx: ssl.SSLContext, node_id: str) -> ssl.SSLContext:
        key, cert = self.ca.issue(f"node:{node_id}", days=self.days)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_verify_locations(cadata=self._ca_pem)
        p = self._tmp / f"{os.getpid()}-{secrets.token_hex(4)}.pem"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, key_pem(key) + cert_pem(cert))
        finally:
            os.close(fd)
        try:
            ctx.load_cert_chain(str(p))
        finally:
            p.unlink(missing_ok=True)
        send_leaf_only(ctx)
        return ctx

    def close(self) -> None:
        import shutil
        shutil.rmtree(self._tmp, ignore_errors=True)
