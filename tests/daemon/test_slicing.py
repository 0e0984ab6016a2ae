"""Large writes are served in slices: others are served between them, and a sliced request is
as safe as a whole one (refusals change nothing, an ended session stops it, no page is lost)."""

from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import time

import pytest

from benchmarks._common import PEER, call as acall
from hisparse import KVLayout, protocol
from hisparse.daemon.conf import config
from hisparse.daemon.ops.handlers import DaemonContext
from hisparse.daemon.store.namespaces import Registry
from hisparse.daemon.policy.peers import Peer
from hisparse.daemon.store.sessions import SessionTable
from hisparse.daemon.front.dispatch import dispatch, resume
from hisparse.daemon.ops.slicing import SLICE_KEYS, Sliced
from hisparse.daemon.ops.writes import CHECK_SLICE
from hisparse.protocol import ErrorCode, Op
from hisparse.shm.fence import fence_dir_for
from hisparse.shm.table import WRITING
from tests.daemon import test_server
from tests.rawclient import keys_for

LAYOUT = KVLayout(1, 1, 64)
N = 4 * SLICE_KEYS + 100  # five slices
inproc = test_server.inproc  # the fixture: the real Server loop on a socket, in a thread


def test_another_connections_requests_are_served_between_a_large_writes_slices(inproc):
    """Timing-free: a stats reply that sees a write in slices was served between two of them.
    Same uid, two connections: a uid's connections take turns too."""
    ctx, _, client, _ = inproc
    writer, watcher = client(), client()
    writer.hello("big", LAYOUT, capacity_bytes=64 * 2 * protocol.MAX_KEYS_PER_REQUEST)
    watcher.hello("big", LAYOUT)
    keys = keys_for("k", protocol.MAX_KEYS_PER_REQUEST)
    seen = 0
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        writer.next_id += 1
        writer.sock.send(protocol.encode_request(Op.RESERVE, writer.next_id, session=writer.session, keys=keys))
        while not writer.sock.poll(0):  # the watcher asks while the reserve is served
            seen = max(seen, watcher.call(Op.STATS)["daemon"]["requests_in_slices"])
        reply = protocol.decode_reply(writer.sock.recv()).result()
        assert len(reply["slots"]) == len(keys) and min(reply["slots"]) >= 0
        assert writer.call(Op.ABORT, keys=keys)["aborted"] == len(keys)
    assert seen == 1, "no request was served while a 16,384-key reserve was in slices"
    daemon = watcher.call(Op.STATS)["daemon"]
    assert daemon["requests_in_slices"] == 0 and daemon["request_slices"] >= 31


def test_a_request_in_slices_when_the_daemon_stops_is_finished_and_answered(inproc):
    """SIGTERM drains: a write begun in slices is served to its end and answered in full, not
    left half done or refused. The loop is stopped first, so the request is surely still in
    slices when the drain (what the server runs after its loop) finds it."""
    ctx, server, client, result = inproc
    c = client()
    c.hello("big", LAYOUT, capacity_bytes=64 * 2 * N)
    (identity,) = server.guard.limits.peers  # c's connection, as the ROUTER names it
    server.stop("the test's SIGTERM")
    deadline = time.monotonic() + 30
    while "reason" not in result:
        assert time.monotonic() < deadline, "the loop did not stop"
        time.sleep(0.01)
    keys = keys_for("drain", N)
    frame = protocol.encode_request(Op.RESERVE, 99, session=c.session, keys=keys)
    rid, sliced = dispatch(ctx, frame, identity, sliced=True)
    assert isinstance(sliced, Sliced) and ctx.requests_in_slices == 1
    server._next_slice(identity, [], rid, sliced)  # as a first slice leaves it, between turns
    server._drain()
    assert c.sock.poll(10_000), "the request in slices was not answered"
    reply = protocol.decode_reply(c.sock.recv())
    assert reply.id == 99
    slots = reply.result()["slots"]
    assert len(slots) == N and min(slots) >= 0
    assert ctx.requests_in_slices == 0
    index = ctx.registry.namespaces["big"].index
    assert all(index.state[page] == WRITING for page in slots)  # every slice's pages reserved


