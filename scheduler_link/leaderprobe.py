"""Who leads now, asked of the other placers while the current one is silent (several placers,
one leading: placer.ha).

A leader that is paused (SIGSTOP, a VM frozen) or cut off keeps its connections open and
answers nothing; a client that waits for its own deadline (10 s for an agent's report) stays
with it long after a follower has taken over (one lease TTL, 2-3 s). So while a report has gone
unanswered for a short while, the agent asks the *other* placers' ``GET /healthz`` (public, a
few hundred bytes) who leads: a leader names itself, a follower names the leader it knows from
etcd, each with that leader's epoch. A placer is left for another only when that one is named
with an epoch *higher* than the highest this agent has seen (scheduler_link.epochs): a leader
that is merely slow is named with the epoch the agent already knows, and is waited for.

What ``/healthz`` says is not authenticated as an epoch is (it only chooses whom to ask next):
the new leader's first answer over its own connection carries the epoch the agent then takes.

The CLI (scheduler_link.client.PlacerClient) does the same for a request of its own: while it
goes unanswered, the other placers are asked (:func:`probe_blocking`), and a leader named at an
epoch above the one the others give the placer asked (:func:`epoch_named`) is asked instead.

:func:`claim_of`, :func:`epoch_named` and :func:`newer_leader` decide (no I/O); :func:`probe`
and :func:`probe_blocking` ask.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import httpx
import msgspec
import trio

log = logging.getLogger("herd.link.leaderprobe")

__all__ = ["Claim", "claim_of", "epoch_named", "newer_leader", "probe", "probe_blocking", "PROBE_AFTER_S",
           "PROBE_EVERY_S", "PROBE_TIMEOUT_S"]

PROBE_AFTER_S = 1.0     # a report unanswered this long: ask the other placers who leads
PROBE_EVERY_S = 1.0     # ... and again this often while it stays unanswered
PROBE_TIMEOUT_S = 1.0   # one /healthz; a placer that does not answer in time names nobody


class Claim(msgspec.Struct, frozen=True):
    """A leader as one placer names it: its API URL, its framed channel (empty when not
    announced) and its epoch."""
    url: str
    epoch: int
    wire: str = ""


class _HA(msgspec.Struct):
    leader: str | None = None
    leader_wire: str | None = None
    epoch: int = 0


class _Health(msgspec.Struct):
    ha: _HA | None = None


_health = msgspec.json.Decoder(_Health)


def claim_of(body: bytes) -> Claim | None:
    """The leader a placer's ``/healthz`` names, with its epoch; None when it names none (no
    leader elected, a single placer without etcd, not a placer's answer)."""
    try:
        ha = _health.decode(body).ha
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if ha is None or not ha.leader or ha.epoch <= 0 or not ha.leader.startswith(("http://", "https://")):
        return None
    wire = ha.leader_wire if ha.leader_wire and ha.leader_wire.startswith(("tcp://", "tls://")) else ""
    return Claim(ha.leader.rstrip("/"), ha.epoch, wire)


def newer_leader(claims: Iterable[Claim | None], known_epoch: int, current: str) -> Claim | None:
    """The leader of the highest epoch named above ``known_epoch``, unless it is ``current``
    (the placer already asked); None when none is newer."""
    current = current.rstrip("/")
    best: Claim | None = None
    for c in claims:
        if c is None or c.epoch <= known_epoch or c.url == current:
            continue
        if best is None or c.epoch > best.epoch or (c.epoch == best.epoch and c.wire and not best.wire):
            best = c
    return best


def epoch_named(claims: Iterable[Claim | None], url: str) -> int:
    """The highest epoch at which any claim names ``url`` the leader (0: none names it): a
    caller that has seen no epoch of its own (the CLI) takes that as the one known."""
    url = url.rstrip("/")
    return max((c.epoch for c in claims if c is not None and c.url == url), default=0)


async def probe(client: httpx.AsyncClient, urls: Sequence[str], *,
                timeout_s: float = PROBE_TIMEOUT_S) -> list[Claim | None]:
    """Every URL's ``/healthz`` at once, each within ``timeout_s``: what each names (None for
    one that did not answer, or named nobody)."""
    out: list[Claim | None] = [None] * len(urls)

    async def one(i: int, url: str) -> None:
        with trio.move_on_after(timeout_s):
            try:
                r = await client.get(url.rstrip("/") + "/healthz")
            except httpx.HTTPError as e:
                log.debug("leader probe failed url=%s err=%s", url, e)
                return
            if r.status_code == 200:
                out[i] = claim_of(r.content)

    async with trio.open_nursery() as n:
        for i, u in enumerate(urls):
            n.start_soon(one, i, u)
    return out


def probe_blocking(client: httpx.Client, urls: Sequence[str]) -> list[Claim | None]:
    """:func:`probe` for a synchronous caller (the CLI): one URL after another, each bounded
    by ``client``'s timeout (PROBE_TIMEOUT_S for the CLI's)."""
    out: list[Claim | None] = []
    for url in urls:
        try:
            r = client.get(url.rstrip("/") + "/healthz")
        except httpx.HTTPError as e:
            log.debug("leader probe failed url=%s err=%s", url, e)
            out.append(None)
            continue
        out.append(claim_of(r.content) if r.status_code == 200 else None)
    return out
