"""Message-level authentication (scheduler_link.msgauth): MACs up, signatures down."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest

from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    GpuTelemetry,
    NodeOutcome,
    NodePart,
    NodeReport,
    PartPod,
    RackBundle,
    Victim,
    WorkloadEvent,
)
from scheduler_link.msgauth import (
    AuthError,
    BundleSigner,
    BundleSpec,
    BundleVerifier,
    beat_mac,
    load_placer_keys,
    node_key,
    outcome_ok,
    report_ok,
    with_outcome_mac,
    with_report_mac,
)

MASTER = b"m" * 32


def test_node_keys_differ_by_node_and_boot_and_master() -> None:
    k = node_key(MASTER, "n1", "b1")
    assert len(k) == 32
    assert k == node_key(MASTER, "n1", "b1")
    assert len({k, node_key(MASTER, "n2", "b1"), node_key(MASTER, "n1", "b2"), node_key(b"x" * 32, "n1", "b1")}) == 4


def test_report_mac_covers_every_field_and_survives_the_relays_round_trip() -> None:
    key = node_key(MASTER, "n1", "b1")
    snap = GpuSnapshot(gpus=[GpuInfo(index=0, uuid="GPU-1", name="x", memory_total_mib=1, pci_bus_id="0",
                                     telemetry=GpuTelemetry(temperature_c=45))])  # an int in a float field
    rep = NodeReport(node_id="n1", boot_id="b1", seq=3, full=False, snapshot=snap,
                     events=[WorkloadEvent(workload_id="j.0.0", job_id="j", state="running", at=1)])
    signed = with_report_mac(key, rep)
    # what the placer sees: the relay decoded and re-encoded it (msgpack frames)
    seen = msgspec.msgpack.decode(msgspec.msgpack.encode(signed), type=NodeReport)
    assert report_ok(key, seen)
    assert not report_ok(node_key(MASTER, "n2", "b1"), seen)     # another node's key
    forged = msgspec.structs.replace(seen, events=[msgspec.structs.replace(seen.events[0], state="failed")])
    assert not report_ok(key, forged)
    assert not report_ok(key, msgspec.structs.replace(seen, mac=b""))


def test_empty_heartbeat_mac_is_the_beat_entry_mac() -> None:
    key = node_key(MASTER, "n1", "b1")
    rep = with_report_mac(key, NodeReport(node_id="n1", boot_id="b1", seq=9, full=False, sent_at=5.0))
    assert rep.mac == beat_mac(key, "n1", "b1", 9)
    assert rep.mac != beat_mac(key, "n1", "b1", 10)   # a replayed seq does not carry over


def test_outcome_mac() -> None:
    key = node_key(MASTER, "n1", "b1")
    o = with_outcome_mac(key, NodeOutcome(node_id="n1", placement_id="p", outcome="refused_gpus",
                                          refused_gpus=["GPU-1"]))
    assert outcome_ok(key, o)
    assert not outcome_ok(key, msgspec.structs.replace(o, outcome="accepted", refused_gpus=[]))
    assert not outcome_ok(key, msgspec.structs.replace(o, node_id="n2"))


def _parts() -> list[NodePart]:
    return [NodePart(placement_id=f"start:j:0:n{i}", node_id=f"n{i}", job_id="j", attempt=0,
                     pods=[PartPod(workload_id=f"j.0.{i}", rank=i, gpu_indices=[0])], issued_at=1,
                     expires_at=31, victims=[Victim(workload_id="old.0.0", grace_s=5)]) for i in range(3)]


def test_signed_bundle_verifies_at_the_relay_and_at_each_member() -> None:
    signer = BundleSigner.generate()
    rb = signer.bundle(rack="z/b/r", blob_id="ab" * 32, parts=_parts(), deliver_by=100)
    payload = msgspec.msgpack.encode(rb)
    ver = BundleVerifier(signer.public)
    view, parts, proofs = ver.bundle(payload)
    assert [p.node_id for p in parts] == ["n0", "n1", "n2"]
    assert parts[0].victims[0].grace_s == 5.0
    seen: dict[bytes, bytes] = {}
    for p, pr in zip(parts, proofs, strict=True):
        # the relay hands the member its part (blob id filled in) with the proof, over msgpack
        sent = msgspec.structs.replace(p, blob_id=view.blob_id, proof=pr)
        got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=NodePart)
        ok = ver.part(got, seen=seen)
        assert ok.node_id == p.node_id and ok.blob_id == view.blob_id and ok.proof is None
    assert ver.verified == 2   # the relay once, the members once per bundle (seen)


def _batch(signer: BundleSigner, n: int) -> list[RackBundle]:
    """``n`` racks' bundles signed together (one signature, a Merkle path each), as the placer
    builds a round's batch."""
    return signer.bundles_raw([BundleSpec(f"z/b/r{k}", "ab" * 32,
                                          [msgspec.msgpack.encode(msgspec.structs.replace(p, node_id=f"r{k}-{p.node_id}"))
                                           for p in _parts()], 100.0) for k in range(n)])


