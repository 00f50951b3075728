"""A follower's warm model (placer.observe) on a real etcd (skipped where ``etcd`` is absent):
what the fleet sends a follower is applied to its model and acted on never -- no stop, no
placement, no key, no relay named, jobs left to the leader -- and, promoted, it adopts the
running gang from what it heard (the agents' workloads are the truth) and places again without
waiting for the fleet to register anew."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import trio

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig
from placer.etcd import EtcdClient
from placer.service import PlacerService
from scheduler_link.follow import OBSERVED
from scheduler_link.messages import JobSpec, NodeReport, RackBeat
from testing.etcd import EtcdCluster
from testing.fake_agent import FakeAgent

from .test_etcd_placer import Placer, _role, cfg, until


def _full(agent: FakeAgent) -> NodeReport:
    """The agent's full report as its link would send it now (its boot, its current sequence)."""
    assert agent.link is not None
    return msgspec.structs.replace(agent.full_report(), node_id=agent.node_id, boot_id=agent.link.boot_id,
                                   seq=agent.link.seq)


async def test_follower_observes_then_adopts_the_running_gang(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                              token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(60):
        async with trio.open_nursery() as n, ops, EtcdClient(etcd_cluster.endpoints) as etcd:
            a = Placer(PlacerService(cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            await until(lambda: _role(ops, url_a, "leader"))
            b = Placer(PlacerService(cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            hb = await until(lambda: _role(ops, url_b, "follower"))
            assert hb["observing"] and hb["wire"] is None   # (no framed channel configured here)
            agents = [FakeAgent(f"n{i}", tokens, rack="r0") for i in range(2)]
            for ag in agents:
                await n.start(ag.run, url_a)
            r = await ops.post(url_a + "/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="j1", pods=2, gpus_per_pod=8, argv=["sleep", "100"])))
            assert r.status_code == 201, r.text
            r = await ops.get(url_a + "/v1/jobs/j1?wait=running&timeout_ms=10000")
            assert r.json()["state"] == "running"
            placed = sum(len(ag.placements) for ag in agents)
            # the fleet's reports reach the follower too: applied to its model, nothing to act on
            for ag in agents:
                status, reply = b.svc._ingest(ag.node_id, _full(ag))
                assert status == OBSERVED, reply
                assert reply.ok and not reply.stop and reply.mac_key is None and reply.relay_url is None
                assert reply.epoch == 0 and reply.placer_key is None
            st = b.svc.state
            assert sorted(st.nodes) == ["n0", "n1"] and st.jobs == {} and b.svc.journal is None
            assert all(len(st.nodes[ag.node_id].stale) == 1 for ag in agents)   # held, never adopted ...
            # ... and never stopped: a beat answers nothing but the full reports it lacks
            ag0 = agents[0]
            assert ag0.link is not None
            beat = RackBeat(rack="r0", node_ids=["n0", "n9"], boot_ids=[ag0.link.boot_id, "x"],
                            seqs=[ag0.link.seq + 1, 1], macs=[b"", b"\0" * 16])
            br = b.svc.apply_beat(beat, b.svc.clock(), via="n0", answered=None)
            assert br.need_full == [] and br.stop == []      # (n9's entry carries no valid MAC: dropped)
            assert st.nodes["n0"].last_seq == ag0.link.seq + 1
            assert sum(len(ag.placements) for ag in agents) == placed
            # promoted (the leader's lease revoked): the gang is adopted from the warm model, not
            # placed again, and the follower places at once without the fleet registering anew
            full_before = sum(ag.link.full_reports_sent for ag in agents if ag.link is not None)
            await etcd.revoke(a.svc.ha.election.core.lease_id)   # type: ignore[union-attr]
            with trio.fail_after(10):
                await until(lambda: _role(ops, url_b, "leader"))
            j1 = st.jobs["j1"]
            assert j1.n_pods == 2 and all(not nd.stale for nd in st.nodes.values())
            await until(lambda: b.svc.recovery is None)
            assert j1.state == "running" and not j1.recovering
            # each step of the promotion stamped once, in order (the leader's key was the one it
            # waited behind: it leads on the deletion, without reading the keys again)
            steps = b.svc.ha.promotion.at   # type: ignore[union-attr]
            assert list(steps) == ["joined", "predecessor_gone", "elected", "journal_read", "model_adopted", "placing"]
            assert sorted(steps.values()) == list(steps.values())
            assert (await ops.get(url_b + "/healthz")).json()["ha"]["promotion"]["placing"] == round(steps["placing"], 3)
            assert b.svc.ha.election.view.leader == url_b   # type: ignore[union-attr]
            assert b.svc.ha.fleet_read   # type: ignore[union-attr]   # (the fleet snapshot read beside the journal)
            r = await ops.post(url_b + "/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="probe", pods=1, gpus_per_pod=8, argv=["x"])))
            assert r.status_code == 201, r.text
            pj = st.jobs["probe"]
            assert pj.state == "pending" and pj.reason is None   # every GPU is the gang's: nothing to take
            assert sum(len(ag.placements) for ag in agents) == placed
            assert full_before == sum(ag.link.full_reports_sent for ag in agents if ag.link is not None)
            n.cancel_scope.cancel()


def wired(tmp: Path, name: str, endpoints: list[str]) -> PlacerConfig:
    return msgspec.structs.replace(cfg(tmp, name, endpoints), wire_listen="127.0.0.1:0")


async def test_agents_copy_their_reports_and_move_without_registering_again(
        etcd_cluster: EtcdCluster, tmp_path: Path, token_dir: Path) -> None:
    """Agents told both placers report to the leader and copy every report to the follower over
    a framed connection of their own; the leader deposed, each moves to the new leader over that
    connection with its next heartbeat: no full report, the gang adopted, nothing placed twice."""
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(180):
        async with trio.open_nursery() as n, ops, EtcdClient(etcd_cluster.endpoints) as etcd:
            a = Placer(PlacerService(wired(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            await until(lambda: _role(ops, url_a, "leader"))
            b = Placer(PlacerService(wired(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            hb = await until(lambda: _role(ops, url_b, "follower"))
            assert hb["wire"] == b.svc.wire_url
            agents = [FakeAgent(f"n{i}", tokens, rack="r0") for i in range(2)]
            for ag in agents:
                await n.start(ag.run, f"{url_a},{url_b}")
                assert ag.link is not None
                ag.link.full_every = 0   # (no periodic full report: what the follower holds came as events)
            st = b.svc.state
            # the follower learns the nodes before the gang exists: its pods come to it as events
            # (a node's sequence there trails its own by the heartbeats not copied yet: an empty
            # one goes every other interval, and under load the next is built before it lands)
            await until(lambda: all(ag.node_id in st.nodes and st.nodes[ag.node_id].last_seq > 0 for ag in agents))
            r = await ops.post(url_a + "/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="j1", pods=2, gpus_per_pod=8, argv=["sleep", "100"])))
            assert r.status_code == 201, r.text
            r = await ops.get(url_a + "/v1/jobs/j1?wait=running&timeout_ms=10000")
            assert r.json()["state"] == "running"

            seen = {ag.node_id: ag.link.seq for ag in agents if ag.link is not None}   # (the pods' events among them)

            async def copied() -> bool:   # the follower's model: both nodes, at least where the gang ran
                return all(st.nodes[n].last_seq >= seq and st.nodes[n].stale for n, seq in seen.items())
            with trio.fail_after(30):   # (copies start 1-4 intervals after registering; a loaded host is slower)
                await until(copied)
            assert len(seen) == 2
            assert st.jobs == {} and b.svc.journal is None
            placed = sum(len(ag.placements) for ag in agents)
            links = [ag.link for ag in agents if ag.link is not None]
            full_before = sum(lk.full_reports_sent for lk in links)
            assert all(lk.placer_url == url_a for lk in links)
            await etcd.revoke(a.svc.ha.election.core.lease_id)   # type: ignore[union-attr]
            with trio.fail_after(30):
                await until(lambda: _role(ops, url_b, "leader"))
            await until(lambda: b.svc.recovery is None)
            assert st.jobs["j1"].state == "running" and st.jobs["j1"].n_pods == 2

            async def moved() -> bool:
                return all(lk.placer_url == url_b and lk.registered for lk in links)
            await until(moved)
            now = {lk.node_id: lk.seq for lk in links}   # (reports from here on go to b alone)
            await until(lambda: all(st.nodes[n].last_seq >= seq and not st.nodes[n].stale for n, seq in now.items()))
            assert sum(lk.full_reports_sent for lk in links) == full_before, [(lk.full_reports_sent, lk.conflicts, lk.statistics()["follower_copies"]) for lk in links]
            stats = [lk.statistics()["follower_copies"] for lk in links]
            assert all(s is not None and s["handovers"] == 1 for s in stats), stats
            assert sum(len(ag.placements) for ag in agents) == placed
            assert all(w.state == "running" for ag in agents for w in ag.workloads.values())
            n.cancel_scope.cancel()
