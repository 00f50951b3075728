"""Which nodes may read which manifests from this node's data plane, from its placements.

The data plane serves a manifest's bytes only to the nodes of gangs here that use it
(:mod:`p2p.readers`). This module says who those are: each live workload names its gang's
manifest, and its gang's nodes are the rows of the gang's blob (every node of the gang), or
until the blob is here, the peers its placement named (a placement without a blob names its
whole gang there; a big gang's direct push, its rack and contacts).
:class:`GangReaders` recomputes the gangs whenever a workload changes state or a gang blob
comes in, and hands them to the data plane's :class:`~p2p.readers.Readers`.

Cost: O(live workloads here) per change; a gang's node set is built once per blob (kept for
the blobs the agent keeps) and never per request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from p2p.readers import Gang, Readers
from scheduler_link.messages import GangBlob

from .state import WorkloadRecord

# blob id -> the verified blob if the agent holds it now (agent.blobs.BlobCache.cached)
CachedBlob = Callable[[str], GangBlob | None]


class GangReaders:
    """Keeps ``readers``' gangs equal to the gangs of this node's live workloads."""

    def __init__(self, readers: Readers, records: Callable[[], Mapping[str, WorkloadRecord]],
                 blob: CachedBlob, *, want: Callable[[str], None] | None = None, keep: int = 16) -> None:
        """``want(blob_id)``: a live workload's blob is not held (an agent restarted with its
        workloads running): get it (its arrival calls :meth:`refresh` again); asked once per id."""
        self.readers = readers
        self._records = records
        self._blob = blob
        self._want = want
        self._keep = keep
        self._nodes: dict[str, frozenset[str]] = {}   # blob id -> its gang's node ids (recent first out)
        self._asked: set[str] = set()                  # blob ids ``want`` was called for

    def _blob_nodes(self, blob_id: str) -> frozenset[str]:
        got = self._nodes.get(blob_id)
        if got is not None:
            return got
        blob = self._blob(blob_id)
        if blob is None:          # not here yet: refreshed when it comes
            if self._want is not None and blob_id not in self._asked:
                if len(self._asked) > 4 * self._keep:
                    self._asked.clear()
                self._asked.add(blob_id)
                self._want(blob_id)
            return frozenset()
        got = frozenset(blob.peers.node_ids)
        while len(self._nodes) >= self._keep:
            del self._nodes[next(iter(self._nodes))]
        self._nodes[blob_id] = got
        return got

    def refresh(self) -> None:
        gangs: dict[str, Gang] = {}
        for r in self._records().values():
            if r.terminal or not r.manifest_id:
                continue
            key = r.gang_blob_id or r.placement_id
            if key in gangs:   # another pod of the same gang
                continue
            nodes = self._blob_nodes(r.gang_blob_id) if r.gang_blob_id else frozenset()
            if not nodes:      # no blob (yet): the peers the placement named
                nodes = frozenset(p.node_id for p in r.peers)
            gangs[key] = Gang(r.manifest_id, nodes)
        self.readers.set_gangs(gangs)
