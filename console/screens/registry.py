"""The console's eight screens, declared once: the app builds its modes, titles, screen keys and palette entries
from :data:`SCREENS`.

Each screen is a mode (``App.MODES``) named by :attr:`ScreenSpec.name`; its key switches to it, under the stable
binding id ``console.<name>`` (``--key console.heatmap=h`` remaps it); the command palette offers it by its
title, with the key's tooltip as help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from textual.binding import Binding

from console.screens.base import StateScreen
from console.screens.heatmap import HeatmapScreen
from console.screens.overview import OverviewScreen
from console.screens.policies import PoliciesScreen
from console.screens.slack import SlackScreen
from console.screens.sql import SqlScreen
from console.screens.stages import StagesScreen
from console.screens.steps import StepsScreen
from console.screens.whatif import WhatIfScreen


@dataclass(frozen=True, slots=True)
class ScreenSpec:
    """One screen of the console, as the app, its keys, the help screen and the command palette name it."""

    name: str
    """The mode's name (``App.MODES``, ``show_mode('<name>')``)."""
    title: str
    """What the header, the footer's key and the palette call it."""
    key: str
    """The key that switches to it (remappable by :attr:`binding_id`)."""
    tooltip: str
    """What the screen shows: the key's tooltip (the help screen) and the palette entry's help."""
    screen: type[StateScreen]
    """The screen's class (the mode makes one when first shown)."""

    @property
    def binding_id(self) -> str:
        """The key's stable id, ``console.<name>``."""
        return f"console.{self.name}"

    @property
    def action(self) -> str:
        """The app's action that shows the screen."""
        return f"show_mode({self.name!r})"


SCREENS: Final[tuple[ScreenSpec, ...]] = (
    ScreenSpec(
        "overview",
        "Overview",
        "1",
        "Nodes and units: state, policy, throughput, goodput, SLO attainment, TTFT/TPOT, alerts",
        OverviewScreen,
    ),
    ScreenSpec(
        "heatmap",
        "Heatmap",
        "2",
        "One metric of every unit over time, with a cursor and policy-change markers",
        HeatmapScreen,
    ),
    ScreenSpec(
        "steps",
        "Steps",
        "3",
        "A unit's recent steps: prefill/decode tokens, mode, predicted vs measured time, budget, reasons",
        StepsScreen,
    ),
    ScreenSpec(
        "slack",
        "Slack",
        "4",
        "A unit's slack over its running requests, the nearest to a miss, one request's envelope",
        SlackScreen,
    ),
    ScreenSpec(
        "stages",
        "Stages",
        "5",
        "Length stages of a staged dispatcher: lengths, boundaries over time, stage load, migrations",
        StagesScreen,
    ),
    ScreenSpec(
        "policies",
        "Policies",
        "6",
        "Policies of units and dispatchers: edit with a dry run, pause/drain/resume, the audit log",
        PoliciesScreen,
    ),
    ScreenSpec(
        "sql",
        "SQL",
        "7",
        "Read-only SQL on the console's DuckDB (the replay or its own recording); export to CSV/Parquet",
        SqlScreen,
    ),
    ScreenSpec(
        "whatif",
        "What-if",
        "8",
        "A window of a node's history replayed under other batch policies: ranked, with fidelity; apply the best",
        WhatIfScreen,
    ),
)
"""The screens in the order of their keys; the first is the console's default mode."""

SCREEN_KEYS: Final = Binding.Group("screens", compact=True)
"""The eight screen keys share one footer entry (``12345678 screens``; the current one dimmed), so the footer fits
80 columns; the help screen and the command palette still name each screen."""

SCREEN_BINDINGS: Final[list[Binding]] = [
    Binding(spec.key, spec.action, spec.title, id=spec.binding_id, group=SCREEN_KEYS, tooltip=spec.tooltip)
    for spec in SCREENS
]
"""One key per screen, by id (remappable with ``--key console.sql=s``)."""
