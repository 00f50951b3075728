"""A delivery's bundles leave as they are built once the journal is durable (issue 12): at
131,072 nodes the build of 782 bundles took ~0.2 s of the critical path while every relay
waited for the last one. In process (the placer service's own relay hub; fake frames
connections that log when a bundle is encoded and when it is sent, and answer every part
accepted): with the journal durable at once, the first bundles are sent before the last is
built; with a journal that is slow, nothing leaves before it says yes; with one that fails,
nothing leaves at all. Every node is acked once either way."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from placer.attempts import Outcome
from placer.config import PlacerConfig
from placer.records import Push
from placer.service import PlacerService
from scheduler_link.auth import TokenSet
from scheduler_link.frames import decode_payload, encode_frame
from scheduler_link.heartbeat_wire import Hello
from scheduler_link.messages import (
    AckBundle,
    Frame,
    GpuInfo,
    GpuSnapshot,
    NodeOutcome,
    NodeReport,
    Placement,
    RackBundle,
    TopologyPath,
)

RACKS = 160  # one node a rack, each its rack's relay: five slices of 32 bundles


class LoggingChannel:
    """A relay's frames connection as RelayHub uses it: ``prepare`` (a bundle encoded) and
    ``call_prepared`` (sent, answered at once with every part accepted), both logged."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.info: Any = None
        self.closed = trio.Event()
        self.log = log
        self._next = 0
        self.sent: dict[int, bytes] = {}

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        self._next += 1
        self.log.append(("built", self.name))
        return self._next, encode_frame(type_, payload, id=self._next)

    async def call_prepared(self, rid: int, data: bytes) -> Frame:
        self.log.append(("sent", self.name))
        rb = decode_payload(msgspec.msgpack.decode(data[4:], type=Frame), RackBundle)
        acks = AckBundle(rack=rb.rack, blob_id=rb.blob_id, outcomes=[
            NodeOutcome(node_id=p.node_id, placement_id=p.placement_id, outcome="accepted") for p in rb.parts])
        await trio.lowlevel.checkpoint()
        return msgspec.msgpack.decode(encode_frame("acks", acks, id=rid)[4:], type=Frame)


def _full(node: str, rack: str) -> NodeReport:
    snap = GpuSnapshot(hostname=node, backend="simulated:test", simulated=True,
                       gpus=[GpuInfo(index=0, uuid=f"GPU-{node}", name="sim", memory_total_mib=80000,
                                     pci_bus_id="0000:01:00.0", simulated=True)])
    return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=1, full=True, control_url=f"http://127.0.0.1:9/{node}",
                      data_url="http://127.0.0.1:9", topology=TopologyPath(zone="z1", block="b1", rack=rack),
                      snapshot=snap, sent_at=time.time())


def _fleet(tmp_path: Any) -> tuple[PlacerService, list[Push], list[tuple[str, str]]]:
    svc = PlacerService(PlacerConfig(state_dir=str(tmp_path), relays=True), TokenSet())
    log: list[tuple[str, str]] = []
    pushes = []
    for k in range(RACKS):
        node, rack = f"n{k:03d}", f"r{k:03d}"
        st, _ = svc._ingest(node, _full(node, rack))
        assert st == 200
        ch = LoggingChannel(node, log)
        svc.relays.opened(Hello(token="", node_id=node, frames=True, racks=[f"z1/b1/{rack}"]), ch)  # type: ignore[arg-type]
        pl = Placement(placement_id=f"start:j:1:{node}", job_id="j", issued_at=1.0)
        pushes.append(Push(node, f"http://127.0.0.1:9/{node}", pl, "j", 1, "start"))
    return svc, pushes, log


async def _direct(p: Push) -> Outcome:
    raise AssertionError(f"pushed directly: {p}")


async def test_bundles_leave_as_they_are_built_once_durable(tmp_path: Any) -> None:
    svc, pushes, log = _fleet(tmp_path)

    async def durable() -> bool:
        return True
    with trio.fail_after(10):
        acks = await svc.relays.deliver("j", None, pushes, _direct, ready=durable)
    assert acks is not None and sorted(acks) == sorted(p.node_id for p in pushes)
    assert all(o.outcome == "accepted" for o in acks.values())
    first_sent = next(i for i, (what, _) in enumerate(log) if what == "sent")
    last_built = max(i for i, (what, _) in enumerate(log) if what == "built")
    assert first_sent < last_built, log[:40]
    assert sorted(n for what, n in log if what == "sent") == sorted(p.node_id for p in pushes)
    d = svc.relays.stats.last_delivery
    assert 0 < d["first_bundle_sent_s"] <= d["last_bundle_sent_s"]


@pytest.mark.parametrize("says", [True, False])
async def test_nothing_leaves_before_the_journal_says_yes(tmp_path: Any, says: bool) -> None:
    svc, pushes, log = _fleet(tmp_path)
    gate = trio.Event()

    async def durable() -> bool:
        await gate.wait()
        return says
    out: list[Any] = []

    async def run() -> None:
        out.append(await svc.relays.deliver("j", None, pushes, _direct, ready=durable))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
            assert [w for w, _ in log].count("built") == RACKS and "sent" not in [w for w, _ in log]
            gate.set()
    if says:
        assert out[0] is not None and len(out[0]) == RACKS
        assert [w for w, _ in log].count("sent") == RACKS
    else:
        assert out == [None] and "sent" not in [w for w, _ in log]
