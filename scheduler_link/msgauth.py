"""Message-level authentication: what a rack relay carries it can delay or drop, never forge.

Theory of operation (DESIGN.md, Security model; issue 17 §1)
------------------------------------------------------------
TLS (infra.tls) authenticates each *connection*; a relay sits between the placer
and its rack's members, so what crosses it is authenticated here, per message:

- **Up (member -> relay -> placer): keyed BLAKE3 MACs.** Node X holds a 32-byte key K_X it
  received in the answer to a full report over its own connection, or sealed to it in the
  answer to its enrolment through its relay (scheduler_link.enroll: the relay cannot read it).
  Every report, heartbeat and placement outcome a relay forwards for X carries
  ``MAC = BLAKE3(key=K_X, kind || canonical bytes)[:16]``; the placer recomputes and
  compares in constant time, and drops (and counts) what does not verify.
  K_X is *derived*, not stored: ``K_X = BLAKE3(key=master, "herd node mac v1" || X || boot)``
  with ``master`` 32 random bytes in the placer's state dir (0600, made once). So the key is
  fresh for every agent boot (a restarted agent registers directly and gets a new one), the
  placer keeps no per-node secret and journals nothing, and a restarted placer still verifies
  what relays forward for nodes that have not re-registered yet (their boot id is in the
  report). Whoever holds the placer's state dir is the placer anyway (its signing key is there).
- **Down (placer -> relay -> member): one Ed25519 signature per batch of rack bundles.** A
  bundle's *header* is (rack, blob id, deliver_by, the BLAKE3 of each part's bytes exactly as
  encoded in the bundle, and the placer's epoch: scheduler_link.epochs); the placer signs the root of a Merkle tree over the headers of the
  bundles it builds together (up to 32), and each bundle carries its header's path to that
  root (5 hashes). The relay checks path and signature before acting; it hands each member its part
  with a :class:`~scheduler_link.messages.PartProof` (the header, the signature, the part's own
  bytes), and the member checks its bytes' digest is listed and the signature holds before
  acting. Signing what was sent and verifying what was received (never a re-encoding) keeps the
  check exact whatever the encoder does with an int in a float field. The placer's public key
  reaches agents in the same registration answer as their MAC key.
- **Stops a relay passes down** (fencing stops in answers to relayed reports and in beat
  replies) carry the placer's MAC with the member's own key (the placer holds K_X too), one per
  victim, over the placer's epoch, the attempt its workload id names and an expiry too; the
  member acts only on those that verify and are unexpired (:func:`stop_binding`). What else a
  relay could change in an answer (need_full, the interval, relay_url, its epoch) can only
  delay or reroute reports, as dropping them could; a relayed answer's keys and ``wire_url``
  are never taken, and its epoch is compared, never taken (scheduler_link.epochs).

Costs: a MAC is one BLAKE3 call over tens to hundreds of bytes (~2 us here); a batch of bundles
is one signature plus a BLAKE3 per part and per tree node at the placer, one verification per
relay and per member (a receiver that already verified the batch's root skips it).
Measured in ``bench/msgauth.py``.
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path
from typing import NamedTuple

import blake3
import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from infra.durable import atomic_write
from infra.errors import AuthError as AuthError  # (defined with the package's other errors)
from infra.grants import make_grant

from .messages import MAC_LEN as MAC_LEN
from .messages import (
    NodeOutcome,
    NodePart,
    NodeReport,
    PartProof,
    PlacementOutcome,
    RackBundle,
    RevokedList,
    Victim,
    expand_part,
    parse_workload_id,
)

log = logging.getLogger("herd.link.msgauth")

KEY_LEN = 32
_KDF = b"herd node mac v1\0"
_BUNDLE = b"herd rack bundle v1\0"
_REVOKED = b"herd deny-list v1\0"
MASTER_FILE = "node-mac.secret"
SIGNING_FILE = "placer-signing.key"

_canon = msgspec.msgpack.Encoder(order="deterministic")
_report_dec = msgspec.msgpack.Decoder(NodeReport)
_part_dec = msgspec.msgpack.Decoder(NodePart)
_enc = msgspec.msgpack.Encoder()     # the frames encoder's settings: a part's bytes as the bundle carries them


# ---------------------------------------------------------------- MACs (up)

def node_key(master: bytes, node_id: str, boot_id: str) -> bytes:
    """K_X for (node, boot): what the placer gives X at registration and checks X's MACs with."""
    return blake3.blake3(_KDF + node_id.encode() + b"\0" + boot_id.encode(), key=master).digest(KEY_LEN)


