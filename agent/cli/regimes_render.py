"""Drawing a regime map (:mod:`agent.bench.regimes`): rich tables for the terminal and a PNG heatmap (Pillow).

Both show the same thing: one panel per burstiness value, rows the SLO pairs, columns the loads; each cell names
its winner and its margin over the runner-up, in the winner's colour (the same colours in both). In the PNG the
colour's strength grows with the margin: pale for a tie or a few percent, full from :data:`FULL_MARGIN` up.
"""

from __future__ import annotations

import io
import math

from rich.console import Group
from rich.table import Table
from rich.text import Text

from agent.bench.regimes import Burstiness, Cell, RegimeMap, burstiness_label

RGB = tuple[int, int, int]

COLOURS: dict[str, RGB] = {
    "vllm": (0, 114, 178), "sarathi": (230, 159, 0), "fairbatching": (0, 158, 115),
    "fairbatching+pab": (213, 94, 0), "eb": (204, 121, 167), "eb+": (86, 180, 233), "static": (120, 120, 120),
}
"""Each built-in batch policy's colour (Okabe-Ito, readable with the common colour blindnesses)."""
EXTRA_COLOURS: tuple[RGB, ...] = ((200, 180, 0), (0, 0, 0), (150, 60, 200), (120, 80, 40))
"""Other policies' (plugins), in the order the map lists them."""
SHORT_NAMES = {"fairbatching": "fb", "fairbatching+pab": "fb+pab"}
FULL_MARGIN = 0.5
"""A margin at which a PNG cell takes its winner's full colour."""
ANY_FILL: RGB = (236, 236, 236)
"""A PNG cell in which every policy did the same."""

# PNG layout, in pixels.
MARGIN = 16
TITLE_H = 30
PANEL_TITLE_H = 24
COL_HEADER_H = 36
ROW_LABEL_W = 84
CELL_W = 112
CELL_H = 40
PANEL_GAP = 28
LEGEND_ROW_H = 24
LEGEND_ITEM_W = 200
NOTE_H = 22
MIN_WIDTH = 640


def short_name(policy: str) -> str:
    return SHORT_NAMES.get(policy, policy if len(policy) <= 12 else policy[:11] + "~")


