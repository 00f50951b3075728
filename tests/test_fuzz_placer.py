"""Fuzzing the real placer (issue 16): hypothesis sends generated node reports -- over HTTP
and as framed-channel frames, well formed, malformed and hostile (GPU counts over the
model's width, duplicate UUIDs, UUIDs another node reports, unknown workloads and events,
wrong sequence numbers, absurd numbers) -- to a real PlacerService on loopback, with a
job placed and running on nodes that report honestly. After every example the placer
still answers, its model keeps every invariant, and the honest job still runs on its
GPUs. Bounded: a fixed number of examples, each exchange cut after a fraction of a second."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infra.auth import TokenSet, generate_token_dir
from infra.http import App, Request, Response, json_response, serve
from placer.config import PlacerConfig
from placer.service import PlacerService
from scheduler_link.messages import Placement, PlacementAck

EXAMPLES = 60
READ_S = 0.3


@dataclass
class Running:
    svc: PlacerService
    url: str
    wire: tuple[str, int]
    tokens: TokenSet
    trio_token: Any
    cancel: trio.CancelScope
    thread: threading.Thread
    honest_url: str = ""


def _gpus(node: str, n: int) -> list[dict[str, Any]]:
    return [{"index": i, "uuid": f"GPU-{node}-{i}", "name": "sim", "memory_total_mib": 1, "pci_bus_id": str(i),
             "simulated": True} for i in range(n)]


def _full(node: str, seq: int, workloads: list[dict[str, Any]] | None = None, n: int = 8,
          control_url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"node_id": node, "boot_id": f"boot-{node}", "seq": seq, "full": True, "control_url": control_url,
            "data_url": "http://127.0.0.1:9", "topology": {"zone": "z", "block": "b", "rack": "r"},
            "snapshot": {"simulated": True, "gpus": _gpus(node, n)}, "workloads": workloads or []}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("fuzzp")
    tokens = TokenSet.load(generate_token_dir(tmp / "tokens"))
    cfg = PlacerConfig(listen="127.0.0.1:0", wire_listen="127.0.0.1:0", state_dir=str(tmp / "state"),
                       heartbeat_s=60.0, recover_s=0.0, tick_s=0.05)
    svc = PlacerService(cfg, tokens)
    started = threading.Event()
    box: dict[str, Any] = {}

    honest = App(name="honest-agent")

    async def place(req: Request) -> Response:  # an honest agent: accepts what names its GPUs
        pl = req.decode(Placement)
        return json_response(PlacementAck(placement_id=pl.placement_id, node_id="honest", accepted=True,
                                          outcome="accepted", workloads=[p.workload_id for p in pl.pods]))
    honest.add("POST", "/v1/placements", place)

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as n:
            box["cancel"] = n.cancel_scope
            box["agent"] = await n.start(serve, honest, "127.0.0.1:0")
            box["url"] = await n.start(svc.run)
            started.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert started.wait(30), "placer did not start"
    assert svc.wire_url is not None
    host, port = svc.wire_url.removeprefix("tcp://").rsplit(":", 1)
    r = Running(svc, box["url"], (host, int(port)), tokens, box["token"], box["cancel"], thread)
    # an honest node runs a job (its pod's state comes from its full reports alone: no pushes land)
    h = {"authorization": f"Bearer {tokens.cluster}"}
    with httpx.Client(base_url=r.url, timeout=10) as c:
        r.honest_url = box["agent"]
        assert c.post("/v1/nodes/honest/report", json=_full("honest", 1, control_url=r.honest_url),
                      headers=h).status_code == 200
        spec = {"job_id": "keep", "pods": 1, "gpus_per_pod": 8, "argv": ["x"]}
        assert c.post("/v1/jobs", json=spec, headers={"authorization": f"Bearer {tokens.operator}"}).status_code == 201
        deadline = time.monotonic() + 10
        while svc.state.jobs["keep"].state != "starting" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.state.jobs["keep"].state == "starting"
    try:
        yield r
    finally:
        trio.from_thread.run_sync(r.cancel.cancel, trio_token=r.trio_token)
        thread.join(15)
        assert not thread.is_alive()


def _frame(obj: Any) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def _wire(r: Running, frames: list[bytes], relay: bool) -> bytes:
    s = socket.create_connection(r.wire, timeout=2)
    try:
        s.settimeout(READ_S)
        hello = {"token": r.tokens.cluster, "node_id": "fz", "relay": relay}
        try:
            s.sendall(_frame(hello) + b"".join(frames))
        except OSError:
            pass
        out = b""
        deadline = time.monotonic() + READ_S
        while time.monotonic() < deadline:
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


def _replies(out: bytes) -> list[dict[str, Any]]:
    """The framed channel's answers (u32 length + JSON WireReply each); a torn tail is dropped."""
    got, pos = [], 0
    while len(out) - pos >= 4:
        (n,) = struct.unpack_from(">I", out, pos)
        if len(out) - pos - 4 < n:
            break
        got.append(json.loads(out[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return got


def _check(r: Running) -> None:
    with httpx.Client(base_url=r.url, timeout=5) as c:
        assert c.get("/healthz").status_code == 200
    trio.from_thread.run_sync(r.svc.state.model.check_invariants, trio_token=r.trio_token)
    st_ = r.svc.state
    assert sum(st_.node_states.values()) == len(st_.nodes), (dict(st_.node_states), len(st_.nodes))
    assert all(st_.uuid_owner.get(u) == nid for nid, n in st_.nodes.items() for u in n.uuids)
    job = r.svc.state.jobs["keep"]
    assert job.state in ("placing", "starting", "running"), (job.state, job.reason)
    assert job.pods and job.pods[0].node_id == "honest"
    held = r.svc.state.model.jobs["keep"].gpus_by_node
    assert held == {"honest": tuple(range(8))}, held


# (an impostor "honest" is the identity issue's); the plausible values repeat, to come up often
_node = st.sampled_from(["fz", "fz", "a", "b", "x" * 300, "", "n/../x"])
_num = st.one_of(st.integers(-2, 2), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True))
_workload = st.fixed_dictionaries({
    "workload_id": st.sampled_from(["keep.1.0", "keep.0.0", "zz.1.0", "keep.1.9", "bad id", "x" * 400]),
    "job_id": st.sampled_from(["keep", "zz", ""]),
    "state": st.sampled_from(["accepted", "running", "exited", "lost", "bogus"]),
    "gpus": st.lists(st.sampled_from(["GPU-honest-0", "GPU-honest-1", "GPU-fz-0", "GPU-a-0"]), max_size=10),
}, optional={"exit_code": _num})
_report = st.builds(
    lambda node, seq, full, n_gpus, uuid_of, dup, workloads, events, extra: {
        "node_id": node, "boot_id": f"boot-{node}", "seq": seq, "full": full,
        "control_url": "http://127.0.0.1:9", "topology": {"zone": "z", "block": "b", "rack": "r"},
        "snapshot": {"gpus": [{"index": i, "uuid": f"GPU-{uuid_of}-{i % 3 if dup else i}",
                               "name": "g", "memory_total_mib": 1, "pci_bus_id": "p"} for i in range(n_gpus)]},
        "workloads": workloads, "events": events, **extra},
    _node, st.one_of(st.just(1), st.just(1), _num), st.sampled_from([True, True, True, False]),
    st.sampled_from([8, 8, 1, 64, 0, 65, 200]), st.sampled_from(["honest", "honest", "fz", "a", "b"]),
    st.sampled_from([False, False, True]), st.lists(_workload, max_size=4),
    st.lists(st.fixed_dictionaries({"workload_id": st.sampled_from(["keep.1.0", "zz.1.0"]),
                                    "job_id": st.sampled_from(["keep", "zz"]),
                                    "state": st.sampled_from(["running", "exited", "failed"]),
                                    "at": _num}), max_size=3),
    st.sampled_from([{}, {}, {}, {"sent_at": float("inf")}, {"version": 99}, {"manifests": ["zz"] * 3},
                     {"unknown": 1}]))
_report_bytes = _report.map(lambda d: json.dumps(d, allow_nan=True).encode())
_payload = st.one_of(_report_bytes, _report_bytes, _report_bytes, st.binary(max_size=300), st.just(b"{}"),
                     st.just(b"[]"), st.just(b"null"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
@given(payloads=st.lists(_payload, min_size=1, max_size=4), path_node=_node, relay=st.booleans(),
       same_path=st.sampled_from([True, True, True, False]))
def test_generated_reports_over_http_and_the_framed_channel(running: Running, payloads: list[bytes],
                                                           path_node: str, relay: bool, same_path: bool) -> None:
    h = {"authorization": f"Bearer {running.tokens.cluster}", "content-type": "application/json"}
    with httpx.Client(base_url=running.url, timeout=5) as c:
        for p in payloads:
            try:  # most reports to their own node's path (else they are refused before anything)
                node = json.loads(p).get("node_id") if same_path else None
            except (ValueError, AttributeError):
                node = None
            where = node if isinstance(node, str) and node and "/" not in node else (path_node or "empty")
            r = c.post(f"/v1/nodes/{where}/report", content=p, headers=h)
            assert r.status_code in (200, 400, 404, 409, 413), (r.status_code, r.text[:200])
    for rep in _replies(_wire(running, [_frame(p) for p in payloads], relay)):  # it may also close
        assert rep["status"] in (200, 400, 409), rep
    _check(running)
    # the honest node's next full report (its truth) still lands
    with httpx.Client(base_url=running.url, timeout=5) as c:
        seq = running.svc.state.nodes["honest"].last_seq + 1
        w = [{"workload_id": "keep.1.0", "job_id": "keep", "state": "running",
              "gpus": [f"GPU-honest-{i}" for i in range(8)]}]
        r = c.post("/v1/nodes/honest/report", json=_full("honest", seq, w, control_url=running.honest_url),
                   headers=h)
        assert r.status_code == 200, r.text
    _check(running)
