"""``trackside calibrate``: fit a simulator profile from a node's recorded steps, or from probe files.

    trackside calibrate --db telemetry.duckdb --out my-node.json                  # every step of the store
    trackside calibrate --db telemetry.duckdb --node gpu-7 --unit 0 --since 2h --out my-node.json
    trackside calibrate --probe llama31-8b_graphs.json --out my-h100.json         # a calibration probe's file
    trackside bench --workload sharegpt-like --profile ./my-node.json              # the simulator runs it

The store path is :func:`agent.engine.step_calibration.profile_from_steps`; the probe path is the shipped
profiles' own derivation (:func:`agent.engine.calibration.derive_profile`). Either writes ``FILE.json`` and
``FILE.records.csv.gz`` next to it (the steps used), and only once the fit has succeeded.

Wiring as :mod:`store.cli`: ``add_calibrate_command(subparsers)`` adds the parser, :data:`CALIBRATE_COMMANDS`
maps its name to a handler with ``agent.cli``'s signature; the handler prints a problem (no such file, not a
store, too few steps, a degenerate fit) as one line on stderr and returns 2, never raising it. DuckDB loads
only when a store is read.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console

from agent.cli.common import utc_text
from agent.engine.calibration import CALIBRATION_WORKLOADS, HOLDOUT_WORKLOADS, derive_profile, write_profile
from agent.engine.profile_json import profile_from_json, profile_to_json
from agent.engine.profile_records import Records
from agent.engine.profile_types import Profile
from agent.engine.step_calibration import (
    MIN_STEPS,
    CalibrationError,
    PerRequestFit,
    check_usable,
    profile_from_steps,
)

EXIT_USAGE = 2
DEFAULT_BLOCK_SIZE = 16
"""vLLM's default KV block size (tokens); the store does not record it."""
DEFAULT_MAX_MODEL_LEN = 16384
DEFAULT_MAX_NUM_SEQS = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""The calibration probe's engine settings: the defaults where neither the user nor the input says."""
PROBE_KEYS = ("gpu", "eager", "results", "steps")


