"""Origins are allow-listed (issue 16): a placement or prefetch naming an origin outside
``agent.allowed_origins`` is refused with a clear reason, before anything is fetched."""

from __future__ import annotations

import os

import httpx
import msgspec
import pytest
import trio

from agent.config import AgentConfig, ConfigError, load_config
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra.auth import TokenSet, auth_header
from p2p.origins import origin_refusal
from scheduler_link.messages import Placement, PlacementAck, PodAssignment, PrefetchRequest

MID = "ab" * 32


@pytest.mark.parametrize("url, allowed, ok", [
    ("gs://artifacts/herd", ["gs://artifacts/herd"], True),
    ("gs://artifacts/herd/team", ["gs://artifacts/herd"], True),
    ("gs://artifacts/herd/", ["gs://artifacts/herd"], True),
    ("GS://Artifacts/herd", ["gs://artifacts/herd"], True),
    ("gs://artifacts/herd-other", ["gs://artifacts/herd"], False),
    ("gs://artifacts", ["gs://artifacts/herd"], False),
    ("gs://someone-elses-bucket/x", ["gs://artifacts/herd"], False),
    ("gs://artifacts/herd/../secrets", ["gs://artifacts/herd"], False),
    ("gs://artifacts/herd/%2e%2e/secrets", ["gs://artifacts/herd"], False),
    ("https://mirror.example/herd/a", ["https://mirror.example/herd"], True),
    ("http://mirror.example/herd/a", ["https://mirror.example/herd"], False),
    ("https://mirror.example:8443/herd", ["https://mirror.example/herd"], False),
    ("https://user:pw@mirror.example/herd", ["https://mirror.example/herd"], False),
    ("https://mirror.example/herd?x=1", ["https://mirror.example/herd"], False),
    ("http://169.254.169.254/computeMetadata/v1", ["https://mirror.example/herd"], False),
    ("file:///srv/origin", ["file:///srv/origin"], True),
    ("/srv/origin/sub", ["file:///srv/origin"], True),
    ("file://localhost/srv/origin", ["file:///srv/origin"], True),
    ("file:///etc", ["file:///srv/origin"], False),
    ("file:///srv/origin\n", ["file:///srv/origin"], False),
    ("", ["file:///srv/origin"], False),
    ("gs://anything/at/all", None, True),        # no allow-list configured
    ("gs://x/../y", None, False),                # ... but malformed is refused anyway
    ("gs://anything", [], False),                # an empty list allows nothing
])
def test_origin_refusal(url: str, allowed: list[str] | None, ok: bool) -> None:
    why = origin_refusal(url, allowed)
    assert (why is None) == ok, why


def test_config_takes_and_checks_allowed_origins(tmp_path) -> None:
    f = tmp_path / "agent.toml"
    f.write_text('[agent]\nallowed_origins = ["gs://b/herd", "file:///srv/o"]\n')
    assert load_config(f).allowed_origins == ("gs://b/herd", "file:///srv/o")
    f.write_text('[agent]\nallowed_origins = ["gs://b/../x"]\n')
    with pytest.raises(ConfigError, match="allowed_origins"):
        load_config(f)
    assert load_config(None).allowed_origins == ()  # the default: none allowed


async def test_agent_refuses_a_placement_or_prefetch_from_a_disallowed_origin(tmp_path, token_dir) -> None:
    tokens = TokenSet.load(token_dir)
    cfg = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                      listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir), gpu_poll_interval_s=0.2,
                      workloads=SupervisorConfig(shim_pool=0), allowed_origins=(f"file://{tmp_path}/origin",))
    agent = Agent(cfg, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)
    pl = auth_header(tokens.placer)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            async with httpx.AsyncClient(base_url=url, headers=pl) as c:
                uuids = [g.uuid for g in agent.gpu_snapshot().gpus]
                for bad in ("gs://someone-elses-bucket/prefix", "http://169.254.169.254/computeMetadata",
                            f"file://{tmp_path}/origin/../../etc", f"file://{tmp_path}/origin-evil"):
                    p = Placement(placement_id=f"p-{len(bad)}", job_id="j", argv=["true"], manifest_id=MID,
                                  origin=bad, pods=[PodAssignment(workload_id=f"w-{len(bad)}", rank=0,
                                                                  gpus=uuids[:1])])
                    r = await c.post("/v1/placements", content=msgspec.json.encode(p))
                    assert r.status_code == 409, (bad, r.text)
                    ack = msgspec.json.decode(r.content, type=PlacementAck)
                    assert not ack.accepted and ack.outcome == "refused_spec"
                    assert "origin" in (ack.reason or "")
                    pr = PrefetchRequest(manifest_id=MID, origin=bad)
                    r = await c.post("/v1/prefetch", content=msgspec.json.encode(pr))
                    assert r.status_code == 403 and r.json()["error"] == "origin not allowed"
                assert agent.supervisor.workloads() == []
                # an allowed origin is accepted (the fetch then fails: nothing is published there)
                p = Placement(placement_id="p-ok", job_id="j", argv=["true"], manifest_id=MID,
                              origin=f"file://{tmp_path}/origin/team",
                              pods=[PodAssignment(workload_id="w-ok", rank=0, gpus=uuids[:1])])
                r = await c.post("/v1/placements", content=msgspec.json.encode(p))
                assert r.status_code == 200 and r.json()["accepted"] is True
            n.cancel_scope.cancel()
