"""The hisparse wire protocol: the one module that knows the bytes on the socket.

Transport: ZeroMQ, a ROUTER in the daemon and a DEALER in each client, on an
``ipc://`` endpoint (a unix socket file). Frames as the daemon sees them::

    +-----------------+------------------------------------------+
    | identity (zmq)  | one msgpack map: the request              |
    +-----------------+------------------------------------------+

Every request is ``{v, id, op, ...fields}``; every reply is ``{v, id, ok:
{...}}`` or ``{v, id, error: {code, message}}``. Example::

    -> {"v": 2, "id": 7, "op": "lookup", "session": 3, "keys": [b"\\x01...", b"\\x02..."]}
    <- {"v": 2, "id": 7, "ok": {"count": 2}}
    -> {"v": 2, "id": 8, "op": "commit", "session": 3, "keys": [b"\\x09..."]}
    <- {"v": 2, "id": 8, "error": {"code": "NOT_HELD", "message": "..."}}

A session is bound to the connection that opened it: its id sent on any
other connection is ``UNKNOWN_SESSION``. Before its first ``reserve`` or
``pin`` a namespace session's client must hold ``flock(LOCK_SH)`` on the
fence file the hello reply names (``hisparse.shm.fence``).

Only metadata crosses the socket; page bytes move through the shared regions.
Daemon and client both import this module and never each other. Nothing else
in hisparse calls msgpack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from hisparse import errors
from hisparse.layout import MAX_SIZE_BYTES, KVLayout, parse_size

VERSION = 2  # 2: fences, unpin by page, sessions bound to their connection

MAX_FRAME_BYTES = 8 << 20  # a larger frame is refused before it is decoded
MAX_KEYS_PER_REQUEST = 16_384  # 1M tokens at block size 64; clients split longer chains. Small enough
# that one request costs the loop a few ms (what a flooding peer may delay others by)
MIN_KEY_BYTES = 1
MAX_KEY_BYTES = 64  # vLLM's OffloadKey is 36 bytes (32-byte hash + 4-byte group)
MAX_NAMESPACE_CHARS = 256
MAX_EVENTS_PER_REPLY = 65_536


class Op(str, enum.Enum):
    """Operation names, as sent in a request's ``op`` field."""

    HELLO = "hello"  # open a session: version, namespace and KVLayout handshake
    PING = "ping"  # liveness: version and uptime; needs no session
    LOOKUP = "lookup"  # how many leading keys are committed
    RESERVE = "reserve"  # claim pages for keys not yet committed (evicting LRU pages)
    COMMIT = "commit"  # publish reserved pages: WRITING -> COMMITTED
    ABORT = "abort"  # drop reservations: WRITING -> FREE, never visible
    PIN = "pin"  # hold the committed prefix of keys against eviction
    UNPIN = "unpin"  # release pins taken by this session, by page id
    HEARTBEAT = "heartbeat"  # keep the session's lease alive
    STATS = "stats"  # counters for every namespace and the daemon
    EVENTS = "events"  # commit/evict events of the namespace after a sequence number
    KEYS = "keys"  # page through the namespace's committed keys (mirror resync)
    CLEAR = "clear"  # admin: drop every committed page of one namespace
    SHUTDOWN = "shutdown"  # admin: stop the daemon as SIGTERM would
    BYE = "bye"  # close the session now, releasing everything it holds
    DROP = "drop"  # admin: remove a namespace and its region; its memory goes back to the capacity
    EVICT_SESSION = "evict_session"  # admin: end a session (or a fenced one) and free its pages now
    PUBLISH = "publish"  # commit reservations under new keys (vLLM HiSparse: a block's hash comes late)
    PREFETCH = "prefetch"  # promote the cluster tier's pages of keys into the namespace


