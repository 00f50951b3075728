"""The fleet map encoder (placer.clustermap), pure: round trip, ordering against the model,
the job per node against a per-node reference, and the size at 131,072 nodes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from placer import clustermap as cm
from placer.model import ClusterModel, NodeSpec
from placer.place import JobRequest, place
from placer.sim import build_fleet, fill


def _reference_state(model: ClusterModel, i: int, lost: set[int], degraded: set[int]) -> str:
    """One node's state, written the slow and obvious way."""
    if i in lost:
        return "lost"
    if model.node_draining[i]:
        return "cordoned"
    n = int(model.n_gpus[i])
    if not model.node_healthy[i] or not all(model.gpu_healthy[i, s] for s in range(n)):
        return "fatal"
    if i in degraded:
        return "degraded"
    held = sum(1 for s in range(n) if model.owner[i, s] >= 0)
    return "free" if held == 0 else "full" if held == n else "partial"


def _reference_job(row: np.ndarray) -> int:
    c = Counter(int(x) for x in row if x >= 0)
    if not c:
        return -1
    most = max(c.values())
    return min(j for j, k in c.items() if k == most)


def _small_model() -> tuple[ClusterModel, np.ndarray]:
    m = ClusterModel.build(build_fleet("h100", 512 * 8))     # 512 nodes, 8 GPUs each
    fill(m, "h100", 0.5, seed=3)
    d = place(m, JobRequest(job_id="big", pods=16, gpus_per_pod=8, within="block", priority=5))
    assert d is not None
    m.allocate(d)
    ids = m.node_ids
    free_rows = np.flatnonzero(m.free == 8)
    m.assign("mixed", ids[int(free_rows[0])], [0, 1, 2], 1, True)     # a partly held node
    m.assign("other", ids[int(free_rows[0])], [3, 4], 1, True)
    m.set_gpu_health(ids[int(free_rows[1])], 2, False)                 # a fatal GPU
    m.set_node_state(ids[int(free_rows[2])], healthy=True, draining=True)
    m.set_node_state(ids[int(free_rows[3])], healthy=False)           # lost (the caller says so) or host fatal
    m.set_node_state(ids[int(free_rows[4])], healthy=False)
    return m, free_rows


def test_round_trip_and_ordering_against_the_model():
    m, free_rows = _small_model()
    ids = m.node_ids
    lost = {int(free_rows[3])}
    degraded = {int(free_rows[-1]), int(free_rows[2])}  # (cordoned wins over degraded)
    rows = [cm.JobRow(job_id="big", state="running", priority=5, gpus=128, pods=16, within="block", attempt=1,
                      submitted=1000.0, timings={"decided": 3, "pushed": 5, "acked": 9, "running": 40}),
            cm.JobRow(job_id="queued", state="pending", gpus=4096, pods=512, within="any",
                      waiting={"code": "too_few_free", "may_preempt": False})]
    raw = cm.encode(m, rows, lost_rows=lost, degraded_rows=degraded,
                    extra={"placer": {"epoch": 7}, "version": "0.1.0"}, generation="g1")
    mp = cm.decode(raw)
    N = m.n_nodes
    assert mp.header["nodes"] == N and mp.header["generation"] == "g1" and mp.header["placer"] == {"epoch": 7}
    assert mp.header["version"] == cm.VERSION          # extra fields never replace the map's own
    # every node, in the model's (topology) order
    want = [_reference_state(m, i, lost, degraded) for i in range(N)]
    assert [cm.STATES[s] for s in mp.state.tolist()] == want
    assert mp.counts() == {s: want.count(s) for s in cm.STATES}
    assert mp.header["counts"] == [want.count(s) for s in cm.STATES]
    assert {"lost", "cordoned", "fatal", "degraded", "partial", "full", "free"} <= set(want)
    # the job of each node: the holder of most of its GPUs, by id through the table
    table = mp.job_ids
    assert table[:2] == ["big", "queued"]            # the caller's rows first, in order
    for i in range(N):
        j = _reference_job(m.owner[i])
        got = int(mp.job[i])
        if j < 0:
            assert got == mp.none_job
        else:
            assert table[got] == m.job_id_of(j), ids[i]
    mixed = int(free_rows[0])
    assert table[int(mp.job[mixed])] == "mixed"
    big_nodes = {ids[i] for i in range(N) if int(mp.job[i]) == 0}
    assert big_nodes == set(m.job("big").gpus_by_node)
    assert mp.header["jobs"]["nodes"][0] == 16
    assert mp.header["jobs"]["waiting"][1]["code"] == "too_few_free"
    assert mp.header["jobs"]["timings"][0]["running"] == 40
    # domain boundaries are the model's
    for li, lv in enumerate(cm.MAP_LEVELS):
        assert mp.starts[lv].tolist() == m.starts[li].tolist()
        assert mp.header["levels"][lv] == [n.rsplit("/", 1)[-1] for n in m.dom_names[li]]
    # typed-array friendly: every array starts on a 4-byte boundary
    assert all(off % 4 == 0 for _, _, off in mp.header["arrays"].values())


