"""Placer failover against an emulated fleet: three ``herd placer run`` on a three-member etcd
(placer.ha), the leader SIGKILLed with a gang running; and, in the same run, the baseline a
single placer has: a cold restart of the process on its state dir.

    python -m bench.failover --nodes 1024 [--json]
    python -m bench.failover --relays --nodes 16384 [--json]

Per run (N emulated nodes: ``python -m testing.fleet``, told every placer), on one of two paths:

- direct (``--direct``, the default below 4,096 nodes): real AgentLinks, each node its own
  framed connection to the leader and one to each follower for its copies (scheduler_link.follow);
- relays (``--relays``, the default from 4,096 nodes): one shipped relay per rack
  (agent.relay.Relay, 32 nodes a rack) with its real frames connection up, its host's own link
  the shipped AgentLink; each relay opens one copy connection per follower and copies every rack
  beat and report batch there (agent.relaycopies), and goes up to the promoted follower over it.
  The emulator runs in ``--emulators`` processes (default: one per 8,192 nodes), at +10 nice (they
  stand for other machines: the placers and etcd get the cores first).

- a gang of ``--gang-hosts`` (default N/2) hosts x 8 GPUs is placed and running;
- the leader is killed (SIGKILL) at ``t0``; a probe job (1 x 8 GPUs) is submitted at once to
  the other placers (following 307s, asking again after 503 Retry-After);
- ``failover_s``: ``t0`` -> the probe's ``decided`` timing at the new leader (the placer's
  clock; one machine); ``promoted_s``: ``t0`` -> a follower says it leads and places;
  ``full_report_s``: ``t0`` -> every node up in the new leader's model (a follower's warm
  model holds the nodes whose copies were in step: placer.observe);
  ``reregistrations``: full reports the fleet sent after ``t0`` (a node whose copies to the
  new leader were in step goes on with a heartbeat over its copy connection: none);
- ``--recover-s`` (5): a new leader (or a restarted placer) waits this long for the fleet's
  reports before placing; shorter than the fleet takes to report again, it places the
  recovered gang a second time (``placements_doubled``) and stops the old pods (``stops``);
- ``leader_kept``: the first leader still leads, at the epoch it had before the fleet
  registered (its lease held through the registration storm and the gang's placement);
- ``followers_warm_s``: once the fleet is up, until both followers' models hold every node (their
  copies; bounded), before the gang is placed (on the relay path each member's full report goes
  through its relay to the leader too, once: not while the gang is being placed);
- steady state, over ``--steady-s`` (10 s) before the kill: each placer's CPU as a fraction of one
  core (``leader_cpu``, ``follower_cpu``), the emulators' (``emu_cpu``), and on the relay path the
  bytes the relays copied to each follower a second (``copy_bytes_per_s``); the baseline row
  measures the same window with one placer, so ``relays_added_cpu`` (the emulators' CPU with two
  followers less theirs with none, a fraction of a core: the relays' copies and their hosts'
  links' copies) and ``relays_added_cpu_per_relay`` compare one run's two rows;
- where the seconds go: ``key_deleted_s``, ``t0`` -> etcd deleted the killed leader's election
  key (its lease expired; heard by a watch of this bench's own), and ``promotion_s``, ``t0`` ->
  each step of the new leader (its ``/healthz`` ``ha.promotion``, placer.ha.PromotionTimeline):
  ``predecessor_gone`` (its watch heard the deletion), ``elected``, ``journal_read``,
  ``model_adopted`` (its warm model's workloads handed to their jobs), ``placing`` (recovery
  over), ``first_decision``;
- invariants: ``jobs_lost`` (jobs submitted, not in the new leader's list),
  ``placements_doubled`` (workloads the emulators took after ``t0`` beyond the probe's pod),
  ``gang_running`` (the gang's pods the emulators still run), ``stops`` (stop orders the
  fleet got after ``t0``), ``refused_acks`` (placements the emulators refused: a GPU given
  twice would be one).
- baseline (``--no-baseline`` to skip): one placer (file journal), the same fleet and gang,
  killed and started again on the same state dir and ports: ``failover_s`` is ``t0`` -> the
  probe decided by the restarted process.

``--pause-agents K`` measures the other way a leader goes: paused (SIGSTOP), its connections
open and silent. Three placers on a three-member etcd, K real agents (``herd agent run``,
simulated GPUs, told every placer, reporting directly): ``promoted_s`` is the pause -> a
follower leads and places; ``agents_moved_s`` the pause -> every agent registered at the new
leader; ``leader_moves`` how many agents moved because another placer named a newer leader
(scheduler_link.leaderprobe) rather than after their report's deadline (10 s).

``--baseline-root DIR --repeat K`` compares this tree with another (its own ``.venv``, e.g. the
tree before a change): the same command runs K times in each tree as a subprocess, alternated,
and the HA row's medians and their ratios (this tree / DIR's) are printed (``ab``): each
follower's CPU, the failover, the full reports and re-registrations after the kill.

Every wait is bounded; traffic stays on 127.0.0.1; nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cli.demo_ha import LocalEtcd, free_port  # noqa: E402
from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from infra.pki import throwaway  # noqa: E402
from placer.config import PlacerConfig  # noqa: E402
from placer.errors import EtcdError  # noqa: E402
from placer.etcd import EtcdClient, prefix_end  # noqa: E402
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, proc_cpu_s, verify  # noqa: E402

TTL = 2
HEARTBEAT_S = 1.0
HEARTBEAT_LARGE_S = 5.0   # the fleet's beat from LARGE_FROM nodes (a production interval: 1 s beats to three
LARGE_FROM = 65536        # placers from 131,072 nodes are ~400k entries a second on this host's two cores)
RELAYS_FROM = 4096        # the relay path is the default from this many nodes
NODES_PER_EMULATOR = 8192
NODES_PER_RACK = 32       # (the h100 fleet shape: testing.fleet)
EMULATOR_NICE = 10        # the emulators stand for other machines: they yield the cores to the placers and etcd


def _note(msg: str, **kw: Any) -> None:
    """A progress line on stderr, named by the bench that runs (bench.restart shares these waits)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    fields = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())
    print(f"[{spec.name if spec else 'bench.failover'} {time.strftime('%H:%M:%S')}] {msg} {fields}", file=sys.stderr,
          flush=True)


