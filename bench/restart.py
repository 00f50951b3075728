"""A placer restart under an emulated fleet with a gang running: ``kill -9``, start again on
the same state dir and ports, and time how long the new process takes to hold the fleet.

    python -m bench.restart --nodes 16384 [--fleet h100|gb200] [--plain] [--baseline] [--json]
        [--baseline-root DIR [--repeat K]]

One ``herd placer run`` (mutual TLS unless ``--plain``; rack relays on) and
``ceil(N / --per-proc)`` emulator processes (``python -m testing.fleet --relays``: each rack
runs the shipped relay, :class:`agent.relay.Relay`; every node has its own certificate, and
over TLS members register by enrolling through their relay, ``--enroll``, as agents that
kept their relay's address do, with the enrolment key issued with their certificate;
``--enroll-ecdh``: by ECDH with their certificate's key, as certificates issued without one;
``--no-enroll``: each over its own connection, a handshake each).

- cold: ``go`` -> every node up (``register_s``), with the placer's CPU and the emulators', the
  nodes it declared lost meanwhile (``register_nodes_lost``) and the mass silences it held
  (``register_mass_silences``: [placer] lost_mass_fraction) and its TLS handshakes
  (``register_tls_handshakes``); the members that enrolled through their relay
  (``register_enrolled``) and those that registered directly instead (``register_direct``,
  by outcome ``register_enroll_refused``: ``upstream_down`` past the member's hold);
- a gang of ``--gang-hosts`` (default: 200,000 GPUs scaled to the fleet: 25,000 h100 hosts x 8 or
  50,000 gb200 trays x 4 of 131,072) placed and running;
- ``--steady-s S``: the fleet left alone S seconds first, the placer's and the emulators' CPU
  over it (``steady_placer_cores``, ``steady_emulator_cores``);
- ``kill -9`` the placer at ``t0``, start it again at once; ``listening``: the new process
  wrote its endpoints (its listeners are open); from there:
  ``model_full_s`` (every node up in the new model), ``placer_cpu_s`` to then,
  ``tls_handshakes`` (the new process's, both listeners: ``herd_placer_tls_handshakes_total``)
  against ``relays`` + 1 % of the nodes, ``relayed_registrations`` / ``reregistrations``
  (members' full reports through their relay / all of them, from the emulators);
- a probe job (``--probe-gpus``, default 1,024 GPUs, a pod a host) submitted once the model
  is full: ``probe_acked_s`` (submit -> every pod acked, the placer's clock) and
  ``probe_from_listening_s`` (listening -> acked), against ``recover_s`` + 2 s;
- invariants, from the emulators' own state, from a settled fleet (``gang_settle_s``: until one gang
  pod a host runs; nodes lost in a loaded registration may have run an ended attempt on): ``stops`` (stop orders after ``t0``),
  ``placements_doubled`` (gang workloads the nodes did not have before ``t0``: the gang placed
  again), ``placements_extra`` (every placement taken after ``t0`` beyond the probe's pods),
  ``refused_acks`` (a GPU given twice is refused by the emulated node), ``gang_running``.

``compact_registrations`` / ``inventory_misses``: re-registrations that named the GPU inventory
the placer stored instead of sending it (placer.inventories) / that it did not hold;
``--cold-only``: the cold registration alone (no gang, no restart), for its ``register_*`` figures.
``--baseline-compact``: the same run again with every full report carrying its snapshot, for the
ratio. ``--baseline``: the same run again with the members' relay hold off (``--relay-hold 0``:
every member reports to the placer directly as soon as its relay loses the placer, as
before the hold existed), in the same invocation, for the ratio. ``--baseline-root DIR``: the
same run by another checkout's placer and emulators, alternated with this tree's (``--repeat K``
each), with the medians and ``*_ratio_over_base``. ``register_closes`` / ``restart_closes``:
the frames connections ended by then, and why, at both ends (the placer's closes by a bound,
``frames_closed_*``; the relays' own view of their connection up, ``relay_drop_reasons``),
also noted every 20 s while the bench waits for the fleet. Every wait is bounded;
traffic stays on 127.0.0.1; nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.failover import Placer, _job, _nodes_up, _note, _submit  # noqa: E402
from bench.fleet_tls import tree_cpu_s  # noqa: E402
from infra.auth import TokenSet, generate_token_dir  # noqa: E402
from infra.pki import throwaway  # noqa: E402
from testing.harness import EmulatorProc, PlacerOptions, PlacerProc, verify  # noqa: E402

HEARTBEAT_S = 5.0
GPUS_PER_HOST = {"h100": 8, "gb200": 4}   # a DGX H100; a GB200 NVL72 compute tray
EMULATOR_NICE = 10   # the emulators stand for other machines: they yield the cores to the placer


class TreePlacer(Placer):
    """bench.failover's Placer, run from ``root``'s code (``--baseline-root``: another checkout)."""

    def __init__(self, *args: Any, root: Path = ROOT, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.root = root

    def start(self) -> None:
        (self.state / "endpoints.json").unlink(missing_ok=True)
        with open(self.work / "placer.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "placer", "run", "--config", str(self.conf)],
                                         cwd=self.root, env={**os.environ, "PYTHONPATH": str(self.root)}, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


async def _closes(c: httpx.AsyncClient, url: str, emus: list[EmulatorProc]) -> dict[str, dict[str, int]]:
    """Why frames connections ended so far: the placer's closes by a bound (its framed channel's
    ``frames_closed_*``) and the relays' own view of their connection up (``relay_drop_reasons``)."""
    placer: dict[str, int] = {}
    relays: dict[str, int] = {}
    try:   # (a busy process may not answer in time: what did answer is reported, the bench goes on)
        r = await c.get(url + "/v1/cluster", params={"detail": "0"}, timeout=30)
        fc = r.json().get("framed_channel") or {} if r.status_code == 200 else {}
        placer = {k.removeprefix("frames_closed_"): int(v) for k, v in fc.items()
                  if k.startswith("frames_closed_") and v}
        for e in emus:
            for k, v in (await e.stats(c)).get("relay_drop_reasons", {}).items():
                relays[k] = relays.get(k, 0) + int(v)
    except (httpx.HTTPError, ValueError) as e:
        relays["(not known: " + type(e).__name__ + ")"] = 0
    return {"placer_closed": placer, "relay_drops": relays}


