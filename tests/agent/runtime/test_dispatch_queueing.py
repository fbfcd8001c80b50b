"""The queueing argument of staggered batch scheduling (seed 000, section 3; POLICIES.md 2.2).

N units whose steps last a fixed T and never stop (each keeps one long decode running), with step phases
spread over the cycle (unit k starts at k*T/N), take uniformly arriving one-token requests. Immediate dispatch
binds a request to a unit in the middle of its step: it waits for that step to end, T/2 on average. Staggered
dispatch holds it at the dispatcher until the next unit ends its step: T/(2N) on average.

In lockstep (every unit steps together, DP+EP) no dispatcher can do better than T/2: every unit's next step
starts at the same instant. The paper's T/(2N) is across instances whose steps are out of phase: with G
instances of lockstep units, T/(2G).
"""

from __future__ import annotations

import numpy as np
import pytest
from node_builders import make_unit

from agent.runtime.node import Node
from agent.workload.types import RequestSpec
from policies.cost.step_model import StepCoefficients
from policies.registry import make_dispatch_policy

T = 0.1
N = 4
SBS = {"net_latency_ms": 0.0, "default_step_ms": T * 1e3}


def mean_wait(dispatch: str, *, lockstep: bool = False, params: dict[str, object] | None = None,
              instances: int = 0) -> float:
    """With ``instances`` (G), the N units form G lockstep groups of N/G units, group g's phase g*T/G."""
    units = [make_unit(k, cost=StepCoefficients(T, 0.0, 0.0)) for k in range(N)]
    size = N // instances if instances else 1
    groups = [list(range(g * size, (g + 1) * size)) for g in range(instances)] if instances else None
    keep_busy = [RequestSpec(f"bg{k}", (k // size) * T * size / N, 16, 10**6) for k in range(N)]
    rng = np.random.default_rng(7)
    times = np.sort(rng.uniform(2 * T, 2 * T + 200 * T, 4000))
    probes = [RequestSpec(f"q{i:05d}", float(t), 16, 1) for i, t in enumerate(times)]
    done: dict[str, float] = {}
    node = Node(
        units,
        make_dispatch_policy(dispatch, params or {}),
        keep_busy + probes,
        ttft_slo_s=1e9,
        tpot_slo_s=1e9,
        on_finish=lambda o: done.__setitem__(o.request_id, o.first_token_s),
        lockstep=lockstep,
        lockstep_groups=groups,
    )
    node.advance(205 * T)
    assert len(done) == len(probes)
    # Time to first token minus the one step that computes the request: the time spent waiting.
    return float(np.mean([done[r.request_id] - r.arrival_s - T for r in probes]))


def test_immediate_dispatch_waits_half_a_step() -> None:
    assert mean_wait("round_robin") == pytest.approx(T / 2, rel=0.10)


def test_least_loaded_waits_longer_than_half_a_step() -> None:
    # vLLM's score (4 * waiting + running) avoids units that already hold a request for their next step,
    # i.e. the ones about to start it, and prefers those that just started one: worse than a random phase.
    assert mean_wait("least_loaded") > 1.2 * T / 2


def test_staggered_dispatch_waits_half_a_step_over_n() -> None:
    assert mean_wait("sbs", params=SBS) == pytest.approx(T / (2 * N), rel=0.10)


@pytest.mark.parametrize("dispatch", ["round_robin", "sbs"])
def test_in_lockstep_every_dispatcher_waits_half_a_step(dispatch: str) -> None:
    assert mean_wait(dispatch, lockstep=True, params=SBS if dispatch == "sbs" else None) == pytest.approx(
        T / 2, rel=0.10
    )


def test_across_instances_staggered_dispatch_waits_half_a_step_over_the_instances() -> None:
    # Seed 000's deployment: 2 instances of 2 DP units, lockstep inside, out of phase. Immediate dispatch still
    # waits T/2; SBS T/(2G) with G = 2 instances, not T/(2N): the units of one instance end their steps together,
    # and SBS fires on those end-of-step reports (its fast path), so it needs no notion of instances for this.
    assert mean_wait("round_robin", instances=2) == pytest.approx(T / 2, rel=0.10)
    assert mean_wait("sbs", params=SBS, instances=2) == pytest.approx(T / 4, rel=0.10)
