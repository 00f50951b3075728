"""A pod's start path in the supervisor: its directories, made with as few metadata changes
as hold their modes and owners whatever the agent's umask or what an earlier start left."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.isolation import WorkloadUser
from agent.supervisor import _workload_dirs


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_workload_dirs_get_their_modes_under_any_umask(tmp_path: Path) -> None:
    me = WorkloadUser(name="me", uid=os.geteuid(), gid=os.getegid(), groups=(os.getegid(),))
    old = os.umask(0o077)            # strips the 0o011 a workload needs to reach its scratch
    try:
        _workload_dirs(tmp_path / "wl" / "w1", me)
    finally:
        os.umask(old)
    assert (_mode(tmp_path / "wl" / "w1"), _mode(tmp_path / "wl" / "w1" / "scratch")) == (0o711, 0o700)


def test_workload_dirs_mend_what_an_earlier_start_left(tmp_path: Path) -> None:
    me = WorkloadUser(name="me", uid=os.geteuid(), gid=os.getegid(), groups=(os.getegid(),))
    wdir = tmp_path / "w1"
    (wdir / "scratch").mkdir(parents=True)
    os.chmod(wdir, 0o755)
    os.chmod(wdir / "scratch", 0o777)
    (wdir / "scratch" / "kept").write_text("x")
    _workload_dirs(wdir, me)
    assert (_mode(wdir), _mode(wdir / "scratch")) == (0o711, 0o700)
    assert (wdir / "scratch" / "kept").read_text() == "x"


def test_workload_dirs_give_the_scratch_to_the_workload_user(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    other = WorkloadUser(name="other", uid=3100123, gid=3100124, groups=(3100124,))
    _workload_dirs(tmp_path / "w1", other)
    s = os.lstat(tmp_path / "w1" / "scratch")
    w = os.lstat(tmp_path / "w1")
    assert (s.st_uid, s.st_gid, stat.S_IMODE(s.st_mode)) == (3100123, 3100124, 0o700)
    assert (w.st_uid, stat.S_IMODE(w.st_mode)) == (0, 0o711)
