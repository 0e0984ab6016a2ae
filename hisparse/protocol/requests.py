"""Requests: one frozen dataclass per op, and the decoder that validates a frame into one.

``decode_request`` is the daemon's only entry for untrusted bytes: every
field is type- and range-checked here, so handlers receive plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hisparse import errors
from hisparse.layout import MAX_SIZE_BYTES, KVLayout, parse_size
from hisparse.protocol.codes import (
    ADMIN_OPS, MAX_EVENTS_PER_REPLY, MAX_FRAME_BYTES, MAX_KEY_BYTES, MAX_KEYS_PER_REQUEST,
    MAX_NAMESPACE_CHARS, MIN_KEY_BYTES, VERSION, ErrorCode, Op, WireError,
)
from hisparse.protocol.frames import KEY_FIELDS, SHORT_BINS, unpack_request

_KEYS = KEY_FIELDS[0]
assert MIN_KEY_BYTES == 1, "_keys checks keys of a frame msgpack held to short bins only for emptiness"


@dataclass(frozen=True)
class Request:
    op: Op
    id: int
    session: int | None


@dataclass(frozen=True)
class HelloRequest(Request):
    namespace: str | None  # None: an admin session with no region (hisparsectl)
    layout: KVLayout | None
    capacity_bytes: int | None  # region size if this hello creates the namespace
    client: str  # free text for logs: "pid 1234 vllm-engine-0"
    access_key: str | None = None  # a group-restricted namespace's key (access/<tag>.key beside the socket)
    token: str | None = None  # admin session: the admin token, to see every namespace in stats


@dataclass(frozen=True)
class PingRequest(Request):
    pass


@dataclass(frozen=True)
class KeysRequest(Request):
    """lookup, reserve, commit, abort, pin, unpin."""

    keys: tuple[bytes, ...]
    # abort only: skip keys this session does not hold instead of refusing
    # (a client whose reserve reply was lost cleans up what it may hold)
    missing_ok: bool = False
    # lookup only: also count the keys after the local prefix that the cluster holds
    remote: bool = False
    # lookup with remote, prefetch: answer once the cluster has (False: at once)
    wait: bool = True
    # reserve, pin: the calling operation's tag (a client-chosen nonce); abort: give back only
    # what reserves with this tag took. A call whose reply was lost releases exactly its own.
    tag: int | None = None
    # pin only: these keys were looked up in the client's own mirror of the namespace (the vLLM
    # adapter's lookups never reach the daemon), and ``missed`` more keys missed there since its
    # last such pin; the namespace counts them as lookups (hit: the keys pinned). None: a plain pin.
    missed: int | None = None


@dataclass(frozen=True)
class PagesRequest(Request):
    """unpin: page ids as the pin reply gave them (a page pinned twice is listed twice).

    With ``tag``: the pages leave that tagged call's record too; with ``tag``
    and no ``pages``: every pin that call's requests took and did not give
    back is released (its reply was lost).
    """

    pages: tuple[int, ...]
    tag: int | None = None
    whole_call: bool = False  # no pages, a tag: release what that call pinned


@dataclass(frozen=True)
class PublishRequest(Request):
    """publish: reservations held under ``keys`` become committed pages under ``as_keys``."""

    keys: tuple[bytes, ...]
    as_keys: tuple[bytes, ...]
    pin: bool  # the session also pins each published page (it is still reading it)


@dataclass(frozen=True)
class SessionRequest(Request):
    """heartbeat, stats, bye."""


@dataclass(frozen=True)
class EventsRequest(Request):
    after: int  # last sequence number the caller has applied
    limit: int


@dataclass(frozen=True)
class KeysPageRequest(Request):
    cursor: int  # page id to start the scan at; 0 for the first page
    limit: int


@dataclass(frozen=True)
class AdminRequest(Request):
    token: str
    namespace: str | None  # clear: the namespace; shutdown: None
    target: str | None = None  # evict_session: the session's 8-hex-digit handle
    force: bool = False  # drop: end the namespace's sessions too


_KEY_OPS = frozenset({Op.LOOKUP, Op.RESERVE, Op.COMMIT, Op.ABORT, Op.PIN, Op.PREFETCH})
_TAGGED_OPS = frozenset({Op.RESERVE, Op.ABORT, Op.PIN, Op.UNPIN})
MAX_PAGE_ID = (1 << 31) - 1


def _field(msg: dict[str, Any], name: str, types: tuple[type, ...], *, optional: bool = False) -> Any:
    if name not in msg or (optional and msg[name] is None):
        if optional:
            return None
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"missing field {name!r}")
    value = msg[name]
    # bool is an int in Python; on the wire it is not one.
    if isinstance(value, bool) and bool not in types:
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"field {name!r} must be {_tname(types)}, not bool")
    if not isinstance(value, types):
        raise WireError(ErrorCode.PROTOCOL_ERROR,
                        f"field {name!r} must be {_tname(types)}, not {type(value).__name__}")
    return value


MAX_WIRE_INT = (1 << 63) - 1


def _number(msg: dict[str, Any], name: str) -> int:
    """A required non-negative integer field below 2**63 (ids, sessions, cursors)."""
    value = msg.get(name)
    if type(value) is int and 0 <= value <= MAX_WIRE_INT:  # the common case: no further checks
        return value
    value = _field(msg, name, (int,))
    if not 0 <= value <= MAX_WIRE_INT:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be 0-{MAX_WIRE_INT}, not {value}")
    return value


def _tag(msg: dict[str, Any], op: Op) -> int | None:
    """A call's tag: an optional non-negative integer below 2**63 on the ops that take one."""
    if op not in _TAGGED_OPS or msg.get("tag") is None:
        return None
    return _number(msg, "tag")


