"""Issue 42, contacts: a node outside a gang that holds its manifest (a "contact" the placer
names to the gang to seed its herd) serves it to the gang's nodes on the placer's read grant
(infra.grants) and to no one else. The grant is the placer's (signed with its bundle key, one
a gang, in the gang blob and a small gang's placements); the serving node checks the proof
against the asker's TLS certificate: a gang node reads, an outsider does not, nor with a gang
node's proof, an expired grant, one signed by another key or one changed after signing.

Real agents over mutual TLS on loopback, as in tests/test_security_dataplane.py: a1 holds M and
is in no gang; a2 gets gang g's pod (peers: a2, then the contact a1) pushed as the placer pushes
it, with the grant."""

from __future__ import annotations

import dataclasses
import os
import time

import httpx
import msgspec
import pytest
import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra import grants, tls
from infra.auth import TokenSet
from p2p.fetch import fetch_artifact
from p2p.herd import render_metrics
from p2p.origins import open_origin
from p2p.peers import PeerClient, PeerRefused
from p2p.publish import publish
from p2p.readers import Asker, Readers, chunk_refusal, manifest_refusal
from scheduler_link.messages import Peer, Placement, PodAssignment
from scheduler_link.msgauth import BundleSigner
from testing.waiting import poll
from tests.dataplane_agents import publish_random, secure_agent

_agent = secure_agent
_publish = publish_random


async def test_a_contact_serves_the_gangs_nodes_on_the_placers_grant_and_no_one_else(tmp_path, token_dir, tls_pki):
    origin = f"file://{tmp_path / 'origin'}"
    m, m_other = [await _publish(tmp_path, origin, x) for x in ("gang", "other")]
    tokens = TokenSet.load(token_dir)
    placer_key, other_key = BundleSigner.generate(), BundleSigner.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            a1 = _agent(tmp_path, token_dir, tls_pki, "a1", origin)
            a2 = _agent(tmp_path, token_dir, tls_pki, "a2", origin)
            await n.start(a1.run)
            control2 = await n.start(a2.run)
            assert a1.store is not None and a1.dataplane is not None and a1.dataplane.readers is not None
            assert a2.herd is not None
            # the contact: holds M (and another manifest), in no gang; knows the placer's key
            # (an agent has it from its registration answer)
            async with open_origin(origin) as o:
                for x in (m, m_other):
                    await fetch_artifact(a1.store, x, o)
            a1.dataplane.readers.set_grant_key(placer_key.public)
            # a refused request is held for a member whose placement may be on its way: long
            # here, so that a grant's refusal (never held) shows in the fail_after bounds below
            a1.dataplane.config = dataclasses.replace(a1.dataplane.config, member_wait_ms=30_000)
            # the placer pushes gang g's pod to a2: its peers the gang (a2), then the contact a1;
            # its grant over the gang's node ids
            grant = placer_key.read_grant(m, ["a2"], time.time() + 3600)
            pl = Placement(placement_id="start:g:1:a2", job_id="g", node_id="a2", attempt=1, argv=["sleep", "30"],
                           manifest_id=m, origin=origin, world_size=1, gang_nodes=1, read_grant=grant,
                           peers=[Peer(node_id="a2", data_url=a2.data_url), Peer(node_id="a1", data_url=a1.data_url)],
                           pods=[PodAssignment(workload_id="g.1.0", rank=0, gpus=[a2.gpu_snapshot().gpus[0].uuid])])
            ctx = tls.client_context(tls_pki.ca, tls_pki.files("placer"))
            async with httpx.AsyncClient(verify=ctx, base_url=control2, timeout=10) as placer:
                r = await placer.post("/v1/placements", content=msgspec.json.encode(pl))
                assert r.status_code == 200 and r.json()["accepted"], r.text
            url = a1.data_url
            chunks = {x: [(c.id, c.size) for c in a1.store.get_manifest(x).chunks] for x in (m, m_other)}
            cid, size = chunks[m][0]
            # the gang's node reads M from the contact: manifest, have-bitmap, a chunk, a batch
            member = a2.herd.client
            with trio.fail_after(5):
                assert await member.get_manifest(url, m) == a1.store.manifest_bytes(m)
                assert len(await member.get_have(url, m, len(chunks[m]))) == (len(chunks[m]) + 7) // 8
                assert bytes(await member.get_chunk(url, cid, size)) == a1.store.read_chunk(cid)
                kept: dict[str, bytes] = {}
                got = await member.get_chunks(url, chunks[m][:2], store=lambda c, b: kept.update({c: bytes(b)}))
                assert list(got.outcomes) == ["ok", "ok"] and len(kept) == 2
            await poll(lambda: m in a2.store.complete_manifests(), 0.02)  # type: ignore[union-attr]

            def client(node: str, proof: str | None = None, manifest: str = m) -> PeerClient:
                c = PeerClient(token=tokens.cluster, ssl_context=tls.client_context(
                    tls_pki.ca, tls_pki.files(f"node:{node}")))
                if proof is not None:
                    c.set_grant(manifest, proof, time.time() + 3600)
                return c

            proof = grants.prove(grant, ["a2"], "a2")
            assert proof is not None
            expired = grants.prove(placer_key.read_grant(m, ["a2"], time.time() - 1), ["a2"], "a2")
            forged = grants.prove(other_key.read_grant(m, ["a2"], time.time() + 3600), ["a2"], "a2")
            g = grants.decode_grant(grant)   # signed for M; its manifest changed after signing
            changed = grants.prove(msgspec.msgpack.encode(msgspec.structs.replace(g, manifest_id=m_other)),
                                   ["a2"], "a2")
            # an outsider (a valid node certificate, in no gang): without a grant, held then refused
            a1.dataplane.config = dataclasses.replace(a1.dataplane.config, member_wait_ms=50)
            outsider = client("a3")
            with pytest.raises(PeerRefused) as e:
                await outsider.get_chunk(url, cid, size)
            assert e.value.reason == "not_a_member"
            # ... and the gang's node reads nothing else the contact holds: the grant names M only
            with pytest.raises(PeerRefused) as e:
                await member.get_manifest(url, m_other)
            assert e.value.reason == "not_a_member"
            a1.dataplane.config = dataclasses.replace(a1.dataplane.config, member_wait_ms=30_000)
            # ... with the gang node's proof (it names a2, the connection a3), or any bad grant:
            # refused at once, never held
            for c, ask in ((client("a3", proof), "chunk"), (client("a3", proof), m),
                           (client("a2", expired), "chunk"), (client("a2", forged), m),
                           (client("a2", changed, m_other), m_other), (client("a2", "bm90IGEgZ3JhbnQ"), "have")):
                with trio.fail_after(5), pytest.raises(PeerRefused) as e:
                    if ask == "chunk":
                        await c.get_chunk(url, cid, size)
                    elif ask == "have":
                        await c.get_have(url, m, len(chunks[m]))
                    else:
                        await c.get_manifest(url, ask)
                assert e.value.reason == "bad_grant"
                await c.aclose()
            await outsider.aclose()
            stats = a1.dataplane.statistics()
            assert stats["refused_bad_grant"] == 6 and stats["refused_not_a_member"] == 2
            # (each (asker, proof) is checked once: the second a3 request reads the outcome kept)
            assert stats["readers"]["grants_refused"] == {"not_listed": 1, "expired": 1, "forged": 2,
                                                          "malformed": 1}
            assert 'herd_dataplane_rejected_total{node="a1",reason="bad_grant"} 6' in render_metrics("a1", None, stats)
            n.cancel_scope.cancel()