def _mac(key: bytes, data: bytes) -> bytes:
    return blake3.blake3(data, key=key).digest(MAC_LEN)


def beat_mac(key: bytes, node_id: str, boot_id: str, seq: int) -> bytes:
    """An empty heartbeat's MAC: what a relay's RackBeat entry carries (node, boot, seq)."""
    return _mac(key, b"beat\0%s\0%s\0%d" % (node_id.encode(), boot_id.encode(), seq))


def beat_macs(keys: list[bytes], node_ids: list[str], boot_ids: list[str], seqs: list[int]) -> bytes:
    """:func:`beat_mac` of each entry, joined: what a relay's RackBeat (its ``macs`` joined) is
    checked against in one comparison."""
    b3 = blake3.blake3
    return b"".join([b3(b"beat\0%s\0%s\0%d" % (n.encode(), b.encode(), s), key=k).digest(MAC_LEN)
                     for k, n, b, s in zip(keys, node_ids, boot_ids, seqs, strict=True)])


def _is_empty(rep: NodeReport) -> bool:
    return not rep.full and not rep.events and rep.snapshot is None and rep.manifests is None


def _report_bytes(rep: NodeReport) -> bytes:
    return b"report\0" + _canon.encode(msgspec.structs.replace(rep, mac=b""))


def report_mac(key: bytes, rep: NodeReport) -> bytes:
    """The MAC of a report as the placer checks it: an empty heartbeat's is :func:`beat_mac`
    (a relay folds those into a RackBeat), any other's covers its canonical bytes."""
    if _is_empty(rep):
        return beat_mac(key, rep.node_id, rep.boot_id, rep.seq)
    return _mac(key, _report_bytes(rep))


def with_report_mac(key: bytes, rep: NodeReport) -> NodeReport:
    """``rep`` with its MAC, normalised first (one msgpack round trip: an int in a float field
    becomes the float the placer will decode, so the placer's bytes are these bytes)."""
    if not _is_empty(rep):
        rep = _report_dec.decode(_canon.encode(msgspec.structs.replace(rep, mac=b"")))
    return msgspec.structs.replace(rep, mac=report_mac(key, rep))


def report_ok(key: bytes, rep: NodeReport) -> bool:
    return bool(rep.mac) and hmac.compare_digest(rep.mac, report_mac(key, rep))


def outcome_mac(key: bytes, o: NodeOutcome) -> bytes:
    """Over every field but the MAC (a msgpack array: unambiguous, and cheaper than the struct)."""
    return _mac(key, b"ack\0" + _canon.encode((o.node_id, o.placement_id, o.outcome, o.refused_gpus, o.detail)))


def accepted_macs(keys: list[bytes], node_ids: list[str], placement_ids: list[str]) -> bytes:
    """The MACs of plain acceptances (:func:`outcome_mac` of ``NodeOutcome(node_id=...,
    placement_id=..., outcome="accepted")``), one per node, joined: what a rack's aggregate
    ack (AckBundle.accepted and .macs) is checked against in one comparison."""
    enc, b3 = _canon.encode, blake3.blake3
    return b"".join([b3(b"ack\0" + enc((n, p, "accepted", _NO_GPUS, None)), key=k).digest(MAC_LEN)
                     for k, n, p in zip(keys, node_ids, placement_ids, strict=True)])


