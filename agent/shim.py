"""The per-workload shim: a tiny stdlib-only program that owns one workload.

Why a shim (and not ``systemd-run`` transient units)
----------------------------------------------------
A restarted agent is not the parent of the workloads it started, so it cannot
``waitpid`` them, and ``pidfd`` tells *that* a process exited, never *how*. Someone
that outlives the agent must collect the exit status and put it on disk. systemd can
be that someone (``systemd-run --unit`` keeps ``ExecMainStatus``), but:

* it needs systemd as PID 1 and a D-Bus round trip per start (``systemd-run`` costs
  20-60 ms of forks, D-Bus and unit setup), so the 10 ms placement->start target is
  out of reach, and containers/CI/dev laptops have no systemd at all;
* exit statuses and logs would live in systemd's namespace (journal, unit GC), not
  in our state dir next to the rest of the workload's record.

So each workload runs under this shim (the pattern of containerd's shim and Nomad's
executor). The shim lives in its own session, survives ``KillMode=process`` and an
agent SIGKILL, puts the workload in a *new* session/process group (so the agent can
signal the whole group), copies its stdout/stderr into size-capped rotated log
files, and writes ``exit.json`` atomically when the workload ends.

A Python interpreter takes ~20-30 ms to start, so the agent keeps a small pool of
shims started ahead of time (:mod:`agent.launcher`), each with the workload's own process
already forked and waiting on a pipe of its own (:class:`_Leader`). The hot path is then one
pipe write from the agent to that leader, the leader's set-up and ``exec``, and the agent's
read of the leader's answer pipe: the shim itself is not scheduled between a placement and
its process running (on a busy host each process woken on that path waited milliseconds for
a core).

Protocol
--------
The agent makes two pipes per shim and hands the shim one end of each (``--leader-fds R,W``,
or through the zygote): the leader's command pipe (the agent writes) and its answer pipe
(the agent reads).
shim -> agent on stdout, once its leader waits: ``{"ready": true, "pid", "start_time",
"boot_id", "shim_pid", "shim_start_time"}`` (the workload's identity before it exists).
agent: ``run.json`` in the workload's dir (that identity, ``started_at`` and the agent's
``record``), then the command to the leader, one JSON object, then EOF: ``{"dir", "argv",
"env", "cwd", "log_max_bytes", "log_keep", "record", "user": {"uid", "gid", "groups"} |
null, "cgroup": path | null, "umask", "rlimit_core", "oom_score_adj", "grace_s", "view":
{"hidepid", "dev_dir", "gpu_minors"} | null, "files": {name: text}}`` (``files``: written into
``dir`` by the leader before its set-up: a small gang's peers file).
leader -> shim: its part of the command (dir, log bounds, cgroup, grace), before its set-up.
leader -> agent on the answer pipe: nothing, then EOF, when it has exec'd; else why not (then
it exits 127).
Files in ``dir``: ``run.json`` (the agent's, written before the command leaves), ``exit.json``
(``code``: exit status, 128+N for signal N; ``signal``; ``at``), ``stdout.log``,
``stderr.log`` (+ ``.1`` .. ``.keep`` rotations), ``shim.log``. A shim whose leader got no
command (the agent went away: EOF) reaps it and exits, writing nothing.

Isolation (see :mod:`agent.isolation`): the shim is a child subreaper, so every
descendant of the workload stays below it; the workload's child joins its cgroup (when
one is given), enters its own mount namespace (when a ``view`` is given: a /proc that hides
other uids, a /dev without the GPU nodes of other workloads; agent.tenants), then drops to
the workload's user (which clears every capability), sets
``no_new_privs``, umask, ``RLIMIT_CORE`` and ``oom_score_adj``, and only then ``exec``s.
When the leader exits, the shim SIGTERMs what is left of the workload, SIGKILLs it after
``grace_s`` and writes ``exit.json`` (the leader's code) only once the workload is empty:
the agent frees the GPUs when the shim is gone. Files the shim writes are 0600.

This file imports only the standard library: it is run as a script with
``python -I -S`` for a fast start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import signal
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAPBSET_DROP = 24
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_SLAVE = 2, 4, 8, 4096, 16384, 1 << 19
NVIDIA_MAJOR, NVIDIA_FIRST_CONTROL_MINOR = 195, 254
_libc = ctypes.CDLL(None, use_errno=True)


def _atomic_write(path: str, obj: dict, *, sync: bool = True) -> None:
    """temp + rename (never torn); with ``sync`` also fsync the file and its directory.

    The steps of :func:`infra.durable.atomic_write`, kept here because the shim is
    started with ``python -I -S`` and imports nothing of ours."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(json.dumps(obj).encode())
        while view:  # os.write may write less than asked
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if sync:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rfind(b")") + 2:].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown-boot"


