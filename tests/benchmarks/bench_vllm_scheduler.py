"""CPU cost of the trackside scheduler against vLLM's own, per engine step (needs the vllm extra).

    python tests/benchmarks/bench_vllm_scheduler.py [--running 256] [--waiting 1000] [--steps 300]

A real vLLM 0.26.0 ``Scheduler`` and our ``PolicyScheduler`` (``vllm`` policy, then ``fairbatching``) are
driven through the same decode-heavy state: ``--running`` requests decoding and ``--waiting`` queued behind
a full ``max_num_seqs``. Each step is ``schedule()`` plus ``update_from_output()`` with fake outputs; the
difference is what the policy costs on the engine's critical path when scheduling is synchronous (with async
scheduling it overlaps the GPU step). Prints the median microseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.v1.core.sched.scheduler import Scheduler
from vllm_harness import Arrival, Shape, fake_output, make_request, make_scheduler

from agent.engine.vllm.config import KEY, UnitSettings
from agent.engine.vllm.scheduler import PolicyScheduler


def per_step_us(sched: Scheduler, running: int, waiting: int, steps: int) -> float:
    now = time.time()
    for i in range(running + waiting):
        sched.add_request(make_request(Arrival(0, f"r{i:05d}", 64, 100_000), now))
    times = []
    for _ in range(steps + 20):
        t = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, fake_output(sched, out))
        times.append(time.perf_counter() - t)
    return statistics.median(times[20:]) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    shape = Shape(max_num_batched_tokens=8192, max_num_seqs=args.running, num_blocks=200_000,
                  max_model_len=16384)
    base = per_step_us(make_scheduler(Scheduler, shape), args.running, args.waiting, args.steps)
    print(f"vLLM Scheduler                 {base:8.0f} us/step")
    for policy in ("vllm", "fairbatching"):
        sched = make_scheduler(PolicyScheduler, shape, {KEY: UnitSettings(policy=policy).as_config()})
        ours = per_step_us(sched, args.running, args.waiting, args.steps)
        print(f"PolicyScheduler ({policy:12s}) {ours:8.0f} us/step  (+{ours - base:.0f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
