"""The audit log: control actions the agents audited (applied, dry runs, rejected), newest first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.widgets import Static

from agent.telemetry import ControlAudit
from console.model.policy_view import audit_line


class AuditLog(Static):
    """The latest audits (component classes ``audit--applied``, ``audit--dry-run``, ``audit--rejected``,
    ``audit--none``)."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"audit--applied", "audit--dry-run", "audit--rejected", "audit--none"}

    def __init__(self, *, limit: int = 100, id: str | None = None) -> None:
        super().__init__(id=id)
        self.limit = limit
        """Audits shown at most."""
        self.lines_shown: tuple[str, ...] = ()
        """The lines on display, newest first."""
        self._shown_key: tuple[int, int] = (-1, 0)

    def show_audits(self, audits: Sequence[ControlAudit]) -> None:
        """Draw the newest ``limit`` of ``audits`` (oldest first, as the state keeps them) when they changed."""
        key = (len(audits), id(audits[-1]) if audits else 0)
        if key == self._shown_key:
            return
        self._shown_key = key
        if not audits:
            self.lines_shown = ()
            self.update(
                Text("no control actions yet", style=self.get_component_rich_style("audit--none", partial=True))
            )
            return
        text = Text(no_wrap=True, overflow="ellipsis")
        lines = []
        for i, audit in enumerate(reversed(audits)):
            if i == self.limit:
                break
            line = audit_line(audit)
            lines.append(line)
            if i:
                text.append("\n")
            style = {"applied": "audit--applied", "dry_run": "audit--dry-run"}.get(audit.result, "audit--rejected")
            text.append(line, style=self.get_component_rich_style(style, partial=True))
        self.lines_shown = tuple(lines)
        self.update(text)
