"""The help screen: every key binding active where it was opened, with its id (for remapping) and tooltip."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Static


@dataclass(frozen=True, slots=True)
class KeyHelp:
    """One binding as the help screen lists it."""

    key: str
    description: str
    binding_id: str
    tooltip: str
    enabled: bool


def key_help(screen: Screen[Any]) -> list[KeyHelp]:
    """The bindings active on ``screen`` (its focused widget's, its own, the app's), system bindings left out,
    sorted by id."""
    app = screen.app
    rows = {}
    for active in screen.active_bindings.values():
        binding = active.binding
        if binding.system:
            continue
        key = app.get_key_display(binding)
        ident = binding.id or binding.action
        rows[(ident, key)] = KeyHelp(key, binding.description or binding.action, ident, active.tooltip, active.enabled)
    return sorted(rows.values(), key=lambda k: (k.binding_id, k.key))


class HelpScreen(ModalScreen[None]):
    """Keys of the screen underneath; ``App.set_keymap`` takes the ids."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark,f1", "dismiss", "Close", id="help.close", tooltip="Close the help screen"),
    ]

    def __init__(self, keys: Sequence[KeyHelp], *, read_only: bool = False) -> None:
        super().__init__()
        self.keys = tuple(keys)
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Static("Keys (remap by id; ctrl+p opens the command palette)", classes="pane-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(help_text(self.keys), id="help-keys")
            mode = "read-only: control actions are refused" if self.read_only else "control: Policies screen (key 6)"
            yield Static(f"escape closes · {mode}", id="help-footer")

    def on_mount(self) -> None:
        self.query_one("#help-scroll").focus()


def help_text(keys: Sequence[KeyHelp]) -> Text:
    """Two lines per binding: key, what it does and its id; then its tooltip (dim when it cannot run now)."""
    text = Text()
    width = max((len(k.key) for k in keys), default=0) + 2
    for i, k in enumerate(keys):
        if i:
            text.append("\n")
        dim = "" if k.enabled else "dim"
        text.append(k.key.ljust(width), style=f"bold {dim}".strip())
        text.append(k.description, style=f"bold {dim}".strip())
        text.append(f"  {k.binding_id}", style="dim")
        if k.tooltip:
            text.append("\n" + " " * width + k.tooltip, style=dim)
    return text
