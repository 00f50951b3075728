"""Identity attacks of issue 42 as tests: a real placer and agents on loopback over mutual TLS,
one of them hostile (a host with a valid certificate of this cluster's CA).

* finding 4 -- a server holding a node certificate collects no secret: the placer's client, the
  daemon client and the bootstrap client check the principal inside the handshake and send
  nothing; the operator acts on agents with its certificate, never the fleet-wide token;
* finding 5 -- a leaked unbound bootstrap token does not mint the certificate of a node that
  holds a live one; the token is checked before the CA key or the store's lock;
* revocation -- ``herd pki revoke`` denies a node at every handshake (placer API, framed
  channel, peers' data planes both ways), at bootstrap, and fences it like a lost node; the
  agents hear of it within a heartbeat."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from agent import certs
from agent.errors import AgentError
from infra import pki, tls
from infra.auth import TokenSet, auth_header
from infra.http import App, Request, Response, json_response, serve
from p2p.dataplane import DataPlane
from p2p.store import ChunkStore
from placer.service import PlacerService
from scheduler_link.agent_link import AgentLink
from scheduler_link.client import ClientError, PlacerClient
from scheduler_link.daemon_client import DaemonClient
from scheduler_link.heartbeat_wire import HeartbeatClient, WireError
from scheduler_link.messages import JobSpec, NodeReport, RestartPolicy
from testing.waiting import poll
from tests.test_placer_service import cfg, wait_for
from tests.test_tls_cluster import TLSFakeAgent

DATA_TOKEN = "cluster-data-token"


async def _until(pred) -> None:  # noqa: ANN001
    """``pred`` polled (servers' counters without a hook); bounded here or by the caller."""
    with trio.fail_after(5):
        await poll(pred, 0.02)


class Listener:
    """A hostile TLS server: any certificate of the cluster's CA; records every byte a client
    sends after the handshake (it answers nothing)."""

    def __init__(self, ctx: tls.HerdContext) -> None:
        self.ctx = ctx
        self.received: list[bytes] = []
        self.port = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(f"https://127.0.0.1:{self.port}")
        await trio.serve_listeners(self._one, listeners)

    async def _one(self, stream: trio.SocketStream) -> None:
        s = await tls.server_handshake(stream, self.ctx, 5.0)
        got = b""
        if not isinstance(s, tls.HandshakeFailed):
            with trio.move_on_after(1.0):
                try:
                    while data := await s.receive_some(65536):
                        got += data
                except trio.BrokenResourceError:
                    pass
        self.received.append(got)
        await trio.aclose_forcefully(stream)


# ------------------------------------------------------------------ finding 4

async def test_the_peer_client_sends_the_cluster_token_to_nodes_only(tls_pki):
    """A data-plane 'peer' at a node's data URL holding a certificate of this CA that is not a
    node's (here the viewer's): the herd's peer client sends it no request and no token."""
    from p2p.errors import PeerError
    from p2p.peers import PeerClient
    hostile = Listener(tls.server_context(tls_pki.files("viewer"), client_cert="optional"))
    client = PeerClient(token=DATA_TOKEN, ssl_context=tls.client_context(tls_pki.ca, tls_pki.files("node:n1")))
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            url = await n.start(hostile.run)
            with pytest.raises(PeerError, match="viewer, not node"):
                await client.get_chunk(url, "ab" * 32, 10)
            await _until(lambda: len(hostile.received) == 1)
            await client.aclose()
            n.cancel_scope.cancel()
    assert hostile.received == [b""]


async def test_clients_send_nothing_to_a_certificate_of_the_wrong_principal(tmp_path, tls_pki):
    """A host with a node certificate at the placer's (or another node's) address: the CLI's
    placer client, the daemon client and the agent's bootstrap send no request, no token and
    no job env; each fails with one line naming who answered."""
    hostile = Listener(tls.server_context(tls_pki.files("node:n0"), client_cert="optional"))
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(hostile.run)

            def placer_cli() -> str:
                with pytest.raises(ClientError) as e, PlacerClient(url, "OPERATOR-SECRET",
                                                                   tls_dir=tls_pki.dir, timeout=5) as c:
                    c.submit(JobSpec(job_id="j", env={"K": "ENV-SECRET"}))
                return str(e.value)
            assert "node:n0, not placer" in await trio.to_thread.run_sync(placer_cli)

            def daemon_cli() -> str:
                with pytest.raises(ClientError) as e, DaemonClient(
                        url, "agent", timeout=5, expect="node:n1", tls_dir=tls_pki.dir,
                        headers={"x-secret": "HEADER-SECRET"}) as c:
                    c.send("POST", "/v1/placements", content=b'{"env": {"K": "ENV-SECRET"}}')
                return str(e.value)
            assert "node:n0, not node:n1" in await trio.to_thread.run_sync(daemon_cli)

            with pytest.raises(AgentError, match="node:n0, not placer"):
                await certs.bootstrap(url, "n9", "hb1.BOOTSTRAP-SECRET", configured_dir=str(tls_pki.dir),
                                      state_dir=tmp_path / "state")
            await _until(lambda: len(hostile.received) == 3)
            n.cancel_scope.cancel()
    assert hostile.received == [b"", b"", b""]


async def test_operators_act_on_agents_with_their_certificate_never_the_fleet_token(tmp_path, token_dir, tls_pki,
                                                                                   monkeypatch, capsys):
    """A compromised agent (its own valid certificate) that the operator stops a workload on, and
    asks the status of: it sees the operator's certificate in the handshake (nothing it can
    replay) and no bearer token."""
    from cli.main import main
    seen: list[tuple[str, str, dict[str, str], str | None]] = []

    async def record(req: Request) -> Response:
        seen.append((req.method, req.path, dict(req.headers), str(req.principal) if req.principal else None))
        if req.path.endswith("/stop"):
            return json_response({"workload_id": "w1", "state": "terminating"})
        if req.path == "/v1/status":
            return json_response({"node_id": "n0", "ready": True, "gpus": {"gpus": []}, "workloads": [],
                                  "control_url": "", "topology": {}})
        return json_response({"workload_id": "w1", "job_id": "j", "state": "running"})
    app = App()
    for method, path in (("GET", "/v1/workloads/{wid}"), ("POST", "/v1/workloads/{wid}/stop"), ("GET", "/v1/status")):
        app.add(method, path, record)
    monkeypatch.setenv("HERD_TLS_DIR", str(tls_pki.dir))
    monkeypatch.setenv("HERD_TOKEN_DIR", str(token_dir))
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url = await n.start(lambda **kw: serve(app, "127.0.0.1:0", **kw, ssl_context=tls.server_context(
                tls_pki.files("node:n0"), client_cert="optional")))
            rc = await trio.to_thread.run_sync(main, ["agent", "stop", "--agent", url, "w1"])
            assert rc == 0
            rc = await trio.to_thread.run_sync(main, ["status", "--agent", url, "--json"])
            assert rc == 0
            n.cancel_scope.cancel()
    assert [(m, p) for m, p, _, _ in seen] == [("GET", "/v1/workloads/w1"), ("POST", "/v1/workloads/w1/stop"),
                                               ("GET", "/v1/status")]
    tokens = TokenSet.load(token_dir)
    for _, _, headers, who in seen:
        assert "authorization" not in headers
        assert tokens.operator not in repr(headers)
        assert who == "operator (cert)"


# ------------------------------------------------------------------ finding 5

def _csr_body(node: str) -> bytes:
    return msgspec.json.encode({"node_id": node, "csr": pki.make_csr(node)[1].decode()})


async def test_a_leaked_unbound_token_does_not_mint_a_live_nodes_identity(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    tls_pki.node_dir("n1")                                   # n1 holds a live certificate
    store = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json")
    leaked = store.create(ttl_s=600, node_id=None, now=time.time())   # made with --any-node
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir)),
                                tokens)
            url = await n.start(svc.run)
            async with httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, expect="placer"), base_url=url,
                                         timeout=10) as anon:
                r = await anon.post("/v1/pki/bootstrap", content=_csr_body("n1"), headers=auth_header(leaked))
                assert r.status_code == 409 and "holds a live certificate" in r.json()["detail"], r.text
                # the refusal did not spend the token: a new node still gets its certificate
                r = await anon.post("/v1/pki/bootstrap", content=_csr_body("n9"), headers=auth_header(leaked))
                assert r.status_code == 200, r.text
                # ... and n9 now holds a live one: a second token for it is refused as well
                again = store.create(ttl_s=600, node_id="n9", now=time.time())
                r = await anon.post("/v1/pki/bootstrap", content=_csr_body("n9"), headers=auth_header(again))
                assert r.status_code == 409
            n.cancel_scope.cancel()


