"""Snapshot files of the console's screens: what the terminal shows, cell by cell, as plain text.

pytest-textual-snapshot pins syrupy 4.8, which caps pytest below 9 (we run pytest 9), so the console keeps its own
small arrangement (docs/console.md, "Snapshot tests"): a test drives the app with Pilot to a state, takes Textual's
own screenshot (``App.export_screenshot()``, the public API that pytest-textual-snapshot uses too) and reads the SVG
back into a :class:`Picture`: the screen's text, one line per terminal row, and its styles, one letter per cell
with a legend of what each letter is (foreground, bold/italic/underline, background). The picture is compared with
``tests/snapshots/<name>.txt``: a change of text shows as a unified diff of the text, a change of colour only as
the rows and columns whose letters moved. ``TRACKSIDE_UPDATE_SNAPSHOTS=1`` writes the files instead.

The SVG's layout is rich's ``Console.export_svg``: one ``<text>`` per run of a style on a row (its class names the
style in the ``<style>`` block), one ``<rect>`` per run of a background colour, cells 12.2 px wide and 24.4 px
high.
"""

from __future__ import annotations

import difflib
import os
import re
import string
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest
from rich.cells import cell_len

SNAPSHOT_DIR: Final = Path(__file__).parent / "snapshots"
UPDATE_ENV: Final = "TRACKSIDE_UPDATE_SNAPSHOTS"
UPDATE_COMMAND: Final = f"{UPDATE_ENV}=1 .venv/bin/python -m pytest tests/test_console_snapshots.py"

CELL_WIDTH_PX: Final = 20 * 0.61
"""rich's ``export_svg``: 20 px characters at a 0.61 aspect ratio."""
CELL_HEIGHT_PX: Final = 20 * 1.22
BACKGROUND_TOP_PX: Final = 1.5
"""A row's background rectangle starts this far below the row's top."""
LETTERS: Final = string.ascii_lowercase + string.ascii_uppercase + string.digits + "!#$%&*+-/:;<=>?@^_~"
"""Style letters, in the order styles first appear (left to right, top to bottom)."""
MAX_DIFF_LINES: Final = 60

SVG_NS: Final = "{http://www.w3.org/2000/svg}"
STYLE_RULE: Final = re.compile(r"\.(terminal-\d+-r\d+)\s*\{\s*([^}]*)\}")
LINE_CLIP: Final = re.compile(r"-line-(\d+)\)")


@dataclass(frozen=True, slots=True)
class Picture:
    """A screen as text: ``text`` (each row, trailing blanks cut), ``styles`` (each row, one letter per cell) and
    ``legend`` (``a  #e0e0e0 bold on #1e1e1e``: what each letter stands for)."""

    width: int
    height: int
    text: tuple[str, ...]
    styles: tuple[str, ...]
    legend: tuple[str, ...]

    def render(self, name: str) -> str:
        """The snapshot file's contents."""
        return "\n".join(
            [
                f"# trackside console snapshot {name}: {self.width}x{self.height} cells",
                f"# made by tests/test_console_snapshots.py; rewrite with {UPDATE_COMMAND}",
                "## text",
                *self.text,
                "## styles (one letter per cell; the legend below)",
                *self.styles,
                "## legend",
                *self.legend,
                "",
            ]
        )


def _style_words(css: str) -> str:
    """``fill: #e0e0e0;font-weight: bold`` -> ``#e0e0e0 bold``."""
    words: list[str] = []
    for rule in filter(None, (part.strip() for part in css.split(";"))):
        key, _, value = (s.strip() for s in rule.partition(":"))
        if key == "fill":
            words.insert(0, value)
        elif key == "font-weight" and value == "bold":
            words.append("bold")
        elif key == "font-style" and value == "italic":
            words.append("italic")
        elif key == "text-decoration":
            words.append({"line-through": "strike"}.get(value, value))
        else:
            words.append(f"{key}={value}")
    return " ".join(words)


def picture_of_svg(svg: str, width: int, height: int) -> Picture:
    """Read an ``export_screenshot()`` SVG of a ``width`` x ``height`` terminal back into a :class:`Picture`."""
    root = ET.fromstring(svg)
    css = {cls: _style_words(rules) for cls, rules in STYLE_RULE.findall(svg)}
    backgrounds = _backgrounds(root, width, height)
    chars, foregrounds = _characters(root, css, width, height)
    letters: dict[tuple[str, str], str] = {}
    styles = []
    for fg_row, bg_row in zip(foregrounds, backgrounds, strict=True):
        line = []
        for key in zip(fg_row, bg_row, strict=True):
            if key not in letters:
                if len(letters) == len(LETTERS):
                    raise ValueError(f"more than {len(LETTERS)} styles on one screen")
                letters[key] = LETTERS[len(letters)]
            line.append(letters[key])
        styles.append("".join(line))
    legend = tuple(f"{letter}  {fg or '(blank)'} on {bg}" for (fg, bg), letter in letters.items())
    text = tuple("".join(row).rstrip() for row in chars)
    return Picture(width, height, text, tuple(styles), legend)


