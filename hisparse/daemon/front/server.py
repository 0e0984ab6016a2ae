"""The daemon's loop: a ZeroMQ ROUTER on an ``ipc://`` socket, driven by asyncio.

The loop reads the ROUTER from the event loop's reader callback (no future
per message), serves what it read one request per uid in turn
(``daemon.fairness``; each through ``daemon.dispatch``; with nothing queued,
a batch's first request, a connection's second in a row, or any request
while one uid alone has connections, is served as read: the queue would
serve it first), sends without ever
blocking (a client that stops reading loses its replies, not the daemon its
time), and runs the timers (``daemon.timers``: lease reaper, watchdog,
eviction log, loop lag).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import zmq
import zmq.backend

from hisparse import protocol
from hisparse.daemon.front import notify
from hisparse.daemon.front.connections import ConnectionGuard
from hisparse.daemon.front.dispatch import EXPRESS_FRAME_BYTES, dispatch, express, finish, resume, serve_request
from hisparse.daemon.front.fairness import OVERFLOW_READS, FairQueue, overflow_refusal
from hisparse.daemon.front.outbox import Outbox
from hisparse.daemon.front.timers import eviction_log, loop_lag, ready_then_watchdog, reaper
from hisparse.daemon.ops.handlers import DaemonContext
from hisparse.daemon.ops.slicing import Sliced
from hisparse.daemon.policy.limits import LARGE_FRAME_BYTES, Limits, caps_of
from hisparse.protocol import ErrorCode, Op, WireError

log = logging.getLogger(__name__)

MAX_BATCH_S = 0.02  # a reader callback serves this long at most, so timers and signals run
MAX_EXPRESS = 64  # pings and heartbeats answered as read in one callback; later ones take turns
# Per connection (ZeroMQ queues per connection, and the ROUTER takes one message from each
# in turn): a flooding peer has at most RCVHWM requests queued, so it delays another's request
# by at most one of its own per turn; a peer that does not read, SNDHWM replies (then dropped).
RCVHWM_MESSAGES = 2
SNDHWM_MESSAGES = 64
# A larger frame is not even read (ZeroMQ drops the connection at its header): a connection
# holds at most RCVHWM + 1 frames of this size in the daemon (queued, and one being read).
MAX_WIRE_MESSAGE_BYTES = protocol.MAX_FRAME_BYTES
CONNECTION_REQUEST_BYTES = (RCVHWM_MESSAGES + 1) * MAX_WIRE_MESSAGE_BYTES  # what libzmq may hold for one
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Server:
    def __init__(self, ctx: DaemonContext, endpoint: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.zmq = zmq.Context.instance()
        self.sock = self.zmq.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM_MESSAGES)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM_MESSAGES)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_WIRE_MESSAGE_BYTES)
        # A full peer queue or a vanished peer is reported to the send, not
        # silently dropped: the outbox keeps a bounded backlog or drops it.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # _get(_EVENTS) & _POLLIN: a request waits. Plain ints, and the Cython socket's own
        # ``get``: pyzmq's Python-level getsockopt turns the option into an enum first, which
        # costs more than libzmq's answer.
        self._get = zmq.backend.Socket.get.__get__(self.sock)
        self.outbox = Outbox(self.sock)
        self.fair = FairQueue()  # read, not yet served
        self.limits = Limits(caps_of(ctx.config))
        ctx.sessions.limits = self.limits
        self.guard = ConnectionGuard(self.sock, self.limits, endpoint.removeprefix("ipc://"), endpoint)
        ctx.transport_stats = lambda: {"replies_dropped": self.outbox.dropped_replies,
                                       "replies_queued_bytes": self.outbox.queued_bytes,
                                       **self.guard.stats(), **self.limits.stats()}
        self._stopping: asyncio.Event | None = None
        self._reading = False  # inside _on_readable (which checks for more itself)
        self._last_read = b""  # the connection of the request read last
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stop_reason, ctx.request_shutdown = "", self.stop

    # -- lifecycle --

    def bind(self) -> None:
        self.guard.bind()

    def stop(self, reason: str) -> None:
        """Ask the loop to stop; safe from any thread."""
        if self._stopping is None or self._stopping.is_set():
            return
        self.stop_reason = reason
        log.info("stopping: %s", reason)
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop_thread(loop):
            loop.call_soon_threadsafe(self._stopping.set)
        else:
            self._stopping.set()

    async def serve(self, on_ready=None, *, signals: bool = True) -> str:
        loop = self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._on_readable)
        loop.add_reader(self.guard.fd, self._on_connection_events)
        loop.call_soon(self._on_connection_events)
        loop.call_soon(self._on_readable)  # messages that arrived before the reader existed
        if self.ctx.cluster is not None:
            self.ctx.cluster.start(loop)
        if signals:  # only the main thread may; in-process tests run the loop elsewhere
            for sig, reason in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
                loop.add_signal_handler(sig, self.stop, reason)
            loop.add_signal_handler(signal.SIGHUP, self._reload)
        metrics = None
        if self.ctx.config.metrics_endpoint:
            from hisparse.daemon.front.metrics import MetricsServer

            metrics = MetricsServer(self.ctx, self.ctx.config.metrics_endpoint)
        if self.ctx.fence_sweep is not None:  # while it runs, ops that take pages wait for it
            self.ctx.fence_sweep.done = loop.create_future()
        timers = [asyncio.create_task(reaper(self.ctx, self.guard)), asyncio.create_task(eviction_log(self.ctx)),
                  asyncio.create_task(loop_lag(self.ctx)), asyncio.create_task(self.outbox.run(self._rearm))]
        if self.ctx.fence_sweep is not None:
            timers.append(asyncio.create_task(self.ctx.fence_sweep.run()))
        try:
            if metrics is not None:
                await metrics.start()  # before READY: a bad address stops the start
            timers.append(asyncio.create_task(ready_then_watchdog(on_ready)))
            await self._stopping.wait()
        finally:
            if metrics is not None:
                await metrics.close()
            loop.remove_reader(fd)
            loop.remove_reader(self.guard.fd)
            if signals:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
            for t in timers:
                t.cancel()
            await asyncio.gather(*timers, return_exceptions=True)
        self._drain()
        return self.stop_reason

    def close(self) -> None:
        self.guard.close()
        self.sock.close(linger=0)

    # -- the data path --

    def _on_readable(self) -> None:
        guard, fair = self.guard, self.fair
        waiting = self._get  # a message waits: no Again raised, as a read would
        self._reading = True
        try:
            deadline = time.monotonic() + MAX_BATCH_S
            reads = 0
            # Whether the socket said it holds nothing, with no send since. A check costs about
            # 2 us; a request served as read takes one (after its reply: does more wait?).
            idle = False
            expressed = 0  # pings and heartbeats answered as read (dispatch.express), this batch
            overflow = 0  # reads past the queue's bound since the last round (fairness.py)
            while True:  # read what waits (cheap), then serve one request of each uid in turn
                while fair.room() or overflow < OVERFLOW_READS and fair.overflow_room():
                    if reads and not waiting(_EVENTS) & _POLLIN:  # woken: the first read tries
                        idle = True
                        break
                    reads += 1
                    full = not fair.room()
                    overflow += full
                    if reads % 16 == 0 and guard.on_events():  # not kept waiting by a busy batch;
                        asyncio.get_running_loop().call_soon(self._on_connection_events)  # edge went
                    try:
                        identity, envelope, body, refusal = guard.recv()
                    except zmq.Again:
                        idle = True
                        break
                    size = len(body[-1]) if body else 0
                    if refusal is None and size > LARGE_FRAME_BYTES:
                        refusal = guard.admit_large_frame(identity, size, CONNECTION_REQUEST_BYTES)
                    elif (refusal is None and size <= EXPRESS_FRAME_BYTES and expressed < MAX_EXPRESS
                          and len(body) == 1 and not guard.refusing):
                        reply = express(self.ctx, body[0], identity)
                        if reply is not None:
                            expressed += 1
                            self._send([identity, *envelope, reply])
                            continue
                    if refusal is None and not fair.count and (reads == 1 or identity == self._last_read
                                                               or self._one_tenant(identity)):
                        # Nothing queued, and the queue would serve it first: it is the first
                        # read of this batch (whatever is read after it comes after it in every
                        # round), or its connection alone had requests
                        # (ZeroMQ reads connections in turn, and it came twice in a row), or its
                        # uid alone has connections (ZeroMQ's turns are the queue's then).
                        # Served now, before looking for more, which has then arrived: one
                        # look per request instead of two.
                        self._last_read = identity
                        self._handle(identity, envelope, body, None)
                        idle = False  # a send may have taken the edge
                        if time.monotonic() > deadline:
                            break
                        continue
                    self._last_read = identity
                    if refusal != "":  # "": its connection was told why, once; being shed
                        uid = self._uid(identity)
                        if refusal is None and full and fair.crowding(uid, identity) and len(body) == 1:
                            reply = overflow_refusal(body[0], uid, fair)  # a flood, past the bound
                            if reply is not None:
                                self._send([identity, *envelope, reply])
                                continue
                        fair.put(uid, identity, (self._handle, identity, envelope, body, refusal), size)
                if not fair.count:
                    break
                for fn, *args in fair.round():
                    fn(*args)
                idle, reads, overflow = False, max(reads, 1), 0  # a send may have taken the edge
                if time.monotonic() > deadline:
                    break  # a backlog, or what arrived meanwhile: served in the next batch
            # ZeroMQ's fd is edge-triggered and a send can swallow the edge:
            # ask the socket itself whether more is queued (unless it just said).
            if fair.count or not idle and waiting(_EVENTS) & _POLLIN:
                asyncio.get_running_loop().call_soon(self._on_readable)
        except Exception:
            log.error("error in the receive loop; serving on", exc_info=True)
        finally:
            self._reading = False

    def _on_connection_events(self) -> None:
        try:
            if self.guard.on_events():  # the monitor's fd is edge-triggered too
                asyncio.get_running_loop().call_soon(self._on_connection_events)
        except Exception:
            log.error("error reading connection events; serving on", exc_info=True)

    def _handle(self, identity: bytes, envelope: list[bytes], body: list[bytes],
                refusal: str | None) -> None:
        if refusal is None and self.guard.refusing and self.guard.shedding(identity):
            return  # read before its connection was told why; unanswered now
        if refusal is not None:  # unread: its id only if the frame's head names it
            rid = protocol.leading_id(body[-1]) if body else None
            reply = protocol.encode_error(rid, ErrorCode.QUOTA_EXCEEDED, refusal)
        elif len(body) != 1:
            reply = protocol.encode_error(None, ErrorCode.PROTOCOL_ERROR,
                                          f"expected one frame per request, got {len(body)}")
        else:
            known = self.guard.limits.peers.get(identity)
            self.ctx.peer_address = known.address if known is not None else None
            frame = body[0]
            large = len(frame) > LARGE_FRAME_BYTES
            try:  # a large frame that is no request at all costs its sender the connection
                result = dispatch(self.ctx, bytes(frame) if large else frame, identity,
                                  (lambda: self.guard.shed_invalid_large(identity)) if large else None,
                                  sliced=True)
            finally:
                self.ctx.peer_address = None
            if isinstance(result, tuple):  # its reply is finished in the owner's turn too
                rid, deferred = result
                if isinstance(deferred, Sliced):
                    self._next_slice(identity, envelope, rid, deferred)
                    return
                deferred.future.add_done_callback(
                    lambda f: self._queue_finish(identity, envelope, rid, deferred, f))
                return
            reply = result
        self._send([identity, *envelope, reply])

    def _queue_finish(self, identity: bytes, envelope: list[bytes], rid, deferred, future) -> None:
        """A deferred request's work is done: its reply is finished (a hello's session opened,
        say) in its uid's turn, not all at once (a namespace's creation frees many)."""
        self.fair.put(self._uid(identity), identity,
                      (self._finish, identity, envelope, rid, deferred, future), 0)
        if not self._reading:
            asyncio.get_running_loop().call_soon(self._on_readable)

    def _finish(self, identity: bytes, envelope: list[bytes], rid, deferred, future) -> None:
        self._send([identity, *envelope, finish(self.ctx, rid, deferred, future)])

    def _next_slice(self, identity: bytes, envelope: list[bytes], rid, sliced: Sliced) -> None:
        """A large write's next slice is served in its connection's next turn, before that
        connection's later requests (``daemon.slicing``)."""
        self.fair.put_front(self._uid(identity), identity, (self._slice, identity, envelope, rid, sliced))

    def _slice(self, identity: bytes, envelope: list[bytes], rid, sliced: Sliced,
               to_end: bool = False) -> None:
        reply = resume(self.ctx, rid, sliced, to_end)
        if reply is None:
            self._next_slice(identity, envelope, rid, sliced)
        else:
            self._send([identity, *envelope, reply])

    def _one_tenant(self, identity: bytes) -> bool:
        """Whether ``identity``'s uid is the only one with connections open: the queue's turns
        per uid then have nothing to arbitrate, and its turns per connection are the order
        ZeroMQ reads in (one message of each connection in turn)."""
        uids = self.guard.uid_connections
        return len(uids) == 1 and self._uid(identity) in uids

    def _uid(self, identity: bytes) -> object:
        """Whose turn a connection's requests take: its peer's uid (None: the kernel named none)."""
        peer = self.guard.limits.peers.get(identity)
        return peer.uid if peer is not None else None

    def _send(self, frames: list[bytes]) -> None:
        self.outbox.send(frames)
        self._rearm()

    def _rearm(self) -> None:
        """After a send outside the reader (a deferred reply, the outbox's flush): the send may
        have taken ZeroMQ's edge-triggered readable signal, so ask the socket whether a request
        waits, or the loop would wait for some other event to read it."""
        if not self._reading and self._get(_EVENTS) & _POLLIN:
            asyncio.get_running_loop().call_soon(self._on_readable)

    def _drain(self) -> None:
        """Answer what is already queued before closing (SIGTERM drains)."""
        for fn, identity, envelope, *rest in self.fair.drain():
            if fn == self._finish:
                fn(identity, envelope, *rest)  # its work is done: the reply goes
            elif fn == self._slice:
                fn(identity, envelope, *rest, to_end=True)  # begun: its slices left are served
            else:
                self._handle_draining([identity, *envelope, *rest[0]])
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_draining(frames)

    def _handle_draining(self, frames: list[bytes]) -> None:
        started_ns = time.perf_counter_ns()
        try:
            req = protocol.decode_request(frames[-1])
            rid: int | None = req.id
        except WireError as exc:
            req, rid = None, exc.rid
        reply = protocol.encode_error(rid, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if req is not None and req.op in (Op.BYE, Op.COMMIT, Op.ABORT, Op.UNPIN, Op.PING):
            done = serve_request(self.ctx, req, frames[0], started_ns)  # let in-flight work finish
            if isinstance(done, bytes):
                reply = done
        try:
            self.sock.send_multipart([frames[0], *frames[1:-1], reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- signals --

    def _reload(self) -> None:
        from hisparse.daemon.conf import config as config_mod

        try:
            cfg = config_mod.reload(self.ctx.config)
        except Exception as exc:
            log.error("SIGHUP: config not reloaded: %s", exc)
            return
        self.ctx.config = cfg
        if cfg.lease_ttl_s < self.ctx.sessions.lease_ttl_s:
            # A shorter lease must not expire sessions that beat at the old pace:
            # each keeps one old lease from now to learn the new one from a heartbeat.
            grace_until = self.ctx.sessions.now() + self.ctx.sessions.lease_ttl_s - cfg.lease_ttl_s
            for session in self.ctx.sessions.sessions.values():
                session.last_seen_s = max(session.last_seen_s, grace_until)
        self.ctx.sessions.lease_ttl_s = cfg.lease_ttl_s
        logging.getLogger("hisparse").setLevel(cfg.log_level)
        log.info("SIGHUP: reloaded lease_ttl=%ss log_level=%s", cfg.lease_ttl_s, cfg.log_level)
        notify.notify("READY=1")


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def endpoint_for(path: str) -> str:
    return "ipc://" + os.path.abspath(path)
