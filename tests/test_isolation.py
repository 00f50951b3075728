"""Workload isolation (issue 15): identities, cgroup code against a fake cgroupfs and a real
one where the test can make one, the subreaper fallback, and what a workload can and
cannot touch on the host (root only)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import trio

from agent import procs
from agent.errors import AgentError, ConfigError
from agent.isolation import CgroupTree, Identities, Isolation, descendants, detect, parse_own_cgroup
from agent.launcher import ShimPool
from agent.supervisor import Supervisor, SupervisorConfig
from agent.tenants import IsolationSection, Tenancy
from scheduler_link.messages import Placement, PodAssignment
from testing.waiting import poll
from tests.conftest import is_root

GPUS = {f"GPU-{i:04d}": "healthy" for i in range(4)}
root_only = pytest.mark.skipif(not is_root(), reason="needs root (workloads switch to another user)")

# ---------------------------------------------------------------- identities


def test_unprivileged_agent_runs_workloads_as_itself():
    ids = Identities("herd-workload", privileged=False)
    assert ids.default.uid == os.geteuid() and ids.notes
    assert ids.resolve(None) is ids.default
    with pytest.raises(ConfigError):
        ids.resolve("somebody-else")


def test_privileged_agent_falls_back_to_nobody_and_refuses_root():
    ids = Identities(f"no-such-user-{uuid.uuid4().hex[:6]}", privileged=True)
    assert ids.default.name == "nobody" and ids.default.uid != 0
    assert len(ids.notes) == 1 and "nobody" in ids.notes[0]
    with pytest.raises(ConfigError, match="allow_root"):
        Identities("root", privileged=True)
    assert Identities("root", privileged=True, allow_root=True).default.uid == 0
    ids = Identities("nobody", allowed=["65533"], privileged=True)
    assert ids.resolve("65533").uid == 65533           # a bare uid: its own group
    with pytest.raises(ConfigError, match="allowed_users"):
        ids.resolve("root")
    with pytest.raises(ConfigError, match="allow_root"):
        Identities("nobody", allowed=["root"], privileged=True).resolve("root")


# ---------------------------------------------------------------- cgroup v2: detection and a fake cgroupfs

MOUNTINFO_V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
MOUNTINFO_HYBRID = ("25 24 0:23 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755\n"
                    "26 25 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
                    "27 25 0:25 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
MOUNTINFO_V1 = "27 25 0:25 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"


def test_own_cgroup_from_proc():
    own = parse_own_cgroup("0::/system.slice/herd-agent.service\n", MOUNTINFO_V2)
    assert own == Path("/sys/fs/cgroup/system.slice/herd-agent.service")
    own = parse_own_cgroup("4:memory:/x\n0::/user.slice\n", MOUNTINFO_HYBRID)
    assert own == Path("/sys/fs/cgroup/unified/user.slice")
    assert parse_own_cgroup("4:memory:/x\n", MOUNTINFO_V1) is None
    assert parse_own_cgroup("0::/a\n", MOUNTINFO_V1) is None


def test_detect_falls_back_to_subreaper_without_delegation(tmp_path):
    tree, why = detect("auto", proc_self_cgroup="0::/\n", mountinfo=MOUNTINFO_HYBRID)
    assert tree is None and "root cgroup" in why
    tree, why = detect("auto", proc_self_cgroup="4:memory:/x\n", mountinfo=MOUNTINFO_V1)
    assert tree is None and "v1" in why
    assert detect("off")[0] is None
    fake = tmp_path / "not-a-cgroup"
    tree, why = detect(str(fake))
    assert tree is None and "not a cgroup v2" in why
    assert Isolation(None).mode == "subreaper"


def test_detect_auto_on_a_fake_cgroupfs_needs_the_delegation_mark(tmp_path):
    mnt = tmp_path / "cgroupfs"
    unit = mnt / "system.slice" / "herd-agent.service"
    unit.mkdir(parents=True)
    (unit / "cgroup.procs").write_text("")
    (unit / "cgroup.controllers").write_text("memory pids\n")
    mi = f"30 23 0:26 / {mnt} rw - cgroup2 cgroup2 rw\n"
    pc = "0::/system.slice/herd-agent.service\n"
    if os.geteuid() == 0:
        tree, why = detect("auto", proc_self_cgroup=pc, mountinfo=mi)
        assert tree is None and "not delegated" in why        # root may write it; not ours though
    try:
        os.setxattr(unit, "user.delegate", b"1")
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    tree, why = detect("auto", proc_self_cgroup=pc, mountinfo=mi)
    assert tree is not None and tree.parent == unit / "herd-workloads" and "delegated" in why
    assert tree.controllers == frozenset()                   # the agent shares the unit's cgroup


def _fake_cgroupfs(tmp: Path, *, with_kill: bool) -> Path:
    parent = tmp / "cg" / "herd-workloads"
    parent.mkdir(parents=True)
    (parent / "cgroup.controllers").write_text("cpu memory pids io\n")
    (parent / "cgroup.subtree_control").write_text("")
    return parent


def _populate(d: Path, pids: list[int], *, with_kill: bool) -> None:
    (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    (d / "cgroup.events").write_text(f"populated {1 if pids else 0}\nfrozen 0\n")
    (d / "cgroup.freeze").write_text("0\n")
    if with_kill:
        (d / "cgroup.kill").write_text("")


def test_cgroup_tree_on_a_fake_cgroupfs(tmp_path):
    parent = _fake_cgroupfs(tmp_path, with_kill=True)
    sent: list[tuple[int, int]] = []
    tree = CgroupTree(parent, kill=lambda pid, sig: sent.append((pid, sig)))
    tree.setup()
    assert tree.controllers == {"cpu", "memory", "pids"}
    assert (parent / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    (parent / "w1").mkdir()               # the kernel makes a cgroup's files on mkdir; the fake, here
    for f in ("memory.max", "pids.max"):
        (parent / "w1" / f).write_text("max\n")
    d = tree.create("w1", {"memory.max": "1073741824", "pids.max": "64"})
    assert (d / "memory.max").read_text() == "1073741824" and (d / "pids.max").read_text() == "64"
    with pytest.raises(ValueError):
        tree.create("w2", {"devices.allow": "a"})
    with pytest.raises(ValueError):
        tree.path("../escape")
    _populate(d, [101, 102], with_kill=True)
    assert tree.pids("w1") == [101, 102] and tree.populated("w1")
    assert tree.signal("w1", signal.SIGTERM) == 2 and sent == [(101, 15), (102, 15)]
    sent.clear()
    tree.kill("w1")                      # cgroup.kill: one write, no per-pid signals
    assert (d / "cgroup.kill").read_text() == "1" and sent == []
    assert tree.remove("w1") is False    # not empty (a fake dir with files): kept
    iso = Isolation(tree, "fake")
    assert iso.mode == "cgroup" and iso.members("w1", (None, None, None), (None, None, None)) == [101, 102]
    assert iso.statistics()["isolation"] == "cgroup"
    # a workload started before the agent had cgroups (no dir): found by its identity
    me = (os.getpid(), procs.start_time(os.getpid()), procs.boot_id())
    assert iso.members("started-earlier", (None, None, None), me) == [os.getpid()]


def test_configured_limits_go_where_a_controller_is(tmp_path):
    from agent.supervisor import _limits
    cfg = SupervisorConfig(memory_max="1G", pids_max="64", cpu_max="100000 100000")
    assert _limits(cfg, Isolation(None))[0] == {} and "not enforced" in _limits(cfg, Isolation(None))[1][0]
    tree = CgroupTree(tmp_path)
    tree.controllers = frozenset({"memory", "pids"})
    have, notes = _limits(cfg, Isolation(tree))
    assert have == {"memory.max": "1G", "pids.max": "64"} and "cpu.max" in notes[0]
    assert _limits(SupervisorConfig(), Isolation(tree)) == ({}, [])


def test_cgroup_kill_fallback_freezes_kills_each_thaws(tmp_path):
    parent = _fake_cgroupfs(tmp_path, with_kill=False)
    order: list[str] = []
    tree = CgroupTree(parent, kill=lambda pid, sig: order.append(
        f"kill {pid} {sig} frozen={(parent / 'w' / 'cgroup.freeze').read_text()}"))
    d = tree.create("w")
    _populate(d, [7, 8], with_kill=False)
    tree.kill("w")
    assert order == ["kill 7 9 frozen=1", "kill 8 9 frozen=1"]
    assert (d / "cgroup.freeze").read_text() == "0"
    _populate(d, [], with_kill=False)
    assert not tree.populated("w")


def _real_cgroup_parent() -> Path | None:
    """A fresh cgroup v2 dir this test may use, or None (no cgroup v2 or not writable)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.startswith("cgroup2 "):
            mnt = Path(left.split()[4])
            p = mnt / f"herd-test-{uuid.uuid4().hex[:8]}"
            try:
                p.mkdir()
            except OSError:
                return None
            if (p / "cgroup.procs").exists():
                return p
            p.rmdir()
    return None


