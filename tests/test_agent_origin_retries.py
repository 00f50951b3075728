"""Retries in one layer: an agent's fetch retries a failing origin in the herd (counted), never
again inside the origin's transport (real agent parts, a real HTTP origin on loopback)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from tests.herd_cluster import make_artifact

FAILS = 2  # 503s per chunk before the origin answers


async def _flaky_origin(nursery: trio.Nursery, root: Path, seen: Counter[str]) -> str:
    """A static bucket mirror over HTTP/1.1 that answers each chunk 503 ``FAILS`` times first."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                got = await stream.receive_some(65536)
                if not got:
                    return
                head += got
            path = head.split(b" ", 2)[1].decode()
            seen[path] += 1
            f = root / path.lstrip("/")
            if path.startswith("/chunks/") and seen[path] <= FAILS:
                status, body = b"503 Service Unavailable", b"busy"
            elif f.is_file():
                status, body = b"200 OK", f.read_bytes()
            else:
                status, body = b"404 Not Found", b"no"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-length: " + str(len(body)).encode()
                                  + b"\r\nconnection: close\r\n\r\n" + body)

    nursery.start_soon(trio.serve_listeners, handle, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_a_failing_origin_is_retried_once_per_failure_by_the_herd(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 6 * 64 * 1024, chunk_size=64 * 1024, seed=5)
    seen: Counter[str] = Counter()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url = await _flaky_origin(n, art.origin_dir, seen)
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
