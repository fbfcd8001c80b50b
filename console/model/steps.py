"""Recent steps of every unit: a bounded ring per unit and the pure queries behind the Steps screen.

:class:`StepLog` keeps the latest ``max_steps`` ``step`` events of each unit, oldest first (the state model adds
every step it folds). The Steps screen shows one unit's ring as a timeline with a cursor on one step; the cursor
is the step's start time (``None``: the newest step, following new ones), so it stays on the same step while
new ones arrive and survives an agent restart that numbers steps from 1 again. Everything here is a function of
its arguments (no Textual, no clock).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from agent.telemetry import StepEvent
from console.model.render import fmt_ms, fmt_pct, fmt_si, nice_ceiling
from policies.types import ReasonValue

UnitKey = tuple[str, int]
"""``(node_id, unit_id)``."""

MODE_GLYPHS: Final[dict[str, str]] = {"mixed": "M", "prefill": "P", "decode": "D", "idle": "·"}
"""One character per step mode on the timeline's mode row."""


class StepLog:
    """The latest ``max_steps`` steps of every unit, oldest first."""

    __slots__ = ("_rings", "max_steps", "num_steps")

    def __init__(self, max_steps: int = 256) -> None:
        if max_steps < 1:
            raise ValueError("a step log holds at least one step per unit")
        self.max_steps = max_steps
        """Steps kept per unit."""
        self.num_steps = 0
        """Steps ever added."""
        self._rings: dict[UnitKey, deque[StepEvent]] = {}

    def add(self, node_id: str, event: StepEvent) -> None:
        """One step of unit ``event.unit_id`` of ``node_id`` (stream order)."""
        key = (node_id, event.unit_id)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = deque(maxlen=self.max_steps)
        ring.append(event)
        self.num_steps += 1

    def steps(self, node_id: str, unit_id: int) -> Sequence[StepEvent]:
        """The unit's steps held, oldest first (empty for a unit without steps)."""
        return self._rings.get((node_id, unit_id), ())

    def latest(self, node_id: str, unit_id: int) -> StepEvent | None:
        """The unit's newest step, if any."""
        ring = self._rings.get((node_id, unit_id))
        return ring[-1] if ring else None


# -- the cursor ----------------------------------------------------------------------------------------------------
def step_index(steps: Sequence[StepEvent], cursor_ns: int | None) -> int:
    """Where the cursor is in ``steps``: the newest step when following (``None``), else the step starting at
    ``cursor_ns`` (or the last one before it; the oldest when the cursor's step is no longer held); -1 without
    steps."""
    if not steps:
        return -1
    if cursor_ns is None:
        return len(steps) - 1
    for i in range(len(steps) - 1, -1, -1):
        if steps[i].time_ns <= cursor_ns:
            return i
    return 0


def move_cursor(steps: Sequence[StepEvent], cursor_ns: int | None, delta: int) -> int | None:
    """The cursor ``delta`` steps on (negative: back in time), clamped to the steps held; reaching the newest step
    gives ``None`` (follow)."""
    if not steps:
        return None
    index = min(len(steps) - 1, max(0, step_index(steps, cursor_ns) + delta))
    return None if index == len(steps) - 1 else steps[index].time_ns


@dataclass(frozen=True, slots=True)
class StepWindow:
    """The steps that fit across the timeline, and the scales they are drawn on."""

    steps: tuple[StepEvent, ...]
    """Visible steps, oldest first."""
    first: int
    """The index (in the unit's ring) of ``steps[0]``."""
    cursor: int
    """The cursor's index within :attr:`steps` (-1 without steps)."""
    top_tokens: float
    """The token bars' full height: a round number at least the largest prefill + decode shown."""
    top_ms: float
    """The step-time rows' full height: the largest predicted or measured time shown (ms)."""


def step_window(steps: Sequence[StepEvent], width: int, cursor_ns: int | None) -> StepWindow:
    """The last ``width`` steps, or, when the cursor is further back than that, ``width`` steps from the cursor
    on (the cursor at the left edge, as in the heatmap)."""
    width = max(1, width)
    index = step_index(steps, cursor_ns)
    if index < 0:
        return StepWindow((), 0, -1, 1.0, 1.0)
    first = max(0, len(steps) - width) if index >= len(steps) - width else index
    shown = tuple(steps[i] for i in range(first, min(len(steps), first + width)))
    top_tokens = nice_ceiling(max((s.num_prefill_tokens + s.num_decode_tokens for s in shown), default=0))
    top_ms = max((max(s.measured_ns, s.predicted_ns) / 1e6 for s in shown), default=0.0)
    return StepWindow(shown, first, index - first, top_tokens, top_ms if top_ms > 0 else 1.0)


