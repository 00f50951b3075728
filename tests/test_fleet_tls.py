"""Emulated nodes registering with the real placer process over mutual TLS (subprocesses,
loopback only): each node over its own connection with its own certificate; a node
certificate that asks to speak for another node is refused; counts asserted, never times."""

from __future__ import annotations

import httpx
import pytest
import trio

from infra import pki, tls
from infra.auth import TokenSet, generate_token_dir
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


async def test_relay_mode_fleet_registers_over_mutual_tls_then_beats_through_its_relays(tmp_path):
    """Relay mode over mutual TLS, as a fleet at scale runs: every member registers over its
    own connection with its own certificate (its MAC key comes that way), which it then
    closes; each rack's relay holds one frames connection with the relay node's certificate
    and carries its members' MACed beats. After the registration only the relays' connections
    stay open, and every node stays up for several lost-thresholds on relayed beats alone."""
    td = generate_token_dir(tmp_path / "tokens")
    ca = pki.throwaway(tmp_path / "pki")
    viewer = {"authorization": f"Bearer {TokenSet.load(td).viewer}"}
    racks = N // 32   # h100 racks of 32
    opts = PlacerOptions(heartbeat_s=0.5, lost_after_missed=3, tls_dir=str(ca.dir))
    with trio.fail_after(180):
        async with PlacerProc(tmp_path, td, opts) as placer, \
                EmulatorProc(placer, td, nodes=N, mux=8, tls_dir=ca.dir, extra=["--relays"],
                             log_path=tmp_path / "emu.log") as emu, \
                httpx.AsyncClient(timeout=60, headers=viewer, verify=verify(ca.dir)) as c:
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, N, limit_s=150)
            assert up == N
            with trio.fail_after(30):
                while True:
                    fc = (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})).json()["framed_channel"]
                    if fc["open_connections"] == racks:
                        break
                    await trio.sleep(0.2)
            assert fc["connections"] >= N and fc["wrong_node"] == 0 and fc["refused"] == 0
            await trio.sleep(4 * opts.heartbeat_s * opts.lost_after_missed)   # several lost thresholds
            from testing.harness import nodes_up
            assert await nodes_up(c, placer.url) == N
            fc = (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})).json()["framed_channel"]
            assert fc["open_connections"] == racks
