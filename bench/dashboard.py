"""The fleet dashboard at fleet scale: the real placer process, an emulated fleet, a real browser.

    python -m bench.dashboard --nodes 16384 [--fleet h100] [--json] [--screenshot docs/dashboard.png]

One row: a fresh ``herd placer run`` subprocess and ``ceil(N / --per-proc)`` emulator processes
(``python -m testing.fleet``), every node registered, ~``--fill`` of the GPUs asked for by jobs
of placer/sim.py's mix (bounded in jobs and time), one job that cannot fit (pending), a few
nodes cordoned. Then:

- ``map_bytes``: ``GET /v1/cluster/map`` (placer/clustermap.py's binary map);
- ``build_cpu_ms_p50`` / ``_max``: placer CPU (the serving thread's ``thread_time``, the
  ``x-herd-map-build-cpu-ms`` answer header) per map build, over ``--builds`` builds, each
  after a change (a small job submitted or cancelled) so none is a cache hit;
  ``cached_get_ms_p50``: wall time of a ``GET`` when nothing changed (a cache hit, loopback);
- in headless Chromium (skipped where Chromium or selenium are missing): ``first_draw_ms``
  (``performance.now()`` at the end of the first full draw: since navigation, so page load,
  script, fetch, decode, layout and draw), ``first_cycle_ms`` (fetch + decode + draw of the
  first map), ``refresh_ms_p50`` / ``_max`` (each 2 s refresh: fetch + decode + draw + panels,
  with a change between refreshes so each one fetches a new build), ``draw_ms_p50`` (the canvas
  alone), ``panels_ms_p50`` (the legend and the jobs table);
- the baseline in the same run: the fleet as the JSON table the CLI reads (``GET /v1/nodes``
  pages of 1,000), ``--baseline-pages`` pages at most: ``nodes_table_bytes_per_node`` and
  ``nodes_table_ms_per_1000`` as measured, and ``nodes_table_ratio_bytes`` (the table's bytes
  for the pages read over the map's bytes for the same share of the fleet).

Every wait and loop is bounded; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import _jobs_mix, _submit_all, _wait_fill  # noqa: E402
from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from testing.harness import (  # noqa: E402
    DIRECT_DEFAULT,
    EmulatorProc,
    PlacerOptions,
    PlacerProc,
    wait_nodes_up,
    wait_recovered,
)


def _note(msg: str, **kw: Any) -> None:
    fields = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())
    print(f"[bench.dashboard {time.strftime('%H:%M:%S')}] {msg} {fields}", file=sys.stderr, flush=True)


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def _browser() -> Any | None:
    """Headless Chromium through selenium, or None where either is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None
    binary = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        return None
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1600,1000", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(executable_path=driver), options=opts)


def _js(drv: Any, expr: str, limit_s: float = 60.0) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        v = drv.execute_script("return " + expr)
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"page never satisfied: {expr}")
        time.sleep(0.05)


def _page(drv: Any, url: str, token: str, refreshes: int) -> dict[str, Any]:
    drv.get(f"{url}/#token={token}")
    _js(drv, "window.herdDash && window.herdDash.ready()")
    _js(drv, f"window.herdDash.timings().refreshes.length >= {refreshes}", limit_s=4.0 * refreshes + 30)
    return dict(drv.execute_script("return window.herdDash.timings()"))


