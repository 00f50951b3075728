"""herd placer: the numpy cluster model, gang placement, preemption, the job queue,
fragmentation and defragmentation (pure code), plus the placer service (helper F's).

Public API of the core (pure: numpy arrays in, decisions out; no sockets, clocks, trio):

- :class:`NodeSpec` ``(node_id, zone, block, rack, n_gpus, nvlink_domain=None)``
- :class:`ClusterModel` — ``build(nodes)``, ``upsert_node``/``upsert_nodes``/``remove_node``
  (deferred rebuild), ``set_node_state``, ``set_gpu_health`` (incremental), ``node_index``,
  ``node_ids``, ``gpus_per_node``, ``free_gpus``, ``domain_of``, ``allocate(decision)``,
  ``release(job_id)``, ``assign(job_id, node_id, slots, priority, preemptible)``,
  ``jobs`` (id -> :class:`JobRecord` with ``priority``, ``preemptible``, ``gpus_by_node``),
  ``copy()``, ``statistics()``, ``check_invariants()``.
- :class:`JobRequest` ``(job_id, pods, gpus_per_pod, within="any", priority=0,
  preemptible=True, prefer=None, whole_nodes=False)``
- :func:`place` ``(model, job, *, allow_preemption=True, exclude=None) -> Decision | None``
- :class:`Decision` (``job_id, pods: list[PodPlacement], victims, domain, level``, plus
  array forms ``pod_nodes``/``pod_slots``), :class:`PodPlacement` ``(rank, node_id, slots)``
- :data:`LEVELS` (coarse to fine), :data:`WITHIN`
- errors: :class:`PlacerError` and subclasses ``InvalidSpec``, ``UnknownNode``,
  ``UnknownJob``, ``Conflict``.
"""

from .errors import Conflict, InvalidSpec, PlacerError, UnknownJob, UnknownNode
from .model import LEVELS, WITHIN, ClusterModel, JobRecord, NodeSpec
from .place import Decision, JobRequest, PodPlacement, place

__all__ = [
    "LEVELS", "WITHIN", "ClusterModel", "Conflict", "Decision", "InvalidSpec", "JobRecord",
    "JobRequest", "NodeSpec", "PlacerError", "PodPlacement", "UnknownJob", "UnknownNode", "place",
]