@pytest.fixture
def real_cgroup():
    p = _real_cgroup_parent()
    if p is None:
        pytest.skip("no writable cgroup v2 hierarchy here")
    yield p
    for child in sorted(p.iterdir(), reverse=True):
        if child.is_dir():
            try:
                CgroupTree(p).kill(child.name)
            except OSError:
                pass
    for _ in range(50):
        try:
            for child in p.iterdir():
                if child.is_dir():
                    child.rmdir()
            p.rmdir()
            break
        except OSError:
            import time
            time.sleep(0.1)


def test_detect_on_a_real_cgroup(real_cgroup):
    tree, why = detect(str(real_cgroup))
    assert tree is not None and "cgroup v2" in why
    d = tree.create("w1")
    assert (d / "cgroup.procs").exists() and not tree.populated("w1") and tree.remove("w1")


# ---------------------------------------------------------------- the lifecycle, both modes

# The leader exits 0 on SIGTERM; its grandchild called setsid() (left the process group)
# and ignores SIGTERM. Only a SIGKILL after the grace ends it.
ESCAPER = r"""
setsid sh -c 'trap "" TERM; echo $$ > "$HERD_SCRATCH/gc.pid"; while :; do sleep 0.05; done' &
trap 'exit 0' TERM
while [ ! -s "$HERD_SCRATCH/gc.pid" ]; do sleep 0.02; done
echo up > "$HERD_SCRATCH/up"
while :; do sleep 0.05; done
"""


