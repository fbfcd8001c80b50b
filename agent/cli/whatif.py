"""``trackside whatif`` and ``trackside export``: what a node served, replayed under other policies; or written out.

    trackside whatif --db telemetry.duckdb --node gpu-7 --since 1h                 # every batch policy
    trackside whatif --db telemetry.duckdb --compare sarathi,fairbatching --dispatch least_loaded,pab --json w.json
    trackside whatif --db telemetry.duckdb --apply ws://gpu-7:7700 --token-file ~/.trackside/token
    trackside export --db telemetry.duckdb --node gpu-7 --since 1h --trace window.jsonl

The window's recorded arrivals (``store.window``) become a workload on the window's own time base; the node's shape
(units, topology, lockstep, engine limits) comes from its hello. ``--profile auto`` (the default) fits the step-time
model on the window's recorded steps, as ``trackside calibrate`` does, with the engine limits of the profile the
node named when it has one. The policy that ran is replayed first (the fidelity check), then every candidate; the
ranking, fidelity and recommendation are :mod:`agent.bench.whatif`'s.

Wiring as :mod:`agent.cli.calibrate`: ``add_whatif_commands(subparsers)``, :data:`WHATIF_COMMANDS`. A problem with
the input (no store, no such node, an empty window, a fit that fails) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from websockets.exceptions import WebSocketException

from agent.bench.runner import TOPOLOGIES, BenchConfig
from agent.bench.whatif import (
    FIDELITY_KEYS,
    POOR_FIDELITY,
    Candidate,
    Recorded,
    candidate_configs,
    run_all,
    whatif_report,
)
from agent.cli.calibrate import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, parse_when
from agent.cli.common import csv_items, utc_text
from agent.engine.base import RequestOutcome
from agent.engine.profile_json import profile_to_json
from agent.engine.profiles import UnknownProfileError, load_profile
from agent.engine.step_calibration import CalibrationError, profile_from_steps
from agent.telemetry import DEFAULT_TPOT_METRIC, TPOT_METRICS
from agent.workload.traces import write_jsonl
from agent.workload.types import RequestSpec
from policies.params import ParamError, parse_assignments
from policies.registry import BATCH_POLICIES, UnknownPolicyError, batch_policy_class, dispatch_policy_class
from store.cli import STORE_COMMANDS

if TYPE_CHECKING:
    from store.queries import Db
    from store.window import RecordedWindow

EXIT_USAGE = 2


class WhatIfError(Exception):
    """A problem with the input: printed as one line, exit status 2."""


def _window_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", type=Path, required=True, metavar="FILE", help="a store written by `trackside record` "
                   "(or the console); it must not be open for writing by another process")
    p.add_argument("--node", metavar="ID", help="the node (needed when the store has several)")
    p.add_argument("--since", metavar="TIME", help="window start: ISO 8601 time (UTC without a zone) or a duration ago "
                   "(e.g. 1h); default the node's first recorded arrival")
    p.add_argument("--until", metavar="TIME", help="window end (same forms); default its last arrival")


def add_whatif_commands(subparsers: Any) -> None:
    """Add ``whatif`` to an ``argparse`` subparsers object (``export``'s parser is :mod:`store.cli`'s)."""
    p = subparsers.add_parser(
        "whatif",
        help="replay a recorded window under other policies, rank them, recommend (and apply) the best",
        description="Replay the requests a node recorded in a window (arrival times, prompt and output lengths, SLOs) "
        "through the simulator with the node's shape: first the policy that ran, to measure how close the replay is "
        "to the record (fidelity), then each candidate. Prints a ranked table (effective RPS = offered load x SLO "
        "attainment) and a recommendation: the best candidate, or 'keep' when none beats the replayed running policy "
        "by more than the replay's error.",
        epilog="Example: trackside whatif --db telemetry.duckdb --node gpu-7 --since 1h --compare "
        "vllm,sarathi,fairbatching --json whatif.json. docs/whatif.md explains fidelity and the recommendation.",
    )
    _window_args(p)
    p.add_argument("--compare", metavar="P1,P2,...", help="candidate batch policies (default every built-in one)")
    p.add_argument("--dispatch", metavar="D1,D2,...", help="candidate dispatch policies (default the one that ran)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="candidate policy parameter (repeatable); POLICY.NAME=VALUE targets one policy")
    p.add_argument("--profile", default="auto", help="auto (default): fit the step-time model on the window's "
                   "recorded steps; or a profile name (`trackside profiles`) or file (`trackside calibrate`)")
    p.add_argument("--tpot-metric", choices=TPOT_METRICS, default=DEFAULT_TPOT_METRIC,
                   help=f"the TPOT that SLO attainment uses (default {DEFAULT_TPOT_METRIC})")
    p.add_argument("--jobs", type=int, metavar="N", help="runs at once, in worker processes (default one per CPU)")
    p.add_argument("--min-gain", type=float, default=0.02, metavar="FRACTION",
                   help="the least gain worth a swap, whatever the fidelity (default 0.02)")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE ('-': stdout)")
    p.add_argument("--progress", choices=("bar", "jsonl", "none"), default="bar",
                   help="progress on stderr: a bar (default), one JSON object per finished run, or nothing")
    p.add_argument("--apply", metavar="URL", help="send the recommendation to the agent at URL as a control change "
                   "(its dry run first, then a confirmation unless --yes)")
    p.add_argument("--token-file", type=Path, help="the agent's control token (with --apply)")
    p.add_argument("--ca-file", type=Path, metavar="PEM", help="CA bundle for a wss:// agent (with --apply)")
    p.add_argument("--yes", action="store_true", help="with --apply: no confirmation")



# -- the window as a workload ---------------------------------------------------------------------------------
def read_window(args: argparse.Namespace) -> RecordedWindow:
    from store.schema import StoreError
    from store.window import recorded_window  # DuckDB loads only here

    now_ns = time.time_ns()
    try:
        start = parse_when(args.since, now_ns) if args.since else None
        end = parse_when(args.until, now_ns) if args.until else None
        return recorded_window(args.db, node_id=args.node, start_ns=start, end_ns=end)
    except (StoreError, CalibrationError) as exc:
        raise WhatIfError(str(exc)) from None


def as_recorded(window: RecordedWindow) -> Recorded:
    """The window on its own time base (seconds from its start); refused requests get the median output length."""
    t0 = window.start_ns
    outputs = [r.output_tokens for r in window.requests if r.output_tokens]
    median = max(1, round(statistics.median(outputs))) if outputs else 1
    specs, outcomes = [], []
    for r in window.requests:
        specs.append(RequestSpec(request_id=r.request_id, arrival_s=(r.arrival_ns - t0) / 1e9,
                                 prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens or median,
                                 ttft_slo_ms=r.ttft_slo_ms, tpot_slo_ms=r.tpot_slo_ms))
        if not r.refused and r.first_token_ns is not None and r.finish_ns is not None and r.output_tokens:
            outcomes.append(RequestOutcome(
                request_id=r.request_id, unit_id=r.unit_id if r.unit_id is not None else -1,
                arrival_s=(r.arrival_ns - t0) / 1e9, first_token_s=(r.first_token_ns - t0) / 1e9,
                finish_s=(r.finish_ns - t0) / 1e9, prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                num_preemptions=r.num_preemptions, ttft_slo_s=r.ttft_slo_ms / 1e3, tpot_slo_s=r.tpot_slo_ms / 1e3,
                max_tpot_s=None if r.max_tpot_ms is None else r.max_tpot_ms / 1e3,
            ))
    return Recorded(tuple(specs), tuple(outcomes), sum(1 for r in window.requests if r.refused))


def _param_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def running_config(window: RecordedWindow, profile: str, tpot_metric: Any) -> tuple[BenchConfig, list[str]]:
    """The node as it ran at the window's start, and warnings about what the replay cannot reproduce."""
    hello = window.hello
    warnings = []
    policies = Counter(window.unit_policies.values())
    batch = policies.most_common(1)[0][0]
    if len(policies) > 1:
        warnings.append(f"units ran different batch policies ({dict(policies)}): the replay runs {batch} on all")
    params = {f"{batch}.{k}": _param_text(v) for u in hello.units if u.batch_policy == batch
              for k, v in u.batch_params.items()}
    if hello.dispatch_policy == window.dispatch_policy:
        params.update({f"{window.dispatch_policy}.{k}": _param_text(v) for k, v in hello.dispatch_params.items()})
    if window.changes:
        what = Counter(c.action for c in window.changes)
        warnings.append(f"{len(window.changes)} control changes inside the window ("
                        + ", ".join(f"{n} {a}" for a, n in what.items())
                        + "): the replay holds the starting policies, so the fidelity check measures them too")
    if window.num_unfinished:
        warnings.append(f"{window.num_unfinished} requests arrived in the window without a recorded outcome (still "
                        "running when the store was read, or when the recording stopped): left out of both the record "
                        "and the replays")
    if not hello.topology:
        warnings.append("the node's hello does not say its topology (recorded before schema 4): replayed as colocated "
                        "units without lockstep")
    topology = hello.topology or "colocated"
    if topology not in TOPOLOGIES:
        raise WhatIfError(f"the node's topology {topology!r} is not one the simulator runs ({', '.join(TOPOLOGIES)})")
    slos = Counter((r.ttft_slo_ms, r.tpot_slo_ms) for r in window.requests)
    ttft, tpot = slos.most_common(1)[0][0]
    seqs = [u.max_num_seqs for u in hello.units if u.max_num_seqs > 0]
    blocks = [u.num_blocks for u in hello.units if u.num_blocks > 0]
    config = BenchConfig(
        profile=profile, units=len(hello.units), batch_policy=batch, dispatch=window.dispatch_policy, params=params,
        ttft_slo_ms=ttft, tpot_slo_ms=tpot, topology=topology,
        prefill_units=hello.prefill_units or None if topology == "disaggregated" else None, lockstep=hello.lockstep,
        instance_size=hello.instance_size, max_num_seqs=min(seqs) if seqs else None,
        num_gpu_blocks=min(blocks) if blocks else None,
        tpot_metric=tpot_metric,
    )
    return config, warnings


