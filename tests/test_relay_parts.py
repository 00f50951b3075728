"""NodePart acceptance (agent.parts), the relay's beat aggregation (agent.relay.BeatBook) and
the blob cache (agent.blobs): pure decisions over plain data, then the acceptor against a
real supervisor (real workloads, real state dir). Parts reach the acceptor as a member gets
them from its relay: with the placer's signed proof (scheduler_link.msgauth)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
import trio

from agent.beats import BeatBook, is_empty
from agent.blobs import BlobCache, BlobUnavailable
from agent.parts import PartAcceptor, PartNotAuthentic, PartNotDurable, check_part
from agent.partstore import PartRecord, PartStore
from agent.state import WorkloadRecord
from agent.supervisor import Supervisor, SupervisorConfig
from scheduler_link.messages import (
    GangBlob,
    NodePart,
    NodeReport,
    NodeStop,
    PartPod,
    PartProof,
    Peer,
    PeerTable,
    Placement,
    PodAssignment,
    RackBeatReply,
    Victim,
    WorkloadEvent,
    encode_gang_blob,
    inventory_hash,
)
from scheduler_link.msgauth import BundleSigner, digest, node_key, outcome_ok, part_bytes
from testing.waiting import poll

UUIDS = [f"GPU-{i:04d}" for i in range(8)]
HEALTH = dict.fromkeys(UUIDS, "healthy")
INV = inventory_hash(UUIDS)
NOW = 1_000_000.0
SIGNER = BundleSigner.generate()
MAC_KEY = node_key(b"m" * 32, "n1", "boot")
BOOT = "boot"   # the node's link boot id: stop parts name it


def _signed(part: NodePart, signer: BundleSigner = SIGNER, epoch: int = 0) -> NodePart:
    """``part`` as its relay hands it over: with the proof of the bundle it came in (of ``epoch``)."""
    raw = part_bytes(part)
    others = [digest(b"another member's part")]
    sig = signer.sign_parts("z/b/r", part.blob_id, NOW + 5, [raw, b"another member's part"], epoch)
    return msgspec.structs.replace(part, proof=PartProof(rack="z/b/r", blob_id=part.blob_id, deliver_by=NOW + 5,
                                                         digests=[digest(raw), *others], sig=sig, raw=raw,
                                                         epoch=epoch))


class _Member:
    """The acceptor as its relay's member: each part arrives signed (see :func:`_signed`)."""

    def __init__(self, acc: PartAcceptor) -> None:
        self.acc = acc

    async def handle(self, part: NodePart) -> object:
        return await self.acc.handle(_signed(part))

    def __getattr__(self, name: str) -> object:
        return getattr(self.acc, name)


def _part(pid: str = "p1", *, node: str = "n1", slots: tuple[int, ...] = (0, 1), inv: str = INV,
          expires_at: float = NOW + 10, victims: tuple[Victim, ...] = (), blob_id: str = "b" * 64,
          wid: str | None = None, job: str = "job") -> NodePart:
    return NodePart(placement_id=pid, node_id=node, job_id=job, attempt=1, blob_id=blob_id,
                    pods=[PartPod(workload_id=wid or f"{job}.1.{pid}", rank=0, gpu_indices=list(slots))],
                    victims=list(victims), inventory=inv, expires_at=expires_at, gang_nodes=1)


