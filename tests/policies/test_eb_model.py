"""Tests of policies.batch.eb_model: the math of EB(theta*) and EB+ (POLICIES.md 1.5, 1.6)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.batch.eb_costs import PhaseCostEstimator
from policies.batch.eb_memory import cycle_peak_demand, kv_reserve_blocks, memory_safe_batch_size
from policies.batch.eb_model import (
    PhaseCosts,
    cfr_ratio,
    closed_form_theta,
    crossover,
    eb_throughput,
    mixing_advantage_per_token,
    optimal_theta,
)
from policies.batch.eb_survival import LengthWindow, linear_hazard_survival, phase_end_iteration, survival_integral
from policies.cost.step_model import StepCoefficients
from policies.types import StepFeedback, StepMode

H100_8B = StepCoefficients(a_s=9.1e-3, b_s=24e-6, c_s=44e-9)
ALPHA_D = 9e-3


def costs(alpha_p: float = ALPHA_D, beta_d: float = 3e-5, beta_p: float = 2.5e-5, alpha_d: float = ALPHA_D,
          ) -> PhaseCosts:
    return PhaseCosts(alpha_d, beta_d, alpha_p, beta_p, ALPHA_D, beta_p, beta_d - beta_p, 0.0)


def window_of(outputs: np.ndarray, prompts: np.ndarray | None = None) -> LengthWindow:
    w = LengthWindow(maxlen=len(outputs))
    prompts = np.full(len(outputs), 100) if prompts is None else prompts
    for p, o in zip(prompts, outputs, strict=True):
        w.add(int(p), int(o))
    return w


def geometric_curve(mean: float, length: int = 20_000) -> np.ndarray:
    """Exact survival of geometric output lengths on {1, 2, ...} with the given mean: ``(1 - 1/mean)^t``."""
    return (1.0 - 1.0 / mean) ** np.arange(length, dtype=np.float64)


def continuous_mean(mean: float) -> float:
    """``mu'`` with ``(1 - 1/mean)^t = exp(-t / mu')``: the mean the closed form sees in ``t*`` (~ mean - 1/2)."""
    return -1.0 / math.log1p(-1.0 / mean)


def grid_argmax(curve: np.ndarray, c: PhaseCosts, n: int, mu_in: float, lo: float = 0.01, hi: float = 0.99,
                points: int = 3000) -> float:
    """Argmax of eb_throughput on a dense grid: an oracle independent of optimal_theta's knot argument."""
    grid = np.linspace(lo, hi, points)
    thr = [eb_throughput(float(t), curve, c, n, mu_in) for t in grid]
    return float(grid[int(np.argmax(thr))])


# ---- LengthWindow ----------------------------------------------------------------------------------------


def test_window_slides_and_keeps_means() -> None:
    w = LengthWindow(maxlen=3)
    assert len(w) == 0 and w.mean_output == 0.0 and w.mean_prompt == 0.0
    for p, o in [(10, 1), (20, 2), (30, 3), (40, 4)]:
        w.add(p, o)
    assert len(w) == 3
    assert w.mean_prompt == pytest.approx(30.0)
    assert w.mean_output == pytest.approx(3.0)
    assert w.prompts().tolist() == [20, 30, 40]
    assert w.outputs().tolist() == [2, 3, 4]
    with pytest.raises(ValueError):
        w.add(-1, 3)


def test_window_observes_finished_requests_of_a_step() -> None:
    w = LengthWindow()
    fb = StepFeedback(StepMode.DECODE, 0, 8, 8000, 8, 0.01, 0.01, num_finished=2,
                      finished_output_tokens=(5, 7), finished_prompt_tokens=(100, 300))
    assert w.observe(fb) == 2
    assert (w.mean_prompt, w.mean_output) == (200.0, 6.0)
    bad = StepFeedback(StepMode.DECODE, 0, 8, 8000, 8, 0.01, 0.01, finished_output_tokens=(5,))
    with pytest.raises(ValueError):
        w.observe(bad)


