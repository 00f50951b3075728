"""The placer service's configuration: one frozen struct, defaults in the type,
loaded from TOML (every key optional) with CLI flags on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from infra.tomlconfig import read_toml

from .errors import PlacerConfigError

__all__ = ["PlacerConfig", "PlacerConfigError", "load_config"]


class PlacerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    listen: str = "127.0.0.1:7470"
    token_dir: str | None = None
    state_dir: str = "/var/lib/herd-placer"
    heartbeat_s: float = 5.0          # told to agents in every report reply
    lost_after_missed: int = 3        # a node is lost after this many missed heartbeats
    fence_after_s: float = 60.0       # then its gangs are rescheduled after this much more
    # more than this fraction of the up nodes silent within one lost window (and at least
    # MASS_SILENCE_MIN of them) is the placer's or the network's silence, not the nodes': none is
    # declared lost (they only take no new work) until it narrows (placer.attempts); 0: off
    lost_mass_fraction: float = 0.1
    recover_s: float | None = None    # after a restart, wait this long for reports before placing
                                      # recovered jobs again (default: lost threshold)
    # ... and, while a recovered job lacks pods and a node the placer knew before (placer.fleetsnap)
    # has not reported yet, this long at most
    recover_max_s: float = 60.0
    ack_timeout_s: float = 2.0        # one push attempt's deadline
    # more attempts of one push on a transport failure: 0, the placer's own re-placement
    # back-off (starts) and the next reply's stop list (stops) are the one retry layer
    push_retries: int = 0
    push_concurrency: int = 256
    max_peers: int = 64               # peers in a placement beyond the gang's own nodes
    tick_s: float = 0.25              # how often lost nodes and pending jobs are looked at
    wire_listen: str | None = None    # HOST:PORT for framed heartbeat connections (off when None)
    open_reads: bool = False          # viewer routes (jobs, nodes, cluster) public: a lab set-up only
    open_metrics: bool = True         # /metrics public (else the metrics, viewer or operator token)
    relays: bool = True               # deliver through rack relays where a rack has one connected
    relay_timeout_s: float = 0.5      # a relay that has not answered its bundle by then: push directly
    # With no rack relay connected (or relays = false) every node keeps its own connection and
    # report stream to the placer: registrations beyond this many nodes are then refused
    # (503, counted in direct_refusals) until a relay connects. 0: no limit
    direct_max_nodes: int = 16384
    # processes that check a relay batch's enrolment certificates and ECDHs ahead of its turn
    # (placer.enrollpool); None: one a core but the event loop's, at most 4, none below 4 cores; 0: in the loop
    enroll_workers: int | None = None
    blob_seeds: int = 1               # bundles of a gang that carry the blob's bytes (the rest fetch it)
    placement_ttl_s: float = 30.0     # a NodePart is refused as expired this long after it was issued
    # a node relays only for its pinned rack (its certificate's herd:rack: SAN, or herd node
    # approve); true: a node with no pinned rack may register and report but not relay
    require_pinned_racks: bool = False
    # TLS (infra.tls, docs/security.md): ca.crt, placer.crt, placer.key in tls_dir
    # (default $HERD_TLS_DIR or /etc/herd/tls); insecure = true keeps plain HTTP/TCP (warned;
    # unset: $HERD_INSECURE=1 says it); accept_tokens lets agents still use cluster.token.
    tls_dir: str | None = None
    insecure: bool | None = None
    accept_tokens: bool = False
    ca_dir: str | None = None         # a PKI dir with ca.key: sign bootstrap CSRs and renewals
    node_cert_days: int = 365         # what bootstrap and renewal issue
    # High availability (placer.election, placer.etcdjournal): with etcd client URLs, several
    # placers campaign for leadership on an etcd lease and the jobs journal lives in etcd;
    # empty (the default): one placer, the file journal in state_dir.
    etcd: list[str] = []
    etcd_prefix: str = "/herd/placer/"  # every key of this cluster's placers lives under it
    etcd_lease_ttl_s: int = 3          # a dead leader is replaced this long after its last renewal
    etcd_advertise: str | None = None  # the URL other placers redirect to (default: the listen URL)
    etcd_ca: str | None = None         # client TLS to etcd (https:// endpoints): the CA that signed
    etcd_cert: str | None = None       # etcd's certificates, and our client certificate and key
    etcd_key: str | None = None        # when etcd asks for one (--client-cert-auth)

    @property
    def lost_after_s(self) -> float:
        return self.heartbeat_s * self.lost_after_missed

    @property
    def recover_window_s(self) -> float:
        return self.lost_after_s if self.recover_s is None else self.recover_s


def load_config(path: str | Path | None, **overrides: Any) -> PlacerConfig:
    """TOML file (``[placer]`` table or top level) plus flag overrides that are not None."""
    data: dict[str, Any] = {}
    if path:
        raw = read_toml(path, PlacerConfigError)
        data = dict(raw.get("placer", raw))
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(data, PlacerConfig)
    except msgspec.ValidationError as e:
        raise PlacerConfigError(f"bad placer config: {e}") from None
    if not 0 <= cfg.lost_mass_fraction <= 1:
        raise PlacerConfigError("lost_mass_fraction must be within [0, 1] (0: off)")
    if cfg.heartbeat_s <= 0 or cfg.lost_after_missed < 1 or cfg.fence_after_s < 0 or cfg.ack_timeout_s <= 0:
        raise PlacerConfigError("heartbeat_s and ack_timeout_s must be > 0, lost_after_missed >= 1, fence_after_s >= 0")
    if cfg.enroll_workers is not None and not 0 <= cfg.enroll_workers <= 64:
        raise PlacerConfigError("enroll_workers must be within 0..64 (0: enrolments checked in the event loop)")
    if cfg.direct_max_nodes < 0:
        raise PlacerConfigError("direct_max_nodes must be >= 0 (0: no limit)")
    _check_etcd(cfg)
    return cfg


def _check_etcd(cfg: PlacerConfig) -> None:
    for url in cfg.etcd:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
            raise PlacerConfigError(f"bad etcd endpoint {url!r}: want http(s)://HOST:PORT")
    if not 1 <= cfg.etcd_lease_ttl_s <= 60:
        raise PlacerConfigError("etcd_lease_ttl_s must be within 1..60 seconds")
    if not cfg.etcd_prefix.startswith("/") or not cfg.etcd_prefix.endswith("/"):
        raise PlacerConfigError(f"etcd_prefix {cfg.etcd_prefix!r} must start and end with '/'")
    if cfg.etcd_advertise is not None and not cfg.etcd_advertise.startswith(("http://", "https://")):
        raise PlacerConfigError(f"bad etcd_advertise {cfg.etcd_advertise!r}: want http(s)://HOST:PORT")
    if (cfg.etcd_cert is None) != (cfg.etcd_key is None):
        raise PlacerConfigError("etcd_cert and etcd_key go together")
