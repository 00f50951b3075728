"""validate_manifest: every rule of :mod:`manifests.model`'s docstring, checked in one sorted pass.

Run on every decode and before every materialisation. The common case (ASCII paths, a well-formed
chunk table) takes fast paths made of C-level whole-table checks; on any doubt the slow path finds
the culprit and the error names the entry.
"""

from __future__ import annotations

import re

from .errors import ManifestError
from .model import (
    DIR_MODE,
    FILE_MODES,
    MANIFEST_VERSION,
    MAX_CHUNKS,
    MAX_ENTRIES,
    MAX_FILE_SIZE,
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    MAX_SYMLINK_HOPS,
    MAX_TARGET_BYTES,
    SYMLINK_MODE,
    Chunk,
    Entry,
    Manifest,
    check_chunker_params,
)

_HEX64 = re.compile(r"[0-9a-f]{64}")
_ALLOWED_MODES = frozenset({("file", 0o644), ("file", 0o755), ("dir", DIR_MODE), ("symlink", SYMLINK_MODE)})
_HEXSTAR = re.compile(r"[0-9a-f]*")
# ASCII fast path for paths: components of 1..255 chars, no NUL ("." and ".." checked separately).
_PATH_FAST = re.compile(r"(?:[^/\x00]{1,255}/)*[^/\x00]{1,255}")


def _check_text(path: str, value: str, what: str, max_bytes: int) -> None:
    """The checks a path and a symlink target share: no NUL, valid UTF-8, at most
    ``max_bytes``, relative. Errors name the entry (``path``) and ``what`` was wrong."""
    if "\x00" in value:
        raise ManifestError(f"entry {path!r:.200}: NUL byte in {what}")
    try:
        nbytes = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ManifestError(f"entry {path!r:.200}: {what} is not valid UTF-8") from None
    if nbytes > max_bytes:
        raise ManifestError(f"entry {path[:80]!r}...: {what} longer than {max_bytes} bytes")
    if value.startswith("/"):
        raise ManifestError(f"entry {path!r:.200}: absolute {what} {value!r:.200}")


def _check_path(path: object, what: str = "path") -> str:
    if type(path) is not str:
        raise ManifestError(f"entry {path!r:.80}: {what} is not a string")
    if not path:
        raise ManifestError(f"entry with an empty {what}")
    _check_text(path, path, what, MAX_PATH_BYTES)
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
    _check_text(path, target, "symlink target", MAX_TARGET_BYTES)


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
