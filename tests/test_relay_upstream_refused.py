"""A relay whose connection up fails its TLS handshake (a placer busy with a registration
storm resets handshakes it has no slot for) tries again; the relay -- and the agent or
emulator process it runs in -- never ends. At 131,072 emulated nodes enrolling at once, one
such reset ended a relay and, with it, its emulator process."""

from __future__ import annotations

import socket
import struct

import trio

from agent.blobs import BlobCache
from agent.relay import Relay
from infra import tls
from infra.auth import TokenSet
from testing.waiting import poll


async def _resetting_listener(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accepts and resets every connection (SO_LINGER 0): the handshake ends with ECONNRESET."""
    lst = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    task_status.started(lst.socket.getsockname()[1])
    async with lst:
        while True:
            s = await lst.accept()
            s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await s.aclose()


async def test_a_handshake_reset_by_the_placer_is_tried_again_not_the_relays_end(tmp_path, token_dir, tls_pki):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(20):
        async with trio.open_nursery() as n:
            port = await n.start(_resetting_listener)
            relay = Relay(node_id="r0n0", rack="z1/b1/r0", tokens=tokens, listen=None,
                          wire_url=lambda: f"tls://127.0.0.1:{port}", blobs=BlobCache(), heartbeat_s=0.1,
                          keys=lambda: (None, None), backoff_max_s=0.05,
                          security=tls.daemon_security(tls_pki.node_dir("r0n0"), "node", insecure=False))
            n.start_soon(relay.run)
            await poll(lambda: relay.failures >= 3, 0.01)   # three resets survived, still trying
            assert relay.upstream is None and relay.connects == 0
            n.cancel_scope.cancel()