def _check(part: NodePart, records: dict[str, WorkloadRecord] | None = None, **kw: object):
    args: dict[str, object] = {"node_id": "n1", "now": NOW, "inventory": UUIDS, "gpu_health": HEALTH,
                               "records": records or {}}
    args.update(kw)
    return check_part(part, **args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- check_part (pure)

def test_a_part_names_gpus_by_slot_and_is_accepted_with_their_uuids():
    v = _check(_part(slots=(2, 5)))
    assert v.fresh and v.outcome.outcome == "accepted"
    assert v.pods[0].gpus == ["GPU-0002", "GPU-0005"] and v.pods[0].gpu_indices == [2, 5]


def test_a_part_for_another_node_is_refused_as_spec():
    v = _check(_part(node="n2"))
    assert not v.fresh and v.outcome.outcome == "refused_spec" and "bound to node" in (v.outcome.detail or "")


def test_an_expired_part_is_refused_as_expired():
    v = _check(_part(expires_at=NOW - 0.5))
    assert v.outcome.outcome == "expired" and v.outcome.refused_gpus == []


def test_an_inventory_mismatch_is_expired_not_a_gpu_fault():
    v = _check(_part(inv=inventory_hash(list(reversed(UUIDS)))))
    assert v.outcome.outcome == "expired" and v.outcome.detail == "inventory changed"
    assert v.outcome.refused_gpus == []


def test_a_slot_out_of_range_and_a_fatal_gpu():
    assert _check(_part(slots=(8,))).outcome.outcome == "refused_spec"
    v = _check(_part(slots=(3,)), gpu_health={**HEALTH, "GPU-0003": "fatal"})
    assert v.outcome.outcome == "refused_gpus" and v.outcome.refused_gpus == ["GPU-0003"]


def test_a_gpu_held_by_a_live_workload_is_refused_unless_it_is_a_victim():
    held = {"old": WorkloadRecord(workload_id="old", job_id="o", gpus=["GPU-0001"], state="running")}
    v = _check(_part(slots=(1,)), held)
    assert v.outcome.outcome == "refused_gpus" and v.outcome.refused_gpus == ["GPU-0001"]
    assert _check(_part(slots=(1,), victims=(Victim(workload_id="old"),)), held).fresh


def test_a_known_placement_gets_the_same_outcome_again_even_expired():
    first = _check(_part())
    again = _check(_part(expires_at=NOW - 100), known=first.outcome)
    assert again.outcome == first.outcome and not again.fresh


def test_bad_workload_ids_and_version():
    assert _check(_part(wid="../etc")).outcome.outcome == "refused_spec"
    p = msgspec.structs.replace(_part(), version=99)
    assert _check(p).outcome.outcome == "refused_spec"


# ---------------------------------------------------------------- BeatBook (pure)

def _rep(node: str, seq: int, *, full: bool = False, events: bool = False) -> NodeReport:
    ev = [WorkloadEvent(workload_id="w", job_id="j", state="running", at=1.0)] if events else []
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=full, events=ev)


def test_beats_keep_each_members_latest_empty_heartbeat_and_go_in_one_frame():
    book = BeatBook("z/b/r", 5.0)
    assert is_empty(_rep("a", 1)) and not is_empty(_rep("a", 2, events=True)) and not is_empty(_rep("a", 2, full=True))
    for seq in (1, 2, 3):
        assert book.empty(_rep("a", seq)).ok
    book.empty(_rep("b", 7))
    beat = book.take_all(NOW)
    assert beat is not None and beat.node_ids == ["a", "b"] and beat.seqs == [3, 7]
    assert beat.boot_ids == ["boot-a", "boot-b"]
    assert book.take_all(NOW) is None  # taken once


def test_a_content_report_goes_after_its_members_pending_entry():
    """The order the placer must see: a's seq 4 (empty, pending) before a's seq 5 (events)."""
    book = BeatBook("z/b/r", 5.0)
    book.empty(_rep("a", 4))
    book.empty(_rep("b", 9))
    one = book.take_one("a", NOW)  # the relay sends this before forwarding a's report 5
    assert one is not None and one.node_ids == ["a"] and one.seqs == [4]
    assert book.take_one("a", NOW) is None
    rest = book.take_all(NOW)
    assert rest is not None and rest.node_ids == ["b"]


def test_what_a_beat_reply_says_rides_on_the_members_next_answer():
    book = BeatBook("z/b/r", 5.0)
    stop = Victim(workload_id="w1", reason="fenced")
    book.apply(RackBeatReply(need_full=["a"], stop=[NodeStop(node_id="b", stop=[stop])], heartbeat_interval_s=2.0))
    ra = book.empty(_rep("a", 2))
    assert ra.need_full and ra.heartbeat_interval_s == 2.0
    assert book.empty(_rep("a", 3)).need_full      # until a full report went up
    book.forwarded(_rep("a", 4, full=True))
    assert not book.empty(_rep("a", 5)).need_full
    rb = book.empty(_rep("b", 2))
    assert rb.stop == [stop] and book.empty(_rep("b", 3)).stop == []  # told once