def colours(policies: tuple[str, ...]) -> dict[str, RGB]:
    extra = iter(EXTRA_COLOURS * (1 + len(policies) // len(EXTRA_COLOURS)))
    return {p: COLOURS[p] if p in COLOURS else next(extra) for p in policies}


def cell_label(cell: Cell) -> tuple[str, str]:
    """What a cell says: the winner and its margin; for a tie, the tied policies (``any`` when all of them)."""
    m = cell.margin
    if m is None:
        return short_name(cell.winner), ""
    if len(cell.tied) == len(cell.ranked):
        return "any", "all equal"
    if len(cell.tied) > 1:
        more = short_name(cell.tied[1]) if len(cell.tied) == 2 else f"{len(cell.tied) - 1} more"
        return f"{short_name(cell.winner)} = {more}", "tie"
    return short_name(cell.winner), "+inf" if math.isinf(m) else f"+{100 * m:.0f}%" if m >= 0.0995 else (
        f"+{100 * m:.1f}%")


def burstiness_title(b: Burstiness) -> str:
    return "the original arrivals" if b is None else f"gamma gaps, CV {b:g}"


def load_label(rps: float) -> str:
    return f"{rps:,.0f} req/s" if rps >= 100 else f"{rps:.3g} req/s"


def panels(rmap: RegimeMap) -> list[tuple[Burstiness, list[list[Cell]]]]:
    """Per burstiness value, its cells as rows (SLO pairs) of columns (loads)."""
    g = rmap.grid
    return [(b, [[rmap.cell(b, slo, ts) for ts in g.time_scales] for slo in g.slos]) for b in g.burstiness]


def hex_colour(rgb: RGB) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


# -- the terminal ----------------------------------------------------------------------------------------------
def legend_text(rmap: RegimeMap) -> Text:
    text = Text("policies: ")
    for p, rgb in colours(rmap.grid.policies).items():
        text.append("■ ", style=hex_colour(rgb))
        text.append(short_name(p) if short_name(p) == p else f"{short_name(p)} ({p})")
        text.append("  ")
    return text


def _cell_style(cell: Cell, rgb: RGB) -> str:
    """The winner's colour; bold from a 10% margin, dim for a close call or a tie, plain dim when all are equal."""
    if len(cell.ranked) > 1 and len(cell.tied) == len(cell.ranked):
        return "dim"
    m = cell.margin
    if m is None or len(cell.tied) > 1 or m < 0.02:
        return "dim " + hex_colour(rgb)
    return ("bold " if m >= 0.1 else "") + hex_colour(rgb)


def terminal_map(rmap: RegimeMap) -> Group:
    """One table per burstiness value, then the legend and how to read a cell."""
    palette = colours(rmap.grid.policies)
    tables: list[Table | Text] = []
    for b, rows in panels(rmap):
        table = Table(title=f"Burstiness: {burstiness_label(b)} ({burstiness_title(b)})", title_justify="left")
        table.add_column("TTFT/TPOT ms", justify="right")
        for ts in rmap.grid.time_scales:
            table.add_column(f"{load_label(rmap.offered_rps(ts))}\nx{ts:.3g}", justify="center")
        for slo, row in zip(rmap.grid.slos, rows, strict=True):
            cells = []
            for c in row:
                name, detail = cell_label(c)
                text = f"{name} ({detail})" if len(c.tied) > 1 else f"{name} {detail}".strip()
                cells.append(Text(text, style=_cell_style(c, palette[c.winner])))
            table.add_row(slo.label, *cells)
        tables.append(table)
    tables.append(legend_text(rmap))
    tables.append(Text(
        "A cell: the policy with the highest effective req/s (offered x SLO attainment) and its lead over the "
        "runner-up (bold: 10% or more, dim: under 2%); a tie: policies with the same, the first named has the higher "
        "goodput (then the lower TTFT p99); any: every policy the same.",
        style="dim",
    ))
    return Group(*tables)


# -- the PNG ---------------------------------------------------------------------------------------------------
def heatmap_size(num_panels: int, num_rows: int, num_cols: int, num_policies: int) -> tuple[int, int]:
    """The PNG's width and height for a map of this shape."""
    width = max(MIN_WIDTH, 2 * MARGIN + num_panels * (ROW_LABEL_W + num_cols * CELL_W) + (num_panels - 1) * PANEL_GAP)
    per_row = max(1, (width - 2 * MARGIN) // LEGEND_ITEM_W)
    legend_rows = -(-num_policies // per_row)
    height = (2 * MARGIN + TITLE_H + PANEL_TITLE_H + COL_HEADER_H + num_rows * CELL_H + MARGIN
              + legend_rows * LEGEND_ROW_H + NOTE_H)
    return width, height


def _blend(rgb: RGB, strength: float) -> RGB:
    r, g, b = (round(255 + (c - 255) * strength) for c in rgb)
    return r, g, b


def cell_fill(rgb: RGB, cell: Cell) -> RGB:
    """The winner's colour, paler the smaller its margin (a tie or a lone policy: palest; every policy tied: grey)."""
    m = cell.margin
    if len(cell.ranked) > 1 and len(cell.tied) == len(cell.ranked):
        return ANY_FILL
    if m is None or len(cell.tied) > 1:
        return _blend(rgb, 0.15)
    return _blend(rgb, 0.25 + 0.75 * min(m / FULL_MARGIN, 1.0))


def _ink(fill: RGB) -> RGB:
    luminance = (0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2]) / 255
    return (255, 255, 255) if luminance < 0.5 else (0, 0, 0)


def heatmap_png(rmap: RegimeMap) -> bytes:
    """The map as a PNG: a title, one panel per burstiness value, a legend and how to read it."""
    from PIL import Image, ImageDraw, ImageFont  # here: every `trackside` command would pay for it at start

    g = rmap.grid
    palette = colours(g.policies)
    width, height = heatmap_size(len(g.burstiness), len(g.slos), len(g.time_scales), len(g.policies))
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font, small, bold = (ImageFont.load_default(size=s) for s in (13, 11, 15))
    title = f"Winning batch policy: {rmap.workload}, {rmap.base.profile}, {rmap.base.units} units, {rmap.base.dispatch}"
    draw.text((MARGIN, MARGIN), title, fill=(0, 0, 0), font=bold)
    top = MARGIN + TITLE_H
    for k, (b, rows) in enumerate(panels(rmap)):
        left = MARGIN + k * (ROW_LABEL_W + len(g.time_scales) * CELL_W + PANEL_GAP)
        draw.text((left, top), f"burstiness {burstiness_label(b)}: {burstiness_title(b)}", fill=(0, 0, 0),
                  font=font)
        grid_top = top + PANEL_TITLE_H + COL_HEADER_H
        for j, ts in enumerate(g.time_scales):
            x = left + ROW_LABEL_W + j * CELL_W + CELL_W // 2
            draw.text((x, grid_top - 20), load_label(rmap.offered_rps(ts)), fill=(0, 0, 0), font=font, anchor="ms")
            draw.text((x, grid_top - 6), f"time scale {ts:.3g}", fill=(90, 90, 90), font=small, anchor="ms")
        draw.text((left, top + PANEL_TITLE_H + 2), "TTFT/TPOT ms", fill=(90, 90, 90), font=small)
        for i, (slo, row) in enumerate(zip(g.slos, rows, strict=True)):
            y = grid_top + i * CELL_H
            draw.text((left + ROW_LABEL_W - 8, y + CELL_H // 2), slo.label, fill=(0, 0, 0), font=font, anchor="rm")
            for j, c in enumerate(row):
                x = left + ROW_LABEL_W + j * CELL_W
                fill = cell_fill(palette[c.winner], c)
                draw.rectangle((x, y, x + CELL_W - 1, y + CELL_H - 1), fill=fill, outline=(255, 255, 255), width=2)
                ink = _ink(fill)
                name, detail = cell_label(c)
                draw.text((x + CELL_W // 2, y + CELL_H // 2 - 1), name, fill=ink, font=font, anchor="md")
                draw.text((x + CELL_W // 2, y + CELL_H // 2 + 2), detail, fill=ink, font=small, anchor="ma")
    y = top + PANEL_TITLE_H + COL_HEADER_H + len(g.slos) * CELL_H + MARGIN
    per_row = max(1, (width - 2 * MARGIN) // LEGEND_ITEM_W)
    for k, (p, rgb) in enumerate(palette.items()):
        x, yy = MARGIN + (k % per_row) * LEGEND_ITEM_W, y + (k // per_row) * LEGEND_ROW_H
        draw.rectangle((x, yy + 3, x + 14, yy + 17), fill=rgb)
        name = p if short_name(p) == p else f"{short_name(p)} = {p}"
        draw.text((x + 20, yy + 3), name, fill=(0, 0, 0), font=small)
    y += -(-len(palette) // per_row) * LEGEND_ROW_H
    draw.text((MARGIN, y + 4), f"cell: winner by effective req/s, its lead over the runner-up (strength: the lead, "
              f"full from +{100 * FULL_MARGIN:.0f}%); any: every policy equal", fill=(90, 90, 90), font=small)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()
