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
it knows (up or lost: :func:`snapshot_ids`), rewritten (atomically, off the event loop) at most every ``SNAPSHOT_EVERY_S``
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
import time
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from infra.durable import atomic_write

from .errors import JournalError
from .etcd import Compare, EtcdClient, Op, prefix_end

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


def snapshot_ids(nodes: Iterable[str]) -> list[str]:
    """Whom a restarted placer waits for: every node it knows, up or lost. A lost node that is
    not fenced yet may hold pods of a running gang and come back with them; left out of the
    snapshot (as it was while it was lost: a loaded host's nodes flap), the gang looked partial
    after a restart once the others had reported, and was placed a second time."""
    return list(nodes)


def write(state_dir: str | os.PathLike[str], data: bytes) -> None:
    atomic_write(Path(state_dir) / SNAPSHOT_FILE, data, 0o600)


class Recovery:
    """When a restarted placer's recovery ends (pure: the caller brings the clock and the
    facts). ``expected``: the snapshot's nodes (None: no snapshot)."""

    __slots__ = ("started", "window_s", "max_s", "_awaited", "_heard", "expected", "snapshot", "pending")

    def __init__(self, expected: Iterable[str] | None, *, started: float, window_s: float, max_s: float,
                 pending: bool = False) -> None:
        self.started = started
        self.window_s = window_s
        self.max_s = max(max_s, window_s)
        self.snapshot = expected is not None
        self._awaited = set(expected or ())
        self._heard: set[str] = set()
        self.expected = len(self._awaited)
        # the snapshot is still being read (placers on etcd): held as if a node were unheard
        self.pending = pending

    def expect(self, nodes: Iterable[str] | None) -> None:
        """The snapshot, read after the start (a placer promoted on etcd); None: there is none."""
        self.pending = False
        if nodes is None:
            return
        ids = set(nodes)
        self.snapshot = True
        self.expected = len(ids)
        self._awaited = ids - self._heard

    def heard(self, node_id: str) -> None:
        """``node_id`` registered (a full report taken) since the start."""
        self._awaited.discard(node_id)
        if self.pending:
            self._heard.add(node_id)

    @property
    def unheard(self) -> int:
        return len(self._awaited)

    def until(self, now: float, *, jobs_complete: bool) -> float:
        """The time recovery ends, as known at ``now``. ``jobs_complete``: every job recovered
        from the journal has all its pods reported (nothing would be placed again)."""
        if self.pending:
            return self.started + (self.window_s if jobs_complete else self.max_s)
        if not self.snapshot:
            return self.started + self.window_s
        if jobs_complete:   # nothing recovered would be placed again: unheard nodes cannot double it
            return now if not self._awaited else self.started + self.window_s
        return self.started + (self.max_s if self._awaited else self.window_s)


# ---------------------------------------------------------------- in etcd (placers on etcd)

ETCD_CHUNK_BYTES = 1 << 20    # under etcd's 1.5 MiB request limit, with the fence's compare


class EtcdFleetSnapshot:
    """The fleet snapshot of placers on etcd, under ``prefix + b"fleet/"``: written by the
    leader (each write's transaction compares its leader key, as the jobs journal's do), read
    by a placer promoted to leader -- so a promoted follower waits for exactly the nodes the
    last leader had up, as a restarted single placer does with its file, instead of the bare
    ``recover_s`` (a gang whose nodes had not all reported within it was placed a second time).

    The snapshot (``encode``, zlib'd: node ids share their prefixes; ~0.4 MB at 131,072 nodes)
    is cut into chunks of at most ETCD_CHUNK_BYTES under ``fleet/<generation>/<i>/<n>``; a
    reader takes the newest generation whose chunks are all there (a leader deposed mid-write
    leaves an incomplete one, never a mixed one), and the writer drops older generations
    after a complete write."""

    def __init__(self, client: EtcdClient, prefix: bytes, fence: Any, *, chunk_bytes: int = ETCD_CHUNK_BYTES) -> None:
        self.client = client
        self.prefix = prefix + b"fleet/"
        self.fence = fence
        self.chunk_bytes = chunk_bytes
        self.generation = int(time.time() * 1000)
        self.writes = 0

    def _key(self, gen: int, i: int, n: int) -> bytes:
        return self.prefix + b"%016d/%06d/%06d" % (gen, i, n)

    async def save(self, data: bytes) -> None:
        """Write one snapshot (``encode``'s bytes); EtcdError or JournalError when it could not."""
        self.generation = max(self.generation + 1, int(time.time() * 1000))
        gen = self.generation
        z = zlib.compress(data, 1)
        chunks = [z[i:i + self.chunk_bytes] for i in range(0, len(z), self.chunk_bytes)] or [b""]
        fence = [Compare.created(self.fence.key, self.fence.epoch)]
        for i, c in enumerate(chunks):
            r = await self.client.txn(fence, [Op.put(self._key(gen, i, len(chunks)), c)])
            if not r.succeeded:
                raise JournalError(f"fleet snapshot not stored: this placer no longer leads (epoch {self.fence.epoch})")
        await self.client.txn(fence, [Op.delete(self.prefix, self.prefix + b"%016d" % gen)])   # the older ones
        self.writes += 1

    async def load(self) -> FleetSnapshot | None:
        """The newest complete snapshot in etcd, or None (none, or unreadable: logged)."""
        kvs = []
        start, end, revision = self.prefix, prefix_end(self.prefix), 0
        while True:
            r = await self.client.range(start, end, limit=64, revision=revision)
            revision = revision or r.revision
            kvs += r.kvs
            if not r.more or not r.kvs:
                break
            start = r.kvs[-1].key + b"\0"
        gens: dict[int, dict[int, bytes]] = {}
        counts: dict[int, int] = {}
        for kv in kvs:
            try:
                g, i, n = (int(x) for x in kv.key[len(self.prefix):].split(b"/"))
            except ValueError:
                continue
            gens.setdefault(g, {})[i] = kv.value
            counts[g] = n
        for g in sorted(gens, reverse=True):
            parts = gens[g]
            if len(parts) != counts[g] or set(parts) != set(range(counts[g])):
                continue   # (a write cut short: an older one may be whole)
            try:
                snap = _dec.decode(zlib.decompress(b"".join(parts[i] for i in range(counts[g]))))
            except (zlib.error, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("fleet snapshot in etcd ignored generation=%d err=%s", g, e)
                continue
            if snap.version == VERSION:
                return snap
        return None
