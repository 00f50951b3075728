"""A preempting gang's round through rack relays (placer.relays' driver over the real state,
on a virtual clock, each relay an honest fake that checks the placer's signature over every
bundle and answers each part): every node with a victim is sent its stop in a round of stops,
bundled by rack, before any of the gang's bundles is built; the gang's start parts still name
their victims. A refused start rolls the gang back and the victims stay stopped. The fleet
emulator counts a victim told twice (its stop, then its start part) once."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import trio

from placer.attempts import ACCEPTED, Outcome
from placer.records import GangPushes, NodeRec, Push
from placer.relaypolicy import RackPins
from placer.relays import RelayConn, RelayHub
from placer.state import PlacerState
from scheduler_link import msgauth
from scheduler_link.frames import encode_frame
from scheduler_link.messages import (
    AckBundle,
    Frame,
    JobSpec,
    NodeOutcome,
    NodeReport,
    RackBeat,
    RackBeatReply,
    ReportReply,
    Victim,
    expand_part,
)
from testing.fleet import FleetStats
from tests.test_gang_bookkeeping import _state


class Host:
    """RelayHost over a PlacerState (what the hub may use of a placer, and nothing else)."""

    def __init__(self, st_: PlacerState) -> None:
        self.cfg = st_.cfg
        self.signer = msgauth.BundleSigner.generate()
        self.clock: Callable[[], float] = trio.current_time
        self.rack_pins = RackPins()
        self.epoch = 1
        self.st = st_
        self.nursery: trio.Nursery | None = None

    @property
    def nodes(self) -> Mapping[str, NodeRec]:
        return self.st.nodes

    def leading(self) -> bool:
        return True

    def gang_blob(self, blob_id: str) -> bytes | None:
        return self.st.blobs.get(blob_id)

    def mac_key(self, node_id: str, boot_id: str) -> bytes:
        return self.st.mac_key(node_id, boot_id)

    def count_bad_macs(self, n: int) -> None:
        raise AssertionError("every MAC here is its node's own")

    def count_stale_epoch(self, n: int) -> None:
        raise AssertionError("one placer here")

    def apply_beat(self, beat: RackBeat, at: float, *, via: str, answered: float | None) -> RackBeatReply:
        raise AssertionError("no beats here")

    def ingest_relayed(self, rep: NodeReport, via: str) -> tuple[int, ReportReply]:
        raise AssertionError("no reports here")

    def ingest_relayed_many(self, reps: list[NodeReport], via: str) -> list[tuple[int, ReportReply]]:
        raise AssertionError("no reports here")

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(fn)


class Relay:
    """A rack relay's frames connection: each bundle's signature is checked (the shipped
    verifier), its parts logged in ``sent`` (in the order bundles left, all relays together)
    and answered after 10 ms, each part with its node's MAC: accepted, but a start part of a
    node in ``refusing`` (refused_gpus)."""

    def __init__(self, host: Host, rack: str, sent: list[tuple[str, list[Any]]], refusing: set[str]) -> None:
        self.name = rack
        self.info: Any = None
        self.closed = trio.Event()
        self.term = 0
        self.host, self.rack, self.sent, self.refusing = host, rack, sent, refusing
        self.verifier = msgauth.BundleVerifier(host.signer.public)

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1, term=self.term)

    def call_cb(self, rid: int, data: bytes, fn: Callable[[Frame | None], None]) -> None:
        f = msgspec.msgpack.decode(data[4:], type=Frame)
        view, parts, _ = self.verifier.bundle(bytes(f.payload))
        assert view.rack == self.rack and view.epoch == 1
        parts = [expand_part(p) for p in parts]
        self.sent.append((self.rack, parts))
        outs = []
        for p in parts:
            node = self.host.st.nodes[p.node_id]
            refused = bool(p.pods) and p.node_id in self.refusing
            o = NodeOutcome(node_id=p.node_id, placement_id=p.placement_id,
                            outcome="refused_gpus" if refused else "accepted",
                            refused_gpus=[node.uuids[0]] if refused else [])
            outs.append(msgauth.with_outcome_mac(self.host.mac_key(p.node_id, node.boot_id), o))

        async def later() -> None:
            await trio.sleep(0.01)
            raw = encode_frame("acks", AckBundle(rack=self.rack, blob_id=view.blob_id, outcomes=outs), re=rid)
            fn(msgspec.msgpack.decode(raw[4:], type=Frame))
        assert self.host.nursery is not None
        self.host.nursery.start_soon(later)

    def forget(self, rid: int) -> None:
        pass


async def _preempting_round(refuse_first: bool = False) -> tuple[PlacerState, GangPushes, list[tuple[str, list[Any]]],
                                                           Mapping[str, Outcome] | None, list[Push]]:
    """A fleet of 12 nodes in 4 racks full of a low job (12 pods of 7 GPUs), then a high gang of
    7 whole nodes: it preempts every pod of the low job, on its own nodes and on 5 others.
    ``refuse_first``: the gang's first node refuses its start part. Returns the state, the
    gang's pushes, the bundles as they left, the round's outcomes and the pushes the acks then
    asked for (a rollback's stops)."""
    st_ = _state([3, 4, 2, 3])
    st_.mac_master = os.urandom(msgauth.KEY_LEN)   # (the nodes' MAC keys derive from it)
    st_.submit(JobSpec(job_id="low", pods=12, gpus_per_pod=7, priority=0, preemptible=True, argv=["x"]), 0.1)
    (low, lp), = st_.schedule(0.1)
    st_.on_acks("low", low.attempt, {p.node_id: ACCEPTED for p in lp}, 0.2, lp)
    low.move_pods("accepted", "running")
    st_.submit(JobSpec(job_id="high", pods=7, gpus_per_pod=8, priority=5, argv=["x"]), 0.3)
    (high, hp), = st_.schedule(0.3)
    assert isinstance(hp, GangPushes) and hp.victims is not None and len(hp.extra) == 5
    host = Host(st_)
    hub = RelayHub(host)
    sent: list[tuple[str, list[Any]]] = []
    refusing = {hp.node_ids[0]} if refuse_first else set()

    async def push_direct(p: Push) -> Outcome:
        raise AssertionError(f"{p.node_id} pushed directly: its relay answered")

    async with trio.open_nursery() as n:
        host.nursery = n
        for nid, node in st_.nodes.items():
            if node.rack_path not in hub._cands:
                ch = Relay(host, node.rack_path, sent, refusing)
                conn = RelayConn(nid, (node.rack_path,), None, ch)  # type: ignore[arg-type]  # (the FrameChannel calls the hub makes)
                ch.info = conn
                hub._cands[node.rack_path] = {nid: conn}
        acks = await hub.deliver("high", high.blob_id, hp, push_direct)
        n.cancel_scope.cancel()
    more = st_.on_acks("high", high.attempt, acks or {}, 0.4, hp)
    return st_, hp, sent, acks, more


async def test_every_victims_stop_leaves_in_a_round_of_stops_before_the_gangs_bundles(autojump_clock) -> None:
    st_, hp, sent, acks, more = await _preempting_round()
    cols = hp.n_cols
    assert hp.victims is not None
    victims_of = {hp.node_ids[i]: hp.victims[i] for i in range(cols) if hp.victims[i]}
    victims_of |= {p.node_id: p.placement.victims for p in hp.extra}
    assert len(victims_of) == 12 and sum(map(len, victims_of.values())) == 12   # (every low pod a victim)
    kinds = ["start" if any(p.pods for p in parts) else "stop" for _, parts in sent]
    k = kinds.count("stop")
    assert kinds == ["stop"] * k + ["start"] * (len(kinds) - k)   # every stop bundle left first
    stops = [p for _, parts in sent[:k] for p in parts]
    assert all(not p.pods for p in stops) and len({rack for rack, _ in sent[:k]}) == k   # one a rack
    assert sorted(p.node_id for p in stops) == sorted(victims_of)   # every victim's node, once
    assert all(p.victims == victims_of[p.node_id] and p.boot_id == "b" for p in stops)
    starts = [p for _, parts in sent[k:] for p in parts]
    assert sorted(p.node_id for p in starts) == sorted(hp.node_ids[:cols])
    assert all(p.victims == victims_of.get(p.node_id, []) for p in starts)   # (they still name them)
    assert acks is not None and len(acks) == cols and not more
    assert st_.jobs["high"].state == "starting" and st_.jobs["low"].state == "preempted"


async def test_a_refused_start_rolls_the_gang_back_and_the_victims_stay_stopped(autojump_clock) -> None:
    st_, hp, sent, acks, more = await _preempting_round(refuse_first=True)
    bad = hp.node_ids[0]
    assert ["stop" if not any(p.pods for p in parts) else "start" for _, parts in sent].index("start") > 0
    assert acks is not None and acks.refused().keys() == {bad}   # type: ignore[attr-defined]  # (RoundOutcomes)
    low, high = st_.jobs["low"], st_.jobs["high"]
    assert high.state in ("pending", "placing") and "refused_gpus" in (high.reason or "")
    # the rollback stops the gang's pods where they were accepted, and no victim comes back
    assert sorted(p.node_id for p in more) == sorted(set(hp.node_ids[:hp.n_cols]) - {bad})
    assert all(v.workload_id.startswith("high.") for p in more for v in p.placement.victims)
    assert low.state == "preempted" and low.counts["terminating"] == 12 and not low.counts["running"]


def test_the_fleet_emulator_counts_a_victim_told_twice_once() -> None:
    stats = FleetStats()
    v = [Victim(workload_id="low.1.0"), Victim(workload_id="low.1.1")]
    stats.told(v[:1], 1.0, "part")         # its stop, in the round of stops
    stats.told(v, 2.0, "part")             # its node's start part names it again, and another
    stats.told(v[:1], 3.0, "placement")    # a direct push of the same stop
    assert stats.victims_told == 2 and stats.victims_by == {"part": 2}
    assert (stats.first_victim_at, stats.last_victim_at) == (1.0, 2.0)
