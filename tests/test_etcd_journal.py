"""The jobs journal in etcd: batching under etcd's limits (pure), then real etcd (skipped where
``etcd`` is absent): a reload equals what was written (and what the file journal holds after
the same writes), a deposed leader's write is refused whole, a failed commit is retried,
big batches split under the 1.5 MiB request limit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from placer.election import Election
from placer.errors import Deposed, JournalError
from placer.etcd import REQUEST_LIMIT, TXN_OPS_LIMIT, EtcdClient
from placer.etcdjournal import MAX_TXN_BYTES, EtcdJournal, Fence, JobJournal, plan_txns
from placer.journal import Journal
from scheduler_link.messages import JobSpec
from testing.etcd import EtcdCluster
from testing.waiting import poll

PREFIX = b"/herd/test/"
BOUND_S = 30


def spec(i: int, pad: int = 0) -> JobSpec:
    return JobSpec(job_id=f"job-{i:05d}", pods=1 + i % 3, gpus_per_pod=8, priority=i % 5, argv=["train", str(i)],
                   env={"PAD": "x" * pad} if pad else {})


# ------------------------------------------------------------------ batching, no I/O

def test_plan_txns_respects_bytes_and_ops() -> None:
    writes: list[tuple[bytes, bytes | None]] = [(b"k%04d" % i, b"v" * 1000) for i in range(2000)]
    writes += [(b"d%04d" % i, None) for i in range(50)]
    txns = plan_txns(writes, max_bytes=100_000, max_ops=128)
    assert sum(len(t) for t in txns) == len(writes)
    assert all(len(t) <= 128 and sum(op.size() for op in t) <= 100_000 for t in txns)
    assert len(txns) == 21   # 2000 puts at ~1 KiB in 100 KB, then the deletes
    assert plan_txns([]) == []


def test_plan_txns_refuses_a_record_over_the_limit() -> None:
    with pytest.raises(JournalError, match="over etcd's request limit"):
        plan_txns([(b"k", b"v" * 2000)], max_bytes=1000)


# ------------------------------------------------------------------ real etcd

def write_the_same(j: JobJournal) -> None:
    """One history of writes, for either journal."""
    for i in range(12):
        j.submitted(spec(i), float(i), sync=False)
    j.attempt("job-00003", 2, 20.0)
    j.attempt("job-00004", 1, 20.0)
    j.ended_many([("job-00001", "succeeded", 21.0), ("job-00004", "failed", 21.0)])
    j.submitted(msgspec.structs.replace(spec(2), manifest_id="m2"), 22.0)   # a replaced spec keeps its place
    j.cordon("n1", True, 23.0, "disk")
    j.cordon("n2", True, 23.0, "drained by operator")
    j.cordon("n1", False, 24.0)
    j.ended("job-00011", "cancelled", 25.0)


async def test_reload_equals_what_was_written(etcd_cluster: EtcdCluster, tmp_path: Path) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(PREFIX + b"leader", b"me")
            fence = Fence(PREFIX + b"leader", rev)
            j = await EtcdJournal.load(c, PREFIX, fence)
            write_the_same(j)
            j.attempt("job-00005", 1, 26.0, restarts=1)
            await j.flush()
            assert j.synced == j.appends and j.txns == 1     # one batch, one transaction
            again = await EtcdJournal.load(c, PREFIX, fence)
            file = Journal.open(tmp_path / "state")
            write_the_same(file)
            await file.flush()
            file.close()
            file = Journal.open(tmp_path / "state")
            assert again.jobs() == j.jobs() == file.jobs()
            assert [s.job_id for s in again.jobs()][:3] == ["job-00000", "job-00002", "job-00003"]
            assert again.jobs()[1].manifest_id == "m2"
            assert again.attempts == j.attempts == {"job-00003": 2, "job-00005": 1}
            # the file journal's submissions stand for attempt 1 (placer.journal.FIRST_ATTEMPT)
            assert file.attempts == {**{s.job_id: 1 for s in file.jobs()}, "job-00003": 2}
            assert again.restarts == {"job-00005": 1}
            assert again.cordons == j.cordons == file.cordons == {"n2": "drained by operator"}
            file.close()


async def test_deposed_leader_writes_nothing(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            a = Election(c, PREFIX + b"election/", "http://a", ttl_s=2)
            b = Election(c, PREFIX + b"election/", "http://b", ttl_s=2)
            await n.start(a.run)
            va = await a.wait_leading()
            ja = await EtcdJournal.load(c, PREFIX, Fence(a.leader_key, va.epoch))
            ja.submitted(spec(1), 1.0)
            await ja.flush()
            await n.start(b.run)
            await c.revoke(a.core.lease_id)      # a is deposed (its lease gone), unaware yet
            vb = await b.wait_leading()
            ja.submitted(spec(2), 2.0)
            ja.cordon("n9", True, 2.0, "late")
            with pytest.raises(Deposed, match=f"epoch {va.epoch}"):
                await ja.flush()
            assert ja.deposed
            with pytest.raises(Deposed):      # and from then on
                ja.ended("job-00001", "failed", 3.0)
                await ja.flush()
            jb = await EtcdJournal.load(c, PREFIX, Fence(b.leader_key, vb.epoch))
            assert [s.job_id for s in jb.jobs()] == ["job-00001"] and jb.cordons == {}
            jb.submitted(spec(3), 4.0)
            await jb.flush()                  # the new leader writes
            assert [s.job_id for s in (await EtcdJournal.load(c, PREFIX, jb.fence)).jobs()] == ["job-00001", "job-00003"]
            n.cancel_scope.cancel()


async def test_big_batches_split_under_the_request_limit(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(60):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(PREFIX + b"leader", b"me")
            fence = Fence(PREFIX + b"leader", rev)
            j = await EtcdJournal.load(c, PREFIX, fence)
            for i in range(40):                  # ~4 MiB of specs: one transaction would be refused
                j.submitted(spec(i, pad=100_000), float(i), sync=False)
            for i in range(40, 340):             # and more records than one transaction may hold
                j.submitted(spec(i), float(i), sync=False)
            await j.flush()
            assert j.txns >= 5 and j.txn_bytes_max <= MAX_TXN_BYTES < REQUEST_LIMIT
            again = await EtcdJournal.load(c, PREFIX, fence)
            assert again.jobs() == j.jobs() and len(again.jobs()) == 340
            assert TXN_OPS_LIMIT == 128


async def test_a_record_too_large_is_refused_at_once(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(PREFIX + b"leader", b"me")
            j = await EtcdJournal.load(c, PREFIX, Fence(PREFIX + b"leader", rev))
            with pytest.raises(JournalError, match="request limit"):
                j.submitted(spec(1, pad=2 * REQUEST_LIMIT), 1.0)
            assert j.jobs() == [] and j.appends == 0


async def test_failed_commit_is_kept_and_retried(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(60):
        async with EtcdClient(etcd_cluster.endpoints, attempt_timeout_s=1.0) as c:
            rev = await c.put(PREFIX + b"leader", b"me")
            fence = Fence(PREFIX + b"leader", rev)
            j = await EtcdJournal.load(c, PREFIX, fence)
            etcd_cluster.kill_member(0)
            j.submitted(spec(1), 1.0)
            with pytest.raises(JournalError, match="etcd unavailable"):
                await j.flush()
            assert j.synced < j.appends
            etcd_cluster.start_member(0)
            await trio.to_thread.run_sync(etcd_cluster.wait_healthy)
            await j.flush()
            assert [s.job_id for s in (await EtcdJournal.load(c, PREFIX, fence)).jobs()] == ["job-00001"]


async def test_writer_commits_without_a_flush(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            rev = await c.put(PREFIX + b"leader", b"me")
            fence = Fence(PREFIX + b"leader", rev)
            j = await EtcdJournal.load(c, PREFIX, fence)
            await n.start(j.run)
            j.submitted(spec(1), 1.0)
            j.attempt("job-00001", 3, 2.0)
            async def synced() -> bool:
                return (await c.get(PREFIX + b"jobs/job-00001")) is not None and j.synced >= j.appends

            await poll(synced, 0.05)
            assert (await EtcdJournal.load(c, PREFIX, fence)).attempts == {"job-00001": 3}
            n.cancel_scope.cancel()
