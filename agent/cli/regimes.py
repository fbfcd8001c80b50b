"""``trackside regimes``: which batch policy wins where, over load, SLO strictness and burstiness.

    trackside regimes --trace examples/traces/azure_code_2023.csv --limit 1000 --png map.png --json map.json
    trackside regimes --workload sharegpt-like --slo 500/50,2000/100 --burstiness trace,4 --time-scales 1,0.5
    trackside regimes --workload sharegpt-like --knee-loads 0.8,1,1.25,1.6     # loads as multiples of the knee

Every candidate batch policy replays the workload in every cell of the grid (:mod:`agent.bench.regimes`); the map
is printed as one table per burstiness value and can be written as JSON (``--json``) and as a PNG heatmap
(``--png``). Wiring as :mod:`agent.cli.calibrate`: ``add_regimes_command(subparsers)`` adds the parser,
:data:`REGIMES_COMMANDS` maps its name to its handler; a problem with what the user gave prints one line on stderr
and returns 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agent.bench.regimes import (
    DEFAULT_BURSTINESS,
    DEFAULT_SLOS,
    RegimeError,
    RegimeGrid,
    RegimeMap,
    knee_time_scales,
    parse_burstiness,
    parse_positive,
    parse_slos,
    regime_map,
)
from agent.bench.runner import BenchConfig
from agent.cli.common import csv_items
from agent.cli.regimes_render import heatmap_png, terminal_map
from agent.engine.profiles import UnknownProfileError, load_profile
from agent.workload.spec import parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec, WorkloadError
from policies.params import ParamError, parse_assignments
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES, UnknownPolicyError

EXIT_USAGE = 2
DEFAULT_TIME_SCALES = "1,0.5,0.3,0.2"
HANDLED = (RegimeError, WorkloadError, ParamError, UnknownPolicyError, UnknownProfileError)


def add_regimes_command(subparsers: Any) -> None:
    """Add ``regimes`` to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "regimes",
        help="which batch policy wins where: a map over load, SLO strictness and burstiness",
        description="Run every candidate batch policy on a workload in every cell of a grid (load as arrival time "
        "scales or multiples of the best baseline's knee, TTFT/TPOT target pairs, arrival burstiness) and print the "
        "winner of each cell by effective req/s (offered load x SLO attainment) with its margin over the "
        "runner-up. Simulated units in virtual time, deterministic for a seed (docs/regimes.md).",
        epilog="Example: trackside regimes --trace examples/traces/azure_code_2023.csv --limit 1000 "
        "--slo 500/50,2000/50 --burstiness trace,4 --png map.png",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, metavar="FILE", help="trace file: Azure LLM trace CSV or trackside JSONL")
    src.add_argument("--workload", metavar="SPEC", help="synthetic workload NAME[:key=value,...], e.g. sharegpt-like")
    p.add_argument("--limit", type=int, metavar="N", help="only the first N requests")
    p.add_argument("--profile", default="h100-llama31-8b", help="calibration profile (default h100-llama31-8b)")
    p.add_argument("--units", type=int, default=4, help="simulated DP units (default 4)")
    p.add_argument("--policies", metavar="P1,P2,...", help="candidate batch policies (default: every registered one)")
    p.add_argument("--dispatch", default="least_loaded", help="dispatch policy (default least_loaded)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="policy parameter (repeatable); POLICY.NAME=VALUE targets one policy")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--time-scales", metavar="V1,V2,...",
                      help=f"loads as arrival time scales, 2 = half the load (default {DEFAULT_TIME_SCALES})")
    load.add_argument("--knee-loads", metavar="M1,M2,...",
                      help="loads as multiples of the best baseline's (vllm, sarathi) knee: the load at which its "
                      "SLO attainment falls to 90%% at --knee-slo on the workload's own arrivals")
    p.add_argument("--knee-slo", metavar="TTFT/TPOT", help="--knee-loads: the SLO pair of the knee (default: the "
                   "first --slo pair)")
    p.add_argument("--slo", default=DEFAULT_SLOS, metavar="TTFT/TPOT,...",
                   help=f"SLO pairs in ms, one map row each (default {DEFAULT_SLOS})")
    p.add_argument("--burstiness", default=DEFAULT_BURSTINESS, metavar="trace|CV,...",
                   help="arrival burstiness, one table each: trace (the workload's arrivals) or the coefficient of "
                   "variation of gamma-distributed gaps at the same mean rate, order and lengths kept (1: "
                   f"Poisson-like; default {DEFAULT_BURSTINESS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the re-timed arrivals (default 0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: one per CPU)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the map as JSON")
    p.add_argument("--png", type=Path, metavar="FILE", help="write the map as a PNG heatmap")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _workload(args: argparse.Namespace) -> tuple[list[RequestSpec], str]:
    if args.limit is not None and args.limit < 2:
        raise RegimeError("--limit must be >= 2")
    if args.trace is not None:
        requests = load_trace(args.trace, limit=args.limit)
        name = args.trace.name
    else:
        requests = parse_workload(args.workload, seed=args.seed)[: args.limit]
        name = args.workload
    label = f"{name}, first {len(requests):,} requests" if args.limit else f"{name} ({len(requests):,} requests)"
    if len(requests) < 2:
        raise RegimeError("the workload needs at least two requests")
    return requests, label