# ---------------------------------------------------------------- BlobCache

def _blob(job: str = "job", n: int = 3) -> tuple[str, bytes]:
    t = PeerTable(node_ids=[f"n{i}" for i in range(n)], data_urls=[f"http://x{i}" for i in range(n)],
                  rack_of=[0] * n, racks=["z/b/r"], rack_start=[0])
    return encode_gang_blob(GangBlob(job_id=job, attempt=1, world_size=n, peers=t, argv=["true"]))


async def test_a_blob_with_a_wrong_id_is_refused_and_the_next_source_asked():
    bid, raw = _blob()
    _, other = _blob("other")
    asked: list[str] = []

    async def liar(b: str) -> bytes:
        asked.append("liar")
        return other

    async def honest(b: str) -> bytes:
        asked.append("honest")
        return raw

    cache = BlobCache(keep=2)
    assert cache.put(bid, other) is None and cache.refused == 1
    got, blob = await cache.get(bid, [liar, honest])
    assert got == raw and blob.job_id == "job" and asked == ["liar", "honest"] and cache.refused == 2
    await cache.get(bid, [liar])  # cached: no source asked
    assert asked == ["liar", "honest"]
    try:
        await cache.get(_blob("x")[0], [liar])
        raise AssertionError("a wrong blob was accepted")
    except BlobUnavailable:
        pass


async def test_concurrent_callers_share_one_fetch(autojump_clock):
    bid, raw = _blob()
    calls = 0

    async def slow(b: str) -> bytes:
        nonlocal calls
        calls += 1
        await trio.sleep(1)
        return raw

    cache = BlobCache()
    out: list[bytes] = []

    async def one() -> None:
        out.append((await cache.get(bid, [slow]))[0])

    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(one)
    assert calls == 1 and out == [raw] * 5 and trio.current_time() == 1.0


# ---------------------------------------------------------------- PartAcceptor with a real supervisor

class _Events:
    def __init__(self) -> None:
        self.events: list[WorkloadEvent] = []

    def __call__(self, ev: WorkloadEvent) -> None:
        self.events.append(ev)


def _setup(tmp: Path, blobs: dict[str, bytes], *, allowed_users: tuple[str, ...] = ()):
    sup = Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: HEALTH,
                     config=SupervisorConfig(shim_pool=1, allowed_users=allowed_users),
                     base_env={"PATH": os.environ["PATH"]})
    cache = BlobCache()

    async def from_dict(b: str) -> bytes | None:
        return blobs.get(b)

    async def gang_blob(b: str) -> GangBlob:
        return (await cache.get(b, [from_dict]))[1]

    ev = _Events()
    acc = PartAcceptor(tmp / "state", node_id="n1", supervisor=sup, inventory=lambda: (UUIDS, HEALTH),
                       blob=gang_blob, notify=ev, blob_timeout_s=2.0, clock=lambda: NOW,
                       keys=lambda: (MAC_KEY, SIGNER.public), boot=lambda: BOOT)
    return sup, _Member(acc), ev


def _gang(argv: list[str], *, user: str | None = None, bad_id: bool = False) -> tuple[str, bytes]:
    bid, raw = encode_gang_blob(GangBlob(job_id="job", attempt=1, world_size=1, argv=argv, user=user))
    return (("0" * 64) if bad_id else bid), raw


