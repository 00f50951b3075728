"""Transport security end to end (issue 17): a placer over TLS with agents over mutual TLS,
real loopback sockets, and each attack of the issue's list refused with a clear error:
a plain-HTTP client, a certificate from another CA, an expired certificate, a node's
certificate reporting for another node (HTTP, the framed channel, a multi-node connection),
a shared token where a certificate is needed, a push reaching the wrong node's certificate,
a bootstrap token used twice (also across a placer restart) or expired."""

from __future__ import annotations

import datetime as dt
import os
import ssl
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from infra import pki, tls
from infra.auth import TokenSet, auth_header
from infra.http import serve
from placer.service import PlacerService
from scheduler_link import authz
from scheduler_link.agent_link import AgentLink
from scheduler_link.client import ClientError, PlacerClient
from scheduler_link.fanout import PushPool
from scheduler_link.heartbeat_wire import HeartbeatClient, WireError
from scheduler_link.messages import JobSpec, NodeReport
from tests.test_placer_service import FakeAgent, cfg, wait_for


class TLSFakeAgent(FakeAgent):
    """The placer service test's fake agent, over mutual TLS with its node certificate: its
    placements route takes the placer's certificate only (authz with require_certs)."""

    def __init__(self, node_id: str, tokens: TokenSet, ca: pki.ThrowawayPKI, **kw) -> None:
        super().__init__(node_id, tokens, **kw)
        self.files = ca.files(f"node:{node_id}")

    def app(self):
        app = super().app()
        rules = {r.key: r for r in authz.AGENT_ROUTES}
        for r in app.routes:
            r.auth = authz.policy(rules[(r.method, r.template)], self.tokens, {"require_certs": True})
        return app

    async def run(self, placer_url: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with self.cancel:
            async with trio.open_nursery() as n:
                self.url = await n.start(lambda **kw: serve(self.app(), "127.0.0.1:0", **kw,
                                                            ssl_context=tls.server_context(self.files, client_cert="optional")))
                self.link = AgentLink(placer_url, None, self.node_id, self, heartbeat_s=0.1,
                                      ssl_context=tls.client_context(self.files.ca, self.files))
                await n.start(self.link.run)
                task_status.started()


def _secure(tmp: Path, ca: pki.ThrowawayPKI, **kw):
    return cfg(tmp, tls_dir=str(ca.dir), insecure=False, **kw)


def _client(ca: pki.ThrowawayPKI, principal: str | None = None, **kw) -> httpx.AsyncClient:
    ctx = tls.client_context(ca.ca, ca.files(principal) if principal else None)
    return httpx.AsyncClient(verify=ctx, timeout=10, **kw)


async def _start(n: trio.Nursery, tmp: Path, tokens: TokenSet, ca: pki.ThrowawayPKI, agents: int = 2, **kw):
    svc = PlacerService(_secure(tmp, ca, **kw), tokens)
    url = await n.start(svc.run)
    assert url.startswith("https://") and svc.wire_url and svc.wire_url.startswith("tls://")
    fakes = [TLSFakeAgent(f"n{i}", tokens, ca) for i in range(agents)]
    for a in fakes:
        await n.start(a.run, url)
    viewer = _client(ca, base_url=url, headers=auth_header(tokens.viewer))

    async def up() -> bool:
        r = await viewer.get("/v1/nodes")
        return sum(x["state"] == "up" for x in r.json()["nodes"]) == agents
    await wait_for(up)
    return svc, url, fakes, viewer


async def test_cluster_over_mutual_tls_and_operator_token_over_tls(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url, fakes, viewer = await _start(n, tmp_path, tokens, tls_pki)
            # registered over the framed channel, over mutual TLS
            async def on_wire() -> bool:
                return all(a.link is not None and a.link.statistics()["wire_reports"] > 0 for a in fakes)
            await wait_for(on_wire)
            assert svc.wire is not None and svc.wire.statistics()["tls_refused"] == 0
            st = (await viewer.get("/v1/status")).json()
            assert st["tls"] is True and st["insecure"] is False and st["you"] == "viewer (token)"
            # the operator CLI's client: the CA, no client certificate, the operator token over TLS
            ctx = tls.client_context(tls_pki.ca)

            def submit() -> str:
                with PlacerClient(url, tokens.operator, ssl_context=ctx) as c:
                    return c.submit(JobSpec(job_id="j1", pods=2, gpus_per_pod=8, argv=["sleep", "1"])).job_id
            assert await trio.to_thread.run_sync(submit) == "j1"
            r = await viewer.get("/v1/jobs/j1", params={"wait": "running", "timeout_ms": "10000"})
            assert r.json()["state"] == "running"
            # the placements reached the nodes over mutual TLS (the placer's certificate)
            assert sorted(len(a.placements) for a in fakes) == [1, 1]
            # a viewer token reads but does not write
            r = await viewer.post("/v1/jobs", content=b"{}")
            assert r.status_code == 403
            # with the operator's certificate and no token at all
            async with _client(tls_pki, "operator", base_url=url) as op:
                r = await op.get("/v1/status")
                assert r.json()["you"] == "operator (cert)"
                r = await op.delete("/v1/jobs/j1")
                assert r.status_code == 200
            await viewer.aclose()
            n.cancel_scope.cancel()


async def test_attacks_on_the_placer_are_refused(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    other = pki.throwaway(tmp_path / "other-ca", nodes=["n1"])
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc, url, fakes, viewer = await _start(n, tmp_path, tokens, tls_pki)
            def model_of_n1() -> tuple:
                nr = svc.state.nodes["n1"]   # what a forged report would move (not last_seen: n1 beats)
                return (nr.control_url, nr.data_url, nr.boot_id, nr.state, sorted(nr.uuids))
            before = model_of_n1()
            report_n1 = msgspec.json.encode(NodeReport(node_id="n1", boot_id="evil", seq=0, full=True,
                                                       control_url="https://127.0.0.1:1"))
            # 1. a node certificate of n0 cannot report for n1 over HTTP ...
            async with _client(tls_pki, "node:n0", base_url=url) as n0:
                r = await n0.post("/v1/nodes/n1/report", content=report_n1)
                assert r.status_code == 403 and "node:n0; it may not act for node n1" in r.json()["detail"]
            # ... nor open n1's framed channel ...
            n0_ctx = tls.client_context(tls_pki.ca, tls_pki.files("node:n0"))
            with pytest.raises(WireError, match="403 this certificate is node:n0; it may not speak for node n1"):
                await HeartbeatClient.connect(svc.wire_url or "", "", "n1", ssl_context=n0_ctx)
            # ... nor slip n1's report into a multi-node connection of its own
            hc = await HeartbeatClient.connect(svc.wire_url or "", "", "n0", relay=True, ssl_context=n0_ctx)
            wr = await hc.exchange(msgspec.json.decode(report_n1, type=NodeReport))
            assert wr.status == 403 and "may not report for node n1" in (wr.error or "")
            await hc.aclose()
            # nothing changed in the placer's model for n1
            assert model_of_n1() == before
            assert svc.wire is not None and svc.wire.statistics()["wrong_node"] == 2
            # 2. the shared cluster token proves no node over TLS (require_certs)
            async with _client(tls_pki, base_url=url, headers=auth_header(tokens.cluster)) as tok:
                r = await tok.post("/v1/nodes/n1/report", content=report_n1)
                assert r.status_code == 401 and "client certificate" in r.json()["detail"]
            with pytest.raises(WireError, match="closed during TLS set-up"):
                await HeartbeatClient.connect(svc.wire_url or "", tokens.cluster or "", "n1",
                                              ssl_context=tls.client_context(tls_pki.ca))
            # 3. plain HTTP to the TLS port: one clear answer
            plain_url = url.replace("https://", "http://")
            async with httpx.AsyncClient(timeout=5) as plain:
                r = await plain.get(f"{plain_url}/healthz")
                assert r.status_code == 400 and r.json()["error"] == "plain HTTP to a TLS port"

            def plain_cli() -> str:
                with pytest.raises(ClientError) as e, PlacerClient(plain_url, tokens.viewer) as c:
                    c.jobs()
                return str(e.value)
            assert "plain HTTP to a TLS port" in await trio.to_thread.run_sync(plain_cli)
            # ... and plain TCP to the framed channel
            with pytest.raises(WireError, match="speaks TLS only"):
                await HeartbeatClient.connect((svc.wire_url or "").replace("tls://", "tcp://"), "", "n1")
            # 4. a certificate from another CA
            async with httpx.AsyncClient(verify=tls.client_context(tls_pki.ca, other.files("node:n1")),
                                         timeout=5) as foreign:
                with pytest.raises(httpx.HTTPError):
                    await foreign.post(f"{url}/v1/nodes/n1/report", content=report_n1)
            with pytest.raises((tls.TLSError, trio.BrokenResourceError, WireError)):
                await HeartbeatClient.connect(svc.wire_url or "", "", "n1",
                                              ssl_context=tls.client_context(tls_pki.ca, other.files("node:n1")))

            def foreign_cli() -> str:   # a CLI that trusts another CA refuses this placer
                with pytest.raises(ClientError) as e, PlacerClient(
                        url, tokens.viewer, ssl_context=tls.client_context(other.ca)) as c:
                    c.jobs()
                return str(e.value)
            assert "not signed by this cluster's CA" in await trio.to_thread.run_sync(foreign_cli)
            # 5. an expired node certificate
            k, c = pki.CA.load(tls_pki.dir).issue("node:n1", days=1, not_before=pki._now() - dt.timedelta(days=2))
            pki.write_pair(tmp_path / "expired", "node", k, c)
            expired = tls.TLSFiles(tls_pki.ca, tmp_path / "expired/node.crt", tmp_path / "expired/node.key")
            with pytest.raises((tls.TLSError, trio.BrokenResourceError, WireError)):
                await HeartbeatClient.connect(svc.wire_url or "", "", "n1",
                                              ssl_context=tls.client_context(tls_pki.ca, expired))
            assert svc.wire.statistics()["tls_refused"] >= 3
            assert svc.app.tls_refused >= 2
            assert model_of_n1() == before
            await viewer.aclose()
            n.cancel_scope.cancel()


async def test_a_push_to_the_wrong_certificate_is_not_sent(tls_pki):
    got: list[bytes] = []

    async def place(req):
        got.append(req.body)
        from infra.http import json_response
        return json_response({"ok": True})
    from infra.http import App
    app = App()
    app.add("POST", "/v1/placements", place)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(lambda **kw: serve(app, "127.0.0.1:0", **kw,
                                                   ssl_context=tls.server_context(tls_pki.files("node:n0"))))
            pool = PushPool(ssl_context=tls.client_context(tls_pki.ca, tls_pki.files("placer")), retries=2)
            res = await pool.post(url, "/v1/placements", b"{}", key="n1", expect="node:n1")
            assert not res.ok and res.attempts == 1 and "node:n0, not node:n1" in (res.error or "")
            assert got == []
            res = await pool.post(url, "/v1/placements", b"{}", key="n0", expect="node:n0")
            assert res.ok and got == [b"{}"]
            plain = PushPool()
            res = await plain.post(url, "/v1/placements", b"{}", key="n0")
            assert res.status is None and "http://host:port only" in (res.error or "")
            await pool.aclose()
            n.cancel_scope.cancel()


async def test_bootstrap_token_once_across_restarts_and_renewal(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    store = pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json")
    token = store.create(ttl_s=600, now=trio.current_time() * 0 + __import__("time").time())
    old = store.create(ttl_s=1, now=__import__("time").time() - 10)

    def body(node: str) -> bytes:
        return msgspec.json.encode({"node_id": node, "csr": pki.make_csr(node)[1].decode()})
    with trio.fail_after(30):
        for round_ in range(2):   # the second round is a restarted placer: the token stays used
            async with trio.open_nursery() as n:
                svc = PlacerService(_secure(tmp_path, tls_pki, ca_dir=str(tls_pki.dir)), tokens)
                url = await n.start(svc.run)
                async with _client(tls_pki, base_url=url) as anon:
                    r = await anon.post("/v1/pki/bootstrap", content=body("nb"), headers=auth_header(token))
                    if round_ == 0:
                        assert r.status_code == 200, r.text
                        cert = r.json()["cert"]
                        assert "BEGIN CERTIFICATE" in cert
                        (tmp_path / "nb").mkdir()
                        (tmp_path / "nb/node.crt").write_text(cert)
                    else:
                        assert r.status_code == 401 and "already used" in r.json()["detail"]
                    r = await anon.post("/v1/pki/bootstrap", content=body("nc"), headers=auth_header(old))
                    assert r.status_code == 401 and "expired" in r.json()["detail"]
                    r = await anon.post("/v1/pki/bootstrap", content=body("nc"))
                    assert r.status_code == 401
                    # renewal needs the node's own certificate and names that node only
                    r = await anon.post("/v1/pki/renew", content=body("n0"))
                    assert r.status_code == 401
                async with _client(tls_pki, "node:n0", base_url=url) as n0:
                    r = await n0.post("/v1/pki/renew", content=body("n1"))
                    assert r.status_code == 403 and "may not renew node n1" in r.json()["detail"]
                    r = await n0.post("/v1/pki/renew", content=body("n0"))
                    assert r.status_code == 200
                n.cancel_scope.cancel()


async def test_accept_tokens_admits_and_lists_token_agents(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(_secure(tmp_path, tls_pki, accept_tokens=True), tokens)
            url = await n.start(svc.run)
            report = msgspec.json.encode(NodeReport(node_id="legacy", boot_id="b", seq=0, full=True,
                                                    control_url="https://127.0.0.1:1"))
            async with _client(tls_pki, base_url=url, headers=auth_header(tokens.cluster)) as tok:
                r = await tok.post("/v1/nodes/legacy/report", content=report)
                assert r.status_code == 200, r.text
            hc = await HeartbeatClient.connect(svc.wire_url or "", tokens.cluster or "", "legacy2",
                                               ssl_context=tls.client_context(tls_pki.ca))
            await hc.aclose()
            async with _client(tls_pki, base_url=url, headers=auth_header(tokens.viewer)) as v:
                st = (await v.get("/v1/status")).json()
            assert st["accept_tokens"] is True and set(st["token_agents"]) == {"legacy", "legacy2"}
            n.cancel_scope.cancel()


async def test_real_agent_over_mutual_tls(tmp_path, token_dir, tls_pki):
    """The real agent daemon: TLS control API, mutual TLS to the placer, a job pushed to it."""
    tokens = TokenSet.load(token_dir)
    node_dir = tls_pki.node_dir("a1")
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            svc = PlacerService(_secure(tmp_path, tls_pki), tokens)
            url = await n.start(svc.run)
            agent = Agent(AgentConfig(node_id="a1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "a1"),
                                      listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                                      placer=url, heartbeat_s=0.2, tls_dir=str(node_dir), insecure=False,
                                      workloads=SupervisorConfig(shim_pool=0)),
                          env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)
            control = await n.start(agent.run)
            assert control.startswith("https://")
            async with _client(tls_pki, base_url=url, headers=auth_header(tokens.operator)) as op:
                async def up() -> bool:
                    r = await op.get("/v1/nodes")
                    return any(x["state"] == "up" for x in r.json()["nodes"])
                with trio.fail_after(20):
                    await wait_for(up)
                r = await op.post("/v1/jobs", content=msgspec.json.encode(
                    JobSpec(job_id="t1", pods=1, gpus_per_pod=1, argv=["sleep", "30"])))
                assert r.status_code == 201, r.text
                r = await op.get("/v1/jobs/t1", params={"wait": "running", "timeout_ms": "20000"})
                assert r.json()["state"] == "running", r.text
            # the agent's API: the operator token over TLS reads; the placer token alone places nothing
            async with _client(tls_pki, base_url=control) as c:
                st = (await c.get("/v1/status", headers=auth_header(tokens.viewer))).json()
                assert st["security"]["tls"] is True
                r = await c.post("/v1/placements", content=b"{}", headers=auth_header(tokens.placer))
                assert r.status_code == 401
            async with _client(tls_pki, "node:n9", base_url=control) as other_node:
                r = await other_node.post("/v1/placements", content=b"{}")
                assert r.status_code == 403
            n.cancel_scope.cancel()


def test_insecure_shows_and_tls_without_material_is_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HERD_INSECURE", raising=False)
    with pytest.raises(tls.TLSError, match="TLS CA certificate not found.*or set insecure = true"):
        PlacerService(cfg(tmp_path, tls_dir=str(tmp_path / "none")), TokenSet())
    svc = PlacerService(cfg(tmp_path, insecure=True), TokenSet())
    assert svc.security.status()["insecure"] is True
    assert "INSECURE" in caplog.text


def test_client_contexts_check_only_our_ca(tls_pki):
    ctx = tls.client_context(tls_pki.ca)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3 and ctx.verify_mode == ssl.CERT_REQUIRED
    sctx = tls.server_context(tls_pki.files("placer"), client_cert="optional")
    assert sctx.verify_mode == ssl.CERT_OPTIONAL


async def test_the_cli_refuses_a_node_posing_as_the_placer(tls_pki):
    """A node's certificate is signed by the same CA and may carry the placer host's address:
    the CLI checks the principal, not only the chain and the name."""
    from infra.http import App, json_response

    async def jobs(req):
        return json_response({"jobs": [], "total": 0, "offset": 0})
    app = App()
    app.add("GET", "/v1/jobs", jobs)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            url = await n.start(lambda **kw: serve(app, "127.0.0.1:0", **kw,
                                                   ssl_context=tls.server_context(tls_pki.files("node:n0"),
                                                                                  client_cert="optional")))

            def ask() -> str:
                with pytest.raises(ClientError) as e, PlacerClient(
                        url, "tok", ssl_context=tls.client_context(tls_pki.ca)) as c:
                    c.jobs()
                return str(e.value)
            assert "certificate of node:n0, not of the placer" in await trio.to_thread.run_sync(ask)
            n.cancel_scope.cancel()


async def test_agent_bootstraps_then_renews_its_certificate(tmp_path, token_dir, tls_pki):
    """agent.certs against a real placer: a bootstrap token buys the first certificate (kept in
    the state dir, preferred over the configured dir's), renewal over it buys the next."""
    from agent import certs
    tokens = TokenSet.load(token_dir)
    host_dir = tmp_path / "host-tls"
    host_dir.mkdir()
    (host_dir / "ca.crt").write_bytes(tls_pki.ca.read_bytes())   # all a new host gets: the CA
    token_file = tmp_path / "bootstrap.token"
    token_file.write_text(pki.BootstrapTokens(tls_pki.dir / "bootstrap-tokens.json").create(
        ttl_s=600, node_id="fresh", now=__import__("time").time()) + "\n")
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            svc = PlacerService(_secure(tmp_path, tls_pki, ca_dir=str(tls_pki.dir)), tokens)
            url = await n.start(svc.run)
            acfg = AgentConfig(node_id="fresh", state_dir=str(tmp_path / "state"), placer=url, insecure=False,
                               tls_dir=str(host_dir), tls_bootstrap_token=str(token_file))
            assert certs.security_for(acfg) is None            # no certificate yet: bootstrap pending
            sec = await certs.bootstrap_security(acfg)
            assert sec.files is not None and sec.files.cert == tmp_path / "state/tls/node.crt"
            assert certs.node_files(acfg.tls_dir, acfg.state_dir).cert == sec.files.cert
            first = pki.load_cert(sec.files.cert)
            assert "CN=node:fresh" in first.subject.rfc4514_string()
            # the token is spent: a second bootstrap is refused with the reason
            with pytest.raises(Exception, match="already used"):
                await certs.bootstrap_security(acfg)
            # renewal over the bootstrapped certificate (mutual TLS), loaded into the live contexts
            assert await certs.renew(sec, url, "fresh", acfg.state_dir)
            second = pki.load_cert(sec.files.cert)
            assert second.serial_number != first.serial_number
            hc = await HeartbeatClient.connect(svc.wire_url or "", "", "fresh", ssl_context=sec.client)
            await hc.aclose()
            assert svc.pki.issued == {"bootstrap": 1, "renew": 1, "refused": 1}
            n.cancel_scope.cancel()
