"""Flow-level (fluid) model of the herd at fleet scale: up to 10,000 nodes in racks
behind an oversubscribed spine.

    python -m bench.herd_sim [--nodes 8,64,1024,10000] [--size-mb 2048] [--chunk-mb 4]
                             [--rack-size 32] [--link-gbit 100] [--origin-gbit 100]
                             [--oversub 4] [--json]

What is modelled. Every chunk of the artifact gets its homes from the real pure
functions the fetcher uses (``p2p.rendezvous``: balanced global homes with
``assign_homes``, rack homes = the top-ranked node of each rack in the same order).
Walking every chunk gives the bytes each resource must carry:

- the origin's egress;
- each node's uplink (a global home sends to the other racks' rack homes; a rack
  home sends to its rack-mates) and downlink (every node receives every chunk once);
- each rack's uplink to the spine, out and in (capacity = rack nodes x link / oversub).

In a fluid model with the transfers pipelined chunk by chunk, completion is the most
loaded resource's bytes / capacity, plus the pipeline fill (one chunk time per
store-and-forward hop). The same is computed for (a) origin only (N copies through the
origin) and (b) a flat herd that ignores racks (everyone pulls from the global home).
It models bandwidth and real home placement (including its imbalance); it does not
model TCP, latency, failures or CPU (bench/herd.py measures a real herd on shaped links).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from p2p.rendezvous import assign_homes, assign_rack_homes, chunk_key, node_key, scores_np


def simulate(nodes: int, size_mb: float, chunk_mb: float, rack_size: int, link_gbit: float,
             origin_gbit: float, oversub: float, seed: int = 0, balanced: bool = True) -> dict[str, Any]:
    rack_size = max(1, min(rack_size, nodes))
    n_chunks = max(1, int(round(size_mb / chunk_mb)))
    csize = size_mb * (1 << 20) / n_chunks
    size = csize * n_chunks
    ids = [f"node-{i:05d}" for i in range(nodes)]
    rack = np.arange(nodes) // rack_size
    n_racks = int(rack[-1]) + 1
    rack_nodes = np.bincount(rack, minlength=n_racks)
    chunk_ids = [f"{seed:08x}{i:056x}" for i in range(n_chunks)]
    # chunk ids are BLAKE3 hex in real life: hash the index so keys are uniform here too
    chunk_ids = [format(node_key(c), "016x") * 4 for c in chunk_ids]

    link = link_gbit * 1e9 / 8                      # bytes/s
    origin_rate = origin_gbit * 1e9 / 8
    rack_cap = rack_nodes * link / oversub

    homes = (assign_homes([(c, int(csize)) for c in chunk_ids], ids) if balanced else
             {c: ids[int(np.argmax(scores_np(chunk_key(c), np.array([node_key(n) for n in ids],
                                                                      dtype=np.uint64))))]
              for c in chunk_ids})
    index = {n: i for i, n in enumerate(ids)}
    keys = np.array([node_key(n) for n in ids], dtype=np.uint64)

    up_rack = np.zeros(nodes)       # node uplink bytes, rack-aware herd
    up_flat = np.zeros(nodes)       # node uplink bytes, flat herd
    rack_out = np.zeros(n_racks)
    rack_in = np.zeros(n_racks)
    rack_in_flat = np.zeros(n_racks)
    rack_out_flat = np.zeros(n_racks)
    pad = n_racks * rack_size - nodes
    chunk_list = [(c, int(csize)) for c in chunk_ids]
    if balanced:
        # what the fetcher does: balanced rack homes per rack (assign_rack_homes)
        per_rack = [assign_rack_homes(chunk_list, ids[r * rack_size:(r + 1) * rack_size], homes,
                                      n_racks=n_racks)
                    for r in range(n_racks)]
    for c in chunk_ids:
        g = index[homes[c]]
        gr = rack[g]
        if balanced:
            rhome = np.array([index[per_rack[r][c]] for r in range(n_racks)])
        else:  # plain rendezvous: the top-ranked node of each rack
            sc = scores_np(chunk_key(c), keys).astype(np.float64)
            sc[g] = np.inf
            grid = np.concatenate([sc, np.full(pad, -np.inf)]).reshape(n_racks, rack_size)
            rhome = grid.argmax(axis=1) + np.arange(n_racks) * rack_size
        # rack-aware: G -> other racks' homes (cross the spine once per rack); rack homes -> mates
        up_rack[g] += csize * (n_racks - 1)
        np.add.at(up_rack, rhome, csize * (rack_nodes - 1))
        rack_out[gr] += csize * (n_racks - 1)
        rack_in += csize
        rack_in[gr] -= csize
        # flat: every node pulls from G
        up_flat[g] += csize * (nodes - 1)
        rack_out_flat[gr] += csize * (nodes - rack_nodes[gr])
        rack_in_flat += csize * rack_nodes
        rack_in_flat[gr] -= csize * rack_nodes[gr]

    down = size                                      # every node receives every byte once
    ideal = size / link
    hop = csize / link

    bottleneck: dict[str, str] = {}

    def completion(name: str, origin_bytes: float, up: np.ndarray | None, r_in: np.ndarray | None,
                   r_out: np.ndarray | None, hops: int) -> float:
        t = {"origin egress": origin_bytes / origin_rate, "node downlink": down / link}
        if up is not None:
            t["node uplink"] = float(up.max()) / link
        if r_in is not None and n_racks > 1:
            t["rack uplink in"] = float((r_in / rack_cap).max())
        if r_out is not None and n_racks > 1:
            t["rack uplink out"] = float((r_out / rack_cap).max())
        bottleneck[name] = max(t, key=lambda k: t[k])
        return max(t.values()) + hops * hop

    # origin only: every node pulls everything from the origin, through its rack uplink
    oo_rack_in = rack_nodes * size
    t_origin = completion("origin", nodes * size, None, oo_rack_in if n_racks > 1 else None, None, 1)
    t_herd = completion("herd", size, up_rack, rack_in, rack_out, 3 if n_racks > 1 else 2)
    t_flat = completion("flat", size, up_flat, rack_in_flat, rack_out_flat, 2)
    home_load = np.bincount([index[h] for h in homes.values()], minlength=nodes) * csize
    return {
        "nodes": nodes, "racks": n_racks, "rack_size": rack_size, "size_mb": size_mb, "chunks": n_chunks,
        "ideal_s": round(ideal, 4),
        "herd_completion_over_ideal": round(t_herd / ideal, 3),
        "herd_origin_egress_over_size": 1.0,
        "origin_only_completion_over_ideal": round(t_origin / ideal, 3),
        "origin_only_origin_egress_over_size": float(nodes),
        "flat_herd_completion_over_ideal": round(t_flat / ideal, 3),
        "cross_rack_in_per_rack_over_size": round(float(rack_in.mean()) / size, 3) if n_racks > 1 else 0.0,
        "cross_rack_in_per_rack_max_over_size": round(float(rack_in.max()) / size, 3) if n_racks > 1 else 0.0,
        "flat_cross_rack_in_per_rack_over_size": round(float(rack_in_flat.mean()) / size, 3)
        if n_racks > 1 else 0.0,
        "max_home_bytes_over_mean": round(float(home_load.max() / max(home_load.mean(), 1e-9)), 3),
        "max_uplink_over_size": round(float(up_rack.max()) / size, 3),
        "herd_bottleneck": bottleneck["herd"], "flat_bottleneck": bottleneck["flat"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.herd_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,16,64,256,1024,4096,10000")
    p.add_argument("--size-mb", type=float, default=2048)
    p.add_argument("--chunk-mb", type=float, default=4)
    p.add_argument("--rack-size", type=int, default=32)
    p.add_argument("--link-gbit", type=float, default=100)
    p.add_argument("--origin-gbit", type=float, default=100)
    p.add_argument("--oversub", type=float, default=4, help="rack uplink oversubscription (N:1)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        sweep = [int(x) for x in a.nodes.split(",") if x.strip()]
    except ValueError:
        p.error("--nodes: comma-separated integers")
    if not sweep or any(not 1 <= n <= 20000 for n in sweep):
        p.error("--nodes: each between 1 and 20000")
    if a.size_mb <= 0 or a.chunk_mb <= 0 or a.size_mb / a.chunk_mb > 20000:
        p.error("--size-mb/--chunk-mb: positive, at most 20000 chunks")
    if a.rack_size < 1 or a.link_gbit <= 0 or a.origin_gbit <= 0 or a.oversub <= 0:
        p.error("--rack-size, --link-gbit, --origin-gbit, --oversub must be positive")
    t0 = time.perf_counter()
    rows = [simulate(n, a.size_mb, a.chunk_mb, a.rack_size, a.link_gbit, a.origin_gbit, a.oversub)
            for n in sweep]
    out = {"model": "fluid bottleneck + store-and-forward fill, real rendezvous homes",
           "link_gbit": a.link_gbit, "origin_gbit": a.origin_gbit, "oversub": a.oversub,
           "rows": rows, "seconds": round(time.perf_counter() - t0, 2)}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"herd flow model: {a.size_mb:g} MiB in {a.chunk_mb:g} MiB chunks, {a.link_gbit:g} Gbit/s links, "
          f"origin {a.origin_gbit:g} Gbit/s, racks of {a.rack_size} at {a.oversub:g}:1")
    hdr = (f"{'nodes':>6} {'racks':>5} {'herd/ideal':>10} {'flat/ideal':>10} {'origin/ideal':>12} "
           f"{'egress/S':>8} {'xrack in/S':>10} {'flat xrack/S':>12} {'max home/mean':>13}")
    print(hdr)
    for r in rows:
        print(f"{r['nodes']:>6} {r['racks']:>5} {r['herd_completion_over_ideal']:>10.3f} "
              f"{r['flat_herd_completion_over_ideal']:>10.3f} {r['origin_only_completion_over_ideal']:>12.2f} "
              f"{r['herd_origin_egress_over_size']:>8.2f} {r['cross_rack_in_per_rack_over_size']:>10.3f} "
              f"{r['flat_cross_rack_in_per_rack_over_size']:>12.2f} {r['max_home_bytes_over_mean']:>13.2f}  "
              f"{r['herd_bottleneck']}")
    print(f"({out['seconds']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
