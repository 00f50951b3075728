"""Compact registration (placer.inventories): a node whose GPUs the placer took before names
their digest instead of sending its snapshot. The placer rebuilds it from what it stored only
when node, boot and digest match; anything else is a 409 and the snapshot. The book on disk
survives a restart, a torn tail and a foreign file; the agent's side sends a compact report
only for the inventory the placer took and only when nothing about health is to be said."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from placer import inventories
from placer.inventories import INVENTORY_FILE, Inventory, InventoryBook
from placer.state import PlacerState
from scheduler_link.agent_link import registration
from scheduler_link.messages import (
    GpuSnapshot,
    GpuTelemetry,
    HealthReason,
    HostHealth,
    NodeReport,
    WorkloadStatus,
    for_placer,
    gpu_inventory,
)
from tests.test_placer_indexes import full, new_state, snap


def _compact(node: str, *, seq: int = 2, digest: str | None = None, boot: str | None = None,
             workloads=()) -> NodeReport:
    rep = registration(full(node, seq=seq, workloads=workloads), gpu_inventory(snap(node))[1])
    assert rep.compact and rep.snapshot is None
    return msgspec.structs.replace(rep, inventory=digest or rep.inventory, boot_id=boot or rep.boot_id)


def _restarted_with(book: InventoryBook) -> PlacerState:
    st_ = new_state()
    st_.inventories = book
    return st_


# ------------------------------------------------------------------ the placer's side

def test_a_compact_registration_rebuilds_the_node_from_the_stored_inventory(tmp_path: Path) -> None:
    a = new_state()
    assert a.ingest("n1", full("n1"), 0.0)[0] == 200
    data, whole = a.inventories.take()
    inventories.write(tmp_path, data, whole)

    b = _restarted_with(InventoryBook.load(tmp_path))   # a new process on the same state dir
    pod = WorkloadStatus(workload_id="w1", job_id="", gpus=["n1-g0"], state="running")
    status, reply, _ = b.ingest("n1", _compact("n1", workloads=[pod]), 1.0)
    assert status == 200 and reply.ok, reply
    node = b.nodes["n1"]
    assert node.uuids == [f"n1-g{i}" for i in range(8)] and node.simulated
    assert node.workloads == {"w1": "running"} and node.control_url == "http://n1"
    assert b.model.spec("n1").n_gpus == 8
    assert b.counters["compact_registrations"] == 1 and b.counters["full_reports"] == 1
    assert b.uuid_owner["n1-g3"] == "n1"


@pytest.mark.parametrize("change", ["digest", "boot", "unknown_node"])
def test_a_compact_registration_the_placer_cannot_match_is_answered_409(change: str) -> None:
    st_ = new_state()
    st_.ingest("n1", full("n1"), 0.0)
    node = "n2" if change == "unknown_node" else "n1"
    rep = _compact(node, digest="0" * 32 if change == "digest" else None, boot="other" if change == "boot" else None)
    status, reply, _ = st_.ingest(node, rep, 1.0)
    assert (status, reply.ok, reply.need_full, reply.error) == (409, False, True, "unknown_inventory")
    assert st_.counters["inventory_misses"] == 1 and st_.counters["compact_registrations"] == 0
    if change == "unknown_node":
        assert "n2" not in st_.nodes   # nothing registered from a digest alone


def test_a_compact_registration_says_every_gpu_is_healthy() -> None:
    st_ = new_state()
    sick = msgspec.structs.replace(snap("n1"), gpus=[
        msgspec.structs.replace(g, health="fatal") if g.index == 2 else g for g in snap("n1").gpus])
    st_.ingest("n1", msgspec.structs.replace(full("n1"), snapshot=sick), 0.0)
    assert st_.nodes["n1"].fatal == {2} and st_.model._gpu_bad["n1"] == {2}
    status, _, _ = st_.ingest("n1", _compact("n1", seq=3), 1.0)
    assert status == 200
    assert st_.nodes["n1"].fatal == set() and st_.nodes["n1"].health_reasons == ()
    assert not st_.model._gpu_bad.get("n1")   # the model hears the GPU is back


def test_a_registration_whose_gpus_another_node_holds_is_refused_compact_or_not() -> None:
    st_ = new_state()
    st_.ingest("n1", full("n1"), 0.0)
    st_.inventories.note(Inventory(node_id="n2", boot_id="boot-n2", digest="f" * 32,
                                   uuids=[f"n1-g{i}" for i in range(8)]))   # (a book that lies about n2)
    status, reply, _ = st_.ingest("n2", _compact("n2", digest="f" * 32), 1.0)
    assert status == 400 and "already reported" in (reply.error or ""), reply


# ------------------------------------------------------------------ the book on disk

def _inv(i: int, boot: str = "b") -> Inventory:
    return Inventory(node_id=f"n{i}", boot_id=boot, digest=f"{i:032x}", uuids=[f"u{i}-{g}" for g in range(4)])


def test_the_book_appends_chunks_and_loads_the_latest_record_of_each_node(tmp_path: Path) -> None:
    book = InventoryBook()
    for i in range(10):
        book.note(_inv(i))
    book.note(_inv(3))                     # no news: nothing to write
    assert book.pending == 10
    inventories.write(tmp_path, *book.take())
    book.note(_inv(3, boot="b2"))          # a new boot of n3
    data, whole = book.take()
    assert not whole
    inventories.write(tmp_path, data, whole)
    again = InventoryBook.load(tmp_path)
    assert again.by_node == book.by_node and again.by_node["n3"].boot_id == "b2"
    assert again.file_records == 11


def test_a_torn_tail_is_dropped_and_the_file_rewritten_whole(tmp_path: Path) -> None:
    book = InventoryBook()
    for i in range(5):
        book.note(_inv(i))
    inventories.write(tmp_path, *book.take())
    p = tmp_path / INVENTORY_FILE
    p.write_bytes(p.read_bytes() + b"\x40\x00\x00\x00\x93partial")   # a placer killed mid-append
    again = InventoryBook.load(tmp_path)
    assert set(again.by_node) == {f"n{i}" for i in range(5)}
    again.note(_inv(7))
    data, whole = again.take()
    assert whole                                                     # the garbage goes with the rewrite
    inventories.write(tmp_path, data, whole)
    assert set(InventoryBook.load(tmp_path).by_node) == {f"n{i}" for i in (0, 1, 2, 3, 4, 7)}


@pytest.mark.parametrize("content", [b"", b"not ours at all", b"herd-inventories 1\n\xff\xff\xff\xff"])
def test_a_foreign_or_damaged_file_is_an_empty_book_never_a_failed_start(tmp_path: Path, content: bytes) -> None:
    (tmp_path / INVENTORY_FILE).write_bytes(content)
    book = InventoryBook.load(tmp_path)
    assert book.by_node == {}
    book.note(_inv(1))
    inventories.write(tmp_path, *book.take())
    assert set(InventoryBook.load(tmp_path).by_node) == {"n1"}


def test_boot_churn_rewrites_the_file_before_it_outgrows_the_fleet(tmp_path: Path) -> None:
    book = InventoryBook()
    for boot in range(6):
        for i in range(2000):
            book.note(_inv(i, boot=f"b{boot}"))
        inventories.write(tmp_path, *book.take())
        assert book.file_records <= 2 * len(book.by_node) + 4096 + 2000
    assert len(InventoryBook.load(tmp_path).by_node) == 2000
    assert (tmp_path / INVENTORY_FILE).stat().st_size < 3 * 2000 * 80


# ------------------------------------------------------------------ the agent's side

def _with(snapshot: GpuSnapshot) -> NodeReport:
    return msgspec.structs.replace(full("n1"), snapshot=snapshot)


def test_the_agent_sends_the_snapshot_unless_the_placer_took_that_very_inventory() -> None:
    digest = gpu_inventory(snap("n1"))[1]
    assert registration(full("n1"), "").snapshot is not None                 # nothing taken yet
    assert registration(full("n1"), "0" * 32).snapshot is not None           # another inventory taken
    rep = registration(full("n1"), digest)
    assert rep.compact and rep.inventory == digest
    fewer = msgspec.structs.replace(snap("n1"), gpus=snap("n1").gpus[:7])    # a GPU fell off the bus
    assert registration(_with(fewer), digest).snapshot is not None


@given(st.sampled_from(["gpu_fatal", "gpu_degraded", "gpu_reason", "host_fatal", "host_reason"]))
def test_anything_to_say_about_health_travels_whole(what: str) -> None:
    s = snap("n1")
    why = [HealthReason(code="xid:79", severity="application")]
    if what.startswith("gpu"):
        g = s.gpus[0]
        g = msgspec.structs.replace(g, health="fatal") if what == "gpu_fatal" else \
            msgspec.structs.replace(g, health="degraded") if what == "gpu_degraded" else \
            msgspec.structs.replace(g, reasons=why)
        s = msgspec.structs.replace(s, gpus=[g, *s.gpus[1:]])
    else:
        s = msgspec.structs.replace(s, host=HostHealth(state="fatal") if what == "host_fatal" else
                                    HostHealth(reasons=why))
    rep = registration(_with(s), gpu_inventory(s)[1])
    assert rep.snapshot is not None and not rep.compact


def test_what_a_registration_derives_from_a_snapshot_is_kept_on_that_snapshot_object() -> None:
    """An agent reporting the same snapshot object again derives nothing again: the view the
    placer reads, the inventory digest and the health verdict are kept on the object (off
    the wire); a new snapshot object (a new reading) is derived afresh."""
    telemetry = GpuTelemetry(power_w=300.0)
    s = msgspec.structs.replace(snap("n1"), gpus=[msgspec.structs.replace(g, telemetry=telemetry)
                                                  for g in snap("n1").gpus])
    wire = msgspec.msgpack.encode(s)
    base = _with(s)
    first, again = registration(base, ""), registration(base, "")
    assert first.snapshot is not None and first.snapshot is again.snapshot   # the same view object
    assert for_placer(first.snapshot) is first.snapshot                        # ... which is its own view
    assert msgspec.msgpack.encode(s) == wire                                   # nothing kept went on the wire
    uuids, digest = gpu_inventory(s)
    uuids.append("mine")                                                       # the caller's own list
    assert gpu_inventory(s) == ([f"n1-g{i}" for i in range(8)], digest) == gpu_inventory(snap("n1"))
    assert registration(base, digest).compact
    sick = msgspec.structs.replace(s, host=HostHealth(state="fatal"))          # a new reading: derived afresh
    assert not registration(_with(sick), digest).compact
    fewer = msgspec.structs.replace(s, gpus=s.gpus[:7])
    assert gpu_inventory(fewer)[1] != digest
