"""The placer's fleet-scale bookkeeping: deadline heaps, indexed pods and counters,
structured outcomes, bounded views, and a model that registers a fleet with one rebuild
(pure state, ``now`` passed in; counts asserted, never times)."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.config import PlacerConfig
from placer.model import ClusterModel, NodeSpec
from placer.state import ACCEPTED, Outcome, PlacerState
from placer.timers import Deadlines, DenseDeadlines
from placer.views import parse_page
from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    JobSpec,
    NodeReport,
    RestartPolicy,
    TopologyPath,
    WorkloadEvent,
    WorkloadStatus,
    decode_gang_blob,
)


def snap(node: str, n: int = 8) -> GpuSnapshot:
    return GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True) for i in range(n)])


def full(node: str, rack: str = "r0", seq: int = 1, workloads=(), n: int = 8) -> NodeReport:
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=True, control_url=f"http://{node}",
                      data_url=f"http://{node}:1", topology=TopologyPath(zone="z", block="b", rack=rack),
                      snapshot=snap(node, n), workloads=list(workloads))


def beat(node: str, seq: int, events=()) -> NodeReport:
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq, full=False, events=list(events))


def new_state(**kw) -> PlacerState:
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0, **kw), started_at=0.0)
    st_.recover_until = 0.0
    return st_


# ------------------------------------------------------------------ deadlines

@pytest.mark.parametrize("kind", [Deadlines, DenseDeadlines])
def test_deadlines_fire_once_move_later_and_cancel(kind):
    d = kind()
    d.set("a", 5.0)
    d.set("b", 3.0)
    d.set("c", 4.0)
    d.set("a", 9.0)          # moved later: no new heap entry, re-filed when the old one comes up
    d.cancel("c")
    assert d.pop_due(2.9) == []
    assert d.pop_due(5.0) == ["b"]
    assert "a" in d and "c" not in d
    assert d.pop_due(8.9) == []
    d.set("a", 1.0)          # moved earlier: fires at the earlier time, once
    assert d.pop_due(1.0) == ["a"]
    assert d.pop_due(100.0) == [] and len(d) == 0


def test_dense_deadlines_agree_with_the_heap_under_random_use():
    """The array-backed deadlines (every node's "lost" timer) against the heap, op by op,
    through growth past the initial capacity, cancels, moves both ways and partial pops."""
    rng = random.Random(3)
    heap: Deadlines[str] = Deadlines()
    dense: DenseDeadlines[str] = DenseDeadlines(capacity=16)
    now = 0.0
    for _ in range(4000):
        op = rng.random()
        k = f"n{rng.randrange(300)}"
        if op < 0.6:
            at = now + rng.uniform(-1.0, 20.0)
            heap.set(k, at)
            dense.set(k, at)
        elif op < 0.7:
            heap.cancel(k)
            dense.cancel(k)
        else:
            now += rng.uniform(0.0, 3.0)
            a, b = heap.pop_due(now), dense.pop_due(now)
            assert sorted(a) == sorted(b)
        assert len(heap) == len(dense)
        assert (k in heap) == (k in dense)
    assert sorted(heap.pop_due(1e9)) == sorted(dense.pop_due(1e9)) and len(dense) == 0


# ------------------------------------------------------------------ registration: one rebuild

def test_a_fleet_registering_costs_one_rebuild_per_pass():
    st_ = new_state()
    for i in range(300):
        code, _, _ = st_.ingest(f"n{i:03d}", full(f"n{i:03d}", rack=f"r{i // 30}"), 0.0)
        assert code == 200
    assert st_.model.rebuilds == 1  # only the empty build so far: registering rebuilt nothing
    st_.submit(JobSpec(job_id="j", pods=4, gpus_per_pod=8, argv=["x"]), 0.1)
    out = st_.schedule(0.1)
    assert [j.job_id for j, _ in out] == ["j"]
    assert st_.model.rebuilds == 2 and st_.model.n_nodes == 300
    assert st_.node_states["up"] == 300


def test_registrations_with_workloads_after_a_restart_do_not_rebuild_per_node():
    st_ = new_state()
    st_.recover_until = 10.0
    st_.submit(JobSpec(job_id="g", pods=100, gpus_per_pod=8, argv=["x"]), 0.0, recovering=True)
    st_.jobs["g"].attempt = 2
    for i in range(100):
        nid = f"n{i:03d}"
        w = WorkloadStatus(workload_id=f"g.2.{i}", job_id="g", gpus=[f"{nid}-g{s}" for s in range(8)],
                           state="running")
        st_.ingest(nid, full(nid, rack=f"r{i // 10}", workloads=[w]), 0.1)
    assert st_.model.rebuilds == 1
    assert st_.schedule(11.0) == []
    job = st_.jobs["g"]
    assert job.state == "running" and job.counts["running"] == 100
    assert st_.model.rebuilds == 1  # nothing pending: the pass did not even need the model
    assert st_.model.statistics()["allocated"] == 800 and st_.model.rebuilds == 2
    st_.model.check_invariants()


_moves = st.lists(st.tuples(st.sampled_from(["add", "move", "remove", "assign", "health", "down"]),
                            st.integers(0, 5), st.integers(0, 3), st.integers(1, 8)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=_moves)
def test_any_interleaving_equals_a_model_built_from_scratch(ops):
    """Registrations, moves, removals, health changes and assigns in any order, with the
    rebuild deferred throughout, end in the same model as one built from scratch and
    given the same holdings."""
    m = ClusterModel.build([])
    specs: dict[str, NodeSpec] = {}
    held: dict[str, dict[int, str]] = {}
    bad: dict[str, set[int]] = {}
    down: dict[str, bool] = {}
    for k, (op, i, rack, n) in enumerate(ops):
        nid = f"n{i}"
        if op == "add" and nid not in specs:
            specs[nid] = NodeSpec(nid, "z", "b", f"r{rack}", n)
            m.upsert_node(specs[nid])
        elif op == "move" and nid in specs:
            specs[nid] = NodeSpec(nid, "z", "b", f"r{rack}", specs[nid].n_gpus)
            m.upsert_node(specs[nid])
        elif op == "remove" and nid in specs:
            m.remove_node(nid)
            del specs[nid]
            held.pop(nid, None)
            bad.pop(nid, None)
            down.pop(nid, None)
        elif op == "assign" and nid in specs:
            slot = n % specs[nid].n_gpus
            if slot not in held.get(nid, {}):
                m.assign(f"job{k}", nid, [slot], 0, True)
                held.setdefault(nid, {})[slot] = f"job{k}"
        elif op == "health" and nid in specs:
            slot = n % specs[nid].n_gpus
            m.set_gpu_health(nid, slot, False)
            bad.setdefault(nid, set()).add(slot)
        elif op == "down" and nid in specs:
            up = bool(n % 2)
            m.set_node_state(nid, healthy=up)
            down[nid] = not up
    fresh = ClusterModel.build(specs.values())
    for nid, slots in held.items():
        for slot, job in slots.items():
            fresh.assign(job, nid, [slot], 0, True)
    for nid, slots in bad.items():
        for s in slots:
            fresh.set_gpu_health(nid, s, False)
    for nid, is_down in down.items():
        fresh.set_node_state(nid, healthy=not is_down)
    m.check_invariants()
    assert m.node_ids == fresh.node_ids
    assert np.array_equal(m.usable, fresh.usable) and np.array_equal(m.free, fresh.free)
    own = {(n, s): j for j, rec in m.jobs.items() for n, ss in rec.gpus_by_node.items() for s in ss}
    own_fresh = {(n, s): j for j, rec in fresh.jobs.items() for n, ss in rec.gpus_by_node.items() for s in ss}
    assert own == own_fresh


# ------------------------------------------------------------------ events: indexed, counted

def _big_gang(n_nodes: int = 200):
    st_ = new_state()
    for i in range(n_nodes):
        st_.ingest(f"n{i:04d}", full(f"n{i:04d}", rack=f"r{i // 32}"), 0.0)
    st_.submit(JobSpec(job_id="big", pods=n_nodes, gpus_per_pod=8, argv=["x"], env={"K": "v"}), 0.1)
    (job, pushes), = st_.schedule(0.1)
    return st_, job, pushes


def test_a_gang_is_a_table_until_a_pod_is_asked_for():
    """A decision, its pushes' parts and its acks make no pod object (the table's columns and
    state codes); the pods read through the indexes are the table's rows, the same object
    each time, and a node's pods are found through the gangs placed on it."""
    st_, job, pushes = _big_gang(64)
    t = job.table
    assert len(t) == 64 and t.views == [None] * 64 and t.codes == bytearray(64)
    assert [n.node_id for n in st_.nodes.values() if "big" in n.gangs] == [p.node_id for p in pushes]
    from placer.records import parts_bytes
    assert len(parts_bytes(pushes, 1.0)) == 64
    st_.on_acks("big", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    assert t.views == [None] * 64 and job.pod_counts() == {"accepted": 64}
    wid = "big.1.7"
    hit = st_.pods.get(wid)
    assert hit is not None and hit[0] is job and hit[1].rank == 7 and hit[1].state == "accepted"
    node = st_.nodes[hit[1].node_id]
    assert node.pods.get(wid) == hit and node.pods.get(wid)[1] is hit[1] and list(node.pods) == [wid]
    assert st_.pods.get("big.1.64") is None and st_.pods.get("big.2.7") is None and st_.pods.get("big.1.07") is None
    assert sum(v is not None for v in t.views) == 1
    job.set_pod_state(hit[1], "running")
    assert t.codes[7] != 1 and job.counts["running"] == 1 and job.counts["accepted"] == 63


def test_a_gang_start_is_counted_not_scanned():
    st_, job, pushes = _big_gang(200)
    assert job.counts["placing"] == 200
    st_.on_acks("big", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    assert job.state == "starting" and job.counts["accepted"] == 200
    for k, state in enumerate(("fetching", "running")):
        for p in job.pods:
            st_.ingest(p.node_id, beat(p.node_id, 2 + k, [WorkloadEvent(workload_id=p.workload_id, job_id="big",
                                                                        state=state, at=0.3)]), 0.3 + k)
            if state == "running" and p.rank < 199:
                assert job.state == "starting"
    assert job.state == "running" and job.pod_counts() == {"running": 200}
    v = st_.job_view(job, offset=10, limit=5)
    assert [p.rank for p in v.pods] == [10, 11, 12, 13, 14]
    assert v.pods_total == 200 and v.nodes_total == 200 and v.gpus_total == 1600 and v.pod_counts == {"running": 200}
    # every pod exits 0: succeeded, through the counter
    for p in job.pods:
        st_.ingest(p.node_id, beat(p.node_id, 4, [WorkloadEvent(workload_id=p.workload_id, job_id="big",
                                                                state="exited", exit_code=0, at=5.0)]), 5.0)
    assert job.state == "succeeded" and st_.model.statistics()["allocated"] == 0


def test_a_job_view_reads_the_table_and_makes_views_for_its_page_only():
    """A job's view (the submit's answer, GET /v1/jobs/{id}, each job of GET /v1/jobs) costs its
    page of pods, not the gang: its totals come from the table's columns."""
    st_, job, _ = _big_gang(200)
    t = job.table
    v = st_.job_view(job, offset=10, limit=5)
    assert [p.rank for p in v.pods] == [10, 11, 12, 13, 14] and [p.workload_id for p in v.pods][0] == "big.1.10"
    assert v.pods_total == 200 and v.nodes_total == 200 and v.gpus_total == 1600
    assert [i for i, x in enumerate(t.views) if x is not None] == [10, 11, 12, 13, 14]
    listed = st_.job_view(job, limit=0)
    assert listed.pods == [] and listed.pods_total == 200 and listed.nodes_total == 200
    assert [p.rank for p in st_.job_view(job, offset=198, limit=100).pods] == [198, 199]
    assert sum(x is not None for x in t.views) == 7
    st_.submit(JobSpec(job_id="later", pods=2, gpus_per_pod=8, argv=["x"]), 0.2)
    empty = st_.job_view(st_.jobs["later"])
    assert empty.pods == [] and empty.pods_total == empty.nodes_total == empty.gpus_total == 0


def test_big_gang_placements_are_bounded_and_the_blob_holds_every_peer():
    st_, job, pushes = _big_gang(200)
    sizes = {len(p.placement.peers) for p in pushes}
    assert max(sizes) <= 32 + 4  # its rack, and a few contacts: not the gang
    pl = pushes[0].placement
    assert pl.gang_nodes == 200 and pl.gang_blob_id == job.blob_id
    blob = decode_gang_blob(st_.blobs[job.blob_id], job.blob_id)
    assert len(blob.peers) == 200 and sorted(blob.peers.node_ids) == sorted(p.node_id for p in pushes)
    assert blob.env == {"K": "v"} and blob.world_size == 200
    rack = pushes[0].node_id
    own = {p.node_id for p in pl.peers if p.rack == st_.nodes[rack].topology.rack}
    assert rack in own and len(own) == 32


def test_small_gangs_still_list_every_member():
    st_, job, pushes = _big_gang(40)
    assert all(len(p.placement.peers) == 40 for p in pushes)


# ------------------------------------------------------------------ outcomes

def _two_node_job(restart: str = "never"):
    st_ = new_state()
    st_.ingest("a", full("a"), 0.0)
    st_.ingest("b", full("b"), 0.0)
    st_.submit(JobSpec(job_id="j", pods=2, gpus_per_pod=8, argv=["x"], restart=RestartPolicy(kind=restart)), 0.1)
    (job, pushes), = st_.schedule(0.1)
    return st_, job, pushes


def test_refused_gpus_marks_only_the_named_gpus_and_rolls_back():
    st_, job, pushes = _two_node_job()
    st_.on_acks("j", 1, {"a": ACCEPTED, "b": Outcome("refused_gpus", ("b-g3",), "GPU b-g3 is fatal")}, 0.2, pushes)
    assert st_.nodes["b"].refused == {3}
    assert job.state == "pending" and st_.nodes["a"].refused == set()
    assert st_.model.statistics()["unhealthy_gpus"] == 1


def test_refused_spec_fails_the_job_and_touches_no_gpu():
    st_, job, pushes = _two_node_job()
    st_.on_acks("j", 1, {"a": ACCEPTED, "b": Outcome("refused_spec", (), "unsupported placement version")},
                0.2, pushes)
    assert job.state == "failed" and "unsupported placement version" in (job.reason or "")
    assert st_.nodes["b"].refused == set() and st_.model.statistics()["unhealthy_gpus"] == 0


def test_expired_and_unreachable_requeue_without_marking():
    for what in ("expired", "unreachable"):
        st_, job, pushes = _two_node_job()
        st_.on_acks("j", 1, {"a": Outcome(what), "b": ACCEPTED}, 0.2, pushes)
        assert job.state == "pending", what
        assert st_.model.statistics()["unhealthy_gpus"] == 0


def test_a_report_the_model_cannot_hold_is_refused_before_any_change():
    st_ = new_state()
    st_.ingest("a", full("a"), 0.0)
    code, _, _ = st_.ingest("a", full("a", seq=2, n=65), 0.1)   # more GPUs than a node may have
    assert code == 400
    assert len(st_.nodes["a"].uuids) == 8 and st_.model.spec("a").n_gpus == 8
    dup = full("b")
    dup = NodeReport(**{**{f: getattr(dup, f) for f in dup.__struct_fields__},
                        "snapshot": GpuSnapshot(gpus=[GpuInfo(index=i, uuid="same", name="x", memory_total_mib=1,
                                                              pci_bus_id=str(i)) for i in range(2)])})
    assert st_.ingest("b", dup, 0.2)[0] == 400 and "b" not in st_.nodes


def test_lost_and_fence_come_from_the_heaps():
    st_, job, pushes = _two_node_job(restart="on-preemption")
    st_.on_acks("j", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    seq = 1
    for t in (1.0, 2.0, 3.0, 3.5):
        seq += 1
        st_.ingest("a", beat("a", seq), t)
        st_.tick(t)
    assert st_.nodes["b"].state == "lost" and st_.node_states == {"up": 1, "lost": 1}
    assert "b" in st_.fence_timer and len(st_.lost_timer) == 1
    for t in (4.0, 5.0, 6.0, 7.0, 8.0, 9.0):
        seq += 1
        st_.ingest("a", beat("a", seq), t)
        st_.tick(t)
    assert job.state == "pending" and st_.counters["fenced_stops"] == 1


def test_parse_page():
    assert parse_page(None, 100) == (0, 100)
    assert parse_page("20:5", 100) == (20, 5)
    assert parse_page(":7", 100) == (0, 7)
    assert parse_page("3:", 100) == (3, 100)
    assert parse_page("0:999999", 100) == (0, 5000)
    for bad in ("x:1", "-1:3", "1:-3"):
        try:
            parse_page(bad, 10)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a_gang_refused_again_and_again_backs_off():
    st_, job, pushes = _two_node_job()
    refusal = {"a": ACCEPTED, "b": Outcome("refused_gpus", ("b-g0",), "in use")}
    st_.on_acks("j", 1, refusal, 0.2, pushes)
    assert job.state == "pending" and "j" in st_.queue            # first refusal: placed again at once
    # a's pod (accepted, then told to stop) is gone; b's next full report clears the mark
    wid = next(p.workload_id for p in job.pods if p.node_id == "a")
    st_.ingest("a", beat("a", 2, [WorkloadEvent(workload_id=wid, job_id="j", state="preempted", at=0.25)]), 0.25)
    st_.ingest("b", full("b", seq=2), 0.3)
    (job, pushes), = st_.schedule(0.3)
    assert job.attempt == 2
    st_.on_acks("j", 2, refusal, 0.4, pushes)
    wid = next(p.workload_id for p in job.pods if p.node_id == "a")
    st_.ingest("a", beat("a", 3, [WorkloadEvent(workload_id=wid, job_id="j", state="preempted", at=0.45)]), 0.45)
    assert job.state == "pending" and "j" not in st_.queue        # backing off
    assert job.timings["retry_at"] == 0.4 + 0.5
    st_.ingest("b", full("b", seq=3), 0.5)
    st_.tick(0.8)
    assert st_.schedule(0.8) == [] and "j" not in st_.queue
    st_.tick(0.9)
    assert "j" in st_.queue and "retry_at" not in job.timings
    # cancelling a job that waits out its back-off ends it, and nothing requeues it later
    st_.cancel("j", 0.95)
    assert job.state == "cancelled"
    st_.tick(100.0)
    assert "j" not in st_.queue


def test_pods_of_a_cancelled_job_show_their_end():
    st_, job, pushes = _two_node_job()
    st_.on_acks("j", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    st_.cancel("j", 0.3)
    assert job.state == "cancelled" and job.pod_counts() == {"terminating": 2}
    free0 = st_.model.statistics()["free"]
    for p in job.pods:
        st_.ingest(p.node_id, beat(p.node_id, 2, [WorkloadEvent(workload_id=p.workload_id, job_id="j",
                                                                state="exited", exit_code=143, at=0.4)]), 0.4)
    assert job.pod_counts() == {"exited": 2} and {p.exit_code for p in job.pods} == {143}
    assert st_.model.statistics()["free"] == free0 + 16  # their GPUs came back with the end


def test_the_jobs_user_travels_in_every_placement_and_the_blob():
    st_ = new_state()
    st_.ingest("a", full("a"), 0.0)
    st_.submit(JobSpec(job_id="u", pods=1, gpus_per_pod=8, argv=["x"], user="alice"), 0.1)
    (job, pushes), = st_.schedule(0.1)
    assert [p.placement.user for p in pushes] == ["alice"]
    assert decode_gang_blob(st_.blobs[job.blob_id], job.blob_id).user == "alice"


def test_fetch_figures_survive_a_full_report_that_superseded_their_event():
    st_, job, pushes = _two_node_job()
    st_.on_acks("j", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    p0 = job.pods[0]
    w = WorkloadStatus(workload_id=p0.workload_id, job_id="j", gpus=list(p0.uuids), state="running",
                       fetch={"bytes_from_origin": 5, "bytes_from_peers": 7, "bytes_local": 0})
    code, _, _ = st_.ingest(p0.node_id, full(p0.node_id, seq=2, workloads=[w]), 0.5)
    assert code == 200
    assert st_.job_view(job).pods[0].fetch == {"bytes_from_origin": 5, "bytes_from_peers": 7, "bytes_local": 0}


@pytest.mark.parametrize("mass", [0.0, 0.1])
def test_nodes_lost_while_the_fleet_registers_cost_no_rebuild(mass):
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, lost_after_missed=3, lost_mass_fraction=mass), started_at=0.0)
    for i in range(200):
        st_.ingest(f"n{i:03d}", full(f"n{i:03d}", rack=f"r{i // 20}"), 0.0)
    st_.tick(10.0)  # nobody heartbeat: every node lost (or, a mass silence, held), the model still unbuilt
    if mass:
        assert st_.silent_nodes == 200 and st_.node_states["lost"] == 0 and st_.model.rebuilds == 1
    else:
        assert st_.node_states["lost"] == 200 and st_.model.rebuilds == 1
    assert st_.model.statistics()["usable"] == 0 and st_.model.rebuilds == 2


def test_a_pod_stopped_on_its_agent_ends_its_job():
    """An operator stopped the pod on the agent (not the placer): its terminating and exit
    events are the job's news, not the end of a stop the placer asked for."""
    st_, job, pushes = _two_node_job()
    st_.on_acks("j", 1, {p.node_id: ACCEPTED for p in pushes}, 0.2, pushes)
    p0 = job.pods[0]
    for seq, (state, code) in enumerate((("running", None), ("terminating", None), ("exited", 143)), start=2):
        st_.ingest(p0.node_id, beat(p0.node_id, seq, [WorkloadEvent(workload_id=p0.workload_id, job_id="j",
                                                                    state=state, exit_code=code, at=0.3)]), 0.3)
    assert job.state == "failed" and "code 143" in (job.reason or "")
    assert st_.model.statistics()["allocated"] == 8  # the other pod's GPUs, held until it is gone


def test_a_start_push_encodes_its_part_byte_for_byte_without_making_it():
    """Push.part_bytes (the relays' bundles) is msgauth.part_bytes of Push.part: whole-node
    and several-pods-a-node gangs, victims, and a stop push."""
    from placer.records import GangStart, Push, parts_bytes
    from scheduler_link.messages import NodePart, Victim
    from scheduler_link.msgauth import part_bytes

    st_, job, pushes = _big_gang(40)
    assert all(p.part_bytes(9.0) == part_bytes(p.part(9.0)) for p in pushes)
    st_ = new_state()
    for i in range(4):
        st_.ingest(f"m{i}", full(f"m{i}", rack="r0"), 0.0)
    st_.submit(JobSpec(job_id="small", pods=8, gpus_per_pod=3, argv=["x"]), 0.1)
    (job, pushes), = st_.schedule(0.1)
    assert all(p.part_bytes(9.0) == part_bytes(p.part(9.0)) for p in pushes)
    node = st_.nodes["m0"]
    gs = GangStart(job.spec, 2, blob_id="b" * 64, peers_of=lambda n: [], n_gang=4, now=1, expires=31.5)
    victims = [Victim(workload_id="old.1.0", grace_s=2, reason="preempted by small")]
    p = Push.start(gs, node, [pp for pp in job.pods if pp.node_id == "m0"], victims)
    assert p.part_bytes(9.0) == part_bytes(p.part(9.0))
    assert msgspec.msgpack.decode(p.part_bytes(9.0), type=NodePart) == p.part(9.0)
    stop = [q for q in st_.cancel("small", 0.2) if q.kind == "stop"]
    assert stop and all(q.part_bytes(9.0) == part_bytes(q.part(9.0)) for q in stop)
    # a rack's parts in one pass (placer.records.parts_bytes): the same bytes, whatever the mix
    mixed = [*pushes, p, *stop, *_big_gang(40)[2]]
    assert parts_bytes(mixed, 9.0) == [part_bytes(q.part(9.0)) for q in mixed]
    # a decision's pushes encoded from its columns (GangPushes.parts_bytes): the same bytes, for
    # several pods a node, whole nodes, and with victims beside and stops after the starts
    from placer.records import GangPushes
    big = _big_gang(40)[2]
    assert isinstance(pushes, GangPushes) and isinstance(big, GangPushes) and big.runs is not None
    for gp in (pushes, big):
        assert parts_bytes(gp, 9.0) == [part_bytes(q.part(9.0)) for q in gp]
    with_victims = GangPushes(big.gang, big.recs, big.table, None, [victims if k % 3 else [] for k in range(40)],
                              list(stop))
    assert len(with_victims) == 40 + len(stop) and with_victims.counted().tolist() == [True] * 40 + [False] * len(stop)
    assert parts_bytes(with_victims, 9.0) == [part_bytes(q.part(9.0)) for q in with_victims]
    assert with_victims.parts_bytes([41, 3, 40], 9.0) == [part_bytes(with_victims[i].part(9.0)) for i in (41, 3, 40)]
    assert with_victims.parts_bytes(range(5, 17), 9.0) == [part_bytes(with_victims[i].part(9.0)) for i in range(5, 17)]
    assert with_victims.placement_ids(range(2, 5)) == [with_victims[i].placement_id for i in range(2, 5)]
    # the placement ids of any mix of columns and stops (a rack with a stop joined: the round's
    # order is a list), from the columns: no Push is made for a column
    fresh = GangPushes(big.gang, big.recs, big.table, None, with_victims.victims, list(stop))
    mix = [41, 3, 40, 7, 8]
    assert fresh.placement_ids(mix) == [with_victims[i].placement_id for i in mix] and fresh._made == {}


def _stop_ids(started_at: float) -> set[str]:
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0), started_at=started_at)
    st_.recover_until = started_at
    for n in ("a", "b"):
        st_.ingest(n, full(n), started_at)
    st_.submit(JobSpec(job_id="j", pods=2, gpus_per_pod=8, argv=["x"]), started_at)
    (job, pushes), = st_.schedule(started_at)
    st_.on_acks("j", 1, {p.node_id: ACCEPTED for p in pushes}, started_at, pushes)
    stops = st_.cancel("j", started_at + 1)
    assert stops and all(p.placement.placement_id.startswith("stop:") for p in stops)
    return {p.placement.placement_id for p in stops}


def test_a_restarted_placer_never_reuses_a_stop_placement_id():
    """An agent answers a placement id it has done from memory: a restarted placer's first stop
    with the id of the last process's first stop would not be acted on."""
    assert not _stop_ids(1_000.0) & _stop_ids(1_000.5)
