"""The part log (agent.partstore): one append and one fdatasync per batch of records, the
newest frame of a placement id wins, forgetting appends a frame, and a torn or damaged tail
(a crash mid-append, never acknowledged) loses only itself: every record whose save returned
is read back, and appends after a recovery never glue onto torn bytes. Compaction keeps
exactly the live records; the earlier one-file-per-part layout is read and folded in."""

from __future__ import annotations

from pathlib import Path

import blake3
import msgspec
import pytest

from agent import partstore
from agent.partstore import LOG_NAME, PartRecord, PartStore, frame, read_frames
from scheduler_link.messages import NodePart, PartPod, PodAssignment

NOW = 1_000_000.0


def rec(pid: str, state: str = "accepted", at: float = NOW) -> PartRecord:
    part = NodePart(placement_id=pid, node_id="n1", job_id="job", attempt=1, blob_id="b" * 64,
                    pods=[PartPod(workload_id=f"job.1.{pid}", rank=0, gpu_indices=[0])], expires_at=NOW + 10)
    return PartRecord(part=part, pods=[PodAssignment(workload_id=f"job.1.{pid}", rank=0, gpus=["GPU-0"])],
                      state=state, accepted_at=at)  # type: ignore[arg-type]  # (a PartState)


def states(store: PartStore) -> dict[str, str]:
    return {r.part.placement_id: r.state for r in store.load()}


def test_records_round_trip_the_newest_wins_and_forgetting_sticks(tmp_path: Path) -> None:
    s = PartStore(tmp_path)
    s.save([rec("p1", at=NOW), rec("p2", at=NOW + 1)])
    s.save([rec("p1", "placed")])
    s.remove(["p2"])
    assert s.syncs == 2 and s.writes == 3          # one fdatasync per save, whatever its size
    assert states(PartStore(tmp_path)) == {"p1": "placed"}   # (another reader, while it is open)
    assert [r.part.placement_id for r in PartStore(tmp_path).load()] == ["p1"]
    s.save([rec("p3", at=NOW - 1)])
    assert [r.part.placement_id for r in PartStore(tmp_path).load()] == ["p3", "p1"]   # oldest accepted first
    s.close()


def test_a_torn_tail_loses_only_itself_at_every_cut(tmp_path: Path) -> None:
    s = PartStore(tmp_path)
    s.save([rec("p1")])
    s.save([rec("p1", "placed"), rec("p2")])
    s.close()
    log = tmp_path / "parts" / LOG_NAME
    whole = log.read_bytes()
    last = frame(1, msgspec.msgpack.encode(rec("p3")))
    for cut in range(len(last)):                      # a crash anywhere inside the next append
        log.write_bytes(whole + last[:cut])
        assert states(PartStore(tmp_path)) == {"p1": "placed", "p2": "accepted"}, cut
    damaged = bytearray(last)
    damaged[-3] ^= 0x40                               # a whole frame whose bytes are not what was written
    log.write_bytes(whole + bytes(damaged))
    assert states(PartStore(tmp_path)) == {"p1": "placed", "p2": "accepted"}
    # the owner's recovery cuts the tail: what it appends next is read back
    log.write_bytes(whole + last[:7])
    s = PartStore(tmp_path)
    assert len(s.recover()) == 2
    s.save([rec("p4")])
    assert states(PartStore(tmp_path)) == {"p1": "placed", "p2": "accepted", "p4": "accepted"}
    s.close()
    # and so does a first save by a store that did not recover (it opens the log itself)
    log.write_bytes(log.read_bytes() + last[:9])
    s = PartStore(tmp_path)
    s.save([rec("p5")])
    assert set(states(PartStore(tmp_path))) == {"p1", "p2", "p4", "p5"}
    s.close()


def test_frames_stop_at_a_bad_header() -> None:
    ok = frame(1, b"abc")
    frames, end = read_frames(ok + b"\xff\xff\xff\xff" + b"\0" * 8 + ok)
    assert frames == [(1, b"abc")] and end == len(ok)   # an impossible length: nothing after it is trusted
    assert read_frames(b"")[0] == [] and read_frames(ok[:3]) == ([], 0)


def test_compaction_keeps_exactly_the_live_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partstore, "COMPACT_MIN_BYTES", 4096)
    s = PartStore(tmp_path)
    for i in range(200):
        s.save([rec(f"p{i % 5}", "placed" if i % 2 else "accepted", at=NOW + i)])
        if i % 7 == 0:
            s.remove([f"p{(i + 1) % 5}"])
    assert s.compactions > 0
    log = tmp_path / "parts" / LOG_NAME
    assert log.stat().st_size <= 4 * 4096
    expect = states(PartStore(tmp_path))
    s.close()
    s = PartStore(tmp_path)
    assert {r.part.placement_id: r.state for r in s.recover()} == expect
    assert log.stat().st_size == sum(len(frame(1, msgspec.msgpack.encode(r))) for r in PartStore(tmp_path).load())
    s.close()


def test_the_earlier_one_file_per_part_layout_is_read_and_folded_in(tmp_path: Path) -> None:
    d = tmp_path / "parts"
    d.mkdir()
    for pid in ("old1", "old2"):
        (d / (blake3.blake3(pid.encode()).hexdigest(length=16) + ".part")).write_bytes(
            msgspec.msgpack.encode(rec(pid)))
    (d / "junk.part").write_bytes(b"not msgpack")
    assert states(PartStore(tmp_path)) == {"old1": "accepted", "old2": "accepted"}
    s = PartStore(tmp_path)
    assert len(s.recover()) == 2
    assert sorted(p.name for p in d.iterdir()) == [LOG_NAME]
    s.save([rec("old1", "placed")])
    assert states(PartStore(tmp_path)) == {"old1": "placed", "old2": "accepted"}
    s.close()