def test_survival_is_truncated_at_the_quantile_not_winsorized() -> None:
    outputs = np.arange(1, 101)  # 1..100, q95 = 95
    s = window_of(outputs).survival(0.95)
    assert len(s) == 96  # t = 0 .. 95
    for t in (0, 1, 50, 94, 95):
        assert s[t] == pytest.approx(np.mean(outputs > t))  # requests beyond the cut still count
    assert s[-1] == pytest.approx(0.05)
    assert np.all(np.diff(s) <= 0.0)
    with pytest.raises(ValueError):
        LengthWindow().survival()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 500), min_size=1, max_size=300), st.floats(0.5, 1.0))
def test_survival_cut_keeps_theta_up_to_the_quantile_inside(outputs: list[int], q: float) -> None:
    s = window_of(np.array(outputs)).survival(q)
    assert s[-1] <= 1.0 - q + 1e-12
    assert np.all(np.diff(s) <= 0.0) and s[-1] >= 0.0 and s[0] <= 1.0
    assert len(s) - 1 == int(np.quantile(outputs, q, method="inverted_cdf"))


# ---- survival calculus -----------------------------------------------------------------------------------


def test_phase_end_and_integral_are_exact_at_knots() -> None:
    s = np.array([1.0, 0.8, 0.5, 0.4, 0.1])
    # After k iterations a fraction 1 - S[k] has finished: theta = 1 - S[k] ends the phase at t* = k.
    for k in range(1, 5):
        theta = 1.0 - s[k]
        assert phase_end_iteration(theta, s) == pytest.approx(k)
        # N * integral = decode tokens of the phase = sum over iterations j < k of the running fraction S[j].
        assert survival_integral(phase_end_iteration(theta, s), s) == pytest.approx(s[:k].sum())
    assert phase_end_iteration(0.35, s) == pytest.approx(1.5)  # halfway between S[1] = 0.8 and S[2] = 0.5
    assert phase_end_iteration(0.0, s) == 0.0
    assert survival_integral(1.5, s) == pytest.approx(1.0 + 0.5 * 0.8)


def test_beyond_the_cut_the_curve_has_an_exponential_tail() -> None:
    s = geometric_curve(20.0, 41)  # ends at S[40] ~ 0.13
    h = math.log(s[20] / s[40]) / 20.0
    theta = 0.95
    t_star = phase_end_iteration(theta, s)
    assert t_star == pytest.approx(40 + math.log(s[40] / 0.05) / h)
    assert t_star == pytest.approx(math.log(0.05) / math.log(0.95), rel=1e-9)  # geometric tail continues
    assert phase_end_iteration(1.0, s) == math.inf
    assert survival_integral(1e9, s) == pytest.approx(s[:40].sum() + s[40] / h)


@settings(max_examples=60, deadline=None)
@given(st.floats(5.0, 2000.0), st.floats(0.01, 0.99))
def test_geometric_curve_gives_integral_mu_theta_everywhere(mean: float, theta: float) -> None:
    """The fluid identity integral_0^t* S = mu theta holds exactly on a discrete geometric curve."""
    s = geometric_curve(mean, int(mean * 40))
    assert survival_integral(phase_end_iteration(theta, s), s) == pytest.approx(mean * theta, rel=1e-9)


# ---- the closed form -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-12, 1e12))
def test_closed_form_solves_its_equation(ratio: float) -> None:
    theta = closed_form_theta(ratio)
    assert 0.0 < theta < 1.0
    u = 1.0 - theta
    lhs = theta / u + math.log(u) if theta > 1e-3 else sum((k - 1) / k * theta**k for k in range(2, 14))
    # 1 - theta carries a rounding error of ~1e-16 absolute, i.e. ~1e-16 / u relative in the residual.
    assert lhs == pytest.approx(ratio, rel=1e-9 + 1e-15 / u)
    assert closed_form_theta(ratio * 1.01) > theta


