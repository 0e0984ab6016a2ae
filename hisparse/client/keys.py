"""What a key is, checked on the client before any request is sent.

Every key-taking call of ``Client`` (``lookup``, ``lookup_remote``, ``store``,
``load``, ``pin``, ``prefetch``) passes its keys through ``check_keys`` first,
so a bad key is reported with its index, the limit and the fix, and never
reaches the daemon: no reservation is taken for a request that was bound to
be refused, and nothing is logged about aborting one.

A key is ``bytes`` of ``MIN_KEY_BYTES`` to ``MAX_KEY_BYTES`` (1 to 64): the
hash of a block and of every block before it (vLLM's is a 32-byte hash plus
a 4-byte group index).
"""

from __future__ import annotations

from collections.abc import Iterable

from hisparse.errors import InvalidArgument
from hisparse.protocol import MAX_KEY_BYTES, MIN_KEY_BYTES


class KeyTypeError(InvalidArgument, TypeError):
    """A key (or the key list) is not ``bytes``: an ``InvalidArgument`` that is also a ``TypeError``."""


_BYTES_ONLY = {bytes}


def check_keys(keys: Iterable[bytes], call: str) -> list[bytes]:
    """``keys`` as a list, or ``KeyTypeError`` / ``InvalidArgument`` naming the bad key.

    ``call`` names the method in the message (``"store"``, ``"lookup"``, ...).
    """
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise KeyTypeError(f"{call}: keys must be a list of keys, not one {type(keys).__name__}: "
                           f"pass [key]")
    keys = list(keys)
    # The common case in two C passes (a 64-key lookup pays well under a
    # microsecond); the loop below runs only to name the offending key.
    if set(map(type, keys)) <= _BYTES_ONLY:
        lengths = set(map(len, keys))
        if not lengths or (MIN_KEY_BYTES <= min(lengths) and max(lengths) <= MAX_KEY_BYTES):
            return keys
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            hint = ("encode it (key.encode()) or, better, pass the digest's bytes"
                    if isinstance(key, str) else "pass bytes(key)"
                    if isinstance(key, (bytearray, memoryview)) else "pass a bytes hash")
            raise KeyTypeError(f"{call}: keys[{i}] is a {type(key).__name__}; keys are bytes "
                               f"({MIN_KEY_BYTES}-{MAX_KEY_BYTES} of them): {hint}")
        if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"{call}: keys[{i}] is {len(key)} bytes; keys are "
                                  f"{MIN_KEY_BYTES}-{MAX_KEY_BYTES} bytes (a sha256 digest, 32, fits)")
    return keys