def _tname(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def _keys(msg: dict[str, Any], name: str = _KEYS, proven: frozenset[str] = frozenset()) -> tuple[bytes, ...]:
    """A key list field; ``proven``: fields whose items the scan proved keys (``scan.scan_frame``)."""
    raw = _field(msg, name, (list,))
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{len(raw)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    keys = tuple(raw)
    if name in proven:  # the largest frames: their items were walked once already
        return keys
    # The common case checked in C (a flood of the largest requests costs the
    # loop little); the loop below only runs to name the offending key. The
    # join fails on anything but bytes: of what msgpack decodes, only bytes
    # have the buffer protocol.
    try:
        b"".join(keys)
    except TypeError:
        pass
    else:
        if SHORT_BINS in proven:  # msgpack held every bin to MAX_KEY_BYTES: left, MIN_KEY_BYTES (1)
            if all(keys):  # no key is empty
                return keys
        else:
            lengths = set(map(len, keys))  # usually one length: min and max are then free
            if not lengths or (MIN_KEY_BYTES <= min(lengths) and max(lengths) <= MAX_KEY_BYTES):
                return keys
    for i, key in enumerate(raw):
        if not isinstance(key, bytes):
            raise WireError(ErrorCode.PROTOCOL_ERROR, f"{name}[{i}] must be bytes, not {type(key).__name__}")
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise WireError(ErrorCode.INVALID_ARGUMENT,
                            f"{name}[{i}] is {len(key)} bytes; keys are {MIN_KEY_BYTES}-{MAX_KEY_BYTES} bytes")
    return keys


def _pages(msg: dict[str, Any], proven: frozenset[str] = frozenset()) -> tuple[int, ...]:
    raw = _field(msg, "pages", (list,))
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{len(raw)} pages in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    if "pages" in proven:
        return tuple(raw)
    for i, page in enumerate(raw):
        if not isinstance(page, int) or isinstance(page, bool):
            raise WireError(ErrorCode.PROTOCOL_ERROR, f"pages[{i}] must be int, not {type(page).__name__}")
        if not 0 <= page <= MAX_PAGE_ID:
            raise WireError(ErrorCode.INVALID_ARGUMENT, f"pages[{i}] = {page} is not a page id")
    return tuple(raw)


def _limit(msg: dict[str, Any]) -> int:
    limit = _field(msg, "limit", (int,), optional=True)
    if limit is None:
        return MAX_EVENTS_PER_REPLY
    if not 1 <= limit <= MAX_EVENTS_PER_REPLY:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"limit must be 1-{MAX_EVENTS_PER_REPLY}, not {limit}")
    return limit


def _hello(op: Op, rid: int, msg: dict[str, Any]) -> HelloRequest:
    namespace = _field(msg, "namespace", (str,), optional=True)
    layout_raw = _field(msg, "layout", (dict,), optional=True)
    capacity = _field(msg, "capacity_bytes", (int,), optional=True)
    if capacity is None and msg.get("capacity") is not None:
        # docs/design.md's attach() says ``capacity`` (bytes or "384GiB"): take it too.
        try:
            capacity = parse_size(_field(msg, "capacity", (int, str)))
        except errors.InvalidArgument as exc:
            raise WireError(ErrorCode.INVALID_ARGUMENT, f"capacity: {exc}") from None
    client = _field(msg, "client", (str,), optional=True) or ""
    if namespace is not None:
        if not namespace or len(namespace) > MAX_NAMESPACE_CHARS or not namespace.isprintable():
            raise WireError(ErrorCode.INVALID_ARGUMENT,
                            f"namespace must be 1-{MAX_NAMESPACE_CHARS} printable characters")
        if layout_raw is None:
            raise WireError(ErrorCode.PROTOCOL_ERROR, "hello with a namespace needs a layout")
    layout = None
    if layout_raw is not None:
        try:
            layout = KVLayout.from_wire(layout_raw)
        except errors.InvalidArgument as exc:
            raise WireError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
    if capacity is not None and not 0 < capacity <= MAX_SIZE_BYTES:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"capacity_bytes must be 1-{MAX_SIZE_BYTES}, not {str(capacity)[:24]}")
    access_key = _field(msg, "access_key", (str,), optional=True)
    token = _field(msg, "token", (str,), optional=True)
    if access_key is not None and len(access_key) > 256 or token is not None and len(token) > 256:
        raise WireError(ErrorCode.INVALID_ARGUMENT, "access_key and token are at most 256 characters")
    return HelloRequest(op, rid, None, namespace, layout, capacity, client[:200], access_key, token)