def test_a_batch_of_bundles_shares_one_signature_and_each_verifies_alone() -> None:
    signer = BundleSigner.generate()
    rbs = _batch(signer, 5)   # (not a power of two: the tree is padded)
    assert signer.signed == 1 and len({rb.sig for rb in rbs}) == 1
    assert [rb.sig_index for rb in rbs] == [0, 1, 2, 3, 4] and all(len(rb.sig_path) == 3 for rb in rbs)
    seen: dict[bytes, bytes] = {}
    member = BundleVerifier(signer.public)
    for rb in rbs:
        relay = BundleVerifier(signer.public)   # each rack's relay: its own bundle only
        view, parts, proofs = relay.bundle(msgspec.msgpack.encode(rb))
        assert relay.verified == 1 and parts[0].node_id == f"{view.rack[-2:]}-n0"
        for p, pr in zip(parts, proofs, strict=True):
            sent = msgspec.msgpack.decode(msgspec.msgpack.encode(msgspec.structs.replace(p, proof=pr)), type=NodePart)
            assert member.part(sent, seen=seen).node_id == p.node_id
    assert member.verified == 1   # one receiver of several bundles of a batch: one verification


def test_a_batch_signature_does_not_carry_over_to_another_header() -> None:
    """A relay holding a batch's signature cannot make it cover a bundle of its own: not by
    changing the bundle, moving its position, borrowing another's path, or a long path; and a
    receiver that already verified the batch (its cache) still refuses the altered one."""
    signer = BundleSigner.generate()
    rbs = _batch(signer, 5)
    decoded = [msgspec.msgpack.decode(msgspec.msgpack.encode(rb), type=RackBundle) for rb in rbs]
    ver = BundleVerifier(signer.public)
    seen: dict[bytes, bytes] = {}
    b1 = decoded[1]
    bad_bundles = [
        msgspec.structs.replace(b1, sig_index=2),                                  # another position
        msgspec.structs.replace(b1, sig_path=decoded[2].sig_path),                  # another's path
        msgspec.structs.replace(b1, sig_path=list(reversed(b1.sig_path))),
        msgspec.structs.replace(b1, sig_path=b1.sig_path[:-1]),                     # a shorter tree
        msgspec.structs.replace(b1, sig_path=[*b1.sig_path, b"\0" * 32]),          # a deeper one
        msgspec.structs.replace(b1, sig_path=[b"\0" * 32] * 17, sig_index=1),      # past the bound
        msgspec.structs.replace(b1, sig_index=-1),
        msgspec.structs.replace(b1, sig_index=8),
        msgspec.structs.replace(b1, rack="z/b/r0"),                                 # its header changed
        msgspec.structs.replace(b1, parts=decoded[0].parts),
    ]
    for bad in bad_bundles:
        with pytest.raises(AuthError):
            BundleVerifier(signer.public).bundle(msgspec.msgpack.encode(bad))
    # a member that verified bundle 1's batch already: the same signature over a changed header
    _, parts1, proofs1 = ver.bundle(msgspec.msgpack.encode(rbs[1]))
    pr = proofs1[0]
    assert ver.part(msgspec.structs.replace(parts1[0], proof=pr), seen=seen).node_id == parts1[0].node_id
    checks = ver.verified
    forged_raw = msgspec.msgpack.encode(msgspec.structs.replace(parts1[0], node_id="r1-n9"))
    from scheduler_link.msgauth import digest
    for bad_pr in (msgspec.structs.replace(pr, raw=forged_raw, digests=[digest(forged_raw), *pr.digests[1:]]),
                   msgspec.structs.replace(pr, sig_index=3),
                   msgspec.structs.replace(pr, deliver_by=1e12)):
        with pytest.raises(AuthError):
            ver.part(msgspec.structs.replace(parts1[0], proof=bad_pr), seen=seen)
    assert ver.verified == checks   # (refused, not cached)


