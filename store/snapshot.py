"""One node's window of a store, copied into a store file of its own (what ``trackside whatif`` reads in a child).

DuckDB lets one process open a file for writing, and then no other process may open it at all: a console, whose
recorder holds its file, cannot hand that file to a child process. :func:`copy_window` copies what the child needs
into a new file instead: a store made by :func:`store.schema.connect` (so it has the schema and its version),
attached to the source's connection (``ATTACH ... (READ_WRITE)``, which works from a read-only connection too) and
filled in one transaction, then detached. It runs on a cursor of its own, so the source may be a cursor of a live
writer's connection (it copies what is committed) or a store opened read-only.

What is copied, all of it of the one node: every event table's rows from ``start_ns`` on (all of them when None),
except ``nodes``, whose rows are copied whatever their time (a window starts after the node's hello, and the node's
shape, units and policies are in it); and the node's ``positions`` and ``gaps`` rows. Reads DuckDB: call it from a
worker thread.
"""

from __future__ import annotations

import contextlib
import secrets
from pathlib import Path

import duckdb

from store.schema import TABLES, StoreError, columns, connect

ALWAYS_WHOLE: frozenset[str] = frozenset({"nodes"})
"""Event tables whose rows of the node are copied whatever their time (the hellos)."""
NODE_META_TABLES: tuple[str, ...] = ("positions", "gaps")
"""Meta tables whose rows of the node are copied too (each run's committed position, the holes below it)."""


def copy_window(
    con: duckdb.DuckDBPyConnection,
    dest: str | Path,
    *,
    node_id: str,
    start_ns: int | None = None,
) -> int:
    """Copy ``node_id``'s rows of the store ``con`` is connected to, from ``start_ns`` on (None: all), into a new store
    file at ``dest``; how many event rows were copied (``positions`` and ``gaps`` rows not counted).

    Raises :class:`~store.schema.StoreError` (one line) when ``dest`` exists or the copy fails; a failed copy leaves
    no file behind."""
    path = Path(dest).expanduser().resolve()
    if path.exists():
        raise StoreError(f"{path} exists: the window is copied into a new file")
    connect(path).close()
    alias = f"trackside_window_{secrets.token_hex(6)}"
    quoted = str(path).replace("'", "''")
    copied = 0
    try:
        with contextlib.closing(con.cursor()) as cur:
            cur.execute(f"ATTACH '{quoted}' AS {alias} (READ_WRITE)")
            try:
                cur.execute("BEGIN TRANSACTION")
                try:
                    for table in TABLES:
                        copied += _copy_rows(cur, alias, table, node_id, None if table in ALWAYS_WHOLE else start_ns)
                    for table in NODE_META_TABLES:
                        cur.execute(f"INSERT INTO {alias}.{table} SELECT * FROM {table} WHERE node_id = ?", [node_id])
                    cur.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(duckdb.Error):
                        cur.execute("ROLLBACK")
                    raise
            finally:
                cur.execute(f"DETACH {alias}")
    except duckdb.Error as exc:
        _remove(path)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"cannot copy {node_id}'s window to {path}: {first}") from None
    except BaseException:
        _remove(path)
        raise
    return copied


def _copy_rows(cur: duckdb.DuckDBPyConnection, alias: str, table: str, node_id: str, start_ns: int | None) -> int:
    """Insert ``table``'s rows of ``node_id`` (from ``start_ns`` on) into the attached store; how many."""
    names = ", ".join(name for name, _, _ in columns(table))  # by name: the two files' column order may differ
    where = "node_id = ?"
    params: list[object] = [node_id]
    if start_ns is not None:
        where += " AND time_ns >= ?"
        params.append(start_ns)
    row = cur.execute(
        f"INSERT INTO {alias}.{table} ({names}) SELECT {names} FROM {table} WHERE {where}", params
    ).fetchone()
    return int(row[0]) if row else 0


def _remove(path: Path) -> None:
    for leftover in (path, path.with_name(path.name + ".wal")):
        with contextlib.suppress(OSError):
            leftover.unlink()