_OPS = {op.value: op for op in Op}
_ABORT, _LOOKUP, _PIN, _PREFETCH = Op.ABORT, Op.LOOKUP, Op.PIN, Op.PREFETCH  # a global: ``Op.X`` costs ~90 ns a load
_new = object.__new__
_set = object.__setattr__


def _keys_request(op: Op, rid: int, session: int, keys: tuple[bytes, ...], missing_ok: bool,
                  remote: bool, wait: bool, tag: int | None, missed: int | None = None) -> KeysRequest:
    """``KeysRequest(...)`` at half the cost: the frozen dataclass's ``__init__`` sets
    each field through ``object.__setattr__``; this sets its ``__dict__`` once."""
    req = _new(KeysRequest)
    _set(req, "__dict__", {"op": op, "id": rid, "session": session, "keys": keys,
                           "missing_ok": missing_ok, "remote": remote, "wait": wait, "tag": tag,
                           "missed": missed})
    return req


def _flag(msg: dict[str, Any], name: str) -> bool | None:
    """An optional bool field (``_field(msg, name, (bool,), optional=True)``)."""
    value = msg.get(name)
    if value is None or type(value) is bool:
        return value
    return _field(msg, name, (bool,), optional=True)  # raises, naming the type


def decode_request(frame: bytes) -> Request:
    """Parse and validate one request frame, decoding it once; raises ``WireError``.

    The error carries the request's id (``WireError.rid``) whenever it could
    be read, so the caller answers ``encode_error(exc.rid, ...)`` without
    decoding the frame again.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {len(frame)} bytes; the limit is {MAX_FRAME_BYTES}")
    msg, proven = unpack_request(frame)
    raw_id = msg.get("id")
    try:
        return _request(msg, proven)
    except WireError as exc:
        if type(raw_id) is int and 0 <= raw_id <= MAX_WIRE_INT:
            exc.rid = raw_id
        raise


def _request(msg: dict[str, Any], proven: frozenset[str]) -> Request:
    version = msg.get("v")
    if type(version) is not int or version != VERSION:  # not 2.0, not True
        raise WireError(ErrorCode.VERSION_MISMATCH,
                        f"protocol version {version!r}; this daemon speaks {VERSION}")
    rid = _number(msg, "id")
    op_name = _field(msg, "op", (str,))
    op = _OPS.get(op_name)
    if op is None:
        raise WireError(ErrorCode.UNKNOWN_OP, f"unknown op {op_name[:64]!r}")
    if op in _KEY_OPS:  # the hot path (lookups) first; no key op is hello, ping or admin
        session = _number(msg, "session")
        missing_ok = _flag(msg, "missing_ok") if op is _ABORT else None
        remote = _flag(msg, "remote") if op is _LOOKUP else None
        wait = _flag(msg, "wait") if op is _LOOKUP or op is _PREFETCH else None
        missed = _number(msg, "missed") if op is _PIN and msg.get("missed") is not None else None
        return _keys_request(op, rid, session, _keys(msg, _KEYS, proven), bool(missing_ok),
                             bool(remote), wait is not False, _tag(msg, op), missed)
    if op is Op.HELLO:
        return _hello(op, rid, msg)
    if op is Op.PING:
        return PingRequest(op, rid, None)
    if op in ADMIN_OPS:  # the token is checked first: without it, nothing else matters
        token = _field(msg, "token", (str,), optional=True)
        if token is None:
            raise WireError(ErrorCode.PERMISSION_DENIED, f"{op.value} needs the admin token")
        session = _number(msg, "session")
        namespace = _field(msg, "namespace", (str,)) if op in (Op.CLEAR, Op.DROP) else None
        force = bool(_field(msg, "force", (bool,), optional=True)) if op is Op.DROP else False
        target = None
        if op is Op.EVICT_SESSION:
            target = _field(msg, "target", (str,)).lower()
            if len(target) != 8 or any(c not in "0123456789abcdef" for c in target):
                raise WireError(ErrorCode.INVALID_ARGUMENT,
                                f"target must be a session's 8-hex-digit handle, not {target[:20]!r}")
        return AdminRequest(op, rid, session, token, namespace, target, force)
    session = _number(msg, "session")
    if op is Op.UNPIN:
        tag = _tag(msg, op)
        if tag is not None and msg.get("pages") is None:
            return PagesRequest(op, rid, session, (), tag, whole_call=True)
        return PagesRequest(op, rid, session, _pages(msg, proven), tag)
    if op is Op.PUBLISH:
        keys, as_keys = _keys(msg, _KEYS, proven), _keys(msg, "as_keys", proven)
        if len(keys) != len(as_keys):
            raise WireError(ErrorCode.INVALID_ARGUMENT,
                            f"publish: {len(keys)} keys but {len(as_keys)} as_keys")
        return PublishRequest(op, rid, session, keys, as_keys,
                              bool(_field(msg, "pin", (bool,), optional=True)))
    if op is Op.EVENTS:
        return EventsRequest(op, rid, session, _number(msg, "after"), _limit(msg))
    if op is Op.KEYS:
        cursor = _number(msg, "cursor")
        return KeysPageRequest(op, rid, session, cursor, _limit(msg))
    return SessionRequest(op, rid, session)
