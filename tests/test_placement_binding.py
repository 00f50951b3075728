"""Placements are bound to their node and attempt and expire (issue 17): a real agent's HTTP
API refuses a placement for another node, one past its expiry and one replaying an attempt
it has seen superseded -- each with a clear reason and a structured outcome, nothing placed --
while the same accepted placement sent again is answered the same (idempotent)."""

from __future__ import annotations

import time

import httpx
import msgspec
import trio

from agent.placement import attempt_of, check_binding, replayed
from agent.state import WorkloadRecord
from infra.auth import TokenSet, auth_header
from scheduler_link.messages import Placement, PlacementAck, PodAssignment, Victim
from tests.test_agent_api import make_agent


def _p(pid: str, job: str, attempt: int, gpus: list[str], **kw: object) -> Placement:
    return Placement(placement_id=pid, job_id=job, argv=["sleep", "30"], grace_s=1, attempt=attempt,
                     pods=[PodAssignment(workload_id=f"{job}.{attempt}.0", rank=0, gpus=gpus)], **kw)  # type: ignore[arg-type]


def test_binding_rules_are_plain_functions() -> None:
    assert attempt_of("job-a.3.7", "job-a") == 3 and attempt_of("w1", "job-a") is None
    assert attempt_of("job-a.x.7", "job-a") is None
    recs = {"j.2.0": WorkloadRecord(workload_id="j.2.0", job_id="j", placement_id="start:j:2:n1")}
    assert replayed("j", 1, "start:j:1:n1", recs) is not None
    assert replayed("j", 2, "start:j:2:n1", recs) is None         # the same placement: idempotent
    assert replayed("j", 2, "other", recs) is not None
    assert replayed("j", 3, "start:j:3:n1", recs) is None         # a newer attempt is news
    assert replayed("k", 1, "start:k:1:n1", recs) is None
    now = 100.0
    assert check_binding(_p("a", "j", 3, [], node_id="n2"), node_id="n1", now=now, records={}).outcome == "refused_spec"
    assert check_binding(_p("a", "j", 3, [], expires_at=99.0), node_id="n1", now=now, records={}).outcome == "expired"
    assert check_binding(_p("a", "j", 3, [], node_id="n1", expires_at=101.0), node_id="n1", now=now,
                         records={}) is None
    assert check_binding(Placement(placement_id="a", job_id="j"), node_id="n1", now=now, records={}) is None


async def test_an_agent_refuses_placements_for_another_node_expired_or_replayed(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    agent = make_agent(tmp_path, token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(agent.run)
            async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.placer)) as c:
                viewer = auth_header(tokens.viewer)
                uuids = [g["uuid"] for g in (await c.get("/v1/status", headers=viewer)).json()["gpus"]["gpus"]]

                async def post(p: Placement) -> tuple[int, PlacementAck]:
                    r = await c.post("/v1/placements", content=msgspec.json.encode(p))
                    return r.status_code, msgspec.convert(r.json(), PlacementAck)

                soon = time.time() + 30
                refused = [
                    (_p("start:j:2:n2", "j", 2, uuids[:1], node_id="n2", expires_at=soon), "refused_spec",
                     "bound to node 'n2', not 'n1'"),
                    (_p("start:j:2:n1", "j", 2, uuids[:1], node_id="n1", expires_at=time.time() - 1), "expired",
                     "expired"),
                ]
                for p, outcome, words in refused:
                    st, ack = await post(p)
                    assert (st, ack.accepted, ack.outcome) == (409, False, outcome) and words in (ack.reason or "")
                assert (await c.get("/v1/workloads", headers=viewer)).json() == []
                # attempt 2 accepted, bound and unexpired
                good = _p("start:j:2:n1", "j", 2, uuids[:1], node_id="n1", expires_at=soon)
                st, ack = await post(good)
                assert st == 200 and ack.accepted and ack.workloads == ["j.2.0"]
                # replays: an older attempt, and the same attempt under another placement id
                for p in (_p("start:j:1:n1", "j", 1, uuids[1:2], node_id="n1", expires_at=soon),
                          _p("forged", "j", 2, uuids[2:3], node_id="n1", expires_at=soon)):
                    st, ack = await post(p)
                    assert (st, ack.outcome) == (409, "expired") and "a replay" in (ack.reason or ""), ack
                # the accepted placement again, even past its expiry: the same answer, nothing new
                st, again = await post(msgspec.structs.replace(good, expires_at=time.time() - 5))
                assert st == 200 and again.accepted and again.workloads == ["j.2.0"]
                assert [w["workload_id"] for w in (await c.get("/v1/workloads", headers=viewer)).json()] == ["j.2.0"]
                # an unbound placement (an operator's direct one) is still taken
                st, ack = await post(Placement(placement_id="op-1", job_id="op", argv=["true"],
                                               pods=[PodAssignment(workload_id="op-w", rank=0, gpus=uuids[3:4])]))
                assert st == 200 and ack.accepted
            n.cancel_scope.cancel()


def test_a_late_stop_placement_is_still_taken() -> None:
    late = Placement(placement_id="stop:j:1:n1:1", job_id="j", node_id="n1", attempt=1, expires_at=1.0,
                     victims=[Victim(workload_id="j.1.0")])
    assert check_binding(late, node_id="n1", now=100.0, records={}) is None
    assert check_binding(late, node_id="n2", now=100.0, records={}) is not None  # still bound to its node
