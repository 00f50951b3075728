"""The fleet emulator's members enrolling through their rack's relay (``--enroll``) against the
real placer process over mutual TLS (subprocesses, loopback only): every member but the relays'
own nodes registers with no TLS handshake at the placer; counts asserted, never times."""

from __future__ import annotations

import httpx
import trio

from infra import pki
from infra.auth import TokenSet, generate_token_dir
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, nodes_up, verify, wait_nodes_up

N = 96
RACKS = N // 32   # h100 racks of 32


async def test_relay_mode_members_enrol_through_their_relay_with_no_handshake_at_the_placer(tmp_path):
    td = generate_token_dir(tmp_path / "tokens")
    ca = pki.throwaway(tmp_path / "pki")
    viewer = {"authorization": f"Bearer {TokenSet.load(td).viewer}"}
    opts = PlacerOptions(heartbeat_s=0.5, lost_after_missed=3, tls_dir=str(ca.dir), relays=True)
    with trio.fail_after(180):
        async with PlacerProc(tmp_path, td, opts) as placer, \
                EmulatorProc(placer, td, nodes=N, mux=8, tls_dir=ca.dir, extra=["--relays", "--enroll"],
                             log_path=tmp_path / "emu.log") as emu, \
                httpx.AsyncClient(timeout=60, headers=viewer, verify=verify(ca.dir)) as c:
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, N, limit_s=150)
            assert up == N
            st = await emu.stats(c)
            assert st["enrolled"] == N - RACKS and st["enroll_refused"] == {}
            cluster = (await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})).json()
            fc = cluster["framed_channel"]
            # the relays' connections up and their own nodes' registrations: no member's
            assert fc["connections"] <= 2 * RACKS and fc["wrong_node"] == 0
            desk = cluster["placer"]["relays"]["enroll"]
            assert desk["taken"] == N - RACKS and desk["refused"] == {}
            # their certificates came with enrolment keys (as `herd pki issue` gives them): no ECDH, no CA check
            assert desk["keyed"] == N - RACKS and desk["cert_checks"] == 0
            # members' reports go on through their relays with the keys they got sealed
            await trio.sleep(4 * opts.heartbeat_s * opts.lost_after_missed)
            assert await nodes_up(c, placer.url) == N
