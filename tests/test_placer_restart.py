"""A placer restarted under a running rack, with real processes: a placer and three agents in
one rack over mutual TLS, one of them the rack's relay. The placer is SIGKILLed with a gang
running and started again on its state dir: the members keep their relay while it has no
connection up (``upstream_down``), and their full reports reach the new process through it,
MACed with keys that outlive the placer process -- no member opens a connection of its own to
the placer (counted on both sides: the members' links and the placer's TLS handshakes). The
running workloads are untouched, nothing is placed twice, and a job submitted after the
restart runs. The nodes re-register compactly: they name the GPU inventory the placer stored
instead of sending their snapshots."""

from __future__ import annotations

import signal
from typing import Any

import httpx
import pytest
import trio

from infra.auth import TokenSet
from placer.inventories import InventoryBook
from tests.prom import value
from tests.test_relay_agents import Api, RelayCluster, _jobs_workloads, _start

pytestmark = pytest.mark.slow


async def _links(api: Api, nodes: list[str]) -> dict[str, dict[str, Any]]:
    return {n: (await api.agent(n, "/v1/status"))["link"] for n in nodes}


async def _metrics(api: Api) -> str:
    async with httpx.AsyncClient(timeout=15, headers=api.h, verify=api.c.verify) as cl:
        r = await cl.get(api.url + "/metrics")
        r.raise_for_status()
        return r.text


async def test_a_restarted_placer_hears_the_rack_through_its_relay_without_member_handshakes(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(150), RelayCluster(tmp_path, token_dir, relays={0}, heartbeat_s=0.5,
                                            recover_s=1.5, tls=True) as c:
        api = Api(c, tokens)
        await _start(c, api, 0, [1, 2])
        members = ["node1", "node2"]
        await api.submit(job_id="g", pods=2, gpus_per_pod=8, argv=["sleep", "120"], grace_s=1.0)
        assert (await api.job("g", wait="running"))["state"] == "running"
        before = await _jobs_workloads(api, "g")
        assert sorted(w["state"] for ws in before.values() for w in ws) == ["running", "running"], before
        links0 = await _links(api, members)

        assert c.placer is not None

        async def stored() -> bool:   # (written within a second of each registration)
            return set(InventoryBook.load(c.placer.state_dir).by_node) == {"node0", *members}
        with trio.fail_after(10):
            await api.until(stored)
        c.placer.signal_group(signal.SIGKILL)
        c.placer.proc.wait(5)

        # the members hold on to their relay while it has no placer (answered upstream_down)
        async def holding() -> bool:
            ls = await _links(api, members)
            return all(ls[n]["relay_holds"] > links0[n]["relay_holds"] for n in members)
        with trio.fail_after(15):
            await api.until(holding)

        c.start_placer()

        async def all_up() -> bool:
            nodes = await api.nodes()
            return len(nodes) == 3 and all(n["state"] == "up" for n in nodes.values())
        with trio.fail_after(30):
            await api.until(all_up)
        links1 = await _links(api, members)
        for n in members:
            # re-registered through the relay, never directly
            assert links1[n]["relayed_full_reports"] > links0[n]["relayed_full_reports"], (n, links1[n])
            assert links1[n]["relay_failures"] == links0[n]["relay_failures"], (n, links1[n])
            assert links1[n]["relay_url"] == links0[n]["relay_url"] and links1[n]["registered"], (n, links1[n])
        # the new process's framed channel handshook with node0 only: its relay's connection up,
        # which carries node0's own reports too (agent.relay.OwnReports); the members none
        text = await _metrics(api)
        assert value(text, "herd_placer_tls_handshakes_total", listener="wire") <= 1, text
        # and every node named the GPU inventory the placer had stored instead of sending its
        # snapshot (placer.inventories): a compact registration each, none answered 409
        for n, link in (await _links(api, ["node0", *members])).items():
            assert link["compact_registrations"] >= 1 and link["inventory_misses"] == 0, (n, link)
        assert value(text, "herd_placer_compact_registrations_total") >= 3, text
        assert value(text, "herd_placer_inventory_misses_total") == 0, text

        # the gang is the agents' truth: running, the same workloads, nothing placed again
        job = await api.job("g", wait="running")
        assert job["state"] == "running", job
        await trio.sleep(2.0)   # past recover_s: a placer that doubled it would have by now
        after = await _jobs_workloads(api, "g")
        assert {n: sorted((w["workload_id"], w["state"]) for w in ws) for n, ws in after.items()} == \
            {n: sorted((w["workload_id"], w["state"]) for w in ws) for n, ws in before.items()}

        # and the restarted placer places: a new job runs on the node left
        await api.submit(job_id="h", pods=1, gpus_per_pod=8, argv=["sleep", "60"], grace_s=1.0)
        assert (await api.job("h", wait="running"))["state"] == "running"
        ws = await _jobs_workloads(api, "h")
        assert [n for n, w in ws.items() if w] == [n for n, w in before.items() if not w], (ws, before)
