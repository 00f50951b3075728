"""The agent's configuration: frozen msgspec Structs, loaded from TOML, CLI flags on top.

The types are the schema: ``[agent]`` holds :class:`AgentConfig`'s plain fields, and each
field of AgentConfig that is itself a Struct is a section of its own (``[topology]``,
``[store]``, ``[workloads]``, ``[relay]``, ...). Every Struct forbids unknown fields, so a
key added to a type is accepted at once and a typo is a :class:`ConfigError` naming the
key and its section (it never silently falls back to a default). Every key is documented
in the commented reference file ``systemd/agent.toml`` (a test checks that).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from infra.tomlconfig import read_toml
from p2p.origins.allow import origin_refusal
from scheduler_link.messages import TopologyPath

from .errors import ConfigError
from .supervisor import SupervisorConfig
from .tenants import IsolationSection, parse_uid_range

DEFAULT_LISTEN = "127.0.0.1:8470"


class StoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[store]``: the chunk store."""
    dir: str | None = None               # default <state_dir>/store
    quota_bytes: int | None = None       # None: no quota (bounded by the disk)
    keep_trees: int = 2                  # materialised trees kept beyond those in use


class RelayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[relay]``: this agent may relay for its rack (agent.relay)."""
    enabled: bool = False
    listen: str = "127.0.0.1:0"          # the members listener (frames connections)
    advertise: str | None = None         # HOST:PORT members dial (default: the bound address)
    # As a member: after this many heartbeat intervals with nothing the placer vouched for
    # (relayed answers carry no placer MAC), report once directly so a relay that answers
    # every heartbeat itself cannot hold this node for good. 0: never. Each such report is a
    # handshake with the placer: 120 at 5 s over 131,072 nodes is ~220 a second.
    trust_intervals: int = 0
    # As a member: how long to keep a relay that answers it has no connection to the placer
    # (the placer restarting) before reporting directly, a handshake with the placer each.
    hold_s: float = 30.0


class DataPlaneSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[dataplane]``: how peers read this node's chunks (p2p.dataplane)."""
    # Mutual TLS with node certificates (artifacts are often secret: model weights). None: on
    # unless the agent is insecure; false: plain TCP for fleets that need the last cycle (the
    # whole fleet alike: a TLS node refuses plain peers); true with insecure: an error.
    tls: bool | None = None
    # With TLS, a manifest's bytes go only to the nodes of gangs here that use it (p2p.readers);
    # these manifest ids go to any node of the cluster ("*": every manifest, as without TLS).
    public: list[str] = []
    # Without TLS no asker has a name to check reads against: every artifact goes to any holder
    # of cluster.token. tls = false on a secure agent is refused at start unless this is true
    # (or public = ["*"]); an insecure agent (insecure = true) says so for everything already.
    insecure_reads: bool = False

    def __post_init__(self) -> None:
        for m in self.public:
            if m != "*" and not (len(m) == 64 and all(c in "0123456789abcdef" for c in m)):
                raise ValueError(f"[dataplane] public: {m[:80]!r} is neither a manifest id nor \"*\"")


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[agent]``'s keys, and one field per section."""
    node_id: str = msgspec.field(default_factory=socket.gethostname)
    gpus: str = "nvml"                   # "nvml" or "simulated:PROFILE"
    state_dir: str = "/var/lib/herd"
    listen: str = DEFAULT_LISTEN
    data_listen: str | None = "127.0.0.1:0"   # None: no data plane
    placer: str | None = None
    placers: tuple[str, ...] = ()        # every placer (placer = [...]): the link fails over (scheduler_link.placers)
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
    dataplane: DataPlaneSection = DataPlaneSection()
    isolation: IsolationSection = IsolationSection()
    # TLS (agent.certs, docs/security.md): ca.crt + node.crt/node.key in tls_dir (default
    # $HERD_TLS_DIR or /etc/herd/tls); insecure = true keeps plain HTTP/TCP (warned; unset:
    # $HERD_INSECURE=1); tls_bootstrap_token: a file with a single-use token for the first certificate
    tls_dir: str | None = None
    insecure: bool | None = None
    tls_bootstrap_token: str | None = None

    @property
    def store_dir(self) -> Path:
        return Path(self.store.dir) if self.store.dir else Path(self.state_dir) / "store"


def sections() -> dict[str, type[msgspec.Struct]]:
    """The TOML sections besides ``[agent]``: AgentConfig's Struct-typed fields, by name."""
    return {f.name: f.type for f in msgspec.structs.fields(AgentConfig)
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct)}


