"""Emulated nodes registering with the real placer process over mutual TLS (subprocesses,
loopback only): each node over its own connection with its own certificate; a node
certificate that asks to speak for another node is refused; counts asserted, never times."""

from __future__ import annotations

import httpx
import pytest
import trio

from scheduler_link import pki, tls
from scheduler_link.auth import TokenSet, generate_token_dir
from scheduler_link.heartbeat_wire import HeartbeatClient, WireError
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, verify, wait_nodes_up

N = 96


async def test_emulated_fleet_registers_over_mutual_tls(tmp_path):
    td = generate_token_dir(tmp_path / "tokens")
    ca = pki.throwaway(tmp_path / "pki")
    viewer = {"authorization": f"Bearer {TokenSet.load(td).viewer}"}
    with trio.fail_after(180):
        async with PlacerProc(tmp_path, td, PlacerOptions(heartbeat_s=2.0, tls_dir=str(ca.dir))) as placer, \
                EmulatorProc(placer, td, nodes=N, mux=0, tls_dir=ca.dir, log_path=tmp_path / "emu.log") as emu, \
                httpx.AsyncClient(timeout=60, headers=viewer, verify=verify(ca.dir)) as c:
            assert placer.url.startswith("https://") and placer.wire_url.startswith("tls://")
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, N, limit_s=150)
            assert up == N
            r = await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})
            fc = r.json()["framed_channel"]
            assert fc["open_connections"] >= N and fc["wrong_node"] == 0
            # one emulated node's certificate cannot open another node's channel
            ctx = tls.client_context(ca.ca, ca.files("node:hz00-b000-r00-n00"))
            with pytest.raises(WireError, match="403"):
                await HeartbeatClient.connect(placer.wire_url, "", "hz00-b000-r00-n01", ssl_context=ctx)
            r = await c.get(f"{placer.url}/v1/status")
            assert r.json()["tls"] is True