def test_stopping_pods_of_one_gang_share_one_row():
    """A preempted gang's pods each hold their GPUs as ``stale:<workload>`` until they are
    gone: one row per gang in the table, whatever the gang's size."""
    m = ClusterModel.build(build_fleet("h100", 64 * 8))
    ids = m.node_ids
    for r in range(40):
        m.assign(f"stale:gang.1.{r}", ids[r], list(range(8)), 1 << 30, False)
    m.assign("stale:other.2.0", ids[40], [0, 1], 1 << 30, False)
    m.assign("live", ids[41], [0], 0, True)
    mp = cm.decode(cm.encode(m, [cm.JobRow(job_id="live", state="running")]))
    assert mp.job_ids == ["live", "stale:gang", "stale:other"]
    cols = mp.header["jobs"]
    assert cols["state"][1:] == ["stopping", "stopping"] and cols["gpus"][1:] == [320, 2]
    assert cols["nodes"] == [1, 40, 1]
    assert [mp.job_ids[j] for j in mp.job[:42].tolist()] == ["stale:gang"] * 40 + ["stale:other", "live"]


def test_node_jobs_matches_the_reference_for_any_shape():
    rng = np.random.default_rng(7)
    for G in (1, 4, 8, 9, 64):
        owner = rng.integers(-1, 5, size=(300, G)).astype(np.int32)
        owner[:50] = -1
        owner[50:100] = 3
        got = cm.node_jobs(owner)
        assert got.tolist() == [_reference_job(r) for r in owner], G
    assert cm.node_jobs(np.zeros((0, 8), np.int32)).size == 0


def test_fingerprint_follows_what_the_map_reads():
    m = ClusterModel.build([NodeSpec(f"n{i}", "z", "b", f"r{i // 4}", 8) for i in range(16)])
    rows = [cm.JobRow(job_id="a", state="pending")]
    f0 = cm.fingerprint(m, rows)
    assert cm.fingerprint(m, rows) == f0
    m.assign("a", "n3", [0], 0, True)
    f1 = cm.fingerprint(m, rows)
    assert f1 != f0
    assert cm.fingerprint(m, [cm.JobRow(job_id="a", state="running")]) != f1
    assert cm.fingerprint(m, rows, lost_rows=[2]) != f1
    m.release("a")
    assert cm.fingerprint(m, rows) == f0


def test_decode_refuses_what_is_not_a_map():
    with pytest.raises(ValueError):
        cm.decode(b"HM")
    with pytest.raises(ValueError):
        cm.decode(b"XXXX" + bytes(8))


def test_an_empty_fleet_encodes():
    mp = cm.decode(cm.encode(ClusterModel.build([]), []))
    assert mp.header["nodes"] == 0 and mp.state.size == 0 and mp.counts()["free"] == 0


def test_size_at_131072_nodes():
    """The whole fleet of DESIGN.md in well under a megabyte (issue 41: <= 1 MB)."""
    m = ClusterModel.build(build_fleet("h100", 131072 * 8))
    assert m.n_nodes == 131072
    fill(m, "h100", 0.7, seed=1)
    rows = [cm.JobRow(job_id=j, state="running", priority=r.priority, gpus=r.n_gpus, attempt=1,
                      submitted=1.7e9, timings={"decided": 1, "pushed": 2, "acked": 30, "running": 900})
            for j, r in m.jobs.items()]
    raw = cm.encode(m, rows, generation="x" * 16)
    assert len(raw) <= 1 << 20, len(raw)
    mp = cm.decode(raw)
    assert mp.state.size == 131072 and mp.job.dtype == np.uint16
    held = int((m.owner >= 0).any(1).sum())
    assert int((mp.job != mp.none_job).sum()) == held
