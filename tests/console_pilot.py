"""Helpers shared by the console's Pilot tests of the Policies, SQL and recording slices."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator

from textual.pilot import Pilot


async def until(pilot: Pilot[int], predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Let the app run until ``predicate`` holds; fail (not hang) after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def fast_delays() -> Generator[float]:
    while True:
        yield 0.05


def text_of(widget: object) -> str:
    return str(getattr(widget, "content", ""))
