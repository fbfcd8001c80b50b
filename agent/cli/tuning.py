"""``trackside bench --tune-sarathi [GRID]``: what the command line adds to :mod:`agent.bench.tuning` (the grid as
typed, the cases to tune, progress while it runs).

With ``--sweep knee`` Sarathi is a baseline under every dispatch compared, so it is tuned under each; otherwise
under each dispatch it is compared under, and it must be compared. The tuned budget then replaces Sarathi's own
in every run that follows (and in the knee search, which reuses the tuning's runs for the chosen budget).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from rich.progress import Progress, TaskID

from agent.bench.knee import KneeSearch, RunAt
from agent.bench.runner import BenchConfig
from agent.bench.tuning import (
    DEFAULT_GRID,
    TUNED_KEY,
    TUNED_POLICY,
    BudgetScore,
    SarathiTuning,
    case_grid,
    parse_grid,
    tune_sarathi,
)

DEFAULT_GRID_TEXT = ",".join(map(str, DEFAULT_GRID))


class TuningError(Exception):
    """A problem with ``--tune-sarathi`` as given (one line, exit status 2)."""


def tuning_grid(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The grid ``--tune-sarathi`` asks for (None: no tuning)."""
    if args.tune_sarathi is None:
        return None
    try:
        grid = parse_grid(args.tune_sarathi)
    except ValueError as exc:
        raise TuningError(f"--tune-sarathi: {exc}") from None
    if any(a.partition("=")[0].strip() == TUNED_KEY for a in args.param):
        raise TuningError(f"--tune-sarathi chooses {TUNED_KEY}: drop --param {TUNED_KEY}=...")
    return grid


def cases(configs: Sequence[BenchConfig], knee: bool) -> list[str]:
    """The dispatches Sarathi is tuned under: all of them for a knee sweep (it is a baseline), else those it is
    compared under."""
    dispatches = [c.dispatch for c in configs if knee or c.batch_policy == TUNED_POLICY]
    if not dispatches:
        raise TuningError(f"--tune-sarathi: {TUNED_POLICY} is not compared (add it to --compare, or use --sweep knee, "
                          "where it is a baseline)")
    return list(dict.fromkeys(dispatches))


def run_tuning(configs: Sequence[BenchConfig], run_at: RunAt, search: KneeSearch, grid: Sequence[int],
               progress: Progress, knee: bool) -> tuple[dict[str, SarathiTuning], float]:
    """Tune Sarathi per case, one progress line per case counting the budgets done; the tunings by dispatch and the
    wall seconds they took."""
    started = time.monotonic()
    tunings: dict[str, SarathiTuning] = {}
    for dispatch in cases(configs, knee):
        base = next(c for c in configs if c.dispatch == dispatch)
        total = len(case_grid(base, grid))
        task = progress.add_task(f"tuning {TUNED_POLICY}/{dispatch}", total=total, unit="budgets")

        def advance(_: BudgetScore, task_id: TaskID = task) -> None:
            progress.advance(task_id)

        tunings[dispatch] = tune_sarathi(base, run_at, search, grid, on_budget=advance)
    return tunings, time.monotonic() - started


def run_label(config: BenchConfig, tuning: bool, sweep: bool) -> str:
    """A run's progress line: ``batch/dispatch``, Sarathi's budget when tuning, the time scale in a sweep or a
    tuning."""
    label = f"{config.batch_policy}/{config.dispatch}"
    budget = config.params.get(TUNED_KEY) if tuning and config.batch_policy == TUNED_POLICY else None
    if budget is not None:
        label = f"{TUNED_POLICY}@{budget}/{config.dispatch}"
    if sweep or tuning:
        label += f" x{config.time_scale:.3g}"
    return label
