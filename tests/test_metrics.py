"""/metrics of a real agent and a real placer, as Prometheus's own tools read them:
``promtool check metrics`` (Debian package ``prometheus``; skipped where it is absent) and
``prometheus_client.parser``; exact counters; histograms; one registry per daemon; the
Grafana dashboard names only metrics herd serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import msgspec
import prometheus_client
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from agent.config import replace
from infra.auth import TokenSet, auth_header
from infra.metrics import LATENCY_BUCKETS, LatencyHistogram, histogram, text_of
from p2p.herd import render_metrics as render_p2p
from placer.service import PlacerService
from scheduler_link.messages import JobSpec
from testing.waiting import poll
from tests.prom import samples, types, value

from .test_agent_api import make_agent, wait_state
from .test_placer_service import cfg as placer_cfg

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "contrib" / "grafana-herd.json"


async def cluster_scrapes(tmp_path: Path, token_dir: Path) -> dict[str, str]:
    """The /metrics of a real placer and a real agent (simulated GPUs, data plane, reporting
    to the placer) while a job the placer placed holds two of the agent's GPUs."""
    tokens = TokenSet.load(token_dir)
    svc = PlacerService(placer_cfg(tmp_path / "p", lost_after_missed=100), tokens)   # (a loaded host: never "lost")
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            purl = await n.start(svc.run)
            agent = make_agent(tmp_path / "a", token_dir)
            agent.config = replace(agent.config, data_listen="127.0.0.1:0", placer=purl, heartbeat_s=0.1)
            aurl = await n.start(agent.run)
            async with httpx.AsyncClient(base_url=purl, headers=auth_header(tokens.operator)) as pc, \
                    httpx.AsyncClient(base_url=aurl, headers=auth_header(tokens.viewer)) as ac:
                async def n1_up() -> bool:
                    return any(x["node_id"] == "n1" and x["state"] == "up"
                               for x in (await pc.get("/v1/nodes")).json()["nodes"])

                with trio.fail_after(10):
                    await poll(n1_up, 0.05)
                r = await pc.post("/v1/jobs", content=msgspec.json.encode(
                    JobSpec(job_id="job-a", pods=1, gpus_per_pod=2, argv=["sleep", "30"], grace_s=0.5)))
                assert r.status_code in (200, 201, 202), r.text
                r = await pc.get("/v1/jobs/job-a", params={"wait": "running"})
                assert r.json()["state"] == "running", r.text
                wid = r.json()["pods"][0]["workload_id"]
                await wait_state(ac, wid, "running")
                out = {"agent": (r := await ac.get("/metrics")).text, "placer": (await pc.get("/metrics")).text,
                       "workload": wid}
                assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
                await pc.delete("/v1/jobs/job-a")
            n.cancel_scope.cancel()
    return out


@pytest.fixture
async def scrapes(tmp_path: Path, token_dir: Path) -> dict[str, str]:
    return await cluster_scrapes(tmp_path, token_dir)


def check_families(text: str) -> None:
    """Every family has HELP and TYPE, and parses."""
    helps = set(re.findall(r"^# HELP (\S+) \S", text, re.M))
    typed = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    assert helps == typed and typed
    for fam in text_string_to_metric_families(text):
        assert fam.documentation, fam.name


async def test_agent_metrics_parse_and_carry_node_and_holder(scrapes):
    text = scrapes["agent"]
    check_families(text)
    got = samples(text)
    herd = [(n, dict(lb)) for (n, lb) in got if n.startswith("herd_")]
    assert herd and all(lb.get("node") == "n1" for _, lb in herd), [n for n, lb in herd if "node" not in lb]
    assert value(text, "herd_build_info", node="n1", service="agent") == 1
    info = next(dict(lb) for (n, lb) in got if n == "herd_build_info")
    assert set(info) >= {"version", "wire_version", "python"}
    assert value(text, "process_resident_memory_bytes") > 0
    # the GPUs w1 holds say so (dcgm-exporter's labels plus workload and job), the others are free
    held = [dict(lb) for (n, lb) in got if n == "DCGM_FI_DEV_GPU_TEMP" and dict(lb)["workload"] == scrapes["workload"]]
    assert len(held) == 2 and all(lb["job"] == "job-a" for lb in held)
    free = [dict(lb) for (n, lb) in got if n == "DCGM_FI_DEV_GPU_TEMP" and dict(lb)["workload"] == ""]
    assert len(free) == 6 and all(lb["job"] == "" for lb in free)
    for lb in held + free:
        assert {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "node", "simulated"} <= set(lb)
        assert lb["simulated"] == "true"
    # the start is in the histogram (buckets 100 us .. 100 s, +Inf)
    assert value(text, "herd_workload_start_seconds_count", fetch="false") == 1
    les = [dict(lb)["le"] for (n, lb) in got if n == "herd_workload_start_seconds_bucket"
           and dict(lb)["fetch"] == "false"]
    assert les[0] == "0.0001" and "100.0" in les and les[-1] == "+Inf"
    assert types(text)["herd_fetch_seconds"] == "histogram"
    assert types(text)["herd_workload_starts"] == "counter"


