"""Who may read what from this node's data plane: reads by membership.

A node's chunks and manifests are its gangs' artifacts (often secret: model weights). Its
data plane serves a manifest -- the manifest, its have-bitmap, its chunks -- only to the
nodes of gangs on this node that use that manifest, or to any node when the operator marked
the manifest public (``[dataplane] public``: manifest ids, or ``"*"`` for every manifest).
The agent learns the gangs from its placements (a gang's blob lists all its nodes) and
hands them over with :meth:`Readers.set_gangs`; the data plane asks :func:`chunk_refusal`
and :func:`manifest_refusal` with the asker's node id, proven by its TLS certificate.

A node whose pushes race its peers' (a gang's nodes get their placements at about the same
time) may ask before this node has its own: the data plane holds a refused request up to
``member_wait_ms`` for the gangs to change, then decides again.

Pure data, no I/O: the data plane passes the chunk table of a manifest (``chunks_of``: the
set of its chunk ids, None when this node does not hold the manifest).

Invariants:
- a refusal is a :data:`ReadRefusal` code, never words: ``not_a_node`` (the certificate
  names no node: an operator, the placer), ``not_a_member`` (no gang here that uses a
  manifest listing what was asked has the asker in it);
- a chunk is readable by a node only through a manifest it may read that lists the chunk,
  so membership of one gang never opens another gang's chunks;
- the cost of a decision is O(gangs on this node), never O(gang size): each gang's nodes are
  a set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

ReadRefusal = Literal["not_a_node", "not_a_member"]
EVERY_MANIFEST = "*"


@dataclass(frozen=True, slots=True)
class Gang:
    """One gang on this node: the manifest it uses and every node in it."""
    manifest_id: str
    nodes: frozenset[str]


class Readers:
    """The read policy of one data plane: its gangs (set by the agent) and what is public."""

    def __init__(self, public: Iterable[str] = ()) -> None:
        public = tuple(public)
        self.everyone = EVERY_MANIFEST in public
        self.public = frozenset(m for m in public if m != EVERY_MANIFEST)
        self._gangs: dict[str, Gang] = {}
        self.generation = 0
        self.on_change: list[Callable[[], None]] = []   # called (synchronously) when the gangs change

    def set_gangs(self, gangs: Mapping[str, Gang]) -> None:
        """Replace the gangs (key: the gang's blob or placement id) with ``gangs``."""
        if gangs != self._gangs:
            self._gangs = dict(gangs)
            self.generation += 1
            for fn in self.on_change:
                fn()

    def gangs(self) -> dict[str, Gang]:
        return dict(self._gangs)

    def manifests_for(self, node_id: str) -> list[str]:
        """Manifests ``node_id`` may read here besides the public ones."""
        return [g.manifest_id for g in self._gangs.values() if node_id in g.nodes]

    def statistics(self) -> dict[str, object]:
        return {"gangs": len(self._gangs), "public": len(self.public), "everyone": self.everyone}


def manifest_refusal(readers: Readers, node_id: str | None, manifest_id: str) -> ReadRefusal | None:
    """Why ``node_id`` may not read ``manifest_id`` here (None: it may)."""
    if readers.everyone or manifest_id in readers.public:
        return None
    if node_id is None:
        return "not_a_node"
    if manifest_id in readers.manifests_for(node_id):
        return None
    return "not_a_member"


def chunk_refusal(readers: Readers, node_id: str | None, chunk_id: str,
                  chunks_of: Callable[[str], Collection[str] | None], *, strict: bool = True) -> ReadRefusal | None:
    """Why ``node_id`` may not read ``chunk_id`` here (None: it may): it must be listed by a
    manifest the node may read (a public one, or one of its gangs here). With ``strict``
    false (before a wait for a chunk this node does not have yet) an undecidable case passes:
    the node has no gang here yet (its placement may come after its peers ask) or a manifest
    it may read is not held here yet; the strict check follows the wait."""
    if readers.everyone:
        return None
    for m in readers.public:
        listed = chunks_of(m)
        if listed is not None and chunk_id in listed:
            return None
    if node_id is None:
        return "not_a_node"
    mine = readers.manifests_for(node_id)
    undecided = not mine
    for m in mine:
        listed = chunks_of(m)
        if listed is None:
            undecided = True
        elif chunk_id in listed:
            return None
    if undecided and not strict:
        return None
    return "not_a_member"
