"""One retry layer for a fetch's origin reads (issue 20 §2): the herd's origin call
(``Herd._origin_call``) is the only one, with one budget (``origin_tries``); an answer
that will not change (403) fails at once naming the chunk and the origin's answer; bad
bytes are asked again ``origin_verify_tries`` times; ``herd artifact fetch`` (with and
without ``--peer``) asks a chunk at most ``--retries`` + 1 times. And a dead peer given
as a bare URL does not keep a fetch from the origin (it used to: 60 s of reconnects).

Real parts: a static bucket mirror over HTTP/1.1 on loopback (counting every request),
real stores, the real CLI as a subprocess."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from p2p.errors import IntegrityError, OriginError, OriginUnavailable
from p2p.fetch import fetch_artifact
from p2p.herd import Herd, OriginCorruptError
from p2p.origins import open_origin
from p2p.store import ChunkStore
from tests.herd_cluster import FAST, Artifact, Rule, make_artifact, mirror_origin, open_file_origin

HERD = [sys.executable, "-m", "cli.main"]
def _chunk_gets(seen: Counter[str]) -> dict[str, int]:
    return {p.removeprefix("/chunks/"): c for p, c in seen.items() if p.startswith("/chunks/")}


@pytest.fixture
def dead_peer() -> Iterator[str]:
    """A data-plane URL where nothing listens (a bound socket that never listens: refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


async def _herd_fetch_via_http(tmp_path: Path, art: Artifact, rule: Rule, **cfg: object
                               ) -> tuple[Counter[str], Herd, BaseException | None, float]:
    """Fetch ``art`` origin-only through a herd of one with one origin worker (so one chunk
    is asked at a time), the origin opened with retries=0 as every fetch path does."""
    seen: Counter[str] = Counter()
    herd = Herd(ChunkStore(tmp_path / "store"), node_id="n0", token=None,
                config=dataclasses.replace(FAST, origin_concurrency=1, **cfg))  # type: ignore[arg-type]
    err: BaseException | None = None
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url = await mirror_origin(nursery, art.origin_dir, seen, rule)
            origin = open_origin(url, retries=0)
            t0 = trio.current_time()
            try:
                await fetch_artifact(herd.store, art.manifest_id, origin, herd=herd)
            except OriginError as e:
                err = e
            took = trio.current_time() - t0
            await origin.aclose()
            await herd.aclose()
            nursery.cancel_scope.cancel()
    return seen, herd, err, took


async def test_a_403_is_one_request_and_one_clear_error(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=41)
    seen, herd, err, took = await _herd_fetch_via_http(
        tmp_path, art, lambda p, n: (b"403 Forbidden", b"access denied to this key")
        if p.startswith("/chunks/") else None)
    gets = _chunk_gets(seen)
    assert list(gets.values()) == [1]                 # one request, not asked again
    (cid,) = gets
    assert isinstance(err, OriginError) and not isinstance(err, OriginUnavailable)
    assert str(err).startswith(f"chunk {cid}: ")
    assert "HTTP 403 (access denied)" in str(err) and "not retried" in str(err)
    assert "access denied to this key" not in str(err)     # the origin's body is not echoed
    assert herd.counters.origin_retries == 0
    assert not herd.store.is_complete(art.manifest_id)
    print(f"403: failed after {took * 1000:.1f} ms")


async def test_a_503_origin_is_asked_exactly_origin_tries_times(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=42)
    seen, herd, err, _ = await _herd_fetch_via_http(
        tmp_path, art, lambda p, n: (b"503 Service Unavailable", b"later")
        if p.startswith("/chunks/") else None, origin_tries=4)
    gets = _chunk_gets(seen)
    assert list(gets.values()) == [4]                 # the budget, once: no layer above asks again
    (cid,) = gets
    assert isinstance(err, OriginUnavailable)
    assert str(err).startswith(f"chunk {cid}: origin still failing after 4 requests: ")
    assert "HTTP 503" in str(err)
    assert herd.counters.origin_retries == 3


async def test_a_503_twice_then_the_chunk(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=43)
    seen, herd, err, _ = await _herd_fetch_via_http(
        tmp_path, art, lambda p, n: (b"503 Service Unavailable", b"later")
        if p.startswith("/chunks/") and n < 2 else None, origin_tries=4)
    assert err is None
    assert sorted(_chunk_gets(seen).values()) == [3] * len(art.chunks)
    assert herd.counters.origin_retries == 2 * len(art.chunks)
    assert herd.store.is_complete(art.manifest_id)


async def test_wrong_bytes_are_asked_verify_tries_times_then_an_error_naming_the_chunk(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=44)
    bad = sorted(art.chunks)[2]

    def flip(p: str, n: int) -> tuple[bytes, bytes] | None:
        if p != f"/chunks/{bad}":
            return None
        data = art.chunks[bad]
        return b"200 OK", bytes([data[0] ^ 0xFF]) + data[1:]

    seen, herd, err, _ = await _herd_fetch_via_http(tmp_path, art, flip, origin_tries=10, origin_verify_tries=3)
    assert _chunk_gets(seen)[bad] == 3
    assert isinstance(err, OriginCorruptError) and isinstance(err, IntegrityError)
    assert bad in str(err) and "after 3 answers" in str(err)
    assert herd.counters.origin_bad_answers == 3
    assert not herd.store.has_chunk(bad)


async def test_a_dead_bare_url_peer_falls_through_to_the_origin(tmp_path: Path, dead_peer: str) -> None:
    """``fetch_artifact(..., peers=[URL])`` with nothing at URL: the manifest's tree sends
    this node to the dead peer; once it failed (penalised) the origin is next. It used to
    ask the dead peer again at once, ~3,000 times a second, until the 60 s wait ran out."""
    art = make_artifact(tmp_path, 8 * 64 * 1024, chunk_size=64 * 1024, seed=45)
    origin = open_file_origin(art)
    herd = Herd(ChunkStore(tmp_path / "store"), node_id="cold", token="t")
    with trio.fail_after(20):
        stats = await fetch_artifact(herd.store, art.manifest_id, origin, peers=[dead_peer], herd=herd)  # type: ignore[arg-type]
    await herd.aclose()
    assert stats.bytes_from_origin == art.size
    assert origin.manifest_reads == 1
    assert sorted(origin.chunk_reads.values()) == [1] * len(art.chunks)
    # asked at most once for the manifest and once per chunk (then penalised, the origin next)
    assert herd.health.stats[dead_peer].errors <= 1 + len(art.chunks)


@pytest.mark.parametrize("with_peer", [False, True], ids=["origin-only", "dead-peer"])
async def test_cli_fetch_asks_a_chunk_retries_plus_one_times(tmp_path: Path, token_dir: Path, dead_peer: str,
                                                            with_peer: bool) -> None:
    """``herd artifact fetch --retries 2`` (with ``--peer``: the herd's origin retry used to
    sit over the transport's): a chunk that always answers 503 is asked exactly 3 times
    and the command fails in one line naming it; the others, 503 twice first, 3 times."""
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=46)
    stuck = sorted(art.chunks)[0]
    seen: Counter[str] = Counter()

    def rule(p: str, n: int) -> tuple[bytes, bytes] | None:
        if p == f"/chunks/{stuck}" or (p.startswith("/chunks/") and n < 2):
            return b"503 Service Unavailable", b"later"
        return None

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await mirror_origin(nursery, art.origin_dir, seen, rule)
            peer = ["--peer", dead_peer, "--token-dir", str(token_dir)] if with_peer else []
            res = await trio.run_process(
                [*HERD, "artifact", "fetch", art.manifest_id, "--origin", url, "--retries", "2",
                 "--store", str(tmp_path / "cold"), "--into", str(tmp_path / "tree"), "--node-id", "cold",
                 *peer, "--json"], capture_stdout=True, capture_stderr=True, check=False)
            nursery.cancel_scope.cancel()
    err = res.stderr.decode().strip()
    assert res.returncode == 1, err
    assert err.count("\n") == 0 and stuck in err and "after 3 requests" in err and "HTTP 503" in err
    gets = _chunk_gets(seen)
    assert gets[stuck] == 3
    # the fetch ends at the first failure: others asked 3 times at most, none more
    assert max(gets.values()) == 3
    assert not (tmp_path / "tree").exists()


