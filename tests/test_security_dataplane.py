"""Issue 42, finding 7 (the data plane's part), as an attack: a host with a valid node
certificate of the cluster reads another gang's artifact (model weights) from a peer's data
plane. Real agents over mutual TLS on loopback: a1 runs a pod of gang g (a1, a2) using
manifest M, pushed to it as the placer pushes (its certificate, ``POST /v1/placements``), and
fetches M from a file origin; a member that asks before a1 has its gang's pod (the pushes
race) is held until it has, then served. a2, a member, reads M's manifest and chunks from a1; a3, with
its own valid certificate and no gang with a1, is refused -- manifest, have-bitmap, a chunk, a
batch -- with 403 and a structured reason, and so is a2 for a manifest of no gang of its
(membership of one gang opens no other). A manifest the operator made public
(``[dataplane] public``) goes to a3; once g's pod has ended, a2 is refused too."""

from __future__ import annotations

import dataclasses
import os

import httpx
import msgspec
import pytest
import trio

from agent.config import AgentConfig, DataPlaneSection
from agent.daemon import Agent
from infra import tls
from infra.auth import TokenSet
from p2p.fetch import fetch_artifact
from p2p.herd import render_metrics
from p2p.origins import open_origin
from p2p.peers import PeerClient, PeerRefused
from p2p.readers import Gang, Readers, chunk_refusal, manifest_refusal
from scheduler_link.messages import Peer, Placement, PodAssignment
from testing.waiting import poll
from tests.dataplane_agents import publish_random, secure_agent

_agent = secure_agent
_publish = publish_random


