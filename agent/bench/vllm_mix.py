"""Step time of mixed batches against the decode share, on one vLLM engine (issue #19 item 6; needs a GPU).

    python -m agent.bench.vllm_mix --model-8b DIR --out DIR [--eager] [--cells 512:256,512:1024,2048:256]
    python -m agent.bench.vllm_mix --fake --out DIR          # the same path on the CPU (fake executor)

The simulator charges a step that mixes prefill and decode tokens ``(a + b*new + c*ctx) * (1 + kappa*rho*(1-rho))``
with ``rho`` the decode share of its tokens; seed 002 says only attention grows with the decode share. The shipped
``kappa`` comes from calibration records with few mixed steps, and one earlier experiment measured three shares of
one step size (``docs/simulator.md``, "Mixed-batch interference"). This part measures the whole curve on one engine,
for each cell ``T:C`` (a step of exactly ``T`` tokens, its decodes at about ``C`` tokens of context), at the decode
shares ``--rhos``:

* ``D = round(rho * T)`` requests of ``C`` prompt tokens that decode long enough, prefilled at the engine's full
  budget (8,192 tokens); then vLLM's default policy's token budget drops to ``T`` over the control channel and
  prompts of 4,096 tokens that produce one token each arrive, enough to fill ``T - D`` tokens of 30 steps (without
  the full budget first, the last decodes' prompts would get ever fewer tokens per step and, at ``D = T``, none);
* one engine for every cell, synchronous scheduling (each step's time is the step alone), the prefix cache off;
* the steps of exactly ``D`` decode and ``T - D`` prefill tokens are kept: their median time, their count, and the
  median context, beside the shipped profile's linear prediction ``a + b*T + c*ctx`` and with its ``kappa``.

``D`` is at most the engine's 512 sequences, so ``T`` = 512 covers every share and larger steps the small ones.
Writes ``mix.json`` (every cell and share) under ``--out`` and prints one line per share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from agent.bench.vllm_validate import HISTORY, PROFILES, SEEDS, VOCAB, _start, profile_coefs
from agent.engine.vllm.config import UnitSettings
from agent.engine.vllm.cpu import engine_versions
from agent.engine.vllm.messages import SetPolicy, StepMessage
from agent.engine.vllm.options import EngineOptions
from agent.engine.vllm.unit import VllmUnit
from agent.workload.types import RequestSpec
from policies.registry import DISPATCH_POLICIES

RHOS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
FEEDER_TOKENS = 4096
MEASURED_STEPS = 30
MAX_SEQS = 512
LONG_OUTPUT = 8000
ENGINE_BUDGET = 8192
"""The engine's token budget per step; each share's decodes are prefilled with it before the budget drops to T."""


def parse_cells(text: str) -> list[tuple[int, int]]:
    """``T:C,T:C``: step tokens and decode context of each cell."""
    cells = []
    for item in text.split(","):
        t, _, c = item.partition(":")
        cells.append((int(t), int(c)))
    return cells


def cell_requests(tokens: int, context: int, rho: float, tag: str) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """One share's decodes and prefill feeders (module docstring). The decodes ask for more tokens than they will
    produce: they are aborted once the share is measured."""
    d = min(round(rho * tokens), MAX_SEQS)
    decodes = [RequestSpec(f"{tag}-d{i:03d}", 0.0, context, LONG_OUTPUT) for i in range(d)]
    feed = tokens - d
    feeders: list[RequestSpec] = []
    if feed > 0:
        n = -(-(feed * (MEASURED_STEPS + 4)) // FEEDER_TOKENS) + 1  # tokens for 30 full steps and some
        n = max(1, min(n, MAX_SEQS - d))
        feeders = [RequestSpec(f"{tag}-p{i:03d}", 0.0, FEEDER_TOKENS, 1) for i in range(n)]
    return decodes, feeders


def exact_steps(raw: list[StepMessage], tokens: int, d: int) -> list[StepMessage]:
    """The steps of exactly ``d`` decode and ``tokens - d`` prefill tokens."""
    return [r for r in raw if r.num_decode_tokens == d and r.num_prefill_tokens == tokens - d]


def summarize(steps: list[StepMessage], tokens: int, d: int, coefs: tuple[float, float, float] | None,
              kappa: float) -> dict[str, Any]:
    row: dict[str, Any] = {"steps": len(steps), "decode_tokens": d, "prefill_tokens": tokens - d}
    if not steps:
        return row
    t = statistics.median(r.duration_s for r in steps)
    ctx = statistics.median(r.context_tokens for r in steps)
    row.update(t_med_ms=round(t * 1e3, 3), t_min_ms=round(min(r.duration_s for r in steps) * 1e3, 3),
               t_max_ms=round(max(r.duration_s for r in steps) * 1e3, 3), context_tokens=int(ctx))
    if coefs is not None:
        a, b, c = coefs
        linear = a + b * tokens + c * ctx
        rho = d / tokens if tokens else 0.0
        with_kappa = linear * (1 + kappa * rho * (1 - rho))
        row.update(linear_ms=round(linear * 1e3, 3), with_kappa_ms=round(with_kappa * 1e3, 3),
                   measured_over_linear=round(t / linear, 4))
    return row


async def _until(check: Any, timeout_s: float, what: str) -> None:
    t = time.time()
    while not check():
        if time.time() - t > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(0.01)


async def measure_share(unit: VllmUnit, tokens: int, context: int, rho: float,
                        seed: int) -> tuple[int, list[StepMessage]]:
    """One share on a running unit: the decodes prefilled at the full budget, the budget down to ``T``, the feeders
    in, :data:`MEASURED_STEPS` exact steps (or what came in a minute), everything aborted. ``D`` and the steps after
    the switch."""
    from agent.runtime.live.cluster import LiveCluster
    from agent.runtime.live.requests import ClusterRequest
    from agent.workload.prompts import prompt_ids

    tag = f"T{tokens}C{context}r{rho:g}"
    decodes, feeders = cell_requests(tokens, context, rho, tag)
    d = len(decodes)
    cluster = LiveCluster([unit], DISPATCH_POLICIES["round_robin"](), ttft_slo_s=60.0, tpot_slo_s=60.0)
    cluster.start()
    ids: list[str] = []

    def submit(specs: list[RequestSpec]) -> None:
        for spec in specs:
            ids.append(spec.request_id)
            cluster.submit(ClusterRequest(spec.request_id, prompt_ids(spec, VOCAB, seed), spec.output_tokens),
                           collect=False)

    def idle() -> bool:
        load = unit.load()
        return load.num_waiting + load.num_running == 0

    start = len(unit.raw)  # where the steps at budget T begin (set again at the switch)
    steps: list[StepMessage] = []
    try:
        try:
            unit.send_control(SetPolicy(name="vllm", params={"max_num_batched_tokens": ENGINE_BUDGET}))
            submit(decodes)
            if d:
                await _until(lambda: bool(unit.raw) and unit.raw[-1].num_decode_tokens == d, 600.0,
                             f"{tag}: the decodes' prefill")
            unit.send_control(SetPolicy(name="vllm", params={"max_num_batched_tokens": tokens}))
            start = len(unit.raw)
            submit(feeders)
            await _until(lambda: len(exact_steps(unit.raw[start:], tokens, d)) >= MEASURED_STEPS, 60.0,
                         f"{tag}: {MEASURED_STEPS} steps of exactly {d} decode and {tokens - d} prefill tokens")
        except TimeoutError as exc:
            print(f"[mix] {exc}", flush=True)
        steps = list(unit.raw[start:])  # before the aborts' steps
    finally:
        for rid in ids:
            cluster.abort(rid)
        try:
            await _until(idle, 120.0, f"{tag}: the aborts")
        finally:
            await cluster.close()
    return d, steps


async def run(args: argparse.Namespace) -> dict[str, Any]:
    coefs = profile_coefs(PROFILES["8b"])
    kappa = 0.0
    if coefs is not None:
        from agent.engine.profiles import load_profile

        kappa = load_profile(PROFILES["8b"]).interference_kappa
    opts = EngineOptions(model=args.model_8b, load_format="dummy", gpu_memory_utilization=0.9, async_scheduling=False,
                         enforce_eager=args.eager, enable_prefix_caching=False, max_num_seqs=MAX_SEQS,
                         max_num_batched_tokens=ENGINE_BUDGET)
    unit = VllmUnit(0, opts, UnitSettings(policy="vllm", coefficients=coefs), **_engine(args))
    out: dict[str, Any] = {"cells": [], "kappa": kappa, "profile": PROFILES["8b"], "rhos": list(args.rhos)}
    _start(unit)
    try:
        for tokens, context in args.cells:
            for rho in args.rhos:
                if round(rho * tokens) > MAX_SEQS:
                    continue
                t = time.time()
                d, steps = await measure_share(unit, tokens, context, rho, next(SEEDS))
                row = summarize(exact_steps(steps, tokens, d), tokens, d, coefs, kappa)
                row.update(tokens=tokens, context=context, rho=rho, wall_s=round(time.time() - t, 1))
                out["cells"].append(row)
                print(f"[mix] T={tokens} C={context} rho={rho:g}: {json.dumps(row)}", flush=True)
                (args.out / "mix.partial.json").write_text(json.dumps(out, indent=1))
    finally:
        await unit.stop()
    return out


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    """The unit's extra arguments: on a GPU its history; with ``--fake`` a tiny model on the CPU with the fake
    executor (the 8B profile's step times, 512 sequences, 28,239 KV blocks, synchronous scheduling)."""
    if not args.fake:
        return {"history": HISTORY}
    from agent.engine.vllm.cpu import cpu_vllm_config
    from agent.engine.vllm.fake_executor import FakeExecutor
    from agent.engine.vllm.scheduler import DEFAULT_COEFFICIENTS as c

    config = cpu_vllm_config(async_scheduling=False, max_num_batched_tokens=ENGINE_BUDGET,
                             max_num_seqs=MAX_SEQS, num_blocks=28_239, max_model_len=16_384,
                             step_model=profile_coefs(PROFILES["8b"]) or (c.a_s, c.b_s, c.c_s))
    return {"vllm_config": config, "executor_class": FakeExecutor, "history": HISTORY}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.bench.vllm_mix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-8b", default=os.path.abspath(".gpu/models/llama31-8b"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--cells", type=parse_cells, default=parse_cells("512:256,512:1024,2048:256"),
                    help="T:C pairs, comma-separated: step tokens and decode context "
                         "(default 512:256,512:1024,2048:256)")
    ap.add_argument("--rhos", type=lambda t: [float(x) for x in t.split(",")], default=list(RHOS),
                    help="decode shares, comma-separated (default 0 to 1 in eighths)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--fake", action="store_true", help="CPU: tiny model, fake executor (the path, not the numbers)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    result = asyncio.run(run(args))
    result["machine"] = {"host": platform.node(), "python": platform.python_version(), "date": time.strftime("%F"),
                         "fake_executor": args.fake, "eager": args.eager}
    result["machine"].update(engine_versions())
    result["elapsed_s"] = round(time.time() - t, 1)
    path = args.out / "mix.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({result['elapsed_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
