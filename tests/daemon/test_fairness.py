"""Requests read ahead of serving are served one per uid in turn."""

from __future__ import annotations

from hisparse.daemon.fairness import MAX_QUEUED, MAX_QUEUED_BYTES, FairQueue


def test_a_flooding_uid_gets_one_turn_per_round_like_everyone_else():
    q = FairQueue()
    for i in range(100):
        q.put(1000, ("flood", i), 10)
    q.put(2000, ("engine", 0), 10)
    q.put(None, ("unknown", 0), 10)  # a peer the kernel named no uid for is one more turn
    assert q.round() == [("flood", 0), ("engine", 0), ("unknown", 0)]
    assert q.count == 99 and q.nbytes == 990
    assert q.round() == [("flood", 1)]  # alone now: first come, first served
    q.put(2000, ("engine", 1), 10)
    assert q.round() == [("flood", 2), ("engine", 1)]


def test_reading_ahead_stops_at_its_count_or_bytes_and_drain_gives_back_everything():
    q = FairQueue()
    for i in range(MAX_QUEUED - 1):
        q.put(i % 3, i, 1)
    assert q.room()
    q.put(0, "last", 1)
    assert not q.room()
    assert sorted(map(str, q.drain())) == sorted(map(str, [*range(MAX_QUEUED - 1), "last"]))
    assert q.count == 0 and q.nbytes == 0 and q.room()
    q.put(7, "big", MAX_QUEUED_BYTES)
    assert not q.room()
