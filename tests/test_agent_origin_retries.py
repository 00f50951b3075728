"""Retries in one layer: an agent's fetch retries a failing origin in the herd (counted), never
again inside the origin's transport (real agent parts, a real HTTP origin on loopback)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from tests.herd_cluster import make_artifact, mirror_origin

FAILS = 2  # 503s per chunk before the origin answers


def _flaky(path: str, asked_before: int) -> tuple[bytes, bytes] | None:
    """Each chunk answers 503 ``FAILS`` times first."""
    if path.startswith("/chunks/") and asked_before < FAILS:
        return b"503 Service Unavailable", b"busy"
    return None


async def test_a_failing_origin_is_retried_once_per_failure_by_the_herd(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 6 * 64 * 1024, chunk_size=64 * 1024, seed=5)
    seen: Counter[str] = Counter()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url = await mirror_origin(n, art.origin_dir, seen, _flaky)
            cfg = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                              listen="127.0.0.1:0", data_listen=None, workloads=SupervisorConfig(shim_pool=0),
                              allowed_origins=(url,))
            agent = Agent(cfg, handle_signals=False)
            agent._open_store()
            assert agent.herd is not None
            try:
                figures = await agent._fetch_into_store(art.manifest_id, url, [])
            finally:
                await agent.herd.aclose()
            n.cancel_scope.cancel()
    assert figures["bytes_from_origin"] == art.size
    chunk_gets = {p: c for p, c in seen.items() if p.startswith("/chunks/")}
    # each chunk asked FAILS + 1 times in all: one layer of retries (nested, it would be FAILS + 1 per
    # herd attempt times the transport's own 6)
    assert sorted(chunk_gets.values()) == [FAILS + 1] * len(art.chunks)
    assert agent.herd.counters.origin_retries == FAILS * len(art.chunks)