async def _wait_up(c: httpx.AsyncClient, url: str, n: int, limit_s: float, emus: list[EmulatorProc]) -> None:
    """Until ``n`` nodes are up (bounded by ``limit_s``), noting progress every 2 s and, every
    20 s, the connections closed so far and why (both ends)."""
    t0 = last = last_closes = time.time()
    with trio.fail_after(limit_s):
        while (up := await _nodes_up(c, url)) < n:
            if time.time() - last >= 2.0:
                last = time.time()
                _note("nodes up", up=up, of=n, s=round(last - t0, 1))
            if time.time() - last_closes >= 20.0:
                last_closes = time.time()
                _note("closes", **{k: json.dumps(v) for k, v in (await _closes(c, url, emus)).items()})
            await trio.sleep(0.05)


async def _sum_stats(c: httpx.AsyncClient, emus: list[EmulatorProc], job: str) -> dict[str, Any]:
    out: dict[str, Any] = {"placements": 0, "victims_told": 0, "refused_acks": 0, "gang_running": 0, "gang_pods": 0,
                           "relayed_registrations": 0, "reregistrations": 0, "relays": 0, "relay_held": 0,
                           "victims_by": {}}
    for e in emus:
        s = await e.stats(c, job)
        out["placements"] += s["placements"] + s.get("parts", 0)   # (directly, and parts through relays)
        out["victims_told"] += s["victims_told"]
        for k, v in s.get("victims_by", {}).items():
            out["victims_by"][k] = out["victims_by"].get(k, 0) + v
        out["refused_acks"] += sum(v for k, v in s["acks"].items() if k != "accepted")
        out["gang_running"] += s["job"]["states"].get("running", 0)
        out["gang_pods"] += sum(s["job"]["states"].values())   # the gang's workloads the nodes know, any state
        for k in ("relayed_registrations", "reregistrations", "relays", "relay_held"):
            out[k] += s.get(k, 0)
    return out