def _backgrounds(root: ET.Element, width: int, height: int) -> list[list[str]]:
    """Each cell's background colour, from the background rectangles."""
    backgrounds = [["default"] * width for _ in range(height)]
    for rect in root.iter(f"{SVG_NS}rect"):
        if rect.get("shape-rendering") != "crispEdges":
            continue  # the window's chrome and the clip paths
        row = round((float(rect.get("y", "0")) - BACKGROUND_TOP_PX) / CELL_HEIGHT_PX)
        first = round(float(rect.get("x", "0")) / CELL_WIDTH_PX)
        cells = round(float(rect.get("width", "0")) / CELL_WIDTH_PX)
        if 0 <= row < height:
            for col in range(max(0, first), min(width, first + cells)):
                backgrounds[row][col] = rect.get("fill", "default")
    return backgrounds


def _characters(
    root: ET.Element, css: dict[str, str], width: int, height: int
) -> tuple[list[list[str]], list[list[str]]]:
    """Each cell's character and its foreground style ("" for a blank), from the text runs."""
    chars = [[" "] * width for _ in range(height)]
    foregrounds = [[""] * width for _ in range(height)]
    for element in root.iter(f"{SVG_NS}text"):
        clip = LINE_CLIP.search(element.get("clip-path", ""))
        if clip is None:
            continue  # the window's title
        row = int(clip.group(1))
        col = round(float(element.get("x", "0")) / CELL_WIDTH_PX)
        style = css.get(element.get("class", ""), "?")
        for char in (element.text or "").replace("\xa0", " "):
            if char == "\n" or not 0 <= row < height or col >= width:
                break
            chars[row][col] = char
            foregrounds[row][col] = "" if char == " " else style
            for extra in range(1, cell_len(char)):  # a wide character: the next cell is its right half
                if col + extra < width:
                    chars[row][col + extra] = ""
            col += max(1, cell_len(char))
    return chars, foregrounds


def _sections(rendered: str, height: int) -> tuple[list[str], list[str], list[str]]:
    lines = rendered.splitlines()
    text = lines[3 : 3 + height]
    styles = lines[4 + height : 4 + 2 * height]
    legend = lines[5 + 2 * height :]
    return text, styles, legend


def _style_changes(old: list[str], new: list[str], old_legend: list[str], new_legend: list[str]) -> list[str]:
    """Where the style letters differ: ``row 12, columns 3-9: a -> c`` (with the legend's words)."""

    def meaning(legend: list[str], letter: str) -> str:
        return next((line[3:] for line in legend if line.startswith(letter + "  ")), "?")

    out = []
    for row, (a, b) in enumerate(zip(old, new, strict=False)):
        col = 0
        while col < max(len(a), len(b)):
            x, y = a[col : col + 1], b[col : col + 1]
            if meaning(old_legend, x) == meaning(new_legend, y):
                col += 1
                continue
            end = col
            while end < max(len(a), len(b)) and (a[end : end + 1], b[end : end + 1]) == (x, y):
                end += 1
            out.append(f"row {row}, columns {col}-{end - 1}: {meaning(old_legend, x)} -> {meaning(new_legend, y)}")
            col = end
    return out


def compare(picture: Picture, name: str, *, svg: str = "", failures: Path | None = None) -> None:
    """Check ``picture`` against ``tests/snapshots/<name>.txt`` (or write it, with ``TRACKSIDE_UPDATE_SNAPSHOTS=1``).

    On a mismatch the test fails with a diff (and no traceback); the new picture and the SVG it was read from are
    written to ``failures`` to look at."""
    path = SNAPSHOT_DIR / f"{name}.txt"
    rendered = picture.render(name)
    if os.environ.get(UPDATE_ENV, "") not in ("", "0"):
        SNAPSHOT_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"no snapshot {path}: look at the screen, then write it with {UPDATE_COMMAND}", pytrace=False)
    expected = path.read_text(encoding="utf-8")
    if expected == rendered:
        return
    where = ""
    if failures is not None:
        failures.mkdir(parents=True, exist_ok=True)
        (failures / f"{name}.txt").write_text(rendered, encoding="utf-8")
        if svg:
            (failures / f"{name}.svg").write_text(svg, encoding="utf-8")
        where = f"; the new picture is in {failures}"
    old_text, old_styles, old_legend = _sections(expected, picture.height)
    if old_text != list(picture.text) or len(old_styles) != picture.height:
        diff = list(
            difflib.unified_diff(old_text, list(picture.text), f"{name} (snapshot)", f"{name} (now)", lineterm="")
        )
        what = "text"
    else:
        diff = _style_changes(old_styles, list(picture.styles), old_legend, list(picture.legend))
        what = "styles (the text is the same)"
    if not diff:
        diff = ["(the snapshot file's header or legend differs)"]
    if len(diff) > MAX_DIFF_LINES:
        diff = [*diff[:MAX_DIFF_LINES], f"... {len(diff) - MAX_DIFF_LINES} more lines"]
    pytest.fail(
        f"snapshot {name}: the {what} changed{where}\n" + "\n".join(diff) + f"\nif this is intended: {UPDATE_COMMAND}",
        pytrace=False,
    )
