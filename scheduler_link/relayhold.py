"""How long a member keeps a rack relay that has no connection to the placer (no I/O).

Theory of operation
-------------------
A relay with no connection up answers its members ``upstream_down`` and says which of two
cases it is in, structured (``WireReply.dialling``, ``PlacerCert.dialling``):

- *dialling*: it is getting through -- never connected since it started (its first dial under
  way), or a dial to the placer in flight now. In a cold start, and in a large fleet's placer
  restart, every relay of the fleet handshakes with the placer at once, and a relay's turn in
  that queue can come well after ``lost_s``;
- *lost*: it lost the placer and is between dials (the placer refused or did not answer its
  last one: a placer down, or unreachable from this relay).

Either way the member keeps that relay rather than registering with the placer itself: the
relay exists to spare the placer one handshake per member, and a member that gives up adds
one more handshake to the queue its relay waits in. The hold is bounded, from the first such
answer in a row: an answer that says *lost* keeps the relay until ``lost_s`` (``[relay]
hold_s``) after that first answer, one that says *dialling* until ``dialling_s``
(``DIAL_HOLD_FACTOR`` times ``lost_s`` unless given). So a relay that never gets through still
lets its members go after ``dialling_s``, one that cannot reach the placer (its dials refused,
between them) after ``lost_s`` as before, and a relay cannot stretch either bound: the member
keeps the clock and the bounds.

Invariants: ``until`` never returns a time past ``since + dialling_s``; for an answer that says
*lost*, never past ``since + lost_s``; ``lost_s`` 0 holds nothing (a member reports directly at
the first ``upstream_down``).
"""

from __future__ import annotations

DIAL_HOLD_FACTOR = 4.0   # a relay making its first dial is held on to this many times longer


class RelayHold:
    """One member's hold on its relay: :meth:`until` at each ``upstream_down`` answer,
    :meth:`clear` once the relay (or the placer) took a report or the member gave it up."""

    __slots__ = ("lost_s", "dialling_s", "since", "dialling")

    def __init__(self, lost_s: float, dialling_s: float | None = None) -> None:
        self.lost_s = max(0.0, lost_s)
        self.dialling_s = self.lost_s * DIAL_HOLD_FACTOR if dialling_s is None else max(self.lost_s, dialling_s)
        self.since: float | None = None   # the first upstream_down answer of this hold (the caller's clock)
        self.dialling = True              # the latest answer of this hold said dialling

    def until(self, now: float, *, dialling: bool) -> float | None:
        """An ``upstream_down`` answer at ``now`` (``dialling``: the relay said it is getting
        through): the time the relay is kept until, or None when the hold is over (go to the
        placer directly)."""
        if self.since is None:
            self.since = now
        self.dialling = dialling
        end = self.since + (self.dialling_s if dialling else self.lost_s)
        return end if now < end else None

    def keep(self, now: float, *, dialling: bool) -> bool:
        return self.until(now, dialling=dialling) is not None

    def clear(self) -> None:
        self.since = None
        self.dialling = True

    @property
    def holding(self) -> bool:
        return self.since is not None
