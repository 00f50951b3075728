"""Is a node's report acceptable to the placer's model? A pure check, run before any state
changes (DESIGN.md, Security model: "reports validated before any state changes").

``validate_report(rep)`` returns None for a report the model can take, else one line
saying what is wrong (the placer answers 400 with it and leaves the node as it was).
No I/O, no clock, no placer state: a duplicate GPU UUID *across* nodes needs the
placer's own index and is checked there.

Bounds, chosen to hold at fleet scale (1,048,576 GPUs, 131,072 hosts of 8 GPUs or
NVL72 trays of 4) with a wide margin over any real node, while keeping the worst
report to a few MB:

==============================  ==========  =================================================
what                            bound       why
==============================  ==========  =================================================
GPUs in a snapshot              64          ``placer.topology.MAX_GPUS_PER_NODE`` (owner array width)
GPU indices                     0..63, unique  they are the placer's slot numbers
GPU UUIDs                       unique, 1..128 chars, printable, no spaces
NVLinks per GPU                 64          18 on NVLink 5
health reasons per GPU / host   64 / 256
``xid_counts`` keys per GPU     256
topology matrix                 n x n       n = GPUs in the snapshot (or empty)
workloads in a report           4,096       ``keep_terminal`` (200) + live pods, far over
events in a report              4,096       a heartbeat carries changes since the last one
GPUs per workload               64, unique
manifests held                  65,536      64-hex ids
ids (node, boot, workload, job,  1..253      printable ASCII without spaces or ``/`` for node
placement)                      / 256 chars
zone / block / rack             1..128 chars, non-empty (the model's topology path)
control / data URL              http(s)://host[:port] or empty, <= 2,048 chars, no user info
times (``sent_at``, ``at``, ...)  finite, >= 0 (a NaN would poison the placer's deadline heaps)
==============================  ==========  =================================================
"""

from __future__ import annotations

import math
import re
from urllib.parse import urlsplit

from .messages import WIRE_VERSION, GpuSnapshot, NodeReport

MAX_GPUS_PER_NODE = 64          # = placer.topology.MAX_GPUS_PER_NODE (a test keeps them equal)
MAX_NVLINKS_PER_GPU = 64
MAX_REASONS_PER_GPU = 64
MAX_HOST_REASONS = 256
MAX_XID_KEYS = 256
MAX_WORKLOADS = 4096
MAX_EVENTS = 4096
MAX_MANIFESTS = 65_536
MAX_ID_LEN = 256
MAX_NODE_ID_LEN = 253
MAX_TOPO_LEN = 128
MAX_UUID_LEN = 128
MAX_URL_LEN = 2048
_DIGEST = re.compile(r"[0-9a-f]{32}")
MAX_TEXT_LEN = 4096             # reasons, details, names

# (whole strings: fullmatch, never match with "$", which also takes a trailing newline)
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")
_ID = re.compile(r"[\x21-\x7e]+")          # printable ASCII, no spaces
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _id(value: str, what: str, limit: int = MAX_ID_LEN) -> str | None:
    if not value or len(value) > limit or not _ID.fullmatch(value):
        return f"{what} must be 1..{limit} printable ASCII characters without spaces, got {value[:80]!r}"
    return None


def _time(value: float, what: str) -> str | None:
    if not math.isfinite(value) or value < 0:
        return f"{what} must be a finite time >= 0, got {value!r}"
    return None


_BAD_URL_CHAR = re.compile(r"[\s\x00-\x1f\x7f]")
# The form every agent sends (http(s)://name-or-IPv4[:port][/path], nothing else): a strict
# subset of what _url_parsed accepts, so a match is accepted without urlsplit (~20 us a URL,
# two a report); anything else, a refusal included, goes through the full parse.
_URL_FORM = r"https?://[A-Za-z0-9][A-Za-z0-9.-]*(?::([0-9]{1,5}))?(?:/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*)?"
_PLAIN_URL = re.compile(_URL_FORM)
# A report's head (node id, boot id, zone, block, rack, control and data URL) as every agent
# sends it, joined by newlines (no field's form admits one) and taken in one match: a strict
# subset of what the checks field by field accept (each field's own bounds are in the pattern;
# the ports and URL lengths are checked after), so a match needs none of them. Anything else,
# a refusal included, goes through them for its one-line reason.
_PLAIN_HEAD = re.compile(
    rf"[A-Za-z0-9][A-Za-z0-9._:@-]{{0,{MAX_NODE_ID_LEN - 1}}}\n(?:[\x21-\x7e]{{1,{MAX_ID_LEN}}})?"
    rf"(?:\n[\x21-\x7e]{{1,{MAX_TOPO_LEN}}}){{3}}\n(?:{_URL_FORM})?\n(?:{_URL_FORM})?")


