"""Origins: file:// semantics, ref validation, and the http(s) read-only origin with retries
against a real loopback server."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import trio
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.http import App, Request, Response, serve
from p2p.errors import NotFoundError, OriginError, ReadOnlyOriginError, RefError
from p2p.origins import FileOrigin, GCSOrigin, HttpOrigin, check_ref_name, open_origin


def chunk(seed: int, size: int = 1000) -> tuple[str, bytes]:
    data = (seed.to_bytes(4, "big") * (size // 4 + 1))[:size]
    return blake3(data).hexdigest(), data


def test_open_origin_schemes(tmp_path: Path) -> None:
    assert isinstance(open_origin(f"file://{tmp_path}"), FileOrigin)
    assert isinstance(open_origin("gs://bucket/some/prefix"), GCSOrigin)
    assert isinstance(open_origin("https://mirror.example/herd"), HttpOrigin)
    for bad in ("", "ftp://x/y", "file://host/dir", "relative/dir", "http://", "http://[::1", "http://h:99999/x",
                "gs://", "file://"):
        with pytest.raises(OriginError):
            open_origin(bad)


@pytest.mark.parametrize("name", ["trainer:v42", "team/trainer:v1.2-rc3", "a", "x@sha+1=2"])
def test_ref_names_ok(name: str) -> None:
    assert check_ref_name(name) == name


@pytest.mark.parametrize("name", ["", "../x", "a/../b", "/abs", "a//b", "a/./b", ".hidden", "a\x00b",
                                  "sp ace", "a/", "x" * 201, "naïve"])
def test_ref_names_refused(name: str) -> None:
    with pytest.raises(RefError):
        check_ref_name(name)


async def test_file_origin_roundtrip(tmp_path: Path) -> None:
    o = open_origin(f"file://{tmp_path}/origin")
    chunks = [chunk(i) for i in range(100)]
    ids = [c for c, _ in chunks]
    assert await o.missing(ids) == set(ids)  # the directory does not even exist yet
    for cid, data in chunks[:70]:
        await o.put_chunk(cid, data)
    assert await o.missing(ids) == set(ids[70:])  # >64 ids: listed
    assert await o.missing(ids[65:75]) == set(ids[70:75])  # few ids: stat'ed
    assert await o.get_chunk(ids[3]) == chunks[3][1]
    mid = chunk(999)[0]
    await o.put_manifest(mid, b"manifest bytes")
    assert await o.get_manifest(mid) == b"manifest bytes"
    await o.set_ref("trainer:v1", mid)
    assert await o.resolve("trainer:v1") == mid
    assert await o.resolve(mid) == mid
    with pytest.raises(NotFoundError, match="unknown ref"):
        await o.resolve("trainer:v2")
    with pytest.raises(NotFoundError):
        await o.get_chunk(ids[80])
    with pytest.raises(RefError):
        await o.resolve("../../etc/passwd")
    with pytest.raises(RefError):
        await o.get_chunk("../x")
    assert not [n for n in os.listdir(tmp_path / "origin" / "chunks") if n.startswith(".")]
    st = o.statistics()
    assert st.puts == 72 and st.gets >= 3
    # A ref holding garbage is an origin error, not a crash.
    (tmp_path / "origin" / "refs" / "junk").write_text("hello")
    with pytest.raises(OriginError, match="does not hold a manifest id"):
        await o.resolve("junk")


async def test_file_origin_unreachable(tmp_path: Path) -> None:
    o = open_origin(f"file://{tmp_path}/nope")
    with pytest.raises(OriginError, match="unreachable"):
        await o.resolve("trainer:v1")
    with pytest.raises(OriginError, match="unreachable"):
        await o.get_chunk(chunk(1)[0])


async def test_http_origin_reads_retries_and_is_read_only(tmp_path: Path) -> None:
    root = tmp_path / "origin"
    fo = FileOrigin(root)
    chunks = [chunk(i) for i in range(5)]
    for cid, data in chunks:
        await fo.put_chunk(cid, data)
    mid = chunk(77)[0]
    await fo.set_ref("app:v1", mid)
    flaky = {"left": 2, "slow": 1}
    app = App()

    async def get(req: Request) -> Response:
        if flaky["left"] > 0 and req.params["kind"] == "chunks":
            flaky["left"] -= 1
            return Response(status=429 if flaky["left"] else 503, body=b"busy")
        if flaky["slow"] > 0 and req.params["name"] == chunks[1][0]:
            flaky["slow"] -= 1
            await trio.sleep_forever()  # past the client's timeout: a retried timeout
        p = root / req.params["kind"] / req.params["name"]
        if not p.is_file():
            return Response(status=404, body=b"")
        return Response(body=p.read_bytes(), content_type="application/octet-stream")

    app.add("GET", "/herd/{kind}/{name}", get)
    app.add("GET", "/herd/refs/{ns}/{name}", get)  # unused: refs here are flat
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve, app, "127.0.0.1:0")
            o = open_origin(f"{url}/herd", retries=3)
            o.http.backoff_base = 0.01  # type: ignore[attr-defined]
            assert await o.get_chunk(chunks[0][0]) == chunks[0][1]  # after a 429 and a 503
            assert o.statistics().retries == 2
            o.http.client.timeout = httpx.Timeout(0.5)  # type: ignore[attr-defined]
            o.http.lean.timeout = 0.5  # type: ignore[attr-defined]  # plain http:// GETs: p2p.origins.lean
            assert await o.get_chunk(chunks[1][0]) == chunks[1][1]  # after a timeout
            assert o.statistics().retries == 3
            assert await o.resolve("app:v1") == mid
            ids = [c for c, _ in chunks] + [chunk(50)[0]]
            assert await o.missing(ids) == {chunk(50)[0]}
            with pytest.raises(NotFoundError):
                await o.get_manifest(mid)
            with pytest.raises(ReadOnlyOriginError):
                await o.put_chunk(*chunk(51))
            await o.aclose()
            nursery.cancel_scope.cancel()


async def test_http_origin_unreachable_after_retries() -> None:
    # Bind a port, then close it: nothing listens there.
    s = trio.socket.socket()
    await s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    o = open_origin(f"http://127.0.0.1:{port}/x", retries=2)
    o.http.backoff_base = 0.01  # type: ignore[attr-defined]
    with trio.fail_after(10):
        with pytest.raises(OriginError, match="failed after 3 attempts: unreachable"):
            await o.get_chunk(chunk(1)[0])
    await o.aclose()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab.:/-_@+=\x00 \\~")), min_size=0, max_size=24))
def test_ref_names_property(name: str) -> None:
    """Whatever is accepted stays inside refs/: no empty/dot components, no NUL, not absolute."""
    try:
        check_ref_name(name)
    except RefError:
        return
    parts = name.split("/")
    assert all(p and p not in (".", "..") and p[0].isalnum() for p in parts)
    assert "\x00" not in name and not name.startswith("/")
    root = Path("/origin/refs")
    assert (root / name).resolve().is_relative_to(root)