async def _enrolments(c: httpx.AsyncClient, emus: list[EmulatorProc]) -> dict[str, Any]:
    """How the members registered so far, from the emulators: through their relay
    (``register_enrolled``) or, their enrolment not taken, directly (``register_enroll_refused``,
    by outcome: ``upstream_down`` is a member whose relay had no connection up past its hold)."""
    enrolled, refused = 0, dict[str, int]()
    for e in emus:
        s = await e.stats(c)
        enrolled += int(s.get("enrolled", 0))
        for k, v in s.get("enroll_refused", {}).items():
            refused[k] = refused.get(k, 0) + int(v)
    return {"register_enrolled": enrolled, "register_enroll_refused": refused,
            "register_direct": sum(refused.values())}


_COUNTED = {"herd_placer_tls_handshakes_total": "tls_handshakes",
            "herd_placer_compact_registrations_total": "compact_registrations",
            "herd_placer_inventory_misses_total": "inventory_misses",
            "herd_placer_nodes_lost_total": "nodes_lost", "herd_placer_mass_silences_total": "mass_silences"}


async def _counted(c: httpx.AsyncClient, url: str) -> dict[str, int]:
    """The new process's TLS handshakes (both listeners) and compact registrations, from /metrics."""
    r = await c.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    out = dict.fromkeys(_COUNTED.values(), 0)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in _COUNTED:
                out[_COUNTED[s.name]] += int(s.value)
    return out


