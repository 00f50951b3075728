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


async def test_ends_are_appended_without_an_fsync_and_made_durable_by_the_next_flush(tmp_path):
    """A job's end costs the event loop a write; the fsync is the group commit's (off the loop)."""
    j = Journal.open(tmp_path)
    for i in range(3):
        j.submitted(JobSpec(job_id=f"e{i}", argv=["x"]), 0.0)
    fsyncs = j.fsyncs
    j.ended_many([("e0", "succeeded", 1.0), ("e1", "failed", 1.0)])
    assert j.fsyncs == fsyncs and j.synced < j.appends          # written, not yet flushed
    await j.flush()
    assert j.fsyncs == fsyncs + 1 and j.synced == j.appends     # one fsync for both
    j.ended("e2", "cancelled", 2.0)                              # (one end alone: fsynced at once)
    assert j.synced == j.appends
    j.close()
    again = Journal.open(tmp_path)
    assert again.jobs() == []
    again.close()


async def test_a_cancel_is_answered_once_its_end_is_durable(tmp_path, token_dir):
    from infra.auth import TokenSet
    from tests.test_placer_service import start_cluster

    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            await cl.submit(job_id="c", pods=1, gpus_per_pod=8)
            await cl.job("c", wait="running")
            r = await cl.c.delete("/v1/jobs/c")
            assert r.status_code == 200 and r.json()["state"] == "cancelled"
            assert svc.journal.synced == svc.journal.appends      # the end record is on disk
            assert [s.job_id for s in svc.journal.jobs()] == []
            n.cancel_scope.cancel()
