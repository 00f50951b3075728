"""A herd in one process, kraken-style: N real chunk stores, each served by a real data
plane on loopback, fetching from a real file:// origin. Shared by the herd tests.

``WrappedOrigin`` is a fake of an external thing (the bucket): it forwards to the real
file origin and can count reads, be "down" for a while, or serve corrupted bytes.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import trio

from manifests import encode_manifest
from manifests.model import ManifestBuilder
from p2p.dataplane import DataPlane, DataPlaneConfig
from p2p.errors import OriginUnavailable
from p2p.herd import Herd, HerdConfig
from p2p.origins import open_origin
from p2p.store import ChunkStore
from scheduler_link.messages import Peer

# One process (one trio thread) serves every node of a test cluster: manifest polls start
# at 20 ms, not the default 2 ms, so 40 nodes polling at once do not starve the loop
# (a starved loop misses the 0.5 s connect deadline and sends nodes to the origin).
FAST = HerdConfig(wait_ms=3000, head_grace_s=1.0, stall_s=1.0, connect_s=0.5, penalty_s=30.0,
                  origin_tries=60, backoff_min_s=0.05, backoff_max_s=0.4, workers=8,
                  manifest_poll_s=0.02)


@dataclass
class Artifact:
    manifest_id: str
    manifest_bytes: bytes
    chunks: dict[str, bytes]
    origin_dir: Path
    size: int


def make_artifact(tmp: Path, nbytes: int, chunk_size: int = 256 * 1024, seed: int = 1,
                  chunk_sizes: Sequence[int] = ()) -> Artifact:
    """A one-file artifact of random bytes cut into fixed-size chunks (or chunks of
    ``chunk_sizes``' sizes in turn, as content-defined chunks vary), published to a
    file:// origin directory laid out as the origins expect."""
    rnd = os.urandom if seed < 0 else None
    data = rnd(nbytes) if rnd else _det_bytes(nbytes, seed)
    chunks: dict[str, bytes] = {}
    refs: list[tuple[str, int]] = []
    cuts, off, i = [], 0, 0
    while off < nbytes:
        cuts.append(off)
        off += chunk_sizes[i % len(chunk_sizes)] if chunk_sizes else chunk_size
        i += 1
    for off, end in zip(cuts, cuts[1:] + [nbytes], strict=True):
        piece = data[off:end]
        cid = blake3.blake3(piece).hexdigest()
        chunks[cid] = piece
        refs.append((cid, len(piece)))
    b = ManifestBuilder()
    b.add_file("blob.bin", 0o644, refs)
    m = b.build()
    raw = encode_manifest(m)
    mid = m.id
    origin = tmp / "origin"
    (origin / "chunks").mkdir(parents=True, exist_ok=True)
    (origin / "manifests").mkdir(parents=True, exist_ok=True)
    for cid, piece in chunks.items():
        (origin / "chunks" / cid).write_bytes(piece)
    (origin / "manifests" / mid).write_bytes(raw)
    return Artifact(mid, raw, chunks, origin, nbytes)


def _det_bytes(n: int, seed: int) -> bytes:
    out = bytearray()
    h = blake3.blake3(seed.to_bytes(8, "big"))
    out += h.digest(n)
    return bytes(out)


class WrappedOrigin:
    """Forwards to a real origin; counts reads per chunk; can be down or corrupt."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chunk_reads: Counter[str] = Counter()
        self.bytes_out = 0
        self.down_until = 0.0            # trio.current_time() before which every call fails
        self.failures = 0
        self.corrupt: set[str] = set()
        self.corrupt_once: set[str] = set()
        self.manifest_reads = 0   # one bad answer each (in transit), then good

    def _check(self) -> None:
        if trio.current_time() < self.down_until:
            self.failures += 1
            raise OriginUnavailable("origin unreachable (simulated outage)")

    async def get_chunk(self, cid: str, size: int | None = None) -> bytes:
        self._check()
        data = await self.inner.get_chunk(cid, size)
        self.chunk_reads[cid] += 1
        self.bytes_out += len(data)
        if cid in self.corrupt or cid in self.corrupt_once:
            self.corrupt_once.discard(cid)
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    async def get_manifest(self, mid: str) -> bytes:
        self._check()
        self.manifest_reads += 1
        return await self.inner.get_manifest(mid)


@dataclass
class Node:
    node_id: str
    store: ChunkStore
    plane: DataPlane
    url: str
    herd: Herd
    rack: str = ""
    scope: trio.CancelScope | None = None    # its data plane's (killable nodes)
    peer: Peer = field(init=False)

    def __post_init__(self) -> None:
        self.peer = Peer(node_id=self.node_id, data_url=self.url, rack=self.rack)


async def start_nodes(nursery: trio.Nursery, root: Path, n: int, token: str, *,
                      racks: int = 0, config: HerdConfig = FAST,
                      plane_config: DataPlaneConfig | None = None,
                      store_roots: dict[int, Path] | None = None) -> list[Node]:
    nodes = []
    for i in range(n):
        sroot = (store_roots or {}).get(i, root / f"node{i}")
        store = ChunkStore(sroot)
        # every in-process node is 127.0.0.1: the per-client limit must cover them all
        plane = DataPlane(store, token=token, listen="127.0.0.1:0",
                          config=plane_config or DataPlaneConfig(max_per_client=1024, max_concurrent=2048))
        url = await nursery.start(plane.run)
        nid = f"node{i}"
        herd = Herd(store, node_id=nid, token=token, config=config)
        nodes.append(Node(nid, store, plane, url, herd, rack=f"rack{i % racks}" if racks else ""))
    return nodes


def open_file_origin(art: Artifact) -> WrappedOrigin:
    return WrappedOrigin(open_origin(f"file://{art.origin_dir}"))


def assert_bit_exact(node: Node, art: Artifact) -> None:
    assert node.store.is_complete(art.manifest_id)
    for cid, piece in art.chunks.items():
        assert node.store.read_chunk(cid) == piece


async def _hosted(plane: DataPlane, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run one data plane under its own cancel scope (so a test can kill that node)."""
    with trio.CancelScope() as cs:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(plane.run)
            task_status.started((url, cs))


async def start_rack_nodes(nursery: trio.Nursery, root: Path, n: int, token: str, *, rack_size: int,
                           config: HerdConfig, configs: dict[int, HerdConfig] | None = None,
                           plane_config: DataPlaneConfig) -> list[Node]:
    """``n`` killable nodes in racks of ``rack_size`` (node i in rack i // rack_size);
    ``configs`` overrides the herd config of some nodes (a slow rack)."""
    nodes = []
    for i in range(n):
        store = ChunkStore(root / f"node{i}")
        plane = DataPlane(store, token=token, listen="127.0.0.1:0", config=plane_config)
        url, cs = await nursery.start(_hosted, plane)
        nid = f"node{i}"
        cfg = (configs or {}).get(i, config)
        herd = Herd(store, node_id=nid, token=token, config=cfg)
        nodes.append(Node(nid, store, plane, url, herd, rack=f"rack{i // rack_size}", scope=cs))
    return nodes


# path, how many times it was asked before -> (status line, body); None: serve the file
Rule = Callable[[str, int], tuple[bytes, bytes] | None]


async def mirror_origin(nursery: trio.Nursery, root: Path, seen: Counter[str], rule: Rule) -> str:
    """A static mirror of ``root`` over HTTP/1.1 on loopback (one request a connection), each
    request path counted in ``seen``; ``rule`` may answer a request instead of the file."""
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
            n = seen[path]
            seen[path] += 1
            f = root / path.lstrip("/")
            answer = rule(path, n)
            if answer is not None:
                status, body = answer
            elif f.is_file():
                status, body = b"200 OK", f.read_bytes()
            else:
                status, body = b"404 Not Found", b"no such object"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-length: " + str(len(body)).encode()
                                  + b"\r\nconnection: close\r\n\r\n" + body)

    nursery.start_soon(trio.serve_listeners, handle, listeners)
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
