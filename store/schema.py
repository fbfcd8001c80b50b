"""The store's DuckDB schema, its version, and opening a database file safely.

One table per kind of record. Every event table starts with the same four columns: ``node_id``, ``boot_ns``
(the agent run the event belongs to: sequence numbers restart at 1 with every run, so a stream position is
``(node_id, boot_ns, seq)``), ``seq`` and ``time_ns`` (wall-clock ns). The writer keeps that triple unique per
table, except for ``seq`` 0 (per-subscriber notices, which are not part of the stream and are always kept);
``nodes`` is unique per ``(node_id, boot_ns)`` and ``slack_samples`` has one row per sampled request (the
rows of one sample share the event's triple and are numbered by ``idx``). Beside the event tables,
:data:`META_TABLES`: the schema's version, each run's committed position, and the holes in the stream below it
(``gaps``: what the agent no longer buffered when a recorder resumed).

Columns are typed. JSON text is used only for a step's ``reasons``, an audit's ``old``/``new`` settings and the
hello's parameter maps and policy catalogue (``CAST(reasons AS JSON)`` or ``reasons->>'$.key'`` query it).

Opening checks ``schema_version``: a newer version than :data:`SCHEMA_VERSION` is refused (a newer trackside
wrote the file); an older one is migrated by the writer (one step per entry of :data:`MIGRATIONS`) or refused
with a message saying so; a read-only open never migrates.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import duckdb

SCHEMA_VERSION: Final = 5
"""Bumped on any change to the tables below; add a migration from the previous version to :data:`MIGRATIONS`.

