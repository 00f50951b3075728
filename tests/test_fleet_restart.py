"""A placer restart under an emulated fleet, through the real processes (``bench.restart``'s
run): ~4,000 nodes over mutual TLS in rack-relay mode (the shipped relay), a gang running, the
placer SIGKILLed and started again on its state dir. Checked against the emulated agents' own
state: no workload stopped, nothing placed twice, no GPU given twice (an emulated node refuses
a part for GPUs it runs), the gang still running, a new job placed; and the members came back
through their relays (the new process's TLS handshakes stay within two per relay: its own
link and its relay connection, plus the test's clients). Counts asserted, never times."""

from __future__ import annotations

import json
import os

import pytest
import trio

from bench.restart import run_once

pytestmark = pytest.mark.slow

NODES = int(os.environ.get("HERD_TEST_RESTART_NODES", "4096"))   # 128 racks of 32


async def test_a_placer_restart_under_a_tls_fleet_loses_and_doubles_nothing(tmp_path):
    with trio.fail_after(400):
        row = await run_once(NODES, fleet="h100", gang_hosts=NODES // 8, probe_gpus=256, tls=True, relay_hold=30.0,
                             per_proc=NODES, recover_s=2.0, tmp=tmp_path, limit_s=180.0, heartbeat_s=2.0)
    print(json.dumps(row))   # (the whole row in the report of a failure)
    assert row["gang_running"] == row["gang_running_before"] == NODES // 8, row
    assert row["stops"] == 0 and row["placements_doubled"] == 0 and row["refused_acks"] == 0, row
    assert row["probe_state"] == "running", row
    assert row["relayed_registrations"] >= 0.9 * (NODES - row["relays"]), row
    assert row["tls_handshakes"] <= 2 * row["relays"] + 0.01 * NODES, row
    # they re-registered compactly (the placer kept their GPU inventories: placer.inventories)
    assert row["compact_registrations"] >= 0.9 * NODES and row["inventory_misses"] <= 0.01 * NODES, row
