"""One handler per op, and the table that dispatches to them.

A handler takes the daemon's context, the caller's session (None for
``hello`` and ``ping``) and the decoded request, and returns the ``ok``
body of the reply (protocol.REPLY_FIELDS lists each). Expected refusals
raise ``WireError`` with a code; anything else is a bug that the server
turns into ``INTERNAL`` and a logged traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Future
from typing import Any

import hisparse
from hisparse.daemon.admin_ops import handle_clear, handle_evict_session, handle_shutdown
from hisparse.daemon.context import DaemonContext, Deferred, Handler, ns_of
from hisparse.daemon.hello import handle_hello
from hisparse.daemon.governance import handle_drop
from hisparse.daemon.quotas import check_pin_quota, reserve_room, shortfall
from hisparse.daemon.sessions import PinHold, Session
from hisparse.daemon.stats import handle_stats
from hisparse.protocol import (
    VERSION,
    ErrorCode,
    PagesRequest,
    EventsRequest,
    KeysPageRequest,
    KeysRequest,
    Op,
    PublishRequest,
    Request,
    WireError,
)

log = logging.getLogger(__name__)

# Entries of an `events` or `keys` reply, at most (fewer than asked is allowed):
# with 64-byte keys a reply stays under ~1.3 MB however large the limit asked.
MAX_REPLY_ENTRIES = 16_384


# -- session-less ops --

def handle_ping(ctx: DaemonContext, _: None, req: Request) -> dict[str, Any]:
    return {"version": hisparse.__version__, "protocol": VERSION,
            "uptime_s": time.monotonic() - ctx.started_s, "pid": os.getpid()}


# -- data ops --

def handle_lookup(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Deferred:
    ns = ns_of(session)
    count = ns.index.lookup(req.keys)
    if not req.remote:
        return {"count": count}
    if ctx.cluster is None or count == len(req.keys):
        return {"count": count, "remote": 0}
    remote = ctx.cluster.remote_prefix(ns, req.keys[count:], req.wait)
    if isinstance(remote, Future):  # the cluster worker answers (within cluster.timeout)
        return Deferred(asyncio.wrap_future(remote), lambda n: {"count": count, "remote": n},
                        _cluster_errors)
    return {"count": count, "remote": remote}


def handle_prefetch(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Deferred:
    if ctx.cluster is None:
        raise WireError(ErrorCode.CLUSTER_UNAVAILABLE,
                        "this hisparsed has no cluster tier: set [cluster] backend in its config")
    body = ctx.cluster.prefetch(ns_of(session), req.keys, req.wait)
    if isinstance(body, Future):
        return Deferred(asyncio.wrap_future(body), lambda done: done, _cluster_errors)
    return body


def _cluster_errors(exc: BaseException) -> WireError | None:
    return exc if isinstance(exc, WireError) else None


def _require_fence(session: Session, what: str) -> None:
    """Refuse holds until the client's lock on its fence has been seen (once per session)."""
    if session.fence_verified:
        return
    assert session.fence is not None
    if session.fence.holder_gone():
        raise WireError(ErrorCode.NOT_FENCED,
                        f"{what}: lock the session's fence file ({session.fence.name}, in fences/ "
                        "beside the socket) with flock(LOCK_SH) first; hisparse.client does")
    session.fence_verified = True


def handle_reserve(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    ns = ns_of(session)
    _require_fence(session, "reserve")
    _refuse_given_back(session, req)
    room, limit = reserve_room(ctx, session)
    slots, evicted = ns.index.reserve(req.keys, session.reservations, room)
    # The hold is on record before the reply grants it: a successor daemon fences it.
    new = [s for s in slots if s >= 0]
    session.fence.add_reserved(new)  # type: ignore[union-attr]
    session.tags.reserved(req.tag, [key for key, s in zip(req.keys, slots) if s >= 0])
    if evicted:
        ctx.evictions_since_log[ns.name] = ctx.evictions_since_log.get(ns.name, 0) + len(evicted)
    if ctx.cluster is not None:
        ctx.cluster.reserved(ns)
    return {"slots": slots, "evicted": evicted,
            "shortfall": shortfall(ctx, session, len(req.keys), len(slots), len(new), room, limit)}


def _refuse_given_back(session: Session, req: KeysRequest) -> None:
    """A request of a call that was already given up (its reply lost) takes nothing."""
    if session.tags.given_back(req.tag):
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{req.op.value}: its call (tag {req.tag}) was already given up; nothing taken")


def _held(session: Session, keys: tuple[bytes, ...], what: str) -> list[int]:
    """The pages of ``keys`` that ``session`` reserved; all or nothing."""
    pages = []
    for i, key in enumerate(keys):
        page = session.reservations.get(key)
        if page is None:
            raise WireError(ErrorCode.NOT_HELD,
                            f"{what}: keys[{i}] is not reserved by this session (nothing changed)")
        pages.append(page)
    if len(set(keys)) != len(keys):
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"{what}: a key is listed twice (nothing changed)")
    return pages


