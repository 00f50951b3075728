"""Through the real `herd` entry point against real processes (a placer and agents with
simulated GPUs, cli/localcluster.py, a file:// origin): `herd artifact prefetch --wait`
(complete on every node; a fetch that fails and a disallowed origin name their nodes and
exit non-zero), `herd store ls|evict` (a manifest a workload uses is refused, then evicted),
and the agent's allowed origins: `--allowed-origin` lets one in, an agent given none refuses
every origin with one clear line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from cli.localcluster import LocalCluster
from testing.waiting import poll

from .test_cli_job import herd, one_line

pytestmark = pytest.mark.slow


async def _until(fn):  # noqa: ANN001, ANN202
    """``fn`` (async) polled: the cluster is other processes; the caller bounds it."""
    return await poll(fn, 0.2)


async def _publish(src: Path, origin: str, name: str) -> dict:
    rc, out, err = await herd(["artifact", "publish", str(src), "--origin", origin, "--name", name,
                               "--avg-chunk", "64k", "--json"])
    assert rc == 0, err
    return json.loads(out)


async def test_prefetch_wait_store_ls_evict_and_allowed_origins(tmp_path: Path, token_dir: Path) -> None:
    origin = f"file://{tmp_path}/origin"
    other = f"file://{tmp_path}/other"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(2_000_000))
    with trio.fail_after(240), LocalCluster(tmp_path / "c", token_dir, n_agents=2, heartbeat_s=0.2, racks=1,
                                            origins=(origin,)) as c:
        assert c.placer is not None
        env = {"HERD_PLACER": c.placer.url, "HERD_TOKEN_DIR": str(token_dir), "HERD_AGENT": "", "HERD_ORIGIN": ""}

        async def up() -> bool:
            rc, out, _ = await herd(["nodes", "--json"], env)
            return rc == 0 and sum(n["state"] == "up" for n in json.loads(out)["nodes"]) == 2
        await _until(up)
        v1 = await _publish(src, origin, "app:v1")
        await _publish(src, other, "app:v1")

        # --wait: complete on both nodes, bytes done == total on each
        rc, out, err = await herd(["artifact", "prefetch", "app:v1", "--origin", origin, "--nodes", "node0,node1",
                                   "--wait", "--json"], env)
        assert rc == 0, err
        doc = json.loads(out)
        assert doc["manifest"] == v1["manifest"] and doc["failed"] == [] and doc["waited"] is True
        for n in ("node0", "node1"):
            assert doc["nodes"][n]["complete"] is True
            assert doc["nodes"][n]["bytes_done"] == doc["nodes"][n]["bytes_total"] >= 2_000_000
        rc, out, err = await herd(["artifact", "prefetch", "app:v1", "--origin", origin, "--nodes", "node0,node1",
                                   "--wait"], env)
        assert rc == 0 and "complete on every node" in out, out + err

        # an origin the agents were not given: refused by each, named, non-zero
        rc, out, err = await herd(["artifact", "prefetch", "app:v1", "--origin", other, "--nodes", "node0,node1",
                                   "--wait", "--json"], env)
        assert rc == 1
        assert one_line(err) == "herd: error: prefetch failed on 2 of 2 nodes: node0, node1"
        doc = json.loads(out)
        assert doc["failed"] == ["node0", "node1"]
        assert all("allowed origins" in (doc["nodes"][n]["error"] or "") for n in ("node0", "node1")), doc

        # a fetch that fails on the node (a chunk gone from the origin): the node is named
        (src / "more.bin").write_bytes(os.urandom(300_000))
        v2 = await _publish(src, origin, "app:v2")
        from manifests import decode_manifest
        m2 = decode_manifest((tmp_path / "origin" / "manifests" / v2["manifest"]).read_bytes())
        v1_chunks = {c.id for c in decode_manifest(
            (tmp_path / "origin" / "manifests" / v1["manifest"]).read_bytes()).chunks}
        gone = next(c.id for c in m2.chunks if c.id not in v1_chunks)
        (tmp_path / "origin" / "chunks" / gone).unlink()
        rc, out, err = await herd(["artifact", "prefetch", "app:v2", "--origin", origin, "--nodes", "node0",
                                   "--wait", "--wait-timeout", "60"], env)
        assert rc == 1, out + err
        assert err.strip().splitlines()[-1] == "herd: error: prefetch failed on 1 of 1 nodes: node0"
        assert "fetch ended without the manifest complete" in out

        # herd store ls: v1 complete and not in use; v2 held partly
        a0 = c.agents["node0"].url
        rc, out, err = await herd(["store", "ls", "--agent", a0, "--json"], env)
        assert rc == 0, err
        held = {m["manifest_id"]: m for m in json.loads(out)["manifests"]}
        assert held[v1["manifest"]]["complete"] and not held[v1["manifest"]]["pinned"]
        assert held[v1["manifest"]]["present_bytes"] == held[v1["manifest"]]["chunk_bytes"]
        assert set(held[v1["manifest"]]) == {"manifest_id", "bytes", "chunk_bytes", "present_bytes", "complete",
                                             "materialised", "pinned", "last_used"}
        if v2["manifest"] in held:
            assert not held[v2["manifest"]]["complete"]
        rc, out, err = await herd(["store", "ls", "--agent", a0], env)
        assert rc == 0 and v1["manifest"][:16] in out and "complete" in out, out + err

        # a job's workload using v1 on node0 (node1 cordoned): its manifest shows pinned and is not evicted
        rc, out, err = await herd(["node", "cordon", "node1"], env)
        assert rc == 0, err
        rc, out, err = await herd(["job", "submit", "--job-id", "uses-v1", "--gpus-per-pod", "1", "--artifact",
                                   "app:v1", "--origin", origin, "--wait", "running", "--json",
                                   "--", "sleep", "60"], env)
        assert rc == 0, err
        assert json.loads(out)["pods"][0]["node_id"] == "node0"
        rc, out, err = await herd(["store", "ls", "--agent", a0, "--json"], env)
        assert {m["manifest_id"]: m for m in json.loads(out)["manifests"]}[v1["manifest"]]["pinned"] is True
        rc, out, err = await herd(["store", "evict", "--agent", a0, v1["manifest"][:16]], env)
        assert rc == 1 and "in use" in one_line(err), err
        rc, out, err = await herd(["store", "evict", "--agent", a0], env)
        assert rc == 2 and "MANIFEST id or --unused" in one_line(err)
        rc, out, err = await herd(["job", "cancel", "uses-v1"], env)
        assert rc == 0, err

        async def stopped() -> bool:
            rc, out, _ = await herd(["store", "evict", "--agent", a0, v1["manifest"], "--json"], env)
            return rc == 0 and json.loads(out)
        rep = await _until(stopped)
        # its chunks stay: v2's manifest (held partly here) names them too
        assert rep["manifests"] == [v1["manifest"]] and rep["bytes_freed"] == 0
        rc, out, err = await herd(["store", "ls", "--agent", a0, "--json"], env)
        assert v1["manifest"] not in {m["manifest_id"] for m in json.loads(out)["manifests"]}
        rc, out, err = await herd(["store", "evict", "--agent", a0, "f" * 64], env)
        assert rc == 1 and "not in this store" in one_line(err)

        # --unused on node1: v1 goes, its bytes freed; the listing is empty after
        a1 = c.agents["node1"].url
        rc, out, err = await herd(["store", "evict", "--agent", a1, "--unused", "--json"], env)
        assert rc == 0, err
        rep = json.loads(out)
        assert rep["manifests"] == [v1["manifest"]] and rep["bytes_freed"] >= 2_000_000 and rep["refused"] == {}
        rc, out, err = await herd(["store", "evict", "--agent", a0, "--unused"], env)
        assert rc == 0 and "evicted" in out and "freed" in out, out + err
        rc, out, err = await herd(["store", "ls", "--agent", a1], env)
        assert rc == 0 and "no manifests" in out

        # placements: an origin outside --allowed-origin, and an agent given no origin at all
        rc, out, err = await herd(["agent", "place", "--agent", a0, "--gpus", "1", "--artifact", "app:v1",
                                   "--origin", other, "--", "true"], env)
        assert rc == 1 and "is not among this agent's allowed origins" in one_line(err), err
        c.origins = ()
        bare = c.start_agent(2).url
        rc, out, err = await herd(["agent", "place", "--agent", bare, "--gpus", "1", "--artifact", "app:v1",
                                   "--origin", origin, "--", "true"], env)
        assert rc == 1 and "this agent allows no origins" in one_line(err) and "--allowed-origin" in err, err
