"""bench.netns: the tc lines each link shaping builds (pure), and, as root, a lab whose
htb links really put the small packets (a download's ACKs) in the priority leaf and
that reshapes between kinds. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.netns import SMALL_PACKET, Shaping, duration_s, rate_bits

ROOT = Path(__file__).resolve().parent.parent


def _u32_match(argv: list[str], ip_header: bytes) -> bool:
    """What the kernel's u32 does with the filter's ``match`` keys over one IP header."""
    keys = argv[argv.index("u32") + 1: argv.index("flowid")]
    i = 0
    while i < len(keys):
        assert keys[i] == "match"
        if keys[i + 1] == "ip" and keys[i + 2] == "protocol":
            value, mask, off = int(keys[i + 3]), int(keys[i + 4], 16), 9
            if ip_header[off] & mask != value:
                return False
            i += 5
        else:
            assert keys[i + 1] == "u16" and keys[i + 4] == "at"
            value, mask, off = int(keys[i + 2], 16), int(keys[i + 3], 16), int(keys[i + 5])
            if int.from_bytes(ip_header[off:off + 2], "big") & mask != value:
                return False
            i += 6
    return True


def _ip_header(total_length: int, proto: int = 6) -> bytes:
    h = bytearray(20)
    h[0] = 0x45
    h[2:4] = total_length.to_bytes(2, "big")
    h[9] = proto
    return bytes(h)


def test_tbf_is_the_old_single_line() -> None:
    sh = Shaping(kind="tbf", rate="100mbit", burst="64kb", latency="400ms")
    assert sh.tc_argvs("eth0") == [["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                                    "burst", "64kb", "latency", "400ms"]]


def test_htb_sends_small_tcp_packets_to_the_priority_leaf() -> None:
    argvs = Shaping(kind="htb").tc_argvs("vh3")
    assert all(a[a.index("dev") + 1] == "vh3" for a in argvs)
    (flt,) = [a for a in argvs if a[1] == "filter"]
    assert flt[-2:] == ["flowid", "1:10"]
    # a pure ACK with timestamps (52), a SYN (60), the largest small one: priority
    for n in (40, 52, 60, SMALL_PACKET - 1):
        assert _u32_match(flt, _ip_header(n)), n
    # data segments, and small packets that are not TCP, stay in the bulk leaf (the default)
    for n in (SMALL_PACKET, 129, 576, 1500, 9000, 65535):
        assert not _u32_match(flt, _ip_header(n)), n
    assert not _u32_match(flt, _ip_header(52, proto=17))
    root = argvs[0]
    assert root[root.index("default") + 1] == "20"


def test_htb_classes_share_the_link_rate_and_the_bulk_queue_is_short() -> None:
    sh = Shaping(kind="htb", rate="100mbit", burst="64kb", queue="20ms", small_share=0.05)
    classes = {a[a.index("classid") + 1]: a for a in sh.tc_argvs("eth0") if a[1] == "class"}
    assert set(classes) == {"1:1", "1:10", "1:20"}

    def opt(a: list[str], k: str) -> str:
        return a[a.index(k) + 1]

    assert opt(classes["1:1"], "rate") == opt(classes["1:1"], "ceil") == "100mbit"
    assert rate_bits(opt(classes["1:10"], "rate")) + rate_bits(opt(classes["1:20"], "rate")) == 1e8
    for c in ("1:10", "1:20"):
        assert opt(classes[c], "parent") == "1:1" and opt(classes[c], "ceil") == "100mbit"
    assert opt(classes["1:10"], "prio") == "0" and opt(classes["1:20"], "prio") == "1"
    (bulk,) = [a for a in sh.tc_argvs("eth0") if a[1] == "qdisc" and "1:20" in a]
    assert bulk[bulk.index("bfifo") + 2] == "250000"          # 20 ms at 100 mbit
    assert Shaping(kind="htb", rate="1mbit", queue="1ms").queue_bytes() == 16 * 1514   # never under 16 frames
    assert Shaping(kind="htb").queue_bytes() == 1_250_000     # the default: 100 ms at 100 mbit


def test_describe_names_the_parameters_and_lines() -> None:
    d = Shaping(kind="htb", queue="10ms").describe()
    assert d["kind"] == "htb" and d["queue"] == "10ms" and d["queue_bytes"] == 125000
    assert d["small_packet_below"] == SMALL_PACKET and len(d["tc"]) == 7
    assert all(" dev DEV " in line for line in d["tc"])
    t = Shaping(kind="tbf").describe()
    assert t["latency"] == "400ms" and "queue" not in t and len(t["tc"]) == 1


def test_bad_shapings_are_refused() -> None:
    with pytest.raises(ValueError, match="one of"):
        Shaping(kind="fq_codel")
    with pytest.raises(ValueError, match="small_share"):
        Shaping(kind="htb", small_share=1.0)
    with pytest.raises(ValueError, match="duration"):
        Shaping(queue="20")
    assert duration_s("250us") == 250e-6 and duration_s("2s") == 2.0
    r = subprocess.run([sys.executable, "-m", "bench.herd", "--shaping", "tbf,cake"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--shaping" in r.stderr


def _tc_stats(ns: str, dev: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "class", "show", "dev", dev],
                          capture_output=True, text=True, timeout=30, check=True).stdout


def _sent(stats: str, classid: str) -> tuple[int, int]:
    """(bytes, packets) a class sent."""
    lines = stats.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"class htb {classid} "):
            f = lines[i + 1].split()     # " Sent <bytes> bytes <pkts> pkt ..."
            return int(f[1]), int(f[3])
    raise AssertionError(f"no class {classid} in {stats!r}")


@pytest.mark.root
def test_htb_lab_puts_a_downloads_acks_first_and_reshapes() -> None:
    from bench.netns import NetLab, NetnsUnavailable, check

    sh = Shaping(kind="htb", rate="1gbit")
    try:
        check(shaping=sh)
    except NetnsUnavailable as e:
        pytest.skip(str(e))
    with NetLab(sh) as lab:
        a, b = lab.add_host(), lab.add_host()
        recv = ("import socket, sys; s = socket.create_server((sys.argv[1], 7999)); c, _ = s.accept(); n = 0\n"
                "while d := c.recv(1 << 16): n += len(d)\nprint(n)")
        server = subprocess.Popen(b.exec_argv([sys.executable, "-c", recv, b.ip]), stdout=subprocess.PIPE, text=True)
        try:
            send = ("import socket, sys, time\nfor _ in range(100):\n    try:\n"
                    "        c = socket.create_connection((sys.argv[1], 7999), timeout=5); break\n"
                    "    except OSError: time.sleep(0.05)\nc.sendall(bytes(4 << 20)); c.close()")
            subprocess.run(a.exec_argv([sys.executable, "-c", send, b.ip]), check=True, timeout=60)
            out, _ = server.communicate(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        assert int(out) == 4 << 20
        # b only downloaded: its TCP packets were ACKs (and its SYN-ACK), all in the priority
        # leaf; the bulk leaf (the default) saw only what is not IP (ARP) or not TCP
        up = _tc_stats(b.name, "eth0")
        assert _sent(up, "1:10")[1] > 20
        bulk_bytes, bulk_pkts = _sent(up, "1:20")
        assert bulk_pkts <= 4 and bulk_bytes <= 4 * 100, up
        # the data went to b through its hub-side egress's bulk leaf
        assert _sent(_tc_stats(lab.hub, f"vh{b.index}"), "1:20")[0] > 4 << 20
        lab.reshape(Shaping(kind="tbf", rate="1gbit"))
        for ns, dev in ((a.name, "eth0"), (lab.hub, f"vh{a.index}"), (b.name, "eth0"), (lab.hub, f"vh{b.index}")):
            q = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                               capture_output=True, text=True, timeout=30, check=True).stdout
            assert q.startswith("qdisc tbf ") and "htb" not in q, q
        assert lab.shaping.kind == "tbf"


def test_shaping_entries_set_their_own_queue() -> None:
    from bench.herd import shaping_of

    kw = {"rate": "100mbit", "burst": "64kb", "latency": "400ms", "queue": "20ms"}
    assert shaping_of("htb", **kw) == Shaping(kind="htb", queue="20ms")
    assert shaping_of("htb:100ms", **kw) == Shaping(kind="htb", queue="100ms")
    assert shaping_of("tbf:50ms", **kw) == Shaping(kind="tbf", latency="50ms", queue="20ms")
    with pytest.raises(ValueError, match="duration"):
        shaping_of("htb:100", **kw)
