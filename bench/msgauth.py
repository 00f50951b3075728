"""What message-level identity costs at fleet scale (scheduler_link.msgauth): component figures.

    python -m bench.msgauth [--nodes 25000] [--rack 32] [--repeat 5] [--json]

Every row is the real code on realistic messages, timed in this process (medians over
``--repeat``), each beside a same-run baseline doing the same job without identity:

- ``acks``: the placer checking 25,000 members' outcomes (the AckBundles of one 25k-host gang,
  ``--rack`` members each): node key derived, MAC compared, per outcome. Baseline: decoding
  those AckBundles (what the placer did before; it still does).
- ``beats``: the placer applying one heartbeat interval of 25,000 nodes as relays send it
  (RackBeats of ``--rack`` entries), with their MACs (``PlacerState.beat(via=relay)``) against
  the same beats without (``via=None``: no check), on one state holding 25,000 registered nodes.
- ``sign``: the placer building the gang's ~``nodes/rack`` RackBundles signed as it does (each
  part encoded once, BLAKE3 per part, one Ed25519 signature per BUILD_BATCH bundles over a
  Merkle root of their headers, the frame encoded) against building and encoding them
  unsigned; and, beside it, one signature per bundle (``sign_each_ms``: the way before).
- ``relay_verify``: a relay checking one bundle (digests + one signature) against decoding it.
- ``member_verify``: a member checking its part's proof (digest, one signature: a member sees
  one bundle, so nothing is cached) against decoding the part; and the part's bytes with the
  proof against without. Each member does this on its own host: the figure is per member.
- ``report``: a member MACing one event report (normalised by one msgpack round trip) and the
  placer checking it, against decoding it.

Component figures, labelled as such: no sockets, no relay process (bench.delivery measures
delivery end to end). Every loop is bounded in count.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from placer.config import PlacerConfig  # noqa: E402
from placer.relays import BUILD_BATCH  # noqa: E402
from placer.state import PlacerState  # noqa: E402
from scheduler_link.messages import (  # noqa: E402
    AckBundle,
    GpuInfo,
    GpuSnapshot,
    NodeOutcome,
    NodePart,
    NodeReport,
    PartPod,
    Peer,
    RackBeat,
    RackBundle,
    TopologyPath,
    WorkloadEvent,
    inventory_hash,
)
from scheduler_link.msgauth import (  # noqa: E402
    BundleSigner,
    BundleSpec,
    BundleVerifier,
    beat_mac,
    node_key,
    outcome_ok,
    part_bytes,
    report_ok,
    with_outcome_mac,
    with_report_mac,
)

_enc = msgspec.msgpack.Encoder()
MASTER = os.urandom(32)


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call, the collector held off (as the placer holds it off while it builds
    a delivery: a collection here would time the heap, not the code)."""
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    finally:
        gc.enable()


