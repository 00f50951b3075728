"""Two placer services on one etcd (skipped where ``etcd`` is absent): one leads and places, the
other answers /healthz with who leads and redirects writes to it; the leader deposed (its lease
revoked) stops with LeadershipLost, and the other leads with the jobs from etcd."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import msgspec
import trio

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig
from placer.errors import LeadershipLost
from placer.etcd import EtcdClient
from placer.fleetsnap import EtcdFleetSnapshot
from placer.service import PlacerService
from scheduler_link.messages import JobSpec, NodeReport
from testing.etcd import EtcdCluster
from testing.fake_agent import FakeAgent
from testing.harness import PlacerOptions, PlacerProc
from testing.waiting import poll

TTL = 2


def cfg(tmp: Path, name: str, endpoints: list[str]) -> PlacerConfig:
    return PlacerConfig(listen="127.0.0.1:0", state_dir=str(tmp / name), heartbeat_s=0.2, recover_s=0.4,
                        ack_timeout_s=1.0, tick_s=0.05, etcd=endpoints, etcd_lease_ttl_s=TTL)


async def health(c: httpx.AsyncClient, url: str) -> dict:
    r = await c.get(url + "/healthz")
    assert r.status_code == 200
    return r.json()["ha"]


async def until(pred, step: float = 0.05):  # noqa: ANN001, ANN201
    return await poll(pred, step)


class Placer:
    """A placer service in its own cancel scope, its end (an error or None) kept."""

    def __init__(self, svc: PlacerService) -> None:
        self.svc = svc
        self.error: BaseException | None = None
        self.done = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # noqa: ANN001
        try:
            async with trio.open_nursery() as n:
                task_status.started(await n.start(self.svc.run))
        except BaseExceptionGroup as eg:
            self.error = eg
        finally:
            self.done.set()


def only(eg: BaseException | None) -> BaseException | None:
    while isinstance(eg, BaseExceptionGroup) and len(eg.exceptions) == 1:
        eg = eg.exceptions[0]
    return eg


async def test_one_leads_the_other_redirects_then_takes_over(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                             token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(60):
        async with trio.open_nursery() as n, ops, EtcdClient(etcd_cluster.endpoints) as etcd:
            a = Placer(PlacerService(cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            ha = await until(lambda: _role(ops, url_a, "leader"))
            b = Placer(PlacerService(cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            hb = await until(lambda: _role(ops, url_b, "follower"))
            assert hb["leader"] == url_a and hb["epoch"] == ha["epoch"]
            st = (await ops.get(url_b + "/v1/status")).json()["ha"]
            assert (st["role"], st["leader"]) == ("follower", url_a)
            # the leader places: two agents report to it, a job runs
            for i in range(2):
                await n.start(FakeAgent(f"n{i}", tokens, rack="r0").run, url_a)
            r = await ops.post(url_a + "/v1/jobs", content=msgspec.json.encode(
                JobSpec(job_id="j1", pods=2, gpus_per_pod=8, argv=["sleep", "100"])))
            assert r.status_code == 201, r.text
            assert (await etcd.get(b"/herd/placer/jobs/j1")) is not None   # committed before the 201
            r = await ops.get(url_a + "/v1/jobs/j1?wait=running&timeout_ms=10000")
            assert r.json()["state"] == "running"
            # the follower places nothing and sends writes (and reads of state) to the leader
            r = await ops.post(url_b + "/v1/jobs?x=1", content=msgspec.json.encode(JobSpec(job_id="j2", argv=["x"])))
            assert r.status_code == 307 and r.headers["location"] == url_a + "/v1/jobs?x=1"
            assert r.json()["leader"] == url_a
            assert (await ops.get(url_b + "/v1/jobs/j1")).status_code == 307
            assert b.svc.state.jobs == {} and b.svc.journal is None
            # a report reaching a follower another way (the framed channel) goes into its warm
            # model (placer.observe), answered with nothing to act on
            status, reply = b.svc._ingest("n7", NodeReport(node_id="n7", boot_id="b", seq=1))
            assert status == 202 and reply.ok and not reply.stop and "n7" in b.svc.state.nodes
            # the leader keeps its up nodes in etcd (placer.fleetsnap.EtcdFleetSnapshot)
            store = EtcdFleetSnapshot(etcd, b"/herd/placer/", None)

            async def stored() -> bool:
                snap = await store.load()
                return snap is not None and sorted(snap.nodes) == ["n0", "n1"]
            await until(stored)
            # the leader's lease revoked behind its back: it stops, b leads with j1 from etcd
            await etcd.revoke(a.svc.ha.election.core.lease_id)   # type: ignore[union-attr]
            with trio.fail_after(TTL + 4):
                await a.done.wait()
            assert isinstance(only(a.error), LeadershipLost)
            with trio.fail_after(TTL + 4):
                hb = await until(lambda: _role(ops, url_b, "leader"))
            assert hb["epoch"] > ha["epoch"] and hb["leader"] == url_b
            r = await ops.get(url_b + "/v1/jobs/j1")
            assert r.status_code == 200 and r.json()["spec"]["pods"] == 2
            # and b waits for exactly the nodes a had up (they report to a only here): j1, whose
            # pods are on them, is not placed a second time meanwhile
            await until(lambda: b.svc.recovery is not None and not b.svc.recovery.pending)
            assert b.svc.recovery is not None and (b.svc.recovery.expected, b.svc.recovery.unheard) == (2, 2)
            assert b.svc.state.jobs["j1"].recovering
            n.cancel_scope.cancel()


async def _role_or_none(c: httpx.AsyncClient, url: str, role: str) -> dict | None:
    """As :func:`_role`, None while the placer does not answer (it is starting again)."""
    try:
        return await _role(c, url, role)
    except (httpx.HTTPError, AssertionError):
        return None


async def _role(c: httpx.AsyncClient, url: str, role: str) -> dict | None:
    h = await health(c, url)
    return h if h["role"] == role else None


def ha_opts(endpoints: list[str]) -> PlacerOptions:
    return PlacerOptions(heartbeat_s=0.5, tick_s=0.05, recover_s=0.5,
                         extra_toml=f"etcd = {json.dumps(endpoints)}\netcd_lease_ttl_s = {TTL}\n")


async def test_processes_leader_killed_then_paused(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                   token_dir: Path) -> None:
    """``herd placer run`` x3: the leader SIGKILLed, the next leads within TTL + margin with the
    job from etcd; that one SIGSTOPped past its TTL, the third leads, and the paused one,
    continued, serves again on its address as a follower (a submit it held is redirected, never
    journaled) instead of acting as a leader."""
    tokens = TokenSet.load(token_dir)
    opts = ha_opts(etcd_cluster.endpoints)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(120):
        async with ops, trio.open_nursery() as n, EtcdClient(etcd_cluster.endpoints) as etcd, \
                PlacerProc(tmp_path / "a", token_dir, opts) as a:
            ha = await until(lambda: _role(ops, a.url, "leader"))
            async with PlacerProc(tmp_path / "b", token_dir, opts) as b:
                await until(lambda: _role(ops, b.url, "follower"))
                r = await ops.post(a.url + "/v1/jobs", content=msgspec.json.encode(
                    JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["x"])))
                assert r.status_code == 201, r.text
                assert a.proc is not None and b.proc is not None
                a.proc.kill()
                killed_at = trio.current_time()
                with trio.fail_after(TTL + 4):
                    hb = await until(lambda: _role(ops, b.url, "leader"))
                took_s = trio.current_time() - killed_at
                assert hb["epoch"] > ha["epoch"] and took_s <= TTL + 4
                r = await ops.get(b.url + "/v1/jobs/j1")
                assert r.status_code == 200 and r.json()["spec"]["job_id"] == "j1"
                async with PlacerProc(tmp_path / "c", token_dir, opts) as c:
                    await until(lambda: _role(ops, c.url, "follower"))
                    b.proc.send_signal(signal.SIGSTOP)
                    with trio.fail_after(TTL + 6):
                        hc = await until(lambda: _role(ops, c.url, "leader"))
                    assert hc["epoch"] > hb["epoch"]
                    # a submit sent to the paused leader waits in its socket; continued, it no
                    # longer leads: the submit goes to c (307), nothing of it reaches etcd
                    late: list[httpx.Response] = []
                    answered = trio.Event()

                    async def submit_late() -> None:
                        late.append(await ops.post(b.url + "/v1/jobs", content=msgspec.json.encode(
                            JobSpec(job_id="late", pods=1, gpus_per_pod=8, argv=["x"]))))
                        answered.set()

                    n.start_soon(submit_late)
                    await trio.sleep(0.3)
                    b.proc.send_signal(signal.SIGCONT)
                    with trio.fail_after(TTL + 8):   # b serves again, on its address, as a follower of c
                        hb2 = await until(lambda: _role_or_none(ops, b.url, "follower"))
                    assert hb2["leader"] == c.url and hb2["epoch"] == hc["epoch"] and b.proc.poll() is None
                    with trio.fail_after(10):
                        await answered.wait()
                    assert late[0].status_code in (307, 503), late[0].text
                    assert (await etcd.get(b"/herd/placer/jobs/late")) is None
                    log_b = (tmp_path / "b" / "placer.log").read_text()
                    assert "lost the leadership" in log_b and "serving again as a follower" in log_b
                    assert (await health(ops, c.url))["role"] == "leader"
