"""One tenant per uid: each workload runs as a uid of its own, sees no other tenant's
processes in /proc, and can open only its assigned GPU device nodes (issue 42, finding 6).

Theory of operation
-------------------
*Uids.* A root agent gives each workload that names no user of its own a uid from
``[isolation] uid_range`` (gid of the same number, no other group). The lease is taken
just before the command leaves for a shim (:meth:`Tenancy.for_launch`, the ShimPool's
``prepare`` hook) and released when the workload's processes are gone
(:meth:`agent.isolation.Isolation.remove`). Free uids form a queue: a released uid goes
to its back, so it is handed out again only after every other free uid was; a workload
restarted in place gets its own uid back while it is free. A uid that was ever handed
out, or that had a live process when the agent started, is *suspect*: it is handed out
again only after a scan of /proc found no process whose real, effective, saved or
filesystem uid is it. The range may hold no uid or gid of /etc/passwd or /etc/group nor
any subordinate id of /etc/subuid or /etc/subgid (a user's rootless containers run as
those): the agent refuses to start otherwise.

The workload's scratch dir is chowned to its uid (0700) at each lease and back to the
agent (still 0700) at release, so a later tenant of the same uid cannot reach what an
earlier one left there.

*/proc.* The workload runs in a mount namespace of its own (made by the shim in the
child, before it drops to the uid) with a /proc mounted ``hidepid=invisible`` (``2``
before Linux 5.8): other uids' processes are neither listed nor openable. Where the
host's /proc already hides them, no /proc is mounted and the status says ``host``.

*GPU device nodes.* In cgroup mode an eBPF device program (BPF_PROG_TYPE_CGROUP_DEVICE)
on the workload's cgroup refuses NVIDIA GPU nodes (char major 195, minors below 254)
other than the assigned minors; nvidiactl (255), nvidia-modeset (254) and other majors
(nvidia-uvm) stay allowed. Without a workload cgroup (or where BPF cannot be loaded) the
workload's mount namespace gets a tmpfs over the device dir holding the host's entries
except the GPU nodes (``nvidiaN``) it was not assigned.

Invariants: two live leases never hold one uid; a suspect uid is handed out only after a
scan that found no process of it; where a mechanism is unavailable the status says so
(``none: ...``) and today's behaviour holds (one shared user, CUDA_VISIBLE_DEVICES only).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import platform
import re
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal

import msgspec

from .errors import ConfigError, ShimError
from .launcher import SHIM_PATH, LaunchCommand, WorkloadView
from .state import WorkloadRecord

log = logging.getLogger("herd.agent.tenants")

DEFAULT_UID_RANGE = "200000-265535"
NVIDIA_MAJOR = 195
NVIDIA_FIRST_CONTROL_MINOR = 254          # nvidia-modeset 254, nvidiactl 255
GPU_NODE = re.compile(r"nvidia[0-9]+")
HIDING = ("invisible", "2", "ptraceable", "4")   # hidepid values that hide other uids' processes


class IsolationSection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[isolation]`` of the agent config: tenants apart from each other."""
    uid_range: str = DEFAULT_UID_RANGE   # "FIRST-LAST": a uid (and gid) per workload; "off": all as [workloads] user
    hide_proc: str = "auto"              # auto (host option, else a /proc per workload) | off
    gpu_devices: str = "auto"            # auto (eBPF device filter in cgroup mode, else a /dev per workload) | off
    dev_dir: str = "/dev"                # where the GPU device nodes are


def parse_uid_range(text: str) -> range | None:
    """``"FIRST-LAST"`` (inclusive) as a range; None for ``off`` or empty. ConfigError if malformed."""
    if text.strip() in ("", "off"):
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*-\s*([0-9]+)\s*", text)
    if m is None:
        raise ConfigError(f"[isolation] uid_range must be FIRST-LAST (e.g. {DEFAULT_UID_RANGE}) or off, not {text!r}")
    first, last = int(m[1]), int(m[2])
    if not 1000 <= first <= last < 2**32 - 1:
        raise ConfigError(f"[isolation] uid_range {text!r}: need 1000 <= FIRST <= LAST < 4294967295")
    return range(first, last + 1)


