"""Under mutual TLS, a rack whose relay does not answer is pushed directly, and the emulated
nodes take it: each has its own ``https://`` control endpoint presenting its own certificate,
as an agent's API does (testing.fleet, relay mode over TLS). The real placer process and one
emulator process, loopback only; counts asserted, never times."""

from __future__ import annotations

import httpx
import pytest
import trio

from infra import pki
from infra.auth import TokenSet, generate_token_dir
from testing.fleet import fleet_nodes
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, verify, wait_nodes_up
from tests.test_fleet_gang import _job

SHAPES = {"h100": (32, 8), "gb200": (18, 4)}   # nodes a rack, GPUs a node


@pytest.mark.parametrize("fleet", sorted(SHAPES))
async def test_a_hung_relays_rack_is_pushed_directly_over_tls_and_runs(tmp_path, fleet):
    rack, gpus = SHAPES[fleet]
    n_nodes = 3 * rack   # three racks
    td = generate_token_dir(tmp_path / "tokens")
    ca = pki.throwaway(tmp_path / "pki")
    op = {"authorization": f"Bearer {TokenSet.load(td).operator}"}
    s = fleet_nodes(fleet, rack, 1)[0]
    hung = f"{s.zone}/{s.block}/{s.rack}"   # the second rack's relay takes bundles and never answers
    opts = PlacerOptions(heartbeat_s=1.0, lost_after_missed=5, tls_dir=str(ca.dir), relays=True, ack_timeout_s=2.0)
    with trio.fail_after(240):
        async with PlacerProc(tmp_path, td, opts) as placer, \
                EmulatorProc(placer, td, nodes=n_nodes, fleet=fleet, mux=8, tls_dir=ca.dir, log_path=tmp_path / "emu.log",
                             extra=["--relays", "--enroll", "--hung-relays", hung]) as emu, \
                httpx.AsyncClient(timeout=60, headers=op, verify=verify(ca.dir)) as c:
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, n_nodes, limit_s=180)
            assert up == n_nodes
            nodes = (await c.get(f"{placer.url}/v1/nodes")).json()["nodes"]
            urls = {n["node_id"]: n["control_url"] for n in nodes}
            assert all(u.startswith("https://127.") for u in urls.values()) and len(set(urls.values())) == n_nodes

            spec = {"job_id": "g", "pods": n_nodes, "gpus_per_pod": gpus, "argv": ["/bin/sleep", "600"], "grace_s": 1}
            assert (await c.post(f"{placer.url}/v1/jobs", json=spec)).status_code == 201
            job = await _job(c, placer.url, "g", "running")
            assert job["state"] == "running" and job["pod_counts"] == {"running": n_nodes}, job
            es = await emu.stats(c)
            # the hung rack's members took their placements directly, over their own TLS endpoints
            assert es["placements"] == rack and es["parts"] == n_nodes - rack
            assert es["acks"] == {"accepted": n_nodes}
            assert es["control_handshakes"] >= 1
