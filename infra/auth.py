"""Bearer tokens from one token dir per host (DESIGN.md, Contracts).

``placer.token``   placer -> agents' POST /v1/placements
``cluster.token``  agents -> placer reports, and the data plane between peers
``operator.token`` operator actions (stop, inject, submit/cancel jobs)
``viewer.token``   reads (status, workloads, logs, jobs); see scheduler_link/authz.py
``metrics.token``  Prometheus scrapes where /metrics is not left open

Tokens are compared in constant time. A missing file means that role cannot be
authenticated at all (every request for it gets 401), never that it is open.
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from .durable import atomic_write

ROLES = ("placer", "cluster", "operator", "viewer", "metrics")
DEFAULT_TOKEN_DIR = "/etc/herd/tokens"


def token_dir_from_env(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("HERD_TOKEN_DIR", DEFAULT_TOKEN_DIR))


@dataclass(frozen=True, slots=True)
class TokenSet:
    placer: str | None = None
    cluster: str | None = None
    operator: str | None = None
    viewer: str | None = None
    metrics: str | None = None

    @classmethod
    def load(cls, token_dir: str | os.PathLike[str] | None) -> TokenSet:
        d = token_dir_from_env(token_dir)
        vals: dict[str, str | None] = {}
        for role in ROLES:
            p = d / f"{role}.token"
            try:
                vals[role] = p.read_text().strip() or None
            except (FileNotFoundError, PermissionError, NotADirectoryError):
                vals[role] = None
        return cls(**vals)

    def get(self, role: str) -> str | None:
        return getattr(self, role)

    def check(self, role: str, presented: str | None) -> bool:
        """Constant-time check of a presented token for ``role``."""
        expected = self.get(role)
        if not expected or presented is None:
            return False
        return hmac.compare_digest(expected.encode(), presented.encode())


def bearer(headers: dict[str, str]) -> str | None:
    """Extract a bearer token from lower-cased request headers."""
    v = headers.get("authorization")
    if not v:
        return None
    scheme, _, tok = v.partition(" ")
    if scheme.lower() != "bearer" or not tok:
        return None
    return tok.strip()


def auth_header(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def generate_token_dir(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Create one token per role of :data:`ROLES` (mode 0600, dir 0700) once; existing ones are kept."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for role in ROLES:
        p = d / f"{role}.token"
        if p.exists() and not overwrite:
            continue
        atomic_write(p, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return d