def range_conflicts(uids: range, files: Mapping[str, str]) -> list[str]:
    """What in these files (name -> text of /etc/passwd, /etc/group, /etc/subuid, /etc/subgid)
    has an id inside ``uids`` (pure). passwd and group lines hold ``name:x:ID:...``, subuid
    and subgid lines ``name:FIRST:COUNT``."""
    out: list[str] = []
    for name, text in files.items():
        sub = name.endswith(("subuid", "subgid"))
        for line in text.splitlines():
            f = line.strip().split(":")
            try:
                if sub and len(f) >= 3:
                    lo, n = int(f[1]), int(f[2])
                    if lo < uids.stop and uids.start < lo + n:
                        out.append(f"{name}: {f[0]} has {lo}-{lo + n - 1}")
                elif not sub and len(f) >= 3 and int(f[2]) in uids:
                    out.append(f"{name}: {f[0]} is {f[2]}")
            except ValueError:
                continue
    return out


class UidPool:
    """Which uid each live workload holds, and which free uids must be checked before reuse.
    No I/O: :meth:`lease` is handed the /proc scan to call when it must."""

    def __init__(self, uids: range) -> None:
        self.uids = uids
        self._free: dict[int, None] = dict.fromkeys(uids)   # insertion order = hand-out order
        self._held: dict[str, int] = {}
        self._prev: dict[str, int] = {}    # workload -> the uid it held last (restarts get it back)
        self._last: dict[int, str] = {}    # uid -> the workload that held it last
        self._suspect: set[int] = set()

    def held(self, wid: str) -> int | None:
        return self._held.get(wid)

    def next_uid(self, wid: str) -> int | None:
        """The uid for ``wid``: the one it holds, else its last one while free, else the front
        of the free queue; None when every uid of the range is held."""
        if wid in self._held:
            return self._held[wid]
        prev = self._prev.get(wid)
        if prev is not None and prev in self._free:
            return prev
        return next(iter(self._free), None)

    def needs_scan(self, uid: int) -> bool:
        return uid in self._suspect

    def suspect(self, uids: Iterable[int]) -> None:
        """Uids seen with live processes (at start): to the back of the queue, checked before use."""
        for u in uids:
            if u in self._free:
                del self._free[u]
                self._free[u] = None
                self._suspect.add(u)

    def scanned(self, live: set[int]) -> None:
        """A scan found processes of ``live``: the other suspects are clear, these go to the back."""
        for u in list(self._suspect):
            if u not in live:
                self._suspect.discard(u)
        self.suspect(u for u in live if u in self._free)

    def take(self, wid: str, uid: int) -> int | None:
        """``wid`` holds ``uid`` now; returns the uid it held before this lease (None: none or the same)."""
        if self._held.get(wid) == uid:
            return None
        assert uid in self._free and uid not in self._suspect, uid
        del self._free[uid]
        self._held[wid] = uid
        before = self._prev.get(wid)
        old = self._last.get(uid)
        if old is not None and old != wid and self._prev.get(old) == uid:
            del self._prev[old]
        self._last[uid] = wid
        self._prev[wid] = uid
        return before if before != uid else None

    def lease(self, wid: str, scan: Callable[[], set[int]]) -> tuple[int, int | None] | None:
        """Give ``wid`` a uid: (the uid, the one it held before this lease if another), or None
        when every free uid has a live process. ``scan()`` returns the range's uids that live
        processes have; it is called at most once, and only when the uid to hand out is suspect."""
        uid = self.next_uid(wid)
        if uid is None:
            return None
        if self.needs_scan(uid):
            live = scan()
            self.scanned(live)
            prev = self._prev.get(wid)
            uid = prev if prev in self._free and prev not in live else next(iter(self._free), None)
            if uid is None or uid in self._suspect:
                return None
        return uid, self.take(wid, uid)

    def release(self, wid: str) -> int | None:
        uid = self._held.pop(wid, None)
        if uid is not None:
            self._free[uid] = None
            self._suspect.add(uid)
        return uid

    def statistics(self) -> dict[str, object]:
        return {"range": f"{self.uids.start}-{self.uids.stop - 1}", "held": len(self._held),
                "free": len(self._free), "suspect": len(self._suspect)}


