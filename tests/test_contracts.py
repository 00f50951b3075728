"""The fleet-scale wire contracts (scheduler_link.messages, last section) and the
structured placement outcomes the agent answers with."""

from __future__ import annotations

import zlib

import blake3
import msgspec
import pytest

from agent.placement import check_placement
from scheduler_link.messages import (
    BLOB_ZLIB_MAGIC,
    MAX_BLOB_BYTES,
    AckBundle,
    Frame,
    GangBlob,
    NodeOutcome,
    NodePart,
    PartPod,
    PeerTable,
    Placement,
    PlacementAck,
    PodAssignment,
    RackBundle,
    decode_gang_blob,
    encode_gang_blob,
    expand_part,
)


def _table(racks: int, per_rack: int) -> PeerTable:
    ids, urls, rack_of, names, starts = [], [], [], [], []
    for r in range(racks):
        starts.append(len(ids))
        names.append(f"z0/b0/r{r}")
        for k in range(per_rack):
            ids.append(f"n{r}-{k}")
            urls.append(f"http://10.0.{r}.{k}:7070")
            rack_of.append(r)
    return PeerTable(node_ids=ids, data_urls=urls, rack_of=rack_of, racks=names, rack_start=starts)


def test_blob_id_is_hash_of_canonical_bytes_and_env_order_does_not_matter():
    t = _table(3, 4)
    a = GangBlob(job_id="j", attempt=2, argv=["x"], env={"B": "1", "A": "2"}, peers=t, world_size=12)
    b = GangBlob(job_id="j", attempt=2, argv=["x"], env={"A": "2", "B": "1"}, peers=t, world_size=12)
    ida, rawa = encode_gang_blob(a)
    idb, rawb = encode_gang_blob(b)
    assert ida == idb and rawa == rawb
    back = decode_gang_blob(rawa, ida)
    assert back == a
    assert back.peers.peer(5).rack == "r1" and back.peers.peer(5).node_id == "n1-1"
    assert list(back.peers.rack_rows(2)) == [8, 9, 10, 11]
    other, _ = encode_gang_blob(msgspec.structs.replace(a, attempt=3))
    assert other != ida


def test_tampered_or_noncanonical_blob_is_refused():
    blob = GangBlob(job_id="j", attempt=1, env={"A": "1", "B": "2"})
    bid, raw = encode_gang_blob(blob)
    bad = bytearray(raw)
    bad[-1] ^= 1
    with pytest.raises(ValueError, match="does not match"):
        decode_gang_blob(bytes(bad), bid)
    # same content, keys out of order: valid msgpack, not canonical
    noncanon = msgspec.msgpack.encode(msgspec.structs.replace(blob, env={"B": "2", "A": "1"}))
    assert noncanon != raw
    with pytest.raises(ValueError, match="canonical"):
        decode_gang_blob(noncanon)


def test_big_blob_travels_compressed_and_decodes_back():
    t = _table(2_000, 18)   # 36,000 peers
    blob = GangBlob(job_id="j", attempt=1, peers=t, world_size=len(t))
    bid, raw = encode_gang_blob(blob)
    plain = msgspec.msgpack.Encoder(order="deterministic").encode(blob)
    assert raw.startswith(BLOB_ZLIB_MAGIC) and len(raw) * 4 < len(plain)
    assert decode_gang_blob(raw, bid) == blob
    small = GangBlob(job_id="j", attempt=1, argv=["true"])
    sid, sraw = encode_gang_blob(small)
    assert msgspec.msgpack.decode(sraw)["argv"] == ["true"]  # under 4 KiB: plain canonical msgpack
    assert decode_gang_blob(sraw, sid) == small


