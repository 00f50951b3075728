"""Without rack relays every node keeps its own connection and report stream to the placer,
which does not hold at fleet scale (bench.fleet: 131,072 direct nodes collapse it). Past
``[placer] direct_max_nodes`` with no relay connected (or ``relays = false``), a new node's
registration is refused with a clear error and counted; nodes already known still register
again; once a relay connects, new nodes are taken. An in-process placer over real loopback
sockets: HTTP reports and the framed channel's relay hello."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from infra.auth import TokenSet, auth_header
from placer.service import PlacerService
from scheduler_link.frames import open_frames
from scheduler_link.messages import GpuInfo, GpuSnapshot, NodeReport, RelayHello, TopologyPath
from testing.fake_agent import FakeAgent
from testing.waiting import poll

from .test_placer_service import cfg

R1 = "z1/b1/r1"


def _full(node: str, boot: str = "b1") -> bytes:
    snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True) for i in range(8)])
    return msgspec.json.encode(NodeReport(node_id=node, boot_id=boot, seq=1, full=True, control_url="http://127.0.0.1:9",
                                          topology=TopologyPath(zone="z1", block="b1", rack="r1"), snapshot=snap))


async def _register(c: httpx.AsyncClient, tokens: TokenSet, node: str, boot: str = "b1") -> httpx.Response:
    return await c.post(f"/v1/nodes/{node}/report", content=_full(node, boot), headers=auth_header(tokens.cluster))


def _refusals(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("herd_placer_direct_refusals_total "):
            return float(line.split()[1])
    raise AssertionError("herd_placer_direct_refusals_total is not served")


@pytest.mark.parametrize("relays", [True, False])
async def test_registrations_past_the_direct_limit_are_refused_until_a_relay_connects(
        tmp_path: Path, token_dir: Path, relays: bool) -> None:
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, direct_max_nodes=2, relays=relays, heartbeat_s=5.0), tokens)
            url = await n.start(svc.run)
            async with httpx.AsyncClient(base_url=url, timeout=10) as c:
                assert (await _register(c, tokens, "n0")).status_code == 200
                assert (await _register(c, tokens, "n1")).status_code == 200
                r = await _register(c, tokens, "n2")
                assert r.status_code == 503, r.text
                assert r.json()["error"].startswith("direct_limit: this placer serves at most 2 nodes"), r.text
                assert r.json()["retry_after_s"] == 30.0
                assert "n2" not in svc.state.nodes          # nothing of it kept
                # a node the placer knows registers again (a new boot) whatever the count
                assert (await _register(c, tokens, "n0", boot="b2")).status_code == 200
                assert _refusals((await c.get("/metrics")).text) == 1

                # n0 connects as its rack's relay: with relays on, new nodes are taken from now on
                relay = await open_frames(svc.wire_url, tokens.cluster or "", "n0",
                                          relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
                n.start_soon(relay.run, lambda ch, f: None)
                await poll(lambda: svc.relays.has_candidates(), 0.01)
                r = await _register(c, tokens, "n2")
                if relays:
                    assert r.status_code == 200, r.text
                    assert set(svc.state.nodes) == {"n0", "n1", "n2"}
                else:   # relays = false: the placer pushes every node directly, relay or not
                    assert r.status_code == 503 and r.json()["error"].startswith("direct_limit"), r.text
                    assert _refusals((await c.get("/metrics")).text) == 2
                await relay.aclose()
            n.cancel_scope.cancel()


async def test_a_refused_agent_comes_back_after_the_placers_retry_after_not_every_beat(
        tmp_path: Path, token_dir: Path, autojump_clock: object) -> None:
    """The refusal says when to try again (retry_after_s, 30 s): a refused AgentLink waits 15-30 s
    between tries instead of its own back-off (capped at the heartbeat, 0.1 s here), so a crowd
    past the limit costs the placer a refusal per node per ~20 s. Virtual time; real sockets."""
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(600):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, direct_max_nodes=1), tokens, clock=trio.current_time)
            url = await n.start(svc.run)
            first = FakeAgent("n0", tokens, rack="r1")
            await n.start(first.run, url)
            await poll(lambda: "n0" in svc.state.nodes, 0.02)
            late = FakeAgent("n1", tokens, rack="r1")
            await n.start(late.run, url)
            await trio.sleep(120.0)
            refused = svc.state.counters["direct_refusals"]
            assert "n1" not in svc.state.nodes
            assert 4 <= refused <= 9, refused     # one try at once, then one every 15-30 s: 120 s -> 4..9
            assert late.link is not None and "direct_limit" in (late.link.last_error or "")
            # its rack's relay connects: n1 is taken at its next try
            relay = await open_frames(svc.wire_url, tokens.cluster or "", "n0",
                                      relay=RelayHello(racks=[R1], listen_url="tcp://127.0.0.1:9"))
            n.start_soon(relay.run, lambda ch, f: None)
            with trio.fail_after(31):
                await poll(lambda: "n1" in svc.state.nodes, 0.05)
            await relay.aclose()
            n.cancel_scope.cancel()
