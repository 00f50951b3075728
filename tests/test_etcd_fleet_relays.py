"""An emulated fleet in relay mode (testing.fleet: each rack's relay the shipped agent.relay.Relay,
its host's link the shipped AgentLink) under two placers on a real etcd (skipped where ``etcd``
is absent): the relays copy every beat and report batch to the follower (agent.relaycopies,
opened for the host's own copies), so the follower's warm model holds every node; the leader
gone, the relays go up to the promoted follower over their copy connections and the fleet
goes on there with no full report, no re-registration, and the running gang kept."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import trio

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig
from placer.service import PlacerService
from scheduler_link.messages import JobSpec
from testing.etcd import EtcdCluster
from testing.fleet import Fleet, FleetConfig, Timing
from testing.waiting import poll

from .test_etcd_placer import TTL, health

RACKS = 2
NODES = 32 * RACKS   # (h100 racks of 32)
HB = 0.3


def _cfg(tmp: Path, name: str, endpoints: list[str]) -> PlacerConfig:
    return PlacerConfig(listen="127.0.0.1:0", wire_listen="127.0.0.1:0", state_dir=str(tmp / name), heartbeat_s=HB,
                        recover_s=2.0, fence_after_s=60.0, ack_timeout_s=5.0, tick_s=0.05, relays=True,
                        etcd=endpoints, etcd_lease_ttl_s=TTL)


class Placer:
    """A placer service in a cancel scope of its own (``stop()``: gone, as a killed process's
    connections are)."""

    def __init__(self, svc: PlacerService) -> None:
        self.svc = svc
        self.scope = trio.CancelScope()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # noqa: ANN001
        with self.scope:
            async with trio.open_nursery() as n:
                task_status.started(await n.start(self.svc.run))


async def test_a_relayed_fleet_moves_to_the_promoted_follower_with_no_full_report(
        etcd_cluster: EtcdCluster, tmp_path: Path, token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(60):
        async with ops, trio.open_nursery() as n:
            a = Placer(PlacerService(_cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            ha = await poll(lambda: _role(ops, url_a, "leader"), 0.05)
            b = Placer(PlacerService(_cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            await poll(lambda: _role(ops, url_b, "follower"), 0.05)
            # (the follower listed first: the hosts find the leader as an agent does, by its 307)
            fleet = Fleet(FleetConfig(placer_url=f"{url_b},{url_a}", nodes=NODES, wire_url=ha["wire"], mux=1,
                                      heartbeat_s=HB, relays=True, request_timeout_s=5.0,
                                      timing=Timing(fetch_s=0.01, run_s=0.01, stop_s=0.01)), tokens)
            await n.start(fleet.run)
            fleet.go()
            await poll(lambda: _up(a, NODES), 0.05)
            r = await ops.post(url_a + "/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="gang", pods=NODES, gpus_per_pod=8, argv=["train"], grace_s=1.0)))
            assert r.status_code == 201, r.text
            r = await ops.get(url_a + "/v1/jobs/gang?wait=running&timeout_ms=20000&pods=0:0")
            assert r.json()["state"] == "running", r.text
            # warm: every relay copies to b (opened for its host's own copies), b holds every node
            await poll(lambda: all(k.relay.copies.conns for k in fleet.racks), 0.05)
            await poll(lambda: _running_in(b, NODES), 0.05)
            before = fleet.statistics("gang")
            assert before["relay_copies"]["connections"] == RACKS and before["relay_copies"]["frames"] > 0
            # the leader goes (its connections with it): b leads, every relay goes up to it over
            # its copy connection, and every node is up there with no full report sent
            a.scope.cancel()
            hb = await poll(lambda: _role(ops, url_b, "leader"), 0.05)
            assert hb["epoch"] > ha["epoch"]
            await poll(lambda: all(k.relay.upstream is not None and k.link is not None
                                   and k.link.placer_url == url_b for k in fleet.racks), 0.05)
            await poll(lambda: _up(b, NODES) and not b.svc.state.jobs["gang"].recovering, 0.05)
            await trio.sleep(3 * HB)   # (beats and heartbeats go on there: still none)
            after = fleet.statistics("gang")
            assert after["full_reports"] == before["full_reports"], (before, after)
            assert after["reregistrations"] == before["reregistrations"]
            assert after["relay_connects"] == before["relay_connects"] + RACKS   # (the copy connections, taken)
            assert after["handovers"] >= RACKS   # each host's link: onto its copy channel, no full report
            assert after["victims_told"] == 0 and after["job"]["states"] == {"running": NODES}
            assert b.svc.state.jobs["gang"].state == "running" and _up(b, NODES)
            n.cancel_scope.cancel()


async def _role(c: httpx.AsyncClient, url: str, role: str) -> dict | None:
    h = await health(c, url)
    return h if h["role"] == role else None


def _up(p: Placer, n: int) -> bool:
    return sum(1 for x in p.svc.state.nodes.values() if x.state == "up") == n


def _running_in(p: Placer, n: int) -> bool:
    """The follower holds the gang's ``n`` pods as running workloads (stale: it holds no jobs)."""
    return sum(1 for x in p.svc.state.nodes.values() for st in x.workloads.values() if st == "running") == n
