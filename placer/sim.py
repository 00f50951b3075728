"""Cluster simulator: synthetic fleets, a job stream, and a replay through the real placer.

Fleets (always whole racks; zones of about 262,144 GPUs):

- ``h100``: HGX nodes of 8 GPUs (NVLink domain = the node), 32 nodes per rack,
  16 racks per block, 64 blocks per zone (262,144 GPUs).
- ``gb200``: NVL72 racks of 18 trays x 4 GPUs (NVLink domain = the rack), 16 racks per
  block, 228 blocks per zone (262,656 GPUs).

The job stream draws sizes from 1 GPU to 200,000 GPUs (most small, a few huge), with
mixed priorities, Poisson arrivals and exponential durations; everything comes from one
seeded ``numpy.random.Generator``, so a seed gives the same stream and the same replay.

``replay`` is a discrete-event simulation over virtual time (no sleeping): arrivals go to
a :class:`~placer.queue.JobQueue`, completions release GPUs, and the queue is scheduled
after every batch of simultaneous events. Preempted jobs go back to the queue with the
time they had left. It reports utilisation (over the whole replay, and in the steady
state between the first fifth of the arrivals and the last one), queueing delay,
fragmentation and decision latencies (the only wall-clock figure: how long each
``place`` call took).

``python -m placer.sim --help``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidSpec
from .frag import fragmentation
from .model import ClusterModel, NodeSpec
from .place import Decision, JobRequest, place
from .queue import JobQueue


@dataclass(frozen=True, slots=True)
class FleetShape:
    name: str
    gpus_per_node: int
    nodes_per_rack: int
    racks_per_block: int
    blocks_per_zone: int
    nvlink_rack: bool          # NVLink domain = rack (NVL72) or node (HGX)

    @property
    def rack_gpus(self) -> int:
        return self.gpus_per_node * self.nodes_per_rack

    @property
    def block_gpus(self) -> int:
        return self.rack_gpus * self.racks_per_block

    @property
    def zone_gpus(self) -> int:
        return self.block_gpus * self.blocks_per_zone


FLEETS: dict[str, FleetShape] = {
    "h100": FleetShape("h100", 8, 32, 16, 64, False),
    "gb200": FleetShape("gb200", 4, 18, 16, 228, True),
}


def fleet_shape(name: str) -> FleetShape:
    try:
        return FLEETS[name]
    except KeyError:
        raise InvalidSpec(f"unknown fleet {name!r}; expected one of {', '.join(FLEETS)}") from None


def build_fleet(name: str, gpus: int) -> list[NodeSpec]:
    """Node specs for at least ``gpus`` GPUs of fleet ``name`` (rounded up to whole racks)."""
    fs = fleet_shape(name)
    if gpus < 1:
        raise InvalidSpec("a fleet needs at least one GPU")
    racks = -(-gpus // fs.rack_gpus)
    racks_per_zone = fs.racks_per_block * fs.blocks_per_zone
    out: list[NodeSpec] = []
    p = name[0]
    for r in range(racks):
        z, rem = divmod(r, racks_per_zone)
        b, rr = divmod(rem, fs.racks_per_block)
        zone, block, rack = f"{p}z{z:02d}", f"b{b:03d}", f"r{rr:02d}"
        nvl = f"{zone}-{block}-{rack}-nvl" if fs.nvlink_rack else None
        for n in range(fs.nodes_per_rack):
            out.append(NodeSpec(f"{zone}-{block}-{rack}-n{n:02d}", zone, block, rack, fs.gpus_per_node, nvl))
    return out


# ---------------------------------------------------------------------- job stream

_SIZES = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                   65536, 131072, 200_000])
_WEIGHTS = np.array([10, 6, 8, 20, 8, 7, 8, 6, 6, 5, 4, 3, 3, 2, 1.5, 1, 0.4, 0.2, 0.1])


@dataclass(frozen=True, slots=True)
class SimJob:
    request: JobRequest
    arrival: float
    duration: float


def shape_job(fs: FleetShape, job_id: str, size: int, priority: int = 0, preemptible: bool = True) -> JobRequest:
    """A gang of ``size`` GPUs on fleet ``fs``: one pod on one node when it fits a node,
    else whole-node pods, kept within the smallest level that holds it."""
    g = fs.gpus_per_node
    if size <= g:
        return JobRequest(job_id, 1, size, "node", priority, preemptible)
    pods = -(-size // g)
    gpus = pods * g
    if fs.nvlink_rack and gpus <= fs.rack_gpus:
        within = "nvlink"
    elif gpus <= fs.rack_gpus:
        within = "rack"
    elif gpus <= fs.block_gpus:
        within = "block"
    elif gpus <= fs.zone_gpus:
        within = "zone"
    else:
        within = "any"
    return JobRequest(job_id, pods, g, within, priority, preemptible)


def job_stream(fleet: str, n_jobs: int, *, seed: int, fleet_gpus: int, max_gpus: int = 200_000,
               mean_interarrival_s: float | None = None, mean_duration_s: float = 3600.0,
               size_scale: float = 1.0, load: float = 0.9) -> list[SimJob]:
    """``n_jobs`` jobs, deterministic for a seed. Sizes above ``min(max_gpus, fleet_gpus/2)``
    are not drawn; ``size_scale`` tilts the draw toward bigger jobs (>1) or smaller (<1).
    Without ``mean_interarrival_s`` arrivals are spaced so the offered load is ``load``
    times the fleet (GPU-seconds asked per second over GPUs)."""
    fs = fleet_shape(fleet)
    rng = np.random.default_rng(seed)
    cap = min(max_gpus, max(fleet_gpus // 2, 1))
    ok = _SIZES <= cap
    sizes, w = _SIZES[ok], _WEIGHTS[ok] * np.power(np.arange(ok.sum()) + 1.0, np.log2(size_scale))
    w = w / w.sum()
    if mean_interarrival_s is None:
        mean_size = float((sizes * w).sum())
        mean_interarrival_s = mean_size * (mean_duration_s + 60.0) / (load * fleet_gpus)
    drawn = rng.choice(sizes, size=n_jobs, p=w)
    prios = rng.choice([0, 1, 2], size=n_jobs, p=[0.6, 0.3, 0.1])
    gaps = rng.exponential(mean_interarrival_s, size=n_jobs)
    durs = np.minimum(rng.exponential(mean_duration_s, size=n_jobs) + 60.0, 20 * mean_duration_s)
    t = np.cumsum(gaps)
    out = []
    for i in range(n_jobs):
        pr = int(prios[i])
        req = shape_job(fs, f"s{seed}-{i:06d}", int(drawn[i]), pr, preemptible=pr < 2)
        out.append(SimJob(req, float(t[i]), float(durs[i])))
    return out


def fill(model: ClusterModel, fleet: str, target: float, *, seed: int, max_jobs: int = 200_000,
         priority: int | None = 0) -> int:
    """Place jobs of the stream (no preemption) until ``target`` of usable GPUs are allocated.
    ``priority`` overrides the drawn priority (None keeps it). Returns jobs placed."""
    usable = int(model.usable.sum())
    goal = int(target * usable)
    allocated = usable - int(model.free.sum())
    placed = 0
    batch = 512
    i = 0
    while allocated < goal and i < max_jobs:
        for sj in job_stream(fleet, batch, seed=seed * 7919 + i, fleet_gpus=usable, size_scale=1.0):
            r = sj.request
            if priority is not None:
                r = JobRequest(f"fill-{seed}-{i}-{r.job_id}", r.pods, r.gpus_per_pod, r.within, priority,
                               True, r.prefer, r.whole_nodes)
            if r.pods * r.gpus_per_pod > goal - allocated + r.gpus_per_pod:
                continue
            d = place(model, r, allow_preemption=False)
            if d is not None:
                model.allocate(d)
                allocated += d.n_gpus
                placed += 1
            if allocated >= goal:
                break
        i += batch
    return placed


def saturate(model: ClusterModel, *, priority: int = 0, prefix: str = "filler") -> int:
    """Give every free usable GPU to a low-priority preemptible one-node job (one per node):
    the state in which any new job needs preemption. Returns the jobs made."""
    nodes = np.flatnonzero(model.free > 0)
    avail = (model.owner[nodes] == -1) & model.usable[nodes]
    rows, cols = np.nonzero(avail)
    bounds = np.searchsorted(rows, np.arange(nodes.size + 1))
    for k, n in enumerate(nodes.tolist()):
        a, b = bounds[k], bounds[k + 1]
        model.assign_arrays(f"{prefix}-{n}", np.full(b - a, n), cols[a:b], priority, True)
    return int(nodes.size)


# ---------------------------------------------------------------------- replay

def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def replay(model: ClusterModel, jobs: list[SimJob], *, queue: JobQueue | None = None,
           frag_every: int = 200, max_events: int = 1_000_000) -> dict[str, Any]:
    """Replay ``jobs`` through a queue and the placer in virtual time; return a report."""
    latencies: list[float] = []

    def timed_place(m: ClusterModel, job: JobRequest, **kw: Any) -> Decision | None:
        t0 = time.perf_counter()
        d = place(m, job, **kw)
        latencies.append(time.perf_counter() - t0)
        return d

    q = queue or JobQueue(reserve_after_rounds=8)
    q.place_fn = timed_place
    by_id = {sj.request.job_id: sj for sj in jobs}
    remaining: dict[str, float] = {k: v.duration for k, v in by_id.items()}
    enqueued_at: dict[str, float] = {}
    started_at: dict[str, float] = {}
    gen: dict[str, int] = {}
    delays: list[float] = []
    events: list[tuple[float, int, int, str, int]] = []   # (time, kind 0=end 1=arrive, seq, job, gen)
    seq = 0
    for sj in jobs:
        heapq.heappush(events, (sj.arrival, 1, seq, sj.request.job_id, 0))
        seq += 1
    usable = max(int(model.usable.sum()), 1)
    now = 0.0
    util_area = 0.0
    t_start = jobs[0].arrival if jobs else 0.0
    last_t = t_start
    # steady state: from the arrival of the first 20 % of the stream to the last arrival
    # (leaves out the ramp-up of an empty fleet and the drain after the stream ends)
    t_w0 = jobs[len(jobs) // 5].arrival if jobs else 0.0
    t_w1 = jobs[-1].arrival if jobs else 0.0
    steady_area = 0.0
    completed = preempted = 0
    frags: list[float] = []
    n_events = 0
    while events and n_events < max_events:
        t = events[0][0]
        u = (usable - int(model.free.sum())) / usable
        util_area += u * (t - last_t)
        steady_area += u * max(0.0, min(t, t_w1) - max(last_t, t_w0))
        last_t = now = t
        while events and events[0][0] == t:
            _, kind, _, jid, g = heapq.heappop(events)
            n_events += 1
            if kind == 0:
                if gen.get(jid) != g or jid not in model.jobs:
                    continue                          # stale completion of a preempted run
                model.release(jid)
                completed += 1
            else:
                q.submit(by_id[jid].request, now)
                enqueued_at[jid] = now
        for d in q.schedule(model, now):
            jid = d.job_id
            delays.append(now - enqueued_at.get(jid, now))
            started_at[jid] = now
            for v in d.victims:
                if v in by_id:
                    preempted += 1
                    remaining[v] = max(remaining[v] - (now - started_at.get(v, now)), 1.0)
                    gen[v] = gen.get(v, 0) + 1
                    q.submit(by_id[v].request, now)
                    enqueued_at[v] = now
            gen[jid] = gen.get(jid, 0) + 1
            heapq.heappush(events, (now + remaining[jid], 0, seq, jid, gen[jid]))
            seq += 1
        if frag_every and n_events % frag_every == 0:
            frags.append(fragmentation(model)["overall"])
    span = max(last_t - t_start, 1e-9)
    return {
        "jobs": len(jobs), "events": n_events, "placed": q.placed, "completed": completed,
        "preempted": preempted, "pending_at_end": len(q),
        "utilisation_mean": util_area / span,
        "utilisation_steady": steady_area / (t_w1 - t_w0) if t_w1 > t_w0 else util_area / span,
        "queue_delay_s": {"p50": _pct(delays, 50), "p99": _pct(delays, 99), "max": max(delays, default=0.0)},
        "fragmentation_mean": float(np.mean(frags)) if frags else fragmentation(model)["overall"],
        "decision_ms": {"n": len(latencies), "p50": _pct(latencies, 50) * 1e3, "p99": _pct(latencies, 99) * 1e3,
                        "max": max(latencies, default=0.0) * 1e3},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m placer.sim",
                                 description="Replay a synthetic job stream through the herd placer.")
    ap.add_argument("--fleet", choices=sorted(FLEETS), default="h100")
    ap.add_argument("--gpus", type=int, default=16384, help="fleet size in GPUs (rounded up to whole racks)")
    ap.add_argument("--jobs", type=int, default=1000, help="jobs in the stream")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--interarrival", type=float, default=None,
                    help="mean seconds between arrivals (default: spaced for --load)")
    ap.add_argument("--load", type=float, default=0.9, help="offered load as a share of the fleet")
    ap.add_argument("--duration", type=float, default=3600.0, help="mean job duration, seconds")
    ap.add_argument("--size-scale", type=float, default=1.0, help=">1 favours bigger jobs")
    ap.add_argument("--reserve-after", type=int, default=8, help="rounds before a blocked job reserves")
    ap.add_argument("--no-preemption", action="store_true")
    ap.add_argument("--json", action="store_true", help="print exactly one JSON object")
    a = ap.parse_args(argv)
    if a.gpus < 1 or a.jobs < 1:
        ap.error("--gpus and --jobs must be >= 1")
    t0 = time.perf_counter()
    model = ClusterModel.build(build_fleet(a.fleet, a.gpus))
    build_s = time.perf_counter() - t0
    jobs = job_stream(a.fleet, a.jobs, seed=a.seed, fleet_gpus=int(model.n_gpus.sum()),
                      mean_interarrival_s=a.interarrival, mean_duration_s=a.duration, size_scale=a.size_scale,
                      load=a.load)
    q = JobQueue(reserve_after_rounds=a.reserve_after, allow_preemption=not a.no_preemption)
    t1 = time.perf_counter()
    rep = replay(model, jobs, queue=q)
    rep.update({"fleet": a.fleet, "gpus": int(model.n_gpus.sum()), "nodes": model.n_nodes, "seed": a.seed,
                "build_s": build_s, "replay_s": time.perf_counter() - t1})
    if a.json:
        print(json.dumps(rep))
        return 0
    print(f"fleet {a.fleet}: {rep['gpus']:,} GPUs on {rep['nodes']:,} nodes (built in {build_s:.2f} s), seed {a.seed}")
    print(f"jobs {rep['jobs']:,}  placed {rep['placed']:,}  completed {rep['completed']:,}  "
          f"preempted {rep['preempted']:,}  pending at end {rep['pending_at_end']:,}")
    print(f"utilisation mean {rep['utilisation_mean']:.1%} (steady state {rep['utilisation_steady']:.1%})   "
          f"fragmentation mean {rep['fragmentation_mean']:.3f}")
    qd = rep["queue_delay_s"]
    print(f"queue delay s   p50 {qd['p50']:.1f}  p99 {qd['p99']:.1f}  max {qd['max']:.1f}")
    dm = rep["decision_ms"]
    print(f"decision ms     p50 {dm['p50']:.3f}  p99 {dm['p99']:.3f}  max {dm['max']:.3f}  (n={dm['n']:,})")
    print(f"replay took {rep['replay_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
