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

One effect is on whenever the profile has it: **mixed-batch interference** (``interference_kappa``, 0 = off).
A step that computes both prefill and decode tokens takes ``linear * (1 + kappa * rho * (1 - rho))`` with
``rho = decode_tokens / new_tokens``: 1 for pure prefill or pure decode steps, largest at ``rho = 0.5``.
Seed 002 (exclusive batching) fits the kernel time of a fixed-size batch as a quadratic in ``rho``, whose
excess over the line between the pure-prefill and pure-decode costs is proportional to ``rho * (1 - rho)``;
our linear model is that line (it is linear in ``rho`` at fixed ``new_tokens``), so the factor is the
paper's shape, applied multiplicatively. ``kappa`` is fitted per profile by
:func:`agent.engine.profile_fit.fit_interference_kappa` (see there for the data and for what it absorbs).
With ``interference_on="attention"`` the factor multiplies only the context (attention) term instead,
``a + b * new + c * ctx * (1 + kappa * rho * (1 - rho))``: seed 002's kernel breakdown (A.2) says only
attention grows with the decode share, and on the H100 8B records this shape fits the mixed steps better
(``docs/simulator.md``); its ``kappa`` is the profile's ``interference_kappa_attention``, fitted the same way.
:func:`marginal_cost_crossover` and :func:`kappa_for_crossover` translate between ``kappa`` and the paper's
observable: the decode share above which a mixed step's per-token marginal cost exceeds pure decode's.
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
    # Start values 0.0: mypyc (setup.py) miscompiles an operation on two start-less sum()s as integers.
    return sum((x * s for x, (_, _, s) in zip(xs, points, strict=True)), 0.0) / sum((x * x for x in xs), 0.0)


HETEROGENEITY_H = fit_heterogeneity()
INTERFERENCE_ON = ("step", "attention")
"""What the mixed-batch interference factor may multiply (:attr:`StepTimer.interference_on`)."""
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
    interference_kappa: float = 0.0
    """Mixed-batch interference (see the module docstring); 0 leaves every step linear."""
    interference_on: str = "step"
    """What the interference factor multiplies: ``step`` (the whole linear prediction) or ``attention`` (the
    context term only)."""
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.noise_sigma < 0:
            raise ValueError("noise_sigma must be >= 0")
        if self.interference_kappa < 0:
            raise ValueError("interference_kappa must be >= 0")
        if self.interference_on not in INTERFERENCE_ON:
            raise ValueError(f"interference_on must be one of {', '.join(INTERFERENCE_ON)}, "
                             f"not {self.interference_on!r}")
        self._rng = random.Random(self.seed)

    def duration_s(
        self,
        new_tokens: int,
        context_tokens: int,
        num_requests: int = 0,
        contexts: list[int] | None = None,
        *,
        decode_tokens: int = 0,
    ) -> float:
        """Duration of a step computing ``new_tokens`` over ``context_tokens`` of context for ``num_requests``.

        ``contexts`` (per scheduled request) is only needed for the heterogeneity term, ``decode_tokens`` (of
        the ``new_tokens``) only for the interference term: with the default 0 every step counts as pure.
        """
        t = self.coefficients.predict_s(new_tokens, context_tokens)
        if self.interference_kappa:
            factor = interference_factor(self.interference_kappa, new_tokens, decode_tokens)
            if self.interference_on == "step":
                t *= factor
            else:
                t += self.coefficients.c_s * context_tokens * (factor - 1.0)
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


def interference_factor(kappa: float, new_tokens: int, decode_tokens: int) -> float:
    """``1 + kappa * rho * (1 - rho)`` with ``rho = decode_tokens / new_tokens``; exactly 1 for pure steps."""
    if new_tokens <= 0 or decode_tokens <= 0 or decode_tokens >= new_tokens:
        return 1.0
    rho = decode_tokens / new_tokens
    return 1.0 + kappa * rho * (1.0 - rho)


def _crossover_terms(
    coefficients: StepCoefficients, decode_context_tokens: int, on: str = "step"
) -> tuple[float, float]:
    """``(b + c, c * (C - 1))`` of the marginal-cost model below (seconds per token); ``(c, c * (C - 1))`` when the
    interference is ``on`` the attention term only (``b`` takes no part in it)."""
    if decode_context_tokens < 2:
        raise ValueError("decode_context_tokens must be >= 2 (a decode step reads at least one earlier token)")
    if on not in INTERFERENCE_ON:
        raise ValueError(f"on must be one of {', '.join(INTERFERENCE_ON)}, not {on!r}")
    c = coefficients.c_s
    return (coefficients.b_s if on == "step" else 0.0) + c, c * (decode_context_tokens - 1)


def marginal_cost_crossover(
    coefficients: StepCoefficients, kappa: float, decode_context_tokens: int, on: str = "step"
) -> float | None:
    """Decode share above which a mixed step's per-token marginal cost exceeds a pure-decode step's.

    Seed 002's observable: grow a step of ``N`` new tokens at fixed decode share ``rho``; its marginal cost
    per token is ``dT/dN``. Decode requests sit at context ``C = decode_context_tokens`` (so each adds ``C``
    context tokens); prefill tokens are fresh prompts' first chunks (each adds its own 1 token of context).
    With ``L(rho) = b + c * (1 + rho * (C - 1))`` the linear model's marginal cost,

        m(rho) = L(rho) * (1 + kappa * rho * (1 - rho)),  m(1) = b + c * C = L(1),
        m(rho) - m(1) = (1 - rho) * (kappa * rho * L(rho) - c * (C - 1)),

    so mixed steps cost more per token than pure decode exactly when ``kappa * rho * L(rho) > c * (C - 1)``;
    ``rho * L(rho)`` increases with ``rho``, so there is one crossover, the root in ``rho`` of
    ``kappa * c * (C - 1) * rho^2 + kappa * (b + c) * rho - c * (C - 1) = 0``. Returns it, or None when
    mixed steps never cost more (``kappa = 0``, or the root is at or above 1).

    With the interference ``on`` the attention term only, ``m(rho) = b + A(rho) * (1 + kappa * rho * (1 - rho))``
    with ``A(rho) = c * (1 + rho * (C - 1))``, and the same algebra holds with ``A`` in place of ``L``: the root of
    ``kappa * c * (C - 1) * rho^2 + kappa * c * rho - c * (C - 1) = 0``.
    """
    if kappa <= 0.0:
        return None
    b1, slope = _crossover_terms(coefficients, decode_context_tokens, on)
    if slope <= 0.0:
        return None
    rho = (-b1 + math.sqrt(b1 * b1 + 4.0 * slope * slope / kappa)) / (2.0 * slope)
    return rho if rho < 1.0 else None


def kappa_for_crossover(
    coefficients: StepCoefficients, crossover: float, decode_context_tokens: int, on: str = "step"
) -> float:
    """The ``kappa`` whose :func:`marginal_cost_crossover` is ``crossover`` (the inverse, closed form).

    From ``kappa * rho * L(rho) = c * (C - 1)`` at ``rho = crossover``:
    ``kappa = c * (C - 1) / (rho * (b + c + rho * c * (C - 1)))``; ``on="attention"``:
    ``kappa = (C - 1) / (rho * (1 + rho * (C - 1)))``.
    """
    if not 0.0 < crossover < 1.0:
        raise ValueError("crossover must lie strictly between 0 and 1")
    b1, slope = _crossover_terms(coefficients, decode_context_tokens, on)
    return slope / (crossover * (b1 + crossover * slope))
