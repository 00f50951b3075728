"""The plain-http:// origin's lean GETs (p2p.origins.lean) against a real server on
loopback that misbehaves on purpose: a body cut by FIN or RST, a stall, an idle
keep-alive the server closed, and answers the lean client hands to httpx (a redirect, a
chunked body, a gzip coding) -- each ends in the right bytes or the right error, and a
herd fetch through such an origin is byte-exact."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import socket
import struct
from collections import Counter
from pathlib import Path

import blake3
import pytest
import trio

from p2p.errors import OriginError, OriginUnavailable
from p2p.fetch import fetch_artifact
from p2p.herd import Herd
from p2p.origins import open_origin
from p2p.store import ChunkStore
from tests.herd_cluster import FAST, make_artifact


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


class _Server:
    """HTTP/1.1 on loopback, keep-alive. ``plan[path]``: the answers to that path, in turn
    (the last repeats): "ok" (Content-Length), "fin"/"reset" (cut mid-body), "stall"
    (half the body, then silence), "redirect" (302 to path + "?moved"), "chunked", "gzip",
    "close-idle" (answer, then close the kept-alive connection), "corrupt" (the first byte
flipped). Counts requests a path."""

    def __init__(self, bodies: dict[str, bytes], plan: dict[str, list[str]]) -> None:
        self.bodies, self.plan = bodies, plan
        self.seen: Counter[str] = Counter()
        self.connections = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            listeners = await n.start(functools.partial(trio.serve_tcp, self._one, 0, host="127.0.0.1"))
            task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")

    async def _one(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await self._serve(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass                            # the client hung up (e.g. after a head it hands to httpx)

    async def _serve(self, stream: trio.SocketStream) -> None:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                piece = await stream.receive_some(65536)
                if not piece:
                    return
                buf += piece
            head, _, buf = buf.partition(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode()
            base = path.split("?")[0]
            n = self.seen[path]
            self.seen[path] += 1
            steps = self.plan.get(base, ["ok"])
            mode = steps[min(n, len(steps) - 1)]
            if path.endswith("?moved"):
                mode = "ok"
            body = self.bodies.get(base)
            if body is None:
                await stream.send_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            if mode == "redirect":
                await stream.send_all(f"HTTP/1.1 302 Found\r\nlocation: {base}?moved\r\n"
                                      "content-length: 0\r\n\r\n".encode())
                continue
            if mode == "chunked":
                pieces = [body[i:i + 100_000] for i in range(0, len(body), 100_000)]
                out = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
                await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + out)
                continue
            if mode == "gzip":
                z = gzip.compress(body)
                await stream.send_all(f"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: {len(z)}"
                                      "\r\n\r\n".encode() + z)
                continue
            if mode == "corrupt":
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            wire = f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
            if mode in ("fin", "reset", "stall"):
                await stream.send_all(wire[:len(wire) // 2])
                if mode == "stall":
                    await trio.sleep_forever()
                if mode == "reset":
                    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                stream.socket.close()
                return
            await stream.send_all(wire)
            if mode == "close-idle":
                stream.socket.close()
                return


async def _against(bodies: dict[str, bytes], plan: dict[str, list[str]], ask: list[tuple[str, int]],
                   retries: int = 2, read_timeout_s: float | None = None) -> tuple[list[object], _Server]:
    srv = _Server(bodies, plan)
    out: list[object] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(srv.run)
            async with open_origin(url, retries=retries) as o:
                o.http.backoff_base = 0.01          # type: ignore[attr-defined]
                if read_timeout_s is not None:   # the lean client's bound on each read
                    o.http.lean.timeout = read_timeout_s   # type: ignore[attr-defined]
                assert o.http.lean is not None      # type: ignore[attr-defined]
                for cid, size in ask:
                    try:
                        out.append(await o.get_chunk(cid, size))
                    except OriginError as e:
                        out.append(e)
            n.cancel_scope.cancel()
    return out, srv


@pytest.mark.parametrize("mode", ["fin", "reset", "stall"])
async def test_a_body_cut_or_stalled_is_asked_again_and_comes_whole(mode: str) -> None:
    cid, data = _chunk(1 << 20)
    (got,), srv = await _against({f"/chunks/{cid}": data}, {f"/chunks/{cid}": [mode, "ok"]}, [(cid, len(data))],
                                 read_timeout_s=0.3)
    assert got == data and srv.seen[f"/chunks/{cid}"] == 2


@pytest.mark.parametrize("mode", ["fin", "reset", "stall"])
async def test_a_body_cut_with_no_retries_left_is_unavailable(mode: str) -> None:
    cid, data = _chunk(1 << 20)
    (got,), _ = await _against({f"/chunks/{cid}": data}, {f"/chunks/{cid}": [mode]}, [(cid, len(data))],
                               retries=0, read_timeout_s=0.3)
    assert isinstance(got, OriginUnavailable)
    assert "failed after 1 attempt" in str(got)
    assert ("timed out" if mode == "stall" else "unreachable") in str(got)


@pytest.mark.parametrize("mode", ["chunked", "gzip"])
async def test_answers_the_lean_client_does_not_take_go_through_httpx(mode: str) -> None:
    data = os.urandom(1000) * 300           # compressible: gzip's length is under the bound too
    cid = blake3.blake3(data).hexdigest()
    (got,), _ = await _against({f"/chunks/{cid}": data}, {f"/chunks/{cid}": [mode]}, [(cid, len(data))])
    assert got == data


async def test_a_redirect_is_an_error_never_followed() -> None:
    data = os.urandom(1000)
    cid = blake3.blake3(data).hexdigest()
    (got,), srv = await _against({f"/chunks/{cid}": data}, {f"/chunks/{cid}": ["redirect"]}, [(cid, len(data))])
    assert isinstance(got, OriginError) and "HTTP 302 (redirect, not followed)" in str(got)
    assert srv.seen[f"/chunks/{cid}"] == 1


async def test_keep_alive_is_reused_and_a_closed_idle_one_is_replaced() -> None:
    a, b, c = _chunk(200_000), _chunk(5000), _chunk(1 << 20)
    bodies = {f"/chunks/{cid}": d for cid, d in (a, b, c)}
    got, srv = await _against(bodies, {f"/chunks/{b[0]}": ["close-idle"]}, [(a[0], len(a[1])), (b[0], len(b[1])),
                                                                              (c[0], len(c[1]))], retries=0)
    assert got == [a[1], b[1], c[1]]
    # a and b on one connection; the server closed it after b; c on a fresh one, no retry counted
    assert srv.connections == 2


async def test_over_the_bound_and_missing_are_not_retried() -> None:
    cid, data = _chunk(100_000)
    other, _ = _chunk(10)
    (big, gone), srv = await _against({f"/chunks/{cid}": data}, {}, [(cid, 4096), (other, 10)])
    assert isinstance(big, OriginError) and not isinstance(big, OriginUnavailable)
    assert "announces 100000 bytes" in str(big)
    assert "not found" in str(gone)
    assert srv.seen[f"/chunks/{cid}"] == 1 and srv.seen[f"/chunks/{other}"] == 1


async def test_a_herd_fetch_through_a_misbehaving_http_origin_is_byte_exact(tmp_path: Path) -> None:
    """Every chunk's first answer is cut (FIN, RST or a stall, in turn) or corrupt: the
    herd's one retry layer asks again and the store ends byte-exact."""
    art = make_artifact(tmp_path, 12 * 64 * 1024, chunk_size=64 * 1024, seed=61)
    bodies = {f"/chunks/{cid}": d for cid, d in art.chunks.items()}
    bodies[f"/manifests/{art.manifest_id}"] = (art.origin_dir / "manifests" / art.manifest_id).read_bytes()
    modes = ["fin", "reset", "stall", "corrupt"]
    plan = {f"/chunks/{cid}": [modes[i % 4], "ok"] for i, cid in enumerate(sorted(art.chunks))}
    srv = _Server(bodies, plan)
    herd = Herd(ChunkStore(tmp_path / "store"), node_id="n0", token=None,
                config=dataclasses.replace(FAST, backoff_min_s=0.01, backoff_max_s=0.02))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url = await n.start(srv.run)
            origin = open_origin(url, retries=0)
            origin.http.lean.timeout = 0.3  # type: ignore[attr-defined]
            await fetch_artifact(herd.store, art.manifest_id, origin, herd=herd)
            await origin.aclose()
            await herd.aclose()
            n.cancel_scope.cancel()
    store = herd.store
    assert store.is_complete(art.manifest_id)
    for cid, piece in art.chunks.items():
        assert store.read_chunk(cid) == piece
    assert herd.counters.origin_bad_answers == len(plan) // 4
    assert all(srv.seen[p] == 2 for p in plan)          # every bad first answer asked once more
