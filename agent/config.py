"""The agent's configuration: frozen dataclasses, loaded from TOML, CLI flags on top.

Every key is documented in the commented reference file ``systemd/agent.toml``; an
unknown key or a value of the wrong type is a :class:`ConfigError` naming it (a typo
never silently falls back to a default).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from p2p.origins.allow import origin_refusal
from scheduler_link.messages import TopologyPath

from .errors import ConfigError
from .supervisor import SupervisorConfig

DEFAULT_LISTEN = "127.0.0.1:8470"


@dataclass(frozen=True, slots=True)
class StoreConfig:
    dir: str | None = None               # default <state_dir>/store
    quota_bytes: int | None = None       # None: no quota (bounded by the disk)
    keep_trees: int = 2                  # materialised trees kept beyond those in use


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """``[relay]``: this agent may relay for its rack (agent.relay)."""
    enabled: bool = False
    listen: str = "127.0.0.1:0"          # the members listener (frames connections)
    advertise: str | None = None         # HOST:PORT members dial (default: the bound address)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_id: str = field(default_factory=socket.gethostname)
    gpus: str = "nvml"                   # "nvml" or "simulated:PROFILE"
    state_dir: str = "/var/lib/herd"
    listen: str = DEFAULT_LISTEN
    data_listen: str | None = "127.0.0.1:0"   # None: no data plane
    placer: str | None = None
    token_dir: str | None = None         # default $HERD_TOKEN_DIR or /etc/herd/tokens
    open_reads: bool = False             # viewer routes public (no token); a lab set-up only
    open_metrics: bool = True            # /metrics public (else the metrics, viewer or operator token)
    heartbeat_s: float = 5.0
    gpu_poll_interval_s: float = 5.0
    max_body_bytes: int = 4 << 20        # placements and prefetches (fleet scale: a few MB at most)
    # Origins a placement or prefetch may name (URL prefixes: gs://bucket/prefix, https://host/path,
    # file:///dir; `herd agent run --allowed-origin URL`). Default none: every origin is refused.
    allowed_origins: tuple[str, ...] = ()
    topology: TopologyPath = TopologyPath()
    store: StoreConfig = StoreConfig()
    workloads: SupervisorConfig = SupervisorConfig()
    relay: RelayConfig = RelayConfig()

    @property
    def store_dir(self) -> Path:
        return Path(self.store.dir) if self.store.dir else Path(self.state_dir) / "store"


_AGENT_KEYS = {"node_id": str, "gpus": str, "state_dir": str, "listen": str, "data_listen": (str, type(None)),
               "placer": (str, type(None)), "token_dir": (str, type(None)), "open_reads": bool, "open_metrics": bool,
               "heartbeat_s": (int, float), "gpu_poll_interval_s": (int, float), "max_body_bytes": int,
               "allowed_origins": list}
_TOPO_KEYS = {"zone": str, "block": str, "rack": str}
_STORE_KEYS = {"dir": str, "quota_bytes": int, "keep_trees": int}
_RELAY_KEYS = {"enabled": bool, "listen": str, "advertise": str}
_WL_KEYS = {"shim_pool": int, "log_max_bytes": int, "log_keep": int, "keep_terminal": int,
            "default_grace_s": (int, float), "user": str, "allowed_users": list, "allow_root": bool,
            "cgroup": str, "rlimit_core": int, "memory_max": str, "cpu_max": str, "pids_max": str}


def _check(section: str, table: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in table.items():
        if k not in schema:
            raise ConfigError(f"unknown key [{section}] {k} (known: {', '.join(sorted(schema))})")
        want = schema[k]
        if isinstance(v, bool) and want in (int, (int, float)):
            raise ConfigError(f"[{section}] {k} must be a number, not {v!r}")
        if not isinstance(v, want):
            raise ConfigError(f"[{section}] {k} has the wrong type: {v!r}")
        if want is list:
            if not all(isinstance(x, str) for x in v):
                raise ConfigError(f"[{section}] {k} must be a list of strings: {v!r}")
            v = tuple(v)
        out[k] = float(v) if want == (int, float) else v
    return out


def load_config(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None) -> AgentConfig:
    """Read the TOML file (if any), then apply ``overrides`` (CLI flags; None values are ignored).

    Override keys: the [agent] keys, plus ``zone``, ``block``, ``rack``, ``relay_enabled``,
    ``relay_listen``.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    for k in data:
        if k not in ("agent", "topology", "store", "workloads", "relay"):
            raise ConfigError(f"unknown section [{k}] (known: agent, topology, store, workloads, relay)")
        if not isinstance(data[k], dict):
            raise ConfigError(f"[{k}] must be a table")
    agent = _check("agent", data.get("agent", {}), _AGENT_KEYS)
    topo = _check("topology", data.get("topology", {}), _TOPO_KEYS)
    store = _check("store", data.get("store", {}), _STORE_KEYS)
    wl = _check("workloads", data.get("workloads", {}), _WL_KEYS)
    relay = _check("relay", data.get("relay", {}), _RELAY_KEYS)
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k in _TOPO_KEYS:
            topo[k] = v
        elif k in ("relay_enabled", "relay_listen"):
            relay[k.removeprefix("relay_")] = v
        elif k in _AGENT_KEYS:
            agent[k] = v
        else:
            raise ConfigError(f"unknown override {k}")
    try:
        cfg = AgentConfig(**agent, topology=TopologyPath(**topo), store=StoreConfig(**store),
                          workloads=SupervisorConfig(**wl), relay=RelayConfig(**relay))
    except TypeError as e:
        raise ConfigError(str(e)) from None
    validate(cfg)
    return cfg