def live_uids(uids: range, proc: str = "/proc") -> set[int]:
    """Uids in ``uids`` that a live process has as real, effective, saved or fs uid (one /proc scan)."""
    out: set[int] = set()
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/status", "rb") as f:
                text = f.read(2048)
        except OSError:
            continue
        i = text.find(b"\nUid:")
        if i < 0:
            continue
        for v in text[i + 5:text.find(b"\n", i + 5)].split():
            if int(v) in uids:
                out.add(int(v))
    return out


def host_hidepid(mounts: str) -> str | None:
    """The hidepid option of the /proc in ``/proc/self/mounts`` if it hides other uids (pure)."""
    for line in mounts.splitlines():
        f = line.split()
        if len(f) >= 4 and f[1] == "/proc" and f[2] == "proc":
            for opt in f[3].split(","):
                k, _, v = opt.partition("=")
                if k == "hidepid" and v in HIDING:
                    return v
    return None


# ---------------------------------------------------------------- eBPF device filter

_BPF_PROG_LOAD, _BPF_PROG_ATTACH = 5, 8
_BPF_PROG_TYPE_CGROUP_DEVICE, _BPF_CGROUP_DEVICE = 15, 6
_SYS_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine())


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(allowed_minors: Iterable[int]) -> bytes:
    """The BPF_PROG_TYPE_CGROUP_DEVICE program (pure): deny char 195:N for N < 254 unless N is
    allowed; allow everything else. ctx is ``{u32 access_type (type in the low 16 bits), u32
    major, u32 minor}``; the program returns 1 to allow."""
    minors = sorted(set(allowed_minors))
    allow = 7 + len(minors) + 2            # index of the "allow" block
    code = [_insn(0x61, 2, 1, 0),          # r2 = ctx->access_type
            _insn(0x57, 2, imm=0xFFFF),    # r2 &= 0xffff (the device type)
            _insn(0x55, 2, off=allow - 3, imm=2),                      # not a char device: allow
            _insn(0x61, 3, 1, 4),          # r3 = ctx->major
            _insn(0x55, 3, off=allow - 5, imm=NVIDIA_MAJOR),           # not NVIDIA's major: allow
            _insn(0x61, 4, 1, 8),          # r4 = ctx->minor
            _insn(0x35, 4, off=allow - 7, imm=NVIDIA_FIRST_CONTROL_MINOR)]   # control nodes: allow
    for i, m in enumerate(minors):
        code.append(_insn(0x15, 4, off=allow - (7 + i) - 1, imm=m))  # an assigned GPU: allow
    code += [_insn(0xB7, 0, imm=0), _insn(0x95),                     # deny
             _insn(0xB7, 0, imm=1), _insn(0x95)]                     # allow
    return b"".join(code)


