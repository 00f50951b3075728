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
from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    JobSpec,
    NodeReport,
    TopologyPath,
    Victim,
    decode_gang_blob,
)
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


def _victims_first(st_: PlacerState, drv: _RoundDriver, gp: GangPushes) -> int:
    """A round builds its racks victims first: racks of stops only, then the gang's racks with
    a victim, then the rest, each group in topology order. Returns the first rack that names
    the gang's blob (its seed)."""
    topo = list(dict.fromkeys(st_.nodes[nid].rack_path for nid in st_.model.node_ids))
    kinds = []
    for r in range(len(drv.racks)):
        lo, hi = drv.core.rack_slice(r)
        ps = [gp[i] for i in drv._at(lo, hi)]
        kinds.append(0 if all(p.kind == "stop" for p in ps) else 1 if any(p.placement.victims for p in ps) else 2)
    assert kinds == sorted(kinds)
    for k in set(kinds):
        paths = [drv.racks[r][0] for r in range(len(kinds)) if kinds[r] == k]
        assert paths == sorted(paths, key=topo.index)
    assert drv.rack_starts == [k > 0 for k in kinds]
    return drv.rack_starts.index(True)


async def test_a_preempting_gangs_round_tells_its_victims_first() -> None:
    """A gang that preempts some of its nodes' pods: its racks with a victim are built and sent
    before its others (and the blob rides in the first of them)."""
    st_ = _state([3, 4, 2, 3, 4])
    st_.submit(JobSpec(job_id="low", pods=3, gpus_per_pod=8, priority=0, preemptible=True, argv=["x"]), 0.1)
    (low, lp), = st_.schedule(0.1)
    st_.on_acks("low", low.attempt, {p.node_id: ACCEPTED for p in lp}, 0.2, lp)
    st_.submit(JobSpec(job_id="high", pods=15, gpus_per_pod=8, priority=5, argv=["x"]), 0.3)
    (high, hp), = st_.schedule(0.3)
    assert low.state == "preempted" and isinstance(hp, GangPushes) and hp.victims is not None
    hub = RelayHub(_Host(st_))  # type: ignore[arg-type]  # (what a round's builder reads)
    for nid, node in st_.nodes.items():
        if node.rack_path not in hub._cands:
            ch = _Chan()
            conn = RelayConn(nid, (node.rack_path,), None, ch)  # type: ignore[arg-type]
            ch.info = conn  # type: ignore[assignment]
            hub._cands[node.rack_path] = {nid: conn}
    drv = _RoundDriver(hub, "high", high.blob_id, hp, None, None)  # type: ignore[arg-type]  # (never pushes)
    first = _victims_first(st_, drv, hp)
    racks = [path for path, _ in drv.racks]
    topo = list(dict.fromkeys(st_.nodes[nid].rack_path for nid in hp.node_ids[:hp.n_cols]))
    assert racks != topo and sorted(racks) == sorted(topo)   # (some rack with a victim came later in topology)
    assert drv.carry == [r == first for r in range(len(racks))]
    for r in range(len(racks)):
        lo, hi = drv.core.rack_slice(r)
        assert drv._spec(r, 1.0).raws == [part_bytes(hp[i].part(drv.expires)) for i in drv._at(lo, hi)]


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
    for extra in (hp.extra, hp.extra[::-1]):   # (the decision's stops as columns, then as a list of pushes)
        gp = GangPushes(hp.gang, hp.recs, hp.table, hp.rows, hp.victims, extra, runs=hp.runs)
        drv = _RoundDriver(hub, "high", high.blob_id, gp, None, None)  # type: ignore[arg-type]  # (never pushes)
        permuted.append(drv.order is not None)
        first = _victims_first(st_, drv, gp)
        assert drv.carry == [r == first for r in range(len(drv.racks))]
        assert all(drv.parent[r] == (first if r > first else -1) for r in range(len(drv.racks)))
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
            assert (spec.blob is not None) == (r == first) and (not spec.blob_sources or starts)
            stop_only += not starts
            seen += drv.ids[lo:hi]
        assert sorted(seen) == sorted(gp.node_ids) and len(drv.core.direct) == 0
    assert any(permuted)   # (some stop came in after a later rack's: the round's order is not the pushes')
    assert stop_only       # (and some rack had stops only)
    assert ranges          # (and, in a round whose order is not the pushes', some rack was a range)



