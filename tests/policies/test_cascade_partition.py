"""CascadeInfer's math (seed 001 sections 4.1-4.3): QoE model and fit, stage costs, partition DP, fast path,
range refinement. Expected values are computed by hand or by independent plain-Python code in this file."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.cost.step_model import StepCoefficients
from policies.dispatch.cascade_model import (
    BatchFeatures,
    QoeCoefficients,
    QoeSample,
    fit_qoe,
    fit_qoe_samples,
    qoe_relative_error,
)
from policies.dispatch.cascade_partition import (
    StageCostTable,
    exponential_edges,
    partition_brute_force,
    partition_dp,
    partition_fast,
    refine_boundary,
    representative_share,
)

H100_8B = StepCoefficients(9.11e-3, 24e-6, 43.9e-9)


def q_batch(d: tuple[float, ...], lengths: list[tuple[int, int]]) -> float:
    """Independent ``Q_B`` of Equation 1 over ``(I, L)`` pairs."""
    n = len(lengths)
    if n == 0:
        return 0.0
    s_i = sum(i for i, _ in lengths)
    s_i2 = sum(i * i for i, _ in lengths)
    s_l = sum(ell for _, ell in lengths)
    return n * (d[0] + d[1] * n + d[2] * s_i + d[3] * s_i2 + d[4] * s_l)


# ---- QoE model -------------------------------------------------------------------------------------------


def test_default_coefficients_from_the_step_model_by_hand() -> None:
    d = QoeCoefficients.from_step_model(StepCoefficients(0.01, 2e-5, 4e-8), mean_output_tokens=100, chunk_tokens=1000)
    assert d.d0 == pytest.approx(0.01)
    assert d.d1 == pytest.approx(2e-5)
    assert d.d2 == pytest.approx((2e-5 + 2e-8) / 100)  # (b + c/2) / O
    assert d.d3 == pytest.approx(4e-8 / (2 * 1000 * 100))  # c / (2 C O)
    assert d.d4 == pytest.approx(4e-8)
    # Q_B of two requests (I, L) = (100, 150), (300, 400): n = 2, sum I = 400, sum I^2 = 100000, sum L = 550.
    q1 = 0.01 + 2e-5 * 2 + d.d2 * 400 + d.d3 * 100_000 + 4e-8 * 550
    assert d.of_lengths([100, 300], [150, 400]) == pytest.approx(2 * q1)
    assert d.batch(0, 0, 0, 0) == 0.0


def simulate_steady_unit(step: StepCoefficients, n: int, prompt: int, output: int, chunk: int) -> tuple[float, float]:
    """A unit with ``n`` slots, each refilled at once with a new (prompt, output) request when one finishes.

    Each step decodes every decoding request and prefills up to ``chunk`` tokens (oldest first); the step
    costs ``a + b * new + c * ctx`` (ctx = computed + new of each scheduled request). Returns the mean
    normalized latency (end-to-end over output tokens) and the mean over steps of ``sum L`` of the batch.
    """
    # slot state: [computed, outputs, start_time]; staggered so that completions spread out.
    slots = [[prompt + k * output // n, k * output // n, 0.0] for k in range(n)]
    t = 0.0
    lat: list[float] = []
    sum_l: list[float] = []
    for _ in range(40 * output):
        new = ctx = 0
        budget = chunk
        plan = []
        for s in slots:
            if s[0] >= prompt:  # decoding
                plan.append((s, 1))
            elif budget > 0:
                take = min(budget, prompt - s[0])
                budget -= take
                plan.append((s, take))
        for s, k in plan:
            new += k
            ctx += s[0] + k
        sum_l.append(sum(prompt + s[1] for s in slots))
        t += step.a_s + step.b_s * new + step.c_s * ctx
        for s, k in plan:
            s[0] += k
            if s[0] >= prompt:
                s[1] += 1
            if s[1] >= output:
                if s[2] > 0.0:
                    lat.append((t - s[2]) / output)
                s[0], s[1], s[2] = 0, 0, t
    return float(np.mean(lat)), float(np.mean(sum_l))


def test_default_coefficients_predict_a_simulated_steady_unit() -> None:
    """The derivation's claim, checked against a step-by-step simulation of the step model (within 1%; the
    iteration part alone, ``a + b n + c sum L``, is 2-32% low on these cases)."""
    for n, prompt, output in ((8, 512, 128), (32, 2048, 256), (16, 200, 400)):
        measured, mean_sum_l = simulate_steady_unit(H100_8B, n, prompt, output, chunk=1024)
        d = QoeCoefficients.from_step_model(H100_8B, mean_output_tokens=output, chunk_tokens=1024)
        predicted = d.per_request(n, n * prompt, n * prompt**2, mean_sum_l)
        assert predicted == pytest.approx(measured, rel=0.01), (n, prompt, output)


def synthetic(d: tuple[float, ...], rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 256, rows).astype(float)
    mean_i = rng.uniform(50, 8000, rows)
    s_i = n * mean_i
    s_i2 = n * mean_i**2 * rng.uniform(1.0, 3.0, rows)
    s_l = s_i + n * rng.uniform(10, 2000, rows)
    x = np.column_stack((n, s_i, s_i2, s_l))
    y = d[0] + d[1] * n + d[2] * s_i + d[3] * s_i2 + d[4] * s_l
    return x, y


def test_fit_recovers_known_coefficients_from_noiseless_data() -> None:
    true = (9e-3, 2.4e-5, 1e-7, 1e-14, 4.4e-8)
    x, y = synthetic(true, 400, seed=1)
    fit = fit_qoe(x, y)
    assert fit.coefficients.as_tuple() == pytest.approx(true, rel=1e-6)
    assert fit.mean_relative_error < 1e-9
    assert fit.num_samples == 400
    assert fit.clamped == ()


def test_fit_reports_its_mean_relative_error() -> None:
    true = (9e-3, 2.4e-5, 1e-7, 1e-14, 4.4e-8)
    x, y = synthetic(true, 300, seed=2)
    y = y * np.where(np.arange(300) % 2 == 0, 1.1, 0.9)  # +-10% off the model's family
    fit = fit_qoe(x, y)
    d = fit.coefficients.as_tuple()
    by_hand = np.mean(
        [abs(d[0] + d[1] * r[0] + d[2] * r[1] + d[3] * r[2] + d[4] * r[3] - t) / t for r, t in zip(x, y, strict=True)]
    )
    assert fit.mean_relative_error == pytest.approx(by_hand, rel=1e-9)
    assert 0.05 < fit.mean_relative_error < 0.15
    assert qoe_relative_error(fit.coefficients, x, y) == pytest.approx(by_hand, rel=1e-9)


def test_fit_keeps_coefficients_non_negative_and_satisfies_kkt() -> None:
    true = (9e-3, 2.4e-5, 1e-7, -3e-14, 4.4e-8)  # a negative D3 the constraint must refuse
    x, y = synthetic(true, 200, seed=3)
    y = np.maximum(y, 1e-4)
    fit = fit_qoe(x, y)
    d = np.asarray(fit.coefficients.as_tuple())
    assert (d >= 0).all()
    assert 3 in fit.clamped
    # KKT of min ||X d - y||^2 s.t. d >= 0, in scaled columns: gradient 0 on the support, >= 0 off it.
    design = np.column_stack((np.ones(len(x)), x))
    scale = np.abs(design).max(axis=0)
    xs = design / scale
    grad = xs.T @ (xs @ (d * scale) - y)
    tol = 1e-8 * np.abs(xs.T @ y).max()
    for k in range(5):
        if d[k] > 0:
            assert abs(grad[k]) <= tol
        else:
            assert grad[k] >= -tol


def test_fit_refuses_rank_deficient_data() -> None:
    n = np.arange(1, 11, dtype=float)
    x = np.column_stack((n, 100 * n, 10_000 * n, 150 * n))  # all columns proportional to n
    with pytest.raises(ValueError, match="rank"):
        fit_qoe(x, 0.01 + 0.001 * n)
    with pytest.raises(ValueError, match="at least 5"):
        fit_qoe(x[:3], np.ones(3))


def test_fit_from_samples_matches_the_array_form() -> None:
    true = (9e-3, 2.4e-5, 1e-7, 1e-14, 4.4e-8)
    x, y = synthetic(true, 50, seed=4)
    samples = [QoeSample(BatchFeatures(*r), float(t)) for r, t in zip(x, y, strict=True)]
    assert fit_qoe_samples(samples).coefficients.as_tuple() == pytest.approx(true, rel=1e-6)


# ---- buckets and stage costs -----------------------------------------------------------------------------


def test_exponential_edges() -> None:
    assert exponential_edges(1024, 64) == (0, 64, 128, 256, 512, 1024)
    assert exponential_edges(1000, 64) == (0, 64, 128, 256, 512, 1000)
    edges = exponential_edges(131_072, 64)
    assert len(edges) - 1 == 12 and edges[-1] == 131_072
    small = exponential_edges(10, 1, 1.1)
    assert small == tuple(range(11))  # strictly increasing even when rounding repeats
    with pytest.raises(ValueError):
        exponential_edges(64, 64)


COUNT_AND_LENGTH = QoeCoefficients(1.0, 1.0, 0.0, 0.0, 0.01)


def test_stage_cost_splits_every_kth_and_sums_all_units() -> None:
    lengths = [10, 20, 30, 40, 50]
    table = StageCostTable(lengths, lengths, (0, 100), COUNT_AND_LENGTH)
    # k = 1: n = 5, sum L = 150: 5 * (1 + 5 + 1.5) = 37.5
    assert table.cost(0, 1, 1) == pytest.approx(37.5)
    # k = 2: {10, 30, 50} and {20, 40}: 3 * (1 + 3 + 0.9) + 2 * (1 + 2 + 0.6) = 14.7 + 7.2
    assert table.cost(0, 1, 2) == pytest.approx(21.9)
    # k = 3: {10, 40}, {20, 50}, {30}: 2 * 3.5 + 2 * 3.7 + 1 * 2.3
    assert table.cost(0, 1, 3) == pytest.approx(16.7)
    # k = 7 > 5 requests: five singletons, two idle units: 5 * 2 + 0.01 * 150 (the paper's single
    # representative from the k/2-th element would say 7 * Q({40}) = 16.8)
    assert table.cost(0, 1, 7) == pytest.approx(11.5)
    full = table.table(7)
    assert full[0, 1, 2] == pytest.approx(21.9)
    assert np.isinf(full[0, 1, 0]) and np.isinf(full[1, 0, 1])


def test_stage_cost_ranges_and_cut_costs_by_hand() -> None:
    prompts = [5, 20, 20, 90, 150]
    contexts = [8, 40, 120, 95, 400]
    edges = (0, 32, 128, 1000)
    table = StageCostTable(prompts, contexts, edges, COUNT_AND_LENGTH, cut_cost_per_token=0.5)
    # [0, 32): L = 8 -> 1 * (1 + 1 + 0.08)
    assert table.cost(0, 1, 1) == pytest.approx(2.08)
    # [32, 128): L = 40, 95, 120 -> 3 * (1 + 3 + 2.55)
    assert table.cost(1, 2, 1) == pytest.approx(19.65)
    # last bucket keeps lengths beyond the top edge: [128, inf): 400
    assert table.cost(2, 3, 1) == pytest.approx(1 * (2 + 4.0))
    # straddlers of 32: I < 32 <= L: (20, 40), (20, 120) -> 0.5 * 32 * 2; of 128: (90, ...)? 95 < 128 no;
    # (20, 120) no; (150, 400) has I >= 128: none -> 0. First and last edges cost nothing.
    assert table.cut_costs.tolist() == pytest.approx([0.0, 32.0, 0.0, 0.0])


# ---- partition -------------------------------------------------------------------------------------------


def evaluate(
    part_cuts: tuple[int, ...],
    units: tuple[int, ...],
    prompts: list[int],
    contexts: list[int],
    edges: tuple[int, ...],
    d: tuple[float, ...],
    per_token: float,
) -> float:
    """A third, independent evaluation of a partition's pipeline quality."""
    items = sorted(zip(contexts, prompts, strict=True))
    total = 0.0
    for j, k in enumerate(units):
        lo = edges[part_cuts[j]]
        last = j == len(units) - 1
        hi = edges[part_cuts[j + 1]]
        inside = [(i, ell) for ell, i in items if ell >= lo and (last or ell < hi)]
        for r in range(k):
            total += q_batch(d, inside[r::k])
    for c in part_cuts[1:-1]:
        total += per_token * edges[c] * sum(1 for ell, i in items if i < edges[c] <= ell)
    return total


