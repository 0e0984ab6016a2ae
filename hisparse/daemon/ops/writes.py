"""The handlers that change a session's holds: reserve, commit, abort, pin, unpin, publish.

Each is served in slices of ``slicing.SLICE_KEYS`` keys with the loop free
between them (``slicing.py`` says how and what may change meanwhile). The
rules that keep a sliced request as safe as an unsliced one:

- Everything that can refuse the whole request (keys not held, a key
  listed twice, a quota) is checked before the first change, so a refusal
  still changes nothing. Checking may itself take slices: only this
  session's own requests (which wait behind this one) or its end (which
  stops this one) can change what was checked.
- Every change of a slice is on record (table, fence, session) before the
  slice ends, in the order a crash needs: a reservation is fenced before
  its reply grants it; a published page is pinned before its reservation's
  fence record goes.
- Nothing another tenant can take is kept across a slice: a pin re-walks
  its slice's committed prefix and pins it at once (a page found in an
  earlier slice may have been evicted since; the prefix then ends there).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from hisparse.daemon.ops.context import DaemonContext, ns_of
from hisparse.daemon.ops.slicing import SLICE_KEYS, Sliced, Steps, run, session_alive, spans
from hisparse.daemon.policy.quotas import check_pin_quota, reserve_room, shortfall
from hisparse.daemon.store.namespaces import Namespace
from hisparse.daemon.store.sessions import PinHold, Session
from hisparse.protocol import ErrorCode, KeysRequest, PagesRequest, PublishRequest, WireError

CHECK_SLICE = 4 * SLICE_KEYS  # checking a key (a dict lookup) costs a few times less than changing it


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


def _refuse_given_back(session: Session, req: KeysRequest) -> None:
    """A request of a call that was already given up (its reply lost) takes nothing."""
    if session.tags.given_back(req.tag):
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{req.op.value}: its call (tag {req.tag}) was already given up; nothing taken")


def _sliced(ctx: DaemonContext, session: Session, steps: Steps) -> dict[str, Any] | Sliced:
    return run(steps, session_alive(ctx, session))


def _taking(session: Session, req: KeysRequest) -> Namespace:
    """The namespace of a request that takes pages: the fence held, its call not given up."""
    ns = ns_of(session)
    _require_fence(session, req.op.value)
    _refuse_given_back(session, req)
    return ns


# -- reserve --

def handle_reserve(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Sliced:
    return _sliced(ctx, session, _reserve(ctx, session, req, _taking(session, req)))


def _reserve(ctx: DaemonContext, session: Session, req: KeysRequest, ns: Namespace) -> Steps:
    room, limit = reserve_room(ctx, session)  # none at all: refused, nothing taken
    slots: list[int] = []
    evicted: list[bytes] = []
    new = 0
    for start, stop in spans(len(req.keys)):
        if start:
            yield
            try:  # again: other connections of this uid may have taken some since
                room, limit = reserve_room(ctx, session)
            except WireError:
                room = 0  # the quota's end: the reply's shortfall says so
        keys = req.keys[start:stop]
        got, gone = ns.index.reserve(keys, session.reservations, room)
        pages = [s for s in got if s >= 0]
        # The hold is on record before the reply grants it: a successor daemon fences it.
        session.fence.add_reserved(pages)  # type: ignore[union-attr]
        session.tags.reserved(req.tag, [key for key, s in zip(keys, got) if s >= 0])
        slots += got
        evicted += gone
        new += len(pages)
        if len(got) < stop - start:
            room -= len(pages)  # what the quota still allowed when this slice stopped
            break  # no room, or the quota's end
    if evicted:
        ctx.evictions_since_log[ns.name] = ctx.evictions_since_log.get(ns.name, 0) + len(evicted)
    if ctx.cluster is not None:
        ctx.cluster.reserved(ns)
    return {"slots": slots, "evicted": evicted,
            "shortfall": shortfall(ctx, session, len(req.keys), len(slots), new, new + room, limit)}


# -- commit, abort: settle reservations --

def _held(session: Session, keys: tuple[bytes, ...], what: str) -> Generator[None, None, list[int]]:
    """The pages of ``keys`` that ``session`` reserved; all or nothing (a refusal changes nothing)."""
    pages: list[int] = []
    get = session.reservations.get
    for start, stop in spans(len(keys), CHECK_SLICE):
        if start:
            yield
        for i in range(start, stop):
            page = get(keys[i])
            if page is None:
                raise WireError(ErrorCode.NOT_HELD,
                                f"{what}: keys[{i}] is not reserved by this session (nothing changed)")
            pages.append(page)
    if len(set(keys)) != len(keys):
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"{what}: a key is listed twice (nothing changed)")
    return pages


def _settle(session: Session, keys: tuple[bytes, ...] | list[bytes], pages: list[int],
            apply: Callable[[bytes, int], None], after: Callable[[], None] = lambda: None) -> Steps:
    """Commit or abort (``apply``) reservations ``session`` holds, a slice at a time."""
    for start, stop in spans(len(keys)):
        if start:
            yield
        for key, page in zip(keys[start:stop], pages[start:stop]):
            del session.reservations[key]
            apply(key, page)
        session.tags.settled(keys[start:stop])
        session.fence.clear_reserved(pages[start:stop])  # type: ignore[union-attr]  (after: a crash keeps it fenced)
        after()
    return {}


def handle_commit(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Sliced:
    return _sliced(ctx, session, _commit(ctx, session, req, ns_of(session)))


def _commit(ctx: DaemonContext, session: Session, req: KeysRequest, ns: Namespace) -> Steps:
    pages = yield from _held(session, req.keys, "commit")
    index = ns.index
    done: list[tuple[bytes, int]] = []
    cleared: list[bytes] = []
    committed = 0

    def commit(key: bytes, page: int) -> None:
        if page in index.cleared_writes:  # reserved before a clear: its bytes predate it
            index.abort(key, page)
            cleared.append(key)
            return
        index.commit(key, page)
        done.append((key, page))

    def to_cluster() -> None:  # each slice's commits go behind to the cluster tier
        nonlocal committed
        if ctx.cluster is not None and done:
            ctx.cluster.committed(ns, list(done))
        committed += len(done)
        done.clear()

    yield from _settle(session, req.keys, pages, commit, to_cluster)
    return {"committed": committed, "cleared": cleared} if cleared else {"committed": committed}


def handle_abort(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Sliced:
    return _sliced(ctx, session, _abort(session, req, ns_of(session)))


def _abort(session: Session, req: KeysRequest, ns: Namespace) -> Steps:
    if req.tag is not None or req.missing_ok:
        # tag: only what that call's reserves took, never another thread's live reservation
        keys = session.tags.reserved_by(req.tag, req.keys) if req.tag is not None else req.keys
        held = [key for key in dict.fromkeys(keys) if key in session.reservations]
        pages = [session.reservations[key] for key in held]
    else:
        held = list(req.keys)
        pages = yield from _held(session, req.keys, "abort")
    yield from _settle(session, held, pages, ns.index.abort)
    return {"aborted": len(held)}


# -- pin, unpin --

def handle_pin(ctx: DaemonContext, session: Session, req: KeysRequest) -> dict[str, Any] | Sliced:
    return _sliced(ctx, session, _pin(ctx, session, req, _taking(session, req)))


def _pin(ctx: DaemonContext, session: Session, req: KeysRequest, ns: Namespace) -> Steps:
    found: list[int] = []  # the committed prefix, walked once for the quota (touching nothing)
    for start, stop in spans(len(req.keys), CHECK_SLICE):
        if start:
            yield
        run_ = ns.index.committed_prefix_pages(req.keys[start:stop])
        found += run_
        if len(run_) < stop - start:
            break
    check_pin_quota(ctx, session, found)  # refused: nothing pinned
    pages: list[int] = []
    for start, stop in spans(len(found)):
        if start:
            yield
        # Pinned in the slice that (re)found them: an earlier slice's walk may be stale.
        now = ns.index.committed_prefix_pages(req.keys[start:stop])
        same = 0
        for page, was in zip(now, found[start:stop]):
            if page != was:
                break
            same += 1
        if start:
            try:  # again: other connections of this uid may have pinned since
                check_pin_quota(ctx, session, now[:same])
            except WireError:
                break  # the prefix pinned ends here, within the quota
        _pin_held(ctx, session, ns, req.keys[start:start + same], now[:same], req.tag)
        pages += now[:same]
        if same < stop - start:
            break  # evicted meanwhile: the prefix ends here
    if req.missed is not None:  # a mirror's lookups (the vLLM adapter): its hits are these pins
        ns.index.count_lookup(len(req.keys) + req.missed, len(pages))
    return {"count": len(pages), "pages": pages}


def _pin_held(ctx: DaemonContext, session: Session, ns: Namespace, keys: tuple[bytes, ...] | list[bytes],
              pages: list[int], tag: int | None) -> None:
    """Pin ``pages`` (of ``keys``) for ``session``: in the index, its fence, its call's record,
    its holds and its peer's count."""
    if not pages:
        return
    ns.index.pin_pages(pages)
    session.fence.add_pins(pages)  # type: ignore[union-attr]
    session.tags.pinned(tag, pages)
    holds = session.pins
    added = []
    for key, page in zip(keys, pages):
        hold = holds.get(page)
        if hold is None:
            holds[page] = PinHold(key, 1)
            added.append(page)
        else:
            hold.count += 1
    ctx.sessions.note_pins(session.owner.key, ns.name, added, [])


