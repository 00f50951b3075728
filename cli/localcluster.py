"""A local cluster of real processes on loopback: one placer and N agents with
simulated GPUs (`herd placer run`, `herd agent run`). Used by `herd demo`, the link
integration tests, the end-to-end test and bench.link.

Each process runs in its own session (process group), so a "host failure" kills an
agent and its workloads together (``kill_host``); ``pause``/``resume`` (SIGSTOP/SIGCONT)
make a partition. Endpoints come from each process's ``endpoints.json``.

``tls=True`` (``herd demo``'s default): a throwaway cluster CA under ``root/pki``
(:func:`infra.pki.throwaway`), the placer over TLS with its certificate, each agent
with its own node certificate (``HERD_TLS_DIR`` per process); :attr:`LocalCluster.verify` is
the ``verify=`` for httpx clients of the cluster. ``tls=False``: every process is started
explicitly insecure (``insecure = true`` / ``HERD_INSECURE=1``), as the tests that use it were
written for plain HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def herd_cmd() -> list[str]:
    return [sys.executable, "-m", "cli.main"]


def _wait_file(path: Path, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("control_url"):
                    return data
            except ValueError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}): {log.read_text()[-2000:]}")
        time.sleep(0.02)
    raise TimeoutError(f"{path} did not appear in {timeout}s: {log.read_text()[-2000:]}")


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    state_dir: Path
    log: Path
    url: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None


class LocalCluster:
    """``with LocalCluster(tmp, token_dir, n_agents=4) as c: ...`` (blocking helpers)."""

    def __init__(self, root: Path, token_dir: Path, *, n_agents: int = 4, heartbeat_s: float = 0.2,
                 fence_after_s: float = 1.0, profile: str = "simulated:dgx-h100", racks: int = 2,
                 placer_port: int = 0, extra_placer_config: str = "", recover_s: float | None = None,
                 origins: tuple[str, ...] | list[str] = (), tls: bool = False) -> None:
        """``origins``: what the agents may fetch from (``--allowed-origin``; an agent
        allows none by default)."""
        self.root = Path(root)
        self.token_dir = Path(token_dir)
        self.n_agents = n_agents
        self.heartbeat_s = heartbeat_s
        self.fence_after_s = fence_after_s
        self.profile = profile
        self.racks = racks
        self.placer_port = placer_port
        self.wire_port = 0
        self.extra = extra_placer_config
        self.recover_s = max(3 * heartbeat_s, 0.5) if recover_s is None else recover_s
        self.origins = tuple(origins)
        self.tls = tls
        self.pki: Any = None                 # infra.pki.ThrowawayPKI when tls
        self.placer: Proc | None = None
        self.agents: dict[str, Proc] = {}

    # ------------------------------------------------------------ processes

    @property
    def verify(self) -> Any:
        """httpx's ``verify=`` for this cluster's placer and agents (the CA, or True)."""
        if self.pki is None:
            return True
        from infra.tls import client_context
        return client_context(self.pki.ca)

    def _spawn(self, name: str, args: list[str], state_dir: Path, tls_dir: Path | None = None) -> Proc:
        state_dir.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HERD_TOKEN_DIR": str(self.token_dir)}
        env.pop("HERD_PLACER", None)
        env.pop("HERD_INSECURE", None)
        env.pop("HERD_TLS_DIR", None)
        if tls_dir is not None:
            env["HERD_TLS_DIR"] = str(tls_dir)
        else:
            env["HERD_INSECURE"] = "1"
        f = open(log, "ab")
        p = subprocess.Popen(herd_cmd() + ["--log-level", "INFO"] + args, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, cwd=str(ROOT), start_new_session=True)
        f.close()
        return Proc(name, p, state_dir, log)

    def start_placer(self, timeout: float = 20.0) -> Proc:
        sd = self.root / "placer"
        sd.mkdir(parents=True, exist_ok=True)
        (sd / "endpoints.json").unlink(missing_ok=True)
        conf = self.root / "placer.toml"
        if self.tls and self.pki is None:
            from infra.pki import throwaway
            self.pki = throwaway(self.root / "pki")
        conf.write_text(
            "[placer]\n"
            f"heartbeat_s = {self.heartbeat_s}\nfence_after_s = {self.fence_after_s}\n"
            f"recover_s = {self.recover_s}\nack_timeout_s = 2.0\ntick_s = 0.05\n"
            + (f'insecure = false\ntls_dir = "{self.pki.dir}"\n' if self.tls else "insecure = true\n")
            + f'wire_listen = "127.0.0.1:{self.wire_port}"\n' + self.extra)
        p = self._spawn("placer", ["placer", "run", "--listen", f"127.0.0.1:{self.placer_port}",
                                   "--token-dir", str(self.token_dir), "--state-dir", str(sd),
                                   "--config", str(conf)], sd, tls_dir=self.pki.dir if self.tls else None)
        p.info = _wait_file(sd / "endpoints.json", p.proc, timeout, p.log)
        p.url = p.info["control_url"]
        self.placer_port = int(p.url.rsplit(":", 1)[1])  # a restart comes back on the same ports
        self.wire_port = int(str(p.info.get("wire_url") or ":0").rsplit(":", 1)[1])
        self.placer = p
        return p

    @property
    def placer_urls(self) -> list[str]:
        """Every placer an agent is told of (one here; several on etcd: cli.demo_ha)."""
        assert self.placer is not None
        return [self.placer.url]

    def start_agent(self, i: int, timeout: float = 30.0) -> Proc:
        node = f"node{i}"
        sd = self.root / node
        sd.mkdir(parents=True, exist_ok=True)
        (sd / "endpoints.json").unlink(missing_ok=True)
        p = self._spawn(node, ["agent", "run", "--node-id", node, "--gpus", self.profile, "--state-dir", str(sd),
                               "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                               *[a for u in self.placer_urls for a in ("--placer", u)],
                               "--token-dir", str(self.token_dir),
                               "--zone", "z1", "--block", "b1", "--rack", f"rack{i % self.racks}",
                               "--heartbeat-s", str(self.heartbeat_s),
                               *[a for o in self.origins for a in ("--allowed-origin", o)]], sd,
                        tls_dir=self.pki.node_dir(node) if self.tls else None)
        p.info = _wait_file(sd / "endpoints.json", p.proc, timeout, p.log)
        p.url = p.info["control_url"]
        self.agents[node] = p
        return p

    def start(self) -> LocalCluster:
        self.start_placer()
        for i in range(self.n_agents):
            self.start_agent(i)
        return self

    def stop_proc(self, p: Proc, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if not p.alive():
            return
        p.signal_group(signal.SIGCONT)
        try:
            p.proc.send_signal(sig)
            p.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            p.signal_group(signal.SIGKILL)
            p.proc.wait(5)

    def pause(self, node: str) -> None:
        """A partition: the agent process freezes (SIGSTOP); its workloads keep running."""
        self.agents[node].proc.send_signal(signal.SIGSTOP)

    def resume(self, node: str) -> None:
        self.agents[node].proc.send_signal(signal.SIGCONT)

    def kill_host(self, node: str) -> None:
        """A whole-host failure: the agent and every workload it started die together."""
        p = self.agents[node]
        pids = self.workload_pids(node)
        p.signal_group(signal.SIGKILL)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        p.proc.wait(5)

    def read_headers(self) -> dict[str, str]:
        """Reads on agents need the viewer role (scheduler_link/authz.py)."""
        from infra.auth import TokenSet, auth_header
        t = TokenSet.load(self.token_dir)
        return auth_header(t.viewer or t.operator)

    def workload_pids(self, node: str) -> list[int]:
        import httpx
        try:
            r = httpx.get(self.agents[node].url + "/v1/workloads", timeout=2, headers=self.read_headers(),
                          verify=self.verify)
            data = r.json()
        except (httpx.HTTPError, ValueError):
            return []
        items = data.get("workloads", data) if isinstance(data, dict) else data
        return [int(w["pid"]) for w in items if isinstance(w, dict) and w.get("pid")]

    def all_procs(self) -> list[Proc]:
        return ([self.placer] if self.placer else []) + list(self.agents.values())

    def close(self) -> None:
        for p in list(self.agents.values()):
            self.stop_proc(p)
        if self.placer is not None:
            self.stop_proc(self.placer)
        # any workload left behind (agents keep workloads across their own stop by design)
        for p in self.agents.values():
            for pid in _pids_in_state(p.state_dir):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pids_in_state(state_dir: Path) -> list[int]:
    """Workload process groups recorded anywhere in an agent's state dir (best effort)."""
    out: list[int] = []
    for f in state_dir.rglob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (ValueError, OSError):
            continue
        stack = [data]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                for k, v in x.items():
                    if k in ("pid", "pgid") and isinstance(v, int) and v > 1:
                        out.append(v)
                    elif isinstance(v, dict | list):
                        stack.append(v)
            elif isinstance(x, list):
                stack.extend(x)
    return sorted(set(out))