def _sup(tmp: Path, isolation: Isolation, **cfg) -> Supervisor:
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: GPUS,
                      config=SupervisorConfig(shim_pool=1, **cfg), base_env={"PATH": "/usr/bin:/bin"},
                      isolation=isolation)


def _alive(pid: int) -> bool:
    return procs.start_time(pid) is not None and not procs.is_zombie(pid)


async def _escaper_is_killed_after_grace(tmp: Path, isolation: Isolation) -> None:
    sup = _sup(tmp, isolation)
    grace = 1.5
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = Placement(placement_id="p1", job_id="j1", argv=["sh", "-c", ESCAPER], grace_s=grace,
                          pods=[PodAssignment(workload_id="w1", rank=0, gpus=["GPU-0001"])])
            assert (await sup.place(p)).accepted
            scratch = sup.wl_dir / "w1" / "scratch"
            await poll(lambda: (scratch / "up").exists(), 0.02)
            gc = int((scratch / "gc.pid").read_text())
            assert os.getsid(gc) != sup.record("w1").pid          # it left the group and session
            t0 = trio.current_time()
            await sup.stop("w1", reason="preempted", grace_s=grace, preempted=True)
            # the leader exits at once; the grandchild lives on: the GPU stays held
            await trio.sleep(grace / 2)
            assert not procs.same_process(sup.record("w1").pid, sup.record("w1").start_time,
                                          sup.record("w1").boot_id)
            assert _alive(gc) and sup.gpu_holders() == {"GPU-0001": "w1"}
            assert sup.record("w1").state == "terminating"
            st = await sup.wait_terminal("w1")
            elapsed = trio.current_time() - t0
            assert not _alive(gc), "the TERM-ignoring grandchild survived"
            assert sup.gpu_holders() == {}
            assert st.state == "preempted" and st.exit_code == 0       # the leader's code
            assert grace * 0.9 <= elapsed < grace + 5
            assert sup.statistics()["isolation"] == isolation.mode
            n.cancel_scope.cancel()


def _kill_leftovers(tmp: Path, name: str) -> None:
    """A failing test (or a mutated agent) must not leave an escaped process behind."""
    for f in tmp.glob(f"state/workloads/*/scratch/{name}"):
        try:
            pid = int(f.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid) and f"HERD_SCRATCH={f.parent}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def no_escapers(tmp_path):
    yield
    _kill_leftovers(tmp_path, "gc.pid")
    _kill_leftovers(tmp_path, "d.pid")


