"""How workloads are isolated on the host: who they run as, and how every process of one
workload is found, signalled and killed (issue 15).

Theory of operation
-------------------
*Identity.* A privileged agent runs workloads as an unprivileged user (``[workloads]
user``, default ``herd-workload``; ``nobody`` when that user does not exist, said once);
a placement may name another user only if it is in ``allowed_users``; uid 0 is refused
unless ``allow_root``. An unprivileged agent (a laptop, ``herd demo`` as a normal user)
runs workloads as itself: it cannot do otherwise. With ``[isolation] uid_range`` (the
default) a root agent runs each workload that names no user as a uid of its own instead,
in a mount namespace of its own (:mod:`agent.tenants`, applied through
:meth:`Isolation.for_launch`, the shim pool's ``prepare`` hook, and released by
:meth:`Isolation.remove`). The shim applies the identity in the
child before ``exec`` (:mod:`agent.shim`): setgroups/setgid/setuid, which drops every
capability, then ``no_new_privs``, umask 077, ``RLIMIT_CORE``, ``oom_score_adj`` 0.

*Membership.* Two modes, chosen once at start and reported in ``/v1/status``:

``cgroup``     each workload in its own cgroup v2 ``<parent>/<workload-id>``, the parent
               inside the agent's delegated subtree (``Delegate=yes``). The child joins it
               before ``exec``, so every descendant is in it whatever it does (``setsid``,
               double fork). Killing is ``cgroup.kill`` (Linux >= 5.14), else freeze, kill
               each pid, thaw. Empty = ``populated 0`` in ``cgroup.events``.
``subreaper``  where no cgroup v2 subtree can be delegated (containers, a hybrid host
               where the agent sits in the root cgroup): the shim is a
               ``PR_SET_CHILD_SUBREAPER``, so every descendant of the workload, including
               one that called ``setsid()`` and left the process group, stays below the
               shim (orphans are re-parented to it). The members are the descendants of
               the shim, found from ``/proc`` (PPid links) with the shim's identity
               checked first. Empty = the shim has no children left.

In both modes the shim itself stays out of the workload's cgroup and group (it must
outlive a ``cgroup.kill`` to write ``exit.json``), waits until the workload is empty, and
only then exits; the agent frees GPUs when the shim is gone *and* the members are gone.

Invariants: a pid is signalled only after it was found in the workload's cgroup, or as a
descendant of a shim whose (pid, start time, boot id) matched; a cgroup is removed only
when empty.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from . import procs
from .errors import ConfigError
from .launcher import LaunchCommand
from .shim import descendants
from .tenants import Tenancy

log = logging.getLogger("herd.agent.isolation")

Mode = Literal["cgroup", "subreaper"]
CGROUP_LEAF = "herd-workloads"
AGENT_LEAF = "agent"
LIMIT_FILES = ("memory.max", "cpu.max", "pids.max")


# ---------------------------------------------------------------- identity

@dataclass(frozen=True, slots=True)
class WorkloadUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str = "/"


def _lookup(name: str) -> WorkloadUser | None:
    try:
        pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, OverflowError):
        if name.isdigit():  # a bare uid without a passwd entry: its own group, no others
            return WorkloadUser(name=name, uid=int(name), gid=int(name))
        return None
    try:
        groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))))
    except OSError:
        groups = (pw.pw_gid,)
    return WorkloadUser(name=pw.pw_name, uid=pw.pw_uid, gid=pw.pw_gid, groups=groups, home=pw.pw_dir)


def agent_user() -> WorkloadUser:
    uid, gid = os.geteuid(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return WorkloadUser(name=name, uid=uid, gid=gid, groups=tuple(sorted(set(os.getgroups()) | {gid})))


class Identities:
    """Resolves the user a workload runs as (the default and the allowed per-job ones)."""

    def __init__(self, default: str, *, allowed: Iterable[str] = (), allow_root: bool = False,
                 privileged: bool | None = None) -> None:
        self.privileged = os.geteuid() == 0 if privileged is None else privileged
        self.allow_root = allow_root
        self.allowed = frozenset(allowed)
        self.notes: list[str] = []
        if not self.privileged:
            self.default = agent_user()
            self.notes.append(f"the agent is unprivileged: workloads run as its own user {self.default.name}")
            return
        found = _lookup(default)
        if found is None:
            found = _lookup("nobody")
            if found is None:
                raise ConfigError(f"workloads.user {default!r} does not exist, nor does 'nobody'")
            self.notes.append(f"workloads.user {default!r} does not exist on this host: workloads run as "
                              f"nobody (uid {found.uid}); systemd/install.sh creates {default!r}")
        self.default = self._check(found)

    def _check(self, u: WorkloadUser) -> WorkloadUser:
        if u.uid == 0 and not self.allow_root:
            raise ConfigError(f"refusing to run workloads as root (user {u.name!r}); set "
                              "[workloads] allow_root = true to allow it")
        return u

    def resolve(self, requested: str | None) -> WorkloadUser:
        """The user for a placement naming ``requested`` (None: the default). Raises
        :class:`ConfigError` (the placement is refused) for a user not allowed here."""
        if not requested:
            return self.default
        if not self.privileged:
            if requested in (self.default.name, str(self.default.uid)):
                return self.default
            raise ConfigError(f"user {requested!r}: this agent is unprivileged and runs workloads as "
                              f"{self.default.name} only")
        if requested not in self.allowed:
            raise ConfigError(f"user {requested!r} is not in this agent's workloads.allowed_users")
        u = _lookup(requested)
        if u is None:
            raise ConfigError(f"user {requested!r} does not exist on this host")
        return self._check(u)


def reachable(path: Path, user: WorkloadUser) -> Path | None:
    """The first directory on the way to ``path`` that ``user`` cannot traverse (None: all
    can be). Uses owner/group/other bits only (no ACLs): an approximation for a warning."""
    if user.uid == os.geteuid():
        return None
    p = Path(os.path.abspath(path))
    for d in [*reversed(p.parents), p]:
        try:
            st = d.stat()
        except OSError:
            return d
        if st.st_uid == user.uid:
            ok = bool(st.st_mode & 0o100)
        elif st.st_gid in user.groups or st.st_gid == user.gid:
            ok = bool(st.st_mode & 0o010)
        else:
            ok = bool(st.st_mode & 0o001)
        if not ok:
            return d
    return None


# ---------------------------------------------------------------- cgroup v2

def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def parse_own_cgroup(proc_self_cgroup: str, mountinfo: str) -> Path | None:
    """The agent's cgroup v2 directory from ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo`` (pure), or None without a cgroup v2 mount / entry."""
    rel = None
    for line in proc_self_cgroup.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip()
    if rel is None:
        return None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep or not right.startswith("cgroup2 "):
            continue
        fields = left.split()
        if len(fields) < 5:
            continue
        root, mnt = fields[3], fields[4]
        # the mount shows the hierarchy from `root`; our path is relative to the hierarchy
        if rel == root or rel.startswith(root.rstrip("/") + "/") or root == "/":
            sub = rel[len(root):] if root != "/" else rel
            return Path(mnt) / sub.lstrip("/")
    return None


