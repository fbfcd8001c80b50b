"""Tests of policies.cost.fit: batch OLS, evaluation, and the online RLS model."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.cost.fit import FitStats, OnlineStepModel, evaluate, fit_step_model
from policies.cost.step_model import StepCoefficients

H100_8B = StepCoefficients(a_s=9.11e-3, b_s=24.0e-6, c_s=43.9e-9)


def steps(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Step shapes like the calibration runs: 70% decode steps, 30% chunked-prefill steps."""
    decode = rng.random(n) < 0.7
    batch = rng.integers(1, 513, n)
    new = np.where(decode, batch, rng.integers(512, 8193, n))
    ctx = np.where(decode, batch * rng.integers(100, 4000, n), new + rng.integers(0, 300_000, n))
    return new, ctx


def times(coefs: StepCoefficients, new: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    return coefs.a_s + coefs.b_s * new + coefs.c_s * ctx


# ---- batch OLS -------------------------------------------------------------------------------------------

def test_ols_recovers_noiseless_coefficients_exactly() -> None:
    new, ctx = steps(np.random.default_rng(1), 500)
    coefs, stats = fit_step_model(new, ctx, times(H100_8B, new, ctx))
    assert coefs.a_s == pytest.approx(H100_8B.a_s, rel=1e-9)
    assert coefs.b_s == pytest.approx(H100_8B.b_s, rel=1e-9)
    assert coefs.c_s == pytest.approx(H100_8B.c_s, rel=1e-9)
    assert stats.n == 500
    assert stats.r2 == pytest.approx(1.0, abs=1e-12)
    assert stats.mape < 1e-10


def test_ols_recovers_noisy_coefficients_approximately() -> None:
    rng = np.random.default_rng(2)
    new, ctx = steps(rng, 4000)
    t = times(H100_8B, new, ctx) * np.exp(rng.normal(0.0, 0.06, len(new)))
    coefs, stats = fit_step_model(new, ctx, t)
    assert coefs.a_s == pytest.approx(H100_8B.a_s, rel=0.05)
    assert coefs.b_s == pytest.approx(H100_8B.b_s, rel=0.05)
    assert coefs.c_s == pytest.approx(H100_8B.c_s, rel=0.05)
    assert 0.03 < stats.mape < 0.08  # 6% log-normal noise -> ~4.8% mean absolute error
    assert stats.r2 > 0.97


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(1e-4, 0.05),
    b=st.floats(0.0, 1e-4),
    c=st.floats(0.0, 1e-6),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(3, 300),
)
def test_ols_noiseless_property(a: float, b: float, c: float, seed: int, n: int) -> None:
    truth = StepCoefficients(a, b, c)
    new, ctx = steps(np.random.default_rng(seed), n)
    new[:3], ctx[:3] = (1, 4096, 16), (1000, 4096, 300_000)  # never rank-deficient
    coefs, stats = fit_step_model(new, ctx, times(truth, new, ctx))
    # Each coefficient to 1e-7 of the largest time it contributes (b or c may be 0).
    t_max = float(times(truth, new, ctx).max())
    assert abs(coefs.a_s - a) <= 1e-7 * t_max
    assert abs(coefs.b_s - b) * new.max() <= 1e-7 * t_max
    assert abs(coefs.c_s - c) * ctx.max() <= 1e-7 * t_max
    assert stats.mape < 1e-7


def test_evaluate_perfect_predictions() -> None:
    new, ctx = steps(np.random.default_rng(3), 50)
    assert evaluate(H100_8B, new, ctx, times(H100_8B, new, ctx)) == FitStats(n=50, r2=1.0, mape=0.0)


def test_evaluate_known_values() -> None:
    # Predictions 2, 3, 4 s (a = 1 s, b = 1 s/token, c = 0) against measured 2, 2, 5 s.
    stats = evaluate(StepCoefficients(1.0, 1.0, 0.0), [1, 2, 3], [0, 0, 0], [2.0, 2.0, 5.0])
    assert stats.n == 3
    assert stats.mape == pytest.approx((0 + 0.5 + 0.2) / 3)
    assert stats.r2 == pytest.approx(1.0 - 2.0 / 6.0)  # SS_res = 0 + 1 + 1, SS_tot = 1 + 1 + 4


def test_evaluate_constant_times_gives_nan_r2() -> None:
    assert math.isnan(evaluate(StepCoefficients(1.0, 0.0, 0.0), [1, 2], [3, 4], [1.0, 1.0]).r2)


