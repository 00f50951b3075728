"""Reads by membership: a node reads a gang's blob (its argv, env and peer table) only if it
takes part in the gang, and a rack's relay reads it only if a node of a rack it is the active
relay for takes part (the Kubernetes node authorizer's rule: a kubelet reads only the objects
of pods bound to it).

The two ways in, ``GET /v1/gangs/{blob_id}`` (placer.service) and ``blob_get`` on the framed
channel (placer.relays), each call one method here; :func:`refusal` decides, over the placer's
own indexes, without a scan of the cluster:

- a node's own gangs: ``NodeRec.gangs`` (node -> the jobs with current pods on it, a
  handful), whose ``blob_id`` is the current attempt's blob;
- a gang's racks: read once per blob from the blob's own peer table (the placer wrote it, for
  exactly the gang's nodes) and kept while the blob lives (:class:`GangRacks`).

A refusal is a reason code (``REASONS``), counted in the placer's counters
(``blob_refusals``, ``blob_refusals_<reason>``), answered as a 403 or a ``BlobReply`` error, and
logged at most at debug level: a node asking for what it may not read is no operator news
per request, and a hostile one must not be able to fill the log.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Collection, Mapping
from typing import Protocol, runtime_checkable

import msgspec

from infra.errors import HTTPError
from infra.http import Request
from scheduler_link.messages import BLOB_ZLIB_MAGIC, MAX_BLOB_BYTES, BlobReply

from .records import NodeRec

log = logging.getLogger("herd.placer.membership")

NOT_A_MEMBER = "not_a_member"      # neither the node nor (for a relay) its racks take part
UNKNOWN_NODE = "unknown_node"      # the asker is not a registered node
NO_IDENTITY = "no_node_identity"   # a frames connection that named no node
REASONS = (NOT_A_MEMBER, UNKNOWN_NODE, NO_IDENTITY)


class _JobView(Protocol):
    @property
    def blob_id(self) -> str | None: ...


class _NodeView(Protocol):
    @property
    def gangs(self) -> Mapping[str, _JobView]: ...


def refusal(blob_id: str, node: _NodeView | None, relayed_racks: Collection[str],
            gang_racks: Callable[[], Collection[str]]) -> str | None:
    """Pure: why ``node`` (None: not registered) may not read gang blob ``blob_id``, or None
    when it may. ``relayed_racks``: the racks the asking connection is the active relay for
    (empty for a plain member or an HTTP caller); ``gang_racks``: the gang's racks, asked for
    only when the node's own gangs do not settle it."""
    if node is None:
        return UNKNOWN_NODE
    for job in node.gangs.values():
        if job.blob_id == blob_id:
            return None
    if relayed_racks:
        racks = gang_racks()
        if any(r in racks for r in relayed_racks):
            return None
    return NOT_A_MEMBER


class _TableRacks(msgspec.Struct, array_like=True):
    """The part of ``infra.peers.PeerTable`` read here (its columns before ``racks`` skipped)."""
    node_ids: msgspec.Raw
    data_urls: msgspec.Raw
    rack_of: msgspec.Raw
    racks: list[str] = []


class _BlobRacks(msgspec.Struct):
    """The part of ``GangBlob`` read here."""
    peers: _TableRacks | None = None


_racks_decoder = msgspec.msgpack.Decoder(_BlobRacks)


def racks_of_blob(raw: bytes) -> frozenset[str]:
    """The racks of a gang blob's peer table (the placer's own bytes: canonical, maybe
    compressed behind ``BLOB_ZLIB_MAGIC``); empty if it cannot be read."""
    body: bytes = raw
    if raw.startswith(BLOB_ZLIB_MAGIC):
        try:
            body = zlib.decompressobj().decompress(memoryview(raw)[len(BLOB_ZLIB_MAGIC):], MAX_BLOB_BYTES)
        except zlib.error:
            return frozenset()
    try:
        view = _racks_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return frozenset()
    return frozenset(view.peers.racks) if view.peers is not None else frozenset()


