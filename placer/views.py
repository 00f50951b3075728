"""Views: what operators read, bounded whatever the fleet or the gang.

A job view carries the job, its timings, its pods' counts by state, and one page of pods
(``offset``/``limit``, at most ``MAX_PAGE``); a node listing is paged the same way. Each
view costs O(page) plus O(1) counters, never a walk of a 25,000-pod gang or a 131,072-node
fleet per request.

Job env values are never returned (issue 17 §2): every view shows the names of a job's
``env`` with each value replaced by :data:`REDACTED`, for every role (operators too; the
values live in the journal and in placements only). Secrets that must not sit in the job at
all go in ``env_from_files`` (host paths the agent reads at start).
"""

from __future__ import annotations

import msgspec

from scheduler_link.messages import JobSpec, JobView, NodeView, PodView

from .errors import BadRequest
from .records import JobRec, NodeRec, PodRec
from .statebase import MODEL_ERRORS, StateBase

DEFAULT_PODS = 100
MAX_PAGE = 5000
REDACTED = "<redacted>"


def redacted(spec: JobSpec) -> JobSpec:
    """``spec`` as read APIs show it: env names, no values."""
    if not spec.env:
        return spec
    return msgspec.structs.replace(spec, env=dict.fromkeys(spec.env, REDACTED))


def parse_page(text: str | None, default: int) -> tuple[int, int]:
    """``"offset:limit"`` (either part may be empty) -> (offset, limit), clamped."""
    if not text:
        return 0, default
    off_s, _, lim_s = text.partition(":")
    try:
        off = int(off_s) if off_s else 0
        lim = int(lim_s) if lim_s else default
    except ValueError:
        raise BadRequest("a page is OFFSET:LIMIT, two integers") from None
    if off < 0 or lim < 0:
        raise BadRequest("offset and limit must be >= 0")
    return off, min(lim, MAX_PAGE)


def pod_view(p: PodRec) -> PodView:
    return PodView(rank=p.rank, node_id=p.node_id, workload_id=p.workload_id, gpus=list(p.uuids),
                   gpu_indices=list(p.slots), state=p.state, exit_code=p.exit_code, reason=p.reason,
                   timings=dict(p.timings or {}), fetch=dict(p.fetch or {}))


class Views(StateBase):
    def job_view(self, job: JobRec, *, offset: int = 0, limit: int = DEFAULT_PODS) -> JobView:
        # (from the pod table's columns: views are made for the page only, never for the gang)
        t = job.table
        page = t.page(offset, limit) if limit else []
        return JobView(job_id=job.job_id, spec=redacted(job.spec), state=job.state, attempt=job.attempt,
                       restarts=job.restarts, reason=job.reason, timings=dict(job.timings),
                       pods=[pod_view(p) for p in page], pod_counts=job.pod_counts(), pods_total=len(t),
                       pods_offset=offset, nodes_total=t.n_nodes(), gpus_total=t.n_gpus())

    def node_view(self, n: NodeRec) -> NodeView:
        unhealthy = sorted(n.fatal | n.refused)
        try:
            free = len(self.model.free_gpus(n.node_id)) if n.state == "up" else 0
        except MODEL_ERRORS:
            free = 0
        live = sum(1 for _, p in n.pods.values() if not p.terminal) + len(n.stale)
        return NodeView(node_id=n.node_id, state=n.state, control_url=n.control_url, data_url=n.data_url,
                        topology=n.topology, nvlink_domain=n.nvlink_domain, gpus=len(n.uuids),
                        free_gpus=free, unhealthy_gpus=unhealthy, workloads=live, simulated=n.simulated,
                        last_seen=n.last_seen, cordoned=n.cordoned, draining=n.draining and live > 0)

    def node_page(self, offset: int, limit: int, *, state: str | None = None) -> tuple[int, list[NodeView]]:
        """(total, one page of nodes in id order). Sorting the ids is O(N log N) but cheap
        next to building views; only the page's views are built."""
        ids = sorted(self.nodes) if state is None else sorted(k for k, n in self.nodes.items() if n.state == state)
        return len(ids), [self.node_view(self.nodes[k]) for k in ids[offset:offset + limit]]

    def job_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for j in self.jobs.values():
            counts[j.state] = counts.get(j.state, 0) + 1
        return counts