async def test_an_accepted_part_is_on_disk_before_its_ack_then_runs_once(tmp_path):
    bid, raw = _gang(["sh", "-c", "echo hello-from-part"])
    sup, acc, _ = _setup(tmp_path, {bid: raw})
    part = _part(blob_id=bid, expires_at=0.0)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            out = await acc.handle(part)
            assert out.outcome == "accepted" and out.node_id == "n1"
            on_disk = PartStore(tmp_path / "state").load()
            assert [r.part.placement_id for r in on_disk] == ["p1"]
            assert on_disk[0].pods[0].gpus == ["GPU-0000", "GPU-0001"]
            # the same part again (a relay re-sent it, or the placer pushed it directly)
            assert (await acc.handle(part)).outcome == "accepted"
            wid = part.pods[0].workload_id
            await poll(lambda: wid in sup.records_view(), 0.01)
            st = await sup.wait_terminal(wid)
            assert (st.state, st.exit_code) == ("exited", 0)
            assert "hello-from-part" in sup.read_log(wid)
            rec = sup.record(wid)
            assert rec.gpus == ["GPU-0000", "GPU-0001"] and rec.gang_blob_id == bid
            # the same placement pushed over HTTP: the supervisor's known ack, nothing new
            ack = await sup.place(Placement(placement_id="p1", job_id="job", pods=list(on_disk[0].pods),
                                            argv=["false"]))
            assert ack.accepted and list(sup.records_view()) == [wid]
            n.cancel_scope.cancel()
    assert acc.counters.accepted == 1 and acc.counters.repeated == 1 and acc.counters.placed == 1


async def test_a_placement_first_pushed_over_http_answers_the_part_the_same(tmp_path):
    bid, raw = _gang(["true"])
    sup, acc, _ = _setup(tmp_path, {bid: raw})
    part = _part(blob_id=bid)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            ack = await sup.place(Placement(placement_id="p1", job_id="job", argv=["true"],
                                            pods=[PodAssignment(workload_id="job.1.p1", rank=0,
                                                                gpus=["GPU-0000", "GPU-0001"])]))
            assert ack.accepted
            out = await acc.handle(part)
            assert out.outcome == "accepted"
            await trio.sleep(0.2)
            assert list(sup.records_view()) == ["job.1.p1"] and acc.counters.accepted == 0
            n.cancel_scope.cancel()


async def test_refused_after_the_ack_or_a_wrong_blob_reports_each_pod_failed(tmp_path):
    good_id, good = _gang(["true"], user="mallory")          # a user this agent does not allow
    bad_id, bad = _gang(["true"], bad_id=True)               # bytes that do not hash to the id
    sup, acc, ev = _setup(tmp_path, {good_id: good, bad_id: bad})
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            assert (await acc.handle(_part("p1", blob_id=good_id, slots=(0,)))).outcome == "accepted"
            assert (await acc.handle(_part("p2", blob_id=bad_id, slots=(1,)))).outcome == "accepted"
            store = PartStore(tmp_path / "state")
            await poll(lambda: not (len(ev.events) < 2 or any(r.state == "accepted" for r in store.load())), 0.01)
            n.cancel_scope.cancel()
    by = {e.placement_id: e for e in ev.events}
    assert by["p1"].state == "failed" and "mallory" in (by["p1"].reason or "")
    assert by["p2"].state == "failed" and "unavailable" in (by["p2"].reason or "")
    assert sup.records_view() == {}
    states = {r.part.placement_id: r.state for r in PartStore(tmp_path / "state").load()}
    assert states == {"p1": "failed", "p2": "failed"}


async def test_a_restarted_agent_places_the_parts_it_accepted(tmp_path):
    bid, raw = _gang(["true"])
    part = _part(blob_id=bid)
    pods = [PodAssignment(workload_id=part.pods[0].workload_id, rank=0, gpus=["GPU-0000", "GPU-0001"],
                          gpu_indices=[0, 1])]
    PartStore(tmp_path / "state").save([PartRecord(part=part, pods=pods, accepted_at=NOW)])
    sup, acc, _ = _setup(tmp_path, {bid: raw})
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            wid = part.pods[0].workload_id
            await poll(lambda: wid in sup.records_view(), 0.01)
            st = await sup.wait_terminal(wid)
            assert st.state == "exited"
            n.cancel_scope.cancel()