@st.composite
def small_cases(draw: st.DrawFn) -> tuple[list[int], list[int], tuple[int, ...], QoeCoefficients, int, float]:
    n = draw(st.integers(0, 10))
    prompts = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    growth = draw(st.lists(st.integers(0, 400), min_size=n, max_size=n))
    contexts = [p + g for p, g in zip(prompts, growth, strict=True)]
    edges = exponential_edges(1024, 16)[: draw(st.integers(2, 6))]
    d = QoeCoefficients(
        draw(st.floats(0, 1)),
        draw(st.floats(0, 1)),
        draw(st.floats(0, 1e-2)),
        draw(st.floats(0, 1e-5)),
        draw(st.floats(0, 1e-2)),
    )
    return prompts, contexts, tuple(edges), d, draw(st.integers(1, 4)), draw(st.floats(0, 1e-2))


@settings(max_examples=150, deadline=None)
@given(small_cases())
def test_dp_equals_the_brute_force_optimum(
    case: tuple[list[int], list[int], tuple[int, ...], QoeCoefficients, int, float],
) -> None:
    prompts, contexts, edges, d, units, per_token = case
    table = StageCostTable(prompts, contexts, edges, d, per_token)
    dp = partition_dp(table, units)
    brute = partition_brute_force(prompts, contexts, edges, d, units, per_token)
    assert dp.cost == pytest.approx(brute.cost, rel=1e-9, abs=1e-12)
    assert sum(dp.units) == units and all(k >= 1 for k in dp.units)
    assert dp.cuts[0] == 0 and dp.cuts[-1] == len(edges) - 1
    assert all(a < b for a, b in itertools.pairwise(dp.cuts))
    # the DP's own account of its cost agrees with an independent evaluation of the partition it returns
    again = evaluate(dp.cuts, dp.units, prompts, contexts, edges, d.as_tuple(), per_token)
    assert dp.cost == pytest.approx(again, rel=1e-9, abs=1e-12)
    fast = partition_fast(table, units)
    assert sum(fast.units) == units
    assert fast.cost >= brute.cost - 1e-9 * max(1.0, brute.cost)
    assert fast.cost == pytest.approx(
        evaluate(fast.cuts, fast.units, prompts, contexts, edges, d.as_tuple(), per_token), rel=1e-9, abs=1e-12
    )