def _shoot(drv: Any, path: Path) -> None:
    """The picture for the README: jobs coloured, a pending job's "why pending?", a node hovered."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(drv.find_element(By.ID, "colour")).select_by_value("job")
    pending = drv.find_elements(By.CSS_SELECTOR, 'tr[data-job="waiting-big"]')
    if pending:
        pending[0].click()
        _js(drv, "document.getElementById('why') !== null")
    overlay = drv.find_element(By.ID, "overlay")
    size = overlay.size
    row = int(drv.execute_script("const m = window.herdDash.state.map; let r = 0; "
                                 "while (r < m.header.nodes - 1 && m.job[r] === m.none) r++; return r"))
    at = drv.execute_script(f"return window.herdDash.hoverRow({row})")
    rect = drv.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.top]", overlay)
    ActionChains(drv).move_to_element_with_offset(
        overlay, int(at["x"] - rect[0] - size["width"] / 2), int(at["y"] - rect[1] - size["height"] / 2)).click().perform()
    try:
        _js(drv, "document.querySelector('#node-detail dd') !== null", limit_s=10)
    except TimeoutError:
        _note("the pinned node's details did not come: the picture shows the map without them")
    time.sleep(1.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    drv.save_screenshot(str(path))


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    N = ns.nodes
    out: dict[str, Any] = {"nodes": N, "fleet": ns.fleet}
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        work = Path(ns.workdir or tmp)          # --workdir: kept, with the placer's and emulators' logs
        td = generate_token_dir(work / "tokens")
        tok = TokenSet.load(td)
        op = {"authorization": f"Bearer {tok.operator}"}
        viewer = tok.viewer or ""
        view = {"authorization": f"Bearer {viewer}"}
        async with AsyncExitStack() as stack:
            placer = await stack.enter_async_context(
                PlacerProc(work, td, PlacerOptions(heartbeat_s=ns.heartbeat, fence_after_s=600,
                                                 # (no rack relays here: the map, not the direct path, is measured)
                                                 direct_max_nodes=0 if N > DIRECT_DEFAULT else None)))
            procs = math.ceil(N / ns.per_proc)
            emus = []
            for k in range(procs):
                n = min(ns.per_proc, N - k * ns.per_proc)
                emus.append(await stack.enter_async_context(EmulatorProc(
                    placer, td, nodes=n, offset=k * ns.per_proc, fleet=ns.fleet, mux=8,
                    log_path=work / f"emu{k}.log", extra=["--fetch-delay", "0.05", "--run-delay", "0.05"])))
            c = await stack.enter_async_context(httpx.AsyncClient(timeout=120, headers=op))
            for e in emus:
                await e.go()
            up, reg_s = await wait_nodes_up(c, placer.url, N, limit_s=ns.register_limit)
            _note("registered", up=up, seconds=reg_s)
            out["nodes_up"] = up
            await wait_recovered(c, placer.url)
            gpus = int((await c.get(f"{placer.url}/v1/cluster")).json()["model"]["gpus"])
            specs = _jobs_mix(ns.fleet, gpus, ns.fill, ns.seed, ns.max_jobs)
            await _submit_all(c, placer.url, op, specs, limit_s=120)
            counts = await _wait_fill(c, placer.url, len(specs), limit_s=ns.fill_limit)
            out["jobs_running"] = counts.get("running", 0)
            _note("filled", jobs=len(specs), running=out["jobs_running"])
            page = (await c.get(f"{placer.url}/v1/nodes", params={"page": "0:1000"})).json()["nodes"]
            for nd in page[-8:]:
                await c.post(f"{placer.url}/v1/nodes/{nd['node_id']}/cordon", json={"reason": "bench"})
            # a job that cannot fit (the fleet, at the fill's priority: nothing it may preempt)
            await c.post(f"{placer.url}/v1/jobs", json={"job_id": "waiting-big", "pods": N, "gpus_per_pod": 8,
                                                        "argv": ["x"], "priority": 0})

            # map builds, each after a change; then cache hits
            builds: list[float] = []
            sizes: list[int] = []
            for i in range(ns.builds):
                if i % 2 == 0:
                    await c.post(f"{placer.url}/v1/jobs", json={"job_id": f"probe-{i}", "pods": 1, "gpus_per_pod": 1,
                                                                "argv": ["p"], "priority": 3})
                else:
                    await c.delete(f"{placer.url}/v1/jobs/probe-{i - 1}")
                await trio.sleep(0.5)
                r = await c.get(f"{placer.url}/v1/cluster/map", headers=view)
                r.raise_for_status()
                builds.append(float(r.headers["x-herd-map-build-cpu-ms"]))
                sizes.append(len(r.content))
            hits: list[float] = []
            for _ in range(ns.builds):
                t0 = time.perf_counter()
                r = await c.get(f"{placer.url}/v1/cluster/map", headers=view)
                hits.append((time.perf_counter() - t0) * 1000)
            out.update(map_bytes=sizes[-1] if sizes else 0, build_cpu_ms_p50=_p50(builds),
                       build_cpu_ms_max=round(max(builds), 2) if builds else None, cached_get_ms_p50=_p50(hits))
            _note("map", bytes=out["map_bytes"], build_cpu_ms=out["build_cpu_ms_p50"])

            # the baseline: the fleet as the JSON table of GET /v1/nodes
            got = tbytes = 0
            t0 = time.perf_counter()
            for p in range(min(ns.baseline_pages, math.ceil(N / 1000))):
                r = await c.get(f"{placer.url}/v1/nodes", params={"page": f"{p * 1000}:1000"}, headers=view)
                got += len(r.json()["nodes"])
                tbytes += len(r.content)
            dt = time.perf_counter() - t0
            out.update(nodes_table_nodes_read=got, nodes_table_bytes_per_node=round(tbytes / max(got, 1), 1),
                       nodes_table_ms_per_1000=round(dt * 1000 / max(got, 1) * 1000, 1),
                       nodes_table_ratio_bytes=round(tbytes / max(1.0, out["map_bytes"] * got / N), 1))

            # the page in a real browser
            drv = await trio.to_thread.run_sync(_browser)
            if drv is None:
                out["browser"] = "skipped: chromium, chromedriver or selenium missing"
            else:
                try:
                    async with trio.open_nursery() as n:
                        async def churn() -> None:     # a change every ~2 s: each refresh fetches a new build
                            for i in range(4 * ns.refreshes + 20):
                                jid = f"churn-{i // 2}"
                                if i % 2 == 0:
                                    await c.post(f"{placer.url}/v1/jobs", json={
                                        "job_id": jid, "pods": 1, "gpus_per_pod": 1, "argv": ["c"], "priority": 3})
                                else:
                                    await c.delete(f"{placer.url}/v1/jobs/{jid}")
                                await trio.sleep(1.0)
                        n.start_soon(churn)
                        t = await trio.to_thread.run_sync(_page, drv, placer.url, viewer, ns.refreshes)
                        if ns.screenshot:
                            await trio.to_thread.run_sync(_shoot, drv, Path(ns.screenshot))
                        n.cancel_scope.cancel()
                finally:
                    await trio.to_thread.run_sync(drv.quit)
                out.update(_page_figures(t))
    return out


async def run_synthetic(ns: argparse.Namespace) -> dict[str, Any]:
    """The page and the map at ``--nodes`` without emulated agents: an in-process placer
    service whose model is placer/sim.py's fleet, filled by its job mix (``sim.fill``) with
    jobs that hold GPUs but were never submitted (so the table lists them as holders). The
    map, the page and the browser are the real ones; only the registration is skipped."""
    from placer.config import PlacerConfig
    from placer.model import ClusterModel
    from placer.service import PlacerService
    from placer.sim import build_fleet, fill, fleet_shape

    N = ns.nodes
    out: dict[str, Any] = {"nodes": N, "fleet": ns.fleet, "synthetic": True}
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        td = generate_token_dir(Path(tmp) / "tokens")
        tok = TokenSet.load(td)
        viewer = tok.viewer or ""
        svc = PlacerService(PlacerConfig(listen="127.0.0.1:0", state_dir=tmp, token_dir=str(td), insecure=True),
                            tok)
        m = ClusterModel.build(build_fleet(ns.fleet, N * fleet_shape(ns.fleet).gpus_per_node))
        out["jobs_holding"] = fill(m, ns.fleet, ns.fill, seed=ns.seed)
        ids = m.node_ids
        for i in range(0, min(N, 64), 8):
            m.set_node_state(ids[i], healthy=True, draining=True)        # cordoned
        svc.state.model = m
        async with trio.open_nursery() as n:
            url = await n.start(svc.run)
            view = {"authorization": f"Bearer {viewer}"}
            async with httpx.AsyncClient(timeout=60, headers=view) as c:
                builds: list[float] = []
                sizes: list[int] = []
                free = np.flatnonzero(m.free > 0)
                for i in range(ns.builds):
                    if i % 2 == 0:
                        m.assign(f"probe-{i}", ids[int(free[i])], [int(m.free_gpus(ids[int(free[i])])[0])], 3, True)
                    else:
                        m.release(f"probe-{i - 1}")
                    r = await c.get(f"{url}/v1/cluster/map")
                    r.raise_for_status()
                    builds.append(float(r.headers["x-herd-map-build-cpu-ms"]))
                    sizes.append(len(r.content))
                hits = []
                for _ in range(ns.builds):
                    t0 = time.perf_counter()
                    await c.get(f"{url}/v1/cluster/map")
                    hits.append((time.perf_counter() - t0) * 1000)
            out.update(map_bytes=sizes[-1], build_cpu_ms_p50=_p50(builds), build_cpu_ms_max=round(max(builds), 2),
                       cached_get_ms_p50=_p50(hits))
            drv = await trio.to_thread.run_sync(_browser)
            if drv is None:
                out["browser"] = "skipped: chromium, chromedriver or selenium missing"
            else:
                try:
                    async def churn() -> None:     # a change every second: each refresh fetches a new build
                        for i in range(4 * ns.refreshes + 20):
                            jid = f"churn-{i // 2}"
                            node = ids[int(free[-1 - (i // 2) % 100])]
                            if i % 2 == 0 and m.free_gpus(node):
                                m.assign(jid, node, [m.free_gpus(node)[0]], 3, True)
                            elif jid in m.jobs:
                                m.release(jid)
                            await trio.sleep(1.0)
                    async with trio.open_nursery() as inner:
                        inner.start_soon(churn)
                        t = await trio.to_thread.run_sync(_page, drv, url, viewer, ns.refreshes)
                        if ns.screenshot:
                            await trio.to_thread.run_sync(_shoot, drv, Path(ns.screenshot))
                        inner.cancel_scope.cancel()
                finally:
                    await trio.to_thread.run_sync(drv.quit)
                out.update(_page_figures(t))
            n.cancel_scope.cancel()
    return out


def _page_figures(t: dict[str, Any]) -> dict[str, Any]:
    refreshes = [r["total"] for r in t["refreshes"]]
    return dict(first_draw_ms=round(t["firstDraw"], 1), first_cycle_ms=round(t["firstCycle"]["total"], 1),
                first_draw_only_ms=round(t["firstCycle"]["draw"], 1),
                refresh_ms_p50=_p50(refreshes), refresh_ms_max=round(max(refreshes), 1),
                draw_ms_p50=_p50([r["draw"] for r in t["refreshes"]]),
                panels_ms_p50=_p50([r["panels"] for r in t["refreshes"]]),
                decode_ms_p50=_p50([r["decode"] for r in t["refreshes"]]),
                fetch_ms_p50=_p50([r["fetch"] for r in t["refreshes"]]), refreshes=len(refreshes))


def print_table(out: dict[str, Any]) -> None:
    rows = [("nodes", out["nodes"]), ("map bytes", out.get("map_bytes")),
            ("placer CPU per map build, p50 / max (ms)", f"{out.get('build_cpu_ms_p50')} / {out.get('build_cpu_ms_max')}"),
            ("cached GET, p50 (ms)", out.get("cached_get_ms_p50")),
            ("page: first full draw since navigation (ms)", out.get("first_draw_ms", out.get("browser"))),
            ("page: first fetch+decode+draw (ms)", out.get("first_cycle_ms")),
            ("page: refresh p50 / max (ms)", f"{out.get('refresh_ms_p50')} / {out.get('refresh_ms_max')}"),
            ("page: canvas draw alone p50 (ms)", out.get("draw_ms_p50")),
            ("page: legend and jobs table p50 (ms)", out.get("panels_ms_p50")),
            ("baseline /v1/nodes: bytes per node", out.get("nodes_table_bytes_per_node")),
            ("baseline /v1/nodes: ms per 1000 nodes", out.get("nodes_table_ms_per_1000")),
            ("baseline bytes / map bytes (same nodes)", out.get("nodes_table_ratio_bytes"))]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16384)
    ap.add_argument("--fleet", choices=["h100", "gb200"], default="h100")
    ap.add_argument("--per-proc", type=int, default=16384)
    ap.add_argument("--heartbeat", type=float, default=10.0,
                    help="the emulated agents' heartbeat (long: a starved emulator on a shared machine is not a lost fleet)")
    ap.add_argument("--register-limit", type=float, default=300.0)
    ap.add_argument("--fill", type=float, default=0.6)
    ap.add_argument("--max-jobs", type=int, default=1500)
    ap.add_argument("--fill-limit", type=float, default=120.0)
    ap.add_argument("--builds", type=int, default=8)
    ap.add_argument("--refreshes", type=int, default=5)
    ap.add_argument("--baseline-pages", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--screenshot", default=None, help="save a PNG of the page here")
    ap.add_argument("--synthetic", action="store_true",
                    help="no emulated agents: an in-process placer whose model placer/sim.py fills")
    ap.add_argument("--workdir", default=None, help="keep state and logs here (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ns = ap.parse_args(argv)
    if ns.workdir:
        Path(ns.workdir).mkdir(parents=True, exist_ok=True)
    out = trio.run(run_synthetic if ns.synthetic else run, ns)
    if ns.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