class Placer:
    """One ``herd placer run`` on fixed ports (so that a restart comes back where the fleet
    looks for it); ``start()`` / ``kill()`` / ``stop()``."""

    def __init__(self, work: Path, token_dir: Path, etcd: list[str] | None, recover_s: float, *,
                 tls_dir: Path | None = None, relays: bool = False, heartbeat_s: float = HEARTBEAT_S,
                 extra_toml: str = "") -> None:
        self.work = work
        self.state = work / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        self.port, self.wire_port = free_port(), free_port()
        self.url = f"{'https' if tls_dir else 'http'}://127.0.0.1:{self.port}"
        self.wire_url = f"{'tls' if tls_dir else 'tcp'}://127.0.0.1:{self.wire_port}"
        self.conf = work / "placer.toml"
        self.conf.write_text(
            "[placer]\n"
            f'listen = "127.0.0.1:{self.port}"\nwire_listen = "127.0.0.1:{self.wire_port}"\n'
            f'state_dir = "{self.state}"\ntoken_dir = "{token_dir}"\n'
            + (f'insecure = false\ntls_dir = "{tls_dir}"\n' if tls_dir else "insecure = true\n")
            + f"heartbeat_s = {heartbeat_s}\nfence_after_s = 60.0\ntick_s = 0.05\n"
            f"relays = {'true' if relays else 'false'}\n"
            f"recover_s = {recover_s}\npush_concurrency = 256\nack_timeout_s = 10.0\n"
            + (f"etcd = {json.dumps(etcd)}\netcd_lease_ttl_s = {TTL}\n" if etcd else "") + extra_toml)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        ep = self.state / "endpoints.json"
        ep.unlink(missing_ok=True)
        with open(self.work / "placer.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "placer", "run", "--config", str(self.conf)],
                                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    async def ready(self, limit_s: float = 60.0) -> None:
        ep = self.state / "endpoints.json"
        with trio.fail_after(limit_s):
            while not ep.exists():
                assert self.proc is not None and self.proc.poll() is None, f"placer exited: see {self.work}"
                await trio.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0


class KeyDeletion:
    """When etcd deleted a key under the placers' election prefix, as this bench hears it (its
    own watch, outside the placers: how long etcd took to expire the killed leader's lease,
    apart from how long the followers took to hear it). ``await nursery.start(w.run)``."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.prefix = PlacerConfig().etcd_prefix.encode() + b"election/"
        self.at: float | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with EtcdClient(self.endpoints, attempt_timeout_s=2.0) as client:
            rev = (await client.range(self.prefix, prefix_end(self.prefix))).revision
            try:
                async with client.watch(self.prefix, prefix_end(self.prefix), start_revision=rev + 1) as batches:
                    task_status.started()
                    async for b in batches:
                        if any(e.type == "DELETE" for e in b.events):
                            self.at = time.time()
                            return
            except EtcdError as e:
                _note("etcd watch ended", err=str(e))


async def _health(c: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        r = await c.get(url + "/healthz", timeout=2)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def _leader(c: httpx.AsyncClient, placers: list[Placer], limit_s: float) -> Placer:
    with trio.fail_after(limit_s):
        while True:
            for p in placers:
                if p.proc is not None and p.proc.poll() is None:
                    h = await _health(c, p.url)
                    if h is not None and h.get("ha", {}).get("placing"):
                        return p
            await trio.sleep(0.02)


class LeaderLost(RuntimeError):
    """The placer whose model a wait reads redirects to another: it lost its etcd lease."""


async def _nodes_up(c: httpx.AsyncClient, url: str) -> int:
    try:
        r = await c.get(url + "/v1/cluster", params={"detail": "0"}, timeout=10)
    except httpx.HTTPError:
        return 0
    if r.status_code == 307:   # (a wait that would never end: said at once, in one line)
        raise LeaderLost(f"the placer at {url} no longer leads (its etcd lease ran out: see its placer.log)")
    try:
        return int(r.json()["nodes"]["up"]) if r.status_code == 200 else 0
    except (ValueError, KeyError):
        return 0


async def _wait_up(c: httpx.AsyncClient, url: str, n: int, limit_s: float) -> float:
    t0 = last = time.time()
    with trio.fail_after(limit_s):
        while (up := await _nodes_up(c, url)) < n:
            if time.time() - last >= 2.0:
                last = time.time()
                _note("nodes up", up=up, of=n, s=last - t0)
            await trio.sleep(0.05)
    return time.time()


async def _followers_warm(c: httpx.AsyncClient, followers: list[Placer], n: int, limit_s: float) -> float:
    """Seconds until every follower's model holds the ``n`` nodes (``nodes_reported`` in its
    /healthz), bounded by ``limit_s``."""
    t0 = last = time.time()
    with trio.fail_after(limit_s):
        while True:
            held = [int((await _health(c, p.url) or {}).get("nodes_reported", 0)) for p in followers]
            if min(held) >= n:
                return time.time() - t0
            if time.time() - last >= 5.0:
                last = time.time()
                _note("followers warming", held=",".join(map(str, held)), of=n, s=last - t0)
            await trio.sleep(0.1)


async def _submit(c: httpx.AsyncClient, urls: list[str], spec: dict[str, Any], limit_s: float) -> str:
    """POST the job to the placers in turn until one takes it (201): 307 -> the leader named,
    503 / no connection -> the next; the placer that took it."""
    i = 0
    target: str | None = None
    unanswered = False   # a submit went unanswered: it may have been taken (then asked again: 409)
    with trio.fail_after(limit_s):
        while True:
            url = target or urls[i % len(urls)]
            target = None
            try:
                r = await c.post(url + "/v1/jobs", json=spec, timeout=10)
            except httpx.ConnectError:
                i += 1
                await trio.sleep(0.02)
                continue
            except (httpx.TimeoutException, httpx.TransportError):   # (a placer busy taking over)
                unanswered = True
                target = url
                continue
            if r.status_code == 201 or (r.status_code == 409 and unanswered):
                return url
            if r.status_code == 307:
                target = r.json().get("leader")
                if target:
                    continue
            if r.status_code not in (307, 503):
                raise RuntimeError(f"submit answered {r.status_code}: {r.text[:200]}")
            i += 1
            await trio.sleep(0.05)


async def _job(c: httpx.AsyncClient, url: str, job_id: str, want: str, limit_s: float) -> dict[str, Any]:
    with trio.fail_after(limit_s):
        while True:
            try:
                r = await c.get(f"{url}/v1/jobs/{job_id}", params={"wait": want, "timeout_ms": "5000", "pods": "0:0"},
                                timeout=15)
            except (httpx.TimeoutException, httpx.TransportError):   # a placer busy placing a 50,000-host gang
                await trio.sleep(0.05)                                  # answers late (or resets): ask again
                continue
            if r.status_code == 200:
                j: dict[str, Any] = r.json()
                if j["state"] == want or j["state"] in ("failed", "cancelled", "succeeded"):
                    return j
            await trio.sleep(0.05)


async def _emu_stats(c: httpx.AsyncClient, emus: list[EmulatorProc], job: str) -> dict[str, Any]:
    """The emulators' /stats summed (the counters this bench reads)."""
    got = [await e.stats(c, job) for e in emus]
    acks: dict[str, int] = {}
    states: dict[str, int] = {}
    for g in got:
        for k, v in g["acks"].items():
            acks[k] = acks.get(k, 0) + v
        for k, v in g["job"]["states"].items():
            states[k] = states.get(k, 0) + v
    return {"full_reports": sum(g["full_reports"] for g in got), "placements": sum(g["placements"] for g in got),
            "parts": sum(g.get("parts", 0) for g in got), "victims_told": sum(g["victims_told"] for g in got),
            "workloads": sum(g["workloads"] for g in got),
            "acks": acks, "job": {"states": states},
            "copy_bytes": sum(g.get("relay_copies", {}).get("bytes", 0) for g in got),
            "copy_drops": sum(g.get("relay_copies", {}).get("drops", 0) for g in got),
            "handovers": sum(g.get("handovers", 0) for g in got)}


