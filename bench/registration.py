"""Per-member registration cost, in process: what an agent (or the fleet emulator, which runs
the same code) spends building a full report (``scheduler_link.agent_link.registration``), and
what the placer spends taking one (``PlacerState.ingest``: validation, the inventory match,
``Reports._register``), compact and whole, after a restart (inventories stored, model empty);
``relayed``: as a relay forwards it, with the member's MAC checked before and its key taken
again for the answer's epoch MAC after (what ``PlacerService`` does around the state).

    python -m bench.registration --nodes 4096 --repeat 5

Prints the median microseconds a member for each part over ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import msgspec

from placer import inventories
from placer.config import PlacerConfig
from placer.inventories import InventoryBook
from placer.state import PlacerState
from scheduler_link.agent_link import registration
from scheduler_link.messages import NodeReport, TopologyPath, for_placer, gpu_inventory
from scheduler_link.msgauth import epoch_mac, report_ok, with_report_mac
from testing.fleet import SnapshotFactory


def _state() -> PlacerState:
    st = PlacerState(PlacerConfig(heartbeat_s=5.0, recover_s=0.0), started_at=0.0)
    st.recover_until = 0.0
    return st


def _bases(n: int) -> list[NodeReport]:
    f = SnapshotFactory("dgx-h100")
    out = []
    for i in range(n):
        nid, rack = f"node-{i:06d}", f"rack-{i // 32:04d}"
        snap = for_placer(f.snapshot(nid, f"z0/b0/{rack}"))
        out.append(NodeReport(node_id=nid, boot_id=f"boot-{nid}", seq=1, full=True, control_url=f"http://10.0.0.1:{i}",
                              data_url=f"http://10.0.0.1:9/{nid}",
                              topology=TopologyPath(zone="z0", block="b0", rack=rack),
                              nvlink_domain=snap.nvlink_domain, snapshot=snap, sent_at=1.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="herd-registration-") as d:
        times = run(a.nodes, a.repeat, Path(d))
    out = {"nodes": a.nodes, "repeat": a.repeat, "component": True,
           "us_per_member": {k: statistics.median(v) / a.nodes * 1e6 for k, v in times.items()},
           "rounds_us_per_member": {k: [x / a.nodes * 1e6 for x in v] for k, v in times.items()}}
    if not a.json:
        for k, v in times.items():
            print(f"component {k:15s} median_us_per_member={statistics.median(v) / a.nodes * 1e6:8.2f} "
                  f"rounds={','.join(f'{x / a.nodes * 1e6:.1f}' for x in v)}")
    print(json.dumps(out))


def run(nodes: int, repeat: int, state_dir: Path) -> dict[str, list[float]]:
    bases = _bases(nodes)
    taken = [gpu_inventory(b.snapshot)[1] if b.snapshot else "" for b in bases]
    first = _state()
    for b in bases:
        assert first.ingest(b.node_id, registration(b, ""), 0.0)[0] == 200
    inventories.write(state_dir, *first.inventories.take())
    fulls = [registration(msgspec.structs.replace(b, seq=2), "") for b in bases]
    compacts = [registration(msgspec.structs.replace(b, seq=2), t) for b, t in zip(bases, taken, strict=True)]
    assert all(c.compact for c in compacts)
    master = bytes(range(32))
    first.set_mac_master(master)
    relayed = [with_report_mac(first.mac_key(r.node_id, r.boot_id), r) for r in compacts]
    times: dict[str, list[float]] = {"build_compact": [], "build_full": [], "ingest_compact": [], "ingest_full": [],
                                     "ingest_relayed": []}
    gc.disable()
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b, t in zip(bases, taken, strict=True):
            registration(b, t)
        t1 = time.perf_counter()
        for b in bases:
            registration(b, "")
        t2 = time.perf_counter()
        times["build_compact"].append(t1 - t0)
        times["build_full"].append(t2 - t1)
        for kind, reps in (("ingest_compact", compacts), ("ingest_full", fulls)):
            st = _state()
            st.inventories = InventoryBook.load(state_dir)
            t0 = time.perf_counter()
            for r in reps:
                st.ingest(r.node_id, r, 1.0)
            times[kind].append(time.perf_counter() - t0)
            assert len(st.nodes) == nodes
        st = _state()
        st.inventories = InventoryBook.load(state_dir)
        st.set_mac_master(master)
        t0 = time.perf_counter()
        for r in relayed:
            assert report_ok(st.mac_key(r.node_id, r.boot_id), r)
            st.ingest(r.node_id, r, 1.0)
            epoch_mac(st.mac_key(r.node_id, r.boot_id), r.node_id, r.boot_id, 1)
        times["ingest_relayed"].append(time.perf_counter() - t0)
        assert len(st.nodes) == nodes
        gc.collect()
    gc.enable()
    return times


if __name__ == "__main__":
    main()