def _median(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` calls (one warm-up call first)."""
    fn()
    return statistics.median(_timed(fn) for _ in range(repeat))


def _ids(n: int) -> list[str]:
    return [f"node-{i:06d}" for i in range(n)]


def _parts(ids: list[str]) -> list[NodePart]:
    now = time.time()
    contacts = [Peer(node_id=f"c{k}", data_url=f"http://10.0.{k}.1:7471", zone="z", block="b", rack=f"r{k}")
                for k in range(4)]
    return [NodePart(placement_id=f"start:job-a:1:{nid}", node_id=nid, job_id="job-a", attempt=1,
                     pods=[PartPod(workload_id=f"job-a.1.{i}", rank=i, gpu_indices=list(range(8)))],
                     issued_at=now, expires_at=now + 30.0, inventory=inventory_hash([f"GPU-{nid}-{g}" for g in range(8)]),
                     gang_nodes=len(ids), contacts=contacts) for i, nid in enumerate(ids)]


def bench_acks(st: PlacerState, ids: list[str], rack: int, repeat: int) -> dict[str, Any]:
    boots = {nid: f"boot-{nid}" for nid in ids}
    frames = []
    for r in range(0, len(ids), rack):
        outs = [with_outcome_mac(node_key(MASTER, nid, boots[nid]), NodeOutcome(
            node_id=nid, placement_id=f"start:job-a:1:{nid}", outcome="accepted")) for nid in ids[r:r + rack]]
        frames.append(_enc.encode(AckBundle(rack=f"z/b/r{r}", blob_id="ab" * 32, outcomes=outs)))
    dec = msgspec.msgpack.Decoder(AckBundle)

    def decode() -> list[AckBundle]:
        return [dec.decode(f) for f in frames]
    bundles = decode()

    nodes = st.nodes

    def verify() -> None:  # as placer.relays does per outcome: the node's boot, its key (kept), the MAC
        for ab in bundles:
            for o in ab.outcomes:
                if not outcome_ok(st.mac_key(o.node_id, nodes[o.node_id].boot_id), o):
                    raise AssertionError("a good MAC did not verify")
    d, v = _median(decode, repeat), _median(verify, repeat)
    return {"acks": len(ids), "acks_decode_ms": d * 1e3, "acks_verify_ms": v * 1e3,
            "acks_verify_us_each": v / len(ids) * 1e6, "acks_verify_over_decode": v / d}


def registered(ids: list[str], rack: int) -> tuple[PlacerState, float]:
    """A placer state holding ``ids`` (8 GPUs each, ``rack`` per rack), as after registration."""
    cfg = PlacerConfig(state_dir="/nonexistent", heartbeat_s=3600.0)
    st = PlacerState(cfg, started_at=0.0)
    st.set_mac_master(MASTER)
    t0 = time.perf_counter()
    for i, nid in enumerate(ids):
        snap = GpuSnapshot(gpus=[GpuInfo(index=g, uuid=f"GPU-{nid}-{g}", name="sim", memory_total_mib=80000,
                                         pci_bus_id=f"0000:{g:02x}:00.0") for g in range(8)])
        st.ingest(nid, NodeReport(node_id=nid, boot_id=f"boot-{nid}", seq=1, full=True,
                                  topology=TopologyPath(zone="z", block="b", rack=f"r{i // rack}"), snapshot=snap), 1.0)
        st.mac_key(nid, f"boot-{nid}")  # (the service derives it at registration, for the answer)
    return st, time.perf_counter() - t0


def bench_beats(st: PlacerState, ids: list[str], rack: int, repeat: int) -> dict[str, Any]:
    seq = [1]

    def beats(with_macs: bool) -> list[RackBeat]:
        seq[0] += 1
        s = seq[0]
        out = []
        for r in range(0, len(ids), rack):
            members = ids[r:r + rack]
            out.append(RackBeat(rack=f"z/b/r{r // rack}", node_ids=members, boot_ids=[f"boot-{m}" for m in members],
                                seqs=[s] * len(members),
                                macs=[beat_mac(node_key(MASTER, m, f"boot-{m}"), m, f"boot-{m}", s) for m in members]
                                if with_macs else []))
        return out

    def apply(with_macs: bool) -> float:
        bs = beats(with_macs)

        def go() -> None:
            for b in bs:
                reply, _ = st.beat(b, 2.0, via="relay-x" if with_macs else None)
                if reply.need_full:
                    raise AssertionError(f"beat entries refused: {reply.need_full[:3]}")
        return _timed(go)
    apply(True)
    plain = statistics.median(apply(False) for _ in range(repeat))
    macs = statistics.median(apply(True) for _ in range(repeat))
    if st.counters.get("bad_macs", 0):
        raise AssertionError("good beat MACs were refused")
    return {"beat_entries": len(ids), "beats_plain_ms": plain * 1e3,
            "beats_mac_ms": macs * 1e3, "beats_mac_over_plain": macs / plain,
            "beats_mac_added_us_each": (macs - plain) / len(ids) * 1e6}


def bench_sign(ids: list[str], rack: int, repeat: int) -> tuple[dict[str, Any], bytes, bytes, BundleSigner]:
    parts = _parts(ids)
    racks = [parts[r:r + rack] for r in range(0, len(parts), rack)]
    signer = BundleSigner.generate()
    deliver_by = time.time() + 0.4

    def unsigned() -> list[bytes]:
        return [_enc.encode(RackBundle(rack=f"z/b/r{k}", blob_id="ab" * 32, parts=ps, deliver_by=deliver_by))
                for k, ps in enumerate(racks)]

    def signed() -> list[bytes]:   # one signature per bundle (the baseline)
        return [_enc.encode(signer.bundle(rack=f"z/b/r{k}", blob_id="ab" * 32, parts=ps, deliver_by=deliver_by))
                for k, ps in enumerate(racks)]

    def batched() -> list[bytes]:  # as the placer builds a round: BUILD_BATCH bundles under one signature
        out = []
        for b0 in range(0, len(racks), BUILD_BATCH):
            specs = [BundleSpec(f"z/b/r{k}", "ab" * 32, [part_bytes(p) for p in ps], deliver_by)
                     for k, ps in enumerate(racks[b0:b0 + BUILD_BATCH], b0)]
            out += [_enc.encode(rb) for rb in signer.bundles_raw(specs)]
        return out
    u, s, b = _median(unsigned, repeat), _median(signed, repeat), _median(batched, repeat)
    one_signed, one_plain = batched()[0], unsigned()[0]
    return ({"bundles": len(racks), "parts": len(parts), "sign_unsigned_ms": u * 1e3, "sign_signed_ms": b * 1e3,
             "sign_added_ms": (b - u) * 1e3, "sign_over_unsigned": b / u,
             "sign_us_per_bundle": (b - u) / len(racks) * 1e6, "sign_batch": BUILD_BATCH,
             "sign_each_ms": s * 1e3, "sign_each_us_per_bundle": (s - u) / len(racks) * 1e6,
             "bundle_bytes_signed": len(one_signed), "bundle_bytes_unsigned": len(one_plain)},
            one_signed, one_plain, signer)


def bench_verify(signed: bytes, plain: bytes, signer: BundleSigner, repeat: int, n: int = 200) -> dict[str, Any]:
    ver = BundleVerifier(signer.public)
    dec = msgspec.msgpack.Decoder(RackBundle)
    part_dec = msgspec.msgpack.Decoder(NodePart)

    def relay_decode() -> None:
        for _ in range(n):
            dec.decode(plain)

    def relay_verify() -> None:
        for _ in range(n):
            ver.bundle(signed)
    rd, rv = _median(relay_decode, repeat), _median(relay_verify, repeat)
    view, parts, proofs = ver.bundle(signed)
    with_proof = _enc.encode(msgspec.structs.replace(parts[0], blob_id=view.blob_id, proof=proofs[0]))
    bare = _enc.encode(msgspec.structs.replace(parts[0], blob_id=view.blob_id))

    def member_decode() -> None:
        for _ in range(n):
            part_dec.decode(bare)

    def member_verify() -> None:
        for _ in range(n):
            ver.part(part_dec.decode(with_proof))   # no seen cache: one member, one bundle
    md, mv = _median(member_decode, repeat), _median(member_verify, repeat)
    return {"relay_decode_us": rd / n * 1e6, "relay_verify_us": rv / n * 1e6,
            "relay_verify_over_decode": rv / rd,
            "member_decode_us": md / n * 1e6, "member_verify_us": mv / n * 1e6,
            "member_verify_added_us": (mv - md) / n * 1e6,
            "part_bytes_with_proof": len(with_proof), "part_bytes_bare": len(bare)}


def bench_report(repeat: int, n: int = 2000) -> dict[str, Any]:
    key = node_key(MASTER, "node-1", "boot-1")
    rep = NodeReport(node_id="node-1", boot_id="boot-1", seq=42, full=False, sent_at=time.time(),
                     events=[WorkloadEvent(workload_id="job-a.1.7", job_id="job-a", state="running", at=time.time(),
                                           gpus=[f"GPU-{g}" for g in range(8)], placement_id="start:job-a:1:node-1")])
    raw = _enc.encode(with_report_mac(key, rep))
    dec = msgspec.msgpack.Decoder(NodeReport)

    def decode() -> None:
        for _ in range(n):
            dec.decode(raw)

    def member() -> None:
        for _ in range(n):
            with_report_mac(key, rep)

    def placer() -> None:
        for _ in range(n):
            if not report_ok(key, dec.decode(raw)):
                raise AssertionError("a good report MAC did not verify")
    d, m, p = _median(decode, repeat), _median(member, repeat), _median(placer, repeat)
    return {"report_decode_us": d / n * 1e6, "report_mac_member_us": m / n * 1e6,
            "report_check_placer_us": p / n * 1e6, "report_check_added_us": (p - d) / n * 1e6}


def run(nodes: int, rack: int, repeat: int, log: Callable[[str], None]) -> dict[str, Any]:
    ids = _ids(nodes)
    out: dict[str, Any] = {"bench": "msgauth", "kind": "component figures (no sockets)", "nodes": nodes,
                           "rack": rack, "repeat": repeat, "load_before": list(os.getloadavg())}
    log(f"registering {nodes} nodes in a placer state")
    st, reg_s = registered(ids, rack)
    out["register_s"] = reg_s
    log("acks")
    out.update(bench_acks(st, ids, rack, repeat))
    log("sign")
    row, signed, plain, signer = bench_sign(ids, rack, repeat)
    out.update(row)
    log("verify")
    out.update(bench_verify(signed, plain, signer, repeat))
    log("report")
    out.update(bench_report(repeat))
    log("beats")
    out.update(bench_beats(st, ids, rack, repeat))
    out["load_after"] = list(os.getloadavg())
    return out


def table(r: dict[str, Any]) -> str:
    n = r["nodes"]
    rows = [
        (f"placer: check {r['acks']} acks' MACs", f"{r['acks_verify_ms']:.1f} ms", f"decode {r['acks_decode_ms']:.1f} ms",
         f"x{r['acks_verify_over_decode']:.2f}"),
        (f"placer: {r['beat_entries']} beat entries applied", f"{r['beats_mac_ms']:.1f} ms",
         f"no MAC {r['beats_plain_ms']:.1f} ms", f"x{r['beats_mac_over_plain']:.2f}"),
        (f"placer: build {r['bundles']} bundles ({n} parts), {r['sign_batch']} a signature",
         f"{r['sign_signed_ms']:.1f} ms", f"unsigned {r['sign_unsigned_ms']:.1f} ms", f"x{r['sign_over_unsigned']:.2f}"),
        ("placer: the same, one signature a bundle", f"{r['sign_each_ms']:.1f} ms", "", ""),
        ("relay: one bundle checked", f"{r['relay_verify_us']:.0f} us", f"decode {r['relay_decode_us']:.0f} us",
         f"x{r['relay_verify_over_decode']:.1f}"),
        ("member: its part's proof checked", f"{r['member_verify_us']:.0f} us", f"decode {r['member_decode_us']:.1f} us",
         f"+{r['member_verify_added_us']:.0f} us"),
        ("member: part bytes", f"{r['part_bytes_with_proof']} B", f"bare {r['part_bytes_bare']} B", ""),
        ("member: MAC one event report", f"{r['report_mac_member_us']:.1f} us", "", ""),
        ("placer: check one relayed report", f"{r['report_check_placer_us']:.1f} us",
         f"decode {r['report_decode_us']:.1f} us", f"+{r['report_check_added_us']:.1f} us"),
    ]
    w = max(len(a) for a, *_ in rows)
    lines = [f"bench.msgauth (component figures, medians of {r['repeat']}; load {r['load_before'][0]:.2f} -> "
             f"{r['load_after'][0]:.2f})"]
    lines += [f"  {a:<{w}}  {b:>12}  {c:>22}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=25_000)
    p.add_argument("--rack", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.nodes < a.rack or a.rack < 1 or a.repeat < 1:
        p.error("--nodes >= --rack >= 1 and --repeat >= 1")
    r = run(a.nodes, a.rack, a.repeat, lambda m: print(f"[bench.msgauth] {m}", file=sys.stderr, flush=True))
    print(json.dumps(r) if a.json else table(r))  # (one line: bench.quick reads the last line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