def test_fast_path_merges_a_single_cluster_into_one_stage() -> None:
    lengths = [100] * 12
    table = StageCostTable(lengths, lengths, (0, 64, 128, 256, 1024), QoeCoefficients(0.0, 1.0, 0.0, 0.0, 0.0))
    part = partition_fast(table, 3)
    # one unit per stage leaves 12 requests on one unit (144); merging with an empty neighbour gains
    # 144 - 2 * 36 = 72, then 72 - 3 * 16 = 24; empty-empty merges gain nothing.
    assert part.units == (3,)
    assert part.boundaries == (0, 1024)
    assert part.cost == pytest.approx(48.0)


def test_fast_path_keeps_a_long_outlier_apart_when_merging_loses() -> None:
    prompts = [100] * 8 + [10_000]
    edges = (0, 64, 128, 256, 16_384)
    table = StageCostTable(prompts, prompts, edges, QoeCoefficients(0.0, 1.0, 0.0, 0.0, 0.01))
    part = partition_fast(table, 2)
    # apart: 8 * (8 + 8) + 1 * (1 + 100) = 229; merged over 2 units: {4 short + long}, {4 short}
    # = 5 * (5 + 104) + 4 * (4 + 4) = 577: no merge. Cuts at 128 and 256 tie; the first (128) wins.
    assert part.units == (1, 1)
    assert part.boundaries == (0, 128, 16_384)
    assert part.cost == pytest.approx(229.0)
    assert partition_dp(table, 2).cost == pytest.approx(229.0)