# The ``ok`` body of each op's reply. Every field is listed here; the daemon's
# handlers build exactly these maps and the client reads exactly these names.
REPLY_FIELDS: dict[Op, dict[str, str]] = {
    Op.HELLO: {
        "session": "int: the id every later request names",
        "lease_ttl_s": "float: a session silent this long loses its reservations and pins",
        "daemon_pid": "int", "daemon_version": "str",
        "region": "map or nil (admin session): path (str), size_bytes, num_pages, page_bytes, "
                  "num_layers, block_tokens, row_bytes, layer_stride_bytes (ints), "
                  "region_id (int, changes when the file is re-created), created (bool)",
        "events_seq": "int: the namespace's event sequence number now",
        "warnings": "list[str]: what the attacher should know, e.g. a requested capacity that is "
                    "not the existing namespace's (also logged by the daemon)",
        "fence": "str or nil (admin session): the session's fence file, in fences/ beside "
                 "the socket; hold flock(LOCK_SH) on it while any process may touch its pages",
    },
    Op.PING: {"version": "str", "protocol": "int", "uptime_s": "float", "pid": "int"},
    Op.LOOKUP: {"count": "int: leading keys that are committed",
                "remote": "int, only when the request says remote: true: how many keys after "
                          "those the cluster tier holds (0 without one); wait: false answers "
                          "from what the daemon already knows and asks the cluster meanwhile"},
    Op.RESERVE: {"slots": "list[int], one per key processed in order: a page id to write, "
                          "SLOT_COMMITTED or SLOT_BUSY; shorter than keys when the region is full",
                 "evicted": "list[bytes]: keys evicted (least recently used) to make room"},
    Op.COMMIT: {"committed": "int"},
    Op.ABORT: {"aborted": "int (the request may say missing_ok: true to skip keys not held)"},
    Op.PIN: {"count": "int: leading keys pinned", "pages": "list[int]: their page ids"},
    Op.UNPIN: {"unpinned": "int (the request names pages: list[int], as pin replied them)"},
    Op.HEARTBEAT: {"lease_ttl_s": "float"},
    Op.STATS: {"daemon": "map of daemon counters", "namespaces": "map name -> map of counters",
               "sessions": "list of maps (admin sessions only): handle, namespace, client, state "
                           "(live | fenced), pids (holding its fence), age_s, idle_s, "
                           "reserved_pages, pinned_pages, fenced_pages"},
    Op.EVENTS: {"seq": "int: sequence number of the last event returned (or now)",
                "events": "list of [kind, key, page]: EVENT_COMMIT / EVENT_EVICT",
                "reset": "bool: events after `after` are gone; resync with `keys`"},
    Op.KEYS: {"keys": "list of [key, page]", "next_cursor": "int, -1 when the scan is done",
              "seq": "int: event sequence number when this page was read"},
    Op.CLEAR: {"freed_pages": "int", "doomed_pages": "int: pinned now, freed on their last unpin"},
    Op.SHUTDOWN: {},
    Op.BYE: {},
    Op.DROP: {"freed_bytes": "int: what the namespace took from the capacity",
              "ended_sessions": "int: sessions ended (needs force: true when any were attached)"},
    Op.EVICT_SESSION: {"freed_pages": "int: fenced pages freed", "released_pins": "int"},
    Op.PUBLISH: {"pages": "list[int], one per key: the page now committed under as_keys[i], or -1 "
                          "when as_keys[i] was already taken (that reservation stays held under keys[i])"},
    Op.PREFETCH: {"queued": "int: keys being promoted in the background (wait: false)",
                  "promoted": "int: pages fetched, verified and committed", "local": "int: "
                  "already committed here", "missing": "int: not in the cluster",
                  "refused": "int: values whose header or hash did not match (dropped)",
                  "busy": "int: being written by a session here",
                  "missing_keys": "list[bytes]: the keys counted in missing (empty unless waited)"},
}

SESSIONLESS_OPS = frozenset({Op.HELLO, Op.PING})
ADMIN_OPS = frozenset({Op.CLEAR, Op.SHUTDOWN, Op.EVICT_SESSION, Op.DROP})


