"""``trackside sql``, ``trackside export`` and ``trackside prune``: the store's subcommands, for ``agent.cli``.

    trackside sql --db run.duckdb "select policy, count(*) from steps group by all"   # a table
    trackside sql --db run.duckdb --json "..."                                          # or --csv
    trackside export --db run.duckdb --to parquet/
    trackside prune --db run.duckdb --older-than 7d                                     # delete old events

Wiring: ``add_store_commands(subparsers)`` adds the parsers; :data:`STORE_COMMANDS` maps their names to
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
import re
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from store.queries import SqlResult

EXIT_USAGE = 2

_DURATION_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def duration_s(text: str) -> float:
    """Seconds in a duration such as ``7d``, ``12h``, ``1h30m``, ``90s`` or ``1.5w`` (units s, m, h, d, w);
    an ``argparse`` type: anything else, or zero, is an ``ArgumentTypeError`` that says what is expected."""
    spec = text.strip().lower()
    if not _DURATION.fullmatch(spec):
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: give a number and a unit (s, m, h, d or w), e.g. 7d, 12h or 1h30m"
        )
    seconds = sum(float(num) * _DURATION_UNITS_S[unit] for num, unit in _DURATION_PART.findall(spec))
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: it must be longer than zero")
    return seconds


def add_store_commands(subparsers: Any) -> None:
    """Add ``sql``, ``export`` and ``prune`` to an ``argparse`` subparsers object (``parser.add_subparsers()``)."""
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
        "export", help="export a store's tables to Parquet files, or a node's recorded arrivals as a JSONL trace",
        description="--to DIR: write every event table of a trackside store, and its gaps, to DIR/<table>.parquet. "
        "--trace FILE.jsonl: write the requests a node recorded in a window (arrival time from the window's start, "
        "prompt and output tokens, SLO targets) as a trace that `trackside bench --trace` and `trackside agent "
        "--trace` read; requests refused at intake have no recorded output length and get the window's median.",
    )
    e.add_argument("--db", type=Path, required=True, help="the store's DuckDB file")
    what = e.add_mutually_exclusive_group(required=True)
    what.add_argument("--to", type=Path, metavar="DIR", help="Parquet: output directory (created if missing)")
    what.add_argument("--trace", type=Path, metavar="FILE.jsonl", help="the recorded arrivals as a JSONL trace")
    e.add_argument("--node", metavar="ID", help="--trace: the node (needed when the store has several)")
    e.add_argument("--since", metavar="TIME", help="--trace: window start, ISO 8601 (UTC without a zone) or a "
                   "duration ago (e.g. 1h); default the node's first arrival")
    e.add_argument("--until", metavar="TIME", help="--trace: window end (same forms); default its last arrival")
    p = subparsers.add_parser(
        "prune", help="delete a store's events older than a duration",
        description="Delete every event older than DURATION (by its time_ns) from a trackside store; the runs' "
        "hellos and resume positions stay. Needs the file to itself (stop its recorder, or give the recorder "
        "--retention instead).",
    )
    p.add_argument("--db", type=Path, required=True, help="the store's DuckDB file")
    p.add_argument("--older-than", type=duration_s, required=True, metavar="DURATION",
                   help="e.g. 7d, 12h, 1h30m (units s, m, h, d, w)")


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


def cmd_prune(args: argparse.Namespace, console: Console) -> int:
    from store.schema import StoreError
    from store.writer import StoreWriter

    if not args.db.is_file():
        return _fail("prune", StoreError(f"no database at {args.db}"))
    cutoff_ns = time.time_ns() - round(args.older_than * 1e9)
    try:
        with StoreWriter(args.db) as writer:
            num = writer.prune(cutoff_ns)
    except StoreError as exc:
        return _fail("prune", exc)
    cutoff = dt.datetime.fromtimestamp(cutoff_ns / 1e9, tz=dt.UTC).isoformat(timespec="seconds")
    console.print(f"deleted {num} rows older than {cutoff} from {args.db}")
    return 0


STORE_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "sql": cmd_sql, "export": cmd_export, "prune": cmd_prune,
}


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