def test_closed_form_asymptotics_and_edges() -> None:
    assert closed_form_theta(1e-14) == pytest.approx(math.sqrt(2e-14), rel=1e-6)
    r = 1e10  # 1 - theta = 1 / (r + 1 - ln(1 - theta))
    u = 1.0 - closed_form_theta(r)
    assert u == pytest.approx(1.0 / (r + 1.0 - math.log(u)), rel=1e-5)
    assert closed_form_theta(0.0) == 0.0
    assert closed_form_theta(math.inf) == 1.0
    with pytest.raises(ValueError):
        closed_form_theta(-1.0)
    with pytest.raises(ValueError):
        closed_form_theta(math.nan)


@pytest.mark.parametrize("alpha_p", [ALPHA_D, 5 * ALPHA_D, 20 * ALPHA_D, 100 * ALPHA_D])
def test_closed_form_is_the_maximum_on_an_exact_geometric_curve(alpha_p: float) -> None:
    mean = 200.0
    s = geometric_curve(mean)
    c = costs(alpha_p)
    expected = closed_form_theta(alpha_p / (ALPHA_D * continuous_mean(mean)))
    knot_step = 1.0 / mean  # the maximizer sits on a knot; knots are ~(1 - theta) / mean apart
    assert grid_argmax(s, c, 256, 500.0) == pytest.approx(expected, abs=knot_step)
    assert optimal_theta(s, c, 256, 500.0, lo=0.01, hi=0.99) == pytest.approx(expected, abs=knot_step)


@pytest.mark.parametrize("alpha_p", [ALPHA_D, 5 * ALPHA_D, 20 * ALPHA_D, 100 * ALPHA_D])
def test_closed_form_matches_the_numerical_maximum_on_50k_geometric_draws(alpha_p: float) -> None:
    mean = 200.0
    lengths = np.random.default_rng(7).geometric(1.0 / mean, 50_000)
    w = window_of(lengths)
    s = w.survival()
    c = costs(alpha_p)
    closed = closed_form_theta(cfr_ratio(c, w.mean_output))
    numeric = grid_argmax(s, c, 256, 500.0, lo=0.05, hi=0.95)
    # The throughput curve is flat at its top: sampling noise of 50k draws moves the argmax by ~0.02
    # (std over seeds), while the throughput at the closed-form root stays within 1% of the maximum.
    assert numeric == pytest.approx(closed, abs=0.03)
    assert optimal_theta(s, c, 256, 500.0) == pytest.approx(numeric, abs=1e-3)
    best = eb_throughput(numeric, s, c, 256, 500.0)
    assert eb_throughput(closed, s, c, 256, 500.0) >= 0.99 * best


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60),
    st.floats(1e-4, 1.0), st.floats(0.0, 1e-3), st.floats(1e-4, 1.0), st.floats(0.0, 1e-3),
    st.integers(1, 512), st.floats(0.0, 4000.0),
)
def test_optimal_theta_is_the_global_maximum_of_eb_throughput(
    drops: list[float], alpha_d: float, beta_d: float, alpha_p: float, beta_p: float, n: int, mu_in: float,
) -> None:
    """Any non-increasing curve: no grid point beats the knot search (the segments are linear-fractional)."""
    s = np.cumprod(1.0 - np.array(drops))  # may start below 1 and reach 0
    c = PhaseCosts(alpha_d, beta_d, alpha_p, beta_p, alpha_d, beta_p, 0.0, 0.0)
    best = optimal_theta(s, c, n, mu_in, lo=0.05, hi=0.95)
    assert 0.05 <= best <= 0.95
    top = eb_throughput(best, s, c, n, mu_in)
    for theta in np.linspace(0.05, 0.95, 181):
        assert eb_throughput(float(theta), s, c, n, mu_in) <= top * (1.0 + 1e-9)
    t_star = phase_end_iteration(best, s)
    assert 0.0 <= t_star < math.inf and 0.0 <= survival_integral(t_star, s) <= t_star + 1e-12


def test_theta_falls_as_mean_output_grows() -> None:
    rng = np.random.default_rng(3)
    c = costs(10 * ALPHA_D)
    closed, numeric = [], []
    for mean in (25.0, 50.0, 100.0, 200.0, 400.0, 800.0):
        w = window_of(rng.geometric(1.0 / mean, 50_000))
        closed.append(closed_form_theta(cfr_ratio(c, w.mean_output)))
        numeric.append(optimal_theta(w.survival(), c, 256, 500.0))
    assert all(a > b for a, b in itertools.pairwise(closed))
    assert all(a > b for a, b in itertools.pairwise(numeric)), numeric
    assert numeric == pytest.approx(closed, abs=0.03)