def validate(cfg: AgentConfig) -> None:
    if not cfg.node_id or "/" in cfg.node_id:
        raise ConfigError(f"node_id must be non-empty without '/': {cfg.node_id!r}")
    if not (cfg.gpus == "nvml" or cfg.gpus.startswith("simulated:")):
        raise ConfigError(f"gpus must be 'nvml' or 'simulated:PROFILE', not {cfg.gpus!r}")
    for name, v in (("listen", cfg.listen), ("data_listen", cfg.data_listen), ("relay.listen", cfg.relay.listen),
                    ("relay.advertise", cfg.relay.advertise)):
        if v is None:
            continue
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"{name} must be HOST:PORT, not {v!r}")
    if cfg.placer is not None and not cfg.placer.startswith(("http://", "https://")):
        raise ConfigError(f"placer must be an http(s) URL, not {cfg.placer!r}")
    if cfg.heartbeat_s <= 0 or cfg.gpu_poll_interval_s <= 0:
        raise ConfigError("heartbeat_s and gpu_poll_interval_s must be > 0")
    w = cfg.workloads
    if w.shim_pool < 0 or w.shim_pool > 64:
        raise ConfigError("workloads.shim_pool must be within 0..64")
    if w.log_max_bytes < 1024 or w.log_keep < 0 or w.default_grace_s < 0 or w.keep_terminal < 0:
        raise ConfigError("workloads: log_max_bytes >= 1024, log_keep/keep_terminal/default_grace_s >= 0")
    if not w.user:
        raise ConfigError("workloads.user must name a user (or a numeric uid)")
    if not (w.cgroup in ("auto", "off") or w.cgroup.startswith("/")):
        raise ConfigError(f"workloads.cgroup must be auto, off or an absolute cgroup v2 path, not {w.cgroup!r}")
    if w.rlimit_core < 0:
        raise ConfigError("workloads.rlimit_core must be >= 0")
    if cfg.store.quota_bytes is not None and cfg.store.quota_bytes <= 0:
        raise ConfigError("store.quota_bytes must be > 0")
    if cfg.store.keep_trees < 0:
        raise ConfigError("store.keep_trees must be >= 0")
    if cfg.max_body_bytes < 1024:
        raise ConfigError("max_body_bytes must be >= 1024")
    for o in cfg.allowed_origins or ():
        if why := origin_refusal(o, None):
            raise ConfigError(f"allowed_origins: {why}")


def replace(cfg: AgentConfig, **changes: Any) -> AgentConfig:
    return dataclasses.replace(cfg, **changes)
