"""A relay's members' heartbeats, aggregated: pure bookkeeping, no I/O (see agent.relay).

An *empty* heartbeat (not full, no events, no snapshot, no manifests) says only "alive":
the relay answers it at once and keeps it as the member's pending entry (the latest only;
a skipped seq said nothing). Pending entries go up together in one ``RackBeat`` per
interval, and a member's pending entry goes up before any content report of that member,
so the placer sees each node's sequence in order. What the placer's ``RackBeatReply``
says of a member (``need_full``, fencing ``stop``) rides on the next answer to it; a stop
is told once, a need_full until a full report of that member went up.

Each pending entry keeps the member's own MAC of that heartbeat (``NodeReport.mac``: the
relay cannot make one, scheduler_link.msgauth.beat_mac); the beat carries it up in ``macs``.
"""

from __future__ import annotations

import msgspec

from scheduler_link.follow import is_empty
from scheduler_link.messages import NodeReport, RackBeat, RackBeatReply, ReportReply, RevokedList, Victim

__all__ = ["BeatBook", "is_empty"]   # (is_empty: scheduler_link.follow's, one definition for relays and copies)


class BeatBook:
    """Members' pending empty heartbeats and what the placer said of them (no I/O)."""

    def __init__(self, rack: str, heartbeat_s: float) -> None:
        self.rack = rack
        self.heartbeat_s = heartbeat_s
        self._pending: dict[str, tuple[str, int, bytes]] = {}   # node -> (boot, seq, mac), the latest empty one
        self._need_full: set[str] = set()
        self._stops: dict[str, list[Victim]] = {}
        self._plain: ReportReply | None = None   # the answer with nothing to say (frozen: shared)
        # the newest deny-list the placer signed (its answers to beats and reports): handed to
        # every member in the answers to its heartbeats; the members check the signature
        self.revoked: RevokedList | None = None
        # seqs per member: of the latest entry taken into a beat, and of its latest full report
        # forwarded: a beat's need_full for an entry older than a full report already gone up is
        # moot (after a placer restart each member's beat and its full report cross: without
        # this, every member sent its full report twice)
        self._taken: dict[str, int] = {}
        self._full_seq: dict[str, int] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def empty(self, rep: NodeReport) -> ReportReply:
        """Keep an empty heartbeat as the member's pending entry; the answer to give it now."""
        nid = rep.node_id
        self._pending[nid] = (rep.boot_id, rep.seq, rep.mac)
        if nid not in self._need_full and nid not in self._stops:   # (most answers: one shared reply)
            p = self._plain
            if p is None or p.heartbeat_interval_s != self.heartbeat_s or p.revoked_signed is not self.revoked:
                p = self._plain = ReportReply(ok=True, heartbeat_interval_s=self.heartbeat_s,
                                              revoked_signed=self.revoked)
            return p
        need = nid in self._need_full
        stop = self._stops.pop(nid, [])
        return ReportReply(ok=True, need_full=need, stop=stop, heartbeat_interval_s=self.heartbeat_s,
                           revoked_signed=self.revoked)

    def take_one(self, node_id: str, now: float) -> RackBeat | None:
        """The member's pending entry as a one-entry beat (to go before its content report)."""
        return self.take_some([node_id], now)

    def take_some(self, node_ids: list[str], now: float) -> RackBeat | None:
        """These members' pending entries as one beat (to go before their content reports)."""
        ids: list[str] = []
        boots: list[str] = []
        seqs: list[int] = []
        macs: list[bytes] = []
        for nid in node_ids:
            e = self._pending.pop(nid, None)
            if e is not None:
                self._taken[nid] = e[1]
                ids.append(nid)
                boots.append(e[0])
                seqs.append(e[1])
                macs.append(e[2])
        if not ids:
            return None
        return RackBeat(rack=self.rack, node_ids=ids, boot_ids=boots, seqs=seqs, sent_at=now, macs=macs)

    def take_all(self, now: float) -> RackBeat | None:
        if not self._pending:
            return None
        p, self._pending = self._pending, {}
        for nid, e in p.items():
            self._taken[nid] = e[1]
        return RackBeat(rack=self.rack, node_ids=list(p), boot_ids=[e[0] for e in p.values()],
                        seqs=[e[1] for e in p.values()], sent_at=now, macs=[e[2] for e in p.values()])

    def forwarded(self, rep: NodeReport) -> None:
        """A content report goes up: a full one answers any need_full."""
        if rep.full:
            self._need_full.discard(rep.node_id)
            self._full_seq[rep.node_id] = rep.seq

    def answer(self, node_id: str, reply: ReportReply) -> ReportReply:
        """The placer's answer to a member's content report, plus stops a beat_reply left for it."""
        self.took_revoked(reply.revoked_signed)
        if reply.heartbeat_interval_s:
            self.heartbeat_s = reply.heartbeat_interval_s
        stop = self._stops.pop(node_id, None)
        if not stop:
            return reply
        return msgspec.structs.replace(reply, stop=[*reply.stop, *stop])

    def took_revoked(self, rl: RevokedList | None) -> None:
        """A deny-list from the placer's answer: kept when newer (the members check it)."""
        if rl is not None and (self.revoked is None or rl.issued_at > self.revoked.issued_at):
            self.revoked = rl

    def apply(self, r: RackBeatReply) -> None:
        self.took_revoked(r.revoked_signed)
        if r.heartbeat_interval_s:
            self.heartbeat_s = r.heartbeat_interval_s
        full, taken = self._full_seq, self._taken
        self._need_full.update(nid for nid in r.need_full if full.get(nid, -1) < taken.get(nid, 0))
        for s in r.stop:
            self._stops.setdefault(s.node_id, []).extend(s.stop)

    def need_full(self, node_ids: list[str]) -> None:
        """These members are asked for a full report in the answer to their next heartbeat,
        whatever went up before (a placer refused the full report itself)."""
        self._need_full.update(node_ids)

    def reconnected(self) -> int:
        """The relay's connection up is new: what the placer on the other end holds of the
        members is unknown (a restarted placer holds nothing), so each member it has heard
        from is asked for a full report in the answer to its next heartbeat (compact where the
        placer kept its inventory: placer.inventories) instead of waiting for the placer's
        answer to the next beat. Returns how many were asked."""
        members = self._taken.keys() | self._pending.keys()
        self._need_full.update(members)
        return len(members)

    def forget(self, node_id: str) -> None:
        self._pending.pop(node_id, None)
        self._taken.pop(node_id, None)
        self._full_seq.pop(node_id, None)