def test_theta_does_not_move_with_n_mu_in_or_betas_on_geometric_data() -> None:
    """Terms linear in theta drop out. mu_in and beta_p enter only through such a term for *every* curve;
    N and beta_d multiply integral_0^t* S, which is linear in theta (= mu theta) only for constant hazard."""
    c = costs(10 * ALPHA_D)
    exact = geometric_curve(200.0)
    ref = optimal_theta(exact, c, 256, 500.0)
    for n in (1, 16, 256, 4096):
        for mu_in in (0.0, 100.0, 8000.0):
            assert optimal_theta(exact, c, n, mu_in) == ref
    assert optimal_theta(exact, costs(10 * ALPHA_D, beta_d=1e-3, beta_p=0.0), 256, 500.0) == ref
    sampled = window_of(np.random.default_rng(11).geometric(1 / 200.0, 50_000)).survival()
    thetas = [optimal_theta(sampled, c, n, mu_in) for n in (1, 64, 1024) for mu_in in (0.0, 2000.0)]
    assert max(thetas) - min(thetas) < 0.03
    # The condition matters: with an increasing hazard, a larger beta_d * N pushes theta* up.
    ifr = window_of(np.random.default_rng(11).integers(1, 401, 50_000)).survival()
    small_ratio = costs(ALPHA_D / 4)
    assert optimal_theta(ifr, small_ratio, 4096, 500.0, hi=0.99) > optimal_theta(ifr, small_ratio, 1, 500.0,
                                                                                  hi=0.99) + 0.05


IFR_SAMPLERS = {
    "uniform": lambda rng, mu, n: rng.integers(1, int(2 * mu) + 1, n),
    "weibull2": lambda rng, mu, n: np.maximum(1, np.rint(rng.weibull(2.0, n) * mu / math.gamma(1.5))),
    "weibull1.5": lambda rng, mu, n: np.maximum(1, np.rint(rng.weibull(1.5, n) * mu / math.gamma(1 + 1 / 1.5))),
}


@pytest.mark.parametrize("shape", sorted(IFR_SAMPLERS))
@pytest.mark.parametrize("model", ["empirical", "linear_hazard"])
def test_increasing_hazard_never_lowers_theta_below_the_constant_hazard_root(shape: str, model: str) -> None:
    rng = np.random.default_rng(5)
    margins = []
    for mean in (50.0, 300.0):
        w = window_of(IFR_SAMPLERS[shape](rng, mean, 20_000).astype(np.int64))
        s = w.survival(model=model)  # type: ignore[arg-type]
        for alpha_p in (0.1 * ALPHA_D, ALPHA_D, 10 * ALPHA_D, 100 * ALPHA_D):
            c = costs(alpha_p)
            cfr = min(max(closed_form_theta(cfr_ratio(c, w.mean_output)), 0.05), 0.95)
            for n in (8, 256):
                margins.append(optimal_theta(s, c, n, 300.0) - cfr)
                assert margins[-1] >= -1e-9, (mean, alpha_p, n)
    assert float(np.mean(margins)) > 0.1  # and clearly above it, not merely equal


def test_linear_hazard_smoothing_is_exact_on_geometric_and_steadies_small_windows() -> None:
    exact = geometric_curve(200.0, 600)
    assert linear_hazard_survival(exact) == pytest.approx(exact, rel=1e-9)
    c = costs(5 * ALPHA_D)
    raw, smooth = [], []
    for seed in range(20):
        w = window_of(np.random.default_rng(100 + seed).geometric(1 / 200.0, 2000))
        raw.append(optimal_theta(w.survival(), c, 256, 500.0))
        smooth.append(optimal_theta(w.survival(model="linear_hazard"), c, 256, 500.0))
    closed = closed_form_theta(5 * ALPHA_D / (ALPHA_D * 200.0))
    assert float(np.std(smooth)) < 0.015 < 0.04 < float(np.std(raw))
    assert float(np.mean(smooth)) == pytest.approx(closed, abs=0.01)


