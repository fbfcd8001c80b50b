"""Synthetic workloads: an arrival process and two length distributions, sampled with a seeded numpy RNG.

Everything is deterministic for a seed and does no I/O. Arrivals, prompt lengths and output lengths draw
from three independent streams spawned from the seed, so two workloads that differ only in their arrival
process (say ``rate=20`` against ``rate=40``) get exactly the same lengths: comparisons use common random
numbers. Named presets and the CLI syntax ``NAME[:key=value,...]`` live in :mod:`agent.workload.spec`.

Default loads are sized for 4 data-parallel H100 units of Llama-3.1-8B, which saturate at about 82
requests/s on sharegpt-like lengths (each unit: 5,900 output tokens/s, 1,000 requests in 48.5 s, see
``calibration/README.md``). The presets aim at roughly half of the saturation load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from agent.workload.types import RequestSpec, request_id_for
from agent.workload.types import require as _require

MAX_LENGTH_TOKENS = 32_768
"""Default upper clip of every length distribution, in tokens."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class ArrivalProcess(Protocol):
    """Arrival times of ``n`` requests: seconds from the start of the workload, nondecreasing."""

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray: ...


class LengthDistribution(Protocol):
    """Token counts of ``n`` requests, each within the distribution's clip bounds and >= 1."""

    def sample(self, rng: np.random.Generator, n: int) -> IntArray: ...


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _check_clip(lo: int, hi: int) -> None:
    _require(1 <= lo <= hi, f"length bounds need 1 <= lo <= hi (got lo={lo}, hi={hi})")


def _clip(values: FloatArray, lo: int, hi: int) -> IntArray:
    return np.clip(values, lo, hi).astype(np.int64)


def _clip_suffix(lo: int, hi: int) -> str:
    return "".join(f",{k}={v}" for k, v, d in (("lo", lo, 1), ("hi", hi, MAX_LENGTH_TOKENS)) if v != d)


# ---------------------------------------------------------------------------------------- arrivals


@dataclass(frozen=True, slots=True)
class PoissonArrivals:
    """Poisson arrivals: exponential gaps with mean ``1 / rate_rps`` seconds; the first at its own gap."""

    rate_rps: float
    """Mean arrival rate, requests per second."""

    def __post_init__(self) -> None:
        _require(_positive(self.rate_rps), f"rate must be > 0 requests/s (got {self.rate_rps!r})")

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        return np.cumsum(rng.exponential(1.0 / self.rate_rps, n))


@dataclass(frozen=True, slots=True)
class GammaArrivals:
    """Gamma-distributed gaps with mean ``1 / rate_rps`` s and coefficient of variation ``cv``.

    ``cv = 1`` has the law of Poisson arrivals; ``cv > 1`` is bursty (clusters and long lulls); ``cv < 1``
    is more regular than Poisson.
    """

    rate_rps: float
    """Mean arrival rate, requests per second."""
    cv: float
    """Standard deviation of the gaps divided by their mean."""

    def __post_init__(self) -> None:
        _require(_positive(self.rate_rps), f"rate must be > 0 requests/s (got {self.rate_rps!r})")
        _require(_positive(self.cv), f"cv must be > 0 (got {self.cv!r})")

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        shape = 1.0 / (self.cv * self.cv)
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate_rps * shape), n))


@dataclass(frozen=True, slots=True)
class AllAtOnce:
    """Every request arrives at 0.0 s (an offline batch, like the calibration runs)."""

    def sample(self, rng: np.random.Generator, n: int) -> FloatArray:
        return np.zeros(n, dtype=np.float64)


# ---------------------------------------------------------------------------------------- lengths


