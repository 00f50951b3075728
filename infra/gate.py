"""Open connections (or anything held open per client: the data plane's waiting requests)
counted overall and per client address (pure bookkeeping), shared by every server that
caps them: the HTTP layer and the data plane; and the one way
both turn away a connection past the caps (:func:`turn_away`)."""

from __future__ import annotations

import trio

__all__ = ["BUSY_ANSWER", "ConnectionGate", "turn_away"]

BUSY_ANSWER = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               b"retry-after: 1\r\nconnection: close\r\ncontent-length: 53\r\n\r\n"
               b'{"error":"busy","detail":"too many open connections"}')


async def turn_away(stream: trio.abc.Stream, *, plain: bool = True) -> None:
    """Answer 503 busy (at most half a second spent on it) and close the connection. On a
    TLS listener (``plain=False``) the connection is only closed: a canned answer in plain
    text would reach a TLS client as garbage ("wrong version number"), and a handshake to
    say "busy" inside TLS is the work being refused; the client sees the connection closed
    during its handshake and backs off."""
    if not plain:
        await trio.aclose_forcefully(stream)
        return
    with trio.move_on_after(0.5):
        try:
            await stream.send_all(BUSY_ANSWER)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await trio.aclose_forcefully(stream)


class ConnectionGate:
    """Counts open connections overall and per client address; pure bookkeeping."""

    def __init__(self, max_connections: int, max_per_client: int) -> None:
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.open = 0
        self.refused = 0
        self._per_client: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        n = self._per_client.get(client, 0)
        if self.open >= self.max_connections or n >= self.max_per_client:
            self.refused += 1
            return False
        self.open += 1
        self._per_client[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        self.open -= 1
        n = self._per_client[client] - 1
        if n:
            self._per_client[client] = n
        else:
            del self._per_client[client]
