"""The operator's rack approvals over the placer's API (``herd node approve``).

* ``POST /v1/nodes/{node_id}/approve`` -- body :class:`~scheduler_link.messages.RackApproval`
  (operator): pin the node's rack where its certificate pins none. Durable
  (:class:`placer.nodeops.ApprovalFile`, fsynced) before it is acknowledged; the node need not
  have reported yet. The answer names the rack of the node's registration in force when it
  differs: the node stops being chosen as that rack's relay at once (relaypolicy.may_relay), and
  its next full report is refused.
* ``GET /v1/approvals`` (viewer) -- every approval, with the node's registered rack and the
  rack its certificate pins, when the placer has seen one.

Where approvals are durable: always this placer's state dir (``rack-approvals.json``, read at
start), and with ``[placer] etcd`` in etcd too (:class:`EtcdApprovals`: one key per node under
the placers' prefix, ``approvals/<node>``, written by the leader in a transaction guarded by its
leader key, like the jobs journal). A placer promoted to leader reads etcd's approvals and takes
them (over its own file's, which it then rewrites; its own that etcd lacks, taken before etcd
was configured, it writes there), so an approval outlives the leader that took it; an
approval answered 200 is in etcd first. Until its promotion a follower knows only its own
file's (it applies no report and places nothing).

What a pin does is placer.relaypolicy's.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from infra.http import HTTPError, Request, Response, RouteDoc, json_response
from infra.tls import parse_rack
from scheduler_link.messages import RackApproval

from .errors import EtcdError, JournalError
from .etcd import Compare, EtcdClient, Op, prefix_end
from .etcdjournal import Fence
from .nodeops import ApprovalFile, NodeOps, approval_problem
from .records import JobError

log = logging.getLogger("herd.placer.approvals")


class _Approval(msgspec.Struct, frozen=True, kw_only=True):
    v: int = 1
    rack: str


_approval_dec = msgspec.json.Decoder(_Approval)
LOAD_PAGE = 1000


class EtcdApprovals:
    """The approvals in etcd, under ``prefix + b"approvals/"``: read by a placer promoted to
    leader, written by the leader only (``fence``: its leader key and epoch, compared in each
    write's transaction, as the jobs journal's writes are)."""

    def __init__(self, client: EtcdClient, prefix: bytes, fence: Fence) -> None:
        self.client = client
        self.prefix = prefix + b"approvals/"
        self.fence = fence

    async def load(self) -> dict[str, str]:
        """Every approval in etcd (node id -> rack); :class:`JournalError` when etcd cannot be read."""
        out: dict[str, str] = {}
        start, end, revision = self.prefix, prefix_end(self.prefix), 0
        try:
            while True:
                r = await self.client.range(start, end, limit=LOAD_PAGE, revision=revision)
                revision = revision or r.revision
                for kv in r.kvs:
                    try:
                        rack = _approval_dec.decode(kv.value).rack
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        log.warning("rack approval in etcd unreadable key=%s", kv.key[:200])
                        continue
                    if parse_rack(rack) is not None:
                        out[kv.key[len(self.prefix):].decode(errors="replace")] = rack
                if not r.more or not r.kvs:
                    return out
                start = r.kvs[-1].key + b"\0"
        except EtcdError as e:
            raise JournalError(f"rack approvals cannot be read from etcd: {e}") from None

    async def save(self, node_id: str, rack: str) -> None:
        """Write one approval; :class:`JournalError` when etcd refused it (this placer no
        longer leads) or could not be reached."""
        op = Op.put(self.prefix + node_id.encode(), msgspec.json.encode(_Approval(rack=rack)))
        try:
            r = await self.client.txn([Compare.created(self.fence.key, self.fence.epoch)], [op])
        except EtcdError as e:
            raise JournalError(f"rack approval not stored in etcd: {e}") from None
        if not r.succeeded:
            raise JournalError(f"rack approval not stored: this placer no longer leads (epoch {self.fence.epoch})")


class ApprovalRoutes:
    """The two handlers, over the state (its ``rack_pins``), the approvals' file and, once this
    placer leads with ``[placer] etcd``, etcd's approvals (:meth:`promoted`)."""

    def __init__(self, state: NodeOps, file: ApprovalFile) -> None:
        self.state = state
        self.file = file
        self.etcd: EtcdApprovals | None = None

    def load(self) -> int:
        """Take the file's approvals into the state (at start); how many."""
        racks = self.file.load()
        for node_id, rack in racks.items():
            self.state.rack_pins.approve(node_id, rack)
        return len(racks)

    async def promoted(self, etcd: EtcdApprovals) -> int:
        """This placer leads with etcd: take etcd's approvals (over the file's: they are the
        fleet's) and write approvals there from now on; how many were read. One that cannot
        be read leaves the file's in force and is retried at the next approval's write."""
        try:
            racks = await etcd.load()
        except JournalError as e:
            log.error("rack approvals not read from etcd (this placer's own stay in force): %s", e)
            self.etcd = etcd
            return 0
        pins = self.state.rack_pins
        own = {k: v for k, v in pins.approved.items() if k not in racks}   # (taken before etcd was set)
        for node_id, rack in racks.items():
            self.state.approve_rack(node_id, rack)
        self.etcd = etcd
        try:
            for node_id, rack in sorted(own.items()):
                await etcd.save(node_id, rack)
        except JournalError as e:
            log.warning("this placer's own rack approvals not copied to etcd: %s", e)
        try:
            self.file.save(pins.approved)
        except JournalError as e:
            log.warning("rack approvals from etcd not copied to the state dir: %s", e)
        log.info("rack approvals read from etcd count=%d epoch=%d", len(racks), etcd.fence.epoch)
        return len(racks)

    async def h_approve(self, req: Request) -> Response:
        """Pin a node's rack (operator); durable before the answer."""
        body = req.decode(RackApproval)
        node_id = req.params["node_id"]
        pins = self.state.rack_pins
        before = pins.approved.get(node_id)
        if (why := approval_problem(node_id, body.rack)) is not None:
            raise HTTPError(400, "approval refused", why)
        if self.etcd is not None:   # the fleet's copy first: an answered approval outlives this placer
            try:
                await self.etcd.save(node_id, body.rack)
            except JournalError as e:
                log.error("rack approval not stored node=%s: %s", node_id, e)
                raise HTTPError(503, "approval not stored", str(e)) from None
        try:
            differs = self.state.approve_rack(node_id, body.rack)
        except JobError as e:
            raise HTTPError(400, "approval refused", str(e)) from None
        try:
            self.file.save(pins.approved)   # (the store is small: one entry per approved node)
        except JournalError as e:
            if self.etcd is None:
                if before is None:
                    pins.approved.pop(node_id, None)
                else:
                    pins.approve(node_id, before)
                log.error("rack approval not stored node=%s: %s", node_id, e)
                raise HTTPError(503, "approval not stored", str(e)) from None
            # durable in etcd already: this placer's file is its copy for a restart as follower
            log.warning("rack approval stored in etcd, not in the state dir node=%s: %s", node_id, e)
        pin = pins.pin(node_id)
        return json_response({"node_id": node_id, "rack": body.rack, "registered_rack": differs,
                              "pinned": {"rack": pin.rack, "by": pin.source} if pin is not None else None})

    async def h_list(self, req: Request) -> Response:
        """Every approval: node, approved rack, registered rack, the certificate's rack."""
        pins = self.state.rack_pins
        nodes = self.state.nodes
        out: list[dict[str, Any]] = []
        for node_id, rack in sorted(pins.approved.items()):
            rec = nodes.get(node_id)
            out.append({"node_id": node_id, "rack": rack, "registered_rack": rec.rack_path if rec is not None else None,
                        "certificate_rack": pins.certified.get(node_id)})
        return json_response({"approvals": out})


APPROVAL_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/nodes/{node_id}/approve"): RouteDoc(
        summary="Pin a node's rack (where its certificate pins none): it registers and relays there only",
        body=RackApproval, responses={200: {"type": "object"}},
        errors={400: "not a zone/block/rack path, or a bad node id", 503: "the approval could not be stored"}),
    ("GET", "/v1/approvals"): RouteDoc(
        summary="The operators' rack approvals, with each node's registered and certificate rack",
        responses={200: {"type": "object"}}),
}