_NO_GPUS: tuple[str, ...] = ()


def with_outcome_mac(key: bytes, o: NodeOutcome) -> NodeOutcome:
    return msgspec.structs.replace(o, mac=outcome_mac(key, o))


def outcome_ok(key: bytes, o: NodeOutcome) -> bool:
    return bool(o.mac) and hmac.compare_digest(o.mac, outcome_mac(key, o))


def stop_mac(key: bytes, node_id: str, boot_id: str, v: Victim) -> bytes:
    """Over the node, its boot, the victim, the placer epoch that asks and the stop's attempt
    and expiry (a stop of epoch 0, from a placer without epochs, is MACed as before epochs
    existed; one without an attempt or expiry as before they existed: a relay that strips them
    changes the MAC)."""
    fields: tuple[object, ...] = (node_id, boot_id, v.workload_id, float(v.grace_s), v.reason)
    if v.epoch:
        fields = (*fields, v.epoch)
    if v.attempt or v.expires_at:
        fields = (*fields, v.attempt, float(v.expires_at))
    return _mac(key, b"stop\0" + _canon.encode(fields))


def stop_attempt(workload_id: str) -> int:
    """The attempt a placer-made workload id (``<job>.<attempt>.<rank>``) names; 0 if none."""
    parsed = parse_workload_id(workload_id)
    return parsed[1] if parsed is not None else 0


def bound_stop(v: Victim, epoch: int, expires_at: float) -> Victim:
    """``v`` as an epoch-aware placer sends it in an answer: of its ``epoch``, for the attempt
    its workload id names, expiring at ``expires_at`` (unix seconds)."""
    return msgspec.structs.replace(v, epoch=epoch, attempt=stop_attempt(v.workload_id), expires_at=expires_at)


class StopRefusal(NamedTuple):
    """Why a relayed stop whose MAC verified is not acted on (a structured outcome)."""
    workload_id: str
    outcome: PlacementOutcome       # "expired" | "refused_spec"
    detail: str


def stop_binding(v: Victim, now: float) -> StopRefusal | None:
    """Why a stop that came through a relay (its MAC verified: :func:`verified_stops`) may not
    act at ``now`` (unix seconds; None: it may). A stop of an epoch-aware placer must carry an
    expiry and the attempt its workload id names (else ``refused_spec``) and be used before
    its expiry (else ``expired``, no late window): a relay that held one back can replay it
    only until then, never to a later attempt's pod. A stop of epoch 0 (a placer without
    epochs) is bound by its MAC alone: the node, its boot and the workload."""
    if not v.epoch:
        return None
    if not v.expires_at:
        return StopRefusal(v.workload_id, "refused_spec", "a stop must carry an expiry")
    named = stop_attempt(v.workload_id)
    if v.attempt != named:
        return StopRefusal(v.workload_id, "refused_spec", f"a stop of attempt {v.attempt} names {v.workload_id}")
    if now > v.expires_at:
        return StopRefusal(v.workload_id, "expired", f"stop expired {now - v.expires_at:.3f}s ago")
    return None


def epoch_mac(key: bytes, node_id: str, boot_id: str, epoch: int) -> bytes:
    """The placer's MAC over its epoch in an answer a relay carries to the node (the member then
    takes the epoch as if the answer had come over its own connection)."""
    return _mac(key, b"epoch\0%s\0%s\0%d" % (node_id.encode(), boot_id.encode(), epoch))


def epoch_ok(key: bytes | None, node_id: str, boot_id: str, epoch: int, mac: bytes) -> bool:
    return key is not None and bool(mac) and hmac.compare_digest(mac, epoch_mac(key, node_id, boot_id, epoch))


def with_stop_macs(key: bytes, node_id: str, boot_id: str, victims: list[Victim]) -> list[Victim]:
    return [msgspec.structs.replace(v, mac=stop_mac(key, node_id, boot_id, v)) for v in victims]


