"""Frames: msgpack in and out. The only module in hisparse that calls msgpack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from hisparse import errors
from hisparse.layout import KVLayout
from hisparse.protocol.codes import MAX_FRAME_BYTES, VERSION, ErrorCode, Op, WireError, error_for_code

KEY_FIELDS = ("keys", "as_keys")  # fields that carry lists of keys


def unpack_map(frame: bytes) -> dict[str, Any]:
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
        elif name in KEY_FIELDS:
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
