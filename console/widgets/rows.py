"""Styled rows: what the console's chart widgets draw, as plain data.

A chart widget builds its picture with a pure function as rows of ``(text, style)`` cells, ``style`` naming one
of the widget's component classes (without its prefix; "" for the widget's own style), so tests read the picture
as text (:func:`row_text`) and only :func:`rows_text` touches the widget, to look the styles up.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

Cell = tuple[str, str]
"""Text and the style name it is drawn in."""
Row = list[Cell]


def row_text(row: Sequence[Cell]) -> str:
    """The row's characters, styles left out."""
    return "".join(text for text, _ in row)


def rows_text(widget: Widget, rows: Sequence[Sequence[Cell]], prefix: str) -> Text:
    """``rows`` as one rich text, each style name looked up as the component class ``{prefix}--{name}``; a run of
    cells in one style becomes one span (charts draw cell by cell: a span per cell would make a segment per cell
    all the way to the terminal)."""
    styles: dict[str, Style] = {}
    text = Text(no_wrap=True, overflow="crop", end="")
    for i, row in enumerate(rows):
        if i:
            text.append("\n")
        for name, run in groupby(row, key=itemgetter(1)):
            chunk = "".join(cell for cell, _ in run)
            if not name:
                text.append(chunk)
                continue
            style = styles.get(name)
            if style is None:
                style = styles[name] = widget.get_component_rich_style(f"{prefix}--{name}", partial=True)
            text.append(chunk, style=style)
    return text