async def test_escaping_grandchild_killed_after_grace_subreaper(tmp_path, no_escapers):
    await _escaper_is_killed_after_grace(tmp_path, Isolation(None, "test"))


async def test_escaping_grandchild_killed_after_grace_cgroup(tmp_path, real_cgroup, no_escapers):
    tree, _ = detect(str(real_cgroup))
    assert tree is not None
    await _escaper_is_killed_after_grace(tmp_path, Isolation(tree, "test"))
    assert not (real_cgroup / "w1").exists()   # removed once empty


async def test_leftovers_of_a_finished_leader_are_ended(tmp_path, no_escapers):
    """The leader exits 3 by itself, leaving a TERM-ignoring daemon: the workload is
    'exited 3' only once the daemon is gone (shim: SIGTERM, grace, SIGKILL)."""
    sup = _sup(tmp_path, Isolation(None, "test"))
    script = ("setsid sh -c 'trap \"\" TERM; echo $$ > \"$HERD_SCRATCH/d.pid\"; while :; do sleep 0.05; done' &\n"
              "while [ ! -s \"$HERD_SCRATCH/d.pid\" ]; do sleep 0.02; done; exit 3")
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = Placement(placement_id="p1", job_id="j1", argv=["sh", "-c", script], grace_s=0.5,
                          pods=[PodAssignment(workload_id="w1", rank=0, gpus=["GPU-0002"])])
            assert (await sup.place(p)).accepted
            st = await sup.wait_terminal("w1")
            d = int((sup.wl_dir / "w1" / "scratch" / "d.pid").read_text())
            assert (st.state, st.exit_code) == ("exited", 3) and not _alive(d)
            n.cancel_scope.cancel()


async def test_a_placement_naming_a_user_not_allowed_is_refused(tmp_path):
    sup = _sup(tmp_path, Isolation(None, "test"))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            p = Placement(placement_id="p1", job_id="j1", argv=["true"], user="root",
                          pods=[PodAssignment(workload_id="w1", rank=0, gpus=["GPU-0001"])])
            ack = await sup.place(p)
            assert not ack.accepted and ack.outcome == "refused_spec" and "root" in (ack.reason or "")
            assert sup.workloads() == []
            n.cancel_scope.cancel()