def verified_stops(key: bytes | None, node_id: str, boot_id: str, victims: list[Victim]) -> tuple[list[Victim], int]:
    """(the victims whose MAC verifies, how many did not): what a member acts on from its relay."""
    if key is None:
        return [], len(victims)
    ok = [v for v in victims if v.mac and hmac.compare_digest(v.mac, stop_mac(key, node_id, boot_id, v))]
    return ok, len(victims) - len(ok)


class RelayedStops(NamedTuple):
    """What a member makes of the stops its relay carried: those to act on, how many had no
    valid placer MAC, and those whose MAC held but whose binding did not (:func:`stop_binding`)."""
    ok: list[Victim]
    forged: int
    refused: list[StopRefusal]


def relayed_stops(key: bytes | None, node_id: str, boot_id: str, victims: list[Victim], now: float) -> RelayedStops:
    """The stops a relay carried to ``node_id`` (in its ``boot_id``), checked: MAC, then binding."""
    verified, forged = verified_stops(key, node_id, boot_id, victims)
    ok: list[Victim] = []
    refused: list[StopRefusal] = []
    for v in verified:
        why = stop_binding(v, now)
        if why is None:
            ok.append(v)
        else:
            refused.append(why)
    return RelayedStops(ok, forged, refused)


# ---------------------------------------------------------------- signatures (down)

def part_bytes(part: NodePart) -> bytes:
    """A part's bytes as a bundle carries them (what its digest is over)."""
    return _enc.encode(part)


def header_bytes(rack: str, blob_id: str, deliver_by: float, digests: list[bytes], epoch: int = 0) -> bytes:
    """A bundle's signed header. The placer's epoch is its fifth field (absent at epoch 0, so a
    bundle of a placer without epochs verifies as before; a relay that changes the epoch, to
    0 or anything else, changes the header and the signature no longer holds)."""
    fields: list[object] = [rack, blob_id, float(deliver_by), digests]
    if epoch:
        fields.append(epoch)
    return _BUNDLE + _canon.encode(fields)


def digest(raw: bytes) -> bytes:
    return blake3.blake3(raw).digest()


# The signed message: the root of a Merkle tree over the headers of the bundles signed
# together (one Ed25519 signature per batch, not per bundle: ~70 us each here, 2,778 of them in
# a 50,000-tray round). Leaves and inner nodes hash under distinct prefixes (a header cannot pass
# for an inner node), the leaves are padded to a power of two with a value no header hashes to,
# and a path is at most MAX_SIG_DEPTH long.
_LEAF, _NODE, _PAD = b"\0", b"\1", blake3.blake3(b"\2herd merkle pad").digest()
_ROOT = b"herd bundle batch v1\0"
MAX_SIG_DEPTH = 16


def _leaf(header: bytes) -> bytes:
    return blake3.blake3(_LEAF + header).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return blake3.blake3(_NODE + left + right).digest()


def merkle_paths(leaves: list[bytes]) -> tuple[bytes, list[list[bytes]]]:
    """(the root over ``leaves``, each leaf's path: its siblings, leaf level first)."""
    level = list(leaves)
    width = 1
    while width < len(level):
        width *= 2
    level += [_PAD] * (width - len(level))
    paths: list[list[bytes]] = [[] for _ in leaves]
    pos = list(range(len(leaves)))
    while len(level) > 1:
        for i, p in enumerate(pos):
            paths[i].append(level[p ^ 1])
            pos[i] = p >> 1
        level = [_node(level[k], level[k + 1]) for k in range(0, len(level), 2)]
    return level[0], paths


def merkle_root(leaf: bytes, path: list[bytes], index: int) -> bytes:
    """The root a leaf's path leads to (AuthError if it cannot be one of a signed tree's)."""
    if len(path) > MAX_SIG_DEPTH or not 0 <= index < (1 << len(path)):
        raise AuthError("a malformed signature path")
    h = leaf
    for k, sib in enumerate(path):
        h = _node(sib, h) if (index >> k) & 1 else _node(h, sib)
    return h