# -- drawing helpers -----------------------------------------------------------------------------------------------
def bar_rows(prefill_tokens: int, decode_tokens: int, top: float, height: int) -> tuple[int, int]:
    """A step's stacked bar on ``height`` rows scaled to ``top`` tokens: ``(decode_rows, prefill_rows)``, decode
    at the bottom. The bar is rounded up (any work shows), and each part that is not zero gets a row when the
    bar has two; with one row, the larger part takes it."""
    total = prefill_tokens + decode_tokens
    if total <= 0 or top <= 0 or height <= 0:
        return 0, 0
    rows = min(height, math.ceil(total / top * height - 1e-9))
    decode_rows = round(decode_tokens / total * rows)
    if rows >= 2:
        if decode_tokens and not decode_rows:
            decode_rows = 1
        elif prefill_tokens and decode_rows == rows:
            decode_rows = rows - 1
    return decode_rows, rows - decode_rows


def level_row(value: float, top: float, height: int) -> int | None:
    """The row (1 = the bottom one) whose top a level of ``value`` on a ``top``-high scale reaches; None when it
    is off the scale (above ``top``, or not positive)."""
    if value <= 0 or top <= 0 or value > top * (1 + 1e-9):
        return None
    return max(1, min(height, round(value / top * height)))


def prediction_error(step: StepEvent) -> float | None:
    """How far the measured time was from the cost model's prediction, as a fraction of the prediction (+0.1: took
    10% longer); None without a prediction."""
    if step.predicted_ns <= 0:
        return None
    return (step.measured_ns - step.predicted_ns) / step.predicted_ns


@dataclass(frozen=True, slots=True)
class StepStats:
    """The visible steps in a few numbers (the timeline's heading)."""

    num_steps: int
    num_by_mode: dict[str, int]
    """Steps per mode (``mixed``, ``prefill``, ``decode``, ``idle``), in that order."""
    mean_abs_error: float | None
    """The mean of ``|measured - predicted| / predicted`` over the steps with a prediction."""
    mean_tokens: float
    """Prefill plus decode tokens per step."""


def step_stats(steps: Sequence[StepEvent]) -> StepStats:
    """Mode counts, mean prediction error and tokens per step of ``steps``."""
    counts = dict.fromkeys(MODE_GLYPHS, 0)
    errors = []
    tokens = 0
    for s in steps:
        counts[str(s.mode)] = counts.get(str(s.mode), 0) + 1
        error = prediction_error(s)
        if error is not None:
            errors.append(abs(error))
        tokens += s.num_prefill_tokens + s.num_decode_tokens
    return StepStats(
        len(steps),
        counts,
        sum(errors) / len(errors) if errors else None,
        tokens / len(steps) if steps else 0.0,
    )


# -- the cursor's step in words --------------------------------------------------------------------------------------
def fmt_reason(value: ReasonValue) -> str:
    """A reason's value: booleans as yes/no, floats compact, strings as sent (``inf`` included)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt_si(value, digits=4)
    return str(value)


def reason_lines(reasons: Mapping[str, ReasonValue]) -> list[tuple[str, str]]:
    """The policy's reasons as ``(name, value)`` in the policy's own order ("why did it decide that")."""
    return [(name, fmt_reason(value)) for name, value in reasons.items()]


def step_facts(step: StepEvent) -> list[tuple[str, str]]:
    """The step's numbers as ``(label, value)`` lines: mode and policy, tokens and requests of each kind, the
    budget, predicted against measured time, batch, queue, KV, preemptions and finishes."""
    error = prediction_error(step)
    kv = f"{step.kv_used_blocks}/{step.num_blocks}"
    if step.num_blocks:
        kv += f" ({fmt_pct(step.kv_used_blocks / step.num_blocks)})"
    return [
        ("mode", str(step.mode)),
        ("policy", step.policy or "-"),
        ("prefill", f"{step.num_prefill_tokens} tok · {step.num_prefill_reqs} req"),
        ("decode", f"{step.num_decode_tokens} tok · {step.num_decode_reqs} req"),
        ("budget", f"{step.budget_tokens} tok"),
        ("predicted", f"{fmt_ms(step.predicted_ns / 1e6)} ms"),
        (
            "measured",
            f"{fmt_ms(step.measured_ns / 1e6)} ms" + ("" if error is None else f" ({error * 100:+.1f}%)"),
        ),
        ("context", f"{fmt_si(step.context_tokens)} tok"),
        ("running", f"{step.num_running} · waiting {step.num_waiting}"),
        ("KV", kv),
        ("preempted", f"{step.num_preempted} · finished {step.num_finished}"),
    ]
