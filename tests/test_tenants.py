"""Tenants apart (issue 42, finding 6): a uid per workload from a configured range, /proc
hidden from other uids, GPU device nodes limited to the assigned GPUs. The pure parts
everywhere; real workloads through the supervisor and its shims where the test is root.

GPU device nodes here are simulated: character devices made with mknod in a temp dir with
NVIDIA's numbers (195:N, nvidiactl 195:255). No driver answers them, so opening an allowed
one fails with ENXIO, a filtered one with EPERM, a hidden one with ENOENT."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.config import load_config
from agent.errors import ConfigError
from agent.isolation import CgroupTree, Isolation, detect
from agent.launcher import ShimPool
from agent.state import WorkloadRecord
from agent.supervisor import Supervisor, SupervisorConfig
from agent.tenants import (
    IsolationSection,
    Tenancy,
    UidPool,
    decide,
    device_program,
    host_hidepid,
    live_uids,
    parse_uid_range,
    range_conflicts,
)
from scheduler_link.messages import Placement, PodAssignment
from tests.conftest import is_root
from tests.test_isolation import _real_cgroup_parent

GPUS = {f"GPU-{i:04d}": "healthy" for i in range(4)}
MINORS = {f"GPU-{i:04d}": i for i in range(4)}
PY = "/usr/bin/python3"
root_only = pytest.mark.skipif(not is_root() or not os.path.exists(PY),
                               reason="needs root (workloads switch uids, mount namespaces) and /usr/bin/python3")

# ---------------------------------------------------------------- pure parts


def test_uid_range_is_parsed_or_refused():
    assert parse_uid_range("200000-265535") == range(200000, 265536)
    assert parse_uid_range(" 5000 - 5000 ") == range(5000, 5001)
    assert parse_uid_range("off") is None and parse_uid_range("") is None
    for bad in ("200000", "200000-", "a-b", "300-200", "0-10", "100-2000", "1000-4294967295"):
        with pytest.raises(ConfigError, match="uid_range"):
            parse_uid_range(bad)


def test_the_agent_config_refuses_a_malformed_range(tmp_path):
    f = tmp_path / "agent.toml"
    f.write_text('[isolation]\nuid_range = "200000:265535"\n')
    with pytest.raises(ConfigError, match=r"\[isolation\] uid_range must be FIRST-LAST"):
        load_config(f)
    f.write_text('[isolation]\nuid_range = "off"\nhide_proc = "off"\n')
    assert load_config(f).isolation.uid_range == "off"
    assert load_config(None).isolation == IsolationSection()      # on by default


def test_a_range_over_ids_in_use_is_found():
    r = range(200000, 265536)
    files = {"passwd": "root:x:0:0::/root:/bin/sh\nbob:x:200007:200007::/home/bob:/bin/sh\n",
             "group": "wheel:x:10:\nlab:x:265535:\n",
             "subuid": "alice:100000:65536\ncarol:165536:65536\n", "subgid": "dave:300000:10\n"}
    assert range_conflicts(r, files) == ["passwd: bob is 200007", "group: lab is 265535",
                                         "subuid: carol has 165536-231071"]
    assert range_conflicts(range(300010, 300020), files) == []


def test_the_agent_refuses_to_start_on_a_range_in_use(tmp_path):
    (tmp_path / "passwd").write_text("svc:x:200100:200100::/:/bin/false\n")
    with pytest.raises(ConfigError, match="overlaps ids in use on this host .*svc is 200100"):
        Tenancy(IsolationSection(), privileged=True, etc=str(tmp_path))
    (tmp_path / "passwd").write_text("")
    (tmp_path / "subuid").write_text("alice:100000:131072\n")
    with pytest.raises(ConfigError, match="subuid: alice has 100000-231071"):
        Tenancy(IsolationSection(), privileged=True, etc=str(tmp_path))


def test_pool_never_shares_a_uid_and_reuses_last():
    pool = UidPool(range(10, 13))
    got = {}
    for w in ("a", "b", "c"):
        uid = pool.next_uid(w)
        assert uid is not None and not pool.needs_scan(uid)
        pool.take(w, uid)
        got[w] = uid
    assert sorted(got.values()) == [10, 11, 12]
    assert pool.next_uid("d") is None                    # every uid held
    assert pool.release("a") == 10 and pool.release("a") is None
    assert pool.next_uid("d") == 10 and pool.needs_scan(10)   # released: scanned before reuse
    pool.scanned({10})                                   # a process of 10 still lives
    assert pool.needs_scan(10)
    pool.scanned(set())
    assert not pool.needs_scan(10)
    pool.take("d", 10)
    pool.release("b")
    pool.release("c")
    pool.scanned(set())
    assert pool.next_uid("e") == 11                      # the queue: released uids in release order
    assert pool.next_uid("c") == 12                      # a restarted workload gets its own back
    assert pool.take("c", 12) is None
    assert pool.statistics() == {"range": "10-12", "held": 2, "free": 1, "suspect": 0}


def test_pool_restart_after_the_uid_went_elsewhere():
    pool = UidPool(range(10, 12))
    pool.take("a", 10)
    pool.release("a")
    pool.scanned(set())
    pool.take("b", pool.next_uid("b") or 0)             # 11
    pool.take("x", 10)                                   # a's old uid goes to x
    pool.release("b")
    pool.scanned(set())
    pool.release("x")
    pool.scanned(set())
    assert pool.next_uid("a") == 11                      # not its old 10's affinity any more: the queue
    assert pool.take("a", 11) is None                    # a's "before" was forgotten when x took 10


def test_pool_lease_scans_only_for_a_suspect_uid_and_skips_live_ones():
    pool = UidPool(range(10, 13))
    scans: list[int] = []

    def scan(live: set[int]):
        return lambda: scans.append(1) or live
    assert pool.lease("a", scan(set())) == (10, None) and scans == []      # fresh: no scan
    assert pool.lease("a", scan(set())) == (10, None)                       # held: the same
    pool.release("a")
    assert pool.lease("b", scan(set())) == (11, None) and scans == []
    pool.release("b")
    pool.lease("c", scan(set()))                                             # 12
    assert pool.lease("a", scan({10})) == (11, 10) and scans == [1]        # its old 10 lives on: another
    pool.release("a")
    pool.release("c")
    assert pool.lease("d", scan({10, 11, 12})) is None                      # every free uid lives on
    assert pool.lease("d", scan({10, 12})) == (11, None)
    assert pool.lease("c", scan(set())) == (12, None)                       # its own, once clear


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lease", "release", "leave", "die"]), st.integers(0, 5),
                          st.integers(20, 23)), max_size=60), st.frozensets(st.integers(20, 23)))
def test_pool_never_shares_nor_hands_out_a_live_uid(ops, strays):
    """Invariants under any sequence: two workloads never hold one uid; a uid handed out has no
    live process at that moment; a lease fails only when every free uid has one."""
    pool = UidPool(range(20, 24))
    world = set(strays)              # uids with live processes (what a /proc scan would find)
    pool.suspect(world)              # the agent's scan at start
    for op, w, u in ops:
        wid = f"w{w}"
        if op == "lease":
            free_before = {x for x in range(20, 24) if x not in {pool.held(f"w{i}") for i in range(6)}}
            held_before = pool.held(wid)
            got = pool.lease(wid, lambda: set(world))
            if got is None:
                assert held_before is None and pool.held(wid) is None and free_before <= world
            else:
                assert got[0] == pool.held(wid)
                assert held_before is not None or got[0] not in world
                world.add(got[0])            # the workload's processes
        elif op == "release" and (uid := pool.held(wid)) is not None:
            world.discard(uid)               # its processes are gone ...
            pool.release(wid)
        elif op == "leave" and (uid := pool.held(wid)) is not None:
            pool.release(wid)                # ... or one escaped and lives on
        elif op == "die" and u not in {pool.held(f"w{i}") for i in range(6)}:
            world.discard(u)
        held = [h for h in (pool.held(f"w{i}") for i in range(6)) if h is not None]
        assert len(held) == len(set(held))


def test_host_hidepid_is_read_from_mounts():
    assert host_hidepid("proc /proc proc rw,nosuid,hidepid=invisible 0 0\n") == "invisible"
    assert host_hidepid("proc /proc proc rw,hidepid=2,gid=4 0 0\n") == "2"
    assert host_hidepid("proc /proc proc rw,hidepid=noaccess 0 0\n") is None
    assert host_hidepid("proc /proc proc rw,relatime 0 0\nproc /x/proc proc rw,hidepid=2 0 0\n") is None


def test_device_program_shape():
    code = device_program([3, 1, 1])
    assert len(code) == 8 * (7 + 2 + 4)                   # the checks, one jump per minor, deny and allow
    assert code[-16:] == bytes([0xB7, 0, 0, 0, 1, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0])


def test_an_unprivileged_agent_keeps_todays_behaviour_and_says_so():
    t = Tenancy(IsolationSection(), privileged=False)
    assert t.pool is None
    assert t.modes.uids == "shared" and t.modes.hidepid is None and t.modes.proc in ("host", "none")
    st = Isolation(None, "test", tenancy=t).statistics()["tenants"]
    assert isinstance(st, dict) and st["uid_pool"] is None and st["gpu_devices"] == "none"
    assert "uids: the agent is not root; every workload runs as its own user" in st["notes"]  # type: ignore[operator]


NS_OK, BPF_OK = (True, "invisible"), (True, "")


def test_modes_fall_back_where_the_host_does_not_allow_and_say_so():
    on = IsolationSection()
    m = decide(on, privileged=True, ns=NS_OK, host_hidepid=None, bpf=BPF_OK)
    assert (m.uids, m.proc, m.hidepid, m.notes) == ("per-workload", "namespace", "invisible", ())
    assert (m.gpu_devices(True), m.gpu_devices(False)) == ("filter", "namespace")
    m = decide(on, privileged=True, ns=NS_OK, host_hidepid="2", bpf=BPF_OK)
    assert (m.proc, m.hidepid) == ("host", None)                  # the host hides already: no /proc mounted
    m = decide(on, privileged=True, ns=(False, "unshare(CLONE_NEWNS): Operation not permitted"), host_hidepid=None,
               bpf=(False, "Operation not permitted"))
    assert (m.uids, m.proc, m.gpu_devices(True), m.gpu_devices(False)) == ("per-workload", "none", "none", "none")
    assert m.notes == ("proc: other workloads' processes are visible (no mount namespace: unshare(CLONE_NEWNS): "
                       "Operation not permitted)",
                       "gpu_devices: no eBPF device filter (Operation not permitted)",
                       "gpu_devices: no device namespace (unshare(CLONE_NEWNS): Operation not permitted): "
                       "without a filter, CUDA_VISIBLE_DEVICES only")
    m = decide(on, privileged=True, ns=NS_OK, host_hidepid=None, bpf=(False, "Invalid argument"))
    assert (m.gpu_devices(True), m.gpu_devices(False)) == ("namespace", "namespace")
    m = decide(on, privileged=False, ns=(False, "the agent is not root"), host_hidepid=None, bpf=(False, "off"))
    assert (m.uids, m.proc, m.gpu_devices(True)) == ("shared", "none", "none") and len(m.notes) == 4
    off = IsolationSection(uid_range="off", hide_proc="off", gpu_devices="off")
    m = decide(off, privileged=True, ns=NS_OK, host_hidepid=None, bpf=BPF_OK)
    assert (m.uids, m.proc, m.gpu_devices(True), m.hidepid) == ("shared", "none", "none", None)
    assert [n.split(":")[0] for n in m.notes] == ["uids", "proc", "gpu_devices"]


# ---------------------------------------------------------------- real workloads (root)


@pytest.fixture(autouse=True)
def _no_tenant_left(tmp_path: Path) -> Iterator[None]:
    """Workloads outlive a cancelled supervisor (by design): a failing test must not leave one
    of its workloads holding a uid to the next test (found by the scratch dir in its env)."""
    yield
    mark = f"HERD_SCRATCH={tmp_path}/".encode()
    for name in os.listdir("/proc") if is_root() else ():
        with contextlib.suppress(OSError):
            if name.isdigit() and mark in Path(f"/proc/{name}/environ").read_bytes():
                os.kill(int(name), 9)


def _sup(tmp: Path, iso: Isolation) -> Supervisor:
    return Supervisor(tmp / "state", node_id="n1", gpu_health=lambda: GPUS, config=SupervisorConfig(shim_pool=1),
                      base_env={"PATH": "/usr/bin:/bin"}, isolation=iso, pool=ShimPool(1, prepare=iso.for_launch))


def _tenancy(uids: str, **kw: str) -> Tenancy:
    return Tenancy(IsolationSection(uid_range=uids, **kw), gpu_minors=lambda: MINORS)


def _place(wid: str, argv: list[str], gpu: int, **env: str) -> Placement:
    return Placement(placement_id=f"p-{wid}", job_id=f"j-{wid}", argv=argv, env=env, grace_s=1.0,
                     pods=[PodAssignment(workload_id=wid, rank=0, gpus=[f"GPU-{gpu:04d}"])])


def _uids_of(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return [int(x) for x in line.split()[1:]]
    return []


def _proc_state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


async def _up(sup: Supervisor, wid: str) -> int:
    """The workload's pid once it wrote scratch/up and its record says it runs."""
    while not (sup.wl_dir / wid / "scratch" / "up").exists() or sup.record(wid).pid is None:
        assert not sup.record(wid).terminal, (sup.record(wid).state, sup.record(wid).reason)
        await trio.sleep(0.02)
    pid = sup.record(wid).pid
    assert pid is not None
    return pid


