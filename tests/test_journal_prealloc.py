"""The placer's jobs journal is pre-allocated (placer.journal): records are written over zeros
made at open and synced with fdatasync, so a submission's sync never grows the file; a
write a crash cut short is dropped and written over; a journal of the earlier layout (lines
only) is still read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from placer import journal as journal_mod
from placer.journal import PREALLOC_BYTES, Journal
from scheduler_link.messages import JobSpec


def _spec(jid: str) -> JobSpec:
    return JobSpec(job_id=jid, argv=["sleep", "1"])


def _records_end(path: Path) -> int:
    return path.read_bytes().find(0)


def test_submissions_are_written_over_zeros_and_never_grow_the_file(tmp_path: Path) -> None:
    j = Journal.open(tmp_path)
    path = tmp_path / "jobs.journal"
    size = path.stat().st_size
    assert size >= PREALLOC_BYTES and path.read_bytes().count(0) == size   # made of zeros at open
    for i in range(50):
        j.submitted(_spec(f"j{i}"), float(i))
    j.ended("j3", "succeeded", 60.0)
    assert path.stat().st_size == size          # every record over the zeros
    assert j.fsyncs == 51
    j.close()
    j = Journal.open(tmp_path)
    assert [s.job_id for s in j.jobs()] == [f"j{i}" for i in range(50) if i != 3]
    assert path.stat().st_size == size          # reopened: the zeros left are kept, none added
    j.close()


def test_appends_sync_the_data_not_the_inode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submission's sync is an fdatasync over written blocks: no fsync (which would commit
    the filesystem's journal for the mtime) on the submit path."""
    j = Journal.open(tmp_path)
    calls: list[str] = []
    real_fdatasync = os.fdatasync

    def fsync(fd: int) -> None:
        calls.append("fsync")

    def fdatasync(fd: int) -> None:
        calls.append("fdatasync")
        real_fdatasync(fd)

    monkeypatch.setattr(journal_mod.os, "fsync", fsync)
    monkeypatch.setattr(journal_mod.os, "fdatasync", fdatasync)
    j.submitted(_spec("a"), 1.0)
    j.cordon("n1", True, 2.0, "disk")
    j.ended("a", "succeeded", 3.0)
    assert calls == ["fdatasync"] * 3
    j.close()


async def test_the_group_commit_is_an_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = Journal.open(tmp_path)
    j.sync_in_thread = False
    synced: list[int] = []
    monkeypatch.setattr(journal_mod.os, "fsync", lambda fd: synced.append(-1))
    monkeypatch.setattr(journal_mod.os, "fdatasync", lambda fd: synced.append(fd))
    j.submitted(_spec("a"), 1.0, sync=False)
    await j.flush()
    assert synced == [j._fd] and j.synced == j.appends == 1
    j.close()


def test_a_record_past_the_zeros_grows_the_file_by_more_zeros(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal_mod, "PREALLOC_BYTES", 512)
    j = Journal.open(tmp_path)
    path = tmp_path / "jobs.journal"
    assert path.stat().st_size == 512
    for i in range(20):   # ~60 bytes a record: past the first zeros after a few
        j.submitted(_spec(f"j{i}"), float(i))
    end = _records_end(path)
    assert end > 512 and path.stat().st_size - end <= 512 and path.stat().st_size > end
    j.close()
    assert [s.job_id for s in Journal.open(tmp_path).jobs()] == [f"j{i}" for i in range(20)]


def test_a_write_torn_over_the_zeros_is_dropped_and_written_over(tmp_path: Path) -> None:
    """A crash mid-write can leave the record's first bytes, a page never written (zeros) and
    later bytes: open drops the record and zeros the rest, so the next record (shorter than
    the torn write) is not followed by stale bytes that would read as a corrupt line."""
    j = Journal.open(tmp_path)
    for jid in ("a", "b", "c"):
        j.submitted(_spec(jid), 1.0)
    j.close()
    path = tmp_path / "jobs.journal"
    end = _records_end(path)
    torn = b'{"v":1,"op":"submit","at":2.0,"spec":{"job_id":"d"' + bytes(8) + b"stale bytes of the cut write\n" * 40
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(torn)
    j = Journal.open(tmp_path)
    assert [s.job_id for s in j.jobs()] == ["a", "b", "c"]
    j.submitted(_spec("e"), 3.0)
    j.ended("a", "succeeded", 4.0)
    j.close()
    j = Journal.open(tmp_path)
    assert [s.job_id for s in j.jobs()] == ["b", "c", "e"]
    j.close()


def test_a_journal_of_lines_only_is_read_and_takes_zeros(tmp_path: Path) -> None:
    """The earlier layout (lines appended to a growing file, maybe a torn last one): read,
    then the torn line written over and zeros added after the records."""
    path = tmp_path / "jobs.journal"
    path.write_bytes(b'{"v":1,"op":"submit","at":1.0,"spec":{"job_id":"a","argv":["x"]}}\n'
                     b'{"v":1,"op":"submit","at":1.0,"spec":{"job_id":"b","argv":["x"]}}\n'
                     b'{"v":1,"op":"end","at":2.0,"job_id":"a","sta')
    j = Journal.open(tmp_path)
    assert [s.job_id for s in j.jobs()] == ["a", "b"]
    assert path.stat().st_size >= PREALLOC_BYTES
    j.submitted(_spec("c"), 3.0)
    j.close()
    j = Journal.open(tmp_path)
    assert [s.job_id for s in j.jobs()] == ["a", "b", "c"]
    j.close()


def test_a_complete_last_record_without_its_newline_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "jobs.journal"
    path.write_bytes(b'{"v":1,"op":"submit","at":1.0,"spec":{"job_id":"a","argv":["x"]}}' + bytes(PREALLOC_BYTES))
    j = Journal.open(tmp_path)
    j.submitted(_spec("b"), 2.0)
    j.close()
    assert [s.job_id for s in Journal.open(tmp_path).jobs()] == ["a", "b"]