async def run_once(n: int, *, fleet: str, gang_hosts: int, probe_gpus: int, tls: bool, relay_hold: float,
                   per_proc: int, recover_s: float, tmp: Path, limit_s: float,
                   heartbeat_s: float = HEARTBEAT_S, enroll: bool = True, compact: bool = True,
                   enroll_workers: int | None = None, enroll_ecdh: bool = False,
                   steady_s: float = 0.0, root: Path = ROOT, cold_only: bool = False) -> dict[str, Any]:
    token_dir = generate_token_dir(tmp / "tokens")
    op = {"authorization": f"Bearer {TokenSet.load(token_dir).operator}"}
    pki = throwaway(tmp / "pki").dir if tls else None
    placer = TreePlacer(tmp / "placer", token_dir, None, recover_s, tls_dir=pki, relays=True, heartbeat_s=heartbeat_s,
                        extra_toml="" if enroll_workers is None else f"enroll_workers = {enroll_workers}\n", root=root)
    enroll = enroll and tls
    per_host = GPUS_PER_HOST[fleet]
    row: dict[str, Any] = {"tree": str(root), "nodes": n, "fleet": fleet, "tls": tls, "enroll": enroll, "enroll_ecdh": enroll and enroll_ecdh,
                           "relay_hold_s": relay_hold,
                           "compact": compact,
                           "heartbeat_s": heartbeat_s, "enroll_workers": enroll_workers,
                           "gang_hosts": gang_hosts, "recover_s": recover_s, "load_before": os.getloadavg()[0]}
    emus: list[EmulatorProc] = []
    try:
        placer.start()
        await placer.ready()
        # the harness's emulator entry point, pointed at this placer's fixed ports
        proxy = PlacerProc(tmp / "unused", token_dir, PlacerOptions(heartbeat_s=heartbeat_s))
        proxy.url, proxy.wire_url = placer.url, placer.wire_url
        procs = math.ceil(n / per_proc)
        for k in range(procs):
            cnt = min(per_proc, n - k * per_proc)
            e = EmulatorProc(proxy, token_dir, nodes=cnt, offset=k * per_proc, fleet=fleet, mux=8, tls_dir=pki,
                             log_path=tmp / f"emu-{k}.log", nice=EMULATOR_NICE, root=root,
                             extra=["--relays", "--relay-hold", str(relay_hold), *(["--enroll"] if enroll else []),
                                    *(["--enroll-ecdh"] if enroll and enroll_ecdh else []),
                                    *([] if compact else ["--no-compact"]),
                                    *(["--tls-threads", str(max(8, 32 // procs))] if tls else [])])
            await e.__aenter__()
            emus.append(e)
        async with httpx.AsyncClient(headers=op, verify=verify(pki), timeout=60) as c:
            cpu0, ecpu0 = tree_cpu_s(placer.pid()), sum(e.cpu_s() for e in emus)
            t = time.time()
            for e in emus:
                await e.go()
            await _wait_up(c, placer.url, n, limit_s, emus)
            row.update(register_s=round(time.time() - t, 2), register_placer_cpu_s=round(tree_cpu_s(placer.pid()) - cpu0, 2),
                       register_emulator_cpu_s=round(sum(e.cpu_s() for e in emus) - ecpu0, 2))
            cold = await _counted(c, placer.url)
            row.update(register_nodes_lost=cold["nodes_lost"], register_mass_silences=cold["mass_silences"],
                       register_tls_handshakes=cold["tls_handshakes"], **await _enrolments(c, emus))
            row["register_closes"] = await _closes(c, placer.url, emus)
            _note("fleet up", nodes=n, s=row["register_s"], closes=json.dumps(row["register_closes"]))
            if cold_only:
                return row
            gang = {"job_id": "gang", "pods": gang_hosts, "gpus_per_pod": per_host, "argv": ["train"], "priority": 2,
                    "preemptible": False, "grace_s": 1.0}
            await _submit(c, [placer.url], gang, 60)
            g = await _job(c, placer.url, "gang", "running", limit_s)
            assert g["state"] == "running", g["state"]
            await trio.sleep(2 * heartbeat_s)   # the running events in
            # A loaded registration can lose nodes and end the gang's attempt while their pods run on
            # (told to stop when those nodes speak again): the restart starts from a settled fleet, one
            # running gang pod a host, so that what is stopped or placed after it is the restart's doing.
            t_settle = time.time()
            before = await _sum_stats(c, emus, "gang")
            while before["gang_running"] != gang_hosts and time.time() - t_settle < limit_s:
                await trio.sleep(heartbeat_s)
                before = await _sum_stats(c, emus, "gang")
            row["gang_settle_s"] = round(time.time() - t_settle, 2)
            row["relays"] = before["relays"]
            _note("gang running", hosts=gang_hosts)
            if steady_s > 0:
                # A restart in production comes to a fleet in its steady state, not to one still
                # working off a cold registration's backlog: the fleet left alone this long first,
                # the placer's and the emulators' CPU over that window reported.
                pc, ec, ts = tree_cpu_s(placer.pid()), sum(e.cpu_s() for e in emus), time.time()
                await trio.sleep(steady_s)
                dt = time.time() - ts
                row["steady_placer_cores"] = round((tree_cpu_s(placer.pid()) - pc) / dt, 3)
                row["steady_emulator_cores"] = round((sum(e.cpu_s() for e in emus) - ec) / dt, 3)
                _note("steady", s=round(dt, 1), placer_cores=row["steady_placer_cores"],
                      emulator_cores=row["steady_emulator_cores"])
            row["steady_s"] = steady_s

            t0 = time.time()
            placer.kill()
            placer.start()
            await placer.ready()
            t_listen = time.time()
            cpu1, ecpu1 = tree_cpu_s(placer.pid()), sum(e.cpu_s() for e in emus)
            row["restart_to_listening_s"] = round(t_listen - t0, 2)
            await _wait_up(c, placer.url, n, limit_s, emus)
            t_full = time.time()
            row["model_full_s"] = round(t_full - t_listen, 2)
            row["recovery_placer_cpu_s"] = round(tree_cpu_s(placer.pid()) - cpu1, 2)
            row["recovery_emulator_cpu_s"] = round(sum(e.cpu_s() for e in emus) - ecpu1, 2)
            row.update(await _counted(c, placer.url))
            hs = row["tls_handshakes"]
            row["handshake_bound"] = before["relays"] + math.ceil(0.01 * n)
            row["restart_closes"] = await _closes(c, placer.url, emus)
            _note("model full", s=row["model_full_s"], handshakes=hs, closes=json.dumps(row["restart_closes"]))

            probe = {"job_id": "probe", "pods": probe_gpus // per_host, "gpus_per_pod": per_host, "argv": ["probe"],
                     "grace_s": 1.0}
            await _submit(c, [placer.url], probe, 60)
            pj = await _job(c, placer.url, "probe", "running", limit_s)
            tm = pj["timings"]
            row["probe_state"] = pj["state"]
            row["probe_acked_s"] = round(tm["acked"] - tm["submitted"], 3) if "acked" in tm else None
            row["probe_from_listening_s"] = round(tm["acked"] - t_listen, 2) if "acked" in tm else None
            row["probe_target_s"] = recover_s + 2.0
            await trio.sleep(2 * heartbeat_s)
            after = await _sum_stats(c, emus, "gang")
            row.update({
                "stops": after["victims_told"] - before["victims_told"],
                "stops_by": {k: v - before["victims_by"].get(k, 0) for k, v in after["victims_by"].items()
                             if v != before["victims_by"].get(k, 0)},
                # the gang placed again after the kill: workloads of it the nodes did not have before
                "placements_doubled": after["gang_pods"] - before["gang_pods"],
                # every placement the nodes took after the kill beyond the probe's pods (a probe
                # rolled back and placed again on a loaded host counts here, not as doubled)
                "placements_extra": after["placements"] - before["placements"] - probe_gpus // per_host,
                "refused_acks": after["refused_acks"] - before["refused_acks"],
                "gang_running": after["gang_running"], "gang_running_before": before["gang_running"],
                "relayed_registrations": after["relayed_registrations"] - before["relayed_registrations"],
                "reregistrations": after["reregistrations"] - before["reregistrations"],
                "relay_held_answers": after["relay_held"] - before["relay_held"],
                "load_after": os.getloadavg()[0],
            })
            _note("done", model_full_s=row["model_full_s"], probe_from_listening_s=row["probe_from_listening_s"])
    finally:
        for e in emus:
            await e.__aexit__(None, None, None)
        placer.stop()
    return row


async def run_all(ns: argparse.Namespace) -> dict[str, Any]:
    rows = []
    # a 200,000-GPU gang on the 131,072-node fleet: 25,000 h100 hosts, 50,000 gb200 trays (scaled with N)
    gang = ns.gang_hosts or max(1, round(ns.nodes * (200_000 // GPUS_PER_HOST[ns.fleet]) / 131_072))
    base = ns.baseline_root
    with tempfile.TemporaryDirectory(prefix="herd-restart-") as d:
        root = Path(ns.workdir or d)
        runs = [(30.0, True)] + ([(0.0, True)] if ns.baseline else []) + ([(30.0, False)] if ns.baseline_compact else [])
        trees = [ROOT] + ([base] if base is not None else [])
        for i in range(ns.repeat):
            # alternated (this tree first, then the other, then the other way round): drift in the
            # machine's load hits both trees alike
            for tree in trees if i % 2 == 0 else trees[::-1]:
                for hold, compact in runs:
                    tag = f"hold{hold:g}-{int(compact)}" + (f"-{i}-{'base' if tree == base else 'this'}"
                                                           if base is not None or ns.repeat > 1 else "")
                    rows.append(await run_once(ns.nodes, fleet=ns.fleet, gang_hosts=gang, probe_gpus=ns.probe_gpus,
                                               tls=not ns.plain, relay_hold=hold, per_proc=ns.per_proc,
                                               recover_s=ns.recover_s, tmp=root / tag,
                                               limit_s=ns.limit_s, enroll=not ns.no_enroll, heartbeat_s=ns.heartbeat,
                                               compact=compact, enroll_workers=ns.enroll_workers,
                                               enroll_ecdh=ns.enroll_ecdh, steady_s=ns.steady_s, root=tree,
                                               cold_only=ns.cold_only))
    out: dict[str, Any] = {"bench": "restart", "cores": os.cpu_count(), "heartbeat_s": ns.heartbeat, "rows": rows}
    mine = [r for r in rows if r["tree"] == str(ROOT)]
    first = mine[0].get("model_full_s")
    for other in mine[1:len(runs)]:
        if first and other.get("model_full_s"):
            key = "hold_over_direct" if other["relay_hold_s"] == 0 else "compact_over_snapshots"
            out[f"model_full_ratio_{key}"] = round(first / other["model_full_s"], 2)
            out[f"recovery_placer_cpu_ratio_{key}"] = round(mine[0]["recovery_placer_cpu_s"]
                                                           / max(other["recovery_placer_cpu_s"], 1e-3), 2)
    if base is not None:
        # medians of the default runs (hold on, compact), this tree over the baseline's
        for k in ("register_s", "register_placer_cpu_s", "register_emulator_cpu_s", "register_tls_handshakes",
                  "register_direct", "model_full_s", "recovery_placer_cpu_s", "recovery_emulator_cpu_s"):
            a = [r[k] for r in mine if r["relay_hold_s"] and r["compact"] and k in r]
            b = [r[k] for r in rows if r["tree"] == str(base) and r["relay_hold_s"] and r["compact"] and k in r]
            if a and b:
                out[f"{k}_median"], out[f"base_{k}_median"] = statistics.median(a), statistics.median(b)
                out[f"{k}_ratio_over_base"] = round(statistics.median(a) / max(statistics.median(b), 1e-3), 3)
    return out


def print_table(out: dict[str, Any]) -> None:
    cols = ["nodes", "fleet", "tls", "enroll", "relay_hold_s", "compact", "register_s", "register_placer_cpu_s",
            "register_tls_handshakes", "register_direct",
            "model_full_s", "recovery_placer_cpu_s", "recovery_emulator_cpu_s", "compact_registrations",
            "tls_handshakes", "handshake_bound", "relayed_registrations", "probe_acked_s", "probe_from_listening_s",
            "probe_target_s", "stops", "placements_doubled", "refused_acks", "gang_running"]
    print(" ".join(f"{c:>12}" for c in cols))
    for r in out["rows"]:
        print(" ".join(f"{str(r.get(c, '-')):>12}" for c in cols))
    if "model_full_ratio_hold_over_direct" in out:
        print(f"model_full_s, relay hold / members direct: {out['model_full_ratio_hold_over_direct']}")
    for k, v in out.items():
        if k.endswith("_ratio_over_base"):
            m = k.removesuffix("_ratio_over_base")
            print(f"{m}: median {out[m + '_median']} against the baseline's {out['base_' + m + '_median']} (x{v})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--fleet", choices=["h100", "gb200"], default="h100")
    ap.add_argument("--gang-hosts", type=int, default=0, help="default: 200,000 GPUs scaled to the fleet")
    ap.add_argument("--probe-gpus", type=int, default=1024)
    ap.add_argument("--per-proc", type=int, default=16384, help="emulated nodes per emulator process")
    ap.add_argument("--recover-s", type=float, default=5.0)
    ap.add_argument("--heartbeat", type=float, default=HEARTBEAT_S, help="the placer's heartbeat interval (s)")
    ap.add_argument("--limit-s", type=float, default=600.0, help="bound on every wait")
    ap.add_argument("--plain", action="store_true", help="no TLS (the placer insecure)")
    ap.add_argument("--no-enroll", action="store_true",
                    help="TLS: members register over their own connection (a handshake each) instead of enrolling "
                         "through their relay")
    ap.add_argument("--enroll-ecdh", action="store_true",
                    help="members enrol by ECDH with their certificate's key (certificates issued without an enrolment "
                         "key) instead of with their enrolment key")
    ap.add_argument("--baseline", action="store_true", help="also the run with the members' relay hold off")
    ap.add_argument("--baseline-compact", action="store_true",
                    help="also the run with compact registration off (every full report carries its GPU snapshot)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--baseline-root", default=None, metavar="DIR",
                    help="also the same run by that tree's code (another checkout: its placer and emulators), "
                         "alternated with this tree's, medians and ratios printed")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each tree (alternated)")
    ap.add_argument("--enroll-workers", type=int, default=None,
                    help="the placer's enroll_workers (default: its own, one a core but the loop's, none below 4 cores; 0: in the loop)")
    ap.add_argument("--cold-only", action="store_true",
                    help="the cold registration only (no gang, no restart): its rows' register_* figures")
    ap.add_argument("--steady-s", type=float, default=0.0,
                    help="leave the fleet alone this long, the gang running, before the kill (its CPU reported): "
                         "a restart from a steady fleet rather than right after the cold registration")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    ns.baseline_root = Path(ns.baseline_root).resolve() if ns.baseline_root else None
    out = trio.run(run_all, ns)
    print_table(out)
    if ns.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
