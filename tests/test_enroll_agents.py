"""Enrolment through the relay with real processes under mutual TLS: a placer and two agents
in one rack, one of them the relay. The member's agent is stopped and started again (a new
boot): it enrols through the relay it kept in its state dir, with no new connection to the
placer's framed channel, and reports through the relay from then on."""

from __future__ import annotations

import signal

import pytest
import trio

from infra.auth import TokenSet

from .test_relay_agents import Api, RelayCluster, _start

pytestmark = pytest.mark.slow


async def test_a_restarted_agent_enrols_through_the_relay_it_kept(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(120), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=0.5,
                                            recover_s=0.5, tls=True) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1])
        relay_url = (await api.agent("node0", "/v1/status"))["relay"]["listen_url"]
        assert (c.agents["node1"].state_dir / "relay-url").read_text() == relay_url
        first = (await api.agent("node1", "/v1/status"))["link"]
        assert first["enrolled"] == 0        # (it had never reported through a relay: directly)
        c.agents["node1"].signal_group(signal.SIGTERM)
        await trio.to_thread.run_sync(c.agents["node1"].proc.wait)
        before = (await api.get("/v1/cluster"))["framed_channel"]["connections"]
        await trio.to_thread.run_sync(c.start_agent, 1)

        async def enrolled() -> bool:
            link = (await api.agent("node1", "/v1/status"))["link"]
            return bool(link["registered"] and link["enrolled"] == 1 and link["relay_url"] == relay_url)
        await api.until(enrolled)
        link = (await api.agent("node1", "/v1/status"))["link"]
        assert link["boot_id"] != first["boot_id"] and link["enroll_failures"] == 0
        cluster = await api.get("/v1/cluster")
        assert cluster["placer"]["relays"]["enroll"]["taken"] == 1
        assert cluster["placer"]["relays"]["enroll"]["keyed"] == 1   # (its node.enrol, from `herd pki issue`)
        assert cluster["framed_channel"]["connections"] == before   # no connection to the placer for it
        nodes = await api.nodes()
        assert nodes["node1"]["state"] == "up"