@dataclass(frozen=True, slots=True)
class Lognormal:
    """``floor(exp(N(mu, sigma)))`` clipped to ``[lo, hi]``: ``int(random.lognormvariate(mu, sigma))``."""

    mu: float
    """Mean of the underlying normal (the median is ``exp(mu)`` tokens)."""
    sigma: float
    """Standard deviation of the underlying normal."""
    lo: int = 1
    hi: int = MAX_LENGTH_TOKENS

    def __post_init__(self) -> None:
        _require(math.isfinite(self.mu), f"lognormal mu must be finite (got {self.mu!r})")
        _require(
            math.isfinite(self.sigma) and self.sigma >= 0,
            f"lognormal sigma must be >= 0 (got {self.sigma!r})",
        )
        _check_clip(self.lo, self.hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        return _clip(np.floor(rng.lognormal(self.mu, self.sigma, n)), self.lo, self.hi)

    def __str__(self) -> str:
        return f"lognormal({self.mu!r},{self.sigma!r}{_clip_suffix(self.lo, self.hi)})"


@dataclass(frozen=True, slots=True)
class Uniform:
    """Whole numbers of tokens, uniform on ``[lo, hi]`` (both included)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_clip(self.lo, self.hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        return rng.integers(self.lo, self.hi, size=n, endpoint=True, dtype=np.int64)

    def __str__(self) -> str:
        return f"uniform({self.lo},{self.hi})"


@dataclass(frozen=True, slots=True)
class Fixed:
    """Always ``tokens`` tokens."""

    tokens: int

    def __post_init__(self) -> None:
        _require(self.tokens >= 1, f"fixed length must be >= 1 token (got {self.tokens!r})")

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        return np.full(n, self.tokens, dtype=np.int64)

    def __str__(self) -> str:
        return f"fixed({self.tokens})"


@dataclass(frozen=True, slots=True)
class Geometric:
    """Geometric on 1, 2, ... with the given mean in tokens (success probability ``1 / mean``), clipped.

    Memoryless: a request that has generated k tokens is as likely to stop at the next one as a new one.
    """

    mean: float
    lo: int = 1
    hi: int = MAX_LENGTH_TOKENS

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.mean) and self.mean >= 1, f"geometric mean must be >= 1 (got {self.mean!r})"
        )
        _check_clip(self.lo, self.hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        return _clip(rng.geometric(1.0 / self.mean, n).astype(np.float64), self.lo, self.hi)

    def __str__(self) -> str:
        return f"geometric({self.mean!r}{_clip_suffix(self.lo, self.hi)})"


@dataclass(frozen=True, slots=True)
class Gamma:
    """Gamma with the given mean (tokens) and coefficient of variation, rounded to whole tokens, clipped."""

    mean: float
    cv: float
    lo: int = 1
    hi: int = MAX_LENGTH_TOKENS

    def __post_init__(self) -> None:
        _require(_positive(self.mean), f"gamma mean must be > 0 (got {self.mean!r})")
        _require(_positive(self.cv), f"gamma cv must be > 0 (got {self.cv!r})")
        _check_clip(self.lo, self.hi)

    def sample(self, rng: np.random.Generator, n: int) -> IntArray:
        shape = 1.0 / (self.cv * self.cv)
        return _clip(np.rint(rng.gamma(shape, self.mean / shape, n)), self.lo, self.hi)

    def __str__(self) -> str:
        return f"gamma({self.mean!r},{self.cv!r}{_clip_suffix(self.lo, self.hi)})"


# ---------------------------------------------------------------------------------------- generation


def generate(
    num_requests: int,
    arrivals: ArrivalProcess,
    prompt_dist: LengthDistribution,
    output_dist: LengthDistribution,
    *,
    seed: int,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
) -> list[RequestSpec]:
    """``num_requests`` requests ``r000000``, ``r000001``, ... in arrival order, the same for the same seed.

    SLOs (milliseconds), when given, are set on every request; ``None`` leaves the run's default.
    """
    _require(
        not isinstance(num_requests, bool) and isinstance(num_requests, int) and num_requests >= 1,
        f"number of requests must be a whole number >= 1 (got {num_requests!r})",
    )
    _require(
        not isinstance(seed, bool) and isinstance(seed, int) and seed >= 0,
        f"seed must be a whole number >= 0 (got {seed!r})",
    )
    arrival_rng, prompt_rng, output_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)
    )
    times = arrivals.sample(arrival_rng, num_requests).tolist()
    prompts = prompt_dist.sample(prompt_rng, num_requests).tolist()
    outputs = output_dist.sample(output_rng, num_requests).tolist()
    return [
        RequestSpec(request_id_for(i), t, p, o, ttft_slo_ms, tpot_slo_ms)
        for i, (t, p, o) in enumerate(zip(times, prompts, outputs, strict=True))
    ]
