"""How nodes are named and reached: a node's place in the topology, a data-plane peer and
a gang's peer table (column by column, in topology order).

The data plane (:mod:`p2p`) and the scheduler link (:mod:`scheduler_link.messages`, which
re-exports these types as part of the wire contract) share them; this module imports nothing
of ours.
"""

from __future__ import annotations

import msgspec


class TopologyPath(msgspec.Struct, frozen=True, kw_only=True):
    """Where a node sits: zone > block > rack > node. Declared in the agent config."""
    zone: str = "zone-a"
    block: str = "block-a"
    rack: str = "rack-a"


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    """A data-plane peer; every member of a gang gets the same list."""
    node_id: str
    data_url: str
    zone: str = ""
    block: str = ""
    rack: str = ""


class PeerTable(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A gang's peers, column by column, in topology order; row i is one node."""
    node_ids: list[str] = []
    data_urls: list[str] = []
    rack_of: list[int] = []                  # row -> index into ``racks``
    racks: list[str] = []                    # "zone/block/rack" path of each rack, in order
    rack_start: list[int] = []               # racks[r]'s rows are rack_start[r]:rack_start[r+1]

    def __len__(self) -> int:
        return len(self.node_ids)

    def peer(self, row: int) -> Peer:
        zone, block, rack = (self.racks[self.rack_of[row]].split("/", 2) + ["", "", ""])[:3]
        return Peer(node_id=self.node_ids[row], data_url=self.data_urls[row], zone=zone, block=block, rack=rack)

    def rack_rows(self, r: int) -> range:
        end = self.rack_start[r + 1] if r + 1 < len(self.rack_start) else len(self.node_ids)
        return range(self.rack_start[r], end)
