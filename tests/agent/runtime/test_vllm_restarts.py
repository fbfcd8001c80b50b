"""Restarting failed live units (agent/runtime/live/restarts.py): a backoff that gives up. Needs no vLLM."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent.runtime.live.restarts import Restarts, backoff


class Unit:
    """A unit whose engine starts at the ``works``-th attempt (never with 0)."""

    def __init__(self, works: int = 0) -> None:
        self.unit_id = 3
        self.works = works
        self.attempts = 0

    async def restart(self) -> None:
        self.attempts += 1
        if self.attempts != self.works:
            raise RuntimeError("CUDA error: no device")


def run(unit: Unit, max_attempts: int | None) -> tuple[list[Any], list[Any]]:
    rejoined: list[Any] = []
    gave_up: list[Any] = []

    async def main() -> None:
        r = Restarts(lambda: backoff(0.001, 2.0, 0.004), lambda u, n: rejoined.append((u.unit_id, n)),
                     max_attempts=max_attempts, gave_up=lambda u, n, e: gave_up.append((u.unit_id, n, e)))
        r.after_backoff(unit)  # type: ignore[arg-type]
        for _ in range(200):
            await asyncio.sleep(0.005)
            if rejoined or gave_up:
                break
        r.cancel()

    asyncio.run(main())
    return rejoined, gave_up


def test_a_backoff_gives_up_after_max_attempts_and_says_why() -> None:
    unit = Unit(works=0)
    rejoined, gave_up = run(unit, max_attempts=4)
    assert not rejoined and unit.attempts == 4
    assert gave_up == [(3, 4, "RuntimeError: CUDA error: no device")]


def test_an_engine_that_starts_within_the_limit_rejoins() -> None:
    unit = Unit(works=3)
    assert run(unit, max_attempts=4) == ([(3, 3)], [])


def test_without_a_limit_it_keeps_trying() -> None:
    unit = Unit(works=12)
    assert run(unit, max_attempts=None) == ([(3, 12)], [])
    with pytest.raises(ValueError):
        Restarts(None, lambda u, n: None, max_attempts=0)