def test_a_preemptions_victims_are_stopped_from_their_tables_columns() -> None:
    """A preempting gang's victims are stopped from their tables' columns: every live pod marked
    stale on its node and moved to "terminating" with the counts, its Victim in its node's
    placement (the gang's part, or a stop of its own), the GPUs the gang does not take held as
    ``stale:<workload>``, a lost node told at its next word; and no pod view is made."""
    st_ = _state([3, 4, 2, 3])
    st_.submit(JobSpec(job_id="low", pods=10, gpus_per_pod=7, priority=0, preemptible=True, argv=["x"],
                       grace_s=3.0), 0.1)
    (low, lp), = st_.schedule(0.1)
    st_.on_acks("low", low.attempt, {p.node_id: ACCEPTED for p in lp}, 0.2, lp)
    low.move_pods("accepted", "running")
    low.table.views = [None] * len(low.table)   # (what the acks made, if anything: none is made again)
    lost = st_.nodes[low.table.node_ids[-1]]
    st_._lose(lost, 0.26)
    pods = {f"low.{low.attempt}.{r}": (nid, sl) for r, (nid, sl) in enumerate(zip(low.table.node_ids, low.table.slots, strict=True))}
    st_.submit(JobSpec(job_id="high", pods=7, gpus_per_pod=8, priority=5, argv=["x"]), 0.3)
    (high, hp), = st_.schedule(0.3)
    assert low.state == "preempted" and low.table.views == [None] * 10
    assert low.pod_counts() == {"terminating": 10}
    assert hp.extra   # (some victims are on nodes the gang does not take: stops of their own)
    told: dict[str, list] = {}
    for i in range(len(hp)):
        for v in hp[i].placement.victims:
            told[v.workload_id] = [hp.node_ids[i], v]
    for wid, (nid, sl) in pods.items():
        node = st_.nodes[nid]
        assert node.stale[wid] == sl
        if node is lost:
            assert wid in node.tell and wid not in told
            continue
        assert told[wid][0] == nid and told[wid][1] == Victim(workload_id=wid, grace_s=3.0, reason="preempted",
                                                              preempted=True)
        in_gang = nid in hp.node_ids[:hp.n_cols]
        assert (f"stale:{wid}" in st_.model.jobs) == (not in_gang)   # (the gang took the GPUs of its own nodes)
    assert sorted(told) == sorted(w for w, (nid, _) in pods.items() if st_.nodes[nid] is not lost)
    st_.model.check_invariants()


def test_stopping_a_jobs_live_pods_at_once_is_stopping_them_one_by_one() -> None:
    """JobRec.stop_live moves the codes and the counts as set_pod_state pod by pod would: live
    pods to "terminating", "placing" ones to "cancelled", terminal ones left as they are."""
    from placer.records import JobRec, PodTable

    states = ["placing", "accepted", "running", "exited", "cancelled", "failed", "terminating", "running"]
    jobs = []
    for _ in range(2):
        job = JobRec(spec=JobSpec(job_id="j", pods=len(states), gpus_per_pod=1, argv=["x"]), order=1)
        job.set_table(PodTable.decided("j.1.", [f"n{i}" for i in range(len(states))], [(0,)] * len(states),
                                       [["u"]] * len(states)))
        for i, s in enumerate(states):
            job.set_pod_state(job.table.view(i), s, 0 if s == "exited" else None)
        jobs.append(job)
    one, once = jobs
    for p in one.live_pods():
        one.set_pod_state(p, "terminating" if p.state != "placing" else "cancelled", p.exit_code)
    rows = once.stop_live()
    assert rows == [0, 1, 2, 4, 6, 7]
    assert once.table.codes == one.table.codes and once.pod_counts() == one.pod_counts()
    assert once.ok_exits == one.ok_exits == 1
