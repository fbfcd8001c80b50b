"""The ``trackside`` command line.

Subcommands: ``bench`` (replay a workload through simulated units), ``policies`` (every policy and its
parameters), ``profiles`` (calibration profiles and their fit error). Errors in what the user typed or
gave us (a bad trace line, an unknown policy, a parameter out of range) print one line and exit 2. The commands
that take policy names register the installed policy plugins first (``agent.plugins``; a broken one is one warning
line on stderr, and skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agent.bench.knee import KneeResult, KneeSearch, KnownKnee, knee_sweep
from agent.bench.report import offered_rps
from agent.bench.runner import TOPOLOGIES, BenchConfig, Fault, RunResult, run_once, scale_arrivals
from agent.bench.tuning import TUNED_POLICY, SarathiTuning, apply_tuning, tuning_json
from agent.cli.calibrate import CALIBRATE_COMMANDS, add_calibrate_command
from agent.cli.common import csv_items, load_policy_plugins
from agent.cli.node_config import NodeConfigError
from agent.cli.regimes import REGIMES_COMMANDS, add_regimes_command
from agent.cli.render import (
    policies_json,
    policies_text,
    profiles_table,
    render_cluster,
    render_knee,
    render_peaks,
    render_runs,
    render_tuning,
    render_units,
)
from agent.cli.serve import HANDLED_ERRORS, SERVE_COMMANDS, add_serve_commands, with_node_config
from agent.cli.tuning import DEFAULT_GRID_TEXT, TuningError, run_label, run_tuning, tuning_grid
from agent.cli.whatif import WHATIF_COMMANDS, add_whatif_commands
from agent.engine.profiles import UnknownProfileError, fit_report, list_profiles, load_profile
from agent.engine.timing import INTERFERENCE_ON
from agent.telemetry import DEFAULT_TPOT_METRIC, TPOT_METRICS
from agent.workload.spec import describe_presets, parse_workload
from agent.workload.traces import load_trace
from agent.workload.types import RequestSpec, WorkloadError
from policies.params import ParamError, parse_assignments
from policies.registry import BATCH_POLICIES, DISPATCH_POLICIES, UnknownPolicyError
from store.cli import STORE_COMMANDS, add_store_commands

EXIT_USAGE = 2


class CliError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""


def version_line() -> str:
    """``trackside VERSION (python X.Y.Z; code: compiled | pure...)``: the code state is ``policies._compiled``'s."""
    from importlib.metadata import PackageNotFoundError, version

    from policies._compiled import STATE

    try:
        ours = version("trackside")
    except PackageNotFoundError:  # run from a checkout that is not installed
        ours = "(not installed)"
    return f"trackside {ours} (python {sys.version.split()[0]}; code: {STATE})"


