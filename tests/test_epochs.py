"""Placer epochs (fencing tokens, scheduler_link.epochs): the pure check over any interleaving
of messages of several epochs, its durable file, and every receiver that keeps it: a real
agent's placement API, its link's answers and stops, a relay core's bundles (also replayed
after the relay restarted on its state dir), and a placer restarted on its state dir."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.relaycore import Refuse, RelayCore, Taken
from cli.demo_ha import HACluster
from cli.placer import placer_status
from infra.auth import TokenSet, auth_header
from scheduler_link.agent_link import AgentLink
from scheduler_link.client import PlacerClient
from scheduler_link.epochs import EPOCH_FILE, Check, EpochFile, EpochGate, Epochs
from scheduler_link.heartbeat_wire import WireReply
from scheduler_link.messages import (
    GpuSnapshot,
    JobSpec,
    NodePart,
    NodeReport,
    NodeStop,
    Placement,
    PlacementAck,
    PodAssignment,
    RackBeatReply,
    ReportReply,
    Victim,
)
from scheduler_link.msgauth import BundleSigner, epoch_mac, node_key, stop_mac, verified_stops, with_stop_macs
from testing.etcd import EtcdCluster, etcd_running
from testing.waiting import poll
from tests.prom import value
from tests.test_agent_api import make_agent
from tests.test_placer_service import start_cluster

# ---------------------------------------------------------------- the pure check


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3]), max_size=40))
def test_nothing_older_than_the_highest_seen_is_ever_accepted(epochs: list[int]) -> None:
    """Messages of up to three epochs (and epoch 0) in any order: each is accepted iff it is
    not older than every epoch before it; equal epochs are accepted; the highest only grows."""
    gate = EpochGate()
    seen = 0
    for e in epochs:
        c = gate.check(e)
        assert (c is Check.STALE) == (e < seen)
        assert (c is Check.NEWER) == (e > seen)
        if c is Check.NEWER:
            gate.advance(e)
        seen = max(seen, e)
        assert gate.highest == seen
    gate.advance(0)
    assert gate.highest == seen


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 4, 5, 6]), st.booleans()), max_size=25))
def test_the_highest_survives_a_reload_from_disk(tmp_path_factory: pytest.TempPathFactory,
                                                 msgs: list[tuple[int, bool]]) -> None:
    """The durable gate, reloaded (a restart) at random points between messages, refuses
    exactly what one gate that never restarted would."""
    path = tmp_path_factory.mktemp("ep") / EPOCH_FILE
    gate = Epochs(path)
    ref = EpochGate()
    for e, restart in msgs:
        if restart:
            gate = Epochs(path)
        want = ref.check(e) is not Check.STALE
        ref.advance(e)
        assert gate.admit(e, "part") is want
        assert gate.highest == ref.highest == EpochFile(path).load()
    assert Epochs(path).highest == ref.highest


def test_a_newer_epoch_that_cannot_be_written_is_not_admitted(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    g = Epochs(ro / EPOCH_FILE)
    assert g.admit(3, "part")
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a read-only directory is still writable")
        with pytest.raises(OSError):
            g.admit(4, "part")
        assert g.highest == 3 and g.admit(3, "part")
    finally:
        os.chmod(ro, 0o700)


def test_the_epoch_file_counts_starts_and_refuses_a_damaged_file(tmp_path: Path) -> None:
    f = EpochFile(tmp_path / "placer-epoch")
    assert f.load() == 0
    assert [f.next(), f.next(), f.next()] == [1, 2, 3]
    assert json.loads(f.path.read_bytes()) == {"epoch": 3, "version": 1}
    f.path.write_bytes(b"three")
    with pytest.raises(ValueError, match="not an epoch file"):
        f.load()


def test_a_stop_mac_covers_its_epoch() -> None:
    key = node_key(b"m" * 32, "n1", "boot")
    v = with_stop_macs(key, "n1", "boot", [Victim(workload_id="w", epoch=7)])[0]
    assert verified_stops(key, "n1", "boot", [v]) == ([v], 0)
    for forged in (msgspec.structs.replace(v, epoch=8), msgspec.structs.replace(v, epoch=0)):
        assert verified_stops(key, "n1", "boot", [forged]) == ([], 1)
    # a stop of a placer without epochs is MACed as before epochs existed
    old = Victim(workload_id="w")
    assert stop_mac(key, "n1", "boot", old) != stop_mac(key, "n1", "boot", msgspec.structs.replace(old, epoch=1))


# ---------------------------------------------------------------- a relay's bundles

def _bundle(signer: BundleSigner, epoch: int, pid: str) -> bytes:
    part = NodePart(placement_id=pid, node_id="relay0", job_id="j", attempt=1, victims=[Victim(workload_id="w")])
    rb = signer.bundle(rack="z/b/r", blob_id="", parts=[part], deliver_by=0.0, epoch=epoch)
    return msgspec.msgpack.encode(rb)


def test_a_relay_refuses_a_bundle_of_an_older_epoch_also_replayed_after_it_restarted(tmp_path: Path) -> None:
    signer = BundleSigner.generate()
    path = tmp_path / "state" / EPOCH_FILE
    old = _bundle(signer, 4, "stop:a")
    core = RelayCore(node_id="relay0", rack="z/b/r", epochs=Epochs(path))
    assert isinstance(core.bundle(old, signer.public, now=0.0, wall=0.0), Taken)
    assert isinstance(core.bundle(_bundle(signer, 5, "stop:b"), signer.public, now=0.0, wall=0.0), Taken)
    got = core.bundle(old, signer.public, now=0.0, wall=0.0)
    assert isinstance(got, Refuse) and got.reason == "stale_epoch" and not got.new_key
    assert core.stale_bundles == 1 and core.epochs.stale == {"bundle": 1}
    # the relay restarts on its state dir: the replay is still refused, epoch 0 too
    core = RelayCore(node_id="relay0", rack="z/b/r", epochs=Epochs(path))
    for stale in (old, _bundle(signer, 0, "stop:c")):
        got = core.bundle(stale, signer.public, now=0.0, wall=0.0)
        assert isinstance(got, Refuse) and got.reason == "stale_epoch"
    assert isinstance(core.bundle(_bundle(signer, 5, "stop:d"), signer.public, now=0.0, wall=0.0), Taken)
    # the epoch is signed: a relay upstream that raises it breaks the signature
    view = msgspec.msgpack.decode(old, type=dict)
    view["epoch"] = 9
    got = core.bundle(msgspec.msgpack.encode(view), signer.public, now=0.0, wall=0.0)
    assert isinstance(got, Refuse) and got.reason == "not_authentic" and core.epochs.highest == 5


def test_a_relay_passes_down_no_answer_of_a_replaced_placer(tmp_path: Path) -> None:
    """The placer's answers over the relay's own connection raise its epoch; an older one's
    beat answer (need_full, stops) is dropped and its report answers go down as 503."""
    core = RelayCore(node_id="relay0", rack="z/b/r", epochs=Epochs(tmp_path / EPOCH_FILE))
    core.member_opened("n1")
    core.beat_answered(RackBeatReply(epoch=3))
    assert core.epochs.highest == 3 and EpochFile(tmp_path / EPOCH_FILE).load() == 3
    core.beat_answered(RackBeatReply(epoch=2, need_full=["n1"], stop=[NodeStop(node_id="n1", stop=[
        Victim(workload_id="w", epoch=2)])]))
    beat = NodeReport(node_id="n1", boot_id="b", seq=1, full=False)
    plain = core.report("n1", beat, upstream=True)
    assert isinstance(plain, WireReply) and not plain.reply.need_full and not plain.reply.stop
    for ep, status in ((2, 503), (0, 503), (3, 200)):
        t = core.report("n1", NodeReport(node_id="n1", boot_id="b", seq=2, full=True), upstream=True)
        batch = core.next_batch(0.0)
        assert batch is not None and batch.tickets == [t]
        [(t2, wr)] = core.batch_answered(batch, [WireReply(status=200, reply=ReportReply(epoch=ep, stop=[
            Victim(workload_id="w", epoch=ep)]))])
        assert t2 == t and wr.status == status and (status == 503 or wr.reply.stop)
    assert core.epochs.stale == {"reply": 3}


# ---------------------------------------------------------------- an agent's placements

def _placement(pid: str, gpu: str, epoch: int) -> Placement:
    return Placement(placement_id=pid, job_id=pid, argv=["sleep", "30"], grace_s=0.2, epoch=epoch,
                     pods=[PodAssignment(workload_id=f"{pid}.0.0", rank=0, gpus=[gpu])])


async def test_an_agent_refuses_a_placement_of_an_older_epoch_also_after_a_restart(tmp_path, token_dir) -> None:
    tokens = TokenSet.load(token_dir)
    for run in range(2):
        agent = make_agent(tmp_path, token_dir)
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                url = await n.start(agent.run)
                async with httpx.AsyncClient(base_url=url, headers=auth_header(tokens.placer)) as c:
                    viewer = auth_header(tokens.viewer)
                    uuids = [g["uuid"] for g in (await c.get("/v1/status", headers=viewer)).json()["gpus"]["gpus"]]

                    async def post(p: Placement, token: str | None = tokens.placer) -> tuple[int, PlacementAck]:
                        r = await c.post("/v1/placements", content=msgspec.json.encode(p), headers=auth_header(token))
                        return r.status_code, msgspec.convert(r.json(), PlacementAck)

                    if run == 0:   # no epoch seen yet: a placer without epochs is taken, then epoch 5
                        for pid, gpu, ep in (("a", uuids[0], 0), ("b", uuids[1], 5)):
                            st, ack = await post(_placement(pid, gpu, ep))
                            assert st == 200 and ack.accepted, ack
                    for pid, ep in (("c", 4), ("d", 0), ("b", 4)):   # older; none; an accepted id replayed old
                        st, ack = await post(_placement(pid, uuids[2], ep))
                        assert st == 409 and ack.outcome == "stale_epoch" and not ack.accepted, (pid, ack)
                    r = (await c.get("/v1/workloads", headers=viewer)).json()
                    wids = {w["workload_id"] for w in (r.get("workloads", r) if isinstance(r, dict) else r)}
                    assert "b.0.0" in wids and not wids & {"c.0.0", "d.0.0"}
                    # an operator's direct placement carries no epoch and is not fenced
                    st, ack = await post(_placement(f"op{run}", uuids[3 + run], 0), tokens.operator)
                    assert st == 200 and ack.accepted, ack
                    st, ack = await post(_placement("e", uuids[5], 5))   # the current epoch (again: idempotent)
                    assert st == 200 and ack.accepted, ack
                    status = (await c.get("/v1/status", headers=viewer)).json()
                    assert status["placer_epoch"]["epoch"] == 5
                    assert status["placer_epoch"]["stale"]["placement"] == 3
                    m = (await c.get("/metrics", headers=viewer)).text
                    assert value(m, "herd_agent_stale_epoch_total", kind="placement", node="n1") == 3
                    assert value(m, "herd_agent_placer_epoch", node="n1") == 5
                n.cancel_scope.cancel()


# ---------------------------------------------------------------- a link's answers

class _Hooks:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    def full_report(self) -> NodeReport:
        return NodeReport(node_id="n1", boot_id="", seq=0, full=True)

    def gpu_snapshot(self) -> GpuSnapshot:
        return GpuSnapshot()

    async def stop_workloads(self, victims: list[Victim]) -> None:
        self.stopped += [v.workload_id for v in victims]


async def test_an_answer_of_an_older_epoch_is_not_acted_on(tmp_path, autojump_clock) -> None:
    """The placer answers with epoch 3, then a replaced placer's answers (epoch 2, then 0) come
    with stops, a relay and a wire URL: none is taken, each is counted; epoch 3 again is."""
    answers = [ReportReply(epoch=3, stop=[Victim(workload_id="w1", epoch=3)]),
               ReportReply(epoch=2, stop=[Victim(workload_id="w2", epoch=2)], relay_url="tcp://127.0.0.1:9",
                           wire_url="tcp://127.0.0.1:9", heartbeat_interval_s=30.0),
               ReportReply(epoch=0, stop=[Victim(workload_id="w3")]),
               ReportReply(epoch=3, stop=[Victim(workload_id="w4", epoch=3)])]
    served: list[int] = []
    all_served = trio.Event()

    def placer(req: httpx.Request) -> httpx.Response:
        i = min(len(served), len(answers) - 1)
        served.append(i)
        if len(served) == len(answers):
            all_served.set()
        return httpx.Response(200, content=msgspec.json.encode(answers[i]))

    hooks = _Hooks()
    epochs = Epochs(tmp_path / EPOCH_FILE)
    async with httpx.AsyncClient(transport=httpx.MockTransport(placer)) as http:
        link = AgentLink("http://placer", None, "n1", hooks, heartbeat_s=1.0, use_wire=False, http=http,
                         epochs=epochs)
        async with trio.open_nursery() as n:
            await n.start(link.run)
            await all_served.wait()
            await trio.sleep(0.5)
            n.cancel_scope.cancel()
    assert hooks.stopped[:2] == ["w1", "w4"] and "w2" not in hooks.stopped and "w3" not in hooks.stopped
    assert epochs.stale["reply"] == 2 and link.stops_refused == 2
    assert link.heartbeat_s == 1.0 and link.wire_url is None and link._relay is None
    assert EpochFile(tmp_path / EPOCH_FILE).load() == 3


def test_a_member_takes_the_epoch_its_relay_carried_only_under_the_placers_mac(tmp_path: Path) -> None:
    """A member behind a relay learns a new epoch from the answer to its report (the placer MACs
    the epoch in the member's key): a relay cannot raise it (no valid MAC: not taken), nor make
    a replaced placer's answer pass (a valid MAC of an older epoch: not acted on)."""
    link = AgentLink("http://placer", None, "n1", _Hooks(), use_wire=False,
                     epochs=Epochs(tmp_path / EPOCH_FILE))
    link.mac_key = key = node_key(b"m" * 32, "n1", link.boot_id)

    def relayed(ep: int, mac_ep: int | None, k: bytes = key) -> ReportReply:
        m = b"" if mac_ep is None else epoch_mac(k, "n1", link.boot_id, mac_ep)
        return ReportReply(epoch=ep, epoch_mac=m, stop=[Victim(workload_id="w", epoch=ep)])

    assert link._fresh_relayed(relayed(4, 4)) and link.epochs.highest == 4 == EpochFile(tmp_path / EPOCH_FILE).load()
    assert link._fresh_relayed(relayed(9, None)) and link.epochs.highest == 4           # no MAC: not taken
    assert link._fresh_relayed(relayed(9, 4)) and link.epochs.highest == 4              # the MAC of another epoch
    assert link._fresh_relayed(relayed(9, 9, b"k" * 32)) and link.epochs.highest == 4   # another key's
    assert not link._fresh_relayed(relayed(3, 3)) and link.stops_refused == 1            # a replaced placer's
    assert link.epochs.stale == {"reply": 1}


# ---------------------------------------------------------------- a placer restarted

async def test_a_placer_restarted_on_its_state_dir_has_a_larger_epoch_and_says_so(tmp_path, token_dir) -> None:
    """Each start's epoch is larger, on disk before it listens; agents raise theirs from its
    answers; /healthz, /v1/status and /metrics show this start; its pushes carry the epoch."""
    tokens = TokenSet.load(token_dir)
    first = await _one_start(tmp_path, tokens, "j0")
    second = await _one_start(tmp_path, tokens, "j1")
    assert second == first + 1 >= 2


async def _one_start(tmp_path: Path, tokens: TokenSet, job: str) -> int:
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2, recover_s=0.3)
            assert EpochFile(tmp_path / "placer" / EPOCH_FILE).load() == svc.epoch
            h = (await cl.c.get("/healthz")).json()
            s = (await cl.c.get("/v1/status")).json()
            for doc in (h, s):
                assert doc["epoch"] == svc.epoch and doc["started_at"] == svc.started_at
                assert doc["nodes_reported"] == 2 and 0 <= doc["recover_s_left"] <= 0.3
            cli = await trio.to_thread.run_sync(placer_status, cl.url, tokens.viewer, 5.0)   # herd placer status
            assert cli["epoch"] == svc.epoch and cli["role"] == "leader" and cli["nodes_reported"] == 2
            assert cli["started_at"] == svc.started_at and 0 <= cli["recover_s_left"] <= 0.3
            m = (await cl.c.get("/metrics")).text
            assert value(m, "herd_placer_epoch") == svc.epoch
            assert value(m, "herd_placer_nodes_reported") == 2
            assert value(m, "herd_placer_started_timestamp_seconds") == svc.started_at
            links = [a.link for a in cl.agents.values()]
            await poll(lambda: all(lk is not None and lk.epochs.highest == svc.epoch for lk in links), 0.02)
            await cl.submit(job_id=job, pods=1, gpus_per_pod=8)
            await cl.job(job, wait="running")
            assert {p.epoch for a in cl.agents.values() for p in a.placements} == {svc.epoch}
            await poll(lambda: svc.recover_s_left(svc.clock()) == 0.0, 0.02)
            assert (await cl.c.get("/healthz")).json()["recover_s_left"] == 0
            await cl.c.aclose()
            n.cancel_scope.cancel()
    return svc.epoch