def test_descendants_follow_ppid_links():
    import subprocess
    import time
    p = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        end = time.monotonic() + 5
        while len(descendants(p.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert len(descendants(p.pid)) == 2
    finally:
        for c in descendants(p.pid):
            os.kill(c, signal.SIGKILL)
        p.kill()
        p.wait()


# ---------------------------------------------------------------- what a workload can touch (root only)

PROBE = r"""
r="$HERD_SCRATCH/probe"
id -u > "$r.uid"
grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status > "$r.status"
umask > "$r.umask"
cat /proc/self/oom_score_adj > "$r.oom"
ulimit -c > "$r.core"
try() { if (eval "$2") >/dev/null 2>&1; then echo "$1 yes"; else echo "$1 no"; fi; }
{
try read_token "cat '$TOKENS/placer.token'"
try list_tokens "ls '$TOKENS'"
try read_state "cat '$STATE/state.json'"
try list_state "ls '$STATE'"
try read_other_scratch "ls '$OTHER'"
try read_own_log "cat '$HERD_SCRATCH/../stdout.log'"
try read_run_json "cat '$HERD_SCRATCH/../run.json'"
try plant_symlink "ln -sf /etc/shadow '$HERD_SCRATCH/../stderr.log'"
try write_tree "echo x >> data.txt"
try chmod_tree "chmod u+w data.txt"
try write_chunk "for f in '$STORE'/chunks/*/*; do echo x >> \$f && exit 0; done; exit 1"
try list_chunks "ls '$STORE/chunks'"
try read_notice "test -r '$HERD_PREEMPT_NOTICE' || test ! -e '$HERD_PREEMPT_NOTICE'"
try write_scratch "echo ok > '$HERD_SCRATCH/w'"
} > "$r.access"
"""


@root_only
@pytest.mark.parametrize("mode", ["subreaper", "cgroup", "tenants"])
async def test_workload_cannot_touch_the_host(tmp_path, token_dir, mode, request):
    from p2p.fetch import fetch_artifact
    from p2p.origins import open_origin
    from p2p.publish import publish
    from p2p.store import ChunkStore

    if mode == "cgroup":
        cg = request.getfixturevalue("real_cgroup")
        tree, _ = detect(str(cg))
        iso = Isolation(tree, "test")
    elif mode == "tenants":   # a uid of its own (agent.tenants): no more reach than the shared user
        iso = Isolation(None, "test", tenancy=Tenancy(IsolationSection(uid_range="3100700-3100763")))
    else:
        iso = Isolation(None, "test")
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("payload\n" * 1000)
    origin_url = f"file://{tmp_path / 'origin'}"
    async with open_origin(origin_url) as o:
        pub = await publish(src, o, "t:v1")
    store = ChunkStore(tmp_path / "state" / "store")

    async def fetcher(mid: str, origin: str | None, peers: list) -> tuple[Path, dict[str, int]]:
        async with open_origin(origin or origin_url) as o:
            await fetch_artifact(store, mid, o, peers=[], node_id="n1")
        return Path(await trio.to_thread.run_sync(store.materialise, mid)), {}

    sup = Supervisor(tmp_path / "state", node_id="n1", gpu_health=lambda: GPUS,
                     config=SupervisorConfig(shim_pool=1, user="nobody", allowed_users=("65533",)),
                     base_env={"PATH": "/usr/bin:/bin"}, isolation=iso, fetcher=fetcher,
                     pool=ShimPool(1, prepare=iso.for_launch))
    assert sup.identities.default.name == "nobody"
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            other = Placement(placement_id="p0", job_id="j0", argv=["sh", "-c", "echo secret > \"$HERD_SCRATCH/s\"; sleep 30"],
                              user="65533", pods=[PodAssignment(workload_id="other", rank=0, gpus=["GPU-0000"])])
            assert (await sup.place(other)).accepted
            await poll(lambda: (sup.wl_dir / "other" / "scratch" / "s").exists(), 0.02)
            env = {"TOKENS": str(token_dir), "STATE": str(sup.state_dir), "OTHER": str(sup.wl_dir / "other" / "scratch"),
                   "STORE": str(store.root)}
            p = Placement(placement_id="p1", job_id="j1", argv=["sh", "-c", PROBE], env=env, manifest_id=pub.manifest,
                          origin=origin_url, pods=[PodAssignment(workload_id="w1", rank=0, gpus=["GPU-0001"])])
            assert (await sup.place(p)).accepted
            st = await sup.wait_terminal("w1")
            assert st.state == "exited", st
            await sup.stop("other", grace_s=0)
            await sup.wait_terminal("other")
            n.cancel_scope.cancel()
    scratch = sup.wl_dir / "w1" / "scratch"
    uid = sup.identities.default.uid if mode != "tenants" else 3100700
    owner = uid if mode != "tenants" else os.geteuid()     # a released uid's scratch is sealed back
    assert (scratch.stat().st_uid, scratch.stat().st_mode & 0o777) == (owner, 0o700)
    r = {k: v for k, v in (line.split() for line in (scratch / "probe.access").read_text().splitlines())}
    assert r == {"read_token": "no", "list_tokens": "no", "read_state": "no", "list_state": "no",
                 "read_other_scratch": "no", "read_own_log": "no", "read_run_json": "no", "plant_symlink": "no",
                 "write_tree": "no", "chmod_tree": "no", "write_chunk": "no", "list_chunks": "no",
                 "read_notice": "yes", "write_scratch": "yes"}, r
    assert int((scratch / "probe.uid").read_text()) == uid != 0
    status = dict(line.split(":") for line in (scratch / "probe.status").read_text().splitlines())
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0 and status["NoNewPrivs"].strip() == "1"
    assert (scratch / "probe.umask").read_text().strip() == "0077"
    assert (scratch / "probe.oom").read_text().strip() == "0"
    assert (scratch / "probe.core").read_text().strip() == "0"
    # state files are the agent's alone
    for f in (sup.state_dir / "state.json", sup.state_dir / "state.log", sup.wl_dir / "w1" / "run.json", sup.wl_dir / "w1" / "stdout.log"):
        assert f.stat().st_mode & 0o077 == 0, f
    # the log API never follows a symlink, even one planted by someone who could
    (sup.wl_dir / "w1" / "stderr.log").unlink()
    (sup.wl_dir / "w1" / "stderr.log").symlink_to("/etc/shadow")
    with pytest.raises(AgentError, match="symlink"):
        sup.read_log("w1", stream="stderr")
