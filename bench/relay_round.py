"""The placer's CPU for one relayed delivery round (RelayHub.deliver), in process.

    python -m bench.relay_round [--nodes 56000] [--fleet gb200|h100] [--gang-gpus 200000] [--repeat 3] [--json]
    python -m bench.relay_round --ab BASE_TREE [--pairs 3] ...   # same-run A/B against another tree
    python -m bench.relay_round --nodes 32768 --fleet h100 --fill 0.75 [--ab BASE_TREE]   # a preempting gang

``--nodes`` gb200 trays (or h100 hosts) registered in a real PlacerService, a ``--gang-gpus``
gang of whole-node pods decided by the real state; its round delivered to fake relay channels (one per rack) whose answers (the
real AckBundles, each outcome with its member's MAC, made before the clock starts: the relays'
work, not the placer's) come from one answerer task in batches of 32, as connections' readers
would. What is timed is the round's own work: splitting by rack, building, signing and
encoding every bundle, waiting for the answers, checking every member's MAC. No sockets, no
reads or writes (bench.delivery measures those end to end). A same-run A/B is two trees' runs
back to back (``cd TREE && python -m bench.relay_round``), or ``--ab TREE``: this tree and
TREE's runs in alternating order (base, new, new, base, ...), ``--pairs`` of each, each in
its own process (this driver over each tree's placer: ``HERD_BENCH_TREE``), and the medians of
their per-run medians with the ratio. The fakes speak
both the waiting call (``call_prepared``) and the callback one (``call_cb``). Every loop is
bounded in count. Besides the round, each row times the placer's whole path for the gang,
submit -> every node acked: the submission, the decision and its bookkeeping (pods, pushes,
the gang blob), the round, and recording the acks (``path_cpu_s``). ``--fill F``: before each
round the fleet is filled to F with placer/sim.py's job mix (priority 0, preemptible, every pod
running), so the gang preempts (bench.delivery's preemption phase, in process), and each row
says when the victims' last stop was handed to its relay, in the placer's CPU-s from the submit
(``victims_sent_s``: the decision and its bookkeeping, then the round's build order).
``--manifest``: the gang names an artifact that one node in ``--manifest-every`` (2048, chosen by
a hash of its id as testing.fleet's ``--holds-every``) reports holding, so the placer lists those
outside the gang as the gang's contacts and signs its read grant (bench.delivery's ``--manifest``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import trio
import trio.lowlevel

# the tree whose placer runs (HERD_BENCH_TREE: another tree's, with this driver: a same-run A/B)
ROOT = Path(os.environ.get("HERD_BENCH_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))

from infra.auth import TokenSet  # noqa: E402
from placer.attempts import ACCEPTED  # noqa: E402
from placer.config import PlacerConfig  # noqa: E402
from placer.records import GangPushes, Push  # noqa: E402
from placer.relays import RelayConn  # noqa: E402
from placer.service import PlacerService  # noqa: E402
from placer.sim import fleet_shape  # noqa: E402
from scheduler_link.frames import encode_frame  # noqa: E402
from scheduler_link.messages import AckBundle, Frame, JobSpec, NodeOutcome, NodeReport, TopologyPath  # noqa: E402
from scheduler_link.msgauth import with_outcome_mac  # noqa: E402
from testing.fleet import PROFILE_OF, SnapshotFactory, fleet_nodes  # noqa: E402

Answer = Callable[[Frame | None], None]

# --manifest: the artifact the gang names (bench.delivery's), held by one node in --manifest-every
MANIFEST = "5e" * 32
ORIGIN = "gs://bench-artifacts/herd"


class Answerer:
    """Hands out the relays' answers in batches of 32 per scheduler pass."""

    def __init__(self) -> None:
        self.pending: list[tuple[Answer, Frame]] = []
        self.wake = trio.Event()

    def put(self, fn: Answer, f: Frame) -> None:
        self.pending.append((fn, f))
        self.wake.set()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            while self.pending:
                batch, self.pending = self.pending[:32], self.pending[32:]
                for fn, f in batch:
                    fn(f)
                await trio.lowlevel.checkpoint()


