"""Frames: msgpack in and out. The only module in hisparse that calls msgpack."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgpack

from hisparse import errors
from hisparse.layout import KVLayout
from hisparse.protocol.codes import (
    MAX_FRAME_BYTES, MAX_KEY_BYTES, MAX_KEYS_PER_REQUEST, VERSION, ErrorCode, Op, WireError, error_for_code,
)
from hisparse.protocol.scan import (
    MAX_BIN_BYTES, MAX_FIELDS, MAX_STR_BYTES, SCAN_ABOVE_BYTES, UNSCANNED_LIST_ITEMS, scan_frame,
)

KEY_FIELDS = ("keys", "as_keys")  # fields that carry lists of keys


# msgpack's per-container limits, the same for every request: no map wider
# than a request, no string longer than any field needs, no bin much longer
# than a key, no ext at all; and (``unpack_request``) no list longer than a
# request may carry, or than UNSCANNED_LIST_ITEMS in a frame not scanned.
_UNPACK_LIMITS = dict(max_map_len=MAX_FIELDS, max_str_len=MAX_STR_BYTES, max_bin_len=MAX_BIN_BYTES,
                      max_ext_len=0)


def unpack_map(frame: bytes) -> dict[str, Any]:
    """Decode a request frame once, within the protocol's bounds; raises ``WireError``.

    A frame over ``SCAN_ABOVE_BYTES`` is scanned first (``scan.scan_frame``);
    a smaller one only when it does not decode with short lists
    (``scan.UNSCANNED_LIST_ITEMS``). So no frame costs the loop more than a
    few milliseconds. The error carries the request's id when one was read.
    """
    return unpack_request(frame)[0]


# In what ``unpack_request`` proves of a frame: no bin in it is longer than a key may be.
SHORT_BINS = "*bins*"
_SHORT_BINS_PROVEN = frozenset({SHORT_BINS})
# An unscanned frame's bins are held to a key's length (a request's only bins are keys): a
# longer one sends the frame to the scan, and the decoder then names the key.
_UNSCANNED_LIMITS = {**_UNPACK_LIMITS, "max_bin_len": MAX_KEY_BYTES}


def unpack_request(frame: bytes) -> tuple[dict[str, Any], frozenset[str]]:
    """``unpack_map``, and what is proven of it: the list fields the scan proved valid
    (``scan.scan_frame``), whose items the decoder need not check again; of an unscanned
    frame, ``SHORT_BINS`` (no bin over ``MAX_KEY_BYTES``)."""
    if not frame:
        raise WireError(ErrorCode.PROTOCOL_ERROR, "empty frame")
    if len(frame) <= SCAN_ABOVE_BYTES:
        try:
            msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                                  max_array_len=UNSCANNED_LIST_ITEMS, **_UNSCANNED_LIMITS)
        except Exception:  # msgpack raises several unrelated types: the scan names the fault
            pass
        else:
            return _map(msg), _SHORT_BINS_PROVEN
    rid, proven = scan_frame(frame)
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                              max_array_len=MAX_KEYS_PER_REQUEST, **_UNPACK_LIMITS)
    except Exception as exc:
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"not msgpack within the protocol's limits: "
                        f"{type(exc).__name__}", rid=rid) from None
    return _map(msg), proven


def _map(msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise WireError(ErrorCode.PROTOCOL_ERROR, f"a frame must be a map, not {type(msg).__name__}")
    return msg


def request_id(frame: bytes) -> int | None:
    """The ``id`` of a frame, when one can be read, so even a bad request gets an addressed reply.

    Bounded as ``unpack_map`` (it is one): the daemon itself takes the id from
    ``decode_request``'s result or error and never decodes a frame twice.
    """
    if len(frame) > MAX_FRAME_BYTES:
        return None
    try:
        msg = unpack_map(frame)
    except WireError as exc:
        return exc.rid
    rid = msg.get("id")
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


_replies = threading.local()  # one Packer per thread: what ``packb`` builds on every call


def _pack_reply(msg: dict[str, Any]) -> bytes:
    try:
        packer = _replies.packer
    except AttributeError:
        packer = _replies.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(msg)  # the same bytes as packb; a failed pack leaves the packer empty


def encode_ok(rid: int | None, body: dict[str, Any]) -> bytes:
    return _pack_reply({"v": VERSION, "id": rid, "ok": body})


def encode_error(rid: int | None, code: ErrorCode, message: str) -> bytes:
    return _pack_reply({"v": VERSION, "id": rid, "error": {"code": code.value, "message": message}})


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
