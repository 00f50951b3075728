"""placer.observe: a follower's warm model handed to the jobs of the journal on promotion (pure
state, ``now`` passed in): a recovered gang takes its pods at once, the rest one by one, and the
outcome is what a restarted placer adopting each node's reported workloads would hold."""

from __future__ import annotations

from placer import observe
from placer.config import PlacerConfig
from placer.state import PlacerState
from scheduler_link.messages import JobSpec, RackBeat, WorkloadStatus
from scheduler_link.msgauth import beat_mac, node_key
from tests.test_placer_indexes import beat, full


def _w(wid: str, node: str, slots: range, state: str = "running") -> WorkloadStatus:
    return WorkloadStatus(workload_id=wid, job_id=wid.split(".")[0], gpus=[f"{node}-g{s}" for s in slots],
                          state=state)


def _follower(nodes: int, extra: dict[int, list[WorkloadStatus]]) -> PlacerState:
    """A follower's model: nodes n0.. each running rank i of gang g's attempt 2 on all 8 GPUs,
    plus ``extra`` workloads (by node); it holds no jobs, so every workload is held stale."""
    st = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=60.0, recover_s=5.0), started_at=0.0)
    for i in range(nodes):
        ws = [_w(f"g.2.{i}", f"n{i}", range(8))] if i not in extra else extra[i]
        status, reply, _ = st.ingest(f"n{i}", full(f"n{i}", rack=f"r{i // 4}", workloads=ws), 1.0)
        assert status == 200, reply
    assert not st.jobs and all(node.stale for node in st.nodes.values())
    return st


def test_a_gang_is_adopted_at_once_and_strays_are_told() -> None:
    extra = {
        3: [_w("g.1.3", "n3", range(8))],                                   # an older attempt: stale, told
        5: [_w("g.2.5", "n5", range(4)), _w("other.1.0", "n5", range(4, 8))],   # no such job: told
        6: [_w("g.2.1", "n6", range(8))],                                   # rank 1 again: the first keeps it
        7: [_w("g.2.40", "n7", range(8))],                                  # beyond the gang's pods
    }
    st = _follower(12, extra)
    st.submit(JobSpec(job_id="g", pods=12, gpus_per_pod=8, argv=["x"]), 2.0, recovering=True)
    st.jobs["g"].attempt = 1                        # the journal's: the fleet runs attempt 2 now
    adopted, told = observe.adopt(st, 2.0)
    g = st.jobs["g"]
    ranks = sorted(p.rank for p in g.pods)
    assert ranks == [0, 1, 2, 4, 5, 8, 9, 10, 11] and adopted == 9 and told == 4
    assert g.attempt == 2 and all(p.state == "running" for p in g.pods)
    held = {p.workload_id: (p.node_id, p.slots) for p in g.pods}
    assert held["g.2.5"] == ("n5", (0, 1, 2, 3)) and held["g.2.1"] == ("n1", tuple(range(8)))
    assert st.model.job("g").n_gpus == 8 * 8 + 4
    assert st.model.job("g").gpus_by_node == {f"n{i}": tuple(range(8 if i != 5 else 4))
                                              for i in (0, 1, 2, 4, 5, 8, 9, 10, 11)}
    # the rest stay held stale (their GPUs taken) and are told to stop in their node's next answer
    for node, wid in [("n3", "g.1.3"), ("n5", "other.1.0"), ("n6", "g.2.1"), ("n7", "g.2.40")]:
        assert wid in st.nodes[node].stale and wid in st.nodes[node].tell
        assert st.model.owner_of(node, 7) == f"stale:{wid}"
    assert all(not node.stale for nid, node in st.nodes.items() if nid not in ("n3", "n5", "n6", "n7"))
    st.model.check_invariants()


def test_a_gang_already_holding_pods_is_adopted_one_by_one() -> None:
    """A job that holds pods (or GPUs in the model) is not taken at once: each pod as a restarted
    placer adopts it, with the same outcome."""
    st = _follower(4, {})
    st.submit(JobSpec(job_id="g", pods=4, gpus_per_pod=8, argv=["x"]), 2.0, recovering=True)
    st.jobs["g"].attempt = 2
    node = st.nodes["n0"]
    slots = node.stale.pop("g.2.0")
    st._release_quiet("stale:g.2.0")
    assert st._adopt(node, "g.2.0", "g", slots, list(node.uuids), "running", 2.0)
    assert observe.adopt(st, 2.0) == (3, 0)
    assert sorted(p.rank for p in st.jobs["g"].pods) == [0, 1, 2, 3] and st.model.job("g").n_gpus == 32
    st.model.check_invariants()


def test_a_big_gang_is_given_its_gpus_in_one_step() -> None:
    """4,096 pods: the job's GPUs are given in one vector step (its arrays are that step's, never
    grown pod by pod), its stale holders gone."""
    st = _follower(4096, {})
    st.submit(JobSpec(job_id="g", pods=4096, gpus_per_pod=8, argv=["x"]), 2.0, recovering=True)
    st.jobs["g"].attempt = 2
    assert observe.adopt(st, 2.0) == (4096, 0)
    rec = st.model.job("g")
    assert rec.n_gpus == 8 * 4096
    assert rec.nodes.base is not None and rec.nodes.base.size == rec.n_gpus   # one step: no room grown pod by pod
    assert not any(j.startswith("stale:") for j in st.model.jobs)
    st.model.check_invariants()


