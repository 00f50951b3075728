"""The agent's state on disk: a snapshot plus a pre-allocated, fdatasync'd log of the changed
records (agent.state), and "acked means written durably" across a crash of the agent process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec

from agent.state import (
    KIND_DELTA,
    PREALLOC_BYTES,
    AgentState,
    StateDelta,
    StateFile,
    WorkloadRecord,
    frame,
    read_state,
)
from scheduler_link.messages import PlacementAck

ROOT = Path(__file__).resolve().parent.parent


def rec(wid: str, state: str = "accepted") -> WorkloadRecord:
    return WorkloadRecord(workload_id=wid, job_id="j", state=state)


def ack(pid: str) -> PlacementAck:
    return PlacementAck(placement_id=pid, node_id="n1", accepted=True, outcome="accepted")


def test_snapshot_then_deltas_replay_in_order(tmp_path: Path) -> None:
    f = StateFile(tmp_path)
    f.save(AgentState(node_id="n1", records=[rec("a")], acks=[ack("pa")], seq=5))
    f.append([StateDelta(seq=6, records=[rec("b")], acks=[ack("pb")]),
              StateDelta(seq=7, records=[rec("a", "running")])])
    f.append([StateDelta(seq=8, forget=["b"], forget_acks=["pa"])])
    f.close()
    st = read_state(tmp_path)
    assert {r.workload_id: r.state for r in st.records} == {"a": "running"}
    assert [a.placement_id for a in st.acks] == ["pb"] and st.seq == 8
    # the snapshot was written once; the three deltas went to the log
    assert (f.writes, f.appends) == (1, 3)


def test_deltas_already_in_the_snapshot_are_not_replayed(tmp_path: Path) -> None:
    """A crash after a new snapshot, before the log was reset: its old deltas are skipped
    (else an older copy of a record would overwrite the snapshot's newer one)."""
    f = StateFile(tmp_path)
    f.save(AgentState(seq=1))
    f.append([StateDelta(seq=2, records=[rec("a", "running")])])
    f.close()
    old_log = (tmp_path / "state.log").read_bytes()
    f.save(AgentState(records=[rec("a", "exited")], seq=2))
    f.close()
    (tmp_path / "state.log").write_bytes(old_log)   # the reset lost
    assert [(r.workload_id, r.state) for r in read_state(tmp_path).records] == [("a", "exited")]


def test_a_write_a_crash_cut_short_is_dropped(tmp_path: Path) -> None:
    """A crash mid-write of a delta (never acknowledged): its frame cut short, or only part of
    its pages on disk over the zeros (written back out of order); either way the log ends at
    the last whole frame."""
    f = StateFile(tmp_path)
    f.save(AgentState(seq=0))
    f.append([StateDelta(seq=1, records=[rec("a")])])
    at = f.log_bytes
    f.close()
    whole = frame(KIND_DELTA, msgspec.json.encode(StateDelta(seq=2, records=[rec("b")])))
    half = len(whole) // 2
    # cut at its end; its header and first part on disk, the rest still zeros (its checksum
    # fails); only its later part on disk (a zero header)
    for torn in (whole[:half], whole[:half] + bytes(len(whole) - half), bytes(half) + whole[half:]):
        with open(tmp_path / "state.log", "r+b") as out:
            out.seek(at)
            out.write(torn)
        st = read_state(tmp_path)
        assert [r.workload_id for r in st.records] == ["a"] and st.seq == 1
    # a start folds it into a snapshot and a fresh log: later writes never glue onto it
    f2 = StateFile(tmp_path)
    f2.save(f2.load())
    f2.append([StateDelta(seq=2, records=[rec("c")])])
    f2.close()
    assert sorted(r.workload_id for r in read_state(tmp_path).records) == ["a", "c"]


def test_deltas_are_written_over_preallocated_zeros(tmp_path: Path) -> None:
    """The log's blocks exist before a delta is written (zeros written, not a sparse file) and
    its size does not change with a write that fits: what lets fdatasync skip the
    filesystem's journal commit. A delta past the zeros grows the file by more of them."""
    f = StateFile(tmp_path)
    f.save(AgentState(seq=0))
    log = tmp_path / "state.log"
    st = log.stat()
    assert st.st_size == PREALLOC_BYTES and st.st_blocks * 512 >= PREALLOC_BYTES
    for seq in range(1, 11):
        f.append([StateDelta(seq=seq, records=[rec(f"w{seq}")])])
        assert log.stat().st_size == PREALLOC_BYTES
    big = WorkloadRecord(workload_id="big", job_id="j", env={"X": "y" * PREALLOC_BYTES})
    f.append([StateDelta(seq=11, records=[big])])
    grown = log.stat()
    assert grown.st_size >= f.log_bytes + PREALLOC_BYTES and grown.st_blocks * 512 >= grown.st_size
    f.append([StateDelta(seq=12, records=[rec("after")])])
    assert log.stat().st_size == grown.st_size
    f.close()
    st2 = read_state(tmp_path)
    assert st2.seq == 12 and len(st2.records) == 12


def test_a_log_of_json_lines_is_still_read(tmp_path: Path) -> None:
    """The earlier layout (one JSON delta per line; a torn last line dropped), as an agent
    upgraded in place finds it."""
    f = StateFile(tmp_path)
    f.save(AgentState(records=[rec("a")], seq=1))
    f.close()
    lines = [msgspec.json.encode(StateDelta(seq=2, records=[rec("b")])),
             msgspec.json.encode(StateDelta(seq=3, records=[rec("a", "running")]))]
    (tmp_path / "state.log").write_bytes(b"\n".join(lines) + b"\n" + lines[0][:10])
    st = StateFile(tmp_path).load()
    assert {r.workload_id: r.state for r in st.records} == {"a": "running", "b": "accepted"} and st.seq == 3


def test_a_whole_frame_that_does_not_decode_sets_both_files_aside(tmp_path: Path) -> None:
    """Its checksum holds, so it is no torn write: the files are not trusted."""
    f = StateFile(tmp_path)
    f.save(AgentState(records=[rec("a")]))
    f.close()
    (tmp_path / "state.log").write_bytes(frame(KIND_DELTA, b"{garbage") + bytes(64))
    assert StateFile(tmp_path).load() == AgentState()
    assert sorted(p.name.split(".bad-")[0] for p in tmp_path.glob("*.bad-*")) == ["state.json", "state.log"]


def test_a_corrupt_line_before_the_last_sets_both_files_aside(tmp_path: Path) -> None:
    f = StateFile(tmp_path)
    f.save(AgentState(records=[rec("a")]))
    f.close()
    (tmp_path / "state.log").write_bytes(b"{garbage\n" + msgspec.json.encode(StateDelta(seq=1)) + b"\n")
    assert StateFile(tmp_path).load() == AgentState()
    names = sorted(p.name.split(".bad-")[0] for p in tmp_path.glob("*.bad-*"))
    assert names == ["state.json", "state.log"]


def test_the_log_is_compacted_past_its_bound(tmp_path: Path) -> None:
    f = StateFile(tmp_path)
    f.save(AgentState(seq=0))
    big = WorkloadRecord(workload_id="a", job_id="j", env={"X": "y" * 4096})
    seq = 0
    while not f.wants_snapshot():
        seq += 1
        f.append([StateDelta(seq=seq, records=[big])])
        assert seq < 10_000
    assert f.log_bytes > (1 << 20)
    f.save(AgentState(records=[big], seq=seq))
    assert f.log_bytes == 0 and not f.wants_snapshot()
    assert (tmp_path / "state.log").read_bytes() == bytes(PREALLOC_BYTES)
    f.close()


CRASH = textwrap.dedent("""
    import os, sys, trio
    from agent.supervisor import Supervisor, SupervisorConfig
    from scheduler_link.messages import Placement, PodAssignment

    async def main(state, n):
        sup = Supervisor(state, node_id="n1", gpu_health=lambda: {}, config=SupervisorConfig(shim_pool=1),
                         base_env={"PATH": os.environ["PATH"]})
        async with trio.open_nursery() as nur:
            await nur.start(sup.run)
            for i in range(n):
                a = await sup.place(Placement(placement_id=f"p{i}", job_id="j", argv=["true"],
                                              pods=[PodAssignment(workload_id=f"w{i}", rank=0, gpus=[])]))
                assert a.accepted
                print(a.placement_id, flush=True)   # acked: from here it must survive a crash
            os.kill(os.getpid(), 9)                 # no cleanup, no flush: the agent dies here

    trio.run(main, sys.argv[1], int(sys.argv[2]))
""")


def test_every_acked_placement_survives_the_agent_killed_right_after(tmp_path: Path) -> None:
    """The supervisor in its own process, SIGKILLed by itself right after its fifth ack:
    what a restarted agent reads holds every acked placement and its workload."""
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CRASH, str(state), "5"], env=env, capture_output=True,
                       timeout=60, cwd=str(ROOT))
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    acked = p.stdout.decode().split()
    assert acked == [f"p{i}" for i in range(5)]
    st = read_state(state)
    assert st.seq > 0   # from the log: the snapshot is the start's, empty
    assert {a.placement_id for a in st.acks} >= set(acked)
    assert {r.workload_id for r in st.records} >= {f"w{i}" for i in range(5)}
