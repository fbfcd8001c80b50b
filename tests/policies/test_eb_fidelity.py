"""EB(theta*)'s options that follow seed 002 more closely (issue #19, items 4 and 6).

``theta_method``: ``cfr`` (the default since 2026-11-26) is the paper's closed form (section 3.2.1), ``fluid`` our
maximization of the fluid model's throughput on the survival curve. With ``fluid``: ``theta_slots=in_use`` optimizes
theta* for the batch size in use (the last memory-safe N), the paper's one-step fixed point, not for
``max_num_seqs``; ``survival=linear_hazard`` takes theta*, t* and the reserve from the paper's linear-hazard
estimator instead of the empirical curve.
"""

from __future__ import annotations

import numpy as np
from builders import H100_LIKE, rview

from policies.batch.eb_model import cfr_ratio, closed_form_theta, optimal_theta
from policies.batch.exclusive import ExclusiveBatching
from policies.registry import make_batch_policy
from policies.types import RequestView, StepFeedback, StepMode, UnitView

MAX_SEQS = 256
OUTPUTS = tuple(int(x) for x in np.maximum(1, np.random.default_rng(1).gamma(4.0, 50.0, 64)))
"""Gamma-distributed output lengths (shape 4, mean 200): an increasing hazard, so theta* depends on N."""


def view(running: list[RequestView]) -> UnitView:
    return UnitView(0, 0, tuple(running), (), 16, 100_000, 100_000, 8192, MAX_SEQS, 16_384, H100_LIKE)


def finished(count: int = 64) -> StepFeedback:
    return StepFeedback(
        StepMode.DECODE, 0, count, count * 300, count, 0.02, 0.02, count, OUTPUTS[:count], tuple([200] * count), 0
    )


def adapted(params: dict[str, object], n_safe: int | None) -> ExclusiveBatching:
    """A policy that has seen 64 finished requests, its memory-safe N pinned at ``n_safe`` beforehand; theta* by the
    fluid model unless ``params`` say otherwise."""
    policy = make_batch_policy("eb", {"min_samples": 16, "update_every": 16, "memory_update_every": 1_000_000,
                                      "theta_method": "fluid", **params})
    assert isinstance(policy, ExclusiveBatching)
    running = [rview("d0", 100, computed=104, output=5)]
    policy.plan(view(running), 0.0)  # creates the cost estimator from the unit's model
    policy.n_safe = n_safe
    policy.observe_step(finished())
    policy.plan(view(running), 0.0)
    return policy


def theta_for(policy: ExclusiveBatching, n: int) -> float:
    assert policy.estimator is not None
    return optimal_theta(policy.window.survival(model=policy.survival_model), policy.estimator.costs(), n,
                         policy.window.mean_prompt, policy.theta_lo, policy.theta_hi)


def test_the_fluid_theta_star_is_optimized_for_max_num_seqs_by_default() -> None:
    policy = adapted({}, n_safe=8)
    assert policy.theta_star == theta_for(policy, MAX_SEQS)


def test_theta_slots_in_use_optimizes_for_the_memory_safe_n() -> None:
    policy = adapted({"theta_slots": "in_use"}, n_safe=8)
    assert policy.n_safe == 8  # not recomputed: memory_update_every is far away
    assert policy.theta_star == theta_for(policy, 8)
    # The option matters: on increasing-hazard lengths a smaller N gives a smaller theta*.
    assert theta_for(policy, 8) < theta_for(policy, MAX_SEQS)


def test_theta_slots_in_use_without_a_memory_safe_n_is_the_default() -> None:
    on = adapted({"theta_slots": "in_use", "memory_safe": False}, n_safe=None)
    off = adapted({"memory_safe": False}, n_safe=None)
    assert on.theta_star == off.theta_star


def test_linear_hazard_survival_drives_theta_star() -> None:
    policy = adapted({"survival": "linear_hazard", "memory_safe": False}, n_safe=None)
    empirical = adapted({"memory_safe": False}, n_safe=None)
    assert policy.survival_model == "linear_hazard"
    assert policy.theta_star == theta_for(policy, MAX_SEQS)
    assert empirical.theta_star == theta_for(empirical, MAX_SEQS)


def test_theta_method_cfr_is_the_papers_constant_hazard_root_and_the_default() -> None:
    policy = adapted({"theta_method": "cfr", "memory_safe": False}, n_safe=None)
    fluid = adapted({"memory_safe": False}, n_safe=None)
    assert make_batch_policy("eb").params["theta_method"] == "cfr"
    assert policy.estimator is not None
    root = closed_form_theta(cfr_ratio(policy.estimator.costs(), policy.window.mean_output))
    assert policy.theta_lo < root < policy.theta_hi  # not clipped here, so the root itself is theta*
    assert policy.theta_star == root
    # On these increasing-hazard lengths the fluid model's theta* lies above the constant-hazard root (POLICIES.md
    # 1.5: "never below the constant-hazard root on increasing-hazard data").
    assert fluid.theta_star is not None and fluid.theta_star > root


def test_theta_method_cfr_is_clipped() -> None:
    policy = adapted({"theta_method": "cfr", "memory_safe": False, "theta_min": 0.9}, n_safe=None)
    assert policy.theta_star == 0.9