class BundleSpec(NamedTuple):
    """A RackBundle to be signed with others (:meth:`BundleSigner.bundles_raw`): its parts as
    the bytes the bundle carries (:func:`part_bytes` of each)."""
    rack: str
    blob_id: str
    raws: list[bytes]
    deliver_by: float
    blob: bytes | None = None
    blob_sources: list[str] = []
    epoch: int = 0                        # the placer's epoch (signed with the header)


class BundleSigner:
    """The placer's Ed25519 key: signs rack bundles."""

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.signed = 0

    @classmethod
    def generate(cls) -> BundleSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes, where: str) -> BundleSigner:
        """A signer from its PKCS#8 PEM (:class:`AuthError` naming ``where`` when it is not an Ed25519 key)."""
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except ValueError as e:
            raise AuthError(f"{where} is not a PEM private key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise AuthError(f"{where} is not an Ed25519 key")
        return cls(key)

    def private_pem(self) -> bytes:
        """The private key, PKCS#8 PEM (to share it with the other placers of an HA cluster)."""
        return self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption())

    def sign_parts(self, rack: str, blob_id: str, deliver_by: float, raws: list[bytes], epoch: int = 0) -> bytes:
        """The signature over one bundle alone (a tree of one leaf: an empty path) whose parts
        are encoded as ``raws``."""
        return self.sign_headers([header_bytes(rack, blob_id, deliver_by, [digest(r) for r in raws], epoch)])[0]

    def sign_headers(self, headers: list[bytes]) -> tuple[bytes, list[list[bytes]]]:
        """One signature over many bundles' headers: (it, each header's path to the root)."""
        if not headers or len(headers) > 1 << MAX_SIG_DEPTH:
            raise ValueError(f"1 to {1 << MAX_SIG_DEPTH} headers are signed together, not {len(headers)}")
        root, paths = merkle_paths([_leaf(h) for h in headers])
        self.signed += 1
        return self._key.sign(_ROOT + root), paths

    def bundles_raw(self, specs: list[BundleSpec]) -> list[RackBundle]:
        """Several signed RackBundles, one signature for all (a Merkle root over their headers)."""
        sig, paths = self.sign_headers([header_bytes(sp.rack, sp.blob_id, sp.deliver_by, [digest(r) for r in sp.raws],
                                                     sp.epoch) for sp in specs])
        return [RackBundle(rack=sp.rack, blob_id=sp.blob_id, parts=[msgspec.Raw(r) for r in sp.raws],  # type: ignore[misc]  # parts are signed raw bytes (msgspec.Raw) that encode as NodeParts without a re-encode
                           deliver_by=sp.deliver_by, blob=sp.blob, blob_sources=sp.blob_sources,
                           sig=sig, sig_path=path, sig_index=i, epoch=sp.epoch)
                for i, (sp, path) in enumerate(zip(specs, paths, strict=True))]

    def read_grant(self, manifest_id: str, node_ids: list[str], expires_at: float) -> bytes:
        """A gang's read grant (:mod:`infra.grants`): its nodes may read ``manifest_id`` from
        nodes outside the gang until ``expires_at``."""
        return make_grant(self._key.sign, manifest_id, node_ids, expires_at)

    def revoked(self, issued_at: float, nodes: list[str], serials: list[str]) -> RevokedList:
        """The deny-list signed, for members to take through their relay."""
        self.signed += 1
        return RevokedList(issued_at=issued_at, nodes=nodes, serials=serials,
                           sig=self._key.sign(revoked_bytes(issued_at, nodes, serials)))

    def bundle(self, *, rack: str, blob_id: str, parts: list[NodePart], deliver_by: float,
               blob: bytes | None = None, blob_sources: list[str] | None = None, epoch: int = 0) -> RackBundle:
        """A signed RackBundle (its parts carried as the exact bytes the signature covers)."""
        return self.bundle_raw(rack=rack, blob_id=blob_id, raws=[part_bytes(p) for p in parts],
                               deliver_by=deliver_by, blob=blob, blob_sources=blob_sources, epoch=epoch)

    def bundle_raw(self, *, rack: str, blob_id: str, raws: list[bytes], deliver_by: float,
                   blob: bytes | None = None, blob_sources: list[str] | None = None, epoch: int = 0) -> RackBundle:
        """As :meth:`bundle`, the parts given as their bytes (:func:`part_bytes` of each)."""
        return self.bundles_raw([BundleSpec(rack, blob_id, raws, deliver_by, blob, blob_sources or [], epoch)])[0]


