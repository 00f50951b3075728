"""The placer's CPU for a gang's read grant (infra.grants), same-run A/B, in process.

    python -m bench.read_grants [--nodes 4096] [--pairs 5] [--json]

``--nodes`` h100 hosts (racks of 32) registered in a real PlacerState, plus one node outside
the gang that holds the gang's manifest (a contact: the case that makes a grant). Each pair
decides the whole-node gang twice, grants on and off in alternating order (on, off, off, on,
...): submit, decide (the gang blob, with its grant when on), every node's part encoded as the
relays' bundles carry it, every node's ack recorded; then the job cancelled and the stops
built. Timed: the process CPU of submit -> acks recorded (``path_cpu_s``), per run; printed:
the medians with grants on and off and their ratio, and the grant alone (``grant_ms``: the
Merkle root over the gang's node ids and one Ed25519 signature). Every loop is bounded.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from placer.config import PlacerConfig
from placer.records import parts_bytes
from placer.state import ACCEPTED, PlacerState
from scheduler_link.messages import GpuInfo, GpuSnapshot, JobSpec, NodeReport, TopologyPath, WorkloadEvent
from scheduler_link.msgauth import BundleSigner

MANIFEST = "ab" * 32


def sim_report(node: str, rack: str, gpus: int, manifests: list[str]) -> NodeReport:
    """A node's full report with ``gpus`` simulated GPUs, holding ``manifests`` (benches and tests)."""
    snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True) for i in range(gpus)])
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=1, full=True, control_url=f"http://{node}",
                      data_url=f"https://{node}:1", topology=TopologyPath(zone="z", block="b", rack=rack),
                      snapshot=snap, manifests=manifests)


def run(nodes: int, pairs: int) -> dict[str, object]:
    signer = BundleSigner.generate()
    st = PlacerState(PlacerConfig(heartbeat_s=5.0, fence_after_s=60.0, recover_s=0.0), started_at=0.0)
    st.recover_until = 0.0
    for i in range(nodes):
        st.ingest(f"n{i:06d}", sim_report(f"n{i:06d}", f"r{i // 32}", 8, []), 0.0)
    st.ingest("holder", sim_report("holder", "rh", 1, [MANIFEST]), 0.0)   # (too small for a pod: outside)
    st.schedule(0.0)   # (the model built: a pass waits 4x a rebuild's cost after it)
    times: dict[str, list[float]] = {"on": [], "off": []}
    now = 100.0
    seq: dict[str, int] = {}
    for k in range(2 * pairs):
        mode = ("on", "off", "off", "on")[k % 4]
        st.read_grants = signer.read_grant if mode == "on" else None
        job_id = f"g{k}"
        gc.collect()
        t0 = time.process_time()
        st.submit(JobSpec(job_id=job_id, pods=nodes, gpus_per_pod=8, argv=["x"], manifest_id=MANIFEST,
                          origin="file:///o"), now)
        decided = st.schedule(now)
        assert len(decided) == 1, decided
        job, pushes = decided[0]
        parts_bytes(pushes, now + 30.0)
        st.on_acks(job_id, job.attempt, {p.node_id: ACCEPTED for p in pushes}, now, pushes)
        times[mode].append(time.process_time() - t0)
        assert bool(job.read_grant) == (mode == "on")
        pods = [(q.node_id, q.workload_id) for q in job.pods]
        st.cancel(job_id, now)
        for node, wid in pods:   # the nodes report the pods gone: their GPUs are free again
            seq[node] = seq.get(node, 1) + 1
            st.ingest(node, NodeReport(node_id=node, boot_id=f"boot-{node}", seq=seq[node], full=False, events=[
                WorkloadEvent(workload_id=wid, job_id=job_id, state="exited", exit_code=0, at=now)]), now)
        now += 100.0
    ids = [f"n{i:06d}" for i in range(nodes)]
    grant = []
    for _ in range(5):
        t0 = time.process_time()
        signer.read_grant(MANIFEST, ids, 1.0)
        grant.append(time.process_time() - t0)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"nodes": nodes, "pairs": pairs, "path_cpu_s_on": on, "path_cpu_s_off": off,
            "ratio_on_over_off": on / off, "grant_ms": statistics.median(grant) * 1000,
            "runs": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    a = ap.parse_args()
    out = run(a.nodes, max(1, min(a.pairs, 50)))
    if a.json:
        print(json.dumps(out))
        return
    print(f"nodes={out['nodes']} pairs={out['pairs']}")
    print(f"path_cpu_s grants on  {out['path_cpu_s_on']:.4f} (median)")
    print(f"path_cpu_s grants off {out['path_cpu_s_off']:.4f} (median)")
    print(f"ratio_on_over_off     {out['ratio_on_over_off']:.3f}")
    print(f"grant_ms              {out['grant_ms']:.2f}")


if __name__ == "__main__":
    main()
