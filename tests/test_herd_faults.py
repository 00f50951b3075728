"""Faults in a herd, each with bit-exact results on the nodes that should finish:
a peer killed mid-transfer, a peer serving corrupted bytes, the origin down for a
while, a peer that accepts and never answers, a real full disk on one node."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import trio

from p2p.errors import StoreFullError
from p2p.herd import herd_fetch
from scheduler_link.messages import Peer
from testing.waiting import poll
from tests.conftest import is_root
from tests.herd_cluster import (
    FAST,
    assert_bit_exact,
    make_artifact,
    open_file_origin,
    start_nodes,
)

TOKEN = "fault-token"


async def test_peer_killed_mid_transfer(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 8 * 1024 * 1024, chunk_size=128 * 1024, seed=11)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, peer_rate_bps=200e6)   # slow enough to kill it mid-way
    victim_scope = trio.CancelScope()        # its data plane
    victim_fetch_scope = trio.CancelScope()  # its own fetch

    async def run_victim(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with victim_scope:
            async with trio.open_nursery() as vn:
                (v,) = await start_nodes(vn, tmp_path / "victim", 1, TOKEN, config=cfg)
                task_status.started(v)
                await trio.sleep_forever()

    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            victim = await nursery.start(run_victim)
            others = await start_nodes(nursery, tmp_path, 3, TOKEN, config=cfg)
            peers = [victim.peer] + [n.peer for n in others]

            async def victim_fetch() -> None:
                with victim_fetch_scope:
                    await herd_fetch(victim.herd, art.manifest_id, origin, peers)

            async def killer() -> None:
                await poll(lambda: victim.plane.statistics()["bytes_served"] >= 512 * 1024, 0.005)
                victim_scope.cancel()
                victim_fetch_scope.cancel()

            async with trio.open_nursery() as fetches:
                fetches.start_soon(killer)
                fetches.start_soon(victim_fetch)
                for n in others:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            assert victim_scope.cancel_called
            assert not victim.store.is_complete(art.manifest_id)
            errors = 0
            for n in others:
                assert_bit_exact(n, art)
                st = n.herd.health.stats.get(victim.node_id)
                errors += (st.errors + st.misses) if st else 0
                await n.herd.aclose()
            assert errors >= 1          # the survivors noticed and fell through
            await victim.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_peer_serving_corrupted_bytes_is_banned(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=128 * 1024, seed=12)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN)
            bad = nodes[0]
            await herd_fetch(bad.herd, art.manifest_id, origin, [])
            # rot its chunk files on disk (same length): it will serve wrong bytes
            for cid in art.chunks:
                p = bad.store.chunk_path(cid)
                os.chmod(p, 0o644)
                data = bytearray(p.read_bytes())
                data[len(data) // 2] ^= 0x5A
                p.write_bytes(bytes(data))
            reads_before = sum(origin.chunk_reads.values())
            peers = [n.peer for n in nodes]
            async with trio.open_nursery() as fetches:
                for n in nodes[1:]:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            for n in nodes[1:]:
                assert_bit_exact(n, art)
                st = n.herd.health.stats[bad.node_id]
                assert st.integrity_errors >= 1            # detected
                assert n.herd.health.until[bad.node_id] == float("inf")   # banned
                assert n.herd.counters.integrity_failures >= 1
                await n.herd.aclose()
            # fetched elsewhere: the origin once per chunk, the rest from the good peer
            assert sum(origin.chunk_reads.values()) - reads_before == len(art.chunks)
            await bad.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_origin_down_for_a_while_then_completes(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=128 * 1024, seed=13)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN)
            peers = [n.peer for n in nodes]
            # the manifest is already known; the chunk store is cold and the origin is down
            for n in nodes:
                n.store.put_manifest(art.manifest_id, art.manifest_bytes)
            origin.down_until = trio.current_time() + 1.0
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            assert origin.failures > 0
            assert sum(n.herd.counters.origin_retries for n in nodes) > 0
            assert max(origin.chunk_reads.values()) == 1
            for n in nodes:
                assert_bit_exact(n, art)
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


async def _blackhole(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A 'peer' that accepts connections, reads, and never answers."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        while await stream.receive_some(65536):
            pass

    async with trio.open_nursery() as n:
        await n.start(trio.serve_listeners, handler, listeners)
        task_status.started(f"http://127.0.0.1:{port}")


async def test_peer_that_never_answers_times_out(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=128 * 1024, seed=14)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, wait_ms=500, head_grace_s=0.5)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            hole_url = await nursery.start(_blackhole)
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN, config=cfg)
            peers = [n.peer for n in nodes] + [Peer(node_id="silent", data_url=hole_url)]
            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(herd_fetch, n.herd, art.manifest_id, origin, peers)
            timeouts = 0
            for n in nodes:
                assert_bit_exact(n, art)
                st = n.herd.health.stats.get("silent")
                timeouts += st.timeouts if st else 0
                await n.herd.aclose()
            assert timeouts >= 1
            nursery.cancel_scope.cancel()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    if not is_root():
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


async def test_full_disk_on_one_node(tmp_path: Path, tiny_tmpfs: Path) -> None:
    art = make_artifact(tmp_path, 3 * 1024 * 1024, chunk_size=128 * 1024, seed=15)
    origin = open_file_origin(art)
    cfg = dataclasses.replace(FAST, wait_ms=800)
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 3, TOKEN, config=cfg,
                                      store_roots={1: tiny_tmpfs / "store"})
            full = nodes[1]
            peers = [n.peer for n in nodes]
            errors: dict[str, BaseException] = {}

            async def fetch(n) -> None:
                try:
                    await herd_fetch(n.herd, art.manifest_id, origin, peers)
                except StoreFullError as e:
                    errors[n.node_id] = e

            async with trio.open_nursery() as fetches:
                for n in nodes:
                    fetches.start_soon(fetch, n)
            assert set(errors) == {full.node_id}
            msg = str(errors[full.node_id]).lower()
            assert "full" in msg or "space" in msg or "quota" in msg
            assert not full.store.is_complete(art.manifest_id)
            assert not any((tiny_tmpfs / "store" / "tmp").iterdir())   # no temp leftovers
            for n in (nodes[0], nodes[2]):
                assert_bit_exact(n, art)
            for n in nodes:
                await n.herd.aclose()
            nursery.cancel_scope.cancel()


async def test_busy_peer_is_not_penalised_and_fetch_completes(tmp_path: Path) -> None:
    from p2p.dataplane import DataPlaneConfig

    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=64 * 1024, seed=16)
    origin = open_file_origin(art)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nodes = await start_nodes(nursery, tmp_path, 2, TOKEN,
                                      plane_config=DataPlaneConfig(max_per_client=1))
            warm, cold = nodes
            await herd_fetch(warm.herd, art.manifest_id, origin, [])
            await herd_fetch(cold.herd, art.manifest_id, origin, [n.peer for n in nodes])
            assert_bit_exact(cold, art)
            assert warm.plane.statistics()["rejected_busy"] > 0
            st = cold.herd.health.stats[warm.node_id]
            assert st.misses > 0 and st.errors == 0          # busy is not a fault
            assert warm.node_id not in cold.herd.health.until
            for n in nodes:
                await n.herd.aclose()
            nursery.cancel_scope.cancel()