@pytest.mark.parametrize("count", [1, 2, 63, 64, 65, 130, 1000])
def test_every_node_of_the_tree_proves_itself_and_no_other_node_does(count):
    signer = BundleSigner.generate()
    ids = [f"n{i}" for i in range(count)]
    m = "1" * 64
    raw = signer.read_grant(m, ids, 1000.0)
    checker = grants.GrantChecker(signer.public)
    for i in sorted({0, count // 2, count - 1, min(64, count - 1)}):
        proof = grants.prove(raw, ids, ids[i])
        assert proof is not None
        got = checker.check(proof, ids[i], 999.0)
        assert isinstance(got, grants.ReadGrant) and got.manifest_id == m
        assert checker.check(proof, "stranger", 999.0) == "not_listed"
        assert checker.check(proof, ids[i], 1000.5) == "expired"
        assert len(proof) < grants.MAX_PROOF_CHARS
    assert grants.prove(raw, ids, "stranger") is None
    assert grants.prove(raw, ids[::-1] if count > 1 else ["x"], ids[0]) is None   # another table


def test_a_proof_does_not_stretch_to_another_leaf_or_root():
    signer = BundleSigner.generate()
    ids = [f"n{i}" for i in range(200)]
    raw = signer.read_grant("1" * 64, ids, 1000.0)
    checker = grants.GrantChecker(signer.public)
    import base64

    def decode(p: str) -> grants.GrantProof:
        return msgspec.msgpack.decode(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)), type=grants.GrantProof)

    def encode(p: grants.GrantProof) -> str:
        return base64.urlsafe_b64encode(msgspec.msgpack.encode(p)).rstrip(b"=").decode()

    good = decode(grants.prove(raw, ids, "n70") or "")
    # a stranger's id put into a genuine leaf: the leaf no longer hashes to the path's start
    rp = msgspec.structs.replace
    assert checker.check(encode(good), "n70", 1.0) == good.grant
    assert checker.check(encode(rp(good, ids=["x", *good.ids[1:]])), "x", 1.0) == "not_listed"
    # the leaf moved, a hash of the path dropped or added: no longer the signed root
    assert checker.check(encode(rp(good, leaf=2)), "n70", 1.0) == "not_listed"
    assert checker.check(encode(rp(good, path=good.path[:-1])), "n70", 1.0) == "not_listed"
    assert checker.check(encode(rp(good, path=[*good.path, b"\0" * 32])), "n70", 1.0) == "not_listed"
    # a node count that is not the signed one, a root that is not: the signature fails
    g = good.grant
    assert checker.check(encode(rp(good, grant=rp(g, nodes=300))), "n70", 1.0) == "forged"
    assert checker.check(encode(rp(good, grant=rp(g, root=b"\1" * 32))), "n70", 1.0) == "forged"
    assert checker.check("%%%", "n70", 1.0) == "malformed"


