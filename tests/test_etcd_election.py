"""Leader election on etcd: the pure core, then real etcd (skipped where ``etcd`` is absent):
two campaigners, the leader's lease revoked or its process killed, the other leads within
TTL + a margin, epochs strictly increase, resign hands over at once; the lease renewed on its
own thread holds while the event loop is blocked past the TTL, and a leader whose renewal
stopped knows it is not leading the moment its loop wakes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from placer.election import Election, ElectionCore, Leadership, Role
from placer.etcd import EtcdClient, KeyValue
from testing.etcd import EtcdCluster, etcd_running
from testing.waiting import poll

TTL = 2
MARGIN_S = 4.0     # etcd's lease checker, a watch, a loaded machine
PREFIX = b"/herd/test/election/"
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the core, no I/O

def kv(key: bytes, rev: int, value: bytes = b"") -> KeyValue:
    return KeyValue(key=key, value=value or key, create_revision=rev)


def test_core_ranks_by_create_revision() -> None:
    c = ElectionCore(3)
    c.granted(7, 3, sent_at=100.0)
    c.joined(b"p/c", 30)
    turn = c.rank([kv(b"p/b", 20), kv(b"p/c", 30), kv(b"p/a", 10), kv(b"p/d", 40)])
    assert not turn.lost and turn.predecessor == b"p/b"
    assert turn.leader is not None and turn.leader.key == b"p/a"
    assert c.view(100.5) == Leadership(Role.WAITING, 0, "p/a", 10)
    turn = c.rank([kv(b"p/c", 30), kv(b"p/d", 40)])
    assert turn.predecessor == b"" and c.lead(101.0)
    assert c.view(101.0) == Leadership(Role.LEADER, 30, "p/c", 30)
    assert c.rank([kv(b"p/d", 40)]).lost       # our key is gone


def test_core_leads_when_the_leader_it_waited_behind_is_gone() -> None:
    """The predecessor's deletion: when it led, no older key is left and we lead without
    reading the keys again, naming ourselves; when another led, we must look again."""
    c = ElectionCore(3, b"http://c")
    c.granted(7, 3, sent_at=100.0)
    c.joined(b"p/c", 30)
    behind_leader = c.rank([kv(b"p/b", 20, b"http://b"), kv(b"p/c", 30)])
    assert c.predecessor_gone(behind_leader) and c.lead(100.5)
    assert c.view(100.5) == Leadership(Role.LEADER, 30, "http://c", 30)
    d = ElectionCore(3, b"http://d")
    d.granted(8, 3, sent_at=100.0)
    d.joined(b"p/d", 40)
    behind_other = d.rank([kv(b"p/a", 10, b"http://a"), kv(b"p/b", 20), kv(b"p/d", 40)])
    assert not d.predecessor_gone(behind_other) and d.view(100.5).leader == "http://a"
    assert not d.predecessor_gone(d.rank([kv(b"p/d", 40)]))   # (none waited behind)


def test_core_belief_ends_a_ttl_after_the_last_renewal_sent() -> None:
    c = ElectionCore(3)
    c.granted(7, 3, sent_at=100.0)
    c.joined(b"k", 5)
    assert c.lead(100.0) and c.leading(102.9)
    assert not c.leading(103.0)                 # no renewal: the lease may be gone at etcd
    v = c.view(103.0)                           # fenced: acts on nothing, keeps asking etcd
    assert v.role is Role.LEADER and v.fenced and not v.leading and v.epoch == 5
    assert c.renewed(3, sent_at=102.0)          # sent at 102: good until 105, not reply time + 3
    assert c.leading(104.9) and not c.leading(105.0)
    assert c.view(104.0) == Leadership(Role.LEADER, 5, "", 5)   # renewed: the same epoch leads again
    assert c.renewed(3, sent_at=101.0) and c.valid_until == 105.0   # a late old reply shortens nothing
    assert not c.renewed(0, sent_at=104.0)      # etcd says the lease is gone
    assert c.role is Role.IDLE and not c.leading(104.0)


def test_core_does_not_lead_on_an_expired_lease() -> None:
    c = ElectionCore(2)
    c.granted(1, 2, sent_at=0.0)
    c.joined(b"k", 9)
    assert not c.lead(2.5) and c.role is Role.WAITING


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.integers(1, 5)), max_size=20), st.floats(0, 120),
       st.lists(st.integers(1, 10_000), min_size=1, max_size=8, unique=True), st.randoms())
def test_core_properties(replies: list[tuple[float, int]], now: float, revs: list[int], rnd: random.Random) -> None:
    """Renewals answered in any order: the belief ends at the latest send + TTL, never later;
    the ranking does not depend on the order etcd lists the keys in."""
    c = ElectionCore(3)
    c.granted(1, 3, sent_at=0.0)
    c.joined(b"k%d" % revs[0], revs[0])
    for sent, ttl in replies:
        assert c.renewed(ttl, sent)
    until = max([3.0] + [sent + ttl for sent, ttl in replies])
    assert c.valid_until == until and c.expired(now) == (now >= until)
    kvs = [kv(b"k%d" % r, r) for r in revs]
    rnd.shuffle(kvs)
    turn = c.rank(kvs)
    assert turn.leader is not None and turn.leader.create_revision == min(revs)
    older = [r for r in revs if r < revs[0]]
    assert turn.predecessor == (b"k%d" % max(older) if older else b"")


# ------------------------------------------------------------------ real etcd

async def _lead(e: Election) -> Leadership:
    with trio.fail_after(TTL + MARGIN_S):
        return await e.wait_leading()


async def test_lease_revoked_the_other_leads(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(60):
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            a = Election(c, PREFIX, "http://a", ttl_s=TTL)
            b = Election(c, PREFIX, "http://b", ttl_s=TTL)
            await n.start(a.run)
            va = await _lead(a)
            await n.start(b.run)
            with trio.fail_after(TTL + MARGIN_S):
                while b.view.leader != "http://a" or b.view.role is not Role.WAITING:
                    await b.wait_change(b.view)
            assert b.view.leader_epoch == va.epoch and not b.leading()
            # a's lease revoked behind its back (an operator, or etcd expiring it): b leads
            lease_id = a.core.lease_id
            await c.revoke(lease_id)
            vb = await _lead(b)
            assert vb.epoch > va.epoch and vb.leader == "http://b"
            # a notices, steps down and queues up behind b with a newer key
            with trio.fail_after(TTL + MARGIN_S):
                while not (a.view.role is Role.WAITING and a.view.leader == "http://b"):
                    await a.wait_change(a.view)
            assert not a.leading() and a.core.revision > vb.epoch
            # b resigns: a leads at once (no TTL to wait), with a greater epoch still
            await b.resign()
            va2 = await _lead(a)
            assert va2.epoch > vb.epoch
            n.cancel_scope.cancel()


CAMPAIGNER = """
import sys, trio
from placer.etcd import EtcdClient
from placer.election import Election
async def main():
    async with EtcdClient(sys.argv[1].split(",")) as c:
        e = Election(c, sys.argv[2].encode(), "http://killed", ttl_s=int(sys.argv[3]))
        async with trio.open_nursery() as n:
            await n.start(e.run)
            v = await e.wait_leading()
            print(v.epoch, flush=True)
