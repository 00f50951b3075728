"""A real placer process and emulated-fleet processes, for tests and bench/fleet.py.

:class:`PlacerProc` runs ``herd placer run`` (``python -m cli.main``) with a generated
config (framed channel on, timings configurable) and reads its own CPU time, RSS and open
descriptors from ``/proc/<pid>``. :class:`EmulatorProc` runs ``python -m testing.fleet``
for a slice of the fleet, reads its ready line and starts it with ``go``. Both are trio
async context managers; leaving one stops its process (stdin closed, then SIGTERM, then
SIGKILL, each bounded). Traffic stays on 127.0.0.0/8.

TLS: ``PlacerOptions(tls_dir=DIR)`` (a PKI dir, e.g. :func:`infra.pki.throwaway`'s)
runs the placer over TLS (``insecure = false``); without one the placer is started with
``insecure = true`` written in its config. ``EmulatorProc(tls_dir=DIR)`` makes every emulated
node report over its own mutual-TLS connection with a certificate of that CA.
:func:`verify` is the ``verify=`` for an httpx client of either.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import trio

from placer.config import PlacerConfig

ROOT = Path(__file__).resolve().parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (children not counted)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def proc_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _stop(proc: trio.Process, *, grace_s: float = 3.0) -> None:
    with trio.CancelScope(shield=True):
        if proc.stdin is not None:
            try:
                await proc.stdin.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        with trio.move_on_after(grace_s):
            await proc.wait()
            return
        proc.terminate()
        with trio.move_on_after(grace_s):
            await proc.wait()
            return
        proc.kill()
        await proc.wait()


DIRECT_DEFAULT = PlacerConfig().direct_max_nodes   # nodes a placer serves without rack relays by default


@dataclass(frozen=True, slots=True)
class PlacerOptions:
    heartbeat_s: float = 5.0
    lost_after_missed: int = 3
    fence_after_s: float = 60.0
    tick_s: float = 0.25
    push_concurrency: int = 256
    ack_timeout_s: float = 10.0
    recover_s: float | None = None    # the placer's post-restart wait before placing (None: its default)
    relays: bool = True               # deliver through rack relays where racks have them
    extra_toml: str = ""              # more [placer] lines, as they are
    # [placer] direct_max_nodes (None: the placer's default). Benches that measure a fleet without
    # rack relays past the default (16,384) set 0 (no limit) and say so
    direct_max_nodes: int | None = None
    tls_dir: str | None = None        # a PKI dir (ca.crt, placer.crt/key): TLS; None: insecure = true


class PlacerProc:
    """``async with PlacerProc(workdir, token_dir) as p``: p.url, p.wire_url, p.pid."""

    def __init__(self, workdir: Path, token_dir: Path, opts: PlacerOptions = PlacerOptions(), *,
                 root: Path = ROOT, python: str = sys.executable) -> None:
        self.workdir = workdir
        self.token_dir = token_dir
        self.opts = opts
        self.root = root
        self.python = python
        self.proc: trio.Process | None = None
        self.url = ""
        self.wire_url = ""
        self.pid = 0

    async def __aenter__(self) -> PlacerProc:
        state = self.workdir / "placer-state"
        state.mkdir(parents=True, exist_ok=True)
        o = self.opts
        cfg = self.workdir / "placer.toml"
        cfg.write_text(
            "[placer]\n"
            'listen = "127.0.0.1:0"\nwire_listen = "127.0.0.1:0"\n'
            f'state_dir = "{state}"\ntoken_dir = "{self.token_dir}"\n'
            f"heartbeat_s = {o.heartbeat_s}\nlost_after_missed = {o.lost_after_missed}\n"
            f"fence_after_s = {o.fence_after_s}\ntick_s = {o.tick_s}\n"
            f"push_concurrency = {o.push_concurrency}\nack_timeout_s = {o.ack_timeout_s}\n"
            f"relays = {'true' if o.relays else 'false'}\n"
            + (f'tls_dir = "{o.tls_dir}"\ninsecure = false\n' if o.tls_dir else "insecure = true\n")
            + o.extra_toml
            + (f"direct_max_nodes = {o.direct_max_nodes}\n" if o.direct_max_nodes is not None else "")
            + (f"recover_s = {o.recover_s}\n" if o.recover_s is not None else ""))
        endpoints = state / "endpoints.json"
        endpoints.unlink(missing_ok=True)
        log = open(self.workdir / "placer.log", "ab")  # noqa: ASYNC230 (local file, once; the process owns it)
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        self.proc = await trio.lowlevel.open_process(
            [self.python, "-m", "cli.main", "placer", "run", "--config", str(cfg)],
            cwd=str(self.root), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        self.pid = self.proc.pid
        with trio.fail_after(60):
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"placer exited rc={self.proc.returncode}; see {self.workdir}/placer.log")
                try:
                    ep = json.loads(endpoints.read_text())
                    if ep.get("control_url") and ep.get("wire_url"):
                        break
                except (FileNotFoundError, ValueError):
                    pass
                await trio.sleep(0.05)
        self.url, self.wire_url = ep["control_url"], ep["wire_url"]
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.proc is not None:
            await _stop(self.proc)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)

    def rss_mib(self) -> float:
        return proc_rss_mib(self.pid)

    def fds(self) -> int:
        return proc_fds(self.pid)


class EmulatorProc:
    """``async with EmulatorProc(placer, token_dir, nodes=N, offset=K, ...) as e``; ``e.go()``."""

    def __init__(self, placer: PlacerProc, token_dir: Path, *, nodes: int, offset: int = 0, fleet: str = "h100",
                 mux: int = 8, known_wire: bool = True, http_only: bool = False, extra: list[str] | None = None,
                 seconds: float = 3600.0, root: Path = ROOT, python: str = sys.executable,
                 log_path: Path | None = None, tls_dir: str | os.PathLike[str] | None = None,
                 nice: int = 0) -> None:
        self.argv = [python, "-m", "testing.fleet", "--placer", placer.url, "--token-dir", str(token_dir),
                     "--nodes", str(nodes), "--offset", str(offset), "--fleet", fleet, "--mux", str(mux),
                     "--seconds", str(seconds), "--heartbeat", str(placer.opts.heartbeat_s)]
        if known_wire and not http_only:
            self.argv += ["--wire-url", placer.wire_url]
        if http_only:
            self.argv.append("--http-only")
        if tls_dir is not None:
            self.argv += ["--tls-dir", str(tls_dir)]
        self.argv += extra or []
        self.root = root
        self.log_path = log_path
        self.nodes = nodes
        self.nice = nice   # added to the emulator's niceness (os.nice): it yields the CPU to the placer
        self.proc: trio.Process | None = None
        self.control = ""
        self.pid = 0

    async def __aenter__(self) -> EmulatorProc:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: ASYNC230
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        nice = self.nice
        self.proc = await trio.lowlevel.open_process(self.argv, cwd=str(self.root), env=env, stdin=subprocess.PIPE,
                                                     stdout=subprocess.PIPE, stderr=log,
                                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        if log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]  # log is the opened file here, not DEVNULL (checked just above)
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        buf = b""
        with trio.fail_after(120):
            while b"\n" not in buf:
                data = await self.proc.stdout.receive_some(4096)
                if not data:
                    raise RuntimeError(f"emulator exited before it was ready (rc={self.proc.poll()})")
                buf += data
        ready = json.loads(buf.split(b"\n", 1)[0])
        self.control = ready["control"]
        return self

    async def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        await self.proc.stdin.send_all(b"go\n")

    async def stats(self, client: httpx.AsyncClient, job: str | None = None) -> dict[str, Any]:
        r = await client.get(f"{self.control}/stats", params={"job": job} if job else None, timeout=30)
        r.raise_for_status()
        return r.json()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.proc is not None:
            await _stop(self.proc)

    def cpu_s(self) -> float:
        return proc_cpu_s(self.pid)


def verify(tls_dir: str | os.PathLike[str] | None) -> ssl.SSLContext | bool:
    """httpx's ``verify=`` for a harness placer: the PKI dir's CA (no client certificate;
    callers send a viewer or operator token), or True for an insecure one."""
    if tls_dir is None:
        return True
    from infra.tls import client_context
    return client_context(Path(tls_dir) / "ca.crt")


async def wait_recovered(client: httpx.AsyncClient, placer_url: str, *, limit_s: float = 60.0) -> None:
    """Until the placer's ``/healthz`` no longer says ``recovering`` (it places jobs again)."""
    with trio.fail_after(limit_s):
        while True:
            r = await client.get(f"{placer_url}/healthz")
            if r.status_code == 200 and not r.json().get("recovering"):
                return
            await trio.sleep(0.1)


async def nodes_up(client: httpx.AsyncClient, placer_url: str) -> int:
    r = await client.get(f"{placer_url}/v1/cluster", params={"detail": "0"}, timeout=30)  # counts only
    r.raise_for_status()
    return int(r.json()["nodes"]["up"])


async def wait_nodes_up(client: httpx.AsyncClient, placer_url: str, want: int, *, limit_s: float,
                        poll_s: float = 0.25) -> tuple[int, float]:
    """Poll until ``want`` nodes are up or ``limit_s`` passed: (nodes up, seconds)."""
    t0 = trio.current_time()
    up = 0
    with trio.move_on_after(limit_s):
        while True:
            try:
                up = await nodes_up(client, placer_url)
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if up >= want:
                break
            await trio.sleep(poll_s)
    return up, trio.current_time() - t0
