"""Scheduler-link benchmarks: end to end, fan-out, ingest.

    python -m bench.link [--json] [--jobs 100] [--fleet 1000] [--skip-e2e | --e2e-only] [--quick]
                         [--against OTHER_CHECKOUT]

- e2e: a local cluster (placer + 4 agent processes, simulated GPUs, no artifact); per job
  the time from submit to every pod's process running, measured by the placer's own
  timings (submitted -> running, one clock); p50/p99 over ``--jobs`` jobs (each cancelled
  after). Baseline: the same submit's HTTP round trip alone (``submit_rtt``). Split by
  the same timings: submitted -> pushed (``e2e_placer_part``: the decision, stamped as the
  placements are made), pushed -> acked (``e2e_agent_ack``), itself split at the job's
  journal sync, which every placement of a job waits for (``e2e_journal_wait``: pushed ->
  durable, 0 when the sync came first; ``e2e_push_to_ack``: the rest, the push and the
  agent's durable acceptance), and acked -> running (``e2e_acked_to_running``); the agents' own
  stamps of the pods, from submit: the placement applied (``e2e_pod_accepted``), the first and
  the last pod's process running (``e2e_pod_running_first``, ``e2e_pod_running_last``): the job
  runs at the later of the last pod and the acks. ``--against DIR``: the
  same-run A/B instead: a cluster of this tree and one of the checkout at DIR (run from its own
  ``.venv``; give it this bench file) up at once, one job on each in turn, which goes first
  alternating; ``e2e_base_*`` are DIR's figures and ``e2e_ratio_to_base`` this tree's p50
  over DIR's.
- fanout: one decision pushed to ``--fleet`` real HTTP endpoints (bench.fleet_helper in a
  separate process) -> the last answer. herd's PushPool and the httpx baseline run under the
  same conditions: the placer's own concurrency bound (``PlacerConfig.push_concurrency``,
  256), one cold round (every connection opened; ``*_cold_ms``) and then warm rounds on the
  kept-alive connections (medians of 5; ``fanout_1000_ms`` / ``fanout_httpx_ms``).
- ingest_core_per_s: empty heartbeats decoded and applied to the placer state (10,000
  registered nodes) per second; they move a deadline and touch no model. Baseline: decode only.
- ingest_model_*_per_s: reports that change the model (pod state events, one per heartbeat
  as agents send them; full reports listing the node's workload; exits that give GPUs back
  to the numpy model) decoded and applied; baseline: decoding the same reports.
- heartbeats_per_s: heartbeats absorbed over real sockets from a separate load process, 64
  nodes each sending one report and waiting for its answer as a real agent does, on the
  framed channel (one persistent connection per node); baseline: the same load as HTTP
  requests to the report endpoint, one kept-alive connection per node.
- part_save_*: an accepted NodePart made durable before its ``accepted`` outcome (the
  agent's part log, agent.partstore: one append and one fdatasync) by 4 writers at once in
  one state dir's filesystem, as 4 agents sharing a host's disk; baseline in the same run,
  rounds alternating: the earlier layout, one file per part written atomically (temp,
  fsync, rename, fsync of the directory). Medians and p99 of one save.
- state_append_*: a supervisor batch's delta made durable in the agent's state log
  (agent.state: written over the log's pre-allocated zeros, one fdatasync) by 4 writers at
  once; baseline in the same run, rounds alternating: the same frames appended to a growing
  file, as the log was (each fdatasync then commits the filesystem's journal).
- journal_sync_*: a job submission made durable in the placer's jobs journal (placer.journal:
  a line written over its pre-allocated zeros, one fdatasync) while 3 agents' state logs sync
  in the same filesystem; baseline in the same run, rounds alternating: the same line appended
  to a growing file and fsynced, as the journal was.
Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio

ROOT = Path(__file__).resolve().parent.parent


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ------------------------------------------------------------------ e2e

class _E2E:
    """One local cluster (placer + 4 agent processes, simulated GPUs) and its operator client:
    :meth:`job` runs one job from submit to every pod running, then cancels it and waits until
    its GPUs are free, so each job sees an idle cluster."""

    def __init__(self, tmp: Path) -> None:
        import httpx

        sys.path.insert(0, str(ROOT))
        from cli.localcluster import LocalCluster
        from infra.auth import TokenSet, generate_token_dir

        td = generate_token_dir(tmp / "tokens")
        tok = TokenSet.load(td)
        self.cluster = LocalCluster(tmp, td, n_agents=4, heartbeat_s=1.0, fence_after_s=30)
        self.cluster.__enter__()
        try:
            assert self.cluster.placer is not None
            self.cl = httpx.Client(base_url=self.cluster.placer.url, timeout=30,
                                   headers={"authorization": f"Bearer {tok.operator}"})
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                nodes = self.cl.get("/v1/nodes").json()["nodes"]
                if sum(n["state"] == "up" for n in nodes) == 4 and self.cl.get("/healthz").json()["recovering"] is False:
                    break
                time.sleep(0.1)
        except BaseException:
            self.cluster.__exit__(None, None, None)
            raise

    def close(self) -> None:
        self.cl.close()
        self.cluster.__exit__(None, None, None)

    def job(self, jid: str) -> dict[str, float]:
        """The job's timings (the placer's own clock) in ms from submit, and ``rtt`` (the
        submit's HTTP round trip); no ``running`` when it did not run within 10 s."""
        t0 = time.perf_counter()
        r = self.cl.post("/v1/jobs", json={"job_id": jid, "pods": 4, "gpus_per_pod": 2, "within": "any",
                                           "argv": ["sleep", "60"], "grace_s": 1.0})
        out = {"rtt": (time.perf_counter() - t0) * 1000}
        r.raise_for_status()
        v = self.cl.get(f"/v1/jobs/{jid}", params={"wait": "running", "timeout_ms": "10000"}).json()
        if v["state"] == "running":
            t = v["timings"]
            out.update({k: (t[k] - t["submitted"]) * 1000 for k in ("pushed", "durable", "acked", "running")
                        if k in t})
            out.update(_pod_stamps(v.get("pods") or [], t["submitted"]))
        self.cl.delete(f"/v1/jobs/{jid}")
        w_end = time.monotonic() + 10
        while time.monotonic() < w_end:
            nodes = self.cl.get("/v1/nodes").json()["nodes"]
            if sum(n["free_gpus"] for n in nodes) == 32:
                break
            time.sleep(0.01)
        return out


def _pod_stamps(pods: list[dict[str, Any]], submitted: float) -> dict[str, float]:
    """The agents' own stamps of a job's pods (each pod's state events, the host's clock, which
    the placer's shares here), ms from submit: when the first pod was accepted (the agent
    applied the placement) and when the first and the last pod were running (their shims
    answered that the workload had exec'd)."""
    out: dict[str, float] = {}
    for state, key, pick in (("accepted", "pod_accepted", min), ("running", "pod_running_first", min),
                             ("running", "pod_running_last", max)):
        at = [p["timings"][state] for p in pods if state in (p.get("timings") or {})]
        if at and len(at) == len(pods):
            out[key] = (pick(at) - submitted) * 1000
    return out


def _e2e_summary(runs: list[dict[str, float]], prefix: str = "e2e") -> dict[str, Any]:
    ran = [r for r in runs if "running" in r]
    lat = [r["running"] for r in ran]
    acked = [r for r in ran if "acked" in r]
    rtt = [r["rtt"] for r in runs]
    return {f"{prefix}_jobs": len(lat), f"{prefix}_p50_ms": pct(lat, 0.5), f"{prefix}_p99_ms": pct(lat, 0.99),
            f"{prefix}_submit_rtt_p50_ms": pct(rtt, 0.5),
            # where the time goes: the placer's part (submit -> pushed: decision, placement
            # encoded), the push and the agent's durable acceptance (pushed -> acked: the journal's
            # group commit, the HTTP push, the agent's state log append) and the processes' start
            # with the reports that say so (acked -> running; 0 when those reports came first)
            f"{prefix}_placer_part_p50_ms": pct([r["pushed"] for r in ran], 0.5),
            f"{prefix}_agent_ack_p50_ms": pct([r["acked"] - r["pushed"] for r in acked], 0.5),
            f"{prefix}_journal_wait_p50_ms": pct([max(0.0, r["durable"] - r["pushed"]) for r in acked
                                                  if "durable" in r], 0.5),
            f"{prefix}_push_to_ack_p50_ms": pct([r["acked"] - max(r["pushed"], r["durable"]) for r in acked
                                                 if "durable" in r], 0.5),
            f"{prefix}_acked_to_running_p50_ms": pct([r["running"] - r["acked"] for r in acked], 0.5),
            # the agents' side (their own stamps): the placement applied, the first and the last
            # pod's process running (the job runs at the later of the last pod and the acks)
            f"{prefix}_pod_accepted_p50_ms": pct([r["pod_accepted"] for r in ran if "pod_accepted" in r], 0.5),
            f"{prefix}_pod_running_first_p50_ms": pct([r["pod_running_first"] for r in ran
                                                       if "pod_running_first" in r], 0.5),
            f"{prefix}_pod_running_last_p50_ms": pct([r["pod_running_last"] for r in ran
                                                      if "pod_running_last" in r], 0.5),
            f"{prefix}_pod_running_last_p99_ms": pct([r["pod_running_last"] for r in ran
                                                      if "pod_running_last" in r], 0.99)}


def bench_e2e(n_jobs: int, gap_s: float = 0.0) -> dict[str, Any]:
    """Submit -> every pod running, ``n_jobs`` times; ``gap_s`` of quiet after each job's GPUs are free."""
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        e = _E2E(Path(tmp))
        try:
            t_end = time.monotonic() + 120
            for i in range(n_jobs):
                if time.monotonic() > t_end:
                    break
                runs.append(e.job(f"e2e-{i}"))
                time.sleep(gap_s)
        finally:
            e.close()
    out = _e2e_summary(runs)
    out["submit_rtt_p50_ms"] = out.pop("e2e_submit_rtt_p50_ms")
    out["e2e_ratio_to_submit_rtt"] = (out["e2e_p50_ms"] / out["submit_rtt_p50_ms"]
                                      if out["e2e_jobs"] else None)
    return out


def _e2e_serve() -> None:
    """``--e2e-serve``: a cluster of this tree; one job per line read (its id), its timings
    written back as a JSON line. The other side of :func:`bench_e2e_ab`."""
    with tempfile.TemporaryDirectory() as tmp:
        e = _E2E(Path(tmp))
        try:
            sys.stdout.write(json.dumps({"ready": True}) + "\n")
            sys.stdout.flush()
            for line in sys.stdin:
                sys.stdout.write(json.dumps(e.job(line.strip())) + "\n")
                sys.stdout.flush()
        finally:
            e.close()


def bench_e2e_ab(other: Path, n_jobs: int, gap_s: float) -> dict[str, Any]:
    """The same jobs on this tree's cluster and on ``other``'s (another checkout with its own
    ``.venv``), both up at once, one job on each in turn (which goes first alternates), so
    both see the same load; medians of each and their ratio (this tree / the other)."""
    trees = {"this": (ROOT, sys.executable), "base": (other, str(other / ".venv" / "bin" / "python"))}
    procs = {name: subprocess.Popen([py, "-m", "bench.link", "--e2e-serve"], cwd=str(root), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
             for name, (root, py) in trees.items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for p in procs.values():
            assert p.stdout is not None
            if not json.loads(p.stdout.readline() or "{}").get("ready"):
                raise RuntimeError("a cluster did not start")
        t_end = time.monotonic() + 600
        for i in range(n_jobs):
            if time.monotonic() > t_end:
                break
            for name in (("this", "base") if i % 2 == 0 else ("base", "this")):
                p = procs[name]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(f"ab-{i}\n")
                p.stdin.flush()
                runs[name].append(json.loads(p.stdout.readline()))
                time.sleep(gap_s)
    finally:
        for p in procs.values():
            assert p.stdin is not None
            p.stdin.close()
        for p in procs.values():
            p.wait(60)
    out = {**_e2e_summary(runs["this"]), **_e2e_summary(runs["base"], "e2e_base"), "e2e_base_tree": str(other)}
    out["e2e_ratio_to_base"] = out["e2e_p50_ms"] / out["e2e_base_p50_ms"] if out["e2e_base_jobs"] else None
    return out


# ------------------------------------------------------------------ part writes

def bench_part_saves(rounds: int = 60, writers: int = 4) -> dict[str, Any]:
    """One part record made durable, the part log against one file per part (module docstring)."""
    import blake3

    from agent.partstore import PartRecord, PartStore
    from infra.durable import atomic_write
    from scheduler_link.messages import NodePart, PartPod

    enc = msgspec.msgpack.Encoder()
    times: dict[str, list[float]] = {"log": [], "files": []}
    with tempfile.TemporaryDirectory() as tmp:
        stores = [PartStore(Path(tmp) / f"log{w}") for w in range(writers)]
        dirs = [Path(tmp) / f"files{w}" / "parts" for w in range(writers)]
        for d in dirs:
            d.mkdir(parents=True)

        def record(w: int, k: int) -> PartRecord:
            pid = f"start:job{k}:1:n{w}:1"
            return PartRecord(part=NodePart(placement_id=pid, node_id=f"n{w}", job_id=f"job{k}", attempt=1,
                                            blob_id="b" * 64, pods=[PartPod(workload_id=f"job{k}.1.{w}", rank=w,
                                                                            gpu_indices=[0, 1])]),
                              accepted_at=time.time())

        def one(mode: str, w: int, k: int, out: list[float]) -> None:
            r = record(w, k)
            t0 = time.perf_counter()
            if mode == "log":
                stores[w].save([r])
            else:
                atomic_write(dirs[w] / (blake3.blake3(r.part.placement_id.encode()).hexdigest(length=16) + ".part"),
                             enc.encode(r))
            out.append(time.perf_counter() - t0)

        _alternate(("log", "files"), rounds, writers, one, times)
        for st in stores:
            st.close()
    return _against("part_save", "file_per_part", "part_saves", times["log"], times["files"])


def _against(name: str, other: str, count: str, new_s: list[float], other_s: list[float]) -> dict[str, Any]:
    """One alternated comparison's rows (seconds in): ``{name}`` p50/p99 ms, ``{name}_{other}``
    p50/p99 ms, their p50 ratio and how many were timed."""
    a, b = [x * 1000 for x in new_s], [x * 1000 for x in other_s]
    return {f"{name}_p50_ms": pct(a, 0.5), f"{name}_p99_ms": pct(a, 0.99),
            f"{name}_{other}_p50_ms": pct(b, 0.5), f"{name}_{other}_p99_ms": pct(b, 0.99),
            f"{name}_ratio_to_{other}": pct(a, 0.5) / pct(b, 0.5), count: len(a)}


def _alternate(modes: tuple[str, str], rounds: int, writers: int,
               one: Callable[[str, int, int, list[float]], None], times: dict[str, list[float]]) -> None:
    """``rounds`` rounds (at most 60 s) of ``writers`` threads calling ``one(mode, writer,
    round, out)`` for each of the two modes, their order alternating round by round; each
    mode's times added to ``times[mode]``."""
    t_end = time.monotonic() + 60
    for k in range(rounds):
        if time.monotonic() > t_end:
            break
        for mode in (modes if k % 2 == 0 else modes[::-1]):
            got: list[float] = []
            ts = [threading.Thread(target=one, args=(mode, w, k, got)) for w in range(writers)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            times[mode] += got


def bench_state_appends(rounds: int = 60, writers: int = 4) -> dict[str, Any]:
    """One supervisor batch made durable in the agent's state log (agent.state: a delta written
    over the log's pre-allocated zeros, one fdatasync) by 4 writers at once in one
    filesystem, as 4 agents sharing a host's disk; baseline in the same run, rounds
    alternating: the same frames appended to a file that grows (the earlier layout: each
    fdatasync commits the filesystem's journal for the new size). Medians and p99 of one write."""
    from agent.state import KIND_DELTA, AgentState, StateDelta, StateFile, WorkloadRecord, frame
    from infra.durable import write_all

    times: dict[str, list[float]] = {"prealloc": [], "append": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = [StateFile(Path(tmp) / f"s{w}") for w in range(writers)]
        grow: list[int] = []
        for w, f in enumerate(files):
            f.dir.mkdir()
            f.save(AgentState(node_id=f"n{w}"))
            grow.append(os.open(Path(tmp) / f"grow{w}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))

        def delta(w: int, k: int) -> StateDelta:
            return StateDelta(seq=k + 1, records=[WorkloadRecord(workload_id=f"job{k}.1.{w}", job_id=f"job{k}",
                                                                 argv=["sleep", "60"], env={"PATH": "/usr/bin:/bin"},
                                                                 gpus=[f"GPU-{w}-0", f"GPU-{w}-1"])])

        def one(mode: str, w: int, k: int, out: list[float]) -> None:
            d = delta(w, k)
            t0 = time.perf_counter()
            if mode == "prealloc":
                files[w].append([d])
            else:
                write_all(grow[w], frame(KIND_DELTA, msgspec.json.encode(d)))
                os.fdatasync(grow[w])
            out.append(time.perf_counter() - t0)

        _alternate(("prealloc", "append"), rounds, writers, one, times)
        for f in files:
            f.close()
        for fd in grow:
            os.close(fd)
    pre = [x * 1000 for x in times["prealloc"]]
    app = [x * 1000 for x in times["append"]]
    return {"state_append_p50_ms": pct(pre, 0.5), "state_append_p99_ms": pct(pre, 0.99),
            "state_append_growing_p50_ms": pct(app, 0.5), "state_append_growing_p99_ms": pct(app, 0.99),
            "state_append_ratio_to_growing": pct(pre, 0.5) / pct(app, 0.5), "state_appends": len(pre)}


def bench_journal_syncs(rounds: int = 60) -> dict[str, Any]:
    """One job submission made durable in the placer's jobs journal (placer.journal: a line
    written over the journal's pre-allocated zeros, one fdatasync), with 3 agents' state logs
    syncing in the same filesystem at once; baseline in the same run, rounds alternating: the
    same line appended to a file that grows and fsynced (the earlier layout: each sync commits
    the filesystem's journal). Medians and p99 of the journal's write."""
    from agent.state import AgentState, StateDelta, StateFile, WorkloadRecord
    from infra.durable import write_all
    from placer.journal import Journal, Record
    from scheduler_link.messages import JobSpec

    times: dict[str, list[float]] = {"prealloc": [], "growing": []}
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal.open(Path(tmp) / "placer")
        grow = os.open(Path(tmp) / "grow.journal", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        agents = [StateFile(Path(tmp) / f"a{w}") for w in range(3)]
        for w, f in enumerate(agents):
            f.dir.mkdir()
            f.save(AgentState(node_id=f"n{w}"))

        def spec(k: int) -> JobSpec:
            return JobSpec(job_id=f"job{k}", pods=4, gpus_per_pod=2, argv=["sleep", "60"], grace_s=1.0)

        def one(mode: str, w: int, k: int, out: list[float]) -> None:
            if w:   # the agents' writes alongside
                agents[w - 1].append([StateDelta(seq=k + 1, records=[WorkloadRecord(workload_id=f"job{k}.1.{w}",
                                                                                     job_id=f"job{k}")])])
                return
            t0 = time.perf_counter()
            if mode == "prealloc":
                journal.submitted(spec(k), time.time())
            else:
                write_all(grow, msgspec.json.encode(Record(op="submit", at=time.time(), spec=spec(k))) + b"\n")
                os.fsync(grow)
            out.append(time.perf_counter() - t0)

        _alternate(("prealloc", "growing"), rounds, 4, one, times)
        journal.close()
        os.close(grow)
        for f in agents:
            f.close()
    return _against("journal_sync", "growing", "journal_syncs", times["prealloc"], times["growing"])


# ------------------------------------------------------------------ fan-out

async def bench_fanout(n: int, rounds: int = 5, limit_s: float = 120.0) -> dict[str, Any]:
    """One decision pushed to ``n`` endpoints, herd's PushPool against httpx under the same
    conditions: the placer's own concurrency (``PlacerConfig.push_concurrency``) for both, a
    cold round (every connection opened) and then ``rounds`` warm rounds on the kept-alive
    connections for both; medians of the warm rounds are compared, the cold rounds shown."""
    import httpx

    from placer.config import PlacerConfig
    from scheduler_link.fanout import PushPool
    from scheduler_link.messages import Placement, PodAssignment

    conc = PlacerConfig().push_concurrency
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "bench.fleet_helper", "--n", str(n), "--seconds", str(int(limit_s * 3))],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=str(ROOT))
    try:
        buf = b""
        assert proc.stdout is not None
        with trio.fail_after(60):
            while b"\n" not in buf:
                chunk = await proc.stdout.receive_some(1 << 20)
                if not chunk:
                    raise RuntimeError("fleet helper died")
                buf += chunk
        urls = json.loads(buf.split(b"\n", 1)[0])["urls"]

        def items(tag: str) -> list[tuple[str, str, str, bytes]]:
            return [(f"n{i}", u, "/v1/placements", msgspec.json.encode(Placement(
                placement_id=f"{tag}:{i}", job_id=tag, world_size=n, argv=["train"],
                pods=[PodAssignment(workload_id=f"{tag}.1.{i}", rank=i, gpus=[f"GPU-{i}-{g}" for g in range(8)])])))
                for i, u in enumerate(urls)]

        pool = PushPool(concurrency=conc, attempt_timeout_s=10, retries=1)
        herd_s: list[float] = []
        for k in range(rounds + 1):   # round 0 is cold: it opens every connection
            its = items(f"r{k}")
            t0 = time.perf_counter()
            res = await pool.post_many(its)
            herd_s.append(time.perf_counter() - t0)
            assert all(r.ok for r in res.values()), [r.error for r in res.values() if not r.ok][:3]
        await pool.aclose()

        # baseline: the same pushes through one httpx client, the same concurrency bound, the
        # same cold round then warm rounds on kept-alive connections (bounded by ``limit_s``)
        hx_s: list[float] = []
        hx_errors = 0
        limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
        async with httpx.AsyncClient(limits=limits, timeout=30) as c:
            lim = trio.CapacityLimiter(conc)

            async def hx_post(url: str, body: bytes) -> None:
                nonlocal hx_errors
                async with lim:
                    try:
                        (await c.post(url, content=body)).raise_for_status()
                    except httpx.HTTPError:
                        hx_errors += 1

            t_end = time.monotonic() + limit_s
            for k in range(rounds + 1):
                if k >= 2 and time.monotonic() > t_end:
                    break
                its = items(f"hx{k}")
                t0 = time.perf_counter()
                async with trio.open_nursery() as nur:
                    for _, u, path, body in its:
                        nur.start_soon(hx_post, u + path, body)
                hx_s.append(time.perf_counter() - t0)
        warm, hx_warm = statistics.median(herd_s[1:]), statistics.median(hx_s[1:])
        return {"fanout_1000_ms": warm * 1000, "fanout_cold_ms": herd_s[0] * 1000,
                "fanout_endpoints": n, "fanout_concurrency": conc, "fanout_warm_rounds": len(herd_s) - 1,
                "fanout_httpx_ms": hx_warm * 1000, "fanout_httpx_cold_ms": hx_s[0] * 1000,
                "fanout_httpx_warm_rounds": len(hx_s) - 1,
                "fanout_ratio_vs_httpx": warm / hx_warm, "fanout_cold_ratio_vs_httpx": herd_s[0] / hx_s[0],
                "fanout_httpx_errors": hx_errors}
    finally:
        assert proc.stdin is not None
        await proc.stdin.aclose()
        with trio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()


# ------------------------------------------------------------------ ingest core

def _fleet_reports(n_nodes: int, start: int = 0) -> list[Any]:
    from scheduler_link.messages import GpuInfo, GpuSnapshot, NodeReport, TopologyPath
    out = []
    for i in range(start, start + n_nodes):
        snap = GpuSnapshot(simulated=True, gpus=[GpuInfo(index=g, uuid=f"GPU-{i}-{g}", name="sim", memory_total_mib=1,
                                                         pci_bus_id=f"0:{g}", simulated=True) for g in range(8)])
        out.append(NodeReport(node_id=f"n{i:06d}", boot_id=f"b{i}", seq=1, full=True, control_url="http://127.0.0.1:9",
                              topology=TopologyPath(zone="z", block=f"b{i // 512}", rack=f"r{i // 32}"),
                              snapshot=snap))
    return out


def bench_ingest_core(n_nodes: int = 10_000, seconds: float = 2.0, max_reports: int = 400_000) -> dict[str, Any]:
    from placer.config import PlacerConfig
    from placer.state import PlacerState
    from scheduler_link.messages import NodeReport, WorkloadEvent

    st = PlacerState(PlacerConfig(), started_at=0.0)
    fulls = _fleet_reports(n_nodes)
    t0 = time.perf_counter()
    for rep in fulls:
        st.ingest(rep.node_id, rep, 1.0)
    assert st.model.n_nodes == n_nodes  # the deferred model rebuild, once
    register_rate = n_nodes / (time.perf_counter() - t0)
    ev = [WorkloadEvent(workload_id="x.1.0", job_id="x", state="running", at=1.0)]
    # pre-encoded heartbeats (1 in 4 carries an event of an unknown job)
    blobs = [msgspec.json.encode(NodeReport(node_id=f"n{i % n_nodes:06d}", boot_id=f"b{i % n_nodes}",
                                            seq=2 + i // n_nodes, full=False, events=ev if i % 4 == 0 else []))
             for i in range(min(max_reports, 200_000))]
    dec = msgspec.json.Decoder(NodeReport)
    # baseline: decode only
    t0 = time.perf_counter()
    k = 0
    for b in blobs:
        dec.decode(b)
        k += 1
        if k % 4096 == 0 and time.perf_counter() - t0 > seconds:
            break
    base = k / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    k = ok = 0
    for b in blobs:
        r = dec.decode(b)
        status, _, _ = st.ingest(r.node_id, r, 2.0)
        ok += status == 200
        k += 1
        if k % 4096 == 0 and time.perf_counter() - t0 > seconds:
            break
    rate = k / (time.perf_counter() - t0)
    return {"ingest_core_per_s": rate, "register_core_per_s": register_rate, "ingest_decode_only_per_s": base, "ingest_ratio_vs_decode": rate / base,
            "ingest_ok_fraction": ok / max(1, k)}


def _event(w: tuple[str, str, str, str, list[str]], state: str, at: float) -> Any:
    """The event an agent sends for pod ``w`` (node, workload, job, placement, GPUs)."""
    from scheduler_link.messages import WorkloadEvent
    return WorkloadEvent(workload_id=w[1], job_id=w[2], state=state, at=at,  # type: ignore[arg-type]  # the state is drawn from WorkloadState's members
                         gpus=w[4], placement_id=w[3], exit_code=0 if state == "exited" else None)


def bench_ingest_model(n_nodes: int = 2048, seconds: float = 2.0, max_rounds: int = 20) -> dict[str, Any]:
    """Reports that change the model, decoded and applied, against decoding them alone.

    Rounds over a registered fleet (8 GPUs a node): jobs of 8 pods x 8 GPUs fill it (placed
    and acked, untimed), then every pod's ``fetching`` and ``running`` events arrive, one
    heartbeat each as an agent sends them (pod state, job counters); then every node's full
    report listing its running workload (the re-registration path: model row, GPU owners,
    the node's pods); then every pod's ``exited`` event (the job ends, its GPUs go back to the
    numpy model). Every report is pre-encoded; the timed loops decode and ingest. The round
    checks the model: full after placing, empty after the exits."""
    from placer.config import PlacerConfig
    from placer.state import ACCEPTED, PlacerState
    from scheduler_link.messages import JobSpec, NodeReport, WorkloadEvent, WorkloadStatus

    st = PlacerState(PlacerConfig(), started_at=0.0)
    fulls = {r.node_id: r for r in _fleet_reports(n_nodes)}
    for rep in fulls.values():
        st.ingest(rep.node_id, rep, 1.0)
    seq = dict.fromkeys(fulls, 1)
    dec = msgspec.json.Decoder(NodeReport)
    enc = msgspec.json.Encoder()
    timed = {"events": [0.0, 0.0, 0], "full": [0.0, 0.0, 0], "exits": [0.0, 0.0, 0]}  # apply s, decode s, count
    now = 2.0
    rounds = 0
    t_all = time.perf_counter()
    while rounds < max_rounds and (rounds == 0 or time.perf_counter() - t_all < seconds * 3):
        for j in range(n_nodes // 8):
            st.submit(JobSpec(job_id=f"m{rounds}-{j}", pods=8, gpus_per_pod=8, argv=["x"], within="any"), now)
        placed: list[tuple[str, str, str, str, list[str]]] = []   # node, workload, job, placement, gpus
        for job, pushes in st.schedule(now):
            st.on_acks(job.job_id, job.attempt, {p.node_id: ACCEPTED for p in pushes}, now, pushes)
            for p in pushes:
                pl = p.placement
                placed += [(p.node_id, pod.workload_id, job.job_id, pl.placement_id, pod.gpus) for pod in pl.pods]
        assert len(placed) == n_nodes and int(st.model.free.sum()) == 0, "the fleet did not fill"

        def beat(node: str, events: list[WorkloadEvent]) -> bytes:
            seq[node] += 1
            rep = fulls[node]
            return enc.encode(NodeReport(node_id=node, boot_id=rep.boot_id, seq=seq[node], full=False, events=events))

        events = [beat(w[0], [_event(w, s, now)]) for s in ("fetching", "running") for w in placed]
        full = []
        for w in placed:
            seq[w[0]] += 1
            rep = fulls[w[0]]
            full.append(enc.encode(msgspec.structs.replace(rep, seq=seq[w[0]], workloads=[WorkloadStatus(
                workload_id=w[1], job_id=w[2], placement_id=w[3], gpus=w[4], state="running")])))
        exits = [beat(w[0], [_event(w, "exited", now)]) for w in placed]
        for name, blobs in (("events", events), ("full", full), ("exits", exits)):
            t0 = time.perf_counter()
            for b in blobs:
                dec.decode(b)
            t1 = time.perf_counter()
            for b in blobs:
                r = dec.decode(b)
                status, _, _ = st.ingest(r.node_id, r, now)
                assert status == 200, status
            t2 = time.perf_counter()
            timed[name][0] += t2 - t1
            timed[name][1] += t1 - t0
            timed[name][2] += len(blobs)
            if name == "full":
                assert all(st.jobs[f"m{rounds}-{j}"].counts["running"] == 8 for j in range(n_nodes // 8))
        assert int(st.model.free.sum()) == 8 * n_nodes, "the exits did not free the fleet"
        now += 1.0
        rounds += 1
    out: dict[str, Any] = {"ingest_model_nodes": n_nodes, "ingest_model_rounds": rounds}
    for name, (apply_s, decode_s, k) in timed.items():
        out[f"ingest_model_{name}_per_s"] = k / apply_s
        out[f"ingest_model_{name}_decode_only_per_s"] = k / decode_s
    return out


# ------------------------------------------------------------------ heartbeats over sockets

class _Start:
    """Every load connection registers, then all start together for the same ``seconds``."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds
        self.registered = 0
        self.stop_at = 0.0
        self.go = trio.Event()

    async def ready(self) -> None:
        self.registered += 1
        if self.registered == self.n:
            self.stop_at = trio.current_time() + self.seconds
            self.go.set()
        await self.go.wait()


async def _load_main(mode: str, url: str, token: str, n_conn: int, seconds: float, start_node: int) -> None:
    """The separate load process: registers ``n_conn`` nodes, then each heartbeats as a real
    agent does, one report at a time waiting for its answer (framed: one report per frame on
    the node's own connection; HTTP: one request on a kept-alive connection), for
    ``seconds``; prints the count."""
    from scheduler_link.heartbeat_wire import HeartbeatClient
    from scheduler_link.messages import NodeReport

    reps = _fleet_reports(n_conn, start_node)
    counts = [0] * n_conn
    start = _Start(n_conn, seconds)

    async def wire_one(i: int) -> None:
        rep = reps[i]
        c = await HeartbeatClient.connect(url, token, rep.node_id)
        await c.send([rep])
        await c.receive(1)
        await start.ready()
        seq = rep.seq
        while trio.current_time() < start.stop_at:
            seq += 1
            await c.send([NodeReport(node_id=rep.node_id, boot_id=rep.boot_id, seq=seq, full=False)])
            got = await c.receive(1)
            counts[i] += got[0].status == 200
        await c.aclose()

    async def http_one(i: int) -> None:
        import httpx
        rep = reps[i]
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=30) as c:
            await c.post(f"/v1/nodes/{rep.node_id}/report", content=msgspec.json.encode(rep))
            await start.ready()
            seq = rep.seq
            while trio.current_time() < start.stop_at:
                seq += 1
                r = await c.post(f"/v1/nodes/{rep.node_id}/report", content=msgspec.json.encode(
                    NodeReport(node_id=rep.node_id, boot_id=rep.boot_id, seq=seq, full=False)))
                counts[i] += r.status_code == 200

    async with trio.open_nursery() as n:
        for i in range(n_conn):
            n.start_soon(wire_one if mode == "wire" else http_one, i)
        await start.go.wait()
        t0 = time.perf_counter()
    sys.stdout.write(json.dumps({"count": sum(counts), "seconds": time.perf_counter() - t0}) + "\n")


async def bench_heartbeats(seconds: float = 3.0, n_conn: int = 64) -> dict[str, Any]:
    from infra.auth import TokenSet, generate_token_dir
    from placer.config import PlacerConfig
    from placer.service import PlacerService

    with tempfile.TemporaryDirectory() as tmp:
        td = generate_token_dir(Path(tmp) / "tokens")
        tokens = TokenSet.load(td)
        # plain TCP and tokens (insecure = true): this row measures the channel, not TLS (bench.tls_handshake)
        cfg = PlacerConfig(listen="127.0.0.1:0", wire_listen="127.0.0.1:0", state_dir=str(Path(tmp) / "p"),
                           heartbeat_s=60.0, tick_s=1.0, insecure=True)
        svc = PlacerService(cfg, tokens)
        out: dict[str, Any] = {}
        async with trio.open_nursery() as n:
            await n.start(svc.run)
            for mode, url, start in (("wire", svc.wire_url, 0), ("http", svc.url, 10_000)):
                with trio.fail_after(seconds + 60):
                    r = await trio.run_process(
                        [sys.executable, "-m", "bench.link", "--load", mode, "--url", str(url),
                         "--token", str(tokens.cluster), "--conns", str(n_conn), "--seconds", str(seconds),
                         "--start-node", str(start)], capture_stdout=True, cwd=str(ROOT))
                res = json.loads(r.stdout.decode().strip().splitlines()[-1])
                out[mode] = res["count"] / res["seconds"]
            n.cancel_scope.cancel()
    return {"heartbeats_per_s": out["wire"], "heartbeats_http_per_s": out["http"],
            "heartbeats_ratio_vs_http": out["wire"] / out["http"], "heartbeat_connections": n_conn}


# ------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.link")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--fleet", type=int, default=1000)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--e2e-only", action="store_true", help="only the small-gang end to end rows")
    ap.add_argument("--parts-only", action="store_true", help="only the part-save and state-log rows")
    ap.add_argument("--against", type=Path, help="e2e against another checkout (with its .venv), job for job")
    ap.add_argument("--e2e-serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small sizes (make bench-quick); pass --jobs/--fleet too")
    ap.add_argument("--load", choices=["wire", "http"], help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=3.0, help=argparse.SUPPRESS)
    ap.add_argument("--start-node", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.load:
        trio.run(_load_main, a.load, a.url, a.token, a.conns, a.seconds, a.start_node)
        return
    if a.e2e_serve:
        import logging
        logging.disable(logging.WARNING)
        _e2e_serve()
        return
    import logging
    logging.disable(logging.WARNING)
    q = a.quick
    res: dict[str, Any] = {}
    if a.parts_only:
        res.update(bench_part_saves(rounds=10 if q else 60))
        res.update(bench_state_appends(rounds=10 if q else 60))
        res.update(bench_journal_syncs(rounds=10 if q else 60))
        print(json.dumps(res) if a.json else "\n".join(f"{k:32s} {v}" for k, v in res.items()))
        return
    if not a.e2e_only:
        res.update(bench_part_saves(rounds=10 if q else 60))
        res.update(bench_state_appends(rounds=10 if q else 60))
        res.update(bench_journal_syncs(rounds=10 if q else 60))
        res.update(bench_ingest_core(n_nodes=1000 if q else 10_000, seconds=0.5 if q else 2.0))
        res.update(bench_ingest_model(n_nodes=256 if q else 2048, seconds=0.5 if q else 2.0,
                                      max_rounds=2 if q else 20))
        res.update(trio.run(partial(bench_heartbeats, seconds=1.0 if q else 3.0)))
        res.update(trio.run(partial(bench_fanout, a.fleet, rounds=2 if q else 5, limit_s=20 if q else 120)))
    if a.against is not None:
        # same-run A/B: back to back and with 300 ms of quiet between jobs
        res.update(bench_e2e_ab(a.against.resolve(), a.jobs, 0.0))
        idle = bench_e2e_ab(a.against.resolve(), max(2 if q else 10, a.jobs // 2), 0.3)
        res.update({"e2e_idle_gap_p50_ms": idle["e2e_p50_ms"], "e2e_idle_gap_p99_ms": idle["e2e_p99_ms"],
                    "e2e_base_idle_gap_p50_ms": idle["e2e_base_p50_ms"],
                    "e2e_idle_gap_ratio_to_base": idle["e2e_ratio_to_base"]})
    elif not a.skip_e2e:
        res.update(bench_e2e(a.jobs))
        # the same with 300 ms of quiet between jobs: back to back, each job lands while the
        # previous one's teardown (exit files, state writes, reports) still runs on 2 cores
        idle = bench_e2e(max(2 if q else 10, a.jobs // 2), gap_s=0.3)
        res.update({"e2e_idle_gap_p50_ms": idle["e2e_p50_ms"], "e2e_idle_gap_p99_ms": idle["e2e_p99_ms"]})
    res["targets"] = {"e2e_p50_ms": 15, "e2e_p99_ms": 30, "fanout_1000_ms": 500, "ingest_core_per_s": 100_000,
                      "heartbeats_per_s": 10_000}
    if a.json:
        print(json.dumps(res))
        return
    for k, v in res.items():
        if k != "targets":
            print(f"{k:32s} {v:12.2f}" if isinstance(v, float) else f"{k:32s} {v}")


if __name__ == "__main__":
    main()