def test_a_sliced_reserve_commit_publish_pin_and_unpin_answer_as_a_whole_one_would(inproc):
    _, _, client, _ = inproc
    c = client()
    c.hello("whole", LAYOUT, capacity_bytes=64 * 3 * N)
    keys, names = keys_for("p", N), keys_for("named", N)
    slots = c.call(Op.RESERVE, keys=keys)["slots"]
    assert len(set(slots)) == N and min(slots) >= 0
    assert c.call(Op.PUBLISH, keys=keys[:N // 2], as_keys=names[:N // 2], pin=True)["pages"] == slots[:N // 2]
    assert c.call(Op.COMMIT, keys=keys[N // 2:])["committed"] == N - N // 2
    assert c.call(Op.LOOKUP, keys=names[:N // 2])["count"] == N // 2
    pinned = c.call(Op.PIN, keys=names[:N // 2])
    assert pinned["count"] == N // 2 and pinned["pages"] == slots[:N // 2]
    assert c.call(Op.UNPIN, pages=pinned["pages"] * 2)["unpinned"] == N  # publish's pins and pin's
    stats = c.call(Op.STATS)["namespaces"]["whole"]
    assert stats["pinned_pages"] == 0 and stats["committed_pages"] == N


def test_a_refusal_found_in_a_late_slice_changes_nothing(inproc):
    _, _, client, _ = inproc
    c = client()
    c.hello("refused", LAYOUT, capacity_bytes=64 * 2 * N)
    keys = keys_for("r", N)
    c.call(Op.RESERVE, keys=keys)
    stranger = [*keys[:CHECK_SLICE + 5], b"never-reserved-key", *keys[CHECK_SLICE + 5:]]
    for op in (Op.COMMIT, Op.ABORT):
        reply = c.request(op, keys=stranger)
        assert reply.error_code == ErrorCode.NOT_HELD.value and f"keys[{CHECK_SLICE + 5}]" in reply.error_message
    reply = c.request(Op.PUBLISH, keys=keys, as_keys=[*keys[:-1], keys[0]])
    assert reply.error_code == ErrorCode.INVALID_ARGUMENT.value
    assert c.call(Op.STATS)["namespaces"]["refused"]["writing_pages"] == N  # every reservation still held
    assert c.call(Op.COMMIT, keys=keys)["committed"] == N


@pytest.fixture
def context(tmp_path):
    """A real DaemonContext, no socket: the dispatcher's slices stepped by hand.
    ``context(layout, pages)`` -> (ctx, a hello's reply, its fence held); ``context.hello(ctx)``
    -> another session of the namespace."""
    cfg = config.build(env={}, flags={"socket": str(tmp_path / "s.sock"), "shm_dir": str(tmp_path / "shm"),
                                      "capacity": "64MiB", "metrics_address": "",
                                      "session_reserve_share": "1", "session_pin_share": "1"})
    (tmp_path / "shm").mkdir()
    os.makedirs(cfg.metadata_dir, exist_ok=True)
    fds: list[int] = []

    def hello(ctx, layout: KVLayout = LAYOUT, pages: int | None = None) -> dict:
        reply = asyncio.run(acall(ctx, Op.HELLO, namespace="ns", layout=layout, client="test",
                                  capacity_bytes=None if pages is None else layout.page_bytes * pages))
        fds.append(os.open(os.path.join(fence_dir_for(cfg.socket), reply["fence"]), os.O_RDONLY))
        fcntl.flock(fds[-1], fcntl.LOCK_SH)
        return reply

    def make(layout: KVLayout, pages: int):
        ctx = DaemonContext(cfg, Registry(cfg), SessionTable(cfg.lease_ttl_s), admin_token="x")
        return ctx, hello(ctx, layout, pages)

    make.hello = hello  # type: ignore[attr-defined]
    yield make
    for fd in fds:
        os.close(fd)


def call(ctx, op: Op, **fields):
    reply = dispatch(ctx, protocol.encode_request(op, 1, **fields), PEER)
    return protocol.decode_reply(reply).result()


def begin(ctx, op: Op, **fields) -> Sliced:
    pending = dispatch(ctx, protocol.encode_request(op, 1, **fields), PEER, sliced=True)
    assert isinstance(pending, tuple) and isinstance(pending[1], Sliced), "served in slices"
    return pending[1]


def test_a_session_evicted_between_slices_ends_its_request_and_loses_no_page(context):
    ctx, hello = context(LAYOUT, 2 * N)
    session = hello["session"]
    keys = keys_for("e", N)
    sliced = begin(ctx, Op.RESERVE, session=session, keys=keys)
    assert resume(ctx, 1, sliced) is None  # a second slice served; three left
    ns = ctx.registry.namespaces["ns"]
    assert ns.index.num_writing == 2 * SLICE_KEYS
    ctx.sessions.evict(ctx.sessions.sessions[session])
    reply = protocol.decode_reply(resume(ctx, 1, sliced))
    assert reply.error_code == ErrorCode.UNKNOWN_SESSION.value
    assert ctx.requests_in_slices == 0
    snap = ns.index.snapshot()
    assert snap["writing_pages"] == 0 and snap["fenced_pages"] == 0
    assert len(ns.index.free) == snap["num_pages"]  # every page back: none lost, none held


def test_a_pin_stops_where_a_page_was_evicted_between_its_slices(context):
    ctx, hello = context(LAYOUT, N)  # a full region: new reservations evict
    session = hello["session"]
    ns = ctx.registry.namespaces["ns"]
    keys = keys_for("c", ns.geometry.num_pages)
    call(ctx, Op.RESERVE, session=session, keys=keys)
    call(ctx, Op.COMMIT, session=session, keys=keys)
    wanted = keys[:CHECK_SLICE]
    sliced = begin(ctx, Op.PIN, session=session, keys=wanted)  # walked; its first slice pinned
    other = context.hello(ctx)["session"]
    evicted = call(ctx, Op.RESERVE, session=other, keys=keys_for("new", 8))["evicted"]
    assert evicted and not set(evicted) & set(wanted[:SLICE_KEYS])  # pinned pages never go
    body = sliced.finish()
    cut = min(wanted.index(key) for key in evicted if key in wanted)
    assert body["count"] == len(body["pages"]) == cut
    assert ns.index.num_pinned_pages == cut == len(ctx.sessions.sessions[session].pins)
    assert [ns.index.keys[key] for key in wanted[:cut]] == body["pages"]


def test_quotas_are_checked_again_at_each_slice(context):
    """Another connection of the same uid may reserve between two slices: the uid's share holds."""
    ctx, hello = context(LAYOUT, 4 * N)
    ctx.config = dataclasses.replace(ctx.config, peer_reserve_share=0.5)
    ns = ctx.registry.namespaces["ns"]
    limit = ns.geometry.num_pages // 2
    first = hello["session"]
    other = context.hello(ctx)["session"]
    tenant = ctx.sessions.sessions[context.hello(ctx)["session"]]
    tenant.owner = Peer(4302, 4302, 1)  # another uid attached: the shares bind
    sliced = begin(ctx, Op.RESERVE, session=first, keys=keys_for("first", N))
    taken = len(call(ctx, Op.RESERVE, session=other, keys=keys_for("other", limit - SLICE_KEYS - 10))["slots"])
    body = sliced.finish()
    assert SLICE_KEYS <= len(body["slots"]) < N
    assert body["shortfall"]["by"] == "quota"
    assert ns.index.num_writing == len(body["slots"]) + taken <= limit
