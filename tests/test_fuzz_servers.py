"""Fuzzing the real agent servers (issue 16): hypothesis sends generated requests -- raw
bytes, odd methods and headers, bodies, generated placements and data-plane queries --
to a real agent's control API and data plane on loopback, and checks after every
example that both still answer and that the data plane has released every slot and
wait place the example took. Bounded: a fixed number of examples, each request cut
after a fraction of a second, the whole file well under a minute."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra.auth import TokenSet, generate_token_dir

EXAMPLES = 60
READ_S = 0.4


@dataclass
class Running:
    agent: Agent
    control: tuple[str, int]
    data: tuple[str, int]
    tokens: TokenSet
    trio_token: Any
    cancel: trio.CancelScope
    thread: threading.Thread


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1"
    return host, int(port)


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("fuzz")
    token_dir = generate_token_dir(tmp / "tokens")
    tokens = TokenSet.load(token_dir)
    cfg = AgentConfig(node_id="fz", gpus="simulated:dgx-h100", state_dir=str(tmp / "state"), listen="127.0.0.1:0",
                      data_listen="127.0.0.1:0", token_dir=str(token_dir), gpu_poll_interval_s=0.5,
                      workloads=SupervisorConfig(shim_pool=0), allowed_origins=(f"file://{tmp}/origin",))
    agent = Agent(cfg, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)
    started = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as n:
            box["cancel"] = n.cancel_scope
            box["url"] = await n.start(agent.run)
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(30), "agent did not start"
    assert agent.data_url is not None
    r = Running(agent, _hostport(box["url"]), _hostport(agent.data_url), tokens, box["token"], box["cancel"], thread)
    try:
        yield r
    finally:
        trio.from_thread.run_sync(r.cancel.cancel, trio_token=r.trio_token)
        thread.join(15)
        assert not thread.is_alive()


def _exchange(addr: tuple[str, int], data: bytes) -> bytes:
    """Send ``data``, read what comes back for READ_S at most, close."""
    s = socket.create_connection(addr, timeout=2)
    try:
        s.settimeout(READ_S)
        try:
            s.sendall(data)
        except OSError:
            pass
        out = b""
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline and len(out) < 1 << 20:
            try:
                piece = s.recv(65536)
            except (TimeoutError, OSError):
                break
            if not piece:
                break
            out += piece
        return out
    finally:
        s.close()


def _status(addr: tuple[str, int], path: str, token: str | None) -> int:
    auth = f"authorization: Bearer {token}\r\n" if token else ""
    out = _exchange(addr, f"GET {path} HTTP/1.1\r\nhost: a\r\n{auth}connection: close\r\n\r\n".encode())
    assert out.startswith(b"HTTP/1.1 "), out[:100]
    return int(out[9:12])


def _still_up(r: Running) -> None:
    assert _status(r.control, "/healthz", None) == 200
    assert _status(r.data, "/v1/stats", r.tokens.cluster) == 200
    # every slot and wait place an example took is released once its connection closed
    deadline = time.monotonic() + 2
    while True:
        st_ = r.agent.dataplane.statistics() if r.agent.dataplane is not None else {}
        if st_.get("active", 0) == 0 and st_.get("waiting_requests", 0) == 0:
            break
        assert time.monotonic() < deadline, st_
        time.sleep(0.01)


# ------------------------------------------------------------------ strategies

_text = st.text(max_size=40)
_json_leaf = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _text
_json = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
                     max_leaves=12)

_origins = st.sampled_from(["gs://evil/x", "http://169.254.169.254/", "file:///etc", "", "file:///", "gs://"]) | _text
_pods = st.lists(st.fixed_dictionaries({"workload_id": _text, "rank": st.integers(-5, 2**40),
                                        "gpus": st.lists(_text, max_size=4)}), max_size=3)
_placement = st.fixed_dictionaries(
    {"placement_id": _text, "job_id": _text},
    optional={"pods": _pods | _json, "victims": st.lists(st.fixed_dictionaries({"workload_id": _text}), max_size=3),
              "origin": _origins, "manifest_id": st.sampled_from(["ab" * 32, "zz", ""]) | _text,
              "argv": st.just(["true"]), "env": st.dictionaries(_text, _text, max_size=3),
              "world_size": st.integers(-3, 2**40), "grace_s": st.floats(), "version": st.integers(-1, 3),
              "peers": st.lists(st.fixed_dictionaries({"node_id": _text, "data_url": _text}), max_size=3),
              "extra": _json})

_control_paths = st.sampled_from([
    "/v1/placements", "/v1/prefetch", "/v1/status", "/v1/gpus", "/v1/workloads", "/v1/workloads/x",
    "/v1/workloads/x/logs?tail=99999999999", "/v1/workloads/%2e%2e/logs", "/v1/workloads/x/stop",
    "/v1/gpus/GPU-0/inject", "/metrics", "/openapi.json", "/healthz", "/readyz", "/", "//", "/v1/../etc/passwd",
]) | _text.map(lambda t: "/" + "".join(c for c in t if c.isprintable() and c not in " \r\n"))
_data_paths = st.sampled_from(["/v1/stats", "/v1/chunks/", "/v1/chunks/", "/v1/manifests/", "/v1/have/"]).flatmap(
    lambda p: st.just(p) if p == "/v1/stats" else st.one_of(st.just(p + "ab" * 32), st.text(
        "0123456789abcdefXYZ/%.", max_size=80).map(lambda t: p + t)))
_query = st.one_of(st.sampled_from(["", "?wait_ms=0", "?wait_ms=50", "?wait_ms=60000", "?wait_ms=99999999999999"]),
                   st.integers(-5, 10**15).map(lambda n: f"?wait_ms={n}"),
                   st.text("wait_ms=0123456789&x%", max_size=30).map(lambda t: "?" + t))


# tokens are known only once the agent runs: requests carry placeholders, filled in by _fill
_TOKENS = ("cluster", "placer", "operator", "viewer")


def _fill(req: bytes, tokens: TokenSet) -> bytes:
    for role in _TOKENS:
        req = req.replace(f"{{{role}}}".encode(), getattr(tokens, role).encode())
    return req


@st.composite
def _request(draw: st.DrawFn, data_plane: bool) -> bytes:
    method = draw(st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "G\x00T"]
                                  if data_plane else ["GET", "POST", "POST", "HEAD", "PUT", "DELETE", "G\x00T"]))
    path = draw(_data_paths) + draw(_query) if data_plane else draw(_control_paths)
    right = "{cluster}" if data_plane else "{placer}"
    token = draw(st.one_of(st.just(right), st.sampled_from([*(f"{{{r}}}" for r in _TOKENS), "wrong", None])))
    kind = draw(st.sampled_from(["none", "none", "binary"] if data_plane else ["placement", "placement", "binary", "none"]))
    body = (json.dumps(draw(_placement)).encode() if kind == "placement"
            else draw(st.binary(max_size=2048)) if kind == "binary" else b"")
    headers = [("host", "a")]
    if token:
        headers.append(("authorization", draw(st.sampled_from(["Bearer ", "Bearer ", "bearer ", "Basic ", ""])) + token))
    framing = draw(st.sampled_from(["length", "lie", "huge", "chunked", "none", "garbage"] if method != "GET"
                                   else ["none", "none", "none", "length", "lie", "huge", "chunked", "garbage"]))
    if framing == "length":
        headers.append(("content-length", str(len(body))))
    elif framing == "lie":
        headers.append(("content-length", str(len(body) + draw(st.integers(1, 10_000)))))
    elif framing == "huge":
        headers.append(("content-length", str(draw(st.integers(1 << 20, 1 << 62)))))
    elif framing == "chunked":
        headers.append(("transfer-encoding", "chunked"))
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    elif framing == "garbage":
        headers.append(("content-length", draw(st.sampled_from(["-1", "1e9", "0x10", " 5", "5, 5", "\u00e9"]))))
    extra = draw(st.just([]) | st.lists(st.tuples(st.text("abcxyz-", min_size=1, max_size=10),
                                                  st.text(st.characters(min_codepoint=32, max_codepoint=126),
                                                          max_size=40) | _text), max_size=3))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers + extra) + "\r\n"
    return head.encode("utf-8", "replace") + body


_raw = st.one_of(
    st.binary(max_size=4096),
    st.sampled_from([b"GET / HTTP/1.1\r\n", b"POST /v1/placements HTTP/1.1\r\nhost: a\r\n", b"\r\n\r\n",
                     b"GET /v1/stats HTTP/1.0\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"]).flatmap(
        lambda prefix: st.binary(max_size=2048).map(lambda tail: prefix + tail)),
)

_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.data_too_large])


# ------------------------------------------------------------------ the tests

_WAIT = "GET /v1/chunks/{id}?wait_ms={ms} HTTP/1.1\r\nhost: a\r\nauthorization: Bearer {{cluster}}\r\n\r\n"


@_SETTINGS
@given(req=st.one_of(_request(data_plane=False), _raw))
@example(req=b"POST /v1/placements HTTP/1.1\r\nhost: a\r\ncontent-length: 900000\r\n\r\n" + b"x" * 60000)
@example(req=b"POST /v1/placements HTTP/1.1\r\nhost: a\r\nauthorization: Bearer {placer}\r\n"
             b"content-length: 90\r\n\r\n" + b'{"placement_id": "p", "job_id": "j", "origin": "gs://evil/x"}')
@example(req=b"GET /v1/status HTTP/1.1\r\nhost: a\r\nx-slow: ")
def test_fuzz_control_api(running: Running, req: bytes) -> None:
    out = _exchange(running.control, _fill(req, running.tokens))
    assert not out.startswith(b"HTTP/1.1 500"), (req[:300], out[:300])
    _still_up(running)


@_SETTINGS
@given(req=st.one_of(_request(data_plane=True), _raw))
@example(req=_WAIT.format(id="ab" * 32, ms=60000).encode())          # a waiter that goes away
@example(req=_WAIT.format(id="cd" * 32, ms=10**15).encode())
@example(req=b"GET /v1/chunks/" + b"ab" * 32 + b" HTTP/1.1\r\nhost: a\r\nauthorization: Bearer {cluster}\r\n"
             b"transfer-encoding: chunked\r\n\r\n5\r\nhello")
@example(req=b"GET /v1/stats HTTP/1.1\r\nhost: a\r\nx-slow: ")
def test_fuzz_data_plane(running: Running, req: bytes) -> None:
    out = _exchange(running.data, _fill(req, running.tokens))
    assert not out.startswith(b"HTTP/1.1 500"), (req[:300], out[:300])
    _still_up(running)


def test_fuzz_started_nothing_on_a_gpu(running: Running) -> None:
    """Generated GPU names never match the inventory: whatever was accepted holds no GPU."""
    assert all(not w.gpus for w in running.agent.supervisor.workloads())
