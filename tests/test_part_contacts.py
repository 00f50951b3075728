"""A gang's contacts (up nodes outside it that hold its manifest) travel once, in its blob
(GangBlob version 2), not in every node's part: the parts of a gang with contacts are byte for
byte those of the same gang without; the blob lists them; a relay that changes a contact is
caught (the blob no longer matches the id the placer signed into the bundle's header); a
version-1 blob (a placer that lists contacts in each part) is still read, and a blob of a
version this tree does not read is refused with the version named. Pure: placer state,
encoders, the relay core and the blob cache; no sockets."""

from __future__ import annotations

import blake3
import msgspec
import pytest
import trio

from agent.blobs import BlobCache, BlobUnavailable
from agent.parts import build_placement
from agent.relaycore import KeepBlob, Refuse, RelayCore, Taken
from bench.read_grants import sim_report
from placer.config import PlacerConfig
from placer.records import parts_bytes
from placer.state import PlacerState
from scheduler_link.messages import (
    GANG_BLOB_VERSION,
    GangBlob,
    JobSpec,
    NodePart,
    PartPod,
    Peer,
    PodAssignment,
    decode_gang_blob,
    encode_gang_blob,
)
from scheduler_link.msgauth import BundleSigner

M = "ab" * 32
RACK = "z/b/r0"


def _decide(holders: int) -> tuple[list[Peer], list[bytes], GangBlob]:
    """A 40-node gang of M on 40 nodes in two racks (and ``holders`` one-GPU nodes holding M,
    too small for its pods: its contacts): the first node's direct-push peers, the parts' bytes
    as a bundle carries them, and the blob."""
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0), started_at=0.0)
    st_.recover_until = 0.0
    st_.read_grants = BundleSigner.generate().read_grant
    for i in range(40):
        st_.ingest(f"n{i:02d}", sim_report(f"n{i:02d}", f"r{i // 20}", 8, []), 0.0)
    for i in range(holders):
        st_.ingest(f"h{i}", sim_report(f"h{i}", "r9", 1, [M]), 0.0)
    st_.submit(JobSpec(job_id="g", pods=40, gpus_per_pod=8, argv=["x"], manifest_id=M, origin="file:///o"), 0.1)
    (job, pushes), = st_.schedule(0.1)
    assert job.blob_id is not None
    blob = decode_gang_blob(st_.blobs[job.blob_id], job.blob_id)
    return pushes[0].placement.peers, parts_bytes(pushes, 9.0), blob


def test_a_gangs_contacts_are_in_its_blob_and_in_no_part():
    direct, with_contacts, blob = _decide(holders=8)
    _, without, plain = _decide(holders=0)
    assert sorted(p.node_id for p in blob.contacts) == [f"h{i}" for i in range(8)]
    assert blob.version == GANG_BLOB_VERSION == 2 and blob.read_grant
    assert plain.contacts == [] and not plain.read_grant
    # every node's part is the same bytes whether the gang has contacts or not: they are not in it
    assert len(with_contacts) == 40 and with_contacts == without
    parts = [msgspec.msgpack.decode(r, type=NodePart) for r in with_contacts]
    assert all(p.contacts == [] and p.rack_members == [] for p in parts)
    assert max(map(len, with_contacts)) < 128
    # a node pushed directly (its relay failed) gets them in its Placement's peers, as before
    assert {p.node_id for p in blob.contacts} <= {p.node_id for p in direct}


def _blob(contacts: list[Peer]) -> tuple[str, bytes]:
    return encode_gang_blob(GangBlob(job_id="g", attempt=1, argv=["x"], manifest_id=M, contacts=contacts))


def _peer(n: str) -> Peer:
    return Peer(node_id=n, data_url=f"https://{n}:7471", zone="z", block="b", rack="r9")


def _bundle(signer: BundleSigner, blob_id: str, raw: bytes) -> bytes:
    part = NodePart(placement_id="", node_id="n1", job_id="g", attempt=1,
                    pods=[PartPod(workload_id="", rank=0, gpu_indices=[0])], expires_at=9e9)
    return msgspec.msgpack.encode(signer.bundle(rack=RACK, blob_id=blob_id, parts=[part], deliver_by=0.0, blob=raw))


