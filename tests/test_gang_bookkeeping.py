"""A decided gang's bookkeeping made in array passes agrees with its definition: the gang
blob's peer table by rack (placer.model.ClusterModel.rack_runs) and the start pushes made in
one pass (placer.records.Push.gang_starts), whole-node gangs and several pods a node."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.config import PlacerConfig
from placer.records import parts_bytes
from placer.state import PlacerState
from scheduler_link.messages import GpuInfo, GpuSnapshot, JobSpec, NodeReport, TopologyPath, decode_gang_blob


def _state(racks: list[int], gpus: int = 8) -> PlacerState:
    """Nodes in racks of the given sizes (rack names out of order, some blocks apart)."""
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0), started_at=0.0)
    st_.recover_until = 0.0
    names = list(range(len(racks)))
    random.Random(len(racks)).shuffle(names)
    k = 0
    for r, size in enumerate(racks):
        for _ in range(size):
            nid = f"n{k:04d}"
            k += 1
            snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{nid}-g{i}", name="sim", memory_total_mib=1,
                                                             pci_bus_id=str(i), simulated=True) for i in range(gpus)])
            st_.ingest(nid, NodeReport(node_id=nid, boot_id="b", seq=1, full=True, control_url=f"http://{nid}",
                                       data_url=f"http://{nid}:1",
                                       topology=TopologyPath(zone="z", block=f"b{names[r] % 3}", rack=f"r{names[r]}"),
                                       snapshot=snap), 0.0)
    return st_


def _runs_by_records(st_: PlacerState, node_ids: list[str]) -> tuple[list[str], list[int], list[int]]:
    racks: list[str] = []
    start: list[int] = []
    of: list[int] = []
    for i, nid in enumerate(node_ids):
        path = st_.nodes[nid].rack_path
        if not racks or racks[-1] != path:
            racks.append(path)
            start.append(i)
        of.append(len(racks) - 1)
    return racks, start, of


@settings(max_examples=25, deadline=None)
@given(racks=st.lists(st.integers(1, 9), min_size=1, max_size=12), data=st.data())
def test_rack_runs_are_the_racks_of_the_nodes_in_topology_order(racks, data) -> None:
    st_ = _state(racks)
    model = st_.model
    n = len(model.node_ids)
    idx = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1))), dtype=np.int64)
    assert model.rack_runs(idx) == _runs_by_records(st_, [model.node_ids[i] for i in idx.tolist()])


def test_a_gangs_blob_and_pushes_whole_nodes_and_several_pods_a_node() -> None:
    for pods, gpus_per_pod in ((20, 8), (40, 4), (13, 2)):
        st_ = _state([3, 5, 1, 7, 4])
        st_.submit(JobSpec(job_id="g", pods=pods, gpus_per_pod=gpus_per_pod, argv=["x"]), 0.1)
        (job, pushes), = st_.schedule(0.1)
        blob = decode_gang_blob(st_.blobs[job.blob_id], job.blob_id)
        t = blob.peers
        assert (t.racks, t.rack_start, t.rack_of) == _runs_by_records(st_, t.node_ids)
        assert sorted(t.node_ids) == sorted(p.node_id for p in pushes)
        # each push names its node's pods, every pod once, and its part encodes them
        ranks = sorted(pod.rank for p in pushes for pod in p.placement.pods)
        assert ranks == list(range(pods))
        for p in pushes:
            assert {pod.node_id for pod in job.pods if pod.workload_id in {q.workload_id for q in p.placement.pods}} \
                == {p.node_id}
            assert p.placement_id == f"start:g:1:{p.node_id}" and p.kind == "start"
        assert len(parts_bytes(pushes, 1.0)) == len(pushes)
