"""A relay's RackBeat at the placer (placer.reports.Reports.beat): every entry for another node
needs that node's MAC; the entries are checked in one comparison over the joined MACs and entry
by entry only when that fails, with the same outcome either way: an entry that does not verify
is dropped and counted, never applied; the relay's own entry needs none."""

from __future__ import annotations

import os

import pytest

import placer.reports
from placer.config import PlacerConfig
from placer.state import PlacerState
from scheduler_link.messages import GpuInfo, GpuSnapshot, NodeReport, RackBeat, TopologyPath
from scheduler_link.msgauth import beat_mac, beat_macs, node_key

RELAY = "n0"


def _state(n: int) -> PlacerState:
    st = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0), started_at=0.0)
    st.recover_until = 0.0
    st.set_mac_master(os.urandom(32))
    for i in range(n):
        nid = f"n{i}"
        snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=0, uuid=f"{nid}-g0", name="sim", memory_total_mib=1,
                                                         pci_bus_id="0", simulated=True)])
        st.ingest(nid, NodeReport(node_id=nid, boot_id="b1", seq=1, full=True, control_url=f"http://{nid}",
                                  data_url=f"http://{nid}:1", topology=TopologyPath(zone="z", block="b", rack="r"),
                                  snapshot=snap), 0.0)
    return st


def _beat(st: PlacerState, ids: list[str], seq: int, macs: dict[str, bytes] | None = None) -> RackBeat:
    macs = macs or {}
    return RackBeat(rack="z/b/r", node_ids=ids, boot_ids=["b1"] * len(ids), seqs=[seq] * len(ids),
                    macs=[macs.get(n, beat_mac(node_key(st.mac_master, n, "b1"), n, "b1", seq)) for n in ids])


def test_beat_macs_are_each_entrys_beat_mac_joined() -> None:
    keys = [os.urandom(32) for _ in range(3)]
    ids, boots, seqs = ["a", "bb", "c"], ["x", "y", "z"], [1, 22, 333]
    assert beat_macs(keys, ids, boots, seqs) == b"".join(beat_mac(k, n, b, s) for k, n, b, s in
                                                         zip(keys, ids, boots, seqs, strict=True))
    assert beat_macs([], [], [], []) == b""


def test_a_beat_whose_macs_all_verify_is_applied_in_one_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """No entry's MAC is made on its own (beat_mac) when the joined MACs verify; the relay's
    own entry carries no MAC at all."""
    st = _state(64)
    ids = [f"n{i}" for i in range(64)]
    b = _beat(st, ids, 5, {RELAY: b""})

    def one_by_one(*a: object) -> bytes:
        raise AssertionError("an entry checked on its own")
    monkeypatch.setattr(placer.reports, "beat_mac", one_by_one)
    reply, _ = st.beat(b, 1.0, via=RELAY)
    assert not reply.need_full and st.counters.get("bad_macs", 0) == 0
    assert all(st.nodes[n].last_seq == 5 and st.nodes[n].last_seen == 1.0 for n in ids)


@pytest.mark.parametrize("bad", [b"x" * 16, b"short", b""])
def test_an_entry_that_does_not_verify_is_dropped_and_the_others_applied(bad: bytes) -> None:
    st = _state(8)
    ids = [f"n{i}" for i in range(8)]
    reply, _ = st.beat(_beat(st, ids, 5, {"n3": bad, RELAY: b"whatever"}), 1.0, via=RELAY)
    assert st.counters["bad_macs"] == 1 and not reply.need_full
    assert st.nodes["n3"].last_seq == 1 and st.nodes["n3"].last_seen == 0.0
    assert all(st.nodes[n].last_seq == 5 for n in ids if n != "n3")


def test_a_mac_of_another_seq_or_node_does_not_verify() -> None:
    """A replayed entry (its MAC for an older seq) or one MACed with another node's key."""
    st = _state(4)
    k1, k2 = node_key(st.mac_master, "n1", "b1"), node_key(st.mac_master, "n2", "b1")
    b = _beat(st, ["n1", "n2", "n3"], 7, {"n1": beat_mac(k1, "n1", "b1", 6), "n2": beat_mac(k1, "n2", "b1", 7)})
    st.beat(b, 1.0, via=RELAY)
    assert st.counters["bad_macs"] == 2 and st.nodes["n3"].last_seq == 7
    assert st.nodes["n1"].last_seq == st.nodes["n2"].last_seq == 1
    assert beat_mac(k2, "n2", "b1", 7) != b.macs[1]


def test_an_unknown_node_with_its_mac_is_asked_for_a_full_report_and_direct_beats_need_no_mac() -> None:
    st = _state(2)
    reply, _ = st.beat(_beat(st, ["n1", "stranger"], 3), 1.0, via=RELAY)
    assert reply.need_full == ["stranger"] and st.counters.get("bad_macs", 0) == 0 and st.nodes["n1"].last_seq == 3
    reply, _ = st.beat(_beat(st, ["n1"], 4, {"n1": b""}), 2.0)   # (no relay: the node's own connection)
    assert not reply.need_full and st.nodes["n1"].last_seq == 4
