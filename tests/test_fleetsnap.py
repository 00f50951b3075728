"""placer.fleetsnap: whom a restarted placer waits for, and when its recovery ends (pure), and
the snapshot file (a damaged one is ignored, never a failed start)."""

from __future__ import annotations

from pathlib import Path

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from placer import fleetsnap
from placer.config import PlacerConfig
from placer.fleetsnap import Recovery
from placer.state import JobRec, PlacerState
from scheduler_link.messages import JobSpec, WorkloadStatus
from tests.test_placer_indexes import full


def _restarted() -> PlacerState:
    """A placer's state just after a restart: recovering until t = 5."""
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=5.0), started_at=0.0)
    st_.recover_until = 5.0
    return st_


def _recovering(st_: PlacerState, pods: int) -> JobRec:
    """Job g from the journal (attempt 1, ``pods`` pods of 8 GPUs), waiting for its pods' reports."""
    st_.submit(JobSpec(job_id="g", pods=pods, gpus_per_pod=8, argv=["x"]), 0.0, recovering=True)
    st_.jobs["g"].attempt = 1
    return st_.jobs["g"]


def _pod(i: int) -> WorkloadStatus:
    """Rank ``i`` of g's attempt 1, running on node n<i> (all its 8 GPUs)."""
    return WorkloadStatus(workload_id=f"g.1.{i}", job_id="g", gpus=[f"n{i}-g{s}" for s in range(8)], state="running")


def test_no_snapshot_waits_the_window() -> None:
    r = Recovery(None, started=100.0, window_s=5.0, max_s=60.0)
    assert r.until(100.0, jobs_complete=True) == 105.0
    assert r.until(200.0, jobs_complete=False) == 105.0


def test_every_node_heard_and_every_job_whole_ends_at_once() -> None:
    r = Recovery(["a", "b"], started=100.0, window_s=5.0, max_s=60.0)
    r.heard("a")
    assert r.until(101.0, jobs_complete=True) == 105.0      # b unheard: the window
    assert r.until(101.0, jobs_complete=False) == 160.0     # b may hold a missing pod: up to max
    r.heard("b")
    r.heard("c")                                             # (not in the snapshot: nothing changes)
    assert r.unheard == 0 and r.expected == 2
    assert r.until(101.0, jobs_complete=True) == 101.0      # now
    assert r.until(101.0, jobs_complete=False) == 105.0     # truly partial: the window, as before


@given(st.lists(st.sampled_from("abcdef"), max_size=12), st.sets(st.sampled_from("abcdef")), st.booleans(),
       st.floats(0, 100), st.floats(0, 100))
def test_recovery_never_ends_before_a_possibly_missing_pod_could_report(heard: list[str], expected: set[str],
                                                                         complete: bool, window: float,
                                                                         t: float) -> None:
    """A recovered job that lacks pods is never given up on (placed again: doubled) while a node
    of the snapshot is unheard, before max_s; nor anything before the window unless every node
    reported and every job is whole."""
    r = Recovery(sorted(expected), started=0.0, window_s=window, max_s=60.0)
    for n in heard:
        r.heard(n)
    end = r.until(t, jobs_complete=complete)
    unheard = expected - set(heard)
    if not complete and unheard:
        assert end == max(60.0, window)
    elif not (complete and not unheard):
        assert end == window
    else:
        assert end == t


def test_the_file_round_trips_and_a_damaged_one_is_ignored(tmp_path: Path) -> None:
    assert fleetsnap.load(tmp_path) is None
    fleetsnap.write(tmp_path, fleetsnap.encode(["n1", "n2"], 12.5))
    snap = fleetsnap.load(tmp_path)
    assert snap is not None and snap.nodes == ["n1", "n2"] and snap.taken_at == 12.5
    assert (tmp_path / fleetsnap.SNAPSHOT_FILE).stat().st_mode & 0o077 == 0
    (tmp_path / fleetsnap.SNAPSHOT_FILE).write_bytes(b"\xc1garbage")
    assert fleetsnap.load(tmp_path) is None