# ---- memory ----------------------------------------------------------------------------------------------


def stepwise_oom_frequency(prompts: np.ndarray, outputs: np.ndarray, n: int, theta: float, capacity: float,
                           cycles: int, warmup: int, seed: int) -> float:
    """An independent, iteration-by-iteration simulation of EB cycles from empty (all-fresh) slots.

    A request holds prompt + generated tokens of KV; its prefill samples token 1; each decode iteration adds a
    token to every running request; it frees its KV after the iteration that generates its last token. A
    decode phase ends once ceil(theta N) of its requests have finished; then every free slot is refilled.
    """
    rng = np.random.default_rng(seed)
    k = max(1, math.ceil(theta * n))
    idx = rng.integers(0, len(outputs), n)
    p, length, gen = prompts[idx].copy(), np.maximum(outputs[idx], 1), np.ones(n, dtype=np.int64)
    exceeded = 0
    for cycle in range(warmup + cycles):
        peak = int((p + gen).sum())
        finished = gen >= length
        while int(finished.sum()) < k:
            running = ~finished
            gen[running] += 1
            peak = max(peak, int((p[running] + gen[running]).sum()))
            finished |= gen >= length
        new = rng.integers(0, len(outputs), int(finished.sum()))
        p[finished], length[finished], gen[finished] = prompts[new], np.maximum(outputs[new], 1), 1
        if cycle >= warmup:
            exceeded += peak > capacity
    return exceeded / cycles


def test_memory_safe_batch_size_keeps_oom_under_delta_in_an_independent_simulation() -> None:
    rng = np.random.default_rng(21)
    prompts = rng.integers(20, 400, 2000)
    outputs = np.maximum(1, rng.lognormal(math.log(80), 0.7, 2000)).astype(np.int64)
    capacity, theta, delta = 40_000, 0.25, 0.02
    n = memory_safe_batch_size(prompts, outputs, capacity, theta, delta=delta, cycles=4000)
    assert 20 < n < 1024
    at_n = stepwise_oom_frequency(prompts, outputs, n, theta, capacity, cycles=3000, warmup=300, seed=1)
    above = stepwise_oom_frequency(prompts, outputs, math.ceil(n * 1.06), theta, capacity, 3000, 300, seed=1)
    assert at_n <= delta + 0.01  # 3000 correlated cycles: ~0.005 of noise
    assert above > 2 * delta  # 6% more slots is clearly unsafe: the answer is not needlessly small


def test_memory_safe_batch_size_is_deterministic_and_monotone() -> None:
    rng = np.random.default_rng(2)
    prompts, outputs = rng.integers(50, 1000, 1000), rng.geometric(1 / 150, 1000)
    a = memory_safe_batch_size(prompts, outputs, 100_000, 0.2, cycles=500)
    assert a == memory_safe_batch_size(prompts, outputs, 100_000, 0.2, cycles=500)
    assert memory_safe_batch_size(prompts, outputs, 200_000, 0.2, cycles=500) > a
    assert memory_safe_batch_size(prompts, outputs, 100_000, 0.2, delta=0.2, cycles=500) >= a
    assert memory_safe_batch_size(prompts, outputs, 1e12, 0.2, max_n=300, cycles=200) == 300
    assert memory_safe_batch_size([10], [10_000], 5_000, 0.2, cycles=100) == 0  # one request outgrows it


def test_cycle_peaks_match_the_stepwise_simulation_on_average() -> None:
    """The event-driven peaks (length-biased start + 4 warmup cycles) agree with the stepwise simulator."""
    rng = np.random.default_rng(4)
    prompts, outputs = rng.integers(10, 300, 2000), rng.integers(1, 200, 2000)
    peaks = cycle_peak_demand(prompts, outputs, 64, 0.3, seed=3, cycles=3000)
    lo, hi = np.quantile(peaks, [0.5, 0.99])
    freq_lo = stepwise_oom_frequency(prompts, outputs, 64, 0.3, lo, cycles=2000, warmup=200, seed=9)
    freq_hi = stepwise_oom_frequency(prompts, outputs, 64, 0.3, hi, cycles=2000, warmup=200, seed=9)
    assert freq_lo == pytest.approx(0.5, abs=0.06)
    assert freq_hi <= 0.025


