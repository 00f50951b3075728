"""The origin interface every backend implements, and what they share.

Bucket layout (the same for every backend)::

    chunks/<id>      chunk bytes, id = BLAKE3-256 hex of the bytes
    manifests/<id>   canonical manifest bytes, id = BLAKE3-256 hex of the bytes
    refs/<name>      the text of a manifest id (``name:tag`` allowed)

Nothing read from an origin is trusted: callers verify chunks and manifests by
their ids. Nor is its size: every read is bounded -- a chunk by the size the manifest
promises (``get_chunk(id, size)``; without one, by the largest chunk a manifest may
describe, ``MAX_CHUNK_BYTES``), a manifest by ``MAX_MANIFEST_BYTES``, a ref by 1 KiB. Backends implement four primitives (``_get``, ``_put``, ``_exists_many``
and ``aclose``); naming, validation and counters live here.

Garbage collection (``p2p/gc.py``) needs three more, which writable backends implement:
``_list_info`` (every object under a prefix, with its size and the backend's own time),
``_move`` (no-clobber: an object already at the destination is kept) and
``_delete_if_unchanged`` (gone only if it is still the version that was listed).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable

import msgspec

from manifests import MAX_MANIFEST_BYTES

from ..errors import NotFoundError, OriginError, ReadOnlyOriginError, RefError

HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Path-like ref names: components start with an alphanumeric (so no "." / ".." parts),
# then a sane charset; ':' separates a tag, '@' and '+' are common in versions.
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]*(/[A-Za-z0-9][A-Za-z0-9._:@+=-]*)*$")
MAX_REF_LEN = 200
MAX_REF_BYTES = 1024
MAX_CHUNK_BYTES = 1 << 30          # the chunker's largest max_size (manifests.model)


def check_hex_id(value: str, what: str = "chunk id") -> str:
    if not isinstance(value, str) or not HEX64.match(value):
        raise RefError(f"invalid {what}: {value!r:.80} (want 64 lower-case hex digits)")
    return value


def check_ref_name(name: str) -> str:
    """Validate a ref name (``trainer:v42``, ``team/trainer:v42``); RefError if unacceptable."""
    if not isinstance(name, str) or not name:
        raise RefError("empty ref name")
    if len(name) > MAX_REF_LEN:
        raise RefError(f"ref name longer than {MAX_REF_LEN} characters")
    if not _REF.match(name):
        raise RefError(f"invalid ref name {name!r:.80}: use letters, digits and ._:@+=- "
                       "in '/'-separated parts, each starting with a letter or digit")
    return name


def ref_family(name: str) -> str:
    """``trainer:v42`` -> ``trainer``; a ref without a tag is its own family (gc keeps the
    last N of each family; publish dedups against them)."""
    return name.rsplit(":", 1)[0] if ":" in name else name


def is_manifest_id(ref: str) -> bool:
    return bool(HEX64.match(ref))


class ObjectInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One object as a listing saw it. ``key`` is relative to the origin's root
    (``chunks/<id>``); ``updated`` is the backend's own clock (unix seconds: a file's
    mtime, a GCS object's ``updated``); ``version`` tells two writes of one key apart
    (a GCS generation; a file's inode and mtime in ns)."""
    key: str
    size: int
    updated: float
    version: str = ""


_KEY_PREFIXES = ("chunks/", "manifests/", "refs/", "trash/")


def _check_key(key: str) -> str:
    """A key of the bucket layout (or a prefix of one): one of its four folders, no
    '.'/'..' parts. Guards the listing and moving primitives against a confused caller."""
    if not key.startswith(_KEY_PREFIXES) or any(p in (".", "..") for p in key.split("/")) or "\\" in key:
        raise RefError(f"not a key of the origin layout: {key!r:.120}")
    return key


