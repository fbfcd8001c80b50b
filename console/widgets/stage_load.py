"""Per-stage load of a staged dispatcher: each stage's lengths, units, running and waiting requests, KV use,
queued prefill and its share of recent arrivals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual.widgets import Static

from console.model.render import fmt_pct, fmt_si
from console.model.stages import StageLoad, fmt_units, stage_range
from console.widgets.rows import Row, rows_text

HEADER = f"{'#':<3}{'lengths':<10}{'units':<8}{'run':>5}{'wait':>5}{'KV':>5}{'queued':>7}{'share':>6}"


def load_line(load: StageLoad) -> str:
    """One stage as a row under :data:`HEADER`."""
    return (
        f"{load.index:<3}{stage_range(load.low_tokens, load.high_tokens)[:9]:<10}{fmt_units(load.unit_ids)[:7]:<8}"
        f"{load.num_running:>5}{load.num_waiting:>5}{fmt_pct(load.kv):>5}{fmt_si(load.queued_prefill_tokens):>7}"
        f"{fmt_pct(load.share):>6}"
    )


def load_rows(loads: Sequence[StageLoad] | None) -> list[Row]:
    """The header and a row per stage; a plain sentence without a staged dispatcher. Pure, for tests."""
    if loads is None:
        return [[("no stages: no staged dispatcher is running on this node", "muted")]]
    return [[(HEADER, "heading")], *([(load_line(load), "")] for load in loads)]


class StageLoadPanel(Static):
    """Stages and their load (component classes ``stage-load--heading``, ``stage-load--muted``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"stage-load--heading", "stage-load--muted"}

    def show_loads(self, loads: Sequence[StageLoad] | None) -> None:
        self.update(rows_text(self, load_rows(loads), "stage-load"))
