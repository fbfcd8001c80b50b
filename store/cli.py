"""``trackside sql`` and ``trackside export``: the store's subcommands, for ``agent.cli`` to register.

    trackside sql --db run.duckdb "select policy, count(*) from steps group by all"   # a table
    trackside sql --db run.duckdb --json "..."                                          # or --csv
    trackside export --db run.duckdb --to parquet/

Wiring: ``add_store_commands(subparsers)`` adds both parsers; :data:`STORE_COMMANDS` maps their names to
handlers with ``agent.cli``'s signature ``(args, console) -> exit status``. Importing this module does not
load DuckDB (the handlers do), so ``agent.cli`` stays light for its other commands. Handlers print problems (bad SQL, a
missing file, a file another process is writing) as one line on stderr and return 2; they never raise them.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import decimal
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from store.queries import SqlResult

EXIT_USAGE = 2


def add_store_commands(subparsers: Any) -> None:
    """Add ``sql`` and ``export`` to an ``argparse`` subparsers object (``parser.add_subparsers()``)."""
    q = subparsers.add_parser(
        "sql", help="run a read-only SQL query on a store (DuckDB file)",
        description="Run one read-only SQL statement on a trackside store and print the result. Tables: nodes, "
        "steps, requests, request_events, unit_loads, stage_boundaries, slack_samples, audits, alerts.",
    )
    q.add_argument("--db", type=Path, required=True, help="the store's DuckDB file")
    fmt = q.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print a JSON array of objects")
    fmt.add_argument("--csv", action="store_true", help="print CSV with a header row")
    q.add_argument("query", help="the SQL statement (quote it)")
    e = subparsers.add_parser(
        "export", help="export a store's tables to Parquet files",
        description="Write every table of a trackside store to DIR/<table>.parquet.",
    )
    e.add_argument("--db", type=Path, required=True, help="the store's DuckDB file")
    e.add_argument("--to", type=Path, required=True, metavar="DIR", help="output directory (created if missing)")


def cmd_sql(args: argparse.Namespace, console: Console) -> int:
    from store.queries import sql  # DuckDB loads only when a store command runs
    from store.schema import StoreError

    try:
        result = sql(args.db, args.query)
    except StoreError as exc:
        return _fail("sql", exc)
    if args.json:
        rows = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
        sys.stdout.write(json.dumps(rows, default=_jsonable, indent=2) + "\n")
    elif args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(result.columns)
        writer.writerows(result.rows)
    else:
        console.print(render_table(result))
    return 0


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    from store.queries import export_parquet
    from store.schema import StoreError

    try:
        paths = export_parquet(args.db, args.to)
    except StoreError as exc:
        return _fail("export", exc)
    console.print(f"wrote {len(paths)} Parquet files to {args.to}")
    return 0


STORE_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"sql": cmd_sql, "export": cmd_export}


def render_table(result: SqlResult) -> Table:
    table = Table(show_edge=False, caption=f"{len(result.rows)} rows")
    for name in result.columns:
        table.add_column(name, overflow="fold")
    for row in result.rows:
        table.add_row(*("NULL" if v is None else str(v) for v in row))
    return table


def _jsonable(value: object) -> object:
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.date | dt.time | dt.timedelta | uuid.UUID):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def _fail(command: str, exc: BaseException) -> int:
    print(f"trackside {command}: error: {exc}", file=sys.stderr)
    return EXIT_USAGE
