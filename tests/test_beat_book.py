"""agent.beats.BeatBook: a beat's need_full and a member's full report that crossed it."""

from __future__ import annotations

from agent.beats import BeatBook
from scheduler_link.messages import NodeReport, RackBeatReply


def _empty(seq: int) -> NodeReport:
    return NodeReport(node_id="x", boot_id="b", seq=seq, full=False, mac=b"m" * 16)


def test_a_need_full_for_an_entry_older_than_a_full_report_gone_up_is_moot() -> None:
    book = BeatBook("z/b/r", 5.0)
    book.empty(_empty(5))
    beat = book.take_all(1.0)
    assert beat is not None and beat.seqs == [5]
    book.forwarded(NodeReport(node_id="x", boot_id="b", seq=6, full=True))   # crossed the beat
    book.apply(RackBeatReply(need_full=["x"]))
    assert not book.empty(_empty(7)).need_full          # not a second full report


def test_a_need_full_for_an_entry_newer_than_the_last_full_report_stands() -> None:
    book = BeatBook("z/b/r", 5.0)
    book.forwarded(NodeReport(node_id="x", boot_id="b", seq=4, full=True))
    book.empty(_empty(5))
    assert book.take_all(1.0) is not None
    book.apply(RackBeatReply(need_full=["x"]))
    assert book.empty(_empty(6)).need_full


def _of(node: str, seq: int) -> NodeReport:
    return NodeReport(node_id=node, boot_id="b", seq=seq, full=False, mac=b"m" * 16)


def test_a_new_connection_up_asks_every_known_member_for_a_full_report_once() -> None:
    book = BeatBook("z/b/r", 5.0)
    book.empty(_of("x", 1))
    assert book.take_all(1.0) is not None   # x's entry went up before the connection was lost
    book.empty(_of("y", 1))                 # y's waits in the book
    assert book.reconnected() == 2
    assert book.empty(_of("x", 2)).need_full and book.empty(_of("y", 2)).need_full
    assert not book.empty(_of("z", 1)).need_full          # a member first heard after it: nothing to ask
    book.forwarded(NodeReport(node_id="x", boot_id="b", seq=3, full=True))
    assert not book.empty(_of("x", 4)).need_full          # its full report went up: asked once
    book.forget("y")
    assert book.reconnected() == 2                        # x and z; y left the rack
