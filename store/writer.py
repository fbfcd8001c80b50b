"""The store's only writer: buffers protocol events, writes them to DuckDB in Arrow batches, one commit per batch.

Guarantees (what a recorder may rely on):

* **Durable when reported.** :meth:`StoreWriter.flush` returns after a DuckDB ``COMMIT``: a recorder killed
  afterwards loses none of it (tested with a child killed by ``os._exit`` right after a flush; survival of a
  power loss rests on DuckDB's commit, not tested here). :meth:`StoreWriter.last_seq`
  only ever reports committed positions, so resuming from it never skips an event. Events only buffered
  (since the last commit) are lost by a kill; the agent's replay buffer has them for a resume.
* **Atomic batches.** Each commit writes every pending event of every table in one transaction; a failed
  commit is rolled back whole, the pending events are dropped, and :class:`StoreWriteError` says so
  (``last_seq`` still tells where to resume from). Pending events are converted to Arrow as they come, every
  :data:`CONVERT_ROWS` rows of a table; an event that cannot be converted fails its whole batch the same way,
  in the ``write`` that converts it (or at the commit).
* **No duplicates.** A stream position ``(node_id, boot_ns, seq)`` is stored at most once per table, whether
  it is written twice in one batch, again after a resume, or after a reopen. The common case, a stream whose
  ``seq`` grows, costs nothing: each run's committed high-water mark (table ``positions``) proves a batch new;
  only a batch that goes back below it pays for an anti-join against the stored rows in its ``seq`` range.
  ``seq`` 0 rows (per-subscriber notices) are always kept; hellos are kept once per run.
* **Policies.** A finished request is stored with the batch policy of its unit's latest step before it in the
  stream (the node's hello before any step; after a reopen, the latest stored step of the current run), so
  per-policy queries need no join with ``steps``; a refused request with the policy that refused it.
* **Runs.** ``seq`` restarts at 1 whenever an agent restarts; a :class:`~agent.telemetry.NodeHello` starts a
  new run (its ``boot_ns``) for its node, and the events after it belong to that run.
* **Gaps.** A ``gap`` alert (the notice an agent sends a resume whose events it no longer buffers, ``seq`` 0)
  becomes a row of ``gaps`` for the run it arrives in, committed with the events around it; other notices are
  stored as before. A hole announced again keeps one row (the first ``detected_ns``, the larger ``to_seq``).

One writer per file and per process (DuckDB lets one process open a file for writing, and then no other
process may open it); read in the same process through :meth:`StoreWriter.cursor`. Not thread-safe: call it
from one thread (queries on a cursor may run in another).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from itertools import repeat
from pathlib import Path
from types import TracebackType
from typing import Any

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from agent.telemetry import Alert, AlertCode, Event, NodeHello, RequestFinished, RequestRefused, StepEvent
from store.convert import ROUTES, to_arrow
from store.schema import TABLES, StoreError, connect

DEFAULT_BATCH_ROWS = 122_880
"""Events buffered before a commit happens on its own (a flush commits sooner). DuckDB's row-group size: an
insert of at least one row group is written straight to the file instead of through the log (about twice the
rows per second of 20,000-row batches, docs/benchmarks.md)."""


CONVERT_ROWS = 4096
"""Rows of one table converted to Arrow as soon as that many are buffered, between commits: the events are then
still in the CPU's caches (converting 100,000 at a commit took about twice as long per row), and until the
commit the pending rows hold Arrow's memory instead of Python objects'."""


class StoreWriteError(StoreError):
    """A commit failed; its events were not stored (resume the stream from :meth:`StoreWriter.last_seq`)."""


RunKey = tuple[str, int]
"""``(node_id, boot_ns)``: one run of one agent."""


class PendingRows:
    """One table's rows since the last commit: Arrow tables already converted, then the events not converted
    yet, with the run each belongs to and (``requests``) the batch policy each request counts for."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.converted: list[pa.Table] = []
        self.events: list[Event] = []
        self.boots: list[int] = []
        self.policies: list[str | None] = []

    def convert(self) -> None:
        """Turn the events not converted yet into Arrow tables of at most :data:`CONVERT_ROWS` rows each (a
        larger write converted at once, at its commit, is as slow per row as converting late)."""
        if self.events:
            table, events, boots = self.table, self.events, self.boots
            for start in range(0, len(events), CONVERT_ROWS):
                end = start + CONVERT_ROWS
                policies = self.policies[start:end] if table == "requests" else None
                self.converted.append(to_arrow(table, events[start:end], boots[start:end], policies))
            self.events.clear()
            self.boots.clear()
            self.policies.clear()

    def take(self) -> pa.Table | None:
        """Every pending row as one Arrow table (None when there is none); :meth:`clear` forgets them."""
        self.convert()
        return pa.concat_tables(self.converted).combine_chunks() if self.converted else None

    def clear(self) -> None:
        self.converted.clear()
        self.events.clear()
        self.boots.clear()
        self.policies.clear()


