"""Read grants: the placer's word that the nodes of a gang may read its artifact from nodes
outside the gang (the "contacts" it names: holders of the manifest, used to seed the herd).

A node's data plane serves a manifest to the nodes of its own gangs that use it (p2p.readers).
A contact is in no gang of the fetcher's, so it cannot know who may read; the grant tells it.

Theory of operation
-------------------
The placer makes one grant a gang, never one a node (its cost must not grow with the gang):
it signs (Ed25519, its bundle key, which every agent already holds to check bundles) the
manifest id, an expiry, the number of nodes and the root of a Merkle tree over the gang's
node ids in its peer table's order, ``LEAF_IDS`` ids to a leaf (:func:`make_grant`). The
grant travels in the gang blob, so every node of the gang has it, verified by the blob's id,
with the whole node list. A node proves its membership by presenting the grant with its
leaf's ids and the leaf's path to the root (:func:`prove`; the ``x-herd-grant`` header of
its data-plane requests); the serving node checks it against the asker's TLS identity
(:class:`GrantChecker`): the signature (once per grant, cached), the expiry (wall clock),
the asker's id among the leaf's ids, the path.

Invariants:
- a grant names one manifest and opens that manifest only (and the chunks it lists);
- a proof holds only for a node id of the tree the placer signed: the leaf's ids are hashed
  whole, the path must lead to the signed root at the leaf's position, and the tree's shape
  follows from the signed node count;
- a check's outcome is a :data:`GrantRefusal` code or the grant, never words.

Cost: the placer hashes ``ceil(n / 64)`` leaves of a few hundred bytes and as many inner
nodes, and signs once (~1 ms and 44 us for 25,000 nodes); a proof is at most 64 ids and
``log2(n / 64)`` hashes (~1.5 KiB at 25,000 nodes).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Literal

import blake3
import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

GRANT_VERSION = 1
LEAF_IDS = 64                   # node ids a leaf
HEADER = "x-herd-grant"         # the data-plane request header that carries proofs (comma-separated)
MAX_PROOF_CHARS = 8192          # one proof in the header, base64
MAX_PROOFS = 4                  # proofs a request carries (the node's most recent grants)
_DOMAIN = b"herd read grant v1\x00"

GrantRefusal = Literal["malformed", "forged", "expired", "not_listed"]


class ReadGrant(msgspec.Struct, frozen=True, array_like=True):
    """One gang's grant: ``manifest_id`` may be read until ``expires_at`` (the placer's wall
    clock) by the ``nodes`` node ids whose tree has root ``root``; ``sig`` over
    :func:`signed_bytes`."""
    manifest_id: str
    root: bytes
    nodes: int
    expires_at: float
    sig: bytes
    version: int = GRANT_VERSION


class GrantProof(msgspec.Struct, frozen=True, array_like=True):
    """A node's proof that it is one of a grant's nodes: its leaf (position and ids) and the
    leaf's sibling hashes up to the root (leaf level first; a level's last hash with no
    sibling goes up as it is and has no entry)."""
    grant: ReadGrant
    leaf: int
    ids: list[str]
    path: list[bytes]


_enc = msgspec.msgpack.Encoder()
_grant_dec = msgspec.msgpack.Decoder(ReadGrant)
_proof_dec = msgspec.msgpack.Decoder(GrantProof)


def _leaf(ids: Sequence[str]) -> bytes:
    return blake3.blake3(b"\x00" + _enc.encode(list(ids))).digest()


def _inner(left: bytes, right: bytes) -> bytes:
    return blake3.blake3(b"\x01" + left + right).digest()


def _levels(node_ids: Sequence[str]) -> list[list[bytes]]:
    level = [_leaf(node_ids[i:i + LEAF_IDS]) for i in range(0, max(len(node_ids), 1), LEAF_IDS)]
    levels = [level]
    while len(level) > 1:
        nxt = [_inner(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
        levels.append(level)
    return levels


def nodes_root(node_ids: Sequence[str]) -> bytes:
    """The root of the tree over ``node_ids`` (in this order)."""
    return _levels(node_ids)[-1][0]


def signed_bytes(manifest_id: str, root: bytes, nodes: int, expires_at: float) -> bytes:
    """What the placer signs."""
    return _DOMAIN + _enc.encode([GRANT_VERSION, manifest_id, root, nodes, expires_at])


def make_grant(sign: Callable[[bytes], bytes], manifest_id: str, node_ids: Sequence[str],
               expires_at: float) -> bytes:
    """The encoded grant for ``node_ids`` (the gang's peer table order); ``sign``: Ed25519
    with the placer's bundle key."""
    root = nodes_root(node_ids)
    sig = sign(signed_bytes(manifest_id, root, len(node_ids), expires_at))
    return _enc.encode(ReadGrant(manifest_id=manifest_id, root=root, nodes=len(node_ids),
                                 expires_at=expires_at, sig=sig))


def decode_grant(raw: bytes) -> ReadGrant:
    """Raises ``msgspec.DecodeError``/``ValueError`` on anything else."""
    return _grant_dec.decode(raw)


def prove(grant_raw: bytes, node_ids: Sequence[str], node_id: str) -> str | None:
    """The header value by which ``node_id`` shows it is one of ``node_ids`` (the table the
    grant was made over), or None when it is not one of them or the grant is not for them."""
    try:
        grant = decode_grant(grant_raw)
        row = list(node_ids).index(node_id)
    except (msgspec.DecodeError, ValueError):
        return None
    if grant.nodes != len(node_ids):
        return None
    levels = _levels(node_ids)
    if levels[-1][0] != grant.root:
        return None
    leaf = row // LEAF_IDS
    path: list[bytes] = []
    i = leaf
    for level in levels[:-1]:
        sib = i ^ 1
        if sib < len(level):
            path.append(level[sib])
        i //= 2
    proof = GrantProof(grant=grant, leaf=leaf, ids=list(node_ids[leaf * LEAF_IDS:(leaf + 1) * LEAF_IDS]), path=path)
    return base64.urlsafe_b64encode(_enc.encode(proof)).rstrip(b"=").decode("ascii")


class GrantChecker:
    """Checks proofs against one placer key (raw Ed25519 public bytes), remembering the
    signatures that verified (a bounded few: one verification per grant, not per request)."""

    KEEP = 256

    def __init__(self, public: bytes) -> None:
        self.public = public
        self._key = Ed25519PublicKey.from_public_bytes(public)
        self._good: dict[bytes, None] = {}

    def check(self, value: str, asker: str, now: float) -> ReadGrant | GrantRefusal:
        """The grant ``value`` (one proof, as :func:`prove` made it) gives ``asker`` at wall
        time ``now``, or why none."""
        if len(value) > MAX_PROOF_CHARS:
            return "malformed"
        try:
            proof = _proof_dec.decode(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
        except (msgspec.DecodeError, ValueError):
            return "malformed"
        g = proof.grant
        leaves = (g.nodes + LEAF_IDS - 1) // LEAF_IDS
        if (g.version != GRANT_VERSION or g.nodes < 1 or not 0 <= proof.leaf < leaves
                or len(proof.ids) != min(LEAF_IDS, g.nodes - proof.leaf * LEAF_IDS) or len(proof.path) > 64):
            return "malformed"
        signed = signed_bytes(g.manifest_id, g.root, g.nodes, g.expires_at)
        if (seen := g.sig + signed) not in self._good:   # (the signature with what it signs)
            try:
                self._key.verify(g.sig, signed)
            except InvalidSignature:
                return "forged"
            while len(self._good) >= self.KEEP:
                del self._good[next(iter(self._good))]
            self._good[seen] = None
        if now > g.expires_at:
            return "expired"
        if asker not in proof.ids:
            return "not_listed"
        h, i, width, path = _leaf(proof.ids), proof.leaf, leaves, iter(proof.path)
        while width > 1:
            sib = i ^ 1
            if sib < width:
                s = next(path, None)
                if s is None:
                    return "not_listed"
                h = _inner(s, h) if i & 1 else _inner(h, s)
            i //= 2
            width = (width + 1) // 2
        if next(path, None) is not None or h != g.root:
            return "not_listed"
        return g