class RotatingLog:
    """Append-only log capped at ``max_bytes`` per file, keeping ``keep`` old files."""

    def __init__(self, path: str, max_bytes: int, keep: int) -> None:
        self.path, self.max_bytes, self.keep = path, max(1024, max_bytes), max(0, keep)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.size = os.fstat(self.fd).st_size

    def write(self, data: bytes) -> None:
        while data:
            room = self.max_bytes - self.size
            if room <= 0:
                self._rotate()
                continue
            part, data = data[:room], data[room:]
            os.write(self.fd, part)
            self.size += len(part)

    def _rotate(self) -> None:
        os.close(self.fd)
        if self.keep == 0:
            os.unlink(self.path)
        else:
            for i in range(self.keep - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        self.size = 0

    def close(self) -> None:
        os.close(self.fd)


def _reply(obj: dict) -> None:
    try:
        os.write(1, (json.dumps(obj) + "\n").encode())
    except OSError:  # the agent is gone; the workload goes on regardless
        pass


def _detach_stdio(log_path: str | None) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        os.dup2(null, 2)
    os.close(null)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")


def _drop_all_caps() -> None:
    """A root workload (``allow_root``) still gets no capabilities: empty bounding set,
    then capset(0, 0, 0) on this thread."""
    cap = 0
    while _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if _libc.capset(header, data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    def b(x: str | None) -> bytes | None:
        return x.encode() if x is not None else None
    if _libc.mount(b(src), b(target), b(fstype), ctypes.c_ulong(flags), b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype or src} on {target}: {os.strerror(e)}")


def _hidden_gpu(name: str, st: os.stat_result, minors: set[int]) -> bool:
    """A GPU node the workload was not given: a char device 195:N (N < 254), or a name nvidiaN."""
    if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == NVIDIA_MAJOR:
        m = os.minor(st.st_rdev)
        return m < NVIDIA_FIRST_CONTROL_MINOR and m not in minors
    return name.startswith("nvidia") and name[6:].isdigit() and not stat.S_ISDIR(st.st_mode) \
        and int(name[6:]) not in minors


def _dev_view(dev_dir: str, minors: set[int]) -> None:
    """Cover ``dev_dir`` with a tmpfs holding the same entries but the hidden GPU nodes: device
    nodes made again (same numbers, owner, mode), symlinks copied, the rest bind-mounted from
    the covered dir (reached through an O_PATH descriptor opened before covering it)."""
    top = os.stat(dev_dir)
    entries = []
    for name in os.listdir(dev_dir):
        st = os.lstat(os.path.join(dev_dir, name))
        if not _hidden_gpu(name, st, minors):
            entries.append((name, st))
    fd = os.open(dev_dir, os.O_PATH | os.O_DIRECTORY)
    umask = os.umask(0)                  # nodes made with their own mode bits, no chmod after
    try:
        _mount("tmpfs", dev_dir, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755")
        for name, st in entries:
            p, src = os.path.join(dev_dir, name), f"/proc/self/fd/{fd}/{name}"
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(src), p)
                continue
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                os.mknod(p, mode, st.st_rdev)
            elif stat.S_ISDIR(mode):
                os.mkdir(p)
                _mount(src, p, None, MS_BIND | MS_REC, None)
            else:
                os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0))
                _mount(src, p, None, MS_BIND, None)
            if (st.st_uid or st.st_gid) and not stat.S_ISDIR(mode):
                os.chown(p, st.st_uid, st.st_gid)
                if mode & (stat.S_ISUID | stat.S_ISGID):
                    os.chmod(p, stat.S_IMODE(mode))      # chown cleared them
        os.chown(dev_dir, top.st_uid, top.st_gid)
        os.chmod(dev_dir, stat.S_IMODE(top.st_mode))
    finally:
        os.umask(umask)
        os.close(fd)


