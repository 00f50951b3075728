"""scan_tree: the publish ingest path, from a real directory tree."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import blake3
import pytest

from manifests import ChunkerParams, ManifestError, decode_manifest, encode_manifest, scan_tree

SMALL = ChunkerParams(4096, 16384, 65536)


def make_tree(root: Path) -> None:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "run").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "bin" / "run", 0o700)
    (root / "data" / "deep" / "er").mkdir(parents=True)
    (root / "data" / "big").write_bytes(os.urandom(300_000))
    (root / "data" / "copy").write_bytes((root / "data" / "big").read_bytes())
    os.chmod(root / "data" / "copy", 0o600)
    (root / "data" / "empty").write_bytes(b"")
    (root / "empty-dir").mkdir()
    os.chmod(root / "empty-dir", 0o700)
    (root / "ünïcødé ✓.txt").write_text("non-ascii name\n")
    (root / "suid").write_bytes(b"x")
    os.chmod(root / "suid", 0o4755)
    os.symlink("bin/run", root / "latest")
    os.symlink("../../big", root / "data" / "deep" / "link")
    os.symlink("does-not-exist", root / "dangling")


def test_scan_describes_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "t"
    make_tree(root)
    res = scan_tree(root, SMALL)
    m = res.manifest
    kinds = {e.path: (e.kind, e.mode) for e in m.entries}
    assert kinds == {
        "bin": ("dir", 0o755),
        "bin/run": ("file", 0o755),
        "dangling": ("symlink", 0o755),
        "data": ("dir", 0o755),
        "data/big": ("file", 0o644),
        "data/copy": ("file", 0o644),
        "data/deep": ("dir", 0o755),
        "data/deep/er": ("dir", 0o755),
        "data/deep/link": ("symlink", 0o755),
        "data/empty": ("file", 0o644),
        "empty-dir": ("dir", 0o755),
        "latest": ("symlink", 0o755),
        "suid": ("file", 0o755),
        "ünïcødé ✓.txt": ("file", 0o644),
    }
    assert [e.path for e in m.entries] == sorted(e.path for e in m.entries)
    assert m.entry("data/deep/link").target == "../../big"
    big, copy = m.entry("data/big"), m.entry("data/copy")
    assert big.size == 300_000 and big.chunks == copy.chunks
    assert m.entry("data/empty").chunks == ()
    assert decode_manifest(encode_manifest(m), m.id) == m
    # Every unique chunk can be read back from its source and hashes to its id.
    assert set(res.sources) == {c.id for c in m.chunks}
    for chunk_id, src in res.sources.items():
        with open(src.path, "rb") as f:
            f.seek(src.offset)
            assert blake3.blake3(f.read(src.size)).hexdigest() == chunk_id


def test_same_tree_same_id_wherever_and_whenever(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "elsewhere" / "b"
    make_tree(a)
    make_tree(b)
    (b / "data" / "big").write_bytes((a / "data" / "big").read_bytes())
    (b / "data" / "copy").write_bytes((a / "data" / "big").read_bytes())
    os.utime(b / "bin" / "run", (1, 1))
    os.chmod(b / "bin" / "run", 0o755)  # exec bits matter, the rest does not
    assert scan_tree(a, SMALL).manifest.id == scan_tree(b, SMALL).manifest.id
    os.chmod(b / "bin" / "run", 0o644)
    assert scan_tree(a, SMALL).manifest.id != scan_tree(b, SMALL).manifest.id


def test_empty_tree(tmp_path: Path) -> None:
    m = scan_tree(tmp_path, SMALL).manifest
    assert m.entries == () and m.chunks == ()


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_special_files_refused(tmp_path: Path, kind: str) -> None:
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "special"
    if kind == "fifo":
        os.mkfifo(path)
        with pytest.raises(ManifestError, match="fifo not supported"):
            scan_tree(tmp_path, SMALL)
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(path))
            with pytest.raises(ManifestError, match="socket not supported"):
                scan_tree(tmp_path, SMALL)


def test_absolute_symlink_refused(tmp_path: Path) -> None:
    os.symlink("/etc/passwd", tmp_path / "abs")
    with pytest.raises(ManifestError, match="absolute symlink target"):
        scan_tree(tmp_path, SMALL)


def test_escaping_symlink_refused(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    os.symlink("../../outside", tmp_path / "a" / "esc")
    with pytest.raises(ManifestError, match="'a/esc'.*escapes the root"):
        scan_tree(tmp_path, SMALL)


def test_non_utf8_name_refused(tmp_path: Path) -> None:
    fd = os.open(os.fsencode(tmp_path) + b"/bad\xffname", os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)
    with pytest.raises(ManifestError, match="not valid UTF-8"):
        scan_tree(tmp_path, SMALL)


def test_bad_roots_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot scan"):
        scan_tree(tmp_path / "missing", SMALL)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(ManifestError, match="not a directory"):
        scan_tree(tmp_path / "file", SMALL)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads everything")
def test_unreadable_file_refused(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"x")
    os.chmod(tmp_path / "secret", 0)
    with pytest.raises(ManifestError, match="cannot open"):
        scan_tree(tmp_path, SMALL)


@pytest.mark.parametrize("params", [SMALL, ChunkerParams()])
def test_scan_with_the_cut_worker_equals_the_in_process_cut(tmp_path: Path, monkeypatch, params) -> None:
    """Cutting in the worker process (CUT_WORKER_MIN_BYTES=0: always) gives the same
    manifest and chunk sources as the in-process cut, byte for byte."""
    import manifests.scan as scan_mod

    make_tree(tmp_path / "t")
    (tmp_path / "t" / "data" / "large").write_bytes(os.urandom(5_000_000))
    monkeypatch.setattr(scan_mod, "CUT_WORKER_MIN_BYTES", None)
    a = scan_tree(tmp_path / "t", params)
    monkeypatch.setattr(scan_mod, "CUT_WORKER_MIN_BYTES", 0)
    monkeypatch.setattr(scan_mod.os, "cpu_count", lambda: 2)
    b = scan_tree(tmp_path / "t", params)
    assert encode_manifest(a.manifest) == encode_manifest(b.manifest)
    assert a.sources == b.sources
    assert len(a.manifest.chunks) > 3