async def test_a_part_runs_with_the_contacts_its_blob_lists(tmp_path):
    """A part lists no contacts; its gang's blob (version 2) does: the workload's placement
    names them (the herd's holders outside the gang), as a direct push would."""
    contacts = [Peer(node_id=f"h{i}", data_url=f"https://h{i}:7471", zone="z", block="b", rack="r9") for i in range(2)]
    bid, raw = encode_gang_blob(GangBlob(job_id="job", attempt=1, argv=["true"], contacts=contacts))
    sup, acc, _ = _setup(tmp_path, {bid: raw})
    part = _part(blob_id=bid)
    assert part.contacts == []
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            assert (await acc.handle(part)).outcome == "accepted"
            wid = part.pods[0].workload_id
            await poll(lambda: wid in sup.records_view(), 0.01)
            assert sup.record(wid).peers == contacts and sup.record(wid).gang_blob_id == bid
            n.cancel_scope.cancel()


async def test_a_victims_only_part_stops_them_and_is_acked(tmp_path):
    sup, acc, _ = _setup(tmp_path, {})
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            ack = await sup.place(Placement(placement_id="old", job_id="o", argv=["sleep", "30"],
                                            pods=[PodAssignment(workload_id="o.1.0", rank=0, gpus=["GPU-0003"])]))
            assert ack.accepted
            stop = NodePart(placement_id="stop1", node_id="n1", job_id="new", attempt=1, expires_at=NOW + 10,
                            boot_id=BOOT, victims=[Victim(workload_id="o.1.0", grace_s=0.5, preempted=True)])
            out = await acc.handle(stop)
            assert out.outcome == "accepted"
            st = await sup.wait_terminal("o.1.0")
            assert st.state == "preempted"
            n.cancel_scope.cancel()


async def test_two_parts_never_get_one_gpu(tmp_path):
    bid, raw = _gang(["sleep", "5"])
    sup, acc, _ = _setup(tmp_path, {})  # no blob: both stay accepted-not-placed a while
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            a, b = await _both(acc, _part("p1", blob_id=bid, slots=(4,)), _part("p2", blob_id=bid, slots=(4,)))
            n.cancel_scope.cancel()
    assert sorted([a.outcome, b.outcome]) == ["accepted", "refused_gpus"]


async def _both(acc: PartAcceptor, p: NodePart, q: NodePart):
    out: dict[str, object] = {}

    async def go(x: NodePart) -> None:
        out[x.placement_id] = await acc.handle(x)

    async with trio.open_nursery() as n:
        n.start_soon(go, p)
        n.start_soon(go, q)
    return out[p.placement_id], out[q.placement_id]


async def test_a_part_that_cannot_be_written_is_not_acked(tmp_path):
    bid, raw = _gang(["true"])
    sup, acc, _ = _setup(tmp_path, {bid: raw})
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            (tmp_path / "state" / "parts").write_bytes(b"")  # a file where the parts dir goes
            try:
                await acc.handle(_part(blob_id=bid))
                raise AssertionError("acked a part that is not on disk")
            except PartNotDurable:
                pass
            await trio.sleep(0.1)
            assert sup.records_view() == {}
            n.cancel_scope.cancel()


async def test_a_peer_relay_waits_a_little_for_a_blob_on_its_way(autojump_clock):
    bid, raw = _blob()
    cache = BlobCache()
    got: list[object] = []

    async def ask() -> None:
        got.append(await cache.wait_cached(bid, 2.0))

    async with trio.open_nursery() as n:
        n.start_soon(ask)
        await trio.sleep(0.5)
        cache.put(bid, raw)  # its bundle came
    assert got and got[0] is not None and trio.current_time() == 0.5
    t0 = trio.current_time()
    assert await cache.wait_cached(_blob("never")[0], 2.0) is None
    assert trio.current_time() - t0 == 2.0
    assert await cache.wait_cached(_blob("never")[0]) is None  # no wait asked: at once


