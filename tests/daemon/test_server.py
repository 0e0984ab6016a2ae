"""The daemon in-process: the real Server loop on a temporary ipc:// socket, in a thread."""

from __future__ import annotations

import threading

import msgpack
import pytest
import uvloop
import zmq

from hisparse import KVLayout, protocol
from hisparse.daemon.conf import config
from hisparse.daemon.ops import handlers
from hisparse.daemon.ops.handlers import DaemonContext
from hisparse.daemon.store.namespaces import Registry
from hisparse.daemon.front.server import Server, endpoint_for
from hisparse.daemon.store.sessions import SessionTable
from hisparse.protocol import ErrorCode, Op
from tests.rawclient import RawClient, keys_for
from tests.waiting import wait_for


@pytest.fixture
def inproc(tmp_path):
    cfg = config.build(env={}, flags={"socket": str(tmp_path / "s.sock"), "shm_dir": str(tmp_path / "shm"),
                                      "capacity": "16MiB"})
    (tmp_path / "shm").mkdir()
    (tmp_path / "meta").mkdir(mode=0o700)  # the default meta_dir, beside the socket
    ctx = DaemonContext(cfg, Registry(cfg), SessionTable(5.0), admin_token="secret")
    server = Server(ctx, endpoint_for(cfg.socket))
    server.bind()
    result: dict[str, str] = {}
    started = threading.Event()

    async def on_ready() -> None:
        started.set()

    thread = threading.Thread(
        target=lambda: result.setdefault("reason", uvloop.run(server.serve(on_ready, signals=False))))
    thread.start()
    assert started.wait(10)
    clients: list[RawClient] = []

    def client() -> RawClient:
        c = RawClient(cfg.socket, timeout_s=5)
        clients.append(c)
        return c

    yield ctx, server, client, result
    for c in clients:
        c.close()
    server.stop("test over")
    thread.join(10)
    server.close()


def test_ping_and_hello(inproc):
    ctx, _, client, _ = inproc
    c = client()
    assert c.call(Op.PING)["protocol"] == protocol.VERSION
    r = c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=64 * 10)
    assert r["region"]["num_pages"] == 10 and r["region"]["created"] is True
    assert client().hello("ns", KVLayout(2, 4, 8))["region"]["created"] is True  # same run, same region
    assert len(ctx.registry.namespaces) == 1


def test_internal_error_is_a_reply_and_the_loop_serves_on(inproc, monkeypatch):
    _, _, client, _ = inproc
    c = client()
    c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=640)

    def broken(ctx, session, req):
        raise RuntimeError("boom")

    monkeypatch.setitem(handlers.HANDLERS, Op.LOOKUP, broken)
    reply = c.request(Op.LOOKUP, keys=keys_for("a", 1))
    assert reply.error_code == ErrorCode.INTERNAL.value and "boom" in reply.error_message
    assert c.call(Op.HEARTBEAT)["lease_ttl_s"] == 5.0


def test_req_socket_envelope_is_answered_in_kind(inproc):
    ctx, _, _, _ = inproc
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint_for(ctx.config.socket))
        sock.send(protocol.encode_request(Op.PING, 9))
        assert sock.poll(5000)
        assert protocol.decode_reply(sock.recv()).id == 9
    finally:
        sock.close(linger=0)


def test_multipart_request_is_refused(inproc):
    _, _, client, _ = inproc
    c = client()
    reply = c.send_raw([b"a", b"b", b"c"])
    assert reply is not None and reply.error_code == ErrorCode.PROTOCOL_ERROR.value
    assert c.call(Op.PING)


def test_shutdown_needs_the_token_then_stops_the_loop(inproc):
    _, server, client, result = inproc
    c = client()
    c.hello()
    assert c.request(Op.SHUTDOWN, token="wrong").error_code == ErrorCode.PERMISSION_DENIED.value
    assert c.call(Op.SHUTDOWN, token="secret") == {}
    deadline = 100
    while "reason" not in result and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    assert "shutdown requested" in result["reason"]