def test_a_relay_that_changes_a_contact_is_caught():
    """The contacts are covered by the placer's signature: the bundle's signed header names the
    blob id, and a blob is kept only when its bytes hash to that id. A relay that swaps a
    contact in the blob it passes on keeps the id (the bundle verifies) but its blob is
    refused by every receiver; one that names the changed blob's id breaks the signature."""
    signer = BundleSigner.generate()
    bid, raw = _blob([_peer("h0"), _peer("h1")])
    forged_id, forged = _blob([_peer("h0"), _peer("evil")])
    core = RelayCore(node_id="n0", rack=RACK)
    core.member_opened("n1")
    # the blob's bytes changed, its id kept: the relay core takes the bundle (the header holds)
    # and hands the bytes on; the cache that would keep them refuses them
    got = core.bundle(_bundle(signer, bid, forged), signer.public, now=0.0, wall=0.0)
    assert isinstance(got, Taken)
    keep = got.actions[0]
    assert isinstance(keep, KeepBlob) and keep.blob_id == bid
    cache = BlobCache()
    assert cache.put(keep.blob_id, keep.raw) is None and cache.refused == 1 and cache.cached(bid) is None
    # the id changed with the bytes: the signature no longer holds, nothing is handed
    payload = msgspec.msgpack.decode(_bundle(signer, bid, raw))
    payload.update(blob_id=forged_id, blob=forged)
    refused = core.bundle(msgspec.msgpack.encode(payload), signer.public, now=0.0, wall=0.0)
    assert isinstance(refused, Refuse) and refused.reason == "not_authentic"
    # the blob as the placer made it is kept, contacts and all
    ok = cache.put(bid, raw)
    assert ok is not None and [p.node_id for p in ok.contacts] == ["h0", "h1"]


def test_the_agent_takes_the_contacts_from_the_blob():
    """A part names its gang's blob; the Placement the agent builds from the two lists the
    blob's contacts after the part's own peers (a part from a placer that lists contacts in
    each part, with a version-1 blob, keeps its own)."""
    bid, raw = _blob([_peer("h0"), _peer("h1")])
    blob = decode_gang_blob(raw, bid)
    part = NodePart(placement_id="start:g:1:n1", node_id="n1", job_id="g", attempt=1, blob_id=bid,
                    pods=[PartPod(workload_id="g.1.0", rank=0, gpu_indices=[0])])
    pods = [PodAssignment(workload_id="g.1.0", rank=0, gpus=["GPU-0"], gpu_indices=[0])]
    pl = build_placement(part, pods, blob)
    assert [p.node_id for p in pl.peers] == ["h0", "h1"] and pl.gang_blob_id == bid and pl.manifest_id == M
    old_id, old_raw = _blob([])
    old = decode_gang_blob(old_raw, old_id)
    assert msgspec.msgpack.decode(old_raw)["version"] == 1
    legacy = msgspec.structs.replace(part, blob_id=old_id, contacts=[_peer("h7")])
    assert [p.node_id for p in build_placement(legacy, pods, old).peers] == ["h7"]


def test_blob_versions_are_named_and_never_mixed_silently():
    """A blob without contacts is version 1, byte for byte what a placer before version 2 made
    (agents that read only version 1 run its gang); one with contacts is version 2. A blob of
    a version this tree does not read, or a version-1 blob that lists contacts, is refused
    naming why."""
    bid, raw = _blob([])
    fields = msgspec.msgpack.decode(raw)
    assert fields["version"] == 1 and "contacts" not in fields
    assert decode_gang_blob(raw, bid) == GangBlob(job_id="g", attempt=1, argv=["x"], manifest_id=M)
    bid2, raw2 = _blob([_peer("h0")])
    fields2 = msgspec.msgpack.decode(raw2)
    assert fields2["version"] == 2 and fields2["contacts"][0]["node_id"] == "h0"
    assert decode_gang_blob(raw2, bid2).contacts == [_peer("h0")]
    enc = msgspec.msgpack.Encoder(order="deterministic")
    with pytest.raises(ValueError, match="unsupported gang blob version 3"):
        decode_gang_blob(enc.encode({**fields2, "version": 3}))
    with pytest.raises(ValueError, match="version-1 gang blob lists no contacts"):
        decode_gang_blob(enc.encode({**fields2, "version": 1}))
    with pytest.raises(ValueError, match="canonical"):   # a version-2 blob must list its contacts field
        decode_gang_blob(enc.encode({**fields, "version": 2}))


async def test_a_blob_of_a_version_not_read_here_fails_naming_it():
    """What an agent that reads only versions 1 and 2 makes of a later blob whose bytes match
    its id: not kept, and the fetch fails naming the version (the part's pods are then reported
    failed with that reason: agent.parts)."""
    _, raw2 = _blob([_peer("h0")])
    later = msgspec.msgpack.Encoder(order="deterministic").encode({**msgspec.msgpack.decode(raw2), "version": 3})
    later_id = blake3.blake3(later).hexdigest()

    async def source(b: str) -> bytes | None:
        return later if b == later_id else None

    cache = BlobCache()
    with trio.fail_after(5), pytest.raises(BlobUnavailable, match="unsupported gang blob version 3"):
        await cache.get(later_id, [source])
    assert cache.refused == 1 and cache.cached(later_id) is None
