"""How long a simulated step takes: the calibrated linear model, plus optional measured effects.

The ground truth of the simulator is ``T = a + b * new + c * ctx`` with the coefficients of a calibration
profile (fitted on H100 step records, ``shared/calibration``), plus the engine loop's time outside the
recorded window, ``g0 + g1 * scheduled_requests`` (output processing in ``LLMEngine.step()``; about 0.1 ms
+ 8-10 us per request on the H100 runs, fitted per profile from each workload's wall time minus its summed
step times). Two optional effects, both off by default:

* **noise** - multiplicative log-normal, ``T * exp(N(-sigma^2/2, sigma))`` (mean-preserving), with the
  profile's residual spread as ``sigma``;
* **length heterogeneity** - decode steps with the same batch size and total context ran slower when a few
  requests were very long (``shared/calibration/h100_llama31-8b_heterogeneity.json``): +9.5% at 64
  requests (context CV 1.92), +7.2% at 128 (CV 2.74), +1.7% at 256 (CV 1.88). The slowdown per unit of CV
  falls roughly as 1/batch, so we model ``slowdown = h * cv / n`` and fit ``h`` by least squares through
  the origin on those three points: ``h = sum(x*s) / sum(x^2)`` with ``x = cv/n``, giving h = 3.19. The
  slowdown is capped at the largest measured value (9.5%): we do not extrapolate beyond what was seen.
  CascadeInfer reports 1.1-2.1x on other hardware; on an H100 with FA3 the measurements do not support
  that, so neither does the simulator.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from policies.cost.step_model import StepCoefficients

# (batch size, context CV, measured slowdown) from h100_llama31-8b_heterogeneity.json (medians of 14 steps).
HETEROGENEITY_POINTS: tuple[tuple[int, float, float], ...] = (
    (64, 1.921, 21.953 / 20.052 - 1.0),
    (128, 2.740, 23.606 / 22.026 - 1.0),
    (256, 1.875, 27.387 / 26.936 - 1.0),
)


def fit_heterogeneity(points: tuple[tuple[int, float, float], ...] = HETEROGENEITY_POINTS) -> float:
    """Least-squares ``h`` of ``slowdown = h * cv / n`` through the origin."""
    xs = [cv / n for n, cv, _ in points]
    return sum(x * s for x, (_, _, s) in zip(xs, points, strict=True)) / sum(x * x for x in xs)


HETEROGENEITY_H = fit_heterogeneity()
HETEROGENEITY_CAP = max(s for _, _, s in HETEROGENEITY_POINTS)


@dataclass(slots=True)
class StepTimer:
    """Ground-truth step durations for one simulated unit."""

    coefficients: StepCoefficients
    noise_sigma: float = 0.0
    heterogeneity: bool = False
    seed: int = 0
    loop_overhead_s: float = 0.0
    loop_overhead_per_request_s: float = 0.0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.noise_sigma < 0:
            raise ValueError("noise_sigma must be >= 0")
        self._rng = random.Random(self.seed)

    def duration_s(
        self, new_tokens: int, context_tokens: int, num_requests: int = 0, contexts: list[int] | None = None
    ) -> float:
        """Duration of a step computing ``new_tokens`` over ``context_tokens`` of context for ``num_requests``.

        ``contexts`` (per scheduled request) is only needed for the heterogeneity term.
        """
        t = self.coefficients.predict_s(new_tokens, context_tokens)
        if self.heterogeneity and contexts and len(contexts) > 1:
            t *= 1.0 + heterogeneity_slowdown(contexts)
        if self.noise_sigma > 0.0:
            s = self.noise_sigma
            t *= math.exp(self._rng.gauss(-0.5 * s * s, s))
        return t + self.loop_overhead_s + self.loop_overhead_per_request_s * num_requests


def heterogeneity_slowdown(contexts: list[int]) -> float:
    """Fractional slowdown of a step whose requests have these context lengths."""
    n = len(contexts)
    mean = sum(contexts) / n
    if mean <= 0:
        return 0.0
    var = sum((x - mean) ** 2 for x in contexts) / n
    cv = math.sqrt(var) / mean
    return min(HETEROGENEITY_H * cv / n, HETEROGENEITY_CAP)
