"""Garbage-collector control for a long-running engine loop: freeze what lives long, collect when idle.

CPython's cyclic collector stops the world, and a collection of the oldest generation traverses every
tracked object in it, so in a process with a large heap it pauses the loop for a long time. FairBatching
(seed 003) saw pauses of hundreds of ms and did two things, which :class:`GcController` does for the node:

* at start, collect once and :func:`gc.freeze` what survives (modules, engines, units, caches): frozen
  objects sit in a permanent generation that no collection traverses;
* collect in quiet periods: when the loop is about to wait at least ``quiet_gap_s`` for its next event,
  collect the young generations there, or the oldest one too when a full collection is due (by time or by
  young collections since the last) and the wait is at least as long as the last full collection took;
  the survivors of each full collection are frozen, so the next one only traverses what survived since.

While the controller runs, CPython no longer collects the oldest generation on its own (young generations
stay automatic). A loop that never waits long enough still gets full collections: when CPython collects
the young generations (allocations, so maybe garbage) and no full collection ran for ``fallback_s`` or
for ``fallback_young`` generation-1 collections, the next wait, however short, runs one. Frozen objects
that are dropped are freed by reference counting as usual; only reference cycles that die after being
frozen wait for a *thaw* (unfreeze, collect everything, freeze again), done every ``thaw_every_s`` in a
quiet period at least as long as the last whole-heap collection took, forced after twice that.

Usage::

    with GcController() as gc_control:
        node.run(clock, gc_control=gc_control)

Time is injected (``now``), so tests are deterministic. The controller's own statistics (collections by
reason, time spent, longest pause), gathered with :data:`gc.callbacks`, read as a plain dict
(:meth:`GcController.stats`).

Written for CPython's generational collector (3.11 to 3.13; measured on 3.11). On 3.14 the collector is
incremental: ``threshold2`` is ignored, the old generation is scanned automatically in increments and
``gc.collect(1)`` runs an increment; the freezes still apply there, the rest is unmeasured.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self, get_args

GcReason = Literal["auto", "start", "quiet", "quiet_full", "fallback_full", "thaw"]
"""Why a collection ran: ``auto`` is CPython's own (allocation thresholds); the others are this module's."""
GC_REASONS: tuple[GcReason, ...] = get_args(GcReason)

_NEVER = 2**31 - 1
"""A generation-2 threshold that CPython never reaches: no automatic full collection."""


@dataclass(frozen=True, slots=True)
class GcSettings:
    """When the controller collects. Times are seconds of the injected ``now``."""

    quiet_gap_s: float = 0.005
    """A wait at least this long is a quiet period, in which the controller may collect."""
    young_min_fill: float = 0.5
    """A quiet young collection runs only when generation 0 is at least this full (net container allocations
    since the last collection, as a fraction of its threshold); below that there is little to find."""
    full_every_s: float = 10.0
    """A quiet period this long after the last full collection gets a full one."""
    full_after_young: int = 5
    """...and so does one after this many young-generation (generation-1) collections: allocations grew."""
    fallback_s: float = 60.0
    """No full collection for this long (no quiet period came) and CPython collected the young generations
    since: the next wait, however short, gets a full collection."""
    fallback_young: int = 10
    """...or after this many generation-1 collections: bounds both the garbage a loop that never waits can
    leave in the oldest generation and the length of the forced pause (it traverses survivors since the
    last freeze only)."""
    threshold0: int | None = None
    """Generation-0 threshold while running (None: keep the process's, CPython's default is 700). Raising it
    makes fewer but longer young pauses, for about the same total (docs/benchmarks.md): the default keeps it."""
    threshold1: int | None = None
    """Generation-1 threshold while running (None: keep the process's)."""
    auto_full: bool = False
    """Let CPython also collect the oldest generation on its own (False: only this controller does)."""
    refreeze: bool = True
    """Freeze the survivors of every full collection, so that the next one does not traverse them again.
    The price: a reference cycle that dies after being frozen waits for the next thaw."""
    thaw_every_s: float | None = 600.0
    """Unfreeze, collect the whole heap and freeze again this often, in a quiet period at least as long as
    the last whole-heap collection took; after twice this long, at the next wait whatever its length once
    young generations were collected (None: never; cycles that die frozen then wait for the exit)."""

    def __post_init__(self) -> None:
        if self.quiet_gap_s < 0 or self.full_every_s < 0 or self.fallback_s <= 0:
            raise ValueError("quiet_gap_s and full_every_s must be >= 0, fallback_s > 0")
        if self.young_min_fill < 0 or self.full_after_young < 1 or self.fallback_young < 1:
            raise ValueError("young_min_fill must be >= 0, full_after_young and fallback_young >= 1")
        if any(t is not None and t < 1 for t in (self.threshold0, self.threshold1)):
            raise ValueError("GC thresholds must be >= 1 (0 would disable collection)")
        if self.thaw_every_s is not None and self.thaw_every_s <= 0:
            raise ValueError("thaw_every_s must be > 0 or None")


@dataclass(frozen=True, slots=True)
class _SavedState:
    enabled: bool
    threshold: tuple[int, int, int]
    freeze_count: int


class GcController:
    """Freezes at start, collects in the loop's quiet periods, restores the previous GC state on exit.

    Use it as a context manager and call :meth:`before_wait` each time the loop is about to wait, with the
    real seconds it will wait. A short wait costs one comparison: the fallback is decided in the GC
    callback, when CPython collects the young generations (no young collection, no new garbage). Not
    reentrant; one loop (one thread) per controller.
    """

    def __init__(self, settings: GcSettings | None = None, *, now: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings or GcSettings()
        self._quiet_gap_s = self.settings.quiet_gap_s
        self._now = now
        self._saved: _SavedState | None = None
        self._reason: GcReason | None = None
        """Set while this controller runs a collection, so the callback can tell it from CPython's own."""
        self._forced: GcReason | None = None
        """A collection the next :meth:`before_wait` runs whatever the gap (set by the callback)."""
        self._started_at = 0.0
        self._last_full = 0.0
        self._last_thaw = 0.0
        self._young_since_full = 0
        """Generation-1 collections since the last full one: how much may have reached the oldest generation."""
        self._full_s = 0.0
        """How long the last full collection took: a quiet period shorter than that is not used for one."""
        self._whole_heap_s = 0.0
        """How long the last collection of the whole heap (start or thaw) took: the next thaw's estimate."""
        self._num: dict[GcReason, int] = dict.fromkeys(GC_REASONS, 0)
        self._pause_s: dict[GcReason, float] = dict.fromkeys(GC_REASONS, 0.0)
        self._num_by_generation = [0, 0, 0]
        self._max_pause_s = 0.0
        self._max_pause_reason: GcReason | None = None
        self._num_collected = 0
        self._num_freezes = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        if self._saved is not None:
            raise RuntimeError("GcController is already active")
        self._saved = _SavedState(gc.isenabled(), gc.get_threshold(), gc.get_freeze_count())
        gc.callbacks.append(self._on_gc)
        try:
            now = self._now()
            self._collect("start", now)
            s, (t0, t1, t2) = self.settings, self._saved.threshold
            gc.set_threshold(
                t0 if s.threshold0 is None else s.threshold0,
                t1 if s.threshold1 is None else s.threshold1,
                t2 if s.auto_full else _NEVER,
            )
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._restore()

    def _restore(self) -> None:
        saved = self._saved
        if saved is None:
            return
        gc.set_threshold(*saved.threshold)
        # Objects frozen before we started cannot be told from ours: unfreeze only if nothing was frozen.
        if saved.freeze_count == 0:
            gc.unfreeze()
        if saved.enabled:
            gc.enable()
        else:
            gc.disable()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._saved = None

    @property
    def active(self) -> bool:
        return self._saved is not None

    # -- the loop's hook ----------------------------------------------------------------------------
    def before_wait(self, gap_s: float) -> GcReason | None:
        """The loop is about to wait ``gap_s`` real seconds: collect if that is worth it. Returns what ran."""
        if self._saved is None:
            raise RuntimeError("enter the GcController (with ...) before calling before_wait")
        if gap_s < self._quiet_gap_s and self._forced is None:
            return None  # the busy loop's path: keep it cheap
        s = self.settings
        now = self._now()
        if self._forced == "thaw":
            return self._collect("thaw", now)
        if gap_s >= self._quiet_gap_s:
            if (
                s.thaw_every_s is not None
                and now - self._last_thaw >= s.thaw_every_s
                and gap_s >= self._whole_heap_s
            ):
                return self._collect("thaw", now)
            if (
                now - self._last_full >= s.full_every_s or self._young_since_full >= s.full_after_young
            ) and gap_s >= self._full_s:
                return self._collect("quiet_full", now)
        if self._forced is not None:
            return self._collect(self._forced, now)
        if gc.get_count()[0] >= s.young_min_fill * gc.get_threshold()[0]:
            return self._collect("quiet", now)
        return None

    def _collect(self, reason: GcReason, now: float) -> GcReason:
        self._reason = reason
        try:
            if reason == "quiet":
                gc.collect(1)
            else:
                if reason == "thaw":
                    gc.unfreeze()
                gc.collect()
                if reason in ("start", "thaw") or self.settings.refreeze:
                    gc.freeze()
                    self._num_freezes += 1
        finally:
            self._reason = None
        if reason != "quiet":
            self._last_full = now
            self._young_since_full = 0
            if reason in ("start", "thaw") or self._forced == "fallback_full":
                self._forced = None
        if reason in ("start", "thaw"):
            self._last_thaw = now
        return reason

    # -- statistics and the fallback ----------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_at = self._now()
            return
        now = self._now()
        pause_s = now - self._started_at
        reason: GcReason = self._reason or "auto"
        self._num[reason] += 1
        self._pause_s[reason] += pause_s
        generation = min(max(int(info.get("generation", 2)), 0), 2)
        self._num_by_generation[generation] += 1
        self._num_collected += int(info.get("collected", 0))
        if pause_s > self._max_pause_s or self._max_pause_reason is None:
            self._max_pause_s = pause_s
            self._max_pause_reason = reason
        if generation == 2:
            if reason in ("start", "thaw"):
                self._whole_heap_s = pause_s
            else:
                self._full_s = pause_s
            return
        if generation == 1:
            self._young_since_full += 1
        # Young generations were collected, so garbage may be piling up where only a full collection finds
        # it: when one is overdue (no quiet period came), the next wait runs it, however short.
        s = self.settings
        if s.thaw_every_s is not None and now - self._last_thaw >= 2 * s.thaw_every_s:
            self._forced = "thaw"
        elif self._forced is None and (
            now - self._last_full >= s.fallback_s or self._young_since_full >= s.fallback_young
        ):
            self._forced = "fallback_full"

    def stats(self) -> dict[str, Any]:
        """Collections seen while active: counts and pause times by reason, by generation, the longest."""
        enabled = gc.isenabled()
        gc.disable()  # building the dict allocates: no collection may change the counts half-way
        try:
            return self._stats()
        finally:
            if enabled:
                gc.enable()

    def _stats(self) -> dict[str, Any]:
        return {
            "num_collections": dict(self._num),
            "pause_ms": {r: self._pause_s[r] * 1e3 for r in GC_REASONS},
            "num_by_generation": list(self._num_by_generation),
            "total_pause_ms": sum(self._pause_s.values()) * 1e3,
            "max_pause_ms": self._max_pause_s * 1e3,
            "max_pause_reason": self._max_pause_reason,
            "num_collected": self._num_collected,
            "num_freezes": self._num_freezes,
            "freeze_count": gc.get_freeze_count(),
        }


def freeze_startup_heap() -> None:
    """Collect every generation once, then :func:`gc.freeze` what survived: for a process that has just started
    (modules, engines, the app) and will then serve for long, so no later collection traverses its start-up heap.

    What vLLM's own OpenAI server does once it has started (its app's lifespan, ``freeze_gc_heap``). The vLLM agent
    serves vLLM's app with the lifespan off, and without this its per-token cost was ~20% higher under saturation
    (``tests/benchmarks/bench_openai_intake.py``, docs/vllm.md).
    """
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
