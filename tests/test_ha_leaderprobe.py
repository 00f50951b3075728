"""Agents leave a silent leader by asking the other placers who leads (scheduler_link.leaderprobe):
the decision without I/O, then real processes (skipped where ``etcd`` is absent): the leader
SIGSTOPped, every agent moves to the new leader because a follower named it at a newer epoch,
not because its report's 10 s deadline ran out."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cli.demo_ha import HACluster
from scheduler_link.leaderprobe import Claim, claim_of, epoch_named, newer_leader
from testing.etcd import EtcdCluster, etcd_running

TTL = 2


def test_claim_of_reads_who_a_placer_names() -> None:
    follower = b'{"ok": true, "ha": {"role": "follower", "leader": "http://b:1/", "epoch": 42, ' \
               b'"leader_wire": "tcp://b:2", "placing": false}}'
    assert claim_of(follower) == Claim("http://b:1", 42, "tcp://b:2")
    assert claim_of(b'{"ok": true, "ha": {"role": "candidate", "leader": null, "epoch": 0}}') is None
    assert claim_of(b'{"ok": true, "epoch": 3}') is None                  # a single placer: no ha
    assert claim_of(b"<html>") is None
    assert claim_of(b'{"ha": {"leader": "file:///x", "epoch": 9}}') is None
    assert claim_of(b'{"ha": {"leader": "http://b", "epoch": 9, "leader_wire": "ftp://x"}}') == Claim("http://b", 9)


def test_newer_leader_moves_only_to_a_higher_epoch_elsewhere() -> None:
    a, b, c = "http://a", "http://b", "http://c"
    # the followers still name the paused leader at the epoch known: it is only slow, stay
    assert newer_leader([Claim(a, 10), None], 10, a) is None
    # a newer epoch named: move there; the highest wins; the one asked is never chosen
    assert newer_leader([Claim(a, 10), Claim(b, 12)], 10, a) == Claim(b, 12)
    assert newer_leader([Claim(b, 12), Claim(c, 15), Claim(b, 12, "tcp://b")], 10, a) == Claim(c, 15)
    assert newer_leader([Claim(b, 12), Claim(b, 12, "tcp://b")], 10, a) == Claim(b, 12, "tcp://b")
    assert newer_leader([Claim(a, 20)], 10, a + "/") is None
    assert newer_leader([], 0, a) is None


def test_epoch_named_is_the_highest_epoch_any_placer_gives_a_leader() -> None:
    """(A client that has seen no epoch itself, the CLI, takes this as the one known: a leader
    named above it is newer, a live leader the others still name keeps the request.)"""
    a, b = "http://a", "http://b"
    claims = [Claim(a, 10), None, Claim(a, 11), Claim(b, 12)]
    assert epoch_named(claims, a) == 11 and epoch_named(claims, a + "/") == 11
    assert epoch_named(claims, "http://c") == 0 and epoch_named([], a) == 0
    assert newer_leader(claims, epoch_named(claims, a), a) == Claim(b, 12)
    assert newer_leader([Claim(a, 12), Claim(b, 12)], epoch_named([Claim(a, 12), Claim(b, 12)], a), a) is None


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 3)


def _link(c: HACluster, node: str) -> dict[str, Any]:
    try:
        st = httpx.get(c.agents[node].url + "/v1/status", headers=c.read_headers(), timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return st.get("link") or {}


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.05)
    return v


def test_agents_leave_a_paused_leader_for_the_one_a_follower_names(tmp_path: Path, token_dir: Path,
                                                                   etcd3: EtcdCluster) -> None:
    with HACluster(tmp_path / "c", token_dir, etcd3.endpoints, n_placers=3, n_agents=2, heartbeat_s=0.3,
                   fence_after_s=30.0, recover_s=1.0, lease_ttl_s=TTL, racks=1) as c:
        old = c.leader()
        _wait(lambda: all(_link(c, n).get("placer_url") == old.url and _link(c, n).get("registered")
                          for n in c.agents), 30, "agents registered at the leader")
        old.proc.send_signal(signal.SIGSTOP)
        try:
            nxt = c.leader(timeout_s=TTL + 8, besides=old)
            links = _wait(lambda: (ls := {n: _link(c, n) for n in c.agents}) and all(
                x.get("placer_url") == nxt.url and x.get("registered") for x in ls.values()) and ls,
                30, "agents registered at the new leader")
        finally:
            old.proc.send_signal(signal.SIGCONT)
        for node, link in links.items():
            # moved because another placer named a newer leader, not because a deadline ran out
            assert link["leader_moves"] >= 1, (node, link)
