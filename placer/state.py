"""The placer service's bookkeeping: nodes, jobs, pods, and what to push next.

Theory of operation
-------------------
``PlacerState`` is the one owner of the service's mutable state. It is plain,
synchronous code (no sockets, no trio, ``now`` passed in): every method applies one
input — an agent report, a submission, a cancel, the outcomes of a push, a clock tick —
and returns the pushes the service must carry out (:class:`Push`: a Placement for
one node). The trio service calls these methods between awaits, so no two inputs
ever interleave, and performs the returned pushes outside.

It is split by concept, one mixin a module over :class:`placer.statebase.StateBase`
(the shared data and indexes):

- :mod:`placer.reports` — reports (heartbeats, full reports, events) and recovery;
- :mod:`placer.attempts` — ending attempts, placement outcomes, lost nodes and fencing;
- :mod:`placer.scheduling` — submissions, the scheduling pass, compact placements;
- :mod:`placer.views` — bounded views for operators.

Soft state. Allocations live only in the numpy model and are rebuilt from the agents'
full reports: a report lists every workload a node runs; its ``workload_id`` names
``<job>.<attempt>.<rank>``. After a restart, jobs come back from the journal (spec only)
as *recovering* (see :mod:`placer.reports`). Nothing is placed twice.

Costs (DESIGN.md, Fleet scale): an event or heartbeat is O(1); a full report is
O(that node); a tick is O(nodes that came due); a pass rebuilds the model at most once.

Invariants:
- A GPU slot is held in the model by at most one job (the core guarantees it; we only
  ever ``assign`` slots a report shows in use, or ``allocate`` a core decision).
- A job's pods all belong to one attempt; a pod of an older attempt is *stale* and is
  only ever stopped (victims are never resurrected).
- ``pods`` (and each node's ``pods``) index exactly the current attempts' pods;
  ``JobRec.counts`` counts them by state.
- Slots held by stale workloads stay taken (pseudo-job ``stale:<workload>``) until the
  agent reports them terminal.
"""

from __future__ import annotations

from .attempts import ACCEPTED, Attempts, Outcome
from .nodeops import DrainOutcome, NodeOps
from .records import (
    JOB_ID_RE,
    STALE_PRIORITY,
    TERMINAL_JOB_STATES,
    JobError,
    JobRec,
    NodeRec,
    PodRec,
    Push,
    parse_workload_id,
    workload_id,
)
from .reports import Reports
from .scheduling import Scheduling
from .views import Views

__all__ = [
    "ACCEPTED", "DrainOutcome", "JOB_ID_RE", "STALE_PRIORITY", "TERMINAL_JOB_STATES", "JobError", "JobRec", "NodeRec", "Outcome",
    "PlacerState", "PodRec", "Push", "parse_workload_id", "workload_id",
]


class PlacerState(NodeOps, Reports, Attempts, Scheduling, Views):
    """See the module docstring."""
