"""Every placer address a client knows, and which one it talks to now (several placers, one
leading: placer.ha).

Agents (``placer = [...]`` / ``--placer`` repeated) and the CLI (``HERD_PLACER=a,b,c`` or
``--placer`` repeated) are given every placer; they also learn addresses from answers: a
follower answers a write with 307, its body naming the leader (``{"leader": URL}``), and a
503 with ``Retry-After`` while no leader is known (the placers are electing one). On a
connection failure the client moves to the next address, round robin; a redirect moves it to
the leader at once. No I/O here: the callers carry the requests out (scheduler_link.client,
scheduler_link.agent_link).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

import msgspec

from infra.errors import ClientError

__all__ = ["Placers", "placer_urls", "placer_urls_from_env", "leader_of", "leader_wire_of", "not_leading", "retry_after_s"]


class _Redirect(msgspec.Struct, frozen=True):
    leader: str | None | msgspec.UnsetType = msgspec.UNSET
    leader_wire: str | None = None


_redirect = msgspec.json.Decoder(_Redirect)

REDIRECT = 307
NO_LEADER = 503
RETRY_AFTER_MAX_S = 5.0
DOWN_HOLD_S = 3.0   # an address that failed is passed over this long (a dead leader, still named by followers)


def _norm(url: str) -> str:
    return url.strip().rstrip("/")


def placer_urls(given: Iterable[str] | str | None) -> list[str]:
    """Addresses as given (each may be comma-separated), in order, without repeats; each must
    be an http(s) URL (:class:`ClientError` otherwise)."""
    if given is None:
        return []
    items = [given] if isinstance(given, str) else list(given)
    out: list[str] = []
    for item in items:
        for u in item.split(","):
            u = _norm(u)
            if not u:
                continue
            if not u.startswith(("http://", "https://")):
                raise ClientError(f"placer URL must start with http:// or https://, got {u!r}")
            if u not in out:
                out.append(u)
    return out


def placer_urls_from_env(explicit: Sequence[str] | str | None = None) -> list[str]:
    """``--placer`` (repeatable, comma-separated) else ``$HERD_PLACER`` (comma-separated)."""
    urls = placer_urls(explicit) or placer_urls(os.environ.get("HERD_PLACER"))
    if not urls:
        raise ClientError("no placer URL: pass --placer URL or set HERD_PLACER")
    return urls


def leader_of(status: int, body: bytes) -> str | None:
    """The leader a follower's answer names (a 307 whose body says ``leader``), else None."""
    if status != REDIRECT:
        return None
    try:
        leader = _redirect.decode(body).leader
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not isinstance(leader, str) or not leader.startswith(("http://", "https://")):
        return None
    return _norm(leader)


def leader_wire_of(status: int, body: bytes) -> str | None:
    """The leader's framed channel a follower's 307 names (``leader_wire``), else None."""
    if status != REDIRECT:
        return None
    try:
        wire = _redirect.decode(body).leader_wire
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return wire if wire and wire.startswith(("tcp://", "tls://")) else None


def not_leading(status: int, body: bytes) -> bool:
    """An answer of a placer that does not lead: a 307, or a 503 whose body says which leader
    it knows (``"leader": null`` while none is elected). A busy placer's 503 (infra.gate) names
    none: it leads, and is asked again."""
    if status == REDIRECT:
        return True
    if status != NO_LEADER:
        return False
    try:
        return _redirect.decode(body).leader is not msgspec.UNSET
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


def retry_after_s(status: int, header: str | None) -> float | None:
    """How long to wait before asking again: a 503 with ``Retry-After`` seconds (the placers
    are electing a leader), bounded; None for any other answer."""
    if status != NO_LEADER or header is None:
        return None
    try:
        s = float(header)
    except ValueError:
        return None
    return min(max(0.0, s), RETRY_AFTER_MAX_S)


class Placers:
    """The addresses, in order, and the current one. ``failed(url, now)`` moves on from ``url``
    (only if it is still the current one: a late failure of an old request moves nothing) to
    the next address not itself failed within ``hold_s``; ``learned(url, now)`` makes ``url``
    current, adding it when new, unless it failed within ``hold_s``: a follower keeps naming a
    dead leader until its lease runs out, and following it back and forth would only cost
    full reports. ``now`` is the caller's clock (None: nothing is held)."""

    def __init__(self, urls: Iterable[str], *, hold_s: float = DOWN_HOLD_S) -> None:
        self.urls: list[str] = []
        for u in urls:
            u = _norm(u)
            if u and u not in self.urls:
                self.urls.append(u)
        if not self.urls:
            raise ValueError("no placer address")
        self._i = 0
        self.hold_s = hold_s
        self._down: dict[str, float] = {}   # url -> until when it is passed over
        self.switches = 0

    def __len__(self) -> int:
        return len(self.urls)

    @property
    def current(self) -> str:
        return self.urls[self._i]

    def _is_down(self, url: str, now: float | None) -> bool:
        return now is not None and self._down.get(url, -math.inf) > now

    def failed(self, url: str, now: float | None = None) -> str:
        url = _norm(url)
        if now is not None:
            self._down[url] = now + self.hold_s
        if url == self.current:
            self._advance(now)
        return self.current

    def _advance(self, now: float | None) -> None:
        """To the next address not held (the next one when all are)."""
        n = len(self.urls)
        if n > 1:
            self._i = next((j for j in ((self._i + k) % n for k in range(1, n)) if not self._is_down(self.urls[j], now)),
                           (self._i + 1) % n)
            self.switches += 1

    def learned(self, url: str, now: float | None = None) -> str:
        """The leader an answer named: current now, unless it failed us a moment ago (then the
        placer that named it counts as failed: the next is asked)."""
        url = _norm(url)
        if self._is_down(url, now):
            self._advance(now)
            return self.current
        if url not in self.urls:
            self.urls.append(url)
        i = self.urls.index(url)
        if i != self._i:
            self._i = i
            self.switches += 1
        return self.current
