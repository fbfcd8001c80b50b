"""Restarting failed vLLM units: after a backoff (a dead engine core), or at once (an operator's ``recover-unit``).

:class:`Restarts` owns the restart tasks of a cluster's units (:mod:`agent.runtime.live.cluster`): at most one per
unit, a backoff's delays one after another until a fresh engine starts
(:meth:`~agent.engine.live.LiveEngine.restart`), then ``rejoin(unit, attempts)``. Each failure gets a fresh
backoff (``delays``); without one (``--no-restart``) failed units stay failed until an operator recovers them.
With ``max_attempts``, a backoff gives up after that many failed attempts (an engine that cannot start: no GPU
memory, a GPU error): the unit stays failed, ``gave_up(unit, attempts, error)`` is told, and an operator's
``recover-unit`` tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from agent.engine.live import LiveEngine

log = logging.getLogger(__name__)


def backoff(first_s: float = 1.0, factor: float = 2.0, max_s: float = 60.0) -> Iterator[float]:
    """Delays before each restart attempt of a failed unit: ``first_s``, then ``factor`` times longer, at most
    ``max_s``, without end."""
    delay = first_s
    while True:
        yield delay
        delay = min(max_s, delay * factor)


class Restarts:
    """The restart tasks of a cluster's units (see the module's docstring)."""

    def __init__(self, delays: Callable[[], Iterator[float]] | None,
                 rejoin: Callable[[LiveEngine, int], None], *, max_attempts: int | None = None,
                 gave_up: Callable[[LiveEngine, int, str], None] | None = None) -> None:
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 (None: no limit)")
        self.delays = delays
        """A fresh backoff (delays in seconds) for each failure; None: no restart after a failure."""
        self.max_attempts = max_attempts
        """Attempts a backoff makes before it gives up (None: no limit)."""
        self._gave_up = gave_up
        self._rejoin = rejoin
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._restarting: set[int] = set()
        """Units whose engine is being built right now."""

    def restarting(self, unit_id: int) -> bool:
        return unit_id in self._restarting

    def after_backoff(self, unit: LiveEngine) -> None:
        """Restart ``unit`` after each delay of a fresh backoff until it starts (nothing without ``delays``)."""
        if self.delays is not None:
            self._tasks[unit.unit_id] = asyncio.get_running_loop().create_task(self._backoff(unit, self.delays()))

    def now(self, unit: LiveEngine, *, then_backoff: bool) -> asyncio.Task[None]:
        """One attempt now, in place of any backoff waiting; the task raises what the restart raised, after which
        (``then_backoff``) a backoff takes over again."""
        uid = unit.unit_id
        waiting = self._tasks.pop(uid, None)
        if waiting is not None:
            waiting.cancel()
        task = asyncio.get_running_loop().create_task(self._now(unit, then_backoff), name=f"unit {uid} restart")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by whoever awaits it, or logged
        self._tasks[uid] = task
        return task

    def cancel(self) -> None:
        """Stop every restart waiting or under way."""
        for task in self._tasks.values():
            task.cancel()

    async def _attempt(self, unit: LiveEngine) -> None:
        self._restarting.add(unit.unit_id)
        try:
            await unit.restart()
        finally:
            self._restarting.discard(unit.unit_id)

    async def _now(self, unit: LiveEngine, then_backoff: bool) -> None:
        uid = unit.unit_id
        try:
            await self._attempt(unit)
        except Exception:
            log.exception("unit %s: restart on request failed", uid)
            self._tasks.pop(uid, None)
            if then_backoff:
                self.after_backoff(unit)
            raise
        self._tasks.pop(uid, None)
        self._rejoin(unit, 1)

    async def _backoff(self, unit: LiveEngine, delays: Iterator[float]) -> None:
        attempts = 0
        for delay in delays:
            await asyncio.sleep(delay)
            attempts += 1
            try:
                await self._attempt(unit)
            except Exception as exc:  # vLLM's start failed (no memory, no GPU...): try again after the next delay
                log.exception("unit %s: restart attempt %d failed", unit.unit_id, attempts)
                if self.max_attempts is not None and attempts >= self.max_attempts:
                    self._tasks.pop(unit.unit_id, None)
                    log.error("unit %s: gave up restarting after %d attempts", unit.unit_id, attempts)
                    if self._gave_up is not None:
                        self._gave_up(unit, attempts, f"{type(exc).__name__}: {exc}")
                    return
                continue
            self._tasks.pop(unit.unit_id, None)
            self._rejoin(unit, attempts)
            return