def test_cycle_peak_is_exact_on_identical_requests() -> None:
    """theta = 1 synchronizes the slots after one cycle: each later cycle peaks when every request holds its
    prompt and all its output tokens, N * (prompt + output)."""
    peaks = cycle_peak_demand([100], [50], 4, 1.0, seed=0, cycles=50, warmup_cycles=1)
    assert peaks.tolist() == [4 * 150] * 50
    assert cycle_peak_demand([100], [50], 1, 0.3, cycles=10, warmup_cycles=1).tolist() == [150] * 10


def test_block_rounding_is_charged_per_running_request() -> None:
    p, o = np.array([100, 200]), np.array([50, 70])
    plain = cycle_peak_demand(p, o, 8, 0.5, seed=1, cycles=200)
    blocks = cycle_peak_demand(p, o, 8, 0.5, seed=1, cycles=200, block_size=16)
    assert np.all(blocks > plain) and np.all(blocks - plain <= 8 * 15)


# ---- KV reserve ------------------------------------------------------------------------------------------


def test_kv_reserve_is_kappa_times_phase_growth_clipped() -> None:
    s = geometric_curve(100.0, 2000)
    theta = 0.3
    growth = 64 * 100.0 * theta  # N * mu * theta decode tokens per phase
    assert kv_reserve_blocks(64, s, theta, 16) == math.ceil(1.5 * growth / 16) + 1
    assert kv_reserve_blocks(64, s, theta, 16, hi=50) == 50
    assert kv_reserve_blocks(0, s, theta, 16, base=0, lo=3) == 3
    sizes = [kv_reserve_blocks(n, s, theta, 16, lo=2, hi=400) for n in range(0, 513, 8)]
    assert all(2 <= r <= 400 for r in sizes)
    assert all(a <= b for a, b in itertools.pairwise(sizes))
    assert sizes[1] < sizes[10] < sizes[20]


# ---- EB+ -------------------------------------------------------------------------------------------------


def test_mixing_advantage_falls_like_one_over_n() -> None:
    c = costs(ALPHA_D)
    r = [mixing_advantage_per_token(c, 0.2, 40.0, n, 300.0, 500.0) for n in (8, 16, 64, 256)]
    assert [x * n for x, n in zip(r, (8, 16, 64, 256), strict=True)] == pytest.approx([r[0] * 8] * 4)
    assert r[0] == pytest.approx(((ALPHA_D * 40.0 + ALPHA_D) / 0.2 - ALPHA_D * 500.0) / (8 * 800.0))
    assert mixing_advantage_per_token(c, 0.2, 40.0, 0.0, 300.0, 500.0) == math.inf


def test_crossover_rule_is_the_per_request_time_comparison() -> None:
    """EB is exclusive-better exactly when its time per request, fixed plus per-token, is the smaller one."""
    c = PhaseCosts(9e-3, 40e-6, 12e-3, 20e-6, 10e-3, 20e-6, 60e-6, -30e-6)
    mu_in, mu_out, theta, t_star = 300.0, 500.0, 0.2, 112.0
    rho = mu_out / (mu_in + mu_out)
    for n in (4, 32, 256, 2048):
        eb = (c.alpha_d * t_star + c.alpha_p) / (theta * n) + c.beta_p * mu_in + c.beta_d * mu_out
        mb = c.alpha_m * mu_out / n + c.beta_mix(rho) * (mu_in + mu_out)
        r_adv = mixing_advantage_per_token(c, theta, t_star, n, mu_in, mu_out)
        assert crossover(rho, c, r_adv, 0.0).exclusive == (eb < mb)