def handle_unpin(ctx: DaemonContext, session: Session, req: PagesRequest) -> dict[str, Any] | Sliced:
    ns = ns_of(session)
    if req.whole_call:
        assert req.tag is not None
        return {"unpinned": _unpin_pages(ctx, session, ns, session.tags.take_pins(req.tag), strict=False)}
    return _sliced(ctx, session, _unpin(ctx, session, req, ns))


def _unpin(ctx: DaemonContext, session: Session, req: PagesRequest, ns: Namespace) -> Steps:
    need: dict[int, int] = {}
    for start, stop in spans(len(req.pages), CHECK_SLICE):
        if start:
            yield
        for i in range(start, stop):
            page = req.pages[i]
            need[page] = need.get(page, 0) + 1
            held = session.pins.get(page)
            if held is None or held.count < need[page]:
                raise WireError(ErrorCode.NOT_HELD,
                                f"unpin: pages[{i}] = {page} is not pinned by this session "
                                "(that many times); nothing changed")
    for start, stop in spans(len(req.pages)):
        if start:
            yield
        pages = list(req.pages[start:stop])
        _unpin_pages(ctx, session, ns, pages)
        if req.tag is not None:
            session.tags.unpinned(req.tag, pages)
    return {"unpinned": len(req.pages)}


