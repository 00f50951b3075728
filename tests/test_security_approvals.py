"""Issue 42: an operator's rack approval (``herd node approve``) outlives the placer that took
it. With ``[placer] etcd`` (skipped where ``etcd`` is absent): two placer services on one etcd,
the leader takes an approval, then is deposed; the other, with a state dir of its own that
never saw the approval, leads and enforces it -- a report of that node into another rack is
refused; an approval of b's own state dir (taken before etcd was configured) goes to etcd. A
deposed leader's approval write is refused by etcd. (A single placer keeps its
approvals in its state dir: tests/test_rack_pinning_placer.py, across a restart.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from infra.auth import TokenSet, auth_header
from placer.approvals import EtcdApprovals
from placer.errors import JournalError
from placer.etcd import EtcdClient
from placer.etcdjournal import EtcdJournal
from placer.nodeops import ApprovalFile
from placer.service import PlacerService
from testing.etcd import EtcdCluster
from testing.fake_agent import FakeAgent
from tests.test_etcd_placer import TTL, Placer, _role, cfg, until

R0, R1 = "z1/b1/r0", "z1/b1/r1"


async def test_an_approval_outlives_the_leader_that_took_it(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                             token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10, follow_redirects=False)
    with trio.fail_after(60):
        async with trio.open_nursery() as n, ops, EtcdClient(etcd_cluster.endpoints) as etcd:
            a = Placer(PlacerService(cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            await until(lambda: _role(ops, url_a, "leader"))
            # b's own state dir holds an approval taken before etcd was configured
            ApprovalFile(tmp_path / "b").save({"n7": R0})
            b = Placer(PlacerService(cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            await until(lambda: _role(ops, url_b, "follower"))
            await until(lambda: a.svc.approvals.etcd is not None)
            r = await ops.post(url_a + "/v1/nodes/n9/approve", content=msgspec.json.encode({"rack": R1}))
            assert r.status_code == 200, r.text
            assert (await etcd.get(b"/herd/placer/approvals/n9")) is not None    # in etcd before the 200
            assert ApprovalFile(tmp_path / "b").load() == {"n7": R0}             # b never saw it
            r = await ops.post(url_b + "/v1/nodes/n9/approve", content=msgspec.json.encode({"rack": R0}))
            assert r.status_code == 307                                          # a follower takes none
            journal = a.svc.journal
            assert isinstance(journal, EtcdJournal)
            deposed = EtcdApprovals(etcd, journal.prefix, journal.fence)
            # a is deposed (its lease revoked behind its back); b leads and takes etcd's approvals
            await etcd.revoke(a.svc.ha.election.core.lease_id)   # type: ignore[union-attr]
            with trio.fail_after(TTL + 4):
                await until(lambda: _role(ops, url_b, "leader"))
                await until(lambda: b.svc.state.rack_pins.approved.get("n9") == R1)
            r = await ops.get(url_b + "/v1/approvals")
            assert [(x["node_id"], x["rack"]) for x in r.json()["approvals"]] == [("n7", R0), ("n9", R1)]
            assert ApprovalFile(tmp_path / "b").load() == {"n7": R0, "n9": R1}   # and in b's state dir
            await until(lambda: etcd.get(b"/herd/placer/approvals/n7"))         # b's own, now the fleet's
            # it holds: n9 registering into r0 is refused by the new leader
            report = msgspec.structs.replace(FakeAgent("n9", tokens, rack="r0").full_report(), boot_id="b1", seq=1)
            r = await ops.post(url_b + "/v1/nodes/n9/report", content=msgspec.json.encode(report),
                               headers=auth_header(tokens.cluster))
            assert r.status_code == 403 and r.json()["error"] == "rack_mismatch", r.text
            # the deposed leader's write is refused by etcd, whatever it believes
            with pytest.raises(JournalError, match="no longer leads"):
                await deposed.save("n9", R0)
            assert b.svc.state.rack_pins.approved == {"n7": R0, "n9": R1}
            r = await ops.post(url_b + "/v1/nodes/n8/approve", content=msgspec.json.encode({"rack": R0}))
            assert r.status_code == 200 and (await etcd.get(b"/herd/placer/approvals/n8")) is not None
            n.cancel_scope.cancel()
