"""Open connections counted overall and per client address (pure bookkeeping), shared by
every server that caps connections: the HTTP layer and the data plane."""

from __future__ import annotations

__all__ = ["ConnectionGate"]


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