def test_the_read_decision_bad_grants():
    m1, m2, c1, c2 = "1" * 64, "2" * 64, "c" * 64, "d" * 64
    listed = {m1: frozenset({c1}), m2: frozenset({c2})}
    r = Readers()
    assert manifest_refusal(r, "a", m1, frozenset({m1})) is None
    assert manifest_refusal(r, "a", m2, frozenset({m1})) == "not_a_member"    # a grant opens its manifest only
    assert manifest_refusal(r, "a", m1, bad_grant=True) == "bad_grant"       # it presented grants, none held
    assert chunk_refusal(r, "a", c1, listed.get, granted=frozenset({m1})) is None
    assert chunk_refusal(r, "a", c2, listed.get, granted=frozenset({m1})) == "not_a_member"
    # no gang here yet: a lenient pass before a wait (its placement may come), unless its grants failed
    assert chunk_refusal(r, "a", c1, listed.get, strict=False) is None
    assert chunk_refusal(r, "a", c2, listed.get, strict=False, granted=frozenset({m1})) is None
    assert chunk_refusal(r, "a", c1, listed.get, strict=False, bad_grant=True) == "bad_grant"
    # without the placer's key no grant holds
    signer = BundleSigner.generate()
    proof = grants.prove(signer.read_grant(m1, ["a"], time.time() + 60), ["a"], "a") or ""
    assert r.asker("a", proof, time.time()) == Asker("a", frozenset(), bad_grant=True)
    assert r.statistics()["grants_refused"] == {"no_key": 1}
    r.set_grant_key(signer.public)
    assert r.asker("a", proof, time.time()) == Asker("a", frozenset({m1}))
    assert r.asker("b", proof, time.time()) == Asker("b", frozenset(), bad_grant=True)   # a's proof, b's connection
    assert r.asker("a", None, time.time()) == Asker("a")


def test_the_placer_grants_a_gang_its_contacts_and_only_then():
    """A gang whose manifest a node outside it holds (a contact) gets a grant over its peer
    table's node ids, in its blob and its direct placements; one with no contact gets none."""
    from placer.config import PlacerConfig
    from placer.state import PlacerState
    from scheduler_link.messages import (
        GpuInfo,
        GpuSnapshot,
        JobSpec,
        NodeReport,
        TopologyPath,
        decode_gang_blob,
    )

    signer = BundleSigner.generate()
    st_ = PlacerState(PlacerConfig(heartbeat_s=1.0, fence_after_s=5.0, recover_s=0.0), started_at=0.0)
    st_.recover_until = 0.0
    st_.read_grants = signer.read_grant
    m = "ab" * 32

    def full(node: str, gpus: int, manifests: list[str]) -> NodeReport:
        snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"{node}-g{i}", name="sim", memory_total_mib=1,
                                                         pci_bus_id=str(i), simulated=True) for i in range(gpus)])
        return NodeReport(node_id=node, boot_id=f"boot-{node}", seq=1, full=True, control_url=f"http://{node}",
                          data_url=f"http://{node}:1", topology=TopologyPath(zone="z", block="b", rack="r0"),
                          snapshot=snap, manifests=manifests)

    for i in range(3):
        st_.ingest(f"n{i}", full(f"n{i}", 8, []), 0.0)
    st_.ingest("holder", full("holder", 1, [m]), 0.0)   # (too small for the gang's pods: stays outside)
    st_.submit(JobSpec(job_id="g", pods=3, gpus_per_pod=8, argv=["x"], manifest_id=m, origin="file:///o"), 0.1)
    st_.submit(JobSpec(job_id="h", pods=1, gpus_per_pod=1, argv=["x"], manifest_id="cd" * 32, origin="file:///o"), 0.1)
    decided = dict((job.job_id, (job, pushes)) for job, pushes in st_.schedule(0.1))
    job, pushes = decided["g"]
    blob = decode_gang_blob(st_.blobs[job.blob_id], job.blob_id)
    assert "holder" in {p.node_id for p in pushes[0].placement.peers}
    assert blob.read_grant and all(p.placement.read_grant == blob.read_grant for p in pushes)
    checker = grants.GrantChecker(signer.public)
    for node in blob.peers.node_ids:
        got = checker.check(grants.prove(blob.read_grant, blob.peers.node_ids, node) or "", node, 0.2)
        assert isinstance(got, grants.ReadGrant) and got.manifest_id == m and got.expires_at == 0.1 + 3600
    job_h, pushes_h = decided["h"]
    assert decode_gang_blob(st_.blobs[job_h.blob_id], job_h.blob_id).read_grant == b""
    assert pushes_h[0].placement.read_grant == b""


