"""The console's own themes, registered with Textual's theme API next to its built-in ones.

This is the one place colours are defined (as CSS colour names and ``hsl()``; STYLE example 11): the ``.tcss``
uses theme variables only (``$primary``, ``$error``, ...), so a theme recolours every screen. Pick one with
``--theme NAME`` or the command palette's "Theme" entry (``ctrl+p``), which lists these with Textual's own.
"""

from __future__ import annotations

from typing import Final

from textual.theme import BUILTIN_THEMES, Theme

TRACKSIDE_DARK: Final = Theme(
    name="trackside-dark",
    primary="steelblue",
    secondary="cadetblue",
    accent="darkorange",
    warning="gold",
    error="crimson",
    success="mediumseagreen",
    foreground="gainsboro",
    background="hsl(210, 25%, 7%)",
    surface="hsl(210, 22%, 11%)",
    panel="hsl(210, 20%, 16%)",
    dark=True,
)
"""Dark blue-grey, steel-blue accents; severities from green through gold to crimson."""

TRACKSIDE_LIGHT: Final = Theme(
    name="trackside-light",
    primary="royalblue",
    secondary="teal",
    accent="darkorange",
    warning="darkgoldenrod",
    error="firebrick",
    success="seagreen",
    foreground="hsl(210, 25%, 15%)",
    background="whitesmoke",
    surface="white",
    panel="gainsboro",
    dark=False,
)
"""Light grey paper, dark text; severities darker than the dark theme's, to read on white."""

THEMES: Final[tuple[Theme, ...]] = (TRACKSIDE_DARK, TRACKSIDE_LIGHT)
"""The console's themes, registered by the app at start."""


def theme_names() -> list[str]:
    """Every theme ``--theme`` accepts: the console's and Textual's built-in ones."""
    return sorted({*BUILTIN_THEMES, *(theme.name for theme in THEMES)})
