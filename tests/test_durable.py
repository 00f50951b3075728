"""infra.durable.atomic_write: the one whole-file rewrite (looping writes, fsync of
file and directory, temp removed on failure)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from infra import durable
from infra.durable import atomic_write


def test_short_writes_are_looped_and_both_fsyncs_happen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write, real_fsync = os.write, os.fsync
    synced: list[str] = []

    def one_byte(fd: int, data: object) -> int:   # the kernel may write less than asked
        return real_write(fd, memoryview(data)[:1])  # type: ignore[arg-type]

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(durable.os, "write", one_byte)
    monkeypatch.setattr(durable.os, "fsync", fsync)
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    atomic_write(target, b"new contents", 0o640)
    assert target.read_bytes() == b"new contents"
    assert synced == ["file", "dir"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]   # no temp left


def test_mode_ignores_the_umask_and_sync_false_skips_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durable.os, "fsync", lambda fd: pytest.fail("fsync with sync=False"))
    old = os.umask(0o077)
    try:
        atomic_write(tmp_path / "sub" / "peers", b"x", 0o644, sync=False)   # the directory is made
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "sub" / "peers").stat().st_mode) == 0o644


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "m"
    target.write_bytes(b"old")

    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable.os, "write", full)
    with pytest.raises(OSError) as e:
        atomic_write(target, b"new", tmp_dir=tmp_path)
    assert e.value.errno == 28
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_missing_tmp_dir_is_an_error_not_created(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "x", b"1", tmp_dir=tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
