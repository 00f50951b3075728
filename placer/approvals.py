"""The operator's rack approvals over the placer's API (``herd node approve``).

* ``POST /v1/nodes/{node_id}/approve`` -- body :class:`~scheduler_link.messages.RackApproval`
  (operator): pin the node's rack where its certificate pins none. Durable
  (:class:`placer.nodeops.ApprovalFile`, fsynced) before it is acknowledged; the node need not
  have reported yet. The answer names the rack of the node's registration in force when it
  differs: the node stops being chosen as that rack's relay at once (relaypolicy.may_relay), and
  its next full report is refused.
* ``GET /v1/approvals`` (viewer) -- every approval, with the node's registered rack and the
  rack its certificate pins, when the placer has seen one.

What a pin does is placer.relaypolicy's.
"""

from __future__ import annotations

import logging
from typing import Any

from infra.http import HTTPError, Request, Response, RouteDoc, json_response
from scheduler_link.messages import RackApproval

from .errors import JournalError
from .nodeops import ApprovalFile, NodeOps
from .records import JobError

log = logging.getLogger("herd.placer.approvals")


class ApprovalRoutes:
    """The two handlers, over the state (its ``rack_pins``) and the approvals' file."""

    def __init__(self, state: NodeOps, file: ApprovalFile) -> None:
        self.state = state
        self.file = file

    def load(self) -> int:
        """Take the file's approvals into the state (at start); how many."""
        racks = self.file.load()
        for node_id, rack in racks.items():
            self.state.rack_pins.approve(node_id, rack)
        return len(racks)

    async def h_approve(self, req: Request) -> Response:
        """Pin a node's rack (operator); durable before the answer."""
        body = req.decode(RackApproval)
        node_id = req.params["node_id"]
        pins = self.state.rack_pins
        before = pins.approved.get(node_id)
        try:
            differs = self.state.approve_rack(node_id, body.rack)
        except JobError as e:
            raise HTTPError(400, "approval refused", str(e)) from None
        try:
            self.file.save(pins.approved)   # (the store is small: one entry per approved node)
        except JournalError as e:
            if before is None:
                pins.approved.pop(node_id, None)
            else:
                pins.approve(node_id, before)
            log.error("rack approval not stored node=%s: %s", node_id, e)
            raise HTTPError(503, "approval not stored", str(e)) from None
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
