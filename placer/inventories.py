"""The GPU inventories a placer has been told, kept on its own disk: compact re-registration.

Theory of operation
-------------------
After a placer restart every node registers again with a full report. Most of a full report
is the node's GPU snapshot (a DGX H100's is ~3.1 KB of its ~3.4 KB: UUIDs, names, PCI ids,
health), and at 131,072 nodes reading, checking and decoding those snapshots is most of what
the new process does before its model is whole. Yet the GPUs of a node whose agent kept
running did not change.

So the placer keeps, per node, the inventory it last registered: the boot, the UUIDs in
index order, the NVLink domain, whether they are simulated, and their digest
(:func:`scheduler_link.messages.gpu_inventory`). An agent whose full report was taken knows
the placer holds its inventory; its next full report -- a re-registration after a restart,
through its relay or directly -- leaves the snapshot out and names the digest (a *compact*
registration, ~0.5 KB). The placer rebuilds the node from what it stored when node, boot and
digest all match, every GPU and the host healthy (a node with anything to say about health
sends its snapshot, :func:`scheduler_link.messages.compact_ok`); anything else is answered
409 and the node sends its snapshot at once. A compact registration is as authenticated as a
full one (the node's own connection, or its MAC through a relay), and names only its own
node's record: it cannot claim another node's GPUs.

Storage: ``inventories.log`` in the state dir, chunks appended off the event loop at most once
a second (each chunk a length-prefixed msgpack list of records), rewritten whole when it holds
more than twice the live records (boots churn), and at load when its tail is torn. It is a
cache: a lost or damaged file costs full reports, never correctness (a missing entry is a 409
and a snapshot). ~0.4 KB a DGX node: ~50 MB at 131,072 nodes, loaded in well under a second.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import msgspec

from infra.durable import atomic_write

log = logging.getLogger("herd.placer.inventories")

INVENTORY_FILE = "inventories.log"
MAGIC = b"herd-inventories 1\n"
# Writes run in a worker thread; tests in virtual time turn this off (as placer.fleetsnap's).
WRITE_IN_THREAD = True
FLUSH_EVERY_S = 1.0
_LEN = struct.Struct("<I")
MAX_CHUNK = 1 << 30


class Inventory(msgspec.Struct, frozen=True, array_like=True):
    node_id: str
    boot_id: str
    digest: str
    uuids: list[str]
    simulated: bool = False
    nvlink_domain: str | None = None


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[Inventory])


def _chunk(records: list[Inventory]) -> bytes:
    body = _enc.encode(records)
    return _LEN.pack(len(body)) + body


class InventoryBook:
    """The inventories by node (in memory), and what is still to be appended to the file."""

    __slots__ = ("by_node", "_pending", "file_records", "rewrite")

    def __init__(self) -> None:
        self.by_node: dict[str, Inventory] = {}
        self._pending: list[Inventory] = []
        self.file_records = 0          # records in the file (live and superseded)
        self.rewrite = False           # the next write replaces the file whole (torn, foreign, failed)

    def match(self, node_id: str, boot_id: str, digest: str) -> Inventory | None:
        inv = self.by_node.get(node_id)
        return inv if inv is not None and inv.boot_id == boot_id and inv.digest == digest else None

    def note(self, inv: Inventory) -> None:
        """A full report's inventory was registered: kept (and appended later) if it is news."""
        if self.by_node.get(inv.node_id) != inv:
            self.by_node[inv.node_id] = inv
            self._pending.append(inv)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def take(self) -> tuple[bytes, bool]:
        """What to write now: (bytes, whole). ``whole``: the bytes are the entire file (it
        holds more than twice the live records); else a chunk to append."""
        if self.rewrite or self.file_records + len(self._pending) > 2 * len(self.by_node) + 4096:
            self.rewrite = False
            self._pending = []
            self.file_records = len(self.by_node)
            return MAGIC + _chunk(list(self.by_node.values())), True
        recs, self._pending = self._pending, []
        self.file_records += len(recs)
        return _chunk(recs), False

    @classmethod
    def load(cls, state_dir: str | os.PathLike[str]) -> InventoryBook:
        """The book in ``state_dir`` (empty if there is none or it is not ours). A torn tail
        (a placer killed mid-append) is dropped and the file rewritten whole."""
        book = cls()
        p = Path(state_dir) / INVENTORY_FILE
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return book
        except OSError as e:
            log.warning("inventories ignored path=%s err=%s", p, e)
            book.rewrite = True
            return book
        if not raw.startswith(MAGIC):
            log.warning("inventories ignored path=%s: not an inventory file of this version", p)
            book.rewrite = True
            return book
        at, n, torn = len(MAGIC), 0, False
        view = memoryview(raw)
        while at < len(raw):
            if at + _LEN.size > len(raw):
                torn = True
                break
            (size,) = _LEN.unpack_from(raw, at)
            end = at + _LEN.size + size
            if size > MAX_CHUNK or end > len(raw):
                torn = True
                break
            try:
                recs = _dec.decode(view[at + _LEN.size:end])
            except (msgspec.DecodeError, msgspec.ValidationError):
                torn = True
                break
            for r in recs:
                book.by_node[r.node_id] = r
            n += len(recs)
            at = end
        book.file_records = n
        if torn:
            log.warning("inventories: a torn tail dropped path=%s at=%d of=%d bytes", p, at, len(raw))
            book.rewrite = True
        log.info("inventories loaded nodes=%d records=%d", len(book.by_node), n)
        return book


def write(state_dir: str | os.PathLike[str], data: bytes, whole: bool) -> None:
    p = Path(state_dir) / INVENTORY_FILE
    if whole:
        atomic_write(p, data, 0o600)
        return
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size == 0:
            data = MAGIC + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
