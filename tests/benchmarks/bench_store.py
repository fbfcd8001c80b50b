"""Store benchmark: step-row ingestion and canned queries over a large file.

    python tests/benchmarks/bench_store.py [--ingest 1000000] [--batch 122880] [--rows 10000000] [--dir DIR]
    python tests/benchmarks/bench_store.py --against REV [--repeat 3] [--ingest 1000000] [--write 122880]
        [--stream steps|node]

1. Ingestion into a fresh file: (a) DuckDB alone, ``INSERT ... SELECT`` from prebuilt Arrow batches of step
   rows (and the conversion alone: ``to_arrow`` on whole batches, then as the writer does it); (b)
   ``StoreWriter.write`` + ``flush`` end to end from ``StepEvent`` structs (conversion included); (c) the same
   events written again (every batch takes the duplicate check, and stores nothing).
2. A second file with ``--rows`` step rows (and one finished request per 10 steps) generated inside DuckDB,
   then the canned queries on it, best of 3: ``policy_summary`` (all, a 10-minute window, 60 s buckets),
   ``unit_balance`` (all, a 10-minute window), ``replay`` of a 10-minute window of one unit, and a Parquet
   export. Prints numbers; asserts nothing. ``--rows 0`` skips it.

``--against REV`` (issue #21, item 6) times ``StoreWriter.write`` + ``flush`` end to end in this tree and in REV's
(checked out in a temporary git worktree, as ``bench_sim_speed.py --against`` does), alternately, each run in a
fresh process with its tree first on the path and a fresh file, ``--write`` events per ``write`` call (a recorder
writes a frame's events at a time; the default, one row group, is what the table above measures) of
``--ingest`` step events, or with ``--stream node`` of a simulated node's whole stream of that many events;
prints each run, each tree's median step rows/s and their ratio, this tree over REV.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import duckdb
import pyarrow as pa  # type: ignore[import-untyped]
from bench_sim_speed import git, worktree

import store
from agent.telemetry import Event, StepEvent
from policies.types import StepMode
from store.convert import to_arrow
from store.queries import export_parquet, policy_summary, unit_balance
from store.replay import replay
from store.schema import connect
from store.writer import CONVERT_ROWS, StoreWriter, insert_batch

T0 = 1_800_000_000_000_000_000
STEP_GAP_NS = 1_250_000
"""8 units, a step each 10 ms: one step row per 1.25 ms on the node."""


def steps(n: int, first_seq: int = 1) -> list[StepEvent]:
    return [
        StepEvent(
            seq=s, node_id="bench", time_ns=T0 + s * STEP_GAP_NS, unit_id=s % 8, step_id=s // 8,
            measured_ns=8_000_000 + s % 4_000_000, predicted_ns=9_000_000, mode=StepMode.MIXED,
            policy="vllm" if s % 8 < 4 else "sarathi", num_prefill_tokens=s % 2048, num_decode_tokens=s % 64,
            num_prefill_reqs=s % 3, num_decode_reqs=s % 64, context_tokens=s % 100_000, budget_tokens=2048,
            kv_used_blocks=s % 10_000, num_blocks=10_000, num_running=s % 64, num_waiting=s % 5,
            num_preempted=0, num_finished=s % 2, reasons={"budget_tokens": 2048, "theta": 0.25} if s % 10 == 0 else {},
        )
        for s in range(first_seq, first_seq + n)
    ]


def timed(fn: Callable[[], object], repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_ingest(directory: Path, n: int, batch: int) -> None:
    events = steps(n)
    batches = [events[i:i + batch] for i in range(0, n, batch)]
    t0 = time.perf_counter()
    arrow = [to_arrow("steps", b, [0] * len(b)) for b in batches]
    convert_s = time.perf_counter() - t0
    print(f"events -> Arrow (to_arrow, {batch}-row batches): {n / convert_s:,.0f} rows/s ({convert_s:.2f} s)")
    t0 = time.perf_counter()
    for b in batches:  # as the writer converts: CONVERT_ROWS at a time, then one table per batch
        pa.concat_tables([to_arrow("steps", b[i:i + CONVERT_ROWS], [0] * len(b[i:i + CONVERT_ROWS]))
                          for i in range(0, len(b), CONVERT_ROWS)]).combine_chunks()
    chunked_s = time.perf_counter() - t0
    print(f"  the same, {CONVERT_ROWS} rows at a time (as the writer): {n / chunked_s:,.0f} rows/s ({chunked_s:.2f} s)")
    def insert_all(con: duckdb.DuckDBPyConnection, check: bool) -> None:
        for table in arrow:
            insert_batch(con, "steps", table, check=check)

    for label, check in (("plain", False), ("checked, all new", True)):
        con = connect(directory / f"raw-{check}.duckdb")
        raw_s = timed(partial(insert_all, con, check))
        if check:
            again_s = timed(partial(insert_all, con, True))
        con.close()
        print(f"DuckDB Arrow INSERT, {label + ',':<17} per batch: {n / raw_s:,.0f} rows/s ({raw_s:.2f} s)")
    print(f"DuckDB Arrow INSERT, checked, all dups, per batch: {n / again_s:,.0f} rows/s ({again_s:.2f} s)")

    with StoreWriter(directory / "writer.duckdb", batch_rows=batch) as writer:
        t0 = time.perf_counter()
        for b in batches:
            writer.write(b)
        writer.flush()
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in batches:  # a full replay of the stream: every batch is checked against stored rows
            writer.write(b)
            writer.flush()
        dup_s = time.perf_counter() - t0
        stored = writer.cursor().execute("SELECT count(*) FROM steps").fetchone()
    print(f"StoreWriter.write+flush, end to end:            {n / write_s:,.0f} rows/s ({write_s:.2f} s)")
    print(f"  again, all duplicates (anti-join path):       {n / dup_s:,.0f} rows/s ({dup_s:.2f} s); "
          f"rows stored {stored[0] if stored else '?':,}")


def node_stream(n: int) -> list[Event]:
    """A node's stream as a recorder receives it: its hello, then ``n`` events of the Azure code trace run on 4
    simulated units through a ``Hub`` (``bench_telemetry.py recorder``'s events: ~68% steps, then unit loads,
    slack samples and the requests' lifecycle)."""
    from bench_telemetry import TRACE, BenchConfig, load_trace, pregenerate

    config = BenchConfig(profile="h100-llama31-8b", units=4, batch_policy="vllm", seed=0)
    hello, events = pregenerate(config, load_trace(TRACE), n)
    return [hello, *events]


def time_writer(directory: Path, n: int, write: int, stream: str) -> tuple[float, float]:
    """Step rows and events per second of ``StoreWriter.write`` (``write`` events a call) + ``flush``, into a
    fresh file, of ``n`` step events (``stream`` "steps") or of a node's stream of ``n`` events ("node")."""
    events: list[Event] = list(steps(n)) if stream == "steps" else node_stream(n)
    num_steps = sum(1 for e in events if type(e) is StepEvent)
    writes = [events[i:i + write] for i in range(0, len(events), write)]
    with StoreWriter(directory / "timed.duckdb") as writer:
        t0 = time.perf_counter()
        for chunk in writes:
            writer.write(chunk)
        writer.flush()
        elapsed = time.perf_counter() - t0
    return num_steps / elapsed, len(events) / elapsed


RESULT = "RESULT "
"""The prefix of a child run's one line of JSON."""


def describe_tree(path: Path) -> str:
    """Commit, and whether the store's sources differ from it."""
    dirty = git(path, "status", "--porcelain", "--", "store", "agent/telemetry")
    return git(path, "rev-parse", "--short", "HEAD") + (" + uncommitted changes in store/" if dirty else "")


def run_against(rev: str, repeat: int, n: int, write: int, stream: str) -> None:
    root = Path(__file__).resolve().parents[2]
    with worktree(rev) as other:
        trees = {"A": root, "B": other}
        print(f"A: this tree ({describe_tree(root)}); B: {rev} ({describe_tree(other)}); {n:,} "
              f"{'step events' if stream == 'steps' else 'events of a node stream'}, "
              f"{write:,} a write, {repeat} runs each, alternately")
        rates: dict[str, list[float]] = {"A": [], "B": []}
        for i, label in enumerate(["A", "B"] * repeat):
            argv = [sys.executable, __file__, "--child", "--ingest", str(n), "--write", str(write), "--stream", stream]
            env = {**os.environ, "PYTHONPATH": str(trees[label])}
            done = subprocess.run(argv, cwd=trees[label], env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"the run in {trees[label]} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
            result = json.loads(lines[-1].removeprefix(RESULT))
            if not Path(result["store"]).resolve().is_relative_to(trees[label].resolve()):
                raise SystemExit(f"the run meant for {trees[label]} imported store from {result['store']}")
            rates[label].append(result["rows_per_s"])
            print(f"run {i + 1} ({label}): {result['rows_per_s']:,.0f} step rows/s, {result['events_per_s']:,.0f} "
                  "events/s", flush=True)
    a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
    print(f"StoreWriter.write+flush, median step rows/s: A {a:,.0f}, B {b:,.0f}; ratio A/B {a / b:.3f}")


def build_big(path: Path, rows: int) -> None:
    con = connect(path)
    t0 = time.perf_counter()
    con.execute(f"""
        INSERT INTO steps SELECT 'bench', 1, s, {T0} + s * {STEP_GAP_NS}, s % 8, s // 8, 8000000 + s % 4000000,
            9000000, 'mixed', CASE WHEN s % 8 < 4 THEN 'vllm' ELSE 'sarathi' END, s % 2048, s % 64, s % 3, s % 64,
            s % 100000, 2048, s % 10000, 10000, s % 64, s % 5, 0, s % 2, '{{}}'
        FROM range(1, {rows} + 1) t(s)
    """)
    n_req = rows // 10
    con.execute(f"""
        INSERT INTO requests SELECT 'bench', 1, {rows} + i, {T0} + i * {STEP_GAP_NS * 10} + 5000000000,
            'r' || i, i % 8, FALSE, {T0} + i * {STEP_GAP_NS * 10}, {T0} + i * {STEP_GAP_NS * 10} + 300000000,
            500, 200, 0, 300 + (i * 7919) % 700, 20 + (i * 104729) % 40, 800, 50,
            300 + (i * 7919) % 700 <= 800 AND 20 + (i * 104729) % 40 <= 50,
            CASE WHEN i % 8 < 4 THEN 'vllm' ELSE 'sarathi' END, NULL
        FROM range({n_req}) t(i)
    """)
    con.execute("CHECKPOINT")
    con.close()
    size = path.stat().st_size / 2**20
    print(f"built {rows:,} step rows + {n_req:,} requests in {time.perf_counter() - t0:.1f} s ({size:,.0f} MiB)")


def bench_queries(path: Path, rows: int, out_dir: Path) -> None:
    con = connect(path, read_only=True)
    mid = T0 + rows // 2 * STEP_GAP_NS
    ten_min = 600 * 10**9
    cases: list[tuple[str, Callable[[], object]]] = [
        ("policy_summary (all)", lambda: policy_summary(con)),
        ("policy_summary (10-minute window)", lambda: policy_summary(con, start_ns=mid, end_ns=mid + ten_min)),
        ("policy_summary (60 s buckets)", lambda: policy_summary(con, window_s=60.0)),
        ("unit_balance (all)", lambda: unit_balance(con)),
        ("unit_balance (10-minute window)", lambda: unit_balance(con, start_ns=mid, end_ns=mid + ten_min)),
        ("replay steps, unit 3, 10-minute window",
         lambda: sum(1 for _ in replay(con, kinds=["step"], unit_ids=[3], start_ns=mid, end_ns=mid + ten_min))),
    ]
    for name, fn in cases:
        print(f"{name:<42} {timed(fn, repeat=3) * 1e3:8.1f} ms (best of 3)")
    con.close()
    t = timed(lambda: export_parquet(path, out_dir))
    size = sum(p.stat().st_size for p in out_dir.iterdir()) / 2**20
    print(f"{'export_parquet (all tables)':<42} {t * 1e3:8.1f} ms ({size:,.0f} MiB of Parquet)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ingest", type=int, default=1_000_000, help="step events for the ingestion runs")
    parser.add_argument("--batch", type=int, default=122_880, help="rows per batch (StoreWriter batch_rows)")
    parser.add_argument("--rows", type=int, default=10_000_000, help="step rows of the query benchmark's file")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary files go (default: a temp dir)")
    parser.add_argument("--against", metavar="REV", help="time the writer in this tree and REV's, alternately")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tree with --against (default 3)")
    parser.add_argument("--write", type=int, default=122_880, help="events per write call with --against")
    parser.add_argument("--stream", choices=["steps", "node"], default="steps",
                        help="with --against: step events only, or a simulated node's whole stream")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            rate, events_rate = time_writer(Path(tmp), args.ingest, args.write, args.stream)
        print(RESULT + json.dumps({"rows_per_s": rate, "events_per_s": events_rate,
                                   "store": str(Path(store.__file__).parent)}))
        return
    print(f"duckdb {duckdb.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"{platform.machine()}")
    if args.against:
        run_against(args.against, args.repeat, args.ingest, args.write, args.stream)
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        bench_ingest(directory, args.ingest, args.batch)
        if not args.rows:
            return
        big = directory / "big.duckdb"
        build_big(big, args.rows)
        bench_queries(big, args.rows, directory / "parquet")


if __name__ == "__main__":
    main()
