"""Small modal dialogs: a yes/no confirmation (``ModalScreen[bool]``) and a one-line prompt (``ModalScreen[str |
None]``). Both are dismissed with their answer; the screen that pushed them acts on it in its callback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static


class ConfirmScreen(ModalScreen[bool]):
    """Asks whether to go ahead with what ``lines`` describe; ``y`` (or the button) says yes, ``n`` or escape no.
    The cancel button has the focus, so a stray enter never confirms."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes", id="confirm.yes", tooltip="Go ahead"),
        Binding("n,escape", "answer(False)", "No", id="confirm.no", tooltip="Cancel: nothing is sent"),
    ]

    def __init__(self, title: str, lines: Sequence[str], *, yes: str = "Apply", warning: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.lines = tuple(lines)
        """What would happen, one line each (a dry run's diff)."""
        self.yes_label = yes
        self.warning = warning

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="dialog"):
            yield Static(self.title_text, classes="pane-title")
            with VerticalScroll(id="confirm-scroll"):
                yield Static("\n".join(self.lines), id="confirm-lines", markup=False)
            if self.warning:
                yield Static(self.warning, id="confirm-warning", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes_label} (y)", variant="warning", id="confirm-yes")
                yield Button("Cancel (n)", id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-no", Button).focus()

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm-yes")


class PromptScreen(ModalScreen[str | None]):
    """Asks for one line of text (a file path); enter answers it, escape cancels (None)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="prompt.cancel", tooltip="Close without an answer"),
    ]

    def __init__(self, title: str, *, value: str = "", hint: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.value = value
        self.hint = hint

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt-box", classes="dialog"):
            yield Static(self.title_text, classes="pane-title")
            yield Input(self.value, id="prompt-input")
            if self.hint:
                yield Static(self.hint, id="prompt-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
