"""The manifest model: what an artifact is, as plain frozen values.

A manifest lists every entry of a directory tree in sorted path order (``str`` order, which for
valid UTF-8 equals byte order): ``path``, ``kind`` (file | dir | symlink), ``mode``, ``size``,
``target`` (symlinks) and, for files, an ordered list of indices into the chunk table. The chunk
table holds each unique chunk once as ``(id, size)``.

Invariants (checked by :func:`manifests.validate.validate_manifest`, which every decode runs):

- paths are relative and normalised: no leading ``/``, no empty, ``.`` or ``..`` components, no NUL,
  at most ``MAX_PATH_BYTES`` bytes, each component at most ``MAX_NAME_BYTES`` bytes;
- entries are strictly sorted (so no duplicates) and every parent directory is an explicit ``dir``
  entry (the root itself is implicit and never listed). Explicit parents keep directory modes in the
  manifest and let one sorted pass check the tree;
- modes are normalised: files ``0o644`` or ``0o755``, directories and symlinks ``0o755``; never
  setuid/setgid/sticky. The same tree therefore gets the same id whatever the publisher's umask;
- a file's size is the sum of its chunks' sizes; dirs and symlinks have size 0 and no chunks;
- chunk ids are 64 lowercase hex digits (BLAKE3-256), unique in the table, sizes in
  ``1..chunker.max_size``; the table is in first-use order (walking entries in order) and holds no
  unreferenced chunk — so one tree has exactly one manifest value;
- symlink targets are relative and resolve inside the root, following the manifest's own symlinks
  the way the kernel would (``s -> .`` then ``l -> s/x/../..`` escapes even though the lexical form
  does not), with at most ``MAX_SYMLINK_HOPS`` hops;
- counts are bounded (``MAX_ENTRIES``, ``MAX_CHUNKS``; the codec bounds the encoded size).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from importlib import metadata
from typing import Literal

import msgspec

from .errors import ManifestError

KiB = 1024
MiB = 1024 * KiB

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 256 * MiB
MAX_ENTRIES = 1_000_000
MAX_CHUNKS = 4_000_000
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_TARGET_BYTES = 4095
MAX_SYMLINK_HOPS = 40
MAX_FILE_SIZE = 1 << 50

FILE_MODES = frozenset({0o644, 0o755})
DIR_MODE = 0o755
SYMLINK_MODE = 0o755

CHUNKER_NAME = "fastcdc"
"""The cut-point algorithm of the ``fastcdc`` PyPI package (its own FastCDC variant)."""

# The fastcdc kernel's own bounds (fastcdc_cy.pyx: MINIMUM_MIN..MAXIMUM_MAX).
_MIN_BOUNDS = (64, 67_108_864)
_AVG_BOUNDS = (256, 268_435_456)
_MAX_BOUNDS = (1024, 1_073_741_824)


def _installed_chunker_version() -> str:
    try:
        return metadata.version("fastcdc")
    except metadata.PackageNotFoundError:
        return "unknown"


CHUNKER_VERSION = _installed_chunker_version()

_VERSION_RE = re.compile(r"[0-9A-Za-z.+_-]{1,64}")

Kind = Literal["file", "dir", "symlink"]


class ChunkerParams(msgspec.Struct, frozen=True, array_like=True):
    """Content-defined chunking parameters, recorded in every manifest.

    ``name``/``version`` identify the cut-point algorithm (the ``fastcdc`` package's, whose cut points
    differ from other FastCDC implementations); they default to the installed kernel.
    """

    min_size: int = 256 * KiB
    avg_size: int = 1 * MiB
    max_size: int = 4 * MiB
    name: str = CHUNKER_NAME
    version: str = CHUNKER_VERSION

    def __post_init__(self) -> None:
        check_chunker_params(self)


def check_chunker_params(p: ChunkerParams) -> None:
    """Raise ManifestError unless ``p`` is something the kernel accepts and we know."""
    if p.name != CHUNKER_NAME:
        raise ManifestError(f"unknown chunker {p.name!r:.80} (this herd knows {CHUNKER_NAME!r})")
    if not _VERSION_RE.fullmatch(p.version):
        raise ManifestError(f"bad chunker version {p.version!r:.80}")
    for label, value, (lo, hi) in (
        ("min_size", p.min_size, _MIN_BOUNDS),
        ("avg_size", p.avg_size, _AVG_BOUNDS),
        ("max_size", p.max_size, _MAX_BOUNDS),
    ):
        if type(value) is not int or not lo <= value <= hi:
            raise ManifestError(f"chunker {label}={value!r:.40} outside {lo}..{hi}")
    if not p.min_size <= p.avg_size <= p.max_size:
        raise ManifestError(
            f"chunker sizes must satisfy min <= avg <= max, got {p.min_size}/{p.avg_size}/{p.max_size}"
        )


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """One unique chunk: BLAKE3-256 hex id and its size in bytes."""

    id: str
    size: int


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One path of the tree. ``chunks`` are indices into ``Manifest.chunks`` (files only)."""

    path: str
    kind: Kind
    mode: int
    size: int
    target: str
    chunks: tuple[int, ...]