def revoked_bytes(issued_at: float, nodes: list[str], serials: list[str]) -> bytes:
    """What the placer signs of a deny-list (RevokedList)."""
    return _REVOKED + _canon.encode((issued_at, nodes, serials))


class BundleView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A RackBundle as a receiver checks it: its parts left as the bytes that were signed."""
    rack: str
    blob_id: str
    version: int = 1
    blob: bytes | None = None
    blob_sources: list[str] = []
    parts: list[msgspec.Raw] = []
    deliver_by: float = 0.0
    sig: bytes = b""
    sig_path: list[bytes] = []
    sig_index: int = 0
    epoch: int = 0


class BundleVerifier:
    """Checks the placer's signatures with its public key (32 raw bytes)."""

    def __init__(self, public: bytes) -> None:
        if len(public) != 32:
            raise AuthError(f"a placer signing key is 32 bytes, not {len(public)}")
        self.public = public
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self.verified = 0
        self.refused = 0

    def _check(self, header: bytes, sig: bytes, path: list[bytes], index: int,
               seen: dict[bytes, bytes] | None = None) -> None:
        """``header`` is signed: its path leads to a root the signature covers. ``seen``:
        signature -> the root it was verified over, for this receiver's recent batches (the
        bundles of a batch share one signature; one verification serves them all)."""
        try:
            root = merkle_root(_leaf(header), path, index)
        except AuthError:
            self.refused += 1
            raise
        if seen is not None and seen.get(sig) == root:
            return
        try:
            self._key.verify(sig, _ROOT + root)
        except InvalidSignature:
            if path or index or not self._legacy_ok(sig, header):
                self.refused += 1
                raise AuthError("the placer's signature does not verify") from None
        self.verified += 1
        if seen is not None:
            seen[sig] = root
            while len(seen) > 64:
                seen.pop(next(iter(seen)))

    def revoked_ok(self, rl: RevokedList) -> bool:
        """Whether the placer signed this deny-list."""
        try:
            self._key.verify(rl.sig, revoked_bytes(rl.issued_at, rl.nodes, rl.serials))
        except InvalidSignature:
            self.refused += 1
            return False
        self.verified += 1
        return True

    def _legacy_ok(self, sig: bytes, header: bytes) -> bool:
        """A bundle signed alone the way placers before batched signatures did (over its header
        itself, no path): still good, so agents can be upgraded before their placer."""
        try:
            self._key.verify(sig, header)
        except InvalidSignature:
            return False
        return True

    def bundle(self, raw_payload: bytes, *, seen: dict[bytes, bytes] | None = None
               ) -> tuple[BundleView, list[NodePart], list[PartProof]]:
        """Decode and verify a bundle frame's payload: (the bundle, its parts, each part's proof
        for its member). Raises AuthError (nothing in it may be acted on) or msgspec errors.
        ``seen``: as for :meth:`part` (one verification per batch of bundles)."""
        view = msgspec.msgpack.decode(raw_payload, type=BundleView)
        if not view.sig:
            self.refused += 1
            raise AuthError("the bundle is not signed")
        raws = [bytes(r) for r in view.parts]
        digests = [digest(r) for r in raws]
        self._check(header_bytes(view.rack, view.blob_id, view.deliver_by, digests, view.epoch), view.sig,
                    list(view.sig_path), view.sig_index, seen)
        parts = [expand_part(_part_dec.decode(r)) for r in raws]
        proofs = [PartProof(rack=view.rack, blob_id=view.blob_id, deliver_by=view.deliver_by, digests=digests,
                            sig=view.sig, raw=r, sig_path=view.sig_path, sig_index=view.sig_index,
                            epoch=view.epoch) for r in raws]
        return view, parts, proofs

    def part(self, part: NodePart, *, seen: dict[bytes, bytes] | None = None) -> NodePart:
        """The part a member may act on: the signed bytes its proof carries, checked (digest
        listed, path to a signed root, signature valid), with the bundle's blob id filled in.
        ``seen``: signatures this member already verified, and over which root (one
        verification per batch)."""
        pr = part.proof
        if pr is None:
            self.refused += 1
            raise AuthError("a part from a relay must carry the placer's signed proof")
        d = digest(pr.raw)
        if d not in pr.digests:
            self.refused += 1
            raise AuthError("the part is not one of the signed bundle's parts")
        self._check(header_bytes(pr.rack, pr.blob_id, pr.deliver_by, list(pr.digests), pr.epoch), pr.sig,
                    list(pr.sig_path), pr.sig_index, seen)
        signed = expand_part(_part_dec.decode(pr.raw))
        if signed.blob_id and signed.blob_id != pr.blob_id:
            self.refused += 1
            raise AuthError("the part names another gang blob than its signed bundle")
        if signed.pods and not signed.blob_id:
            signed = msgspec.structs.replace(signed, blob_id=pr.blob_id)
        return signed