ATTACK = r"""
import errno, json, os
b = int(os.environ["B_PID"])
out = {}
def attempt(name, fn):
    try:
        out[name] = "ok " + repr(fn())[:300]
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
attempt("environ", lambda: open(f"/proc/{b}/environ", "rb").read())
attempt("cmdline", lambda: open(f"/proc/{b}/cmdline", "rb").read())
attempt("cwd", lambda: os.listdir(f"/proc/{b}/cwd"))
attempt("kill0", lambda: os.kill(b, 0))
attempt("stop", lambda: os.kill(b, 19))
out["listed"] = str(b) in os.listdir("/proc")
out["uid"], out["gid"], out["groups"] = os.getuid(), os.getgid(), os.getgroups()
with open(os.environ["HERD_SCRATCH"] + "/attack.json", "w") as f:
    json.dump(out, f)
"""
VICTIM = 'echo hidden > "$HERD_SCRATCH/file-b"; echo up > "$HERD_SCRATCH/up"; exec sleep 60'


@root_only
async def test_a_workload_cannot_read_signal_or_list_another(tmp_path):
    t = _tenancy("3100000-3100063")
    assert t.modes.proc in ("namespace", "host"), t.modes
    sup = _sup(tmp_path, Isolation(None, "test", tenancy=t))
    with trio.fail_after(40):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            assert (await sup.place(_place("b", ["sh", "-c", VICTIM], 0, SECRET_B="s3cr3t-of-b"))).accepted
            bpid = await _up(sup, "b")
            assert (await sup.place(_place("a", [PY, "-I", "-S", "-c", ATTACK], 1, B_PID=str(bpid)))).accepted
            st = await sup.wait_terminal("a")
            assert (st.state, st.exit_code) == ("exited", 0), st
            buid = _uids_of(bpid)
            assert sup.record("b").state == "running" and _proc_state(bpid) == "S"   # not stopped
            await sup.stop("b", grace_s=0)
            await sup.wait_terminal("b")
            n.cancel_scope.cancel()
    out = json.loads((sup.wl_dir / "a" / "scratch" / "attack.json").read_text())
    assert "s3cr3t" not in json.dumps(out)
    assert out["environ"] in ("EACCES", "ENOENT") and out["cwd"] in ("EACCES", "ENOENT"), out
    assert out["kill0"] == "EPERM" and out["stop"] == "EPERM", out
    assert out["listed"] is False and out["cmdline"] == "ENOENT", out    # hidepid: B is not there at all
    # two tenants, two uids (and gids) from the range, neither the shared default user
    rng = range(3100000, 3100064)
    assert out["uid"] in rng and out["gid"] == out["uid"] and out["groups"] == [out["uid"]]
    assert buid[0] in rng and buid == [buid[0]] * 4 and buid[0] != out["uid"]
    assert sup.identities.default.uid not in (out["uid"], buid[0])
    # the scratch dirs were their own (0700) and are sealed back to the agent once released
    for w in ("a", "b"):
        s = (sup.wl_dir / w / "scratch").stat()
        assert (s.st_uid, s.st_mode & 0o777) == (os.geteuid(), 0o700)
    assert (sup.wl_dir / "b" / "scratch" / "file-b").stat().st_uid == buid[0]
    assert t.pool is not None and t.pool.statistics()["held"] == 0


