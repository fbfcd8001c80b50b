"""The sampled requests of a unit nearest to missing their next token's deadline, least slack first, with the
selected one (whose envelope is drawn below) highlighted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.widget import Widget

from console.model.render import fmt_si
from console.model.slack import SlackRow
from console.widgets.rows import Row, rows_text

HEADER = f"{'request':<10}{'slack ms':>8}{'done':>5}{'ctx':>6}{'ahead':>7}"


def request_line(row: SlackRow) -> str:
    """One request: id, slack (ms), output tokens done, context tokens, tokens ahead of its deadline line."""
    return (
        f"{row.request_id[:9]:<10}{fmt_si(row.slack_ms):>8}{row.output_tokens:>5}"
        f"{fmt_si(row.computed_tokens):>6}{row.tokens_ahead:>+7.1f}"
    )


def nearest_rows(rows: Sequence[SlackRow], selected: str | None, height: int) -> list[Row]:
    """The header and as many requests as fit, scrolled so the selected one shows. Pure, for tests."""
    if not rows:
        return [[("no running requests sampled", "muted")]]
    out: list[Row] = [[(HEADER, "heading")]]
    visible = max(1, height - 1)
    ids = [r.request_id for r in rows]
    at = ids.index(selected) if selected in ids else 0
    first = max(0, at - visible + 1)
    for row in rows[first : first + visible]:
        style = "cursor" if row.request_id == selected else "late" if row.slack_ms < 0 else ""
        out.append([(request_line(row), style)])
    return out


class NearestRequests(Widget):
    """Requests nearest to a miss (component classes ``nearest--heading``, ``nearest--cursor``, ``nearest--late``,
    ``nearest--muted``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"nearest--heading", "nearest--cursor", "nearest--late", "nearest--muted"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: Sequence[SlackRow] = ()
        """The unit's sampled requests, least slack first."""
        self.selected: str | None = None
        """The highlighted request."""

    def show(self, rows: Sequence[SlackRow], selected: str | None) -> None:
        self.rows, self.selected = rows, selected
        self.refresh()

    def render(self) -> Text:
        return rows_text(self, nearest_rows(self.rows, self.selected, self.size.height), "nearest")
