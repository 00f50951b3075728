"""A leader acts only while its lease is known to hold at the moment of acting (skipped where
``etcd`` is absent): a placer whose renewal thread stopped and whose event loop was then stalled
past the TTL sends nothing when it wakes, before any task could have told it the lease ran out,
and applies no relay's beat."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import trio

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig
from placer.records import Push
from placer.service import PlacerService
from scheduler_link.messages import Placement, RackBeat, RackBeatReply
from testing.etcd import EtcdCluster
from testing.fake_agent import FakeAgent
from testing.waiting import poll

TTL = 2


def _stop_push(agent: FakeAgent, placement_id: str) -> Push:
    return Push(agent.node_id, agent.url, Placement(placement_id=placement_id, job_id="j"), "j", 1, "stop")


async def test_a_stalled_leader_whose_lease_ran_out_pushes_nothing(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                                  token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    cfg = PlacerConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "a"), heartbeat_s=0.2, recover_s=0.4,
                       ack_timeout_s=1.0, tick_s=0.05, etcd=etcd_cluster.endpoints, etcd_lease_ttl_s=TTL)
    svc = PlacerService(cfg, tokens)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10)

    async def leads() -> bool:
        return bool((await ops.get(f"{svc.url}/healthz")).json()["ha"]["placing"])

    with trio.fail_after(60):
        async with ops, trio.open_nursery() as n:
            await n.start(svc.run)
            await poll(leads, 0.05)
            agent = FakeAgent("n0", tokens, rack="r0")
            await n.start(agent.run, svc.url)
            await poll(lambda: "n0" in svc.state.nodes, 0.05)
            node = svc.state.nodes["n0"]
            seq = node.last_seq
            svc.apply_beat(RackBeat(rack="r0", node_ids=["n0"], boot_ids=[node.boot_id], seqs=[seq + 500],
                                    macs=[b""]), time.time(), via="n0", answered=None)
            assert node.last_seq == seq + 500                              # leading: a beat is applied
            assert (await svc._push_one(_stop_push(agent, "p1"))).ok      # leading: it goes out
            assert svc.ha is not None and svc.ha.election is not None and svc.ha.election.renewer is not None
            svc.ha.election.renewer.stop()
            time.sleep(TTL + 0.5)  # noqa: ASYNC251 (the loop stalled on purpose: no task runs meanwhile)
            out = await svc._push_one(_stop_push(agent, "p2"))
            assert out.outcome == "unreachable" and not svc.ha.leading()
            assert [p.placement_id for p in agent.placements] == ["p1"]
            # a relay's beat for the node, taken while leading, is applied no more
            node = svc.state.nodes["n0"]
            seq, boot = node.last_seq, node.boot_id
            reply = svc.apply_beat(RackBeat(rack="r0", node_ids=["n0"], boot_ids=[boot], seqs=[seq + 1000],
                                            macs=[b""]), time.time(), via="n0", answered=None)
            assert reply == RackBeatReply() and node.last_seq == seq
            n.cancel_scope.cancel()
