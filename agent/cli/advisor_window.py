"""The advisor's what-if step on the recorder's own store: :class:`StoreAnalyst`, and :func:`advise_beside`.

The store file is locked to other processes while ``trackside record`` writes it, so the windows are read through a
connection of the recorder's (:meth:`store.recorder.Recorder.cursor`), in a thread; it sees what is committed (at
least every ``--flush-s``). The replays run in a pool of worker processes kept for the advisor's life, at a lower
priority (``nice`` 10) and deaf to ^C, started from a fork server (never forked from the recorder, whose threads hold
DuckDB and the writer): recording never waits for them.

A node's window is the last ``window_s`` of its clock up to its latest recorded arrival (its events' ``time_ns``:
wall clock for a live node, node time for simulated units at ``--speed``), from its current run's start at the
earliest. The profile is the one the node names (``hello.profile``) when it is a known one, else fitted on the
window's steps as ``trackside whatif --profile auto`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeVar

from agent.bench.runner import BenchConfig
from agent.bench.whatif import Recorded, candidate_configs, recorded_summary, run_all, whatif_report
from agent.cli.advisor import Advisor, AdvisorSettings, Assessment, Observed, Skipped, WatchedNode
from agent.cli.whatif import WhatIfError, as_recorded, candidates_of, fit_window_profile, running_config
from agent.engine.profiles import UnknownProfileError, load_profile
from agent.telemetry import NodeHello

if TYPE_CHECKING:
    import duckdb

    from store.recorder import Recorder
    from store.window import RecordedWindow

T = TypeVar("T")
WORKER_NICE = 10
"""How much lower the replays' worker processes run than the recorder."""

_LATEST_SQL = ("SELECT max(time_ns) FROM request_events WHERE node_id = ? AND boot_ns = ? AND kind = "
               "'request_arrived'")
_LATEST_OUTCOME_SQL = "SELECT max(time_ns) FROM requests WHERE node_id = ? AND boot_ns = ?"
_FIRST_AFTER_SQL = ("SELECT min(time_ns) FROM request_events WHERE node_id = ? AND boot_ns = ? AND kind = "
                    "'request_arrived' AND seq > ?")