def _enter_view(view: dict[str, Any]) -> None:
    """The workload's own mount namespace (agent.launcher.WorkloadView). Slave propagation
    first: the host's later mounts still reach the workload, nothing mounted here reaches
    the host."""
    if _libc.unshare(CLONE_NEWNS) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"unshare(CLONE_NEWNS): {os.strerror(e)}")
    _mount(None, "/", None, MS_REC | MS_SLAVE, None)
    if view.get("dev_dir"):
        _dev_view(view["dev_dir"], {int(m) for m in view.get("gpu_minors") or ()})
    if view.get("hidepid"):
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"hidepid={view['hidepid']}")


def probe_namespace() -> int:
    """``shim.py --probe-ns`` (run by the agent once at start, as a throwaway process): can a
    workload get a mount namespace and a /proc that hides other uids? Prints the answer."""
    try:
        if _libc.unshare(CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno()))
        _mount(None, "/", None, MS_REC | MS_SLAVE, None)
        for opt in ("invisible", "2"):    # names since Linux 5.8, numbers before
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"hidepid={opt}")
            except OSError:
                continue
            print(json.dumps({"ok": True, "hidepid": opt}))
            return 0
        raise OSError(0, "mounting /proc with hidepid failed")
    except OSError as e:
        print(json.dumps({"ok": False, "error": str(e.strerror or e)}))
        return 0


def _child_setup(cmd: dict[str, Any]) -> Callable[[], None]:
    """What the workload's child does after fork, before exec (runs as root when the
    agent is): join the cgroup, reset oom_score_adj and limits, drop to the user."""
    cgroup = cmd.get("cgroup")
    user = cmd.get("user")
    umask = int(cmd.get("umask", 0o077))
    core = int(cmd.get("rlimit_core", 0))
    adj = cmd.get("oom_score_adj", 0)
    view = cmd.get("view")

    def setup() -> None:
        if cgroup:
            fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        if adj is not None:
            try:
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                try:
                    os.write(fd, str(int(adj)).encode())
                finally:
                    os.close(fd)
            except OSError:
                pass  # lowering needs privilege; raising the agent's -500 back to 0 never does
        soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
        limit = core if hard == resource.RLIM_INFINITY else min(core, hard)
        resource.setrlimit(resource.RLIMIT_CORE, (limit, limit))
        os.umask(umask)
        if view:
            _enter_view(view)   # as root still: mounts need it; before the uid drops
        if user is not None and os.geteuid() == 0:
            uid, gid = int(user["uid"]), int(user["gid"])
            if uid == 0:
                _drop_all_caps()
            else:
                os.setgroups([int(g) for g in user.get("groups") or [gid]])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)  # from root to non-root: every capability is gone
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
    return setup


