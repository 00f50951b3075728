"""Two placers on one etcd (skipped where ``etcd`` is absent): ``herd placer status`` says who
leads, the epoch and each placer's role; ``/metrics`` has herd_placer_leader, _epoch,
_failovers_total and _etcd_errors_total; the CLI's client, given a dead address and a follower,
reaches the leader by itself."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio

from cli.main import main
from infra.auth import TokenSet, auth_header
from placer.service import PlacerService
from scheduler_link.client import PlacerClient
from scheduler_link.messages import JobSpec
from testing.etcd import EtcdCluster, free_port
from tests.prom import value

from .test_etcd_placer import Placer, _role, cfg, until


async def test_status_metrics_and_client_failover(etcd_cluster: EtcdCluster, tmp_path: Path, token_dir: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    dead = f"http://127.0.0.1:{free_port()}"
    with trio.fail_after(60):
        async with trio.open_nursery() as n, ops:
            a = Placer(PlacerService(cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            ha = await until(lambda: _role(ops, url_a, "leader"))
            b = Placer(PlacerService(cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            await until(lambda: _role(ops, url_b, "follower"))

            def status() -> int:
                return main(["placer", "status", "--placer", f"{url_b},{dead}", "--placer", url_a,
                             "--token-dir", str(token_dir), "--json"])

            capsys.readouterr()
            rc = await trio.to_thread.run_sync(status)
            out = json.loads(capsys.readouterr().out)
            assert rc == 0 and out["leader"] == url_a and out["epoch"] == ha["epoch"]
            roles = {p["url"]: p["role"] for p in out["placers"]}
            assert roles == {url_a: "leader", url_b: "follower", dead: "unreachable"}

            ma = (await ops.get(url_a + "/metrics")).text
            mb = (await ops.get(url_b + "/metrics")).text
            assert value(ma, "herd_placer_leader") == 1 and value(mb, "herd_placer_leader") == 0
            assert value(ma, "herd_placer_epoch") == value(mb, "herd_placer_epoch") == ha["epoch"]
            assert value(mb, "herd_placer_failovers_total") == 0
            assert value(mb, "herd_placer_etcd_errors_total") == 0

            def submit() -> tuple[str, str]:
                # a dead address first, then the follower: the client ends at the leader
                with PlacerClient([dead, url_b], tokens.operator, timeout=5) as c:
                    view = c.submit(JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["x"]))
                    return view.job_id, c.url

            job_id, at = await trio.to_thread.run_sync(submit)
            assert (job_id, at) == ("j1", url_a)
            assert "j1" in a.svc.state.jobs and b.svc.state.jobs == {}
            n.cancel_scope.cancel()
