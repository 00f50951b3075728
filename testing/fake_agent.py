"""FakeAgent: an agent without processes, for placer tests and benches (CONVENTIONS.md,
"Fakes over mocks"). A small honest HTTP server on loopback that keeps a workload table,
checks a placement's GPUs against its inventory (refusing unknown, fatal or busy ones with
the structured outcome a real agent gives), and reports through the real AgentLink."""

from __future__ import annotations

import gc
import time
from typing import Any

import msgspec
import trio

from infra.auth import TokenSet
from infra.http import App, HTTPError, Request, Response, json_response, require_role, serve
from scheduler_link.agent_link import AgentLink
from scheduler_link.messages import (
    TERMINAL_STATES,
    GpuInfo,
    GpuSnapshot,
    NodeReport,
    Placement,
    PlacementAck,
    TopologyPath,
    Victim,
    WorkloadEvent,
    WorkloadState,
    WorkloadStatus,
)


class FakeAgent:
    """An agent without processes: a placement's pods go accepted -> running at once."""

    def __init__(self, node_id: str, tokens: TokenSet, *, n_gpus: int = 8, rack: str = "rack-a") -> None:
        self.node_id = node_id
        self.tokens = tokens
        self.uuids = [f"GPU-{node_id}-{i}" for i in range(n_gpus)]
        self.fatal: set[str] = set()
        self.topology = TopologyPath(zone="z1", block="b1", rack=rack)
        self.workloads: dict[str, WorkloadStatus] = {}
        self.placements: list[Placement] = []
        self.manifests: list[str] = []
        self.prefetches: list[dict[str, Any]] = []
        self.ack_delay = 0.0
        self.url = ""
        self.link: AgentLink | None = None
        self.cancel = trio.CancelScope()
        self.gc_enabled_at_arrival: list[bool] = []

    def gpu_snapshot(self) -> GpuSnapshot:
        return GpuSnapshot(backend="simulated:test", simulated=True, gpus=[
            GpuInfo(index=i, uuid=u, name="sim", memory_total_mib=1, pci_bus_id=f"0:{i}", simulated=True,
                    health="fatal" if u in self.fatal else "healthy") for i, u in enumerate(self.uuids)])

    def full_report(self) -> NodeReport:
        return NodeReport(node_id=self.node_id, boot_id="", seq=0, control_url=self.url, data_url=self.url,
                          topology=self.topology, snapshot=self.gpu_snapshot(),
                          workloads=list(self.workloads.values()), manifests=list(self.manifests))

    def _set(self, wid: str, state: WorkloadState, **kw: Any) -> None:
        w = msgspec.structs.replace(self.workloads[wid], state=state, **kw)
        self.workloads[wid] = w
        assert self.link is not None
        self.link.notify(WorkloadEvent(workload_id=wid, job_id=w.job_id, state=state, at=time.time(),
                                       exit_code=w.exit_code, gpus=w.gpus))

    async def stop_workloads(self, victims: list[Victim]) -> None:
        for v in victims:
            w = self.workloads.get(v.workload_id)
            if w is not None and w.state not in TERMINAL_STATES:
                self._set(v.workload_id, "preempted")

    def in_use(self) -> set[str]:
        return {g for w in self.workloads.values() if w.state not in TERMINAL_STATES for g in w.gpus}

    def exit(self, wid: str, code: int) -> None:
        self._set(wid, "exited", exit_code=code)

    def app(self) -> App:
        app = App()

        @app.route("POST", "/v1/placements", auth=require_role(self.tokens, "placer"))
        async def place(req: Request) -> Response:
            pl = req.decode(Placement)
            self.gc_enabled_at_arrival.append(gc.isenabled())  # (same process as the placer)
            if pl.pods and self.ack_delay:
                await trio.sleep(self.ack_delay)
            self.placements.append(pl)
            freed = {g for v in pl.victims for g in self.workloads.get(v.workload_id, WorkloadStatus(
                workload_id="", job_id="")).gpus}
            busy = self.in_use() - freed
            for pod in pl.pods:
                for g in pod.gpus:
                    if g not in self.uuids:
                        return json_response(PlacementAck(placement_id=pl.placement_id, node_id=self.node_id,
                                                          accepted=False, reason=f"unknown GPU {g}",
                                                          outcome="refused_spec"))
                    if g in self.fatal or g in busy:
                        why = "fatal" if g in self.fatal else "in use"
                        return json_response(PlacementAck(placement_id=pl.placement_id, node_id=self.node_id,
                                                          accepted=False, reason=f"GPU {g} is {why}",
                                                          outcome="refused_gpus", refused_gpus=[g]))
            await self.stop_workloads(list(pl.victims))
            for pod in pl.pods:
                if pod.workload_id in self.workloads:
                    continue
                self.workloads[pod.workload_id] = WorkloadStatus(
                    workload_id=pod.workload_id, job_id=pl.job_id, placement_id=pl.placement_id, rank=pod.rank,
                    world_size=pl.world_size, gpus=list(pod.gpus), state="accepted")
                self._set(pod.workload_id, "running")
            return json_response(PlacementAck(placement_id=pl.placement_id, node_id=self.node_id, accepted=True,
                                              workloads=[p.workload_id for p in pl.pods]))

        @app.route("POST", "/v1/prefetch", auth=require_role(self.tokens, "placer"))
        async def prefetch(req: Request) -> Response:
            body = msgspec.json.decode(req.body)
            if body["origin"] == "file:///missing":
                raise HTTPError(404, "no such origin")
            self.prefetches.append(body)
            return json_response({"ok": True})
        return app

    async def run(self, placer_url: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel:
            async with trio.open_nursery() as n:
                self.url = await n.start(serve, self.app(), "127.0.0.1:0")
                self.link = AgentLink(placer_url, self.tokens.cluster, self.node_id, self, heartbeat_s=0.1)
                await n.start(self.link.run)
                task_status.started()