async def test_placer_metrics_parse(scrapes):
    text = scrapes["placer"]
    check_families(text)
    t = types(text)
    for name in ("herd_placer_decision_seconds", "herd_placement_delivery_seconds"):
        assert t[name] == "histogram"
        assert value(text, name + "_count") >= 1, name
    assert "quantile" not in text
    assert value(text, "herd_placer_nodes", state="up") == 1
    assert value(text, "herd_placer_gpus") == 8 and value(text, "herd_placer_gpus_allocated") == 2
    assert "herd_placer_gpus_gpus" not in text
    assert value(text, "herd_placer_decisions_total") >= 1
    assert value(text, "herd_build_info", service="placer") == 1


# What promtool says about dcgm-exporter's own names, kept on purpose so dashboards work:
# its label names (UUID, modelName, Hostname) and a counter named ..._COUNTER.
DCGM_REMARKS = (re.compile(r"DCGM_\w+ label names should be written in 'snake_case' not 'camelCase'"),
                re.compile(r"DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'"))


def promtool(text: str) -> tuple[int, list[str]]:
    r = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    return r.returncode, [ln for ln in (r.stdout + r.stderr).decode().splitlines() if ln.strip()]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (Debian package prometheus)")
async def test_promtool_check_metrics(scrapes):
    rc, out = promtool(scrapes["placer"])
    assert rc == 0 and out == [], out
    rc, out = promtool(scrapes["agent"])
    others = [ln for ln in out if not any(p.fullmatch(ln) for p in DCGM_REMARKS)]
    assert others == [], others          # nothing about herd_* or process_* series
    # with the dcgm-exporter series left out, promtool has nothing to say at all
    ours = "".join(ln + "\n" for ln in scrapes["agent"].splitlines()
                   if not re.match(r"(# (HELP|TYPE) )?DCGM_", ln))
    rc, out = promtool(ours)
    assert rc == 0 and out == [], out


def test_counters_round_trip_exactly_up_to_2_pow_53():
    for n in (0, 1, 14752849, 10**12 + 7, 2**53 - 1, 2**53):
        text = render_p2p("n", {"bytes_from_origin": n, "bytes_from_peers": n - 1 if n else 0})
        got = value(text, "herd_p2p_bytes_total", node="n", source="origin")
        assert got == n and int(got) == n, (n, got)
    # beyond 2**53 a float (what prometheus_client writes) rounds: said in infra/metrics.py
    text = render_p2p("n", {"bytes_from_origin": 2**53 + 1})
    assert value(text, "herd_p2p_bytes_total", source="origin") == 2**53


def test_histogram_buckets_and_counts():
    assert LATENCY_BUCKETS[0] == 1e-4 and LATENCY_BUCKETS[-1] == 100.0
    h = LatencyHistogram()
    for v in (1e-4, 3e-4, 0.7, 100.0, 250.0):
        h.observe(v)
    text = text_of([histogram("herd_x_seconds", "x", [({"node": "n"}, h)])])
    assert value(text, "herd_x_seconds_bucket", le="0.0001") == 1      # le is inclusive
    assert value(text, "herd_x_seconds_bucket", le="0.0005") == 2
    assert value(text, "herd_x_seconds_bucket", le="1.0") == 3
    assert value(text, "herd_x_seconds_bucket", le="100.0") == 4
    assert value(text, "herd_x_seconds_bucket", le="+Inf") == 5 == value(text, "herd_x_seconds_count")
    assert value(text, "herd_x_seconds_sum") == pytest.approx(350.7004)


