"""Every route of the agent and the placer against every credential kind (issue 15 §2).

The expectations below are written by hand, route by route: a route added to a daemon
without a rule in ``scheduler_link/authz.py`` fails ``test_served_routes_match_the_table``,
and a rule without an expectation here fails ``test_every_rule_has_an_expectation``."""

from __future__ import annotations

import os

import pytest

from infra.auth import TokenSet, auth_header
from infra.http import HTTPError, Request
from scheduler_link import authz

CREDS = ("none", "wrong", "placer", "node", "operator", "viewer", "metrics")
EVERYONE = frozenset(CREDS)
READERS = frozenset({"viewer", "operator"})
SCRAPERS = frozenset({"metrics", "viewer", "operator"})
OPS = frozenset({"operator"})

AGENT = {
    ("GET", "/healthz"): EVERYONE,
    ("GET", "/readyz"): EVERYONE,
    ("GET", "/metrics"): EVERYONE,              # open_metrics defaults to true
    ("GET", "/openapi.json"): READERS,
    ("GET", "/v1/status"): READERS,
    ("GET", "/v1/gpus"): READERS,
    ("GET", "/v1/workloads"): READERS,
    ("GET", "/v1/workloads/{wid}"): READERS,
    ("GET", "/v1/workloads/{wid}/logs"): READERS,
    ("POST", "/v1/workloads/{wid}/stop"): OPS,
    ("POST", "/v1/gpus/{uuid}/inject"): OPS,
    ("POST", "/v1/placements"): frozenset({"placer", "operator"}),
    ("POST", "/v1/prefetch"): frozenset({"placer", "operator"}),
    ("GET", "/v1/store"): READERS,
    ("POST", "/v1/store/evict"): OPS,
}
PLACER = {
    ("GET", "/healthz"): EVERYONE,
    ("GET", "/metrics"): EVERYONE,
    ("GET", "/openapi.json"): READERS,
    ("POST", "/v1/nodes/{node_id}/report"): frozenset({"node"}),
    ("GET", "/v1/nodes"): READERS,
    ("POST", "/v1/nodes/{node_id}/cordon"): OPS,
    ("POST", "/v1/nodes/{node_id}/uncordon"): OPS,
    ("POST", "/v1/nodes/{node_id}/approve"): OPS,
    ("POST", "/v1/nodes/{node_id}/drain"): OPS,
    ("GET", "/v1/cluster"): READERS,
    ("GET", "/"): EVERYONE,                    # the dashboard's page and assets: static, no data
    ("GET", "/dashboard/{asset}"): EVERYONE,
    ("GET", "/v1/cluster/map"): READERS,
    ("GET", "/v1/cluster/map/node/{row}"): READERS,
    ("GET", "/v1/cluster/map/job/{job_id}"): READERS,
    ("GET", "/v1/gangs/{blob_id}"): frozenset({"node"}),
    ("POST", "/v1/jobs"): OPS,
    ("GET", "/v1/jobs"): READERS,
    ("GET", "/v1/jobs/{job_id}"): READERS,
    ("DELETE", "/v1/jobs/{job_id}"): OPS,
    ("POST", "/v1/jobs/{job_id}/artifact"): OPS,
    ("POST", "/v1/defrag"): OPS,
    ("POST", "/v1/prefetch"): OPS,
    ("GET", "/v1/status"): READERS,
    ("GET", "/v1/approvals"): READERS,
    ("POST", "/v1/pki/bootstrap"): EVERYONE,   # the handler checks the bootstrap token
    ("POST", "/v1/pki/renew"): frozenset({"node"}),
}
EXPECT = {"agent": AGENT, "placer": PLACER}
TOKENS = TokenSet(placer="tp", cluster="tn", operator="to", viewer="tv", metrics="tm")
PRESENT = {"none": None, "wrong": "nope", "placer": "tp", "node": "tn", "operator": "to", "viewer": "tv",
           "metrics": "tm"}


