"""A decided gang's bookkeeping made in array passes agrees with its definition: the gang
blob's peer table by rack (placer.model.ClusterModel.rack_runs) and the start pushes made in
one pass as columns (placer.records.GangPushes), whole-node gangs and several pods a node, and a
preempting gang's round by rack with its victims' stops."""

from __future__ import annotations

import random

import numpy as np
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.attempts import ACCEPTED
from placer.config import PlacerConfig
from placer.records import GangPushes, parts_bytes
from placer.relaypolicy import RackPins
from placer.relays import RelayConn, RelayHub, _RoundDriver
from placer.state import PlacerState
from scheduler_link import msgauth
from scheduler_link.messages import GpuInfo, GpuSnapshot, JobSpec, NodeReport, TopologyPath, decode_gang_blob
from scheduler_link.msgauth import part_bytes


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


class _Chan:
    """A relay's frames connection as the round's builder touches it (nothing is sent here)."""

    def __init__(self) -> None:
        self.closed = trio.Event()
        self.term = 0
        self.info = None

    def prepare(self, type_: str, payload: object) -> tuple[int, bytes]:
        return 1, b""


class _Host:
    """What a round's driver reads of the placer while it is built (placer.relays.RelayHost)."""

    def __init__(self, st_: PlacerState) -> None:
        self.cfg = st_.cfg
        self.signer = msgauth.BundleSigner.generate()
        self.clock = trio.current_time
        self.rack_pins = RackPins()
        self.epoch = 1
        self._st = st_

    @property
    def nodes(self):
        return self._st.nodes

    def gang_blob(self, blob_id: str) -> bytes | None:
        return self._st.blobs.get(blob_id)

    def leading(self) -> bool:
        return True


async def test_a_preempting_gangs_round_puts_its_victims_stops_in_their_racks_bundles() -> None:
    """A gang that preempts: its start pushes are columns in topology order, the stops on the
    victims' other nodes follow; the round groups them by rack (a stop joins its rack's bundle,
    wherever it came in the pushes), and each bundle's parts, node ids and placement ids are
    those of the pushes the round put there, in any order of the stops."""
    st_ = _state([3, 4, 2, 3])
    st_.submit(JobSpec(job_id="low", pods=12, gpus_per_pod=7, priority=0, preemptible=True, argv=["x"]), 0.1)
    (low, lp), = st_.schedule(0.1)
    st_.on_acks("low", low.attempt, {p.node_id: ACCEPTED for p in lp}, 0.2, lp)
    st_.submit(JobSpec(job_id="high", pods=7, gpus_per_pod=8, priority=5, argv=["x"]), 0.3)
    (high, hp), = st_.schedule(0.3)
    assert isinstance(hp, GangPushes) and hp.runs is not None and hp.n_cols == 7 and len(hp.extra) == 5
    hub = RelayHub(_Host(st_))  # type: ignore[arg-type]  # (what a round's builder reads)
    relays = {}
    for nid, node in st_.nodes.items():
        if node.rack_path not in relays:
            ch = _Chan()
            conn = RelayConn(nid, (node.rack_path,), None, ch)  # type: ignore[arg-type]
            ch.info = conn  # type: ignore[assignment]
            relays[node.rack_path] = conn
            hub._cands[node.rack_path] = {nid: conn}
    permuted = []
    stop_only = ranges = 0
    for extra in (hp.extra, hp.extra[::-1]):
        gp = GangPushes(hp.gang, hp.recs, hp.table, hp.rows, hp.victims, list(extra), runs=hp.runs)
        drv = _RoundDriver(hub, "high", high.blob_id, gp, None, None)  # type: ignore[arg-type]  # (never pushes)
        permuted.append(drv.order is not None)
        seen: list[str] = []
        for r, (path, _) in enumerate(drv.racks):
            lo, hi = drv.core.rack_slice(r)
            spec = drv._spec(r, 1.0)
            at = drv._at(lo, hi)
            # consecutive pushes come as a range (a rack's parts, ids and placement ids are then
            # cut from the columns' slices), others as the list of their indices
            assert isinstance(at, range) == (list(at) == list(range(at[0], at[-1] + 1)))
            ranges += isinstance(at, range) and drv.order is not None
            pushes = [gp[i] for i in at]
            assert {st_.nodes[p.node_id].rack_path for p in pushes} == {path}
            assert spec.raws == [part_bytes(p.part(drv.expires)) for p in pushes]
            assert drv.ids[lo:hi] == [p.node_id for p in pushes]
            assert drv.pids(lo, hi) == [p.placement_id for p in pushes]
            assert drv.core.counted[lo:hi].tolist() == [p.kind == "start" for p in pushes]
            starts = any(p.kind == "start" for p in pushes)   # (a rack of stops only names no blob)
            assert spec.blob_id == (high.blob_id if starts else "")
            stop_only += not starts
            seen += drv.ids[lo:hi]
        assert sorted(seen) == sorted(gp.node_ids) and len(drv.core.direct) == 0
    assert any(permuted)   # (some stop came in after a later rack's: the round's order is not the pushes')
    assert stop_only       # (and some rack had stops only)
    assert ranges          # (and, in a round whose order is not the pushes', some rack was a range)
