"""Manifest model and codec: round trips, stable ids, and hostile manifests refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3
import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import manifests.codec as codec
from manifests import (
    MAX_CHUNKS,
    MAX_ENTRIES,
    Chunk,
    ChunkerParams,
    Entry,
    IntegrityError,
    Manifest,
    ManifestBuilder,
    ManifestError,
    decode_manifest,
    encode_manifest,
    to_json_view,
    validate_manifest,
)

PARAMS = ChunkerParams(min_size=4096, avg_size=16384, max_size=65536, version="1.7.0")


def cid(n: int) -> str:
    return blake3.blake3(str(n).encode()).hexdigest()


def sample() -> Manifest:
    b = ManifestBuilder(PARAMS)
    b.add_dir("bin")
    b.add_file("bin/run", 0o755, [(cid(1), 100), (cid(2), 200)])
    b.add_dir("data")
    b.add_file("data/a.bin", 0o644, [(cid(2), 200), (cid(3), 300)])
    b.add_file("data/empty", 0o644, [])
    b.add_dir("data/nested")
    b.add_symlink("data/nested/up", "../a.bin")
    b.add_file("données✓.txt", 0o644, [(cid(4), 7)])
    b.add_symlink("latest", "bin/run")
    b.add_dir("zzz-empty-dir")
    return b.build()


def raw(m: Manifest) -> bytes:
    """Encode without validation (what a hostile peer could send)."""
    return msgspec.msgpack.encode(m)


def with_entries(m: Manifest, entries) -> Manifest:
    return msgspec.structs.replace(m, entries=tuple(entries))


def E(path: str, kind: str = "file", mode: int | None = None, size: int = 0, target: str = "", chunks=()):
    if mode is None:
        mode = 0o644 if kind == "file" else 0o755
    return Entry(path, kind, mode, size, target, tuple(chunks))  # type: ignore[arg-type]


def one_chunk_manifest(*entries: Entry) -> Manifest:
    return Manifest(1, PARAMS, tuple(entries), (Chunk(cid(1), 10),))


# ------------------------------------------------------------------------------------- round trips


def test_round_trip_and_id() -> None:
    m = sample()
    data = encode_manifest(m)
    back = decode_manifest(data, m.id)
    assert back == m
    assert back.id == m.id == blake3.blake3(data).hexdigest()
    assert encode_manifest(back) == data
    assert m.entry("data/a.bin").size == 500
    assert m.entry("nope") is None
    assert m.chunk_ids(m.entry("bin/run")) == [cid(1), cid(2)]
    assert m.total_size == 300 + 500 + 7 and m.unique_size == 607


def test_id_is_stable_across_builds_and_releases() -> None:
    """Golden id: the canonical encoding must never change silently (ids are on origins forever)."""
    b1 = sample()
    items = [
        ("latest", "symlink"), ("zzz-empty-dir", "dir"), ("data", "dir"), ("bin", "dir"),
    ]
    b = ManifestBuilder(PARAMS)  # same tree, entries added in another order
    for path, kind in items:
        b.add_symlink(path, "bin/run") if kind == "symlink" else b.add_dir(path)
    b.add_file("données✓.txt", 0o644, [(cid(4), 7)])
    b.add_symlink("data/nested/up", "../a.bin")
    b.add_dir("data/nested")
    b.add_file("data/empty", 0o644, [])
    b.add_file("data/a.bin", 0o644, [(cid(2), 200), (cid(3), 300)])
    b.add_file("bin/run", 0o755, [(cid(1), 100), (cid(2), 200)])
    assert b.build().id == b1.id
    assert b1.id == "ba1af1d9b91ce97d63203c7577b630d922f7668bb9a798411a45b0f0ed156184"


def test_json_view() -> None:
    m = sample()
    view = to_json_view(m)
    assert json.loads(json.dumps(view)) == view
    assert view["id"] == m.id
    assert view["files"] == 4 and view["bytes"] == 807
    by_path = {e["path"]: e for e in view["entries"]}
    assert by_path["bin/run"]["mode"] == "0755"
    assert by_path["bin/run"]["chunks"] == [cid(1), cid(2)]
    assert by_path["latest"]["target"] == "bin/run"
    assert view["chunker"]["avg_size"] == 16384


names = st.text(alphabet="abé✓-_.x", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@st.composite
def trees(draw) -> Manifest:
    b = ManifestBuilder(PARAMS)
    dirs = [""]
    used: set[str] = set()
    for _ in range(draw(st.integers(0, 25))):
        parent = draw(st.sampled_from(dirs))
        name = draw(names)
        path = f"{parent}/{name}" if parent else name
        if path in used:
            continue
        used.add(path)
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink"]))
        if kind == "dir":
            b.add_dir(path)
            dirs.append(path)
        elif kind == "symlink":
            b.add_symlink(path, "z" + draw(names))  # a sibling name ("z": never a symlink): inside, no loop
        else:
            n = draw(st.lists(st.integers(0, 12), max_size=5))
            b.add_file(path, draw(st.sampled_from([0o644, 0o755])), [(cid(i), 1000 + i) for i in n])
    return b.build()


@settings(max_examples=150, deadline=None)
@given(trees())
def test_round_trip_property(m: Manifest) -> None:
    data = encode_manifest(m)
    back = decode_manifest(data, expected_id=blake3.blake3(data).hexdigest())
    assert back == m and back.id == m.id
    assert encode_manifest(back) == data


# --------------------------------------------------------------------------------- hostile, by hand


HOSTILE: list[tuple[str, Manifest, str]] = [
    ("dotdot", one_chunk_manifest(E("../x", size=10, chunks=[0])), "'..' component"),
    ("dotdot-inner", one_chunk_manifest(E("a", "dir"), E("a/../b", size=10, chunks=[0])), "'..' component"),
    ("dot", one_chunk_manifest(E("a", "dir"), E("a/./b", size=10, chunks=[0])), "'.' component"),
    ("absolute", one_chunk_manifest(E("/etc/passwd", size=10, chunks=[0])), "absolute path"),
    ("empty-component", one_chunk_manifest(E("a", "dir"), E("a//b", size=10, chunks=[0])), "empty component"),
    ("trailing-slash", one_chunk_manifest(E("a/", "dir"), E("b", size=10, chunks=[0])), "empty component"),
    ("empty-path", one_chunk_manifest(E("", size=10, chunks=[0])), "empty path"),
    ("nul", one_chunk_manifest(E("a\x00b", size=10, chunks=[0])), "NUL"),
    ("long-name", one_chunk_manifest(E("n" * 256, size=10, chunks=[0])), "longer than 255"),
    ("long-path", one_chunk_manifest(E("/".join(["d" * 200] * 21), size=10, chunks=[0])), "longer than 4096"),
    ("duplicate", one_chunk_manifest(E("a", size=10, chunks=[0]), E("a", size=10, chunks=[0])), "duplicate"),
    ("unsorted", one_chunk_manifest(E("b", size=10, chunks=[0]), E("a", size=10, chunks=[0])), "sorted"),
    ("no-parent", one_chunk_manifest(E("d/x", size=10, chunks=[0])), "parent 'd'"),
    ("parent-is-file", one_chunk_manifest(E("d", size=10, chunks=[0]), E("d/x")), "parent 'd'"),
    (
        "parent-is-symlink",
        one_chunk_manifest(E("d", "symlink", target="e"), E("d/x", size=10, chunks=[0])),
        "parent 'd'",
    ),
    ("size-mismatch", one_chunk_manifest(E("a", size=11, chunks=[0])), "add up to 10"),
    ("dir-with-size", one_chunk_manifest(E("a", size=10, chunks=[0]), E("d", "dir", size=3)), "has a size"),
    ("setuid", one_chunk_manifest(E("a", mode=0o4755, size=10, chunks=[0])), "setuid"),
    ("setgid-dir", one_chunk_manifest(E("a", size=10, chunks=[0]), E("d", "dir", mode=0o2755)), "setuid"),
    ("sticky", one_chunk_manifest(E("a", size=10, chunks=[0]), E("d", "dir", mode=0o1777)), "sticky"),
    ("world-writable", one_chunk_manifest(E("a", mode=0o666, size=10, chunks=[0])), "not 0o644 or 0o755"),
    ("file-type-bits", one_chunk_manifest(E("a", mode=0o100644, size=10, chunks=[0])), "file-type bits"),
    ("negative-mode", one_chunk_manifest(E("a", mode=-1, size=10, chunks=[0])), "bad mode"),
    ("bad-index", one_chunk_manifest(E("a", size=10, chunks=[0]), E("b", size=10, chunks=[1])), "out of range"),
    ("negative-index", one_chunk_manifest(E("a", size=10, chunks=[0]), E("b", size=10, chunks=[-1])), "out of range"),
    ("unused-chunk", one_chunk_manifest(E("a")), "no file uses"),
    ("file-with-target", one_chunk_manifest(E("a", size=10, chunks=[0], target="x")), "symlink target"),
    ("symlink-dotdot", one_chunk_manifest(E("a", size=10, chunks=[0]), E("l", "symlink", target="../x")), "escapes"),
    (
        "symlink-deep-dotdot",
        one_chunk_manifest(E("a", "dir"), E("a/l", "symlink", target="../../x"), E("b", size=10, chunks=[0])),
        "escapes",
    ),
    (
        "symlink-a-dotdot-dotdot",
        one_chunk_manifest(E("a", "dir"), E("b", size=10, chunks=[0]), E("l", "symlink", target="a/../../x")),
        "escapes",
    ),
    (
        "symlink-via-symlink",  # lexically "s/x/../.." is ".", but s -> "." makes it the root's parent
        one_chunk_manifest(
            E("a", size=10, chunks=[0]), E("l", "symlink", target="s/x/../.."), E("s", "symlink", target=".")
        ),
        "escapes",
    ),
    ("symlink-absolute", one_chunk_manifest(E("a", size=10, chunks=[0]), E("l", "symlink", target="/etc")), "absolute"),
    ("symlink-empty", one_chunk_manifest(E("a", size=10, chunks=[0]), E("l", "symlink")), "empty target"),
    ("symlink-nul", one_chunk_manifest(E("a", size=10, chunks=[0]), E("l", "symlink", target="a\x00")), "NUL"),
    (
        "symlink-loop",
        one_chunk_manifest(E("a", "symlink", target="b"), E("b", "symlink", target="a"), E("c", size=10, chunks=[0])),
        "hops",
    ),
    ("wrong-version", msgspec.structs.replace(one_chunk_manifest(E("a", size=10, chunks=[0])), version=2), "version 2"),
]


@pytest.mark.parametrize("name, m, message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_manifest_refused(name: str, m: Manifest, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        validate_manifest(m)
    with pytest.raises(ManifestError, match=message):
        decode_manifest(raw(m))


def _table(*chunks: Chunk) -> Manifest:
    entries = [E(f"f{i}", size=c.size if isinstance(c.size, int) else 0, chunks=[i]) for i, c in enumerate(chunks)]
    return Manifest(1, PARAMS, tuple(entries), tuple(chunks))


@pytest.mark.parametrize(
    "m, message",
    [
        (_table(Chunk("ab" * 31, 10)), "64 lowercase hex"),
        (_table(Chunk(cid(1).upper(), 10)), "64 lowercase hex"),
        (_table(Chunk("g" * 64, 10)), "64 lowercase hex"),
        (_table(Chunk(cid(1), 0)), "outside 1..65536"),
        (_table(Chunk(cid(1), 65537)), "outside 1..65536"),
        (_table(Chunk(cid(1), 10), Chunk(cid(1), 10)), "twice"),
        (
            Manifest(1, PARAMS, (E("a", size=20, chunks=[1, 0]),), (Chunk(cid(1), 10), Chunk(cid(2), 10))),
            "first-use order",
        ),
    ],
)
def test_bad_chunk_table_refused(m: Manifest, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        decode_manifest(raw(m))


def test_absurd_counts_refused() -> None:
    e = E("a", size=10, chunks=[0])
    many = Manifest(1, PARAMS, (e,) * (MAX_ENTRIES + 1), (Chunk(cid(1), 10),))
    with pytest.raises(ManifestError, match="entries, more than the limit"):
        validate_manifest(many)
    c = Chunk(cid(1), 10)
    many_chunks = Manifest(1, PARAMS, (e,), (c,) * (MAX_CHUNKS + 1))
    with pytest.raises(ManifestError, match="chunks, more than the limit"):
        validate_manifest(many_chunks)
    # A header announcing four billion entries in a few bytes: refused, nothing allocated.
    head = raw(sample())
    bogus = head[:1] + head[1:2] + raw(PARAMS) + b"\xdd\xff\xff\xff\xff"
    with pytest.raises(ManifestError):
        decode_manifest(bogus)


def test_oversized_manifest_refused_before_decoding(monkeypatch) -> None:
    data = encode_manifest(sample())
    monkeypatch.setattr(codec, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(ManifestError, match="more than the limit"):
        decode_manifest(data)


def test_wrong_id_is_an_integrity_error() -> None:
    data = encode_manifest(sample())
    with pytest.raises(IntegrityError, match="expected"):
        decode_manifest(data, expected_id=cid(9))
    with pytest.raises(IntegrityError):
        decode_manifest(data[:-1] + bytes([data[-1] ^ 1]), expected_id=sample().id)


def test_every_truncation_refused() -> None:
    data = encode_manifest(sample())
    for n in range(len(data)):
        with pytest.raises(ManifestError):
            decode_manifest(data[:n])


def test_trailing_bytes_and_non_canonical_forms_refused() -> None:
    m = sample()
    data = encode_manifest(m)
    with pytest.raises(ManifestError):
        decode_manifest(data + b"\x00")
    # The same value spelt differently: version 1 as a uint8 (0xcc 0x01) instead of a fixint.
    assert data[1] == 1
    with pytest.raises(ManifestError, match="canonical"):
        decode_manifest(data[:1] + b"\xcc\x01" + data[2:])
    # An extra trailing field in the outer array (msgspec would ignore it): refused.
    extended = bytes([data[0] + 1]) + data[1:] + b"\xc0"
    with pytest.raises(ManifestError, match="canonical"):
        decode_manifest(extended)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "not a herd manifest"),
        (b"\xc1", "not a herd manifest"),
        (msgspec.msgpack.encode({"version": 1}), "not a herd manifest"),
        (msgspec.msgpack.encode([True, [], [], []]), "not a herd manifest"),
        (msgspec.msgpack.encode([1, list(PARAMS.__struct_fields__), [], []]), "malformed"),
        (msgspec.msgpack.encode([1, [4096, 16384, 65536, "fastcdc", "1.7.0"], [["a", "fifo", 420, 0, "", []]], []]), "malformed"),
        (msgspec.msgpack.encode([1, [4096, 16384, 65536, "rabin", "1"], [], []]), "unknown chunker"),
        (msgspec.msgpack.encode([1, [4096, 16384, 65536, "fastcdc", "1.7.0"], [["a", "file", True, 0, "", []]], []]), "malformed"),
        (msgspec.msgpack.encode([7, "whatever comes later"]), "version 7"),
    ],
)
def test_garbage_refused(data: bytes, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        decode_manifest(data)


def test_non_bytes_refused() -> None:
    with pytest.raises(ManifestError, match="must be bytes"):
        decode_manifest("not bytes")  # type: ignore[arg-type]


# --------------------------------------------------------------------- hostile, hypothesis-generated


@st.composite
def mutations(draw) -> bytes:
    data = bytearray(encode_manifest(sample()))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[i:]
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_mutated_bytes_refused_or_fully_valid(data: bytes) -> None:
    """Any byte mutation is either refused with ManifestError or decodes to a valid canonical manifest."""
    try:
        m = decode_manifest(data)
    except ManifestError:
        return
    validate_manifest(m)
    assert encode_manifest(m) == data
    assert m.id == blake3.blake3(data).hexdigest()


def path_ok(p: str) -> bool:
    return bool(p) and "\x00" not in p and not p.startswith("/") and all(
        c not in ("", ".", "..") for c in p.split("/")
    )


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=["a", "b", ".", "/", "\x00", "é"], min_size=0, max_size=12))
def test_generated_paths_refused_exactly_when_not_normalised(path: str) -> None:
    parts = path.split("/")
    entries = {"/".join(parts[:i]): E("/".join(parts[:i]), "dir") for i in range(1, len(parts))}
    entries[path] = E(path, size=10, chunks=[0])
    m = one_chunk_manifest(*sorted(entries.values(), key=lambda e: e.path))
    if path_ok(path):
        assert decode_manifest(raw(m)) == m
    else:
        with pytest.raises(ManifestError):
            decode_manifest(raw(m))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    where=st.sampled_from(["l", "a/l", "a/b/l"]),
    target=st.lists(st.sampled_from(["a", "b", "s", "t", "..", ".", "x"]), min_size=1, max_size=7).map("/".join),
)
def test_generated_symlinks_checked_against_the_kernel(tmp_path_factory, where: str, target: str) -> None:
    """Oracle: build the tree for real and let the kernel resolve the link (os.path.realpath)."""
    assume(where != "l" or target != "l")
    base = tmp_path_factory.mktemp("sym")
    root = base / "outer" / "root"
    (root / "a" / "b").mkdir(parents=True)
    os.symlink(".", root / "s")
    os.symlink("a/b", root / "t")
    os.symlink(target, root / where)
    entries = [
        E("a", "dir"), E("a/b", "dir"), E("f", size=10, chunks=[0]),
        E("s", "symlink", target="."), E("t", "symlink", target="a/b"), E(where, "symlink", target=target),
    ]
    m = one_chunk_manifest(*sorted(entries, key=lambda e: e.path))
    try:
        os.stat(root / where)
        looped = False
    except OSError as exc:
        looped = exc.errno == 40  # ELOOP
    if looped:
        with pytest.raises(ManifestError, match="hops"):
            decode_manifest(raw(m))
        return
    resolved = Path(os.path.realpath(root / where))
    inside = resolved == root.resolve() or root.resolve() in resolved.parents
    if inside:
        assert decode_manifest(raw(m)) == m
    else:
        with pytest.raises(ManifestError, match="escapes"):
            decode_manifest(raw(m))