def _req(method: str, cred: str) -> Request:
    # loopback on purpose: the address earns nothing
    return Request(method=method, path="/", query={}, headers=auth_header(PRESENT[cred]), body=b"",
                   client="127.0.0.1")


def _outcome(policy, method: str, cred: str) -> int:
    if policy is None:
        return 200
    try:
        policy(_req(method, cred))
    except HTTPError as e:
        return e.status
    return 200


@pytest.mark.parametrize("daemon", ["agent", "placer"])
def test_every_rule_has_an_expectation(daemon):
    assert {r.key for r in authz.TABLES[daemon]} == set(EXPECT[daemon])


CASES = [(d, r, c) for d in ("agent", "placer") for r in authz.TABLES[d] for c in CREDS]


@pytest.mark.parametrize(("daemon", "rule", "cred"), CASES,
                         ids=[f"{d}-{r.method}-{r.template}-{c}" for d, r, c in CASES])
def test_route_by_credential(daemon, rule, cred):
    want = cred in EXPECT[daemon][rule.key]
    got = _outcome(authz.policy(rule, TOKENS, {"open_metrics": True}), rule.method, cred)
    if want:
        assert got == 200
    else:
        # no credential or an unknown one: 401; a real one without the role: 403
        assert got == (401 if cred in ("none", "wrong") else 403)
    assert authz.allowed(rule, authz.held_roles(TOKENS, PRESENT[cred]), {"open_metrics": True}) == want


def test_flags_open_reads_and_close_metrics():
    rules = {r.key: r for r in authz.AGENT_ROUTES}
    assert authz.policy(rules[("GET", "/v1/status")], TOKENS, {"open_reads": True}) is None
    m = authz.policy(rules[("GET", "/metrics")], TOKENS, {"open_metrics": False})
    assert _outcome(m, "GET", "none") == 401 and _outcome(m, "GET", "metrics") == 200
    # open_reads never opens a write
    assert authz.policy(rules[("POST", "/v1/placements")], TOKENS, {"open_reads": True}) is not None


def test_a_missing_token_file_authenticates_nothing():
    empty = TokenSet(operator="to")
    rules = {r.key: r for r in authz.AGENT_ROUTES}
    assert _outcome(authz.policy(rules[("POST", "/v1/placements")], empty, {}), "POST", "placer") == 401


def test_install_refuses_undeclared_and_unserved_routes():
    from infra.http import App

    async def h(req):  # pragma: no cover - never called
        raise AssertionError

    table = (authz.Rule("GET", "/a", ("viewer",)),)
    with pytest.raises(ValueError, match="without a declared role"):
        authz.install(App(), table, {("GET", "/a"): h, ("GET", "/b"): h}, TOKENS)
    with pytest.raises(ValueError, match="without a handler"):
        authz.install(App(), table, {}, TOKENS)


def test_served_routes_match_the_table(tmp_path, token_dir):
    """What the daemons really serve is what the table declares (both through authz.install)."""
    from agent.api import build_app
    from agent.config import AgentConfig
    from agent.daemon import Agent
    from agent.supervisor import SupervisorConfig
    from placer.config import PlacerConfig
    from placer.service import PlacerService

    agent = Agent(AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "a"),
                              listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                              workloads=SupervisorConfig(shim_pool=0)),
                  env={"PATH": os.environ["PATH"]}, handle_signals=False)
    served = {(r.method, r.template) for r in build_app(agent).routes}
    assert served == {r.key for r in authz.AGENT_ROUTES}
    tokens = TokenSet.load(token_dir)
    for r in build_app(agent).routes:                # the served policies, loopback, no token
        rule = next(x for x in authz.AGENT_ROUTES if x.key == (r.method, r.template))
        req = Request(method=r.method, path="/", query={}, headers={}, body=b"", client="127.0.0.1")
        if r.auth is None:
            assert rule.public or rule.open_flag == "open_metrics"
        else:
            with pytest.raises(HTTPError):
                r.auth(req)
            r.auth(Request(method=r.method, path="/", query={}, body=b"", client="127.0.0.1",
                           headers=auth_header(tokens.operator if "operator" in rule.roles or "viewer" in rule.roles
                                               else tokens.placer)))
    svc = PlacerService(PlacerConfig(listen="127.0.0.1:0", state_dir=str(tmp_path / "p")), TokenSet())
    placer_served = {(r.method, r.template) for r in svc.app.routes}
    assert placer_served == {r.key for r in authz.PLACER_ROUTES}, placer_served ^ {r.key for r in authz.PLACER_ROUTES}


