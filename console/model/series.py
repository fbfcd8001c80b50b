"""Bounded per-bucket aggregates: the rolling time series of the state model.

A :class:`BucketRing` keeps the last ``size`` fixed time buckets of one series in a ring, so history is bounded
by construction and adding to any bucket is O(1); a write older than the ring's history is dropped. Buckets are
small mutable aggregates (:class:`HeatBucket` for a unit's heatmap metrics, :class:`FlowBucket` for request and
token flow), reset and reused when their slot comes round again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from console.model.metrics import METRICS


class Resettable(Protocol):
    """A bucket that can be emptied for reuse."""

    def reset(self) -> None: ...


B = TypeVar("B", bound=Resettable)


class BucketRing(Generic[B]):
    """The last ``size`` buckets of one series, by absolute bucket index (see ``render.bucket_index``)."""

    __slots__ = ("_factory", "_held", "_slots", "newest", "size")

    def __init__(self, size: int, factory: Callable[[], B]) -> None:
        if size < 1:
            raise ValueError("a ring holds at least one bucket")
        self.size = size
        self._factory = factory
        self._slots: list[B | None] = [None] * size
        self._held: list[int] = [-1] * size
        """The bucket index each slot holds (-1: none)."""
        self.newest = -1
        """The newest bucket index written (-1: none yet)."""

    def at(self, index: int) -> B | None:
        """The bucket ``index`` to add to, started (or recycled) when new; None when it is older than the ring's
        history (the write is dropped)."""
        slot = index % self.size
        held = self._held[slot]
        if held == index:
            return self._slots[slot]
        if held > index or index <= self.newest - self.size:
            return None
        bucket = self._slots[slot]
        if bucket is None:
            bucket = self._factory()
            self._slots[slot] = bucket
        else:
            bucket.reset()
        self._held[slot] = index
        if index > self.newest:
            self.newest = index
        return bucket

    def get(self, index: int) -> B | None:
        """Bucket ``index`` if it holds data and is still in the history; None otherwise."""
        if index <= self.newest - self.size:
            return None
        slot = index % self.size
        return self._slots[slot] if self._held[slot] == index else None

    @property
    def oldest(self) -> int:
        """The oldest bucket index the history still covers (-1 before any write)."""
        return -1 if self.newest < 0 else self.newest - self.size + 1

    def __len__(self) -> int:
        """Buckets holding data within the history."""
        return sum(1 for held in self._held if held >= 0 and held > self.newest - self.size)


class HeatBucket:
    """One unit's heatmap metrics within one bucket: sum, count and maximum per metric (``console.model.metrics``)."""

    __slots__ = ("counts", "maxes", "sums")

    def __init__(self) -> None:
        n = len(METRICS)
        self.sums = [0.0] * n
        self.counts = [0] * n
        self.maxes = [0.0] * n

    def reset(self) -> None:
        n = len(METRICS)
        self.sums = [0.0] * n
        self.counts = [0] * n
        self.maxes = [0.0] * n

    def add(self, index: int, value: float) -> None:
        """One sample of metric ``index``."""
        self.sums[index] += value
        if self.counts[index] == 0 or value > self.maxes[index]:
            self.maxes[index] = value
        self.counts[index] += 1

    def mean(self, index: int) -> float | None:
        """The mean of metric ``index`` in this bucket (None without samples)."""
        count = self.counts[index]
        return self.sums[index] / count if count else None


class FlowBucket:
    """Request and token flow of one node or unit within one bucket."""

    __slots__ = ("finished", "met", "out_tokens", "refused", "steps", "tpot_ms", "ttft_ms")

    def __init__(self) -> None:
        self.out_tokens = 0
        """Output tokens: decode tokens of steps plus first tokens."""
        self.steps = 0
        self.finished = 0
        self.met = 0
        """Finished requests that met their SLO."""
        self.refused = 0
        self.ttft_ms: list[float] = []
        """TTFT of the requests that finished in the bucket."""
        self.tpot_ms: list[float] = []
        """TPOT of those with more than one output token."""

    def reset(self) -> None:
        self.out_tokens = self.steps = self.finished = self.met = self.refused = 0
        self.ttft_ms = []
        self.tpot_ms = []