class FakeRelay:
    """A relay's frames connection as RelayHub uses it, answering with a prepared AckBundle."""

    def __init__(self, name: str, answerer: Answerer) -> None:
        self.name = name
        self.info: Any = None
        self.closed = trio.Event()
        self.answer: Frame | None = None
        self.sent_at = 0.0          # when the round handed it its bundle (process_time)
        self._a = answerer

    def prepare(self, type_: str, payload: Any) -> tuple[int, bytes]:
        return 1, encode_frame(type_, payload, id=1)

    def call_cb(self, rid: int, data: bytes, fn: Answer) -> None:
        assert self.answer is not None
        self.sent_at = time.process_time()
        self._a.put(fn, self.answer)

    async def call_prepared(self, rid: int, data: bytes) -> Frame:
        assert self.answer is not None
        done = trio.Event()
        box: list[Frame] = []

        def got(f: Frame | None) -> None:
            assert f is not None
            box.append(f)
            done.set()
        self._a.put(got, self.answer)
        await done.wait()
        return box[0]

    def forget(self, rid: int) -> None:
        pass

    def send(self, *a: Any, **kw: Any) -> None:
        pass


def _holds(node_id: str, every: int) -> list[str]:
    """The manifests ``node_id`` reports holding: MANIFEST on one node in ``every`` (by a hash of
    its id, as testing.fleet's ``held_by``), else none."""
    if not every or int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=4).digest()) % every:
        return []
    return [MANIFEST]


def _fleet(n: int, state_dir: str, fleet: str = "gb200", holds_every: int = 0
           ) -> tuple[PlacerService, dict[str, bytes]]:
    # (registered in process, as if directly: no limit on how many)
    svc = PlacerService(PlacerConfig(state_dir=state_dir, heartbeat_s=5.0, lost_after_missed=1000, insecure=True,
                                     direct_max_nodes=0),
                        TokenSet())
    sf = SnapshotFactory(PROFILE_OF[fleet])
    now = time.time()
    keys = {}
    for s in fleet_nodes(fleet, 0, n):
        snap = sf.snapshot(s.node_id, f"{s.zone}/{s.block}/{s.rack}")
        rep = NodeReport(node_id=s.node_id, boot_id="b1", seq=1, full=True, control_url=f"http://127.0.0.1:9/n/{s.node_id}",
                         data_url=f"http://127.0.0.1:9/{s.node_id}",
                         topology=TopologyPath(zone=s.zone, block=s.block, rack=s.rack),
                         nvlink_domain=snap.nvlink_domain, snapshot=snap, workloads=[],
                         manifests=_holds(s.node_id, holds_every), sent_at=now)
        st, reply = svc._ingest(s.node_id, rep)
        assert st == 200 and reply.mac_key, st
        keys[s.node_id] = reply.mac_key
    svc.state.recover_until = 0
    return svc, keys


def _fill(svc: PlacerService, fleet: str, k: int, fill: float) -> int:
    """The fleet filled to ``fill`` of its GPUs with placer/sim.py's job mix at priority 0,
    preemptible (bench.delivery's preemption phase), every pod running. Returns the jobs placed."""
    from bench.fleet import _jobs_mix

    st = svc.state
    gpus = sum(len(n.uuids) for n in st.nodes.values())
    now = time.time()
    for spec in _jobs_mix(fleet, gpus, fill, 7 + k, 4000):
        st.submit(JobSpec(**{**spec, "job_id": f"r{k}-{spec['job_id']}"}), now)
    placed = 0
    for _ in range(50):   # (bounded: a pass places what fits; the queue tries at most max_tries a pass)
        decided = st.schedule(now)
        for job, pushes in decided:
            st.on_acks(job.job_id, job.attempt, {p.node_id: ACCEPTED for p in pushes if p.kind == "start"}, now, pushes)
            job.move_pods("accepted", "running")
            job.state = "running"
            placed += 1
        if not decided:
            break
        st.dirty = True
    return placed


def _clear(svc: PlacerService) -> None:
    """Every live job cancelled and every stopped pod gone (as their nodes would report):
    the next round starts on an empty fleet."""
    st = svc.state
    now = time.time()
    for job in list(st.jobs.values()):
        if job.state not in ("succeeded", "failed", "cancelled", "preempted"):
            st.cancel(job.job_id, now)
        st._release_quiet(job.job_id)
    for hid in [h for h in st.model.jobs if h.startswith("stale:")]:
        st._release_quiet(hid)
    for node in st.nodes.values():
        node.stale.clear()
        node.tell.clear()


