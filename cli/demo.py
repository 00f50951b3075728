"""`herd demo`: the whole system on one machine, with simulated GPUs.

A placer, 4 agents (simulated dgx-h100, two racks of one block) and an origin (the
GCS emulator when it is installed, else file://), each a real process on loopback.
The story: publish a trainer artifact; run a 16-GPU job within one rack; a
higher-priority 32-GPU job within the block preempts it (the victim writes its
final checkpoint on SIGTERM); publish v2 while the first job waits; the first job
comes back on v2 with a delta fetch. Prints a timeline with measured milliseconds
and a final status table; ``--json`` prints one JSON object instead (the e2e test
reads it). Ends by itself and stops every process it started, workloads and shims
included (Ctrl-C too); ``--keep`` leaves the cluster running, and ``herd demo stop DIR``
(:mod:`cli.demo_stop`) stops all of it later from any shell.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .demo_ha import FLAG as HA_FLAG
from .output import emit_json, human_bytes, table

DEMO_BUCKET = "herd-demo"
WEIGHTS_MB = 24


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a local cluster with simulated GPUs and tell its story")
    p.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object with the measured story")
    p.add_argument("--workdir", default=None, help="where state, logs and the origin live (default: a temp dir)")
    p.add_argument("--origin", choices=("auto", "gcs", "file"), default="auto",
                   help="auto: the GCS emulator when installed, else file://")
    p.add_argument("--insecure", action="store_true",
                   help="plain HTTP/TCP and tokens only (default: mutual TLS with a throwaway CA)")
    p.add_argument("--agents", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--ha", **HA_FLAG)   # a highly available placer: cli.demo_ha
    p.set_defaults(func=run_demo)
    sub_demo = p.add_subparsers(dest="demo_command", metavar="{stop}")
    s = sub_demo.add_parser("stop", help="stop everything a `herd demo --keep` started, workloads included")
    s.add_argument("dir", help="the demo's directory (the one --keep printed)")
    s.set_defaults(func=_stop)


def _stop(args: argparse.Namespace) -> int:
    from .demo_stop import stop_demo

    return stop_demo(args)


# ---------------------------------------------------------------- the artifact

def _write_tree(root: Path, version: str, seed: int = 7) -> None:
    """A small trainer tree: code, a config and deterministic pseudo-random 'weights'.
    v2 changes the code and ~3% of the weights in place (a delta, not a new tree)."""
    from .demo_trainer import durable_source, trainer_source

    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(trainer_source(version))
    os.chmod(root / "train.py", 0o755)
    (root / "durable.py").write_text(durable_source())
    (root / "config.json").write_text(json.dumps({"model": "demo", "version": version, "lr": 3e-4}, indent=1))
    rng = random.Random(seed)
    data = bytearray(rng.randbytes(WEIGHTS_MB << 20))
    if version != "v1":
        # touch ~3% of the bytes in a few contiguous regions
        for _ in range(3):
            off = rng.randrange(0, len(data) - (256 << 10))
            data[off:off + (256 << 10)] = rng.randbytes(256 << 10)
    (root / "weights.bin").write_bytes(bytes(data))


def _publish(src: Path, origin_url: str, name: str) -> Any:
    import trio

    from manifests import ChunkerParams
    from p2p.origins import open_origin
    from p2p.publish import publish

    async def go() -> Any:
        origin = open_origin(origin_url)
        try:
            return await publish(src, origin, name, ChunkerParams())
        finally:
            await origin.aclose()

    return trio.run(go)


# ---------------------------------------------------------------- the story

class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.time()
        self.own_workdir = args.workdir is None
        self.root = Path(args.workdir or tempfile.mkdtemp(prefix="herd-demo-"))
        self.root.mkdir(parents=True, exist_ok=True)
        if self.own_workdir:  # traversable (not listable): agents run as root run workloads as another user
            os.chmod(self.root, 0o711)
        self.events: list[tuple[float, str]] = []
        self.cluster: Any = None
        self.emulator: Any = None
        self.origin_url = ""
        self.origin_kind = ""
        self.quiet = bool(args.json)

    def say(self, msg: str) -> None:
        t = time.time() - self.t0
        self.events.append((t, msg))
        if not self.quiet:
            print(f"[{t:6.2f}s] {msg}", flush=True)

    # -- set-up

    def start_origin(self) -> None:
        from p2p.origins.emulator import emulator_available, start_emulator

        want = self.args.origin
        if want in ("auto", "gcs") and emulator_available():
            self.emulator = start_emulator(self.root / "gcs", bucket=DEMO_BUCKET)
            os.environ["STORAGE_EMULATOR_HOST"] = self.emulator.host
            self.origin_url = f"gs://{DEMO_BUCKET}/artifacts"
            self.origin_kind = f"GCS emulator (gcp-storage-emulator on {self.emulator.host})"
        elif want == "gcs":
            from .main import CliError
            raise CliError("--origin gcs: gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
        else:
            d = self.root / "origin"
            d.mkdir(exist_ok=True)
            self.origin_url = d.as_uri()
            self.origin_kind = "file:// origin"
        self.say(f"origin: {self.origin_kind} at {self.origin_url}")

    def start_cluster(self) -> None:
        from infra.auth import generate_token_dir

        from .localcluster import LocalCluster

        tokens = generate_token_dir(self.root / "tokens")
        os.environ["HERD_TOKEN_DIR"] = str(tokens)
        self.cluster = LocalCluster(self.root / "cluster", tokens, n_agents=self.args.agents, heartbeat_s=0.5,
                                    fence_after_s=10.0, racks=2, origins=(self.origin_url,),
                                    tls=not self.args.insecure)
        t = time.perf_counter()
        self.cluster.start()
        self.say(f"cluster up in {(time.perf_counter() - t) * 1e3:.0f} ms: placer {self.cluster.placer.url}, "
                 f"{len(self.cluster.agents)} agents with SIMULATED dgx-h100 GPUs (8 each) in 2 racks of block b1")
        self.say("transport: " + (f"mutual TLS, a throwaway cluster CA in {self.cluster.pki.dir}" if self.cluster.tls
                                  else "INSECURE plain HTTP/TCP (--insecure)"))
        self._record()
        self.placer = self._client()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            nodes = self.placer.nodes()
            if sum(n.state == "up" for n in nodes) >= self.args.agents:
                break
            time.sleep(0.05)

    def _client(self) -> Any:
        from infra.auth import TokenSet
        from scheduler_link.client import PlacerClient

        return PlacerClient(self.cluster.placer.url, TokenSet.load(self.cluster.token_dir).operator,
                            ssl_context=self.cluster.verify if self.cluster.tls else None)

    # -- steps

    def publish(self, version: str) -> Any:
        src = self.root / f"trainer-{version}"
        _write_tree(src, version)
        st = _publish(src, self.origin_url, f"trainer:{version}")
        self.say(f"published trainer:{version} = {st.manifest[:12]}: {st.files} files, {human_bytes(st.bytes)}, "
                 f"{st.chunks} chunks, uploaded {st.chunks_uploaded} chunks ({human_bytes(st.bytes_uploaded)}) "
                 f"in {st.seconds * 1e3:.0f} ms")
        return st

    def submit(self, name: str, **kw: Any) -> Any:
        from scheduler_link.messages import JobSpec, RestartPolicy

        restart = kw.pop("restart", "never")
        spec = JobSpec(job_id=name, origin=self.origin_url, restart=RestartPolicy(kind=restart), **kw)
        view = self.placer.submit(spec)
        self.say(f"submitted {name}: {spec.pods} pods x {spec.gpus_per_pod} GPUs within {spec.within}, "
                 f"priority {spec.priority}, restart {restart}")
        return view

    def wait(self, job_id: str, state: str, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        view = self.placer.job(job_id)
        while view.state != state and time.monotonic() < deadline:
            view = self.placer.job(job_id, wait=state, timeout_ms=int(max(0.05, deadline - time.monotonic()) * 1000))
        if view.state != state:
            from .main import CliError
            raise CliError(f"demo: job {job_id} is {view.state} ({view.reason}), wanted {state} "
                           f"within {timeout:.0f}s; logs under {self.cluster.root}")
        return view

    def victims_gone(self, view: Any, timeout: float = 15.0) -> list[dict[str, Any]]:
        """Each pod of a preempted attempt once its agent reports it ended (state, exit
        code and when), read from the agents' own workload API."""
        import httpx

        from scheduler_link.messages import TERMINAL_STATES

        out = []
        deadline = time.monotonic() + timeout
        for p in view.pods:
            url = f"{self.cluster.agents[p.node_id].url}/v1/workloads/{p.workload_id}"
            doc: dict[str, Any] = {}
            while time.monotonic() < deadline:
                doc = httpx.get(url, timeout=5, headers=self.cluster.read_headers(),
                                verify=self.cluster.verify).json()  # a WorkloadStatus
                if doc.get("state") in TERMINAL_STATES:
                    break
                time.sleep(0.05)
            out.append({"workload": p.workload_id, "node": p.node_id, "state": doc.get("state"),
                        "exit_code": doc.get("exit_code"), "ended_at": doc.get("updated_at")})
        return out

    def describe(self, view: Any, label: str) -> dict[str, Any]:
        """A job's measured timeline (ms after submission) and its pods' fetch figures."""
        t = view.timings
        base = t.get("submitted", 0.0)
        ms = {k: round((v - base) * 1e3, 1) for k, v in sorted(t.items(), key=lambda kv: kv[1]) if v}
        fetch = {"bytes_from_origin": 0, "bytes_from_peers": 0, "bytes_local": 0}
        for p in view.pods:
            for k in fetch:
                fetch[k] += int(p.fetch.get(k, 0))
        nodes = sorted({p.node_id for p in view.pods})
        rack = {n.node_id: n.topology.rack for n in self.placer.nodes()}  # one request, not one per node
        gpus = [g for p in view.pods for g in p.gpus]
        self.say(f"{label}: {view.job_id} {view.state} on {', '.join(nodes)} ({len(gpus)} GPUs); timeline ms "
                 + ", ".join(f"{k}={v:g}" for k, v in ms.items())
                 + f"; fetched {human_bytes(fetch['bytes_from_origin'])} from origin, "
                   f"{human_bytes(fetch['bytes_from_peers'])} from peers, {human_bytes(fetch['bytes_local'])} local")
        return {"job": view.job_id, "state": view.state, "nodes": nodes, "gpus": gpus, "timeline_ms": ms,
                "fetch": fetch, "racks": sorted({rack[n] for n in nodes}),
                "pods": [{"rank": p.rank, "node": p.node_id, "workload": p.workload_id, "gpus": p.gpus,
                          "state": p.state} for p in view.pods]}

    def checkpoints(self, view: Any) -> list[dict[str, Any]]:
        """Final checkpoints the pods of ``view`` wrote in their scratch dirs on the agents."""
        out = []
        for p in view.pods:
            agent = self.cluster.agents.get(p.node_id)
            if agent is None:
                continue
            for f in agent.state_dir.glob(f"workloads/{p.workload_id}/scratch/final.json"):
                try:
                    doc = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                doc["workload"] = p.workload_id
                out.append(doc)
        return out

    def story(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self.start_origin()
        self.start_cluster()
        v1 = self.publish("v1")
        out["publish_v1"] = {"manifest": v1.manifest, "bytes": v1.bytes, "bytes_uploaded": v1.bytes_uploaded}
        argv = ["python3", "train.py"]

        # 1. a 16-GPU job within one rack, restarted when preempted
        self.submit("train-a", pods=2, gpus_per_pod=8, within="rack", priority=10, preemptible=True,
                    manifest_id=v1.manifest, argv=argv, grace_s=5.0, restart="on-preemption")
        a1 = self.wait("train-a", "running")
        out["job_a"] = self.describe(a1, "job A running")
        time.sleep(1.5)  # let it write a checkpoint or two

        # 2. a 32-GPU job within the block, higher priority: it can only run by preempting A
        self.submit("train-b", pods=4, gpus_per_pod=8, within="block", priority=100, preemptible=False,
                    manifest_id=v1.manifest, argv=argv + ["--steps", "3"], grace_s=5.0)
        b = self.wait("train-b", "running")
        out["job_b"] = self.describe(b, "job B running (preempted A)")
        victims = self.victims_gone(a1)
        a_after = self.placer.job("train-a")
        out["job_a_preempted"] = {"state": a_after.state, "restarts": a_after.restarts,
                                  "final_checkpoints": self.checkpoints(a1), "pods": victims}
        for c in out["job_a_preempted"]["final_checkpoints"]:
            self.say(f"victim {c['workload']} saved its final checkpoint at step {c['step']} "
                     f"(reason {c['reason']}) before exiting")
        out["job_b"]["preempted_at_ms"] = round((a_after.timings.get("requeued", 0) - b.timings["submitted"]) * 1e3, 1)

        # 3. publish v2 while A waits; A comes back on v2 (a delta fetch)
        v2 = self.publish("v2")
        out["publish_v2"] = {"manifest": v2.manifest, "bytes": v2.bytes, "bytes_uploaded": v2.bytes_uploaded}
        self.placer.update_artifact("train-a", v2.manifest)
        self.say(f"job A will come back on trainer:v2 ({v2.manifest[:12]})")
        b_done = self.wait("train-b", "succeeded", timeout=30)
        out["job_b_done"] = {"state": b_done.state, "final_checkpoints": self.checkpoints(b)}
        self.say(f"job B finished by itself: {b_done.state}")
        a2 = self.wait("train-a", "running", timeout=30)
        out["job_a_v2"] = self.describe(a2, "job A back on v2")
        out["job_a_v2"]["manifest"] = a2.spec.manifest_id
        out["nodes"] = [{"node": n.node_id, "rack": n.topology.rack, "state": n.state, "gpus": n.gpus,
                         "free": n.free_gpus, "simulated": n.simulated} for n in self.placer.nodes()]
        # a fact, not a label: every node's GPU backend said its devices are simulated (agent.gpus
        # backends set Discovery.simulated; the placer keeps it per node from the reports)
        out["simulated_gpus"] = bool(out["nodes"]) and all(n["simulated"] for n in out["nodes"])
        out["jobs"] = [{"job": j.job_id, "state": j.state, "restarts": j.restarts,
                        "gpus": j.gpus_total} for j in self.placer.jobs()]
        return out

    def final_table(self, out: dict[str, Any]) -> None:
        print()
        print(table(["NODE", "RACK", "STATE", "GPUS", "FREE", "GPU KIND"],
                    [[n["node"], n["rack"], n["state"], n["gpus"], n["free"],
                      "simulated dgx-h100" if n["simulated"] else "real"] for n in out["nodes"]]))
        print()
        print(table(["JOB", "STATE", "RESTARTS", "GPUS"],
                    [[j["job"], j["state"], j["restarts"], j["gpus"]] for j in out["jobs"]]))
        a, a2 = out["job_a"], out["job_a_v2"]
        print()
        print(f"delta fetch for v2: {human_bytes(a2['fetch']['bytes_from_origin'] + a2['fetch']['bytes_from_peers'])}"
              f" moved vs {human_bytes(a['fetch']['bytes_from_origin'] + a['fetch']['bytes_from_peers'])} for v1"
              f" (v2 is {human_bytes(out['publish_v2']['bytes'])})")

    def _record(self) -> None:
        """``root/demo.json``: what `herd demo stop ROOT` stops (cli.demo_stop)."""
        from .demo_stop import record

        started = [(p.name, p.proc.pid) for p in self.cluster.all_procs()]
        if self.emulator is not None:
            started.append(("gcs-emulator", self.emulator.proc.pid))
        record(self.root, started, [p.state_dir for p in self.cluster.agents.values()])

    def close(self) -> None:
        if (self.root / "demo.json").exists():
            from .demo_stop import stop

            stop(self.root)   # every process, the agents' shims and workloads included
        if self.cluster is not None:
            self.cluster.close()
        if self.emulator is not None:
            self.emulator.stop()
        if self.own_workdir:
            shutil.rmtree(self.root, ignore_errors=True)


def run_demo(args: argparse.Namespace) -> int:
    demo = Demo(args)
    # Ctrl-C and SIGTERM both end in close(): every process we started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    keep = False
    try:
        out = demo.story()
        out["seconds"] = round(time.time() - demo.t0, 2)
        if args.json:
            emit_json(out)
        else:
            demo.final_table(out)
        if args.keep:
            keep = True
            from infra.auth import TokenSet
            viewer = TokenSet.load(demo.cluster.token_dir).viewer
            # the token rides in the URL fragment: browsers never send it to the server
            print(f"\ndashboard: {demo.cluster.placer.url}/#token={viewer}"
                  + (f"  (the browser must trust {demo.cluster.pki.ca})" if demo.cluster.tls else ""),
                  file=sys.stderr)
            print(f"\ncluster left running (state under {demo.root}):\n"
                  f"  export HERD_TOKEN_DIR={demo.root / 'tokens'} HERD_PLACER={demo.cluster.placer.url}\n"
                  + (f"  export HERD_TLS_DIR={demo.cluster.pki.dir} SSL_CERT_FILE={demo.cluster.pki.ca}\n"
                     if demo.cluster.tls else "") +
                  f"  herd job list\n  herd nodes\n  herd status --agent {next(iter(demo.cluster.agents.values())).url}\n"
                  f"stop everything it started, workloads included, from any shell:\n"
                  f"  herd demo stop {demo.root}",
                  file=sys.stderr)
        return 0
    finally:
        if not keep:
            demo.close()
