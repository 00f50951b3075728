"""How long a member keeps a rack relay that has no connection to the placer (no I/O).

Theory of operation
-------------------
A relay with no connection up answers its members ``upstream_down`` and says which of two
cases it is in, structured (``WireReply.dialling``, ``PlacerCert.dialling``):

- *dialling*: it has not been connected since it started; its first dial to the placer is
  under way. In a cold start every relay of the fleet handshakes with the placer at once, and
  a relay's turn in that queue can come later than a restart's reconnect would;
- *lost*: it was connected and lost the placer (a placer restart: it reconnects within
  seconds).

Either way the member keeps that relay rather than registering with the placer itself: the
relay exists to spare the placer one handshake per member, and a member that gives up adds
one more handshake to the queue its relay waits in. The hold is bounded, from the first such
answer in a row: ``lost_s`` (``[relay] hold_s``) once any answer of the hold said *lost*,
``dialling_s`` (``DIAL_HOLD_FACTOR`` times ``lost_s`` unless given) while every answer said
*dialling*. So a relay that never gets through still lets its members go after
``dialling_s``, one that lost the placer after ``lost_s`` as before, and a relay cannot
stretch either bound: the member keeps the clock and the bounds.

Invariants: ``until`` never returns a time past ``since + dialling_s``; once an answer said
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
        self.dialling = True              # every answer of this hold said dialling

    def until(self, now: float, *, dialling: bool) -> float | None:
        """An ``upstream_down`` answer at ``now`` (``dialling``: the relay said it is making its
        first dial): the time the relay is kept until, or None when the hold is over (go to the
        placer directly)."""
        if self.since is None:
            self.since = now
            self.dialling = dialling
        else:
            self.dialling = self.dialling and dialling
        end = self.since + (self.dialling_s if self.dialling else self.lost_s)
        return end if now < end else None

    def keep(self, now: float, *, dialling: bool) -> bool:
        return self.until(now, dialling=dialling) is not None

    def clear(self) -> None:
        self.since = None
        self.dialling = True

    @property
    def holding(self) -> bool:
        return self.since is not None
