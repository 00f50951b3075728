"""The chunk store on local disk.

Layout under ``root``::

    chunks/ab/<hex>     one file per chunk, named by its BLAKE3 id
    manifests/<id>      canonical manifest bytes, verified by id on the way in
    complete/<id>       empty marker: every chunk of <id> was present and synced
    artifacts/<id>/     materialised (read-only) trees
    tmp/                temp files; anything here at open is a leftover and removed

Invariants:

- A file under ``chunks/`` always holds the bytes its name promises: chunks are
  verified before they are written, written to ``tmp/`` and renamed into place.
- Durability is batched (DESIGN.md, Contracts): ``put_chunk`` does not fsync;
  ``sync()`` fsyncs every chunk written since the last sync and the directories
  that received them. ``mark_complete`` calls ``sync()`` before it writes the
  marker, so a complete manifest survives a crash.
- Chunks of pinned manifests (``pin``; in-memory refcounts, e.g. a fetch in
  progress or a running workload) and of materialised manifests are never
  evicted. Everything else is evicted least-recently-used first when the
  quota's high watermark would be crossed, down to the low watermark.
- LRU access times live in memory, seeded from file mtimes at open.

The API is synchronous (plain file operations) and thread-safe; async callers
run bulk work in ``trio.to_thread``. ``on_chunk_added`` callbacks run in the
thread that stored the chunk, after the chunk is visible.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from blake3 import blake3

from infra.durable import atomic_write, fill_and_replace, fsync_dir, temp_name
from manifests import Manifest, decode_manifest
from manifests.materialise import materialise as materialise_tree

from .errors import IntegrityError, ManifestError, StoreError, StoreFullError

log = logging.getLogger("herd.p2p.store")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def check_id(value: str, what: str = "chunk id") -> str:
    """Return ``value`` if it is a 64-hex-digit lower-case id, else raise StoreError."""
    if not isinstance(value, str) or not _HEX64.match(value):
        raise StoreError(f"invalid {what}: {value!r:.80}")
    return value


def manifest_chunks(manifest: Manifest) -> dict[str, int]:
    """The unique chunks a manifest needs: id -> size."""
    return {c.id: c.size for c in manifest.chunks}


class StoreStatistics(msgspec.Struct, frozen=True, kw_only=True):
    root: str
    chunks: int
    bytes: int
    pinned_chunks: int
    pinned_bytes: int
    manifests: int
    complete_manifests: int
    materialised: int
    pins: int
    chunks_added: int
    bytes_added: int
    evictions: int
    evicted_bytes: int
    quota_bytes: int | None
    high_watermark: float
    low_watermark: float
    pending_sync: int


class HeldManifest(msgspec.Struct, frozen=True, kw_only=True):
    """One manifest this store holds (``herd store ls``)."""
    manifest_id: str
    bytes: int                 # the artifact's size (its files)
    chunk_bytes: int           # its unique chunks' bytes
    present_bytes: int         # of those, held here
    complete: bool
    materialised: bool
    pinned: bool               # a fetch or a workload holds it: not evictable
    last_used: float           # unix seconds: last pinned, unpinned, materialised or completed


class EvictReport(msgspec.Struct, frozen=True, kw_only=True):
    manifests: list[str]
    chunks: int
    bytes_freed: int
    refused: dict[str, str] = {}   # manifest id -> why it stayed


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    chunks_checked: int
    bytes_checked: int
    bad_chunks: list[str]
    manifests_checked: int
    bad_manifests: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.bad_chunks and not self.bad_manifests


_PID_IN_NAME = re.compile(r"\.p(\d+)\.|\.partial-(\d+)-")


def _temp_name(prefix: str) -> str:
    """A unique temp name that records the writing process: ``<prefix>.p<pid>.<random>``."""
    return f"{prefix}.p{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _writer_alive(name: str) -> bool:
    """True if ``name`` is a temp name of a process that still runs (so not a leftover).
    Our own pid counts as alive: another ChunkStore of this process may be writing."""
    m = _PID_IN_NAME.search(name)
    if m is None:
        return False
    pid = int(m.group(1) or m.group(2))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _full(e: OSError, what: str) -> StoreFullError:
    return StoreFullError(f"store disk full while writing {what}: {os.strerror(e.errno or errno.ENOSPC)}")


def _rmtree_force(path: Path) -> None:
    """Remove a tree even if it was made read-only (materialised trees are)."""
    def onerror(func: Callable[..., Any], p: str, exc: Any) -> None:
        parent = os.path.dirname(p)
        try:
            os.chmod(parent, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except FileNotFoundError:
            pass

    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    try:
        os.chmod(path, 0o700)
    except FileNotFoundError:
        return
    shutil.rmtree(path, onerror=onerror)


def _chmod_if_owned(path: Path, mode: int) -> None:
    st = os.stat(path)
    if st.st_uid == os.geteuid() and (st.st_mode & 0o777) != mode:
        os.chmod(path, mode)


class ChunkStore:
    """Content-addressed chunks, manifests and materialised trees under one root."""

    def __init__(self, root: str | os.PathLike[str], *, quota_bytes: int | None = None,
                 high_watermark: float = 0.9, low_watermark: float = 0.8) -> None:
        if not (0.0 < low_watermark <= high_watermark <= 1.0):
            raise StoreError(f"watermarks must satisfy 0 < low <= high <= 1 (got {low_watermark}, {high_watermark})")
        if quota_bytes is not None and quota_bytes <= 0:
            raise StoreError(f"quota must be positive (got {quota_bytes})")
        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.on_chunk_added: list[Callable[[str], None]] = []
        self.on_manifest_added: list[Callable[[str], None]] = []   # after put_manifest (any thread)
        # Owned by the trio thread of async fetchers: chunk id -> in-flight marker
        # (single-flight across concurrent fetches into this store).
        self.inflight: dict[str, Any] = {}

        self._lock = threading.RLock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._bytes = 0
        self._reserved = 0
        self._pending_files: list[str] = []
        self._pending_dirs: set[str] = set()
        self._pins: Counter[str] = Counter()
        self._manifests: dict[str, Manifest] = {}
        self._complete: set[str] = set()
        self._materialised: set[str] = set()
        self._chunks_added = 0
        self._bytes_added = 0
        self._evictions = 0
        self._evicted_bytes = 0
        self._used: dict[str, float] = {}   # manifest id -> last use (seeded from the manifest file's mtime)
        # sync()'s fsync threads, kept for the store's life: a pool made per sync started
        # SYNC_THREADS threads every 64 MiB a fetch stored (~0.05 CPU-s per GiB here)
        self._sync_pool: ThreadPoolExecutor | None = None
        self._chunks_s = str(self.chunks_dir)
        self._tmp_s = str(self.tmp_dir)
        self._tmp_seq = itertools.count(int.from_bytes(os.urandom(4), "big") << 16)
        self._open()

    # ----------------------------------------------------------------- open

    @property
    def chunks_dir(self) -> Path:
        return self.root / "chunks"

    @property
    def manifests_dir(self) -> Path:
        return self.root / "manifests"

    @property
    def artifacts_dir(self) -> Path:
        return self.root / "artifacts"

    @property
    def tmp_dir(self) -> Path:
        return self.root / "tmp"

    @property
    def complete_dir(self) -> Path:
        return self.root / "complete"

    def _open(self) -> None:
        try:
            for d in (self.chunks_dir, self.manifests_dir, self.artifacts_dir, self.tmp_dir, self.complete_dir):
                d.mkdir(parents=True, exist_ok=True)
            for i in range(256):
                (self.chunks_dir / f"{i:02x}").mkdir(exist_ok=True)
            # Workloads reach their materialised tree by path (root and artifacts/ are
            # traverse-only, the trees 0555/0444); chunks, manifests and temp files are
            # the store owner's alone (0700), chunk files 0444.
            _chmod_if_owned(self.root, 0o711)
            _chmod_if_owned(self.artifacts_dir, 0o711)
            for d in (self.chunks_dir, self.manifests_dir, self.tmp_dir, self.complete_dir):
                _chmod_if_owned(d, 0o700)
        except OSError as e:
            if e.errno in _FULL_ERRNOS:
                raise _full(e, "the store layout") from None
            raise StoreError(f"cannot open store at {self.root}: {e.strerror or e}") from None
        # Leftovers of interrupted writes. Temp names carry the writer's pid: another live
        # process using this store (an agent while `herd artifact verify` runs) keeps its own.
        removed = 0
        for entry in os.scandir(self.tmp_dir):
            if not _writer_alive(entry.name):
                _rmtree_force(Path(entry.path))
                removed += 1
        for entry in os.scandir(self.artifacts_dir):
            if _HEX64.match(entry.name):
                self._materialised.add(entry.name)
            elif not _writer_alive(entry.name):  # a materialisation that never got renamed into place
                _rmtree_force(Path(entry.path))
                removed += 1
        for entry in os.scandir(self.manifests_dir):
            if not _HEX64.match(entry.name):
                os.unlink(entry.path)
                removed += 1
        # Chunk index, oldest first.
        found: list[tuple[float, str, int]] = []
        for sub in os.scandir(self.chunks_dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if not _HEX64.match(entry.name) or entry.name[:2] != sub.name:
                    os.unlink(entry.path)
                    removed += 1
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        for _, cid, size in found:
            self._lru[cid] = size
            self._bytes += size
        for entry in os.scandir(self.complete_dir):
            if _HEX64.match(entry.name) and (self.manifests_dir / entry.name).exists():
                self._complete.add(entry.name)
            else:
                os.unlink(entry.path)
        if removed:
            log.info("store opened root=%s removed_leftovers=%d", self.root, removed)
        log.debug("store opened root=%s chunks=%d bytes=%d", self.root, len(self._lru), self._bytes)

    # --------------------------------------------------------------- chunks

    def chunk_path(self, chunk_id: str) -> Path:
        check_id(chunk_id)
        return self.chunks_dir / chunk_id[:2] / chunk_id

    def has_chunk(self, chunk_id: str) -> bool:
        return chunk_id in self._lru

    def chunk_size(self, chunk_id: str) -> int | None:
        return self._lru.get(chunk_id)

    def touch(self, chunk_id: str) -> None:
        with self._lock:
            if chunk_id in self._lru:
                self._lru.move_to_end(chunk_id)

    def read_chunk(self, chunk_id: str) -> bytes:
        """The chunk's bytes (not re-verified: verified on the way in). StoreError if absent."""
        path = self.chunk_path(chunk_id)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise StoreError(f"chunk {chunk_id} is not in the store") from None
        self.touch(chunk_id)
        return data

    def put_chunk(self, chunk_id: str, data: bytes | bytearray | memoryview, *, verified: bool = False) -> bool:
        """Verify and store a chunk. Returns False if it was already present.

        Raises IntegrityError (nothing stored) when ``data`` does not hash to
        ``chunk_id``, StoreFullError when the disk or quota is full. ``verified``:
        the caller has just hashed ``data`` itself; skip hashing it again.
        """
        check_id(chunk_id)
        if chunk_id in self._lru:
            self.touch(chunk_id)
            return False
        if not verified and blake3(data).hexdigest() != chunk_id:
            raise IntegrityError(f"chunk {chunk_id} does not match its hash ({len(data)} bytes received)")
        size = len(data)
        self._reserve(size)
        try:
            # no fsync here: chunks are synced in batches (sync()) before a manifest is marked complete
            final = self._write_chunk_file(chunk_id, data)
        except OSError as e:
            with self._lock:
                self._reserved -= size
            if e.errno in _FULL_ERRNOS:
                raise _full(e, f"chunk {chunk_id[:16]}") from None
            raise
        with self._lock:
            self._reserved -= size
            if chunk_id in self._lru:  # another thread stored it concurrently: same bytes
                return False
            self._lru[chunk_id] = size
            self._bytes += size
            self._chunks_added += 1
            self._bytes_added += size
            self._pending_files.append(final)
            self._pending_dirs.add(final[: -len(chunk_id) - 1])
        for hook in list(self.on_chunk_added):
            try:
                hook(chunk_id)
            except Exception:
                log.exception("on_chunk_added hook failed chunk=%s", chunk_id)
        return True

    def _write_chunk_file(self, chunk_id: str, data: bytes | bytearray | memoryview) -> str:
        """:func:`infra.durable.atomic_write` of a chunk (read-only, through the
        temp dir, no fsync), on string paths: pathlib and a random name per chunk were
        ~35 us of the ~45 a 4 KiB put took (cProfile). The temp name has the same shape
        (``.<id>.p<pid>.<12 hex>``: a per-store counter for the random part, the next one
        where a leftover holds it). Returns the chunk file's path."""
        final = f"{self._chunks_s}/{chunk_id[:2]}/{chunk_id}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            tmp = f"{self._tmp_s}/{temp_name(chunk_id, f'{next(self._tmp_seq):012x}')}"
            try:
                fd = os.open(tmp, flags, 0o600)
                break
            except FileExistsError:
                continue
        fill_and_replace(fd, tmp, final, data, 0o444, sync=False)
        return final

    def sync(self) -> int:
        """fsync every chunk written since the last sync, then their directories.
        Returns the number of files synced.

        The fsyncs run on a small thread pool: the filesystem batches concurrent
        fsyncs into few journal commits (about 6x faster than one after another here).
        """
        with self._lock:
            files, self._pending_files = self._pending_files, []
            dirs, self._pending_dirs = self._pending_dirs, set()
        pool = None
        if len(files) > 2 or len(dirs) > 2:
            with self._lock:
                if self._sync_pool is None:
                    self._sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="herd-fsync")
                    weakref.finalize(self, self._sync_pool.shutdown, wait=False)
                pool = self._sync_pool
        try:
            fsync_paths(files, missing_ok=True, pool=pool)
            fsync_paths(sorted(dirs), directory=True, pool=pool)
        except OSError as e:
            with self._lock:  # keep them pending: a later sync retries
                self._pending_files.extend(files)
                self._pending_dirs.update(dirs)
            if e.errno in _FULL_ERRNOS:
                raise _full(e, "chunk files (fsync)") from None
            raise
        return len(files)

    # ------------------------------------------------------- quota/eviction

    def _protected(self) -> set[str]:
        keep: set[str] = set()
        for mid in set(self._pins) | self._materialised:
            try:
                keep.update(manifest_chunks(self.get_manifest(mid)))
            except StoreError:
                continue
        return keep

    def _reserve(self, size: int) -> None:
        if self.quota_bytes is None:
            return
        with self._lock:
            quota = self.quota_bytes
            used = self._bytes + self._reserved
            if used + size > self.high_watermark * quota:
                self._evict_locked(target=int(self.low_watermark * quota) - size)
                used = self._bytes + self._reserved
            if used + size > quota:
                raise StoreFullError(
                    f"store quota of {quota} bytes is full: {used} bytes held, "
                    f"{self._pinned_bytes_locked()} of them pinned; cannot add {size} bytes")
            self._reserved += size

    def _pinned_bytes_locked(self) -> int:
        return sum(self._lru.get(c, 0) for c in self._protected())

    def _evict_locked(self, target: int) -> None:
        protected = self._protected()
        victims: list[str] = []
        used = self._bytes + self._reserved
        for cid, size in self._lru.items():
            if used <= target:
                break
            if cid in protected:
                continue
            victims.append(cid)
            used -= size
        if victims:
            self._drop_chunks_locked(victims)
            self._evictions += len(victims)
            log.info("evicted chunks=%d bytes_now=%d quota=%s", len(victims), self._bytes, self.quota_bytes)

    def _drop_chunks_locked(self, ids: Iterable[str], *, evicted: bool = True) -> int:
        gone: set[str] = set()
        freed = 0
        for cid in ids:
            size = self._lru.pop(cid, None)
            if size is None:
                continue
            try:
                os.unlink(self.chunks_dir / cid[:2] / cid)
            except FileNotFoundError:
                pass
            self._bytes -= size
            freed += size
            gone.add(cid)
        if evicted:
            self._evicted_bytes += freed
        if gone:  # manifests that needed them are no longer complete
            for mid in list(self._complete):
                try:
                    needs = manifest_chunks(self.get_manifest(mid))
                except StoreError:
                    needs = {}
                if not gone.isdisjoint(needs):
                    self._complete.discard(mid)
                    try:
                        os.unlink(self.complete_dir / mid)
                    except FileNotFoundError:
                        pass
        return freed

    def evict(self, target_bytes: int) -> int:
        """Evict unprotected chunks, LRU first, until at most ``target_bytes`` are held.
        Returns the number of bytes freed."""
        with self._lock:
            before = self._bytes
            self._evict_locked(target_bytes)
            return before - self._bytes

    # -------------------------------------------------------------- pins

    def pin(self, manifest_id: str) -> None:
        """Protect a manifest's chunks from eviction (refcounted, in memory)."""
        check_id(manifest_id, "manifest id")
        with self._lock:
            self._pins[manifest_id] += 1
        self._mark_used(manifest_id)

    def unpin(self, manifest_id: str) -> None:
        with self._lock:
            if self._pins[manifest_id] <= 1:
                self._pins.pop(manifest_id, None)
            else:
                self._pins[manifest_id] -= 1
        self._mark_used(manifest_id)

    def _mark_used(self, manifest_id: str) -> None:
        """Last use, in memory and (so it survives a restart) as the manifest file's mtime."""
        now = time.time()
        self._used[manifest_id] = now
        try:
            os.utime(self.manifests_dir / manifest_id, (now, now))
        except OSError:  # not stored yet, or not ours to touch
            pass

    def pinned(self) -> list[str]:
        return sorted(set(self._pins) | self._materialised)

    # ---------------------------------------------------------- manifests

    def has_manifest(self, manifest_id: str) -> bool:
        return manifest_id in self._manifests or (self.manifests_dir / check_id(manifest_id, "manifest id")).exists()

    def put_manifest(self, manifest_id: str, data: bytes) -> Manifest:
        """Verify ``data`` against ``manifest_id`` (and validate it), then store it durably."""
        check_id(manifest_id, "manifest id")
        manifest = decode_manifest(data, manifest_id)
        path = self.manifests_dir / manifest_id
        if not path.exists():
            _atomic_write(path, data, self.tmp_dir, what=f"manifest {manifest_id[:16]}")
        with self._lock:
            self._manifests[manifest_id] = manifest
        for hook in list(self.on_manifest_added):
            try:
                hook(manifest_id)
            except Exception:
                log.exception("on_manifest_added hook failed manifest=%s", manifest_id)
        return manifest

    def manifest_bytes(self, manifest_id: str) -> bytes:
        try:
            return (self.manifests_dir / check_id(manifest_id, "manifest id")).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"manifest {manifest_id} is not in the store") from None

    def get_manifest(self, manifest_id: str) -> Manifest:
        m = self._manifests.get(manifest_id)
        if m is not None:
            return m
        data = self.manifest_bytes(manifest_id)
        try:
            m = decode_manifest(data, manifest_id)
        except (ManifestError, IntegrityError) as e:
            raise StoreError(f"stored manifest {manifest_id} is damaged ({e}); run `herd artifact verify`") from None
        with self._lock:
            self._manifests[manifest_id] = m
        return m

    def missing_chunks(self, manifest: Manifest) -> list[str]:
        return [c for c in manifest_chunks(manifest) if c not in self._lru]

    def mark_complete(self, manifest_id: str) -> None:
        """Sync pending chunks, then record that every chunk of the manifest is held."""
        m = self.get_manifest(manifest_id)
        missing = self.missing_chunks(m)
        if missing:
            raise StoreError(f"manifest {manifest_id} is not complete: {len(missing)} chunks missing")
        self.sync()
        if manifest_id in self._complete:
            return
        _atomic_write(self.complete_dir / manifest_id, b"", self.tmp_dir, what="completion marker")
        with self._lock:
            self._complete.add(manifest_id)
        self._mark_used(manifest_id)

    def is_complete(self, manifest_id: str) -> bool:
        return manifest_id in self._complete

    def complete_manifests(self) -> list[str]:
        return sorted(self._complete)

    def manifest_ids(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.manifests_dir) if _HEX64.match(e.name))

    # -------------------------------------------------------- materialise

    def artifact_path(self, manifest_id: str) -> Path:
        return self.artifacts_dir / check_id(manifest_id, "manifest id")

    def is_materialised(self, manifest_id: str) -> bool:
        return manifest_id in self._materialised

    def materialise(self, manifest_id: str, *, sync: bool = True) -> Path:
        """Build (once) the read-only tree of a complete manifest under ``artifacts/<id>``.

        Files whose chunk lists match a file in another materialised tree are
        hard-linked from it. The tree's chunks are then protected from eviction
        until ``remove_artifact``. With ``sync`` (default) the tree is fsynced
        before it is renamed into place, so a visible tree is a whole tree even
        after a crash.
        """
        dest = self.artifact_path(manifest_id)
        if manifest_id in self._materialised and dest.is_dir():
            return dest
        m = self.get_manifest(manifest_id)
        missing = self.missing_chunks(m)
        if missing:
            raise StoreError(f"cannot materialise {manifest_id}: {len(missing)} chunks missing")
        link_from: dict[str, tuple[Path, Manifest]] = {}
        for other in sorted(self._materialised):
            try:
                link_from[other] = (self.artifact_path(other), self.get_manifest(other))
            except StoreError:
                continue
        try:
            if not sync:
                materialise_tree(m, chunk_path=self.chunk_path, dest=dest, link_from=link_from)
            else:
                # Build under tmp/ (same filesystem, so links work and leftovers are
                # swept at open), fsync the whole tree concurrently, then rename it
                # into place: a visible tree is a whole tree, even after a crash.
                private = self.tmp_dir / _temp_name(f"mat-{manifest_id[:16]}")
                try:
                    materialise_tree(m, chunk_path=self.chunk_path, dest=private / "tree", link_from=link_from)
                    fsync_tree(private / "tree")
                    try:
                        os.rename(private / "tree", dest)
                    except OSError as e:
                        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not dest.is_dir():
                            raise  # else: a concurrent materialise won; same content
                    fsync_dir(self.artifacts_dir)
                finally:
                    _rmtree_force(private)
        except OSError as e:
            if e.errno in _FULL_ERRNOS:
                raise _full(e, f"the tree of {manifest_id[:16]}") from None
            raise
        with self._lock:
            self._materialised.add(manifest_id)
        for cid in manifest_chunks(m):
            self.touch(cid)
        self._mark_used(manifest_id)
        return dest

    def materialised(self) -> list[str]:
        """Manifest ids whose trees are materialised here."""
        with self._lock:
            return sorted(self._materialised)

    def remove_artifact(self, manifest_id: str) -> bool:
        """Remove a materialised tree (its chunks become evictable unless pinned)."""
        dest = self.artifact_path(manifest_id)
        if manifest_id in self._pins:
            raise StoreError(f"artifact {manifest_id} is pinned (in use); unpin it first")
        with self._lock:
            self._materialised.discard(manifest_id)
        if not dest.exists():
            return False
        doomed = self.tmp_dir / _temp_name(f"rm-{manifest_id[:16]}")
        os.rename(dest, doomed)
        _rmtree_force(doomed)
        return True

    # ------------------------------------------------- listing and eviction

    def manifest_progress(self, manifest_id: str) -> tuple[int, int] | None:
        """(bytes of its unique chunks held here, their total), or None if the manifest is not here."""
        try:
            need = manifest_chunks(self.get_manifest(manifest_id))
        except StoreError:
            return None
        held = self._lru
        return sum(s for c, s in need.items() if c in held), sum(need.values())

    def held(self, in_use: Iterable[str] = ()) -> list[HeldManifest]:
        """Every manifest stored here. ``in_use``: manifests the caller's workloads use
        (shown pinned, as the store's own pins are)."""
        busy = set(in_use)
        out: list[HeldManifest] = []
        for mid in self.manifest_ids():
            try:
                m = self.get_manifest(mid)
            except StoreError:
                continue
            need = manifest_chunks(m)
            used = self._used.get(mid)
            if used is None:
                try:
                    used = os.stat(self.manifests_dir / mid).st_mtime
                except FileNotFoundError:
                    continue
            out.append(HeldManifest(
                manifest_id=mid, bytes=m.total_size, chunk_bytes=sum(need.values()),
                present_bytes=sum(s for c, s in need.items() if c in self._lru), complete=mid in self._complete,
                materialised=mid in self._materialised, pinned=mid in self._pins or mid in busy, last_used=used))
        return out

    def evict_manifests(self, ids: Iterable[str] | None, in_use: Iterable[str] = ()) -> EvictReport:
        """Remove manifests with their trees and every chunk no other manifest held here
        names. ``ids`` None: every manifest not pinned nor in ``in_use``, and chunks no
        manifest names. A pinned or in-use manifest stays (named in ``refused``)."""
        busy = set(in_use)
        with self._lock:
            held = set(self.manifest_ids())
            wanted = held if ids is None else set(ids)
            refused: dict[str, str] = {}
            doomed: list[str] = []
            for mid in sorted(wanted):
                if mid not in held:
                    refused[mid] = "not in this store"
                elif mid in self._pins or mid in busy:
                    refused[mid] = "in use (a fetch or a workload holds it)"
                else:
                    doomed.append(mid)
            keep_chunks: set[str] = set()
            for mid in held - set(doomed):
                try:
                    keep_chunks.update(manifest_chunks(self.get_manifest(mid)))
                except StoreError:
                    continue
            drop: set[str] = set()
            for mid in doomed:
                try:
                    drop.update(c for c in manifest_chunks(self.get_manifest(mid)) if c not in keep_chunks)
                except StoreError:
                    pass
            if ids is None:  # unused: chunks no manifest here names
                drop.update(c for c in self._lru if c not in keep_chunks)
            for mid in doomed:
                if mid in self._materialised:
                    self.remove_artifact(mid)
                self._manifests.pop(mid, None)
                self._complete.discard(mid)
                self._used.pop(mid, None)
                for path in (self.complete_dir / mid, self.manifests_dir / mid):
                    path.unlink(missing_ok=True)
            n = sum(1 for c in drop if c in self._lru)
            freed = self._drop_chunks_locked(drop, evicted=True)
            self._evictions += n
        log.info("evicted manifests=%d chunks=%d bytes=%d refused=%d", len(doomed), n, freed, len(refused))
        return EvictReport(manifests=doomed, chunks=n, bytes_freed=freed, refused=refused)

    # --------------------------------------------------------------- verify

    def verify(self) -> VerifyReport:
        """Re-hash every chunk and manifest; drop the bad ones and report them."""

        t0 = time.perf_counter()
        bad: list[str] = []
        checked = 0
        nbytes = 0
        for cid in list(self._lru):
            try:
                with open(self.chunks_dir / cid[:2] / cid, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                bad.append(cid)
                continue
            checked += 1
            nbytes += len(data)
            if blake3(data).hexdigest() != cid:
                bad.append(cid)
        if bad:
            log.info("verify dropped bad chunks=%d", len(bad))
            with self._lock:
                self._drop_chunks_locked(bad, evicted=False)
        bad_manifests: list[str] = []
        mids = self.manifest_ids()
        for mid in mids:
            try:
                decode_manifest(self.manifest_bytes(mid), mid)
            except (ManifestError, IntegrityError, StoreError):
                bad_manifests.append(mid)
                with self._lock:
                    self._manifests.pop(mid, None)
                    self._complete.discard(mid)
                for p in (self.manifests_dir / mid, self.complete_dir / mid):
                    p.unlink(missing_ok=True)
        return VerifyReport(chunks_checked=checked, bytes_checked=nbytes, bad_chunks=bad,
                            manifests_checked=len(mids), bad_manifests=bad_manifests,
                            seconds=time.perf_counter() - t0)

    # ----------------------------------------------------------- statistics

    def statistics(self) -> StoreStatistics:
        with self._lock:
            protected = self._protected()
            pinned_bytes = 0
            pinned_chunks = 0
            for c in protected:
                s = self._lru.get(c)
                if s is not None:
                    pinned_bytes += s
                    pinned_chunks += 1
            return StoreStatistics(
                root=str(self.root), chunks=len(self._lru), bytes=self._bytes,
                pinned_chunks=pinned_chunks, pinned_bytes=pinned_bytes,
                manifests=len(self.manifest_ids()), complete_manifests=len(self._complete),
                materialised=len(self._materialised), pins=sum(self._pins.values()),
                chunks_added=self._chunks_added, bytes_added=self._bytes_added,
                evictions=self._evictions, evicted_bytes=self._evicted_bytes,
                quota_bytes=self.quota_bytes, high_watermark=self.high_watermark,
                low_watermark=self.low_watermark, pending_sync=len(self._pending_files))


def _fsync_one(path: str | os.PathLike[str], directory: bool, missing_ok: bool) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    except FileNotFoundError:
        if missing_ok:  # e.g. evicted meanwhile
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SYNC_THREADS = 16


def fsync_paths(paths: Sequence[str], *, directory: bool = False, missing_ok: bool = False,
                pool: ThreadPoolExecutor | None = None) -> None:
    """fsync many files (or directories) concurrently (on ``pool``, else threads made for
    this call); raises the first OSError."""
    if len(paths) <= 2:
        for p in paths:
            _fsync_one(p, directory, missing_ok)
        return
    if pool is not None:
        for fut in [pool.submit(_fsync_one, p, directory, missing_ok) for p in paths]:
            fut.result()
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(paths)), thread_name_prefix="herd-fsync") as ex:
        for fut in [ex.submit(_fsync_one, p, directory, missing_ok) for p in paths]:
            fut.result()


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root``), files first."""
    files: list[str] = []
    dirs: list[str] = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                files.append(full)
        dirs.extend(os.path.join(dirpath, d) for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
    fsync_paths(files)
    fsync_paths(dirs, directory=True)


def _atomic_write(path: Path, data: bytes, tmp_dir: Path, *, what: str) -> None:
    """:func:`infra.durable.atomic_write` (read-only, via the store's temp dir), a
    full disk mapped to :class:`StoreFullError` naming ``what``."""
    try:
        atomic_write(path, data, 0o444, tmp_dir=tmp_dir)
    except OSError as e:
        if e.errno in _FULL_ERRNOS:
            raise _full(e, what) from None
        raise


__all__ = ["ChunkStore", "EvictReport", "HeldManifest", "StoreStatistics", "VerifyReport", "check_id",
           "manifest_chunks"]