def test_crossover_flips_with_the_margin() -> None:
    c = PhaseCosts(9e-3, 40e-6, 9e-3, 20e-6, 9e-3, 20e-6, 60e-6, -30e-6)
    r_adv = mixing_advantage_per_token(c, 0.2, 40.0, 256, 300.0, 500.0)
    rho = 0.6
    gap = c.beta_mix(rho) - c.beta_bar(rho)
    assert gap == pytest.approx(20e-6 + 60e-6 * rho - 30e-6 * rho**2 - (0.4 * 20e-6 + 0.6 * 40e-6))
    flip = gap - r_adv
    low, high = crossover(rho, c, r_adv, flip - 1e-9), crossover(rho, c, r_adv, flip + 1e-9)
    assert low.exclusive and not high.exclusive
    assert low.lhs == pytest.approx(gap) and low.rhs == pytest.approx(r_adv + flip - 1e-9)


# ---- PhaseCostEstimator ----------------------------------------------------------------------------------

TRUE = PhaseCosts(alpha_d=11e-3, beta_d=70e-6, alpha_p=14e-3, beta_p=30e-6, alpha_m=12e-3,
                  mix_q0=30e-6, mix_q1=110e-6, mix_q2=-60e-6)


def step(n_p: int, n_d: int, seconds: float, ctx: int = 0) -> StepFeedback:
    mode = StepMode.MIXED if n_p and n_d else (StepMode.PREFILL if n_p else StepMode.DECODE)
    return StepFeedback(mode, n_p, n_d, ctx, max(n_d, 1), seconds, seconds)


def synthetic_steps(rng: np.random.Generator, count: int, noise: float = 0.0,
                    fixed_mixed_tokens: int | None = None) -> list[StepFeedback]:
    out = []
    for _ in range(count):
        eps = math.exp(rng.normal(0.0, noise)) if noise else 1.0
        kind = rng.integers(3)
        if kind == 0:
            n = int(rng.integers(16, 512))
            out.append(step(0, n, (TRUE.alpha_d + TRUE.beta_d * n) * eps, ctx=n * 1500))
        elif kind == 1:
            n = int(rng.integers(256, 8193))
            out.append(step(n, 0, (TRUE.alpha_p + TRUE.beta_p * n) * eps, ctx=n))
        else:
            new = fixed_mixed_tokens or int(rng.integers(512, 8193))
            d = int(rng.integers(1, new))
            t = TRUE.alpha_m + new * TRUE.beta_mix(d / new)
            out.append(step(new - d, d, t * eps, ctx=d * 1500 + (new - d)))
    return out


