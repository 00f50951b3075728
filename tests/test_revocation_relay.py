"""The deny-list reaches members behind a rack relay (issue: one host is one host): a node
revoked with ``herd pki revoke`` is refused by the data plane of a member that hears the
placer only through its relay, within a few heartbeats -- the placer signs the list and the
member checks the signature, so the relay can neither forge a list nor hand down an older
one. Real processes over mutual TLS: a placer, a relay agent and two members."""

from __future__ import annotations

import time

import pytest
import trio

from infra import pki, tls
from infra.auth import TokenSet
from infra.pki import throwaway
from tests.test_relay_agents import Api, RelayCluster, _start
from tests.test_security_identity import _refused

pytestmark = pytest.mark.slow


async def test_a_member_behind_a_relay_refuses_a_revoked_peer(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    ca = throwaway(tmp_path / "pki")
    with trio.fail_after(90), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=0.5, tls=True,
                                           extra_placer_config=f'ca_dir = "{ca.dir}"\n') as c:
        c.pki = ca
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])
        member = c.agents["node1"]
        bad_ctx = tls.client_context(ca.ca, ca.files("node:node2"))
        data_url = member.info["data_url"]
        assert not await _refused(bad_ctx, data_url)          # a peer like any other
        link = (await api.agent("node1", "/v1/status"))["link"]
        assert link["relay_url"] and link["revoked_at"] == 0.0, link

        assert pki.Revocations(ca.dir).revoke("node2", now=time.time())   # herd pki revoke node2

        async def refused() -> bool:
            return await _refused(bad_ctx, data_url)
        with trio.fail_after(10):
            await api.until(refused)
        link = (await api.agent("node1", "/v1/status"))["link"]
        # heard through the relay (the member never left it), from a list the placer signed
        assert link["revoked_at"] > 0 and link["revoked_refused"] == 0 and link["relay_url"], link
        assert link["relay_failures"] == 0, link
        # the others are still served
        assert not await _refused(tls.client_context(ca.ca, ca.files("node:node0")), data_url)
