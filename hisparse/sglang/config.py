"""The adapter's settings, parsed once from SGLang's JSON extra config into a frozen dataclass.

The same keys serve the HiCache backend
(``--hicache-storage-backend-extra-config``) and the linker
(``linker_extra_config``). SGLang's own keys in that JSON (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, ``prefetch_*``,
``tp_lcm_size``, ``allocator``) are left to SGLang; any other key not listed
here is refused, so that a typo is an error at start and not a silent
default. See docs/sglang.md for the table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hisparse.errors import InvalidArgument
from hisparse.layout import parse_size

SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_per_page",
    "hicache_storage_pass_prefix_keys", "tp_lcm_size", "allocator", "linker",
    "linker_module_path", "linker_class_name",
})


@dataclass(frozen=True)
class SglangConfig:
    """What the backend and the linker read from the extra config."""

    socket: str | None = None       # hisparsed's socket; None: $HISPARSE_SOCKET, else the default
    namespace: str | None = None    # override the derived namespace (pools get "/<pool>" appended)
    capacity: int | None = None     # region bytes if this engine creates the namespace
    timeout_s: float = 1.0          # deadline of one daemon request (the engine's IO threads wait this long at most)
    down_s: float = 2.0             # after a request got no answer: answer miss without asking, this long
    hold_s: float = 10.0            # a page pinned by batch_exists is released after this if never loaded
    lookup_budget_s: float = 0.1    # the longest a linker lookup holds SGLang's scheduler thread
    cluster: bool = False           # batch_exists also promotes what the cluster tier (or a P/D peer) holds

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> SglangConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in extra if k not in known and k not in SGLANG_KEYS)
        if unknown:
            raise InvalidArgument(f"hisparse.sglang: unknown extra-config keys {unknown}; known: "
                                  f"{sorted(known)} (see docs/sglang.md)")
        values: dict[str, Any] = {k: extra[k] for k in known if k in extra}
        if values.get("capacity") is not None:
            values["capacity"] = parse_size(values["capacity"])
        for name in ("timeout_s", "down_s", "hold_s", "lookup_budget_s"):
            if name in values:
                value = values[name]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise InvalidArgument(f"hisparse.sglang: {name} must be a positive number, not {value!r}")
                values[name] = float(value)
        if "cluster" in values:
            values["cluster"] = bool(values["cluster"])
        for name in ("socket", "namespace"):
            if values.get(name) is not None and not isinstance(values[name], str):
                raise InvalidArgument(f"hisparse.sglang: {name} must be a string")
        return cls(**values)