def test_many_requests_in_flight_are_all_answered(inproc):
    _, _, client, _ = inproc
    c = client()
    c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=64 * 100)
    for i in range(500):  # more than one reader batch
        c.sock.send(protocol.encode_request(Op.LOOKUP, i, session=c.session, keys=keys_for("k", 4)))
    seen = set()
    while len(seen) < 500:
        assert c.sock.poll(5000)
        seen.add(msgpack.unpackb(c.sock.recv())["id"])
    assert seen == set(range(500))



def test_servers_closing_one_after_another_leave_the_context_working(tmp_path):
    """libzmq's I/O thread sends monitor events with a blocking send: a server that closed
    its monitor socket before stopping the monitor hung that thread when a connection's end
    was reported after, and every socket of the process's context with it (about one server
    in ten here)."""
    for i in range(30):
        cfg = config.build(env={}, flags={"socket": str(tmp_path / f"s{i}.sock"),
                                          "shm_dir": str(tmp_path / "shm"), "capacity": "1MiB"})
        (tmp_path / "shm").mkdir(exist_ok=True)
        (tmp_path / "meta").mkdir(mode=0o700, exist_ok=True)
        server = Server(DaemonContext(cfg, Registry(cfg), SessionTable(5.0), admin_token="t"),
                        endpoint_for(cfg.socket))
        server.bind()
        started = threading.Event()

        async def on_ready() -> None:
            started.set()

        thread = threading.Thread(target=lambda: uvloop.run(server.serve(on_ready, signals=False)))
        thread.start()
        assert started.wait(10)
        client = RawClient(cfg.socket, timeout_s=5)
        try:
            assert client.call(Op.PING)["protocol"] == protocol.VERSION, f"server {i}"
        finally:
            client.close()
            server.stop("next")
            thread.join(10)
            server.close()


def test_a_slow_reader_pipelining_is_answered_while_replies_wait_in_the_outbox(inproc):
    """Replies that wait for a slow reader are sent by the outbox's flush; a send can take
    ZeroMQ's edge-triggered readable signal, so a request that arrived meanwhile must still
    be read (it once waited for some other event to wake the loop)."""
    _, server, client, _ = inproc
    c = client()
    c.hello("slow", KVLayout(1, 1, 64), capacity_bytes=64 * 2000)
    keys = keys_for("slow", 1000)
    c.call(Op.RESERVE, keys=keys)
    c.call(Op.COMMIT, keys=keys)
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.connect(server.endpoint)
    try:
        slow.send(protocol.encode_request(Op.HELLO, 0, namespace="slow", layout=KVLayout(1, 1, 64),
                                          client="slow"))
        assert slow.poll(10_000)
        session = protocol.decode_reply(slow.recv()).result()["session"]
        total, depth, sent, answered = 6000, 150, 0, 0
        while answered < total:
            while sent < total and sent - answered < depth:
                # ~18 KB replies: more than the socket buffers hold, so replies wait in the outbox
                op = Op.KEYS if sent % 2 else Op.PING
                fields = {"session": session, "cursor": 0, "limit": 500} if op is Op.KEYS else {}
                slow.send(protocol.encode_request(op, 1 + sent, **fields))
                sent += 1
            assert slow.poll(10_000), f"{answered} of {sent} answered, then none: the loop stalled"
            assert protocol.decode_reply(slow.recv()).ok
            answered += 1
        # the loop's thread takes a reply off its backlog just after sending it: this thread
        # may have read the last one before that
        wait_for(lambda: not server.outbox.backlogs, "the outbox's backlog to empty")
        assert server.outbox.dropped_replies == 0
    finally:
        slow.close(linger=0)