async def test_each_daemon_has_its_own_registry(tmp_path, token_dir):
    """Two agents in one process: each scrape shows its own node only, and nothing of
    herd's lands in prometheus_client's global default registry."""
    from agent.metrics import AgentMetrics

    a1, a2 = make_agent(tmp_path / "1", token_dir), make_agent(tmp_path / "2", token_dir)
    a2.node_id = "n2"
    m1, m2 = AgentMetrics(a1), AgentMetrics(a2)
    assert m1.registry is not m2.registry
    t1, t2 = m1.render().decode(), m2.render().decode()
    assert {dict(lb).get("node") for (n, lb) in samples(t1) if n.startswith("herd_")} == {"n1"}
    assert {dict(lb).get("node") for (n, lb) in samples(t2) if n.startswith("herd_")} == {"n2"}
    glob = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "herd_" not in glob


# ---------------------------------------------------------------- Grafana dashboard

_PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "by", "without", "on", "ignoring", "group_left", "group_right",
    "histogram_quantile", "max", "min", "avg", "count", "topk", "bottomk", "le", "and", "or", "unless",
    "delta", "deriv", "clamp_min", "clamp_max", "abs", "time", "label_replace", "count_values", "offset",
    "bool", "sort", "sort_desc", "changes", "resets", "avg_over_time", "max_over_time", "min_over_time", "vector",
}


def dashboard_exprs(doc: dict) -> list[str]:
    out: list[str] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("expr"), str):
                out.append(x["expr"])
            if isinstance(x.get("query"), str) and x.get("type") == "query":
                out.append(x["query"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (identifiers outside {...}, [...] and strings,
    that are not PromQL words or label names in by/without)."""
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\w+", "", e)
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", e)) - _PROMQL_WORDS
    return {n for n in names if not re.fullmatch(r"\d.*|e\d+", n)}


def served_names(texts: list[str]) -> set[str]:
    return {s.name for text in texts for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_grafana_dashboard_names_only_served_metrics(scrapes):
    doc = json.loads(DASHBOARD.read_text())
    assert doc["title"] and doc["panels"]
    exprs = dashboard_exprs(doc)
    assert len(exprs) >= 10
    texts = [scrapes["agent"], scrapes["placer"]]
    served = served_names(texts)
    # families a quiet test cluster serves without samples (no fetch, no peers): their names
    # come from the families' TYPE lines
    for text in texts:
        for fam in text_string_to_metric_families(text):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(fam.type, [""])
            served |= {fam.name + s for s in suffixes}
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, exprs
    assert used <= served, sorted(used - served)
    assert {"herd_placer_decision_seconds_bucket", "DCGM_FI_DEV_GPU_UTIL", "herd_workload_start_seconds_bucket"} <= used


def readme_metric_names() -> set[str]:
    """The metric names docs/operations.md's ``## Metrics`` section lists: `A`/`B` shares A's prefix
    (`DCGM_FI_DEV_FB_USED`/`FB_FREE`), `X_{A,B}_Y` is X_A_Y and X_B_Y, `{labels}` are labels."""
    sec = (REPO / "docs" / "operations.md").read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    prev = ""
    for m in re.finditer(r"(/?)`([^`]+)`", sec):
        code = re.sub(r"\{[^}]*[a-z][^}]*\}", "", m.group(2))        # label lists
        if m.group(1) and prev and re.fullmatch(r"[A-Z_]+", code):     # `A`/`B`
            code = prev.rsplit("_", code.count("_") + 1)[0] + "_" + code
        alts = re.fullmatch(r"(\w*)\{([A-Z_,]+)\}(\w*)", code)
        expanded = [alts[1] + a + alts[3] for a in alts[2].split(",")] if alts else [code]
        for name in expanded:
            if re.fullmatch(r"(herd|DCGM)_\w+", name):
                names.add(name)
                prev = name
    return names


async def test_readme_lists_exactly_what_is_served(scrapes):
    served: set[str] = set()
    for text in (scrapes["agent"], scrapes["placer"]):
        for fam in text_string_to_metric_families(text):
            if not fam.name.startswith("process_"):       # the docs say `process_*`
                served.add(fam.name + ("_total" if fam.type == "counter" else ""))
    listed = readme_metric_names()
    assert "DCGM_FI_DEV_FB_FREE" in listed and "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL" in listed
    assert served - listed == set(), "served, not in docs/operations.md: " + ", ".join(sorted(served - listed))
    assert listed - served == set(), "in docs/operations.md, not served: " + ", ".join(sorted(listed - served))
