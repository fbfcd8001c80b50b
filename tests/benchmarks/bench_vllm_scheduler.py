"""CPU cost of the trackside scheduler against vLLM's own, per engine step (needs the vllm extra).

    python tests/benchmarks/bench_vllm_scheduler.py [--shapes 256x1000,256x64,64x1000] [--policies all]
                                                    [--steps 300] [--repeats 3] [--async-scheduling]

A real vLLM 0.26.0 ``Scheduler`` and our ``PolicyScheduler`` with each batch policy are driven through the same
decode-heavy state: ``R`` requests decoding (``max_num_seqs = R``) and ``W`` queued behind them, for each shape
``RxW``. Each step is ``schedule()`` plus ``update_from_output()`` with fake outputs; the difference is what the
policy costs on the engine's critical path when scheduling is synchronous (with async scheduling it overlaps the
GPU step; ``--async-scheduling`` drives vLLM's ``AsyncScheduler`` and ours the way the engine core does then, step
N+1 scheduled before N's output is applied, and times the same CPU work per step). Within a shape, vLLM's own
scheduler and every policy are timed one after the other, ``--repeats`` times in turn (A B C ... A B C ...), so
that a machine whose speed drifts affects them alike; each run's figure is the median step after 20 warm-up
steps, and the table shows the median over the repeats of

- ``us/step``: the whole step (vLLM's own: its scheduler alone; ours: its scheduler with the policy inside);
- ``ratio``: ours / vLLM's own in the same repeat (issue #21 item 5's target: at most 1.10);
- ``plan``: the policy's decision alone (``plan()``, p50 over the run's steps) as a share of vLLM's own step in
  that repeat (item 5's target: at most 5%); ``native`` where vLLM's own scheduler decides (the ``vllm`` policy
  with its defaults: ``PolicySchedulerMixin._ts_native``), so no ``plan()`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_harness import Arrival, Shape, fake_output, make_request, make_scheduler

from agent.engine.vllm.config import KEY, UnitSettings
from agent.engine.vllm.scheduler import PolicyAsyncScheduler, PolicyScheduler
from policies.registry import BATCH_POLICIES

WARMUP = 20


def run(sched: Any, running: int, waiting: int, steps: int, lag: int = 0) -> tuple[float, float | None]:
    """Median us per step, and the policy's median ``plan()`` us (None for vLLM's own scheduler). ``lag=1``: as
    under async scheduling, each step's output is applied after the next step is scheduled."""
    plans: list[float] = []
    policy = getattr(sched, "ts_policy", None)
    if policy is not None:
        inner = policy.plan

        def timed(view: Any, now: float) -> Any:
            t = time.perf_counter()
            plan = inner(view, now)
            plans.append(time.perf_counter() - t)
            return plan

        policy.plan = timed
    now = time.time()
    for i in range(running + waiting):
        sched.add_request(make_request(Arrival(0, f"r{i:05d}", 64, 100_000), now))
    times = []
    queue: list[tuple[Any, Any]] = []
    for _ in range(steps + WARMUP):
        t = time.perf_counter()
        out = sched.schedule()
        queue.append((out, fake_output(sched, out)))
        while len(queue) > lag:
            sched.update_from_output(*queue.pop(0))
        times.append(time.perf_counter() - t)
    step_us = statistics.median(times[WARMUP:]) * 1e6
    plan_us = statistics.median(plans[WARMUP:]) * 1e6 if plans else None
    return step_us, plan_us


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        r, _, w = item.partition("x")
        shapes.append((int(r), int(w)))
    return shapes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("256x1000,256x64,64x1000"),
                    help="RUNNINGxWAITING, comma-separated (default: the three shapes of issue #21 item 5)")
    ap.add_argument("--policies", default="all", help="comma-separated batch policies, or all (default)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per run (after 20 warm-up steps)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per scheduler and shape, taken in turn")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="vLLM's AsyncScheduler and ours (vLLM's default): step N+1 scheduled before N's output")
    args = ap.parse_args()
    lag = int(args.async_scheduling)
    theirs_cls = AsyncScheduler if args.async_scheduling else Scheduler
    ours_cls = PolicyAsyncScheduler if args.async_scheduling else PolicyScheduler
    policies = sorted(BATCH_POLICIES) if args.policies == "all" else args.policies.split(",")
    print(f"{'shape':>9} {'scheduler':18} {'us/step':>8} {'ratio':>6} {'plan us':>8} {'plan':>6}")
    for running, waiting in args.shapes:
        shape = Shape(max_num_batched_tokens=8192, max_num_seqs=running, num_blocks=200_000, max_model_len=16384,
                      async_scheduling=args.async_scheduling)
        base: list[float] = []
        ours: dict[str, list[tuple[float, float, float | None, float | None]]] = {p: [] for p in policies}
        for _ in range(args.repeats):
            b, _ = run(make_scheduler(theirs_cls, shape), running, waiting, args.steps, lag)
            base.append(b)
            for policy in policies:
                sched = make_scheduler(ours_cls, shape, {KEY: UnitSettings(policy=policy).as_config()})
                us, plan_us = run(sched, running, waiting, args.steps, lag)
                ours[policy].append((us, us / b, plan_us, None if plan_us is None else plan_us / b))
        label = f"{running}x{waiting}"
        print(f"{label:>9} {'vLLM Scheduler':18} {statistics.median(base):8.0f}")
        for policy in policies:
            rows = ours[policy]
            us = statistics.median(r[0] for r in rows)
            ratio = statistics.median(r[1] for r in rows)
            if any(r[2] is None for r in rows):  # vLLM's own scheduler decided (a native step: no plan() called)
                print(f"{label:>9} {policy:18} {us:8.0f} {ratio:6.3f} {'native':>8} {'-':>6}", flush=True)
                continue
            plan_us = statistics.median(r[2] for r in rows)
            share = statistics.median(r[3] for r in rows)
            print(f"{label:>9} {policy:18} {us:8.0f} {ratio:6.3f} {plan_us:8.1f} {share * 100:5.1f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
