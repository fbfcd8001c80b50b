"""One request's envelope: tokens done over time (bars, from successive slack samples) against its deadline line
``arrival + ttft_slo + tpot_slo * j`` (``─``). A bar is drawn in the calm style while the request is on time
(tokens done at least the tokens due) and in the alarming one while it is behind."""

from __future__ import annotations

from typing import ClassVar, Final

from rich.text import Text
from textual.widget import Widget

from console.model.render import fmt_age, fmt_ms, fmt_si
from console.model.slack import Envelope, envelope_columns
from console.model.steps import level_row
from console.widgets.rows import Row, rows_text

LABEL_WIDTH: Final = 7
CHROME_LINES: Final = 2
"""Rows that are not the chart: the time axis and the legend."""


def envelope_heading(env: Envelope | None, now_ns: int) -> str:
    """The request, its unit, its age, where it stands (tokens done and due), its deadline line."""
    if env is None:
        return "no request selected"
    end = env.end_ns(now_ns)
    done = env.done(end)
    due = env.due(end)
    state = "finished" if env.finished_ns is not None else f"started {fmt_age((now_ns - env.start_ns) / 1e9)}"
    unit = "" if env.unit_id is None else f" u{env.unit_id}"
    first_ms = (env.first_deadline_ns - env.start_ns) / 1e6
    return (
        f"{env.request_id}{unit} · {state} · {done if done is not None else '-'} done, {due} due · first token "
        f"due +{fmt_ms(first_ms)} ms, then every {fmt_ms(env.tpot_ns / 1e6)} ms"
    )


def envelope_rows(env: Envelope | None, end_ns: int, width: int, height: int) -> list[Row]:
    """The chart of ``env`` from its start to ``end_ns`` on ``width`` x ``height`` cells. Pure, for tests."""
    if env is None:
        return [[("no request to draw: select one above", "muted")]]
    columns = envelope_columns(env, max(1, width - LABEL_WIDTH), end_ns)
    top = max(1, max(due for _, due in columns), max((done or 0) for done, _ in columns))
    bars = max(1, height - CHROME_LINES)
    rows: list[Row] = []
    for r in range(bars):
        level = bars - r
        label = fmt_si(top) if r == 0 else "tok" if r == 1 and bars > 2 else "0" if level == 1 else ""
        row: Row = [(label.rjust(LABEL_WIDTH - 1) + " ", "label")]
        for done, due in columns:
            filled = 0 if not done else max(1, round(done / top * bars))
            if level <= filled:
                row.append(("█", "ok" if done is not None and done >= due else "behind"))
            elif level_row(due, top, bars) == level:
                row.append(("─", "deadline"))
            else:
                row.append((" ", ""))
        rows.append(row)
    span_s = (env.end_ns(end_ns) - env.start_ns) / 1e9
    axis_width = len(columns)
    right = "finish" if env.finished_ns is not None else "now"
    left = "arrival" if env.arrival_ns is not None else "first sample"
    axis = f"{left} ({fmt_si(span_s)}s)".ljust(max(0, axis_width - len(right))) + right
    rows.append([("".ljust(LABEL_WIDTH), "label"), (axis[:axis_width], "axis")])
    rows.append(
        [
            ("".ljust(LABEL_WIDTH), "label"),
            ("█", "ok"),
            (" done, on time ", "axis"),
            ("█", "behind"),
            (" behind ", "axis"),
            ("─", "deadline"),
            (" due: arrival+TTFT+TPOT·j", "axis"),
        ]
    )
    return rows[:height] if height > 0 else rows


class EnvelopeChart(Widget):
    """A request's envelope (component classes ``envelope--ok``, ``envelope--behind``, ``envelope--deadline``,
    ``envelope--label``, ``envelope--axis``, ``envelope--muted``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "envelope--ok",
        "envelope--behind",
        "envelope--deadline",
        "envelope--label",
        "envelope--axis",
        "envelope--muted",
    }

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.envelope: Envelope | None = None
        self.end_ns = 0
        """The right edge of the chart while the request runs (the state's time)."""

    def show(self, envelope: Envelope | None, end_ns: int) -> None:
        self.envelope, self.end_ns = envelope, end_ns
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, envelope_rows(self.envelope, self.end_ns, self.size.width, self.size.height), "envelope")