def _settle(session: Session, req: KeysRequest, what: str, apply) -> int:
    """Commit or abort reservations this session holds: all of ``req.keys`` or none."""
    pages = _held(session, req.keys, what)
    for key, page in zip(req.keys, pages):
        del session.reservations[key]
        apply(key, page)
    session.tags.settled(req.keys)
    session.fence.clear_reserved(pages)  # type: ignore[union-attr]  (after: a crash keeps it fenced)
    return len(req.keys)


def handle_commit(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    ns = ns_of(session)
    index = ns.index
    done: list[tuple[bytes, int]] = []
    cleared: list[bytes] = []

    def commit(key: bytes, page: int) -> None:
        if page in index.cleared_writes:  # reserved before a clear: its bytes predate it
            index.abort(key, page)
            cleared.append(key)
            return
        index.commit(key, page)
        done.append((key, page))
    _settle(session, req, "commit", commit)
    if ctx.cluster is not None and done:
        ctx.cluster.committed(ns, done)
    return {"committed": len(done), "cleared": cleared} if cleared else {"committed": len(done)}


def handle_abort(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    index = ns_of(session).index
    if req.tag is not None or req.missing_ok:
        # tag: only what that call's reserves took, never another thread's live reservation
        keys = session.tags.reserved_by(req.tag, req.keys) if req.tag is not None else req.keys
        held = [key for key in dict.fromkeys(keys) if key in session.reservations]
        pages = [session.reservations.pop(key) for key in held]
        for key, page in zip(held, pages):
            index.abort(key, page)
        session.tags.settled(held)
        session.fence.clear_reserved(pages)  # type: ignore[union-attr]
        return {"aborted": len(held)}
    return {"aborted": _settle(session, req, "abort", index.abort)}


def handle_pin(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any]:
    ns = ns_of(session)
    _require_fence(session, "pin")
    _refuse_given_back(session, req)
    pages = ns.index.committed_prefix_pages(req.keys)  # walked once: the quota sees what is pinned
    check_pin_quota(ctx, session, pages)
    ns.index.pin_pages(pages)
    session.fence.add_pins(pages)  # type: ignore[union-attr]
    session.tags.pinned(req.tag, pages)
    pins = session.pins
    added = []
    for key, page in zip(req.keys, pages):
        held = pins.get(page)
        if held is None:
            pins[page] = PinHold(key, 1)
            added.append(page)
        else:
            held.count += 1
    ctx.sessions.note_pins(session.owner.key, ns.name, added, [])
    return {"count": len(pages), "pages": pages}


def handle_unpin(ctx: DaemonContext, session: Session, req: PagesRequest) -> dict[str, Any]:
    ns = ns_of(session)
    index = ns.index
    if req.whole_call:
        assert req.tag is not None
        return {"unpinned": _unpin_call(ctx, session, index, req.tag)}
    need: dict[int, int] = {}
    for i, page in enumerate(req.pages):
        need[page] = need.get(page, 0) + 1
        held = session.pins.get(page)
        if held is None or held.count < need[page]:
            raise WireError(ErrorCode.NOT_HELD,
                            f"unpin: pages[{i}] = {page} is not pinned by this session "
                            "(that many times); nothing changed")
    gone = []
    for page in req.pages:
        held = session.pins[page]
        index.unpin(page)
        held.count -= 1
        if held.count == 0:
            del session.pins[page]
            gone.append(page)
    ctx.sessions.note_pins(session.owner.key, ns.name, [], gone)
    session.fence.remove_pins(list(req.pages))  # type: ignore[union-attr]
    if req.tag is not None:
        session.tags.unpinned(req.tag, req.pages)
    return {"unpinned": len(req.pages)}


def _unpin_call(ctx: DaemonContext, session: Session, index: Any, tag: int) -> int:
    """Release the pins a call took and never unpinned (its reply was lost): each still held."""
    pages, gone = [], []
    for page in session.tags.take_pins(tag):
        held = session.pins.get(page)
        if held is None:
            continue
        index.unpin(page)
        held.count -= 1
        if held.count == 0:
            del session.pins[page]
            gone.append(page)
        pages.append(page)
    ctx.sessions.note_pins(session.owner.key, ns_of(session).name, [], gone)
    session.fence.remove_pins(pages)  # type: ignore[union-attr]
    return len(pages)


def handle_publish(ctx: DaemonContext, session: Session, req: PublishRequest) -> dict[str, Any]:
    """Commit reservations under the keys their bytes turned out to have.

    vLLM's HiSparse host pool hands a block out before its tokens exist, so
    the reservation's key is a placeholder and the block hash comes at
    publication. A key someone already committed (or is writing) is not
    published twice: that reservation stays held, its page id is -1 here.
    """
    ns = ns_of(session)
    index = ns.index
    held = _held(session, req.keys, "publish")
    if len(set(req.as_keys)) != len(req.as_keys):
        raise WireError(ErrorCode.INVALID_ARGUMENT, "publish: an as_key is listed twice (nothing changed)")
    if req.pin:
        check_pin_quota(ctx, session, held, reserved_now=True)  # a pin (nothing changed if refused)
    pages: list[int] = []
    done: list[tuple[bytes, int]] = []
    for key, new_key, page in zip(req.keys, req.as_keys, held):
        if new_key != key and new_key in index.keys:
            pages.append(-1)
            continue
        del session.reservations[key]
        index.rename(key, new_key, page)
        index.commit(new_key, page)
        done.append((new_key, page))
        pages.append(page)
    # The holds in one call each (a per-page numpy call cost ~5 us: 16,384 of them ~100 ms).
    session.tags.settled([key for key, page in zip(req.keys, pages) if page >= 0])
    published = [page for _, page in done]
    if req.pin and published:
        # Pinned before the reservations' fence records go: the pages stay fenced.
        index.pin_pages(published)
        session.fence.add_pins(published)  # type: ignore[union-attr]
        first: list[int] = []
        for new_key, page in done:
            hold = session.pins.get(page)
            if hold is None:
                session.pins[page] = PinHold(new_key, 1)
                first.append(page)
            else:
                hold.count += 1
        ctx.sessions.note_pins(session.owner.key, ns.name, first, [])
    session.fence.clear_reserved(published)  # type: ignore[union-attr]
    if ctx.cluster is not None and done:
        ctx.cluster.committed(ns, done)  # published pages go behind to the cluster like any commit
    return {"pages": pages}


def handle_heartbeat(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    return {"lease_ttl_s": ctx.sessions.lease_ttl_s}


def handle_bye(ctx: DaemonContext, session: Session, req: Request) -> dict[str, Any]:
    reserved, pinned = len(session.reservations), session.pinned_pages
    zombie = ctx.sessions.end(session, "bye")
    if session.namespace is not None:
        log.info("detach: %s (aborted %d reservations, released %d pinned pages%s)",
                 session.describe(), reserved, pinned,
                 "; fenced until its process lets go" if zombie else "")
    return {}


def handle_events(ctx: DaemonContext, session: Session, req: EventsRequest) -> dict[str, Any]:
    events, seq, reset = ns_of(session).index.events.since(req.after, min(req.limit, MAX_REPLY_ENTRIES))
    return {"seq": seq, "events": [list(e) for e in events], "reset": reset}


def handle_keys(ctx: DaemonContext, session: Session, req: KeysPageRequest) -> dict[str, Any]:
    index = ns_of(session).index
    seq = index.events.last_seq
    index.events.enabled = True
    keys, cursor = index.committed_page(req.cursor, min(req.limit, MAX_REPLY_ENTRIES))
    return {"keys": [list(k) for k in keys], "next_cursor": cursor, "seq": seq}


HANDLERS: dict[Op, Handler] = {
    Op.HELLO: handle_hello,
    Op.PING: handle_ping,
    Op.LOOKUP: handle_lookup,
    Op.RESERVE: handle_reserve,
    Op.COMMIT: handle_commit,
    Op.ABORT: handle_abort,
    Op.PIN: handle_pin,
    Op.UNPIN: handle_unpin,
    Op.HEARTBEAT: handle_heartbeat,
    Op.STATS: handle_stats,
    Op.EVENTS: handle_events,
    Op.KEYS: handle_keys,
    Op.CLEAR: handle_clear,
    Op.SHUTDOWN: handle_shutdown,
    Op.BYE: handle_bye,
    Op.EVICT_SESSION: handle_evict_session,
    Op.DROP: handle_drop,
    Op.PUBLISH: handle_publish,
    Op.PREFETCH: handle_prefetch,
}
assert set(HANDLERS) == set(Op), "every op needs a handler"
