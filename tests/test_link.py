"""AgentLink against the real placer service; the framed heartbeat channel; the CLI."""

from __future__ import annotations

import functools
import json
import os
import socket
import struct
import sys

import msgspec
import pytest
import trio

from infra.auth import TokenSet
from placer.service import PlacerService
from scheduler_link.heartbeat_wire import HeartbeatClient, WireError, WireReply, frame, split_frames
from scheduler_link.messages import NodeReport, WorkloadEvent

from .test_placer_service import FakeAgent, cfg, start_cluster, wait_for


async def _true(v):
    return v


async def test_seq_gap_gets_409_and_a_full_report(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=1)
            link = cl.agents["n0"].link
            assert link is not None and link.registered
            await wait_for(lambda: _true(link.statistics()["framed_channel"]))
            full0, conflicts0 = link.full_reports_sent, link.conflicts
            link.seq += 5  # reports went missing: the placer must notice the gap
            await wait_for(lambda: _true(link.conflicts > conflicts0 and link.full_reports_sent > full0))
            assert link.registered and svc.state.nodes["n0"].last_seq == link.seq
            # HTTP heartbeats work the same when the framed channel is off
            link.use_wire = False
            await link._close_wire()
            s0 = link.reports_sent
            await wait_for(lambda: _true(link.reports_sent > s0 + 2))
            n.cancel_scope.cancel()


