"""A mass silence (placer.attempts): more than ``lost_mass_fraction`` of the fleet silent in one
lost window is the placer's or the network's silence, not that many dead hosts -- none is
declared lost or fenced; they take no new work until they speak again, and once the silence
narrows the ones still silent are lost as usual. A few nodes dying is a failure, as before."""

from __future__ import annotations

import pytest

from placer.attempts import MASS_SILENCE_MIN
from placer.config import PlacerConfig, PlacerConfigError, load_config
from placer.state import PlacerState
from scheduler_link.messages import JobSpec, NodeReport
from tests.test_placer_indexes import full


def _fleet(n: int, **kw: float) -> PlacerState:
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0, **kw), started_at=0.0)
    st_.recover_until = 0.0
    for i in range(n):
        assert st_.ingest(f"n{i}", full(f"n{i}", rack=f"r{i // 32}"), 0.0)[0] == 200
    return st_


def _beat(st_: PlacerState, nodes: range | list[int], now: float) -> None:
    for i in nodes:
        node = st_.nodes[f"n{i}"]
        rep = NodeReport(node_id=node.node_id, boot_id=node.boot_id, seq=node.last_seq + 1, full=False)
        assert st_.ingest(node.node_id, rep, now)[0] == 200


def test_a_tenth_of_the_fleet_silent_at_once_is_held_not_lost() -> None:
    st_ = _fleet(640)
    _beat(st_, range(0, 500), 2.0)          # 140 of 640 say nothing more
    st_.tick(3.5)
    assert st_.counters["nodes_lost"] == 0 and st_.counters["mass_silences"] == 1
    assert st_.silent_nodes == 140 and st_.mass_silence_since == 3.5
    assert st_.nodes["n600"].silent and st_.nodes["n600"].state == "up"
    # held nodes take no new work: a job that needs more than the 500 speaking nodes waits
    st_.submit(JobSpec(job_id="big", pods=501, gpus_per_pod=8, argv=["x"]), 3.5)
    st_.schedule(3.5)
    assert st_.jobs["big"].state == "pending"
    # they speak again: back, without a registration, and usable
    _beat(st_, range(500, 640), 4.0)
    assert st_.silent_nodes == 0 and not st_.nodes["n600"].silent
    _beat(st_, range(0, 500), 4.0)
    st_.tick(5.0)
    assert st_.mass_silence_since is None and st_.counters["nodes_lost"] == 0
    st_.schedule(5.0)
    assert st_.jobs["big"].state != "pending"


def test_a_few_nodes_dying_are_lost_as_before() -> None:
    st_ = _fleet(640)
    _beat(st_, range(0, 630), 2.0)          # 10 die
    st_.tick(3.5)
    assert st_.counters["nodes_lost"] == 10 and st_.counters["mass_silences"] == 0 and st_.silent_nodes == 0
    assert st_.node_states["lost"] == 10


def test_below_the_minimum_a_large_fraction_is_still_a_failure() -> None:
    st_ = _fleet(100)
    _beat(st_, range(0, 100 - (MASS_SILENCE_MIN - 1)), 2.0)   # 63 of 100 silent: under the minimum
    st_.tick(3.5)
    assert st_.counters["nodes_lost"] == MASS_SILENCE_MIN - 1 and st_.silent_nodes == 0


def test_once_the_silence_narrows_the_ones_still_silent_are_lost() -> None:
    st_ = _fleet(1000)
    _beat(st_, range(0, 850), 2.0)          # 150 silent: held
    st_.tick(3.5)
    assert st_.silent_nodes == 150 and st_.counters["nodes_lost"] == 0
    _beat(st_, range(0, 950), 5.0)          # 100 of them back; 50 still silent
    st_.tick(6.6)                           # judged again a lost window later
    assert st_.counters["nodes_lost"] == 50 and st_.silent_nodes == 0 and st_.mass_silence_since is None
    assert {n for n, r in st_.nodes.items() if r.state == "lost"} == {f"n{i}" for i in range(950, 1000)}


def test_held_nodes_gangs_are_never_fenced() -> None:
    st_ = _fleet(640)
    st_.submit(JobSpec(job_id="g", pods=200, gpus_per_pod=8, argv=["x"]), 0.0)
    st_.schedule(0.0)
    job = st_.jobs["g"]
    on = sorted({p.node_id for p in job.pods})
    assert len(on) == 200
    for p in job.pods:   # the gang runs
        job.set_pod_state(p, "running")
    silent = set(on[:100])
    _beat(st_, [i for i in range(640) if f"n{i}" not in silent], 2.0)
    for t in (3.5, 7.0, 10.5, 14.0):        # far past lost + fence_after_s
        _beat(st_, [i for i in range(640) if f"n{i}" not in silent], t - 0.5)
        st_.tick(t)
    assert st_.counters["nodes_lost"] == 0 and st_.counters["fenced_stops"] == 0
    assert st_.jobs["g"].state in ("placing", "starting", "running")


def test_off_when_the_fraction_is_zero() -> None:
    st_ = _fleet(640, lost_mass_fraction=0.0)
    _beat(st_, range(0, 500), 2.0)
    st_.tick(3.5)
    assert st_.counters["nodes_lost"] == 140 and st_.silent_nodes == 0


def test_the_fraction_is_checked_at_load() -> None:
    with pytest.raises(PlacerConfigError, match="lost_mass_fraction"):
        load_config(None, lost_mass_fraction=1.5)