def test_recovered_complete_only_once_every_pod_of_a_recovering_job_reported() -> None:
    """PlacerState.recovered_complete: what Recovery.until is told (a recovered gang whose
    pods have not all reported is not whole: ending recovery then would place it again)."""
    st_ = _restarted()
    assert st_.recovered_complete()                 # nothing recovering
    _recovering(st_, 3)
    for i in range(3):
        assert not st_.recovered_complete()
        st_.ingest(f"n{i}", full(f"n{i}", workloads=[_pod(i)]), 0.1)
    assert st_.recovered_complete()


def test_a_node_reporting_twice_while_the_placer_recovers_keeps_its_pod() -> None:
    """A second full report of a node during recovery lists the pod its first one had adopted:
    the same pod (never a stale one told to stop). At 1,024 emulated nodes re-registering
    through their relays, a rack's pods were stopped this way."""
    st_ = _restarted()
    _recovering(st_, 2)
    for i in range(2):
        nid = f"n{i}"
        for seq in (1, 2):   # twice
            _, reply, _ = st_.ingest(nid, full(nid, seq=seq, workloads=[_pod(i)]), 0.1 * seq)
            assert not reply.stop, reply
        assert not st_.nodes[nid].stale and not st_.nodes[nid].tell
    assert st_.schedule(6.0) == []
    job = st_.jobs["g"]
    assert job.state == "running" and job.counts["running"] == 2, job.counts


def test_a_recovery_adopting_pods_one_report_at_a_time_keeps_the_node_index() -> None:
    """Each adopted pod is a row appended to its job's table, and each registration reads its
    node's rows: the per-node index is extended, never rebuilt from the whole table per row."""
    st_ = _restarted()
    table = _recovering(st_, 40).table
    idx = None
    for i in range(40):
        nid = f"n{i}"
        st_.ingest(nid, full(nid, workloads=[_pod(i)]), 0.1)
        if idx is None:
            idx = table._on_node
        assert idx is not None and table._on_node is idx     # the same index, extended
        assert [table.node_ids[r] for r in table.on_node(nid)] == [nid]
    assert st_.recovered_complete()


def test_membership_changes_count_what_the_snapshot_must_follow() -> None:
    """The snapshot is rewritten after membership changed (a node added, lost, back), not after
    every full report: a steady fleet writes nothing."""
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, lost_after_missed=3, fence_after_s=60.0), started_at=0.0)
    st_.recover_until = 0.0
    st_.ingest("n0", full("n0", seq=1), 0.0)
    assert st_.membership_changes == 1                 # added
    st_.ingest("n0", full("n0", seq=2), 0.5)
    assert st_.membership_changes == 1                 # a full report of a known, up node: nothing
    st_.tick(10.0)
    assert st_.nodes["n0"].state == "lost" and st_.membership_changes == 2
    st_.ingest("n0", full("n0", seq=3), 11.0)
    assert st_.nodes["n0"].state == "up" and st_.membership_changes >= 3   # back


def test_a_lost_node_is_waited_for_after_a_restart() -> None:
    """A node lost (not fenced yet) when the snapshot was written may hold a running gang's pod:
    it is in the snapshot, so the restarted placer does not take the gang for partial."""
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=60.0, recover_s=5.0), started_at=0.0)
    st_.recover_until = 0.0
    for n in ("n0", "n1"):
        st_.ingest(n, full(n), 0.0)
    st_.ingest("n0", msgspec.structs.replace(full("n0"), seq=2), 2.0)   # n0 speaks, n1 falls silent
    st_.tick(3.5)
    assert st_.nodes["n1"].state == "lost"
    assert sorted(fleetsnap.snapshot_ids(st_.nodes)) == ["n0", "n1"]
