"""Synthetic workloads: determinism, statistics of arrivals and lengths, presets and the spec syntax."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.workload import (
    PRESETS,
    AllAtOnce,
    ArrivalProcess,
    Fixed,
    Gamma,
    GammaArrivals,
    Geometric,
    LengthDistribution,
    Lognormal,
    PoissonArrivals,
    Uniform,
    WorkloadError,
    WorkloadSpec,
    describe_presets,
    generate,
    parse_length,
    parse_workload,
    parse_workload_spec,
)

N = 20_000


def _cv(values: np.ndarray) -> float:
    return float(np.std(values) / np.mean(values))


def _gaps(arrivals: ArrivalProcess, seed: int = 11) -> np.ndarray:
    times = arrivals.sample(np.random.default_rng(seed), N)
    return np.diff(np.concatenate([[0.0], times]))


# ------------------------------------------------------------------------------------------ determinism


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    first = parse_workload("bursty:n=500", seed=42)
    assert first == parse_workload("bursty:n=500", seed=42)
    assert first != parse_workload("bursty:n=500", seed=43)
    assert [r.request_id for r in first[:3]] == ["r000000", "r000001", "r000002"]


def test_arrival_process_does_not_change_lengths_for_a_seed() -> None:
    slow = parse_workload("sharegpt-like:rate=10,n=300", seed=5)
    fast = parse_workload("sharegpt-like:rate=20,n=300", seed=5)
    bursty = parse_workload("sharegpt-like:rate=20,cv=3,n=300", seed=5)
    assert [(r.prompt_tokens, r.output_tokens) for r in slow] == [
        (r.prompt_tokens, r.output_tokens) for r in bursty
    ]
    assert [r.arrival_s for r in slow] == pytest.approx([2 * r.arrival_s for r in fast], rel=1e-12)


# ------------------------------------------------------------------------------------------ arrivals


@pytest.mark.parametrize("rate", [0.5, 40.0])
def test_poisson_gaps_have_mean_one_over_rate_and_cv_one(rate: float) -> None:
    gaps = _gaps(PoissonArrivals(rate))
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert _cv(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize(("rate", "cv"), [(12.0, 0.5), (12.0, 1.0), (3.0, 2.0)])
def test_gamma_gaps_have_the_requested_mean_and_cv(rate: float, cv: float) -> None:
    gaps = _gaps(GammaArrivals(rate, cv))
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.06)
    assert _cv(gaps) == pytest.approx(cv, rel=0.1)


def test_all_at_once() -> None:
    assert {r.arrival_s for r in generate(50, AllAtOnce(), Fixed(3), Fixed(4), seed=0)} == {0.0}


@pytest.mark.parametrize(
    "make",
    [
        lambda: PoissonArrivals(0.0),
        lambda: GammaArrivals(1.0, -1.0),
        lambda: GammaArrivals(float("inf"), 1.0),
    ],
)
def test_bad_arrival_parameters(make: object) -> None:
    with pytest.raises(WorkloadError):
        make()  # type: ignore[operator]


# ------------------------------------------------------------------------------------------ lengths


def _lengths(dist: LengthDistribution, seed: int = 3) -> np.ndarray:
    return dist.sample(np.random.default_rng(seed), N)


def test_lognormal_is_probe_py_formula_on_the_same_draws() -> None:
    dist = Lognormal(5.2, 1.0, lo=4, hi=4096)
    draws = np.random.default_rng(9).lognormal(5.2, 1.0, N)
    expected = [int(min(4096, max(4, value))) for value in draws]  # as /work/shared/gpu/probe.py does
    assert dist.sample(np.random.default_rng(9), N).tolist() == expected


def test_lognormal_mean_matches_the_underlying_normal() -> None:
    values = _lengths(Lognormal(5.2, 1.0))
    assert np.mean(values) == pytest.approx(math.exp(5.2 + 0.5) - 0.5, rel=0.04)  # floor removes ~0.5
    assert np.median(values) == pytest.approx(math.exp(5.2), rel=0.04)


def test_lognormal_agrees_in_law_with_random_lognormvariate() -> None:
    rng = random.Random(0)
    reference = [int(min(2048, max(4, rng.lognormvariate(5.2, 0.9)))) for _ in range(N)]
    ours = _lengths(Lognormal(5.2, 0.9, lo=4, hi=2048))
    for q in (0.1, 0.5, 0.9):
        assert np.quantile(ours, q) == pytest.approx(np.quantile(reference, q), rel=0.06)


def test_geometric_mean_and_cv() -> None:
    values = _lengths(Geometric(200.0))
    assert np.mean(values) == pytest.approx(200, rel=0.03)
    assert _cv(values) == pytest.approx(math.sqrt(1 - 1 / 200), rel=0.05)
    assert values.min() >= 1


def test_gamma_mean_and_cv() -> None:
    values = _lengths(Gamma(300.0, 2.0))
    assert np.mean(values) == pytest.approx(300, rel=0.06)
    assert _cv(values) == pytest.approx(2.0, rel=0.1)


def test_uniform_covers_both_ends_and_fixed_is_fixed() -> None:
    values = _lengths(Uniform(1, 10))
    assert sorted(set(values.tolist())) == list(range(1, 11))
    assert np.mean(values) == pytest.approx(5.5, rel=0.02)
    assert set(_lengths(Fixed(128)).tolist()) == {128}


@pytest.mark.parametrize(
    "dist",
    [Lognormal(5.2, 2.0, lo=50, hi=300), Geometric(100.0, lo=20, hi=150), Gamma(100.0, 3.0, lo=2, hi=400)],
)
def test_clipping_is_respected_and_reached(dist: Lognormal | Geometric | Gamma) -> None:
    values = _lengths(dist)
    assert values.min() == dist.lo
    assert values.max() == dist.hi
    assert values.dtype == np.int64


@pytest.mark.parametrize(
    "make",
    [
        lambda: Lognormal(5.0, -1.0),
        lambda: Lognormal(5.0, 1.0, lo=0),
        lambda: Uniform(10, 5),
        lambda: Fixed(0),
        lambda: Geometric(0.5),
        lambda: Gamma(100.0, 0.0),
        lambda: Gamma(100.0, 1.0, lo=9, hi=8),
    ],
)
def test_bad_length_parameters(make: object) -> None:
    with pytest.raises(WorkloadError):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(("num_requests", "seed"), [(0, 0), (10, -1), (True, 0)])
def test_generate_rejects_bad_counts_and_seeds(num_requests: int, seed: int) -> None:
    with pytest.raises(WorkloadError):
        generate(num_requests, AllAtOnce(), Fixed(1), Fixed(1), seed=seed)


# ------------------------------------------------------------------------------------------ presets


def test_sharegpt_like_is_the_calibration_baseline() -> None:
    spec = parse_workload_spec("sharegpt-like")
    assert spec.prompt == Lognormal(5.2, 1.0, lo=4, hi=4096)
    assert spec.output == Lognormal(5.2, 0.9, lo=4, hi=2048)
    assert isinstance(spec.arrivals, PoissonArrivals)


def test_presets_have_the_promised_shapes() -> None:
    longbench = parse_workload("longbench-like", seed=1)
    numina = parse_workload("numina-like", seed=1)
    assert 4_000 < np.median([r.prompt_tokens for r in longbench]) < 8_000
    assert all(1_000 <= r.prompt_tokens <= 15_000 for r in longbench)
    assert 50 < np.mean([r.output_tokens for r in longbench]) < 200
    assert 50 < np.mean([r.prompt_tokens for r in numina]) < 200
    assert 1_000 < np.mean([r.output_tokens for r in numina]) < 2_000
    assert isinstance(parse_workload_spec("bursty").arrivals, GammaArrivals)
    assert parse_workload_spec("bursty").arrivals == GammaArrivals(PRESETS["bursty"].rate_rps, 4.0)


def test_describe_presets_lists_every_name_on_one_line_each() -> None:
    described = dict(describe_presets())
    assert list(described)[:4] == ["sharegpt-like", "longbench-like", "numina-like", "bursty"]
    assert {"poisson", "gamma", "all-at-once"} <= set(described)
    assert "LongBench" in described["longbench-like"]
    assert all(text and "\n" not in text for text in described.values())
    for name in described:
        assert parse_workload(f"{name}:n=5", seed=0)


# ------------------------------------------------------------------------------------------ spec syntax


def test_spec_examples_from_the_cli_help() -> None:
    bursty = parse_workload_spec("bursty:rate=12,cv=3,n=2000")
    assert (bursty.num_requests, bursty.arrivals) == (2000, GammaArrivals(12.0, 3.0))
    spec = parse_workload_spec("poisson:rate=5,n=500,prompt=uniform(100,2000),output=fixed(64)")
    assert spec == WorkloadSpec(500, PoissonArrivals(5.0), Uniform(100, 2000), Fixed(64))
    requests = parse_workload("poisson:rate=5,n=500,prompt=uniform(100,2000),output=fixed(64)", seed=1)
    assert len(requests) == 500 and {r.output_tokens for r in requests} == {64}


def test_spec_clipping_named_arguments_slos_and_spaces() -> None:
    spec = parse_workload_spec(
        " Gamma : rate=2.5, prompt=lognormal(5.2, 1.0, lo=4, hi=4096), output=gamma(mean=300,cv=2,hi=999),"
        " ttft_slo_ms=250, tpot_slo_ms=30"
    )
    assert spec.arrivals == GammaArrivals(2.5, 2.0)
    assert spec.prompt == Lognormal(5.2, 1.0, lo=4, hi=4096)
    assert spec.output == Gamma(300.0, 2.0, hi=999)
    requests = spec.generate(seed=0)
    assert {(r.ttft_slo_ms, r.tpot_slo_ms) for r in requests} == {(250.0, 30.0)}
    assert parse_length("geometric(200)") == Geometric(200.0)


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (
            "sharegtp-like",
            ["unknown workload 'sharegtp-like'", "sharegpt-like, longbench-like", "all-at-once"],
        ),
        ("sharegpt-like:rps=3", ["unknown key 'rps'", "valid keys for sharegpt-like: n, rate, cv, prompt"]),
        ("poisson:cv=2", ["unknown key 'cv'", "valid keys for poisson: n, rate, prompt"]),
        ("all-at-once:rate=3", ["unknown key 'rate'", "valid keys for all-at-once: n, prompt"]),
        ("sharegpt-like:n=0", ["n must be >= 1"]),
        ("sharegpt-like:n=1e3", ["n must be a whole number (got '1e3')"]),
        ("sharegpt-like:rate=fast", ["rate must be a number"]),
        ("bursty:cv=-2", ["cv must be > 0"]),
        ("sharegpt-like:n=3,n=4", ["n is given twice"]),
        ("sharegpt-like:rate", ["rate needs a value"]),
        ("sharegpt-like:n=3,,rate=2", ["empty item"]),
        ("sharegpt-like:prompt=lognormal(5.2,1.0", ["unbalanced '('"]),
        (
            "sharegpt-like:prompt=normal(5,1)",
            [
                "bad length distribution 'normal(5,1)'",
                "lognormal(mu,sigma",
                "uniform(lo,hi)",
                "fixed(tokens)",
                "geometric(mean",
                "gamma(mean,cv",
            ],
        ),
        ("sharegpt-like:prompt=lognormal(5.2)", ["missing sigma"]),
        ("sharegpt-like:prompt=uniform(1,9,hi=4)", ["bad arguments", "usage: uniform(lo,hi)"]),
        ("sharegpt-like:prompt=lognormal(lo=4,5.2,1.0)", ["bad arguments"]),
        ("sharegpt-like:output=fixed(1.5)", ["fixed tokens must be a whole number"]),
        ("sharegpt-like:output=uniform(9,3)", ["1 <= lo <= hi"]),
        ("sharegpt-like:output=gamma(100,nan)", ["must be finite"]),
    ],
)
def test_spec_errors_say_what_is_valid(spec: str, fragments: list[str]) -> None:
    with pytest.raises(WorkloadError) as caught:
        parse_workload(spec, seed=0)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message
    assert "\n" not in message


# ------------------------------------------------------------------------------------------ properties

_clip = st.tuples(st.integers(1, 5_000), st.integers(0, 5_000)).map(lambda t: (t[0], t[0] + t[1]))
lengths: st.SearchStrategy[LengthDistribution] = st.one_of(
    st.builds(
        lambda mu, sigma, c: Lognormal(mu, sigma, *c),
        st.floats(-2, 12),
        st.floats(0, 3),
        _clip,
    ),
    _clip.map(lambda c: Uniform(*c)),
    st.integers(1, 100_000).map(Fixed),
    st.builds(lambda mean, c: Geometric(mean, *c), st.floats(1, 10_000), _clip),
    st.builds(
        lambda mean, cv, c: Gamma(mean, cv, *c),
        st.floats(0.01, 10_000),
        st.floats(0.05, 10),
        _clip,
    ),
)
arrival_processes: st.SearchStrategy[ArrivalProcess] = st.one_of(
    st.floats(1e-3, 1e4).map(PoissonArrivals),
    st.builds(GammaArrivals, st.floats(1e-3, 1e4), st.floats(0.05, 20)),
    st.just(AllAtOnce()),
)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 300),
    arrivals=arrival_processes,
    prompt=lengths,
    output=lengths,
    seed=st.integers(0, 2**32),
)
def test_every_generated_workload_is_well_formed(
    n: int, arrivals: ArrivalProcess, prompt: LengthDistribution, output: LengthDistribution, seed: int
) -> None:
    requests = generate(n, arrivals, prompt, output, seed=seed)
    assert len(requests) == n
    assert len({r.request_id for r in requests}) == n
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in requests)
    assert all(isinstance(r.prompt_tokens, int) and isinstance(r.output_tokens, int) for r in requests)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(requests))
    assert requests[0].arrival_s >= 0.0
    for dist, values in (
        (prompt, [r.prompt_tokens for r in requests]),
        (output, [r.output_tokens for r in requests]),
    ):
        lo, hi = getattr(dist, "lo", None), getattr(dist, "hi", None)
        if lo is not None and hi is not None:
            assert lo <= min(values) and max(values) <= hi


@given(dist=lengths)
def test_length_distributions_print_as_spec_text_that_parses_back(dist: LengthDistribution) -> None:
    assert parse_length(str(dist)) == dist


@given(
    n=st.integers(1, 10**6),
    arrivals=arrival_processes,
    prompt=lengths,
    output=lengths,
    slos=st.tuples(*[st.none() | st.floats(0.001, 1e6)] * 2),
)
def test_workload_specs_print_as_text_that_parses_back(
    n: int,
    arrivals: ArrivalProcess,
    prompt: LengthDistribution,
    output: LengthDistribution,
    slos: tuple[float | None, float | None],
) -> None:
    spec = WorkloadSpec(n, arrivals, prompt, output, *slos)
    assert parse_workload_spec(str(spec)) == spec
