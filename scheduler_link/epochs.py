"""Placer epochs (fencing tokens): what a receiver keeps so a replaced placer can act on nothing.

Theory of operation (DESIGN.md, Availability and fencing)
--------------------------------------------------------
Every placer term has an *epoch*, greater than every earlier one: a single placer counts its
starts in its state dir (:class:`EpochFile`, read, +1, written and fsynced before it listens);
with etcd the leader's epoch is its leader key's create revision (placer.election). Everything
a placer sends that makes a node act carries it: report and beat answers, direct placements,
rack bundles (in the signed header), the stops in answers (under their MAC) and its frames'
``term``.

A receiver (an agent, a rack relay: the same node keeps one) holds the highest epoch it has
seen, durably, in ``<state dir>/placer-epoch`` next to its part store. :class:`EpochGate` is
the decision and nothing else: :meth:`EpochGate.check` says ``ok`` (the highest, or no epoch
seen yet), ``newer`` (higher: the receiver must make it durable before acting on it) or
``stale`` (older: refused, with the structured outcome ``stale_epoch``, never by words).
:class:`Epochs` carries it out for a daemon: a newer epoch is written (temp, fsync, rename,
fsync dir) before the message is acted on, so a receiver that restarts refuses what it
refused before it stopped; a stale one is counted by kind. A node's parts, placement API, link
and relay share its one :class:`Epochs`; every call is synchronous (no await inside), so each
check-and-write is one step that no other task can interleave with.

Epoch 0 means "a placer without epochs" (an older placer, or a message that has none). It is
accepted only while the receiver has seen no epoch; once it has seen one, 0 is stale like any
other older epoch (were it not, a replaced placer could void the fence by sending 0).

Invariants (tests/test_epochs.py checks them over interleavings of messages of several epochs):
- nothing older than the highest epoch seen is ever accepted; equal epochs are;
- the highest only grows, and survives a reload from disk;
- a newer epoch that cannot be made durable is not accepted (``admit`` raises OSError: the
  message is not acted on).

Only authenticated epochs may raise the highest: a signed bundle header, a MAC-covered stop,
an answer or placement over the placer's own (TLS) connection. A relay could otherwise lock a
member out by inventing a huge epoch; an unauthenticated epoch is only compared
(:meth:`Epochs.compare`), never taken.
"""

from __future__ import annotations

import enum
import logging
import os
from pathlib import Path

import msgspec

from infra.durable import atomic_write

log = logging.getLogger("herd.link.epochs")

EPOCH_FILE = "placer-epoch"
EPOCH_FILE_VERSION = 1


class Check(enum.Enum):
    OK = "ok"          # the highest seen (or none seen yet and none given)
    NEWER = "newer"    # higher than any seen: durable first, then act
    STALE = "stale"    # older than the highest seen: refused (outcome ``stale_epoch``)


class EpochGate:
    """The highest placer epoch seen, and the check against it (pure: no I/O, no clock)."""

    __slots__ = ("highest",)

    def __init__(self, highest: int = 0) -> None:
        if highest < 0:
            raise ValueError(f"an epoch is >= 0, not {highest}")
        self.highest = highest

    def check(self, epoch: int) -> Check:
        if epoch > self.highest:
            return Check.NEWER
        if epoch == self.highest:
            return Check.OK
        return Check.STALE

    def advance(self, epoch: int) -> None:
        """``epoch`` is the highest seen from now on (never lowers it)."""
        if epoch > self.highest:
            self.highest = epoch


class _Stored(msgspec.Struct, frozen=True, kw_only=True):
    epoch: int
    version: int = EPOCH_FILE_VERSION


_dec = msgspec.json.Decoder(_Stored)


class EpochFile:
    """One epoch in a small durable file (JSON with a version; 0644: it is no secret)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> int:
        """The stored epoch (0 when there is no file). A file that does not parse is an error:
        guessing 0 would void the fence."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        try:
            st = _dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"{self.path}: not an epoch file ({e}); remove it only if no placer "
                             "of a higher epoch can exist") from None
        if st.version != EPOCH_FILE_VERSION or st.epoch < 0:
            raise ValueError(f"{self.path}: unsupported epoch file (version {st.version}, epoch {st.epoch})")
        return st.epoch

    def save(self, epoch: int) -> None:
        """Written and fsynced (file and directory) before this returns."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, msgspec.json.encode(_Stored(epoch=epoch)), 0o644)

    def next(self) -> int:
        """A placer start: the stored epoch plus one, durable before this returns."""
        epoch = self.load() + 1
        self.save(epoch)
        return epoch


class Epochs:
    """A receiver's gate with its durable file (``path`` None: in memory only, e.g. emulated
    nodes), and the stale messages refused by kind (``placement``, ``part``, ``bundle``,
    ``stop``, ``reply``)."""

    __slots__ = ("file", "gate", "raised", "stale")

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.file = EpochFile(path) if path is not None else None
        self.gate = EpochGate(self.file.load() if self.file is not None else 0)
        self.stale: dict[str, int] = {}
        self.raised = 0

    @classmethod
    def in_state_dir(cls, state_dir: str | os.PathLike[str]) -> Epochs:
        return cls(Path(state_dir) / EPOCH_FILE)

    @property
    def highest(self) -> int:
        return self.gate.highest

    def compare(self, epoch: int) -> Check:
        """The check alone, for an epoch nothing authenticates (it is never taken)."""
        return self.gate.check(epoch)

    def admit(self, epoch: int, kind: str) -> bool:
        """An authenticated message of ``epoch``: True when it may be acted on (a newer epoch
        is durable by then), False when it is stale (counted under ``kind``). Raises OSError
        when a newer epoch cannot be written: the message must not be acted on."""
        c = self.gate.check(epoch)
        if c is Check.STALE:
            self.refused(kind)
            return False
        if c is Check.NEWER:
            if self.file is not None:
                try:
                    self.file.save(epoch)
                except OSError as e:
                    log.error("placer epoch not written epoch=%d err=%s", epoch, e)
                    raise
            log.info("placer epoch raised from=%d to=%d by=%s", self.gate.highest, epoch, kind)
            self.gate.advance(epoch)
            self.raised += 1
        return True

    def refused(self, kind: str, n: int = 1) -> None:
        """Count ``n`` stale messages of ``kind``."""
        self.stale[kind] = self.stale.get(kind, 0) + n
        log.warning("stale placer epoch refused kind=%s highest=%d", kind, self.gate.highest)

    def statistics(self) -> dict[str, object]:
        return {"epoch": self.gate.highest, "raised": self.raised, "stale": dict(self.stale)}