# ---------------------------------------------------------------- the placer's keys on disk

def _read_or_make(path: Path, make: bytes) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    atomic_write(path, make, 0o600)
    log.info("placer key made path=%s", path)
    return path.read_bytes()


def load_placer_keys(state_dir: str | os.PathLike[str]) -> tuple[bytes, BundleSigner]:
    """(MAC master secret, bundle signer) from the placer's state dir, made once (0600)."""
    d = Path(state_dir)
    master = _read_or_make(d / MASTER_FILE, os.urandom(KEY_LEN))
    if len(master) != KEY_LEN:
        raise AuthError(f"{d / MASTER_FILE} is {len(master)} bytes, not {KEY_LEN}")
    pem = _read_or_make(d / SIGNING_FILE, BundleSigner.generate().private_pem())
    return master, BundleSigner.from_pem(pem, str(d / SIGNING_FILE))


class _PlacerKeys(msgspec.Struct, frozen=True):
    version: int
    mac_master: bytes
    signing_key: bytes      # PKCS#8 PEM


PLACER_KEYS_VERSION = 1


def encode_placer_keys(master: bytes, signer: BundleSigner) -> bytes:
    """The MAC master secret and the signing key as one value (several placers share them: placer.ha)."""
    return msgspec.json.encode(_PlacerKeys(PLACER_KEYS_VERSION, master, signer.private_pem()))


def decode_placer_keys(raw: bytes, where: str) -> tuple[bytes, BundleSigner]:
    """What :func:`encode_placer_keys` made (:class:`AuthError` naming ``where`` otherwise)."""
    try:
        k = msgspec.json.decode(raw, type=_PlacerKeys)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise AuthError(f"{where} does not hold the placer keys: {e}") from None
    if k.version != PLACER_KEYS_VERSION:
        raise AuthError(f"{where}: placer keys of version {k.version}, this placer reads {PLACER_KEYS_VERSION}")
    if len(k.mac_master) != KEY_LEN:
        raise AuthError(f"{where}: a MAC master of {len(k.mac_master)} bytes, not {KEY_LEN}")
    return k.mac_master, BundleSigner.from_pem(k.signing_key, where)
