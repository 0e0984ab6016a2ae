"""Holds (pure units) and Writes (on a real session's fence): who keeps a pin or a reservation, and when it goes."""

from __future__ import annotations

import pytest

from hisparse.client import attach
from hisparse.layout import KVLayout
from hisparse.vllm.holds import Holds, Release
from hisparse.vllm.writes import BUSY_RETRY_S, Writes


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def session(hisparsed):
    """A real daemon session (with its real fence), as the manager's reservations hold them."""
    client = attach("holds-test", KVLayout(1, 4, 16), socket=hisparsed.socket, capacity=64 * 1024)
    yield client.session
    client.close()


def test_a_hold_is_shared_by_requests_and_goes_with_the_last():
    holds = Holds(Clock())
    s = object()
    holds.want(b"k", "a")
    assert holds.take_wanted() == {b"k": {"a"}}
    assert holds.add(b"k", 7, s, {"a"}) is None
    assert holds.touch(b"k", "b")  # b looked it up too: a HIT for b
    assert holds.finish("a") == []  # b still wants it
    assert holds.finish("b") == [Release(b"k", 7, s)]
    assert b"k" not in holds


def test_a_bound_load_keeps_the_hold_past_its_request():
    holds = Holds(Clock())
    s = object()
    holds.add(b"k", 3, s, {"a"})
    assert holds.bind_load(b"k", "a") == 3
    assert holds.finish("a") == []  # the worker may still be copying
    assert holds.unbind_load(b"k", "a") == Release(b"k", 3, s)


def test_unused_holds_age_out_loaded_ones_do_not():
    clock = Clock()
    holds = Holds(clock)
    s = object()
    holds.add(b"idle", 1, s, {"a"})
    holds.add(b"busy", 2, s, {"b"})
    holds.bind_load(b"busy", "b")
    clock.now_s += 10
    assert holds.expired(5.0) == [Release(b"idle", 1, s)]
    assert b"busy" in holds


def test_a_second_pin_of_a_held_key_is_given_back():
    holds = Holds(Clock())
    s = object()
    holds.add(b"k", 4, s, {"a"})
    assert holds.add(b"k", 4, s, {"b"}) == Release(b"k", 4, s)
    assert holds.touch(b"k", "b") and holds.finish("a") == []


def test_holds_of_a_lost_session_are_forgotten():
    holds = Holds(Clock())
    old, new = object(), object()
    holds.add(b"x", 1, old, {"a"})
    holds.add(b"y", 2, new, {"a"})
    assert holds.drop_session(lambda s: s is new) == [b"x"]
    assert b"x" not in holds and b"y" in holds


def test_a_reservation_holds_its_fence_until_the_worker_is_done(session):
    writes = Writes(Clock())
    s = session
    base = s.fence.refs  # the session being current
    assert writes.add([b"a", b"b"], [5, 6], s)
    assert s.fence.refs == base + 2
    writes.worker_done([b"a"], success=True)  # committing: the fence reference goes
    writes.worker_done([b"b"], success=False)  # dropped
    assert s.fence.refs == base and b"a" in writes and b"b" not in writes
    assert writes.committed([b"a"], [b"a"]) == [(b"a", 5)]
    assert len(writes) == 0


def test_a_reservation_on_a_let_go_fence_is_refused(hisparsed):
    client = attach("holds-test", KVLayout(1, 4, 16), socket=hisparsed.socket, capacity=64 * 1024)
    s = client.session
    client.close()  # the session's fence is let go
    writes = Writes(Clock())
    assert not writes.add([b"a"], [1], s)
    assert len(writes) == 0


def test_busy_keys_answer_for_a_while():
    clock = Clock()
    writes = Writes(clock)
    writes.mark_busy(b"k")
    assert writes.busy(b"k")
    clock.now_s += BUSY_RETRY_S
    assert not writes.busy(b"k")


def test_reset_keeps_commits_under_way_and_hands_back_the_rest(session):
    writes = Writes(Clock())
    s = session
    writes.add([b"a", b"b"], [1, 2], s)
    writes.worker_done([b"a"], success=True)
    aborts, fences = writes.reset()
    assert aborts == [(s, [b"b"])] and fences == [s.fence]
    assert b"a" in writes and b"b" not in writes
    for fence in fences:  # what on_reset_flushed does
        fence.release()


def test_wanted_keys_of_a_finished_request_are_not_pinned():
    holds = Holds(Clock())
    holds.want(b"k", "a")
    holds.want(b"k", "b")
    holds.finish("a")
    assert holds.take_wanted() == {b"k": {"b"}}
