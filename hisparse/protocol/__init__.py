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

from hisparse.protocol.codes import (
    ADMIN_OPS, EVENT_COMMIT, EXPRESS_OPS, EVENT_EVICT, MAX_EVENTS_PER_REPLY, MAX_FRAME_BYTES, MAX_KEY_BYTES,
    MAX_KEYS_PER_REQUEST, MAX_NAMESPACE_CHARS, MAX_REPLY_ENTRIES, MIN_KEY_BYTES, REPLY_FIELDS,
    SESSIONLESS_OPS, SLOT_BUSY, SLOT_COMMITTED, VERSION, ErrorCode, Op, WireError, error_for_code,
)
from hisparse.protocol.scan import leading_fields, leading_id
from hisparse.protocol.frames import (
    Reply, decode_reply, encode_error, encode_ok, encode_request, request_id, unpack_map,
)
from hisparse.protocol.requests import (
    MAX_PAGE_ID, MAX_WIRE_INT, AdminRequest, EventsRequest, HelloRequest, KeysPageRequest,
    KeysRequest, PagesRequest, PingRequest, PublishRequest, Request, SessionRequest,
    decode_request,
)

__all__ = [
    "ADMIN_OPS", "EVENT_COMMIT", "EXPRESS_OPS", "EVENT_EVICT", "MAX_EVENTS_PER_REPLY", "MAX_FRAME_BYTES",
    "MAX_KEY_BYTES", "MAX_KEYS_PER_REQUEST", "MAX_NAMESPACE_CHARS", "MAX_PAGE_ID", "MAX_REPLY_ENTRIES",
    "MAX_WIRE_INT", "MIN_KEY_BYTES", "REPLY_FIELDS", "SESSIONLESS_OPS", "SLOT_BUSY", "SLOT_COMMITTED", "VERSION",
    "AdminRequest", "ErrorCode", "EventsRequest", "HelloRequest", "KeysPageRequest", "KeysRequest",
    "Op", "PagesRequest", "PingRequest", "PublishRequest", "Reply", "Request", "SessionRequest",
    "WireError", "decode_reply", "decode_request", "encode_error", "encode_ok", "encode_request",
    "error_for_code", "leading_fields", "leading_id", "request_id", "unpack_map",
]
