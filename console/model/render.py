"""Pure functions behind the console's numbers and pictures: percentiles, time buckets, colour scales,
sparklines and value formats (STYLE example 12). No Textual, no clocks: everything is an argument."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Final, TypeVar

T = TypeVar("T")

SPARK_GLYPHS: Final = "▁▂▃▄▅▆▇█"
"""Sparkline bars, lowest to highest."""


# -- statistics ------------------------------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of already sorted values, interpolated linearly between the two nearest
    ranks (numpy's default method); None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    n = len(sorted_values)
    if n == 0:
        return None
    rank = (n - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, n - 1)
    frac = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * frac


def percentiles(values: Iterable[float], qs: Sequence[float]) -> tuple[float | None, ...]:
    """Several percentiles of unsorted values (sorted once)."""
    ordered = sorted(values)
    return tuple(percentile(ordered, q) for q in qs)


# -- time buckets ------------------------------------------------------------------------------------------------
def bucket_index(time_ns: int, bucket_ns: int) -> int:
    """The fixed time bucket holding ``time_ns``: buckets are aligned on the epoch, so every node's bucket ``i``
    covers the same wall-clock interval ``[i * bucket_ns, (i + 1) * bucket_ns)``."""
    return time_ns // bucket_ns


def bucket_start_ns(index: int, bucket_ns: int) -> int:
    """Where bucket ``index`` starts (wall-clock ns)."""
    return index * bucket_ns


def window_buckets(now_ns: int, window_ns: int, bucket_ns: int) -> range:
    """The buckets of the sliding window ending at ``now_ns``: the bucket holding ``now_ns`` and enough before it
    to cover ``window_ns`` (at least one)."""
    end = bucket_index(now_ns, bucket_ns)
    count = max(1, math.ceil(window_ns / bucket_ns))
    return range(end - count + 1, end + 1)


# -- colour scales ---------------------------------------------------------------------------------------------
def cycled(items: Sequence[T], current: T | None, step: int) -> T:
    """The item ``step`` places after ``current`` in ``items`` (wrapping); the first when ``current`` is not
    among them. ``items`` must not be empty."""
    at = items.index(current) if current in items else -step
    return items[(at + step) % len(items)]


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least ``value`` (1.0 for zero or less): a
    legend's top that reads well."""
    if not value > 0 or math.isinf(value):
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        top = step * 10.0**exponent
        if top >= value * (1 - 1e-12):
            return top
    return 10.0 ** (exponent + 1)  # pragma: no cover - the loop always returns


def scale_range(values: Iterable[float | None], fixed_max: float | None) -> tuple[float, float]:
    """The colour scale ``(low, high)`` for a heatmap: from 0 to ``fixed_max`` when the metric has one, else to a
    :func:`nice_ceiling` of the largest value shown."""
    if fixed_max is not None:
        return 0.0, fixed_max
    top = max((v for v in values if v is not None), default=0.0)
    return 0.0, nice_ceiling(top)


def scale_level(value: float, low: float, high: float, levels: int, *, higher_is_worse: bool = True) -> int:
    """The colour level (0 = calm .. ``levels - 1`` = alarming) of ``value`` on the scale ``low..high``; values
    outside the scale are clamped. With ``higher_is_worse`` False the scale is reversed (low free capacity is
    the alarming end)."""
    if levels < 1:
        raise ValueError("levels must be at least 1")
    frac = 0.0 if high <= low or math.isnan(value) else min(1.0, max(0.0, (value - low) / (high - low)))
    if not higher_is_worse:
        frac = 1.0 - frac
    return min(levels - 1, int(frac * levels))


def gradient_stop(level: int, levels: int) -> tuple[int, float]:
    """Where colour ``level`` lies on a three-colour gradient (calm, middle, alarming): the segment (0: calm to
    middle, 1: middle to alarming) and the blend fraction within it."""
    if levels <= 1:
        return 0, 0.0
    t = level / (levels - 1)
    if t <= 0.5:
        return 0, t * 2.0
    return 1, (t - 0.5) * 2.0