class Manifest(msgspec.Struct, frozen=True, array_like=True, dict=True):
    """A whole artifact tree. Build one with :class:`ManifestBuilder` or :func:`decode_manifest`."""

    version: int
    chunker: ChunkerParams
    entries: tuple[Entry, ...]
    chunks: tuple[Chunk, ...]

    @functools.cached_property
    def id(self) -> str:  # noqa: A003 - the contract names it ``id``
        """BLAKE3-256 hex of the canonical encoding."""
        from .codec import manifest_id

        return manifest_id(self)

    @property
    def files(self) -> Iterator[Entry]:
        return (e for e in self.entries if e.kind == "file")

    @property
    def total_size(self) -> int:
        """Bytes of all files (duplicates counted every time)."""
        return sum(e.size for e in self.entries if e.kind == "file")

    @property
    def unique_size(self) -> int:
        """Bytes of the chunk table (each unique chunk once)."""
        return sum(c.size for c in self.chunks)

    def chunk_ids(self, entry: Entry) -> list[str]:
        """The ordered chunk ids of a file entry."""
        table = self.chunks
        return [table[i].id for i in entry.chunks]

    def entry(self, path: str) -> Entry | None:
        """The entry at ``path`` (binary search over the sorted entries) or None."""
        entries = self.entries
        lo, hi = 0, len(entries)
        while lo < hi:
            mid = (lo + hi) // 2
            if entries[mid].path < path:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(entries) and entries[lo].path == path:
            return entries[lo]
        return None


def normalise_file_mode(st_mode: int) -> int:
    """0o755 if any exec bit is set, else 0o644 (setuid/setgid/sticky and write bits dropped)."""
    return 0o755 if st_mode & 0o111 else 0o644


class ManifestBuilder:
    """Collect entries in any order; :meth:`build` sorts them and lays out the chunk table canonically."""

    def __init__(self, chunker: ChunkerParams | None = None) -> None:
        self.chunker = chunker if chunker is not None else ChunkerParams()
        self._items: list[tuple[str, str, int, str, list[tuple[str, int]]]] = []

    def add_dir(self, path: str, mode: int = DIR_MODE) -> None:
        self._items.append((path, "dir", mode, "", []))

    def add_symlink(self, path: str, target: str) -> None:
        self._items.append((path, "symlink", SYMLINK_MODE, target, []))

    def add_file(self, path: str, mode: int, chunks: Iterable[tuple[str, int]]) -> None:
        """``chunks``: the ordered ``(id, size)`` pairs of the file's content."""
        self._items.append((path, "file", mode, "", list(chunks)))

    def build(self, *, validate: bool = True) -> Manifest:
        """The canonical manifest of the entries added; validated unless ``validate`` is False."""
        index: dict[str, int] = {}
        table: list[Chunk] = []
        entries: list[Entry] = []
        for path, kind, mode, target, chunks in sorted(self._items, key=lambda it: it[0]):
            idxs: list[int] = []
            size = 0
            for cid, csize in chunks:
                i = index.get(cid)
                if i is None:
                    i = index[cid] = len(table)
                    table.append(Chunk(cid, csize))
                idxs.append(i)
                size += csize
            entries.append(Entry(path, kind, mode, size, target, tuple(idxs)))  # type: ignore[arg-type]  # kind is a str from the encoding; validation checks it is one of the Literal's
        m = Manifest(MANIFEST_VERSION, self.chunker, tuple(entries), tuple(table))
        if validate:
            from .validate import validate_manifest

            validate_manifest(m)
        return m