2: ``requests.max_tpot_ms`` (the worst per-token TPOT) and each unit's placement in ``nodes.units`` (``gpu_ids``,
``tensor_parallel_size``, ``pipeline_parallel_size``).
3: the ``gaps`` table (:data:`GAPS_COLUMNS`).
4: the node's shape in ``nodes``: ``topology``, ``prefill_units``, ``lockstep`` (what ``trackside whatif`` replays).
5: ``nodes.instance_size`` (seed 000's instances of units in lockstep)."""

KEY_COLUMNS: Final = ("node_id VARCHAR!", "boot_ns BIGINT!", "seq BIGINT!", "time_ns BIGINT!")
"""The first four columns of every event table; ``!`` marks NOT NULL."""

UNIT_STRUCT: Final = (
    "STRUCT(unit_id BIGINT, mode VARCHAR, batch_policy VARCHAR, batch_params VARCHAR, num_blocks BIGINT, "
    "max_num_seqs BIGINT, num_running BIGINT, num_waiting BIGINT, gpu_ids BIGINT[], tensor_parallel_size BIGINT, "
    "pipeline_parallel_size BIGINT)[]"
)

TABLES: Final[dict[str, tuple[str, ...]]] = {
    "nodes": (
        "protocol_version BIGINT!", "profile VARCHAR!", "dispatch_policy VARCHAR!", "dispatch_params VARCHAR!",
        f"units {UNIT_STRUCT}!", "batch_policies VARCHAR!", "dispatch_policies VARCHAR!", "topology VARCHAR",
        "prefill_units BIGINT", "lockstep BOOLEAN", "instance_size BIGINT",
    ),
    "steps": (
        "unit_id BIGINT!", "step_id BIGINT!", "measured_ns BIGINT!", "predicted_ns BIGINT!", "mode VARCHAR!",
        "policy VARCHAR!", "num_prefill_tokens BIGINT!", "num_decode_tokens BIGINT!", "num_prefill_reqs BIGINT!",
        "num_decode_reqs BIGINT!", "context_tokens BIGINT!", "budget_tokens BIGINT!", "kv_used_blocks BIGINT!",
        "num_blocks BIGINT!", "num_running BIGINT!", "num_waiting BIGINT!", "num_preempted BIGINT!",
        "num_finished BIGINT!", "reasons VARCHAR!",
    ),
    "requests": (
        "request_id VARCHAR!", "unit_id BIGINT", "refused BOOLEAN!", "arrival_ns BIGINT", "first_token_ns BIGINT",
        "prompt_tokens BIGINT", "output_tokens BIGINT", "num_preemptions BIGINT", "ttft_ms DOUBLE",
        "tpot_ms DOUBLE", "ttft_slo_ms DOUBLE", "tpot_slo_ms DOUBLE", "met_slo BOOLEAN!", "policy VARCHAR",
        "reason VARCHAR", "max_tpot_ms DOUBLE",
    ),
    "request_events": (
        "kind VARCHAR!", "request_id VARCHAR!", "unit_id BIGINT", "from_unit_id BIGINT", "prompt_tokens BIGINT",
        "ttft_slo_ms DOUBLE", "tpot_slo_ms DOUBLE", "num_rounds_waited BIGINT", "ttft_ms DOUBLE", "step_id BIGINT",
        "policy VARCHAR", "reason VARCHAR",
    ),
    "unit_loads": (
        "unit_id BIGINT!", "dispatch_id BIGINT!", "healthy BOOLEAN!", "num_running BIGINT!", "num_waiting BIGINT!",
        "kv_used_blocks BIGINT!", "num_blocks BIGINT!", "kv_tokens BIGINT!", "queued_prefill_tokens BIGINT!",
        "max_num_seqs BIGINT!", "pab_tokens DOUBLE", "last_step_ns BIGINT", "mean_step_ns BIGINT",
    ),
    "stage_boundaries": (
        "policy VARCHAR!", "boundaries_tokens BIGINT[]!", "stage_unit_ids BIGINT[][]!", "reason VARCHAR!",
    ),
    "slack_samples": (
        "unit_id BIGINT!", "sample_period_ms DOUBLE!", "idx BIGINT!", "request_id VARCHAR", "deadline_ns BIGINT",
        "slack_ms DOUBLE", "output_tokens BIGINT", "computed_tokens BIGINT",
    ),
    "audits": (
        "actor VARCHAR!", "control_id VARCHAR!", "action VARCHAR!", "unit_ids BIGINT[]!", "old VARCHAR!",
        "new VARCHAR!", "result VARCHAR!", "error_code VARCHAR!", "message VARCHAR!",
    ),
    "alerts": (
        "code VARCHAR!", "severity VARCHAR!", "unit_id BIGINT", "message VARCHAR!", "num_dropped BIGINT!",
        "first_seq BIGINT!", "last_seq BIGINT!",
    ),
}
"""Event tables: their columns after :data:`KEY_COLUMNS`, as ``"name TYPE"`` (``!``: NOT NULL)."""


def _v1_to_v2(con: duckdb.DuckDBPyConnection) -> None:
    """``requests.max_tpot_ms`` (NULL in the rows already there: their worst TPOT was never measured) and the units'
    placement (empty and 0 in the hellos already there, as for a simulated unit). Written out here, not derived from
    :data:`TABLES`, so that a later version's tables do not change what this step does."""
    con.execute("ALTER TABLE requests ADD COLUMN max_tpot_ms DOUBLE")
    con.execute(
        "ALTER TABLE nodes ALTER COLUMN units SET DATA TYPE STRUCT(unit_id BIGINT, mode VARCHAR, batch_policy VARCHAR, "
        "batch_params VARCHAR, num_blocks BIGINT, max_num_seqs BIGINT, num_running BIGINT, num_waiting BIGINT, "
        "gpu_ids BIGINT[], tensor_parallel_size BIGINT, pipeline_parallel_size BIGINT)[] "
        "USING list_transform(units, lambda u: struct_insert(u, gpu_ids := []::BIGINT[], "
        "tensor_parallel_size := 0::BIGINT, pipeline_parallel_size := 0::BIGINT))"
    )


def _v2_to_v3(con: duckdb.DuckDBPyConnection) -> None:
    """The ``gaps`` table, empty: a store written before knew of no hole (its recorders printed them only).
    Written out here, as :func:`_v1_to_v2`, so that a later version's columns do not change what this step does."""
    con.execute(
        "CREATE TABLE gaps (node_id VARCHAR NOT NULL, boot_ns BIGINT NOT NULL, from_seq BIGINT NOT NULL, "
        "to_seq BIGINT NOT NULL, detected_ns BIGINT NOT NULL, PRIMARY KEY (node_id, boot_ns, from_seq))"
    )


def _v3_to_v4(con: duckdb.DuckDBPyConnection) -> None:
    """The node's shape, NULL in the hellos already there (their agents did not say it)."""
    con.execute("ALTER TABLE nodes ADD COLUMN topology VARCHAR")
    con.execute("ALTER TABLE nodes ADD COLUMN prefill_units BIGINT")
    con.execute("ALTER TABLE nodes ADD COLUMN lockstep BOOLEAN")


def _v4_to_v5(con: duckdb.DuckDBPyConnection) -> None:
    """The node's instance size, NULL in the hellos already there (read back as 0: no instances)."""
    con.execute("ALTER TABLE nodes ADD COLUMN instance_size BIGINT")


MIGRATIONS: dict[int, Callable[[duckdb.DuckDBPyConnection], None]] = {
    1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5,
}
"""``MIGRATIONS[v]`` turns a version-``v`` database into a version ``v + 1`` one (inside one transaction)."""


def columns(table: str) -> list[tuple[str, str, bool]]:
    """``(name, sql_type, not_null)`` of every column of an event table, key columns first."""
    out = []
    for spec in (*KEY_COLUMNS, *TABLES[table]):
        name, sql_type = spec.split(" ", 1)
        out.append((name, sql_type.rstrip("!"), sql_type.endswith("!")))
    return out


def create_sql(table: str) -> str:
    cols = ", ".join(f"{name} {kind}{' NOT NULL' if not_null else ''}" for name, kind, not_null in columns(table))
    return f"CREATE TABLE {table} ({cols})"


GAPS_COLUMNS: Final = (
    "node_id VARCHAR NOT NULL, boot_ns BIGINT NOT NULL, from_seq BIGINT NOT NULL, to_seq BIGINT NOT NULL, "
    "detected_ns BIGINT NOT NULL, PRIMARY KEY (node_id, boot_ns, from_seq)"
)
"""``gaps``: events ``from_seq..to_seq`` of a run that the store will never have, because the agent no longer
buffered them when a recorder resumed (its ``gap`` alert); ``detected_ns`` is the alert's time (the agent's wall
clock when it answered the resume). One row per hole: a hole announced again (a recorder killed before it
committed what followed) keeps its first row, widened to the larger ``to_seq``."""

META_TABLES: Final[dict[str, str]] = {
    "schema_version": "version BIGINT NOT NULL, applied_ns BIGINT NOT NULL",
    "positions": "node_id VARCHAR NOT NULL, boot_ns BIGINT NOT NULL, last_seq BIGINT NOT NULL, "
    "PRIMARY KEY (node_id, boot_ns)",
    "gaps": GAPS_COLUMNS,
}
"""``positions``: the highest committed ``seq`` of each run of each node (what a recorder resumes from); ``gaps``:
the holes below it (:data:`GAPS_COLUMNS`), so a position never looks more complete than the rows are."""


class StoreError(Exception):
    """A store that cannot be opened or used as asked; the message is one line meant for the operator."""


class StoreLockedError(StoreError):
    """Another process has the database file open for writing."""

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder
        """That process, ``PID 123 (trackside record ...)``, when DuckDB names it (None: it did not)."""


class StoreVersionError(StoreError):
    """The file's schema version is one this code cannot use."""


def connect(path: str | Path, *, read_only: bool = False, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A connection to ``path`` (or ``":memory:"``) whose schema is checked, created or migrated.

    ``memory_limit`` (DuckDB's setting, e.g. ``"512MB"``; None: DuckDB's default, 80% of the machine's memory)
    bounds what DuckDB keeps in memory, its cache of the file's blocks included: a recorder that runs for months
    would otherwise cache more and more of a growing file. A limit DuckDB cannot read raises :class:`StoreError`.

    Raises :class:`StoreLockedError` when another process writes the file, :class:`StoreVersionError` for
    a schema this code cannot use, and :class:`StoreError` for a missing file (read-only) or one that is
    not a DuckDB database.
    """
    name = str(path)
    if read_only and name != ":memory:" and not Path(name).is_file():
        raise StoreError(f"no database at {name}")
    try:
        config: dict[str, str | bool | int | float | list[str]] = {}
        if memory_limit is not None:
            config["memory_limit"] = memory_limit
        con = duckdb.connect(name, read_only=read_only and name != ":memory:", config=config)
    except duckdb.IOException as exc:
        text = str(exc)
        if "lock" in text.lower():
            holder = lock_holder(text)
            raise StoreLockedError(
                f"{name} is open for writing by another process{', ' + holder if holder else ''} (DuckDB allows one "
                "writer and then no other process at all): query it through that process (the console's SQL "
                "screen), stop it, or copy the file and query the copy",
                holder,
            ) from None
        raise StoreError(f"cannot open {name}: {_first_line(text)}") from None
    except duckdb.ParserException as exc:  # only the settings are parsed here
        raise StoreError(f"memory limit {memory_limit!r}: {_first_line(str(exc))}") from None
    except duckdb.Error as exc:
        raise StoreError(f"cannot open {name}: {_first_line(str(exc))}") from None
    try:
        ensure_schema(con, read_only=read_only and name != ":memory:")
    except BaseException:
        con.close()
        raise
    return con


def ensure_schema(con: duckdb.DuckDBPyConnection, *, read_only: bool = False) -> int:
    """Create the schema in an empty database, migrate an older one, refuse a newer one; the version in use."""
    existing = {row[0] for row in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    if "schema_version" not in existing:
        if existing:
            raise StoreError(f"not a trackside store (tables {', '.join(sorted(existing))} but no schema_version)")
        if read_only:
            raise StoreError("empty database: nothing recorded yet")
        _create(con)
        return SCHEMA_VERSION
    row = con.execute("SELECT max(version) FROM schema_version").fetchone()
    version = int(row[0]) if row and row[0] is not None else 0
    if version > SCHEMA_VERSION:
        raise StoreVersionError(
            f"the store has schema version {version}, newer than this trackside knows ({SCHEMA_VERSION}): "
            "upgrade trackside to read it"
        )
    if version < SCHEMA_VERSION:
        missing = [v for v in range(version, SCHEMA_VERSION) if v not in MIGRATIONS]
        if missing:
            raise StoreVersionError(
                f"the store has schema version {version} and there is no migration from version {missing[0]} "
                f"to {missing[0] + 1}: export it with the trackside that wrote it, or start a new file"
            )
        if read_only:
            raise StoreVersionError(
                f"the store has schema version {version} (this trackside uses {SCHEMA_VERSION}): open it once "
                "for writing to migrate it"
            )
        _migrate(con, version)
    return SCHEMA_VERSION


def _create(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("BEGIN TRANSACTION")
    for table in TABLES:
        con.execute(create_sql(table))
    for name, cols in META_TABLES.items():
        con.execute(f"CREATE TABLE {name} ({cols})")
    con.execute("INSERT INTO schema_version VALUES (?, ?)", [SCHEMA_VERSION, time.time_ns()])
    con.execute("COMMIT")


def _migrate(con: duckdb.DuckDBPyConnection, version: int) -> None:
    con.execute("BEGIN TRANSACTION")
    try:
        for v in range(version, SCHEMA_VERSION):
            MIGRATIONS[v](con)
            con.execute("INSERT INTO schema_version VALUES (?, ?)", [v + 1, time.time_ns()])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


_LOCK_HOLDER: Final = re.compile(r"lock is held in (?P<program>.*?) \(PID (?P<pid>\d+)\)")
"""What DuckDB's lock error says of the process holding the lock (``... Conflicting lock is held in
/usr/bin/python3.11 (PID 28494) ...``)."""


def lock_holder(message: str, proc: Path = Path("/proc"), max_chars: int = 100) -> str | None:
    """The process named by DuckDB's lock error ``message``: ``PID 28494 (trackside record ws://...)``, with its command
    line where ``proc`` has it (Linux), else the program DuckDB names; None when the message names no process."""
    match = _LOCK_HOLDER.search(message)
    if match is None:
        return None
    try:
        argv = [a.decode(errors="replace") for a in (proc / match["pid"] / "cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        argv = []
    if not argv:
        argv = [match["program"]]
    argv[0] = Path(argv[0]).name
    if argv[0].startswith("python") and len(argv) > 1 and not argv[1].startswith("-"):
        argv = [Path(argv[1]).name, *argv[2:]]  # an installed script (.../bin/trackside) run by its interpreter
    command = " ".join(argv)
    if len(command) > max_chars:
        command = command[: max_chars - 3] + "..."
    return f"PID {match['pid']} ({command})"
