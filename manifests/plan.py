"""What it takes to get from what a node holds to a manifest: pure functions over plain data.

``plan(new, have=..., materialised=...)`` works for any pair of manifests (no notion of
"successive versions"): content is matched by chunk id, whole files by their exact chunk list.

- A file of ``new`` whose (chunk list, mode) equals a file of an already materialised manifest can
  be hard-linked from that tree (``links``); its bytes are already on disk in final form.
- Every unique chunk of ``new`` is either local (``have(id)`` is true), needed (absent and used by
  at least one file that is not linked), or only used by linked files and absent
  (``chunks_linked``): materialising with those links does not need it, a plain copy would.
- Empty files are never linked (creating one is cheaper than a link and shares nothing).

``diff(a, b)`` says what changed between two manifests for humans (added, removed, changed paths)
and how many bytes of ``b`` are in chunks ``a`` lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from .model import Entry, Manifest


class LinkOp(msgspec.Struct, frozen=True):
    """Link ``path`` of the new tree from ``src_path`` of materialised manifest ``src_manifest_id``."""

    path: str
    src_manifest_id: str
    src_path: str


class Plan(msgspec.Struct, frozen=True):
    chunks_needed: list[str]
    """Absent chunks used by files that are not linked, unique, in manifest (first-use) order."""
    chunks_local: list[str]
    """Chunks of the manifest already present locally."""
    bytes_needed: int
    bytes_local: int
    links: list[LinkOp]
    chunks_linked: list[str] = []
    """Absent chunks that only linked files use: not needed when materialising with ``links``."""
    bytes_linked: int = 0


class Diff(msgspec.Struct, frozen=True):
    added: list[str]
    removed: list[str]
    changed: list[str]
    """Paths in both whose kind, mode, symlink target or content differ."""
    bytes_new: int
    """Bytes of the unique chunks ``b`` has and ``a`` lacks."""
    chunks_new: int = 0


LinkKey = tuple[tuple[str, ...], int]


def link_index(materialised: Mapping[str, Manifest]) -> dict[LinkKey, tuple[str, str]]:
    """``(chunk ids, mode) -> (manifest id, path)`` over the non-empty files of materialised trees.

    Iterates manifests in mapping order; the first tree holding a given file wins.
    """
    index: dict[LinkKey, tuple[str, str]] = {}
    for mid, m in materialised.items():
        table = m.chunks
        for e in m.entries:
            if e.kind == "file" and e.chunks:
                key = (tuple([table[i].id for i in e.chunks]), e.mode)
                index.setdefault(key, (mid, e.path))
    return index


def file_key(m: Manifest, e: Entry) -> LinkKey:
    table = m.chunks
    return (tuple([table[i].id for i in e.chunks]), e.mode)


def plan(
    new: Manifest,
    *,
    have: Callable[[str], bool],
    materialised: Mapping[str, Manifest] = {},  # noqa: B006 - read-only default
) -> Plan:
    """Chunks to fetch, chunks already local, and files to link, to materialise ``new``."""
    index = link_index(materialised) if materialised else {}
    table = new.chunks
    used_unlinked = bytearray(len(table))
    links: list[LinkOp] = []
    for e in new.entries:
        if e.kind != "file" or not e.chunks:
            continue
        if index:
            src = index.get(file_key(new, e))
            if src is not None:
                links.append(LinkOp(e.path, src[0], src[1]))
                continue
        for i in e.chunks:
            used_unlinked[i] = 1
    needed: list[str] = []
    local: list[str] = []
    linked: list[str] = []
    bytes_needed = bytes_local = bytes_linked = 0
    for i, c in enumerate(table):
        if have(c.id):
            local.append(c.id)
            bytes_local += c.size
        elif used_unlinked[i]:
            needed.append(c.id)
            bytes_needed += c.size
        else:
            linked.append(c.id)
            bytes_linked += c.size
    return Plan(needed, local, bytes_needed, bytes_local, links, linked, bytes_linked)


def _signature(m: Manifest, e: Entry) -> tuple[str, int, str, tuple[str, ...]]:
    table = m.chunks
    return (e.kind, e.mode, e.target, tuple([table[i].id for i in e.chunks]))


def diff(a: Manifest, b: Manifest) -> Diff:
    """Paths added, removed and changed from ``a`` to ``b``; bytes of ``b``'s chunks ``a`` lacks."""
    a_entries = {e.path: e for e in a.entries}
    b_paths = set()
    added: list[str] = []
    changed: list[str] = []
    for e in b.entries:
        b_paths.add(e.path)
        old = a_entries.get(e.path)
        if old is None:
            added.append(e.path)
        elif _signature(a, old) != _signature(b, e):
            changed.append(e.path)
    removed = [e.path for e in a.entries if e.path not in b_paths]
    a_ids = {c.id for c in a.chunks}
    new_chunks = [c for c in b.chunks if c.id not in a_ids]
    return Diff(added, removed, changed, sum(c.size for c in new_chunks), len(new_chunks))
