"""The node an AgentLink is built for in the link tests (what scheduler_link.agent_link asks of its
host): a full report naming the node, an empty GPU snapshot, and the workloads it was told to stop."""

from __future__ import annotations

from scheduler_link.messages import GpuSnapshot, NodeReport, Victim


class Hooks:
    def __init__(self, node_id: str = "n1") -> None:
        self.node_id = node_id
        self.stopped: list[str] = []

    def full_report(self) -> NodeReport:
        return NodeReport(node_id=self.node_id, boot_id="", seq=0, full=True)

    def gpu_snapshot(self) -> GpuSnapshot:
        return GpuSnapshot()

    async def stop_workloads(self, victims: list[Victim]) -> None:
        self.stopped += [v.workload_id for v in victims]
