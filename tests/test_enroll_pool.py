"""Enrolment certificate checks in worker processes (placer.enrollpool): what a worker finds is
what the desk would have found, a batch's answers are the desk's whatever the pool did, and
refusals keep their structured outcome."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from infra.pki import CA, make_ca
from placer.enrollpool import MAX_WORKERS, MIN_BATCH, MIN_CORES, PARENT_POLL_S, EnrollPool, default_workers
from scheduler_link.enroll import (
    EnrollClient,
    EnrollDesk,
    EnrollRefused,
    check_members,
    member_known,
)
from scheduler_link.messages import Enroll, NodeReport, TopologyPath
from tests.test_enroll_crypto import NOW, _der
from tests.test_enroll_crypto import Cluster as CryptoCluster


class Cluster(CryptoCluster):
    """The enrolment tests' CA, placer certificate and desk (and their clock, NOW), making whole enrolments."""

    def enrolment(self, node: str, *, ca: CA | None = None, principal: str | None = None) -> Enroll:
        key, cert = (ca or self.ca).issue(principal or f"node:{node}", rack=None if principal else "z/b/r1")
        rep = NodeReport(node_id=node, boot_id="b1", seq=1, full=True, control_url=f"http://{node}",
                         topology=TopologyPath(zone="z", block="b", rack="r1"), sent_at=NOW)
        e, _ = EnrollClient(self.ca.cert, key, _der(cert)).make(rep, self.placer_cert, now=NOW)
        return e


@pytest.fixture(scope="module")
def cl() -> Cluster:
    return Cluster()


def test_a_workers_check_is_the_desks_and_a_refusal_is_none(cl: Cluster) -> None:
    good = [cl.enrolment(f"n{i}") for i in range(3)]
    stranger = cl.enrolment("x", ca=CA(*make_ca()))
    operator = cl.enrolment("op", principal="operator")
    ders = [e.cert for e in [*good, stranger, operator]]
    ca, key = cl.desk.pool_args()
    got = check_members(ca, key, ders)
    assert got[3] is None and got[4] is None
    for e, k in zip(good, got[:3], strict=True):
        assert k == member_known(e.cert, cl.ca.cert, cl.placer_key)
        assert k is not None and k.node_id == e.node_id and k.rack == "z/b/r1"


async def test_a_batch_checked_by_a_worker_is_answered_as_the_desk_answers_it(cl: Cluster) -> None:
    desk = EnrollDesk(cl.ca.cert, cl.placer_key, cl.placer_cert)
    batch = [cl.enrolment(f"m{i}") for i in range(MIN_BATCH + 2)]
    stranger = cl.enrolment("s", ca=CA(*make_ca()))
    batch.insert(5, stranger)
    batch.append(batch[0])   # the same certificate twice: checked once
    ders = desk.unchecked(batch)
    assert len(ders) == MIN_BATCH + 3
    pool = EnrollPool(1)
    try:
        with trio.fail_after(60):
            checking = pool.submit(desk, ders)
            await checking.wait()
        got = checking.result()
    finally:
        pool.close()
    assert got is not None and pool.statistics()["certificates"] == len(ders)
    desk.learn(checking.ders, got)
    assert desk.cert_checks == MIN_BATCH + 2 and desk.unchecked(batch) == [stranger.cert]
    for e in batch[1:-1]:
        if e is stranger:
            with pytest.raises(EnrollRefused) as r:
                desk.check(e, now=NOW)
            assert r.value.outcome == "not_from_ca"
        else:
            assert desk.check(e, now=NOW).node_id == e.node_id
    assert desk.cert_checks == MIN_BATCH + 2   # (the stranger: refused by the desk, not counted as checked)
    assert desk.refused == {"not_from_ca": 1}


async def test_a_small_batch_or_no_workers_is_checked_by_the_desk(cl: Cluster) -> None:
    desk = EnrollDesk(cl.ca.cert, cl.placer_key, cl.placer_cert)
    small = [cl.enrolment(f"k{i}") for i in range(MIN_BATCH - 1)]
    for pool in (EnrollPool(1), EnrollPool(0)):
        ders = desk.unchecked(small if pool.workers else [*small, cl.enrolment("k99")])
        checking = pool.submit(desk, ders)
        await checking.wait()
        assert checking.result() is None and pool.statistics()["batches"] == 0
        assert pool.statistics()["started"] == 0
        pool.warm(desk)   # (no workers: nothing to start)
        assert pool.statistics()["started"] == int(pool.workers > 0)
        pool.close()


async def test_a_relays_batch_has_its_certificates_checked_by_a_worker(tmp_path, token_dir, tls_pki) -> None:
    """Through the real service and relay: a batch of members queued together (enrolling by
    ECDH: certificates with no enrolment key) is one batch up, its certificates go to a worker (where the host has a core to spare), every member enrols."""
    from scheduler_link.messages import EnrollAnswer
    from testing.waiting import poll

    from .test_enroll_relay import RACK, _report, rig

    with trio.fail_after(90):
        async with rig(tmp_path, token_dir, tls_pki) as r:
            await poll(lambda: r.svc.relays.relay_for(RACK) is not None, 0.02)
            pc = await r.placer_cert()   # (a relay asked for it: the workers start)
            assert r.svc.relays.enroll_pool.statistics()["started"] == int(r.svc.relays.enroll_pool.workers > 0)
            es = [r.client(f"m{i}", keyed=False).make(_report(f"m{i}"), pc, now=time.time())[0]
                  for i in range(MIN_BATCH + 4)]
            pending = [r.relay.member_enroll(e.node_id, e) for e in es]   # queued together: one batch up
            answers = [p if isinstance(p, EnrollAnswer) else await p for p in pending]
            assert [a.outcome for a in answers] == ["enrolled"] * len(es)
            assert all(f"m{i}" in r.svc.state.nodes for i in range(len(es)))
            desk = r.svc.relays.enroll_desk()
            assert desk is not None and desk.cert_checks == len(es) and desk.taken == len(es)
            pool = r.svc.relays.enroll_pool.statistics()
            assert pool["certificates"] == (len(es) if pool["workers"] else 0)


_CHILD = """
import sys, time
from infra.pki import throwaway
from placer.enrollpool import EnrollPool
from scheduler_link.enroll import desk_from_files
desk = desk_from_files(throwaway(sys.argv[1]).files("placer"))
EnrollPool(1).warm(desk)
print("ready", flush=True)
time.sleep(600)
"""


def _workers_of(pid: int) -> list[int]:
    """The spawned worker processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_the_workers_exit_when_the_placer_is_killed(tmp_path) -> None:
    """A kill -9 of the placer (a restart) leaves no worker behind."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "pki")], stdout=subprocess.PIPE,
                             cwd=str(Path(__file__).resolve().parent.parent))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while not (workers := _workers_of(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers, "the worker did not start"
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + 10 * PARENT_POLL_S
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(w) for w in workers)
    finally:
        child.kill()
        child.wait(10)


def test_default_workers_leave_a_small_host_alone():
    """Unset, no worker below MIN_CORES (on 2 cores one takes the core everything else runs on);
    from there one a core but the event loop's, at most MAX_WORKERS."""
    assert [default_workers(c) for c in (1, 2, MIN_CORES - 1)] == [0, 0, 0]
    assert default_workers(MIN_CORES) == MIN_CORES - 1
    assert default_workers(64) == MAX_WORKERS
    assert default_workers() == default_workers(os.cpu_count() or 1)
