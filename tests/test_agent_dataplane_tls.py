"""The agent's data plane over mutual TLS (issue 17: artifacts are often secret): the real
agent daemon serves its chunks on https:// with its node certificate and reads peers the same
way; a plain client, a client without a certificate of the cluster's CA, and a certificate of
another CA are refused; ``[dataplane] tls = false`` is plain TCP (warned), and asking for TLS
on an insecure agent is a configuration error."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import blake3
import pytest
import trio

from agent.config import AgentConfig, DataPlaneSection
from agent.daemon import Agent
from agent.errors import AgentError
from agent.supervisor import SupervisorConfig
from infra import pki, tls
from infra.auth import TokenSet
from p2p.peers import PeerClient, PeerError


def _agent(tmp: Path, token_dir: Path, node: str, *, tls_dir: Path | None, **kw) -> Agent:
    conf = AgentConfig(node_id=node, gpus="simulated:dgx-h100", state_dir=str(tmp / node), listen="127.0.0.1:0",
                       data_listen="127.0.0.1:0", token_dir=str(token_dir), heartbeat_s=0.2,
                       tls_dir=str(tls_dir) if tls_dir else None, insecure=tls_dir is None,
                       workloads=SupervisorConfig(shim_pool=0), **kw)
    return Agent(conf, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)


def _chunk(agent: Agent, data: bytes) -> str:
    cid = blake3.blake3(data).hexdigest()
    assert agent.store is not None
    agent.store.put_chunk(cid, data)
    return cid


async def test_chunks_travel_over_mutual_tls_between_agents(tmp_path, token_dir, tls_pki, caplog):
    tokens = TokenSet.load(token_dir)
    other_ca = pki.throwaway(tmp_path / "other-pki", nodes=["a2"])
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            # (every manifest public: this is about the transport; reads by membership are
            # tests/test_security_dataplane.py's)
            a1 = _agent(tmp_path, token_dir, "a1", tls_dir=tls_pki.node_dir("a1"),
                        dataplane=DataPlaneSection(public=["*"]))
            a2 = _agent(tmp_path, token_dir, "a2", tls_dir=tls_pki.node_dir("a2"))
            await n.start(a1.run)
            await n.start(a2.run)
            assert a1.data_url.startswith("https://") and a2.data_url.startswith("https://")
            data = os.urandom(300_000)
            cid = _chunk(a1, data)
            # a2's own herd client (its node certificate) reads a1's chunk
            assert a2.herd is not None and a2.herd.client.tls
            got = await a2.herd.client.get_chunk(a1.data_url, cid, len(data))
            assert bytes(got) == data
            # refused: a plain client (to the https URL and to the same port as http://), no certificate,
            # another CA's node certificate
            plain = PeerClient(token=tokens.cluster)
            with pytest.raises(PeerError):
                await plain.get_chunk(a1.data_url, cid, len(data))
            with pytest.raises(PeerError):
                await plain.get_chunk(a1.data_url.replace("https://", "http://"), cid, len(data))
            anonymous = PeerClient(token=tokens.cluster, ssl_context=tls.client_context(tls_pki.ca))
            with pytest.raises(PeerError):
                await anonymous.get_chunk(a1.data_url, cid, len(data))
            stranger = PeerClient(token=tokens.cluster, ssl_context=tls.client_context(
                tls_pki.ca, other_ca.files("node:a2")))
            with pytest.raises(PeerError):
                await stranger.get_chunk(a1.data_url, cid, len(data))
            # and a TLS client refuses to read a plain http:// peer rather than speak in the clear
            with pytest.raises(PeerError, match="TLS|https"):
                await a2.herd.client.get_chunk("http://127.0.0.1:9", cid, len(data))
            for c in (plain, anonymous, stranger):
                await c.aclose()
            n.cancel_scope.cancel()


async def test_dataplane_tls_off_is_plain_and_warned(tmp_path, token_dir, tls_pki, caplog):
    with trio.fail_after(60), caplog.at_level(logging.WARNING):
        async with trio.open_nursery() as n:
            a = _agent(tmp_path, token_dir, "a3", tls_dir=tls_pki.node_dir("a3"),
                       dataplane=DataPlaneSection(tls=False, insecure_reads=True))
            control = await n.start(a.run)
            assert control.startswith("https://")          # the control API stays TLS
            assert a.data_url.startswith("http://") and a.herd is not None and not a.herd.client.tls
            assert any("chunks travel in the clear" in r.getMessage() for r in caplog.records)
            n.cancel_scope.cancel()


def test_dataplane_tls_on_an_insecure_agent_is_a_config_error(tmp_path, token_dir):
    with pytest.raises(AgentError, match=r"\[dataplane\] tls = true"):
        _agent(tmp_path, token_dir, "a4", tls_dir=None, dataplane=DataPlaneSection(tls=True))
