"""A pool of pre-started workload shims (see :mod:`agent.shim` for why a shim).

The pool keeps ``size`` idle shims whose interpreter has already started, each with its
workload's process (the leader) forked and waiting on a command pipe whose write end the
pool holds. :meth:`ShimPool.launch` writes ``run.json`` with the identity the shim said,
hands the leader its command and reads the leader's answer pipe to EOF (the exec): the hot
path is a file rename, a pipe write, the leader's set-up and exec and a pipe read, with no
hop through the shim, instead of a ~30 ms interpreter start. A taken shim is replaced in
the background. When the pool is empty (a burst), a shim is started on the spot.

Shims are started with ``posix_spawn(setsid=True)``: their own session, so neither a
terminal's SIGINT nor systemd's ``KillMode=process`` stop (which signals only the
agent) reaches them. An idle shim exits when its leader's command pipe reaches EOF with
no command, i.e. when the agent exits or dies.

:func:`read_env_files` is the one place a job's ``env_from_files`` are read: by the agent
(not the workload user), at each start, from paths under the agent's
``workloads.env_files_prefixes`` only (checked on the resolved path, so a symlink cannot
lead out), bounded in size; the values go into the launch command's environment and
nowhere else (not the workload record, not run.json, not any API).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import trio

from . import procs
from .errors import AgentError, ShimError
from .placement import env_files_problem, under_prefix

log = logging.getLogger("herd.agent.launcher")

SHIM_PATH = str(Path(__file__).with_name("shim.py"))


class EnvFileError(AgentError):
    """A job's env_from_files entry that cannot be used (one line naming the file and why)."""