def descendants(pid: int, proc: str = "/proc") -> list[int]:
    """Every live descendant of ``pid`` by one scan of /proc (zombies and dead left out). The
    agent's subreaper mode uses this too (agent.isolation); it lives here because the shim
    runs on the standard library alone."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        if len(rest) > 1 and rest[0] not in (b"Z", b"X"):
            kids.setdefault(int(rest[1]), []).append(int(name))
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


class Members:
    """The live processes of the workload: its cgroup's, else the shim's descendants
    (the shim is a subreaper: nothing of the workload leaves its subtree)."""

    def __init__(self, cgroup: str | None) -> None:
        self.cgroup = cgroup

    def pids(self) -> list[int]:
        if self.cgroup:
            try:
                with open(os.path.join(self.cgroup, "cgroup.procs")) as f:
                    return [int(x) for x in f.read().split()]
            except OSError:
                return []
        return descendants(os.getpid())

    def signal(self, sig: int) -> None:
        if sig == signal.SIGKILL and self.cgroup and os.path.exists(os.path.join(self.cgroup, "cgroup.kill")):
            try:
                with open(os.path.join(self.cgroup, "cgroup.kill"), "w") as f:
                    f.write("1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except OSError:
                pass

    def empty(self) -> bool:
        return not self.pids()


def _pump(pid: int, logs: dict[int, RotatingLog], members: Members, grace_s: float) -> int:
    """Copy the workload's output into its logs, reap every child (the leader's status is
    the result), and once the leader is gone end the rest: SIGTERM, ``grace_s``, SIGKILL.
    Returns when the leader is reaped and the workload is empty."""
    sel = selectors.DefaultSelector()
    for fd in logs:
        sel.register(fd, selectors.EVENT_READ)
    rc: int | None = None
    term_at: float | None = None
    killed = False
    while True:
        for key, _ in sel.select(timeout=0.5 if rc is None else 0.05) if sel.get_map() else ():
            try:
                data = os.read(key.fd, 1 << 16)
            except OSError:
                data = b""
            if data:
                logs[key.fd].write(data)
            else:
                sel.unregister(key.fd)
        if not sel.get_map() and rc is None:
            time.sleep(0.2)  # the workload closed its stdout and stderr: poll for its exit
        children = True
        while True:
            try:
                p, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children = False
                break
            if p == 0:
                break
            if p == pid:
                rc = os.waitstatus_to_exitcode(status)
        if rc is None:
            continue
        if not children and members.empty():
            break
        now = time.monotonic()
        if term_at is None:
            term_at = now
            members.signal(signal.SIGTERM)
        elif not killed and now - term_at >= grace_s:
            killed = True
            members.signal(signal.SIGKILL)
        elif killed and now - term_at >= grace_s + 5 and not members.pids():
            break  # only unreapable children of someone else's left (cannot happen as subreaper)
    # what is still buffered in the pipes (every writer is gone)
    for key in list(sel.get_map().values()):
        fd = key.fd
        os.set_blocking(fd, False)
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except (OSError, BlockingIOError):
                break
            if not data:
                break
            logs[fd].write(data)
    sel.close()
    return rc


class _Leader:
    """The workload's process, forked while the shim is idle: it makes its own session and
    waits for its command on a pipe from the agent, then sets itself up (what
    ``subprocess.Popen`` with a ``preexec_fn`` did after its fork: stdio, cwd,
    :func:`_child_setup`, every other descriptor closed) and ``exec``s. The command reaches a
    process that is already there: the fork (the shim's page tables copied, the interpreter's
    after-fork work), the new session and the reads of the leader's identity happen while the
    shim waits, not between a placement and its process running, and a busy host's scheduler
    favours a waking sleeper over a new task.

    The agent holds the other ends of ``cmd_r`` (it writes the command, then closes: EOF) and
    of ``err_w`` (exec failure or a failed set-up comes back there; close-on-exec: EOF with
    no bytes means the exec happened), so neither the command nor the answer waits for the
    shim to be scheduled. The leader hands the shim what it needs to look after the workload
    (``info``: its dir, log bounds, cgroup, grace) before it sets itself up. The pid and the
    start time survive the exec, so the workload's identity is known before it."""

    def __init__(self, cmd_r: int, err_w: int) -> None:
        self.info, info_w = os.pipe()
        self.out, out_w = os.pipe()
        self.errout, errout_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 127
            try:
                for fd in (self.info, self.out, self.errout):
                    os.close(fd)
                code = _leader(cmd_r, err_w, info_w, out_w, errout_w)
            finally:
                os._exit(code)
        # only the agent and the leader hold these: the agent's EOFs are the leader's alone
        for fd in (cmd_r, err_w, info_w, out_w, errout_w):
            os.close(fd)

    def handed_over(self) -> dict[str, Any] | None:
        """What the leader handed over (waits for it); None when it got no command (the agent
        went away, or sent one that does not decode), and the leader is reaped then."""
        got = b""
        while chunk := os.read(self.info, 4096):
            got += chunk
        os.close(self.info)
        self.info = -1
        try:
            info = json.loads(got) if got else None
        except ValueError:
            info = None
        if not isinstance(info, dict):
            for fd in (self.out, self.errout):
                os.close(fd)
            os.waitpid(self.pid, 0)
            return None
        return info