def test_a_bundle_signed_the_way_older_placers_did_still_verifies() -> None:
    """Before batched signatures a placer signed each bundle's header itself: agents upgraded
    first still take its bundles (and nothing else signed that way: a path, or other bytes)."""
    from scheduler_link.msgauth import digest, header_bytes
    signer = BundleSigner.generate()
    raws = [msgspec.msgpack.encode(p) for p in _parts()]
    old_sig = signer._key.sign(header_bytes("z/b/r", "ab" * 32, 100.0, [digest(r) for r in raws]))
    rb = RackBundle(rack="z/b/r", blob_id="ab" * 32, parts=[msgspec.Raw(r) for r in raws],  # type: ignore[misc]
                    deliver_by=100.0, sig=old_sig)
    ver = BundleVerifier(signer.public)
    view, parts, proofs = ver.bundle(msgspec.msgpack.encode(rb))
    assert ver.part(msgspec.structs.replace(parts[1], proof=proofs[1])).node_id == "n1"
    for bad in (msgspec.structs.replace(rb, sig_path=[b"\0" * 32]), msgspec.structs.replace(rb, deliver_by=101.0)):
        with pytest.raises(AuthError):
            ver.bundle(msgspec.msgpack.encode(bad))


def test_a_relay_cannot_alter_a_bundle_or_a_part() -> None:
    signer = BundleSigner.generate()
    ver = BundleVerifier(signer.public)
    rb = signer.bundle(rack="z/b/r", blob_id="ab" * 32, parts=_parts(), deliver_by=100)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(rb), type=RackBundle)
    # a part for another node / changed argv-bearing blob / a later deadline: re-encoded by the relay
    for bad in (msgspec.structs.replace(decoded, parts=[msgspec.structs.replace(decoded.parts[0], node_id="n9")]
                                        + decoded.parts[1:]),
                msgspec.structs.replace(decoded, blob_id="cd" * 32),
                msgspec.structs.replace(decoded, deliver_by=1e12),
                msgspec.structs.replace(decoded, sig=b""),
                msgspec.structs.replace(decoded, sig=BundleSigner.generate().sign_parts("z/b/r", "ab" * 32, 100, []))):
        with pytest.raises(AuthError):
            ver.bundle(msgspec.msgpack.encode(bad))
    _, parts, proofs = ver.bundle(msgspec.msgpack.encode(rb))
    pr = proofs[0]
    other = msgspec.structs.replace(parts[0], node_id="n1")
    with pytest.raises(AuthError):  # a part's bytes changed (retargeted), digests kept
        ver.part(msgspec.structs.replace(other, proof=msgspec.structs.replace(
            pr, raw=msgspec.msgpack.encode(other))))
    with pytest.raises(AuthError):  # the digest list changed to match: the signature fails
        raw = msgspec.msgpack.encode(other)
        from scheduler_link.msgauth import digest
        ver.part(msgspec.structs.replace(other, proof=msgspec.structs.replace(
            pr, raw=raw, digests=[digest(raw), *pr.digests[1:]])))
    with pytest.raises(AuthError):
        ver.part(parts[0])  # no proof at all
    with pytest.raises(AuthError):
        BundleVerifier(b"short")


def test_placer_keys_made_once_0600(tmp_path: os.PathLike[str]) -> None:
    m1, s1 = load_placer_keys(tmp_path)
    m2, s2 = load_placer_keys(tmp_path)
    assert m1 == m2 and s1.public == s2.public and len(m1) == 32
    for name in ("node-mac.secret", "placer-signing.key"):
        assert stat.S_IMODE(os.stat(os.path.join(tmp_path, name)).st_mode) == 0o600
    with open(os.path.join(tmp_path, "node-mac.secret"), "wb") as f:
        f.write(b"short")
    with pytest.raises(AuthError, match="not 32"):
        load_placer_keys(tmp_path)