class OriginStatistics(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    gets: int
    bytes_got: int
    puts: int
    bytes_put: int
    exists_checks: int
    retries: int
    lists: int = 0


class Origin(ABC):
    """An artifact origin. Async; safe to share between tasks of one trio run."""

    url: str
    read_only: bool = False

    def __init__(self, url: str) -> None:
        self.url = url
        self.gets = 0
        self.bytes_got = 0
        self.puts = 0
        self.bytes_put = 0
        self.exists_checks = 0
        self.retries = 0
        self.lists = 0

    # --------------------------------------------------------- primitives

    @abstractmethod
    async def _get(self, key: str, limit: int) -> bytes:
        """The object's bytes; NotFoundError if absent, OriginError if unreachable or
        if it holds more than ``limit`` bytes (never read past ``limit`` + 1)."""

    @abstractmethod
    async def _put(self, key: str, data: bytes | memoryview) -> None:
        """Store an object (replacing it); atomic where the backend allows. ``data`` may be
        a view of a buffer its caller reuses once this returns: keep no reference to it."""

    @abstractmethod
    async def _exists_many(self, prefix: str, names: set[str]) -> set[str]:
        """Which of ``names`` exist under ``prefix`` (e.g. 'chunks/')."""

    async def _put_manifest(self, key: str, data: bytes, ref: str | None) -> None:
        """Store a manifest. Backends that keep object metadata describe it there (GCS: the
        ref it is published as, its size and counts); the others just ``_put`` it."""
        await self._put(key, data)

    async def _flush(self) -> None:
        """Make earlier chunk puts durable before a manifest or ref refers to them."""
        return None

    async def _list_info(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (temp files excluded)."""
        raise ReadOnlyOriginError(f"origin {self.url} cannot be listed (read-only); garbage-collect the "
                                  "bucket it mirrors")

    async def _move(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst`` without replacing an object already at ``dst`` (then
        ``src`` is just removed: the keys are content-addressed or the caller said the
        destination wins). False when ``src`` is absent."""
        raise ReadOnlyOriginError(f"origin {self.url} is read-only")

    async def _delete_if_unchanged(self, info: ObjectInfo) -> bool:
        """Delete ``info.key`` only if it still is the version listed; False if it is
        gone or was rewritten meanwhile."""
        raise ReadOnlyOriginError(f"origin {self.url} is read-only")

    async def aclose(self) -> None:
        """Release connections."""
        return None

    async def __aenter__(self) -> Origin:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------ reads

    async def _get_counted(self, key: str, limit: int) -> bytes:
        data = await self._get(key, limit)
        self.gets += 1
        self.bytes_got += len(data)
        return data

    async def get_chunk(self, chunk_id: str, size: int | None = None) -> bytes:
        """The chunk's bytes (unverified), at most ``size`` (what the manifest promises)."""
        check_hex_id(chunk_id)
        try:
            return await self._get_counted(f"chunks/{chunk_id}", MAX_CHUNK_BYTES if size is None else size)
        except NotFoundError:
            raise NotFoundError(f"chunk {chunk_id} not found at origin {self.url}") from None

    async def get_manifest(self, manifest_id: str) -> bytes:
        check_hex_id(manifest_id, "manifest id")
        try:
            return await self._get_counted(f"manifests/{manifest_id}", MAX_MANIFEST_BYTES)
        except NotFoundError:
            raise NotFoundError(f"manifest {manifest_id} not found at origin {self.url}") from None

    async def resolve(self, ref: str) -> str:
        """A 64-hex manifest id passes through; a name is looked up under refs/."""
        if is_manifest_id(ref):
            return ref
        check_ref_name(ref)
        try:
            data = await self._get_counted(f"refs/{ref}", MAX_REF_BYTES)
        except NotFoundError:
            raise NotFoundError(f"unknown ref {ref!r} at origin {self.url}") from None
        value = data.decode("ascii", "replace").strip()
        if not is_manifest_id(value):
            raise OriginError(f"ref {ref!r} at origin {self.url} does not hold a manifest id")
        return value

    async def missing(self, ids: Iterable[str]) -> set[str]:
        """The chunk ids among ``ids`` the origin does not hold (checked in bulk)."""
        want = {check_hex_id(i) for i in ids}
        if not want:
            return set()
        self.exists_checks += len(want)
        return want - await self._exists_many("chunks/", want)

    # ----------------------------------------------------------- writes

    async def put_chunk(self, chunk_id: str, data: bytes | memoryview) -> None:
        check_hex_id(chunk_id)
        await self._put(f"chunks/{chunk_id}", data)
        self.puts += 1
        self.bytes_put += len(data)

    async def put_manifest(self, manifest_id: str, data: bytes, *, ref: str | None = None) -> None:
        """``ref``: the name it is being published as (kept in the object's metadata where
        the backend has any; a manifest already there keeps what it was first published as)."""
        check_hex_id(manifest_id, "manifest id")
        if ref is not None:
            check_ref_name(ref)
        await self._flush()
        await self._put_manifest(f"manifests/{manifest_id}", data, ref)
        self.puts += 1
        self.bytes_put += len(data)

    async def set_ref(self, name: str, manifest_id: str) -> None:
        check_ref_name(name)
        check_hex_id(manifest_id, "manifest id")
        await self._flush()
        await self._put(f"refs/{name}", manifest_id.encode() + b"\n")
        self.puts += 1

    # ------------------------------------------------------ listing (gc)

    async def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (``chunks/``, ``manifests/``,
        ``refs/``, ``trash/``, or a longer prefix such as ``refs/trainer``)."""
        self.lists += 1
        return await self._list_info(_check_key(prefix))

    async def get_object(self, key: str, limit: int) -> bytes:
        """Any object of the layout, at most ``limit`` bytes (gc reads refs and moved-aside manifests)."""
        return await self._get_counted(_check_key(key), limit)

    async def has_manifest(self, manifest_id: str) -> bool:
        check_hex_id(manifest_id, "manifest id")
        self.exists_checks += 1
        return bool(await self._exists_many("manifests/", {manifest_id}))

    async def move(self, src: str, dst: str) -> bool:
        return await self._move(_check_key(src), _check_key(dst))

    async def delete_if_unchanged(self, info: ObjectInfo) -> bool:
        _check_key(info.key)
        return await self._delete_if_unchanged(info)

    def statistics(self) -> OriginStatistics:
        return OriginStatistics(url=self.url, gets=self.gets, bytes_got=self.bytes_got, puts=self.puts,
                                bytes_put=self.bytes_put, exists_checks=self.exists_checks,
                                retries=self.retries, lists=self.lists)
