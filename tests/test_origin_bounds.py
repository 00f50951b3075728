"""Origin bodies are bounded (issue 16): a chunk read never takes more than the size the
manifest promises, whatever the origin holds or announces."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
import trio

from infra.http import App, Request, Response, serve
from p2p.errors import OriginError
from p2p.origins import open_origin


def _chunk(n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    return blake3.blake3(data).hexdigest(), data


async def test_file_origin_reads_no_more_than_promised(tmp_path: Path) -> None:
    cid, data = _chunk(10_000)
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / cid).write_bytes(data)
    async with open_origin(f"file://{tmp_path}") as o:
        assert await o.get_chunk(cid, 10_000) == data
        with pytest.raises(OriginError, match="more than the 100 bytes"):
            await o.get_chunk(cid, 100)
        assert await o.get_chunk(cid) == data        # no size: the largest chunk a manifest may hold


async def test_http_origin_refuses_a_body_over_the_promised_size(tmp_path: Path) -> None:
    cid, data = _chunk(1 << 20)
    app = App()
    served: list[str] = []

    async def chunk(req: Request) -> Response:
        served.append(req.path)
        return Response(body=data, content_type="application/octet-stream")

    app.add("GET", "/herd/chunks/{cid}", chunk)
    app.add("GET", "/herd/refs/{name}", chunk)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(serve, app, "127.0.0.1:0")
            async with open_origin(f"{url}/herd", retries=0) as o:
                assert await o.get_chunk(cid, len(data)) == data
                with pytest.raises(OriginError, match="announces 1048576 bytes"):
                    await o.get_chunk(cid, 4096)
                with pytest.raises(OriginError, match="announces"):
                    await o.resolve("trainer:v1")    # a ref is at most 1 KiB (served: a 1 MiB body)
            n.cancel_scope.cancel()
