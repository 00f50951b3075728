"""Network namespaces for benchmarks: a private bridge, rate-limited host links.

Layout (everything created here, removed on exit, even on error or Ctrl-C)::

    netns <prefix>-hub    bridge br0; one veth end per host (vh<i>), tbf-limited
    netns <prefix>-h<i>   eth0 = 10.77.0.<10+i>/24 (origin: 10.77.0.2), tbf-limited

Both directions of every host link are shaped with ``tc qdisc ... tbf``: the host's
eth0 egress (its upload) and the hub-side veth egress (its download). Nothing is
created in, or routed to, the caller's network namespace: the veth pairs are made
inside the hub namespace with their peer moved straight into the host namespace.

Needs root, ``ip`` and ``tc`` (iproute2) and a kernel with netns + veth + bridge + tbf;
:func:`check` says what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

SUBNET = "10.77.0"


class NetnsUnavailable(Exception):
    """Root, iproute2, or kernel support for netns/veth/bridge/tbf is missing."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def check(prefix: str | None = None) -> None:
    """Raise NetnsUnavailable with a clear reason unless we can build a lab here."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise NetnsUnavailable("needs root (network namespaces and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"needs iproute2: `{tool}` not found")
    name = f"{prefix or 'hbprobe' + str(os.getpid())}-probe"
    try:
        r = _run(["ip", "netns", "add", name], check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"cannot create a network namespace: {r.stderr.strip()}")
        for argv in (["ip", "-n", name, "link", "add", "br0", "type", "bridge"],
                     ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                     ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "v0", "root", "tbf",
                      "rate", "100mbit", "burst", "128kb", "latency", "50ms"]):
            r = _run(argv, check=False)
            if r.returncode != 0:
                raise NetnsUnavailable(f"`{' '.join(argv[3:] if argv[1] == '-n' else argv)}` failed: "
                                       f"{r.stderr.strip()}")
    finally:
        _run(["ip", "netns", "del", name], check=False)


@dataclass
class Host:
    name: str          # the netns name
    ip: str
    index: int

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def tx_bytes(self) -> int:
        r = _run(self.exec_argv(["cat", "/sys/class/net/eth0/statistics/tx_bytes"]))
        return int(r.stdout.strip())

    def rx_bytes(self) -> int:
        r = _run(self.exec_argv(["cat", "/sys/class/net/eth0/statistics/rx_bytes"]))
        return int(r.stdout.strip())


@dataclass
class NetLab:
    """``with NetLab(rate="100mbit") as lab: h = lab.add_host(); ...``"""
    rate: str = "100mbit"
    prefix: str = field(default_factory=lambda: f"hb{os.getpid()}")
    burst: str = "128kb"
    latency: str = "50ms"
    mtu: int = 1500
    # Bridged frames through iptables (br_netfilter, when the module is loaded: Docker
    # loads it): off by default. The hub stands for a switch; a real host's NIC does not
    # run its peers' frames through netfilter a second time, and here that work (~8 % of
    # the namespace bench's CPU at 16 nodes, perf) is charged to the node processes.
    bridge_nf: bool = False
    # sysctls set in every host namespace (each starts from the kernel's defaults), e.g.
    # {"net.ipv4.tcp_slow_start_after_idle": "0"}: the TCP tuning a fleet's hosts would carry
    sysctls: dict[str, str] = field(default_factory=dict)
    hosts: list[Host] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)
    _old_handlers: dict[int, Any] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def __enter__(self) -> NetLab:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._add_ns(self.hub)
            _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
            _run(["ip", "-n", self.hub, "link", "set", "lo", "up"])
            if not self.bridge_nf:
                self._bridge_nf_off()
        except BaseException:
            self.close()
            raise
        return self

    def _bridge_nf_off(self) -> None:
        """br_netfilter's per-namespace switches set to 0 in the hub (absent when the
        module is not loaded: then there is nothing to turn off)."""
        for table in ("iptables", "ip6tables", "arptables"):
            key = f"/proc/sys/net/bridge/bridge-nf-call-{table}"
            _run(["ip", "netns", "exec", self.hub, "sh", "-c", f"[ ! -e {key} ] || echo 0 > {key}"])

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    def add_host(self, octet: int | None = None) -> Host:
        i = len(self.hosts)
        name = f"{self.prefix}-h{i}"
        ip = f"{SUBNET}.{octet if octet is not None else 10 + i}"
        self._add_ns(name)
        hub_end = f"vh{i}"
        _run(["ip", "-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", "eth0",
              "netns", name])
        _run(["ip", "-n", self.hub, "link", "set", hub_end, "master", "br0"])
        _run(["ip", "-n", self.hub, "link", "set", hub_end, "mtu", str(self.mtu), "up"])
        _run(["ip", "-n", name, "addr", "add", f"{ip}/24", "dev", "eth0"])
        _run(["ip", "-n", name, "link", "set", "eth0", "mtu", str(self.mtu), "up"])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        for key, value in self.sysctls.items():
            _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", f"{key}={value}"])
        tbf = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf])
        _run(["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", hub_end, "root", *tbf])
        h = Host(name, ip, i)
        self.hosts.append(h)
        return h

    def close(self) -> None:
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces.clear()
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()


def rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8 (tc units: kbit, mbit, gbit, bit; k=1000)."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit, 1gbit")
