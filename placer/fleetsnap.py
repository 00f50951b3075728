"""Whom a restarted placer waits for: the fleet it last knew, kept on its own disk.

Theory of operation
-------------------
The placer's model is soft state: after a restart every node reports again and the model is
rebuilt from what the agents say (their workloads are the truth). What a restarted process
cannot know from reports alone is *when it has heard enough*: a recovered gang whose nodes have
not all reported yet looks partial, and placing it again doubles it (and stops the old pods).
A fixed wait (``recover_s``) is either too short for a large fleet re-registering or needlessly
long for a small one.

So the placer keeps a small file in its state dir, ``fleet.snapshot``: the ids of the nodes
that were up, rewritten (atomically, off the event loop) at most every ``SNAPSHOT_EVERY_S``
(1 s) after a node was added, lost or came back (the state's ``membership_changes``) -- never
in a steady fleet. A snapshot that lags the fleet is the danger: a gang placed on nodes it
lacks would, after a restart, look partial once the nodes it has all reported, and be placed
again (measured at 4,096 nodes with a 10 s cadence under load); so the lag is one second.
A restarted placer loads it and :class:`Recovery` decides when recovery ends:

- no snapshot (a new cluster, or one the placer never saw up): ``recover_s`` after the start,
  as before;
- every recovered job has all its pods reported and every node of the snapshot has reported:
  at once (a fleet back in seconds places in seconds);
- every recovered job has all its pods but some node is unheard: ``recover_s`` after the start
  (nothing recovered can be doubled; new jobs wait the usual window for the stragglers);
- some recovered job lacks pods while a node of the snapshot is unheard: ``recover_max_s``
  after the start, unless that node reports first (the missing pods may be on it: placing the
  job again would double it); a node that died with the placer holds that job back this long at
  most, then it is lost like any silent node and the job is placed again.

The file says nothing about workloads or GPUs (those come from the agents) and nothing secret;
a missing, unreadable or foreign file is ignored with a warning (a start is never blocked by it).
Its cost: ~25 bytes a node (3 MB at 131,072 nodes), and after membership changed, one O(nodes)
scan (~10 ms at 131,072) and a write, at most once a second.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

import msgspec

from infra.durable import atomic_write

log = logging.getLogger("herd.placer.fleetsnap")

SNAPSHOT_FILE = "fleet.snapshot"
# The write runs in a worker thread; tests in virtual time turn this off (as placer.journal's
# fsyncs): trio's autojump clock cannot see a worker thread and would jump past deadlines.
WRITE_IN_THREAD = True
SNAPSHOT_EVERY_S = 1.0     # at most this often, and only after nodes were added, lost or back
VERSION = 1


class FleetSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    version: int = VERSION
    taken_at: float = 0.0
    nodes: list[str] = []


_dec = msgspec.msgpack.Decoder(FleetSnapshot)
_enc = msgspec.msgpack.Encoder()


def encode(nodes: list[str], taken_at: float) -> bytes:
    return _enc.encode(FleetSnapshot(taken_at=taken_at, nodes=nodes))


def load(state_dir: str | os.PathLike[str]) -> FleetSnapshot | None:
    """The snapshot in ``state_dir``, or None (none, unreadable, or of another version)."""
    p = Path(state_dir) / SNAPSHOT_FILE
    try:
        snap = _dec.decode(p.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("fleet snapshot ignored path=%s err=%s", p, e)
        return None
    if snap.version != VERSION:
        log.warning("fleet snapshot ignored path=%s version=%d", p, snap.version)
        return None
    return snap


def write(state_dir: str | os.PathLike[str], data: bytes) -> None:
    atomic_write(Path(state_dir) / SNAPSHOT_FILE, data, 0o600)


class Recovery:
    """When a restarted placer's recovery ends (pure: the caller brings the clock and the
    facts). ``expected``: the snapshot's nodes (None: no snapshot)."""

    __slots__ = ("started", "window_s", "max_s", "_awaited", "expected", "snapshot")

    def __init__(self, expected: Iterable[str] | None, *, started: float, window_s: float, max_s: float) -> None:
        self.started = started
        self.window_s = window_s
        self.max_s = max(max_s, window_s)
        self.snapshot = expected is not None
        self._awaited = set(expected or ())
        self.expected = len(self._awaited)

    def heard(self, node_id: str) -> None:
        """``node_id`` registered (a full report taken) since the start."""
        self._awaited.discard(node_id)

    @property
    def unheard(self) -> int:
        return len(self._awaited)

    def until(self, now: float, *, jobs_complete: bool) -> float:
        """The time recovery ends, as known at ``now``. ``jobs_complete``: every job recovered
        from the journal has all its pods reported (nothing would be placed again)."""
        if not self.snapshot:
            return self.started + self.window_s
        if jobs_complete:   # nothing recovered would be placed again: unheard nodes cannot double it
            return now if not self._awaited else self.started + self.window_s
        return self.started + (self.max_s if self._awaited else self.window_s)