@pytest.mark.parametrize("via", ["part", "http"])
async def test_a_rollback_that_overtakes_the_blob_never_lets_the_pod_start(tmp_path, via):
    """A part accepted, its blob slow; the gang's rollback stop for its pod comes first (as
    a victims-only part through the relay, or over HTTP: ``hold_stops`` then the supervisor):
    the pod is never placed and its end is reported (the stop was kept with the part)."""
    bid, raw = _gang(["sleep", "30"])
    release = trio.Event()
    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: HEALTH,
                     config=SupervisorConfig(shim_pool=1), base_env={"PATH": os.environ["PATH"]})
    cache = BlobCache()

    async def slow(b: str) -> bytes:
        await release.wait()
        return raw

    async def gang_blob(b: str) -> GangBlob:
        return (await cache.get(b, [slow]))[1]

    ev = _Events()
    acc = _Member(PartAcceptor(tmp_path / "state", node_id="n1", supervisor=sup, inventory=lambda: (UUIDS, HEALTH),
                               blob=gang_blob, notify=ev, blob_timeout_s=20.0, clock=lambda: NOW,
                               keys=lambda: (MAC_KEY, SIGNER.public), boot=lambda: BOOT))
    part = _part(blob_id=bid)
    wid = part.pods[0].workload_id
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            assert (await acc.handle(part)).outcome == "accepted"
            victim = Victim(workload_id=wid, grace_s=1.0, reason="preempted: rollback", preempted=True)
            if via == "part":
                stop = NodePart(placement_id="stop:job:1:n1:1", node_id="n1", job_id="job", attempt=1,
                                expires_at=NOW + 10, boot_id=BOOT, victims=[victim])
                assert (await acc.handle(stop)).outcome == "accepted"
            else:
                await acc.hold_stops([victim])
                ack = await sup.place(Placement(placement_id="stop:job:1:n1:1", job_id="job", victims=[victim]))
                assert ack.accepted
            assert [v.workload_id for r in PartStore(tmp_path / "state").load() for v in r.stopped] == [wid]
            release.set()
            await poll(lambda: ev.events, 0.01)
            await trio.sleep(0.2)
            n.cancel_scope.cancel()
    assert [(e.workload_id, e.state) for e in ev.events] == [(wid, "preempted")], ev.events
    assert wid not in sup.records_view()  # never placed, never started


async def test_only_parts_the_placer_signed_are_acted_on_and_outcomes_carry_the_nodes_mac(tmp_path):
    """A relay can drop or delay a part, never forge one: a part without proof, one signed by
    another key, one retargeted or with its blob changed after signing, and any part before the
    placer's key is known are refused (PartNotAuthentic: not answered, not written, nothing
    starts). An accepted part's outcome carries this node's MAC, which an altered outcome fails."""
    bid, raw = _gang(["sleep", "30"])
    sup, member, _ = _setup(tmp_path, {bid: raw})
    acc: PartAcceptor = member.acc
    good = _part(blob_id=bid)
    retargeted = _signed(_part(node="n2", blob_id=bid))
    reblobbed = _signed(good)
    assert reblobbed.proof is not None
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            forged = [
                good,                                             # no proof
                _signed(good, BundleSigner.generate()),           # another key signed it
                msgspec.structs.replace(retargeted, node_id="n1", proof=msgspec.structs.replace(
                    retargeted.proof, raw=part_bytes(msgspec.structs.replace(_part(node="n1", blob_id=bid))))),
                msgspec.structs.replace(reblobbed, proof=msgspec.structs.replace(reblobbed.proof, blob_id="c" * 64)),
            ]
            for bad in forged:
                with pytest.raises(PartNotAuthentic):
                    await acc.handle(bad)
            assert PartStore(tmp_path / "state").load() == [] and not sup.records_view()
            assert acc.statistics()["not_authentic"] == len(forged)
            out = await acc.handle(_signed(good))
            assert out.outcome == "accepted" and outcome_ok(MAC_KEY, out)
            assert not outcome_ok(MAC_KEY, msgspec.structs.replace(out, outcome="refused_spec"))
            n.cancel_scope.cancel()