def test_hostile_compressed_blobs_are_refused():
    canon = msgspec.msgpack.Encoder(order="deterministic").encode(GangBlob(job_id="j", attempt=1, peers=_table(300, 4)))

    def refused(raw: bytes, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            decode_gang_blob(raw, blake3.blake3(raw).hexdigest())   # the id matches: the content is refused

    # a bomb: 300 MiB of zeros compress to ~300 kB; refused at MAX_BLOB_BYTES, never inflated whole
    z = zlib.compressobj(1)
    bomb = BLOB_ZLIB_MAGIC + b"".join(z.compress(bytes(1 << 20)) for _ in range((MAX_BLOB_BYTES >> 20) + 44)) + z.flush()
    refused(bomb, "inflates past")
    refused(BLOB_ZLIB_MAGIC + zlib.compress(canon)[:-9], "truncated")
    refused(BLOB_ZLIB_MAGIC + zlib.compress(canon) + b"junk", "trailing")
    refused(BLOB_ZLIB_MAGIC + b"not zlib at all", "does not decompress")
    refused(b"\x00other-marker\x00" + zlib.compress(canon), "unknown encoding")
    # valid zlib of non-canonical msgpack (keys out of order)
    noncanon = msgspec.msgpack.encode(GangBlob(job_id="j", attempt=1, env={"B": "2", "A": "1"}))
    refused(BLOB_ZLIB_MAGIC + zlib.compress(noncanon), "canonical")


def test_start_part_ids_are_derived_from_its_signed_fields():
    compact = NodePart(placement_id="", node_id="n7", job_id="big", attempt=3,
                       pods=[PartPod(workload_id="", rank=40, gpu_indices=[0, 1]), PartPod(workload_id="", rank=41)])
    full = expand_part(compact)
    assert full.placement_id == "start:big:3:n7"
    assert [p.workload_id for p in full.pods] == ["big.3.40", "big.3.41"]
    assert expand_part(full) is full                       # named ids are kept as they are
    named = msgspec.structs.replace(compact, placement_id="p-1")
    assert expand_part(named).placement_id == "p-1"
    with pytest.raises(msgspec.ValidationError, match="must name its placement"):
        expand_part(NodePart(placement_id="", node_id="n7", job_id="big", attempt=3))   # stops only


def test_node_part_does_not_grow_with_the_gang():
    small = _table(2, 4)
    big = _table(6400, 4)  # 25,600 nodes
    sizes = []
    for t in (small, big):
        bid, _ = encode_gang_blob(GangBlob(job_id="j", attempt=1, peers=t))
        part = NodePart(placement_id="p", node_id=t.node_ids[0], job_id="j", attempt=1, blob_id=bid,
                        pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["GPU-a"])],
                        rack_members=[t.peer(i) for i in t.rack_rows(0)], contacts=[t.peer(len(t) - 1)])
        sizes.append(len(msgspec.json.encode(part)))
    # rack 0 has 4 members in both, so the parts are the same size give or take a digit
    assert abs(sizes[0] - sizes[1]) < 16


def test_bundles_and_frames_round_trip():
    part = NodePart(placement_id="p", node_id="n", job_id="j", attempt=1, blob_id="ab" * 32)
    rb = RackBundle(rack="z/b/r", blob_id="ab" * 32, blob=b"\x01\x02", parts=[part])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(rb), type=RackBundle) == rb
    ab = AckBundle(rack="z/b/r", blob_id="ab" * 32, outcomes=[
        NodeOutcome(node_id="n", placement_id="p", outcome="refused_gpus", refused_gpus=["GPU-x"])])
    assert msgspec.json.decode(msgspec.json.encode(ab), type=AckBundle) == ab
    f = Frame(type="acks", payload=msgspec.Raw(msgspec.json.encode(ab)))
    back = msgspec.json.decode(msgspec.json.encode(f), type=Frame)
    assert back.term == 0 and back.sig == b""
    assert msgspec.json.decode(back.payload, type=AckBundle) == ab
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"type":"nonsense"}', type=Frame)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode({"node_id": "n", "placement_id": "p", "outcome": "maybe"}),
                            type=NodeOutcome)


def test_old_acks_read_as_accepted_or_spec_refusal():
    assert PlacementAck(placement_id="p", node_id="n", accepted=True).effective_outcome() == "accepted"
    assert PlacementAck(placement_id="p", node_id="n", accepted=False,
                        reason="GPU GPU-1 is fatal-unhealthy").effective_outcome() == "refused_spec"


def test_agent_refusals_are_structured():
    health = {"GPU-a": "healthy", "GPU-b": "fatal"}
    ok = Placement(placement_id="p", job_id="j", argv=["x"],
                   pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["GPU-a"])])
    assert check_placement(ok, {}, health) is None
    bad_gpu = msgspec.structs.replace(ok, pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["GPU-b"])])
    r = check_placement(bad_gpu, {}, health)
    assert r is not None and r.outcome == "refused_gpus" and r.gpus == ("GPU-b",)
    no_argv = msgspec.structs.replace(ok, argv=[])
    r = check_placement(no_argv, {}, health)
    assert r is not None and r.outcome == "refused_spec" and r.gpus == ()
    unknown = msgspec.structs.replace(ok, pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=["GPU-zz"])])
    r = check_placement(unknown, {}, health)
    assert r is not None and r.outcome == "refused_spec"
