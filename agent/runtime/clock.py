"""Clocks that drive a node: virtual (as fast as possible) or wall (real sleeps, for live demos).

The node itself is a discrete-event core that never reads a clock: it is told to process every event up to
a time. A clock only decides how long to wait before that happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def wait_until(self, t_s: float) -> None:
        """Return when node time ``t_s`` (seconds since the run started) may be processed."""
        ...

    def seconds_until(self, t_s: float) -> float:
        """Real seconds :meth:`wait_until` would wait for ``t_s`` if called now (0 when it would not wait)."""
        ...


class VirtualClock:
    """No waiting: events are processed as fast as the machine allows. Deterministic for a seed."""

    def wait_until(self, t_s: float) -> None:
        return None

    def seconds_until(self, t_s: float) -> float:
        return 0.0


class WallClock:
    """Node time follows real time, optionally sped up (``speed=2`` runs twice as fast as real time)."""

    def __init__(
        self,
        speed: float = 1.0,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.speed = speed
        self._monotonic = monotonic
        self._sleep = sleep
        self._origin: float | None = None

    def wait_until(self, t_s: float) -> None:
        now = self._monotonic()
        if self._origin is None:
            self._origin = now - t_s / self.speed
        delay = self._origin + t_s / self.speed - now
        if delay > 0:
            self._sleep(delay)

    def seconds_until(self, t_s: float) -> float:
        if self._origin is None:
            return 0.0  # the first wait starts the clock: it never waits
        return max(0.0, self._origin + t_s / self.speed - self._monotonic())
