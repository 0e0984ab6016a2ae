"""KV page geometry and byte sizes.

A page is one block of ``block_tokens`` tokens for all layers. Its logical
bytes are layer-major: the row of (layer ``l``, token ``t``) sits at
``l * block_tokens * row_bytes + t * row_bytes``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hisparse.errors import InvalidArgument

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
    "p": 1000**5, "pb": 1000**5, "pib": 1 << 50,
}


MAX_SIZE_BYTES = 1 << 60  # 1 EiB: any size above is a mistake (or an attack), not a plan


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"64GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise InvalidArgument(f"size must be an int or a string like '64GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"size must not be negative: {value}")
        if value > MAX_SIZE_BYTES:
            raise InvalidArgument(f"size {str(value)[:24]} is above the largest accepted, {MAX_SIZE_BYTES} B")
        return value
    if not isinstance(value, str):
        raise InvalidArgument(f"size must be an int or a string like '64GiB', not {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise InvalidArgument(f"cannot parse size {value!r} (expected e.g. '64GiB', '512MiB', 1048576)")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise InvalidArgument(f"unknown size unit in {value!r}")
    size = float(number) * _UNITS[unit]
    if not size <= MAX_SIZE_BYTES:  # also inf and nan: "9" * 400 parses as inf
        raise InvalidArgument(f"size {value[:24]!r}... is above the largest accepted, {MAX_SIZE_BYTES} B"
                              if len(value) > 24 else
                              f"size {value!r} is above the largest accepted, {MAX_SIZE_BYTES} B")
    return int(size)


def format_size(num_bytes: int) -> str:
    """``3274752`` -> ``'3.1 MiB'``: for logs and tables."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVLayout:
    """The geometry of one namespace's pages."""

    num_layers: int
    block_tokens: int
    row_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_tokens", "row_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be a positive int, not {value!r}")
            if value > (1 << 24):
                raise InvalidArgument(f"KVLayout.{name} is implausibly large: {value}")

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page in one layer: ``block_tokens * row_bytes``."""
        return self.block_tokens * self.row_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in all layers."""
        return self.num_layers * self.block_tokens * self.row_bytes

    def to_wire(self) -> dict[str, int]:
        return {"num_layers": self.num_layers, "block_tokens": self.block_tokens,
                "row_bytes": self.row_bytes}

    @classmethod
    def from_wire(cls, value: object) -> KVLayout:
        if not isinstance(value, dict):
            raise InvalidArgument(f"layout must be a map, not {type(value).__name__}")
        try:
            return cls(value["num_layers"],
                       value["block_tokens"], value["row_bytes"])
        except KeyError as exc:
            raise InvalidArgument(f"layout lacks field {exc.args[0]!r}") from None