# ---------------------------------------------------------------- certificates (issue 17)
# A TLS daemon sets require_certs: the placer and node roles are proved by certificates only,
# operator/viewer/metrics by a certificate or their token. "wrong CA" and "expired" never reach
# a route: the handshake refuses them (tests/test_tls.py, tests/test_tls_cluster.py), so a
# request that got here without a verified certificate is "no certificate" -- covered by the
# token and none kinds below.
from infra.tls import Principal  # noqa: E402

CERT_KINDS = ("cert:placer", "cert:node", "cert:node-other", "cert:operator", "cert:viewer", "cert:metrics",
              "token:placer", "token:node", "token:operator", "token:viewer", "token:metrics", "none")
TLS_FLAGS = {"open_metrics": True, "require_certs": True}


def _tls_req(method: str, template: str, kind: str) -> Request:
    params = {"node_id": "n1"} if "{node_id}" in template else {}
    how, _, who = kind.partition(":")
    if how == "cert":
        p = Principal("node", "n1" if who == "node" else "n2") if who.startswith("node") else Principal(who)
        return Request(method=method, path="/", query={}, headers={}, body=b"", client="10.0.0.9",
                       params=params, principal=p)
    return Request(method=method, path="/", query={}, headers=auth_header(PRESENT[who] if how == "token" else None),
                   body=b"", client="10.0.0.9", params=params)


def _tls_expect(daemon: str, rule: authz.Rule, kind: str) -> int:
    allowed = EXPECT[daemon][rule.key]
    how, _, who = kind.partition(":")
    if allowed == EVERYONE:
        return 200
    if how == "cert":
        if who == "node-other":
            if "{node_id}" in rule.template:
                return 403                      # node restriction, whatever the route's roles
            who = "node"
        return 200 if who in allowed else 403
    if how == "token" and who not in authz.CERT_ONLY:
        return 200 if who in allowed else 403
    # no credential, or a placer/cluster token that proves nothing under TLS
    return 401


TLS_CASES = [(d, r, k) for d in ("agent", "placer") for r in authz.TABLES[d] for k in CERT_KINDS]


@pytest.mark.parametrize(("daemon", "rule", "kind"), TLS_CASES,
                         ids=[f"{d}-{r.method}-{r.template}-{k}" for d, r, k in TLS_CASES])
def test_route_by_certificate_under_tls(daemon, rule, kind):
    policy = authz.policy(rule, TOKENS, TLS_FLAGS)
    req = _tls_req(rule.method, rule.template, kind)
    try:
        if policy is not None:
            policy(req)
        got = 200
    except HTTPError as e:
        got = e.status
    assert got == _tls_expect(daemon, rule, kind), (got, req.principal)
    if got == 200 and policy is not None:
        assert req.principal is not None   # handlers see who it was


def test_accept_tokens_records_each_token_node_once_per_node():
    use = authz.TokenUse()
    rule = next(r for r in authz.PLACER_ROUTES if r.key == ("POST", "/v1/nodes/{node_id}/report"))
    policy = authz.policy(rule, TOKENS, {"require_certs": False}, use)
    for node in ("a", "b", "a"):
        policy(Request(method="POST", path="/", query={}, headers=auth_header("tn"), body=b"", client="x",
                       params={"node_id": node}))
    assert use.nodes == {"a": 2, "b": 1}
