"""infra.durable.atomic_write: the one whole-file rewrite (looping writes, fsync of
file and directory, temp removed on failure)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
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


def test_temp_names_are_unique_hidden_and_recognised() -> None:
    a, b = durable.temp_name("state.json"), durable.temp_name("state.json")
    assert a != b and a.startswith(".state.json.p") and durable.is_temp_name(a)
    assert durable.is_temp_name(durable.temp_name("c" * 64, f"{7:012x}"))
    assert not durable.is_temp_name("state.json") and not durable.is_temp_name(".hidden")


def _rewriters(d: Path) -> dict[str, Callable[[], object]]:
    """Each whole-file writer of ours, as a call that writes under ``d``."""
    import trio

    from infra import pki
    from infra.auth import generate_token_dir
    from p2p.origins.file import FileOrigin
    from scheduler_link.msgauth import load_placer_keys

    async def origin_put() -> None:
        await FileOrigin(d / "origin").put_manifest("a" * 64, b"manifest")

    return {
        "pki": lambda: pki.init(d / "pki"),
        "tokens": lambda: generate_token_dir(d / "tokens"),
        "placer keys": lambda: load_placer_keys(d / "placer"),
        "file origin": lambda: trio.run(origin_put),
    }


@pytest.mark.parametrize("name", ["pki", "tokens", "placer keys", "file origin"])
def test_every_whole_file_writer_goes_through_atomic_write(name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    replaced: set[Path] = set()
    real = durable.fill_and_replace

    def recording(fd: int, tmp: str | os.PathLike[str], path: str | os.PathLike[str],
                  data: bytes | bytearray | memoryview, mode: int, *, sync: bool) -> None:
        replaced.add(Path(path))
        real(fd, tmp, path, data, mode, sync=sync)

    monkeypatch.setattr(durable, "fill_and_replace", recording)
    _rewriters(tmp_path)[name]()
    files = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert files and files <= replaced, files - replaced   # every file there came by atomic_write
    assert not any(durable.is_temp_name(p.name) for p in files)


def test_the_demo_trainer_checkpoints_through_a_copy_of_this_module(tmp_path: Path) -> None:
    import subprocess
    import sys

    from cli.demo_trainer import durable_source, trainer_source

    (tmp_path / "train.py").write_text(trainer_source("v1"))
    (tmp_path / "durable.py").write_text(durable_source())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"HERD_SCRATCH": str(scratch), "PATH": os.environ.get("PATH", "")}
    subprocess.run([sys.executable, "-I", str(tmp_path / "train.py"), "--steps", "0"], env=env, check=True,
                   timeout=60, capture_output=True)
    assert sorted(p.name for p in scratch.iterdir()) == ["final.json"]
    assert stat.S_IMODE((scratch / "final.json").stat().st_mode) == 0o644