def fit_window_profile(db: Db, window: RecordedWindow, out_dir: Path) -> tuple[str, dict[str, Any]]:
    """``--profile auto``: a profile fitted on the window's steps (read from ``db``: the store's path, or a connection
    to it such as the recorder's), written under ``out_dir``; its path and a description for the report."""
    from store.queries import step_records

    # the steps that served the window's requests: up to the last one's finish, past the last arrival
    end = max([window.end_ns, *(r.finish_ns + 1 for r in window.requests if r.finish_ns is not None)])
    sel = step_records(db, node_id=window.node_id, start_ns=window.start_ns, end_ns=end)
    try:
        named = load_profile(window.hello.profile)
    except (UnknownProfileError, ValueError, OSError):
        named = None
    cols = sel.columns
    longest = max((r.prompt_tokens + (r.output_tokens or 0) for r in window.requests), default=1)
    try:
        cal = profile_from_steps(
            cols, name=f"{window.node_id}-whatif", description=f"fitted by trackside whatif on {window.node_id}",
            gpu=named.gpu if named else "unknown", model=named.model if named else window.hello.profile,
            mode=named.mode if named else "unknown",
            source_files=(Path(db).name if isinstance(db, str | Path) else "store",), measured_date="",
            vllm_version="", block_size=named.block_size if named else DEFAULT_BLOCK_SIZE,
            max_num_batched_tokens=named.max_num_batched_tokens if named else
            int(max(cols["budget_tokens"].max(initial=1), 1)),
            max_num_seqs=named.max_num_seqs if named else (sel.max_num_seqs or DEFAULT_MAX_NUM_SEQS),
            max_model_len=named.max_model_len if named else max(DEFAULT_MAX_MODEL_LEN, longest + 1),
            holdout_fraction=0.0,
        )
    except CalibrationError as exc:
        raise WhatIfError(f"cannot fit a profile on the window's {sel.num_steps:,} steps ({exc}): give --profile NAME "
                          "(e.g. the one the node ran)") from None
    path = out_dir / "whatif-profile.json"
    path.write_text(json.dumps(profile_to_json(cal.profile), indent=1))
    fit = cal.profile.fit
    return str(path), {"name": cal.profile.name, "source": "auto", "steps": sel.num_steps,
                       "engine_limits_from": named.name if named else "defaults",
                       "fit_mape": None if fit is None else fit.mape}


