"""Rack relays through the real placer process (issue 12): an emulated fleet in relay mode
(one real frames connection per rack, aggregated beats, bundles answered per rack; the
relay -> member hop emulated in-process) registers, heartbeats through its relays, and a
gang over every node is delivered as RackBundles with no direct push; a hung relay's rack
is pushed directly after ``relay_timeout_s``, every node acked once; one node refusing
rolls the gang back everywhere through the relays. Subprocesses and loopback only; counts
asserted, never times."""

from __future__ import annotations

import os
from contextlib import AsyncExitStack

import httpx
import pytest
import trio

from infra.auth import TokenSet, generate_token_dir
from testing.fleet import fleet_nodes
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, wait_nodes_up
from tests.test_fleet_gang import RealAgent, _job

pytestmark = pytest.mark.slow

NODES = int(os.environ.get("HERD_TEST_RELAY_NODES", "2048"))   # 64 racks of 32


async def _relays(c: httpx.AsyncClient, url: str) -> dict:
    return (await c.get(f"{url}/v1/cluster", params={"detail": "0"})).json()["placer"]["relays"]


async def _freed(c: httpx.AsyncClient, url: str, gpus: int) -> None:
    with trio.fail_after(120):
        while (await c.get(f"{url}/v1/cluster")).json()["model"]["free"] < gpus:
            await trio.sleep(0.25)


async def test_a_fleet_wide_gang_through_rack_relays(tmp_path):
    td = generate_token_dir(tmp_path / "tokens")
    tok = TokenSet.load(td)
    op = {"authorization": f"Bearer {tok.operator}"}
    racks = NODES // 32
    hung_rack = "/".join(_rack_of(5 * 32))          # the sixth rack's relay never answers
    bad_node = fleet_nodes("h100", NODES, 1)[0].node_id
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            placer = await stack.enter_async_context(
                PlacerProc(tmp_path, td, PlacerOptions(heartbeat_s=1.0, fence_after_s=120, ack_timeout_s=10.0)))
            c = await stack.enter_async_context(httpx.AsyncClient(timeout=60, headers=op))
            emu = await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=NODES, log_path=tmp_path / "emu.log", extra=["--relays"]))
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, NODES, limit_s=180)
            assert up == NODES
            rel = await _relays(c, placer.url)
            assert rel["racks"] == racks and rel["candidates"] == racks
            # heartbeats come as one beat per rack and interval, and keep every node up
            b0 = rel["beats"]
            await trio.sleep(3.5)
            rel = await _relays(c, placer.url)
            assert rel["beats"] - b0 >= 2 * racks and rel["beat_entries"] >= 2 * NODES
            assert rel["beats"] - b0 <= 5 * racks        # ... and no more (one per interval after each answer)
            cl = (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})).json()
            assert cl["nodes"]["up"] == NODES and cl["nodes"]["lost"] == 0
            assert cl["framed_channel"]["frames_connections"] == racks

            # -- 1: every node, through the relays; nothing pushed directly
            spec = {"job_id": "r1", "pods": NODES, "gpus_per_pod": 8, "argv": ["/bin/sleep", "600"], "grace_s": 1}
            assert (await c.post(f"{placer.url}/v1/jobs", json=spec)).status_code == 201
            job = await _job(c, placer.url, "r1", "running")
            assert job["state"] == "running" and job["pod_counts"] == {"running": NODES}, job
            rel = await _relays(c, placer.url)
            d = rel["last_delivery"]
            assert d["job_id"] == "r1" and d["racks"] == racks, rel
            assert d["job_id"] == "r1" and d["racks"] == racks and d["direct"] == 0 and d["fallback_nodes"] == 0
            assert rel["relayed_nodes"] >= NODES and rel["blob_seeds"] >= 1
            es = await emu.stats(c)
            assert es["parts"] == NODES and es["placements"] == 0      # no HTTP push at all
            assert es["acks"].get("accepted") == NODES
            assert es["blobs"] == 1 and es["part_bytes_max"] < 64 << 10
            # the CPU stamps bench.delivery reads (the placer's at acked, the emulator's at its last answer)
            assert 0 < d["process_cpu_at_members_acked_s"] <= d["process_cpu_at_end_s"]
            assert 0 < es["cpu_at_last_answer_s"] <= es["cpu_s"]
            assert (await c.delete(f"{placer.url}/v1/jobs/r1")).status_code == 200
            assert (await _job(c, placer.url, "r1", "cancelled"))["state"] == "cancelled"
            await _freed(c, placer.url, NODES * 8)
            es = await emu.stats(c)   # the cancel's 2,048 stops went through the relays as well
            assert es["placements"] == 0 and es["victims_told"] == NODES
        # (the hung relay and the refusal run on a fresh fleet below)

    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            placer = await stack.enter_async_context(
                PlacerProc(tmp_path / "b", td, PlacerOptions(heartbeat_s=1.0, fence_after_s=120, ack_timeout_s=10.0)))
            c = await stack.enter_async_context(httpx.AsyncClient(timeout=60, headers=op))
            emu = await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=NODES, log_path=tmp_path / "emu-b.log", extra=["--relays", "--hung-relays", hung_rack]))
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, NODES, limit_s=180)
            assert up == NODES

            # -- 2: a hung relay: its 32 nodes are pushed directly after the relay timeout, each once
            spec = {"job_id": "r2", "pods": NODES, "gpus_per_pod": 8, "argv": ["/bin/sleep", "600"], "grace_s": 1}
            assert (await c.post(f"{placer.url}/v1/jobs", json=spec)).status_code == 201
            job = await _job(c, placer.url, "r2", "running")
            assert job["state"] == "running" and job["pod_counts"] == {"running": NODES}, job
            rel = await _relays(c, placer.url)
            assert rel["bundle_failures"] == 1 and rel["last_delivery"]["fallback_nodes"] == 32
            es = await emu.stats(c)
            assert es["placements"] == 32 and es["parts"] == NODES - 32
            assert es["acks"] == {"accepted": NODES}
            assert (await c.delete(f"{placer.url}/v1/jobs/r2")).status_code == 200
            await _freed(c, placer.url, NODES * 8)

            # -- 3: one more rack whose node refuses: the gang over every node rolls back everywhere
            async with EmulatorProc(placer, td, nodes=1, offset=NODES, log_path=tmp_path / "emu-bad.log",
                                    extra=["--relays", "--refuse-gpus", bad_node]) as bad:
                await bad.go()
                up, _ = await wait_nodes_up(c, placer.url, NODES + 1, limit_s=60)
                assert up == NODES + 1
                spec = {**spec, "job_id": "r3", "pods": NODES + 1}
                assert (await c.post(f"{placer.url}/v1/jobs", json=spec)).status_code == 201
                with trio.fail_after(120):
                    while (await c.get(f"{placer.url}/v1/cluster")).json()["placer"]["rollbacks"] < 1:
                        await trio.sleep(0.25)
                job = (await c.get(f"{placer.url}/v1/jobs/r3", params={"pods": "0:0"})).json()
                assert job["state"] in ("pending", "placing") and "refused_gpus" in (job["reason"] or ""), job
                assert (await c.delete(f"{placer.url}/v1/jobs/r3")).status_code == 200
                await _freed(c, placer.url, (NODES + 1) * 8)  # every accepted pod was told to stop, and stopped
                assert (await bad.stats(c))["acks"].get("refused_gpus", 0) >= 1