def _unpin_pages(ctx: DaemonContext, session: Session, ns: Namespace, pages: list[int],
                 strict: bool = True) -> int:
    """Drop one of ``session``'s pins of each of ``pages``; not ``strict``: those it still holds
    (a call whose reply was lost). Returns how many."""
    index = ns.index
    done, gone = [], []
    for page in pages:
        held = session.pins.get(page)
        if held is None and not strict:
            continue
        assert held is not None
        index.unpin(page)
        held.count -= 1
        if held.count == 0:
            del session.pins[page]
            gone.append(page)
        done.append(page)
    ctx.sessions.note_pins(session.owner.key, ns.name, [], gone)
    session.fence.remove_pins(done)  # type: ignore[union-attr]
    return len(done)


# -- publish --

def handle_publish(ctx: DaemonContext, session: Session, req: PublishRequest) -> dict[str, Any] | Sliced:
    """Commit reservations under the keys their bytes turned out to have.

    vLLM's HiSparse host pool hands a block out before its tokens exist, so
    the reservation's key is a placeholder and the block hash comes at
    publication. A key someone already committed (or is writing) is not
    published twice, and a reservation taken before a ``clear`` is never
    published after it: that reservation stays held (its engine may still be
    using the page), its page id is -1 here. Refused once for a clear, the
    reservation is a fresh one again: the block vLLM's pool next writes into
    that page comes after the clear.
    """
    return _sliced(ctx, session, _publish(ctx, session, req, ns_of(session)))


def _publish(ctx: DaemonContext, session: Session, req: PublishRequest, ns: Namespace) -> Steps:
    held = yield from _held(session, req.keys, "publish")
    if len(set(req.as_keys)) != len(req.as_keys):
        raise WireError(ErrorCode.INVALID_ARGUMENT, "publish: an as_key is listed twice (nothing changed)")
    if req.pin:
        check_pin_quota(ctx, session, held, reserved_now=True)  # a pin (nothing changed if refused)
    index = ns.index
    pages: list[int] = []
    for start, stop in spans(len(req.keys)):
        if start:
            yield
            if req.pin:
                try:  # again: other connections of this uid may have pinned since
                    check_pin_quota(ctx, session, held[start:stop], reserved_now=True)
                except WireError:
                    pages += [-1] * (len(req.keys) - start)  # not published; still reserved
                    break
        keys = index.keys  # re-read each slice: a namespace's clear rebuilds it
        done: list[tuple[bytes, int]] = []
        settled: list[bytes] = []
        cleared = index.cleared_writes
        for key, new_key, page in zip(req.keys[start:stop], req.as_keys[start:stop], held[start:stop]):
            if page in cleared:  # reserved before a clear: what it holds now may predate it
                cleared.discard(page)  # the page's next use (a block written after it) may publish
                pages.append(-1)
                continue
            if new_key != key and new_key in keys:
                pages.append(-1)
                continue
            del session.reservations[key]
            index.rename(key, new_key, page)
            index.commit(new_key, page)
            done.append((new_key, page))
            settled.append(key)
            pages.append(page)
        session.tags.settled(settled)
        published = [page for _, page in done]
        if req.pin:  # pinned before the reservations' fence records go: the pages stay fenced
            _pin_held(ctx, session, ns, [key for key, _ in done], published, None)
        session.fence.clear_reserved(published)  # type: ignore[union-attr]
        if ctx.cluster is not None and done:
            ctx.cluster.committed(ns, done)  # published pages go behind to the cluster like any commit
    return {"pages": pages}