class _VersionAction(argparse.Action):
    """``--version``, with the line made only when asked for (reading the installed metadata takes ~40 ms, which
    every other command would pay at start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(version_line() + "\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trackside",
        description="Operator console and control plane for LLM serving: research scheduling policies, "
        "step telemetry, and a simulator calibrated on H100 measurements.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="the version, the Python it runs on, and whether its hot path runs compiled")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    presets = "; ".join(f"{name}: {text}" for name, text in describe_presets())
    bench = sub.add_parser(
        "bench",
        help="replay a trace or synthetic workload through simulated engine units",
        description="Replay a workload through simulated engine units in virtual time (as fast as the "
        "machine allows, deterministic for a seed), then print throughput, goodput, TTFT/TPOT "
        "percentiles, SLO attainment and per-unit load.",
        epilog=f"Workload presets: {presets}. Example: trackside bench --trace "
        "examples/traces/azure_code_2023.csv --units 4 --batch-policy vllm --dispatch least_loaded "
        "--json out.json",
    )
    src = bench.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="trace file: Azure LLM trace CSV or trackside JSONL")
    src.add_argument(
        "--workload", metavar="SPEC",
        help="synthetic workload NAME[:key=value,...], e.g. sharegpt-like or bursty:rate=12,n=2000",
    )
    bench.add_argument("--units", type=int, default=4, help="simulated DP units (default 4)")
    bench.add_argument("--batch-policy", default="vllm", help="per-step batch policy (default vllm)")
    bench.add_argument(
        "--dispatch", default="least_loaded",
        help="dispatch policy, or several comma-separated to compare them (default least_loaded)",
    )
    bench.add_argument(
        "--compare", metavar="P1,P2,...", help="compare these batch policies side by side (overrides "
        "--batch-policy)",
    )
    bench.add_argument(
        "--sweep", metavar="time-scale=V1,V2,...|knee",
        help="load sweep over arrival time scales, reporting each policy's peak goodput; or 'knee': find the best "
        "baseline's (vllm, sarathi) load at --slo-target attainment, then run every policy at --knee-points loads "
        "from 0.8x to 1.3x of it and report each one's sustained load and peak effective RPS against it",
    )
    bench.add_argument("--knee-points", type=int, default=8, metavar="N",
                       help="--sweep knee: loads run around the knee (default 8)")
    bench.add_argument("--knee-band", default="0.8,1.3", metavar="LOW,HIGH",
                       help="--sweep knee: the band, as multiples of the knee load (default 0.8,1.3)")
    bench.add_argument(
        "--tune-sarathi", nargs="?", const=DEFAULT_GRID_TEXT, metavar="B1,B2,...",
        help=f"tune sarathi's token_budget per dispatch before comparing, as the papers tune their baseline: the "
        f"budget of the grid (default {DEFAULT_GRID_TEXT}) that sustains the highest load at --slo-target attainment "
        "(the --sweep knee search; ties to the smaller), then used in every sarathi run (docs/benchmarks.md)",
    )
    bench.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE",
        help="policy parameter (repeatable); POLICY.NAME=VALUE targets one policy",
    )
    bench.add_argument("--profile", default="h100-llama31-8b", help="calibration profile (see `trackside "
                       "profiles`; default h100-llama31-8b), or a profile file from `trackside calibrate`")
    bench.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT target in ms (default 500)")
    bench.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT target in ms (default 50)")
    bench.add_argument(
        "--tpot-metric", choices=TPOT_METRICS, default=DEFAULT_TPOT_METRIC,
        help=f"the TPOT that percentiles and SLO attainment use: worst, each request's worst per-token TPOT (seed "
        f"003); mean, (last - first token) / (outputs - 1) (default {DEFAULT_TPOT_METRIC}; docs/benchmarks.md)",
    )
    bench.add_argument(
        "--slo-target", type=float, default=0.9,
        help="attainment at which a sweep reports the sustained load (default 0.9 = 90%% of requests)",
    )
    bench.add_argument("--seed", type=int, default=0, help="random seed (workload generation, noise)")
    bench.add_argument(
        "--time-scale", type=float, default=1.0,
        help="multiply inter-arrival times (2 = half the load; default 1)",
    )
    bench.add_argument("--limit", type=int, help="replay only the first N requests")
    bench.add_argument("--noise", action="store_true", help="apply the profile's measured step-time noise")
    bench.add_argument(
        "--heterogeneity", action="store_true",
        help="apply the measured slowdown of length-heterogeneous batches (at most +9.5%%)",
    )
    bench.add_argument("--no-online-fit", action="store_true", help="keep policies' step model at the profile")
    bench.add_argument("--max-num-seqs", type=int, help="override the profile's max_num_seqs")
    bench.add_argument("--max-num-batched-tokens", type=int, help="override the profile's token budget cap")
    bench.add_argument("--kv-blocks", type=int, help="override the profile's KV capacity (blocks)")
    bench.add_argument(
        "--interference-on", choices=INTERFERENCE_ON, default="step",
        help="what the profile's mixed-batch interference slows: the whole step (default, kappa) or the "
        "attention (context) term only (kappa_attention: seed 002's kernel breakdown; docs/simulator.md)",
    )
    bench.add_argument(
        "--topology", choices=TOPOLOGIES, default="colocated",
        help="colocated: every unit prefills and decodes (default); disaggregated: prefill units hand requests "
        "with their KV to decode units",
    )
    bench.add_argument("--prefill-units", type=int, help="disaggregated: units in the prefill pool (default half)")
    bench.add_argument(
        "--lockstep", action="store_true",
        help="DP+EP: all units step together and a step lasts as long as the slowest unit's",
    )
    bench.add_argument(
        "--instance-size", type=int, default=0, metavar="M",
        help="seed 000's instances: consecutive groups of M units step in lockstep (DP+EP), the instances out of "
        "phase with each other (default 0: none)",
    )
    bench.add_argument(
        "--pass-sync-ms", type=float, default=0.0, metavar="MS",
        help="with --lockstep or --instance-size: a synchronisation cost added to every lockstep pass, however "
        "full (a DP+EP pass's all-to-all and barrier; default 0, as on a dense model)",
    )
    bench.add_argument(
        "--migration", choices=("live", "recompute"), default="live",
        help="how a moved request's KV travels: live copy over the link (default) or recompute on the target",
    )
    bench.add_argument(
        "--kv-bandwidth-gb-s", type=float, default=50.0,
        help="link bandwidth for KV transfers in GB/s (default 50, one 400 Gb/s NIC)",
    )
    bench.add_argument(
        "--fault", action="append", default=[], metavar="UNIT@S[+DOWN]",
        help="unit UNIT fails at S seconds (node time) and comes back after DOWN seconds (repeatable); its "
        "requests go back to the dispatcher and recompute elsewhere",
    )
    bench.add_argument("--json", type=Path, metavar="PATH", help="write the numbers as JSON")
    bench.add_argument("--outcomes", type=Path, metavar="FILE.csv|FILE.parquet",
                       help="write one row per finished request of every run (unit, arrival, first token, finish, "
                       "tokens, preemptions, TTFT, E2E, TPOT, SLO met) as CSV or Parquet, to compare with another "
                       "simulator or a real run (agent/bench/outcomes.py)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")

    pol = sub.add_parser("policies", help="list every policy with its parameters")
    pol.add_argument("--json", action="store_true", help="print the parameter schemas as JSON")
    prof = sub.add_parser("profiles", help="list calibration profiles and their fit error on their records")
    prof.add_argument("--json", action="store_true", help="print the fit report as JSON")
    add_serve_commands(sub)
    add_store_commands(sub)
    add_calibrate_command(sub)
    add_regimes_command(sub)
    add_whatif_commands(sub)
    for name, text in UI_COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


UI_COMMANDS = {
    "console": "the operator console (Textual): live agents, or --replay a store (see `trackside console --help`)",
    "demo": "the console on local simulated agents with a scripted story (--scenario; default showcase: two "
    "nodes, one staged, a unit failure and a policy swap), recording to DuckDB (see `trackside demo --help`)",
}
"""Commands of the ``console`` package. The agent imports no UI: these hand the process over to
``python -m console`` with the same arguments."""


def _hand_over_to_console(argv: Sequence[str], *, replace_process: bool) -> int:
    """Run ``python -m console ARGV``: in place of this process (the command line), or as a child whose exit
    status is returned (an in-process call, e.g. from a test)."""
    command = [sys.executable, "-m", "console", *argv]
    if replace_process:
        os.execv(sys.executable, command)
    return subprocess.call(command)


def _load_workload(args: argparse.Namespace) -> list[RequestSpec]:
    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be >= 1")
    if args.time_scale <= 0:
        raise CliError("--time-scale must be > 0")
    if args.trace is not None:
        return load_trace(args.trace, time_scale=args.time_scale, limit=args.limit)
    requests = parse_workload(args.workload, seed=args.seed)
    if args.time_scale != 1.0:
        requests = scale_arrivals(requests, args.time_scale)
    return requests[: args.limit] if args.limit else requests


def _faults(texts: Sequence[str]) -> list[Fault]:
    try:
        return [Fault.parse(t) for t in texts]
    except ValueError as exc:
        raise CliError(f"--fault: {exc}") from None


def _plan_runs(args: argparse.Namespace) -> list[BenchConfig]:
    if args.units < 1:
        raise CliError("--units must be >= 1")
    batch_policies = csv_items(args.compare) if args.compare else [args.batch_policy]
    dispatches = csv_items(args.dispatch)
    if not batch_policies or not dispatches:
        raise CliError("name at least one batch policy and one dispatch policy")
    for name in batch_policies:
        if name not in BATCH_POLICIES:
            raise CliError(f"unknown batch policy {name!r} (known: {', '.join(sorted(BATCH_POLICIES))})")
    for name in dispatches:
        if name not in DISPATCH_POLICIES:
            raise CliError(f"unknown dispatch policy {name!r} (known: {', '.join(sorted(DISPATCH_POLICIES))})")
    scales = [1.0]
    if args.sweep and args.sweep.strip() != "knee":
        key, sep, values = args.sweep.partition("=")
        if key.strip() != "time-scale" or not sep:
            raise CliError(f"--sweep takes time-scale=V1,V2,... or knee (got {args.sweep!r})")
        try:
            scales = [float(v) for v in csv_items(values)]
        except ValueError:
            raise CliError(f"--sweep: time scales must be numbers (got {values!r})") from None
        if not scales or min(scales) <= 0:
            raise CliError("--sweep: give at least one time scale, each > 0")
    params = parse_assignments(args.param)
    for key in params:
        owner, dot, name = key.rpartition(".")
        if not dot:
            continue
        cls = BATCH_POLICIES.get(owner) or DISPATCH_POLICIES.get(owner)
        if cls is None:
            raise CliError(f"--param {key}: no policy named {owner!r}")
        if name not in {p.name for p in cls.params_schema}:
            known = ", ".join(p.name for p in cls.params_schema) or "none"
            raise CliError(f"--param {key}: {owner} has no parameter {name!r} (its parameters: {known})")
    base = BenchConfig(
        profile=args.profile, units=args.units, params=params, ttft_slo_ms=args.slo_ttft_ms,
        tpot_slo_ms=args.slo_tpot_ms, tpot_metric=args.tpot_metric, seed=args.seed, noise=args.noise,
        heterogeneity=args.heterogeneity, interference_on=args.interference_on,
        online_fit=not args.no_online_fit, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_gpu_blocks=args.kv_blocks,
        topology=args.topology, prefill_units=args.prefill_units, lockstep=args.lockstep,
        instance_size=args.instance_size, pass_sync_ms=args.pass_sync_ms, migration=args.migration,
        kv_bandwidth_gb_s=args.kv_bandwidth_gb_s, faults=tuple(_faults(args.fault)),
    )
    try:
        base.roles()
        base.pass_groups()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.kv_bandwidth_gb_s <= 0:
        raise CliError("--kv-bandwidth-gb-s must be > 0")
    if any(f.unit_id >= args.units for f in base.faults):
        raise CliError(f"--fault names a unit beyond --units {args.units} (units are 0..{args.units - 1})")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise CliError("SLO targets must be > 0 ms")
    for opt, value in (("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens",
                       args.max_num_batched_tokens), ("--kv-blocks", args.kv_blocks)):
        if value is not None and value < 1:
            raise CliError(f"{opt} must be >= 1")
    runs = []
    for scale in scales:
        for bp in batch_policies:
            for dp in dispatches:
                runs.append(replace(base, batch_policy=bp, dispatch=dp, time_scale=scale))
    return runs


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    requests = _load_workload(args)
    if not requests:
        raise CliError("the workload has no requests")
    if not 0.0 < args.slo_target <= 1.0:
        raise CliError("--slo-target must be in (0, 1]")
    if args.outcomes is not None and args.outcomes.suffix not in (".csv", ".parquet"):
        raise CliError(f"--outcomes writes .csv or .parquet files, not {args.outcomes.name!r}")
    configs = _plan_runs(args)
    load_profile(args.profile)  # fail early on an unknown profile
    knee = _knee_search(args) if args.sweep and args.sweep.strip() == "knee" else None
    grid = tuning_grid(args)
    tunings: dict[str, SarathiTuning] = {}
    tuned: dict[str, Any] | None = None
    tuning_s = 0.0
    results: list[RunResult] = []
    show = not args.no_progress
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[unit]}"),
        TimeElapsedColumn(), console=Console(stderr=True), disable=not show, transient=False,
    ) as progress:

        def run_at(config: BenchConfig) -> RunResult:
            label = run_label(config, grid is not None, bool(args.sweep))
            task = progress.add_task(label, total=len(requests), unit="requests")

            def report(done: int, total: int) -> None:
                progress.update(task, completed=done)

            result = run_once(config, requests, progress=report)
            progress.update(task, completed=len(requests))
            if result.unfinished:
                console.print(
                    f"[yellow]warning:[/] {result.unfinished} requests could not be scheduled "
                    f"({label}); they count as missed"
                )
            return result

        if grid is not None:
            search = knee or _knee_search(args)
            tunings, tuning_s = run_tuning(configs, run_at, search, grid, progress, knee is not None)
            tuned = tuning_json(tunings, search, grid)
            configs = apply_tuning(configs, tunings)
        if knee is not None:
            known: dict[str, KnownKnee] = {}
            for dispatch, tuning in tunings.items():
                if (chosen := tuning.known_knee()) is not None:
                    known[f"{TUNED_POLICY}/{dispatch}"] = chosen
            try:
                found = knee_sweep(configs, run_at, knee, offered_rps([r.arrival_s for r in requests]), known)
            except ValueError as exc:
                raise CliError(f"--sweep knee: {exc}") from None
            results = found.band_runs
        else:
            results = [run_at(config) for config in configs]
    if args.outcomes is not None:
        _write_outcomes(console, results, args.outcomes)
    if tunings:
        render_tuning(console, tunings, args.slo_target, tuning_s)
    if knee is not None:
        return _knee_report(console, found, args, tuned)
    single = len(results) == 1
    render_runs(console, results)
    if single or any(r.config.dispatch != results[0].config.dispatch for r in results) or args.topology != (
        "colocated"
    ) or args.fault:
        render_cluster(console, results)
    if single:
        render_units(console, results[0])
    if args.sweep:
        render_peaks(console, results, args.slo_target)
    if args.json:
        payload: dict[str, Any]
        if single:
            r = results[0]
            payload = {"summary": r.summary, "config": _config_json(r, args), "cluster": r.cluster, "units": r.units}
        else:
            payload = {"runs": [r.as_run() for r in results], "config": _config_json(results[0], args)}
        if tuned is not None:
            payload["sarathi_tuning"] = tuned
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _write_outcomes(console: Console, results: Sequence[RunResult], path: Path) -> None:
    """``--outcomes``: CSV directly, Parquet through DuckDB from the same rows."""
    from agent.bench.outcomes import write_outcomes_csv

    if path.suffix == ".csv":
        n = write_outcomes_csv(results, path)
    else:
        import tempfile

        import duckdb

        with tempfile.TemporaryDirectory() as tmp:
            csv_path = Path(tmp) / "outcomes.csv"
            n = write_outcomes_csv(results, csv_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect()
            try:
                src, dst = (str(p).replace("'", "''") for p in (csv_path, path))  # SQL string literals
                con.execute(f"COPY (SELECT * FROM read_csv('{src}', header=true)) TO '{dst}' (FORMAT parquet)")
            finally:
                con.close()
    console.print(f"wrote {n:,} request outcomes to {path}")


def _knee_search(args: argparse.Namespace) -> KneeSearch:
    low, _, high = args.knee_band.partition(",")
    try:
        return KneeSearch(target=args.slo_target, points=args.knee_points, low=float(low), high=float(high))
    except ValueError as exc:
        raise CliError(f"--sweep knee: --knee-band LOW,HIGH with 0 < LOW < HIGH and --knee-points >= 2 ({exc})") \
            from None


def _knee_report(console: Console, found: KneeResult, args: argparse.Namespace,
                 tuned: dict[str, Any] | None) -> int:
    render_knee(console, found)
    if found.knee_rps is None:
        console.print("[yellow]no baseline's knee was found[/]: every baseline met the target at the heaviest load "
                      "tried, or missed it at the lightest (see the search runs; try --time-scale)")
    if args.json:
        payload: dict[str, Any] = {"runs": [r.as_run() for r in found.band_runs], "knee": found.as_json()}
        any_run = (found.band_runs or found.search_runs)[0]
        payload["config"] = _config_json(any_run, args)
        if tuned is not None:
            payload["sarathi_tuning"] = tuned
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0 if found.knee_rps is not None else 1


def _config_json(result: RunResult, args: argparse.Namespace) -> dict[str, Any]:
    cfg = result.config.describe()
    cfg["batch_params"] = result.batch_params
    cfg["dispatch_params"] = result.dispatch_params
    cfg["workload"] = str(args.trace) if args.trace is not None else args.workload
    cfg["limit"] = args.limit
    cfg["input_time_scale"] = args.time_scale
    return cfg


def cmd_policies(args: argparse.Namespace, console: Console) -> int:
    plugins = load_policy_plugins()
    if args.json:
        payload = {
            "batch": policies_json(BATCH_POLICIES.values(), plugins),
            "dispatch": policies_json(DISPATCH_POLICIES.values(), plugins),
        }
        print(json.dumps(payload, indent=2))
        return 0
    print(policies_text("Batch policies (per step, per unit)", BATCH_POLICIES.values(), plugins))
    print()
    print(policies_text("Dispatch policies (across DP units)", DISPATCH_POLICIES.values(), plugins))
    return 0


def cmd_profiles(args: argparse.Namespace, console: Console) -> int:
    reports = {name: fit_report(name) for name in list_profiles()}
    if args.json:
        print(json.dumps(reports, indent=2))
    else:
        console.print(profiles_table(reports))
    return 0


COMMANDS = {
    "bench": cmd_bench, "policies": cmd_policies, "profiles": cmd_profiles, **SERVE_COMMANDS, **STORE_COMMANDS,
    **CALIBRATE_COMMANDS, **WHATIF_COMMANDS, **REGIMES_COMMANDS,
}
PLUGIN_COMMANDS = ("bench", "policies", "agent", "whatif", "regimes")
"""Commands that resolve policy names: they register the installed policy plugins first (``agent.plugins``)."""
USER_ERRORS: tuple[type[Exception], ...] = (
    CliError, TuningError, WorkloadError, ParamError, UnknownPolicyError, UnknownProfileError, *HANDLED_ERRORS,
)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in UI_COMMANDS:
        return _hand_over_to_console(args_list, replace_process=argv is None)
    parser = build_parser()
    try:
        args_list = with_node_config(args_list)
    except NodeConfigError as exc:
        print(f"trackside agent: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(args_list)
    args.argv = args_list  # as given, the config file expanded (trackside agent --agents starts its agents with it)
    if args.command in PLUGIN_COMMANDS:
        load_policy_plugins()
    console = Console()
    try:
        return COMMANDS[args.command](args, console)
    except USER_ERRORS as exc:
        # KeyError subclasses would print their message quoted: take the argument as it is.
        message = str(exc.args[0]) if exc.args else str(exc)
        print(f"trackside {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