class GangRacks:
    """blob id -> the gang's racks, read once per blob; entries of blobs the placer dropped
    go when the cache outgrows the live blobs (so it stays about their size)."""

    def __init__(self, blobs: Mapping[str, bytes]) -> None:
        self._blobs = blobs
        self._racks: dict[str, frozenset[str]] = {}

    def get(self, blob_id: str) -> frozenset[str]:
        hit = self._racks.get(blob_id)
        if hit is not None:
            return hit
        raw = self._blobs.get(blob_id)
        if raw is None:
            return frozenset()
        if len(self._racks) >= 2 * len(self._blobs) + 16:
            self._racks = {k: v for k, v in self._racks.items() if k in self._blobs}
        out = self._racks[blob_id] = racks_of_blob(raw)
        return out

    def __len__(self) -> int:
        return len(self._racks)


class _Hub(Protocol):
    def relay_for(self, rack: str) -> object | None: ...


class _Conn(Protocol):
    @property
    def node_id(self) -> str: ...

    @property
    def racks(self) -> tuple[str, ...]: ...


class Membership:
    """The placer's membership checks: its node records, live blobs and counters, and the
    relay hub that says which connection is a rack's active relay."""

    def __init__(self, nodes: Mapping[str, NodeRec], blobs: Mapping[str, bytes],
                 counters: dict[str, int], hub: _Hub) -> None:
        self._nodes = nodes
        self._counters = counters
        self._hub = hub
        self.gang_racks = GangRacks(blobs)

    def _refused(self, why: str, asker: str, blob_id: str, path: str) -> str:
        c = self._counters
        c["blob_refusals"] = c.get("blob_refusals", 0) + 1
        c["blob_refusals_" + why] = c.get("blob_refusals_" + why, 0) + 1
        log.debug("gang blob refused why=%s asker=%s blob=%s path=%s", why, asker[:64], blob_id[:16], path)
        return why

    def check_http(self, req: Request) -> None:
        """``GET /v1/gangs/{blob_id}``: a node certificate's node reads only its gangs' blobs
        (raises a 403 whose ``error`` is the reason code). Callers proven only by a shared
        token or an insecure set-up name no node, and keep the role's access."""
        p = req.principal
        if p is None or p.via != "cert" or p.kind != "node" or p.node_id is None:
            return
        blob_id = req.params["blob_id"]
        why = refusal(blob_id, self._nodes.get(p.node_id), (), frozenset)
        if why is not None:
            raise HTTPError(403, self._refused(why, p.node_id, blob_id, "http"),
                            f"node {p.node_id[:64]} takes no part in gang blob {blob_id[:16]}")

    def check_frames(self, conn: _Conn | None, blob_id: str) -> BlobReply | None:
        """``blob_get`` on a frames connection: the answer refusing it, or None when the
        connection's node, or a node of a rack it is the active relay for, takes part."""
        if conn is None:
            return BlobReply(blob_id=blob_id, error=self._refused(NO_IDENTITY, "?", blob_id, "frames"))
        hub = self._hub
        active = [r for r in conn.racks if hub.relay_for(r) is conn]
        why = refusal(blob_id, self._nodes.get(conn.node_id), active, lambda: self.gang_racks.get(blob_id))
        if why is None:
            return None
        return BlobReply(blob_id=blob_id, error=self._refused(why, conn.node_id, blob_id, "frames"))


@runtime_checkable
class HasMembership(Protocol):
    membership: Membership


def frames_refusal(host: object, conn: _Conn | None, blob_id: str) -> BlobReply | None:
    """The relay hub's hook: ``host``'s membership check for a ``blob_get`` (a host without
    one serves no blob: the check fails closed)."""
    if isinstance(host, HasMembership):
        return host.membership.check_frames(conn, blob_id)
    return BlobReply(blob_id=blob_id, error=NO_IDENTITY)
