"""Builders of simulated units, nodes and requests without a calibration profile (tests of the runtime)."""

from __future__ import annotations

from collections.abc import Sequence

from builders import H100_LIKE, UNIT_COST

from agent.engine.base import RequestOutcome, StepRecord
from agent.engine.sim import SimUnit
from agent.engine.timing import StepTimer
from agent.runtime.node import Node
from agent.workload.types import RequestSpec
from policies.cost.step_model import StepCoefficients
from policies.registry import make_batch_policy, make_dispatch_policy

__all__ = ["H100_LIKE", "UNIT_COST", "make_unit", "requests", "run_node"]


def make_unit(
    unit_id: int = 0,
    policy: str = "vllm",
    *,
    cost: StepCoefficients = UNIT_COST,
    block_size: int = 16,
    num_blocks: int = 10_000,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    max_model_len: int | None = None,
    noise_sigma: float = 0.0,
    seed: int = 0,
    params: dict[str, str] | None = None,
    role: str = "mixed",
) -> SimUnit:
    return SimUnit(
        unit_id,
        make_batch_policy(policy, params or {}),
        StepTimer(cost, noise_sigma=noise_sigma, seed=seed),
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len if max_model_len is not None else min(16_384, num_blocks * block_size),
        role=role,
    )


def requests(pairs: Sequence[tuple[int, int]], arrivals: Sequence[float] | None = None) -> list[RequestSpec]:
    """RequestSpecs from (prompt, output) pairs; all at time 0 unless arrivals are given."""
    times = arrivals if arrivals is not None else [0.0] * len(pairs)
    return [RequestSpec(f"r{i:03d}", t, p, o) for i, ((p, o), t) in enumerate(zip(pairs, times, strict=True))]


def run_node(
    units: Sequence[SimUnit],
    reqs: Sequence[RequestSpec],
    dispatch: str = "round_robin",
    *,
    ttft_slo_s: float = 1e9,
    tpot_slo_s: float = 1e9,
) -> tuple[Node, list[StepRecord], list[RequestOutcome]]:
    steps: list[StepRecord] = []
    done: list[RequestOutcome] = []
    node = Node(
        units, make_dispatch_policy(dispatch), reqs, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
        on_step=steps.append, on_finish=done.append,
    )
    node.run()
    return node, steps, done
