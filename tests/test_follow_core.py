"""What one follower is sent of a node's reports (scheduler_link.follow.FollowerCopy): pure, no I/O."""

from __future__ import annotations

from scheduler_link.follow import FULL, OBSERVED, FollowerCopy, follower_wire_of
from scheduler_link.messages import NodeReport, WorkloadEvent


def beat(seq: int) -> NodeReport:
    return NodeReport(node_id="n", boot_id="b", seq=seq, full=False)


def news(seq: int) -> NodeReport:
    return NodeReport(node_id="n", boot_id="b", seq=seq, full=False,
                      events=[WorkloadEvent(workload_id="w", job_id="j", state="running", at=1.0)])


def full(seq: int) -> NodeReport:
    return NodeReport(node_id="n", boot_id="b", seq=seq)


def test_a_full_report_at_the_newest_sequence_first_then_every_report_in_order() -> None:
    f = FollowerCopy("http://p2")
    assert f.next(0.0) is None                       # nothing built yet
    f.offer(full(1))
    f.offer(beat(2))
    assert f.next(0.0) == FULL and f.made_full() == 2   # made at the newest sequence, never one of its own
    f.offer(beat(3))                              # built while the full one is out: queued behind it
    f.answered(full(2), OBSERVED)
    assert f.next(0.0) == beat(3) and not f.caught_up()
    f.answered(beat(3), OBSERVED)
    assert f.next(0.0) is None and f.caught_up() and (f.sent, f.fulls, f.gaps) == (2, 1, 0)


def test_a_gap_or_a_failure_asks_for_a_full_report_again() -> None:
    f = FollowerCopy("http://p2")
    f.offer(full(1))
    f.made_full()
    f.answered(full(1), OBSERVED)
    f.offer(beat(2))
    f.answered(beat(2), 409)                      # the follower lacks the node's state
    assert f.next(0.0) == FULL and f.gaps == 1 and not f.caught_up()
    f.made_full()
    f.answered(full(2), None)                     # no answer: the connection failed
    assert f.next(0.0) == FULL and f.gaps == 2
    f.made_full()
    f.answered(full(2), OBSERVED, need_full=True)   # taken, but it asks for a full report
    assert f.next(0.0) == FULL and f.gaps == 3


def test_a_queue_that_overflows_becomes_one_full_report() -> None:
    f = FollowerCopy("http://p2")
    f.offer(full(1))
    f.made_full()
    f.answered(full(1), OBSERVED)
    for s in range(2, 40):
        f.offer(news(s))
    assert f.next(0.0) == FULL and f.made_full() == 39 and f.gaps == 1


def test_reports_the_follower_took_from_the_node_itself_count() -> None:
    f = FollowerCopy("http://p2")
    f.offer(full(1))
    f.made_full()
    f.answered(full(1), OBSERVED)
    f.offer(beat(2))
    f.delivered(2)                                # the node's own link asked it (its 202)
    assert f.next(0.0) is None and f.caught_up()
    f.offer(beat(3))
    f.offer(beat(4))
    f.delivered(4)                                # (taken in sequence: it holds 3 too)
    assert f.next(0.0) is None and f.caught_up()


def test_the_followers_channel_comes_from_its_redirect() -> None:
    body = b'{"error": "not the leader", "leader": "http://a:1", "leader_wire": "tcp://a:2", "wire": "tcp://b:3"}'
    assert follower_wire_of(307, body) == "tcp://b:3"
    assert follower_wire_of(307, b'{"leader": "http://a:1"}') is None
    assert follower_wire_of(307, b'{"wire": "http://b:3"}') is None
    assert follower_wire_of(400, body) is None and follower_wire_of(307, b"<html>") is None


def test_empty_heartbeats_are_copied_the_newest_only_every_so_often() -> None:
    f = FollowerCopy("http://p2", empty_every_s=2.0)
    f.offer(full(1))
    f.made_full()
    f.answered(full(1), OBSERVED, now=10.0)
    f.offer(beat(2))
    f.offer(beat(3))
    assert f.next(11.0) is None and f.due() == 12.0     # not yet: the newest goes every 2 s
    assert f.next(12.0) == beat(3)                       # the newest only (a follower takes it past 2)
    f.answered(beat(3), OBSERVED, now=12.0)
    f.offer(beat(4))
    ev = NodeReport(node_id="n", boot_id="b", seq=5, full=False,
                    events=[WorkloadEvent(workload_id="w", job_id="j", state="running", at=1.0)])
    f.offer(ev)                                          # news: the pending empty one goes first, then it
    assert f.next(12.1) == beat(4)
    f.answered(beat(4), OBSERVED, now=12.1)
    assert f.next(12.1) == ev
    f.answered(ev, OBSERVED, now=12.2)
    f.offer(beat(6))
    assert not f.caught_up() and f.next(12.3) is None
    f.flush = True                                       # the node moves there: the pending one at once
    assert f.next(12.3) == beat(6)
    f.answered(beat(6), OBSERVED, now=12.3)
    assert f.caught_up()