def test_bootstrap_tokens_are_bound_to_a_node_unless_asked(tmp_path, tls_pki, capsys):
    from cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["pki", "bootstrap-token", str(tls_pki.dir)])
    assert e.value.code == 2 and "--node" in capsys.readouterr().err
    assert main(["pki", "bootstrap-token", str(tls_pki.dir), "--node", "gpu-7"]) == 0
    assert main(["pki", "bootstrap-token", str(tls_pki.dir), "--any-node"]) == 0
    capsys.readouterr()
    listed = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json").list()
    assert sorted(str(t["node_id"]) for t in listed) == ["None", "gpu-7"]


async def test_a_wrong_bootstrap_token_costs_neither_the_lock_nor_the_ca_key(tmp_path, token_dir, tls_pki):
    """The store's lock held elsewhere (the CLI adding a token) and the CA key unreadable: a
    wrong token is still refused at once, with 401."""
    tokens = TokenSet.load(token_dir)
    pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json").create(ttl_s=600, node_id="n5", now=time.time())
    lock_fd = os.open(tls_pki.dir / "bootstrap-tokens.json.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    release = threading.Timer(2.0, lambda: os.close(lock_fd))   # (bounds the wait of a placer that blocks)
    release.start()
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False,
                                        ca_dir=str(tls_pki.dir)), tokens)
                url = await n.start(svc.run)
                async with httpx.AsyncClient(verify=tls.client_context(tls_pki.ca), base_url=url, timeout=10) as c:
                    t0 = time.monotonic()
                    r = await c.post("/v1/pki/bootstrap", content=_csr_body("n5"), headers=auth_header("hb1.wrong"))
                    assert r.status_code == 401 and "unknown bootstrap token" in r.json()["detail"]
                    assert time.monotonic() - t0 < 1.0
                    (tls_pki.dir / "ca.key").rename(tmp_path / "ca.key.away")
                    r = await c.post("/v1/pki/bootstrap", content=_csr_body("n5"), headers=auth_header("hb1.wrong"))
                    assert r.status_code == 401, r.text
                n.cancel_scope.cancel()
    finally:
        release.join()


