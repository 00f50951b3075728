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

Read grants (:mod:`infra.grants`): a node outside a gang (a contact the placer named to the
gang, holding its manifest) learns who may read from the request itself: the asker presents
the placer's signed grant for its gang with the proof that its certificate's node id is one
of the gang's (``x-herd-grant``); :meth:`Readers.granted` checks it with the placer's key
(:meth:`Readers.set_grant_key`) and the manifests it names count as the asker's here, for
that request. A request whose grants all fail is refused at once, never held: the asker
relied on a grant, not on a placement on its way.

Pure data, no I/O: the data plane passes the chunk table of a manifest (``chunks_of``: the
set of its chunk ids, None when this node does not hold the manifest).

Invariants:
- a refusal is a :data:`ReadRefusal` code, never words: ``not_a_node`` (the certificate
  names no node: an operator, the placer), ``not_a_member`` (no gang here that uses a
  manifest listing what was asked has the asker in it, nor a grant it presented),
  ``bad_grant`` (it presented grants and none holds: forged, expired, not its own, malformed);
- a chunk is readable by a node only through a manifest it may read that lists the chunk,
  so membership of one gang never opens another gang's chunks;
- the cost of a decision is O(gangs on this node), never O(gang size): each gang's nodes are
  a set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import blake3

from infra.grants import MAX_PROOFS, GrantChecker, GrantRefusal, ReadGrant

ReadRefusal = Literal["not_a_node", "not_a_member", "bad_grant"]
EVERY_MANIFEST = "*"
NO_GRANTS: frozenset[str] = frozenset()
GRANT_MEMO = 1024   # (asker, grant header) outcomes a data plane remembers


@dataclass(frozen=True, slots=True)
class Asker:
    """Who asks, for one request: its certificate's node id (None: no node), what its
    request's grants open (``granted``), and ``bad_grant``: it presented grants and none holds
    (forged, expired, not its own, malformed)."""
    node_id: str | None
    granted: frozenset[str] = NO_GRANTS
    bad_grant: bool = False


@dataclass(frozen=True, slots=True)
class Gang:
    """One gang on this node: the manifest it uses and every node in it."""
    manifest_id: str
    nodes: frozenset[str]


