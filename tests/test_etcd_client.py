"""placer.etcd against a real etcd (skipped where the ``etcd`` binary is absent): round trips,
a transaction whose compare fails, leases, watches, errors as one line, endpoint failover."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from placer.errors import EtcdRefused, EtcdUnavailable, LeaseNotFound
from placer.etcd import REQUEST_LIMIT, Compare, EtcdClient, Op, prefix_end, tls_context
from testing.etcd import EtcdCluster, etcd_running, free_port

BOUND_S = 20


@pytest.fixture
def etcd3_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_round_trip(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(b"/t/a", b"\x00\xffone")   # any bytes: base64 inside
            await c.put(b"/t/b", b"two")
            kv = await c.get(b"/t/a")
            assert kv is not None and kv.value == b"\x00\xffone" and kv.create_revision == rev
            r = await c.range(b"/t/", prefix_end(b"/t/"), sort_target="CREATE", sort_order="DESCEND")
            assert [k.key for k in r.kvs] == [b"/t/b", b"/t/a"] and r.count == 2
            assert r.revision == rev + 1
            assert await c.delete(b"/t/", prefix_end(b"/t/")) == 2
            assert await c.get(b"/t/a") is None


async def test_txn_compare(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(b"/t/leader", b"me")
            ok = await c.txn([Compare.created(b"/t/leader", rev)], [Op.put(b"/t/x", b"1")],
                             [Op.get(b"/t/leader")])
            assert ok.succeeded and ok.ranges == []
            bad = await c.txn([Compare.created(b"/t/leader", rev + 100)], [Op.put(b"/t/x", b"2")],
                              [Op.get(b"/t/leader")])
            assert not bad.succeeded
            assert [kv.value for kv in bad.ranges[0]] == [b"me"]
            kv = await c.get(b"/t/x")
            assert kv is not None and kv.value == b"1"     # the failed branch wrote nothing
            # a missing key's create revision is 0
            gone = await c.txn([Compare.created(b"/t/nothing", 0)], [Op.put(b"/t/y", b"1")])
            assert gone.succeeded


async def test_limits_are_refused_in_one_line(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            with pytest.raises(EtcdRefused) as e:
                await c.put(b"/t/big", b"x" * (REQUEST_LIMIT + 1024))
            assert "request is too large" in str(e.value) and "\n" not in str(e.value)
            with pytest.raises(EtcdRefused, match="too many operations"):
                await c.txn([], [Op.put(b"/t/%d" % i, b"v") for i in range(129)])
            with pytest.raises(EtcdRefused, match="duplicate key"):
                await c.txn([], [Op.put(b"/t/d", b"v"), Op.put(b"/t/d", b"w")])


async def test_lease_grant_keepalive_revoke(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            lease = await c.grant(5)
            assert lease.id and lease.ttl == 5
            await c.put(b"/t/leased", b"v", lease=lease.id)
            assert await c.keepalive(lease.id) == 5
            await c.revoke(lease.id)
            assert await c.get(b"/t/leased") is None       # keys on a lease go with it
            assert await c.keepalive(lease.id) == 0
            await c.revoke(lease.id)                       # already gone: not an error
            with pytest.raises(LeaseNotFound):
                await c.put(b"/t/leased", b"v", lease=lease.id)


async def test_watch_sees_puts_and_deletes(etcd_cluster: EtcdCluster) -> None:
    with trio.fail_after(BOUND_S):
        async with EtcdClient(etcd_cluster.endpoints) as c:
            rev = await c.put(b"/w/a", b"1")
            await c.delete(b"/w/a")
            seen: list[tuple[str, bytes, int]] = []
            async with c.watch(b"/w/", prefix_end(b"/w/"), start_revision=rev) as batches:
                async for b in batches:
                    seen += [(e.type, e.kv.key, e.kv.mod_revision) for e in b.events]
                    if len(seen) >= 3:
                        break
                    if b.created:
                        await c.put(b"/w/b", b"2")
            assert seen == [("PUT", b"/w/a", rev), ("DELETE", b"/w/a", rev + 1), ("PUT", b"/w/b", rev + 2)]


async def test_failover_to_a_live_endpoint(etcd3_cluster: EtcdCluster) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(BOUND_S):
        # (an attempt's deadline past etcd's election timeout: the paused member may be the raft
        # leader, and the others answer once they have elected another)
        async with EtcdClient([dead, *etcd3_cluster.endpoints], attempt_timeout_s=4.0) as c:
            await c.put(b"/f/a", b"1")        # the dead endpoint refuses: the next one answers
            assert c.failovers >= 1 and c.statistics()["endpoint"] != dead
            # the member in use hangs (SIGSTOP): after one attempt's deadline, another answers
            etcd3_cluster.pause_member(etcd3_cluster.endpoints.index(str(c.statistics()["endpoint"])))
            kv = await c.get(b"/f/a")
            assert kv is not None and kv.value == b"1"


async def test_unavailable_names_every_endpoint() -> None:
    ports = [free_port(), free_port()]
    with trio.fail_after(BOUND_S):
        async with EtcdClient([f"http://127.0.0.1:{p}" for p in ports], attempt_timeout_s=1.0) as c:
            with pytest.raises(EtcdUnavailable) as e:
                await c.get(b"/x")
    msg = str(e.value)
    assert all(str(p) in msg for p in ports) and "\n" not in msg


@pytest.fixture
def etcd_tls(tmp_path: Path, tls_pki) -> Iterator[tuple[EtcdCluster, object]]:  # noqa: ANN001 - ThrowawayPKI
    yield from ((c, tls_pki) for c in etcd_running(tmp_path / "etcd", 1, tls=tls_pki.files("placer")))


async def test_tls_with_client_certificates(etcd_tls: tuple[EtcdCluster, object]) -> None:
    cluster, pki = etcd_tls
    mine = pki.files("operator")  # type: ignore[attr-defined]
    with trio.fail_after(BOUND_S):
        async with EtcdClient(cluster.endpoints, ssl_context=tls_context(str(mine.ca), str(mine.cert),
                                                                           str(mine.key))) as c:
            await c.put(b"/tls/a", b"1")
            kv = await c.get(b"/tls/a")
            assert kv is not None and kv.value == b"1"
        # without a client certificate etcd refuses the handshake: one line, every endpoint named
        async with EtcdClient(cluster.endpoints, ssl_context=tls_context(str(mine.ca)),
                              attempt_timeout_s=2.0) as c:
            with pytest.raises(EtcdUnavailable) as e:
                await c.get(b"/tls/a")
            assert cluster.endpoints[0] in str(e.value) and "\n" not in str(e.value)
