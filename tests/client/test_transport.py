"""The DEALER transport and the client's session upkeep, against a real hisparsed."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

import hisparse
from hisparse import client
from hisparse.client import transport
from hisparse.paths import SYSTEM_SOCKET, embedded_socket_path
from hisparse.protocol import Op
from tests.client.engine import chain, pages_for
from tests.waiting import wait_for

LAYOUT = hisparse.KVLayout(num_layers=2, block_tokens=8, row_bytes=32)


def test_default_socket_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HISPARSE_SOCKET", "/somewhere/h.sock")
    assert transport.default_socket_path() == "/somewhere/h.sock"
    monkeypatch.delenv("HISPARSE_SOCKET")
    if os.path.exists(SYSTEM_SOCKET):
        pytest.skip("a system hisparsed is installed here")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert transport.default_socket_path() == str(tmp_path / "hisparsed" / "hisparsed.sock")
    assert transport.default_socket_path() == embedded_socket_path()  # the daemon's own rule
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert transport.default_socket_path().endswith(f"hisparsed-{os.getuid()}/hisparsed.sock")
    assert transport.default_socket_path() == embedded_socket_path()


def test_socket_paths_too_long_for_unix_are_refused():
    with pytest.raises(hisparse.InvalidArgument):
        transport.Transport("/tmp/" + "x" * 200)


def test_no_daemon_is_unavailable_within_the_timeout(tmp_path):
    sock = str(tmp_path / "nobody.sock")
    started = time.monotonic()
    with pytest.raises(hisparse.DaemonUnavailable):
        client.attach("ns", LAYOUT, socket=sock, timeout_s=0.3)
    assert time.monotonic() - started < 0.3 * 10  # bounded by the timeout, not a hang


def test_attach_to_a_missing_socket_fails_at_once_naming_the_command(tmp_path):
    # issue 22.1: not after the whole 5 s timeout, and with the next step to take
    sock = str(tmp_path / "nobody.sock")
    started = time.monotonic()
    with pytest.raises(hisparse.DaemonUnavailable) as info:
        client.attach("ns", LAYOUT, socket=sock)  # the default timeout, 5 s
    assert time.monotonic() - started < 2.5  # milliseconds expected; the old client took 5 s
    assert sock in str(info.value) and "systemctl start hisparsed" in str(info.value)


def test_calls_during_an_outage_fail_fast_and_work_again_after_it(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=5)
    keys = chain("outage", 2)
    with client.attach("outage", LAYOUT, socket=d.socket, capacity="1MiB", timeout_s=5.0) as cl:
        cl.store(keys, pages_for(keys, LAYOUT.page_bytes))
        d.kill()  # SIGKILL leaves its socket file behind, with nothing listening on it
        wait_for(lambda: not cl.transport.connected, "the client to see the connection drop")
        started = time.monotonic()
        with pytest.raises(hisparse.DaemonUnavailable, match="hisparsed"):
            cl.lookup(keys)
        assert time.monotonic() - started < 2.5  # not the 5 s timeout
        d.start()
        assert cl.lookup(keys) == 2  # the restarted daemon adopted the pages


def test_a_stopped_daemon_times_out_and_its_late_replies_are_dropped(hisparsed):
    t = transport.Transport(hisparsed.socket)
    try:
        assert t.call(Op.PING, 2.0)["pid"] == hisparsed.pid
        os.kill(hisparsed.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(hisparse.DaemonUnavailable):
                t.call(Op.PING, 0.3)
            with pytest.raises(hisparse.DaemonUnavailable):
                t.call(Op.HELLO, 0.3)  # queued in the daemon's socket: answered late
            assert time.monotonic() - started < 0.6 * 10  # two timeouts, generously
        finally:
            os.kill(hisparsed.pid, signal.SIGCONT)
        # the two late replies arrive first; the call must skip them for its own
        body = t.call(Op.PING, 5.0)
        assert body["pid"] == hisparsed.pid and "session" not in body
    finally:
        t.close()


def test_heartbeats_keep_the_lease_and_its_pins(daemon_factory):
    d = daemon_factory(capacity="64MiB", lease_ttl=1)
    keys = chain("hb", 3)
    with client.attach("hb", LAYOUT, socket=d.socket, capacity="1MiB") as cl:
        cl.store(keys, pages_for(keys, LAYOUT.page_bytes))
        with cl.pin(keys) as p:
            time.sleep(2.5)  # two and a half lease ttls without a call of ours
            assert p.held
            assert cl.stats()["namespaces"]["hb"]["pinned_pages"] == 3
        assert cl.stats()["client"]["reconnects"] == 0
        assert cl.stats()["daemon"]["sessions_expired"] == 0


def test_one_client_serves_many_threads(hisparsed):
    errors: list[BaseException] = []
    with client.attach("threads", LAYOUT, socket=hisparsed.socket, capacity="2MiB") as cl:
        def work(t: int) -> None:
            try:
                shared = chain("shared", 20)  # every thread stores the same chain too
                mine = chain(f"thread{t}", 20)
                for keys in (shared, mine):
                    cl.store(keys, pages_for(keys, LAYOUT.page_bytes))
                    out = np.zeros((len(keys), LAYOUT.page_bytes), dtype=np.uint8)
                    assert cl.load(keys, out) == len(keys)
                    assert np.array_equal(out, pages_for(keys, LAYOUT.page_bytes))
                    with cl.pin(keys[:5]) as p:
                        assert len(p) == 5
            except BaseException as exc:  # reported below: a thread cannot fail the test itself
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert errors == []
        ns = cl.stats()["namespaces"]["threads"]
        assert ns["committed_pages"] == 20 * 7 and ns["pinned_pages"] == 0


def test_calls_from_many_threads_each_keep_their_timeout(hisparsed):
    # one socket, one request in flight: waiting for the socket counts against the timeout
    # 4 calls of 2 s each: 8 s if waiting for the socket did not count against the timeout
    with client.attach("hung", LAYOUT, socket=hisparsed.socket, capacity="1MiB", timeout_s=2.0) as cl:
        os.kill(hisparsed.pid, signal.SIGSTOP)
        took: list[float] = []
        try:
            def call() -> None:
                started = time.monotonic()
                with pytest.raises(hisparse.DaemonUnavailable):
                    cl.lookup(chain("hung", 2))
                took.append(time.monotonic() - started)

            threads = [threading.Thread(target=call) for _ in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(10)
        finally:
            os.kill(hisparsed.pid, signal.SIGCONT)
        assert len(took) == 4 and max(took) < 5.0, took
        assert cl.lookup(chain("hung", 2)) == 0  # and the client works on


def test_a_forked_child_gets_a_prompt_error_from_its_parents_client_never_a_hang(hisparsed):
    # The parent's threads are in calls (holding the transport's and the session's locks at
    # random) when it forks: in the child, the inherited client refuses at once, typed, and
    # closes without touching the parent's session; a client of the child's own works.
    with client.attach("forked", LAYOUT, socket=hisparsed.socket, capacity="1MiB", timeout_s=2.0) as cl:
        keys = chain("forked", 3)
        cl.store(keys, pages_for(keys, LAYOUT.page_bytes))
        stop = threading.Event()

        def busy() -> None:
            while not stop.is_set():
                cl.lookup(keys)

        threads = [threading.Thread(target=busy) for _ in range(4)]
        for th in threads:
            th.start()
        outcomes = []
        try:
            for _ in range(12):
                pid = os.fork()
                if pid == 0:  # the child: exit codes say what happened; a hang is killed by the alarm
                    signal.alarm(10)
                    code = 0
                    try:
                        cl.lookup(keys)
                        code = 1  # the parent's session served the child
                    except hisparse.DaemonUnavailable as exc:
                        code = 0 if "forked child" in str(exc) else 2
                    except BaseException:  # noqa: BLE001 - any other outcome is a failure
                        code = 3
                    try:
                        cl.close()
                        with client.attach("forked", LAYOUT, socket=hisparsed.socket) as own:
                            code = code or (0 if own.lookup(keys) == 3 else 4)
                    except BaseException:  # noqa: BLE001
                        code = code or 5
                    os._exit(code)
                _, status = os.waitpid(pid, 0)
                outcomes.append(os.waitstatus_to_exitcode(status))
        finally:
            stop.set()
            for th in threads:
                th.join(10)
        assert outcomes == [0] * 12, outcomes  # -14: a child hung until its alarm
        assert cl.lookup(keys) == 3  # the parent's client is untouched
        assert cl.stats()["client"]["reconnects"] == 0


def test_a_request_over_the_frame_limit_is_refused_before_it_goes_out(hisparsed):
    # The daemon's socket drops a connection at such a frame's header, and the transport would
    # send it again on the next connection, taking other threads' calls down with it each time.
    from hisparse.protocol import MAX_FRAME_BYTES, MAX_KEY_BYTES

    with client.attach("big", LAYOUT, socket=hisparsed.socket, capacity="1MiB", timeout_s=5.0) as cl:
        keys = chain("big", 3)
        cl.store(keys, pages_for(keys, LAYOUT.page_bytes))
        huge = [bytes([i % 251]) * MAX_KEY_BYTES for i in range(MAX_FRAME_BYTES // MAX_KEY_BYTES + 1)]
        started = time.monotonic()
        with pytest.raises(hisparse.ProtocolError, match="at most"):
            cl.request(Op.LOOKUP, keys=huge)
        assert time.monotonic() - started < 2.0  # refused here, not timed out
        assert cl.lookup(keys) == 3
        assert cl.stats()["client"]["reconnects"] == 0
        assert cl.transport.connected


def test_a_call_in_flight_when_the_daemon_dies_is_unavailable_though_it_answered_others(daemon_factory):
    # Gone is not slow: a call queued behind its connection's large writes hears the daemon answer
    # them (and its probe) after it went out; then the daemon dies. At its timeout the call is
    # DaemonUnavailable (its connection is down), not Timeout (something was heard since).
    from tests.rawclient import keys_for

    d = daemon_factory(capacity="256MiB")
    layout = hisparse.KVLayout(2, 4, 8)
    with client.attach("dies", layout, socket=d.socket, capacity=layout.page_bytes * 300_000,
                       timeout_s=30.0) as cl:
        sid = cl.session.id
        writes = [cl.transport.submit(Op.RESERVE, session=sid, keys=keys_for(f"w{i}", 16_384))
                  for i in range(16)]  # served in slices, one after another: about a second or more
        late = cl.transport.submit(Op.LOOKUP, session=sid, keys=keys_for("late", 1))
        wait_for(lambda: late.sent_at is not None and cl.transport.heard_at > late.sent_at,
                 "the daemon to answer something after the late call went out")
        assert late.reply is None  # still queued behind the writes
        d.kill()
        started = time.monotonic()
        with pytest.raises(hisparse.DaemonUnavailable, match="dropped while lookup was in flight"):
            late.result(1.0)
        assert time.monotonic() - started < 10.0
        for w in writes:
            w.abandon()


def test_one_client_pipelining_thousands_of_requests_gets_every_reply_and_pings_go_first(hisparsed):
    # The daemon queues a bounded number of replies per connection and drops those its peer leaves
    # unread past that bound. The transport keeps at most MAX_IN_FLIGHT requests on the wire, so
    # none is dropped, and a ping made behind them all goes ahead of those still waiting.
    with client.attach("flood", LAYOUT, socket=hisparsed.socket, capacity="1MiB", timeout_s=60.0) as cl:
        sid = cl.session.id
        pendings = cl.transport.submit_all(Op.STATS, [{"session": sid}] * 8000)  # ~1.4 KB replies
        assert cl.transport.call(Op.PING, 60.0)["pid"] == hisparsed.pid
        assert pendings[-1].reply is None  # the ping did not wait for the flood
        assert all("daemon" in p.result(60.0) for p in pendings)
        assert cl.stats()["daemon"]["replies_dropped"] == 0


def test_a_request_held_in_the_client_is_slow_not_unreachable(hisparsed):
    # Past MAX_IN_FLIGHT a request waits in the client, connection up: at its timeout that is a
    # Timeout, not DaemonUnavailable (which tells an engine to stop offloading), even with the
    # daemon stopped; the ones on the wire, unanswered since they went out, are DaemonUnavailable.
    with client.attach("held", LAYOUT, socket=hisparsed.socket, capacity="1MiB", timeout_s=10.0) as cl:
        keys = chain("held", 2)
        sid = cl.session.id
        os.kill(hisparsed.pid, signal.SIGSTOP)
        try:
            on_wire = cl.transport.submit_all(Op.LOOKUP, [{"session": sid, "keys": keys}] * transport.MAX_IN_FLIGHT)
            wait_for(lambda: all(p.sent_at is not None for p in on_wire), "the first requests to go out")
            held = cl.transport.submit(Op.LOOKUP, session=sid, keys=keys)
            with pytest.raises(hisparse.Timeout, match="not sent"):
                held.result(0.3)
            with pytest.raises(hisparse.DaemonUnavailable):
                on_wire[0].result(0.3)
        finally:
            os.kill(hisparsed.pid, signal.SIGCONT)
        assert all(p.result(10.0) == {"count": 0} for p in on_wire[1:])
        assert cl.lookup(keys) == 0


def test_every_new_transport_learns_its_connection_is_up(hisparsed):
    # The socket monitor must listen before the connect: a handshake done first was never
    # reported, and about one transport in six then took its working connection for one that
    # is not up, for good (no liveness probe, lost requests never re-sent, slow read as gone).
    transports = [transport.Transport(hisparsed.socket) for _ in range(40)]
    try:
        for t in transports:
            assert t.call(Op.PING, 5.0)["pid"] == hisparsed.pid
        wait_for(lambda: all(t.connected for t in transports), "every transport to see its connection up",
                 timeout_s=10)
    finally:
        for t in transports:
            t.close()
