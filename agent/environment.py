"""A workload's environment (issue 4 §1): what it inherits, what it never sees, what we add.

Inherited from the agent: an allow-list only (PATH, HOME, locale, TZ, TMPDIR, user
names), so the agent's own settings and credentials never leak into workloads. Never
passed: systemd's NOTIFY_SOCKET/WATCHDOG_*/LISTEN_* (a workload must not be able to
notify or pet the agent's watchdog) and the token dir. Added: CUDA_VISIBLE_DEVICES and
NVIDIA_VISIBLE_DEVICES (the assigned GPU UUIDs), HERD_JOB_ID, HERD_WORKLOAD_ID,
HERD_RANK, HERD_WORLD_SIZE, HERD_SCRATCH, HERD_PREEMPT_NOTICE, HERD_PEERS_FILE (one line
per peer, see agent.peersfile) and, for gangs of at most 64 peers, HERD_PEERS
(``node=url,...``). A workload that runs as another user
than the agent (agent.isolation) also gets HOME and TMPDIR = its scratch dir, USER and
LOGNAME = that user (``herd-UID`` for a uid of its own, agent.tenants).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .peersfile import ENV_PEERS_MAX, PEERS_FILE
from .state import WorkloadRecord

SCRUB_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
             "LISTEN_FDNAMES", "INVOCATION_ID", "HERD_TOKEN_DIR")
# What a workload inherits from the agent's environment (an allow-list: the agent's own
# settings and credentials never leak into workloads); the placement's env adds the rest.
KEEP_ENV = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL"})


def base_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of the agent's environment a workload inherits."""
    return {k: v for k, v in env.items() if (k in KEEP_ENV or k.startswith("LC_")) and k not in SCRUB_ENV}


def workload_env(base: Mapping[str, str], rec: WorkloadRecord, wdir: Path) -> dict[str, str]:
    """The workload's environment: the allowed part of ``base``, the placement's env, then ours."""
    env = base_env(base)
    env.update({k: v for k, v in rec.env.items() if k not in SCRUB_ENV})
    gpus = ",".join(rec.gpus)
    env.update({
        "CUDA_VISIBLE_DEVICES": gpus,
        "NVIDIA_VISIBLE_DEVICES": gpus or "void",
        "HERD_JOB_ID": rec.job_id,
        "HERD_WORKLOAD_ID": rec.workload_id,
        "HERD_RANK": str(rec.rank),
        "HERD_WORLD_SIZE": str(rec.world_size),
        "HERD_SCRATCH": str(wdir / "scratch"),
        "HERD_PREEMPT_NOTICE": str(wdir / "preempt-notice.json"),
    })
    if rec.peers or rec.gang_blob_id:
        env["HERD_PEERS_FILE"] = str(wdir / PEERS_FILE)
    if rec.peers and len(rec.peers) <= ENV_PEERS_MAX and rec.gang_nodes <= len(rec.peers):
        env["HERD_PEERS"] = ",".join(f"{p.node_id}={p.data_url}" for p in rec.peers)  # small gangs only
    return env