class StoreWriter:
    """Writes events to a DuckDB file (or ``":memory:"``), creating or migrating its schema on open."""

    def __init__(self, path: str | Path, *, batch_rows: int = DEFAULT_BATCH_ROWS,
                 memory_limit: str | None = None) -> None:
        if batch_rows < 1:
            raise ValueError("batch_rows must be at least 1")
        self.path = str(path)
        self.batch_rows = batch_rows
        self._con: duckdb.DuckDBPyConnection | None = connect(path, memory_limit=memory_limit)
        self._pending: dict[str, PendingRows] = {table: PendingRows(table) for table in TABLES}
        self._routes: dict[type[Any], tuple[PendingRows, ...]] = {
            cls: tuple(self._pending[table] for table in tables) for cls, tables in ROUTES.items()
        }
        """The pending rows each event type goes to (:data:`~store.convert.ROUTES`)."""
        self._num_pending = 0
        self._committed: dict[RunKey, int] = {
            (node, boot): seq
            for node, boot, seq in self._con.execute("SELECT node_id, boot_ns, last_seq FROM positions").fetchall()
        }
        self._accepted = dict(self._committed)
        """The highest ``seq`` buffered or committed, per run: a later event above it cannot be a duplicate."""
        self._recheck = False
        """Whether a pending event went back below ``_accepted`` (the next commit then anti-joins)."""
        self._run_of: dict[str, int] = dict(self._con.execute(
            "SELECT node_id, max(boot_ns) FROM (SELECT node_id, boot_ns FROM positions "
            "UNION ALL SELECT node_id, boot_ns FROM nodes) GROUP BY node_id"
        ).fetchall())
        """Each node's current run: the latest hello's ``boot_ns`` (0 before any hello)."""
        self._unit_policy: dict[str, dict[int, str]] = {}
        """The batch policy of each unit's latest step in its node's current run (a finished request's policy), by
        node and unit."""
        for node, unit, policy in self._con.execute(
            "SELECT s.node_id, s.unit_id, arg_max(s.policy, s.seq) FROM steps s SEMI JOIN "
            "(SELECT node_id, max(boot_ns) AS boot_ns FROM positions GROUP BY node_id) r "
            "ON s.node_id = r.node_id AND s.boot_ns = r.boot_ns GROUP BY ALL"
        ).fetchall():
            self._unit_policy.setdefault(node, {})[unit] = policy
        self._gaps: dict[tuple[str, int, int], tuple[int, int]] = {}
        """Gap rows since the last commit: ``(to_seq, detected_ns)`` by ``(node_id, boot_ns, from_seq)``."""

    # -- the recorder's interface ----------------------------------------------------------------------------
    def write(self, events: Sequence[Event]) -> None:
        """Buffer ``events``; commits on its own every ``batch_rows`` events. Raises TypeError for a non-event,
        and :class:`StoreWriteError` when buffered events cannot be stored (then none of the pending ones is)."""
        self._require()
        steps = self._pending["steps"]
        step_events, step_boots = steps.events, steps.boots
        node, boot, high = "", 0, 0  # the previous event's run, and the highest seq accepted in it so far
        unit_policy = self._unit_policy.setdefault(node, {})  # the batch policy of each of its node's units
        recheck = False
        try:
            for event in events:
                if type(event) is StepEvent and event.node_id == node:  # the bulk of a stream: kept short
                    seq = event.seq
                    if seq > high:
                        high = seq
                    elif seq:
                        recheck = True
                    unit_policy[event.unit_id] = event.policy
                    step_events.append(event)  # its run's boot: added for all such steps at once
                else:
                    if len(step_boots) < len(step_events):
                        step_boots.extend(repeat(boot, len(step_events) - len(step_boots)))
                    node, boot, high = self._buffer(event, node, boot, high)
                    unit_policy = self._unit_policy.get(node) or self._unit_policy.setdefault(node, {})
        finally:
            step_boots.extend(repeat(boot, len(step_events) - len(step_boots)))
        self._accept(node, boot, high)
        self._recheck |= recheck
        self._num_pending += len(events)
        if self._num_pending >= self.batch_rows:
            self._commit()
            return
        for rows in self._pending.values():
            if len(rows.events) >= CONVERT_ROWS:
                self._convert(rows)

    def _buffer(self, event: Event, node: str, boot: int, high: int) -> tuple[str, int, int]:
        """:meth:`write`'s general case: ``event`` of any kind, and of any run; the run it is in, and that run's
        highest ``seq`` accepted so far (``node``, ``boot``, ``high``: the previous event's run)."""
        cls = type(event)
        routes = self._routes.get(cls)
        if routes is None:
            raise TypeError(f"not a protocol event: {cls.__name__}")
        if event.node_id != node or isinstance(event, NodeHello):
            self._accept(node, boot, high)
            node = event.node_id
            if isinstance(event, NodeHello):
                self._run_of[node] = event.boot_ns
                self._unit_policy.setdefault(node, {}).update((u.unit_id, u.batch_policy) for u in event.units)
            boot = self._run_of.get(node, 0)
            high = self._accepted.get((node, boot), 0)
        if isinstance(event, Alert) and not event.seq and event.code == AlertCode.GAP:
            self._gap(node, boot, event)
            return node, boot, high
        policy: str | None = None
        if isinstance(event, RequestFinished):
            policy = self._unit_policy.get(node, {}).get(event.unit_id)
        elif isinstance(event, StepEvent):
            self._unit_policy.setdefault(node, {})[event.unit_id] = event.policy
        elif isinstance(event, RequestRefused):
            policy = event.policy
        seq = event.seq
        if seq > high:
            high = seq
        elif seq:
            self._recheck = True
        for rows in routes:
            rows.events.append(event)
            rows.boots.append(boot)
            rows.policies.append(policy)
        return node, boot, high

    def _gap(self, node: str, boot: int, alert: Alert) -> None:
        """Keep a ``gap`` alert as a pending row of ``gaps`` (one per hole: the larger ``to_seq``, the first time)."""
        key = (node, boot, alert.first_seq)
        to_seq, detected_ns = self._gaps.get(key, (alert.last_seq, alert.time_ns))
        self._gaps[key] = (max(to_seq, alert.last_seq), min(detected_ns, alert.time_ns))

    def _accept(self, node: str, boot: int, high: int) -> None:
        """Record ``high`` as the highest ``seq`` buffered or committed in the run ``(node, boot)``."""
        if high:
            self._accepted[node, boot] = high

    def flush(self) -> None:
        """Commit everything written so far; when it returns, it is durable."""
        self._require()
        self._commit()

    def last_seq(self, node_id: str, boot_ns: int | None = None) -> int:
        """The highest committed ``seq`` of one run of the node, 0 if none: the run that started at
        ``boot_ns`` (a hello's), or by default the node's current run (the latest hello's)."""
        run = self._run_of.get(node_id, 0) if boot_ns is None else boot_ns
        return self._committed.get((node_id, run), 0)

    def close(self) -> None:
        """Flush and close (idempotent). The connection is closed even when the last commit fails."""
        if self._con is None:
            return
        try:
            self._commit()
        finally:
            self._con.close()
            self._con = None

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- beyond the recorder's interface ---------------------------------------------------------------------
    def prune(self, older_than_ns: int) -> int:
        """Delete every event row with ``time_ns`` before ``older_than_ns`` (hellos and positions stay), and the gaps
        detected before it (their holes are older still); rows deleted. Commits pending events first; ``last_seq`` is
        unchanged (pruned events are not rewritten)."""
        con = self._require()
        self._commit()
        deleted = 0
        con.execute("BEGIN TRANSACTION")
        try:
            for table in TABLES:
                if table != "nodes":
                    row = con.execute(f"DELETE FROM {table} WHERE time_ns < ?", [older_than_ns]).fetchone()
                    deleted += int(row[0]) if row else 0
            row = con.execute("DELETE FROM gaps WHERE detected_ns < ?", [older_than_ns]).fetchone()
            deleted += int(row[0]) if row else 0
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("CHECKPOINT")
        return deleted

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A connection to the same database for queries in this process (e.g. in a thread worker)."""
        return self._require().cursor()

    @property
    def num_pending(self) -> int:
        """Events written but not yet committed."""
        return self._num_pending

    # -- internals -------------------------------------------------------------------------------------------
    def _require(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            raise StoreError(f"the store writer for {self.path} is closed")
        return self._con

    def _commit(self) -> None:
        con = self._require()
        if not self._num_pending:
            return
        changed = {key: seq for key, seq in self._accepted.items() if self._committed.get(key) != seq}
        try:
            con.execute("BEGIN TRANSACTION")
            for table, rows in self._pending.items():
                batch = rows.take()
                if batch is not None:
                    self._insert(con, table, batch)
            if self._gaps:
                self._insert_gaps(con)
            if changed:
                con.execute(
                    "INSERT OR REPLACE INTO positions VALUES " + ", ".join(["(?, ?, ?)"] * len(changed)),
                    [v for (node, boot), seq in changed.items() for v in (node, boot, seq)],
                )
            con.execute("COMMIT")
        except Exception as exc:
            with contextlib.suppress(duckdb.Error):  # a failed statement may have ended the transaction
                con.execute("ROLLBACK")
            raise self._drop_pending(f"commit of {self._num_pending} events to {self.path} failed", exc) from exc
        finally:
            self._clear()
        self._committed.update(changed)

    def _insert_gaps(self, con: duckdb.DuckDBPyConnection) -> None:
        """The pending gap rows (a few at most: one per hole); a hole already stored keeps its row, widened."""
        rows = [(node, boot, first, last, at) for (node, boot, first), (last, at) in self._gaps.items()]
        con.execute(
            "INSERT INTO gaps VALUES " + ", ".join(["(?, ?, ?, ?, ?)"] * len(rows))
            + " ON CONFLICT (node_id, boot_ns, from_seq) DO UPDATE SET to_seq = greatest(to_seq, excluded.to_seq)",
            [v for row in rows for v in row],
        )

    def _convert(self, rows: PendingRows) -> None:
        try:
            rows.convert()
        except Exception as exc:
            what = f"converting {self._num_pending} events ({rows.table} rows) for {self.path} failed"
            error = self._drop_pending(what, exc)
            self._clear()
            raise error from exc

    def _drop_pending(self, what: str, exc: Exception) -> StoreWriteError:
        """Forget what was accepted since the last commit; the error to raise (its events are not stored)."""
        self._accepted = dict(self._committed)
        return StoreWriteError(f"{what}, nothing of them was stored: {exc}")

    def _clear(self) -> None:
        for rows in self._pending.values():
            rows.clear()
        self._gaps.clear()
        self._num_pending = 0
        self._recheck = False

    def _insert(self, con: duckdb.DuckDBPyConnection, table: str, batch: pa.Table) -> None:
        insert_batch(con, table, batch, check=self._recheck)


def insert_batch(con: duckdb.DuckDBPyConnection, table: str, batch: pa.Table, *, check: bool) -> None:
    """Insert an Arrow batch of ``table``'s rows; with ``check``, only the rows whose stream position is not
    stored yet (an anti-join against the stored rows in the batch's ``seq`` range, and DISTINCT within it)."""
    con.register("_batch", batch)
    try:
        if table == "nodes":  # once per run, whatever its seq
            con.execute(
                "INSERT INTO nodes BY NAME SELECT * FROM _batch b WHERE NOT EXISTS "
                "(SELECT 1 FROM nodes x WHERE x.node_id = b.node_id AND x.boot_ns = b.boot_ns) "
                "QUALIFY row_number() OVER (PARTITION BY b.node_id, b.boot_ns ORDER BY b.seq) = 1"
            )
        elif not check:
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _batch")
        else:
            bounds = pc.min_max(batch["seq"]).as_py()
            con.execute(
                f"INSERT INTO {table} BY NAME SELECT DISTINCT * FROM _batch b WHERE b.seq = 0 OR NOT EXISTS "
                f"(SELECT 1 FROM {table} x WHERE x.seq BETWEEN ? AND ? AND x.seq = b.seq "
                "AND x.node_id = b.node_id AND x.boot_ns = b.boot_ns)",
                [bounds["min"], bounds["max"]],
            )
    finally:
        con.unregister("_batch")
