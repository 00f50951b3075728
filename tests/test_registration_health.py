"""A full report's registration (placer.reports): what it says about health and manifests is
what the placer holds, whether the snapshot says "all healthy" (taken as a compact
registration is) or names fatal and degraded GPUs; ``now`` passed in, no I/O."""

from __future__ import annotations

import msgspec

from placer.config import PlacerConfig
from placer.state import PlacerState
from scheduler_link.messages import GpuInfo, GpuSnapshot, HealthReason, HostHealth, NodeReport, TopologyPath


def _snap(node: str, *, fatal: tuple[int, ...] = (), degraded: tuple[int, ...] = (), host: str = "healthy") -> GpuSnapshot:
    def health(i: int) -> str:
        return "fatal" if i in fatal else "degraded" if i in degraded else "healthy"
    return GpuSnapshot(simulated=True, host=HostHealth(state=host),  # type: ignore[arg-type]
                       gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1, pci_bus_id=str(i),
                                     simulated=True, health=health(i),  # type: ignore[arg-type]
                                     reasons=[HealthReason(code="xid:79", severity="fatal")] if i in fatal else [])
                             for i in range(8)])


def _full(node: str, seq: int, snap: GpuSnapshot, manifests: list[str] | None = None) -> NodeReport:
    return NodeReport(node_id=node, boot_id="b1", seq=seq, control_url=f"http://{node}",
                      topology=TopologyPath(zone="z", block="b", rack="r"), snapshot=snap, manifests=manifests)


def test_a_registration_holds_what_its_snapshot_says_and_the_next_one_replaces_it() -> None:
    st = PlacerState(PlacerConfig(heartbeat_s=1.0), started_at=0.0)
    assert st.ingest("n1", _full("n1", 1, _snap("n1", fatal=(2,), degraded=(5,))), 1.0)[0] == 200
    st.ingest("n2", _full("n2", 1, _snap("n2")), 1.0)
    st.schedule(1.0)
    n1, n2 = st.nodes["n1"], st.nodes["n2"]
    assert (n1.fatal, n1.degraded, n1.health_reasons) == ({2}, frozenset({5}), ("gpu2:xid:79",))
    assert "n1" in st.degraded_nodes and "n2" not in st.degraded_nodes
    assert (n2.fatal, n2.degraded, n2.health_reasons, n2.host_fatal) == (set(), frozenset(), (), False)
    assert st.model.free_gpus("n1") == [0, 1, 3, 4, 5, 6, 7] and st.model.free_gpus("n2") == list(range(8))
    # n1 again, all healthy now; n2 again, its host fatal
    st.ingest("n1", _full("n1", 2, _snap("n1")), 2.0)
    st.ingest("n2", _full("n2", 2, _snap("n2", host="fatal")), 2.0)
    st.schedule(2.0)
    assert (st.nodes["n1"].fatal, st.nodes["n1"].degraded) == (set(), frozenset()) and "n1" not in st.degraded_nodes
    assert st.model.free_gpus("n1") == list(range(8)) and st.nodes["n2"].host_fatal and st.model.free_gpus("n2") == []


def test_a_registrations_manifests_are_held_and_the_next_ones_replace_them() -> None:
    st = PlacerState(PlacerConfig(heartbeat_s=1.0), started_at=0.0)
    a, b = "a" * 64, "b" * 64
    st.ingest("n1", _full("n1", 1, _snap("n1"), [a, b]), 1.0)
    assert st.manifest_holders == {a: {"n1"}, b: {"n1"}} and st.nodes["n1"].manifests == {a, b}
    st.ingest("n1", _full("n1", 2, _snap("n1"), [b]), 2.0)
    assert st.manifest_holders == {b: {"n1"}}
    st.ingest("n1", _full("n1", 3, _snap("n1"), None), 3.0)
    assert st.manifest_holders == {} and st.nodes["n1"].manifests == set()


def test_a_gpu_another_node_reported_is_refused_and_its_own_are_taken_again() -> None:
    st = PlacerState(PlacerConfig(heartbeat_s=1.0), started_at=0.0)
    st.ingest("n1", _full("n1", 1, _snap("n1")), 1.0)
    theirs = msgspec.structs.replace(_snap("n2"), gpus=[*_snap("n2").gpus[:7], _snap("n1").gpus[7]])
    status, reply, _ = st.ingest("n2", _full("n2", 1, theirs), 1.0)
    assert status == 400 and reply.error == "GPU n1-g7 is already reported by node n1" and "n2" not in st.nodes
    assert st.ingest("n1", _full("n1", 2, _snap("n1")), 2.0)[0] == 200
    assert st.uuid_owner["n1-g7"] == "n1"
