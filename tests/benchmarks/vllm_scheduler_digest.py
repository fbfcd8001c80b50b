"""The vLLM scheduler's decisions and step records over many driven runs, as JSON, to check that a change to
``agent/engine/vllm/scheduler.py`` leaves them unchanged (issue #21 items 2 and 5).

    python tests/benchmarks/vllm_scheduler_digest.py OUT.json [--tree DIR]   # DIR: another checkout (a worktree)
    cmp before.json after.json

Real vLLM 0.26.0 schedulers (``tests/vllm_harness.py``) with the policies whose decisions do not read the clock
(``vllm`` with and without parameters, ``sarathi``, ``eb``, ``static``), sync and async, 4 request streams, a KV
cache that preempts (60 blocks) and one that does not (400), with and without vLLM's own prefill threshold: 192
runs. Each run keeps its trace (scheduled tokens, admissions, preemptions, finishes per step) and its step records'
fields that do not depend on the clock. Prints the counts; asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

KEEP = ("step_id", "mode", "policy", "num_prefill_tokens", "num_decode_tokens", "num_prefill_reqs", "num_decode_reqs",
        "context_tokens", "budget_tokens", "kv_used_blocks", "num_blocks", "num_running", "num_waiting",
        "num_preempted", "num_finished", "reasons", "preempted", "admission_budget", "queued_prefill_tokens")
POLICIES: tuple[tuple[str, dict[str, object]], ...] = (
    ("vllm", {}), ("vllm", {"long_prefill_token_threshold": 64}), ("vllm", {"max_num_batched_tokens": 100}),
    ("sarathi", {}), ("eb", {}), ("static", {}),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                    help="the checkout whose scheduler runs (default: this one)")
    args = ap.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree), str(tree / "tests")]
    from vllm_harness import Shape, drive, make_scheduler, random_stream

    from agent.engine.vllm.config import KEY, UnitSettings
    from agent.engine.vllm.messages import StepMessage
    from agent.engine.vllm.scheduler import PolicyAsyncScheduler, PolicyScheduler

    out: dict[str, object] = {}
    steps = 0
    for (policy, params), async_, seed, blocks, threshold in itertools.product(
            POLICIES, (False, True), range(4), (60, 400), (0, 48)):
        shape = Shape(max_num_batched_tokens=256, num_blocks=blocks, async_scheduling=async_,
                      long_prefill_token_threshold=threshold)
        cls = PolicyAsyncScheduler if async_ else PolicyScheduler
        sched = make_scheduler(cls, shape, {KEY: UnitSettings(policy=policy, params=params).as_config()})
        trace = drive(sched, random_stream(seed, n=30, max_prompt=500, max_out=30), lag=int(async_))
        records = [{k: getattr(r, k) for k in KEEP} for r in sched.ts_sink.records if isinstance(r, StepMessage)]
        key = f"{policy}{params}-async={async_}-seed={seed}-blocks={blocks}-threshold={threshold}"
        out[key] = {"trace": [[t.scheduled, t.new_ids, t.preempted, t.finished] for t in trace], "records": records}
        steps += len(trace)
    args.out.write_text(json.dumps(out, sort_keys=True, default=str))
    print(f"{len(out)} runs, {steps} steps -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
