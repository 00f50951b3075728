"""Real agents over mutual TLS with a data plane, and random artifacts on a file origin:
shared by the data-plane security tests (reads by membership, read grants)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agent.config import AgentConfig
from agent.daemon import Agent
from agent.supervisor import SupervisorConfig
from p2p.origins import open_origin
from p2p.publish import publish


def secure_agent(tmp: Path, token_dir: Path, tls_pki: Any, node: str, origin: str, **kw: Any) -> Agent:
    """An agent with its own certificate (``tls_pki``), its data plane on loopback, reading ``origin``."""
    conf = AgentConfig(node_id=node, gpus="simulated:dgx-h100", state_dir=str(tmp / node), listen="127.0.0.1:0",
                       data_listen="127.0.0.1:0", token_dir=str(token_dir), tls_dir=str(tls_pki.node_dir(node)),
                       insecure=False, allowed_origins=(origin,), workloads=SupervisorConfig(shim_pool=0), **kw)
    return Agent(conf, env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "@nope"}, handle_signals=False)


async def publish_random(tmp: Path, origin: str, name: str) -> str:
    """A 5 MiB artifact ``name:v1`` of random bytes (past the chunker's 4 MiB largest chunk, so
    at least two chunks whatever the bytes: 3 MiB was now and then one); its manifest id."""
    src = tmp / f"src-{name}"
    src.mkdir()
    (src / "weights.bin").write_bytes(os.urandom(5 << 20))
    async with open_origin(origin) as o:
        return (await publish(src, o, f"{name}:v1")).manifest
