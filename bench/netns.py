"""Network namespaces for benchmarks: a private bridge, rate-limited host links.

Layout (everything created here, removed on exit, even on error or Ctrl-C)::

    netns <prefix>-hub    bridge br0; one veth end per host (vh<i>), rate-limited
    netns <prefix>-h<i>   eth0 = 10.77.0.<10+i>/24 (origin: 10.77.0.2), rate-limited

Both directions of every host link are shaped the same way (:class:`Shaping`): the
host's eth0 egress (its upload) and the hub-side veth egress (its download). Two kinds:

``tbf``  one token bucket, one FIFO holding up to ``latency`` of data. A host that
         uploads and downloads at full rate queues the ACKs of its downloads behind a
         full upload queue (up to ``latency``, 400 ms in bench.herd), so plain
         all-to-all TCP tops out near 1.3 x ideal in this lab with no herd code at all.
``htb``  an htb class at the link rate over two leaves: TCP packets under 128 bytes
         of IP (pure ACKs, SYNs, small requests) in a prio-0 leaf, everything else in
         a prio-1 byte FIFO of ``queue`` (a duration at the link rate, 100 ms default:
         1.25 MB at 100 mbit). That is what a host NIC (BQL: a short ring; ACKs not
         behind the data) and a switch port (a buffer of its own) do under
         bidirectional load. With 20 ms (250 kB) 16+ flows into one downlink lost
         ~4-5 % of the origin's bytes to retransmits and plain all-to-all TCP took
         1.18-1.30 x ideal; with 100 ms 0.3 % and 1.13-1.19 (N = 8).
         fq_codel or prio would be the obvious leaves; this lab's kernel has neither
         (htb, tbf, pfifo/bfifo and u32 only), and :func:`check` probes what a kind needs.

Nothing is created in, or routed to, the caller's network namespace: the veth pairs
are made inside the hub namespace with their peer moved straight into the host namespace.

Needs root, ``ip`` and ``tc`` (iproute2) and a kernel with netns + veth + bridge and the
qdiscs of the shaping; :func:`check` says what is missing.
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
    """Root, iproute2, or kernel support for netns/veth/bridge/the shaping is missing."""


SHAPINGS = ("tbf", "htb")
# IP packets shorter than this (total length) go to htb's high-priority leaf: a pure ACK
# with timestamps is 52 bytes, a SYN 60; a full-size data segment is the MTU
SMALL_PACKET = 128


@dataclass(frozen=True, slots=True)
class Shaping:
    """How one direction of one host link is shaped (see the module docstring).

    ``burst``: the token bucket of either kind. ``latency``: tbf's queue, as time at
    ``rate``. ``queue``: htb's bulk FIFO, as time at ``rate`` (turned into bytes).
    ``small_share``: the small-packet leaf's guaranteed share of ``rate`` (it may borrow
    up to the whole rate; the bulk leaf is guaranteed the rest)."""
    kind: str = "tbf"
    rate: str = "100mbit"
    burst: str = "64kb"
    latency: str = "400ms"
    queue: str = "100ms"
    small_share: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in SHAPINGS:
            raise ValueError(f"shaping {self.kind!r}: one of {', '.join(SHAPINGS)}")
        if not 0 < self.small_share < 1:
            raise ValueError(f"small_share {self.small_share}: in (0, 1)")
        rate_bits(self.rate)
        duration_s(self.queue)

    def describe(self) -> dict[str, Any]:
        """What a run's JSON records: the parameters and the exact tc lines for one device."""
        d: dict[str, Any] = {"kind": self.kind, "rate": self.rate, "burst": self.burst}
        if self.kind == "tbf":
            d["latency"] = self.latency
        else:
            d.update(queue=self.queue, queue_bytes=self.queue_bytes(), small_share=self.small_share,
                     small_packet_below=SMALL_PACKET)
        d["tc"] = [" ".join(argv) for argv in self.tc_argvs("DEV")]
        return d

    def queue_bytes(self) -> int:
        """htb's bulk FIFO in bytes: ``queue`` at ``rate``, at least 16 full frames."""
        return max(16 * 1514, int(rate_bits(self.rate) / 8 * duration_s(self.queue)))

    def tc_argvs(self, dev: str) -> list[list[str]]:
        """The ``tc`` command lines (without the netns prefix) that shape ``dev``'s egress
        from scratch. Pure: builds argv lists, runs nothing."""
        if self.kind == "tbf":
            return [["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", self.burst,
                     "latency", self.latency]]
        bits = rate_bits(self.rate)
        small = f"{max(1, int(bits * self.small_share / 1000))}kbit"
        bulk = f"{max(1, int(bits * (1 - self.small_share) / 1000))}kbit"
        cls = ["tc", "class", "add", "dev", dev]
        # explicit quantum: htb's default (rate / r2q) overflows at these rates and warns;
        # a quantum of one frame shares a class's borrowed rate by packets, as DRR should
        return [
            ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
            [*cls, "parent", "1:", "classid", "1:1", "htb", "rate", self.rate, "ceil", self.rate,
             "burst", self.burst, "cburst", self.burst],
            [*cls, "parent", "1:1", "classid", "1:10", "htb", "rate", small, "ceil", self.rate,
             "burst", self.burst, "cburst", self.burst, "prio", "0", "quantum", "1514"],
            [*cls, "parent", "1:1", "classid", "1:20", "htb", "rate", bulk, "ceil", self.rate,
             "burst", self.burst, "cburst", self.burst, "prio", "1", "quantum", "1514"],
            ["tc", "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo", "limit", "1000"],
            ["tc", "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo", "limit",
             str(self.queue_bytes())],
            # TCP (protocol 6) with an IP total length under SMALL_PACKET: the u16 at
            # offset 2 of the IP header, masked to its bits above SMALL_PACKET - 1, is 0
            ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "protocol", "6", "0xff",
             "match", "u16", "0x0000", f"{0xffff & ~(SMALL_PACKET - 1):#06x}", "at", "2", "flowid", "1:10"],
        ]


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def check(prefix: str | None = None, shaping: Shaping | None = None) -> None:
    """Raise NetnsUnavailable with a clear reason unless we can build a lab here, with
    ``shaping`` (default: tbf) on its links."""
    shaping = shaping or Shaping()
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
                     *(["ip", "netns", "exec", name, *tc] for tc in shaping.tc_argvs("v0"))):
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
    """``with NetLab(Shaping(rate="100mbit")) as lab: h = lab.add_host(); ...``"""
    shaping: Shaping = field(default_factory=Shaping)
    prefix: str = field(default_factory=lambda: f"hb{os.getpid()}")
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
        h = Host(name, ip, i)
        self._shape(h, self.shaping)
        self.hosts.append(h)
        return h

    def _links(self, h: Host) -> list[tuple[str, str]]:
        """(namespace, device) of both egresses of ``h``'s link: its upload, its download."""
        return [(h.name, "eth0"), (self.hub, f"vh{h.index}")]

    def _shape(self, h: Host, shaping: Shaping) -> None:
        for ns, dev in self._links(h):
            for argv in shaping.tc_argvs(dev):
                _run(["ip", "netns", "exec", ns, *argv])

    def reshape(self, shaping: Shaping) -> None:
        """Every host link shaped with ``shaping`` from now on (both directions): the same
        lab and processes compared under two shapings in one run."""
        for h in self.hosts:
            for ns, dev in self._links(h):
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"])
            self._shape(h, shaping)
        self.shaping = shaping

    def close(self) -> None:
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces.clear()
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()


def duration_s(d: str) -> float:
    """'20ms' -> 0.02 (tc units: s, ms, us)."""
    t = d.strip().lower()
    for suffix, mult in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    raise ValueError(f"duration {d!r}: use e.g. 20ms, 1s")


def rate_bits(rate: str) -> float:
    """'100mbit' -> 1e8 (tc units: kbit, mbit, gbit, bit; k=1000)."""
    r = rate.strip().lower()
    for suffix, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * mult
    raise ValueError(f"rate {rate!r}: use e.g. 100mbit, 1gbit")