class ErrorCode(str, enum.Enum):
    """Codes of an error reply; ``error_for_code`` maps each to an exception class."""

    PROTOCOL_ERROR = "PROTOCOL_ERROR"  # not msgpack, not a map, missing field, wrong type
    VERSION_MISMATCH = "VERSION_MISMATCH"  # the frame's ``v`` is not ours
    UNKNOWN_OP = "UNKNOWN_OP"  # ``op`` names no operation
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # frame over MAX_FRAME_BYTES
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # well formed, unacceptable values
    NOT_HELD = "NOT_HELD"  # commit/abort/unpin of keys or pages this session does not hold
    NOT_FENCED = "NOT_FENCED"  # reserve/pin before the client locked its session's fence file
    UNKNOWN_SESSION = "UNKNOWN_SESSION"  # no session, or one expired / from an earlier run
    NOT_ATTACHED = "NOT_ATTACHED"  # a data op on an admin session (hello without namespace)
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"  # namespace exists under another KVLayout
    CAPACITY = "CAPACITY"  # a region would not fit in the daemon's capacity
    PERMISSION_DENIED = "PERMISSION_DENIED"  # admin op without the admin token
    SHUTTING_DOWN = "SHUTTING_DOWN"  # the daemon is draining and takes no new work
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # a per-session limit (the message names it) would be passed
    CLUSTER_UNAVAILABLE = "CLUSTER_UNAVAILABLE"  # no cluster tier, or it did not answer in time
    INTERNAL = "INTERNAL"  # a bug in the daemon; it logged a traceback and serves on


_ERROR_CLASSES: dict[ErrorCode, type[errors.HisparseError]] = {
    ErrorCode.PROTOCOL_ERROR: errors.ProtocolError,
    ErrorCode.VERSION_MISMATCH: errors.ProtocolError,
    ErrorCode.UNKNOWN_OP: errors.ProtocolError,
    ErrorCode.FRAME_TOO_LARGE: errors.ProtocolError,
    ErrorCode.INVALID_ARGUMENT: errors.InvalidArgument,
    ErrorCode.NOT_HELD: errors.InvalidArgument,
    ErrorCode.NOT_FENCED: errors.InvalidArgument,
    ErrorCode.UNKNOWN_SESSION: errors.LeaseExpired,
    ErrorCode.NOT_ATTACHED: errors.InvalidArgument,
    ErrorCode.LAYOUT_MISMATCH: errors.LayoutMismatch,
    ErrorCode.CAPACITY: errors.CapacityError,
    ErrorCode.PERMISSION_DENIED: errors.PermissionDenied,
    ErrorCode.SHUTTING_DOWN: errors.DaemonUnavailable,
    ErrorCode.QUOTA_EXCEEDED: errors.QuotaExceeded,
    ErrorCode.CLUSTER_UNAVAILABLE: errors.ClusterUnavailable,
    ErrorCode.INTERNAL: errors.HisparseError,
}


class WireError(Exception):
    """Raised while decoding or handling a request; becomes an error reply."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_for_code(code: str, message: str) -> errors.HisparseError:
    """The exception a client raises for an error reply."""
    try:
        cls = _ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        cls = errors.ProtocolError
        message = f"unknown error code {code!r}: {message}"
    return cls(f"[{code}] {message}")


# Slot values in a reserve reply, one per key processed, in key order.
SLOT_COMMITTED = -1  # already committed: nothing to write
SLOT_BUSY = -2  # being written (by any session, this one too): wait for its commit or abort
# (a reply shorter than the request means the region ran out of room there)

# Event kinds in an events reply.
EVENT_COMMIT = 1
EVENT_EVICT = 2


# --------------------------------------------------------------------------
# Requests: one frozen dataclass per op. ``FIELDS`` is the schema the decoder
# checks; the dataclass is what a handler receives.
# --------------------------------------------------------------------------

_KEYS = "keys"


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


@dataclass(frozen=True)
class PagesRequest(Request):
    """unpin: page ids as the pin reply gave them (a page pinned twice is listed twice)."""

    pages: tuple[int, ...]


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
    value = _field(msg, name, (int,))
    if not 0 <= value <= MAX_WIRE_INT:
        raise WireError(ErrorCode.INVALID_ARGUMENT, f"field {name!r} must be 0-{MAX_WIRE_INT}, not {value}")
    return value


def _tname(types: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types)


def _keys(msg: dict[str, Any], name: str = _KEYS) -> tuple[bytes, ...]:
    raw = _field(msg, name, (list,))
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{len(raw)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    keys = tuple(raw)
    # The common case checked in C (a flood of the largest requests costs the
    # loop little); the loop below only runs to name the offending key.
    if set(map(type, keys)) <= _BYTES_ONLY:
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


def _pages(msg: dict[str, Any]) -> tuple[int, ...]:
    raw = _field(msg, "pages", (list,))
    if len(raw) > MAX_KEYS_PER_REQUEST:
        raise WireError(ErrorCode.INVALID_ARGUMENT,
                        f"{len(raw)} pages in one request; the limit is {MAX_KEYS_PER_REQUEST}")
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
_BYTES_ONLY = frozenset({bytes})


def decode_request(frame: bytes) -> Request:
    """Parse and validate one request frame; raises ``WireError``.

    The caller answers a ``WireError`` with ``encode_error(request_id(frame), ...)``.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {len(frame)} bytes; the limit is {MAX_FRAME_BYTES}")
    msg = _unpack_map(frame)
    version = msg.get("v")
    if type(version) is not int or version != VERSION:  # not 2.0, not True
        raise WireError(ErrorCode.VERSION_MISMATCH,
                        f"protocol version {version!r}; this daemon speaks {VERSION}")
    rid = _number(msg, "id")
    op_name = _field(msg, "op", (str,))
    op = _OPS.get(op_name)
    if op is None:
        raise WireError(ErrorCode.UNKNOWN_OP, f"unknown op {op_name[:64]!r}")
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
    if op in _KEY_OPS:
        missing_ok = _field(msg, "missing_ok", (bool,), optional=True) if op is Op.ABORT else None
        remote = _field(msg, "remote", (bool,), optional=True) if op is Op.LOOKUP else None
        wait = _field(msg, "wait", (bool,), optional=True) if op in (Op.LOOKUP, Op.PREFETCH) else None
        return KeysRequest(op, rid, session, _keys(msg), bool(missing_ok), bool(remote),
                           wait is not False)
    if op is Op.UNPIN:
        return PagesRequest(op, rid, session, _pages(msg))
    if op is Op.PUBLISH:
        keys, as_keys = _keys(msg), _keys(msg, "as_keys")
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


