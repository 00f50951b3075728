"""`herd demo --ha`: a highly available placer on one machine. A three-member etcd cluster on
loopback, three ``herd placer run`` processes campaigning on it (placer.ha), four agents with
simulated GPUs that know every placer (``--placer`` repeated); a job placed by the leader, the
leader killed (SIGKILL) mid-demo, the next leader placing the next job, the agents following
it by themselves. Nothing is left running at the end.

:class:`LocalEtcd` and :class:`HACluster` are the blocking helpers the demo and the tests
(tests/test_ha_cluster.py) share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from cli.main import CliError
from cli.output import emit_json, table
from infra.auth import TokenSet

from .localcluster import LocalCluster, Proc, _wait_file

ETCD = shutil.which("etcd")
LEASE_TTL_S = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalEtcd:
    """``size`` etcd members on loopback under ``root`` (Debian's ``etcd-server``); each in its
    own session. ``start()`` waits until every member says it is healthy."""

    def __init__(self, root: Path, size: int = 3) -> None:
        if ETCD is None:
            raise CliError("etcd is not installed (Debian package etcd-server): `herd demo --ha` needs it")
        self.root = Path(root)
        self.names = [f"etcd{i}" for i in range(size)]
        self.client = [f"http://127.0.0.1:{free_port()}" for _ in self.names]
        self.peer = [f"http://127.0.0.1:{free_port()}" for _ in self.names]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def endpoints(self) -> list[str]:
        return list(self.client)

    def start_member(self, i: int) -> None:
        assert ETCD is not None
        p = self.procs[i]
        if p is not None and p.poll() is None:
            return
        d = self.root / self.names[i]
        d.mkdir(parents=True, exist_ok=True)
        initial = ",".join(f"{n}={u}" for n, u in zip(self.names, self.peer, strict=True))
        with open(d / "etcd.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [ETCD, "--name", self.names[i], "--data-dir", str(d / "data"),
                 "--listen-client-urls", self.client[i], "--advertise-client-urls", self.client[i],
                 "--listen-peer-urls", self.peer[i], "--initial-advertise-peer-urls", self.peer[i],
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"herd-demo-{os.getpid()}", "--logger", "zap", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.client[i] + "/health", timeout=1.0) as r:
                return b'"true"' in r.read()
        except (OSError, urllib.error.URLError):
            return False

    def start(self, timeout_s: float = 30.0) -> LocalEtcd:
        for i in range(len(self.names)):
            self.start_member(i)
        deadline = time.monotonic() + timeout_s
        for i in range(len(self.names)):
            while not self.healthy(i):
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise CliError(f"etcd member {self.names[i]} exited {p.returncode} (log under {self.root})")
                if time.monotonic() > deadline:
                    raise CliError(f"etcd member {self.names[i]} not healthy in {timeout_s:g}s (log under {self.root})")
                time.sleep(0.1)
        return self

    def kill_member(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        self.procs[i] = None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    self.kill_member(i)
            self.procs[i] = None


class HACluster(LocalCluster):
    """Several ``herd placer run`` on one etcd, agents that know every placer. ``placers`` are
    the placer processes (their URLs stay theirs: each listens on a port of its own)."""

    def __init__(self, root: Path, token_dir: Path, etcd: list[str], *, n_placers: int = 3,
                 lease_ttl_s: int = LEASE_TTL_S, **kw: Any) -> None:
        super().__init__(root, token_dir, **kw)
        self.etcd = etcd
        self.n_placers = n_placers
        self.lease_ttl_s = lease_ttl_s
        self.placers: list[Proc] = []

    def start_placer(self, timeout: float = 20.0) -> Proc:
        """The next placer (``placer<i>``), campaigning; the first also becomes :attr:`placer`."""
        i = len(self.placers)
        name = f"placer{i}"
        sd = self.root / name
        sd.mkdir(parents=True, exist_ok=True)
        (sd / "endpoints.json").unlink(missing_ok=True)
        conf = self.root / f"{name}.toml"
        conf.write_text(
            "[placer]\n"
            f"heartbeat_s = {self.heartbeat_s}\nfence_after_s = {self.fence_after_s}\n"
            f"recover_s = {self.recover_s}\nack_timeout_s = 2.0\ntick_s = 0.05\ninsecure = true\n"
            f"etcd = {json.dumps(self.etcd)}\netcd_lease_ttl_s = {self.lease_ttl_s}\n" + self.extra)
        p = self._spawn(name, ["placer", "run", "--listen", "127.0.0.1:0", "--token-dir", str(self.token_dir),
                               "--state-dir", str(sd), "--config", str(conf)], sd)
        p.info = _wait_file(sd / "endpoints.json", p.proc, timeout, p.log)
        p.url = p.info["control_url"]
        self.placers.append(p)
        if self.placer is None:
            self.placer = p
        return p

    @property
    def placer_urls(self) -> list[str]:
        return [p.url for p in self.placers]

    def start(self) -> HACluster:
        for _ in range(self.n_placers):
            self.start_placer()
        for i in range(self.n_agents):
            self.start_agent(i)
        return self

    def health(self, p: Proc) -> dict[str, Any] | None:
        """A placer's ``ha`` section of /healthz (None: it did not answer)."""
        try:
            with urllib.request.urlopen(p.url + "/healthz", timeout=2.0) as r:
                ha = json.loads(r.read()).get("ha")
                return ha if isinstance(ha, dict) else None
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def leader(self, timeout_s: float = 20.0, *, besides: Proc | None = None) -> Proc:
        """The placer that says it leads and places (waiting for one, other than ``besides``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.placers:
                if p is not besides and p.alive():
                    h = self.health(p)
                    if h is not None and h.get("placing"):
                        return p
            if time.monotonic() > deadline:
                raise CliError(f"no placer leads after {timeout_s:g}s (logs under {self.root})")
            time.sleep(0.05)

    def kill_placer(self, p: Proc) -> None:
        p.signal_group(signal.SIGKILL)
        p.proc.wait(5)

    def all_procs(self) -> list[Proc]:
        return list(self.placers) + list(self.agents.values())

    def close(self) -> None:
        super().close()   # the agents (and their workloads), then self.placer
        for p in self.placers:
            self.stop_proc(p)


# ---------------------------------------------------------------- the demo

class _HAFlag(argparse.Action):
    """``herd demo --ha``: this module's demo instead of the single-placer one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.ha = True
        namespace.func = run_ha_demo


FLAG: dict[str, Any] = {"action": _HAFlag, "nargs": 0, "default": False,
                        "help": "a highly available placer: 3 etcd members, 3 placers, 4 agents; "
                                "the leader killed mid-demo (needs etcd)"}


def run_ha_demo(args: argparse.Namespace) -> int:
    """Three etcd members, three placers, four agents; a job, the leader killed, the next job
    placed by the next leader; everything stopped at the end (``--keep``: left running)."""
    from scheduler_link.client import PlacerClient
    from scheduler_link.messages import JobSpec

    t0 = time.time()
    root = Path(getattr(args, "workdir", None) or tempfile.mkdtemp(prefix="herd-demo-ha-"))
    quiet = bool(getattr(args, "json", False))

    def say(msg: str) -> None:
        if not quiet:
            print(f"[{time.time() - t0:6.2f}s] {msg}", flush=True)

    from infra.auth import generate_token_dir
    tokens = generate_token_dir(root / "tokens")
    etcd = LocalEtcd(root / "etcd", 3)
    cluster = HACluster(root, tokens, etcd.endpoints, n_agents=4, heartbeat_s=0.5, fence_after_s=10.0,
                        recover_s=1.0, racks=2)
    out: dict[str, Any] = {"workdir": str(root)}
    keep = bool(getattr(args, "keep", False))
    try:
        etcd.start()
        say(f"etcd: 3 members {', '.join(etcd.endpoints)}")
        cluster.start()
        first = cluster.leader()
        say(f"placers: {', '.join(cluster.placer_urls)}; leader {first.name} {first.url}")
        say(f"agents: {len(cluster.agents)} with simulated GPUs, each knowing every placer")
        op = TokenSet.load(tokens).operator
        with PlacerClient(cluster.placer_urls, op, timeout=10, failover_s=30) as c:
            _wait_nodes(c, len(cluster.agents))
            c.submit(JobSpec(job_id="train-a", pods=2, gpus_per_pod=8, argv=["sleep", "3600"], grace_s=0.5))
            a = c.job("train-a", wait="running", timeout_ms=20000)
            say(f"train-a {a.state} on {sorted({p.node_id for p in a.pods})} (placed by {c.url})")
            epoch_a = (cluster.health(first) or {}).get("epoch", 0)
            killed = time.monotonic()
            cluster.kill_placer(first)
            say(f"SIGKILL {first.name} (the leader)")
            nxt = cluster.leader(timeout_s=30, besides=first)
            took = time.monotonic() - killed
            h = cluster.health(nxt) or {}
            say(f"{nxt.name} leads after {took:.1f}s, epoch {epoch_a} -> {h.get('epoch')}")
            _wait_nodes(c, len(cluster.agents))
            c.submit(JobSpec(job_id="train-b", pods=1, gpus_per_pod=8, argv=["sleep", "3600"], grace_s=0.5))
            b = c.job("train-b", wait="running", timeout_ms=20000)
            a2 = c.job("train-a")
            say(f"train-b {b.state} on {sorted({p.node_id for p in b.pods})} (placed by {c.url}); "
                f"train-a still {a2.state}")
            if b.state != "running" or a2.state != "running":
                raise CliError(f"demo: after the failover train-b is {b.state}, train-a {a2.state}")
            out.update({"leader_before": first.url, "leader_after": nxt.url, "epoch_before": epoch_a,
                        "epoch_after": h.get("epoch"), "failover_s": round(took, 2),
                        "jobs": {"train-a": a2.state, "train-b": b.state}, "placed_by": c.url})
            if not keep:
                c.cancel("train-a")
                c.cancel("train-b")
    finally:
        if keep:
            say(f"left running under {root}: HERD_TOKEN_DIR={tokens} HERD_PLACER={','.join(cluster.placer_urls)}")
        else:
            cluster.close()
            etcd.stop()
    out["seconds"] = round(time.time() - t0, 2)
    if quiet:
        emit_json(out)
    else:
        print(table(["", "VALUE"], [(k, v) for k, v in out.items() if k != "jobs"]))
    return 0


def _wait_nodes(c: Any, want: int, timeout_s: float = 30.0) -> None:
    """Until the leader ``c`` reaches has every agent up."""
    deadline = time.monotonic() + timeout_s
    while True:
        up = [n for n in c.nodes() if n.state == "up"]
        if len(up) >= want:
            return
        if time.monotonic() > deadline:
            raise CliError(f"demo: {len(up)} of {want} agents up at {c.url} after {timeout_s:g}s")
        time.sleep(0.1)


