"""One identity for every placer of an HA cluster (skipped where ``etcd`` is absent): the MAC
master and the bundle signing key live in etcd (placer.ha), so that the MAC key a node got from
one leader, and the signing key it pinned, still hold at the next: a relayed report MACed under
leader A's key is taken by B after failover, a bundle B signs verifies under A's public key."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from infra.auth import TokenSet, auth_header
from placer.config import PlacerConfig
from placer.etcd import EtcdClient
from placer.service import PlacerService
from scheduler_link import msgauth
from testing.etcd import EtcdCluster
from testing.fake_agent import FakeAgent
from testing.waiting import poll

TTL = 2


def test_placer_keys_round_trip_and_a_damaged_value_is_one_clear_error() -> None:
    master, signer = b"\x07" * msgauth.KEY_LEN, msgauth.BundleSigner.generate()
    m2, s2 = msgauth.decode_placer_keys(msgauth.encode_placer_keys(master, signer), "etcd key k")
    assert m2 == master and s2.public == signer.public
    for bad in (b"not json", msgspec.json.encode({"version": 99, "mac_master": b"x" * 32, "signing_key": b""}),
                msgspec.json.encode({"version": 1, "mac_master": b"short", "signing_key": signer.private_pem()}),
                msgspec.json.encode({"version": 1, "mac_master": master, "signing_key": b"-----BEGIN nothing"})):
        with pytest.raises(msgauth.AuthError, match="^etcd key k"):
            msgauth.decode_placer_keys(bad, "etcd key k")


def cfg(tmp: Path, name: str, endpoints: list[str]) -> PlacerConfig:
    return PlacerConfig(listen="127.0.0.1:0", state_dir=str(tmp / name), heartbeat_s=0.2, recover_s=0.4,
                        ack_timeout_s=1.0, tick_s=0.05, etcd=endpoints, etcd_lease_ttl_s=TTL)


class Placer:
    """A placer service in its own cancel scope; ``done`` once it ended (its lease lost)."""

    def __init__(self, svc: PlacerService) -> None:
        self.svc = svc
        self.done = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:  # noqa: ANN001
        try:
            async with trio.open_nursery() as n:
                task_status.started(await n.start(self.svc.run))
        except BaseExceptionGroup:
            pass
        finally:
            self.done.set()


async def _role(c: httpx.AsyncClient, url: str, role: str) -> bool:
    r = await c.get(url + "/healthz")
    return r.status_code == 200 and r.json()["ha"]["role"] == role


async def test_macs_and_signatures_of_leader_a_hold_at_b_after_failover(etcd_cluster: EtcdCluster, tmp_path: Path,
                                                                        token_dir: Path) -> None:
    tokens = TokenSet.load(token_dir)
    ops = httpx.AsyncClient(headers=auth_header(tokens.operator), timeout=10)
    with trio.fail_after(60):
        async with trio.open_nursery() as n, ops, EtcdClient(etcd_cluster.endpoints) as etcd:
            a = Placer(PlacerService(cfg(tmp_path, "a", etcd_cluster.endpoints), tokens))
            url_a = await n.start(a.run)
            await poll(lambda: _role(ops, url_a, "leader"), 0.05)
            b = Placer(PlacerService(cfg(tmp_path, "b", etcd_cluster.endpoints), tokens))
            url_b = await n.start(b.run)
            await poll(lambda: _role(ops, url_b, "follower"), 0.05)
            # each placer made its own keys in its state dir; both took the first one's from etcd
            own_b, _ = msgauth.load_placer_keys(tmp_path / "b")
            assert own_b != b.svc.mac_master and b.svc.mac_master == a.svc.mac_master
            assert (await etcd.get(b"/herd/placer/keys")) is not None
            # a node registers with leader A: its MAC key and A's signing key come in the answer
            agent = FakeAgent("n0", tokens, rack="r0")
            await n.start(agent.run, url_a)
            assert agent.link is not None
            link = agent.link
            await poll(lambda: link.mac_key is not None and link.placer_key is not None, 0.05)
            mac_key, placer_key, boot = link.mac_key, link.placer_key, link.boot_id
            assert mac_key is not None and placer_key is not None
            agent.cancel.cancel()
            # A deposed (its lease revoked behind its back): B leads
            await etcd.revoke(a.svc.ha.election.core.lease_id)   # type: ignore[union-attr]
            with trio.fail_after(TTL + 4):
                await a.done.wait()
            with trio.fail_after(TTL + 4):
                await poll(lambda: _role(ops, url_b, "leader"), 0.05)
            # the node's report, MACed with the key A gave it, forwarded by a relay: B takes it
            rep = msgspec.structs.replace(agent.full_report(), boot_id=boot, seq=1000)
            status, reply = b.svc.ingest_relayed(msgauth.with_report_mac(mac_key, rep), via="relay-n1")
            assert status == 200 and reply.ok, reply
            forged = msgauth.with_report_mac(b"\x01" * msgauth.KEY_LEN, msgspec.structs.replace(rep, seq=1001))
            assert b.svc.ingest_relayed(forged, via="relay-n1")[0] == 401
            # a bundle B signs verifies under the key the node pinned from A
            bundle = b.svc.signer.bundle(rack="z1/b1/r0", blob_id="", parts=[], deliver_by=1.0, epoch=7)
            view, _, _ = msgauth.BundleVerifier(placer_key).bundle(msgspec.msgpack.encode(bundle))
            assert view.epoch == 7
            n.cancel_scope.cancel()
