"""Several placers, one leading: the placer service's side of etcd (``[placer] etcd = [...]``).

Every placer serves its API and campaigns (placer.election). The leader loads the jobs journal
from etcd (placer.etcdjournal, fenced by its epoch), recovers its jobs as a restarted placer
does, and places; the others place nothing and answer the routes of :data:`LOCAL_ROUTES`
themselves (health with who leads, status, metrics, certificate bootstrap), redirecting every
other request to the leader (307 with its URL; 503 while none is known). A leader that loses
its lease stops (:class:`~placer.errors.LeadershipLost`): restarted, it joins as a follower
with a fresh state, and meanwhile etcd refuses any journal write it still attempts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode

import msgspec
import trio

from infra.http import Handler, Request, Response

from .config import PlacerConfig
from .election import Election, Role
from .errors import LeadershipLost
from .etcd import EtcdClient, tls_context
from .etcdjournal import EtcdJournal, Fence

log = logging.getLogger("herd.placer.ha")

# what a follower answers itself; everything else goes to the leader
LOCAL_ROUTES = frozenset({("GET", "/healthz"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                          ("GET", "/v1/status"), ("POST", "/v1/pki/bootstrap"), ("POST", "/v1/pki/renew")})


class HighAvailability:
    """``await nursery.start(ha.run, url, on_promoted)`` once the API listens."""

    def __init__(self, cfg: PlacerConfig) -> None:
        self.cfg = cfg
        # one try of one member well inside a TTL, so that a hung member leaves time for the next
        self.client = EtcdClient(cfg.etcd, ssl_context=tls_context(cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key),
                                 attempt_timeout_s=max(1.0, cfg.etcd_lease_ttl_s / 2))
        self.prefix = cfg.etcd_prefix.encode()
        self.election: Election | None = None
        self.journal: EtcdJournal | None = None
        self.url = ""

    def leading(self) -> bool:
        """Place now: we lead, our lease holds, and our journal is loaded."""
        return self.journal is not None and self.election is not None and self.election.leading()

    def why_not_placing(self) -> str:
        if self.election is None or self.election.view.role is Role.IDLE:
            return "the placers are electing a leader; try again shortly"
        return "this placer leads but is loading the jobs journal; try again shortly"

    def health(self) -> dict[str, Any]:
        """Who leads and this placer's role, for /healthz, /v1/status, /metrics and
        ``herd placer status``: ``placing`` is whether it places now."""
        e = self.election
        if e is None:
            return {"role": "starting", "leader": None, "epoch": 0, "placing": False, "url": self.url,
                    "failovers": 0, "etcd_errors": self.client.errors}
        v = e.view
        role = ("follower" if v.role is Role.WAITING else "candidate" if v.role is Role.IDLE
                else "leader" if self.leading() else "promoting")   # promoting: loading the journal
        return {"role": role, "leader": v.leader or None, "epoch": v.leader_epoch, "placing": self.leading(),
                "url": self.url, "failovers": e.failovers, "etcd_errors": self.client.errors,
                "etcd": self.client.statistics(), "election": e.statistics()}

    async def run(self, url: str, on_promoted: Callable[[EtcdJournal], None], *,
                  task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign; on promotion load the journal, hand it to ``on_promoted`` and keep it
        written; raise :class:`LeadershipLost` when the lease goes. ``started()`` at once: the
        placer serves (as a candidate) while etcd is out of reach."""
        self.url = self.cfg.etcd_advertise or url
        self.election = Election(self.client, self.prefix + b"election/", self.url,
                                 ttl_s=self.cfg.etcd_lease_ttl_s)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self.election.run)
                log.info("campaigning url=%s etcd=%s", self.url, ",".join(self.cfg.etcd))
                task_status.started()
                view = await self.election.wait_leading()
                journal = await EtcdJournal.load(self.client, self.prefix, Fence(self.election.leader_key, view.epoch))
                await n.start(journal.run)
                self.journal = journal
                on_promoted(journal)
                log.info("leading epoch=%d jobs=%d", view.epoch, len(journal.jobs()))
                while self.election.view.leading:
                    await self.election.wait_change(self.election.view)
                raise LeadershipLost(f"placer {self.url} lost the leadership (epoch {view.epoch}); "
                                     "stopping so that a restart joins as a follower")
        finally:
            await self.client.aclose()

    def guard(self, handlers: Mapping[tuple[str, str], Handler]) -> dict[tuple[str, str], Handler]:
        """The handlers, each but :data:`LOCAL_ROUTES`'s answering only while we lead."""
        return {k: h if k in LOCAL_ROUTES else self._leader_only(h) for k, h in handlers.items()}

    def _leader_only(self, handler: Handler) -> Handler:
        async def h(req: Request) -> Response:
            if self.leading():
                return await handler(req)
            leader = self.election.view.leader if self.election is not None else ""
            if not leader or leader == self.url:   # Retry-After: clients ask again (scheduler_link.placers)
                return Response(status=503, headers=[("retry-after", "1")], body=msgspec.json.encode(
                    {"error": "no leader", "detail": self.why_not_placing(), "leader": None}))
            where = leader.rstrip("/") + req.path + (f"?{urlencode(req.query)}" if req.query else "")
            return Response(status=307, body=msgspec.json.encode({"error": "not the leader", "leader": leader}),
                            headers=[("location", where)])
        return h