LINGER = 'echo up > "$HERD_SCRATCH/up"; exec sleep 60'


@contextlib.contextmanager
def _stray(uid: int) -> Iterator[subprocess.Popen[bytes]]:
    """A process of ``uid`` the agent did not start (what a workload could leave behind)."""
    p = subprocess.Popen(["sleep", "60"], user=uid, group=uid, cwd="/")
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@root_only
async def test_a_uid_is_reused_only_after_its_processes_are_gone(tmp_path):
    t = _tenancy("3100100-3100101")
    sup = _sup(tmp_path, Isolation(None, "test", tenancy=t))
    assert t.pool is not None
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            for w, g in (("w1", 0), ("w2", 1)):
                assert (await sup.place(_place(w, ["sh", "-c", LINGER], g))).accepted
            u1, u2 = _uids_of(await _up(sup, "w1"))[0], _uids_of(await _up(sup, "w2"))[0]
            assert {u1, u2} == {3100100, 3100101}                # never shared
            # the range is exhausted: a third workload fails to launch, it never shares
            assert (await sup.place(_place("w3", ["true"], 2))).accepted
            st = await sup.wait_terminal("w3")
            assert st.state == "failed" and "no free workload uid" in (st.reason or ""), st
            await sup.stop("w1", grace_s=0)
            await sup.wait_terminal("w1")
            with _stray(u1):                                    # something of u1 still lives
                assert (await sup.place(_place("w4", ["true"], 2))).accepted
                st = await sup.wait_terminal("w4")
                assert st.state == "failed" and "no free workload uid" in (st.reason or ""), st
            # once it is gone, u1 goes to the next workload
            assert (await sup.place(_place("w5", ["sh", "-c", LINGER], 2))).accepted
            assert _uids_of(await _up(sup, "w5"))[0] == u1
            for w in ("w2", "w5"):
                await sup.stop(w, grace_s=0)
                await sup.wait_terminal(w)
            n.cancel_scope.cancel()
    assert t.pool.statistics()["held"] == 0