def candidates_of(args: argparse.Namespace, running: BenchConfig) -> list[Candidate]:
    names = csv_items(args.compare) if args.compare else [n for n in BATCH_POLICIES]
    dispatches = csv_items(args.dispatch) if args.dispatch else [running.dispatch]
    if not names or not dispatches:
        raise WhatIfError("--compare and --dispatch need at least one policy name")
    for name in names:
        batch_policy_class(name)
    for name in dispatches:
        dispatch_policy_class(name)
    params = dict(parse_assignments(args.param))
    out = []
    for d in dispatches:
        for b in names:
            if (b, d) == (running.batch_policy, running.dispatch) and not params:
                continue  # the replay is this run already
            out.append(Candidate(b, d, params))
    return out


# -- the command ------------------------------------------------------------------------------------------------
@contextmanager
def _progress(mode: str, total: int) -> Iterator[Callable[[int, int, BenchConfig], None]]:
    if mode == "jsonl":
        def report(done: int, n: int, config: BenchConfig) -> None:
            print(json.dumps({"event": "progress", "done": done, "total": n,
                              "label": f"{config.batch_policy} + {config.dispatch}"}), file=sys.stderr, flush=True)
        yield report
        return
    if mode == "none":
        yield lambda done, n, config: None
        return
    bar = Progress(TextColumn("replaying"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with bar:
        task = bar.add_task("", total=total)
        yield lambda done, n, config: bar.update(task, completed=done,
                                                 description=f"{config.batch_policy} + {config.dispatch}")


def cmd_whatif(args: argparse.Namespace, console: Console) -> int:
    try:
        return _whatif(args, console)
    except (WhatIfError, ParamError, UnknownPolicyError, UnknownProfileError) as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        print(f"trackside whatif: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _whatif(args: argparse.Namespace, console: Console) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise WhatIfError("--jobs must be >= 1")
    if args.apply and args.token_file is None:
        raise WhatIfError("--apply needs --token-file (a change needs the agent's control token)")
    window = read_window(args)
    recorded = as_recorded(window)
    with tempfile.TemporaryDirectory(prefix="trackside-whatif-") as tmp:
        if args.profile == "auto":
            profile, profile_info = fit_window_profile(args.db, window, Path(tmp))
        else:
            load_profile(args.profile)
            profile, profile_info = args.profile, {"name": args.profile, "source": "named"}
        running, warnings = running_config(window, profile, args.tpot_metric)
        candidates = candidates_of(args, running)
        configs = candidate_configs(running, candidates)
        for line in warnings:
            print(f"trackside whatif: warning: {line}", file=sys.stderr)
        with _progress(args.progress, len(configs)) as progress:
            results = run_all(configs, recorded.requests, jobs=args.jobs, progress=progress)
    report = {
        "window": {"node_id": window.node_id, "start_ns": window.start_ns, "end_ns": window.end_ns,
                   "requests": len(recorded.requests), "unfinished": window.num_unfinished,
                   "refused": recorded.num_refused, "changes": len(window.changes)},
        "shape": {"units": running.units, "topology": running.topology, "prefill_units": running.prefill_units,
                  "lockstep": running.lockstep, "instance_size": running.instance_size,
                  "batch_policy": running.batch_policy, "dispatch": running.dispatch,
                  "profile": window.hello.profile},
        "profile": profile_info,
        "warnings": warnings,
        **whatif_report(recorded, results, min_gain=args.min_gain),
    }
    if args.json == "-":
        print(json.dumps(report, indent=1))
    else:
        render_whatif(console, report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    if args.apply:
        return apply_recommendation(args, report["recommendation"], running, console)
    return 0


# -- output -----------------------------------------------------------------------------------------------------
def _pct(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def render_whatif(console: Console, report: dict[str, Any]) -> None:
    w, rec = report["window"], report["recorded"]
    console.print(f"node {w['node_id']}: {w['requests']:,} requests from {utc_text(w['start_ns'])} to "
                  f"{utc_text(w['end_ns'])} UTC; profile {report['profile']['name']} ({report['profile']['source']})")
    dispatches = {run["dispatch"] for run in report["runs"]}
    one = next(iter(dispatches)) if len(dispatches) == 1 else None
    table = Table(title="What-if: ranked by effective RPS = offered x SLO attainment"
                  + (f"; every run dispatches with {one}" if one else ""), title_justify="left")
    for col in ("#", "policy", "eff/s", "Δ rec", "SLO", "TTFT p50/p99", "TPOT p50/p99", "rej"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=col == "policy")
    table.caption = ("*: the running policy, replayed (the fidelity check); Δ rec: effective RPS against the record; "
                     "SLO: requests meeting TTFT and TPOT targets; latencies in ms")
    table.add_row("", "recorded", f"{rec['effective_rps']:,.2f}", "", _pct(rec["slo_attainment"], False),
                  f"{_ms(rec['ttft_ms']['p50'])}/{_ms(rec['ttft_ms']['p99'])}",
                  f"{_ms(rec['tpot_ms']['p50'])}/{_ms(rec['tpot_ms']['p99'])}", f"{rec['rejected']:,}",
                  style="dim")
    for run in sorted(report["runs"], key=lambda r: r["rank"]):
        s = run["summary"]
        name = run["batch_policy"] + (f" + {run['dispatch']}" if one is None else "")
        name += " *" if run["role"] == "replay" else ""
        table.add_row(str(run["rank"]), name, f"{s['effective_rps']:,.2f}",
                      _pct(run["delta"]["effective_rps_rel"]), _pct(s["slo_attainment"], False),
                      f"{_ms(s['ttft_ms']['p50'])}/{_ms(s['ttft_ms']['p99'])}",
                      f"{_ms(s['tpot_ms']['p50'])}/{_ms(s['tpot_ms']['p99'])}", f"{s['rejected']:,}",
                      style="bold" if run["role"] == "replay" else None)
    console.print(table)
    fid = report["fidelity"]
    poor = any((fid[k] or 0.0) > POOR_FIDELITY for k in ("goodput_rel_err", "slo_attainment_abs_err"))
    console.print("fidelity (replay of the running policy vs the record): "
                  + ", ".join(f"{k.removesuffix('_err')} {_pct(fid[k], False)}" for k in FIDELITY_KEYS)
                  + (" [bold red]poor: trust the ranking less[/]" if poor else ""))
    r = report["recommendation"]
    verdict = ("[bold green]switch[/] to " + f"{r['batch_policy']} + {r['dispatch']}" if r["action"] == "switch"
               else "[bold]keep[/] " + f"{r['batch_policy']} + {r['dispatch']}")
    console.print(f"recommendation: {verdict}: {r['reason']}")


# -- --apply ------------------------------------------------------------------------------------------------------
def apply_recommendation(args: argparse.Namespace, rec: dict[str, Any], running: BenchConfig, console: Console) -> int:
    """Send the recommendation: each change's dry run, then (confirmed, or ``--yes``) the changes themselves."""
    from agent.cli.ctl import EXIT_UNREACHABLE, render_reply
    from agent.telemetry import DryRun, ErrorReply, SetBatchPolicy, SetDispatchPolicy
    from agent.telemetry.client import client_ssl_context, read_token, unreachable

    if rec["action"] != "switch":
        console.print("--apply: nothing to apply (the recommendation is to keep the running policy)")
        return 0
    params = rec.get("params") or {}
    batch_names = {p.name for p in batch_policy_class(rec["batch_policy"]).params_schema}
    changes: list[Any] = []
    if rec["batch_policy"] != running.batch_policy:
        changes.append(SetBatchPolicy(policy=rec["batch_policy"],
                                      params={k: v for k, v in params.items() if k in batch_names}))
    if rec["dispatch"] != running.dispatch:
        changes.append(SetDispatchPolicy(policy=rec["dispatch"],
                                         params={k: v for k, v in params.items() if k not in batch_names}))
    token = read_token(args.token_file)
    ssl_context = client_ssl_context(args.ca_file)

    async def send(requests: Sequence[Any]) -> list[Any]:
        from agent.telemetry.client import open_session

        async with open_session(args.apply, token=token, ssl_context=ssl_context) as session:
            return [await session.call(r) for r in requests]

    try:
        dry = asyncio.run(send([DryRun(change=c) for c in changes]))
        for reply in dry:
            if isinstance(reply, ErrorReply):
                print(f"trackside whatif: --apply refused: {reply.code}: {reply.message}", file=sys.stderr)
                return EXIT_USAGE
            console.print(f"dry run: {render_reply(reply)}")
        if not args.yes:
            if not sys.stdin.isatty():
                print("trackside whatif: --apply: not confirmed (no terminal to ask on; give --yes)", file=sys.stderr)
                return EXIT_USAGE
            if input("apply these changes? [y/N] ").strip().lower() not in ("y", "yes"):
                console.print("not applied")
                return 1
        for reply in asyncio.run(send(changes)):
            if isinstance(reply, ErrorReply):
                print(f"trackside whatif: --apply refused: {reply.code}: {reply.message}", file=sys.stderr)
                return EXIT_USAGE
            console.print(render_reply(reply))
    except (OSError, TimeoutError, WebSocketException) as exc:
        print(f"trackside whatif: {unreachable(args.apply, exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


# -- export -------------------------------------------------------------------------------------------------------
def cmd_export(args: argparse.Namespace, console: Console) -> int:
    """``trackside export``: ``--trace`` here, ``--to`` (Parquet) in :mod:`store.cli`."""
    if args.trace is None:
        return STORE_COMMANDS["export"](args, console)
    try:
        window = read_window(args)
    except WhatIfError as exc:
        print(f"trackside export: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    recorded = as_recorded(window)
    try:
        count = write_jsonl(recorded.requests, args.trace)
    except OSError as exc:
        print(f"trackside export: error: cannot write {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    console.print(f"wrote {count:,} requests of node {window.node_id} to {args.trace}"
                  + (f" ({recorded.num_refused} refused, with the median output length)" if recorded.num_refused
                     else "")
                  + (f"; {window.num_unfinished} unfinished left out" if window.num_unfinished else ""))
    return 0


WHATIF_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"whatif": cmd_whatif, "export": cmd_export}