class CgroupTree:
    """Workload cgroups ``<parent>/<workload-id>`` in a cgroup v2 directory the agent may
    write (its delegated subtree). Works on any directory laid out like cgroupfs, which is
    how the tests drive it without a kernel."""

    def __init__(self, parent: Path, *, kill: Callable[[int, int], None] = os.kill) -> None:
        self.parent = parent
        self._kill = kill
        self.controllers: frozenset[str] = frozenset()

    def setup(self) -> None:
        self.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.parent, 0o755)
        with contextlib.suppress(OSError):
            have = set((self.parent / "cgroup.controllers").read_text().split())
            want = have & {"memory", "cpu", "pids"}
            if want:
                _write(self.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(want)))
                self.controllers = frozenset(want)

    def path(self, wid: str) -> Path:
        if not wid or "/" in wid or wid in (".", ".."):
            raise ValueError(f"bad workload id for a cgroup: {wid!r}")
        return self.parent / wid

    def create(self, wid: str, limits: dict[str, str] | None = None) -> Path:
        d = self.path(wid)
        d.mkdir(exist_ok=True)
        for name, value in (limits or {}).items():
            if name not in LIMIT_FILES:
                raise ValueError(f"unknown cgroup limit {name}")
            _write(d / name, value)
        return d

    def pids(self, wid: str) -> list[int]:
        try:
            text = (self.path(wid) / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def populated(self, wid: str) -> bool:
        try:
            text = (self.path(wid) / "cgroup.events").read_text()
        except FileNotFoundError:
            return False
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "populated":
                return v.strip() == "1"
        return bool(self.pids(wid))

    def signal(self, wid: str, sig: int) -> int:
        n = 0
        for pid in self.pids(wid):
            with contextlib.suppress(ProcessLookupError):
                self._kill(pid, sig)
                n += 1
        return n

    def kill(self, wid: str) -> None:
        """SIGKILL every process of the workload: ``cgroup.kill`` where the kernel has it,
        else freeze (no fork can outrun the loop), kill each pid, thaw."""
        d = self.path(wid)
        if (d / "cgroup.kill").exists():
            _write(d / "cgroup.kill", "1")
            return
        frozen = (d / "cgroup.freeze").exists()
        if frozen:
            _write(d / "cgroup.freeze", "1")
        try:
            self.signal(wid, signal.SIGKILL)
        finally:
            if frozen:
                _write(d / "cgroup.freeze", "0")

    def remove(self, wid: str) -> bool:
        try:
            os.rmdir(self.path(wid))
            return True
        except FileNotFoundError:
            return True
        except OSError:  # still populated (EBUSY), or a fake dir with files in it
            return False


def delegated(d: Path) -> bool:
    """Was ``d`` delegated to us? systemd (>= 251) marks a ``Delegate=yes`` unit's cgroup
    with the xattr ``trusted.delegate`` (``user.delegate`` for a user manager); a user
    manager's delegation also chowns it. Root writing any cgroup it can is not delegation:
    without the mark, a root agent stays out of a cgroup tree that is not its own."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(d, name) == b"1":
                return True
    return os.geteuid() != 0 and d.stat().st_uid == os.geteuid()


def detect(setting: str, *, proc_self_cgroup: str | None = None, mountinfo: str | None = None,
           privileged: bool | None = None) -> tuple[CgroupTree | None, str]:
    """Choose the mode for ``[workloads] cgroup`` (auto | off | a path): a tree for cgroup
    mode, or None for subreaper mode, and the reason in words."""
    if setting == "off":
        return None, "cgroups off by configuration"
    if setting.startswith("/"):
        tree = CgroupTree(Path(setting))
        try:
            tree.setup()
            probe = tree.create(".probe")
            ok = (probe / "cgroup.procs").exists()
            tree.remove(".probe")
        except (OSError, ValueError) as e:
            return None, f"cgroup dir {setting} unusable ({e})"
        if not ok:
            return None, f"{setting} is not a cgroup v2 directory"
        return tree, f"cgroup v2 at {setting}"
    try:
        if proc_self_cgroup is None:
            proc_self_cgroup = Path("/proc/self/cgroup").read_text()
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError as e:
        return None, f"cannot read /proc ({e})"
    own = parse_own_cgroup(proc_self_cgroup, mountinfo)
    if own is None:
        return None, "no cgroup v2 hierarchy for this process (cgroup v1 host or container)"
    rel = proc_self_cgroup.split("0::", 1)[1].split()[0] if "0::" in proc_self_cgroup else "/"
    if rel == "/":
        return None, "the agent is in the root cgroup: no delegated subtree (run it under systemd with Delegate=yes)"
    base = own.parent if own.name == AGENT_LEAF else own
    if not os.access(base, os.W_OK) or not os.access(base / "cgroup.procs", os.W_OK) or not delegated(base):
        return None, f"cgroup {base} is not delegated to the agent (Delegate=yes in its unit)"
    try:
        if own.name == AGENT_LEAF:
            # systemd >= 254 ``DelegateSubgroup=agent`` put the agent in a leaf of its own:
            # the unit's cgroup has no processes, so controllers (memory, cpu, pids) can be
            # enabled for the workloads' side. Otherwise the agent shares its cgroup with
            # the workloads' parent and no controller is enabled ("no internal processes"):
            # membership, freeze and cgroup.kill need none.
            with contextlib.suppress(OSError):
                have = set((base / "cgroup.controllers").read_text().split()) & {"memory", "cpu", "pids"}
                if have:
                    _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(have)))
        tree = CgroupTree(base / CGROUP_LEAF)
        tree.setup()
    except OSError as e:
        return None, f"cannot set up workload cgroups under {base} ({e.strerror or e})"
    return tree, f"cgroup v2 delegated at {base}"


# ---------------------------------------------------------------- subreaper mode

# descendants(pid): the live descendants by one /proc scan, shared with the shim (which runs
# on the standard library alone, so the function lives there)


# ---------------------------------------------------------------- one interface


class Isolation:
    """What the supervisor calls: the mode, a cgroup per workload, the members of a
    workload, signalling them all, killing them all."""

    def __init__(self, tree: CgroupTree | None, reason: str = "", *, tenancy: Tenancy | None = None) -> None:
        self.tree = tree
        self.reason = reason
        self.tenancy = tenancy   # tenants apart from each other (agent.tenants); None: one shared user

    def for_launch(self, cmd: LaunchCommand) -> LaunchCommand:
        """The ShimPool's ``prepare`` hook: the workload's own uid, /proc and /dev."""
        return cmd if self.tenancy is None else self.tenancy.for_launch(cmd)

    @property
    def mode(self) -> Mode:
        return "cgroup" if self.tree is not None else "subreaper"

    def prepare(self, wid: str, limits: dict[str, str] | None = None) -> str | None:
        """Create the workload's cgroup (cgroup mode); its path for the shim, else None."""
        if self.tree is None:
            return None
        return str(self.tree.create(wid, limits))

    def members(self, wid: str, shim: tuple[int | None, int | None, str | None],
                leader: tuple[int | None, int | None, str | None]) -> list[int]:
        """Live processes of the workload. Cgroup mode: its cgroup. Subreaper mode (and a
        workload started before this agent had cgroups): the shim's descendants (the shim
        verified first), else the leader if it is itself."""
        if self._in_cgroup(wid):
            assert self.tree is not None
            return self.tree.pids(wid)
        if procs.same_process(*shim):
            assert shim[0] is not None
            return descendants(shim[0])
        if procs.same_process(*leader):
            assert leader[0] is not None
            return [leader[0]]
        return []

    def signal_all(self, wid: str, sig: int, shim: tuple[int | None, int | None, str | None],
                   leader: tuple[int | None, int | None, str | None]) -> int:
        if self.tree is not None and sig == signal.SIGKILL and self._in_cgroup(wid):
            n = len(self.tree.pids(wid))
            if n:
                self.tree.kill(wid)
            return n
        n = 0
        for pid in self.members(wid, shim, leader):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                n += 1
        return n

    def _in_cgroup(self, wid: str) -> bool:
        return self.tree is not None and self.tree.path(wid).is_dir()

    def remove(self, wid: str) -> None:
        """The workload's processes are gone (or it never started): remove its cgroup, and
        release its uid (only once the cgroup is gone: a populated one still runs as it)."""
        if self.tree is not None and not self.tree.remove(wid):
            log.warning("workload cgroup not removed (still populated?) id=%s", wid)
            return
        if self.tenancy is not None:
            self.tenancy.release(wid)

    def statistics(self) -> dict[str, object]:
        return {"isolation": self.mode, "reason": self.reason,
                "cgroup_parent": str(self.tree.parent) if self.tree is not None else None,
                "tenants": self.tenancy.statistics(cgroups=self.tree is not None) if self.tenancy is not None else None}
