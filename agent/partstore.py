"""Accepted NodeParts on disk: one small file per part under ``<state>/parts`` (agent.parts).

Written (temp, fsync, rename, fsync dir: :func:`agent.state.atomic_write`) before an
acceptance is answered, rewritten when the part is handed over or fails, and read back at
start so a restarted agent hands over what it accepted. Files are named by a hash of the
placement id, so any id is a safe file name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import blake3
import msgspec

from scheduler_link.messages import NodePart, PodAssignment, Victim

from .state import atomic_write

log = logging.getLogger("herd.agent.parts")

PART_VERSION = 1

PartState = Literal["accepted", "placed", "failed"]


class PartRecord(msgspec.Struct, frozen=True, kw_only=True):
    version: int = PART_VERSION
    part: NodePart
    pods: list[PodAssignment] = []       # with UUIDs
    state: PartState = "accepted"
    accepted_at: float = 0.0
    detail: str | None = None
    # stops that named this part's pods before they were handed over (a rollback that
    # overtook the blob): applied right after the hand-over, so nothing starts again
    stopped: list[Victim] = []


_rec_dec = msgspec.msgpack.Decoder(PartRecord)
_rec_enc = msgspec.msgpack.Encoder()


class PartStore:
    """One small file per accepted part under ``<state>/parts`` (named by a hash of the
    placement id, so any id is a safe file name)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir) / "parts"
        self.writes = 0

    def _path(self, placement_id: str) -> Path:
        return self.dir / (blake3.blake3(placement_id.encode()).hexdigest(length=16) + ".part")

    def load(self) -> list[PartRecord]:
        out: list[PartRecord] = []
        if not self.dir.is_dir():
            return out
        for p in self.dir.glob("*.part"):
            try:
                r = _rec_dec.decode(p.read_bytes())
                if r.version != PART_VERSION:
                    raise msgspec.ValidationError(f"part record version {r.version}")
                out.append(r)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("part record unreadable, ignored path=%s err=%s", p, e)
        out.sort(key=lambda r: r.accepted_at)
        return out

    def save(self, recs: Sequence[PartRecord]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for r in recs:
            atomic_write(self._path(r.part.placement_id), _rec_enc.encode(r))
            self.writes += 1

    def remove(self, placement_ids: Sequence[str]) -> None:
        for pid in placement_ids:
            self._path(pid).unlink(missing_ok=True)
