"""`herd artifact fetch --peer URL` and `herd artifact prefetch` as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio

from infra.auth import TokenSet
from p2p.dataplane import DataPlane
from p2p.herd import Herd, herd_fetch
from p2p.store import ChunkStore
from tests.herd_cluster import make_artifact, open_file_origin

HERD = [sys.executable, "-m", "cli.main"]


async def test_fetch_from_a_peer_without_a_placer(tmp_path: Path, token_dir: Path) -> None:
    art = make_artifact(tmp_path, 2 * 1024 * 1024, chunk_size=256 * 1024, seed=21)
    token = TokenSet.load(token_dir).cluster
    origin = open_file_origin(art)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            warm = ChunkStore(tmp_path / "warm")
            herd = Herd(warm, node_id="warm", token=token)
            await herd_fetch(herd, art.manifest_id, origin, [])
            await herd.aclose()
            url = await nursery.start(DataPlane(warm, token=token, listen="127.0.0.1:0").run)
            # the origin's chunks are gone: only the peer can supply them now
            for p in (art.origin_dir / "chunks").iterdir():
                p.unlink()
            res = await trio.run_process(
                [*HERD, "artifact", "fetch", art.manifest_id, "--origin", f"file://{art.origin_dir}",
                 "--store", str(tmp_path / "cold"), "--into", str(tmp_path / "tree"),
                 "--peer", url, "--node-id", "cold", "--token-dir", str(token_dir), "--json"],
                capture_stdout=True, capture_stderr=True, check=False)
            assert res.returncode == 0, res.stderr.decode()
            out = json.loads(res.stdout)
            assert out["bytes_from_peers"] == art.size and out["bytes_from_origin"] == 0
            got = (tmp_path / "tree" / "blob.bin").read_bytes()
            assert got == b"".join(art.chunks[c] for c in art.chunks)
            nursery.cancel_scope.cancel()


def test_peer_without_cluster_token_is_one_clear_line(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 64 * 1024, chunk_size=64 * 1024, seed=22)
    empty = tmp_path / "no-tokens"
    empty.mkdir()
    r = subprocess.run([*HERD, "artifact", "fetch", art.manifest_id, "--origin", f"file://{art.origin_dir}",
                        "--store", str(tmp_path / "s"), "--into", str(tmp_path / "t"),
                        "--peer", "http://127.0.0.1:9", "--token-dir", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "cluster token" in r.stderr
    assert not (tmp_path / "t").exists()


def test_prefetch_bad_domain_is_one_clear_line(tmp_path: Path) -> None:
    r = subprocess.run([*HERD, "artifact", "prefetch", "a" * 64, "--origin", f"file://{tmp_path}",
                        "--placer", "http://127.0.0.1:9", "--within", "galaxy:far"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--within" in r.stderr and r.stderr.strip().count("\n") == 0