async def test_cli_fetch_succeeds_after_503s_within_its_retries(tmp_path: Path, token_dir: Path,
                                                                dead_peer: str) -> None:
    art = make_artifact(tmp_path, 4 * 64 * 1024, chunk_size=64 * 1024, seed=47)
    seen: Counter[str] = Counter()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url = await mirror_origin(nursery, art.origin_dir, seen, lambda p, n: (b"503 Service Unavailable", b"x")
                                if p.startswith("/chunks/") and n < 2 else None)
            res = await trio.run_process(
                [*HERD, "artifact", "fetch", art.manifest_id, "--origin", url, "--retries", "2",
                 "--store", str(tmp_path / "cold"), "--into", str(tmp_path / "tree"), "--node-id", "cold",
                 "--peer", dead_peer, "--token-dir", str(token_dir), "--json"],
                capture_stdout=True, capture_stderr=True, check=False)
            nursery.cancel_scope.cancel()
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout)["bytes_from_origin"] == art.size
    assert sorted(_chunk_gets(seen).values()) == [3] * len(art.chunks)
    assert (tmp_path / "tree" / "blob.bin").read_bytes() == b"".join(art.chunks[c] for c in art.chunks)


async def test_a_file_origin_says_which_failures_may_pass(tmp_path: Path) -> None:
    """A directory that is not there (a network mount not up yet) or an I/O error is
    OriginUnavailable, asked again by the herd; a refusal (permissions) is an answer."""
    import errno

    from p2p.origins import FileOrigin
    missing = FileOrigin(tmp_path / "not-mounted")
    with pytest.raises(OriginUnavailable, match="is unreachable: directory .* does not exist"):
        await missing.get_chunk("0" * 64)
    here = FileOrigin(tmp_path)
    eio = here._oserror(OSError(errno.EIO, "Input/output error"), "chunks/x", "read")
    eacces = here._oserror(OSError(errno.EACCES, "Permission denied"), "chunks/x", "read")
    assert isinstance(eio, OriginUnavailable) and "cannot read chunks/x: Input/output error" in str(eio)
    assert type(eacces) is OriginError and "Permission denied" in str(eacces)