def test_a_ping_and_a_heartbeat_are_answered_ahead_of_their_connections_large_write(inproc):
    # A reserve of 16,384 keys is served in 32 slices, the connection's later requests after it:
    # a ping (the client's liveness probe) and a heartbeat do not wait for it.
    _, _, client, _ = inproc
    c = client()
    c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=64 * 20_000)
    c.sock.send(protocol.encode_request(Op.RESERVE, 1, session=c.session, keys=keys_for("big", 16_384)))
    c.sock.send(protocol.encode_request(Op.PING, 2))
    c.sock.send(protocol.encode_request(Op.HEARTBEAT, 3, session=c.session))
    c.sock.send(protocol.encode_request(Op.LOOKUP, 4, session=c.session, keys=keys_for("big", 1)))
    replies = []
    while len(replies) < 4:
        assert c.sock.poll(10_000)
        replies.append(msgpack.unpackb(c.sock.recv()))
    order = [r["id"] for r in replies]
    assert sorted(order[:2]) == [2, 3] and order[2:] == [1, 4], order  # the lookup keeps its turn
    assert all("ok" in r for r in replies), replies


def test_a_flood_of_pings_is_answered_whole_and_in_bounded_batches(inproc):
    # More pings than one reader callback answers as read (MAX_EXPRESS): the rest take turns.
    _, _, client, _ = inproc
    c = client()
    c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=64 * 100)
    for i in range(300):
        c.sock.send(protocol.encode_request(Op.PING, i))
        if i % 50 == 0:
            c.sock.send(protocol.encode_request(Op.LOOKUP, 1000 + i, session=c.session, keys=keys_for("k", 2)))
    seen = set()
    while len(seen) < 306:
        assert c.sock.poll(5000)
        seen.add(msgpack.unpackb(c.sock.recv())["id"])
    assert seen == set(range(300)) | {1000 + i for i in range(0, 300, 50)}


def test_requests_the_queue_would_serve_first_are_served_as_read_each_connection_in_order(inproc):
    # Read twice in a row from one connection, with nothing queued, a request skips the fair
    # queue (that connection alone had requests waiting): served at once, in its order. Two
    # connections of one uid (the only one connected, as here) pipelining at once: ZeroMQ's
    # reads alternate, which is the queue's turns per connection, so those are served as read
    # too, each connection's in order. (Two uids: test_fairness.py.)
    _, server, client, _ = inproc
    queued = []
    put = server.fair.put
    server.fair.put = lambda uid, conn, item, size: (queued.append(conn), put(uid, conn, item, size))
    keys = keys_for("solo", 8)
    x, y = client(), client()
    for c in (x, y):
        c.hello("ns", KVLayout(2, 4, 8), capacity_bytes=64 * 100)
    assert len(x.call(Op.RESERVE, keys=keys)["slots"]) == 8
    x.call(Op.COMMIT, keys=keys)
    queued.clear()
    for i in range(200):  # each lookup asks for a prefix one key longer (mod 8) than the last
        x.sock.send(protocol.encode_request(Op.LOOKUP, i, session=x.session, keys=keys[:1 + i % 8]))
    replies = []
    while len(replies) < 200:
        assert x.sock.poll(10_000)
        replies.append(msgpack.unpackb(x.sock.recv()))
    assert [r["id"] for r in replies] == list(range(200))
    assert all(r["ok"]["count"] == 1 + i % 8 for i, r in enumerate(replies))
    assert len(queued) < 20, len(queued)  # nearly every one served as read (the first may queue)
    queued.clear()
    for i in range(100):  # two connections at once: each keeps its order
        for c in (x, y):
            c.sock.send(protocol.encode_request(Op.LOOKUP, 1000 + i, session=c.session, keys=keys[:1 + i % 8]))
    for c in (x, y):
        got = []
        while len(got) < 100:
            assert c.sock.poll(10_000)
            got.append(msgpack.unpackb(c.sock.recv()))
        assert [r["id"] for r in got] == [1000 + i for i in range(100)]
        assert all(r["ok"]["count"] == 1 + i % 8 for i, r in enumerate(got))
    assert len(queued) < 20, len(queued)
