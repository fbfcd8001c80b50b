"""Recent alerts, newest first, coloured by severity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from console.model.records import AlertEntry
from console.model.render import fmt_clock


def alert_line(entry: AlertEntry) -> str:
    """One alert as a line: time, node (and unit), code, message."""
    where = entry.node_id if entry.unit_id is None else f"{entry.node_id} u{entry.unit_id}"
    return f"{fmt_clock(entry.time_ns)} {entry.severity:<7} {where} {entry.code}: {entry.message}"


class AlertList(Static):
    """The latest alerts (component classes ``alerts--info``, ``alerts--warning``, ``alerts--error``,
    ``alerts--none``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"alerts--info", "alerts--warning", "alerts--error", "alerts--none"}

    def __init__(self, *, limit: int = 50, id: str | None = None) -> None:
        super().__init__(id=id)
        self.limit = limit
        """Alerts shown at most."""
        self.num_shown = -1
        """The state's alert count when last drawn (-1: never)."""

    def show_alerts(self, alerts: Sequence[AlertEntry], num_alerts: int) -> None:
        """Draw the newest ``limit`` of ``alerts`` when ``num_alerts`` (alerts ever added) has moved."""
        if num_alerts == self.num_shown:
            return
        self.num_shown = num_alerts
        if not alerts:
            self.update(Text("no alerts", style=self.get_component_rich_style("alerts--none", partial=True)))
            return
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, entry in enumerate(reversed(alerts)):
            if i == self.limit:
                break
            if i:
                text.append("\n")
            severity = entry.severity if entry.severity in ("info", "warning", "error") else "warning"
            text.append(alert_line(entry), style=self.get_component_rich_style(f"alerts--{severity}", partial=True))
        self.update(text)
