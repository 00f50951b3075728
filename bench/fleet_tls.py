"""Registration over mutual TLS against the same registration without TLS, same run.

    python -m bench.fleet --tls --nodes 4096,16384 [--per-proc 4096] [--repeat 1] [--relays] [--json]
        [--modes enroll] [--baseline-root DIR]

Per row (N nodes) and per mode, a fresh ``herd placer run`` subprocess (framed channel on) and
``ceil(N / --per-proc)`` emulator processes (``python -m testing.fleet``). Every emulated node
opens its **own** framed connection to the placer (``--mux 0``: over TLS a node certificate
speaks only for its node, so connections cannot be shared), knowing the channel's URL as after
a placer restart; ``go`` starts them all at once.

- ``plain``: TCP, the cluster token in the hello (``insecure = true``): the baseline.
- ``tls``: TLS 1.3, mutual: each node presents its own certificate (ECDSA P-256, issued by a
  throwaway CA before ``go``, not timed), the placer its own; the placer checks the hello's
  node against the certificate.

``--relays``: the placer and the emulator in relay mode, as a fleet at this scale runs, and a
third mode in the same run:

- ``tls`` (the baseline): each member registers over its own connection (a handshake, the full
  report, its MAC key), then beats through its rack's relay;
- ``enroll``: each member registers *through* its rack's relay (``testing.fleet --enroll``;
  scheduler_link.enroll: the enrolment key issued with its certificate proves it, its keys
  come back sealed): the placer handshakes with the relays only;
- ``enroll_ecdh`` (only when asked for in ``--modes``): the same with members whose certificates
  came without an enrolment key (``--enroll-ecdh``): each enrols by ECDH with its certificate's
  key, and the placer checks each certificate's CA signature and makes an ECDH.

``--modes`` runs a subset of the modes; ``--baseline-root DIR`` (relay mode) adds
``enroll_base``, the enroll mode run by the tree at DIR (another checkout: its placer and its
emulators), alternated with the others in the same run, for ``*_ratio_enroll_over_base``.

Members beat through their rack's relay (emulated in-process, one frames connection per rack to the
placer, over TLS with the relay node's certificate); without it every node keeps its own
connection and beats on it, which costs the placer a TLS record and a report each beat.

The emulators run at a lower priority than the placer (``EMULATOR_NICE``), and their members
register with blocking ``ssl`` sockets in worker threads (``testing.fleet._register_blocking``:
the same wire as an agent's).

Figures: ``handshakes`` (the TLS handshakes the placer's framed channel completed),
``register_s`` (``go`` -> the placer's ``GET /v1/cluster`` counts N nodes up),
``placer_cpu_s`` (the placer's with its enrolment workers'; ``placer_loop_cpu_s`` its own process
alone, ``placer_workers_cpu_s`` the workers') and ``emulator_cpu_s`` (CPU time meanwhile, from ``/proc``), and per mode the medians
over ``--repeat`` runs, with the ratio tls / plain. The machine's load average is recorded with
every row (a shared machine: read the figures with it).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx

from infra.auth import generate_token_dir
from infra.pki import throwaway
from testing.harness import (
    DIRECT_DEFAULT,
    EmulatorProc,
    PlacerOptions,
    PlacerProc,
    proc_cpu_s,
    verify,
    wait_nodes_up,
)

# The emulators run 10 nicer than the placer, in both modes: on a fleet they are other machines,
# and here each member's wake-up (its blocking handshake thread, woken by the placer's send)
# preempted the placer mid-send. Consecutive runs, 16,384 nodes, quiet: 74-77 s with the
# emulators at the placer's priority, 65 s at +10, the placer's CPU about the same (59-62 CPU-s).
EMULATOR_NICE = 10


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and of its live children: the placer's with its enrolment
    workers (placer.enrollpool), whose CPU is the placer's as much as its loop's."""
    total = proc_cpu_s(pid)
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == pid:
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:   # (gone meanwhile)
            continue
        if int(fields[1]) == pid:   # its parent
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def register_once(n_nodes: int, mode: str, tmp: Path, *, per_proc: int, heartbeat_s: float,
                        limit_s: float, root: Path, relays: bool = False) -> dict[str, Any]:
    label = mode
    ecdh = mode == "enroll_ecdh"
    if mode in ("enroll_base", "enroll_ecdh"):   # the enroll mode, by the baseline tree (``root``) / by ECDH
        mode = "enroll"
    td = generate_token_dir(tmp / "tokens")
    pki_dir = None
    if mode in ("tls", "enroll"):
        pki_dir = tmp / "pki"
        if not (pki_dir / "ca.key").exists():
            throwaway(pki_dir)
    opts = PlacerOptions(heartbeat_s=heartbeat_s, lost_after_missed=1000, relays=relays,
                         tls_dir=str(pki_dir) if pki_dir else None,
                         # (registration without relays is measured past the default: no limit)
                         direct_max_nodes=0 if not relays and n_nodes > DIRECT_DEFAULT else None)
    viewer = {"authorization": f"Bearer {(td / 'viewer.token').read_text().strip()}"}
    row: dict[str, Any] = {"nodes": n_nodes, "mode": label, "relays": relays, "load_before": _load()}
    async with AsyncExitStack() as stack:
        placer = await stack.enter_async_context(PlacerProc(tmp / f"run-{mode}", td, opts, root=root))
        c = await stack.enter_async_context(httpx.AsyncClient(timeout=120, headers=viewer, verify=verify(pki_dir)))
        emus = []
        t_setup = time.perf_counter()
        procs = math.ceil(n_nodes / per_proc)
        # ~32 members registering at once over all the emulators (testing.fleet: tls_threads)
        tls_threads = ["--tls-threads", str(max(8, 32 // procs))] if pki_dir and relays else []
        if mode == "enroll":
            tls_threads += ["--enroll", *(["--enroll-ecdh"] if ecdh else [])]
        for k in range(procs):
            cnt = min(per_proc, n_nodes - k * per_proc)
            emus.append(await stack.enter_async_context(EmulatorProc(
                placer, td, nodes=cnt, offset=k * per_proc, mux=8 if relays else 0, known_wire=True, root=root,
                tls_dir=pki_dir, log_path=tmp / f"emu-{mode}-{k}.log", extra=(["--relays", *tls_threads] if relays else None),
                nice=EMULATOR_NICE)))
        row["emulator_setup_s"] = round(time.perf_counter() - t_setup, 2)
        cpu0, loop0 = tree_cpu_s(placer.pid), proc_cpu_s(placer.pid)
        ecpu0 = sum(e.cpu_s() for e in emus)
        for e in emus:
            await e.go()
        up, secs = await wait_nodes_up(c, placer.url, n_nodes, limit_s=limit_s)
        row.update(register_s=round(secs, 2), nodes_up=up, complete=up >= n_nodes,
                   placer_cpu_s=round(tree_cpu_s(placer.pid) - cpu0, 2), placer_loop_cpu_s=round(proc_cpu_s(placer.pid) - loop0, 2),
                   emulator_cpu_s=round(sum(e.cpu_s() for e in emus) - ecpu0, 2), placer_rss_mib=round(placer.rss_mib(), 1),
                   placer_fds=placer.fds(), load_after=_load())
        fc, cluster = {}, {}
        for _ in range(3):  # (a kept-alive connection the placer closed while idle: once more)
            try:
                r = await c.get(f"{placer.url}/v1/cluster", params={"detail": "0"})
                cluster = r.json()
                fc = cluster.get("framed_channel", {})
                break
            except httpx.HTTPError:
                continue
        row["placer_workers_cpu_s"] = round(row["placer_cpu_s"] - row["placer_loop_cpu_s"], 2)
        row["framed_channel"] = {k: v for k, v in fc.items() if k.startswith("tls_refused") or k in (
            "connections", "open_connections", "refused", "wrong_node", "tls_handshakes")}
        row["handshakes"] = int(fc.get("tls_handshakes", 0))
        if mode == "enroll":
            st = [await e.stats(c) for e in emus]
            row["enrolled"] = sum(int(x.get("enrolled", 0)) for x in st)
            refused: dict[str, int] = {}
            for x in st:
                for k, v in x.get("enroll_refused", {}).items():
                    refused[k] = refused.get(k, 0) + v
            row["enroll_refused"] = refused
            row["enroll_keyed"] = int(cluster.get("placer", {}).get("relays", {}).get("enroll", {}).get("keyed", 0))
    return row


async def run_tls_bench(nodes: list[int], *, per_proc: int, heartbeat_s: float, limit_s: float,
                        repeat: int, root: Path, tmp: Path, relays: bool = False,
                        modes: tuple[str, ...] | None = None, baseline_root: Path | None = None) -> dict[str, Any]:
    """``modes``: a subset of plain, tls, enroll (default all the relay mode has);
    ``baseline_root``: also ``enroll_base``, the enroll mode run by that tree (another
    checkout), alternated with the others in the same run."""
    out: dict[str, Any] = {"bench": "fleet_tls", "relays": relays, "rows": [], "summary": []}
    modes = modes or (("plain", "tls", "enroll") if relays else ("plain", "tls"))
    if baseline_root is not None:
        modes = (*modes, "enroll_base")
    for n in nodes:
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for i in range(repeat):
            # alternate the order, so drift in the machine's load hits every mode
            order = modes if i % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                row = await register_once(n, mode, tmp / f"n{n}-{i}-{mode}", per_proc=per_proc,
                                          heartbeat_s=heartbeat_s, limit_s=limit_s, relays=relays,
                                          root=baseline_root if mode == "enroll_base" and baseline_root else root)
                row["repeat"] = i
                runs[mode].append(row)
                out["rows"].append(row)
        summ: dict[str, Any] = {"nodes": n, "repeat": repeat, "relays": relays}
        for mode, rows in runs.items():
            summ[f"{mode}_register_s_median"] = statistics.median(r["register_s"] for r in rows)
            summ[f"{mode}_placer_cpu_s_median"] = statistics.median(r["placer_cpu_s"] for r in rows)
            summ[f"{mode}_placer_loop_cpu_s_median"] = statistics.median(r["placer_loop_cpu_s"] for r in rows)
            summ[f"{mode}_emulator_cpu_s_median"] = statistics.median(r["emulator_cpu_s"] for r in rows)
            summ[f"{mode}_handshakes_median"] = statistics.median(r["handshakes"] for r in rows)
            summ[f"{mode}_complete"] = all(r["complete"] for r in rows)
        t, tc = summ.get("tls_register_s_median"), summ.get("tls_placer_cpu_s_median")
        if "plain" in runs and t is not None and tc is not None:
            p, pc = summ["plain_register_s_median"], summ["plain_placer_cpu_s_median"]
            summ["register_ratio_tls_over_plain"] = round(t / p, 2) if p else None
            summ["placer_cpu_ratio_tls_over_plain"] = round(tc / pc, 2) if pc else None
        if tc is not None:
            summ["tls_placer_cpu_ms_per_node"] = round(1000 * tc / n, 3)
        if "enroll" in runs:
            ec, er = summ["enroll_placer_cpu_s_median"], summ["enroll_register_s_median"]
            summ["enroll_placer_cpu_ms_per_node"] = round(1000 * ec / n, 3)
            summ["enroll_emulator_cpu_ms_per_node"] = round(1000 * summ["enroll_emulator_cpu_s_median"] / n, 3)
            if t is not None and tc is not None:
                summ["register_ratio_enroll_over_tls"] = round(er / t, 2) if t else None
                summ["placer_cpu_ratio_enroll_over_tls"] = round(ec / tc, 2) if tc else None
            if "enroll_ecdh" in runs:   # keyed (this tree) against ECDH enrolment (this tree), same run
                for k in ("register_s", "placer_cpu_s", "placer_loop_cpu_s", "emulator_cpu_s"):
                    b = summ[f"enroll_ecdh_{k}_median"]
                    summ[f"{k.removesuffix('_s')}_ratio_enroll_over_ecdh"] = round(summ[f"enroll_{k}_median"] / b, 2) if b else None
            if "enroll_base" in runs:
                br, bc = summ["enroll_base_register_s_median"], summ["enroll_base_placer_cpu_s_median"]
                be = summ["enroll_base_emulator_cpu_s_median"]
                summ["register_ratio_enroll_over_base"] = round(er / br, 2) if br else None
                summ["placer_cpu_ratio_enroll_over_base"] = round(ec / bc, 2) if bc else None
                bl = summ["enroll_base_placer_loop_cpu_s_median"]
                summ["placer_loop_cpu_ratio_enroll_over_base"] = round(
                    summ["enroll_placer_loop_cpu_s_median"] / bl, 2) if bl else None
                summ["emulator_cpu_ratio_enroll_over_base"] = round(
                    summ["enroll_emulator_cpu_s_median"] / be, 2) if be else None
        out["summary"].append(summ)
    return out


def print_tls_table(out: dict[str, Any]) -> None:
    print("relays: " + ("on (members register over their own connection, then beat through their relay)"
                        if out.get("relays") else "off (every node beats on its own connection)"))
    print(f"{'nodes':>7} {'mode':>6} {'rep':>3} {'register_s':>10} {'placer_cpu_s':>12} {'loop_cpu_s':>10} {'emu_cpu_s':>9} {'up':>7} "
          f"{'handshakes':>10} {'emu_setup_s':>11} load(before->after)")
    for r in out["rows"]:
        print(f"{r['nodes']:>7} {r['mode']:>6} {r['repeat']:>3} {r['register_s']:>10} {r['placer_cpu_s']:>12} {r['placer_loop_cpu_s']:>10} "
              f"{r['emulator_cpu_s']:>9} {r['nodes_up']:>7} {r['handshakes']:>10} {r['emulator_setup_s']:>11} "
              f"{r['load_before']}->{r['load_after']}")
    print()
    for s in out["summary"]:
        if "register_ratio_enroll_over_base" in s:
            print(f"{s['nodes']:>7} nodes, enrolment through the relays, this tree / the baseline tree (medians): "
                  f"register {s['enroll_register_s_median']} / {s['enroll_base_register_s_median']} s "
                  f"(x{s['register_ratio_enroll_over_base']}), placer CPU {s['enroll_placer_cpu_s_median']} / "
                  f"{s['enroll_base_placer_cpu_s_median']} s (x{s['placer_cpu_ratio_enroll_over_base']}; its loop "
                  f"{s['enroll_placer_loop_cpu_s_median']} / {s['enroll_base_placer_loop_cpu_s_median']} s, "
                  f"x{s['placer_loop_cpu_ratio_enroll_over_base']}), emulators "
                  f"{s['enroll_emulator_cpu_s_median']} / {s['enroll_base_emulator_cpu_s_median']} s "
                  f"(x{s['emulator_cpu_ratio_enroll_over_base']})")
        if "register_ratio_enroll_over_ecdh" in s:
            print(f"{s['nodes']:>7} nodes, keyed enrolment / enrolment by ECDH (medians): register "
                  f"{s['enroll_register_s_median']} / {s['enroll_ecdh_register_s_median']} s "
                  f"(x{s['register_ratio_enroll_over_ecdh']}), placer CPU {s['enroll_placer_cpu_s_median']} / "
                  f"{s['enroll_ecdh_placer_cpu_s_median']} s (x{s['placer_cpu_ratio_enroll_over_ecdh']}), emulators "
                  f"{s['enroll_emulator_cpu_s_median']} / {s['enroll_ecdh_emulator_cpu_s_median']} s "
                  f"(x{s['emulator_cpu_ratio_enroll_over_ecdh']})")
        if "register_ratio_tls_over_plain" not in s:
            continue
        print(f"{s['nodes']:>7} nodes: register median plain {s['plain_register_s_median']} s, "
              f"tls {s['tls_register_s_median']} s (x{s['register_ratio_tls_over_plain']}); placer CPU "
              f"plain {s['plain_placer_cpu_s_median']} s, tls {s['tls_placer_cpu_s_median']} s; emulators "
              f"plain {s['plain_emulator_cpu_s_median']} s, tls {s['tls_emulator_cpu_s_median']} s "
              f"(x{s['placer_cpu_ratio_tls_over_plain']}; {s['tls_placer_cpu_ms_per_node']} ms/node over TLS)")
        if "register_ratio_enroll_over_tls" in s:
            print(f"{'':>7}        enrolment through the relays: register {s['enroll_register_s_median']} s "
                  f"(x{s['register_ratio_enroll_over_tls']} of tls), placer CPU {s['enroll_placer_cpu_s_median']} s "
                  f"({s['enroll_placer_cpu_ms_per_node']} ms/node, x{s['placer_cpu_ratio_enroll_over_tls']} of tls), "
                  f"emulators {s['enroll_emulator_cpu_s_median']} s, placer handshakes "
                  f"{s['enroll_handshakes_median']} (tls: {s['tls_handshakes_median']})")
