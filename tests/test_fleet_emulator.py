"""The fleet emulator against the real placer process (subprocesses, loopback only).

Registration of ``HERD_TEST_FLEET_NODES`` (default 4,096) emulated h100 nodes at once, as
after a placer restart (every node knows the framed channel): every node ``up`` with the
right GPU count, every report over the framed channel, the placer's open descriptors
bounded (a few multiplexed connections, not one per node). Then one gang placed on the
emulated fleet runs (acks, accepted -> fetching -> running events) and is cancelled.
Counts are asserted, never times.
"""

from __future__ import annotations

import os

import httpx
import trio

from infra.auth import TokenSet, generate_token_dir
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, wait_nodes_up

N = int(os.environ.get("HERD_TEST_FLEET_NODES", "4096"))
MUX = 8
# ~13 s on 2 shared cores at 4,096 nodes: not marked slow (pyproject: > 30 s is slow)


async def test_registration_of_an_emulated_fleet_through_the_real_placer(tmp_path):
    td = generate_token_dir(tmp_path / "tokens")
    tok = TokenSet.load(td)
    op = {"authorization": f"Bearer {tok.operator}"}
    with trio.fail_after(240):
        async with PlacerProc(tmp_path, td, PlacerOptions(heartbeat_s=2.0, fence_after_s=60)) as placer, \
                EmulatorProc(placer, td, nodes=N - N // 2, mux=MUX, log_path=tmp_path / "emu0.log",
                             extra=["--fetch-delay", "0.05", "--run-delay", "0.05"]) as e0, \
                EmulatorProc(placer, td, nodes=N // 2, offset=N - N // 2, mux=MUX,
                             log_path=tmp_path / "emu1.log") as e1, \
                httpx.AsyncClient(timeout=60, headers=op) as c:
            fds_before = placer.fds()
            await e0.go()
            await e1.go()
            up, _ = await wait_nodes_up(c, placer.url, N, limit_s=200)
            assert up == N

            nodes: list[dict] = []
            while len(nodes) < N:  # paginated (page=OFFSET:LIMIT); an older placer answers all at once
                page = (await c.get(f"{placer.url}/v1/nodes", params={"page": f"{len(nodes)}:1000"})).json()["nodes"]
                if not page:
                    break
                nodes += page
            assert len(nodes) == N and len({n["node_id"] for n in nodes}) == N
            assert {n["state"] for n in nodes} == {"up"}
            assert all(n["gpus"] == 8 and n["free_gpus"] == 8 and n["simulated"] for n in nodes)
            assert len({n["topology"]["rack"] for n in nodes[:64]}) == 2  # racks of 32
            cluster = (await c.get(f"{placer.url}/v1/cluster")).json()
            assert {k: cluster["nodes"][k] for k in ("up", "lost", "simulated")} == {"up": N, "lost": 0, "simulated": N}

            s0, s1 = await e0.stats(c), await e1.stats(c)
            for s in (s0, s1):
                assert s["registered"] == s["nodes"]
                assert s["wire_full_reports"] == s["full_reports"] >= s["nodes"]  # none over HTTP
                assert s["failures"] == 0
            # a few multiplexed connections, not one per node
            assert placer.fds() <= fds_before + 2 * MUX + 16
            assert s0["open_fds"] < 64 and s1["open_fds"] < 64

            # one gang on the emulated fleet: placed, every pod running, then cancelled
            spec = {"job_id": "gang", "pods": 64, "gpus_per_pod": 8, "within": "block", "priority": 1,
                    "argv": ["train"]}
            r = await c.post(f"{placer.url}/v1/jobs", json=spec, headers=op)
            assert r.status_code == 201, r.text
            job = (await c.get(f"{placer.url}/v1/jobs/gang",
                               params={"wait": "running", "timeout_ms": "60000", "pods": "0:64"})).json()
            assert job["state"] == "running"
            assert {p["state"] for p in job["pods"]} == {"running"} and len(job["pods"]) == 64
            if "pod_counts" in job:
                assert job["pod_counts"] == {"running": 64}
            s0, s1 = await e0.stats(c, "gang"), await e1.stats(c, "gang")
            assert s0["job"]["events"] + s1["job"]["events"] == 64 * 3  # accepted, fetching, running
            assert s0["acks"].get("accepted", 0) + s1["acks"].get("accepted", 0) == 64
            r = await c.delete(f"{placer.url}/v1/jobs/gang", headers=op)
            assert r.status_code == 200
            job = (await c.get(f"{placer.url}/v1/jobs/gang",
                               params={"wait": "cancelled", "timeout_ms": "30000"})).json()
            assert job["state"] == "cancelled"
            # every pod told to stop: terminating, then exited (the fake supervisor's grace)
            with trio.fail_after(30):
                while True:
                    s0, s1 = await e0.stats(c, "gang"), await e1.stats(c, "gang")
                    if s0["job"]["events"] + s1["job"]["events"] >= 64 * 5:
                        break
                    await trio.sleep(0.1)
            assert s0["job"]["events"] + s1["job"]["events"] == 64 * 5
