"""The dashboard in a real headless Chromium (selenium) against a real ``herd placer run``
process and an emulated fleet (testing.fleet) with a gang running.

What the page drew is read back from its canvas: the nodes by state must be exactly the
counts ``GET /v1/cluster`` reports, and selecting a job's row must light exactly that job's
nodes. A hover shows the node; "why pending?" reads the queue's structured reason; when the
placer stops, the page says so. The page's own timings (``performance.now()``: the first full
draw and each 2 s refresh) are recorded in ``dashboard-timings.json``, with a screenshot, in
the test's directory (or ``$HERD_TEST_ARTIFACTS``); they are not asserted against a threshold.

Skips where Chromium, chromedriver or selenium are missing (``.ci/run`` installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from infra.auth import TokenSet, generate_token_dir
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, wait_nodes_up
from testing.waiting import poll

N = int(os.environ.get("HERD_TEST_DASHBOARD_NODES", "1024"))
GANG = 32                                   # whole 8-GPU nodes, within one block


def chromium() -> tuple[str, str] | None:
    """(browser, driver) paths, or None where either is missing."""
    browser = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


PATHS = chromium()
pytestmark = pytest.mark.skipif(PATHS is None, reason="chromium and chromedriver are not installed "
                                                     "(apt-get install chromium chromium-driver)")
pytest.importorskip("selenium", reason="selenium is not installed (the test extras)")


def open_browser(paths: tuple[str, str]) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1600,1000", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(executable_path=paths[1]), options=opts)


def wait_js(drv: Any, script: str, limit_s: float = 30.0) -> Any:
    """Poll a JavaScript expression until it is truthy (bounded)."""
    deadline = time.monotonic() + limit_s
    while True:
        v = drv.execute_script("return " + script)
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"page never satisfied: {script}")
        time.sleep(0.05)


def artifacts(tmp_path: Path) -> Path:
    d = Path(os.environ.get("HERD_TEST_ARTIFACTS") or tmp_path)
    d.mkdir(parents=True, exist_ok=True)
    return d


async def test_dashboard_in_a_real_browser(tmp_path):
    paths = PATHS
    assert paths is not None
    td = generate_token_dir(tmp_path / "tokens")
    tok = TokenSet.load(td)
    op = {"authorization": f"Bearer {tok.operator}"}
    out = artifacts(tmp_path)
    with trio.fail_after(300):
        async with PlacerProc(tmp_path, td, PlacerOptions(heartbeat_s=5.0, recover_s=0.5)) as placer, \
                EmulatorProc(placer, td, nodes=N, mux=4, log_path=tmp_path / "emu.log",
                             extra=["--fetch-delay", "0.02", "--run-delay", "0.02"]) as emu, \
                httpx.AsyncClient(timeout=60, headers=op) as c:
            await emu.go()
            up, _ = await wait_nodes_up(c, placer.url, N, limit_s=200)
            assert up == N
            r = await c.post(f"{placer.url}/v1/jobs", json={"job_id": "train", "pods": GANG, "gpus_per_pod": 8,
                                                             "within": "block", "priority": 5, "argv": ["train"],
                                                             "env": {"WANDB_KEY": "sekrit-value"}})
            assert r.status_code == 201, r.text
            job = (await c.get(f"{placer.url}/v1/jobs/train",
                               params={"wait": "running", "timeout_ms": "60000", "pods": f"0:{GANG}"})).json()
            assert job["state"] == "running"
            train_nodes = {p["node_id"] for p in job["pods"]}
            r = await c.post(f"{placer.url}/v1/jobs", json={"job_id": "huge", "pods": N, "gpus_per_pod": 8,
                                                             "argv": ["x"]})
            assert r.status_code == 201
            nodes = (await c.get(f"{placer.url}/v1/nodes", params={"page": f"0:{GANG + 1}"})).json()["nodes"]
            spare = next(n["node_id"] for n in nodes if n["node_id"] not in train_nodes)
            assert (await c.post(f"{placer.url}/v1/nodes/{spare}/cordon", json={"reason": "fan"})).status_code == 200
            async def looked_at() -> bool:     # the queue has looked at "huge" (another process)
                r = await c.get(f"{placer.url}/v1/cluster/map/job/huge")
                return bool(r.json()["waiting"]["code"] != "not_tried")

            with trio.fail_after(30):
                await poll(looked_at, 0.1)
            cluster = (await c.get(f"{placer.url}/v1/cluster")).json()
            by_state = cluster["nodes"]["by_state"]
            assert by_state["full"] == GANG and by_state["cordoned"] == 1

            drv = await trio.to_thread.run_sync(open_browser, paths)
            try:
                async with trio.open_nursery() as churn_n:
                    async def churn() -> None:  # a small job comes and goes: refreshes draw new maps
                        for i in range(60):
                            if i % 2 == 0:
                                await c.post(f"{placer.url}/v1/jobs", json={
                                    "job_id": f"churn-{i}", "pods": 1, "gpus_per_pod": 1, "argv": ["c"]})
                            else:
                                await c.delete(f"{placer.url}/v1/jobs/churn-{i - 1}")
                            await trio.sleep(1.0)
                    page = await trio.to_thread.run_sync(_browse_after, drv, placer.url, tok.viewer, out,
                                                         lambda: churn_n.start_soon(churn))
                    churn_n.cancel_scope.cancel()
                # the page's nodes by state, read off its canvas, are GET /v1/cluster's
                assert page["counts"] == by_state, (page["counts"], by_state)
                assert sum(page["counts"].values()) == cluster["nodes"]["total"] == N
                assert page["counts"]["lost"] == cluster["nodes"]["lost"] == 0
                # selecting the job's row lit exactly its nodes
                assert page["lit"]["nodes"] == GANG and len(page["lit"]["rows"]) == GANG
                lit_ids = set()
                for row in page["lit"]["rows"]:
                    d = (await c.get(f"{placer.url}/v1/cluster/map/node/{row}")).json()
                    lit_ids.add(d["node_id"])
                assert lit_ids == train_nodes
                assert page["hover_node"] in train_nodes
                assert "why pending?" in page["why"] and "asks" in page["why"]
                assert page["hash_after_load"] == ""          # the token left the address bar
                assert "sekrit-value" not in page["html"]
                # without a token: the login form, not the data
                assert await trio.to_thread.run_sync(_login_form, drv, placer.url)
                # the placer goes away: the page says so
                await trio.to_thread.run_sync(_open, drv, placer.url, tok.viewer)
                assert placer.proc is not None
                placer.proc.terminate()
                down = await trio.to_thread.run_sync(
                    wait_js, drv, "(!document.getElementById('banner').hidden) && "
                                  "document.getElementById('banner').textContent")
                assert "stopped answering" in down
            finally:
                await trio.to_thread.run_sync(drv.quit)
    t = page["timings"]
    (out / "dashboard-timings.json").write_text(json.dumps({"nodes": N, **t}, indent=1))
    print(f"\ndashboard at {N} nodes: first full draw {t['first_draw_ms']:.0f} ms after navigation "
          f"(fetch+decode+draw {t['first_cycle']['total']:.1f} ms), refresh median {t['refresh_median_ms']:.1f} ms "
          f"over {len(t['refreshes'])}, map {t['first_cycle']['bytes']} bytes")


def _open(drv: Any, url: str, token: str) -> None:
    drv.get(f"{url}/#token={token}")
    wait_js(drv, "window.herdDash && window.herdDash.ready()")


def _browse_after(drv: Any, url: str, token: str, out: Path, churn: Any) -> dict[str, Any]:
    """:func:`_browse`; ``churn`` starts the changes once the static checks are read."""
    return _browse(drv, url, token, out, lambda: trio.from_thread.run_sync(churn))


def _browse(drv: Any, url: str, token: str, out: Path, start_churn: Any) -> dict[str, Any]:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    _open(drv, url, token)
    res: dict[str, Any] = {"hash_after_load": drv.execute_script("return location.hash")}
    res["counts"] = drv.execute_script("return window.herdDash.countsFromCanvas()")
    # a real click on the job's row lights its nodes
    drv.find_element(By.CSS_SELECTOR, 'tr[data-job="train"]').click()
    wait_js(drv, "window.herdDash.litFromCanvas().nodes > 0")
    res["lit"] = drv.execute_script("return window.herdDash.litFromCanvas()")
    wait_js(drv, "document.querySelector('#job-detail .timeline [data-step=running]') !== null")
    # hover one of them: the tooltip and the node panel show it
    row = res["lit"]["rows"][0]
    at = drv.execute_script(f"return window.herdDash.hoverRow({row})")
    overlay = drv.find_element(By.ID, "overlay")
    rect = drv.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.top, r.width, r.height]",
                              overlay)
    ActionChains(drv).move_to_element_with_offset(
        overlay, int(at["x"] - rect[0] - rect[2] / 2), int(at["y"] - rect[1] - rect[3] / 2)).perform()
    tip = wait_js(drv, "(!document.getElementById('tip').hidden) && document.getElementById('tip').textContent")
    assert "train" in tip, tip
    res["hover_node"] = wait_js(
        drv, "(document.querySelector('#node-detail dd') || {}).textContent")
    drv.save_screenshot(str(out / "dashboard.png"))
    # why the other job waits
    drv.find_element(By.CSS_SELECTOR, 'tr[data-job="huge"]').click()
    res["why"] = wait_js(drv, "(document.getElementById('why') || {}).textContent")
    # timings the page measured itself: the first full draw, then refreshes every 2 s (each
    # with a new map: a job comes and goes meanwhile; an unchanged map is a 304 and not timed)
    start_churn()
    wait_js(drv, "window.herdDash.timings().refreshes.length >= 3", limit_s=30)
    t = drv.execute_script("return window.herdDash.timings()")
    refreshes = sorted(r["total"] for r in t["refreshes"])
    res["timings"] = {"first_draw_ms": t["firstDraw"], "first_cycle": t["firstCycle"], "refreshes": t["refreshes"],
                      "refresh_median_ms": refreshes[len(refreshes) // 2]}
    res["html"] = drv.page_source
    return res


def _login_form(drv: Any, url: str) -> bool:
    drv.execute_script("sessionStorage.clear()")
    drv.get(f"{url}/")
    return bool(wait_js(drv, "!document.getElementById('login').hidden", limit_s=15))
