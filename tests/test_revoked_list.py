"""The signed deny-list (msgauth.BundleSigner.revoked): what a member behind a relay takes.
A list the placer did not sign, or one older than the list held, is refused -- a relay can
neither add or drop a node nor roll the list back; the relay keeps and hands down the newest."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from agent.beats import BeatBook
from infra.tls import Revoked
from scheduler_link.agent_link import AgentLink
from scheduler_link.messages import NodeReport, RackBeatReply, ReportReply
from scheduler_link.msgauth import BundleSigner, BundleVerifier

SIGNER = BundleSigner.generate()


def _link() -> tuple[AgentLink, Revoked]:
    link = AgentLink("http://placer", None, "n1", object(), heartbeat_s=1.0)
    link.revoked = Revoked()
    link.placer_key = SIGNER.public
    return link, link.revoked


@given(st.sampled_from(["add", "drop", "serial", "time"]))
def test_a_list_the_placer_did_not_sign_is_refused(change: str) -> None:
    rl = SIGNER.revoked(100.0, ["bad"], ["AB"])
    forged = {"add": msgspec.structs.replace(rl, nodes=["bad", "victim"]),
              "drop": msgspec.structs.replace(rl, nodes=[]),
              "serial": msgspec.structs.replace(rl, serials=[]),
              "time": msgspec.structs.replace(rl, issued_at=200.0)}[change]
    v = BundleVerifier(SIGNER.public)
    assert v.revoked_ok(rl) and not v.revoked_ok(forged)
    link, revoked = _link()
    link._take_revoked(ReportReply(revoked_signed=forged), relayed=True)
    assert revoked.nodes == frozenset() and link.revoked_refused == 1 and link._revoked_at == 0.0


def test_a_member_takes_only_a_newer_signed_list_and_never_an_unsigned_one_from_a_relay() -> None:
    link, revoked = _link()
    link._take_revoked(ReportReply(revoked_nodes=["x"], revoked_serials=[]), relayed=True)
    assert revoked.nodes == frozenset()                       # unsigned, through a relay: not taken
    link._take_revoked(ReportReply(revoked_signed=SIGNER.revoked(100.0, ["bad"], [])), relayed=True)
    assert revoked.nodes == frozenset({"bad"}) and link._revoked_at == 100.0
    link._take_revoked(ReportReply(revoked_signed=SIGNER.revoked(50.0, [], [])), relayed=True)
    assert revoked.nodes == frozenset({"bad"})                # an older list (a relay's replay): kept ours
    link._take_revoked(ReportReply(revoked_signed=SIGNER.revoked(150.0, [], [])), relayed=True)
    assert revoked.nodes == frozenset()                       # lifted, by a newer list
    link._take_revoked(ReportReply(revoked_nodes=["y"], revoked_serials=[]), relayed=False)
    assert revoked.nodes == frozenset({"y"})                  # unsigned over its own connection: as before


def test_the_relay_hands_down_the_newest_list_it_heard() -> None:
    book = BeatBook("z/b/r", 5.0)
    empty = NodeReport(node_id="m", boot_id="b", seq=1, full=False, mac=b"m" * 16)
    assert book.empty(empty).revoked_signed is None
    new, old = SIGNER.revoked(20.0, ["bad"], []), SIGNER.revoked(10.0, [], [])
    book.apply(RackBeatReply(revoked_signed=new))
    book.apply(RackBeatReply(revoked_signed=old))             # (answers crossing: the newest stays)
    assert book.empty(empty).revoked_signed == new
    book.answer("m", ReportReply(revoked_signed=SIGNER.revoked(30.0, [], [])))
    assert book.empty(empty).revoked_signed.issued_at == 30.0
