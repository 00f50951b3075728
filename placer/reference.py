"""A naive reference placer: plain Python lists and loops, no numpy on the decision path.

It exists to check the fast placer (tests: both must agree on whether a job can be
placed, with and without preemption) and as the baseline of ``bench/placer.py``. It keeps
its own state as lists of dicts; :meth:`ReferenceCluster.from_model` snapshots a
:class:`~placer.model.ClusterModel`, and :meth:`apply` / :meth:`release` keep it in step.

Placement: for each domain at the ``within`` level in topology order, first fit: count
pods per node, and if the domain holds enough, take nodes in order. With preemption,
slots of strictly lower-priority preemptible jobs count as free for the feasibility test
and victims are taken lowest priority first until the gang fits (not cost-optimal: this
is a feasibility oracle and a speed baseline, not a second scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .model import LEVELS, ClusterModel, level_index
from .place import JobRequest


@dataclass(slots=True)
class RefNode:
    node_id: str
    path: tuple[str, str, str, str, str]     # zone, block, rack, nvlink key, node
    n_gpus: int
    usable: list[bool]
    owner: list[str | None]


class ReferenceCluster:
    def __init__(self) -> None:
        self.nodes: list[RefNode] = []
        self.jobs: dict[str, tuple[int, bool]] = {}       # job -> (priority, preemptible)

    @classmethod
    def from_model(cls, model: ClusterModel) -> ReferenceCluster:
        rc = cls()
        owner = model.owner.tolist()
        usable = model.usable.tolist()
        for i, nid in enumerate(model.node_ids):
            sp = model.spec(nid)
            nvl = f"{sp.zone}/{sp.block}/{sp.rack}/{sp.nvlink_domain}" if sp.nvlink_domain is not None else \
                f"node:{nid}"
            n = sp.n_gpus
            rc.nodes.append(RefNode(nid, (sp.zone, f"{sp.zone}/{sp.block}", f"{sp.zone}/{sp.block}/{sp.rack}",
                                          nvl, nid), n, usable[i][:n],
                                    [model.job_id_of(o) if o >= 0 else None for o in owner[i][:n]]))
        for jid, rec in model.jobs.items():
            rc.jobs[jid] = (rec.priority, rec.preemptible)
        return rc

    def apply(self, job_id: str, priority: int, preemptible: bool, victims: list[str],
              gpus: list[tuple[str, tuple[int, ...]]]) -> None:
        for v in victims:
            self.release(v)
        by_id = {n.node_id: n for n in self.nodes}
        for nid, slots in gpus:
            node = by_id[nid]
            for s in slots:
                assert node.owner[s] is None
                node.owner[s] = job_id
        self.jobs[job_id] = (priority, preemptible)

    def release(self, job_id: str) -> None:
        for n in self.nodes:
            for s in range(n.n_gpus):
                if n.owner[s] == job_id:
                    n.owner[s] = None
        self.jobs.pop(job_id, None)

    def _domains(self, li: int) -> list[list[RefNode]]:
        if li < 0:
            return [self.nodes]
        out: list[list[RefNode]] = []
        prev: Any = None
        for n in self.nodes:
            k = n.path[li]
            if k != prev:
                out.append([])
                prev = k
            out[-1].append(n)
        return out

    def _pods_on(self, n: RefNode, job: JobRequest, free_ok: Any) -> int:
        free = 0
        for s in range(n.n_gpus):
            if n.usable[s] and free_ok(n.owner[s]):
                free += 1
        if job.whole_nodes:
            whole = n.n_gpus > 0 and free == n.n_gpus and n.n_gpus >= max(job.gpus_per_pod, 1)
            return 1 if whole else 0
        return free // job.gpus_per_pod

    def place(self, job: JobRequest, allow_preemption: bool = False) -> tuple[list[tuple[str, int]], list[str]] | None:
        """First-fit: ([(node_id, pods)], victims) or None."""
        li = level_index(job.within)
        free_only = lambda o: o is None  # noqa: E731
        for dom in self._domains(li):
            got: list[tuple[str, int]] = []
            need = job.pods
            for n in dom:
                k = self._pods_on(n, job, free_only)
                if k:
                    got.append((n.node_id, min(k, need)))
                    need -= min(k, need)
                    if need == 0:
                        return got, []
        if not allow_preemption:
            return None

        def eligible(o: str | None) -> bool:
            if o is None:
                return True
            prio, pre = self.jobs[o]
            return pre and prio < job.priority

        for dom in self._domains(li):
            total = sum(self._pods_on(n, job, eligible) for n in dom)
            if total < job.pods:
                continue
            # victims lowest priority first until the gang fits
            cands = sorted({o for n in dom for o in n.owner if o is not None and eligible(o)},
                           key=lambda j: (self.jobs[j][0], j))
            chosen: set[str] = set()
            for v in cands:
                chosen.add(v)

                def ok(o: str | None, chosen: set[str] = chosen) -> bool:
                    return o is None or o in chosen
                if sum(self._pods_on(n, job, ok) for n in dom) >= job.pods:
                    break
            placed: list[tuple[str, int]] = []
            need = job.pods
            for n in dom:
                k = self._pods_on(n, job, lambda o, c=chosen: o is None or o in c)
                if k and need:
                    placed.append((n.node_id, min(k, need)))
                    need -= min(k, need)
            return placed, sorted(chosen)
        return None


__all__ = ["LEVELS", "ReferenceCluster"]
