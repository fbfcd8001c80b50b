"""The console records what it shows (issue #6, item 9): the events of its live feeds go into its own DuckDB file.

:class:`ConsoleRecorder` is the store's recorder (:class:`store.recorder.Recorder`, the one ``trackside record``
uses) on a :class:`store.writer.StoreWriter` of the console's file: the feed workers hand every frame's events to
:meth:`~store.recorder.Recorder.record` (a queue put that never waits: the UI never waits for the database; beyond
``max_backlog`` events behind, frames are dropped and counted), its thread writes them in batches and commits at
least every ``flush_s`` seconds, and :meth:`ConsoleRecorder.close` writes the rest and commits before the file is
closed. What is stored is what the state model is given: each connection's hello, the stream's events (``seq`` > 0)
and its ``gap`` alerts (rows of ``gaps``: what the agent no longer buffered when the feed resumed); other
per-subscriber notices (flow control) are shown, not stored, as ``trackside record`` does.
Events the agent dropped for a console that fell behind are not fetched again (the console shows the present);
``trackside record`` does fetch them.

Resume: a live feed asks :meth:`~store.recorder.Recorder.resume_from` at its first hello, which is the store's last
committed position in that run of the node (``StoreWriter.last_seq``; 0 for a run the file has not seen: the
agent then sends everything it still buffers). A console restarted on the same file so continues where the last
one stopped, without duplicates and, while the agent's replay buffer reaches back that far, without a gap.

History: a :class:`RecordingFeed` with ``history_s`` shows, at the first hello of each node, what the file holds of
that node's last ``history_s`` seconds (:meth:`ConsoleRecorder.history`) before the live stream, so a restarted
console shows what it recorded before, not only what arrives from the resume point on.

DuckDB lets one process open a file for writing and then no other process may open it; in this process, the SQL
screen's queries run on a cursor of the writer's connection (:meth:`query_connection`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import duckdb

from agent.telemetry import Event, NodeHello
from console.feeds import Feed, FeedUpdate
from console.history import MAX_REBUILD_EVENTS, chunks_in_thread, rebuild_events, take
from store.recorder import MAX_BACKLOG, Recorder
from store.replay import time_span
from store.schema import StoreError, StoreLockedError
from store.writer import StoreWriter

HISTORY_CHUNK = 4096
"""Events per update of a node's recorded history."""
MEMORY_LIMIT = "512MB"
"""What DuckDB may keep in memory for the console's file (``store.schema.connect``): without a bound its cache of the
file grows with the file, to 80% of the machine, in a console left open for days. More than ``trackside record``'s
default (128MB), which is sized for a writer alone: the SQL screen's queries and each node's history run on this
connection too (their speed under either limit was not measured)."""


class RecordError(Exception):
    """The console cannot record to the file it was given (locked by another process, not a store, ...)."""


class ConsoleRecorder(Recorder):
    """Records the events the console receives to ``path``; also the SQL screen's database and each node's history."""

    def __init__(
        self,
        path: str | Path,
        *,
        flush_s: float = 1.0,
        max_backlog: int = MAX_BACKLOG,
        clock: Callable[[], float] = time.monotonic,
        memory_limit: str = MEMORY_LIMIT,
    ) -> None:
        if flush_s <= 0:  # before the file is opened
            raise ValueError("flush_s must be positive")
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._store = StoreWriter(self.path, memory_limit=memory_limit)
        except StoreLockedError as exc:
            holder = exc.holder or "another process"
            raise RecordError(
                f"cannot record to {self.path}: {holder} has it open, and DuckDB allows one writer per file"
            ) from None
        except (StoreError, OSError) as exc:
            raise RecordError(f"cannot record to {self.path}: {exc}") from None
        self._query_con = self._store.cursor()
        super().__init__(self._store, flush_s=flush_s, max_backlog=max_backlog, clock=clock,
                         name=f"recorder {self.path.name}")

    def history(self, node_id: str, *, lookback_s: float, max_events: int = MAX_REBUILD_EVENTS) -> Iterator[Event]:
        """The node's recorded events of the last ``lookback_s`` before its newest one (at most ``max_events``),
        and what the state keeps from before them (:func:`console.history.rebuild_events`): what a restarted
        console shows before the live stream resumes after it. Reads the database: iterate it in a thread."""
        with self._lock:
            cur = self._store.cursor()
        try:
            span = time_span(cur, node_ids=(node_id,))
            if span is not None:
                yield from rebuild_events(
                    cur, span[1], lookback_ns=round(lookback_s * 1e9), max_events=max_events, node_ids=(node_id,)
                )
        finally:
            cur.close()

    @property
    def description(self) -> str:
        return f"recording to {self.path}"

    def query_connection(self) -> duckdb.DuckDBPyConnection:
        """A cursor of the writer's connection for the SQL screen (committed rows; one query at a time)."""
        return self._query_con

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, commit, close the file (idempotent)."""
        if self.closed:
            return
        super().close(timeout_s)
        self._query_con.close()


class RecordingFeed:
    """A feed whose events are also handed to a :class:`ConsoleRecorder` (the updates pass through unchanged);
    at the first hello of each node, the node's recorded history comes first (``history_s``; 0: none)."""

    def __init__(self, feed: Feed, recorder: ConsoleRecorder, *, history_s: float = 0.0) -> None:
        self.feed = feed
        self.recorder = recorder
        self.history_s = history_s
        """How much of a node's recorded history to show before its live stream (s; 0: none)."""

    @property
    def source(self) -> str:
        return self.feed.source

    async def updates(self) -> AsyncIterator[FeedUpdate]:
        record = self.recorder.record
        loaded: set[str] = set()
        async for update in self.feed.updates():
            if update.events:
                for event in update.events:
                    if isinstance(event, NodeHello) and event.node_id not in loaded:
                        loaded.add(event.node_id)
                        async for history in self._history(event.node_id):
                            yield history
                record(update.events)
            yield update

    async def _history(self, node_id: str) -> AsyncIterator[FeedUpdate]:
        """The node's recorded history, read in a thread, before its live stream (which resumes after it)."""
        if self.history_s <= 0:
            return
        events = self.recorder.history(node_id, lookback_s=self.history_s)
        async for chunk in chunks_in_thread(take(events, HISTORY_CHUNK)):
            yield FeedUpdate(self.source, chunk)