def _url(value: str, what: str) -> str | None:
    if not value:
        return None
    if len(value) <= MAX_URL_LEN and (m := _PLAIN_URL.fullmatch(value)) is not None \
            and (m[1] is None or int(m[1]) <= 65535):
        return None
    return _url_parsed(value, what)


def _url_parsed(value: str, what: str) -> str | None:
    if len(value) > MAX_URL_LEN or _BAD_URL_CHAR.search(value):
        return f"{what} must be an http(s) URL of at most {MAX_URL_LEN} characters without spaces"
    try:
        u = urlsplit(value)
        port = u.port
    except ValueError as e:
        return f"{what} {value[:80]!r} is not a valid URL: {e}"
    if u.scheme not in ("http", "https") or not u.hostname or (port is not None and not 0 <= port <= 65535):
        return f"{what} must be http(s)://host[:port], got {value[:80]!r}"
    if u.username is not None or u.password is not None or u.query or u.fragment:
        return f"{what} must not carry user info, a query or a fragment: {value[:80]!r}"
    return None


def _snapshot(snap: GpuSnapshot) -> str | None:
    n = len(snap.gpus)
    if n > MAX_GPUS_PER_NODE:
        return f"snapshot lists {n} GPUs; a node has at most {MAX_GPUS_PER_NODE}"
    uuids: set[str] = set()
    indices: set[int] = set()
    for g in snap.gpus:
        if not g.uuid or len(g.uuid) > MAX_UUID_LEN or not _ID.fullmatch(g.uuid):
            return f"GPU uuid must be 1..{MAX_UUID_LEN} printable characters without spaces, got {g.uuid[:80]!r}"
        if g.uuid in uuids:
            return f"GPU uuid {g.uuid!r} appears twice in the snapshot"
        uuids.add(g.uuid)
        if not 0 <= g.index < MAX_GPUS_PER_NODE:
            return f"GPU {g.uuid}: index {g.index} outside 0..{MAX_GPUS_PER_NODE - 1}"
        if g.index in indices:
            return f"GPU index {g.index} appears twice in the snapshot"
        indices.add(g.index)
        if len(g.nvlinks) > MAX_NVLINKS_PER_GPU:
            return f"GPU {g.uuid}: {len(g.nvlinks)} NVLinks (at most {MAX_NVLINKS_PER_GPU})"
        if len(g.reasons) > MAX_REASONS_PER_GPU:
            return f"GPU {g.uuid}: {len(g.reasons)} health reasons (at most {MAX_REASONS_PER_GPU})"
        if len(g.telemetry.xid_counts) > MAX_XID_KEYS:
            return f"GPU {g.uuid}: {len(g.telemetry.xid_counts)} xid counters (at most {MAX_XID_KEYS})"
        if g.memory_total_mib < 0:
            return f"GPU {g.uuid}: memory_total_mib must be >= 0"
        if len(g.name) > MAX_TEXT_LEN or len(g.pci_bus_id) > MAX_TEXT_LEN:
            return f"GPU {g.uuid}: name or pci_bus_id over {MAX_TEXT_LEN} characters"
    m = snap.topology_matrix
    if m and (len(m) != n or any(len(row) != n for row in m)):
        return f"topology matrix must be {n} x {n} (the GPUs in the snapshot)"
    if len(snap.host.reasons) > MAX_HOST_REASONS:
        return f"host lists {len(snap.host.reasons)} health reasons (at most {MAX_HOST_REASONS})"
    if snap.nvlink_domain is not None and not 0 < len(snap.nvlink_domain) <= MAX_TEXT_LEN:
        return f"snapshot nvlink_domain must be 1..{MAX_TEXT_LEN} characters"
    return _time(snap.taken_at, "snapshot taken_at")


def _plain_head(rep: NodeReport) -> bool:
    """Whether ``rep``'s head has the form every agent sends (``_PLAIN_HEAD``): then
    :func:`_head_error` has nothing to say of it."""
    t, cu, du = rep.topology, rep.control_url, rep.data_url
    m = _PLAIN_HEAD.fullmatch(f"{rep.node_id}\n{rep.boot_id}\n{t.zone}\n{t.block}\n{t.rack}\n{cu}\n{du}")
    return m is not None and len(cu) <= MAX_URL_LEN and len(du) <= MAX_URL_LEN and (
        m[1] is None or int(m[1]) <= 65535) and (m[2] is None or int(m[2]) <= 65535)