async def _steady(c: httpx.AsyncClient, placers: list[Placer], first: Placer, emus: list[EmulatorProc],
                  steady_s: float, followers: int) -> dict[str, Any]:
    """CPU (fractions of a core) of each placer and of the emulators, and the bytes the relays
    copied to each follower a second, over ``steady_s`` of steady state."""
    def cpus() -> tuple[dict[int, float], float]:
        return {p.pid(): proc_cpu_s(p.pid()) for p in placers}, sum(proc_cpu_s(e.pid) for e in emus)

    b0 = (await _emu_stats(c, emus, "gang"))["copy_bytes"]
    (p0, e0), t0 = cpus(), time.monotonic()
    await trio.sleep(steady_s)
    (p1, e1), dt = cpus(), time.monotonic() - t0
    b1 = (await _emu_stats(c, emus, "gang"))["copy_bytes"]
    return {"steady_s": round(dt, 1), "leader_cpu": round((p1[first.pid()] - p0[first.pid()]) / dt, 3),
            "follower_cpu": [round((p1[p.pid()] - p0[p.pid()]) / dt, 3) for p in placers if p is not first],
            "emu_cpu": round((e1 - e0) / dt, 3),
            "copy_bytes_per_s": round((b1 - b0) / dt / followers) if followers else None}


