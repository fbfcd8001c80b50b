"""SQL: read-only queries on the console's DuckDB (the replayed file, or the console's own recording), results in
a table, a history, and export of the last query's rows to CSV or Parquet.

Queries and exports run in thread workers (STYLE example 8) and come back as :class:`SqlScreen.QueryFinished`
and :class:`SqlScreen.ExportFinished`; one runs at a time. Keys: ``ctrl+enter`` (or ``ctrl+j``, ``f5``) runs the
editor's query, ``ctrl+up`` / ``ctrl+down`` walk the history, ``ctrl+s`` exports. The editor has the focus when the
screen first opens and takes the single keys while it has it; ``escape`` leaves it for the results table (the app's
``console.leave_input``, which the footer shows meanwhile: :mod:`console.screens.focus`), and the console's
single-key bindings work again; ``tab`` or a click goes back in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Final, Protocol, runtime_checkable

from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static, TextArea

from console.model.state import ConsoleState
from console.screens.base import StateScreen
from console.screens.confirm import PromptScreen
from console.sql import (
    Database,
    ExportResult,
    QueryResult,
    SqlHistory,
    cell_text,
    export_query,
    fmt_seconds,
    run_query,
)

STARTER_QUERY: Final = (
    "SELECT node_id, unit_id, policy, count(*) AS steps,\n"
    "       round(avg(measured_ns) / 1e6, 2) AS mean_step_ms\n"
    "FROM steps GROUP BY ALL ORDER BY ALL"
)
TABLES_HINT: Final = (
    "tables: nodes steps requests request_events unit_loads stage_boundaries slack_samples audits alerts gaps"
)


@runtime_checkable
class SqlHost(Protocol):
    """What the screen needs of the app: the database its queries run on (None: there is none)."""

    database: Database | None


class SqlScreen(StateScreen):
    """An editor, a status line, the results."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding(
            "ctrl+enter,ctrl+j,f5",
            "run_query",
            "Run",
            id="sql.run",
            tooltip="Run the editor's query (one read-only statement) in a worker thread",
            priority=True,
        ),
        Binding(
            "ctrl+up",
            "history(-1)",
            "Older",
            id="sql.history_older",
            tooltip="Put the previous query of the history in the editor",
            priority=True,
        ),
        Binding(
            "ctrl+down",
            "history(1)",
            "Newer",
            id="sql.history_newer",
            tooltip="Put the next query of the history (or your draft) in the editor",
            priority=True,
        ),
        Binding(
            "ctrl+s",
            "export",
            "Export",
            id="sql.export",
            tooltip="Write the last query's rows to a .csv or .parquet file (asks for the path)",
            priority=True,
        ),
    ]

    @dataclass
    class QueryFinished(Message):
        """A query ended: its result, or DuckDB's (or the read-only check's) error."""

        result: QueryResult | None
        error: str = ""

    @dataclass
    class ExportFinished(Message):
        """An export ended: the file written, or why not."""

        result: ExportResult | None
        error: str = ""

    def __init__(self, history: SqlHistory | None = None) -> None:
        super().__init__()
        self.history = history or SqlHistory()
        self.running = False
        """A query or an export is under way."""
        self.last_result: QueryResult | None = None
        self.last_error = ""
        self.last_export: ExportResult | None = None
        self.export_path = "result.csv"
        """The path the export prompt proposes (the last one used)."""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="sql-source", classes="pane-title", markup=False)
        yield TextArea(STARTER_QUERY, id="sql-editor", soft_wrap=True, tab_behavior="focus")
        yield Static(TABLES_HINT, id="sql-status", markup=False)
        yield DataTable(id="sql-results", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()
        self._show_source()

    @property
    def database(self) -> Database | None:
        app = self.app
        return app.database if isinstance(app, SqlHost) else None

    def show_state(self, state: ConsoleState) -> None:
        if self.query("#sql-source"):  # not while the screen's widgets are still being mounted
            self._show_source()

    def _show_source(self) -> None:
        db = self.database
        text = db.description if db is not None else "no database: a live console with --no-record keeps none"
        written = getattr(db, "num_written", None)
        if isinstance(written, int):
            text += f" · {written:,} events written"
        self.query_one("#sql-source", Static).update(text)

    # -- actions ------------------------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Run and export are greyed out without a database and while one is under way; export also before a
        query succeeded; the history keys while there is no history."""
        if action in ("run_query", "export"):
            if self.database is None or self.running:
                return None
            return None if action == "export" and self.last_result is None else True
        if action == "history":
            return True if self.history.entries else None
        return True

    def system_commands(self) -> Iterator[SystemCommand]:
        """The command palette's entries for this screen: the same actions as the keys, when they can run."""
        if self.check_action("run_query", ()) is True:
            yield SystemCommand("SQL: run", "Run the editor's query (key ctrl+enter)", self.action_run_query)
        if self.check_action("export", ()) is True:
            yield SystemCommand(
                "SQL: export", "The last query's rows to CSV or Parquet (key ctrl+s)", self.action_export
            )

    def action_run_query(self) -> None:
        db = self.database
        if db is None or self.running:
            return
        text = self.query_one(TextArea).text
        self.history.add(text)
        self._busy(True, "running ...")

        def work() -> None:
            try:
                result = run_query(db.query_connection(), text)
            except Exception as exc:  # the worker's boundary: every failure is shown, none ends the console
                self.post_message(self.QueryFinished(None, str(exc) or type(exc).__name__))
            else:
                self.post_message(self.QueryFinished(result))

        self.run_worker(work, name="sql query", group="sql", thread=True, exit_on_error=False)

    def on_sql_screen_query_finished(self, message: QueryFinished) -> None:
        self._busy(False)
        status = self.query_one("#sql-status", Static)
        status.set_class(bool(message.error), "-error")
        if message.result is None:
            self.last_error = message.error
            status.update(f"error: {message.error}")
            return
        result = message.result
        self.last_result, self.last_error = result, ""
        status.update(result.summary())
        table = self.query_one("#sql-results", DataTable)
        table.clear(columns=True)
        table.add_columns(*result.columns)
        table.add_rows([tuple(cell_text(v) for v in row) for row in result.rows])
        self.refresh_bindings()

    def action_history(self, step: int) -> None:
        editor = self.query_one(TextArea)
        text = self.history.older(editor.text) if step < 0 else self.history.newer()
        if text is not None:
            editor.load_text(text)
            editor.move_cursor(editor.document.end)

    def action_export(self) -> None:
        if self.check_action("export", ()) is not True or self.last_result is None:
            return
        query = self.last_result.text
        hint = "a .csv or .parquet file; the last query runs again straight into it"

        def chosen(path: str | None) -> None:
            db = self.database
            if path is None or db is None:
                return
            self.export_path = path
            self._busy(True, f"exporting to {path} ...")

            def work() -> None:
                try:
                    result = export_query(db.query_connection(), query, path)
                except Exception as exc:  # the worker's boundary, as for a query
                    self.post_message(self.ExportFinished(None, str(exc) or type(exc).__name__))
                else:
                    self.post_message(self.ExportFinished(result))

            self.run_worker(work, name="sql export", group="sql", thread=True, exit_on_error=False)

        self.app.push_screen(PromptScreen("Export the last query's rows to", value=self.export_path, hint=hint), chosen)

    def on_sql_screen_export_finished(self, message: ExportFinished) -> None:
        self._busy(False)
        status = self.query_one("#sql-status", Static)
        status.set_class(message.result is None, "-error")
        if message.result is None:
            status.update(f"export failed: {message.error}")
            return
        self.last_export = result = message.result
        status.update(f"exported {result.num_rows:,} rows to {result.path} in {fmt_seconds(result.elapsed_s)}")

    def _busy(self, running: bool, text: str = "") -> None:
        self.running = running
        if text:
            status = self.query_one("#sql-status", Static)
            status.set_class(False, "-error")
            status.update(text)
        self.refresh_bindings()