@pytest.mark.parametrize(
    ("new", "ctx", "t", "message"),
    [
        ([1, 2], [3, 4], [0.1, 0.2], "at least 3"),
        ([1, 2, 3], [3, 4], [0.1, 0.2, 0.3], "differ in length"),
        ([1, 2, 3], [3, 4, 5], [0.1, 0.0, 0.3], "positive"),
        ([1, 2, 3], [3, 4, 5], [0.1, float("nan"), 0.3], "NaN"),
        ([4, 4, 4, 4], [3, 4, 5, 6], [0.1, 0.2, 0.3, 0.4], "rank-deficient"),
        ([[1, 2, 3]], [[3, 4, 5]], [[0.1, 0.2, 0.3]], "1-D"),
    ],
)
def test_fit_rejects_bad_input(new: list[int], ctx: list[int], t: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_step_model(new, ctx, t)


def test_evaluate_rejects_empty_and_mismatched() -> None:
    with pytest.raises(ValueError, match="no records"):
        evaluate(H100_8B, [], [], [])
    with pytest.raises(ValueError, match="differ in length"):
        evaluate(H100_8B, [1], [1, 2], [0.1])


# ---- online RLS ------------------------------------------------------------------------------------------

def feed(model: OnlineStepModel, truth: StepCoefficients, n: int, seed: int, sigma: float = 0.0) -> list[float]:
    rng = np.random.default_rng(seed)
    new, ctx = steps(rng, n)
    t = times(truth, new, ctx) * np.exp(rng.normal(0.0, sigma, n))
    return [model.update(int(a), int(b), float(c)) for a, b, c in zip(new, ctx, t, strict=True)]


def test_online_converges_after_a_change() -> None:
    truth = StepCoefficients(a_s=20e-3, b_s=H100_8B.b_s, c_s=H100_8B.c_s)
    model = OnlineStepModel(H100_8B)
    errors = feed(model, truth, 4000, seed=4, sigma=0.03)
    got = model.coefficients
    assert got.a_s == pytest.approx(20e-3, rel=0.03)
    assert got.b_s == pytest.approx(truth.b_s, rel=0.05)
    assert got.c_s == pytest.approx(truth.c_s, rel=0.08)
    assert np.mean(np.abs(errors[:20])) > 0.1  # the prior is far off at first ...
    assert np.mean(np.abs(errors[-500:])) < 0.04  # ... and the model is right at the end
    assert model.num_updates == 4000


def test_forgetting_tracks_a_change_after_a_long_stable_history() -> None:
    slower = StepCoefficients(a_s=20e-3, b_s=H100_8B.b_s, c_s=H100_8B.c_s)
    estimates = {}
    for lam in (0.999, 1.0):
        model = OnlineStepModel(H100_8B, forgetting=lam)
        feed(model, H100_8B, 6000, seed=8, sigma=0.03)
        feed(model, slower, 4000, seed=9, sigma=0.03)
        estimates[lam] = model.coefficients.a_s
    assert estimates[0.999] == pytest.approx(20e-3, rel=0.05)
    assert estimates[1.0] < 17e-3  # without forgetting, 6,000 old steps still hold it back


def test_online_stays_near_prior_when_data_agree() -> None:
    model = OnlineStepModel(H100_8B)
    feed(model, H100_8B, 2000, seed=5, sigma=0.06)
    got = model.coefficients
    assert got.a_s == pytest.approx(H100_8B.a_s, rel=0.05)
    assert got.b_s == pytest.approx(H100_8B.b_s, rel=0.05)
    assert got.c_s == pytest.approx(H100_8B.c_s, rel=0.08)


def test_online_update_returns_error_of_the_prediction_before_the_update() -> None:
    model = OnlineStepModel(H100_8B)
    predicted = H100_8B.predict_s(256, 300_000)
    assert model.predict_s(256, 300_000) == pytest.approx(predicted, rel=1e-12)
    error = model.update(256, 300_000, 2 * predicted)
    assert error == pytest.approx(-0.5, rel=1e-12)
    assert model.predict_s(256, 300_000) > predicted  # and then it moved towards the measurement
    assert model.predict_s(256, 300_000) == pytest.approx(model.coefficients.predict_s(256, 300_000))


def test_a_few_stalls_do_not_destroy_the_prior() -> None:
    model = OnlineStepModel(H100_8B)
    for _ in range(3):  # three 300 ms stalls on steps predicted at ~18 ms
        model.update(64, 64 * 1500, 0.3)
    assert model.coefficients.a_s == pytest.approx(H100_8B.a_s, rel=0.25)
    assert model.predict_s(64, 64 * 1500) == pytest.approx(H100_8B.predict_s(64, 64 * 1500), rel=0.25)


def test_no_covariance_windup_on_identical_steps() -> None:
    """20,000 identical decode steps, then an ordinary prefill step: the estimate must not jump."""
    model = OnlineStepModel(H100_8B)
    t = H100_8B.predict_s(128, 128 * 1000)
    for _ in range(20_000):
        model.update(128, 128 * 1000, t)
    before = model.coefficients
    model.update(8192, 8192 + 100_000, 1.1 * H100_8B.predict_s(8192, 8192 + 100_000))
    after = model.coefficients
    assert after.a_s == pytest.approx(before.a_s, rel=0.1)
    assert after.b_s == pytest.approx(before.b_s, rel=0.1)
    assert after.c_s == pytest.approx(before.c_s, rel=0.1)


def test_forgetting_one_is_growing_window_least_squares() -> None:
    """With lam = 1, no clipping and a weak prior, RLS equals the batch OLS solution."""
    rng = np.random.default_rng(6)
    new, ctx = steps(rng, 300)
    t = times(H100_8B, new, ctx) * np.exp(rng.normal(0.0, 0.05, len(new)))
    model = OnlineStepModel(StepCoefficients(0.0, 0.0, 0.0), prior_strength=1e-9, forgetting=1.0,
                            max_relative_innovation=None)
    for a, b, c in zip(new, ctx, t, strict=True):
        model.update(int(a), int(b), float(c))
    ols, _ = fit_step_model(new, ctx, t)
    got = model.coefficients
    assert got.a_s == pytest.approx(ols.a_s, rel=1e-4)
    assert got.b_s == pytest.approx(ols.b_s, rel=1e-4)
    assert got.c_s == pytest.approx(ols.c_s, rel=1e-4)


def test_reset_restores_the_prior() -> None:
    model = OnlineStepModel(H100_8B)
    feed(model, StepCoefficients(0.03, 1e-5, 1e-8), 100, seed=7)
    model.reset()
    assert model.coefficients.a_s == pytest.approx(H100_8B.a_s, rel=1e-12)
    assert model.num_updates == 0
    other = StepCoefficients(0.004, 5e-6, 2e-8)
    model.reset(other)
    assert model.prior == other
    assert model.coefficients.c_s == pytest.approx(other.c_s, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [{"forgetting": 0.0}, {"forgetting": 1.5}, {"prior_strength": 0.0}, {"max_relative_innovation": 0.0},
     {"time_scale_s": -1.0}, {"token_scale": float("inf")}],
)
def test_online_rejects_bad_parameters(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OnlineStepModel(H100_8B, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("new", "ctx", "t"), [(1, 1, 0.0), (1, 1, -0.01), (1, 1, float("nan")), (-1, 1, 0.01)])
def test_online_rejects_bad_steps(new: int, ctx: int, t: float) -> None:
    model = OnlineStepModel(H100_8B)
    with pytest.raises(ValueError):
        model.update(new, ctx, t)
    assert model.num_updates == 0
    assert model.coefficients == OnlineStepModel(H100_8B).coefficients


# -- the engine-loop term d (held at the prior, never fitted) ---------------------------------------------
H100_LOOP = StepCoefficients(a_s=9.2e-3, b_s=24.0e-6, c_s=43.9e-9, d_s=8.37e-6)


def test_online_model_carries_the_loop_term_of_its_prior() -> None:
    model = OnlineStepModel(H100_LOOP)
    got = model.coefficients
    assert got.d_s == H100_LOOP.d_s
    assert (got.a_s, got.b_s, got.c_s) == pytest.approx((H100_LOOP.a_s, H100_LOOP.b_s, H100_LOOP.c_s), rel=1e-12)
    assert model.predict_s(300, 90_000, 300) == pytest.approx(H100_LOOP.predict_s(300, 90_000, 300), rel=1e-12)
    assert model.predict_s(300, 90_000) == pytest.approx(H100_LOOP.predict_s(300, 90_000), rel=1e-12)
    model.reset(H100_8B)
    assert model.coefficients.d_s == 0.0


def test_loop_term_is_taken_off_measurements_that_include_it() -> None:
    # Steps whose measured time includes d * num_requests (the simulator's): given the count, a, b and c
    # converge to the forward pass alone and d stays the prior's; without it, a, b and c absorb the loop.
    rng = np.random.default_rng(11)
    new, ctx = steps(rng, 4000)
    nreq = np.where(new <= 512, new, 1 + rng.integers(0, 256, len(new)))  # decode steps: one request per token
    t = times(H100_LOOP, new, ctx) + H100_LOOP.d_s * nreq
    told, untold = OnlineStepModel(H100_LOOP), OnlineStepModel(H100_8B)
    errors = [told.update(int(n), int(c), float(s), int(r)) for n, c, s, r in zip(new, ctx, t, nreq, strict=True)]
    for n, c, s in zip(new, ctx, t, strict=True):
        untold.update(int(n), int(c), float(s))
    got = told.coefficients
    assert got.d_s == H100_LOOP.d_s
    assert (got.a_s, got.b_s, got.c_s) == pytest.approx((H100_LOOP.a_s, H100_LOOP.b_s, H100_LOOP.c_s), rel=1e-6)
    assert max(abs(e) for e in errors) < 1e-9  # the prior was right, and the error counts the loop term
    assert untold.coefficients.a_s > H100_LOOP.a_s * 1.05  # absorbed (here mostly into the fixed cost)


def test_update_rejects_a_negative_request_count() -> None:
    with pytest.raises(ValueError):
        OnlineStepModel(H100_LOOP).update(10, 100, 0.01, -1)
