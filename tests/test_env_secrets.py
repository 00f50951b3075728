"""Job env values are never returned by read APIs, and secrets can come from host files
(issue 17 §2): a real placer and a real agent on loopback; the workload sees both kinds of
value, while the placer's job reads (every role, every view) show names only and the file's
value is nowhere but in the workload's environment."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.launcher import EnvFileError, read_env_files
from agent.supervisor import SupervisorConfig
from infra.auth import TokenSet, auth_header
from placer.service import PlacerService
from placer.views import REDACTED
from scheduler_link.messages import JobSpec, Placement, PlacementAck, PodAssignment
from tests.test_placer_service import cfg, wait_for

ENV_VALUE = "env-value-7f3a9c"
FILE_VALUE = "file-secret-91bd42"


def test_read_env_files_bounds_and_errors(tmp_path: Path) -> None:
    d = tmp_path / "secrets"
    d.mkdir()
    (d / "ok").write_text(FILE_VALUE + "\n")
    (d / "big").write_bytes(b"x" * 100)
    (d / "bin").write_bytes(b"\xff\xfe")
    (d / "nul").write_bytes(b"a\0b")
    (tmp_path / "outside").write_text("nope")
    os.symlink(tmp_path / "outside", d / "escape")
    (d / "sub").mkdir()
    pre = (str(d),)
    assert read_env_files({"A": str(d / "ok")}, pre, 64) == {"A": FILE_VALUE}
    for files, words in (({"A": str(d / "missing")}, "does not exist"), ({"A": str(d / "big")}, "over the 64-byte"),
                         ({"A": str(d / "bin")}, "not UTF-8"), ({"A": str(d / "nul")}, "NUL"),
                         ({"A": str(d / "escape")}, "outside the allowed prefixes"),
                         ({"A": str(d / "sub")}, "not a regular file"),
                         ({"A": str(tmp_path / "outside")}, "not under an allowed prefix"),
                         ({"A": str(d / ".." / "outside")}, "not an absolute, normal path"),
                         ({"A": "relative"}, "not an absolute"), ({"A=B": str(d / "ok")}, "bad variable name")):
        with pytest.raises(EnvFileError, match=words):
            read_env_files(files, pre, 64)
    with pytest.raises(EnvFileError, match="allows none"):
        read_env_files({"A": str(d / "ok")}, (), 64)


def _agent(tmp: Path, token_dir: Path, placer: str | None) -> Agent:
    c = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp / "agent"), listen="127.0.0.1:0",
                    data_listen=None, token_dir=str(token_dir), gpu_poll_interval_s=0.2, placer=placer,
                    heartbeat_s=0.2,
                    workloads=SupervisorConfig(shim_pool=1, env_files_prefixes=(str(tmp / "secrets"),)))
    return Agent(c, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)


async def test_env_values_redacted_and_secrets_from_host_files(tmp_path: Path, token_dir: Path):
    tokens = TokenSet.load(token_dir)
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "db").write_text(FILE_VALUE + "\n")
    # (argv is not secret and is shown: it names the values in two halves, never whole)
    check = ('test "$API_KEY" = "env-value-$(printf 7f3a9c)" && test "$DB_PASS" = "file-secret-$(printf 91bd42)"'
             ' && echo both-seen')
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            agent = _agent(tmp_path, token_dir, url)
            agent_url = await n.start(agent.run)
            op = httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10)
            viewer = httpx.AsyncClient(base_url=url, headers=auth_header(tokens.viewer), timeout=10)
            with trio.fail_after(20):
                await wait_for(lambda: _up(op))
            spec = JobSpec(job_id="sec", argv=["sh", "-c", check], env={"API_KEY": ENV_VALUE},
                           env_from_files={"DB_PASS": str(tmp_path / "secrets" / "db")})
            r = await op.post("/v1/jobs", content=msgspec.json.encode(spec))
            assert r.status_code == 201, r.text
            answers = [r.text]
            r = await op.get("/v1/jobs/sec?wait=succeeded&timeout_ms=20000")
            assert r.json()["state"] == "succeeded", r.json()
            for c in (op, viewer):
                for path in ("/v1/jobs", "/v1/jobs/sec", "/v1/jobs?state=succeeded"):
                    res = await c.get(path)
                    assert res.status_code == 200
                    answers.append(res.text)
            for text in answers:
                assert ENV_VALUE not in text and FILE_VALUE not in text
            one = msgspec.json.decode(answers[-1])["jobs"][0]["spec"]
            assert one["env"] == {"API_KEY": REDACTED}
            assert one["env_from_files"] == {"DB_PASS": str(tmp_path / "secrets" / "db")}  # names and paths only
            wid = "sec.1.0" if "sec.1.0" in agent.supervisor.records_view() else next(iter(agent.supervisor.records_view()))
            assert "both-seen" in agent.supervisor.read_log(wid)
            # the file's value is on no disk of the agent's (state, records, run.json)
            for p in (tmp_path / "agent").rglob("*"):
                if p.is_file() and not p.name.startswith("stdout") and not p.name.startswith("stderr"):
                    assert FILE_VALUE.encode() not in p.read_bytes(), p
            # the agent's own read API shows no env either
            async with httpx.AsyncClient(base_url=agent_url, headers=auth_header(tokens.viewer)) as ac:
                body = (await ac.get(f"/v1/workloads/{wid}")).text
                assert FILE_VALUE not in body
            # a file missing on the host: the pod fails and says which file
            (tmp_path / "secrets" / "db").unlink()
            r = await op.post("/v1/jobs", content=msgspec.json.encode(
                msgspec.structs.replace(spec, job_id="sec2")))
            assert r.status_code == 201
            r = await op.get("/v1/jobs/sec2?wait=failed&timeout_ms=20000")
            v = r.json()
            assert v["state"] == "failed" and "does not exist on this host" in (v["reason"] or ""), v
            await op.aclose()
            await viewer.aclose()
            n.cancel_scope.cancel()


async def _up(c: httpx.AsyncClient) -> bool:
    r = await c.get("/v1/nodes")
    return r.status_code == 200 and any(x["state"] == "up" for x in r.json()["nodes"])


async def test_an_agent_refuses_env_files_outside_its_prefixes(tmp_path: Path, token_dir: Path):
    tokens = TokenSet.load(token_dir)
    agent = _agent(tmp_path, token_dir, None)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.placer)) as c:
                st = (await c.get("/v1/status", headers=auth_header(tokens.viewer))).json()
                uuid = st["gpus"]["gpus"][0]["uuid"]
                p = Placement(placement_id="p", job_id="j", argv=["true"], env_from_files={"K": "/etc/shadow"},
                              pods=[PodAssignment(workload_id="j.1.0", rank=0, gpus=[uuid])])
                r = await c.post("/v1/placements", content=msgspec.json.encode(p))
                ack = msgspec.convert(r.json(), PlacementAck)
                assert r.status_code == 409 and ack.outcome == "refused_spec"
                assert "not under an allowed prefix" in (ack.reason or "")
            n.cancel_scope.cancel()