# ---------------------------------------------------------------- a deposed leader (etcd)

@pytest.fixture
def etcd1(tmp_path: Path) -> Iterator[EtcdCluster]:
    yield from etcd_running(tmp_path / "etcd", 1)


def test_a_paused_leader_replaced_then_continued_has_every_message_refused(tmp_path: Path, token_dir: Path,
                                                                          etcd1: EtcdCluster) -> None:
    """Two ``herd placer run`` on a real etcd (skipped without ``etcd``) and two real agents. The
    leader is SIGSTOPped past its lease, the other leads (a larger epoch) and the agents move to
    it, learning its epoch from its answers; the old one is continued (SIGCONT) and serves as a
    follower with no epoch of its own. What it sent as leader, sent again with its credentials (a
    placement of its epoch, bound to the node), is refused ``stale_epoch`` and counted; so is
    anything of epoch 0; the running workload is untouched throughout."""
    ttl = 2
    op = TokenSet.load(token_dir).operator
    placer_token = TokenSet.load(token_dir).placer
    with HACluster(tmp_path / "c", token_dir, etcd1.endpoints, n_placers=2, n_agents=2, heartbeat_s=0.3,
                   fence_after_s=30.0, recover_s=12.0, lease_ttl_s=ttl, racks=1) as c:
        def healthz(url: str) -> dict:
            return httpx.get(url + "/healthz", timeout=5).json()

        def agent_epoch(name: str) -> dict:
            return httpx.get(c.agents[name].url + "/v1/status", headers=c.read_headers(),
                             timeout=5).json()["placer_epoch"]

        def until(pred, timeout_s: float, what: str):  # noqa: ANN001, ANN202
            deadline = time.monotonic() + timeout_s
            while not (v := pred()):
                assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
                time.sleep(0.05)
            return v

        old = c.leader()
        old_epoch = healthz(old.url)["epoch"]
        assert old_epoch > 0 and old_epoch == healthz(old.url)["ha"]["epoch"]
        until(lambda: all(agent_epoch(a)["epoch"] == old_epoch for a in c.agents), 30, "agents at the leader")
        with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
            pc.submit(JobSpec(job_id="j1", pods=1, gpus_per_pod=8, argv=["sleep", "600"], grace_s=0.5))
            j1 = pc.job("j1", wait="running", timeout_ms=20000)
        node1 = j1.pods[0].node_id
        old.proc.send_signal(signal.SIGSTOP)
        try:
            nxt = c.leader(timeout_s=ttl + 8, besides=old)
            new_epoch = healthz(nxt.url)["epoch"]
            assert new_epoch > old_epoch
            until(lambda: all(agent_epoch(a)["epoch"] == new_epoch for a in c.agents), 40,
                  "agents heard the new leader's epoch")
        finally:
            old.proc.send_signal(signal.SIGCONT)
        until(lambda: (h := c.health(old)) is not None and h["role"] == "follower", ttl + 10, "old a follower")
        assert healthz(old.url)["epoch"] == 0     # a follower sends nothing that acts
        for name in c.agents:
            a = c.agents[name]
            status = httpx.get(a.url + "/v1/status", headers=c.read_headers(), timeout=5).json()
            free = [g["uuid"] for g in status["gpus"]["gpus"] if g["uuid"] not in status["gpu_holders"]]
            for ep in (old_epoch, 0):
                p = Placement(placement_id=f"start:late:{ep}:{name}", job_id="late", node_id=name, attempt=1,
                              expires_at=time.time() + 30, argv=["sleep", "1"], epoch=ep,
                              pods=[PodAssignment(workload_id=f"late.1.{ep}", rank=0, gpus=free[:1])])
                r = httpx.post(a.url + "/v1/placements", content=msgspec.json.encode(p),
                               headers=auth_header(placer_token), timeout=5)
                ack = msgspec.convert(r.json(), PlacementAck)
                assert r.status_code == 409 and ack.outcome == "stale_epoch", (name, ep, r.text)
            m = httpx.get(a.url + "/metrics", headers=c.read_headers(), timeout=5).text
            assert value(m, "herd_agent_stale_epoch_total", kind="placement", node=name) == 2
            assert value(m, "herd_agent_placer_epoch", node=name) == new_epoch
        with PlacerClient(c.placer_urls, op, timeout=40, failover_s=30) as pc:
            j1b = pc.job("j1", wait="running", timeout_ms=20000)
        assert j1b.state == "running" and j1b.pods[0].node_id == node1