async def test_only_the_gangs_nodes_read_its_artifact_from_a_peer(tmp_path, token_dir, tls_pki):
    origin = f"file://{tmp_path / 'origin'}"
    m_gang, m_other, m_public, m_late = [await _publish(tmp_path, origin, x) for x in ("gang", "other", "open", "late")]
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            a1 = _agent(tmp_path, token_dir, tls_pki, "a1", origin, dataplane=DataPlaneSection(public=[m_public]))
            a2 = _agent(tmp_path, token_dir, tls_pki, "a2", origin)
            a3 = _agent(tmp_path, token_dir, tls_pki, "a3", origin)
            control = await n.start(a1.run)
            control2 = await n.start(a2.run)
            await n.start(a3.run)
            assert a1.store is not None and a1.dataplane is not None
            # what a1 holds: M (its gang's), a manifest of no gang here, a public one
            async with open_origin(origin) as o:
                for m in (m_other, m_public, m_late):
                    await fetch_artifact(a1.store, m, o)
            peers = [Peer(node_id="a1", data_url=a1.data_url), Peer(node_id="a2", data_url=a2.data_url)]
            ctx = tls.client_context(tls_pki.ca, tls_pki.files("placer"))

            async def push(job: str, manifest: str, gpu: int, *to: tuple[Agent, str]) -> None:
                """The placer's push of ``job``'s pods (one each, on GPU ``gpu``; gang peers a1 and a2)."""
                for rank, (a, api) in enumerate(to):
                    pl = Placement(placement_id=f"start:{job}:1:{a.node_id}", job_id=job, node_id=a.node_id,
                                   attempt=1, argv=["sleep", "30"], manifest_id=manifest, origin=origin,
                                   peers=peers, world_size=2,
                                   pods=[PodAssignment(workload_id=f"{job}.1.{rank}", rank=rank,
                                                       gpus=[a.gpu_snapshot().gpus[gpu].uuid])])
                    async with httpx.AsyncClient(verify=ctx, base_url=api, timeout=10) as placer:
                        r = await placer.post("/v1/placements", content=msgspec.json.encode(pl))
                        assert r.status_code == 200 and r.json()["accepted"], r.text

            def client(node: str) -> PeerClient:
                return PeerClient(token=tokens.cluster, ssl_context=tls.client_context(
                    tls_pki.ca, tls_pki.files(f"node:{node}")))

            member, outsider = client("a2"), client("a3")
            # a2 asks a1 for a chunk of gang h's manifest before a1 has h's pod (the pushes race):
            # held (in the wait budget), then served
            late = [c.id for c in a1.store.get_manifest(m_late).chunks][0]
            answer_send, answer = trio.open_memory_channel[bytes](1)

            async def ask_early() -> None:
                await answer_send.send(bytes(await member.get_chunk(a1.data_url, late,
                                                                    a1.store.chunk_size(late) or 0)))

            n.start_soon(ask_early)
            await poll(lambda: a1.dataplane.statistics()["waiting_requests"] >= 1, 0.01)  # type: ignore[union-attr]
            await push("h", m_late, 1, (a1, control))
            assert await answer.receive() == a1.store.read_chunk(late)
            # the placer pushes gang g's pods to a1 and a2 (peers: a1, a2)
            await push("g", m_gang, 0, (a1, control), (a2, control2))
            assert a2.store is not None
            await poll(lambda: m_gang in a1.store.complete_manifests() and m_gang in a2.store.complete_manifests(),
                       0.02)
            a1.dataplane.config = dataclasses.replace(a1.dataplane.config, member_wait_ms=100)  # (refusals below)
            chunks = {m: [c.id for c in a1.store.get_manifest(m).chunks] for m in (m_gang, m_other, m_public)}
            size = {c.id: c.size for m in chunks for c in a1.store.get_manifest(m).chunks}
            url = a1.data_url
            cid = chunks[m_gang][0]
            # the gang's member reads it all
            assert await member.get_manifest(url, m_gang) == a1.store.manifest_bytes(m_gang)
            assert bytes(await member.get_chunk(url, cid, size[cid])) == a1.store.read_chunk(cid)
            kept: dict[str, bytes] = {}

            def keep(c: str, body: memoryview) -> None:
                kept[c] = bytes(body)

            got = await member.get_chunks(url, [(c, size[c]) for c in chunks[m_gang][:2]], store=keep)
            assert list(got.outcomes) == ["ok", "ok"] and len(kept) == 2
            # another node of the cluster (a valid certificate, no gang with a1) reads none of it
            for attempt in (member.get_manifest(url, m_other), member.get_chunk(url, chunks[m_other][0],
                                                                                 size[chunks[m_other][0]]),
                            outsider.get_manifest(url, m_gang), outsider.get_have(url, m_gang, len(chunks[m_gang])),
                            outsider.get_chunk(url, cid, size[cid]),
                            outsider.get_chunk(url, cid, size[cid], wait_ms=50),
                            outsider.get_chunks(url, [(c, size[c]) for c in chunks[m_gang][:2]], store=keep),
                            outsider.get_chunks(url, [(c, size[c]) for c in chunks[m_gang][:2]], store=keep,
                                                wait_ms=50)):
                with pytest.raises(PeerRefused) as e:
                    await attempt
                assert e.value.reason == "not_a_member"
            stats = a1.dataplane.statistics()
            assert stats["refused_not_a_member"] == 8
            assert 'herd_dataplane_rejected_total{node="a1",reason="not_a_member"} 8' in render_metrics(
                "a1", None, stats)
            assert len(kept) == 2
            # public: anyone of the cluster
            pub = chunks[m_public][0]
            assert await outsider.get_manifest(url, m_public) == a1.store.manifest_bytes(m_public)
            assert bytes(await outsider.get_chunk(url, pub, size[pub])) == a1.store.read_chunk(pub)
            # the gang's pod ends here: its members no longer read its artifact from a1
            await a1.supervisor.stop("g.1.0", grace_s=0.1)
            await a1.supervisor.wait_terminal("g.1.0")
            with pytest.raises(PeerRefused):
                await member.get_chunk(url, cid, size[cid])
            for c in (member, outsider):
                await c.aclose()
            n.cancel_scope.cancel()