def test_fast_path_merges_when_the_outlier_is_cheap() -> None:
    prompts = [100] * 8 + [10_000]
    table = StageCostTable(prompts, prompts, (0, 64, 128, 256, 16_384), QoeCoefficients(0.0, 1.0, 0.0, 0.0, 1e-4))
    part = partition_fast(table, 2)
    # apart: 8 * 8.08 + 1 * 2 = 66.64; merged: 5 * (5 + 1.04) + 4 * (4 + 0.04) = 46.36
    assert part.units == (2,)
    assert part.cost == pytest.approx(46.36)


def test_fast_path_with_more_units_than_buckets() -> None:
    prompts = [50] * 6 + [500] * 2
    table = StageCostTable(prompts, prompts, (0, 100, 1000), QoeCoefficients(0.0, 1.0, 0.0, 0.0, 0.0))
    part = partition_fast(table, 4)
    # two one-unit stages cost 36 + 4; the spare units go where they gain most: short 36 -> 18 (gain 18)
    # then 18 -> 12 (gain 6, long would gain 2). Merging all 8 over 4 units costs 4 * 4 = 16 = 12 + 4: no
    # positive gain, so the pipeline stays (3, 1).
    assert part.units == (3, 1)
    assert part.boundaries == (0, 100, 1000)
    assert part.cost == pytest.approx(16.0)
    assert partition_dp(table, 4).cost == pytest.approx(16.0)  # the DP ties with one stage of 4
    assert partition_dp(table, 4).units == (4,)


