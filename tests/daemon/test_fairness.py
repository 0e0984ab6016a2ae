"""Requests read ahead of serving are served one per uid in turn, a uid's connections in turn."""

from __future__ import annotations

from hisparse.daemon.fairness import MAX_QUEUED, MAX_QUEUED_BYTES, FairQueue


def test_a_flooding_uid_gets_one_turn_per_round_like_everyone_else():
    q = FairQueue()
    for i in range(100):
        q.put(1000, b"flood-%d" % i, ("flood", i), 10)  # a connection each
    q.put(2000, b"engine", ("engine", 0), 10)
    q.put(None, b"?", ("unknown", 0), 10)  # a peer the kernel named no uid for is one more turn
    assert q.round() == [("flood", 0), ("engine", 0), ("unknown", 0)]
    assert q.count == 99 and q.nbytes == 990
    assert q.round() == [("flood", 1)]  # alone now: first come, first served
    q.put(2000, b"engine", ("engine", 1), 10)
    assert q.round() == [("flood", 2), ("engine", 1)]


def test_a_uids_connections_take_turns_and_each_keeps_its_order():
    q = FairQueue()
    for i in range(3):
        q.put(1000, b"flood", ("flood", i), 10)  # one connection pipelining
    q.put(1000, b"engine", ("engine", 0), 10)  # another of the same uid
    q.put(1000, b"engine", ("engine", 1), 10)
    order = [item for _ in range(5) for item in q.round()]
    assert order == [("flood", 0), ("engine", 0), ("flood", 1), ("engine", 1), ("flood", 2)]


def test_the_rest_of_a_sliced_request_comes_before_its_connections_later_requests():
    q = FairQueue()
    q.put(1000, b"a", ("a", "later"), 10)
    q.put_front(1000, b"a", ("a", "next slice"))
    q.put(2000, b"b", ("b", 0), 10)
    assert q.round() == [("a", "next slice"), ("b", 0)]
    assert q.round() == [("a", "later")]
    assert q.count == 0 and q.nbytes == 0


def test_reading_ahead_stops_at_its_count_or_bytes_and_drain_gives_back_everything():
    q = FairQueue()
    for i in range(MAX_QUEUED - 1):
        q.put(i % 3, b"c%d" % (i % 5), i, 1)
    assert q.room()
    q.put(0, b"c0", "last", 1)
    assert not q.room()
    assert sorted(map(str, q.drain())) == sorted(map(str, [*range(MAX_QUEUED - 1), "last"]))
    assert q.count == 0 and q.nbytes == 0 and q.room()
    q.put(7, b"c7", "big", MAX_QUEUED_BYTES)
    assert not q.room()