# ------------------------------------------------------------------ revocation

class Node(TLSFakeAgent):
    """A fake agent whose TLS set-up is the daemon's (one deny-list shared by its control API,
    its data plane and its client), serving a real data plane."""

    def __init__(self, node_id: str, tokens: TokenSet, ca: pki.ThrowawayPKI, store_dir: Path) -> None:
        super().__init__(node_id, tokens, ca)
        self.sec = tls.daemon_security(None, "node", insecure=False, files=self.files)
        self.plane = DataPlane(ChunkStore(store_dir), token=DATA_TOKEN, ssl_context=self.sec.channel)
        self.data_url = ""

    async def run(self, placer_url: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel:
            async with trio.open_nursery() as n:
                self.url = await n.start(lambda **kw: serve(self.app(), "127.0.0.1:0", **kw, ssl_context=self.sec.api))
                self.data_url = await n.start(self.plane.run)
                self.link = AgentLink(placer_url, None, self.node_id, self, heartbeat_s=0.1,
                                      ssl_context=self.sec.client)
                await n.start(self.link.run)
                task_status.started()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def _refused(ctx: tls.HerdContext, url: str) -> bool:
    try:
        s = await tls.connect("127.0.0.1", _port(url), ctx)
    except (tls.TLSError, OSError):
        return True
    # TLS 1.3: the server's verdict on our certificate comes after our side's handshake
    try:
        await s.send_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        return not await s.receive_some(100)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return True
    finally:
        await s.aclose()


async def test_a_revoked_node_is_refused_everywhere_and_fenced(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            # lost only after 10 s of silence, fenced 30 s later: what happens sooner is revocation
            svc = PlacerService(cfg(tmp_path, tls_dir=str(tls_pki.dir), insecure=False, ca_dir=str(tls_pki.dir),
                                    lost_after_missed=100, fence_after_s=30.0), tokens)
            url = await n.start(svc.run)
            nodes = [Node(f"n{i}", tokens, tls_pki, tmp_path / f"store{i}") for i in range(2)]
            for a in nodes:
                await n.start(a.run, url)
            op = httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, tls_pki.files("operator"),
                                                             expect="placer"), base_url=url, timeout=10)

            async def up() -> bool:
                return sum(x["state"] == "up" for x in (await op.get("/v1/nodes")).json()["nodes"]) == 2
            await wait_for(up)
            r = await op.post("/v1/jobs", content=msgspec.json.encode(JobSpec(
                job_id="j1", pods=1, gpus_per_pod=8, argv=["x"], restart=RestartPolicy(kind="on-preemption"))))
            assert r.status_code == 201, r.text
            r = await op.get("/v1/jobs/j1", params={"wait": "running", "timeout_ms": "10000"})
            assert r.json()["state"] == "running"
            bad, good = sorted(nodes, key=lambda a: not a.placements)
            assert bad.placements and not good.placements
            third = tls.client_context(tls_pki.ca, tls_pki.files("node:n2"))
            bad_ctx = tls.client_context(tls_pki.ca, bad.files)
            assert not await _refused(bad_ctx, good.data_url)              # before: a peer like any other
            kept = httpx.AsyncClient(verify=bad_ctx, headers=auth_header(DATA_TOKEN), timeout=10)
            assert (await kept.get(f"{good.data_url}/v1/stats")).status_code == 200   # a connection kept open
            assert svc.wire_url is not None   # and a framed connection to the placer, opened before
            held = await HeartbeatClient.connect(svc.wire_url, "", bad.node_id, ssl_context=bad_ctx)

            t0 = time.monotonic()
            assert pki.Revocations(tls_pki.dir).revoke(bad.node_id, now=time.time())   # herd pki revoke
            # the placer: fenced like a lost node at once (the job moves), and its handshakes refused
            await _until(lambda: bool(good.placements))
            r = await op.get("/v1/nodes")
            assert {x["node_id"]: x["state"] for x in r.json()["nodes"]}[bad.node_id] == "lost"
            assert time.monotonic() - t0 < 5.0
            assert await _refused(bad_ctx, url)
            assert svc.wire_url is not None
            with pytest.raises((WireError, tls.TLSError, OSError)):
                await HeartbeatClient.connect(svc.wire_url, "", bad.node_id, ssl_context=bad_ctx)
            # the one it opened before is closed (not left open until it goes away by itself)
            with pytest.raises((WireError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)):
                await held.exchange(NodeReport(node_id=bad.node_id, boot_id="b", seq=1, full=False))
            assert svc.wire is not None and svc.wire.revoked_closed == 2   # (this one and its agent's link)
            await held.aclose()
            # the other agent hears of it within a heartbeat; its data plane refuses the revoked
            # node both ways, and still serves the others
            with trio.fail_after(2):
                await _until(lambda: bad.node_id in good.sec.revoked.nodes)
            assert await _refused(bad_ctx, good.data_url)
            assert not await _refused(third, good.data_url)
            assert await _refused(good.sec.client, bad.data_url)
            with pytest.raises(httpx.HTTPError):       # the open connection: closed at its next request
                await kept.get(f"{good.data_url}/v1/stats")
            assert good.plane.statistics()["revoked_closed"] == 1
            await kept.aclose()
            # bootstrap (even with a token bound to it) and renewal give it nothing
            tok = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json").create(
                ttl_s=600, node_id=bad.node_id, now=time.time())
            r = await op.post("/v1/pki/bootstrap", content=_csr_body(bad.node_id), headers=auth_header(tok))
            assert r.status_code == 403 and "revoked" in r.json()["detail"]
            await op.aclose()
            n.cancel_scope.cancel()