@dataclass(frozen=True, slots=True)
class _Prepared:
    window: RecordedWindow
    recorded: Recorded
    configs: list[BenchConfig]
    warnings: list[str]
    mark_ns: int


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread; when cancelled, the thread is still waited for (it holds a connection that closes
    after us), then the cancellation goes on."""
    future = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await asyncio.wait([future])
        raise


class StoreAnalyst:
    """:class:`agent.cli.advisor.Analyst` on a store being recorded: ``cursor()`` gives a connection to it (closed
    after each read)."""

    def __init__(self, cursor: Callable[[], duckdb.DuckDBPyConnection], settings: AdvisorSettings) -> None:
        self._cursor = cursor
        self.settings = settings
        self._pool: ProcessPoolExecutor | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="trackside-advisor-")
        self._profile_dirs: dict[str, Path] = {}

    def close(self) -> None:
        """Stop the workers (runs not started are cancelled; one under way finishes) and remove fitted profiles."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the Analyst --------------------------------------------------------------------------------------------
    async def assess(self, node: WatchedNode, window_s: float, since_ns: int) -> Assessment | Skipped:
        prepared = await in_thread(self._prepare, node.hello, window_s, since_ns)
        if isinstance(prepared, Skipped):
            return prepared
        results = await asyncio.to_thread(run_all, prepared.configs, prepared.recorded.requests,
                                          executor=self._executor())
        report = whatif_report(prepared.recorded, results, min_gain=self.settings.min_gain)
        running, window = prepared.configs[0], prepared.window
        return Assessment(
            start_ns=window.start_ns, end_ns=window.end_ns, num_requests=len(prepared.recorded.requests),
            batch_policy=running.batch_policy, dispatch=running.dispatch,
            slo_attainment=float(report["recorded"]["slo_attainment"]), fidelity=report["fidelity"],
            recommendation=report["recommendation"], warnings=tuple(prepared.warnings), mark_ns=prepared.mark_ns,
        )

    async def observe_after(self, node: WatchedNode, after_seq: int, window_s: float) -> Observed | None:
        return await in_thread(self._observe, node.hello, after_seq, window_s)

    # -- in a thread ------------------------------------------------------------------------------------------------
    def _prepare(self, hello: NodeHello, window_s: float, since_ns: int) -> _Prepared | Skipped:
        from store.schema import StoreError
        from store.window import recorded_window

        settings = self.settings
        con = self._cursor()
        try:
            node = [hello.node_id, hello.boot_ns]
            row = con.execute(_LATEST_SQL, node).fetchone()
            if row is None or row[0] is None:
                return Skipped("no request recorded yet in this run of the agent")
            end = int(row[0]) + 1
            outcome = con.execute(_LATEST_OUTCOME_SQL, node).fetchone()
            mark = max(end - 1, int(outcome[0]) if outcome and outcome[0] is not None else 0)
            if mark <= since_ns:
                return Skipped("nothing recorded since the last window (no arrival, no outcome)", mark)
            start = max(end - round(window_s * 1e9), hello.boot_ns)
            try:
                window = recorded_window(con, node_id=hello.node_id, start_ns=start, end_ns=end)
            except StoreError as exc:
                return Skipped(str(exc), mark)
            if len(window.requests) < settings.min_requests:
                behind = f" ({window.num_unfinished:,} more arrived and are still running)" if window.num_unfinished \
                    else ""
                return Skipped(f"{len(window.requests)} finished or refused requests in the window{behind}, fewer "
                               f"than {settings.min_requests}", mark)
            try:
                profile = self._profile(con, window)
                running, warnings = running_config(window, profile, settings.tpot_metric)
                names = argparse.Namespace(compare=",".join(settings.compare) or None,
                                           dispatch=",".join(settings.dispatch) or None, param=[])
                candidates = candidates_of(names, running)
            except WhatIfError as exc:
                return Skipped(str(exc), mark)
            return _Prepared(window, as_recorded(window), candidate_configs(running, candidates), warnings, mark)
        finally:
            con.close()

    def _profile(self, con: duckdb.DuckDBPyConnection, window: RecordedWindow) -> str:
        """The node's named profile when it is a known one, else a profile fitted on the window's steps (a file)."""
        try:
            load_profile(window.hello.profile)
            return window.hello.profile
        except (UnknownProfileError, ValueError, OSError):
            pass
        out = self._profile_dirs.get(window.node_id)
        if out is None:
            out = self._profile_dirs[window.node_id] = Path(self._tmp.name) / f"node-{len(self._profile_dirs)}"
            out.mkdir()
        path, _ = fit_window_profile(con, window, out)
        return path

    def _observe(self, hello: NodeHello, after_seq: int, window_s: float) -> Observed | None:
        from store.window import recorded_window

        con = self._cursor()
        try:
            node = [hello.node_id, hello.boot_ns]
            first = con.execute(_FIRST_AFTER_SQL, [*node, after_seq]).fetchone()
            latest = con.execute(_LATEST_SQL, node).fetchone()
            if first is None or first[0] is None or latest is None or latest[0] is None:
                return None
            start, end = int(first[0]), int(first[0]) + round(window_s * 1e9)
            if int(latest[0]) < end:
                return None
            window = recorded_window(con, node_id=hello.node_id, start_ns=start, end_ns=end)
        finally:
            con.close()
        recorded = as_recorded(window)
        summary = recorded_summary(recorded, BenchConfig(tpot_metric=self.settings.tpot_metric))
        return Observed(start, end, len(recorded.requests), float(summary["slo_attainment"]))

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            self._pool = ProcessPoolExecutor(max_workers=self.settings.jobs, mp_context=multiprocessing.get_context(
                method), initializer=_worker_init)
        return self._pool


def _worker_init() -> None:
    """A replay worker: a lower priority than the recorder, and deaf to ^C (the recorder stops its workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WORKER_NICE)


async def advise_beside(recorder: Recorder, advisor: Advisor) -> None:
    """The recorder's companion (``store.recorder.record_agents(companion=...)``): ``advisor`` on a
    :class:`StoreAnalyst` that reads the store through the recorder, until cancelled."""
    with StoreAnalyst(recorder.cursor, advisor.settings) as analyst:
        advisor.analyst = analyst
        await advisor.run()
