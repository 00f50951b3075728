"""Real etcd clusters for tests: 1 or 3 members on loopback, in a temp dir, on free ports.

``etcd`` is Debian's ``etcd-server`` (``.ci/run`` installs it); tests that need it make a
fixture of :func:`etcd_running`, which skips where the binary is absent. A member
can be killed (SIGKILL), paused (SIGSTOP/SIGCONT) and started again on its data dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.tls import TLSFiles

ETCD = shutil.which("etcd")
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Member:
    name: str
    client_url: str
    peer_url: str
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    tls: TLSFiles | None = None    # https: etcd's certificate, and client certificates required

    def healthy(self) -> bool:
        ctx = None
        if self.tls is not None:
            ctx = ssl.create_default_context(cafile=str(self.tls.ca))
            ctx.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=1.0, context=ctx) as r:
                return b'"true"' in r.read()
        except (OSError, urllib.error.URLError):
            return False


@dataclass
class EtcdCluster:
    """``start()`` and ``stop()``; ``endpoints`` are the members' client URLs."""
    root: Path
    size: int = 1
    tls: TLSFiles | None = None   # serve clients over TLS with this certificate, requiring client certificates
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        scheme = "https" if self.tls is not None else "http"
        for i in range(self.size):
            d = self.root / f"m{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.members.append(Member(f"m{i}", f"{scheme}://127.0.0.1:{free_port()}",
                                       f"http://127.0.0.1:{free_port()}", d / "data", d / "etcd.log", tls=self.tls))

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def _argv(self, m: Member) -> list[str]:
        assert ETCD is not None
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        return [ETCD, "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", m.client_url, "--advertise-client-urls", m.client_url,
                "--listen-peer-urls", m.peer_url, "--initial-advertise-peer-urls", m.peer_url,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"herd-test-{os.getpid()}-{id(self)}",
                "--logger", "zap", "--log-level", "warn", "--enable-v2=false",
                *(["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                   "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"] if self.tls is not None else [])]

    def start_member(self, i: int) -> None:
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            return
        log = open(m.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            m.proc = subprocess.Popen(self._argv(m), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def start(self) -> EtcdCluster:
        for i in range(self.size):
            self.start_member(i)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every running member says it is healthy (it has a leader)."""
        deadline = time.monotonic() + timeout_s
        for m in self.members:
            if m.proc is None:
                continue
            while not m.healthy():
                if m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited {m.proc.returncode}: {self._tail(m)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd {m.name} not healthy in {timeout_s:g}s: {self._tail(m)}")
                time.sleep(0.1)

    def _tail(self, m: Member) -> str:
        try:
            return m.log_path.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def kill_member(self, i: int) -> None:
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait(timeout=10)
        m.proc = None

    def pause_member(self, i: int, paused: bool = True) -> None:
        m = self.members[i]
        if m.proc is not None:
            m.proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        for i, m in enumerate(self.members):
            if m.proc is not None:
                self.pause_member(i, False)
                m.proc.terminate()
        for i, m in enumerate(self.members):
            if m.proc is not None:
                try:
                    m.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.kill_member(i)
                m.proc = None


requires_etcd = pytest.mark.skipif(ETCD is None, reason="etcd absent (Debian package etcd-server)")


def etcd_running(root: Path, size: int = 1, tls: TLSFiles | None = None) -> Iterator[EtcdCluster]:
    """For a fixture: ``yield from etcd_running(tmp_path / "etcd", 3)`` (skips without etcd)."""
    if ETCD is None:
        pytest.skip("etcd absent (Debian package etcd-server)")
    c = EtcdCluster(root, size, tls)
    try:
        c.start()
        yield c
    finally:
        c.stop()