def _full(node: str, boot: str, workloads: list[str]) -> NodeReport:
    from scheduler_link.messages import TopologyPath, WorkloadStatus
    snap = GpuSnapshot(gpus=[GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="x", memory_total_mib=1, pci_bus_id=str(i))
                             for i in range(2)])
    return NodeReport(node_id=node, boot_id=boot, seq=1, full=True, topology=TopologyPath(rack="r1"), snapshot=snap,
                      workloads=[WorkloadStatus(workload_id=w, job_id="gone", state="running",
                                                gpus=[f"GPU-{node}-0"]) for w in workloads])


def test_the_placer_gives_keys_only_over_the_nodes_own_connection_and_macs_its_relayed_stops(tmp_path) -> None:
    """A placer service (its ingest, no sockets): the answer to a direct full report carries the
    node's key and the signing key; a relayed one is refused without the node's MAC and, with it,
    gets no keys; fencing stops for a relayed node (in a report's answer and in a beat reply)
    carry MACs in that node's key, which the member checks (msgauth.verified_stops)."""
    from infra.auth import TokenSet
    from placer.config import PlacerConfig
    from placer.service import PlacerService
    from scheduler_link.messages import RackBeat
    from scheduler_link.msgauth import verified_stops

    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path)), TokenSet())
    st, reply = svc._ingest("n1", _full("n1", "b1", ["gone.0.0"]))   # a workload of no job: told to stop
    assert st == 200 and reply.mac_key and reply.placer_key == svc.signer.public
    assert [v.workload_id for v in reply.stop] == ["gone.0.0"] and not reply.stop[0].mac  # its own connection
    key = reply.mac_key
    assert key == node_key(svc.mac_master, "n1", "b1")
    # relayed: refused without n1's MAC (even a full report), no key in any relayed answer
    st, r = svc._ingest("n1", msgspec.structs.replace(_full("n1", "b1", ["gone.0.0"]), seq=2), via="relay-x")
    assert st == 401 and r.mac_key is None and svc.state.counters["bad_macs"] == 1
    rep = with_report_mac(key, NodeReport(node_id="n1", boot_id="b1", seq=2, full=False,
                                          events=[WorkloadEvent(workload_id="gone.0.0", job_id="gone",
                                                                state="running", at=1.0)]))
    # a relay replaying an older full report of n1 (its MAC once valid), or one of an older boot
    old_full = with_report_mac(key, msgspec.structs.replace(_full("n1", "b1", []), seq=1))
    old_boot = with_report_mac(node_key(svc.mac_master, "n1", "b0"), msgspec.structs.replace(
        _full("n1", "b0", []), seq=9))
    for replay in (old_full, old_boot):
        st, r = svc._ingest("n1", replay, via="relay-x")
        assert st == 409 and "current boot and sequence" in (r.error or "")
    assert svc.state.counters["replays"] == 2 and svc.state.nodes["n1"].boot_id == "b1"
    svc.state.nodes["n1"].tell.add("gone.0.0")   # (the direct answer told it once; tell again)
    st, r = svc._ingest("n1", rep, via="relay-x")
    assert st == 200 and r.mac_key is None
    ok, forged = verified_stops(key, "n1", "b1", list(r.stop))
    assert [v.workload_id for v in ok] == ["gone.0.0"] and forged == 0
    # the same stop in a beat reply, for a relayed entry
    svc.state.nodes["n1"].tell.add("gone.0.0")
    b = RackBeat(rack="zone-a/block-a/r1", node_ids=["n1"], boot_ids=["b1"], seqs=[3],
                 macs=[beat_mac(key, "n1", "b1", 3)])
    br, _ = svc.state.beat(b, 2.0, via="relay-x")
    (ns,) = br.stop
    ok, forged = verified_stops(key, "n1", "b1", list(ns.stop))
    assert [v.workload_id for v in ok] == ["gone.0.0"] and forged == 0
    assert verified_stops(node_key(svc.mac_master, "n2", "b1"), "n1", "b1", list(ns.stop))[0] == []