async def test_link_backs_off_while_the_placer_is_down_then_registers(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    agent = FakeAgent("solo", tokens)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            await n.start(agent.run, f"http://127.0.0.1:{port}")
            link = agent.link
            assert link is not None
            await wait_for(lambda: _true(link.failures >= 3))
            assert not link.registered
            link.notify(WorkloadEvent(workload_id="w", job_id="j", state="running", at=0.0))  # never raises
            svc = PlacerService(cfg(tmp_path, listen=f"127.0.0.1:{port}"), tokens)
            await n.start(svc.run)
            with trio.fail_after(10):
                await wait_for(lambda: _true(link.registered and "solo" in svc.state.nodes))
            n.cancel_scope.cancel()
    link.notify(WorkloadEvent(workload_id="w", job_id="j", state="exited", at=0.0))  # closed link: dropped


async def test_framed_channel_refuses_bad_tokens_and_frames(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            await n.start(svc.run)
            assert svc.wire_url
            with pytest.raises(WireError, match="401"):
                await HeartbeatClient.connect(svc.wire_url, "wrong", "x")
            with pytest.raises(WireError, match="401"):
                await HeartbeatClient.connect(svc.wire_url, tokens.operator or "", "x")
            c = await HeartbeatClient.connect(svc.wire_url, tokens.cluster or "", "x")
            await c.stream.send_all(struct.pack(">I", 5) + b"{nope")
            (r,) = await c.receive(1)
            assert r.status == 400 and "malformed" in (r.error or "")
            await c.send([NodeReport(node_id="x", boot_id="b", seq=3, full=False)])
            (r,) = await c.receive(1)
            assert r.status == 409 and r.reply.need_full  # unknown boot: send a full report
            await c.stream.send_all(struct.pack(">I", 1 << 30))  # over the frame limit: dropped
            with pytest.raises((WireError, trio.BrokenResourceError)):
                await c.receive(1)
            await c.aclose()
            assert svc.state.nodes == {} and svc.wire is not None and svc.wire.refused == 2
            n.cancel_scope.cancel()


def test_frames_split_at_any_boundary():
    data = b"".join(frame(WireReply(status=200 + i)) for i in range(5))
    buf = bytearray()
    got = []
    for i in range(0, len(data), 7):
        buf += data[i:i + 7]
        got += [msgspec.json.decode(f, type=WireReply).status for f in split_frames(buf)]
    assert got == [200, 201, 202, 203, 204] and not buf


async def _herd(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    r = await trio.run_process([sys.executable, "-m", "cli.main", *args], capture_stdout=True,
                               capture_stderr=True, check=False, env={**os.environ, **env})
    return r.returncode, r.stdout.decode(), r.stderr.decode()


async def test_cli_submit_list_show_cancel_nodes_cluster(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            env = {"HERD_PLACER": cl.url, "HERD_TOKEN_DIR": str(token_dir)}
            job_toml = tmp_path / "job.toml"
            job_toml.write_text('[job]\njob_id = "cli1"\npods = 2\ngpus_per_pod = 4\nrestart = "on-failure:2"\n'
                                'grace = 2.5\n')
            rc, out, err = await _herd(["job", "submit", str(job_toml), "--env", "A=1", "--wait", "running",
                                        "--json", "--", "sleep", "5"], env)
            assert rc == 0, err
            assert out.startswith("{"), (out, err)
            v = json.loads(out)
            assert v["state"] == "running" and v["spec"]["restart"] == {"kind": "on-failure", "limit": 2,
                                                                         "backoff_s": 1.0}
            assert v["spec"]["grace_s"] == 2.5 and v["spec"]["env"] == {"A": "<redacted>"} and len(v["pods"]) == 2
            rc, out, err = await _herd(["job", "list", "--json"], env)
            assert rc == 0 and [j["job_id"] for j in json.loads(out)["jobs"]] == ["cli1"]
            rc, out, err = await _herd(["job", "show", "cli1"], env)
            assert rc == 0 and "job cli1: running" in out and "RANK" in out
            rc, out, err = await _herd(["nodes", "--json"], env)
            assert rc == 0 and {x["node_id"] for x in json.loads(out)["nodes"]} == {"n0", "n1"}
            rc, out, err = await _herd(["cluster"], env)
            assert rc == 0 and "GPUs: 16 total" in out and "LEVEL" in out
            rc, out, err = await _herd(["placer", "defrag", "--json"], env)
            assert rc == 0 and "moves" in json.loads(out)
            # an artifact ref resolved against the origin before submitting
            origin = tmp_path / "origin"
            (origin / "refs").mkdir(parents=True)
            (origin / "refs" / "trainer:v1").write_text("cd" * 32 + "\n")
            rc, out, err = await _herd(["job", "submit", "--job-id", "art", "--artifact", "trainer:v1",
                                        "--origin", f"file://{origin}", "--json", "--", "true"], env)
            assert rc == 0, err
            assert json.loads(out)["spec"]["manifest_id"] == "cd" * 32
            rc, out, err = await _herd(["job", "submit", "--artifact", "trainer:v2", "--origin", f"file://{origin}",
                                        "--", "true"], env)
            assert rc == 1 and "unknown ref" in err
            rc, out, err = await _herd(["job", "cancel", "art"], env)
            assert rc == 0
            rc, out, err = await _herd(["job", "cancel", "cli1", "--json"], env)
            assert rc == 0 and json.loads(out)["state"] == "cancelled"
            # bad input: one clear line, nothing submitted
            for args, msg in ((["job", "submit", "--restart", "sometimes", "--", "x"], "bad --restart"),
                              (["job", "submit", "--env", "NOEQUALS", "--", "x"], "bad --env"),
                              (["job", "submit", "--pods", "2"], "nothing to run"),
                              (["job", "submit", str(tmp_path / "none.toml"), "--", "x"], "job file not found"),
                              (["job", "submit", "--artifact", "trainer:v1", "--", "x"], "--origin is needed"),
                              (["job", "submit", "--pods", "0", "--", "x"], "pods and gpus_per_pod"),
                              (["job", "show", "nope"], "404")):
                rc, out, err = await _herd(args, env)
                assert rc == 1 and msg in err and len(err.strip().splitlines()) == 1, (args, err)
            rc, out, err = await _herd(["job", "list"], {"HERD_PLACER": ""})
            assert rc == 1 and "no placer URL" in err
            rc, out, err = await _herd(["job", "list", "--json"], env)
            assert [(j["job_id"], j["state"]) for j in json.loads(out)["jobs"]] == [("cli1", "cancelled"),
                                                                                   ("art", "cancelled")]
            rc, out, err = await _herd(["job", "submit", "--token-dir", str(tmp_path / "nowhere"), "--", "x"], env)
            assert rc == 1 and "401" in err
            n.cancel_scope.cancel()


async def _raw_server(nursery, responses: list[bytes], *, close_after: bool = False):
    """A raw TCP server answering each request (head + content-length body) with the next
    canned response; ``close_after`` closes the connection after each answer."""
    async def handle(stream):
        buf = b""
        async with stream:
            while responses:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                while len(buf) < n:
                    buf += await stream.receive_some(65536)
                buf = buf[n:]
                resp = responses.pop(0)
                if resp:
                    await stream.send_all(resp)
                if close_after or not resp:
                    return
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_push_pool_keepalive_and_bad_answers():
    from scheduler_link.fanout import PushPool

    ok = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}'
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            pool = PushPool(attempt_timeout_s=2, retries=1, retry_backoff_s=0.01)
            url = await _raw_server(n, [ok, ok, ok])
            for _ in range(3):
                r = await pool.post(url, "/v1/placements", b"{}", token="t")
                assert r.ok and r.body == b"{}"
            assert pool.connects == 1  # kept alive
            # the agent closes idle connections: the next push reconnects transparently
            url = await _raw_server(n, [ok, ok], close_after=True)
            assert (await pool.post(url, "/x", b"{}")).ok
            assert (await pool.post(url, "/x", b"{}")).ok
            # protocol errors and silence: no status, a clear error, retried once
            for bad, msg in ((b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", "chunked"),
                             (b"garbage\r\n\r\n", "bad status line"),
                             (b"HTTP/1.1 200 OK\r\n\r\n", "without content-length"),
                             (b"", "closed by peer")):
                url = await _raw_server(n, [bad, bad])
                r = await pool.post(url, "/x", b"{}")
                assert r.status is None and msg in (r.error or "") and r.attempts == 2, (bad, r)
            r = await pool.post("https://example.invalid", "/x", b"{}")
            assert r.status is None and "http://host:port only" in (r.error or "")
            r = await pool.post("http://127.0.0.1:1", "/x", b"{}")
            assert r.status is None and r.error
            # an HTTP error answer is the agent's word: returned, not retried
            url = await _raw_server(n, [b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n"])
            r = await pool.post(url, "/x", b"{}")
            assert r.status == 401 and r.attempts == 1
            await pool.aclose()
            n.cancel_scope.cancel()


def test_wire_endpoint_uses_the_placer_host_when_the_placer_listens_everywhere():
    from scheduler_link.agent_link import wire_endpoint

    assert wire_endpoint("tcp://0.0.0.0:7471", "http://placer.example:7470") == "tcp://placer.example:7471"
    assert wire_endpoint("tcp://[::]:7471", "http://[fd00::5]:7470") == "tcp://[fd00::5]:7471"
    assert wire_endpoint("tcp://10.1.2.3:7471", "http://placer.example:7470") == "tcp://10.1.2.3:7471"