async def run_once(n: int, gang_hosts: int, tmp: Path, *, ha: bool, recover_s: float, relays: bool = False,
                   emulators: int = 1, steady_s: float = 10.0, heartbeat_s: float = HEARTBEAT_S,
                   tls: bool = False) -> dict[str, Any]:
    """One measured kill: three placers on etcd (``ha``), or one placer restarted cold; with
    ``tls`` every placer, relay and member speaks mutual TLS (a throwaway cluster CA)."""
    token_dir = generate_token_dir(tmp / "tokens")
    pki = throwaway(tmp / "pki").dir if tls else None
    op = {"authorization": f"Bearer {TokenSet.load(token_dir).operator}"}
    etcd = LocalEtcd(tmp / "etcd", 3) if ha else None
    placers: list[Placer] = []
    emus: list[EmulatorProc] = []
    out: dict[str, Any] = {"mode": "ha-3-placers" if ha else "single-placer-restart", "nodes": n,
                           "gang_hosts": gang_hosts, "path": "relays" if relays else "direct", "tls": tls,
                           "heartbeat_s": heartbeat_s}
    try:
        if etcd is not None:
            etcd.start()
        placers = [Placer(tmp / f"p{i}", token_dir, etcd.endpoints if etcd else None, recover_s, relays=relays,
                          tls_dir=pki, heartbeat_s=heartbeat_s)
                   for i in range(3 if ha else 1)]
        for p in placers:
            p.start()
        for p in placers:
            await p.ready()
        async with httpx.AsyncClient(headers=op, verify=verify(pki)) as c, trio.open_nursery() as watch_nursery:
            first = await _leader(c, placers, 60) if ha else placers[0]
            epoch0 = ((await _health(c, first.url)) or {}).get("ha", {}).get("epoch") if ha else None
            # the emulated fleet, told every placer (the harness's entry point, its --placer widened);
            # on the relay path the members register with the first leader's channel, as a fleet
            # that starts under one leader (the relay hosts' links find any other)
            proxy = PlacerProc(tmp / "unused", token_dir, PlacerOptions(heartbeat_s=heartbeat_s))
            proxy.url = ",".join(p.url for p in placers)
            proxy.wire_url = first.wire_url
            per = -(-n // emulators // NODES_PER_RACK) * NODES_PER_RACK   # (whole racks a process)
            for k, off in enumerate(range(0, n, per)):
                e = EmulatorProc(proxy, token_dir, nodes=min(per, n - off), offset=off, known_wire=relays,
                                 mux=8 if relays else 0, log_path=tmp / f"emu{k}.log", tls_dir=pki,
                                 extra=[*(["--relays"] if relays else []),
                                        *(["--tls-threads", str(max(8, 32 // emulators))] if tls else [])] or None,
                                 nice=EMULATOR_NICE if relays else 0)
                await e.__aenter__()
                emus.append(e)
            for e in emus:
                await e.go()
            t_reg = time.time()
            await _wait_up(c, first.url, n, 300)   # (a loaded host registers slowly: bounded all the same)
            out["register_s"] = round(time.time() - t_reg, 2)
            _note("fleet up", nodes=n, s=out["register_s"])
            if ha:   # the followers' warm models hold the fleet (the relay path: each member's full
                # report once, through its relay, after the copies began) before the gang is placed
                out["followers_warm_s"] = round(await _followers_warm(c, [p for p in placers if p is not first], n,
                                                                      300), 2)
            gang = {"job_id": "gang", "pods": gang_hosts, "gpus_per_pod": 8, "argv": ["train"], "priority": 2,
                    "preemptible": False, "grace_s": 1.0}
            await _submit(c, [first.url], gang, 30)
            g = await _job(c, first.url, "gang", "running", 120)
            assert g["state"] == "running", g
            await trio.sleep(2 * heartbeat_s)   # the running events in
            if ha:   # the first leader led through the fleet's registration and the gang, on one lease
                h = ((await _health(c, first.url)) or {}).get("ha", {})
                out["leader_kept"] = bool(h.get("placing")) and h.get("epoch") == epoch0
                # steady state: the followers' warm models still hold the fleet (their copies: placer.observe)
                await _followers_warm(c, [p for p in placers if p is not first], n, 300)
            out.update(await _steady(c, placers, first, emus, steady_s, len(placers) - 1))
            before = await _emu_stats(c, emus, "gang")
            deletion = KeyDeletion(etcd.endpoints) if etcd is not None else None
            if deletion is not None:
                await watch_nursery.start(deletion.run)
            # the kill
            t0 = time.time()
            first.kill()
            _note("leader killed", placer=first.url)
            if not ha:
                first.start()
            others = [p.url for p in placers if p is not first] or [first.url]
            probe = {"job_id": "probe", "pods": 1, "gpus_per_pod": 8, "argv": ["probe"], "grace_s": 1.0}
            took_by = await _submit(c, others, probe, 120)
            nxt = await _leader(c, placers, 60) if ha else first
            out["promoted_s"] = round(time.time() - t0, 2) if ha else None
            pj = await _job(c, nxt.url, "probe", "running", 120)
            out["failover_s"] = round(pj["timings"]["decided"] - t0, 3)
            out["full_report_s"] = round(await _wait_up(c, nxt.url, n, 120) - t0, 2)
            if ha:   # where the seconds went: etcd deleting the old leader's key, then the new leader's steps
                steps = ((await _health(c, nxt.url)) or {}).get("ha", {}).get("promotion", {})
                out["key_deleted_s"] = round(deletion.at - t0, 3) if deletion is not None and deletion.at else None
                out["promotion_s"] = {k: round(v - t0, 3) for k, v in steps.items() if k != "joined"}
            await trio.sleep(2 * heartbeat_s)
            after = await _emu_stats(c, emus, "gang")
            jobs = {j["job_id"] for j in (await c.get(nxt.url + "/v1/jobs", timeout=10)).json()["jobs"]}
            out.update({
                "submitted_to": took_by, "placed_by": nxt.url, "probe_state": pj["state"],
                "reregistrations": after["full_reports"] - before["full_reports"],
                "jobs_lost": len({"gang", "probe"} - jobs),
                # workloads the fleet took beyond the probe's one (a placement delivered twice by id,
                # through a relay and directly, is one workload)
                "placements_doubled": after["workloads"] - before["workloads"] - 1,
                "gang_running": after["job"]["states"].get("running", 0),
                "stops": after["victims_told"] - before["victims_told"],
                "refused_acks": sum(v for k, v in after["acks"].items() if k != "accepted"),
                "handovers": after["handovers"] - before["handovers"], "copy_drops": after["copy_drops"],
            })
            _note("done", mode=out["mode"], failover_s=out["failover_s"])
            watch_nursery.cancel_scope.cancel()
    finally:
        for e in emus:
            await e.__aexit__(None, None, None)
        for p in placers:
            p.stop()
        if etcd is not None:
            etcd.stop()
    return out


async def run_all(n: int, gang_hosts: int, baseline: bool, recover_s: float, workdir: str | None = None, *,
                  relays: bool = False, emulators: int = 1, steady_s: float = 10.0, heartbeat_s: float = HEARTBEAT_S,
                  tls: bool = False) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="herd-failover-") as d:
        root = Path(workdir or d)   # --workdir: the logs stay there
        for name, ha in [("ha", True), ("single", False)][:2 if baseline else 1]:
            rows.append(await run_once(n, gang_hosts, root / name, ha=ha, recover_s=recover_s, relays=relays,
                                       emulators=emulators, steady_s=steady_s, heartbeat_s=heartbeat_s, tls=tls))
    out: dict[str, Any] = {"bench": "failover", "cores": os.cpu_count(), "lease_ttl_s": TTL, "recover_s": recover_s,
                           "heartbeat_s": heartbeat_s, "tls": tls, "load_avg": round(os.getloadavg()[0], 2), "rows": rows}
    if len(rows) == 2:   # the emulators' CPU with two followers less theirs with one placer (same fleet)
        added = rows[0]["emu_cpu"] - rows[1]["emu_cpu"]
        out["relays_added_cpu"] = round(added, 3)
        if relays:
            out["relays_added_cpu_per_relay"] = round(added / max(1, n // NODES_PER_RACK), 5)
    return out


def _link(c: Any, node: str) -> dict[str, Any]:
    try:
        r = httpx.get(c.agents[node].url + "/v1/status", headers=c.read_headers(), timeout=5)
        return dict(r.json().get("link") or {})
    except (httpx.HTTPError, ValueError):
        return {}


def _all_at(c: Any, url: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not all((ln := _link(c, n)).get("placer_url") == url and ln.get("registered") for n in c.agents):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the agents did not all register at {url} within {limit_s:g}s")
        time.sleep(0.05)


def pause_once(n_agents: int, tmp: Path) -> dict[str, Any]:
    """The leader SIGSTOPped under ``n_agents`` real agents (blocking; see the module doc)."""
    from cli.demo_ha import HACluster

    token_dir = generate_token_dir(tmp / "tokens")
    etcd = LocalEtcd(tmp / "etcd", 3)
    try:
        etcd.start()
        c = HACluster(tmp / "c", token_dir, etcd.endpoints, n_placers=3, n_agents=n_agents, heartbeat_s=0.3,
                      fence_after_s=30.0, recover_s=12.0, lease_ttl_s=TTL, racks=1)
        with c:
            old = c.leader()
            _all_at(c, old.url, 60)
            old.proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            _note("leader paused", placer=old.url)
            try:
                nxt = c.leader(timeout_s=30, besides=old)
                promoted_s = time.monotonic() - t0
                _all_at(c, nxt.url, 60)
                moved_s = time.monotonic() - t0
            finally:
                old.proc.send_signal(signal.SIGCONT)
            moves = sum(int(_link(c, n).get("leader_moves", 0)) for n in c.agents)
    finally:
        etcd.stop()
    return {"mode": "leader-paused", "agents": n_agents, "promoted_s": round(promoted_s, 2),
            "agents_moved_s": round(moved_s, 2), "leader_moves": moves}


def print_table(out: dict[str, Any]) -> None:
    if out["rows"] and out["rows"][0]["mode"] == "leader-paused":
        print(f"placer leader paused (SIGSTOP) under real agents on {out['cores']} cores (lease TTL {TTL} s)")
        cols = ["mode", "agents", "promoted_s", "agents_moved_s", "leader_moves"]
        print("  ".join(f"{h:>16}" for h in cols))
        for r in out["rows"]:
            print("  ".join(f"{r.get(k)!s:>16}" for k in cols))
        return
    print(f"placer failover, emulated fleet on {out['cores']} cores (lease TTL {out['lease_ttl_s']} s, "
          f"recover_s {out['recover_s']} s, heartbeat {out['heartbeat_s']} s)")
    cols = ["mode", "path", "nodes", "gang_hosts", "leader_kept", "failover_s", "promoted_s", "full_report_s",
            "reregistrations", "jobs_lost", "placements_doubled", "gang_running", "stops", "refused_acks",
            "leader_cpu", "follower_cpu", "emu_cpu", "copy_bytes_per_s"]
    print("  ".join(f"{h:>18}" for h in cols))
    for r in out["rows"]:
        print("  ".join(f"{'-' if r.get(k) is None else r.get(k)!s:>18}" for k in cols))
    if "relays_added_cpu" in out:
        print(f"the fleet's added CPU for two followers: {out['relays_added_cpu']} of a core "
              f"(load average {out['load_avg']})")


AB_KEYS = ("follower_cpu", "failover_s", "full_report_s", "promoted_s", "reregistrations", "leader_cpu", "emu_cpu")


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def _ha_row(root: Path, args: list[str]) -> dict[str, Any]:
    """One run of ``root`` 's bench.failover (its own venv, ``--json``): its HA row, with the load."""
    py = root / ".venv" / "bin" / "python"
    p = subprocess.run([str(py if py.exists() else sys.executable), "-m", "bench.failover", *args, "--json"],
                       cwd=root, capture_output=True, text=True, timeout=3600,
                       env={**os.environ, "PYTHONPATH": str(root)})
    if p.returncode != 0:
        raise RuntimeError(f"bench.failover in {root} failed: {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    row = dict(out["rows"][0])
    if isinstance(row.get("follower_cpu"), list):   # (one figure a follower: their mean)
        row["follower_cpu"] = sum(row["follower_cpu"]) / max(1, len(row["follower_cpu"]))
    row["load_avg"] = out.get("load_avg")
    return row


def ab(base: Path, args: list[str], repeat: int) -> dict[str, Any]:
    """This tree and ``base``, ``repeat`` runs each, alternated (see the module docstring)."""
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
    for k in range(repeat):
        for side in (("base", "new") if k % 2 == 0 else ("new", "base")):
            runs[side].append(_ha_row(ROOT if side == "new" else base, args))
    med = {side: {key: _median([float(r[key]) for r in rows if isinstance(r.get(key), (int, float))])
                  for key in AB_KEYS} for side, rows in runs.items()}
    ratio = {key: (round(n / b, 3) if n is not None and b else None)
             for key in AB_KEYS for n, b in [(med["new"][key], med["base"][key])]}
    return {"bench": "failover", "ab": True, "base_root": str(base), "repeat": repeat, "args": args,
            "medians": med, "ratio_new_over_base": ratio,
            "loads": [r.get("load_avg") for side in ("base", "new") for r in runs[side]], "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--gang-hosts", type=int, default=None, help="hosts of the running gang (default: half)")
    ap.add_argument("--recover-s", type=float, default=5.0,
                    help="the placers' recover_s: a new leader waits this long for the fleet's reports before "
                         "placing (shorter than the fleet's re-registration, the recovered gang is placed again)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the single-placer cold restart")
    ap.add_argument("--workdir", default=None, help="keep the placers', etcd's and the emulator's logs here")
    ap.add_argument("--pause-agents", type=int, default=0, metavar="K",
                    help="instead: pause the leader (SIGSTOP) under K real agents and time their move")
    path = ap.add_mutually_exclusive_group()
    path.add_argument("--relays", action="store_true", default=None,
                      help=f"the fleet reports through rack relays (default from {RELAYS_FROM} nodes)")
    path.add_argument("--direct", dest="relays", action="store_false", help="every node reports directly")
    ap.add_argument("--emulators", type=int, default=None,
                    help=f"emulator processes (default: one per {NODES_PER_EMULATOR} nodes)")
    ap.add_argument("--steady-s", type=float, default=10.0, help="the steady-state window measured before the kill")
    ap.add_argument("--heartbeat", type=float, default=None,
                    help=f"the fleet's heartbeat interval (s; default {HEARTBEAT_S}, {HEARTBEAT_LARGE_S} from "
                         f"{LARGE_FROM} nodes)")
    ap.add_argument("--tls", action="store_true",
                    help="mutual TLS between every placer, relay and member (a throwaway cluster CA)")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    ap.add_argument("--baseline-root", default=None, metavar="DIR",
                    help="A/B: run the same command in DIR's tree too, alternated, and print medians and ratios")
    ap.add_argument("--repeat", type=int, default=2, help="with --baseline-root: runs of each tree")
    ns = ap.parse_args(argv)
    if ns.baseline_root:
        if not 1 <= ns.repeat <= 5:
            ap.error("--repeat must be within 1..5")
        raw = list(sys.argv[1:] if argv is None else argv)
        args = []
        skip = False
        for a in raw:   # (the same command in each tree, without the A/B options)
            if skip:
                skip = False
                continue
            if a in ("--baseline-root", "--repeat"):
                skip = True
                continue
            if a == "--json" or a.startswith(("--baseline-root=", "--repeat=")):
                continue
            args.append(a)
        res = ab(Path(ns.baseline_root).resolve(), args, ns.repeat)
        if ns.json:
            print(json.dumps(res))
        else:
            print(json.dumps({k: res[k] for k in ("medians", "ratio_new_over_base", "loads")}, indent=1))
        return 0
    if not 16 <= ns.nodes <= 131072:
        ap.error("--nodes must be within 16..131072")
    gang = ns.gang_hosts or ns.nodes // 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t = time.perf_counter()
    if ns.pause_agents:
        if not 1 <= ns.pause_agents <= 32:
            ap.error("--pause-agents must be within 1..32 (real agent processes)")
        with tempfile.TemporaryDirectory(prefix="herd-failover-") as d:
            row = pause_once(ns.pause_agents, Path(ns.workdir or d))
        out: dict[str, Any] = {"bench": "failover", "cores": os.cpu_count(), "lease_ttl_s": TTL, "rows": [row]}
    else:
        relays = ns.nodes >= RELAYS_FROM if ns.relays is None else ns.relays
        emulators = ns.emulators or max(1, -(-ns.nodes // NODES_PER_EMULATOR))
        try:
            out = trio.run(partial(run_all, ns.nodes, gang, not ns.no_baseline, ns.recover_s, ns.workdir,
                                   relays=relays, emulators=emulators, steady_s=ns.steady_s,
                                   heartbeat_s=ns.heartbeat or (HEARTBEAT_LARGE_S if ns.nodes >= LARGE_FROM
                                                                else HEARTBEAT_S), tls=ns.tls))
        except BaseExceptionGroup as eg:
            lost, rest = eg.split(LeaderLost)
            if lost is None or rest is not None:
                raise
            cause: BaseException = lost
            while isinstance(cause, BaseExceptionGroup):
                cause = cause.exceptions[0]
            print(f"bench.failover: {cause}", file=sys.stderr)
            return 1
    out["wall_s"] = round(time.perf_counter() - t, 1)
    if ns.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
