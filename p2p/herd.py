"""The herd fetcher: a manifest's missing chunks from peers and the origin, with about
one copy of origin egress however many nodes fetch at once (DESIGN.md, the herd protocol).

Shape (decide, then act). Tree mode (the default, ``HerdConfig.tree``): once per
manifest, :func:`p2p.tree.plan_node` — numpy over the gang's columnar peer view
(a ``PeerTable`` or a ``Peer`` list) — gives this node, for every chunk, its place in
that chunk's bounded fan-in tree (origin -> global home -> a k-ary tree over racks ->
the rack's members); :meth:`p2p.tree.NodePlan.sources` turns one row of it and the
penalty book into ranked sources (parent with wait, rack-mate siblings without,
ancestors and successors with wait; the origin only for the home, a successor of a
dead home, or when the tree above is dead or exhausted). A 503 sends the asker on to
the next source; a round of only 503s backs off (Retry-After) and asks again. The
manifest travels the same way; have-probes go to the rack only. Flat mode (``tree =
False``, the design before, kept as the benchmarks' baseline):
:func:`p2p.rendezvous.plan_sources` per chunk. Either way this module only carries
the plan out:

- the chunk's home (plan = origin only) fetches it from the origin, with bounded
  concurrency and retries with jittered backoff while the origin is down -- the one
  retry layer of a fetch's origin reads (:meth:`Herd._origin_call`; origins are opened
  with ``retries=0``): ``origin_tries`` requests at most, an answer that will not change
  (401/403, a bad request) fails at once, and an origin that failed its budget fails the
  chunk (no re-plan asks it again);
- everyone else asks the peers ranked above it with ``?wait_ms=`` so a request lands on
  the home's in-flight download (or waits for the home to start it);
- a source that fails (refused, 404 after the wait, timeout, stall, bad bytes) is
  penalised in :class:`p2p.peers.PeerHealth` and the next-ranked source is tried, the
  origin last. Bad bytes ban the peer for the rest of the fetch;
- racing follows trio's happy-eyeballs pattern: attempts start one after another in one
  nursery, the next when the previous failed — or, in the *endgame* (the last few
  outstanding chunks), at once on a second peer; the first verified answer wins and
  the losers are cancelled;
- one download per chunk per node (single flight across every fetch run by this Herd);
- every chunk is verified (BLAKE3 == id) before it is stored.

State has one owner: the Herd's tasks all run in one trio thread, and the counters and
the penalty book are only touched from it.
"""

from __future__ import annotations

import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import blake3
import msgspec
import trio
from prometheus_client.metrics_core import Metric

from infra.backoff import Backoff
from infra.metrics import family, text_of
from infra.peers import Peer, PeerTable

from .balance import balanced_order
from .errors import IntegrityError, NotFoundError, OriginError, OriginUnavailable, PeerError
from .fetchrun import OWN, REST, FetchRun
from .flight import SingleFlight
from .origins import Origin, check_hex_id
from .peers import PeerBusy, PeerClient, PeerClientConfig, PeerCorrupt, PeerHealth, PeerMissing
from .pool import run_pool
from .ratelimit import AsyncBucket
from .rendezvous import Source, assign_homes, assign_rack_homes, order, plan_sources, rack_label
from .store import ChunkStore
from .tree import RACK_FANOUT, TREE_K, NodePlan, PeerView, Planner, chunk_keys, plan_node

log = logging.getLogger("herd.p2p.herd")


@dataclass(frozen=True, slots=True)
class HerdConfig:
    workers: int = 16                  # chunks in flight on this node
    per_peer: int = 8                  # concurrent requests to one peer
    origin_concurrency: int = 8        # concurrent origin requests from this node
    # Chunks this node is home for, fetched from the origin at once. Low on purpose: the
    # origin's link is shared by every home, and few streams make it deliver chunks in
    # (about) manifest order, so peers can start forwarding early (a pipeline); many
    # streams would all finish at the end together. None: ``origin_streams`` spread over
    # the homes (see home_streams). Alone (no peers) origin_concurrency.
    home_concurrency: int | None = None
    # What the whole herd keeps open to the origin for its homes, when home_concurrency is
    # None: 2 homes get 2 streams each, 4 or more get 1 (bench.herd, N = 8 under htb: 1
    # stream a home 1.196x ideal, 2 streams 1.29x, 4 streams 1.33x; same-run pairs).
    origin_streams: int = 4
    wait_ms: int = 60_000              # how long we let a peer ranked above us make us wait
    head_grace_s: float = 5.0          # on top of wait_ms, for an answer's head
    connect_s: float = 3.0
    stall_s: float = 10.0              # no body bytes for this long: a stalled peer
    penalty_s: float = 30.0
    endgame: int = 4                   # duplicate the last N outstanding chunks to a 2nd peer
    # Requests for one chunk (or manifest) to an origin that is down or says "later"
    # (OriginUnavailable), the first included: with the backoff below, 1-2 min of outage.
    # The only retry layer of a fetch: origins are opened with retries=0.
    origin_tries: int = 30
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    peer_rate_bps: float | None = None    # optional caps (bits/s) on what we receive
    origin_rate_bps: float | None = None
    rack_aware: bool = True
    peer_transfers_while_home: int = 4  # at least; see Herd._gate and fetch_chunks
    manifest_peers: int = 3            # peers asked for the manifest before the origin
    have_probe_s: float = 1.0          # ... and how long the start of a fetch waits for them
    have_probe_max: int = 256         # peers asked for their have-bitmap at the start of a fetch
    sync_every_bytes: int = 64 << 20   # fsync stored chunks in batches of this much while fetching
    balance_homes: bool = True         # homes balanced by bytes: trees p2p.balance, flat assign_homes
    max_rounds: int = 4                # replans of one chunk after every source failed
    # Bounded fan-in trees (p2p.tree): origin -> global home -> rack homes in a k-ary tree
    # over racks -> rack members (an m-ary tree inside a rack). False: the flat ranking
    # of p2p.rendezvous (the design before; kept as the benchmarks' baseline).
    tree: bool = True
    tree_k: int = TREE_K
    rack_fanout: int = RACK_FANOUT     # m = k: see p2p.tree's module doc
    busy_rounds: int = 600             # rounds where every source was only busy (503) or missing
    origin_verify_tries: int = 3       # origin answers that fail verification before OriginCorruptError
    # A tree source is asked for the manifest with ?wait_ms=manifest_wait_ms (the data
    # plane caps it at 2 s): it answers as soon as it has stored it. After a 404 (the wait
    # ran out, or a data plane without manifest waits) or a 503: ask again after
    # manifest_poll_s, each pause manifest_poll_growth times the last, at most
    # manifest_poll_max_s.
    manifest_wait_ms: int = 2_000
    manifest_poll_s: float = 0.002
    manifest_poll_growth: float = 1.25
    manifest_poll_max_s: float = 0.25
    probe_all_below: int = 64          # gangs up to this size probe every member's have-bitmap
    # The tree plan is made block by block: the fetch starts once the first block is
    # planned (and the have-probes answered); the rest is planned while chunks move.
    plan_first: int = 32
    plan_block: int = 1024
    # Multi-chunk requests (GET /v1/chunks?ids=, p2p.batch): chunks a rack-mate is known
    # to hold (its have-bitmap) are asked of it up to batch_chunks / batch_bytes at a time,
    # received, verified and stored by one worker thread (1 = one request per chunk).
    batch_chunks: int = 16
    batch_bytes: int = 32 << 20
    batch_redo: int = 4                # chunks of a failed batch re-fetched at once, one by one
    # Batches that can wait (GET /v1/chunks?ids=&sizes=&wait_ms=): a tree child asks its
    # parent for its next batch_wait_chunks chunks from that parent at once (found among
    # the next batch_scan queued chunks), each sent as soon as the parent has it -- one
    # request, one receiving thread and no per-chunk round trip on either end for what
    # would be that many waiting requests. 0: one waiting request per chunk (as before).
    batch_wait_chunks: int = 8
    batch_scan: int = 256
    # multi-chunk requests to one peer at once; 0: half this host's cores, 2 to 8 (each
    # stream's thread receives, hashes and writes: about a core at full speed)
    batch_streams: int = 0


