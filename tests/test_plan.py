"""plan and diff: pure functions over manifests, for any pair (not only successive versions)."""

from __future__ import annotations

import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from manifests import ChunkerParams, LinkOp, Manifest, ManifestBuilder, diff, plan

PARAMS = ChunkerParams(4096, 16384, 65536)


def cid(n: int) -> str:
    return blake3.blake3(str(n).encode()).hexdigest()


def build(files: dict[str, tuple[int, list[int]]], dirs=(), links=()) -> Manifest:
    b = ManifestBuilder(PARAMS)
    for d in dirs:
        b.add_dir(d)
    for path, target in links:
        b.add_symlink(path, target)
    for path, (mode, chunks) in files.items():
        b.add_file(path, mode, [(cid(i), 1000 + i) for i in chunks])
    return b.build()


V1 = build({"a": (0o644, [1, 2, 3]), "b": (0o755, [4]), "c": (0o644, [5, 6]), "e": (0o644, [])})
V2 = build(
    {"a": (0o644, [1, 2, 30]), "b": (0o755, [4]), "c2": (0o644, [5, 6]), "d": (0o644, [7, 2]), "e": (0o644, [])},
    links=[("l", "a")],
)


def test_plan_against_empty_store() -> None:
    p = plan(V2, have=lambda _: False)
    assert p.chunks_needed == [cid(i) for i in (1, 2, 30, 4, 5, 6, 7)]
    assert p.bytes_needed == sum(1000 + i for i in (1, 2, 30, 4, 5, 6, 7))
    assert p.chunks_local == [] and p.links == [] and p.chunks_linked == []


def test_plan_with_chunks_local() -> None:
    local = {c.id for c in V1.chunks}
    p = plan(V2, have=local.__contains__)
    assert p.chunks_needed == [cid(30), cid(7)]
    assert p.bytes_needed == 1030 + 1007
    assert set(p.chunks_local) == {cid(i) for i in (1, 2, 4, 5, 6)}
    assert p.bytes_local == sum(1000 + i for i in (1, 2, 4, 5, 6))


def test_plan_links_identical_files_from_materialised_trees() -> None:
    p = plan(V2, have=lambda _: False, materialised={V1.id: V1})
    # b is identical; c2 is c renamed: both linked. a changed, d is new, e is empty (never linked).
    assert p.links == [LinkOp("b", V1.id, "b"), LinkOp("c2", V1.id, "c")]
    assert p.chunks_needed == [cid(i) for i in (1, 2, 30, 7)]
    assert p.chunks_linked == [cid(4), cid(5), cid(6)]
    assert p.bytes_linked == 1004 + 1005 + 1006


def test_plan_does_not_link_across_modes() -> None:
    other = build({"x": (0o755, [5, 6])})
    p = plan(V2, have=lambda _: False, materialised={other.id: other})
    assert p.links == []
    same_mode = build({"x": (0o644, [5, 6])})
    p = plan(V2, have=lambda _: False, materialised={other.id: other, same_mode.id: same_mode})
    assert p.links == [LinkOp("c2", same_mode.id, "x")]


def test_plan_backwards_and_unrelated() -> None:
    # Going back from v2 to v1 works the same way: nothing is special about "successors".
    p = plan(V1, have={c.id for c in V2.chunks}.__contains__, materialised={V2.id: V2})
    assert p.links == [LinkOp("b", V2.id, "b"), LinkOp("c", V2.id, "c2")]
    assert p.chunks_needed == [cid(3)]
    unrelated = build({"z": (0o644, [100, 101])}, dirs=["d"])
    p = plan(unrelated, have={c.id for c in V2.chunks}.__contains__, materialised={V1.id: V1, V2.id: V2})
    assert p.links == [] and p.chunks_local == []
    assert p.chunks_needed == [cid(100), cid(101)]


def test_diff_related() -> None:
    d = diff(V1, V2)
    assert d.added == ["c2", "d", "l"]
    assert d.removed == ["c"]
    assert d.changed == ["a"]
    assert d.bytes_new == 1030 + 1007 and d.chunks_new == 2


def test_diff_sees_mode_and_kind_changes() -> None:
    a = build({"f": (0o644, [1]), "g": (0o644, [2])})
    b = build({"f": (0o755, [1])}, links=[("g", "f")])
    d = diff(a, b)
    assert d.changed == ["f", "g"] and d.added == [] and d.removed == [] and d.bytes_new == 0


def test_diff_identity_and_unrelated() -> None:
    same = diff(V2, V2)
    assert (same.added, same.removed, same.changed, same.bytes_new) == ([], [], [], 0)
    unrelated = build({"z": (0o644, [100])})
    d = diff(V1, unrelated)
    assert d.added == ["z"] and d.removed == ["a", "b", "c", "e"] and d.bytes_new == 1100


files_st = st.dictionaries(
    st.sampled_from(list("abcdefgh")),
    st.tuples(st.sampled_from([0o644, 0o755]), st.lists(st.integers(0, 15), max_size=4)),
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(files_st, files_st, st.sets(st.integers(0, 15)))
def test_plan_invariants(old_files, new_files, have_ids) -> None:
    old, new = build(old_files), build(new_files)
    have = {cid(i) for i in have_ids}
    p = plan(new, have=have.__contains__, materialised={old.id: old})
    all_ids = [c.id for c in new.chunks]
    # Every chunk is in exactly one bucket, buckets keep manifest order, sizes add up.
    assert sorted(p.chunks_needed + p.chunks_local + p.chunks_linked) == sorted(all_ids)
    assert p.chunks_needed == [i for i in all_ids if i in set(p.chunks_needed)]
    assert p.bytes_needed + p.bytes_local + p.bytes_linked == new.unique_size
    linked_paths = {op.path for op in p.links}
    for op in p.links:
        src, dst = old.entry(op.src_path), new.entry(op.path)
        assert old.chunk_ids(src) == new.chunk_ids(dst) and src.mode == dst.mode and dst.chunks
    # Whatever a non-linked file needs is local or needed.
    for e in new.files:
        if e.path not in linked_paths:
            assert set(new.chunk_ids(e)) <= have | set(p.chunks_needed)
    d = diff(old, new)
    assert set(d.added) == set(new_files) - set(old_files)
    assert set(d.removed) == set(old_files) - set(new_files)
    assert d.bytes_new == sum(c.size for c in new.chunks if c.id not in {x.id for x in old.chunks})