async def test_no_part_is_taken_before_the_placer_key_is_known(tmp_path):
    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: HEALTH,
                     config=SupervisorConfig(shim_pool=1), base_env={"PATH": os.environ["PATH"]})

    async def no_blob(b: str) -> GangBlob:
        raise BlobUnavailable("none")

    acc = PartAcceptor(tmp_path / "state", node_id="n1", supervisor=sup, inventory=lambda: (UUIDS, HEALTH),
                       blob=no_blob, notify=_Events(), keys=lambda: (None, None), boot=lambda: None,
                       clock=lambda: NOW)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            await n.start(acc.run)
            with pytest.raises(PartNotAuthentic, match="no placer signing key"):
                await acc.handle(_signed(_part()))
            n.cancel_scope.cancel()


def test_a_part_replaying_a_superseded_attempt_is_expired():
    newer = {"job.2.0": WorkloadRecord(workload_id="job.2.0", job_id="job", placement_id="start:job:2:n1")}
    v = _check(_part("start:job:1:n1", wid="job.1.0"), newer)     # attempt 1 < attempt 2 here
    assert v.outcome.outcome == "expired" and "a replay" in (v.outcome.detail or "")
    same = {"job.1.0": WorkloadRecord(workload_id="job.1.0", job_id="job", placement_id="start:job:1:n1")}
    v = _check(_part("forged", wid="job.1.1"), same)               # attempt 1 under another placement id
    assert v.outcome.outcome == "expired"


def test_a_stop_in_time_for_this_boot_is_applied():
    stop = NodePart(placement_id="stop:j:1:n1:1", node_id="n1", job_id="j", attempt=1, expires_at=NOW + 1,
                    boot_id=BOOT, victims=[Victim(workload_id="j.1.0")])
    assert _check(stop, boot_id=BOOT).outcome.outcome == "accepted"


async def test_a_part_of_an_older_placer_epoch_is_answered_stale_epoch_and_never_acted_on(tmp_path):
    """Parts of epoch 3 are taken; then parts of epoch 2 (a replaced placer: a new start, a stop)
    and of epoch 0 are answered ``stale_epoch`` under this node's MAC, nothing written or started,
    also after the agent restarted on its state dir; a relay that relabels the epoch breaks the
    signature."""
    from scheduler_link.epochs import EPOCH_FILE, Epochs

    bid, raw = _gang(["sleep", "30"])
    for run in range(2):
        sup, member, _ = _setup(tmp_path, {bid: raw})
        acc: PartAcceptor = member.acc
        acc.epochs = Epochs(tmp_path / "state" / EPOCH_FILE)   # (the daemon passes its durable gate)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await n.start(sup.run)
                await n.start(acc.run)
                if run == 0:
                    out = await acc.handle(_signed(_part("p1", blob_id=bid), epoch=3))
                    assert out.outcome == "accepted"
                stale = [_signed(_part("p2", slots=(4,), blob_id=bid), epoch=2),
                         _signed(_part("p3", slots=(5,), blob_id=bid), epoch=0),
                         _signed(NodePart(placement_id="stop:p1", node_id="n1", job_id="job", attempt=1,
                                          expires_at=NOW + 10, boot_id=BOOT,
                                          victims=[Victim(workload_id="job.1.p1")]), epoch=2)]
                for part in stale:
                    out = await acc.handle(part)
                    assert out.outcome == "stale_epoch" and outcome_ok(MAC_KEY, out), out
                assert [r.part.placement_id for r in PartStore(tmp_path / "state").load()] == ["p1"]
                assert acc.counters.stale_epoch == 3 and acc.epochs.stale == {"part": 3}
                relabelled = stale[0]
                assert relabelled.proof is not None
                with pytest.raises(PartNotAuthentic):
                    await acc.handle(msgspec.structs.replace(relabelled, proof=msgspec.structs.replace(
                        relabelled.proof, epoch=3)))
                wid = "job.1.p1"
                await poll(lambda s=sup: "job.1.p1" in s.records_view(), 0.01)
                assert set(sup.records_view()) == {wid}
                if run == 0:
                    assert sup.record(wid).state not in ("exited", "preempted", "failed")   # the old stop did nothing
                    await sup.stop(wid, grace_s=0.1, reason="test over")
                    await sup.wait_terminal(wid)
                n.cancel_scope.cancel()
