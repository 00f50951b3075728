"""A submit resent with the same job id and spec is answered as the original was (201, the
job's view), not refused: a client whose answer was lost (its placer died after committing
the job, or stopped leading) sends it again, to the same placer or to the next leader, which
read the job from the journal. A different spec under a taken id is still a 409."""

from __future__ import annotations

import httpx
import msgspec
import trio

from infra.auth import TokenSet, auth_header
from placer.service import PlacerService
from scheduler_link.messages import JobSpec

from .test_placer_service import cfg


async def test_identical_resubmit_is_answered_as_the_original(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    spec = JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["sleep", "100"])
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10) as c:
                first = await c.post("/v1/jobs", content=msgspec.json.encode(spec))
                assert first.status_code == 201, first.text
                again = await c.post("/v1/jobs", content=msgspec.json.encode(spec))
                assert again.status_code == 201, again.text
                assert again.json()["job_id"] == "j1" and again.json()["spec"] == first.json()["spec"]
                assert len(svc.state.jobs) == 1
                other = msgspec.structs.replace(spec, pods=2)
                clash = await c.post("/v1/jobs", content=msgspec.json.encode(other))
                assert clash.status_code == 409 and "already exists" in clash.text
            n.cancel_scope.cancel()
    # the job came back from the journal (as a promoted leader reads it): resent, it is the same answer
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path), tokens)
            url = await n.start(svc.run)
            assert svc.state.jobs["j1"].recovering
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.operator), timeout=10) as c:
                again = await c.post("/v1/jobs", content=msgspec.json.encode(spec))
                assert again.status_code == 201, again.text
                assert again.json()["job_id"] == "j1"
                clash = await c.post("/v1/jobs", content=msgspec.json.encode(msgspec.structs.replace(spec, priority=3)))
                assert clash.status_code == 409
            n.cancel_scope.cancel()
