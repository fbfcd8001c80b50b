"""Where a replay is and how it moves: the replay cursor (pure; the clock is injected, STYLE example 12).

A :class:`Playback` is shared by the app, whose keys change it (play/pause, seek, jump, speed), and the
:class:`~console.feeds.ReplayFeed`, which reads the store up to :meth:`Playback.position` and rebuilds the state
when the position goes back. The position is a time of the store (wall-clock ns, like the events' ``time_ns``):
the console shows every event up to it. While playing it moves at :attr:`Playback.speed` times the recorded pace
and stops at the end of the store; playing from the end starts again at the beginning.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, Literal

from console.model.render import fmt_clock

MIN_SPEED: Final = 1 / 16
MAX_SPEED: Final = 1024.0
Where = Literal["start", "end"]

Clock = Callable[[], float]
"""Monotonic seconds (``time.monotonic``), injectable for tests."""


class Playback:
    """The replay cursor over a store's time span."""

    def __init__(
        self, *, speed: float = 1.0, playing: bool = False, start: Where = "end", clock: Clock = time.monotonic
    ) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be between {MIN_SPEED:g} and {MAX_SPEED:g}")
        self.speed = speed
        """Store seconds per real second while playing."""
        self.playing = playing
        """Moving (else paused); set back when the end is reached."""
        self.start: Where = start
        """Where the cursor is when the span becomes known."""
        self.span: tuple[int, int] | None = None
        """The store's first and last event time (ns); None until the feed has read it."""
        self._clock = clock
        self._anchor_ns = 0
        """The position at :attr:`_anchor_s` (while playing it moves on from there)."""
        self._anchor_s = 0.0

    def set_span(self, first_ns: int, last_ns: int) -> None:
        """The store's time span (the feed, once it has read it); the cursor starts at :attr:`start` now."""
        self.span = (first_ns, last_ns)
        self._anchor(first_ns if self.start == "start" else last_ns)

    def position(self) -> int | None:
        """The cursor's time (ns; None before the span is known). Reaching the end stops the playback."""
        if self.span is None:
            return None
        if not self.playing:
            return self._anchor_ns
        position = self._anchor_ns + round((self._clock() - self._anchor_s) * self.speed * 1e9)
        last = self.span[1]
        if position >= last:
            self.playing = False
            self._anchor(last)
            return last
        return position

    @property
    def at_end(self) -> bool:
        position = self.position()
        return self.span is not None and position is not None and position >= self.span[1]

    # -- what the keys do ----------------------------------------------------------------------------------------
    def toggle(self) -> None:
        """Pause, or play from the cursor (from the start when at the end)."""
        position = self.position()
        if self.playing or position is None or self.span is None:
            self.playing = not self.playing
            if position is not None:
                self._anchor(position)
            return
        self._anchor(self.span[0] if position >= self.span[1] else position)
        self.playing = True

    def seek(self, seconds: float) -> None:
        """Move the cursor ``seconds`` (negative: back), within the span."""
        position = self.position()
        if position is not None:
            self._anchor(self._clamp(position + round(seconds * 1e9)))

    def jump(self, where: Where) -> None:
        """The cursor to the start or the end of the span."""
        if self.span is not None:
            self.position()
            self._anchor(self.span[0] if where == "start" else self.span[1])

    def change_speed(self, factor: float) -> None:
        """Multiply the speed by ``factor`` (within :data:`MIN_SPEED` and :data:`MAX_SPEED`)."""
        position = self.position()
        if position is not None:
            self._anchor(position)
        self.speed = min(MAX_SPEED, max(MIN_SPEED, self.speed * factor))

    # -- helpers -------------------------------------------------------------------------------------------------
    def _anchor(self, position_ns: int) -> None:
        self._anchor_ns, self._anchor_s = position_ns, self._clock()

    def _clamp(self, position_ns: int) -> int:
        assert self.span is not None
        return min(self.span[1], max(self.span[0], position_ns))


def fmt_offset(seconds: float) -> str:
    """A time into the store: ``0:05``, ``12:30``, ``1:02:03``."""
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def describe(playback: Playback) -> str:
    """The replay cursor in a few words for the header: ``0:05/0:08 08:00:05 playing 2x`` (time into the store, the
    store's length, the cursor's wall-clock time, what it does); "" before the span is known."""
    position = playback.position()
    if position is None or playback.span is None:
        return ""
    first, last = playback.span
    if playback.playing:
        doing = f"playing {playback.speed:g}x"
    else:
        doing = "end" if position >= last else f"paused ({playback.speed:g}x)"
    return f"{fmt_offset((position - first) / 1e9)}/{fmt_offset((last - first) / 1e9)} {fmt_clock(position)} {doing}"
