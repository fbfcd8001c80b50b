"""The per-unit metrics the heatmap can show: what each one is, its unit, its scale and which way is bad.

Plain data, no Textual: the state model fills one time series per metric and unit, the heatmap screen picks one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final


class HeatMetric(enum.Enum):
    """A metric of one unit over time (one heatmap)."""

    KV = "kv"
    """KV-cache use: used blocks over the unit's blocks (0..1)."""
    BATCH = "batch"
    """Batch size: the unit's running sequences."""
    QUEUED_PREFILL = "queued_prefill"
    """Prompt tokens queued at the unit and not prefilled yet (from the dispatcher's ``unit_load``)."""
    CAPACITY = "capacity"
    """Available capacity: the smaller of the free KV fraction and the free sequence-slot fraction (0..1)."""
    PAB = "pab"
    """FairBatching's prefill admission budget, in tokens (units whose policy computes one)."""
    STEP_TIME = "step_time"
    """Measured step time in milliseconds."""


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """How to show one :class:`HeatMetric`."""

    metric: HeatMetric
    label: str
    """Name for legends and the cursor line."""
    short: str
    """A word for the key hints."""
    unit: str
    """Shown after values ("" for fractions, which are shown as percentages)."""
    key: str
    """The key that selects it on the heatmap screen."""
    fixed_max: float | None
    """The top of the colour scale when it is fixed (fractions: 1.0); None: scaled to the visible values."""
    higher_is_worse: bool
    """Whether high values get the alarming end of the colour scale (False for free capacity and budgets)."""
    percent: bool = False
    """Whether values are fractions shown as percentages."""


METRICS: Final[tuple[HeatMetric, ...]] = tuple(HeatMetric)
"""Every metric, in the order the heatmap cycles through them."""
METRIC_INDEX: Final[dict[HeatMetric, int]] = {m: i for i, m in enumerate(METRICS)}
"""Each metric's position in the state model's per-bucket arrays."""

METRIC_SPECS: Final[dict[HeatMetric, MetricSpec]] = {
    spec.metric: spec
    for spec in (
        MetricSpec(
            HeatMetric.KV,
            label="KV use",
            short="KV",
            unit="",
            key="k",
            fixed_max=1.0,
            higher_is_worse=True,
            percent=True,
        ),
        MetricSpec(
            HeatMetric.BATCH,
            label="batch size",
            short="batch",
            unit="seqs",
            key="b",
            fixed_max=None,
            higher_is_worse=True,
        ),
        MetricSpec(
            HeatMetric.QUEUED_PREFILL,
            label="queued prefill",
            short="queued",
            unit="tok",
            key="w",
            fixed_max=None,
            higher_is_worse=True,
        ),
        MetricSpec(
            HeatMetric.CAPACITY,
            label="available capacity",
            short="capacity",
            unit="",
            key="c",
            fixed_max=1.0,
            higher_is_worse=False,
            percent=True,
        ),
        MetricSpec(
            HeatMetric.PAB, label="PAB", short="PAB", unit="tok", key="p", fixed_max=None, higher_is_worse=False
        ),
        MetricSpec(
            HeatMetric.STEP_TIME,
            label="step time",
            short="step",
            unit="ms",
            key="s",
            fixed_max=None,
            higher_is_worse=True,
        ),
    )
}
"""How each metric is shown (in :data:`METRICS` order)."""


def next_metric(metric: HeatMetric, step: int = 1) -> HeatMetric:
    """The metric ``step`` places after ``metric`` in :data:`METRICS`, wrapping around."""
    return METRICS[(METRIC_INDEX[metric] + step) % len(METRICS)]
