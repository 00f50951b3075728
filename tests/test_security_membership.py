"""Reads by membership (issue 42, finding 7, the placer's part): a node reads a gang's blob
only if it takes part in the gang, over ``GET /v1/gangs/{id}`` and over ``blob_get`` on the
framed channel; a rack's active relay reads the blobs of gangs its rack takes part in and no
other. A real placer over mutual TLS with fake agents holding node certificates."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import msgspec
import trio

from infra import pki, tls
from infra.auth import TokenSet, auth_header
from placer import membership
from placer.records import JobRec
from placer.service import PlacerService
from scheduler_link.frames import FrameChannel, decode_payload, open_frames
from scheduler_link.messages import (
    BlobReply,
    BlobRequest,
    GangBlob,
    JobSpec,
    PeerTable,
    RelayHello,
    encode_gang_blob,
)
from tests.test_placer_service import cfg, wait_for
from tests.test_tls_cluster import TLSFakeAgent

RACKS = {"a0": "r0", "a1": "r0", "a2": "r0", "b0": "r1", "b1": "r1", "b2": "r1"}


def _path(rack: str) -> str:
    return f"z1/b1/{rack}"


# ---------------------------------------------------------------- the decision, alone


class _Job:
    def __init__(self, blob_id: str | None) -> None:
        self.blob_id = blob_id


class _Node:
    def __init__(self, *blob_ids: str) -> None:
        self.gangs = {f"j{i}": _Job(b) for i, b in enumerate(blob_ids)}


def test_the_decision_reads_the_nodes_own_gangs_then_the_relayed_racks():
    asked: list[str] = []

    def racks() -> frozenset[str]:
        asked.append("racks")
        return frozenset({"z/b/r0"})

    node = _Node("other", "mine")
    assert membership.refusal("mine", node, (), racks) is None
    assert asked == []                                           # its own gangs settle it
    assert membership.refusal("theirs", node, (), racks) == membership.NOT_A_MEMBER
    assert membership.refusal("theirs", _Node(), ["z/b/r0"], racks) is None
    assert membership.refusal("theirs", _Node(), ["z/b/r1"], racks) == membership.NOT_A_MEMBER
    assert membership.refusal("mine", None, ["z/b/r0"], racks) == membership.UNKNOWN_NODE


def test_a_blobs_racks_are_read_from_its_peer_table_compressed_or_not():
    for n in (3, 20_000):   # (the larger is compressed)
        table = PeerTable(node_ids=[f"n{i}" for i in range(n)], data_urls=[f"https://h{i}:1" for i in range(n)],
                          rack_of=[i // 1000 for i in range(n)], racks=[f"z/b/r{k}" for k in range((n + 999) // 1000)],
                          rack_start=[k * 1000 for k in range((n + 999) // 1000)])
        blob_id, raw = encode_gang_blob(GangBlob(job_id="j", attempt=1, peers=table, env={"K": "v"}))
        assert membership.racks_of_blob(raw) == frozenset(table.racks)
        cache = membership.GangRacks({blob_id: raw})
        assert cache.get(blob_id) == frozenset(table.racks) and cache.get("gone") == frozenset()
    assert membership.racks_of_blob(b"\x00herd-blob-zlib\x00not zlib") == frozenset()


# ---------------------------------------------------------------- a real placer, both ways in


def _client(ca: pki.ThrowawayPKI, principal: str, url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(verify=tls.client_context(ca.ca, ca.files(principal)), base_url=url, timeout=10)


async def _frames(svc: PlacerService, tokens: TokenSet, ca: pki.ThrowawayPKI, node: str, n: trio.Nursery, *,
                  relay_for: str | None = None) -> FrameChannel:
    ch = await open_frames(svc.wire_url or "", tokens.cluster or "", node, expect="placer",
                           ssl_context=tls.client_context(ca.ca, ca.files(f"node:{node}")),
                           relay=RelayHello(racks=[relay_for]) if relay_for else None)
    n.start_soon(ch.run, lambda c, f: None)
    return ch


async def _blob_get(ch: FrameChannel, blob_id: str) -> BlobReply:
    f = await ch.call("blob_get", BlobRequest(blob_id=blob_id), timeout_s=5)
    assert f.type == "blob"
    reply: BlobReply = decode_payload(f, BlobReply)
    return reply


async def test_only_the_gangs_nodes_and_their_racks_relay_read_its_blob(tmp_path: Path, token_dir, tls_pki, caplog):
    tokens = TokenSet.load(token_dir)
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False), tokens)
            url = await n.start(svc.run)
            for node, rack in RACKS.items():
                await n.start(TLSFakeAgent(node, tokens, tls_pki, rack=rack).run, url)
            await wait_for(lambda: _up(svc))
            op = httpx.AsyncClient(verify=tls.client_context(tls_pki.ca), base_url=url, timeout=10,
                                   headers=auth_header(tokens.operator))
            r = await op.post("/v1/jobs", content=msgspec.json.encode(JobSpec(
                job_id="j1", argv=["sleep", "100"], env={"SECRET": "s1"}, pods=1, gpus_per_pod=8)))
            assert r.status_code == 201, r.text
            await wait_for(lambda: _placed(svc.state.jobs.get("j1")))
            job = svc.state.jobs["j1"]
            blob_id = job.blob_id
            assert blob_id is not None
            member = job.pods[0].node_id
            rack = RACKS[member]
            outsider = next(x for x, k in RACKS.items() if k != rack)          # another rack's node
            neighbours = [x for x, k in RACKS.items() if k == rack and x != member]   # same rack, no pod
            other_rack_node = next(x for x, k in RACKS.items() if k != rack and x != outsider)

            # GET /v1/gangs/{id}: the member reads it, an outsider gets a 403 with a reason code
            async with _client(tls_pki, f"node:{member}", url) as c:
                r = await c.get(f"/v1/gangs/{blob_id}")
                assert r.status_code == 200 and r.content == svc.state.blobs[blob_id]
            async with _client(tls_pki, f"node:{outsider}", url) as c:
                r = await c.get(f"/v1/gangs/{blob_id}")
                assert r.status_code == 403 and r.json()["error"] == membership.NOT_A_MEMBER
                assert b"s1" not in r.content
                assert (await c.get("/v1/gangs/" + "0" * 64)).status_code == 404

            # blob_get on plain frames connections: the same
            mine = await _frames(svc, tokens, tls_pki, member, n)
            got = await _blob_get(mine, blob_id)
            assert got.error is None and got.data == svc.state.blobs[blob_id]
            theirs = await _frames(svc, tokens, tls_pki, outsider, n)
            got = await _blob_get(theirs, blob_id)
            assert got.data is None and got.error == membership.NOT_A_MEMBER

            # a relay: its rack's gangs yes (its own node has no pod), another rack's no; a
            # candidate of the gang's rack that is not the rack's active relay, no
            cands = {x: await _frames(svc, tokens, tls_pki, x, n, relay_for=_path(rack)) for x in neighbours}
            active = svc.relays.relay_for(_path(rack))
            assert active is not None and active.node_id in neighbours
            got = await _blob_get(cands[active.node_id], blob_id)
            assert got.error is None and got.data == svc.state.blobs[blob_id]
            loser = next(x for x in neighbours if x != active.node_id)
            got = await _blob_get(cands[loser], blob_id)
            assert got.data is None and got.error == membership.NOT_A_MEMBER
            far = await _frames(svc, tokens, tls_pki, other_rack_node, n, relay_for=_path(RACKS[other_rack_node]))
            assert svc.relays.relay_for(_path(RACKS[other_rack_node])) is not None
            got = await _blob_get(far, blob_id)
            assert got.data is None and got.error == membership.NOT_A_MEMBER

            # counted, never logged per request above debug
            counts = svc.state.counters
            assert counts["blob_refusals"] == 4 and counts["blob_refusals_" + membership.NOT_A_MEMBER] == 4
            assert not [r for r in caplog.records if r.name.startswith("herd.") and r.levelno >= logging.INFO
                        and blob_id[:16] in r.getMessage()]
            await op.aclose()
            n.cancel_scope.cancel()


def _up(svc: PlacerService) -> bool:
    return sum(1 for x in svc.state.nodes.values() if x.state == "up") == len(RACKS)


def _placed(job: JobRec | None) -> bool:
    return job is not None and job.blob_id is not None and len(job.pods) == 1