def add_calibrate_command(subparsers: Any) -> None:
    """Add ``calibrate`` to an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "calibrate",
        help="fit a simulator profile from a node's recorded steps (or a probe file)",
        description="Fit the simulator's step-time profile (T = a + b*new_tokens + c*context_tokens, noise, "
        "mixed-batch interference, KV capacity, engine limits) from the steps a node recorded with `trackside "
        "record` (--db), or from calibration probe files (--probe), and write it as FILE.json with the steps "
        "used in FILE.records.csv.gz. Use it with `trackside bench --profile ./FILE.json`. With --db, 20% of "
        "the steps (chosen at random, --seed) are held out of the fit and only evaluated.",
        epilog="Example: trackside calibrate --db telemetry.duckdb --node gpu-7 --since 2h --gpu 'NVIDIA L40S' "
        "--model Llama-3.1-8B --out l40s-llama31-8b.json",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--db", type=Path, metavar="FILE", help="a store written by `trackside record` (DuckDB)")
    src.add_argument(
        "--probe",
        type=Path,
        action="append",
        metavar="FILE",
        help="a calibration probe's JSON file (repeat for engines that shared one GPU)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE.json",
        help="the profile to write; its name is the file's stem (the records go next to it)",
    )
    sel = p.add_argument_group("selecting steps (--db)")
    sel.add_argument(
        "--node", metavar="NODE_ID", help="the node whose steps to fit (needed when the store has several)"
    )
    sel.add_argument("--unit", type=int, action="append", metavar="N", help="only this unit (repeatable; default all)")
    sel.add_argument(
        "--since",
        metavar="WHEN",
        help="only steps from WHEN: an ISO time (UTC unless it has a zone) or a duration ago such as 2h or 30m",
    )
    sel.add_argument("--until", metavar="WHEN", help="only steps before WHEN (same forms)")
    sel.add_argument(
        "--holdout",
        type=float,
        default=0.2,
        metavar="FRACTION",
        help="steps held out of the fit, at random (default 0.2; 0: none; none below 100 steps)",
    )
    sel.add_argument("--seed", type=int, default=0, help="seed of the holdout draw (default 0)")
    probe = p.add_argument_group("probe files (--probe)")
    probe.add_argument(
        "--calibration-workloads",
        default=",".join(CALIBRATION_WORKLOADS),
        metavar="TAGS",
        help=f"workloads to fit (default {','.join(CALIBRATION_WORKLOADS)})",
    )
    probe.add_argument(
        "--holdout-workloads",
        default=",".join(HOLDOUT_WORKLOADS),
        metavar="TAGS",
        help=f"workloads only evaluated (default {','.join(HOLDOUT_WORKLOADS)}; '' for none)",
    )
    facts = p.add_argument_group("what the input does not say")
    facts.add_argument("--gpu", help="GPU name (default: the probe file's; 'unknown' for a store)")
    facts.add_argument("--model", help="model name (default: the probe's model folder; 'unknown' for a store)")
    facts.add_argument("--mode", help="engine mode, e.g. cuda-graphs or eager (default: the probe's; 'unknown')")
    facts.add_argument("--vllm-version", metavar="VERSION", default="unknown", help="engine version (default unknown)")
    facts.add_argument(
        "--description", metavar="TEXT", default="", help="a sentence put first in the profile's description"
    )
    facts.add_argument(
        "--engines-per-gpu", metavar="N", type=int, default=1, help="engines sharing the GPU (default 1)"
    )
    facts.add_argument(
        "--block-size",
        metavar="TOKENS",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"KV block size in tokens (default {DEFAULT_BLOCK_SIZE}, vLLM's)",
    )
    facts.add_argument(
        "--max-num-batched-tokens",
        metavar="TOKENS",
        type=int,
        help="token budget cap (default: the largest recorded budget; the probe's 8192)",
    )
    facts.add_argument(
        "--max-num-seqs",
        metavar="N",
        type=int,
        help=f"running requests cap (default: as recorded; else {DEFAULT_MAX_NUM_SEQS})",
    )
    facts.add_argument(
        "--max-model-len",
        metavar="TOKENS",
        type=int,
        help=f"model length in tokens (default {DEFAULT_MAX_MODEL_LEN}, at most the KV capacity)",
    )


class Fitted(NamedTuple):
    """A profile ready to write, with what the summary reports about it."""

    profile: Profile
    records: Records
    per_request: PerRequestFit | None
    """The per-request fit (a store); None for probe files (their loop overhead comes from wall times)."""
    num_dropped: int
    warnings: tuple[str, ...]


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    try:
        _check_numbers(args)
        out = _out_path(args)
        fitted = _from_store(args, out.stem) if args.db is not None else _from_probes(args, out.stem)
        profile_from_json(json.loads(json.dumps(profile_to_json(fitted.profile))))  # reads back, before writing
        written = write_profile(fitted.profile, fitted.records, out.parent)
    except CalibrationError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc.strerror or exc}")
    lines = summary_lines(fitted.profile, fitted.records, fitted.per_request, fitted.num_dropped)
    lines += [f"warning: {w}" for w in fitted.warnings]
    lines.append(f"wrote {written[0]} and {written[1].name}")
    lines.append(f"use it: trackside bench --profile {_shell_path(written[0])} --workload sharegpt-like")
    print("\n".join(lines))  # plain lines: no wrapping, easy to grep
    return 0


def _fail(message: str) -> int:
    print(f"trackside calibrate: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _check_numbers(args: argparse.Namespace) -> None:
    for option in ("block_size", "engines_per_gpu", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise CalibrationError(f"--{option.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.holdout < 1.0:
        raise CalibrationError(f"--holdout must be in [0, 1) (got {args.holdout:g})")


def _out_path(args: argparse.Namespace) -> Path:
    out: Path = args.out
    if out.suffix != ".json" or not out.stem:
        raise CalibrationError(f"--out must name a .json file (got {out})")
    if out.is_dir():
        raise CalibrationError(f"--out {out} is a directory")
    if any(out.resolve() == p.resolve() for p in args.probe or ()):
        raise CalibrationError(f"--out {out} is one of the probe files: name another file")
    return out


def _shell_path(path: Path) -> str:
    text = str(path)
    return text if "/" in text else f"./{text}"


# -- a store ---------------------------------------------------------------------------------------------------
def parse_when(text: str, now_ns: int) -> int:
    """Wall-clock ns of ``--since``/``--until``: an ISO 8601 time (UTC when it has no zone) or a duration ago."""
    from store.cli import duration_s

    try:
        return now_ns - round(duration_s(text) * 1e9)
    except argparse.ArgumentTypeError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise CalibrationError(
            f"invalid time {text!r}: give an ISO time such as 2026-11-22T10:00 or a duration ago such as 2h"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return round(when.timestamp() * 1e9)


def _selection(args: argparse.Namespace) -> str:
    parts = [
        f"node {args.node}" if args.node else "",
        f"units {_ints(args.unit)}" if args.unit else "",
        f"since {args.since}" if args.since else "",
        f"until {args.until}" if args.until else "",
    ]
    return ", ".join(x for x in parts if x) or "no filter"


def _ints(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def _from_store(args: argparse.Namespace, name: str) -> Fitted:
    from store.queries import step_records  # DuckDB loads only here
    from store.schema import StoreError

    now_ns = time.time_ns()
    start_ns = parse_when(args.since, now_ns) if args.since else None
    end_ns = parse_when(args.until, now_ns) if args.until else None
    if start_ns is not None and end_ns is not None and end_ns <= start_ns:
        raise CalibrationError("--until must be later than --since")
    try:
        sel = step_records(args.db, node_id=args.node, unit_ids=args.unit, start_ns=start_ns, end_ns=end_ns)
    except StoreError as exc:  # no file, not DuckDB, not a trackside store, another process writes it
        raise CalibrationError(str(exc)) from None
    nodes = sel.steps_per_node
    if sel.num_steps == 0:
        has = "; ".join(f"{n}: {c:,} steps on units {_ints(list(u))}" for n, (c, u) in sel.stored.items())
        raise CalibrationError(
            f"no steps in {args.db} for the selection ({_selection(args)}); "
            + (f"the store has {has}" if has else "the store has none")
        )
    if args.node is None and len(nodes) > 1:
        raise CalibrationError(
            f"{args.db} has steps of {len(nodes)} nodes ({', '.join(f'{n}: {c:,}' for n, c in nodes.items())}): "
            "name one with --node (nodes differ in hardware)"
        )
    cols = sel.columns
    node = args.node or next(iter(nodes))
    units = sorted(set(cols["unit_id"].tolist()))
    new = cols["num_prefill_tokens"] + cols["num_decode_tokens"]
    capacity = int(cols["num_blocks"].min()) * args.block_size
    first, last = int(cols["time_ns"].min()), int(cols["time_ns"].max())
    auto = (
        f"Recorded on node {node} (units {_ints(units)}) from {utc_text(first)} to {utc_text(last)} UTC, "
        f"store {args.db.name}."
    )
    cal = profile_from_steps(
        cols,
        name=name,
        description=f"{args.description.strip()} {auto}".strip(),
        gpu=args.gpu or "unknown",
        model=args.model or "unknown",
        mode=args.mode or "unknown",
        source_files=(args.db.name,),
        measured_date=utc_text(first)[:10],
        vllm_version=args.vllm_version,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or int(max(cols["budget_tokens"].max(), new.max())),
        max_num_seqs=args.max_num_seqs or sel.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_model_len=args.max_model_len or max(1, min(DEFAULT_MAX_MODEL_LEN, capacity)),
        engines_per_gpu=args.engines_per_gpu,
        holdout_fraction=args.holdout,
        seed=args.seed,
    )
    return Fitted(cal.profile, cal.records, cal.per_request, cal.num_dropped, cal.warnings)


# -- probe files -----------------------------------------------------------------------------------------------
def _tags(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _read_probe(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibrationError(f"no probe file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path} is not a probe file: invalid JSON ({exc})") from None
    missing = [k for k in PROBE_KEYS if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise CalibrationError(f"{path} is not a probe file: no {', '.join(missing)} (a store? use --db)")
    return doc  # type: ignore[no-any-return]


def _from_probes(args: argparse.Namespace, name: str) -> Fitted:
    calib, hold = _tags(args.calibration_workloads), _tags(args.holdout_workloads)
    if not calib:
        raise CalibrationError("--calibration-workloads names no workload")
    runs = [_read_probe(p) for p in args.probe]
    for path, run in zip(args.probe, runs, strict=True):
        tags = [str(r.get("tag")) for r in run["results"]]
        absent = [t for t in (*calib, *hold) if t not in tags]
        if absent:
            raise CalibrationError(
                f"{path} has no workload {', '.join(absent)} (its workloads: {', '.join(tags)}): name them with "
                "--calibration-workloads and --holdout-workloads"
            )
        num = sum(r["steps"][1] - r["steps"][0] for r in run["results"] if r.get("tag") in calib)
        if num < MIN_STEPS:
            raise CalibrationError(f"{path}: {num} calibration steps, too few to fit a profile (at least {MIN_STEPS})")
    mtime = max(p.stat().st_mtime for p in args.probe)
    summary = (
        f"{args.description.strip()} Calibrated by trackside calibrate from the probe files "
        f"{', '.join(p.name for p in args.probe)}."
    ).strip()
    try:
        profile, records = derive_profile(
            name,
            args.probe,
            summary,
            model=args.model,
            engines_per_gpu=args.engines_per_gpu,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
            measured_date=dt.datetime.fromtimestamp(mtime, tz=dt.UTC).date().isoformat(),
            vllm_version=args.vllm_version,
            calibration_workloads=calib,
            holdout_workloads=hold,
        )
    except KeyError as exc:
        raise CalibrationError(f"not a probe file: a step or result lacks {exc}") from None
    except ValueError as exc:  # mixed GPUs or modes, no KV evidence, a rank-deficient fit
        raise CalibrationError(str(exc)) from None
    profile = replace(profile, gpu=args.gpu or profile.gpu, mode=args.mode or profile.mode)
    check_usable(profile, records)
    return Fitted(profile, records, None, 0, ())


# -- the summary -----------------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100.0 * x:.1f}%"


def summary_lines(profile: Profile, records: Records, per_request: PerRequestFit | None, num_dropped: int) -> list[str]:
    """What ``calibrate`` prints: steps used, the fit and its error (fit and holdout), noise, kappa, KV, limits."""
    p, c = profile, profile.coefficients
    src = p.source
    held = 0 if src is None else int(sum((records["workload"] == w).sum() for w in src.holdout_workloads))
    lines = [
        f"profile {p.name}: {len(records):,} steps used ({len(records) - held:,} fitted, {held:,} held out)"
        + (f", {num_dropped:,} without tokens or time left out" if num_dropped else "")
    ]
    lines.append(
        f"  step model   a = {c.a_s * 1e3:.3f} ms   b = {c.b_s * 1e6:.2f} us/token   "
        f"c = {c.c_s * 1e9:.2f} ns/context token"
    )
    if per_request is not None:
        if per_request.kept:
            lines.append(
                f"  per request  {per_request.seconds * 1e6:.2f} us per scheduled request "
                f"(t = {per_request.t_stat:.1f}; the simulator adds it as engine-loop time)"
            )
        else:
            est = (
                "not fitted"
                if math.isnan(per_request.estimate_s)
                else (f"{per_request.estimate_s * 1e6:.2f} us, t = {per_request.t_stat:.1f}")
            )
            lines.append(f"  per request  none ({est}: not separable from the context term)")
    else:
        lines.append(
            f"  engine loop  {p.loop_overhead_s * 1e3:.3f} ms + {p.loop_overhead_per_request_s * 1e6:.2f} us "
            "per request (from the workloads' wall times)"
        )
    if p.fit is not None:
        lines.append(f"  fit          {p.fit.n:,} steps   R^2 {p.fit.r2:.4f}   MAPE {_pct(p.fit.mape)}")
    if p.holdout is not None:
        how = (
            f"workloads {', '.join(src.holdout_workloads)}"
            if src and src.holdout_workloads != ("holdout",)
            else ("random, never fitted")
        )
        lines.append(
            f"  holdout      {p.holdout.n:,} steps   R^2 {p.holdout.r2:.4f}   MAPE {_pct(p.holdout.mape)}   ({how})"
        )
    else:
        lines.append("  holdout      none")
    lines.append(
        f"  noise        sigma {p.noise_sigma:.4f} (robust, log scale), std {p.noise_sigma_std:.4f}, "
        f"median log ratio {p.noise_log_median:+.4f}"
    )
    inter = p.interference
    mixed = (
        ""
        if inter is None
        else (f" (mixed steps {inter.num_steps:,}: MAPE {_pct(inter.mape_linear)} linear, {_pct(inter.mape)} with it)")
    )
    lines.append(f"  interference kappa {p.interference_kappa:.4f}{mixed}")
    ev = p.kv_evidence
    check = (
        ""
        if ev is None or ev.num_steps == 0
        else (f"; ctx/kv median {ev.ctx_over_kv_median_tokens:,.0f} tokens over {ev.num_steps:,} decode-only steps")
    )
    lines.append(
        f"  KV cache     {p.num_gpu_blocks:,} blocks of {p.block_size} tokens ({p.usable_gpu_blocks:,} usable "
        f"= {p.kv_capacity_tokens:,} tokens; {ev.method if ev else 'derived'}){check}"
    )
    lines.append(
        f"  engine       max_num_batched_tokens {p.max_num_batched_tokens:,}, max_num_seqs "
        f"{p.max_num_seqs:,}, max_model_len {p.max_model_len:,}"
    )
    return lines


CALIBRATE_COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {"calibrate": cmd_calibrate}