async def test_a_real_placer_grants_its_gang_and_the_contact_serves_it(tmp_path, token_dir, tls_pki):
    """End to end, mutual TLS: a real placer and two real agents. a1 runs job fill (8 GPUs,
    manifest M): it holds M and has no GPU left. Job g (M) goes to a2; the placer names a1 as
    a contact and signs the gang's grant with its bundle key; a1 checks it with the key from
    its registration answer and serves a2 M's bytes, refusing none."""
    from agent.config import DataPlaneSection
    from infra.auth import TokenSet
    from placer.service import PlacerService
    from scheduler_link.messages import JobSpec
    from tests.test_placer_service import cfg, wait_for

    origin = f"file://{tmp_path / 'origin'}"
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(24 << 20))   # ~24 chunks: some are homed at the contact
    async with open_origin(origin) as o:
        m = (await publish(src, o, "w:v1")).manifest
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False), tokens)
            url = await n.start(svc.run)
            agents = {}
            for node in ("a1", "a2"):
                conf = AgentConfig(node_id=node, gpus="simulated:dgx-h100", state_dir=str(tmp_path / node),
                                   listen="127.0.0.1:0", data_listen="127.0.0.1:0", token_dir=str(token_dir),
                                   placer=url, heartbeat_s=0.2, tls_dir=str(tls_pki.node_dir(node)), insecure=False,
                                   allowed_origins=(origin,), workloads=SupervisorConfig(shim_pool=0),
                                   dataplane=DataPlaneSection())
                agents[node] = Agent(conf, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"},
                                     handle_signals=False)
            await n.start(agents["a1"].run)
            op = httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, tls_pki.files("operator"), expect="placer"),
                                   base_url=url, timeout=10)

            async def nodes_up(k: int) -> bool:
                return sum(x["state"] == "up" for x in (await op.get("/v1/nodes")).json()["nodes"]) == k

            async def job_running(job: str) -> None:
                r = await op.get(f"/v1/jobs/{job}", params={"wait": "running", "timeout_ms": "30000"})
                assert r.json()["state"] == "running", r.text

            await wait_for(lambda: nodes_up(1))
            for job in ("fill", "g"):
                if job == "g":   # a2 joins once a1 is full and the placer knows it holds M
                    await wait_for(lambda: _holds(svc, "a1", m))
                    await n.start(agents["a2"].run)
                    await wait_for(lambda: nodes_up(2))
                r = await op.post("/v1/jobs", content=msgspec.json.encode(JobSpec(
                    job_id=job, pods=1, gpus_per_pod=8, argv=["sleep", "30"], manifest_id=m, origin=origin)))
                assert r.status_code == 201, r.text
                await job_running(job)
            a1, a2 = agents["a1"], agents["a2"]
            assert a1.dataplane is not None and a2.herd is not None
            served = a1.dataplane.statistics()
            assert served["bytes_served"] > 0 and served["refused_bad_grant"] == 0
            assert served["refused_not_a_member"] == 0 and served["readers"]["grants_refused"] == {}
            assert a2.herd.statistics()["bytes_from_peers"] > 0
            await op.aclose()
            n.cancel_scope.cancel()


async def _holds(svc, node: str, manifest: str) -> bool:  # noqa: ANN001
    return node in svc.state.manifest_holders.get(manifest, set())