def _bpf(cmd: int, attr: bytes) -> int:
    if _SYS_BPF is None:
        raise OSError(0, f"no bpf syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr.ljust(128, b"\0"), 128)
    r = int(libc.syscall(_SYS_BPF, cmd, buf, 128))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def load_device_program(allowed_minors: Iterable[int]) -> int:
    """Load the program; its fd (the caller closes it). OSError where BPF is not allowed."""
    code = ctypes.create_string_buffer(device_program(allowed_minors))
    lic = ctypes.create_string_buffer(b"GPL")
    n = (len(code) - 1) // 8
    return _bpf(_BPF_PROG_LOAD, struct.pack("<IIQQ", _BPF_PROG_TYPE_CGROUP_DEVICE, n,
                                            ctypes.addressof(code), ctypes.addressof(lic)))


def attach_device_filter(cgroup: str, allowed_minors: Iterable[int]) -> None:
    """Attach the device program to the cgroup dir ``cgroup`` (it stays attached until the cgroup
    is removed). OSError where it cannot."""
    prog = load_device_program(allowed_minors)
    try:
        cg = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _bpf(_BPF_PROG_ATTACH, struct.pack("<IIII", cg, prog, _BPF_CGROUP_DEVICE, 0))
        finally:
            os.close(cg)
    finally:
        os.close(prog)


# ---------------------------------------------------------------- the shell


def probe_namespace() -> tuple[bool, str]:
    """Can a workload get a mount namespace with its own /proc (hidepid)? Asked of a shim child
    once at start (it unshares itself, never the agent). (ok, hidepid value or the reason)."""
    try:
        r = subprocess.run([sys.executable, "-I", "-S", SHIM_PATH, "--probe-ns"], capture_output=True,
                           timeout=30, check=False)
        ans = json.loads(r.stdout or b"{}")
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return False, f"namespace probe failed ({e})"
    if ans.get("ok"):
        return True, str(ans.get("hidepid"))
    return False, str(ans.get("error") or "namespace probe failed")


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


class Modes(msgspec.Struct, frozen=True, kw_only=True):
    """What keeps tenants apart on this host, decided once at start (:func:`decide`)."""
    uids: Literal["per-workload", "shared"]
    proc: Literal["host", "namespace", "none"]
    hidepid: str | None = None       # the option each workload's own /proc is mounted with
    gpu_filter: bool = False         # an eBPF device filter for workloads with a cgroup
    gpu_namespace: bool = False      # a /dev of their own for the others
    notes: tuple[str, ...] = ()      # what does not hold here, and why (log and status)

    def gpu_devices(self, cgroups: bool) -> Literal["filter", "namespace", "none"]:
        """How GPU device access is limited for workloads with (``cgroups``) or without a cgroup."""
        if cgroups and self.gpu_filter:
            return "filter"
        return "namespace" if self.gpu_namespace else "none"


def decide(section: IsolationSection, *, privileged: bool, ns: tuple[bool, str], host_hidepid: str | None,
           bpf: tuple[bool, str]) -> Modes:
    """The modes from the settings and what the host allows (pure): ``ns`` = (a workload may have
    a mount namespace with a hidepid /proc, that hidepid value or why not), ``bpf`` = (a device
    program loads, why not)."""
    notes: list[str] = []
    shared = parse_uid_range(section.uid_range) is None or not privileged
    if parse_uid_range(section.uid_range) is None:
        notes.append("uids: every workload runs as [workloads] user ([isolation] uid_range = off)")
    elif not privileged:
        notes.append("uids: the agent is not root; every workload runs as its own user")
    proc: Literal["host", "namespace", "none"] = "none"
    hidepid = None
    if section.hide_proc == "off":
        notes.append("proc: other workloads' processes are visible ([isolation] hide_proc = off)")
    elif host_hidepid is not None:
        proc = "host"
    elif ns[0]:
        proc, hidepid = "namespace", ns[1]
    else:
        notes.append(f"proc: other workloads' processes are visible (no mount namespace: {ns[1]})")
    gpu_filter = section.gpu_devices != "off" and privileged and bpf[0]
    gpu_ns = section.gpu_devices != "off" and ns[0]
    if section.gpu_devices == "off":
        notes.append("gpu_devices: CUDA_VISIBLE_DEVICES only ([isolation] gpu_devices = off)")
    else:
        if not gpu_filter:
            notes.append(f"gpu_devices: no eBPF device filter ({bpf[1] if privileged else 'the agent is not root'})")
        if not gpu_ns:
            notes.append(f"gpu_devices: no device namespace ({ns[1]}): without a filter, CUDA_VISIBLE_DEVICES only")
    return Modes(uids="shared" if shared else "per-workload", proc=proc, hidepid=hidepid, gpu_filter=gpu_filter,
                 gpu_namespace=gpu_ns, notes=tuple(notes))


class Tenancy:
    """What keeps workloads apart from each other on one host: the uid pool, the /proc and
    /dev each workload sees, the device filter. Decided once at start (:func:`decide`); said
    in :meth:`statistics` and the log."""

    def __init__(self, section: IsolationSection = IsolationSection(), *,
                 gpu_minors: Callable[[], Mapping[str, int]] = dict,
                 privileged: bool | None = None, etc: str = "/etc", proc: str = "/proc") -> None:
        self.section = section
        self.privileged = os.geteuid() == 0 if privileged is None else privileged
        self._gpu_minors = gpu_minors
        self._proc = proc
        self._agent = (os.geteuid(), os.getegid())
        self._scratch: dict[str, Path] = {}
        self._dev_key: tuple[int, int, int] | None = None   # the device dir when last listed
        self._dev_nodes: frozenset[int] = frozenset()
        self.bpf_failures = 0
        uids = parse_uid_range(section.uid_range)
        self.pool: UidPool | None = None
        if uids is not None and self.privileged:
            bad = range_conflicts(uids, {f: _read(f"{etc}/{f}") for f in ("passwd", "group", "subuid", "subgid")})
            if bad:
                raise ConfigError(f"[isolation] uid_range {section.uid_range} overlaps ids in use on this host "
                                  f"({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}): pick a free range")
            self.pool = UidPool(uids)
            self.pool.suspect(live_uids(uids, proc))
        wanted = self.privileged and (section.hide_proc != "off" or section.gpu_devices != "off")
        ns = probe_namespace() if wanted else (False, "the agent is not root" if not self.privileged else "off")
        bpf = (False, "off")
        if section.gpu_devices != "off" and self.privileged:
            try:
                os.close(load_device_program([]))
                bpf = (True, "")
            except OSError as e:
                bpf = (False, e.strerror or str(e))
        self.modes = decide(section, privileged=self.privileged, ns=ns,
                            host_hidepid=host_hidepid(_read(f"{proc}/self/mounts")), bpf=bpf)
        m = self.modes
        log.info("tenants uids=%s uid_range=%s proc=%s gpu_devices=%s (cgroup mode: %s)", m.uids,
                 section.uid_range if self.pool is not None else None, m.proc, m.gpu_devices(False),
                 m.gpu_devices(True))
        for note in m.notes:
            log.warning("tenants: %s", note)

    # ------------------------------------------------------------ per launch

    def _lease(self, wid: str, scratch: Path) -> int:
        pool = self.pool
        assert pool is not None
        got = pool.lease(wid, lambda: live_uids(pool.uids, self._proc))
        if got is None:
            st = pool.statistics()
            raise ShimError(f"no free workload uid in {st['range']} ({st['held']} held, the rest with live processes)")
        uid, before = got
        try:
            _own(scratch, uid, before, pool.uids)
        except OSError as e:
            pool.release(wid)
            raise ShimError(f"cannot give scratch dir {scratch} to uid {uid}: {e.strerror or e}") from e
        self._scratch[wid] = scratch
        return uid

    def release(self, wid: str) -> None:
        """The workload's processes are gone: its uid may go to another workload (after a scan)."""
        if self.pool is None or self.pool.release(wid) is None:
            return
        scratch = self._scratch.pop(wid, None)
        if scratch is not None:
            with contextlib.suppress(OSError):   # gone with the workload's dir: nothing to seal
                os.chown(scratch, *self._agent, follow_symlinks=False)

    def _minors(self, rec: WorkloadRecord) -> list[int]:
        known = self._gpu_minors()
        out = []
        for i, u in enumerate(rec.gpus):
            if u in known:
                out.append(known[u])
            elif i < len(rec.gpu_indices):
                out.append(rec.gpu_indices[i])
        return out

    def _gpu_nodes(self) -> frozenset[int]:
        """The numbers N of the ``nvidiaN`` nodes in the device dir. Listed again only when the
        dir changed (an entry made or removed changes its mtime): one stat a pod, not a listing
        and a match per entry on the event loop for each pod a placement starts. A listing is
        kept only once the dir's last change is a second old, so a change within the same
        timestamp tick as the listing is never missed (git's "racy" rule)."""
        try:
            st = os.stat(self.section.dev_dir)
        except OSError:
            return frozenset()
        key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        if self._dev_key != key:
            try:
                names = os.listdir(self.section.dev_dir)
            except OSError:
                return frozenset()
            self._dev_nodes = frozenset(int(n[6:]) for n in names if GPU_NODE.fullmatch(n))
            settled = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > 1_000_000_000
            self._dev_key = key if settled else None
        return self._dev_nodes

    def _hidden_nodes(self, allowed: list[int]) -> bool:
        return not self._gpu_nodes().issubset(allowed)

    def view(self, rec: WorkloadRecord, cgroup: str | None) -> tuple[str | None, list[int] | None]:
        """(hidepid for the workload's /proc, GPU minors its /dev keeps, None: the host's /dev)."""
        m = self.modes
        if not (m.gpu_filter or m.gpu_namespace):
            return m.hidepid, None
        minors = self._minors(rec)
        if cgroup is not None and m.gpu_filter:
            try:
                attach_device_filter(cgroup, minors)
                return m.hidepid, None
            except OSError as e:
                self.bpf_failures += 1
                log.warning("device filter not attached, using a device namespace cgroup=%s err=%s", cgroup, e)
        if m.gpu_namespace and self._hidden_nodes(minors):
            return m.hidepid, minors
        return m.hidepid, None

    def for_launch(self, cmd: LaunchCommand) -> LaunchCommand:
        """``cmd`` as this host runs it: the workload's own uid (when it names no user), and
        the /proc and /dev it sees. Raises ShimError (the launch fails) when no uid is free."""
        rec = msgspec.convert(cmd.record, WorkloadRecord)
        changes: dict[str, object] = {}
        if self.pool is not None and not rec.user:
            uid = self._lease(rec.workload_id, Path(cmd.dir) / "scratch")
            name = f"herd-{uid}"
            changes["user"] = {"uid": uid, "gid": uid, "groups": [uid]}
            changes["env"] = {**cmd.env, "USER": name, "LOGNAME": name}
        hidepid, minors = self.view(rec, cmd.cgroup)
        if hidepid is not None or minors is not None:
            changes["view"] = WorkloadView(hidepid=hidepid, dev_dir=self.section.dev_dir if minors is not None else None,
                                           gpu_minors=minors or [])
        return msgspec.structs.replace(cmd, **changes) if changes else cmd

    def statistics(self, *, cgroups: bool) -> dict[str, object]:
        """For the status API: the modes (``gpu_devices`` for workloads of this agent's isolation
        mode, with or without ``cgroups``), what does not hold here, the uid pool's counts."""
        m = self.modes
        return {"uids": m.uids, "proc": m.proc, "hidepid": m.hidepid, "gpu_devices": m.gpu_devices(cgroups),
                "notes": list(m.notes), "uid_pool": self.pool.statistics() if self.pool is not None else None,
                "device_filter_failures": self.bpf_failures}


def _own(scratch: Path, uid: int, before: int | None, uids: range) -> None:
    """Give the scratch dir to ``uid`` (0700). A workload that held another uid before (a
    restart after its uid went elsewhere, or after an agent restart) gets its old files too."""
    st = os.lstat(scratch)
    top = st.st_uid
    if before is None and top != uid and top in uids:
        before = top            # never released (the agent restarted meanwhile): still its old uid's
    if before is not None:
        for root, dirs, files in os.walk(scratch):
            for n in dirs + files:
                p = os.path.join(root, n)
                if os.lstat(p).st_uid == before:
                    os.chown(p, uid, uid, follow_symlinks=False)
    # only what differs: a metadata change waits on a busy disk's journal (once per pod, before its launch)
    if (top, st.st_gid) != (uid, uid):
        os.chown(scratch, uid, uid, follow_symlinks=False)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(scratch, 0o700, follow_symlinks=False)