def home_streams(cfg: HerdConfig, *, homes: int) -> int:
    """Origin streams for one home's own chunks: ``cfg.home_concurrency`` when set, else the
    herd's ``origin_streams`` divided among its ``homes`` (at least 1, at most
    ``origin_concurrency``)."""
    if cfg.home_concurrency is not None:
        return max(1, cfg.home_concurrency)
    return max(1, min(cfg.origin_concurrency, -(-cfg.origin_streams // max(1, homes))))


class HerdCounters(msgspec.Struct, kw_only=True):
    bytes_from_origin: int = 0
    bytes_from_peers: int = 0
    bytes_local: int = 0
    chunks_from_origin: int = 0
    chunks_from_peers: int = 0
    chunks_local: int = 0
    origin_retries: int = 0
    origin_errors: int = 0
    integrity_failures: int = 0
    endgame_duplicates: int = 0
    wasted_bytes: int = 0             # received from a loser of a race, or bad bytes
    chunks_in_flight: int = 0
    busy_answers: int = 0             # 503s from peers (their per-chunk or request caps)
    busy_backoff_s: float = 0.0       # time spent backing off after busy rounds
    origin_bad_answers: int = 0       # origin bytes refused (did not match the chunk id)


class HerdError(PeerError):
    """Every source of a chunk failed, repeatedly."""


class OriginCorruptError(OriginError, IntegrityError):
    """The origin kept answering bytes that do not match the chunk's id (corrupt at rest):
    an origin failure and an integrity failure both."""


class _Notes:
    """What the attempts of one race ran into (one race's scratch, one owner)."""
    __slots__ = ("busy", "soft", "hard", "retry_s")

    def __init__(self) -> None:
        self.busy = 0          # 503s
        self.soft = 0          # 404 after the wait: not there yet
        self.hard = 0          # unreachable, timed out, bad bytes, origin errors
        self.retry_s = 0.0     # the longest Retry-After a busy source asked for


PeersArg = Sequence[Peer] | PeerTable


class Herd:
    """A node's herd fetcher. Long-lived (the agent keeps one) or per fetch."""

    def __init__(self, store: ChunkStore, *, node_id: str, token: str | None,
                 config: HerdConfig | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: mutual TLS to peers' data planes (their URLs are then https://)."""
        self.store = store
        self.node_id = node_id
        self.config = cfg = config or HerdConfig()
        self.client = PeerClient(token=token, config=PeerClientConfig(
            head_grace_s=cfg.head_grace_s, stall_s=cfg.stall_s, connect_s=cfg.connect_s,
            rate_bps=cfg.peer_rate_bps), ssl_context=ssl_context)
        self.health = PeerHealth(penalty_s=cfg.penalty_s)
        self.counters = HerdCounters()
        self._rng = random.Random()   # the jitter of the origin retries' back-off
        self._origin_limit = trio.CapacityLimiter(cfg.origin_concurrency)
        self._origin_bucket = AsyncBucket(cfg.origin_rate_bps)
        self._peer_limits: dict[str, trio.CapacityLimiter] = {}
        self._batch_limits: dict[tuple[str, bool], trio.CapacityLimiter] = {}   # multi-chunk requests a peer
        # Peer bodies flowing in at once. While this node still has chunks to pull from
        # the origin as their home, fewer (see fetch_chunks): its origin streams
        # are everyone's critical path and must not starve on its own downlink.
        self._gate = trio.CapacityLimiter(max(cfg.workers, 1))
        # Single flight over the store's in-flight table (p2p.fetch's too): one download
        # per chunk per node, whichever path asked for it.
        self.flight = SingleFlight(store.inflight)
        self.last_plan: tuple[NodePlan, dict[str, int]] | None = None   # the last fetch's tree plan
        self._view: tuple[PeersArg, PeerView, int] | None = None        # the last peers' view

    async def aclose(self) -> None:
        await self.client.aclose()

    def statistics(self) -> dict[str, Any]:
        s = msgspec.structs.asdict(self.counters)
        s["peers"] = self.health.snapshot()
        s["penalised"] = sorted(self.health.penalties(trio.current_time()) if _in_trio() else self.health.until)
        return s

    def view(self, peers: PeersArg) -> tuple[PeerView, int]:
        """The columnar peer view (this node included) and this node's row. Built once
        for the same peers object (the manifest and the chunks of one fetch share it)."""
        if self._view is not None and self._view[0] is peers:
            return self._view[1], self._view[2]
        view, me = self._build_view(peers)
        self._view = (peers, view, me)
        return view, me

    def _build_view(self, peers: PeersArg) -> tuple[PeerView, int]:
        return peer_view(peers, self.node_id)

    def plan(self, view: PeerView, me: int, ids: Sequence[str]) -> NodePlan:
        """This node's tree plan for ``ids`` (pure; seconds of numpy at 25,000 peers)."""
        return plan_node(view, me, chunk_keys(ids), k=self.config.tree_k, rack_fanout=self.config.rack_fanout)

    # ------------------------------------------------------------------ manifests

    async def fetch_manifest_bytes(self, manifest_id: str, origin: Origin, peers: PeersArg) -> bytes:
        """The manifest's bytes. Tree mode: like a chunk, from its tree parent (asked
        with ``?wait_ms=``, again after a 404 or 503, up to ``wait_ms`` in all), the next
        live source when a parent is dead, the origin only at its global home (or when
        every source above is dead, or the wait ran out). Verified by id; the caller
        verifies origin bytes on decode."""
        if self.config.tree:
            return await self._tree_manifest(manifest_id, origin, peers)
        assert not isinstance(peers, PeerTable)
        by_id = {p.node_id: p for p in peers if p.node_id != self.node_id}
        for nid in order(manifest_id, list(by_id))[: self.config.manifest_peers]:
            p = by_id[nid]
            try:
                with trio.move_on_after(self.config.head_grace_s):
                    data = await self.client.get_manifest(p.data_url, manifest_id)
                    if blake3.blake3(data).hexdigest() == manifest_id:
                        return data
                    self.health.bad_bytes(p.node_id, "manifest does not match its id")
            except PeerError:
                continue
        return await self._origin_call(origin.get_manifest, manifest_id, what=f"manifest {manifest_id}")

    async def _tree_manifest(self, manifest_id: str, origin: Origin, peers: PeersArg) -> bytes:
        def plan_manifest() -> NodePlan:
            # the view (~10 ms of numpy at 50,000 peers, kept for the chunks) and the
            # manifest's tree, off the trio thread that serves the data plane
            view, me = self.view(peers)
            return self.plan(view, me, [manifest_id])

        plan = await trio.to_thread.run_sync(plan_manifest)
        deadline = trio.current_time() + self.config.wait_ms / 1000
        polls = manifest_polls(self.config)
        while True:
            now = trio.current_time()
            pen = self.health.penalties(now)
            # the first live source: a penalised one (it just failed) is not asked again
            # here -- with every source above penalised, the origin (the chunks' rule)
            src = next(s for s in plan.sources(0, pen, now) if s.kind == "origin" or s.node_id not in pen)
            if src.kind == "origin" or now >= deadline:
                return await self._origin_call(origin.get_manifest, manifest_id, what=f"manifest {manifest_id}")
            wait_ms = max(0, min(self.config.manifest_wait_ms, int((deadline - now) * 1000)))
            try:
                with trio.fail_after(wait_ms / 1000 + self.config.head_grace_s + self.config.stall_s):
                    data = await self.client.get_manifest(src.url, manifest_id, wait_ms=wait_ms)
            except (PeerMissing, PeerBusy) as e:
                self.health.missing(src.node_id)
                pause = e.retry_after_s if isinstance(e, PeerBusy) and e.retry_after_s else 0.0
                await trio.sleep(max(pause, next(polls)) * random.uniform(0.75, 1.25))
                continue
            except (PeerError, trio.TooSlowError) as e:
                self.health.failed(src.node_id, e if isinstance(e, PeerError) else PeerError(str(e)), now)
                continue
            if blake3.blake3(data).hexdigest() == manifest_id:
                return bytes(data)
            self.health.bad_bytes(src.node_id, "manifest does not match its id")

    async def _holders(self, manifest_id: str, peers: Sequence[Peer]) -> dict[str, list[str]]:
        """chunk id -> peers whose have-bitmap says they hold it (asked once, briefly, in
        parallel; a peer that does not answer simply holds nothing as far as we know)."""
        out: dict[str, list[str]] = {}
        try:
            ids = [c.id for c in self.store.get_manifest(manifest_id).chunks]
        except Exception:
            return out

        async def ask(p: Peer) -> None:
            with trio.move_on_after(self.config.have_probe_s):
                try:
                    bits = await self.client.get_have(p.data_url, manifest_id, len(ids))
                except PeerError:
                    return
                for i, cid in enumerate(ids):
                    if bits[i >> 3] & (0x80 >> (i & 7)):
                        out.setdefault(cid, []).append(p.node_id)

        limit = trio.CapacityLimiter(32)

        async def ask_limited(p: Peer) -> None:
            async with limit:
                await ask(p)

        async with trio.open_nursery() as nursery:
            for p in peers[: self.config.have_probe_max]:
                if p.node_id != self.node_id:
                    nursery.start_soon(ask_limited, p)
        return out

    # ------------------------------------------------------------------ chunks

    async def fetch_chunks(self, chunks: Sequence[tuple[str, int]], origin: Origin,
                           peers: PeersArg, *, manifest_id: str | None = None,
                           progress: Callable[[int], None] | None = None) -> HerdCounters:
        """Get every (id, size) in ``chunks`` into the store. Returns this call's counters
        (the Herd's running totals are in :meth:`statistics`). Raises StoreFullError,
        IntegrityError / NotFoundError from the origin, or HerdError."""
        run = HerdCounters()
        if self.config.tree:
            return await self._fetch_tree(chunks, origin, peers, manifest_id, progress, run)
        assert not isinstance(peers, PeerTable)
        peers = list(peers)
        todo = self._missing(chunks, run)
        if not todo:
            return run
        holders = await self._holders(manifest_id, peers) if manifest_id else {}
        return await self._legacy_pool(chunks, todo, origin, peers, holders, progress, run)

    def _missing(self, chunks: Sequence[tuple[str, int]], run: HerdCounters) -> list[tuple[str, int]]:
        """The chunks not in the store yet; those already there are counted as local."""
        todo: list[tuple[str, int]] = []
        for cid, size in chunks:
            if self.store.has_chunk(cid):
                run.bytes_local += size
                run.chunks_local += 1
            else:
                todo.append((cid, size))
        self.counters.bytes_local += run.bytes_local
        self.counters.chunks_local += run.chunks_local
        return todo

    async def _fetch_tree(self, chunks: Sequence[tuple[str, int]], origin: Origin, peers: PeersArg,
                          manifest_id: str | None, progress: Callable[[int], None] | None,
                          run: HerdCounters) -> HerdCounters:
        """Tree mode: the plan made block by block (the first block, and the have-probes,
        before any chunk moves; the rest while chunks move), fed into the two pools."""
        todo = self._missing(chunks, run)
        if not todo:
            return run
        view, me = self.view(peers)
        # the manifest's whole chunk table, dealt in an order that balances the homes'
        # bytes (p2p.balance, for racks of the view's largest size): the trees depend on it
        table = dict(chunks)
        ids = list(table)
        if self.config.balance_homes and len(view):
            ids = [ids[i] for i in balanced_order([table[c] for c in ids], int(view.sizes.max()))]
        cfg = self.config
        planner = Planner(view, me, chunk_keys(ids), k=cfg.tree_k, rack_fanout=cfg.rack_fanout)
        cindex = {cid: i for i, cid in enumerate(ids)}
        self.last_plan = (planner.plan, cindex)
        # have-probes only within the rack (bounded by the rack's size); a small gang
        # (where every placement lists every member) probes everyone: a warm node in
        # another rack then feeds the chunks its rack-less homes would read from the origin
        if len(view) <= cfg.probe_all_below:
            rack_rows = [r for r in range(len(view)) if r != me]
        else:
            rack_rows = [int(r) for r in view.grid[int(view.rack_of[me])] if r >= 0 and r != me]
        mates = [Peer(node_id=view.node_ids[r], data_url=view.urls[r]) for r in rack_rows if view.urls[r]]
        holders: dict[str, list[str]] = {}

        async def probe(manifest_id: str) -> None:
            holders.update(await self._holders(manifest_id, mates))

        async with trio.open_nursery() as nursery:
            if manifest_id and mates:
                nursery.start_soon(probe, manifest_id)
            await trio.to_thread.run_sync(planner.step, cfg.plan_first)
        fr = self._run_of(others=max(len(view) - 1, 0))
        fr.add_planned(planner, todo, cindex)

        async def plan_rest() -> None:
            size = cfg.plan_first
            while planner.done < len(planner):
                size = min(size * 4, max(cfg.plan_block, 1))
                await trio.to_thread.run_sync(planner.step, size)
                fr.add_planned(planner, todo, cindex)
            fr.close()

        return await self._pools(fr, origin, [], holders, {}, {}, progress, run,
                                 tplan=(planner.plan, cindex), n_homes=len(view), background=plan_rest)

    def _run_of(self, *, others: int, own: list[tuple[str, int]] | None = None,
                rest: list[tuple[str, int]] | None = None) -> FetchRun:
        # Enough peer bodies to fill the downlink (each peer's upload is split among all
        # the nodes it feeds, so ~one flow per peer), few enough that this home's own
        # origin streams keep at least their 1/N share of it.
        cfg = self.config
        return FetchRun(workers=cfg.workers, endgame=cfg.endgame, sync_every_bytes=cfg.sync_every_bytes,
                        home_gate=max(cfg.peer_transfers_while_home, others), own=own, rest=rest)

    async def _legacy_pool(self, chunks: Sequence[tuple[str, int]], todo: list[tuple[str, int]], origin: Origin,
                           peers: list[Peer], holders: dict[str, list[str]],
                           progress: Callable[[int], None] | None, run: HerdCounters) -> HerdCounters:
        # Balanced homes over the manifest (the same map on every node: same inputs).
        ids = [p.node_id for p in peers]
        if self.node_id not in ids:
            ids.append(self.node_id)
        homes = assign_homes(chunks, ids) if self.config.balance_homes else {}
        rhomes: dict[str, str] = {}
        me = next((p for p in peers if p.node_id == self.node_id), None)
        if homes and self.config.rack_aware and me is not None and any(p.rack for p in peers):
            mates = [p.node_id for p in peers if rack_label(p) == rack_label(me)]
            n_racks = len({rack_label(p) for p in peers})
            rhomes = assign_rack_homes(chunks, mates, homes, n_racks=n_racks)
        # Homes run ahead: the chunks this node is home for go through their own pool
        # (they go to the origin anyway), so the origin link stays busy while the other
        # pool waits on peers' in-flight downloads. One pool would stall on both stages.
        own: list[tuple[str, int]] = []
        rest: list[tuple[str, int]] = []
        for cid, size in todo:
            first = plan_sources(cid, self.node_id, peers, rack_aware=self.config.rack_aware,
                                 holders=holders.get(cid, ()), home=homes.get(cid),
                                 rack_home=rhomes.get(cid))[0]
            (own if first.kind == "origin" else rest).append((cid, size))
        fr = self._run_of(others=len({p.node_id for p in peers if p.node_id != self.node_id}), own=own, rest=rest)
        fr.close()
        return await self._pools(fr, origin, peers, holders, homes, rhomes, progress, run,
                                 tplan=None, n_homes=len(set(ids)))

    async def _pools(self, fr: FetchRun, origin: Origin,
                     peers: list[Peer], holders: dict[str, list[str]], homes: dict[str, str],
                     rhomes: dict[str, str], progress: Callable[[int], None] | None, run: HerdCounters, *,
                     tplan: tuple[NodePlan, dict[str, int]] | None, n_homes: int,
                     background: Callable[[], Awaitable[None]] | None = None) -> HerdCounters:
        """Carry out a :class:`FetchRun`: a pool of workers per queue, batched syncs in the
        background, the planner's remaining blocks (``background``). The first failure
        ends the run, raised as it came."""
        endgame = trio.Event()

        def set_gate() -> None:
            self._gate.total_tokens = fr.gate_tokens()

        def failed(e: Exception) -> None:
            fr.fail(e)
            nursery.cancel_scope.cancel()

        async def background_sync() -> None:
            try:
                await trio.to_thread.run_sync(self.store.sync)
            except Exception as e:
                failed(e)
            finally:
                fr.synced()

        async def worker(q: int) -> None:
            while True:
                item = fr.take(q)
                if item is None:
                    if fr.exhausted(q):
                        return
                    await fr.changed()
                    continue
                cid, size = item
                items = [item]
                src = None
                if tplan is not None and self.config.batch_chunks > 1 and not fr.in_endgame():
                    src = self._batch_source(cid, holders, tplan)
                if src is not None and tplan is not None:
                    def fits(c: str, node: str = src.node_id, wait: bool = src.wait,
                             tp: tuple[NodePlan, dict[str, int]] = tplan) -> bool:
                        s = self._batch_source(c, holders, tp)
                        return s is not None and s.node_id == node and s.wait == wait

                    cfg = self.config
                    most = cfg.batch_wait_chunks if src.wait else cfg.batch_chunks
                    items += fr.take_more(q, fits, most - 1, cfg.batch_bytes - size,
                                          scan=cfg.batch_scan if src.wait else 0)
                try:
                    if src is not None and tplan is not None:
                        await self._get_batch(src, items, origin, endgame, run, holders, tplan)
                    else:
                        await self.get_chunk(cid, size, origin, peers, endgame=endgame, run=run,
                                             holders=holders.get(cid, ()), home=homes.get(cid),
                                             rack_home=rhomes.get(cid), tplan=tplan)
                except Exception as e:  # the first failure ends the fetch, as one clear error
                    failed(e)
                    return
                finally:
                    for _ in items:
                        fr.finished(q)
                    if q == OWN:
                        set_gate()
                for _, sz in items:
                    if progress is not None:
                        progress(sz)
                    if fr.stored(sz):
                        # fsync in batches while fetching, so little is left for the final
                        # sync before mark_complete (never one fsync per chunk)
                        nursery.start_soon(background_sync)
                if fr.in_endgame():
                    endgame.set()

        async def plan_then_gate() -> None:
            assert background is not None
            try:
                await background()
            except Exception as e:
                failed(e)
            set_gate()

        async with trio.open_nursery() as nursery:
            set_gate()
            # (alone, no peers: every chunk is this node's and only the origin has it)
            n_own, n_rest = fr.pool_sizes(own_workers=self.config.origin_concurrency if n_homes <= 1
                                          else home_streams(self.config, homes=n_homes))
            for _ in range(n_own):
                nursery.start_soon(worker, OWN)
            for _ in range(n_rest):
                nursery.start_soon(worker, REST)
            if background is not None:
                nursery.start_soon(plan_then_gate)
        if fr.failure is not None:
            raise fr.failure
        return run

    async def get_chunk(self, cid: str, size: int, origin: Origin, peers: Sequence[Peer], *,
                        endgame: trio.Event | None = None, run: HerdCounters | None = None,
                        holders: Sequence[str] = (), home: str | None = None,
                        rack_home: str | None = None,
                        tplan: tuple[NodePlan, dict[str, int]] | None = None) -> None:
        """One chunk into the store, single-flight: concurrent callers share one download."""

        async def acquire() -> None:
            self.counters.chunks_in_flight += 1
            try:
                eg = endgame if endgame is not None else trio.Event()
                r = run if run is not None else HerdCounters()
                if tplan is not None and cid in tplan[1]:
                    await self._acquire_tree(cid, size, origin, tplan[0], tplan[1][cid], eg, r, holders)
                else:
                    await self._acquire(cid, size, origin, peers, eg, r, holders, home, rack_home)
            finally:
                self.counters.chunks_in_flight -= 1

        await self.flight.run(cid, partial(self.store.has_chunk, cid), acquire)

    def _batch_source(self, cid: str, holders: Mapping[str, Sequence[str]],
                      tplan: tuple[NodePlan, dict[str, int]]) -> Source | None:
        """The peer to ask for ``cid`` in a batch: the first holder (have-bitmap) that
        :meth:`_acquire_tree` would ask first without waiting — a rack-mate, or for a
        chunk this node is home for any holder — and is not penalised now; else (with
        ``batch_wait_chunks`` > 1) the chunk's tree parent, asked with wait, when it is
        not penalised. None: the chunk goes the one-by-one way (its tree, waits, races)."""
        plan, cindex = tplan
        ci = cindex.get(cid)
        if ci is None:
            return None
        v = plan.view
        now = trio.current_time()
        pen = self.health.until
        known = holders.get(cid)
        if known:
            my_rack = v.rack_of[plan.me]
            for n in known:
                row = v.index.get(n)
                if row is None or pen.get(n, 0.0) > now:
                    continue
                if v.rack_of[row] == my_rack or plan.is_home(ci):
                    return Source(kind="peer", node_id=n, url=v.urls[row], wait=False)
        if self.config.batch_wait_chunks <= 1 or plan.origin_rank[ci] == 0:
            return None
        parent = int(plan.chain[ci][0])
        if parent < 0 or not v.urls[parent]:
            return None
        n = v.node_ids[parent]
        if pen.get(n, 0.0) > now:
            return None
        return Source(kind="peer", node_id=n, url=v.urls[parent], wait=True)

    async def _get_batch(self, src: Source, items: list[tuple[str, int]], origin: Origin, endgame: trio.Event,
                         run: HerdCounters, holders: Mapping[str, Sequence[str]],
                         tplan: tuple[NodePlan, dict[str, int]]) -> None:
        """``items`` into the store through one multi-chunk request to ``src`` (single
        flight claimed for each; one already in flight elsewhere is left to that
        download). What the batch did not bring — refused as corrupt (the peer is then
        banned), missing, busy, or cut off by the peer dying — goes the one-by-one way
        (:meth:`get_chunk`: its tree, other sources, the origin), ``batch_redo`` at once."""
        claimed: list[tuple[str, int]] = []
        later: list[tuple[str, int]] = []
        for cid, size in items:
            if self.store.has_chunk(cid):
                continue
            (claimed if self.flight.claim(cid) else later).append((cid, size))
        redo: list[tuple[str, int]] = []
        self.counters.chunks_in_flight += len(claimed)
        try:
            if claimed:
                redo = await self._batch_from(src, claimed, run)
        finally:
            self.counters.chunks_in_flight -= len(claimed)
            for cid, _ in claimed:
                self.flight.release(cid)

        async def one(item: tuple[str, int]) -> None:
            await self.get_chunk(item[0], item[1], origin, [], endgame=endgame, run=run,
                                 holders=holders.get(item[0], ()), tplan=tplan)

        await run_pool(redo + later, one, max(1, self.config.batch_redo))

    async def _batch_from(self, src: Source, items: list[tuple[str, int]], run: HerdCounters) -> list[tuple[str, int]]:
        """One multi-chunk request (with wait when ``src.wait``: the parent sends each chunk
        when it has it); counts and penalties as :meth:`_try` keeps them for one chunk.
        Returns the chunks it did not store."""
        key = (src.node_id, src.wait)
        limiter = self._batch_limits.get(key)
        if limiter is None:
            limiter = self._batch_limits[key] = trio.CapacityLimiter(batch_streams(self.config))
        store = self.store

        def keep(cid: str, body: memoryview) -> None:   # in the receiving thread: verified there
            store.put_chunk(cid, body, verified=True)

        try:
            async with limiter:
                # a waiting batch's body comes at its parent's pace, over its whole wait:
                # holding a gate token through it would idle the others (and stall the sender)
                got = await self.client.get_chunks(src.url, items, store=keep, gate=None if src.wait else self._gate,
                                                   wait_ms=self.config.wait_ms if src.wait else 0)
        except PeerBusy:
            self.counters.busy_answers += 1
            self.health.missing(src.node_id)
            return items
        except PeerMissing:
            self.health.missing(src.node_id)
            return items
        except PeerError as e:
            self.health.failed(src.node_id, e, trio.current_time())
            return items
        redo: list[tuple[str, int]] = []
        for i, (cid, size) in enumerate(items):
            outcome = got.outcomes[i] if i < len(got.outcomes) else ""
            if outcome == "ok":
                self.health.ok(src.node_id, size)
                for c in (self.counters, run):
                    c.bytes_from_peers += size
                    c.chunks_from_peers += 1
                continue
            redo.append((cid, size))
            if outcome == "corrupt":
                self.counters.integrity_failures += 1
                self.counters.wasted_bytes += size
                self.health.bad_bytes(src.node_id, f"chunk {cid[:16]} does not match its hash (in a batch)")
            elif outcome == "busy":
                self.counters.busy_answers += 1
                self.health.missing(src.node_id)
            elif outcome == "missing":
                self.health.missing(src.node_id)
        if got.store_error is not None:
            raise got.store_error      # a full store or a broken disk: the fetch's error
        if got.kind:
            self.health.failed(src.node_id, PeerError(got.error), trio.current_time())
        return redo

    async def _acquire_tree(self, cid: str, size: int, origin: Origin, plan: NodePlan, ci: int,
                            endgame: trio.Event, run: HerdCounters, holders: Sequence[str]) -> None:
        """One chunk through its tree: rack-mates known to hold it (no wait), the parent
        (wait), siblings (no wait), the ancestors and successors (wait). A round where
        sources were only busy (503) backs off (their Retry-After, jittered) and asks
        again; rounds with a dead source or one that did not get the chunk within the
        whole wait count toward ``max_rounds``. The origin only for the home, when
        everything above is dead, or in the last round."""
        cfg = self.config
        v = plan.view
        hard = busy = 0
        # holders (have-bitmaps) asked without waiting: rack-mates first for everyone;
        # other racks' only by the chunk's home, in place of the origin (a chunk crosses
        # into a rack once, down its tree)
        my_rack = v.rack_of[plan.me]
        known = [n for n in holders if n in v.index]
        pre = [Source(kind="peer", node_id=n, url=v.urls[v.index[n]], wait=False)
               for n in known if v.rack_of[v.index[n]] == my_rack]
        if plan.is_home(ci):
            pre += [Source(kind="peer", node_id=n, url=v.urls[v.index[n]], wait=False)
                    for n in known if v.rack_of[v.index[n]] != my_rack]
        while True:
            now = trio.current_time()
            pen = self.health.penalties(now)
            last = hard >= cfg.max_rounds - 1 or busy >= cfg.busy_rounds
            srcs = [s for s in pre if pen.get(s.node_id, 0.0) <= now] + plan.sources(ci, pen, now, last_round=last)
            notes = _Notes()
            won = await self._race(cid, size, srcs, origin, endgame, notes)
            if won is not None:
                await self._keep(cid, size, *won, run)
                return
            if last:
                raise HerdError(f"chunk {cid[:16]}: every source failed")
            if notes.hard or notes.soft:
                # a dead source, or one that did not get it within the whole wait: the
                # tree above is not delivering; after max_rounds of that, the origin
                hard += 1
                continue
            busy += 1
            pause = max(notes.retry_s, cfg.backoff_min_s) * random.uniform(0.5, 1.0)
            self.counters.busy_backoff_s += pause
            await trio.sleep(pause)

    async def _keep(self, cid: str, size: int, data: bytes, src: Source, run: HerdCounters) -> None:
        """Store a won chunk (``_try`` verified it against ``cid`` already) and count it by
        source, in the herd's and this run's counters."""
        await trio.to_thread.run_sync(partial(self.store.put_chunk, cid, data, verified=True))
        for c in (self.counters, run):
            if src.kind == "origin":
                c.bytes_from_origin += size
                c.chunks_from_origin += 1
            else:
                c.bytes_from_peers += size
                c.chunks_from_peers += 1

    async def _acquire(self, cid: str, size: int, origin: Origin, peers: Sequence[Peer],
                       endgame: trio.Event, run: HerdCounters, holders: Sequence[str],
                       home: str | None, rack_home: str | None) -> None:
        last: Exception | None = None
        for _ in range(self.config.max_rounds):
            plan = plan_sources(cid, self.node_id, peers, penalties=self.health.penalties(trio.current_time()),
                                now=trio.current_time(), rack_aware=self.config.rack_aware,
                                holders=holders, home=home, rack_home=rack_home)
            won = await self._race(cid, size, plan, origin, endgame)
            if won is not None:
                await self._keep(cid, size, *won, run)
                return
            last = HerdError(f"chunk {cid[:16]}: every source failed")
        raise last or HerdError(f"chunk {cid[:16]}: no source")

    async def _race(self, cid: str, size: int, plan: list[Source], origin: Origin,
                    endgame: trio.Event, notes: _Notes | None = None) -> tuple[bytes, Source] | None:
        """Happy eyeballs over ``plan``: start the next attempt when the previous failed,
        or (once, in the endgame) when the next source is a waiting peer. First verified
        answer wins; the others are cancelled."""
        winner: list[tuple[bytes, Source]] = []
        fatal: list[BaseException] = []
        duplicated = False

        async def attempt(src: Source, failed: trio.Event) -> None:
            try:
                data = await self._try(src, cid, size, origin)
            except (PeerError, OriginError) as e:
                if src.kind == "origin":
                    # the origin's own retry budget (_origin_call) is spent, or its answer
                    # will not change: the chunk fails, no re-plan asks the origin again
                    fatal.append(e)
                    nursery.cancel_scope.cancel()
                if notes is not None:
                    if isinstance(e, PeerBusy):
                        notes.busy += 1
                        notes.retry_s = max(notes.retry_s, e.retry_after_s)
                    elif isinstance(e, PeerMissing):
                        notes.soft += 1
                    else:
                        notes.hard += 1
                failed.set()
                return
            if not winner:
                winner.append((data, src))
                nursery.cancel_scope.cancel()
            else:
                self.counters.wasted_bytes += len(data)

        async with trio.open_nursery() as nursery:
            for i, src in enumerate(plan):
                failed = trio.Event()
                nursery.start_soon(attempt, src, failed)
                nxt = plan[i + 1] if i + 1 < len(plan) else None
                may_dup = (not duplicated and nxt is not None and nxt.kind == "peer" and nxt.wait
                           and src.kind == "peer")
                if may_dup:
                    which = await _first(failed.wait, endgame.wait)
                    if which == 1 and not failed.is_set():
                        duplicated = True
                        self.counters.endgame_duplicates += 1
                else:
                    await failed.wait()
        if fatal:
            raise fatal[0]
        return winner[0] if winner else None

    async def _try(self, src: Source, cid: str, size: int, origin: Origin) -> bytes:
        if src.kind == "origin":
            # Origin bytes are verified like a peer's (bounded by the manifest's size)
            return await self._origin_call(partial(origin.get_chunk, size=size), cid, what=f"chunk {cid}",
                                           verify=lambda data: len(data) == size
                                           and blake3.blake3(data).hexdigest() == cid)
        limiter = self._peer_limits.get(src.node_id)
        if limiter is None:
            limiter = self._peer_limits[src.node_id] = trio.CapacityLimiter(self.config.per_peer)
        try:
            async with limiter:
                # hashed as it arrives (in the receiving thread for big bodies): no second
                # pass over the bytes on this thread
                data = await self.client.get_chunk_verified(src.url, cid, size,
                                                            wait_ms=self.config.wait_ms if src.wait else 0,
                                                            gate=self._gate)
        except PeerBusy:
            self.counters.busy_answers += 1
            self.health.missing(src.node_id)
            raise
        except PeerMissing:
            self.health.missing(src.node_id)
            raise
        except PeerCorrupt as e:
            self.counters.integrity_failures += 1
            self.counters.wasted_bytes += e.nbytes
            self.health.bad_bytes(src.node_id, f"chunk {cid[:16]} does not match its hash")
            raise PeerError(f"peer {src.node_id} sent bad bytes for {cid[:16]}") from None
        except PeerError as e:
            self.health.failed(src.node_id, e, trio.current_time())
            raise
        self.health.ok(src.node_id, len(data))
        return data

    async def _origin_call(self, fn: Callable[[str], Awaitable[bytes]], ident: str, *, what: str,
                           verify: Callable[[bytes], bool] | None = None) -> bytes:
        """``fn(ident)`` from the origin: the one retry layer of a fetch's origin reads (the
        origins are opened with ``retries=0``), one budget of ``origin_tries`` requests with
        bounded concurrency and jittered exponential backoff between them.

        Asked again: ``OriginUnavailable`` (down, or 408/429/5xx), and an answer ``verify``
        refuses (bad bytes in transit) -- ``origin_verify_tries`` such answers mean corrupt
        at rest: ``OriginCorruptError``. Not asked again:
        ``NotFoundError`` and every other ``OriginError`` (401/403, a bad request, a body
        over its bound): the answer will not change, so it fails at once. Every error
        names ``what`` (the chunk or manifest) and the origin's last answer."""
        cfg = self.config
        tries = max(1, cfg.origin_tries)
        bad = 0
        backoff = Backoff(cfg.backoff_min_s, cfg.backoff_max_s)
        for attempt in range(1, tries + 1):
            try:
                async with self._origin_limit:
                    data = await fn(ident)
            except NotFoundError:
                raise
            except OriginUnavailable as e:
                self.counters.origin_errors += 1
                if attempt >= tries:
                    raise OriginUnavailable(f"{what}: origin still failing after {tries} "
                                            f"request{'s' if tries > 1 else ''}: {e}") from None
                self.counters.origin_retries += 1
                delay = backoff.pause(attempt, self._rng)
                log.info("origin failed; retrying in %.2fs id=%s err=%s", delay, ident[:16], e)
                await trio.sleep(delay)
                continue
            except OriginError as e:
                self.counters.origin_errors += 1
                raise type(e)(f"{what}: {e} (an answer that will not change: not retried)") from None
            await self._origin_bucket.consume(len(data))
            if verify is None or verify(data):
                return data   # bytes, or a bytearray no one else holds (p2p.origins.lean): no copy
            bad += 1
            self.counters.integrity_failures += 1
            self.counters.origin_bad_answers += 1
            self.counters.wasted_bytes += len(data)
            # counted (origin_bad_answers); the error after the last try is the one line
            log.info("origin answered bytes that do not match %s", what)
            if bad >= max(1, cfg.origin_verify_tries) or attempt >= tries:
                raise OriginCorruptError(f"origin {what} does not match its hash after {bad} "
                                         f"answer{'s' if bad > 1 else ''}")
        raise AssertionError("unreachable")   # the loop returns or raises


async def _first(*waits: Callable[[], Any]) -> int:
    """Run the waits concurrently; return the index of the first to finish, cancel the rest."""
    done: list[int] = []
    async with trio.open_nursery() as nursery:
        for i, w in enumerate(waits):
            async def one(i: int = i, w: Callable[[], Any] = w) -> None:
                await w()
                if not done:
                    done.append(i)
                nursery.cancel_scope.cancel()
            nursery.start_soon(one)
    return done[0]


def peer_view(peers: PeersArg, node_id: str) -> tuple[PeerView, int]:
    """The columnar view a fetcher plans over (``node_id`` included: appended in no rack
    when the peers lack it) and its row. Pure; ``bench.herd_sim`` times this very call.
    A gang's ``PeerTable`` is taken column by column (no label per row)."""
    if isinstance(peers, PeerTable):
        view = PeerView.from_table(peers, node_id, "//")
    else:
        me = next((p for p in peers if p.node_id == node_id), None)
        view = PeerView.from_peers(list(peers), node_id, rack_label(me) if me is not None else None)
    return view, view.row_of(node_id)


def manifest_polls(cfg: HerdConfig) -> Iterator[float]:
    """The pauses between asks of a tree source that does not have the manifest yet
    (before jitter): ``manifest_poll_s``, growing by ``manifest_poll_growth``, capped at
    ``manifest_poll_max_s``. Pure; ``bench.herd_sim`` uses the same schedule."""
    first = max(cfg.manifest_poll_s, 1e-4)
    backoff = Backoff(first, max(cfg.manifest_poll_max_s, first), factor=max(cfg.manifest_poll_growth, 1.0))
    n = 0
    while True:
        n += 1
        yield backoff.window(n)


def batch_streams(cfg: HerdConfig) -> int:
    """Multi-chunk requests to one peer at once (``HerdConfig.batch_streams``; 0: auto)."""
    if cfg.batch_streams > 0:
        return cfg.batch_streams
    return min(8, max(2, (os.cpu_count() or 2) // 2))


def _hex(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _in_trio() -> bool:
    try:
        trio.lowlevel.current_task()
        return True
    except RuntimeError:
        return False


async def herd_fetch(herd: Herd, manifest_id: str, origin: Origin, peers: PeersArg, *,
                     progress: Callable[[int, int], None] | None = None) -> tuple[Any, HerdCounters]:
    """The whole fetch through the herd: the manifest (store, peers, origin — verified by
    id), every missing chunk, then a batched sync and the completion mark. Returns
    (manifest, this fetch's counters). The manifest is pinned while it runs."""
    check_hex_id(manifest_id, "manifest id")
    store = herd.store

    async def download() -> Any:
        data = await herd.fetch_manifest_bytes(manifest_id, origin, peers)
        return await trio.to_thread.run_sync(store.put_manifest, manifest_id, data)

    # one download of a manifest per store, however many fetches want it at once
    got = await herd.flight.run(f"manifest:{manifest_id}", partial(store.has_manifest, manifest_id), download)
    manifest = got if got is not None else store.get_manifest(manifest_id)
    store.pin(manifest_id)
    try:
        chunks = [(c.id, c.size) for c in manifest.chunks]
        total = manifest.unique_size
        done = [total - sum(sz for cid, sz in chunks if not store.has_chunk(cid))]

        def prog(n: int) -> None:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

        if progress is not None:
            progress(done[0], total)
        run = await herd.fetch_chunks(chunks, origin, peers, manifest_id=manifest_id, progress=prog)
        await trio.to_thread.run_sync(store.mark_complete, manifest_id)
    finally:
        store.unpin(manifest_id)
    return manifest, run


async def fetch_with_peers(store: ChunkStore, manifest_id: str, origin: Origin, *, peers: Sequence[Any] | PeerTable,
                           node_id: str | None = None, token: str | None = None,
                           progress: Callable[[int, int], None] | None = None,
                           herd: Herd | None = None, config: HerdConfig | None = None) -> Any:
    """:func:`p2p.fetch.fetch_artifact` when peers are given: the same FetchStats.

    ``peers`` are :class:`Peer` structs, bare data-plane URLs (``herd artifact fetch
    --peer URL``; their node id is the URL), or the gang's :class:`PeerTable`. ``herd``: a long-lived Herd (the agent's)
    to share single flight, penalties and counters; else one is made for this call."""
    import socket
    import time

    from .fetch import FetchStats

    t0 = time.perf_counter()
    # A gang's PeerTable (from its blob) goes through as is: every member then plans the
    # same trees. A partial Peer list (a big gang's rack + contacts) would not agree.
    plist: PeersArg = peers if isinstance(peers, PeerTable) else [
        p if isinstance(p, Peer) else Peer(node_id=str(p), data_url=str(p)) for p in peers]
    own = herd is None
    if herd is None:
        herd = Herd(store, node_id=node_id or socket.gethostname(), token=token, config=config)
    try:
        manifest, run = await herd_fetch(herd, manifest_id, origin, plist, progress=progress)
        size = manifest.unique_size
    finally:
        if own:
            await herd.aclose()
    stats = FetchStats(manifest=manifest_id, bytes=size, bytes_from_origin=run.bytes_from_origin,
                       bytes_from_peers=run.bytes_from_peers,
                       bytes_local=size - run.bytes_from_origin - run.bytes_from_peers,
                       chunks_fetched=run.chunks_from_origin + run.chunks_from_peers,
                       seconds=round(time.perf_counter() - t0, 6))
    log.info("herd fetched manifest=%s bytes=%d from_origin=%d from_peers=%d local=%d seconds=%.3f",
             manifest_id, size, stats.bytes_from_origin, stats.bytes_from_peers, stats.bytes_local,
             stats.seconds)
    return stats


def metric_families(node_id: str, herd: Mapping[str, Any] | None,
                    plane: Mapping[str, Any] | None = None) -> Iterator[Metric]:
    """Prometheus families (``infra.metrics``) for the herd (``Herd.statistics()``)
    and the data plane (``DataPlane.statistics()``), for the agent's ``/metrics``. Pure."""
    n = {"node": node_id}

    def one(kind: str, name: str, help_: str, rows: list[tuple[dict[str, str], float]]) -> Metric:
        return family(kind, name, help_, [({**n, **lb}, v) for lb, v in rows])

    if herd is not None:
        yield one("counter", "herd_p2p_bytes_total", "Chunk bytes this node got, by source",
                  [({"source": s}, herd.get(f"bytes_from_{s}" if s != "local" else "bytes_local", 0))
                   for s in ("origin", "peers", "local")])
        yield one("gauge", "herd_p2p_chunks_in_flight", "Chunks being fetched now",
                  [({}, herd.get("chunks_in_flight", 0))])
        yield one("counter", "herd_p2p_origin_retries_total", "Origin requests retried after an error",
                  [({}, herd.get("origin_retries", 0))])
        yield one("counter", "herd_p2p_integrity_failures_total", "Chunks that failed BLAKE3 verification",
                  [({}, herd.get("integrity_failures", 0))])
        yield one("counter", "herd_p2p_endgame_duplicates_total", "Endgame requests duplicated to a 2nd peer",
                  [({}, herd.get("endgame_duplicates", 0))])
        peers = herd.get("peers", {}) or {}
        for key, name, help_ in (("bytes", "herd_p2p_peer_bytes_total", "Bytes received from a peer"),
                                 ("errors", "herd_p2p_peer_errors_total", "Failed requests to a peer"),
                                 ("timeouts", "herd_p2p_peer_timeouts_total", "Requests to a peer that timed out"),
                                 ("integrity_errors", "herd_p2p_peer_bad_bytes_total",
                                  "Chunks from a peer that failed verification")):
            yield one("counter", name, help_, [({"peer": p}, v.get(key, 0)) for p, v in sorted(peers.items())])
        yield one("gauge", "herd_p2p_peers_penalised", "Peers ranked last or banned now",
                  [({}, len(herd.get("penalised", [])))])
    if plane is not None:
        yield one("counter", "herd_dataplane_bytes_served_total", "Chunk bytes served to peers (sendfile)",
                  [({}, plane.get("bytes_served", 0))])
        yield one("counter", "herd_dataplane_requests_total", "Data-plane requests",
                  [({}, plane.get("requests", 0))])
        yield one("counter", "herd_dataplane_rejected_total", "Requests refused, by reason",
                  [({"reason": "busy"}, plane.get("rejected_busy", 0)),
                   ({"reason": "unauthorized"}, plane.get("unauthorized", 0)),
                   ({"reason": "bad_request"}, plane.get("bad_requests", 0)),
                   # reads by membership (p2p.readers): 403s by their reason
                   ({"reason": "not_a_member"}, plane.get("refused_not_a_member", 0)),
                   ({"reason": "not_a_node"}, plane.get("refused_not_a_node", 0)),
                   ({"reason": "bad_grant"}, plane.get("refused_bad_grant", 0))])
        yield one("gauge", "herd_dataplane_waiting", "Requests waiting for a chunk (?wait_ms)",
                  [({}, plane.get("waiting", 0))])


def render_metrics(node_id: str, herd: Mapping[str, Any] | None,
                   plane: Mapping[str, Any] | None = None) -> str:
    """Prometheus text of :func:`metric_families`."""
    return text_of(metric_families(node_id, herd, plane))