@root_only
def test_a_restarted_workload_gets_its_files_under_its_new_uid(tmp_path):
    from agent.tenants import _own
    s = tmp_path / "scratch"
    (s / "sub").mkdir(parents=True)
    (s / "sub" / "f").write_text("x")
    (s / "mine").symlink_to("/etc/shadow")
    for p in (s, s / "sub", s / "sub" / "f"):
        os.chown(p, 3100010, 3100010)
    os.chown(s / "mine", 3100010, 3100010, follow_symlinks=False)
    _own(s, 3100011, None, range(3100000, 3100100))     # never sealed (an agent restart): its owner says
    owners = {p.name: p.lstat().st_uid for p in (s, s / "sub", s / "sub" / "f", s / "mine")}
    assert owners == {"scratch": 3100011, "sub": 3100011, "f": 3100011, "mine": 3100011}
    assert Path("/etc/shadow").stat().st_uid == 0                    # the link, not its target
    os.chown(s, 0, 0)                                               # sealed at release
    _own(s, 3100012, 3100011, range(3100000, 3100100))              # the pool remembers the uid before
    assert {p.lstat().st_uid for p in (s, s / "sub", s / "sub" / "f")} == {3100012}


@root_only
def test_the_agent_starts_with_live_uids_as_suspect(tmp_path):
    with _stray(3100200):
        assert 3100200 in live_uids(range(3100200, 3100202))
        t = _tenancy("3100200-3100201")
        assert t.pool is not None and t.pool.needs_scan(3100200) and t.pool.next_uid("x") == 3100201


