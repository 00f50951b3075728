"""A light fleet: N real HTTP endpoints on loopback in one process (for bench.link).

Each endpoint answers ``POST /v1/placements`` with a PlacementAck (accepted), parsing
the request with h11 and the body with msgspec like an agent would; keep-alive is
honoured. Prints one JSON line ``{"urls": [...]}`` on stdout once every listener is
bound, then serves until stdin closes or ``--seconds`` pass.

    python -m bench.fleet_helper --n 1000 --seconds 120
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import h11
import msgspec
import trio

from scheduler_link.messages import Placement, PlacementAck

_dec = msgspec.json.Decoder(Placement)


async def handle(stream: trio.SocketStream, node_id: str) -> None:
    conn = h11.Connection(h11.SERVER)
    body = bytearray()
    try:
        async with stream:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(ev, h11.Data):
                    body += ev.data
                elif isinstance(ev, h11.EndOfMessage):
                    pl = _dec.decode(bytes(body))
                    body.clear()
                    ack = msgspec.json.encode(PlacementAck(placement_id=pl.placement_id, node_id=node_id,
                                                           accepted=True,
                                                           workloads=[p.workload_id for p in pl.pods]))
                    out = conn.send(h11.Response(status_code=200, headers=[
                        ("content-type", "application/json"), ("content-length", str(len(ack)))]))
                    out += conn.send(h11.Data(data=ack)) + conn.send(h11.EndOfMessage())
                    await stream.send_all(out)
                    conn.start_next_cycle()
                elif isinstance(ev, h11.ConnectionClosed):
                    return
    except (trio.BrokenResourceError, h11.ProtocolError, msgspec.DecodeError):
        return


async def main(n: int, seconds: float) -> None:
    async with trio.open_nursery() as nursery:
        urls = []
        for i in range(n):
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            urls.append(f"http://127.0.0.1:{port}")

            async def serve_one(ls: list[trio.SocketListener] = listeners, node: str = f"fleet-{i}") -> None:
                await trio.serve_listeners(partial(handle, node_id=node), ls)
            nursery.start_soon(serve_one)
        sys.stdout.write(json.dumps({"urls": urls}) + "\n")
        sys.stdout.flush()

        async def stdin_closed():
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()
        nursery.start_soon(stdin_closed)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=120)
    a = ap.parse_args()
    trio.run(main, a.n, a.seconds)