SHIM_KEYS = ("dir", "log_max_bytes", "log_keep", "cgroup", "grace_s")   # what the leader hands the shim


def _close_open_fds(keep: tuple[int, ...]) -> None:
    """Close every descriptor above stdio but ``keep``: the ones open, read from /proc (as
    Popen's close_fds does; a loop to the open-file limit costs a close per number where the
    kernel has no close_range)."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1 << 16))
    for fd in fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):   # (the listing's own, closed already)
                os.close(fd)


def _default_signals() -> None:
    """Every disposition back to its default and nothing blocked, as a fresh process has (as
    systemd does before it starts a service): an ignored signal stays ignored across exec, and
    the shim ignores SIGHUP and SIGINT (it outlives its agent's terminal and session), Python
    ignores SIGPIPE and SIGXFSZ, and whatever started the agent may have ignored more (SIGQUIT
    under some supervisors) -- a workload would never see ^C, a hang-up or a quit."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError):
            if sig in (signal.SIGPIPE, signal.SIGXFSZ) or signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _prepare(cmd: dict[str, Any]) -> None:
    """The pod's files (agent.launcher.LaunchCommand), written by its leader as root still:
    each 0644 under a temp name, then renamed over the last start's."""
    for name, text in (cmd.get("files") or {}).items():
        path = os.path.join(cmd["dir"], name)
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)   # (the shim's umask is 077)
            view = memoryview(text.encode())
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(tmp, path)


