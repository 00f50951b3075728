"""`herd gpus` and `herd gpus inject` as real subprocesses; inject goes over a real
loopback HTTP server backed by a real GpuMonitor (the agent's route, in miniature)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from agent.gpus import Fault, FaultError, GpuMonitor, open_backend
from infra.auth import TokenSet
from infra.http import App, HTTPError, json_response, require_role, serve
from scheduler_link.messages import GpuSnapshot

ROOT = Path(__file__).resolve().parent.parent


async def herd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    e.pop("HERD_AGENT", None)
    return await trio.run_process([sys.executable, "-m", "cli.main", *args], capture_stdout=True,
                                  capture_stderr=True, check=False, cwd=str(ROOT), env=e)


async def test_herd_gpus_json_and_table():
    with trio.fail_after(30):
        r = await herd("gpus", "--gpus", "simulated:dgx-h100", "--hostname", "n1", "--json", "--no-kernel-log")
        assert r.returncode == 0, r.stderr
        snap = msgspec.json.decode(r.stdout, type=GpuSnapshot)
        assert snap.simulated and snap.backend == "simulated:dgx-h100" and len(snap.gpus) == 8
        assert snap.topology_matrix[0][1] == "NV18" and all(g.health == "healthy" for g in snap.gpus)
        r = await herd("gpus", "--gpus", "simulated:l40s-pcie", "--no-kernel-log")
        assert r.returncode == 0, r.stderr
        out = r.stdout.decode()
        assert "SIMULATED" in out and "NVIDIA L40S" in out and "all GPUs healthy" in out
        assert any(ln.split()[:5] == ["GPU0", "X", "PXB", "SYS", "SYS"] for ln in out.splitlines())


async def test_herd_gpus_bad_backends_are_one_line():
    with trio.fail_after(30):
        r = await herd("gpus", "--gpus", "simulated:nope")
        assert r.returncode == 1 and r.stdout == b""
        assert r.stderr.decode().count("\n") == 1 and "unknown simulated profile" in r.stderr.decode()
        if ctypes.util.find_library("nvidia-ml"):
            return
        r = await herd("gpus", "--gpus", "nvml")
        err = r.stderr.decode()
        assert r.returncode == 1 and err.count("\n") == 1
        assert "LibraryNotFound" in err and "--gpus simulated:PROFILE" in err


def inject_app(mon: GpuMonitor, tokens: TokenSet) -> App:
    app = App()

    @app.route("POST", "/v1/gpus/{uuid}/inject", auth=require_role(tokens, "operator"))
    async def inject(req):
        fault = req.decode(Fault)
        try:
            mon.inject(req.params["uuid"], fault)
        except FaultError as e:
            raise HTTPError(404 if "no GPU" in str(e) else 400, "bad fault", str(e)) from None
        return json_response({"ok": True, "gpu": req.params["uuid"], "fault": fault})

    return app


async def test_herd_gpus_inject_over_http(token_dir, capsys, monkeypatch):
    from cli.main import main as cli_main
    monkeypatch.delenv("HERD_AGENT", raising=False)
    tokens = TokenSet.load(token_dir)
    mon = GpuMonitor(open_backend("simulated:hgx-b200", hostname="n2"), poll_interval_s=0.05,
                     kernel_log=False, event_wait_ms=50)
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            first = await n.start(mon.run)
            url = await n.start(serve, inject_app(mon, tokens), "127.0.0.1:0")
            u = first.gpus[3].uuid
            rx = mon.subscribe()
            r = await herd("gpus", "inject", "--agent", url, "--gpu", u, "--xid", "48", "--json",
                           env={"HERD_TOKEN_DIR": str(token_dir)})
            assert r.returncode == 0, r.stderr
            assert msgspec.json.decode(r.stdout)["fault"] == {"xid": 48}
            snap = mon.snapshot()
            while snap.gpus[3].health != "fatal":
                snap = await rx.receive()
            assert [x.code for x in snap.gpus[3].reasons] == ["xid:48"]
            # refused (in-process, in a worker thread, to keep the suite fast): unknown GPU, wrong
            # token, no token, no fault, a bad combination, no agent
            from infra.auth import generate_token_dir
            bad = generate_token_dir(token_dir.parent / "other")
            for argv, expect in [
                (["--gpu", "GPU-sim-nope", "--lost", "--token-dir", str(token_dir)], "agent answered 404: bad fault: no GPU"),
                (["--gpu", u, "--clear", "--token-dir", str(bad)], "agent answered 401: unauthorized"),
                (["--gpu", u, "--clear", "--token-dir", str(token_dir.parent / "missing")], "no operator token"),
                (["--gpu", u, "--token-dir", str(token_dir)], "say which fault"),
                (["--gpu", u, "--clear", "--xid", "3", "--token-dir", str(token_dir)], "cannot be combined"),
                (["--gpu", u, "--temperature", "900", "--token-dir", str(token_dir)], "temperature_c must be"),
            ]:
                rc = await trio.to_thread.run_sync(cli_main, ["gpus", "inject", "--agent", url, *argv])
                err = capsys.readouterr().err
                assert rc == 1 and err.startswith("herd: error: ") and expect in err and err.count("\n") == 1
            rc = await trio.to_thread.run_sync(cli_main, ["gpus", "inject", "--gpu", u, "--clear"])
            assert rc == 1 and "no agent URL" in capsys.readouterr().err
            assert mon.snapshot().gpus[3].health == "fatal"   # nothing above changed anything
            assert mon.statistics()["injected"] == 1
            n.cancel_scope.cancel()


@pytest.mark.parametrize("argv", [["gpus", "--help"], ["gpus", "inject", "--help"]])
def test_help_parses(argv, capsys):
    from cli.main import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "simulated" in capsys.readouterr().out