def _rack_of(i: int) -> tuple[str, str, str]:
    s = fleet_nodes("h100", i, 1)[0]
    return s.zone, s.block, s.rack


async def test_a_gang_over_real_agents_and_an_emulated_fleet_through_a_real_relay(tmp_path):
    """Three real agent processes in one rack, the first started with ``--relay``, beside an
    emulated fleet in relay mode: one gang over all of them is delivered as bundles (the real
    rack's through the real relay agent) and runs; with the relay agent killed, its members
    are pushed directly, each placed once."""
    td = generate_token_dir(tmp_path / "tokens")
    tok = TokenSet.load(td)
    op = {"authorization": f"Bearer {tok.operator}"}
    emulated = NODES - 32   # 63 emulated racks
    total = emulated + 3
    with trio.fail_after(600):
        async with AsyncExitStack() as stack:
            placer = await stack.enter_async_context(
                PlacerProc(tmp_path, td, PlacerOptions(heartbeat_s=1.0, fence_after_s=120, ack_timeout_s=10.0)))
            c = await stack.enter_async_context(httpx.AsyncClient(timeout=60, headers=op))
            emu = await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=emulated, log_path=tmp_path / "emu.log", extra=["--relays"]))
            await emu.go()
            relay = RealAgent(tmp_path, "real0", placer, td)
            relay.argv += ["--relay", "--relay-listen", "127.0.0.1:0"]
            relay = await stack.enter_async_context(relay)
            with trio.fail_after(30):   # members learn their relay when they register: the relay first
                while (await _relays(c, placer.url))["racks"] < emulated // 32 + 1:
                    await trio.sleep(0.2)
            members = [await stack.enter_async_context(RealAgent(tmp_path, f"real{i}", placer, td)) for i in (1, 2)]
            up, _ = await wait_nodes_up(c, placer.url, total, limit_s=180)
            assert up == total

            spec = {"job_id": "m1", "pods": total, "gpus_per_pod": 8, "argv": ["/bin/sleep", "600"], "grace_s": 1}
            assert (await c.post(f"{placer.url}/v1/jobs", json=spec)).status_code == 201
            job = await _job(c, placer.url, "m1", "running")
            assert job["state"] == "running" and job["pod_counts"] == {"running": total}, job
            rel = await _relays(c, placer.url)
            d = rel["last_delivery"]
            assert d["racks"] == emulated // 32 + 1 and d["direct"] == 0 and d["fallback_nodes"] == 0, rel
            assert (await emu.stats(c))["placements"] == 0
            viewer = {"authorization": f"Bearer {tok.viewer}"}
            for a in (relay, *members):   # the real agents run the pod's process
                ws = (await c.get(f"{a.url}/v1/workloads", headers=viewer)).json()
                items = ws.get("workloads", ws) if isinstance(ws, dict) else ws
                assert [w["state"] for w in items if w["job_id"] == "m1"] == ["running"], items
            assert (await c.delete(f"{placer.url}/v1/jobs/m1")).status_code == 200
            await _freed(c, placer.url, total * 8)

            # the relay agent dies; a gang over everything else reaches its members directly, once
            assert (await c.post(f"{placer.url}/v1/nodes/real0/cordon", json={})).status_code == 200
            assert relay.proc is not None
            os.killpg(relay.proc.pid, 9)
            with trio.fail_after(30):
                while (await _relays(c, placer.url))["racks"] > emulated // 32:
                    await trio.sleep(0.2)
            spec2 = {**spec, "job_id": "m2", "pods": total - 1}
            assert (await c.post(f"{placer.url}/v1/jobs", json=spec2)).status_code == 201
            job = await _job(c, placer.url, "m2", "running")
            assert job["state"] == "running" and job["pod_counts"] == {"running": total - 1}, job
            for a in members:
                ws = (await c.get(f"{a.url}/v1/workloads", headers=viewer)).json()
                items = ws.get("workloads", ws) if isinstance(ws, dict) else ws
                assert [w["state"] for w in items if w["job_id"] == "m2"] == ["running"], items