trio.run(main)
"""


async def test_leader_process_killed_the_other_leads_within_ttl(etcd_cluster: EtcdCluster) -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", CAMPAIGNER, ",".join(etcd_cluster.endpoints), PREFIX.decode(), str(TTL)],
        stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        out = b""
        with trio.fail_after(30):
            while not out.endswith(b"\n"):
                chunk = await proc.stdout.receive_some()
                assert chunk, "the campaigner exited"
                out += chunk
        killed_epoch = int(out)
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            b = Election(c, PREFIX, "http://b", ttl_s=TTL)
            with trio.fail_after(30):
                await n.start(b.run)
            assert b.view.leader == "http://killed" and b.view.leader_epoch == killed_epoch
            proc.send_signal(signal.SIGKILL)      # no resign: its lease must run out
            killed_at = trio.current_time()
            vb = await _lead(b)
            took = trio.current_time() - killed_at
            assert vb.epoch > killed_epoch
            assert took <= TTL + MARGIN_S
            n.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            proc.kill()
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


@pytest.fixture
def etcd3_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


async def test_an_etcd_member_killed_under_the_leader(etcd3_cluster: EtcdCluster) -> None:
    """The member the leader talks to dies: it fails over to another and keeps its epoch."""
    with trio.fail_after(60):
        async with EtcdClient(etcd3_cluster.endpoints, attempt_timeout_s=1.0) as c, trio.open_nursery() as n:
            a = Election(c, PREFIX, "http://a", ttl_s=3)
            await n.start(a.run)
            va = await a.wait_leading()
            used = str(c.statistics()["endpoint"])
            etcd3_cluster.kill_member(etcd3_cluster.endpoints.index(used))
            with trio.fail_after(15):
                await poll(lambda: c.statistics()["endpoint"] != used, 0.1)   # the next renewal goes elsewhere
            await trio.sleep(2 * 3)    # two TTLs on the surviving members
            assert a.leading() and a.view == va   # the same key, the same epoch
            n.cancel_scope.cancel()


async def _queued_behind(b: Election, leader: str) -> None:
    with trio.fail_after(TTL + MARGIN_S):
        while b.view.leader != leader or b.view.role is not Role.WAITING:
            await b.wait_change(b.view)


async def _a_leads_b_waits(c: EtcdClient, n: trio.Nursery) -> tuple[Election, Election, Any]:
    """Elections a and b: a leads (with its renewal thread), b queued behind it."""
    a = Election(c, PREFIX, "http://a", ttl_s=TTL)
    b = Election(c, PREFIX, "http://b", ttl_s=TTL)
    await n.start(a.run)
    va = await _lead(a)
    await n.start(b.run)
    await _queued_behind(b, "http://a")
    assert a.renewer is not None
    return a, b, va


async def test_a_leader_whose_loop_is_blocked_past_its_ttl_keeps_its_lease(etcd_cluster: EtcdCluster) -> None:
    """The renewal thread renews while the event loop is stuck (a CPU-bound stretch, a storm):
    on waking the leader still leads with the same key and epoch, and the other never led."""
    with trio.fail_after(60):
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            a, b, va = await _a_leads_b_waits(c, n)
            renewals = a.core.lease.renewals
            time.sleep(2.5 * TTL)  # noqa: ASYNC251 (the loop blocked on purpose: no task runs, no checkpoint)
            assert a.leading()                 # decided before any task ran: the thread's expiry holds
            assert a.core.lease.renewals > renewals
            kv = await c.get(a.core.key)
            assert kv is not None and kv.create_revision == va.epoch   # etcd kept the key, so the epoch
            await trio.sleep(TTL)
            assert a.leading() and a.view == va and b.promotions == 0 and not b.leading()
            n.cancel_scope.cancel()


async def test_a_leader_whose_renewal_stopped_is_fenced_on_waking(etcd_cluster: EtcdCluster) -> None:
    """No renewal for a TTL: the leader's very first check after a blocked loop says it does
    not lead (before any task ran to publish it); then it is fenced, the other leads with a
    greater epoch, and the old one queues up behind it."""
    with trio.fail_after(60):
        async with EtcdClient(etcd_cluster.endpoints) as c, trio.open_nursery() as n:
            a, b, va = await _a_leads_b_waits(c, n)
            a.renewer.stop()                   # the renewal thread ends: nobody renews a's lease
            time.sleep(TTL + 0.5)  # noqa: ASYNC251 (the loop blocked on purpose)
            assert a.view.leading              # what was published before the stall still says so,
            assert not a.leading()             # the check at the moment of acting does not
            with trio.fail_after(TTL + MARGIN_S):
                while not (a.view.fenced or a.view.role is not Role.LEADER):
                    await a.wait_change(a.view)
            vb = await _lead(b)
            assert vb.epoch > va.epoch and not a.leading()
            await _queued_behind(a, "http://b")
            assert a.fencings + a.losses >= 1 and a.core.revision > vb.epoch
            n.cancel_scope.cancel()