def _unpack_map(frame: bytes) -> dict[str, Any]:
    if not frame:
        raise WireError(ErrorCode.PROTOCOL_ERROR, "empty frame")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(msg, dict):
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"a frame must be a map, not {type(msg).__name__}")
    return msg


def request_id(frame: bytes) -> int | None:
    """The ``id`` of a frame, when one can be read, so even a bad request gets an addressed reply."""
    if len(frame) > MAX_FRAME_BYTES:
        return None
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception:
        return None
    rid = msg.get("id") if isinstance(msg, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


# --------------------------------------------------------------------------
# Encoding: clients build requests, the daemon builds replies.
# --------------------------------------------------------------------------


def encode_request(op: Op, rid: int, **fields: Any) -> bytes:
    """A request frame. Fields with value None are left out."""
    msg: dict[str, Any] = {"v": VERSION, "id": rid, "op": op.value}
    for name, value in fields.items():
        if value is None:
            continue
        if isinstance(value, KVLayout):
            value = value.to_wire()
        elif name in (_KEYS, "as_keys"):
            value = list(value)
        msg[name] = value
    return msgpack.packb(msg, use_bin_type=True)


def encode_ok(rid: int | None, body: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": VERSION, "id": rid, "ok": body}, use_bin_type=True)


def encode_error(rid: int | None, code: ErrorCode, message: str) -> bytes:
    return msgpack.packb({"v": VERSION, "id": rid, "error": {"code": code.value, "message": message}},
                         use_bin_type=True)


@dataclass(frozen=True)
class Reply:
    id: int | None
    ok: dict[str, Any] | None
    error_code: str | None
    error_message: str | None

    def result(self) -> dict[str, Any]:
        """The ``ok`` body, or raise the ``HisparseError`` the error names."""
        if self.ok is not None:
            return self.ok
        raise error_for_code(self.error_code or "", self.error_message or "")


def decode_reply(frame: bytes) -> Reply:
    """Parse a reply frame; raises ``hisparse.ProtocolError`` when it is not one."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as exc:
        raise errors.ProtocolError(f"reply is not msgpack: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise errors.ProtocolError(f"reply of another protocol version or shape: {str(msg)[:80]}")
    rid = msg.get("id")
    if "ok" in msg and isinstance(msg["ok"], dict):
        return Reply(rid, msg["ok"], None, None)
    err = msg.get("error")
    if isinstance(err, dict):
        return Reply(rid, None, str(err.get("code")), str(err.get("message")))
    raise errors.ProtocolError("reply has neither ok nor error")