def keys(section: str = "agent") -> tuple[str, ...]:
    """The keys a section takes (``agent``: AgentConfig's fields that are not sections)."""
    if section == "agent":
        return tuple(k for k in AgentConfig.__struct_fields__ if k not in sections())
    return sections()[section].__struct_fields__


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]*)`")


def _explain(e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.workloads.shim_pool`" in the file's words:
    "[workloads] shim_pool has the wrong type: expected `int`, got `str`"."""
    text = str(e)
    m = _AT.search(text)
    path = [p for p in (m.group("path") if m else "").split(".") if p]
    what = _AT.sub("", text)
    section = path[0] if path and path[0] in sections() else "agent"
    rest = path[1:] if section != "agent" else path
    if u := _UNKNOWN.match(what):
        if rest:  # an unknown field inside a key's value (no key takes a table today)
            return f"[{section}] {'.'.join(rest)}: unknown field {u['key']}"
        return f"unknown key [{section}] {u['key']} (known: {', '.join(sorted(keys(section)))})"
    if not rest:
        return f"[{section}]: {what}"
    return f"[{section}] {'.'.join(rest)} has the wrong type: {what[0].lower()}{what[1:]}"


def _layout(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The file's tables and the flags as one mapping shaped like AgentConfig."""
    secs = sections()
    for k, v in data.items():
        if k != "agent" and k not in secs:
            raise ConfigError(f"unknown section [{k}] (known: {', '.join(['agent', *secs])})")
        if not isinstance(v, dict):
            raise ConfigError(f"[{k}] must be a table")
    out: dict[str, Any] = dict(data.get("agent", {}))
    for k in out:
        if k in secs:  # `topology = {...}` inside [agent]: the section is a table of its own
            raise ConfigError(f"unknown key [agent] {k} (known: {', '.join(sorted(keys()))}; [{k}] is a section)")
    for name, t in secs.items():
        if name not in data:
            continue
        # TopologyPath is a wire type that tolerates unknown fields (newer peers); a file may not
        if not t.__struct_config__.forbid_unknown_fields and (extra := set(data[name]) - set(t.__struct_fields__)):
            raise ConfigError(f"unknown key [{name}] {min(extra)} (known: {', '.join(sorted(keys(name)))})")
        out[name] = dict(data[name])
    topo = TopologyPath.__struct_fields__
    for k, v in overrides.items():
        if v is None:
            continue
        section, _, name = k.partition("_")
        if k in topo:                          # zone, block, rack: the topology flags
            out.setdefault("topology", {})[k] = v
        elif k in keys():
            out[k] = v
        elif section in secs and name in keys(section):   # relay_listen -> [relay] listen
            out.setdefault(section, {})[name] = v
        else:
            raise ConfigError(f"unknown override {k}")
    return out


def load_config(path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None) -> AgentConfig:
    """Read the TOML file (if any), then apply ``overrides`` (CLI flags; None values are ignored).

    Override keys: the [agent] keys; ``zone``, ``block``, ``rack``; and ``SECTION_KEY`` for a
    key of another section (``relay_enabled``, ``relay_listen``).
    """
    data = read_toml(path, ConfigError) if path is not None else {}
    try:
        cfg = msgspec.convert(_placer_list(_layout(data, overrides or {})), AgentConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(e)) from None
    validate(cfg)
    return cfg


def _placer_list(out: dict[str, Any]) -> dict[str, Any]:
    """``placer = [URL, ...]`` (or ``--placer`` repeated): several placers, one leading; the
    first is ``placer``, every one is in ``placers``."""
    p = out.get("placer")
    if isinstance(p, list | tuple):
        out["placer"] = p[0] if p else None
        out["placers"] = tuple(p)
    return out


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
    for url in (cfg.placer, *cfg.placers):
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ConfigError(f"placer must be an http(s) URL, not {url!r}")
    if cfg.heartbeat_s <= 0 or cfg.gpu_poll_interval_s <= 0:
        raise ConfigError("heartbeat_s and gpu_poll_interval_s must be > 0")
    if cfg.relay.trust_intervals < 0 or not 0 <= cfg.relay.hold_s <= 3600:
        raise ConfigError("relay.trust_intervals must be >= 0 and relay.hold_s within 0..3600")
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
    if any(not p.startswith("/") or p.rstrip("/") == "" for p in w.env_files_prefixes) \
            or not 1 <= w.env_file_max_bytes <= 16 << 20:
        raise ConfigError("workloads.env_files_prefixes must be absolute directories (not /), "
                          "env_file_max_bytes within 1..16777216")
    iso = cfg.isolation
    parse_uid_range(iso.uid_range)   # raises ConfigError when malformed
    if iso.hide_proc not in ("auto", "off") or iso.gpu_devices not in ("auto", "off"):
        raise ConfigError("[isolation] hide_proc and gpu_devices must be auto or off")
    if not iso.dev_dir.startswith("/"):
        raise ConfigError(f"[isolation] dev_dir must be an absolute directory, not {iso.dev_dir!r}")
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
    return msgspec.structs.replace(cfg, **changes)