def test_the_common_answer_is_stamped_once_per_epoch(tmp_path: Path, token_dir: Path) -> None:
    """The state's shared "ok" answer is copied with the epoch once, and that copy is answered
    every time (the framed channel caches an answer's bytes by identity), whatever per-node
    answers come between; a new epoch makes a new copy."""
    from placer.service import PlacerService
    from tests.test_placer_service import cfg

    svc = PlacerService(cfg(tmp_path), TokenSet.load(token_dir))
    svc.own_epoch = 3
    ok = ReportReply(ok=True, heartbeat_interval_s=0.1)
    first = svc._stamped(ok)
    assert first.epoch == 3 and first is not ok
    assert svc._stamped(ReportReply(need_full=True)).epoch == 3
    assert svc._stamped(ReportReply(mac_key=b"k" * 32)).epoch == 3
    assert svc._stamped(ok) is first
    svc.own_epoch = 4
    assert svc._stamped(ok).epoch == 4


async def test_a_relayed_answer_carries_the_epoch_under_the_members_mac(tmp_path, token_dir) -> None:
    """The placer's answer to a report a relay forwarded carries its epoch and that epoch's MAC
    in the member's key (so the member may take it); an answer over the node's own connection
    needs none."""
    from scheduler_link.msgauth import epoch_ok, with_report_mac

    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            link = cl.agents["n0"].link
            assert link is not None
            key = svc.state.mac_key("n0", link.boot_id)
            seq = svc.state.nodes["n0"].last_seq + 1   # (the next in the node's sequence: no await before it goes)
            rep = with_report_mac(key, NodeReport(node_id="n0", boot_id=link.boot_id, seq=seq, full=False,
                                                  manifests=[]))
            status, reply = svc.ingest_relayed(rep, via="n1")
            assert status == 200 and reply.epoch == svc.epoch >= 1
            assert epoch_ok(key, "n0", link.boot_id, svc.epoch, reply.epoch_mac)
            status, own = svc._ingest("n0", msgspec.structs.replace(rep, seq=rep.seq + 1, mac=b""))
            assert status == 200 and own.epoch == svc.epoch and own.epoch_mac == b""
            await cl.c.aclose()
            n.cancel_scope.cancel()
