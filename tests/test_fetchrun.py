"""p2p.fetchrun, pure: the herd's fetch run decides what to take next, how many peer
bodies may flow in, when the endgame starts and when to sync, from its counters alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from p2p.fetchrun import OWN, REST, FetchRun


@dataclass
class _Plan:
    """A planner's surface: chunks < done are planned; homes are the even indexes."""
    done: int = 0

    def is_home(self, c: int) -> bool:
        return c % 2 == 0


def _run(**kw: int) -> FetchRun:
    args = {"workers": 4, "endgame": 1, "sync_every_bytes": 100, "home_gate": 2, **kw}
    return FetchRun(**args)


def test_planned_blocks_fill_the_queues_in_manifest_order() -> None:
    fr = _run()
    todo = [(f"c{i}", 10) for i in range(6) if i != 3]         # c3 is in the store already
    cindex = {f"c{i}": i for i in range(6)}
    plan = _Plan()
    assert fr.add_planned(plan, todo, cindex) == 0 and fr.take(OWN) is None and not fr.exhausted(OWN)
    plan.done = 4
    assert fr.add_planned(plan, todo, cindex) == 3              # c0 c1 c2 (c3 is not to do)
    assert fr.own == [("c0", 10), ("c2", 10)] and fr.rest == [("c1", 10)]
    plan.done = 6
    assert fr.add_planned(plan, todo, cindex) == 2
    assert fr.own == [("c0", 10), ("c2", 10), ("c4", 10)] and fr.rest == [("c1", 10), ("c5", 10)]
    assert fr.add_planned(plan, todo, cindex) == 0              # nothing twice


def test_take_finish_and_exhaust() -> None:
    fr = _run(own=[("a", 1)], rest=[("b", 1), ("c", 1)])
    assert fr.take(OWN) == ("a", 1) and fr.outstanding == 1 and fr.own_active == 1
    assert fr.take(OWN) is None and not fr.exhausted(OWN)       # open: more may come
    fr.close()
    assert fr.exhausted(OWN) and not fr.exhausted(REST)
    fr.finished(OWN)
    assert fr.outstanding == 0 and fr.own_active == 0
    assert fr.take(REST) == ("b", 1) and fr.take(REST) == ("c", 1) and fr.exhausted(REST)
    assert fr.outstanding == 2 and fr.own_active == 0


def test_pool_sizes_open_and_closed() -> None:
    fr = _run(own=[("a", 1)], rest=[("b", 1)])
    assert fr.pool_sizes(own_workers=8) == (8, 4)               # still being filled: whole pools
    fr.close()
    assert fr.pool_sizes(own_workers=8) == (1, 1)               # closed: no more workers than chunks


def test_gate_is_narrow_while_this_node_may_still_read_the_origin() -> None:
    fr = _run(own=[("a", 1)], rest=[("b", 1)])
    assert fr.gate_tokens() == 2                                # open run: more own chunks may come
    fr.close()
    assert fr.gate_tokens() == 2                                # an own chunk not taken yet
    fr.take(OWN)
    assert fr.gate_tokens() == 2                                # ... being read
    fr.finished(OWN)
    assert fr.gate_tokens() == 4                                # done as a home: the whole window


def test_endgame_only_when_closed_taken_and_few_outstanding() -> None:
    fr = _run(endgame=1, rest=[("a", 1), ("b", 1)])
    fr.take(REST)
    fr.take(REST)
    assert not fr.in_endgame()                                  # not closed
    fr.close()
    assert not fr.in_endgame()                                  # 2 outstanding > 1
    fr.finished(REST)
    assert fr.in_endgame()


def test_batched_syncs_never_two_at_once() -> None:
    fr = _run(sync_every_bytes=100)
    assert not fr.stored(60)
    assert fr.stored(60)                                        # 120 >= 100: sync now
    assert not fr.stored(200)                                   # one already running
    fr.synced()
    assert fr.stored(1)                                         # 201 waiting: the next one


def test_first_failure_is_kept() -> None:
    fr = _run()
    a, b = RuntimeError("a"), RuntimeError("b")
    assert fr.fail(a) and not fr.fail(b) and fr.failure is a


@pytest.mark.parametrize("bad", [0, -3])
def test_windows_are_at_least_one(bad: int) -> None:
    fr = _run(workers=bad, home_gate=bad)
    fr.close()
    assert fr.gate_tokens() == 1


def test_take_more_scans_ahead_out_of_order_and_the_pointer_skips_what_it_took() -> None:
    """A waiting batch takes one parent's next chunks from among the queued ones (they
    interleave with other parents'); take() and the endgame then skip those."""
    q = [(f"c{i}", 10) for i in range(8)]
    fr = _run(rest=list(q), endgame=0)
    fr.close()
    first = fr.take(REST)
    assert first == ("c0", 10)
    even = fr.take_more(REST, lambda c: int(c[1:]) % 2 == 0, 10, 1000, scan=5)
    assert even == [("c2", 10), ("c4", 10)]              # c1 does not fit; c6 is past the scan
    assert fr.outstanding == 3 and fr.picked[REST] == {2, 4}
    assert fr.take_more(REST, lambda c: True, 2, 15, scan=8) == [("c1", 10)]   # the bytes bound
    assert fr.take(REST) == ("c3", 10)                    # c2 was taken: skipped
    assert fr.take(REST) == ("c5", 10)                    # and c4
    assert not fr.in_endgame()
    assert fr.take_more(REST, lambda c: c == "c7", 3, 100, scan=0) == []        # in order only: c6 first
    assert fr.take_more(REST, lambda c: c == "c7", 3, 100, scan=4) == [("c7", 10)]
    assert fr.take(REST) == ("c6", 10) and fr.take(REST) is None and fr.exhausted(REST)
    assert fr.taken[REST] == len(q) and not fr.picked[REST] and fr.outstanding == 8
    for _ in range(8):
        fr.finished(REST)
    assert fr.in_endgame()
