"""GPU validation of the vLLM integration (issue #7), one part per call so each fits a 10-minute GPU slot.

    python -m agent.bench.vllm_validate sync     --model-8b DIR --out DIR   # plain vs vllm policy, SLO runs
    python -m agent.bench.vllm_validate async    --model-8b DIR --out DIR   # the same throughput, async
    python -m agent.bench.vllm_validate dispatch --model-1b DIR --out DIR   # 2 units on one GPU
    python -m agent.bench.vllm_validate papers   --model-8b DIR --out DIR   # seed 003's metrics (issue #19)
    python -m agent.bench.vllm_validate smoke --fake --out DIR              # the CPU path (fake executor)
    python -m agent.bench.vllm_validate papers --fake --out DIR             # the papers part on a fake 8B engine

* ``sync``/``async``: the calibration's ShareGPT-like workload (1,000 requests at once, regenerated exactly
  by :mod:`agent.engine.probe_workloads`) on plain vLLM and on the trackside scheduler with the ``vllm``
  policy (output tokens/s; the calibration measured 5,900 with Llama-3.1-8B, sync). ``sync`` then runs a
  bursty workload at about 70% of that capacity on the same engine with the ``vllm`` policy and with
  ``fairbatching`` (swapped live over the control channel), and keeps every step record for the simulator
  check (MAPE of the shipped profile's predictions against measured step times).
* ``papers``: :func:`part_papers` (issue #19 item 11): the batch policies as seed 003 measures them, with the
  simulator's prediction beside each run.
* ``dispatch``: two engines of the 1B model on one GPU (``gpu_memory_utilization`` 0.4 each, started one
  after the other), FairBatching on both, a bursty workload replayed under ``least_loaded``, ``sbs`` and
  ``pab`` in turn on the same engines.

Every part writes ``<part>.json`` (summaries, settings, step records in compact columns) under ``--out`` and
prints a summary. Nothing is tuned between parts: workloads and SLOs are fixed here, before any run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.bench.vllm_runner import RunResult, run_workload
from agent.engine.probe_workloads import probe_workloads
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import engine_versions
from agent.engine.vllm.messages import SetPolicy, StepMessage
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import VllmUnit
from agent.workload.spec import parse_workload
from agent.workload.types import RequestSpec
from policies.params import ParamValue
from policies.registry import DISPATCH_POLICIES

VOCAB = 128_256
SLO_8B = (0.5, 0.05)
"""TTFT and TPOT SLOs (s) of the 8B runs (the bench's defaults)."""
SLO_1B = (0.3, 0.03)
BURSTY_8B = "bursty:rate=16,n=1000"
BURSTY_1B = "bursty:rate=60,n=3000"
SEEDS = itertools.count(1)
"""Each run's prompt seed, a new one per run. Runs on one engine that replayed the same prompts (one seed) were
answered from the engine's prefix cache (on by default) from the second run on: the papers part's first GPU run
(2026-11-26, H100) measured 20 ms TTFT where the first run had 178 ms. The warm-up keeps seed 0."""

PROFILES = {"8b": "h100-llama31-8b", "1b": "h100-llama32-1b-shared"}
SAVE: list[Path] = []
"""Where the running part writes its partial result after every run (a killed call keeps what it measured)."""


def _save(out: dict[str, Any]) -> None:
    if SAVE:
        SAVE[0].write_text(json.dumps(out, indent=1))


def sharegpt_like() -> list[RequestSpec]:
    w = next(w for w in probe_workloads() if w.tag == "sharegpt_like")
    return [RequestSpec(f"s{i:04d}", 0.0, p, o) for i, (p, o) in enumerate(w.requests)]


def warmup() -> list[RequestSpec]:
    return [RequestSpec(f"w{i:02d}", 0.0, 128, 16) for i in range(8)]


def columns(raw: list[StepMessage]) -> dict[str, list[Any]]:
    keys = ("duration_s", "predicted_s", "num_prefill_tokens", "num_decode_tokens", "context_tokens",
            "num_running", "kv_used_blocks", "plan_us", "mode")
    return {k: [getattr(r, k) for r in raw] for k in keys}


def mape(raw: list[StepMessage], coefs: tuple[float, float, float] | None) -> dict[str, Any]:
    steps = [r for r in raw if r.num_prefill_tokens + r.num_decode_tokens > 0]
    if not steps:
        return {}
    out: dict[str, Any] = {"steps": len(steps)}
    online = [abs(r.predicted_s - r.duration_s) / r.duration_s for r in steps]
    out["online_model_mape"] = round(sum(online) / len(online), 4)
    if coefs is not None:
        a, b, c = coefs
        err = [abs(a + b * (r.num_prefill_tokens + r.num_decode_tokens) + c * r.context_tokens
                   - r.duration_s) / r.duration_s for r in steps]
        out["profile_mape"] = round(sum(err) / len(err), 4)
        err.sort()
        out["profile_ape_p50"] = round(err[len(err) // 2], 4)
    plan = sorted(r.plan_us for r in steps)
    out["plan_us_p50"] = plan[len(plan) // 2]
    out["plan_us_p99"] = plan[min(len(plan) - 1, int(0.99 * len(plan)))]
    return out


def step_percentiles(raw: list[StepMessage]) -> dict[str, float]:
    """The measured step times (ms) of the steps that ran tokens: p50, p99 and the longest. A single slow step
    (a compile, a collection) fails every request in it under a per-token TPOT SLO; these show whether one did."""
    times = sorted(r.duration_s * 1e3 for r in raw if r.num_prefill_tokens + r.num_decode_tokens > 0)
    if not times:
        return {}
    n = len(times)
    return {"p50": round(times[n // 2], 2), "p99": round(times[min(n - 1, int(0.99 * n))], 2),
            "max": round(times[-1], 2)}


def profile_coefs(name: str) -> tuple[float, float, float] | None:
    try:
        from agent.engine.profiles import load_profile
    except Exception:  # numpy missing on the device would be the only reason
        return None
    c = load_profile(name).coefficients
    return (c.a_s, c.b_s, c.c_s)


async def _run(units: list[VllmUnit], dispatch: str, requests: list[RequestSpec], slo: tuple[float, float],
               label: str) -> tuple[dict[str, Any], RunResult]:
    t = time.time()
    res = await run_workload(units, DISPATCH_POLICIES[dispatch](), requests, ttft_slo_s=slo[0], tpot_slo_s=slo[1],
                             vocab=VOCAB, progress=True, seed=0 if label == "warmup" else next(SEEDS))
    s = res.summary()
    s["label"] = label
    s["dispatch"] = dispatch
    print(f"[{label}] {json.dumps(s)}  ({time.time() - t:.0f}s)", flush=True)
    return s, res


def _start(unit: VllmUnit) -> float:
    t = time.time()
    unit.start()
    dt = time.time() - t
    print(f"unit {unit.unit_id} started in {dt:.0f}s (plain={unit.options.plain}, "
          f"blocks={unit.num_blocks})", flush=True)
    return dt


async def part_throughput(args: argparse.Namespace, async_sched: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": [], "async_scheduling": async_sched, "rounds": args.rounds}
    work = sharegpt_like()
    for rnd, plain in itertools.product(range(args.rounds), (True, False)):
        opts = EngineOptions(model=args.model_8b, load_format="dummy", gpu_memory_utilization=0.9,
                             async_scheduling=async_sched, plain=plain, enforce_eager=args.eager)
        unit = VllmUnit(0, opts, UnitSettings(policy="vllm", coefficients=profile_coefs(PROFILES["8b"])),
                        **_fake(args, 0))
        start_s = _start(unit)
        await _run([unit], "round_robin", warmup(), SLO_8B, "warmup")
        label = "plain" if plain else "trackside-vllm"
        summary, res = await _run([unit], "round_robin", work, SLO_8B, f"throughput-{label}")
        summary["engine_start_s"] = round(start_s, 1)
        summary["round"] = rnd
        if not plain:
            summary["sim_check"] = mape(res.raw[0], profile_coefs(PROFILES["8b"]))
        out["runs"].append(summary)
        _save(out)
        if not plain and not async_sched and not args.skip_slo and rnd == 0:
            bursty = parse_workload(BURSTY_8B, seed=0)
            for policy in ("vllm", "fairbatching"):
                # An idle engine schedules nothing: the swap applies at the first step of the run.
                mid = unit.send_control(SetPolicy(name=policy))
                s, r = await _run([unit], "round_robin", bursty, SLO_8B, f"slo-{policy}")
                reply = unit.control_replies.pop(mid, None)
                s["policy_swap_ok"] = reply is not None and reply.ok
                s["step_policies"] = sorted({x.policy for x in r.raw[0]})
                s["batch_policy"] = policy
                s["workload"] = BURSTY_8B
                s["sim_check"] = mape(r.raw[0], profile_coefs(PROFILES["8b"]))
                out["runs"].append(s)
                out.setdefault("steps", {})[policy] = columns(r.raw[0])
                _save(out)
        await unit.stop()
        del unit
        gc.collect()
        await asyncio.sleep(2)
    ratios = []
    for rnd in range(args.rounds):
        tps = {r["label"]: r["output_tok_s"] for r in out["runs"] if r.get("round") == rnd}
        plain_tps = tps.get("throughput-plain")
        ours = tps.get("throughput-trackside-vllm")
        ratios.append(round(ours / plain_tps, 4) if plain_tps and ours else None)
    out["trackside_over_plain"] = ratios[0] if args.rounds == 1 else ratios
    return out


async def part_slo(args: argparse.Namespace) -> dict[str, Any]:
    """The batch policies on one 8B engine at a load near its capacity (``--workload``), async scheduling."""
    out: dict[str, Any] = {"runs": [], "workload": args.workload, "slo": SLO_8B, "async_scheduling": True}
    opts = EngineOptions(model=args.model_8b, load_format="dummy", gpu_memory_utilization=0.9,
                         async_scheduling=True, enforce_eager=args.eager)
    unit = VllmUnit(0, opts, UnitSettings(policy="vllm", coefficients=profile_coefs(PROFILES["8b"])),
                    **_fake(args, 0))
    _start(unit)
    await _run([unit], "round_robin", warmup(), SLO_8B, "warmup")
    work = parse_workload(args.workload, seed=0)
    for policy in ("vllm", "fairbatching"):
        mid = unit.send_control(SetPolicy(name=policy))
        s, r = await _run([unit], "round_robin", work, SLO_8B, f"slo-{policy}")
        reply = unit.control_replies.pop(mid, None)
        s["policy_swap_ok"] = reply is not None and reply.ok
        s["step_policies"] = sorted({x.policy for x in r.raw[0]})
        s["batch_policy"] = policy
        s["sim_check"] = mape(r.raw[0], profile_coefs(PROFILES["8b"]))
        out["runs"].append(s)
        _save(out)
    await unit.stop()
    return out


async def part_dispatch(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": [], "workload": BURSTY_1B, "slo": SLO_1B}
    units = []
    for i in range(2):
        opts = EngineOptions(model=args.model_1b, load_format="dummy", gpu_memory_utilization=0.4,
                             async_scheduling=False, enforce_eager=args.eager)
        unit = VllmUnit(i, opts, UnitSettings(policy="fairbatching", coefficients=profile_coefs(PROFILES["1b"])),
                        **_fake(args, i))
        _start(unit)
        units.append(unit)
    await _run(units, "round_robin", warmup(), SLO_1B, "warmup")
    work = parse_workload(BURSTY_1B, seed=0)
    for dispatch in ("least_loaded", "sbs", "pab"):
        s, r = await _run(units, dispatch, work, SLO_1B, f"dispatch-{dispatch}")
        kv_spread = []
        for recs in zip(*(r.raw[u.unit_id] for u in units), strict=False):
            kv = [x.kv_used_blocks for x in recs]
            kv_spread.append(max(kv) - min(kv))
        s["kv_blocks_spread_mean"] = round(sum(kv_spread) / len(kv_spread), 1) if kv_spread else None
        s["sim_check"] = {u.unit_id: mape(r.raw[u.unit_id], profile_coefs(PROFILES["1b"])) for u in units}
        s["per_unit_requests"] = {u.unit_id: sum(1 for o in r.outcomes if o.unit_id == u.unit_id) for u in units}
        out["runs"].append(s)
        _save(out)
        await asyncio.sleep(1)
    for u in units:
        await u.stop()
    return out


PAPER_SLO = (2.0, 0.05)
"""Seed 003's SLOs on the Azure traces (§5.1): TTFT 2,000 ms, TPOT 50 ms (the worst per-token TPOT)."""
PAPER_POLICIES = ("vllm", "sarathi", "fairbatching", "fairbatching+pab")
PAPER_TRACE = "examples/traces/azure_code_2023.csv"


def _window(trace: str, n: int) -> list[RequestSpec]:
    """The trace's first ``n`` requests, arrivals from 0, with the papers' SLOs."""
    from agent.workload.traces import load_trace

    reqs = load_trace(trace, limit=n)
    t0 = min(r.arrival_s for r in reqs)
    return [replace(r, arrival_s=r.arrival_s - t0, ttft_slo_ms=PAPER_SLO[0] * 1e3, tpot_slo_ms=PAPER_SLO[1] * 1e3)
            for r in reqs]


def paper_config(profile: str, policy: str, params: dict[str, str] | None = None) -> Any:
    """The papers part's simulated case: one unit of ``profile`` running ``policy``, seed 003's SLOs."""
    from agent.bench.runner import BenchConfig

    return BenchConfig(profile=profile, units=1, batch_policy=policy, dispatch="round_robin",
                       ttft_slo_ms=PAPER_SLO[0] * 1e3, tpot_slo_ms=PAPER_SLO[1] * 1e3, params=params or {})


def paper_knee(window: list[RequestSpec], profile: str) -> tuple[float | None, dict[str, Any]]:
    """The simulator's knee for one unit of ``profile`` on ``window`` (the best baseline's 90%-attainment load,
    :mod:`agent.bench.knee`), and each baseline's."""
    from agent.bench.knee import BASELINES, KneeSearch, find_knee
    from agent.bench.runner import run_once

    knees: dict[str, Any] = {}
    for policy in BASELINES:
        knees[policy], _ = find_knee(paper_config(profile, policy), lambda c: run_once(c, window), KneeSearch())
    found = [k for k in knees.values() if k is not None]
    return (max(found) if found else None), knees


def tuned_sarathi(window: list[RequestSpec], profile: str) -> tuple[int | None, dict[str, Any]]:
    """Sarathi's token budget tuned as seed 003 tunes its baseline (``trackside bench --tune-sarathi``: the best of
    the default grid by the load it sustains at 90% attainment), in the simulator for one unit of ``profile`` on
    ``window``; and the tuning's record."""
    from agent.bench.knee import KneeSearch
    from agent.bench.runner import run_once
    from agent.bench.tuning import DEFAULT_GRID, tune_sarathi

    config = paper_config(profile, "sarathi")
    tuning = tune_sarathi(config, lambda c: run_once(c, window), KneeSearch(), DEFAULT_GRID)
    return tuning.chosen, tuning.as_json()


def policy_arg(text: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME:key=value;key=value`` (a batch policy and parameters over its defaults)."""
    name, _, rest = text.partition(":")
    params: dict[str, str] = {}
    for item in filter(None, rest.split(";")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SystemExit(f"--policies: {item!r} in {text!r} is not key=value")
        params[key.strip()] = value.strip()
    return name.strip(), params


async def part_papers(args: argparse.Namespace) -> dict[str, Any]:
    """Issue #19 item 11: FairBatching and +PAB against vLLM's default and Sarathi on one 8B engine, seed 003's
    metrics (worst per-token TPOT, effective RPS) and SLOs (2,000/50 ms), the Azure code trace's first
    ``--requests`` requests at ``--loads`` times the simulator's knee, each run next to the simulator's prediction
    for the same requests (the 8B H100 profile: on another GPU the prediction is expected to differ by the GPUs'
    speed, and the steps' MAPE says by how much)."""
    from agent.bench.report import offered_rps
    from agent.bench.runner import run_once, scale_arrivals
    from policies.registry import make_batch_policy

    for policy in args.policies:  # a bad name or parameter fails here, before the engine starts
        make_batch_policy(*policy_arg(policy))
    window = _window(args.trace, args.requests)
    knee, knees = paper_knee(window, PROFILES["8b"])
    out: dict[str, Any] = {"runs": [], "trace": args.trace, "requests": len(window), "slo_s": PAPER_SLO,
                           "sim_knee_rps": knee, "sim_knees_rps": knees, "async_scheduling": not args.sync,
                           "fake_executor": bool(args.fake)}
    _save(out)
    if knee is None:
        raise SystemExit(f"no knee in the simulator for this window: {knees}")
    if args.tune_sarathi:
        budget, out["sarathi_tuning"] = tuned_sarathi(window, PROFILES["8b"])
        _save(out)
        if budget is not None and f"sarathi:token_budget={budget}" not in args.policies:
            args.policies.append(f"sarathi:token_budget={budget}")
        print(f"Sarathi's tuned budget in the simulator: {budget} tokens "
              f"(derived {out['sarathi_tuning']['derived_budget']})", flush=True)
    # Arrivals set the wall time: the window's span at each load, for each policy (plus drains, not counted).
    span_s = max(r.arrival_s for r in window) * offered_rps([r.arrival_s for r in window])
    estimate_s = sum(span_s / (knee * f) for f in args.loads) * len(args.policies)
    out["estimate_s"] = round(estimate_s)
    _save(out)
    print(f"simulator's knee {knee:.3f} req/s ({knees}); the runs take about {estimate_s / 60:.1f} min", flush=True)
    if estimate_s > args.max_minutes * 60:
        raise SystemExit(f"about {estimate_s / 60:.1f} min of arrivals, over --max-minutes {args.max_minutes:g}: "
                         "fewer --requests, --loads or --policies")
    opts = EngineOptions(model=args.model_8b, load_format="dummy", gpu_memory_utilization=0.9,
                         async_scheduling=not args.sync, enforce_eager=args.eager)
    unit = VllmUnit(0, opts, UnitSettings(policy="vllm", coefficients=profile_coefs(PROFILES["8b"])),
                    **_fake(args, 0))
    _start(unit)
    await _run([unit], "round_robin", warmup(), PAPER_SLO, "warmup")
    max_len = int(unit.llm.model_config.max_model_len)
    base_rps = offered_rps([r.arrival_s for r in window])
    for factor in args.loads:
        scale = base_rps / (knee * factor)
        reqs = [r for r in scale_arrivals(window, scale) if r.prompt_tokens + r.output_tokens <= max_len]
        for policy in args.policies:
            name, params = policy_arg(policy)
            wire: dict[str, ParamValue] = dict(params)  # the control channel coerces strings by the schema
            mid = unit.send_control(SetPolicy(name=name, params=wire))
            copy = make_batch_policy(name, params)

            def refuses(uid: int, pt: int, c: Any = copy) -> bool:  # the policy's own rule (False but for PAB)
                return bool(c.refuses_within(pt, unit.load().prefill_admission_budget))

            t = time.time()
            res = await run_workload([unit], DISPATCH_POLICIES["round_robin"](), reqs, ttft_slo_s=PAPER_SLO[0],
                                     tpot_slo_s=PAPER_SLO[1], vocab=VOCAB, progress=True, refuses=refuses,
                                     seed=next(SEEDS))
            s = res.summary()
            offered = offered_rps([r.arrival_s for r in reqs])
            s.update(label=f"papers-{policy}-x{factor:g}", batch_policy=name, batch_params=params, load_factor=factor,
                     offered_rps=round(offered, 3), effective_rps=round(offered * s["slo_attainment"], 3))
            reply = unit.control_replies.pop(mid, None)
            s["policy_swap_ok"] = reply is not None and reply.ok
            s["sim_check"] = mape(res.raw[0], profile_coefs(PROFILES["8b"]))
            s["step_ms"] = step_percentiles(res.raw[0])
            sim = run_once(paper_config(PROFILES["8b"], name, params), reqs).summary
            s["simulated"] = {k: sim.get(k) for k in ("slo_attainment", "effective_rps", "ttft_ms", "tpot_ms")}
            print(f"[{s['label']}] attainment {s['slo_attainment']:.3f} (sim {sim.get('slo_attainment')}), "
                  f"effective {s['effective_rps']:.2f} req/s, rejected {s['rejected']} ({time.time() - t:.0f}s)",
                  flush=True)
            out["runs"].append(s)
            _save(out)
    await unit.stop()
    return out


HISTORY = 500_000
"""Step records and outcomes each unit keeps: every one of a part's runs (the analysis reads them all)."""


def _fake(args: argparse.Namespace, unit_id: int) -> dict[str, Any]:
    """The unit's extra arguments: its history, and with ``--fake`` a tiny model config on the CPU with the fake
    executor (no GPU). The papers part's fake engine is shaped like its GPU engine: async scheduling (unless
    ``--sync``), the 8B H100 profile's step times (sleeps on the executor's thread, overlapping the next step's
    planning as a GPU's run does), 8,192 tokens and 256 requests per step, the H100's 28,239 KV blocks; the other
    parts' is a small one."""
    if not args.fake:
        return {"history": HISTORY}
    from agent.engine.vllm.cpu import cpu_vllm_config
    from agent.engine.vllm.fake_executor import FakeExecutor

    if args.part == "papers":
        from agent.engine.vllm.scheduler import DEFAULT_COEFFICIENTS as c

        config = cpu_vllm_config(async_scheduling=not args.sync, max_num_batched_tokens=8192, max_num_seqs=256,
                                 num_blocks=28_239, max_model_len=16_384,
                                 step_model=profile_coefs(PROFILES["8b"]) or (c.a_s, c.b_s, c.c_s))
    else:
        config = cpu_vllm_config(async_scheduling=False)
    return {"vllm_config": config, "executor_class": FakeExecutor, "history": HISTORY}


async def part_smoke(args: argparse.Namespace) -> dict[str, Any]:
    global BURSTY_8B, BURSTY_1B
    BURSTY_8B = "bursty:rate=20,n=60"
    BURSTY_1B = "bursty:rate=40,n=60"
    sys.modules[__name__].sharegpt_like = lambda: [RequestSpec(f"s{i:03d}", 0.0, 100 + i, 20) for i in range(40)]  # type: ignore[attr-defined]
    return {"sync": await part_throughput(args, False), "dispatch": await part_dispatch(args)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.bench.vllm_validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("sync", "async", "slo", "dispatch", "papers", "smoke"))
    ap.add_argument("--trace", default=PAPER_TRACE, help="the papers part's trace")
    ap.add_argument("--requests", type=int, default=200, help="the papers part: the trace's first N requests")
    ap.add_argument("--loads", type=lambda t: [float(x) for x in t.split(",")], default=[0.9, 1.0, 1.15],
                    help="the papers part: loads as multiples of the simulator's knee (comma-separated)")
    ap.add_argument("--policies", type=lambda t: t.split(","), default=list(PAPER_POLICIES),
                    help="the papers part: batch policies, comma-separated, each NAME or NAME:key=value;key=value "
                         "(e.g. 'sarathi,fairbatching:anchor=first_token')")
    ap.add_argument("--max-minutes", type=float, default=8.0,
                    help="the papers part: refuse to start when the arrivals alone would take longer")
    ap.add_argument("--workload", default="bursty:rate=24,n=1000", help="the slo part's workload")
    ap.add_argument("--model-8b", default=os.path.abspath(".gpu/models/llama31-8b"))
    ap.add_argument("--model-1b", default=os.path.abspath(".gpu/models/llama32-1b"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--skip-slo", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="sync/async: rounds of plain then trackside, each on a fresh "
                    "engine (the ratio per round)")
    ap.add_argument("--fake", action="store_true", help="CPU: tiny model, fake executor (smoke test of the path)")
    ap.add_argument("--tune-sarathi", action="store_true", help="the papers part: also run Sarathi with its token "
                    "budget tuned in the simulator on the same window (seed 003's tuned baseline)")
    ap.add_argument("--sync", action="store_true", help="the papers part: synchronous scheduling (default: async, "
                    "vLLM's default)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    SAVE[:] = [args.out / f"{args.part}.partial.json"]  # this call's (a second call in one process writes its own)
    if args.part == "sync":
        result = asyncio.run(part_throughput(args, False))
    elif args.part == "async":
        result = asyncio.run(part_throughput(args, True))
    elif args.part == "slo":
        result = asyncio.run(part_slo(args))
    elif args.part == "dispatch":
        result = asyncio.run(part_dispatch(args))
    elif args.part == "papers":
        result = asyncio.run(part_papers(args))
    else:
        args.fake = True
        result = asyncio.run(part_smoke(args))
    result["machine"] = {"host": platform.node(), "python": platform.python_version(), "date": time.strftime("%F")}
    result["machine"].update(engine_versions())
    result["elapsed_s"] = round(time.time() - t, 1)
    path = args.out / f"{args.part}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['elapsed_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