def test_estimator_recovers_known_costs_from_noiseless_steps() -> None:
    est = PhaseCostEstimator(H100_8B, refit_every=1)
    for fb in synthetic_steps(np.random.default_rng(0), 600):
        assert est.observe(fb)
    got = est.costs()
    for name in ("alpha_d", "beta_d", "alpha_p", "beta_p", "alpha_m", "mix_q0", "mix_q1", "mix_q2"):
        assert getattr(got, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert est.status.mixed_fit == "quadratic" and est.status.decode_fitted and est.status.prefill_fitted


def test_estimator_recovers_known_costs_from_noisy_steps() -> None:
    est = PhaseCostEstimator(H100_8B, window=2048)
    for fb in synthetic_steps(np.random.default_rng(1), 6000, noise=0.03):
        est.observe(fb)
    got = est.costs(refresh=True)
    assert got.alpha_d == pytest.approx(TRUE.alpha_d, rel=0.1)
    assert got.beta_d == pytest.approx(TRUE.beta_d, rel=0.05)
    assert got.alpha_p == pytest.approx(TRUE.alpha_p, rel=0.3)
    assert got.beta_p == pytest.approx(TRUE.beta_p, rel=0.05)
    for rho in (0.1, 0.5, 0.9):
        assert got.beta_mix(rho) == pytest.approx(TRUE.beta_mix(rho), rel=0.05)


def test_budget_filled_mixed_steps_fit_the_quadratic_with_alpha_held() -> None:
    """Every mixed step of the same size: alpha_m and q0 are inseparable, so alpha_m stays at the prior a."""
    est = PhaseCostEstimator(H100_8B, refit_every=1)
    for fb in synthetic_steps(np.random.default_rng(2), 600, fixed_mixed_tokens=8192):
        est.observe(fb)
    got = est.costs()
    assert est.status.mixed_fit == "quadratic_fixed_alpha"
    assert got.alpha_m == pytest.approx(H100_8B.a_s)
    for rho in (0.1, 0.5, 0.9):  # the fitted curve absorbs the alpha difference: exact at new = 8192
        assert 8192 * got.beta_mix(rho) + got.alpha_m == pytest.approx(8192 * TRUE.beta_mix(rho) + TRUE.alpha_m)


def test_estimator_falls_back_to_the_prior_without_enough_good_points() -> None:
    est = PhaseCostEstimator(H100_8B, typical_decode_context=1000.0, refit_every=1)
    prior = PhaseCosts.from_step_model(H100_8B, 1000.0, 1.0)
    assert est.costs() == prior
    assert prior.beta_d == pytest.approx(24e-6 + 44e-9 * 1000.0)
    assert prior.beta_mix(0.3) == pytest.approx(prior.beta_bar(0.3))
    for n in (100, 200, 300, 400):  # too few points
        est.observe(step(0, n, 0.5, ctx=n * 1000))
    for _ in range(50):  # many points, one token count: beta is not identifiable
        est.observe(step(4096, 0, 0.5, ctx=4096))
    for n in (1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008):  # one narrow cluster
        est.observe(step(n - 100, 100, 0.5, ctx=n))
    got = est.costs()
    assert (got.alpha_d, got.beta_d, got.alpha_p, got.beta_p) == (
        prior.alpha_d, prior.beta_d, prior.alpha_p, prior.beta_p)
    assert est.status == (False, False, "prior", 4, 50, 9)


def test_prior_uses_the_observed_context_per_token() -> None:
    est = PhaseCostEstimator(H100_8B, typical_decode_context=10.0, refit_every=1)
    est.observe(step(0, 100, 0.02, ctx=100 * 3000))
    est.observe(step(1000, 0, 0.05, ctx=3000))
    got = est.costs()
    assert got.beta_d == pytest.approx(H100_8B.b_s + H100_8B.c_s * 3000.0)
    assert got.beta_p == pytest.approx(H100_8B.b_s + H100_8B.c_s * 3.0)


def test_refits_are_lazy() -> None:
    est = PhaseCostEstimator(H100_8B, refit_every=64)
    first = est.costs()
    for fb in synthetic_steps(np.random.default_rng(3), 60):
        est.observe(fb)
    assert est.costs() is first  # fewer than 64 new steps of any kind: the cached object
    assert est.costs(refresh=True) != first


def test_negative_coefficients_are_constrained() -> None:
    est = PhaseCostEstimator(H100_8B, refit_every=1)
    for n in range(100, 500, 20):  # time falls with load: the unconstrained slope would be negative
        est.observe(step(0, n, 0.05 - 1e-5 * n))
    got = est.costs()
    assert got.beta_d == 0.0 and got.alpha_d > 0.0
    assert PhaseCosts.from_step_model(StepCoefficients(-1e-3, -1e-6, 0.0), 100.0).alpha_d == 0.0


feedbacks = st.builds(
    step,
    st.integers(0, 10**7),
    st.integers(0, 10**6),
    st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-6, 10.0)),
    st.integers(-10, 10**9),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(feedbacks, max_size=80))
def test_estimator_never_returns_nan_or_negative_costs(steps: list[StepFeedback]) -> None:
    est = PhaseCostEstimator(H100_8B, min_points=3, refit_every=1)
    for fb in steps:
        est.observe(fb)
        got = est.costs()
        for v in (got.alpha_d, got.beta_d, got.alpha_p, got.beta_p, got.alpha_m):
            assert math.isfinite(v) and v >= 0.0
        for rho in np.linspace(0.0, 1.0, 11):
            assert math.isfinite(got.beta_mix(float(rho))) and got.beta_mix(float(rho)) >= 0.0
