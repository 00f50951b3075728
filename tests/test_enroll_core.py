"""The relay core's enrolment queue (agent.relaycore, no I/O): over any interleaving of
members' enrolments, batches sent up, answers and lost connections, every queued enrolment is
answered exactly once, with the answer for its own node, and batches keep their bounds."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.relaycore import ENROLL_BATCH, ENROLL_BATCH_BYTES, EnrollBatch, RelayCore
from scheduler_link.messages import Enroll, EnrollAnswer


def _enroll(node: str, size: int = 100) -> Enroll:
    return Enroll(node_id=node, boot_id="b", nonce=b"n" * 16, at=0.0, cert=b"c" * 10, report=msgspec.Raw(b"x" * size))


def test_refused_at_once_for_another_node_or_with_no_connection_up() -> None:
    c = RelayCore(node_id="relay", rack="r")
    a = c.enroll("m1", _enroll("m2"), upstream=True)
    assert isinstance(a, EnrollAnswer) and a.outcome == "wrong_node"
    a = c.enroll("m1", _enroll("m1"), upstream=False)
    assert isinstance(a, EnrollAnswer) and a.outcome == "upstream_down"
    assert c.enrolls_refused == {"wrong_node": 1, "upstream_down": 1} and c.enrolls_queued == 0


def test_a_batch_is_bounded_in_entries_and_bytes() -> None:
    c = RelayCore(node_id="relay", rack="r")
    for i in range(ENROLL_BATCH + 10):
        assert isinstance(c.enroll(f"m{i}", _enroll(f"m{i}"), upstream=True), int)
    b = c.next_enrolls()
    assert b is not None and len(b.enrolls) == ENROLL_BATCH and c.enrolls_queued == 10
    big = RelayCore(node_id="relay", rack="r")
    for i in range(8):
        big.enroll(f"m{i}", _enroll(f"m{i}", size=ENROLL_BATCH_BYTES // 3), upstream=True)
    b = big.next_enrolls()
    assert b is not None and len(b.enrolls) == 2      # a third of the bound each (plus headers)


def test_answers_that_do_not_match_the_batch_make_every_ticket_unavailable() -> None:
    c = RelayCore(node_id="relay", rack="r")
    t1, t2 = c.enroll("m1", _enroll("m1"), upstream=True), c.enroll("m2", _enroll("m2"), upstream=True)
    b = c.next_enrolls()
    assert b is not None
    swapped = [EnrollAnswer(node_id="m2"), EnrollAnswer(node_id="m1")]
    got = c.enrolls_answered(b, swapped)
    assert [(t, a.outcome) for t, a in got] == [(t1, "unavailable"), (t2, "unavailable")]
    assert c.enrolls_refused == {"unavailable": 2}


OPS = st.lists(st.one_of(
    st.tuples(st.just("enroll"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("batch"), st.just(0), st.just(False)),
    st.tuples(st.just("answer"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("lost"), st.just(0), st.just(False))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_queued_enrolment_is_answered_exactly_once(ops: list[tuple[str, int, bool]]) -> None:
    c = RelayCore(node_id="relay", rack="r")
    queued: dict[int, str] = {}          # ticket -> node
    answered: dict[int, EnrollAnswer] = {}
    out: list[EnrollBatch] = []
    for op, k, flag in ops:
        if op == "enroll":
            node = f"m{k}"
            got = c.enroll(node, _enroll(node), upstream=flag)
            if isinstance(got, int):
                assert got not in queued
                queued[got] = node
            else:
                assert got.outcome == "upstream_down" and not flag
        elif op == "batch":
            b = c.next_enrolls()
            if b is not None:
                assert 0 < len(b.enrolls) <= ENROLL_BATCH
                out.append(b)
        elif op == "answer" and out:
            b = out.pop(min(k, len(out) - 1))
            answers = [EnrollAnswer(node_id=e.node_id) for e in b.enrolls] if flag else None
            for t, a in c.enrolls_answered(b, answers):
                assert t not in answered and queued[t] == a.node_id
                answered[t] = a
                assert a.outcome == ("enrolled" if flag else "unavailable")
        elif op == "lost":
            for t in c.enrolls_lost():
                assert t not in answered
                answered[t] = EnrollAnswer(node_id=queued[t], outcome="unavailable")
    in_flight = {t for b in out for t in b.tickets}
    assert not (set(answered) & in_flight)
    # what is neither answered nor out is still queued, in order
    left = [t for t in queued if t not in answered and t not in in_flight]
    assert c.enrolls_queued == len(left)
