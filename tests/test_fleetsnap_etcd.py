"""The fleet snapshot of placers on etcd (placer.fleetsnap.EtcdFleetSnapshot): the leader writes
the ids of its up nodes there, a placer promoted to leader reads them and waits for exactly those
nodes (as a restarted single placer does with its file). Real etcd (skipped where absent): a
snapshot over several chunks reads back whole, the newest complete generation wins over an
incomplete newer one, older generations go, a deposed leader's write is refused. Pure: a
recovery whose snapshot is still being read holds a job that lacks pods."""

from __future__ import annotations

import pytest
import trio

from placer import fleetsnap
from placer.errors import JournalError
from placer.etcd import EtcdClient, Op, prefix_end
from placer.etcdjournal import Fence
from placer.fleetsnap import EtcdFleetSnapshot, Recovery
from testing.etcd import EtcdCluster

PREFIX = b"/herd/test/"
BOUND_S = 30


def _ids(n: int, tag: str = "") -> list[str]:
    return [f"z{i % 7}-b{i % 13:03d}-r{i % 97:03d}-n{i:06d}{tag}" for i in range(n)]


async def test_a_snapshot_in_chunks_reads_back_and_replaces_the_last(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            fence = Fence(PREFIX + b"leader", await c.put(PREFIX + b"leader", b"a"))
            store = EtcdFleetSnapshot(c, PREFIX, fence, chunk_bytes=4096)
            assert await store.load() is None
            first = _ids(20_000)
            await store.save(fleetsnap.encode(first, 1.0))
            got = await EtcdFleetSnapshot(c, PREFIX, fence).load()   # (another placer's reader)
            assert got is not None and got.nodes == first
            r = await c.range(store.prefix, prefix_end(store.prefix), keys_only=True)
            chunks = len(r.kvs)
            assert chunks > 2   # (it did not fit one chunk: the test covers the cut)
            second = _ids(5_000, "x")
            await store.save(fleetsnap.encode(second, 2.0))
            got = await store.load()
            assert got is not None and got.nodes == second
            r = await c.range(store.prefix, prefix_end(store.prefix), keys_only=True)
            assert len(r.kvs) < chunks   # the first generation is gone
            # a newer generation cut short (a leader deposed mid-write): the whole older one is read
            await c.put(store._key(store.generation + 10, 0, 3), b"partial")
            got = await store.load()
            assert got is not None and got.nodes == second


async def test_a_deposed_leaders_snapshot_is_refused(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            fence = Fence(PREFIX + b"leader", await c.put(PREFIX + b"leader", b"a"))
            store = EtcdFleetSnapshot(c, PREFIX, fence)
            await store.save(fleetsnap.encode(["n1"], 1.0))
            await c.txn([], [Op.delete(PREFIX + b"leader")])
            await c.put(PREFIX + b"leader", b"b")            # another leader's key now
            with pytest.raises(JournalError, match="no longer leads"):
                await store.save(fleetsnap.encode(["n1", "n2"], 2.0))
            got = await store.load()
            assert got is not None and got.nodes == ["n1"]


def test_while_the_snapshot_is_read_a_job_that_lacks_pods_is_held() -> None:
    r = Recovery(None, started=100.0, window_s=5.0, max_s=60.0, pending=True)
    r.heard("a")
    assert r.until(101.0, jobs_complete=False) == 160.0    # held: the missing pods may be anywhere
    assert r.until(101.0, jobs_complete=True) == 105.0     # nothing recovered can double: the window
    r.expect(["a", "b"])                                   # read: a reported before it came
    assert not r.pending and r.unheard == 1 and r.expected == 2
    assert r.until(102.0, jobs_complete=False) == 160.0    # b may hold them
    r.heard("b")
    assert r.until(102.0, jobs_complete=True) == 102.0     # everyone heard, every job whole: now
    none = Recovery(None, started=100.0, window_s=5.0, max_s=60.0, pending=True)
    none.expect(None)                                      # nothing in etcd: the window, as before
    assert none.until(101.0, jobs_complete=False) == 105.0
