"""A what-if run for the console: the window copied out of the console's store, ``trackside whatif`` in a child.

The console imports no engine (an import-linter contract), so the what-if runs as a child process,
``python -m agent.cli whatif ...`` (:data:`WHATIF_COMMAND`; the app can be given another, as the tests do). DuckDB
lets one process open a file for writing and then no other process may open it, and the console's recorder holds
its file: :class:`WhatIfJob` first copies the node's window into a store of its own in a temporary folder
(:func:`store.snapshot.copy_window`, from a worker thread), then runs the child on that copy and reads its progress
lines from stderr as they come (:mod:`console.model.whatif` parses them and the result). The child runs in a session
of its own (a terminal's Ctrl+C reaches only the console) and, on Linux, gets SIGTERM from the kernel if the console
dies; :meth:`WhatIfJob.kill` kills it (Cancel, leaving the screen, quitting), :meth:`WhatIfJob.remove` removes the
folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import duckdb

from console.model.whatif import Progress, WhatIfResult, Window, child_args, error_line, parse_progress, parse_result
from store.snapshot import copy_window

WHATIF_COMMAND: Final = (sys.executable, "-m", "agent.cli", "whatif")
"""The child's command, before its arguments (:func:`console.model.whatif.child_args`)."""
MAX_LINE_BYTES: Final = 1 << 20
"""The longest stderr line read (a longer one ends the run as an error)."""


class WhatIfError(Exception):
    """The what-if did not give a result: the child's one error line, or why it could not run (one line)."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: have the kernel send SIGTERM to this child when the console dies (as the demo's agents do)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class WhatIfJob:
    """One what-if: its temporary folder (the window's copy, the result file), its child and what it said."""

    def __init__(
        self, command: Sequence[str], node_id: str, window: Window, candidates: Sequence[str]
    ) -> None:
        self.command = tuple(command)
        self.node_id = node_id
        self.window = window
        self.candidates = tuple(candidates)
        self.folder = Path(tempfile.mkdtemp(prefix="trackside-whatif-"))
        """Removed by :meth:`remove`."""
        self.store_path = self.folder / "window.duckdb"
        self.json_path = self.folder / "result.json"
        self.proc: asyncio.subprocess.Process | None = None
        self.cancelled = False
        """:meth:`kill` was called: no result is expected."""
        self.warnings: list[str] = []
        """The child's stderr lines that were not progress (its warnings; on a failure, its error last)."""

    def argv(self) -> list[str]:
        args = child_args(
            db=str(self.store_path),
            node_id=self.node_id,
            window=self.window,
            candidates=self.candidates,
            json_path=str(self.json_path),
        )
        return [*self.command, *args]

    def copy(self, con: duckdb.DuckDBPyConnection) -> int:
        """Copy the node's window out of the store ``con`` is connected to (rows copied). Call it in a thread."""
        return copy_window(con, self.store_path, node_id=self.node_id, start_ns=self.window.start_ns)

    async def run(self, on_progress: Callable[[Progress], object]) -> WhatIfResult | None:
        """Run the child on the copy, handing each progress line to ``on_progress``; its result, or None when
        cancelled. Raises :class:`WhatIfError` with the child's error line when it fails."""
        if self.cancelled:
            return None
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                limit=MAX_LINE_BYTES,
            )
        except OSError as exc:
            raise WhatIfError(f"cannot start {' '.join(self.command)}: {exc.strerror or exc}") from None
        self.proc = proc
        lines: deque[str] = deque(maxlen=200)
        assert proc.stderr is not None
        try:
            async for raw in proc.stderr:
                line = raw.decode(errors="replace").rstrip("\r\n")
                progress = parse_progress(line)
                if progress is not None:
                    on_progress(progress)
                elif line.strip():
                    lines.append(line)
        except ValueError:  # a line over MAX_LINE_BYTES
            self.kill()
            raise WhatIfError("trackside whatif wrote a line too long to read") from None
        returncode = await proc.wait()
        self.warnings = list(lines)
        if self.cancelled:
            return None
        if returncode != 0:
            raise WhatIfError(error_line(list(lines), returncode))
        return await asyncio.to_thread(self._read_result)

    def _read_result(self) -> WhatIfResult:
        try:
            data = json.loads(self.json_path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise WhatIfError(f"trackside whatif wrote no result: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise WhatIfError(f"trackside whatif's result is not JSON: {exc}") from None
        try:
            return parse_result(data)
        except ValueError as exc:
            raise WhatIfError(f"trackside whatif's result is not as expected: {exc}") from None

    @property
    def running(self) -> bool:
        """The child has started and not exited."""
        return self.proc is not None and self.proc.returncode is None

    def kill(self) -> None:
        """Kill the child (and anything it started in its session) now; no result is expected after this."""
        self.cancelled = True
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only the child and what it started

    def remove(self) -> None:
        """Remove the temporary folder (the window's copy and the result)."""
        shutil.rmtree(self.folder, ignore_errors=True)