class Readers:
    """The read policy of one data plane: its gangs (set by the agent) and what is public."""

    def __init__(self, public: Iterable[str] = (), *, grant_key: Callable[[], bytes | None] | None = None) -> None:
        """``grant_key``: the placer's bundle key now (it comes with the node's registration),
        asked when a request presents a grant; or set it with :meth:`set_grant_key`."""
        self._grant_key = grant_key
        public = tuple(public)
        self.everyone = EVERY_MANIFEST in public
        self.public = frozenset(m for m in public if m != EVERY_MANIFEST)
        self._gangs: dict[str, Gang] = {}
        self.generation = 0
        self.on_change: list[Callable[[], None]] = []   # called (synchronously) when the gangs change
        self._checker: GrantChecker | None = None
        self.grants_refused: dict[GrantRefusal | Literal["no_key"], int] = {}
        # BLAKE3(node id, header) -> (what it opens, until when): a fetcher sends the same
        # header with every request; a bounded few (32 bytes a key), the oldest dropped first
        self._grant_memo: dict[bytes, tuple[frozenset[str], float]] = {}

    def set_grant_key(self, public: bytes | None) -> None:
        """The placer's bundle key (raw Ed25519 public bytes) grants are checked with."""
        if public is None:
            self._checker = None
        elif self._checker is None or self._checker.public != public:
            self._checker = GrantChecker(public)
        else:
            return
        self._grant_memo.clear()

    def asker(self, node_id: str | None, header: str | None, now: float) -> Asker:
        """The :class:`Asker` of a request from ``node_id`` whose ``x-herd-grant`` header is
        ``header`` (comma-separated proofs), at wall time ``now``; refused proofs counted by
        reason in ``grants_refused``."""
        if node_id is None or not header:
            return Asker(node_id)
        if self._grant_key is not None and (key := self._grant_key()) is not None:
            self.set_grant_key(key)
        key = blake3.blake3(f"{node_id}\n{header}".encode()).digest()
        memo = self._grant_memo.get(key)
        if memo is not None and now <= memo[1]:
            return Asker(node_id, memo[0], not memo[0])
        out: set[str] = set()
        until = float("inf")
        for value in header.split(",")[:MAX_PROOFS]:
            got: ReadGrant | GrantRefusal | Literal["no_key"] = (
                self._checker.check(value.strip(), node_id, now) if self._checker is not None else "no_key")
            if isinstance(got, ReadGrant):
                out.add(got.manifest_id)
                until = min(until, got.expires_at)
            else:
                self.grants_refused[got] = self.grants_refused.get(got, 0) + 1
        granted = frozenset(out)
        if self._checker is not None:
            while len(self._grant_memo) >= GRANT_MEMO:
                del self._grant_memo[next(iter(self._grant_memo))]
            self._grant_memo[key] = (granted, until)
        return Asker(node_id, granted, not granted)

    def set_gangs(self, gangs: Mapping[str, Gang]) -> None:
        """Replace the gangs (key: the gang's blob or placement id) with ``gangs``."""
        if gangs != self._gangs:
            self._gangs = dict(gangs)
            self.generation += 1
            for fn in self.on_change:
                fn()

    def gangs(self) -> dict[str, Gang]:
        return dict(self._gangs)

    def manifests_for(self, node_id: str, granted: Collection[str] = NO_GRANTS) -> list[str]:
        """Manifests ``node_id`` may read here besides the public ones (``granted``: what its
        request's grants open)."""
        return [g.manifest_id for g in self._gangs.values() if node_id in g.nodes] + list(granted)

    def statistics(self) -> dict[str, object]:
        return {"gangs": len(self._gangs), "public": len(self.public), "everyone": self.everyone,
                "grant_key": self._checker is not None, "grants_refused": dict(self.grants_refused)}


def manifest_refusal(readers: Readers, node_id: str | None, manifest_id: str,
                     granted: Collection[str] = NO_GRANTS, *, bad_grant: bool = False) -> ReadRefusal | None:
    """Why ``node_id`` may not read ``manifest_id`` here (None: it may). ``granted``: the
    manifests its request's grants open; ``bad_grant``: it presented grants and none holds."""
    if readers.everyone or manifest_id in readers.public:
        return None
    if node_id is None:
        return "not_a_node"
    if manifest_id in readers.manifests_for(node_id, granted):
        return None
    return "bad_grant" if bad_grant else "not_a_member"


def chunk_refusal(readers: Readers, node_id: str | None, chunk_id: str,
                  chunks_of: Callable[[str], Collection[str] | None], *, strict: bool = True,
                  granted: Collection[str] = NO_GRANTS, bad_grant: bool = False) -> ReadRefusal | None:
    """Why ``node_id`` may not read ``chunk_id`` here (None: it may): it must be listed by a
    manifest the node may read (a public one, one of its gangs here, or one its request's
    grants open: ``granted``). With ``strict`` false (before a wait for a chunk this node
    does not have yet) an undecidable case passes: the node has no gang here yet and
    presented no grant (its placement may come after its peers ask) or a manifest it may read
    is not held here yet; the strict check follows the wait."""
    if readers.everyone:
        return None
    for m in readers.public:
        listed = chunks_of(m)
        if listed is not None and chunk_id in listed:
            return None
    if node_id is None:
        return "not_a_node"
    mine = readers.manifests_for(node_id)
    undecided = not mine and not bad_grant   # (no gang here yet, and no failed grant to say why)
    mine += granted
    for m in mine:
        listed = chunks_of(m)
        if listed is None:
            undecided = True
        elif chunk_id in listed:
            return None
    if undecided and not strict:
        return None
    return "bad_grant" if bad_grant else "not_a_member"