def test_revoke_cli_denies_the_node_and_its_serials(tmp_path, tls_pki, capsys):
    from cli.main import main
    cert = pki.load_cert(tls_pki.node_dir("gpu-1") / "node.crt")
    assert main(["pki", "revoke", str(tls_pki.dir), "gpu-1"]) == 0
    nodes, serials = pki.Revocations(tls_pki.dir).load()
    assert nodes == {"gpu-1"} and pki.serial_hex(cert) in serials
    assert main(["pki", "revoke", str(tls_pki.dir), "gpu-1", "--undo"]) == 0
    nodes, serials = pki.Revocations(tls_pki.dir).load()
    assert nodes == frozenset() and pki.serial_hex(cert) in serials   # that certificate stays dead
    assert main(["pki", "revoke", str(tls_pki.dir), "gpu-1"]) == 0
    capsys.readouterr()
    assert main(["pki", "status", str(tls_pki.dir)]) == 0
    assert "revoked: nodes gpu-1" in capsys.readouterr().out
    deny = tls.Revoked()
    deny.replace(nodes, serials)
    # getpeercert() writes whole bytes (a leading zero is possible): the same serial either way
    assert deny.refuses({"serialNumber": "0" + pki.serial_hex(cert)}) is not None


def test_two_bootstraps_of_one_node_at_once_record_one_certificate(tls_pki):
    """The live-certificate check and the record are one step under the store's lock: of two
    bootstraps of a node that passed the first check together, the second is not recorded
    (and its certificate is never returned)."""
    ca = pki.CA.load(tls_pki.dir)
    issued = pki.Issued(tls_pki.dir)
    none_denied = (frozenset(), frozenset())
    _, first = ca.issue("node:racer")
    _, second = ca.issue("node:racer")
    assert issued.record("racer", first, now=time.time(), unless_live=none_denied) == []
    assert issued.record("racer", second, now=time.time(), unless_live=none_denied) == [pki.serial_hex(first)]
    assert [s for s, _ in issued.of("racer", now=time.time())] == [pki.serial_hex(first)]
    # once that certificate is revoked, the node may be bootstrapped again
    revoked = (frozenset(), frozenset({pki.serial_hex(first)}))
    assert issued.record("racer", second, now=time.time(), unless_live=revoked) == []
