"""herd placer: the numpy cluster model, gang placement, preemption, the job queue,
fragmentation and defragmentation (pure code), plus the placer service.

Public API of the core (pure: numpy arrays in, decisions out; no sockets, clocks, trio):

- :class:`NodeSpec` ``(node_id, zone, block, rack, n_gpus, nvlink_domain=None)``
- :class:`ClusterModel` — ``build(nodes)``, ``upsert_node``/``upsert_nodes``/``remove_node``
  (deferred rebuild), ``set_node_state``, ``set_gpu_health`` (incremental), ``node_index``,
  ``node_ids``, ``gpus_per_node``, ``free_gpus``, ``domain_of``, ``allocate(decision)``,
  ``release(job_id)``, ``assign(job_id, node_id, slots, priority, preemptible)``,
  ``jobs`` (id -> :class:`Allocation` with ``priority``, ``preemptible``, ``gpus_by_node``),
  ``copy()``, ``statistics()``, ``check_invariants()``.
- :class:`JobRequest` ``(job_id, pods, gpus_per_pod, within="any", priority=0,
  preemptible=True, prefer=None, whole_nodes=False)``
- :func:`place` ``(model, job, *, allow_preemption=True, exclude=None) -> Decision | None``;
  :func:`fits_when_empty` ``(model, job) -> bool`` (False: the job can never be placed here)
- :class:`Decision` (``job_id, pods: list[PodPlacement], victims, domain, level``, plus
  array forms ``pod_nodes``/``pod_slots``), :class:`PodPlacement` ``(rank, node_id, slots)``
- :data:`LEVELS` (coarse to fine), :data:`WITHIN`
- :class:`JobQueue` (``placer.queue``) — ``submit(job, now)``, ``cancel(job_id)``,
  ``schedule(model, now) -> list[Decision]`` (applies what it decides to the model),
  ``pending()``, ``statistics()``; strict priority, FIFO, backfill, reservations.
- ``placer.frag`` — :func:`fragmentation` ``(model, shapes=DEFAULT_SHAPES) -> dict[level, score]``,
  :func:`largest_placeable` ``(model) -> dict[level, gpus]``, :func:`plan_defrag`
  ``(model, max_moves) -> list[Move(job_id, from_nodes, to_decision)]`` (apply a move as
  ``release(job_id)`` then ``allocate(to_decision)``, in order). ``ClusterModel.set_job_shape``
  tells the planner a job's gang shape when its allocation came from reports.
- ``placer.reference`` — :class:`ReferenceCluster`, the naive placer (tests, baseline).
- ``placer.sim`` — fleets (``build_fleet("h100"|"gb200", gpus)``), ``job_stream``, ``fill``,
  ``saturate``, ``replay``; ``python -m placer.sim --help``.
- errors: :class:`PlacerError` and subclasses ``InvalidSpec``, ``UnknownNode``,
  ``UnknownJob``, ``Conflict``.

Note: ``placer.place`` the module is shadowed on the package by ``place`` the function;
import the module with ``importlib.import_module("placer.place")`` or ``from placer.place import ...``.
"""

from .errors import Conflict, InvalidSpec, PlacerError, UnknownJob, UnknownNode
from .frag import DEFAULT_SHAPES, Move, Shape, fragmentation, largest_placeable, plan_defrag
from .model import LEVELS, WITHIN, Allocation, ClusterModel, NodeSpec
from .place import Decision, JobRequest, PodPlacement, fits_when_empty, place
from .queue import JobQueue

__all__ = [
    "DEFAULT_SHAPES", "LEVELS", "WITHIN", "ClusterModel", "Conflict", "Decision", "InvalidSpec",
    "JobQueue", "Allocation", "JobRequest", "Move", "NodeSpec", "PlacerError", "PodPlacement", "Shape",
    "UnknownJob", "UnknownNode", "fits_when_empty", "fragmentation", "largest_placeable", "place",
    "plan_defrag",
]