def _base(args: argparse.Namespace, policies: tuple[str, ...]) -> BenchConfig:
    if args.units < 1:
        raise RegimeError("--units must be >= 1")
    if args.jobs < 1:
        raise RegimeError("--jobs must be >= 1")
    if args.dispatch not in DISPATCH_POLICIES:
        raise RegimeError(f"unknown dispatch policy {args.dispatch!r} (known: {', '.join(sorted(DISPATCH_POLICIES))})")
    params = parse_assignments(args.param)
    dispatch_names = {s.name for s in DISPATCH_POLICIES[args.dispatch].params_schema}
    for key in params:
        owner, dot, name = key.rpartition(".")
        cls = BATCH_POLICIES.get(owner) or DISPATCH_POLICIES.get(owner)
        if dot and cls is None:
            raise RegimeError(f"--param {key}: no policy named {owner!r}")
        if dot and cls is not None and name not in {s.name for s in cls.params_schema}:
            raise RegimeError(f"--param {key}: {owner} has no parameter {name!r}")
        lacking = [p for p in policies if name not in {s.name for s in BATCH_POLICIES[p].params_schema}]
        if not dot and name not in dispatch_names and lacking:
            raise RegimeError(f"--param {key}: not a parameter of {', '.join(lacking)} (name the policy: "
                              f"POLICY.{name}=VALUE)")
    load_profile(args.profile)  # an unknown profile fails here, before any run
    return BenchConfig(profile=args.profile, units=args.units, dispatch=args.dispatch, params=params, seed=args.seed)


def _policies(args: argparse.Namespace) -> tuple[str, ...]:
    names = csv_items(args.policies) if args.policies is not None else list(BATCH_POLICIES)
    unknown = [n for n in names if n not in BATCH_POLICIES]
    if unknown or not names:
        raise RegimeError(f"unknown batch policy {', '.join(map(repr, unknown)) or '(none named)'} "
                          f"(known: {', '.join(BATCH_POLICIES)})")
    return tuple(names)


def cmd_regimes(args: argparse.Namespace, console: Console) -> int:
    try:
        return _run(args, console)
    except HANDLED as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        print(f"trackside regimes: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace, console: Console) -> int:
    slos, burstiness = parse_slos(args.slo), parse_burstiness(args.burstiness)
    if args.knee_slo and not args.knee_loads:
        raise RegimeError("--knee-slo goes with --knee-loads")
    knee_slo = parse_slos(args.knee_slo)[0] if args.knee_slo else slos[0]
    policies = _policies(args)
    base = _base(args, policies)
    requests, label = _workload(args)
    for path in (args.json, args.png):
        if path is not None and path.is_dir():
            raise RegimeError(f"{path} is a directory")
    knee: dict[str, Any] | None = None
    err = Console(stderr=True)
    if args.knee_loads:
        multiples = parse_positive(args.knee_loads, "--knee-loads")
        slo = knee_slo
        with err.status(f"finding the baselines' knee at {slo.label} ms", spinner="dots"):
            scales, knee = knee_time_scales(
                requests, replace(base, ttft_slo_ms=slo.ttft_ms, tpot_slo_ms=slo.tpot_ms), multiples, jobs=args.jobs
            )
        console.print(f"knee: {knee['baseline']} sustains {knee['knee_rps']:.3g} req/s at {slo.label} ms")
    else:
        scales = parse_positive(args.time_scales or DEFAULT_TIME_SCALES, "--time-scales")
    grid = RegimeGrid(scales, slos, burstiness, policies)
    with Progress(
        TextColumn("regimes"), BarColumn(), MofNCompleteColumn(), TextColumn("runs"), TimeElapsedColumn(),
        console=err, disable=args.no_progress, transient=False,
    ) as progress:
        task = progress.add_task("regimes", total=grid.num_runs)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done)

        rmap = regime_map(requests, base, grid, workload=label, seed=args.seed, jobs=args.jobs, progress=report,
                          knee=knee)
    console.print(terminal_map(rmap))
    _write(args, rmap, console)
    return 0


def _write(args: argparse.Namespace, rmap: RegimeMap, console: Console) -> None:
    try:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rmap.as_json(), indent=2) + "\n")
            console.print(f"wrote {args.json}")
        if args.png is not None:
            args.png.parent.mkdir(parents=True, exist_ok=True)
            args.png.write_bytes(heatmap_png(rmap))
            console.print(f"wrote {args.png}")
    except OSError as exc:
        raise RegimeError(f"cannot write: {exc}") from None


REGIMES_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"regimes": cmd_regimes}