# -- text ----------------------------------------------------------------------------------------------------------
def sparkline(values: Sequence[float | None], width: int, *, high: float | None = None) -> str:
    """The last ``width`` values as bar glyphs (scaled from 0 to ``high``, default the largest); None (no data) is
    a space; the result is padded on the left to ``width``."""
    if width <= 0:
        return ""
    tail = list(values[-width:])
    top = high if high is not None else max((v for v in tail if v is not None), default=0.0)
    chars = []
    for v in tail:
        if v is None:
            chars.append(" ")
        elif top <= 0:
            chars.append(SPARK_GLYPHS[0])
        else:
            index = round(min(1.0, max(0.0, v / top)) * (len(SPARK_GLYPHS) - 1))
            chars.append(SPARK_GLYPHS[index])
    return "".join(chars).rjust(width)


def fmt_si(value: float | None, digits: int = 3) -> str:
    """A compact number: 987, 1.23k, 45.6M; "-" for None."""
    if value is None or math.isnan(value):
        return "-"
    magnitude = abs(value)
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= factor:
            return f"{value / factor:.{digits}g}{suffix}"
    if magnitude >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def fmt_pct(fraction: float | None) -> str:
    """A fraction as a whole percentage ("-" for None)."""
    return "-" if fraction is None or math.isnan(fraction) else f"{fraction * 100:.0f}%"


def fmt_ms(value_ms: float | None) -> str:
    """Milliseconds, compact: 12.3, 456, 1.2k ("-" for None)."""
    if value_ms is None or math.isnan(value_ms):
        return "-"
    if value_ms < 10:
        return f"{value_ms:.1f}"
    return fmt_si(value_ms)


def fmt_pair(first: float | None, second: float | None) -> str:
    """Two milliseconds values as ``a/b`` (a p50 and a p99)."""
    return f"{fmt_ms(first)}/{fmt_ms(second)}"


def fmt_value(value: float | None, unit: str, percent: bool) -> str:
    """A metric's value with its unit."""
    if percent:
        return fmt_pct(value)
    text = fmt_ms(value) if unit == "ms" else fmt_si(value)
    return f"{text} {unit}" if unit and value is not None else text


def fmt_clock(time_ns: int) -> str:
    """Local wall-clock time of day, ``HH:MM:SS``."""
    return time.strftime("%H:%M:%S", time.localtime(time_ns / 1e9))


def fmt_age(seconds: float) -> str:
    """A time before now on an axis: ``now``, ``-30s``, ``-2m10s``, ``-5m``, ``-2h05m``, ``-2h`` (to the second
    below two hours, to the minute above, so that neighbouring ticks of a wide axis never read the same)."""
    if seconds <= 0:
        return "now"
    if seconds < 120:
        return f"-{seconds:.0f}s"
    if seconds < 7200:
        minutes, rest_s = divmod(round(seconds), 60)
        return f"-{minutes}m{rest_s:02d}s" if rest_s else f"-{minutes}m"
    hours, rest_m = divmod(round(seconds / 60), 60)
    return f"-{hours}h{rest_m:02d}m" if rest_m else f"-{hours}h"


def time_axis(num_columns: int, bucket_s: float, every: int = 10, end_age_s: float = 0.0) -> str:
    """An axis under ``num_columns`` bucket columns, the rightmost ``end_age_s`` old (0: the newest, labelled
    ``now``; otherwise its age), and a tick with its age every ``every`` columns back, where its label fits."""
    cells = [" "] * num_columns
    end_label = "now" if end_age_s <= 0 else fmt_age(end_age_s)
    if num_columns >= len(end_label):
        cells[num_columns - len(end_label) :] = end_label
    for back in range(every, num_columns, every):
        col = num_columns - 1 - back
        label = "╵" + fmt_age(end_age_s + back * bucket_s)
        end = col + len(label)
        if end <= num_columns - len(end_label) - 1 and all(c == " " for c in cells[col:end]):
            cells[col:end] = label
    return "".join(cells)
