"""The manifest model: what an artifact is, as plain frozen values.

A manifest lists every entry of a directory tree in sorted path order (``str`` order, which for
valid UTF-8 equals byte order): ``path``, ``kind`` (file | dir | symlink), ``mode``, ``size``,
``target`` (symlinks) and, for files, an ordered list of indices into the chunk table. The chunk
table holds each unique chunk once as ``(id, size)``.

Invariants (checked by :func:`validate_manifest`, which every decode runs):

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
_ALLOWED_MODES = frozenset({("file", 0o644), ("file", 0o755), ("dir", DIR_MODE), ("symlink", SYMLINK_MODE)})

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

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEXSTAR = re.compile(r"[0-9a-f]*")
# ASCII fast path for paths: components of 1..255 chars, no NUL ("." and ".." checked separately).
_PATH_FAST = re.compile(r"(?:[^/\x00]{1,255}/)*[^/\x00]{1,255}")
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
            entries.append(Entry(path, kind, mode, size, target, tuple(idxs)))  # type: ignore[arg-type]
        m = Manifest(MANIFEST_VERSION, self.chunker, tuple(entries), tuple(table))
        if validate:
            validate_manifest(m)
        return m


# ---------------------------------------------------------------------------------------- validation


def _check_path(path: object, what: str = "path") -> str:
    if type(path) is not str:
        raise ManifestError(f"entry {path!r:.80}: {what} is not a string")
    if not path:
        raise ManifestError(f"entry with an empty {what}")
    if "\x00" in path:
        raise ManifestError(f"entry {path!r:.200}: NUL byte in {what}")
    try:
        nbytes = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise ManifestError(f"entry {path!r:.200}: {what} is not valid UTF-8") from None
    if nbytes > MAX_PATH_BYTES:
        raise ManifestError(f"entry {path[:80]!r}...: {what} longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        raise ManifestError(f"entry {path!r:.200}: absolute {what}")
    for comp in path.split("/"):
        if comp == "":
            raise ManifestError(f"entry {path!r:.200}: empty component in {what}")
        if comp in (".", ".."):
            raise ManifestError(f"entry {path!r:.200}: {comp!r} component in {what}")
        if len(comp.encode("utf-8")) > MAX_NAME_BYTES:
            raise ManifestError(f"entry {path!r:.200}: a component is longer than {MAX_NAME_BYTES} bytes")
    return path


def _check_mode(e: Entry) -> None:
    if e.kind not in ("file", "dir", "symlink"):
        raise ManifestError(f"entry {e.path!r:.200}: unknown kind {e.kind!r:.40}")
    mode = e.mode
    if type(mode) is not int or mode < 0:
        raise ManifestError(f"entry {e.path!r:.200}: bad mode {mode!r:.40}")
    if mode & 0o7000:
        raise ManifestError(f"entry {e.path!r:.200}: setuid/setgid/sticky bits in mode {mode:#o}")
    if mode & ~0o777:
        raise ManifestError(f"entry {e.path!r:.200}: file-type bits in mode {mode:#o}")
    if e.kind == "file":
        if mode not in FILE_MODES:
            raise ManifestError(f"entry {e.path!r:.200}: file mode {mode:#o} is not 0o644 or 0o755")
    elif e.kind == "dir":
        if mode != DIR_MODE:
            raise ManifestError(f"entry {e.path!r:.200}: directory mode {mode:#o} is not 0o755")
    elif mode != SYMLINK_MODE:
        raise ManifestError(f"entry {e.path!r:.200}: symlink mode {mode:#o} is not 0o755")


def _check_symlink_inside(path: str, symlinks: dict[str, str]) -> None:
    """Resolve ``path``'s target as the kernel would, over the manifest's own symlinks.

    Components that name nothing in the manifest are taken lexically (the materialised tree is
    read-only, so nothing can appear there later). Going above the root is an escape.
    """
    parts = path.split("/")[:-1]
    pending = list(reversed(symlinks[path].split("/")))
    hops = 0
    while pending:
        comp = pending.pop()
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise ManifestError(
                    f"entry {path!r:.200}: symlink target {symlinks[path]!r:.200} escapes the root"
                )
            parts.pop()
            continue
        parts.append(comp)
        target = symlinks.get("/".join(parts))
        if target is not None:
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise ManifestError(
                    f"entry {path!r:.200}: symlink chain longer than {MAX_SYMLINK_HOPS} hops (a loop?)"
                )
            parts.pop()
            pending.extend(reversed(target.split("/")))


def _check_chunk_table(table: tuple[Chunk, ...], max_chunk: int) -> None:
    seen: set[str] = set()
    for i, c in enumerate(table):
        if type(c.id) is not str or not _HEX64.fullmatch(c.id):
            raise ManifestError(f"chunk #{i}: id {c.id!r:.80} is not 64 lowercase hex digits")
        if c.id in seen:
            raise ManifestError(f"chunk #{i}: id {c.id} appears twice in the chunk table")
        seen.add(c.id)
        if type(c.size) is not int or not 0 < c.size <= max_chunk:
            raise ManifestError(f"chunk {c.id}: size {c.size!r:.40} outside 1..{max_chunk}")


def _check_target(e: Entry) -> None:
    path, target = e.path, e.target
    if type(target) is not str or not target:
        raise ManifestError(f"entry {path!r:.200}: symlink with an empty target")
    if "\x00" in target:
        raise ManifestError(f"entry {path!r:.200}: NUL byte in symlink target")
    try:
        tbytes = len(target.encode("utf-8"))
    except UnicodeEncodeError:
        raise ManifestError(f"entry {path!r:.200}: symlink target is not valid UTF-8") from None
    if tbytes > MAX_TARGET_BYTES:
        raise ManifestError(f"entry {path!r:.200}: symlink target longer than {MAX_TARGET_BYTES} bytes")
    if target.startswith("/"):
        raise ManifestError(f"entry {path!r:.200}: absolute symlink target {target!r:.200}")


def validate_manifest(m: Manifest) -> None:
    """Raise ManifestError (naming the entry) unless ``m`` obeys every rule of the module docstring."""
    if type(m.version) is not int or m.version != MANIFEST_VERSION:
        raise ManifestError(f"unknown manifest version {m.version!r:.40} (this herd reads {MANIFEST_VERSION})")
    check_chunker_params(m.chunker)
    if len(m.entries) > MAX_ENTRIES:
        raise ManifestError(f"manifest has {len(m.entries)} entries, more than the limit {MAX_ENTRIES}")
    table = m.chunks
    nchunks = len(table)
    if nchunks > MAX_CHUNKS:
        raise ManifestError(f"manifest has {nchunks} chunks, more than the limit {MAX_CHUNKS}")
    max_chunk = m.chunker.max_size
    ids = [c.id for c in table]
    sizes = [c.size for c in table]
    # Fast whole-table checks in C; on any doubt the slow loop finds and names the culprit.
    fast_ok = (
        set(map(type, ids)) <= {str}
        and set(map(len, ids)) <= {64}
        and _HEXSTAR.fullmatch("".join(ids)) is not None
        and len(set(ids)) == nchunks
        and set(map(type, sizes)) <= {int}
        and (not sizes or (min(sizes) > 0 and max(sizes) <= max_chunk))
    )
    if not fast_ok:
        _check_chunk_table(table, max_chunk)

    dirs: set[str] = set()
    symlinks: dict[str, str] = {}
    next_new = 0  # canonical layout: chunk indices appear for the first time in increasing order
    prev = ""
    path_ok = _PATH_FAST.fullmatch
    for e in m.entries:
        path = e.path
        if not (
            type(path) is str
            and path.isascii()
            and len(path) <= MAX_PATH_BYTES
            and path_ok(path)
            and "/./" not in (slashed := f"/{path}/")
            and "/../" not in slashed
        ):
            _check_path(path)
        if prev:
            if path == prev:
                raise ManifestError(f"entry {path!r:.200}: duplicate path")
            if path < prev:
                raise ManifestError(f"entry {path!r:.200}: entries are not in sorted path order")
        prev = path
        parent = path.rpartition("/")[0]
        if parent and parent not in dirs:
            raise ManifestError(
                f"entry {path!r:.200}: parent {parent!r:.200} is not a directory entry of the manifest"
            )
        kind = e.kind
        if type(e.mode) is not int or (kind, e.mode) not in _ALLOWED_MODES:
            _check_mode(e)
        if kind == "file":
            if e.target != "":
                raise ManifestError(f"entry {path!r:.200}: a file has a symlink target")
            idxs = e.chunks
            if idxs:
                if not (set(map(type, idxs)) <= {int} and min(idxs) >= 0 and max(idxs) < nchunks):
                    bad = next(i for i in idxs if type(i) is not int or not 0 <= i < nchunks)
                    raise ManifestError(f"entry {path!r:.200}: chunk index {bad!r:.40} out of range 0..{nchunks - 1}")
                if max(idxs) >= next_new:
                    for idx in idxs:
                        if idx >= next_new:
                            if idx != next_new:
                                raise ManifestError(
                                    f"entry {path!r:.200}: chunk table is not in first-use order (index {idx})"
                                )
                            next_new += 1
                total = sum(map(sizes.__getitem__, idxs))
            else:
                total = 0
            if type(e.size) is not int or e.size != total:
                raise ManifestError(f"entry {path!r:.200}: size {e.size!r:.40} but its chunks add up to {total}")
            if total > MAX_FILE_SIZE:
                raise ManifestError(f"entry {path!r:.200}: file larger than {MAX_FILE_SIZE} bytes")
        else:
            if e.size != 0 or e.chunks:
                raise ManifestError(f"entry {path!r:.200}: a {kind} has a size or chunks")
            if kind == "dir":
                if e.target != "":
                    raise ManifestError(f"entry {path!r:.200}: a directory has a symlink target")
                dirs.add(path)
            else:
                _check_target(e)
                symlinks[path] = e.target
    if next_new != nchunks:
        raise ManifestError(f"chunk table holds {nchunks - next_new} chunk(s) no file uses")
    for path in symlinks:
        _check_symlink_inside(path, symlinks)
