"""`herd job submit` against a paused leader (skipped where ``etcd`` is absent): a real 3-member
etcd and three ``herd placer run``; the leader SIGSTOPped keeps its connections open and
answers nothing. The CLI, told every placer with the paused one first, asks the others who
leads while its request goes unanswered (scheduler_link.leaderprobe) and submits to the new
leader, instead of waiting out its --timeout (set here far past the test's bound)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cli.demo_ha import HACluster
from infra.auth import TokenSet, auth_header
from testing.etcd import EtcdCluster, etcd_running

TTL = 2
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


def test_a_submit_to_a_paused_leader_reaches_the_new_one(tmp_path: Path, token_dir: Path,
                                                          etcd3: EtcdCluster) -> None:
    op = TokenSet.load(token_dir).operator
    with HACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=3, n_agents=0, heartbeat_s=0.3,
                   fence_after_s=30.0, recover_s=1.0, lease_ttl_s=TTL, racks=1) as c:
        old = c.leader()
        others = [p for p in c.placers if p is not old]
        old.proc.send_signal(signal.SIGSTOP)
        try:
            # --timeout 600: a request left to its timeout would outlast the bound below by far
            r = subprocess.run(
                [sys.executable, "-m", "cli.main", "job", "submit", "--job-id", "after-pause", "--json",
                 "--timeout", "600", "--placer", ",".join([old.url, *(p.url for p in others)]),
                 "--", "sleep", "60"],
                cwd=REPO, capture_output=True, timeout=60,
                env={**os.environ, "PYTHONPATH": str(REPO), "HERD_TOKEN_DIR": str(token_dir)})
            nxt = c.leader(timeout_s=5, besides=old)
        finally:
            old.proc.send_signal(signal.SIGCONT)
        assert r.returncode == 0, r.stderr.decode()
        assert json.loads(r.stdout)["job_id"] == "after-pause"
        # the job is the new leader's, taken once
        jobs = httpx.get(nxt.url + "/v1/jobs", headers=auth_header(op), timeout=5).json()["jobs"]
        assert [j["job_id"] for j in jobs] == ["after-pause"], jobs
