"""One request frame in, one reply frame out: decode once, route to its handler, never raise.

``dispatch`` turns a request frame into a reply frame (or a ``Deferred`` whose
future finishes it later, ``finish``; or, for the server, a ``Sliced`` whose
slices ``resume`` serves in turns). A ``WireError`` becomes its typed error
reply, anything else ``INTERNAL`` plus a logged traceback; each request's
latency goes to the op's statistics.
"""

from __future__ import annotations

import logging
import time

import msgpack

from hisparse import protocol
from hisparse.daemon.ops.handlers import HANDLERS, DaemonContext, Deferred
from hisparse.daemon.ops.slicing import Sliced
from hisparse.daemon.ops.sweep import GATED_OPS
from hisparse.protocol import EXPRESS_OPS, ErrorCode, WireError

log = logging.getLogger(__name__)


Pending = tuple[int | None, Deferred | Sliced]


def dispatch(ctx: DaemonContext, frame: bytes, peer: bytes = b"", on_invalid=None,
             sliced: bool = False) -> bytes | Pending:
    """One request frame from connection ``peer`` in, one reply frame out (or a ``Deferred``
    to finish later; with ``sliced``, a ``Sliced`` to ``resume``: else its slices are served
    now). Decodes the frame once; ``on_invalid()`` when it is no request at all
    (``PROTOCOL_ERROR``: not a request map, not msgpack). Never raises."""
    started_ns = time.perf_counter_ns()
    ctx.requests_total += 1
    try:
        req = protocol.decode_request(frame)
    except WireError as exc:  # the error carries the id when one was read: no second decode
        ctx.opstats.observe("invalid", time.perf_counter_ns() - started_ns)
        if on_invalid is not None and exc.code is ErrorCode.PROTOCOL_ERROR:
            on_invalid()
        return _refusal(ctx, exc.rid, exc)
    except Exception as exc:
        return _internal(ctx, None, exc)
    return serve_request(ctx, req, peer, started_ns, sliced)


# protocol.EXPRESS_OPS are answered when read, ahead of their connection's queue.
EXPRESS_FRAME_BYTES = 64  # a ping or a heartbeat is under 48 bytes: larger frames are not looked at
# Each op's name as msgpack writes it: a small frame without one (a bye, an unpin) is not decoded
# here as well as in its turn.
_EXPRESS_NAMES = tuple(msgpack.packb(op.value) for op in EXPRESS_OPS)


def express(ctx: DaemonContext, frame: bytes, peer: bytes) -> bytes | None:
    """The reply to ``frame`` when it is a ping or a heartbeat (``EXPRESS_OPS``), served now;
    None for any other frame (or one that does not decode): it is served in its turn."""
    if not any(name in frame for name in _EXPRESS_NAMES):
        return None
    started_ns = time.perf_counter_ns()
    try:
        req = protocol.decode_request(frame)
    except Exception:  # its turn answers it (the error, in order)
        return None
    if req.op not in EXPRESS_OPS:
        return None
    ctx.requests_total += 1
    reply = serve_request(ctx, req, peer, started_ns)
    assert isinstance(reply, bytes)  # neither op is deferred or sliced
    return reply


def serve_request(ctx: DaemonContext, req: protocol.Request, peer: bytes,
                  started_ns: int, sliced: bool = False) -> bytes | Pending:
    """A decoded request's reply (or what ``dispatch`` says). Never raises."""
    ctx.peer = peer
    rid = req.id
    op = req.op._value_  # Enum's ``value`` is a property, ten times the cost
    try:
        session = None
        if req.op not in protocol.SESSIONLESS_OPS:
            session = ctx.sessions.get(req.session, peer)  # type: ignore[arg-type]
            if session is None:
                # Never echo the id: the reply goes to whoever sent it, maybe not its owner.
                raise WireError(ErrorCode.UNKNOWN_SESSION,
                                "no such session on this connection: it expired, closed, belongs "
                                "to an earlier daemon or to another connection; send hello again")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s id=%s session=%s", req.op.value, rid,
                      session.handle if session else "-")
        sweep = ctx.fence_sweep
        if sweep is not None and req.op in GATED_OPS and sweep.running:  # pages wait for the sweep
            body = sweep.after(lambda: _whole(HANDLERS[req.op](ctx, session, req)),
                               lambda: session is None or ctx.sessions.sessions.get(session.id) is session)
        else:
            body = HANDLERS[req.op](ctx, session, req)
        if isinstance(body, Sliced):
            if sliced:
                body.op, body.started_ns = op, started_ns
                ctx.requests_in_slices += 1
                return rid, body
            body = body.finish()
        elif isinstance(body, Deferred):
            # the request's latency runs until the work off the loop is done
            body.future.add_done_callback(
                lambda _, op=op: ctx.opstats.observe(op, time.perf_counter_ns() - started_ns))
            return rid, body
        reply = protocol.encode_ok(rid, body)
        ctx.opstats.observe(op, time.perf_counter_ns() - started_ns)
        return reply
    except WireError as exc:
        ctx.opstats.observe(op, time.perf_counter_ns() - started_ns)
        return _refusal(ctx, rid, exc)
    except Exception as exc:
        return _internal(ctx, rid, exc)


def finish(ctx: DaemonContext, rid: int | None, deferred: Deferred, future) -> bytes:
    """The reply of a deferred request once its future is done. Never raises."""
    try:
        exc = future.exception() if not future.cancelled() else RuntimeError("cancelled")
        if exc is not None:
            wire = deferred.errors(exc)
            if wire is None:
                raise exc
            raise wire
        return protocol.encode_ok(rid, deferred.finish(future.result()))
    except WireError as exc:
        return _refusal(ctx, rid, exc)
    except Exception as exc:
        return _internal(ctx, rid, exc)


def resume(ctx: DaemonContext, rid: int | None, sliced: Sliced, to_end: bool = False) -> bytes | None:
    """The next slice of a sliced request (``to_end``: every one left): its reply once the
    last is served, else None. Never raises."""
    ctx.request_slices_total += 1
    try:
        body = sliced.finish() if to_end else sliced.step()
        if body is None:
            return None
        reply = protocol.encode_ok(rid, body)
    except WireError as exc:
        reply = _refusal(ctx, rid, exc)
    except Exception as exc:
        reply = _internal(ctx, rid, exc)
    ctx.requests_in_slices -= 1  # answered
    ctx.opstats.observe(sliced.op, time.perf_counter_ns() - sliced.started_ns)
    return reply


def _whole(body):
    """A handler's body with every slice served (a request that waited for the start-up sweep)."""
    return body.finish() if isinstance(body, Sliced) else body


def _refusal(ctx: DaemonContext, rid: int | None, exc: WireError) -> bytes:
    ctx.errors_total += 1
    ctx.opstats.error(exc.code.value)
    log.debug("refused request id=%s: %s %s", rid, exc.code.value, exc.message)
    return protocol.encode_error(rid, exc.code, exc.message)


def _internal(ctx: DaemonContext, rid: int | None, exc: Exception) -> bytes:
    ctx.errors_total += 1
    ctx.opstats.error(ErrorCode.INTERNAL.value)
    log.error("internal error handling request id=%s", rid, exc_info=exc)
    return protocol.encode_error(rid, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
