"""A rack relay leaves a paused leader (skipped where ``etcd`` is absent): a real 3-member etcd,
three ``herd placer run`` and one rack of real agents (``herd agent run``), the first of them
its relay. The leader SIGSTOPped keeps the relay's connection open and answers nothing; once
the relay host's link has moved to the new leader (another placer named it at a newer epoch)
the relay closes that connection and connects to the new leader, and the rack's members
register there through their relay, never directly."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo_ha import HACluster
from cli.localcluster import Proc, _wait_file
from testing.etcd import EtcdCluster, etcd_running

TTL = 2
MEMBERS = ("node1", "node2")


class RelayHACluster(HACluster):
    """HACluster whose agents are all in one rack, ``node0`` with ``[relay] enabled`` (the
    placers with a framed channel: ``wire_listen`` in ``extra_placer_config``)."""

    def start_agent(self, i: int, timeout: float = 30.0) -> Proc:
        node = f"node{i}"
        sd = self.root / node
        sd.mkdir(parents=True, exist_ok=True)
        (sd / "endpoints.json").unlink(missing_ok=True)
        conf = self.root / f"{node}.toml"
        conf.write_text("[relay]\nenabled = true\n" if i == 0 else "")
        p = self._spawn(node, ["agent", "run", "--config", str(conf), "--node-id", node, "--gpus", self.profile,
                               "--state-dir", str(sd), "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                               *[a for u in self.placer_urls for a in ("--placer", u)],
                               "--token-dir", str(self.token_dir), "--zone", "z1", "--block", "b1",
                               "--rack", "rack0", "--heartbeat-s", str(self.heartbeat_s)], sd)
        p.info = _wait_file(sd / "endpoints.json", p.proc, timeout, p.log)
        p.url = p.info["control_url"]
        self.agents[node] = p
        return p

    def start(self) -> RelayHACluster:   # the agents are started by the test: the relay first
        for _ in range(self.n_placers):
            self.start_placer()
        return self


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


def _get(url: str, headers: dict[str, str]) -> dict[str, Any]:
    try:
        r = httpx.get(url, headers=headers, timeout=5)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _status(c: HACluster, node: str) -> dict[str, Any]:
    return _get(c.agents[node].url + "/v1/status", c.read_headers())


def _up(c: HACluster, p: Proc) -> set[str]:
    nodes = _get(p.url + "/v1/nodes", c.read_headers()).get("nodes") or []
    return {n["node_id"] for n in nodes if n.get("state") == "up"}


def _relays(c: HACluster, p: Proc) -> dict[str, Any]:
    return (_get(p.url + "/v1/cluster", c.read_headers()).get("placer") or {}).get("relays") or {}


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.05)
    return v


def test_a_relay_leaves_a_paused_leader_and_its_rack_registers_at_the_next_through_it(
        tmp_path: Path, token_dir: Path, etcd3: EtcdCluster) -> None:
    with RelayHACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=3, n_agents=0, heartbeat_s=0.3,
                        fence_after_s=30.0, recover_s=1.0, lease_ttl_s=TTL, racks=1,
                        extra_placer_config='wire_listen = "127.0.0.1:0"\n') as c:
        old = c.leader()
        c.start_agent(0)
        _wait(lambda: _relays(c, old).get("candidates") == 1 and "node0" in _up(c, old), 30, "the relay at the leader")
        relay_url = _wait(lambda: (_status(c, "node0").get("relay") or {}).get("listen_url"), 10, "relay listening")
        for i in range(1, len(MEMBERS) + 1):
            c.start_agent(i)
        _wait(lambda: all((ln := _status(c, m).get("link") or {}).get("relay_url") == relay_url and ln.get("registered")
                          for m in MEMBERS), 30, "members reporting through the relay")
        _wait(lambda: _up(c, old) == {"node0", *MEMBERS}, 30, "the rack up at the leader")
        before = {m: _status(c, m)["link"] for m in MEMBERS}
        connects = _status(c, "node0")["relay"]["connects"]
        old.proc.send_signal(signal.SIGSTOP)
        try:
            paused = time.monotonic()
            nxt = c.leader(timeout_s=TTL + 8, besides=old)
            # the relay is connected to the new leader, and every member's full report came up
            # through it: the whole rack is up there, heard through one relay connection
            _wait(lambda: _relays(c, nxt).get("candidates") == 1 and _up(c, nxt) == {"node0", *MEMBERS},
                  TTL + 10, "the rack up at the new leader")
            took = time.monotonic() - paused
            relay = _status(c, "node0")["relay"]
            after = {m: _status(c, m)["link"] for m in MEMBERS}
        finally:
            old.proc.send_signal(signal.SIGCONT)
        assert relay["upstream"] and relay["connects"] > connects and relay["leaves"] >= 1, relay
        assert _relays(c, nxt)["reports"] >= len(MEMBERS), _relays(c, nxt)
        for m in MEMBERS:
            # still with their relay, never left it for the placer directly, and registered again through it
            assert after[m]["relay_url"] == relay_url and after[m]["registered"], (m, after[m])
            assert after[m]["relay_failures"] == before[m]["relay_failures"], (m, before[m], after[m])
            assert after[m]["relayed_full_reports"] > before[m]["relayed_full_reports"], (m, after[m])
        assert took < TTL + 10, took
