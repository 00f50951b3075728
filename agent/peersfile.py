"""The workload's peer list as a file (``HERD_PEERS_FILE``), never one environment string.

A 25,000-node gang's peers do not fit in the environment (the kernel refuses a single
string over 128 KiB at exec: E2BIG), and a placement no longer carries them: it carries
the node's rack and a few contacts, and the id of the gang's blob (DESIGN.md, Fleet scale).
Before a workload starts, the agent fetches the blob (from the placer today; from its relay
or a peer once relays exist), checks it against its id (``decode_gang_blob``) and writes one
line per member of the gang: ``node_id data_url zone/block/rack``, in the table's topology
order. If the blob cannot be had or does not match its id, the file lists what the
placement named, and a first line says the list is partial (``# partial``): a workload
that needs every peer can tell.

``HERD_PEERS`` (``node=url,...``) stays for small gangs only (at most ``ENV_PEERS_MAX``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from infra.durable import atomic_write
from scheduler_link.messages import GangBlob, Peer, PeerTable, decode_gang_blob

log = logging.getLogger("herd.agent.peers")

ENV_PEERS_MAX = 64
PEERS_FILE = "peers"

BlobFetcher = Callable[[str], Awaitable[bytes]]


def lines_from_blob(blob: GangBlob) -> bytes:
    t = blob.peers
    racks = t.racks
    return "".join(f"{n} {u} {racks[r]}\n" for n, u, r in zip(t.node_ids, t.data_urls, t.rack_of, strict=True)).encode()


def lines_from_peers(peers: Sequence[Peer], *, partial: bool) -> bytes:
    head = "# partial: the gang's blob was not available; these are the peers the placement named\n" if partial else ""
    return (head + "".join(f"{p.node_id} {p.data_url} {p.zone}/{p.block}/{p.rack}\n" for p in peers)).encode()


def write_file(path: Path, data: bytes) -> None:
    """Replace the peers file atomically, world-readable (the workload's user reads it; it
    holds no secret). Not fsynced: it is rewritten before every start, so a crash that
    loses it loses nothing a restart does not write again."""
    atomic_write(path, data, 0o644, sync=False)


async def gang_peers(blob_id: str | None, gang_nodes: int, peers: Sequence[Peer],
                     fetch: BlobFetcher | None) -> tuple[bytes, str, PeerTable | None]:
    """(peers file contents, where they came from: "placement" | "blob" | "partial", and the
    gang's whole peer table when the blob was had: the herd plans its trees over it, so every
    node of a big gang computes the same trees)."""
    if not blob_id or gang_nodes <= len(peers):
        return lines_from_peers(peers, partial=False), "placement", None
    if fetch is None:
        return lines_from_peers(peers, partial=True), "partial", None
    try:
        raw = await fetch(blob_id)
        blob = decode_gang_blob(raw, blob_id)
    except Exception as e:  # no answer, a wrong id, a corrupt blob: never used, said once
        log.warning("gang blob refused or unavailable blob=%s err=%s", blob_id[:16], e)
        return lines_from_peers(peers, partial=True), "partial", None
    return lines_from_blob(blob), "blob", blob.peers
