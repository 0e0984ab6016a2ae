"""What the request path counts for the metrics endpoint, at a few hundred ns a request.

The daemon's loop only bumps integers here: per-op latency bucket counts
(one ``bisect`` on fixed bounds), errors by code, and the event loop's lag.
``hisparse.daemon.front.metrics`` turns a copy of them into Prometheus families
when something scrapes; nothing here imports ``prometheus_client``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Upper bounds of the latency buckets, in ns (Prometheus ``le`` is inclusive,
# hence bisect_left). A lookup round trip is tens of microseconds; a reserve
# that evicts thousands of pages, milliseconds.
LATENCY_BOUNDS_NS: tuple[int, ...] = (
    5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000, 25_000_000, 100_000_000, 1_000_000_000,
)
# The loop's lag: how late a timer fires. Under a millisecond is healthy.
LAG_BOUNDS_NS: tuple[int, ...] = (
    100_000, 500_000, 1_000_000, 5_000_000, 10_000_000, 50_000_000, 100_000_000,
    500_000_000, 1_000_000_000,
)


@dataclass
class Histogram:
    """Bucket counts (the last one is +Inf), their sum and count, all in ns."""

    bounds_ns: tuple[int, ...]
    counts: list[int] = field(default_factory=list)
    sum_ns: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds_ns) + 1)

    def observe(self, value_ns: int) -> None:
        self.counts[bisect_left(self.bounds_ns, value_ns)] += 1
        self.sum_ns += value_ns

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds_ns, list(self.counts), self.sum_ns)


@dataclass
class OpStats:
    """Per-op latency, errors by code, and the loop's lag; owned by the event loop."""

    latency: dict[str, Histogram] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    loop_lag: Histogram = field(default_factory=lambda: Histogram(LAG_BOUNDS_NS))
    loop_lag_last_ns: int = 0

    def observe(self, op: str, elapsed_ns: int) -> None:
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = Histogram(LATENCY_BOUNDS_NS)
        h.counts[bisect_left(LATENCY_BOUNDS_NS, elapsed_ns)] += 1
        h.sum_ns += elapsed_ns

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def lag(self, lag_ns: int) -> None:
        self.loop_lag_last_ns = lag_ns
        self.loop_lag.observe(lag_ns)

    def copy(self) -> OpStats:
        """A snapshot another thread may read while the loop keeps counting."""
        return OpStats({op: h.copy() for op, h in self.latency.items()}, dict(self.errors),
                       self.loop_lag.copy(), self.loop_lag_last_ns)