def test_the_read_decision_is_by_manifest_and_gang():
    m1, m2, c1, c2 = "1" * 64, "2" * 64, "c" * 64, "d" * 64
    listed = {m1: frozenset({c1}), m2: frozenset({c2})}
    r = Readers()
    r.set_gangs({"blob1": Gang(m1, frozenset({"a", "b"}))})
    assert manifest_refusal(r, "b", m1) is None and manifest_refusal(r, "x", m1) == "not_a_member"
    assert manifest_refusal(r, None, m1) == "not_a_node"              # an operator's or the placer's certificate
    assert chunk_refusal(r, "b", c1, listed.get) is None
    assert chunk_refusal(r, "b", c2, listed.get) == "not_a_member"    # m2's chunk: b is in no gang using m2
    # before a wait: a node with no gang here yet (its placement may come later) may wait ...
    assert chunk_refusal(r, "x", c1, listed.get, strict=False) is None
    r.set_gangs({"blob1": Gang(m1, frozenset({"a", "b"})), "blob3": Gang("3" * 64, frozenset({"x"}))})
    assert chunk_refusal(r, "x", c1, listed.get, strict=False) is None   # ... its gang's manifest not here yet
    assert chunk_refusal(r, "x", c1, listed.get) == "not_a_member"       # ... and after it, the strict check
    assert manifest_refusal(Readers(public=["*"]), None, m2) is None
    assert chunk_refusal(Readers(public=[m2]), "x", c2, listed.get) is None
    assert chunk_refusal(Readers(public=[m2]), "x", c1, listed.get) == "not_a_member"


def test_public_names_manifest_ids_or_every_manifest():
    assert DataPlaneSection(public=["*", "ab" * 32]).public == ["*", "ab" * 32]
    with pytest.raises(ValueError, match="neither a manifest id"):
        DataPlaneSection(public=["trainer:v1"])


def test_the_agent_takes_its_gangs_from_its_live_workloads():
    """Each live workload's gang: its blob's nodes, until the blob is here the peers its
    placement named (and the blob is asked for, once); ended workloads open nothing."""
    from agent.readers import GangReaders
    from agent.state import WorkloadRecord
    from infra.peers import PeerTable
    from scheduler_link.messages import GangBlob

    m, other = "1" * 64, "2" * 64
    recs = {
        "g.1.0": WorkloadRecord(workload_id="g.1.0", job_id="g", placement_id="start:g:1:a1", manifest_id=m,
                                gang_blob_id="B", peers=[Peer(node_id="a2", data_url="https://a2")], state="running"),
        "g.1.1": WorkloadRecord(workload_id="g.1.1", job_id="g", placement_id="start:g:1:a1", manifest_id=m,
                                gang_blob_id="B", state="fetching"),
        "h.1.0": WorkloadRecord(workload_id="h.1.0", job_id="h", placement_id="start:h:1:a1", manifest_id=other,
                                peers=[Peer(node_id="a4", data_url="https://a4")], state="exited"),
    }
    blobs: dict[str, GangBlob] = {}
    wanted: list[str] = []
    readers = Readers()
    gr = GangReaders(readers, lambda: recs, blobs.get, want=wanted.append)
    gr.refresh()
    assert readers.gangs() == {"B": Gang(m, frozenset({"a2"}))} and wanted == ["B"]
    blobs["B"] = GangBlob(job_id="g", attempt=1, peers=PeerTable(node_ids=["a1", "a2", "a3"]))
    gr.refresh()
    gr.refresh()
    assert readers.gangs() == {"B": Gang(m, frozenset({"a1", "a2", "a3"}))} and wanted == ["B"]
    assert readers.manifests_for("a3") == [m] and readers.manifests_for("a4") == []


def test_a_data_plane_without_tls_starts_only_when_the_operator_says_reads_are_open(tmp_path, token_dir, tls_pki):
    """Without data-plane TLS no certificate names the asker, so reads by membership cannot
    hold: a secure agent with ``[dataplane] tls = false`` refuses to start with one line naming
    the way out, unless the operator says ``insecure_reads = true`` or makes every artifact
    public; an insecure agent (plain everything, warned at start) serves it as before."""
    from agent.errors import AgentError

    origin = f"file://{tmp_path / 'origin'}"
    with pytest.raises(AgentError, match=r"\[dataplane\] insecure_reads = true") as e:
        _agent(tmp_path, token_dir, tls_pki, "a5", origin, dataplane=DataPlaneSection(tls=False))
    assert "\n" not in str(e.value)
    for ok in (DataPlaneSection(tls=False, insecure_reads=True), DataPlaneSection(tls=False, public=["*"]),
               DataPlaneSection()):
        assert _agent(tmp_path, token_dir, tls_pki, "a5", origin, dataplane=ok).config.dataplane == ok
    insecure = AgentConfig(node_id="a6", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "a6"),
                           token_dir=str(token_dir), insecure=True, dataplane=DataPlaneSection(tls=False))
    Agent(insecure, env={"PATH": os.environ["PATH"]}, handle_signals=False)
