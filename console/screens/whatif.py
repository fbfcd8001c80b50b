"""What-if: a window of one node's history replayed in the simulator under other batch policies, ranked, with how
faithful the replay is, and the recommendation applied through the Policies screen.

Flow (STYLE examples 8-10): ``r`` starts one async worker that copies the node's window out of the console's store in
a thread (:class:`console.whatif.WhatIfJob`; DuckDB never runs on the UI thread) and then runs ``trackside whatif``
as a child on the copy; the worker posts :class:`WhatIfScreen.WindowCopied`, a :class:`WhatIfScreen.Progressed` per
progress line of the child and :class:`WhatIfScreen.Finished`, whose handlers draw. ``c`` kills the child; quitting
the console kills it too (another screen meanwhile does not), and the temporary folder goes with the run. ``a`` posts
:class:`WhatIfScreen.ApplyRequested`: the app switches to the Policies screen, which sends the recommendation as an
edit would go (a dry run, the confirmation with the agent's diff, the change). Apply is greyed out, and the line
under the recommendation says why, with ``--read-only``, in a replay, without a token, for a node not connected,
and for a recommendation to keep the running policy.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol, runtime_checkable

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Header, Input, ProgressBar, SelectionList, Static
from textual.widgets.selection_list import Selection

from console.model.policy_view import PolicyChange, control_refusal
from console.model.records import Connection, NodeInfo
from console.model.render import cycled
from console.model.state import ConsoleState
from console.model.whatif import (
    DEFAULT_WINDOW,
    Progress,
    Schemas,
    WhatIfResult,
    fidelity_text,
    parse_window,
    recommendation_text,
    recommended_change,
    result_rows,
    warning_text,
)
from console.screens.base import StateScreen
from console.sql import Database
from console.whatif import WhatIfJob
from console.widgets.whatif_table import WhatIfTable

WINDOW_HELP = "window: a length (10m, 90s, 1h30m) or clock times (07:55-08:00)"
IDLE = "r runs the window under each checked candidate (trackside whatif, in a child process)"


@runtime_checkable
class WhatIfHost(Protocol):
    """What the screen needs of the app: the store to copy the window from (None: none), the child's command, and
    whether control is allowed (for apply)."""

    database: Database | None
    whatif_command: tuple[str, ...]
    read_only: bool
    token: str


class WhatIfScreen(StateScreen):
    """The node and the window, the candidates, the run's progress, the ranked runs, fidelity, the recommendation."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "r",
            "run",
            "Run",
            id="whatif.run",
            tooltip="Copy the node's window out of the store and replay it under each checked candidate (a child)",
        ),
        Binding("c", "cancel", "Cancel", id="whatif.cancel", tooltip="Stop the running what-if (kill its child)"),
        Binding(
            "a",
            "apply",
            "Apply",
            id="whatif.apply",
            tooltip="Send the recommendation through the Policies screen: dry run, confirm, apply",
        ),
        Binding("n", "cycle_node(1)", "Next node", id="whatif.next_node", tooltip="The what-if of the next node"),
        Binding(
            "N",
            "cycle_node(-1)",
            "Previous node",
            show=False,
            id="whatif.previous_node",
            tooltip="The what-if of the previous node",
        ),
        Binding(
            "w",
            "edit_window",
            "Window",
            show=False,
            id="whatif.window",
            tooltip="Edit the window (a length before now or the replay's cursor, or clock times); enter sets it",
        ),
    ]

    @dataclass
    class WindowCopied(Message):
        """The window is in the job's own store file; the child starts."""

        job: WhatIfJob
        rows: int

    @dataclass
    class Progressed(Message):
        """The child finished another run."""

        job: WhatIfJob
        progress: Progress

    @dataclass
    class Finished(Message):
        """The job ended: its result, or the one line saying why not ("" and no result: cancelled)."""

        job: WhatIfJob
        result: WhatIfResult | None
        error: str = ""

    @dataclass
    class ApplyRequested(Message):
        """Apply the recommendation: the app sends ``change`` through the Policies screen's dry run and confirm."""

        change: PolicyChange

    def __init__(self) -> None:
        super().__init__()
        self._state: ConsoleState | None = None
        self.node_id: str | None = None
        """The node shown (None: the first one, once there is one)."""
        self.job: WhatIfJob | None = None
        """The what-if under way (None: none)."""
        self.result: WhatIfResult | None = None
        """The last finished what-if's result (None: none yet, or the node changed)."""
        self.result_node: str | None = None
        """The node of :attr:`result`."""
        self.error = ""
        """The last run's error line ("" when it did not fail)."""
        self.progress: Progress | None = None
        """The child's last progress line of the current or last run."""
        self._listed: tuple[str | None, tuple[str, ...]] = (None, ())
        self._allowed: tuple[bool, ...] = ()
        self._shown: dict[str, tuple[str, tuple[tuple[str, bool], ...]]] = {}
        self._idle = True
        """Nothing has run on this node yet: the status line says what ``r`` does, or why it cannot."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="whatif-heading", classes="pane-title", markup=False)
        with Horizontal(id="whatif-setup"):
            with Vertical(id="whatif-window-pane"):
                yield Static(WINDOW_HELP, classes="whatif-label", markup=False)
                yield Input(DEFAULT_WINDOW, id="whatif-window", select_on_focus=False)
                yield Static(id="whatif-window-text", markup=False)
            with Vertical(id="whatif-candidates-pane"):
                yield Static("candidates (space toggles)", classes="whatif-label", markup=False)
                yield SelectionList[str](id="whatif-candidates")
        with Horizontal(id="whatif-progress-row"):
            yield ProgressBar(total=1, show_eta=False, id="whatif-progress")
            yield Static(IDLE, id="whatif-status", markup=False)
        yield WhatIfTable(id="whatif-table")
        yield Static(id="whatif-fidelity", markup=False)
        yield Static(id="whatif-warnings", markup=False)
        yield Static(id="whatif-recommendation", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        for hidden in ("#whatif-progress", "#whatif-fidelity", "#whatif-warnings", "#whatif-recommendation"):
            self.query_one(hidden).display = False  # until there is something to show
        self.query_one(SelectionList).focus()

    def on_unmount(self) -> None:
        """Leaving the screen for good (quitting the console): the child is killed, its folder removed."""
        job, self.job = self.job, None
        if job is not None:
            job.kill()
            job.remove()

    # -- drawing ------------------------------------------------------------------------------------------------
    def show_state(self, state: ConsoleState) -> None:
        self._state = state
        if not self.query("#whatif-recommendation"):  # its widgets are still being mounted: draw after
            self.call_after_refresh(self.show_state, state)
            return
        if self.node_id not in state.nodes:
            self.node_id = next(iter(state.nodes), None)
        self.redraw()

    def redraw(self) -> None:
        """The heading, the candidates, the window and the apply line from the last state shown; the footer when
        what can run changed."""
        node = self.node
        self._show("#whatif-heading", self._heading(node))
        self._list_candidates(node)
        self._show_window()
        self._show_recommendation()
        if self._idle:
            refusal = self.run_refusal()
            self._show("#whatif-status", IDLE if refusal is None else f"cannot run: {refusal}", error=False)
        self._update_bindings()

    @property
    def node(self) -> NodeInfo | None:
        state = self._state
        return state.nodes.get(self.node_id) if state is not None and self.node_id is not None else None

    def _heading(self, node: NodeInfo | None) -> str:
        state = self._state
        if node is None or state is None:
            return "What-if · no nodes yet"
        nodes = list(state.nodes)
        running = Counter(unit.batch_policy or "?" for unit in node.units.values())
        policies = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in running.items()) or "?"
        units = f"{len(node.units)} unit{'s' if len(node.units) != 1 else ''}"
        where = f"{node.node_id} ({nodes.index(node.node_id) + 1}/{len(nodes)})"
        parts = [f"What-if: {where}", f"batch {policies}", f"dispatch {node.dispatch_policy or '?'}", units]
        return " · ".join([*parts, node.profile or "?"])

    def _list_candidates(self, node: NodeInfo | None) -> None:
        """Every batch policy the node's hello lists, all checked, whenever the node (or its list) changes."""
        names = tuple(schema.name for schema in node.batch_policies) if node is not None else ()
        listed = (None if node is None else node.node_id, names)
        if listed == self._listed:
            return
        self._listed = listed
        candidates = self.query_one(SelectionList)
        candidates.clear_options()
        candidates.add_options([Selection(name, name, True) for name in names])

    def checked_candidates(self) -> list[str]:
        """The candidates checked, in the node's order."""
        checked = set(self.query_one(SelectionList).selected)
        return [name for name in self._listed[1] if name in checked]

    def _anchor(self) -> tuple[int, bool]:
        """The window's end (now, or the replay's cursor: the state's time) and whether it is a replay."""
        state, node = self._state, self.node
        replay = state is not None and node is not None and state.node_connection(node) == Connection.REPLAY
        return (state.now_ns if state is not None else 0), replay

    def _show_window(self) -> None:
        end_ns, replay = self._anchor()
        text = self.query_one("#whatif-window", Input).value
        if end_ns <= 0:
            line, error = "no events yet", False
        else:
            try:
                window = parse_window(text, end_ns)
            except ValueError as exc:
                line, error = str(exc), True
            else:
                before = "the replay's cursor" if replay else "now"
                line, error = f"{window.describe()}, up to {before}", False
        self._show("#whatif-window-text", line, error=error)

    def _show_recommendation(self) -> None:
        result = self.result
        if result is None:
            self._show("#whatif-recommendation", "", refused=False)
            return
        refusal = self.apply_refusal()
        apply = f"apply: refused: {refusal}" if refusal else "a applies it on every unit: dry run, confirm (Policies)"
        text = recommendation_text(result.recommendation, self._schemas())
        self._show("#whatif-recommendation", f"recommendation: {text}\n{apply}", refused=refusal is not None)

    def _show(self, selector: str, text: str, **classes: bool) -> None:
        """Update a line when its text or classes (``refused=True``: ``-refused``) changed, not at every refresh."""
        shown = (text, tuple(sorted(classes.items())))
        if self._shown.get(selector) == shown:
            return
        self._shown[selector] = shown
        widget = self.query_one(selector, Static)
        widget.update(text)
        widget.display = bool(text)  # an empty line takes no row
        for name, on in classes.items():
            widget.set_class(on, f"-{name}")

    def _schemas(self) -> Schemas:
        """The policies of the result's node (its notable parameters are those off their defaults)."""
        state = self._state
        node = state.nodes.get(self.result_node) if state is not None and self.result_node else None
        return Schemas.of(node)

    def _status(self, text: str, *, error: bool = False) -> None:
        self._idle = False
        self._show("#whatif-status", text, error=error)

    def _update_bindings(self) -> None:
        allowed = tuple(self.check_action(action, ()) is True for action in ("run", "cancel", "apply", "cycle_node"))
        if allowed != self._allowed:
            self._allowed = allowed
            self.refresh_bindings()

    # -- what can run -------------------------------------------------------------------------------------------
    def _host(self) -> WhatIfHost | None:
        app = self.app
        return app if isinstance(app, WhatIfHost) else None

    def run_refusal(self) -> str | None:
        """Why a what-if cannot start now (None: it can)."""
        host = self._host()
        if self.job is not None:
            return "a what-if is running (c cancels it)"
        if self.node is None:
            return "no nodes yet"
        if host is None or host.database is None:
            return "no history: a live console with --no-record keeps none to replay"
        if self._listed[1] and not self.checked_candidates():
            return "check at least one candidate"
        if self._anchor()[0] <= 0:
            return "no events yet"
        return None

    def apply_refusal(self) -> str | None:
        """Why the recommendation cannot be applied now (None: it can): no result, control refused (read-only, a
        replay, no token, the node not connected), or nothing to apply (keep)."""
        state, result, host = self._state, self.result, self._host()
        if result is None or state is None or self.result_node is None:
            return "run a what-if first"
        if self.job is not None:
            return "a what-if is running"
        node = state.nodes.get(self.result_node)
        if node is None:
            return f"{self.result_node} is not in the console"
        read_only = host.read_only if host is not None else True
        token = host.token if host is not None else ""
        refusal = control_refusal(read_only=read_only, token=token, connection=state.node_connection(node))
        if refusal is not None:
            return refusal
        try:
            recommended_change(result.recommendation, node)
        except ValueError as exc:
            return str(exc)
        return None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Run is greyed out when it cannot start, Apply when it is refused; Cancel is shown only while a what-if
        runs; the node keys are greyed out with one node and while a what-if runs."""
        if action == "run":
            return True if self.run_refusal() is None else None
        if action == "cancel":
            return self.job is not None
        if action == "apply":
            return True if self.apply_refusal() is None else None
        if action == "cycle_node":
            state = self._state
            return None if state is None or len(state.nodes) < 2 or self.job is not None else True
        return True

    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: the same actions as the keys, when they can run."""
        if self.check_action("run", ()) is True:
            yield SystemCommand(
                "What-if: run", "Replay the window under the checked candidates (key r)", self.action_run
            )
        if self.check_action("cancel", ()) is True:
            yield SystemCommand("What-if: cancel", "Stop the running what-if (key c)", self.action_cancel)
        if self.check_action("apply", ()) is True:
            yield SystemCommand(
                "What-if: apply", "The recommendation through the Policies screen (key a)", self.action_apply
            )
        if self.check_action("cycle_node", ()) is True:
            yield SystemCommand(
                "What-if: next node", "The what-if of the next node (key n)", partial(self.action_cycle_node, 1)
            )

    # -- actions ------------------------------------------------------------------------------------------------
    def action_cycle_node(self, step: int) -> None:
        """Show the node ``step`` places on (wrapping); the last result is forgotten."""
        state = self._state
        if state is None or not state.nodes or self.job is not None:
            return
        node_id = cycled(list(state.nodes), self.node_id, step)
        if node_id != self.node_id:
            self.node_id = node_id
            self._forget_result()
            self._idle = True
        self.redraw()

    def action_edit_window(self) -> None:
        self.query_one("#whatif-window", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self._show_window()
        self._update_bindings()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter sets the window: the focus goes back to the candidates, so the single keys work again."""
        event.stop()
        self._show_window()
        self.query_one(SelectionList).focus()

    def on_selection_list_selected_changed(self, event: SelectionList.SelectedChanged[str]) -> None:
        self._update_bindings()

    def action_run(self) -> None:
        refusal = self.run_refusal()
        host, node = self._host(), self.node
        if refusal is not None or host is None or host.database is None or node is None:
            self._status(f"not run: {refusal or 'nothing to run'}", error=True)
            return
        end_ns, _ = self._anchor()
        try:
            window = parse_window(self.query_one("#whatif-window", Input).value, end_ns)
        except ValueError as exc:
            self._status(f"not run: {exc}", error=True)
            return
        job = WhatIfJob(host.whatif_command, node.node_id, window, self.checked_candidates())
        self.job = job
        self._forget_result()
        bar = self.query_one("#whatif-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self._status(f"copying {node.node_id}'s window {window.describe()} out of the store ...")
        self.run_worker(self._work(job, host.database), name="whatif", group="whatif", exit_on_error=False)
        self.redraw()

    async def _work(self, job: WhatIfJob, database: Database) -> None:
        """The worker: the copy in a thread, then the child; every outcome is a message (it touches no widget)."""
        try:
            rows = await asyncio.to_thread(lambda: job.copy(database.query_connection()))
            if not job.cancelled:
                self.post_message(self.WindowCopied(job, rows))
            result = await job.run(lambda progress: self.post_message(self.Progressed(job, progress)))
        except Exception as exc:  # the worker's boundary: every failure is shown in one line, none ends the console
            self.post_message(self.Finished(job, None, str(exc) or type(exc).__name__))
        else:
            self.post_message(self.Finished(job, result))
        finally:
            if job.running:  # the worker cancelled (the console quitting): no child is left behind
                job.kill()
            job.remove()

    def action_cancel(self) -> None:
        job = self.job
        if job is None:
            return
        job.kill()
        self._status("cancelling ...")

    def on_what_if_screen_window_copied(self, message: WindowCopied) -> None:
        if message.job is not self.job:
            return
        window = message.job.window.describe()
        self._status(f"running trackside whatif on {message.rows:,} rows of {message.job.node_id} ({window}) ...")

    def on_what_if_screen_progressed(self, message: Progressed) -> None:
        if message.job is not self.job:
            return
        progress = self.progress = message.progress
        self.query_one("#whatif-progress", ProgressBar).update(total=max(1, progress.total), progress=progress.done)
        self._status(f"{progress.done}/{progress.total} runs · {progress.label}")

    def on_what_if_screen_finished(self, message: Finished) -> None:
        job = message.job
        if job is not self.job:
            return
        self.job = None
        bar = self.query_one("#whatif-progress", ProgressBar)
        if message.result is not None:
            self.result, self.result_node, self.error = message.result, job.node_id, ""
            total = self.progress.total if self.progress is not None else len(message.result.runs)
            bar.update(total=max(1, total), progress=max(1, total))
            self._show_result(message.result, job)
        else:
            bar.update(total=1, progress=0)
            if job.cancelled and not message.error:
                self._status("cancelled: the what-if was stopped, its files removed")
            else:
                self.error = message.error or "trackside whatif gave no result"
                self._status(self.error, error=True)
        self.redraw()

    def _show_result(self, result: WhatIfResult, job: WhatIfJob) -> None:
        self.query_one(WhatIfTable).show_rows(result_rows(result, self._schemas()))
        text, poor = fidelity_text(result.fidelity)
        fidelity = self.query_one("#whatif-fidelity", Static)
        fidelity.update(text)
        fidelity.set_class(poor, "-poor")
        fidelity.display = True
        warnings = [warning_text(line) for line in job.warnings]
        shown = self.query_one("#whatif-warnings", Static)
        count = f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}"
        shown.update(f"{count}: {'; '.join(warnings)}" if warnings else "")
        shown.tooltip = "\n".join(warnings) or None
        shown.display = bool(warnings)
        requests = f"{result.requests:,} requests" if result.requests is not None else "the window"
        self._status(f"done: {len(result.runs)} runs of {requests} of {job.node_id}, ranked by effective req/s")

    def _forget_result(self) -> None:
        self.result = self.result_node = self.progress = None
        self.error = ""
        self.query_one(WhatIfTable).show_rows([])
        fidelity = self.query_one("#whatif-fidelity", Static)
        fidelity.update("")
        fidelity.set_class(False, "-poor")
        fidelity.display = False
        self.query_one("#whatif-warnings", Static).display = False

    def action_apply(self) -> None:
        refusal = self.apply_refusal()
        node = self._state.nodes.get(self.result_node) if self._state and self.result_node else None
        if refusal is not None or self.result is None or node is None:
            text = recommendation_text(self.result.recommendation, self._schemas()) if self.result else ""
            head = f"recommendation: {text}\n" if text else ""
            self._show("#whatif-recommendation", f"{head}apply: refused: {refusal or 'nothing to apply'}", refused=True)
            return
        self.post_message(self.ApplyRequested(recommended_change(self.result.recommendation, node)))
