"""A workload's peers come from a file (HERD_PEERS_FILE) written from the gang's blob,
verified by its id; HERD_PEERS only for small gangs (no E2BIG at 80,000 peers)."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from agent.supervisor import Supervisor, SupervisorConfig
from scheduler_link.messages import GangBlob, Peer, PeerTable, Placement, PodAssignment, encode_gang_blob

GPUS = {"GPU-0001": "healthy"}


def _table(n: int, per_rack: int = 32) -> PeerTable:
    racks = [f"z/b/r{r}" for r in range((n + per_rack - 1) // per_rack)]
    return PeerTable(node_ids=[f"node{i:05d}" for i in range(n)],
                     data_urls=[f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:7471" for i in range(n)],
                     rack_of=[i // per_rack for i in range(n)], racks=racks,
                     rack_start=[r * per_rack for r in range(len(racks))])


def _placement(blob_id: str, table: PeerTable, pid: str = "p1") -> Placement:
    own = [table.peer(i) for i in table.rack_rows(0)]
    return Placement(placement_id=pid, job_id="big", world_size=len(table), gang_blob_id=blob_id,
                     gang_nodes=len(table), peers=own,
                     pods=[PodAssignment(workload_id=f"big.1.{pid}", rank=0, gpus=["GPU-0001"])],
                     argv=["sh", "-c", 'echo "PEERS=${HERD_PEERS:-unset}"; echo "FILE=$HERD_PEERS_FILE"; '
                                       'wc -l < "$HERD_PEERS_FILE"; head -n 1 "$HERD_PEERS_FILE"'])


def _sup(tmp: Path, fetch) -> Supervisor:
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: GPUS, config=SupervisorConfig(shim_pool=1),
                      base_env={"PATH": os.environ["PATH"]}, blob_fetcher=fetch)


async def _run(sup: Supervisor, pl: Placement) -> str:
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            ack = await sup.place(pl)
            assert ack.accepted, ack
            wid = pl.pods[0].workload_id
            st = await sup.wait_terminal(wid)
            n.cancel_scope.cancel()
    assert (st.state, st.exit_code) == ("exited", 0), st
    return sup.read_log(wid, tail=100)


async def test_an_80000_peer_gang_reads_its_peers_from_the_file(tmp_path):
    table = _table(80_000)
    blob_id, raw = encode_gang_blob(GangBlob(job_id="big", attempt=1, world_size=80_000, peers=table))
    asked: list[str] = []

    async def fetch(bid: str) -> bytes:
        asked.append(bid)
        return raw

    sup = _sup(tmp_path, fetch)
    out = await _run(sup, _placement(blob_id, table))
    assert asked == [blob_id]
    assert "PEERS=unset" in out  # no 80,000-peer environment string (it would be E2BIG at exec)
    path = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("FILE="))
    lines = (await trio.Path(path).read_text()).splitlines()
    assert len(lines) == 80_000 and "80000" in out
    assert lines[0] == "node00000 http://10.0.0.0:7471 z/b/r0" and lines[-1].startswith("node79999 ")
    assert [ln.split()[0] for ln in lines] == table.node_ids  # the file matches the blob
    assert sup.counters["peers_from_blob"] == 1


async def test_a_blob_with_a_wrong_id_is_refused(tmp_path):
    table = _table(200)
    blob_id, _ = encode_gang_blob(GangBlob(job_id="big", attempt=1, peers=table))
    _, forged = encode_gang_blob(GangBlob(job_id="big", attempt=1, peers=_table(300)))

    async def fetch(bid: str) -> bytes:
        return forged  # bytes that do not hash to the id asked for

    sup = _sup(tmp_path, fetch)
    out = await _run(sup, _placement(blob_id, table))
    path = next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("FILE="))
    lines = (await trio.Path(path).read_text()).splitlines()
    assert lines[0].startswith("# partial")           # said, and the forged table not used
    assert len(lines) == 1 + 32 and sup.counters["peers_from_partial"] == 1


async def test_small_gangs_keep_herd_peers_and_get_the_file_too(tmp_path):
    peers = [Peer(node_id=f"n{i}", data_url=f"http://127.0.0.1:{9000 + i}", zone="z", block="b", rack="r")
             for i in range(3)]
    pl = Placement(placement_id="s", job_id="small", world_size=3, peers=peers, gang_nodes=3,
                   pods=[PodAssignment(workload_id="small.1.0", rank=0, gpus=["GPU-0001"])],
                   argv=["sh", "-c", 'echo "PEERS=$HERD_PEERS"; cat "$HERD_PEERS_FILE"'])
    sup = _sup(tmp_path, None)
    out = await _run(sup, pl)
    assert "PEERS=n0=http://127.0.0.1:9000,n1=http://127.0.0.1:9001,n2=http://127.0.0.1:9002" in out
    assert "n2 http://127.0.0.1:9002 z/b/r" in out and sup.counters["peers_from_placement"] == 1


async def test_the_artifact_fetch_plans_over_the_gangs_whole_table(tmp_path):
    """Every node of a big gang must plan the same trees: the fetch gets the blob's table,
    not the placement's rack-and-contacts list."""
    table = _table(500)
    blob_id, raw = encode_gang_blob(GangBlob(job_id="big", attempt=1, world_size=500, peers=table))
    seen: list[object] = []

    async def fetch_blob(bid: str) -> bytes:
        return raw

    async def fetch_artifact(mid: str, origin: str | None, peers: object) -> tuple[Path, dict[str, int]]:
        seen.append(peers)
        tree = tmp_path / "tree"
        await trio.Path(tree).mkdir(exist_ok=True)
        return tree, {"bytes_from_origin": 0, "bytes_from_peers": 1, "bytes_local": 0}

    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: GPUS, config=SupervisorConfig(shim_pool=1),
                     base_env={"PATH": os.environ["PATH"]}, blob_fetcher=fetch_blob, fetcher=fetch_artifact)
    pl = _placement(blob_id, table)
    pl = Placement(**{**{f: getattr(pl, f) for f in pl.__struct_fields__}, "manifest_id": "ab" * 32,
                      "origin": "file:///nowhere", "argv": ["true"]})
    await _run(sup, pl)
    assert len(seen) == 1 and isinstance(seen[0], PeerTable) and seen[0] == table