def test_partition_16_units_over_128k_context() -> None:
    rng = np.random.default_rng(7)
    prompts = (np.exp(rng.normal(6.0, 1.5, 3000)) + 1).astype(int)
    contexts = prompts + (np.exp(rng.normal(5.0, 1.2, 3000))).astype(int)
    d = QoeCoefficients.from_step_model(H100_8B, mean_output_tokens=256, chunk_tokens=8192)
    table = StageCostTable(prompts, contexts, exponential_edges(131_072, 64), d, 5e-6 / 256)
    dp = partition_dp(table, 16)
    fast = partition_fast(table, 16)
    assert sum(dp.units) == sum(fast.units) == 16
    assert dp.cost <= fast.cost * (1 + 1e-12)
    assert dp.boundaries[0] == 0 and dp.boundaries[-1] == 131_072
    # the one-stage pipeline is never better than the optimum
    assert dp.cost <= table.cost(0, table.num_buckets, 16) * (1 + 1e-12)


# ---- range refinement ------------------------------------------------------------------------------------


def pairs(*lengths: int) -> list[tuple[int, int]]:
    return [(x, x) for x in lengths]


def test_representative_share_is_the_papers_footnote() -> None:
    items = pairs(50, 70, 60, 80)
    assert representative_share(items, 2) == pairs(60, 80)  # sorted 50, 60, 70, 80; from index 1, every 2nd
    assert representative_share(items, 1) == pairs(50, 60, 70, 80)
    assert representative_share(items, 3) == pairs(60)
    assert representative_share(items, 0) == []


def test_refinement_freezes_below_five_requests() -> None:
    r = refine_boundary(pairs(10, 20), [pairs(50, 60)], COUNT_AND_LENGTH, 100.0, alpha=0.5, freeze_below=5)
    assert r.frozen and r.proposal is None and r.boundary == 100.0
    r = refine_boundary(pairs(10, 20, 30), [pairs(50, 60)], COUNT_AND_LENGTH, 100.0, alpha=0.5, freeze_below=5)
    assert not r.frozen


def test_refinement_splits_at_the_argmin_and_smooths_with_an_ema() -> None:
    count_only = QoeCoefficients(0.0, 1.0, 0.0, 0.0, 0.0)
    # R = 10..60 (one successor, taken whole): i^2 + (6 - i)^2 is smallest at i = 3 -> R[3] = 40
    r = refine_boundary(pairs(10, 20, 30, 40), [pairs(50, 60)], count_only, 100.0, alpha=0.5)
    assert r.proposal == 40
    assert r.boundary == pytest.approx(0.5 * 100 + 0.5 * 40)
    # two successors: their average is every 2nd of 50, 60, 70, 80 from index 1 = {60, 80};
    # R = 10, 20, 30, 60, 80 with Q = n (n + 0.001 sum L): i = 2 -> 4.06 + 9.51, i = 3 -> 9.18 + 4.28 (best)
    d = QoeCoefficients(0.0, 1.0, 0.0, 0.0, 0.001)
    r = refine_boundary(pairs(10, 20, 30), [pairs(50, 70), pairs(60, 80)], d, 1000.0, alpha=0.25)
    assert r.proposal == 60
    assert r.boundary == pytest.approx(0.75 * 1000 + 0.25 * 60)
    # alpha = 0 never moves; alpha = 1 jumps to the proposal
    assert refine_boundary(pairs(10, 20, 30), [pairs(50, 70), pairs(60, 80)], d, 1000.0, alpha=0.0).boundary == 1000
    assert refine_boundary(pairs(10, 20, 30), [pairs(50, 70), pairs(60, 80)], d, 1000.0, alpha=1.0).boundary == 60