def _leader(cmd_r: int, err_w: int, info_w: int, out_w: int, errout_w: int) -> int:
    """The forked leader's side of :class:`_Leader` (never returns on success)."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)        # never the shim's pipes to the agent
    os.dup2(null, 1)
    os.close(null)
    # the answer's EOF is the exec (descriptors received from the agent may be inheritable)
    os.set_inheritable(err_w, False)
    # A session (and process group) of its own now, while idle: setsid() makes the kernel a
    # new scheduler autogroup, 2-7 ms on a busy host, which would otherwise sit between the
    # command and the exec. Nothing before the exec depends on the session.
    os.setsid()
    # While waiting: the first writes to this process's copy of the shim's memory (reference
    # counts of what decoding a command and the set-up touch) fault in now, not after the
    # command comes.
    json.loads(json.dumps({"argv": ["x"], "env": {"PATH": "/bin"}, "cwd": "/", "record": {"x": [1, 2.5, None]}}))
    json.dumps({k: None for k in SHIM_KEYS})
    _libc.prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0)   # (and libc calls through ctypes: reads a flag)
    # and what os.execvpe's PATH search runs before its execve calls (~0.6 ms a start, cold)
    os.path.dirname("x")
    for d in os.get_exec_path({"PATH": "/usr/bin:/bin"}):
        os.path.join(os.fsencode(d), b"x")
    data = b""
    while chunk := os.read(cmd_r, 1 << 16):
        data += chunk
    os.close(cmd_r)
    if not data:
        return 0            # no work: the agent went away (the shim hears EOF and exits)
    argv: list[str] = []
    try:
        cmd = json.loads(data)
        argv = list(cmd["argv"])
        # the shim's part, small (never fills the pipe), before the set-up: it opens the logs
        # while this process execs
        info = json.dumps({k: cmd.get(k) for k in SHIM_KEYS}).encode()
        if os.write(info_w, info) != len(info):
            raise OSError("the shim took part of its hand-over")
        os.close(info_w)
        _prepare(cmd)
        os.dup2(out_w, 1)
        os.dup2(errout_w, 2)
        os.chdir(cmd.get("cwd") or cmd["dir"])
        _default_signals()
        _child_setup(cmd)()
        _close_open_fds(keep=(err_w,))
        try:
            os.execvpe(argv[0], argv, cmd["env"])
        except OSError as e:
            e.filename = argv[0]   # the program as asked for, not the last PATH entry tried
            raise
    except BaseException as e:
        os.write(err_w, f"{type(e).__name__}: {e}".encode())
    return 127


def main(cmd_r: int, err_w: int) -> int:
    """One shim: its leader forked on the agent's ``cmd_r`` and ``err_w`` (the leader's command
    in, its answer out), the identity said on stdout, then the workload looked after."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.umask(0o077)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    leader = _Leader(cmd_r, err_w)
    # the workload's identity is the leader's, known before its exec (which keeps the pid and
    # the start time): worked out while idle; the agent writes run.json with it before the
    # command goes to the leader
    pid = leader.pid
    _reply({"ready": True, "pid": pid, "start_time": _start_time(pid), "boot_id": _boot_id(),
            "shim_pid": os.getpid(), "shim_start_time": _start_time(os.getpid())})
    info = leader.handed_over()
    if info is None:
        return 0  # no work: the agent went away (or sent what does not decode, and heard so)
    wdir = str(info["dir"])
    max_bytes = int(info.get("log_max_bytes") or 16 << 20)
    keep = int(info["log_keep"] if info.get("log_keep") is not None else 2)
    out_r, err_r = leader.out, leader.errout
    _detach_stdio(os.path.join(wdir, "shim.log"))
    logs = {out_r: RotatingLog(os.path.join(wdir, "stdout.log"), max_bytes, keep),
            err_r: RotatingLog(os.path.join(wdir, "stderr.log"), max_bytes, keep)}
    grace = info.get("grace_s")
    rc = _pump(pid, logs, Members(info.get("cgroup")), float(grace if grace is not None else 10.0))
    for fd, lg in logs.items():
        lg.close()
        os.close(fd)
    sig = -rc if rc < 0 else None
    _atomic_write(os.path.join(wdir, "exit.json"),
                  {"code": 128 + sig if sig else rc, "signal": sig, "at": time.time(), "pid": pid})
    return 0


def zygote() -> int:
    """``shim.py --zygote``: a template process that has already paid the interpreter's
    start-up. Its stdin is a unix socket to the agent; for each request carrying three file
    descriptors (the new shim's stdout, its leader's command pipe and answer pipe,
    SCM_RIGHTS) it forks a shim that runs :func:`main` at once, and answers with the shim's
    pid. A fork of this small process costs ~1 ms where a fresh interpreter costs ~30 ms of
    CPU: under a burst of gangs the pool refills without starving the workloads being
    started. The shims are its children, reaped automatically (SIGCHLD ignored here,
    restored in each shim)."""
    import socket

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    sock = socket.socket(fileno=os.dup(0))
    # fd 0 onto /dev/null: received descriptors then never land on 0 or 1, which the
    # forked shim overwrites with dup2.
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 3)
        except OSError:
            return 0
        if not msg:
            return 0  # the agent went away
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            sock.sendall(b"-1\n")
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.setsid()
                os.dup2(fds[0], 1)
                os.close(fds[0])
                code = main(fds[1], fds[2])
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)
        sock.sendall(f"{pid}\n".encode())


def _leader_fds(arg: str) -> tuple[int, int]:
    r, w = arg.split(",")
    return int(r), int(w)


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(zygote() if args == ["--zygote"] else probe_namespace() if args == ["--probe-ns"]
             else main(*_leader_fds(args[1])) if len(args) == 2 and args[0] == "--leader-fds"
             else 2)