def _sim_dev(d: Path) -> Path:
    """SIMULATED GPU device nodes: NVIDIA's numbers, no driver behind them."""
    d.mkdir()
    os.chmod(d, 0o755)
    nodes = {**{f"nvidia{m}": (195, m) for m in range(4)}, "nvidiactl": (195, 255), "null": (1, 3)}
    for name, (major, minor) in nodes.items():
        os.mknod(d / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(d / name, 0o666)
    (d / "shm").mkdir()
    os.chmod(d / "shm", 0o1777)
    (d / "stdout").symlink_to("/proc/self/fd/1")
    return d


DEVICES = r"""
import errno, json, os
d = os.environ["DEV"]
out = {"names": sorted(os.listdir(d)), "open": {}}
for n in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "null"):
    try:
        os.close(os.open(os.path.join(d, n), os.O_RDWR))
        out["open"][n] = "ok"
    except OSError as e:
        out["open"][n] = errno.errorcode[e.errno]
out["null_is_dev"] = os.stat(os.path.join(d, "null")).st_rdev == os.makedev(1, 3)
out["shm_writable"] = os.access(os.path.join(d, "shm"), os.W_OK)
with open(os.environ["HERD_SCRATCH"] + "/dev.json", "w") as f:
    json.dump(out, f)
"""


async def _devices_seen(tmp: Path, iso: Isolation, dev: Path) -> dict:
    sup = _sup(tmp, iso)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            assert (await sup.place(_place("g", [PY, "-I", "-S", "-c", DEVICES], 1, DEV=str(dev)))).accepted
            st = await sup.wait_terminal("g")
            assert (st.state, st.exit_code) == ("exited", 0), st
            n.cancel_scope.cancel()
    return json.loads((sup.wl_dir / "g" / "scratch" / "dev.json").read_text())


@root_only
async def test_a_workload_sees_only_its_gpu_nodes_without_cgroups(tmp_path):
    dev = _sim_dev(tmp_path / "dev")
    t = _tenancy("3100300-3100301", dev_dir=str(dev))
    assert t.modes.gpu_namespace, t.modes
    out = await _devices_seen(tmp_path, Isolation(None, "test", tenancy=t), dev)
    assert out["names"] == ["null", "nvidia1", "nvidiactl", "shm", "stdout"], out
    assert out["open"] == {"nvidia0": "ENOENT", "nvidia1": "ENXIO", "nvidia2": "ENOENT", "nvidia3": "ENOENT",
                           "nvidiactl": "ENXIO", "null": "ok"}, json.dumps(out)
    assert out["null_is_dev"] and out["shm_writable"]
    assert sorted(os.listdir(dev)) == ["null", "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "shm",
                                       "stdout"]                      # the host's dir is untouched


@pytest.fixture
def cgroup_dir() -> Iterator[Path]:
    p = _real_cgroup_parent()
    if p is None:
        pytest.skip("no writable cgroup v2 hierarchy here")
    yield p
    for child in p.iterdir():
        if child.is_dir():
            with contextlib.suppress(OSError):
                CgroupTree(p).kill(child.name)
            with contextlib.suppress(OSError):
                child.rmdir()
    with contextlib.suppress(OSError):
        p.rmdir()


@root_only
async def test_a_workload_opens_only_its_gpu_nodes_under_the_device_filter(tmp_path, cgroup_dir):
    dev = _sim_dev(tmp_path / "dev")
    t = _tenancy("3100400-3100401", dev_dir=str(dev))
    if not t.modes.gpu_filter:
        pytest.skip(f"no eBPF device filter here: {t.modes.notes}")
    tree, _ = detect(str(cgroup_dir))
    assert tree is not None
    out = await _devices_seen(tmp_path, Isolation(tree, "test", tenancy=t), dev)
    # the filter refuses by device number: the nodes are there, the others cannot be opened
    assert out["open"] == {"nvidia0": "EPERM", "nvidia1": "ENXIO", "nvidia2": "EPERM", "nvidia3": "EPERM",
                           "nvidiactl": "ENXIO", "null": "ok"}, json.dumps(out)
    assert t.bpf_failures == 0


@root_only
def test_status_says_what_holds_here():
    t = _tenancy("3100500-3100999")
    st = Isolation(None, "test", tenancy=t).statistics()["tenants"]
    assert isinstance(st, dict) and st["uids"] == "per-workload" and st["proc"] in ("namespace", "host")
    assert st["uid_pool"] == {"range": "3100500-3100999", "held": 0, "free": 500, "suspect": 0}
    assert st["gpu_devices"] == "namespace" and st["notes"] == []     # subreaper mode: a /dev of its own
    off = Tenancy(IsolationSection(uid_range="off", hide_proc="off", gpu_devices="off"))
    assert off.pool is None and off.modes.proc == "none" and off.modes.gpu_devices(True) == "none"


@root_only
async def test_the_agent_runs_each_workload_as_its_own_uid_by_default(tmp_path, token_dir):
    """The daemon's wiring with the default [isolation] (simulated GPUs): status says what holds,
    two workloads get two uids of 200000-265535."""
    from agent.config import AgentConfig
    from agent.daemon import Agent

    cfg = AgentConfig(node_id="n1", gpus="simulated:dgx-h100", state_dir=str(tmp_path / "state"),
                      listen="127.0.0.1:0", data_listen=None, token_dir=str(token_dir),
                      workloads=SupervisorConfig(shim_pool=1))
    agent = Agent(cfg, env={"PATH": "/usr/bin:/bin"}, handle_signals=False)
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(agent.run)
            st = json.loads(agent.status_json())["tenants"]
            assert st["uids"] == "per-workload" and st["uid_pool"]["range"] == "200000-265535", st
            assert st["uid_pool"]["held"] == 0 and st["proc"] in ("namespace", "host"), st
            assert st["gpu_devices"] == ("filter" if agent.supervisor.isolation.mode == "cgroup" else "namespace"), st
            uuids = [g.uuid for g in agent.gpu_snapshot().gpus]
            sup = agent.supervisor
            for i, w in enumerate(("x", "y")):
                p = Placement(placement_id=f"p{w}", job_id=f"j{w}", argv=["sh", "-c", LINGER],
                              pods=[PodAssignment(workload_id=w, rank=0, gpus=[uuids[i]])])
                assert (await sup.place(p)).accepted
            ux, uy = _uids_of(await _up(sup, "x"))[0], _uids_of(await _up(sup, "y"))[0]
            assert ux != uy and {ux, uy} <= set(range(200000, 265536))
            assert json.loads(agent.status_json())["tenants"]["uid_pool"]["held"] == 2
            for w in ("x", "y"):
                await sup.stop(w, grace_s=0)
                await sup.wait_terminal(w)
            n.cancel_scope.cancel()


@root_only
def test_a_gpu_node_made_after_a_listing_is_hidden_from_the_next_pod(tmp_path):
    """The device dir's listing is kept between pods only while the dir is unchanged: a node
    that appears (even within the timestamp tick of the last listing) is seen at once."""
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidia0", 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    t = _tenancy("3100500-3100501", dev_dir=str(dev))
    if not t.modes.gpu_namespace:
        pytest.skip(f"no device namespace here: {t.modes.notes}")
    rec = WorkloadRecord(workload_id="w", job_id="j", gpus=["GPU-0000"], gpu_indices=[0])
    assert t.view(rec, None)[1] is None                    # nothing to hide: the host's /dev
    before = os.stat(dev)
    os.mknod(dev / "nvidia1", 0o666 | stat.S_IFCHR, os.makedev(195, 1))
    os.utime(dev, ns=(before.st_atime_ns, before.st_mtime_ns))   # as if in the same tick
    assert t.view(rec, None)[1] == [0]                     # a /dev of its own, without nvidia1
    settled = time.time_ns() - 5_000_000_000
    os.utime(dev, ns=(settled, settled))
    assert t.view(rec, None)[1] == [0]
    os.unlink(dev / "nvidia1")                             # changes the dir: listed again
    assert t.view(rec, None)[1] is None
