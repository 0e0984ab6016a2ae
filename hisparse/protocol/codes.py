"""Protocol constants: version, size limits, op names, reply fields, error codes."""

from __future__ import annotations

import enum

from hisparse import errors

VERSION = 2  # 2: fences, unpin by page, sessions bound to their connection

# A larger frame is never read: the daemon's ZeroMQ socket drops the connection
# at its header (ZMQ_MAXMSGSIZE). The largest legal request, a publish of
# 2 x 16,384 keys of 64 B, is 2.2 MB.
MAX_FRAME_BYTES = 4 << 20
MAX_KEYS_PER_REQUEST = 16_384  # 1M tokens at block size 64; clients split longer chains. Small enough
# that one request costs the loop a few ms (what a flooding peer may delay others by)
MIN_KEY_BYTES = 1
MAX_KEY_BYTES = 64  # vLLM's OffloadKey is 36 bytes (32-byte hash + 4-byte group)
MAX_NAMESPACE_CHARS = 256
MAX_EVENTS_PER_REPLY = 65_536  # the largest `limit` an events or keys request may ask
# ... and the most entries a reply carries whatever the limit (fewer than asked is allowed):
# with 64-byte keys a reply stays under ~330 KB, and building one holds the loop about 1 ms.
# A page of events shorter than this means caught up.
MAX_REPLY_ENTRIES = 4096


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
                          "SLOT_COMMITTED or SLOT_BUSY; shorter than keys when the region is full "
                          "(the request may carry tag: int, the calling operation's nonce, which "
                          "abort names to give back only what this call reserved)",
                 "evicted": "list[bytes]: keys evicted (least recently used) to make room",
                 "shortfall": "nil when slots covers every key; else why not, a map: by (str: "
                              "\"quota\", a share of the session's or its peer's; \"room\", the "
                              "region holds nothing more to evict), limit (str: the config key, "
                              "e.g. \"peer_reserve_share\"; \"\" for room), message (str)"},
    Op.COMMIT: {"committed": "int: pages made visible",
                "cleared": "list[bytes], only when not empty: keys whose reservation predates "
                           "a clear of the namespace: aborted, never visible (a clear is a barrier)"},
    Op.ABORT: {"aborted": "int (the request may say missing_ok: true to skip keys not held; "
                          "with tag: int, only reservations that reserves with that tag took, "
                          "others skipped: what a call whose reserve reply was lost sends)"},
    Op.PIN: {"count": "int: leading keys pinned", "pages": "list[int]: their page ids (the "
                      "request may carry tag: int, the calling operation's nonce; the daemon "
                      "keeps what recent tagged calls pinned until they unpin it)"},
    Op.UNPIN: {"unpinned": "int (the request names pages: list[int], as pin replied them, and "
                           "may name their call's tag; tag without pages releases every pin "
                           "that call took and has not unpinned: its pin reply was lost)"},
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
                          "when as_keys[i] was already taken or keys[i] was reserved before a clear (that "
                          "reservation stays held under keys[i])"},
    Op.PREFETCH: {"queued": "int: keys being promoted in the background (wait: false)",
                  "promoted": "int: pages fetched, verified and committed", "local": "int: "
                  "already committed here", "missing": "int: not in the cluster",
                  "refused": "int: values whose header or hash did not match (dropped)",
                  "busy": "int: being written by a session here",
                  "missing_keys": "list[bytes]: the keys counted in missing (empty unless waited)"},
}

SESSIONLESS_OPS = frozenset({Op.HELLO, Op.PING})
ADMIN_OPS = frozenset({Op.CLEAR, Op.SHUTDOWN, Op.EVICT_SESSION, Op.DROP})
# Ahead of their connection's other requests, both ends: they change nothing that the order of a
# connection's requests could (a liveness question; a lease renewed), and a client must learn that
# the daemon is alive, and keep its lease, while its connection waits behind its large writes.
# The daemon answers them when it reads them; the client sends them ahead of its queued requests.
EXPRESS_OPS = frozenset({Op.PING, Op.HEARTBEAT})


class ErrorCode(str, enum.Enum):
    """Codes of an error reply; ``error_for_code`` maps each to an exception class."""

    PROTOCOL_ERROR = "PROTOCOL_ERROR"  # not msgpack, not a map, missing field, wrong type
    VERSION_MISMATCH = "VERSION_MISMATCH"  # the frame's ``v`` is not ours
    UNKNOWN_OP = "UNKNOWN_OP"  # ``op`` names no operation
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"  # frame over MAX_FRAME_BYTES (the daemon's socket drops one unread)
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # well formed, unacceptable values
    NOT_HELD = "NOT_HELD"  # commit/abort/unpin of keys or pages this session does not hold
    NOT_FENCED = "NOT_FENCED"  # reserve/pin before the client locked its session's fence file
    UNKNOWN_SESSION = "UNKNOWN_SESSION"  # no session, or one expired / from an earlier run
    NOT_ATTACHED = "NOT_ATTACHED"  # a data op on an admin session (hello without namespace)
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"  # namespace exists under another KVLayout
    CAPACITY = "CAPACITY"  # a region would not fit in the daemon's capacity
    PERMISSION_DENIED = "PERMISSION_DENIED"  # admin op without the admin token
    SHUTTING_DOWN = "SHUTTING_DOWN"  # the daemon is draining and takes no new work
    QUOTA_EXCEEDED = "QUOTA_EXCEEDED"  # a per-session or per-peer limit (the message names it) would be passed
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

    def __init__(self, code: ErrorCode, message: str, rid: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.rid = rid  # the request's id when it was read before the fault: the reply names it


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