def _head_error(rep: NodeReport) -> str | None:
    """What is wrong with ``rep``'s head (ids, sequence, URLs, topology), field by field."""
    if not rep.node_id or len(rep.node_id) > MAX_NODE_ID_LEN or not _NODE_ID.fullmatch(rep.node_id):
        return (f"node_id must be 1..{MAX_NODE_ID_LEN} characters of letters, digits and ._:@- "
                f"(starting with a letter or digit), got {rep.node_id[:80]!r}")
    if rep.boot_id and (err := _id(rep.boot_id, "boot_id")):
        return err
    if rep.seq < 0:
        return f"seq must be >= 0, got {rep.seq}"
    for what, url in (("control_url", rep.control_url), ("data_url", rep.data_url)):
        if err := _url(url, what):
            return err
    for level in ("zone", "block", "rack"):
        v = getattr(rep.topology, level)
        if not v or len(v) > MAX_TOPO_LEN or not _ID.fullmatch(v):
            return f"topology {level} must be 1..{MAX_TOPO_LEN} printable characters without spaces, got {v[:80]!r}"
    return None


def validate_report(rep: NodeReport) -> str | None:
    """None when ``rep`` is acceptable to the model, else why not (one line)."""
    if rep.version != WIRE_VERSION:
        return f"report version {rep.version} is not {WIRE_VERSION}"
    if _plain_head(rep):
        if rep.seq < 0:
            return f"seq must be >= 0, got {rep.seq}"
    elif err := _head_error(rep):
        return err
    if rep.nvlink_domain is not None and not 0 < len(rep.nvlink_domain) <= MAX_TEXT_LEN:
        return f"nvlink_domain must be 1..{MAX_TEXT_LEN} characters"
    if err := _time(rep.sent_at, "sent_at"):
        return err
    if rep.snapshot is not None and (err := _snapshot(rep.snapshot)):
        return err
    if rep.inventory and not _DIGEST.fullmatch(rep.inventory):
        return "inventory must be 32 lower-case hex digits (messages.gpu_inventory)"
    if len(rep.workloads) > MAX_WORKLOADS:
        return f"report lists {len(rep.workloads)} workloads (at most {MAX_WORKLOADS})"
    seen: set[str] = set()
    for w in rep.workloads:
        if err := _id(w.workload_id, "workload_id") or (w.job_id and _id(w.job_id, "job_id")):
            return err
        if w.workload_id in seen:
            return f"workload {w.workload_id!r} appears twice in the report"
        seen.add(w.workload_id)
        if len(w.gpus) > MAX_GPUS_PER_NODE or len(set(w.gpus)) != len(w.gpus):
            return f"workload {w.workload_id!r}: GPUs must be at most {MAX_GPUS_PER_NODE} distinct UUIDs"
        if w.placement_id and (err := _id(w.placement_id, "placement_id")):
            return err
        if len(w.fetch) > 8 or any(not 0 <= v < 1 << 62 for v in w.fetch.values()):
            return f"workload {w.workload_id!r}: fetch figures must be at most 8 byte counts"
        for name in ("created_at", "updated_at"):
            if err := _time(getattr(w, name), f"workload {w.workload_id!r} {name}"):
                return err
        if w.started_at is not None and (err := _time(w.started_at, f"workload {w.workload_id!r} started_at")):
            return err
        if w.reason is not None and len(w.reason) > MAX_TEXT_LEN:
            return f"workload {w.workload_id!r}: reason over {MAX_TEXT_LEN} characters"
    if len(rep.events) > MAX_EVENTS:
        return f"report carries {len(rep.events)} events (at most {MAX_EVENTS})"
    for ev in rep.events:
        if err := _id(ev.workload_id, "event workload_id") or (ev.job_id and _id(ev.job_id, "event job_id")):
            return err
        if err := _time(ev.at, f"event of {ev.workload_id!r} at"):
            return err
        if len(ev.gpus) > MAX_GPUS_PER_NODE or len(set(ev.gpus)) != len(ev.gpus):
            return f"event of {ev.workload_id!r}: GPUs must be at most {MAX_GPUS_PER_NODE} distinct UUIDs"
        if ev.reason is not None and len(ev.reason) > MAX_TEXT_LEN:
            return f"event of {ev.workload_id!r}: reason over {MAX_TEXT_LEN} characters"
        for name in ("bytes_from_origin", "bytes_from_peers", "bytes_local"):
            v = getattr(ev, name)
            if v is not None and v < 0:
                return f"event of {ev.workload_id!r}: {name} must be >= 0"
    if rep.manifests is not None:
        if len(rep.manifests) > MAX_MANIFESTS:
            return f"report lists {len(rep.manifests)} manifests (at most {MAX_MANIFESTS})"
        for mid in rep.manifests:
            if not _HEX64.fullmatch(mid):
                return f"manifest id {mid[:80]!r} is not 64 lower-case hex characters"
    return None