def read_env_files(files: dict[str, str], prefixes: tuple[str, ...], max_bytes: int) -> dict[str, str]:
    """NAME -> the file's text (one trailing newline dropped). Raises EnvFileError naming the
    file: outside the prefixes (also once resolved), missing, not a regular file, over
    ``max_bytes``, not UTF-8 or holding a NUL."""
    why = env_files_problem(files, prefixes)
    if why is not None:
        raise EnvFileError(why)
    out: dict[str, str] = {}
    for name, path in files.items():
        real = os.path.realpath(path)
        if not under_prefix(real, prefixes):
            raise EnvFileError(f"env_from_files: {name}: {path} resolves to {real}, outside the allowed prefixes")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise EnvFileError(f"env_from_files: {name}: {path} does not exist on this host") from None
        except OSError as e:
            raise EnvFileError(f"env_from_files: {name}: {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise EnvFileError(f"env_from_files: {name}: {path} is not a regular file")
            if st.st_size > max_bytes:
                raise EnvFileError(f"env_from_files: {name}: {path} is {st.st_size} bytes, over the "
                                   f"{max_bytes}-byte bound")
            data = os.read(fd, max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise EnvFileError(f"env_from_files: {name}: {path} is over the {max_bytes}-byte bound")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise EnvFileError(f"env_from_files: {name}: {path} is not UTF-8 text") from None
        if "\0" in text:
            raise EnvFileError(f"env_from_files: {name}: {path} holds a NUL byte")
        out[name] = text[:-1] if text.endswith("\n") else text
    return out


def _shim_env() -> dict[str, str]:
    """The shim's own environment: the agent's, minus what must not leak (the workload's
    environment is built separately and passed in the command)."""
    drop = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
    return {k: v for k, v in os.environ.items() if k not in drop}


class WorkloadView(msgspec.Struct, frozen=True, kw_only=True):
    """What the workload sees of the host (agent.tenants), made by the shim in the child: a
    mount namespace of its own with a /proc mounted ``hidepid`` (None: the host's), and
    ``dev_dir`` as a tmpfs holding its entries except the GPU nodes whose minors are not in
    ``gpu_minors`` (None: the host's dir)."""
    hidepid: str | None = None
    dev_dir: str | None = None
    gpu_minors: list[int] = []


class LaunchCommand(msgspec.Struct, frozen=True, kw_only=True):
    dir: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_max_bytes: int = 16 << 20
    log_keep: int = 2
    record: dict[str, Any] = {}      # the agent's record of this workload, kept in run.json
    # isolation (agent.isolation, applied by the shim in the child before exec)
    user: dict[str, Any] | None = None   # {"uid", "gid", "groups"}; None: the shim's own user
    cgroup: str | None = None            # the workload's cgroup v2 dir (cgroup mode)
    umask: int = 0o077
    rlimit_core: int = 0
    oom_score_adj: int | None = 0
    grace_s: float = 10.0                # for what is left of the workload once its leader exits
    view: WorkloadView | None = None     # None: the host's mount namespace as it is
    # written by the leader (as root still) before its set-up, each pod by its own process rather
    # than one after another on the agent's loop, where each creation waited for the
    # filesystem's journal while someone's fsync committed it
    files: dict[str, str] = {}           # name in ``dir`` -> text (0644, replaced atomically)


class Launched(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    start_time: int | None
    boot_id: str
    shim_pid: int
    shim_start_time: int | None
    started_at: float


class Ready(msgspec.Struct, frozen=True, kw_only=True):
    """A shim's greeting: the identity its waiting leader will keep as the workload."""
    ready: bool
    pid: int
    start_time: int | None
    boot_id: str
    shim_pid: int
    shim_start_time: int | None


_ready_dec = msgspec.json.Decoder(Ready)


@dataclass(slots=True)
class _Shim:
    """An idle shim as the agent holds it: the write end of its leader's command pipe and the
    read end of its answer pipe, and the identity it said."""
    pid: int
    cmd: int
    answer: int
    ident: Ready | None = None

    def close(self) -> None:
        """Closing the command pipe unsent is the shim's EOF: its leader exits, then it."""
        for fd in (self.cmd, self.answer):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.cmd = self.answer = -1


def write_run_json(cmd: LaunchCommand, ident: Ready, started_at: float) -> None:
    """``run.json`` in the workload's dir: the identity the shim said, when it was started and
    the agent's record, before the command leaves (a restarted agent then finds a workload
    that started, also when its own state log had not caught up). Written in place, one
    ``write``, no temp file and rename: every creation and rename on the start path waits for
    the filesystem's journal while someone's fsync commits it, and a ``run.json`` cut short
    (the agent killed mid-write) does not decode, which a restarted agent reads as none --
    true then, since the command leaves only after this returns. Not synced, on purpose: it
    covers the agent process dying, and the page cache survives that; a host crash takes the
    workload with it and changes the boot id, so nothing would be re-adopted anyway."""
    said = msgspec.structs.asdict(ident)
    del said["ready"]
    data = msgspec.json.encode({**said, "started_at": started_at, "record": cmd.record})
    fd = os.open(os.path.join(cmd.dir, "run.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _pipes_for_shim() -> tuple[tuple[int, int], tuple[int, int]]:
    """The leader's command pipe and answer pipe: (the agent's ends: command write, answer
    read), (the shim's ends: command read, answer write). All close-on-exec here."""
    cmd_r, cmd_w = os.pipe()
    ans_r, ans_w = os.pipe()
    os.set_blocking(cmd_w, False)   # (a command bigger than the pipe's buffer must not block the loop)
    return (cmd_w, ans_r), (cmd_r, ans_w)


class ShimPool:
    def __init__(self, size: int = 2, *, python: str | None = None, refill_delay_s: float = 0.05,
                 use_zygote: bool = True,
                 prepare: Callable[[LaunchCommand], LaunchCommand] | None = None) -> None:
        self.size = max(0, size)
        # the last step before a command leaves for a shim: who the workload runs as and what
        # it sees of the host (agent.isolation.Isolation.for_launch); raises ShimError to refuse
        self.prepare = prepare
        self.refill_delay_s = refill_delay_s
        self.python = python or sys.executable
        self._idle: list[_Shim] = []
        self._want = trio.Event()
        self._children: set[int] = set()
        self.spawned = 0
        self.use_zygote = use_zygote
        self._zygote: Any = None
        self._zygote_pid: int | None = None
        self._zlock = trio.Lock()
        self._zbuf = bytearray()

    def _start_zygote(self) -> None:
        import socket
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.posix_spawn(
                self.python, [self.python, "-I", "-S", SHIM_PATH, "--zygote"], _shim_env(),
                file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 0),
                              (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)],
                setsid=True,
            )
        except OSError as e:
            ours.close()
            raise ShimError(f"cannot start the shim zygote: {e}") from e
        finally:
            theirs.close()
        self._zygote_pid = pid
        self._children.add(pid)
        self._zygote = trio.socket.from_stdlib_socket(ours)
        self._zbuf = bytearray()

    async def _fork_shim(self) -> tuple[_Shim, int]:
        """A new shim forked from the zygote (started on first use, restarted if it died),
        and the read end of its stdout."""
        import array
        import socket
        async with self._zlock:
            if self._zygote is None:
                self._start_zygote()
            assert self._zygote is not None
            out_r, out_w = os.pipe()
            (cmd_w, ans_r), theirs = _pipes_for_shim()
            try:
                await self._zygote.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                     array.array("i", [out_w, *theirs]))])
                while b"\n" not in self._zbuf:
                    data = await self._zygote.recv(64)
                    if not data:
                        raise OSError("the shim zygote closed its socket")
                    self._zbuf += data
                line, _, rest = bytes(self._zbuf).partition(b"\n")
                self._zbuf[:] = rest
                pid = int(line)
                if pid <= 0:
                    raise OSError("the shim zygote refused the request")
            except (OSError, ValueError) as e:
                for fd in (out_r, cmd_w, ans_r):
                    os.close(fd)
                self._zygote.close()
                self._zygote = None
                raise ShimError(f"shim zygote failed: {e}") from e
            finally:
                for fd in (out_w, *theirs):
                    os.close(fd)
        self.spawned += 1
        return _Shim(pid, cmd_w, ans_r), out_r

    def _spawn_raw(self) -> tuple[_Shim, int]:
        out_r, out_w = os.pipe()
        (cmd_w, ans_r), (cmd_r, ans_w) = _pipes_for_shim()
        # the shim's ends at 3 and 4: moved above them first, so no dup2 below overwrites a source
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (out_w, cmd_r, ans_w)]
        for fd in (out_w, cmd_r, ans_w):
            os.close(fd)
        try:
            pid = os.posix_spawn(
                self.python, [self.python, "-I", "-S", SHIM_PATH, "--leader-fds", "3,4"], _shim_env(),
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, high[0], 1),
                              (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                              (os.POSIX_SPAWN_DUP2, high[1], 3), (os.POSIX_SPAWN_DUP2, high[2], 4)],
                setsid=True,
            )
        except OSError as e:
            for fd in (out_r, cmd_w, ans_r):
                os.close(fd)
            raise ShimError(f"cannot start shim: {e}") from e
        finally:
            for fd in high:
                os.close(fd)
        self.spawned += 1
        self._children.add(pid)
        return _Shim(pid, cmd_w, ans_r), out_r

    async def _spawn_ready(self) -> _Shim:
        got: tuple[_Shim, int] | None = None
        if self.use_zygote:
            try:
                got = await self._fork_shim()
            except ShimError as e:
                log.warning("falling back to a fresh interpreter for a shim err=%s", e)
        if got is None:
            got = self._spawn_raw()
        shim, out_r = got
        out = trio.lowlevel.FdStream(out_r)
        try:
            buf = b""
            with trio.fail_after(30):
                while b"\n" not in buf:
                    data = await out.receive_some(4096)
                    if not data:
                        raise ShimError(f"shim pid={shim.pid} closed its pipe")
                    buf += data
            try:
                shim.ident = _ready_dec.decode(buf.partition(b"\n")[0])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ShimError(f"unexpected shim greeting {buf[:200]!r}: {e}") from None
        except BaseException:
            shim.close()
            raise
        finally:
            with contextlib.suppress(trio.ClosedResourceError, OSError):
                await out.aclose()   # (the shim says nothing more there)
        return shim

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep ``size`` idle shims ready until cancelled; ``started()`` once the first fill is done."""
        try:
            while len(self._idle) < self.size:
                self._idle.append(await self._spawn_ready())
            task_status.started()
            while True:
                await self._want.wait()
                self._want = trio.Event()
                # A new interpreter costs ~30 ms of CPU: let the workload just launched get
                # its own start first (a burst that empties the pool spawns on the spot).
                await trio.sleep(self.refill_delay_s)
                while len(self._idle) < self.size:
                    try:
                        self._idle.append(await self._spawn_ready())
                    except ShimError as e:
                        log.error("shim refill failed err=%s", e)
                        await trio.sleep(1)
        finally:
            with trio.CancelScope(shield=True):
                idle, self._idle = self._idle, []
                for s in idle:
                    s.close()
                    self._children.discard(s.pid)
                    with trio.move_on_after(2):
                        await wait_exit(s.pid)
                if self._zygote is not None:
                    self._zygote.close()  # EOF: the zygote exits
                    self._zygote = None
                if self._zygote_pid is not None:
                    with trio.move_on_after(2):
                        await wait_exit(self._zygote_pid)
                    self._children.discard(self._zygote_pid)

    async def launch(self, cmd: LaunchCommand) -> Launched:
        """Start ``cmd`` under an idle shim and return the workload's identity: ``run.json``
        written, the command written to the shim's waiting leader, and its answer read (EOF:
        it exec'd). The shim hears its part from the leader, off this path."""
        if self.prepare is not None:
            cmd = self.prepare(cmd)
        shim = self._idle.pop() if self._idle else await self._spawn_ready()
        self._want.set()
        assert shim.ident is not None
        ident = shim.ident
        started_at = time.time()
        why = b""
        try:
            write_run_json(cmd, ident, started_at)
            data = msgspec.json.encode(cmd)
            # written before this task yields: the leader starts on it while the loop prepares
            # the gang's other pods
            try:
                sent = os.write(shim.cmd, data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):   # bigger than the pipe's buffer: the rest as the leader reads
                cmd_pipe = trio.lowlevel.FdStream(shim.cmd)
                shim.cmd = -1
                async with cmd_pipe:
                    await cmd_pipe.send_all(data[sent:])
            else:
                os.close(shim.cmd)   # EOF: the command is whole
                shim.cmd = -1
            answer = trio.lowlevel.FdStream(shim.answer)
            shim.answer = -1
            async with answer:
                with trio.fail_after(30):
                    while chunk := await answer.receive_some(4096):
                        why += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            why = f"shim pid={shim.pid} failed: {e}".encode()
        finally:
            shim.close()
        self._children.discard(shim.pid)
        if why:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(cmd.dir, "run.json"))   # nothing started: nothing to adopt
            with trio.move_on_after(5):
                await wait_exit(shim.pid)
            raise ShimError(why.decode(errors="replace"))
        return Launched(pid=ident.pid, start_time=ident.start_time, boot_id=ident.boot_id, shim_pid=ident.shim_pid,
                        shim_start_time=ident.shim_start_time, started_at=started_at)

    def statistics(self) -> dict[str, int]:
        return {"idle": len(self._idle), "size": self.size, "spawned": self.spawned}


async def wait_exit(pid: int) -> None:
    """Wait for ``pid`` to exit (child or not); reap it if it is our child. The caller
    bounds the wait with its cancel scope. Works across agent restarts through ``pidfd_open``.
    """
    fd = procs.open_pidfd(pid)
    if fd is None:
        procs.reap(pid)
        return
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    procs.reap(pid)


async def wait_identity(pid: int | None, start_time: int | None, boot: str | None) -> bool:
    """Wait for the process recorded as (pid, start time, boot id) to exit.

    The pidfd is opened first and the identity checked after, so a PID recycled in
    between is never waited on (or later signalled) by mistake. False when that
    process was already gone (or is a zombie).
    """
    if not pid:
        return False
    fd = procs.open_pidfd(pid)
    if fd is None:
        return False
    try:
        if not procs.same_process(pid, start_time, boot):
            return False
        await trio.lowlevel.wait_readable(fd)
        return True
    finally:
        os.close(fd)
