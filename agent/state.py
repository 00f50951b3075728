"""The agent's persisted state: every workload record and the acks of accepted placements.

One file, ``<state-dir>/state.json`` (0600: it holds every workload's env), rewritten atomically (temp file, fsync, rename,
fsync of the directory: :func:`infra.durable.atomic_write`) by the supervisor's owner task after each batch of events.
Small by construction: terminal records beyond ``keep_terminal`` are pruned oldest
first. A file that does not decode is moved aside (``state.json.bad-<time>``) and
the agent starts empty rather than trusting half of it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgspec

# re-exported: the agent's callers import it from here
from infra.durable import atomic_write as atomic_write
from scheduler_link.messages import TERMINAL_STATES, Peer, PlacementAck, RestartPolicy, WorkloadStatus

log = logging.getLogger("herd.agent.state")

STATE_VERSION = 1


class WorkloadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the agent must remember about one workload across restarts."""
    workload_id: str
    job_id: str
    placement_id: str = ""
    rank: int = 0
    world_size: int = 1
    gpus: list[str] = []
    gpu_indices: list[int] = []
    argv: list[str] = []
    env: dict[str, str] = {}
    manifest_id: str | None = None
    origin: str | None = None
    peers: list[Peer] = []
    gang_blob_id: str | None = None      # the gang's blob (its whole peer table), when it has more peers
    gang_nodes: int = 0
    grace_s: float = 30.0
    restart: RestartPolicy = RestartPolicy()
    direct: bool = False
    wait_for: list[str] = []             # victims that must be gone before this starts
    state: str = "accepted"
    exit_code: int | None = None
    reason: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    updated_at: float = 0.0
    # identity of the running process (see agent.procs)
    pid: int | None = None
    start_time: int | None = None
    boot_id: str | None = None
    shim_pid: int | None = None
    shim_start_time: int | None = None
    restarts: int = 0
    # graceful stop, persisted so a restarted agent resumes the countdown
    stop_reason: str | None = None
    stop_preempted: bool = False         # the stop is a preemption: it ends "preempted", else "exited"
    stop_deadline: float | None = None
    term_sent: bool = False
    fetch: dict[str, int] = {}           # this workload's artifact fetch: bytes by source
    limits: dict[str, str] = {}          # the job's cgroup limits (cgroup file -> value)
    user: str | None = None              # the user the placement asked for (None: the default)
    env_from_files: dict[str, str] = {}  # NAME -> host path, read at each start (values never stored)
    run_as: str | None = None            # the user it runs as (resolved at start)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def status(self) -> WorkloadStatus:
        return WorkloadStatus(
            workload_id=self.workload_id, job_id=self.job_id, placement_id=self.placement_id,
            rank=self.rank, world_size=self.world_size, gpus=list(self.gpus), state=self.state,  # type: ignore[arg-type]  # the record's state is a str on disk; every value written is a WorkloadState
            exit_code=self.exit_code, reason=self.reason, manifest_id=self.manifest_id,
            pid=self.pid if not self.terminal else None, created_at=self.created_at,
            started_at=self.started_at, updated_at=self.updated_at, fetch=dict(self.fetch))


class AgentState(msgspec.Struct, frozen=True, kw_only=True):
    version: int = STATE_VERSION
    node_id: str = ""
    records: list[WorkloadRecord] = []
    acks: list[PlacementAck] = []


_decoder = msgspec.json.Decoder(AgentState)


class StateFile:
    def __init__(self, state_dir: str | os.PathLike[str]):
        self.dir = Path(state_dir)
        self.path = self.dir / "state.json"
        self.writes = 0

    def load(self) -> AgentState:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return AgentState()
        try:
            st = _decoder.decode(data)
            if st.version != STATE_VERSION:
                raise msgspec.ValidationError(f"state version {st.version} != {STATE_VERSION}")
            return st
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            aside = self.path.with_name(f"state.json.bad-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("state file unreadable, set aside path=%s err=%s", aside, e)
            return AgentState()

    def save(self, st: AgentState) -> None:
        atomic_write(self.path, msgspec.json.encode(st))
        self.writes += 1