def test_silence_counts_from_the_promotion() -> None:
    """Promoted at t=10 (recover_s 5, lost_after 3): the nodes heard since t=5 count as reported
    and get 6 s, the others 3 s from the promotion -- none is lost for what the follower did not
    hear before it led; a node still silent then is lost as usual."""
    st = _follower(4, {})                                  # every node's full report at t=1
    for nid in ("n0", "n1"):
        assert st.ingest(nid, beat(nid, 2), 8.0)[0] == 200   # heard at t=8 (copies of its beats)
    assert observe.promoted(st, 10.0, 5.0) == ["n0", "n1"]
    st.tick(10.5)
    st.tick(12.9)
    assert all(n.state == "up" for n in st.nodes.values())
    st.tick(13.1)
    assert [nid for nid, n in st.nodes.items() if n.state != "up"] == ["n2", "n3"]
    st.tick(15.9)
    assert st.nodes["n0"].state == st.nodes["n1"].state == "up"
    st.tick(16.1)
    assert all(n.state != "up" for n in st.nodes.values())


def _signed_beat(st: PlacerState, entries: dict[str, int], forged: frozenset[str] = frozenset()) -> RackBeat:
    """n0's relay's beat of ``entries`` (node: seq), each MAC in its node's key but ``forged``'s."""
    macs = [beat_mac(node_key(st.mac_master if m not in forged else b"\1" * 32, m, f"boot-{m}"), m, f"boot-{m}", s)
            for m, s in entries.items()]
    return RackBeat(rack="r0", node_ids=list(entries), boot_ids=[f"boot-{m}" for m in entries],
                    seqs=list(entries.values()), macs=macs)


def test_a_followers_beat_moves_sequences_and_liveness_only_where_the_mac_verifies() -> None:
    """A follower's rack beat (observe.beat): the entries that verify move their node's sequence
    and liveness and nothing else (the lost deadlines stay as registration set them, until the
    promotion sets them all); an unknown node or an old sequence asks for a full report; a relay
    forging a member's entry (a MAC not in its key) makes it look alive nowhere -- not in the
    model, not among the nodes a promotion counts as reported."""
    st = _follower(4, {})                                    # every node's full report at t=1 (seq 1)
    st.set_mac_master(b"\7" * 32)
    reply = observe.beat(st, _signed_beat(st, {"n1": 2, "n2": 2, "n9": 1}), 8.0, via="n0")
    assert reply.need_full == ["n9"] and not reply.stop and not reply.epoch
    assert [(st.nodes[m].last_seq, st.nodes[m].last_seen) for m in ("n1", "n2", "n3")] == [(2, 8.0), (2, 8.0), (1, 1.0)]
    assert sorted(st.lost_timer.pop_due(4.0)) == ["n0", "n1", "n2", "n3"]   # (no deadline moved: t=1 + 3 s)
    assert observe.beat(st, _signed_beat(st, {"n1": 2}), 8.5, via="n0").need_full == ["n1"]   # (not newer)
    # n0's relay forges n3's entry: n3 stays as it was, counted; n1's entry in the same beat is taken
    bad = st.counters.get("bad_macs", 0)
    reply = observe.beat(st, _signed_beat(st, {"n1": 3, "n3": 5}, frozenset({"n3"})), 9.0, via="n0")
    assert not reply.need_full and st.counters["bad_macs"] == bad + 1
    assert (st.nodes["n3"].last_seq, st.nodes["n3"].last_seen) == (1, 1.0) and st.nodes["n1"].last_seq == 3
    assert observe.promoted(st, 10.0, 5.0) == ["n1", "n2"]


def test_a_followers_model_is_built_while_it_follows_so_its_adoption_rebuilds_nothing() -> None:
    """Registrations leave a follower's model dirty and a follower runs no scheduling pass:
    observe.keep_built rebuilds it meanwhile (spaced 4x its last cost apart, as a leader's
    passes), so the promotion's adoption of a gang finds it built and rebuilds nothing."""
    st = _follower(64, {})
    assert st.model.needs_rebuild
    ticks = iter([0.0, 0.5, 10.0, 10.25])   # (the monotonic clock that times each rebuild)
    assert observe.keep_built(st, 2.0, lambda: next(ticks)) and not st.model.needs_rebuild
    assert st.counters["rebuilds"] == 1 and st.rebuild_ok_at == 4.0
    assert st.ingest("n64", full("n64", rack="r16", workloads=[_w("g.2.64", "n64", range(8))]), 2.5)[0] == 200
    assert st.model.needs_rebuild and not observe.keep_built(st, 3.9, lambda: next(ticks))
    assert observe.keep_built(st, 4.0, lambda: next(ticks)) and not st.model.needs_rebuild
    assert not observe.keep_built(st, 9.0, lambda: next(ticks))   # (built: nothing to do)
    st.submit(JobSpec(job_id="g", pods=65, gpus_per_pod=8, argv=["x"]), 9.0, recovering=True)
    st.jobs["g"].attempt = 2
    rebuilds = st.model.rebuilds
    assert observe.adopt(st, 9.0) == (65, 0) and st.model.rebuilds == rebuilds
    st.model.check_invariants()