async def one_round(svc: PlacerService, keys: dict[str, bytes], k: int, gang_gpus: int,
                    gpn: int = 4, fill: float = 0.0, fleet: str = "gb200", manifest: bool = False) -> dict[str, Any]:
    answerer = Answerer()
    hub = svc.relays
    by_rack: dict[str, list[str]] = {}
    for nid, node in svc.state.nodes.items():
        by_rack.setdefault(node.rack_path, []).append(nid)
    chans: dict[str, FakeRelay] = {}
    for rack, ids in by_rack.items():
        ch = chans[rack] = FakeRelay(ids[0], answerer)
        conn = RelayConn(ids[0], (rack,), "tcp://127.0.0.1:9", ch)  # type: ignore[arg-type]  # FakeRelay has the FrameChannel methods the hub uses
        ch.info = conn
        hub._cands[rack] = {ids[0]: conn}
        hub._active.pop(rack, None)
    now = time.time()
    async with trio.open_nursery() as n:
        svc._nursery = n
        n.start_soon(answerer.run)
        svc.state.schedule(now)   # (the model's rebuild, untimed)
        filled = _fill(svc, fleet, k, fill) if fill else 0
        spec = JobSpec(job_id=f"big{k}", pods=gang_gpus // gpn, gpus_per_pod=gpn, whole_nodes=True, priority=2,
                       preemptible=False, argv=["/bin/sleep", "3600"], grace_s=1,
                       manifest_id=MANIFEST if manifest else None, origin=ORIGIN if manifest else None)
        gc.collect()
        gc.freeze()   # (as the service does after a pass: the fleet's records out of the collector's sight)
        c_sub = time.process_time()
        svc.state.submit(spec, now)
        decided = svc.state.schedule(now)
        c_dec = time.process_time()
        assert decided, "the gang did not fit"
        job, pushes = decided[0]
        racks: dict[str, list[Push]] = {}
        told: set[str] = set()   # racks with a victim's stop among their parts
        victims = 0
        cols = pushes.n_cols if isinstance(pushes, GangPushes) else 0
        for i, p in enumerate(pushes):
            rack = svc.state.nodes[p.node_id].rack_path
            racks.setdefault(rack, []).append(p)
            # (a start push's victims from its columns: its Placement is not made here)
            vs = (pushes.victims[i] if pushes.victims is not None else []) if i < cols else p.placement.victims
            if vs:
                told.add(rack)
                victims += len(vs)
        for rack, ps in racks.items():
            # what the shipped relay answers (agent.relaycore): every member plainly accepted, as
            # the rack's aggregate (a bitmap over the parts, the members' MACs in part order)
            macs = [with_outcome_mac(keys[p.node_id], NodeOutcome(node_id=p.node_id, placement_id=p.placement_id,
                                                                  outcome="accepted")).mac for p in ps]
            bits = bytearray((len(ps) + 7) // 8)
            for k in range(len(ps)):
                bits[k >> 3] |= 1 << (k & 7)
            raw = encode_frame("acks", AckBundle(rack=rack, blob_id=job.blob_id or "", accepted=bytes(bits),
                                                 macs=b"".join(macs)), re=1)
            chans[rack].answer = msgspec.msgpack.decode(raw[4:], type=Frame)
        gc.collect()
        gc.freeze()
        bad0, fb0 = svc.state.counters["bad_macs"], hub.stats.fallback_nodes

        async def push_direct(p: Push) -> Any:
            raise AssertionError(f"{p.node_id} pushed directly: its relay answered")
        c0, w0 = time.process_time(), time.perf_counter()
        acks = await hub.deliver(job.job_id, job.blob_id, pushes, push_direct)
        c1, w1 = time.process_time(), time.perf_counter()
        starts = pushes.n_cols if isinstance(pushes, GangPushes) else len(pushes)   # (acks: the start pushes')
        assert acks is not None and len(acks) == starts, "not every node acked"
        more = svc.state.on_acks(job.job_id, job.attempt, acks, now, pushes)
        c2 = time.process_time()
        assert not more and job.state == "starting", job.state
        assert svc.state.counters["bad_macs"] == bad0 and hub.stats.fallback_nodes == fb0
        # the victims' last stop handed to its relay: the decision (from the submit) and the
        # round (from its start) in the process's CPU time (the placer's own work, whatever
        # else the machine runs), without the answers' preparation between them (the relays')
        victims_sent = max((chans[r].sent_at for r in told), default=0.0)
        if fill:
            _clear(svc)
        else:
            svc.state.cancel(job.job_id, time.time())
            for pod in job.pods:   # the pods are gone (as their nodes would report): the next round fits
                if not pod.terminal:
                    job.set_pod_state(pod, "exited", 0)
                svc.state._release_quiet(f"stale:{pod.workload_id}")   # (held until then)
            svc.state._release_quiet(job.job_id)
        n.cancel_scope.cancel()
    book = (c_dec - c_sub) + (c2 - c1)
    out: dict[str, Any] = {"cpu_s": c1 - c0, "wall_s": w1 - w0, "racks": len(racks), "nodes": len(pushes),
           "submit_decide_cpu_s": c_dec - c_sub, "acks_cpu_s": c2 - c1, "path_cpu_s": book + (c1 - c0)}
    if fill:
        out |= {"fill_jobs": filled, "victims": victims, "victim_racks": len(told),
                "stop_nodes": len(pushes.extra) if isinstance(pushes, GangPushes) else None,
                "victims_sent_s": (c_dec - c_sub) + (victims_sent - c0) if victims_sent else None}
    return out


MORE = ("submit_decide_cpu_s", "victims_sent_s")   # (victims_sent_s: with --fill only)


def ab(a: argparse.Namespace, gang: int) -> dict[str, Any]:
    """Alternating runs of the base tree and this one, each its own process (same machine, same run)."""
    runs: dict[str, list[float]] = {"base": [], "new": []}
    path: dict[str, list[float]] = {"base": [], "new": []}
    more: dict[str, dict[str, list[float]]] = {k: {"base": [], "new": []} for k in MORE}
    roots = {"base": str(Path(a.ab).resolve()), "new": str(ROOT)}
    for k in range(max(1, a.pairs)):
        for which in (("base", "new") if k % 2 == 0 else ("new", "base")):
            # this driver in both, over each tree's placer (HERD_BENCH_TREE)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--nodes", str(a.nodes), "--gang-gpus", str(gang),
                   "--fleet", a.fleet, "--fill", str(a.fill), "--repeat", str(a.repeat), "--json"]
            if a.manifest:
                cmd += ["--manifest", "--manifest-every", str(a.manifest_every)]
            p = subprocess.run(cmd, cwd=roots[which], env={**os.environ, "PYTHONPATH": roots[which],
                                                           "HERD_BENCH_TREE": roots[which]},
                               capture_output=True, text=True, timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"{which} run failed: {p.stderr[-2000:]}")
            res = json.loads(p.stdout.strip().splitlines()[-1])
            runs[which].append(res["cpu_s_median"])
            path[which].append(res["path_cpu_s_median"])
            for key in MORE:
                if res.get(key + "_median") is not None:
                    more[key][which].append(res[key + "_median"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    pm = {k: statistics.median(v) for k, v in path.items()}
    out: dict[str, Any] = {"roots": roots, "runs": runs, "cpu_s_median": med, "new_over_base": med["new"] / med["base"],
                           "path_runs": path, "path_cpu_s_median": pm, "path_new_over_base": pm["new"] / pm["base"],
                           "load": os.getloadavg()[0]}
    for key, got in more.items():
        if got["base"] and got["new"]:
            m = {k: statistics.median(v) for k, v in got.items()}
            out[key] = {"runs": got, "median": m, "new_over_base": m["new"] / m["base"] if m["base"] else None}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.relay_round", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=56000)
    ap.add_argument("--gang-gpus", type=int, default=None, help="default: min(200,000, 60%% of the fleet's GPUs)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fleet", choices=sorted(PROFILE_OF), default="gb200",
                    help="gb200 trays (4 GPUs, the default) or h100 hosts (8 GPUs); the gang's pods are whole nodes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ab", metavar="BASE_TREE", help="same-run A/B: alternate runs of BASE_TREE's and this tree's")
    ap.add_argument("--pairs", type=int, default=3, help="with --ab: runs of each tree")
    ap.add_argument("--fill", type=float, default=0.0,
                    help="fill the fleet to this fraction with placer/sim.py's job mix (priority 0, preemptible) "
                         "before each round: the gang preempts (bench.delivery's preemption phase), and each row "
                         "says when its victims' last stop was handed to its relay (victims_sent_s)")
    ap.add_argument("--manifest", action="store_true",
                    help="the gang names an artifact that some nodes outside it hold: the placer lists them as "
                         "the gang's contacts and signs its read grant")
    ap.add_argument("--manifest-every", type=int, default=2048,
                    help="with --manifest: one node in this many reports holding the artifact")
    a = ap.parse_args(argv)
    gpn = fleet_shape(a.fleet).gpus_per_node
    gang = a.gang_gpus if a.gang_gpus is not None else min(200_000, int(a.nodes * 0.6) * gpn)
    if a.ab:
        res = ab(a, gang)
        if a.json:
            print(json.dumps(res))
        else:
            m = res["cpu_s_median"]
            print(f"relay round, {a.nodes:,} nodes, placer CPU-s, medians of {a.pairs} runs x {a.repeat} rounds "
                  f"(alternating): base {m['base']:.4f} ({', '.join(f'{x:.4f}' for x in res['runs']['base'])}), "
                  f"new {m['new']:.4f} ({', '.join(f'{x:.4f}' for x in res['runs']['new'])}), "
                  f"new/base {res['new_over_base']:.2f}")
            pm, pr = res["path_cpu_s_median"], res["path_runs"]
            print(f"submit -> every node acked (submit, decide, bookkeeping, round, acks recorded), placer "
                  f"CPU-s: base {pm['base']:.4f} ({', '.join(f'{x:.4f}' for x in pr['base'])}), "
                  f"new {pm['new']:.4f} ({', '.join(f'{x:.4f}' for x in pr['new'])}), "
                  f"new/base {res['path_new_over_base']:.2f}")
            for key in MORE:
                if key in res:
                    m, r = res[key]["median"], res[key]["runs"]
                    print(f"{key}: base {m['base']:.4f} ({', '.join(f'{x:.4f}' for x in r['base'])}), "
                          f"new {m['new']:.4f} ({', '.join(f'{x:.4f}' for x in r['new'])}), "
                          f"new/base {res[key]['new_over_base']:.2f}")
            print(f"load average (1 min) at the end: {res['load']:.2f}")
        return 0
    with tempfile.TemporaryDirectory(prefix="herd-bench-round-") as d:
        svc, keys = _fleet(a.nodes, d, a.fleet, a.manifest_every if a.manifest else 0)
        rows = [trio.run(one_round, svc, keys, k, gang, gpn, a.fill, a.fleet, a.manifest)
                for k in range(max(1, a.repeat))]
    out = {"tree": str(ROOT), "rows": rows, "cpu_s_median": statistics.median(r["cpu_s"] for r in rows),
           "wall_s_median": statistics.median(r["wall_s"] for r in rows),
           **{k + "_median": statistics.median(r[k] for r in rows)
              for k in ("submit_decide_cpu_s", "acks_cpu_s", "path_cpu_s")},
           "victims_sent_s_median": statistics.median(v) if (v := [r["victims_sent_s"] for r in rows
                                                                  if r.get("victims_sent_s") is not None]) else None}
    if a.json:
        print(json.dumps(out))
    else:
        r = rows[0]
        each = ", ".join(f"{x['cpu_s']:.3f}" for x in rows)
        print(f"{ROOT}: one round of {r['nodes']:,} nodes in {r['racks']:,} racks: placer CPU median "
              f"{out['cpu_s_median']:.3f} s, wall {out['wall_s_median']:.3f} s over {len(rows)} "
              f"({each}); submit + decide + bookkeeping {out['submit_decide_cpu_s_median']:.3f} s, acks "
              f"recorded {out['acks_cpu_s_median']:.3f} s, submit -> every node acked "
              f"{out['path_cpu_s_median']:.3f} CPU-s")
        if out["victims_sent_s_median"] is not None:
            print(f"  with the fleet filled to {a.fill:.0%}: {r['fill_jobs']:,} jobs, the gang's {r['victims']:,} "
                  f"victims in {r['victim_racks']:,} racks ({r['stop_nodes']:,} nodes of stops only); submit -> the last victim's stop handed to its relay "
                  f"{out['victims_sent_s_median']:.3f} CPU-s (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
