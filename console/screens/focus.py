"""Keys that never trap: ``escape`` leaves whatever editor or input has the focus, so the console's single-key
bindings (the screen keys ``1``-``8``, ``q``, ``?``, the replay's keys) work again.

A widget that takes text (a :class:`~textual.widgets.TextArea` such as the SQL editor, an
:class:`~textual.widgets.Input`) consumes the printable keys while it has the focus, and Textual then leaves those
keys out of the footer. :data:`LEAVE_INPUT_BINDING` is an app binding that is shown (``esc Leave editor``) exactly
while such a widget has the focus (the app's ``check_action`` asks :func:`takes_text`), so the footer says how to get
out; :func:`leave_input` moves the focus to the screen's first widget that takes no text (none: nothing focused),
so ``tab`` or a click goes back in. Modal dialogs (the policy edit form, the export prompt) keep their own
``escape``, which closes them: the app's bindings do not reach past a modal screen.
"""

from __future__ import annotations

from typing import Any, Final

from textual.binding import Binding
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Input, TextArea

LEAVE_INPUT_BINDING: Final = Binding(
    "escape",
    "leave_input",
    "Leave editor",
    id="console.leave_input",
    tooltip="Move the focus out of the editor or input, so the screen keys (1-8, q, ?) work again; tab goes back",
)
"""Shown in the footer only while an editor or input has the focus (remappable: ``--key console.leave_input=...``)."""


def takes_text(widget: Widget | None) -> bool:
    """Whether ``widget`` (the focused one) consumes the printable keys: an editable editor or an input."""
    if isinstance(widget, TextArea):
        return not widget.read_only
    return isinstance(widget, Input)


def leave_input(screen: Screen[Any]) -> bool:
    """Move ``screen``'s focus out of the editor or input that has it, to its first focusable widget that takes no
    text (None: no widget focused); whether the focus moved."""
    if not takes_text(screen.focused):
        return False
    screen.set_focus(next((w for w in screen.focus_chain if not takes_text(w)), None))
    return True
