"""The journal's group commit: a burst of submissions shares fsyncs, and each is durable
(in the file, and replayed) once its flush returns."""

from __future__ import annotations

import trio

from placer.journal import Journal
from scheduler_link.messages import JobSpec


async def test_concurrent_flushes_share_fsyncs_and_every_submit_is_replayed(tmp_path):
    j = Journal.open(tmp_path)
    done: list[str] = []

    async def submit(i: int) -> None:
        spec = JobSpec(job_id=f"j{i}", argv=["x"])
        j.submitted(spec, 0.0, sync=False)
        await j.flush()
        assert j.synced >= 1
        done.append(spec.job_id)

    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(submit, i)
    assert len(done) == 50 and j.synced == j.appends == 50
    assert 1 <= j.fsyncs < 50  # shared: fewer fsyncs than submissions
    j.ended_many([("j1", "succeeded", 1.0), ("j2", "failed", 1.0), ("nope", "failed", 1.0)])
    j.close()
    again = Journal.open(tmp_path)
    assert {s.job_id for s in again.jobs()} == {f"j{i}" for i in range(50)} - {"j1", "j2"}
    again.close()
