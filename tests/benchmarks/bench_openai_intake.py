"""The OpenAI intake's own cost: trackside's front end against vLLM's, on the CPU (needs the vllm extra).

    python tests/benchmarks/bench_openai_intake.py [--rounds 3] [--prompts 1500] [--concurrency 64] [--rate R]

On the H200 (docs/vllm.md, 2026-11-26) the agent's OpenAI intake reached 0.854 of plain ``vllm serve``'s saturated
output throughput while our scheduler alone, without the HTTP front end, reached 0.991: the gap is in the agent's
process in front of the engine. This benchmark measures that process without a GPU. Both sides run one engine
of the tiny model on the fake executor (a step costs a few milliseconds, so the front end, not the engine, is
what saturates; 1,024 KV blocks as the agent's fake unit has, hence the small prompts) and take the same
``vllm bench serve`` load (random prompts, ``--ignore-eos``, saturating):

* **plain**: vLLM's own OpenAI app (``build_openai_app``) directly over the engine's ``AsyncLLM``, vLLM's own
  scheduler: what ``vllm serve`` runs in front of an engine (``--plain-scheduler trackside``: our scheduler with
  the ``vllm`` policy there too, so that only the front ends differ; on this CPU the engine core shares the two
  cores with the front end and the client, so its cost shows in the throughput too, unlike on a GPU);
* **trackside**: ``trackside agent --engine vllm --fake-executor --units 1 --serve-openai ...``: the same app over
  our engine client, the dispatcher, the live node and its telemetry, our scheduler with the ``vllm`` policy.

The sides alternate (plain, trackside, plain, ...) for ``--rounds`` rounds; the table has each run's output
throughput and TTFT (the client's, and the server's own from its ``/metrics`` histogram: coarse buckets), the
front end's CPU per output token (the server process's own CPU time over the run, its engine core apart), the
medians and their ratio. The machine's other load moves both sides alike only roughly:
read the ratio, and run it twice.

``--against REV`` compares trackside with trackside instead: this tree's agent against REV's, checked out in a
temporary git worktree (removed afterwards), both running their source (``TRACKSIDE_PURE=1``, as on the GPU
machine), alternately. It is how a change to the front end's per-token path is measured (docs/vllm.md, "The front
end per token").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.bench.vllm_serve_compare import MODEL_NAME, Run, metered, python_module, start, stop, wait_healthy


def serve_plain(port: int, max_num_seqs: int, scheduler: str, use_uvloop: bool = False) -> None:
    """vLLM's OpenAI app over one fake-executor ``AsyncLLM`` (vLLM's scheduler, or ours with the ``vllm``
    policy), until killed."""
    import uvicorn

    from agent.engine.vllm.config import UnitSettings
    from agent.engine.vllm.cpu import cpu_vllm_config, tiny_model_dir
    from agent.engine.vllm.fake_executor import FakeExecutor
    from agent.engine.vllm.openai_app import build_openai_app, frontend_namespace
    from agent.engine.vllm.options import EngineOptions
    from agent.engine.vllm.unit import VllmUnit

    config = cpu_vllm_config(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs, max_model_len=4096,
                             num_blocks=1024, async_scheduling=True, prefix_caching=True, tokenizer=True)
    unit = VllmUnit(0, EngineOptions(model=MODEL_NAME, max_num_batched_tokens=2048, max_num_seqs=max_num_seqs,
                                     plain=scheduler == "vllm"), UnitSettings(policy="vllm"), vllm_config=config,
                    executor_class=FakeExecutor)

    async def main() -> None:
        unit.start()  # its watchdog needs the running loop
        app = await build_openai_app(unit.llm, frontend_namespace(tiny_model_dir(), MODEL_NAME))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        await server.serve()

    if use_uvloop:  # as vllm serve runs its API server
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=64, help="also max_num_seqs on both sides")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rate", default="inf", help="requests/s (Poisson); default inf: saturating")
    ap.add_argument("--plain-scheduler", choices=("vllm", "trackside"), default="vllm",
                    help="the plain side's scheduler: vLLM's (what vllm serve runs) or ours with the vllm policy "
                         "(then the ratio is the front end's alone)")
    ap.add_argument("--uvloop", action="store_true",
                    help="both front ends on uvloop's event loop (vllm serve's; the agent's --uvloop), not asyncio's")
    ap.add_argument("--against", metavar="REV",
                    help="trackside at this tree against trackside at REV (a git worktree), both from source")
    ap.add_argument("--serve-plain", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the plain server itself
    args = ap.parse_args()
    if args.serve_plain:
        serve_plain(args.serve_plain, args.concurrency, args.plain_scheduler, args.uvloop)
        return 0
    if args.against:
        from bench_sim_speed import ROOT, describe_tree, worktree

        with worktree(args.against) as other:
            print(f"this tree: {describe_tree(ROOT)}\n{args.against}: {describe_tree(other)}")
            return compare(args, {"this tree": ROOT, args.against: other})
    return compare(args, None)


def compare(args: argparse.Namespace, trees: dict[str, Path] | None) -> int:
    """The rounds, sides alternating: plain and trackside, or (``trees``) trackside at each tree."""
    from agent.engine.vllm.cpu import tiny_model_dir

    tokenizer = tiny_model_dir()
    out = Path(tempfile.mkdtemp(prefix="bench-intake-"))
    run = Run(out)
    token = out / "token"
    token.write_text("bench-intake-token-0123456789")
    token.chmod(0o600)
    agent = [*python_module("agent.cli"), "agent", "--engine", "vllm", "--fake-executor", "--units", "1",
             "--serve-openai", "127.0.0.1:8411", "--listen", "127.0.0.1:7711", "--token-file", str(token),
             "--served-model-name", MODEL_NAME, "--max-num-seqs", str(args.concurrency),
             "--max-num-batched-tokens", "2048", *(["--uvloop"] if args.uvloop else [])]
    here = Path(__file__).resolve().parents[2]
    sides: dict[str, tuple[list[str], Path, dict[str, str]]] = {
        "plain": ([sys.executable, str(Path(__file__).resolve()), "--serve-plain", "8411",
                   "--concurrency", str(args.concurrency), "--plain-scheduler", args.plain_scheduler,
                   *(["--uvloop"] if args.uvloop else [])], here, {}),
        "trackside": (agent, here, {}),
    } if trees is None else {
        name: (agent, tree, {"PYTHONPATH": str(tree), "TRACKSIDE_PURE": "1"}) for name, tree in trees.items()
    }
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, (cmd, cwd, env) in sides.items():
            label = side.replace(" ", "-")
            proc = start(cmd, out / f"server-{label}-{r}.log", cwd, env)
            try:
                wait_healthy("http://127.0.0.1:8411/health", proc, 300)
                summary = metered(run, proc, "http://127.0.0.1:8411", tokenizer, f"{label}-{r}",
                                  prompts=args.prompts, rate=args.rate, concurrency=args.concurrency,
                                  input_len=args.input_len, output_len=args.output_len)
            finally:
                stop(proc)
            if summary.get("completed") != args.prompts:
                raise SystemExit(f"{side} round {r}: {summary}")
            results[side].append(summary)
    width = max(10, *map(len, sides))
    print(f"\n{'side':<{width}} {'round':>5} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'TPOT p50 ms':>12} {'server TTFT p50/p99 ms':>23} {'front end us/token':>19}")
    for side, runs in results.items():
        for r, s in enumerate(runs):
            own = s.get("server_ttft_ms") or {}
            print(f"{side:<{width}} {r:>5} {s['output_throughput']:>10.0f} {s['median_ttft_ms']:>12.1f} "
                  f"{s['p99_ttft_ms']:>12.1f} {s['median_tpot_ms']:>12.2f} "
                  f"{str(own.get('p50')) + ' / ' + str(own.get('p99')):>23} "
                  f"{s['cpu'].get('server_us_per_output_token', float('nan')):>19.1f}")
    first, second = sides
    med = {side: statistics.median(s["output_throughput"] for s in runs) for side, runs in results.items()}
    cpu = {side: statistics.median(s["cpu"].get("server_us_per_output_token", float("nan")) for s in runs)
           for side, runs in results.items()}
    print(f"\nmedian output tok/s: {first} {med[first]:.0f}, {second} {med[second]:.0f}, "
          f"ratio {med[second] / med[first]:.3f}")
    print(f"median front-end CPU per output token: {first} {cpu[first]:.1f} us, {second} {cpu[second]:.1f} us, "
          f"ratio {cpu[second] / cpu[first]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
