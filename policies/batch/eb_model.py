"""The math of exclusive batching: EB(theta*) and the EB+ crossover (POLICIES.md 1.5 and 1.6, seed 002).

Pure functions and a cost model that the ``eb`` and ``eb+`` batch policies build on. Nothing here reads a
clock or does I/O; only the standard library and numpy.

**Workload** (the window of finished requests, the survival curve ``S[t] = P(output > t)`` of output lengths
and the fluid model's phase arithmetic on it) is in :mod:`policies.batch.eb_survival`; **memory** (the
memory-safe batch size, the KV reserve) in :mod:`policies.batch.eb_memory`; the online cost estimator in
:mod:`policies.batch.eb_costs`.

**Costs.** :class:`PhaseCosts` holds one cost model per step kind, all times in seconds:

- decode-only step with ``n`` decodes: ``T = alpha_d + beta_d * n``;
- prefill-only step with ``n`` prefill tokens: ``T = alpha_p + beta_p * n``;
- mixed step with ``new`` tokens of which a share ``rho`` are decodes:
  ``T = alpha_m + new * beta_mix(rho)`` with ``beta_mix(rho) = q0 + q1 * rho + q2 * rho^2``.

:class:`policies.batch.eb_costs.PhaseCostEstimator` starts these from the linear step model
``T = a + b * new + c * ctx`` and refines them online by least squares over a sliding window of recent
steps of each kind.

**Threshold.** With ``N`` slots, a decode phase runs until ``theta * N`` slots are free and one prefill phase
refills them. In the fluid model every request of a decode phase is still running at iteration ``t`` with
probability ``S(t)``, so the phase ends at ``t* = S^-1(1 - theta)``
(:func:`policies.batch.eb_survival.phase_end_iteration`), decodes ``N * integral_0^t* S`` tokens
(:func:`policies.batch.eb_survival.survival_integral`), and the cycle's throughput is :func:`eb_throughput`.
:func:`optimal_theta` maximizes it exactly on the empirical curve; :func:`closed_form_theta` is the
constant-hazard (geometric) root it must agree with.

**EB+.** :func:`mixing_advantage_per_token` is ``R(N)``, the fixed-cost advantage of mixed batching per token;
:func:`crossover` compares it with the marginal-cost gap ``beta_mix(rho) - beta_bar(rho)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from policies.batch.eb_survival import FloatArray, check_survival, cumulative_survival, phase_ends, tail_hazard
from policies.cost.step_model import StepCoefficients
from policies.frozen import picklable

__all__ = [
    "Crossover",
    "PhaseCosts",
    "cfr_ratio",
    "closed_form_theta",
    "crossover",
    "eb_throughput",
    "mixing_advantage_per_token",
    "optimal_theta",
]


# ---- phase costs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PhaseCosts:
    """Step costs per step kind (POLICIES.md 1.5, 1.6). Times in seconds, ``beta`` in seconds per token.

    All ``alpha`` and ``beta`` are finite and >= 0 (checked). The mixed-step quadratic may have negative
    coefficients (concave interference curves are the common case); :meth:`beta_mix` clamps at 0.
    """

    alpha_d: float
    """Fixed cost of a decode-only step (s)."""
    beta_d: float
    """Cost per decode token (= per running request) of a decode-only step (s/token)."""
    alpha_p: float
    """Fixed cost of a prefill-only step (s); the ``alpha_p`` of a prefill phase in ``P(theta)``."""
    beta_p: float
    """Cost per prefill token of a prefill-only step (s/token)."""
    alpha_m: float
    """Fixed cost of a mixed step (s)."""
    mix_q0: float
    """``beta_mix(0)``: constant term of the mixed per-token cost (s/token)."""
    mix_q1: float
    """Linear coefficient of ``beta_mix`` in the decode share ``rho`` (s/token)."""
    mix_q2: float
    """Quadratic coefficient of ``beta_mix`` in ``rho`` (s/token); < 0 is the concave interference curve."""

    def __post_init__(self) -> None:
        values = (self.alpha_d, self.beta_d, self.alpha_p, self.beta_p, self.alpha_m)
        if not all(math.isfinite(v) and v >= 0.0 for v in values):
            raise ValueError(f"alpha and beta costs must be finite and >= 0, got {self}")
        if not all(math.isfinite(v) for v in (self.mix_q0, self.mix_q1, self.mix_q2)):
            raise ValueError(f"beta_mix coefficients must be finite, got {self}")

    @classmethod
    def from_step_model(
        cls, coefs: StepCoefficients, decode_context_per_token: float, prefill_context_per_token: float = 1.0
    ) -> PhaseCosts:
        """Phase costs implied by the linear step model ``T = a + b * new + c * ctx``.

        A decode-only step with ``n`` decodes of mean context ``L`` has ``ctx = n * L``, so
        ``T = a + (b + c * L) * n``: ``alpha_d = a``, ``beta_d = b + c * decode_context_per_token``.
        A prefill-only step has ``ctx = r * new`` with ``r = prefill_context_per_token`` (1 when each prompt
        fits in one chunk, since ``ctx`` counts the context *after* the step; more for later chunks of long
        prompts): ``alpha_p = a``, ``beta_p = b + c * r``. A mixed step adds both:
        ``T = a + new * ((1 - rho) * beta_p + rho * beta_d)``, i.e. the linear model has no interference and
        ``beta_mix = beta_bar``: ``alpha_m = a``, ``q0 = beta_p``, ``q1 = beta_d - beta_p``, ``q2 = 0``.
        Negative coefficients (an unconstrained online fit can produce them) are clamped at 0.
        """
        a = max(coefs.a_s, 0.0)
        beta_d = max(coefs.b_s + coefs.c_s * decode_context_per_token, 0.0)
        beta_p = max(coefs.b_s + coefs.c_s * prefill_context_per_token, 0.0)
        return cls(a, beta_d, a, beta_p, a, beta_p, beta_d - beta_p, 0.0)

    def beta_mix(self, rho: float) -> float:
        """Per-token cost of a mixed step at decode share ``rho``: ``max(0, q0 + q1 rho + q2 rho^2)``."""
        return max(self.mix_q0 + rho * (self.mix_q1 + rho * self.mix_q2), 0.0)

    def beta_bar(self, rho: float) -> float:
        """Workload-weighted exclusive per-token cost ``(1 - rho) * beta_p + rho * beta_d``."""
        return (1.0 - rho) * self.beta_p + rho * self.beta_d


def cfr_ratio(costs: PhaseCosts, mean_output: float) -> float:
    """``alpha_p / (alpha_d * mu_out)``, the one number the constant-hazard threshold depends on.

    ``+inf`` when ``alpha_d * mu_out`` is 0 (and ``alpha_p`` > 0), 0 when ``alpha_p`` is 0.
    """
    denom = costs.alpha_d * mean_output
    if costs.alpha_p == 0.0:
        return 0.0
    return costs.alpha_p / denom if denom > 0.0 else math.inf


# ---- throughput and the optimal threshold ----------------------------------------------------------------


def eb_throughput(
    theta: float, survival: FloatArray, costs: PhaseCosts, n_slots: int, mean_prompt: float
) -> float:
    """Requests per second of EB(theta) with ``N = n_slots`` slots, in the fluid model (POLICIES.md 1.5).

    One cycle = one decode phase + one prefill phase, and completes ``theta * N`` requests:

        D(theta) = alpha_d * t* + beta_d * N * integral_0^t* S(t) dt     (t* iterations; N S(t) decodes each)
        P(theta) = alpha_p + beta_p * theta * N * mu_in                  (refill theta N prompts)
        throughput(theta) = theta * N / (D(theta) + P(theta))

    with ``t*`` from :func:`phase_end_iteration` and the integral from :func:`survival_integral`. The
    prefill phase is one step as in the paper; chunking it into ``m`` steps adds ``(m - 1) * alpha_p``,
    roughly ``alpha_p / budget`` per prefill token, which is linear in ``theta`` and so (like every term
    linear in ``theta``) does not move the optimum.
    """
    if not 0.0 < theta <= 1.0:
        raise ValueError(f"theta must be in (0, 1], got {theta}")
    s = check_survival(survival)
    t_star, integral = phase_ends(np.array([theta]), s, cumulative_survival(s), tail_hazard(s))
    n = float(n_slots)
    cycle = (costs.alpha_d * t_star[0] + costs.beta_d * n * integral[0]
             + costs.alpha_p + costs.beta_p * theta * n * mean_prompt)
    if not cycle > 0.0:
        return math.inf
    return float(theta * n / cycle)


def closed_form_theta(ratio: float) -> float:
    """The constant-hazard optimal threshold: the root in (0, 1) of ``theta/(1-theta) + ln(1-theta) = ratio``.

    ``ratio = alpha_p / (alpha_d * mu_out)`` (:func:`cfr_ratio`).

    **Derivation.** Geometric (constant hazard ``1/mu``) output lengths have ``S(t) = exp(-t/mu)``, so
    ``t* = -mu ln(1 - theta)`` and ``integral_0^t* S = mu (1 - exp(-t*/mu)) = mu theta``. The cycle time is
    ``alpha_p + g(theta) + theta N (beta_d mu + beta_p mu_in)`` with ``g(theta) = -alpha_d mu ln(1 - theta)``,
    hence

        1 / throughput = (alpha_p + g(theta)) / (theta N) + (beta_d mu + beta_p mu_in) / N.

    The second term does not depend on ``theta``: the optimum is the minimum of ``(alpha_p + g) / theta``,
    independent of ``N``, ``mu_in`` and both betas. Setting the derivative to zero,
    ``theta g'(theta) = alpha_p + g(theta)`` with ``g' = alpha_d mu / (1 - theta)``, and dividing by
    ``alpha_d mu``:

        theta / (1 - theta) + ln(1 - theta) = alpha_p / (alpha_d mu) = ratio.

    The left side ``f(theta) = sum_{k>=2} (k-1)/k theta^k`` is 0 at 0, convex and increasing
    (``f' = theta / (1 - theta)^2``) to infinity at 1, so the root is unique and grows with ``ratio``: it
    falls as ``mu_out`` grows. Asymptotics: ``theta ~ sqrt(2 ratio)`` for small ratios, ``1 - theta ~
    1 / (ratio + 1 + ln ratio)`` for large ones.

    **Numerics.** For ``ratio < 0.3`` (root below ~0.55), Newton on ``f`` from ``sqrt(2 ratio)`` (>= the
    root, since ``f >= theta^2 / 2``), with ``f`` from its series below 0.02 to avoid the cancellation of
    ``theta/(1-theta)`` against ``ln(1-theta)``; convexity makes the iterates decrease monotonically to the
    root. Otherwise Newton on ``u = 1 - theta``, ``g(u) = 1/u - 1 + ln u - ratio`` (decreasing, convex), from
    ``u = 1 / (2 ratio + 3)`` (below the root because ``ln x <= x / 2``), increasing monotonically; this keeps
    full relative precision in ``1 - theta`` up to huge ratios. Relative error ~1e-14 or better; it rounds
    to 1.0 once ``1 - theta`` < 1.1e-16 (ratio > ~1e16). ``ratio = 0`` gives 0 and ``+inf`` gives 1.
    Raises ValueError for a negative or NaN ratio.
    """
    if not ratio >= 0.0:
        raise ValueError(f"ratio must be >= 0, got {ratio}")
    if ratio == 0.0:
        return 0.0
    if math.isinf(ratio):
        return 1.0
    if ratio < 0.3:
        theta = math.sqrt(2.0 * ratio)
        for _ in range(100):
            step = (_cfr_lhs(theta) - ratio) * (1.0 - theta) ** 2 / theta
            if not step > 1e-16 * theta:  # monotone from above: a non-positive step is rounding noise
                break
            theta -= step
        return theta
    u = 1.0 / (2.0 * ratio + 3.0)
    for _ in range(100):
        step = ((1.0 / u - 1.0 + math.log(u)) - ratio) * u * u / (1.0 - u)  # -g / g', g' = -(1 - u) / u^2
        if not step > 1e-16 * u:
            break
        u += step
    return 1.0 - u


def _cfr_lhs(theta: float) -> float:
    """``theta / (1 - theta) + ln(1 - theta)``; below 0.02 by its series ``sum_{k>=2} (k-1)/k theta^k`` (12
    terms, truncation < 1e-17 relative), which avoids the cancellation of the two terms."""
    if theta >= 0.02:
        return theta / (1.0 - theta) + math.log1p(-theta)
    acc = 0.0
    for k in range(13, 1, -1):
        acc = theta * (acc + (k - 1) / k)
    return acc * theta


def optimal_theta(
    survival: FloatArray,
    costs: PhaseCosts,
    n_slots: int,
    mean_prompt: float,
    lo: float = 0.05,
    hi: float = 0.95,
) -> float:
    """The threshold in ``[lo, hi]`` that maximizes :func:`eb_throughput` on an (empirical) survival curve.

    **Exact, no iterative search.** Between two consecutive knots ``theta_k = 1 - S[k]`` and
    ``theta_{k+1}``, write ``theta = theta_k + s (S[k] - S[k+1])`` with ``s`` in [0, 1]; then
    ``t* = k + s`` and ``integral = sum_{j<k} S[j] + s S[k]`` are linear in ``s`` too, so the cycle time is
    linear in ``s`` and ``throughput = theta N / cycle`` is a ratio of two linear functions of ``s``: monotone
    on the segment. The maximum over ``[lo, hi]`` is therefore attained at ``lo``, at ``hi`` or at a knot
    inside, and evaluating all of them (one vectorized pass, O(T log T) for a curve of ``T`` points) finds it
    exactly, where a grid plus golden-section search could stop in a local maximum of the piecewise curve.
    Beyond the cut (``theta > 1 - S[T]``, only when ``hi`` exceeds the cut quantile) the curve is the
    exponential tail of :func:`phase_end_iteration`: there the cycle time is ``A + B theta - (alpha_d / h)
    ln(1 - theta)`` and, exactly as in :func:`closed_form_theta`'s derivation, the one stationary point
    solves ``theta/(1-theta) + ln(1-theta) = A h / alpha_d``; it is added (clipped) as a candidate,
    with ``A = alpha_p + alpha_d (T + ln S[T] / h) + beta_d N (sum_{j<T} S[j] - (1 - S[T]) / h)``, the
    terms of the cycle time that do not grow with ``theta``. Ties go to the smallest
    ``theta`` (shorter prefill waits). If every cost is zero all thresholds tie and ``hi`` is returned.

    Properties (tested): on geometric lengths it matches :func:`closed_form_theta` and does not move with
    ``N``, ``mu_in`` or the betas; on increasing-hazard lengths it is never below the constant-hazard root
    of the same mean. Only terms linear in ``theta`` drop out for every curve: ``mu_in`` and ``beta_p``
    never matter, while ``N`` and ``beta_d`` matter unless the hazard is constant (``integral / theta`` is
    then the constant ``mu_out``; for increasing hazards it decreases with ``theta`` and a larger
    ``beta_d N`` pushes ``theta*`` up, the paper's IFR correction).
    """
    if not 0.0 < lo <= hi <= 1.0:
        raise ValueError(f"need 0 < lo <= hi <= 1, got lo={lo} hi={hi}")
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    s = check_survival(survival)
    if costs.alpha_d == costs.beta_d == costs.alpha_p == costs.beta_p == 0.0:
        return hi
    last = len(s) - 1
    cum, tail_h, n = cumulative_survival(s), tail_hazard(s), float(n_slots)
    # Knots, evaluated exactly (t* = k, integral = cum[k]) rather than through 1 - (1 - S[k]), whose rounding
    # could land on the wrong side of a plateau: the first index of each distinct value of S.
    first = np.concatenate(([s[0] < 1.0], s[1:] < s[:-1]))
    knot_theta = 1.0 - s
    keep = first & (knot_theta > lo) & (knot_theta < hi)
    knot_k = np.flatnonzero(keep)
    cands = [np.array([lo, hi])]
    cut_theta = 1.0 - float(s[last])
    if hi > cut_theta:
        cands.append(np.array([max(cut_theta, lo)]))
        # Beyond the cut the cycle time is A + B theta - (alpha_d / h) ln(1 - theta) (exponential tail), and
        # d/dtheta [theta / cycle] = 0 is the constant-hazard equation with ratio A h / alpha_d.
        fixed = (costs.alpha_d * (last + math.log(float(s[last])) / tail_h) + costs.alpha_p
                 + costs.beta_d * n * (float(cum[last]) - cut_theta / tail_h))
        if costs.alpha_d > 0.0 and fixed > 0.0:
            root = closed_form_theta(fixed * tail_h / costs.alpha_d)
            cands.append(np.array([min(max(root, cut_theta, lo), hi)]))
    other = np.concatenate(cands)
    t_other, i_other = phase_ends(other, s, cum, tail_h)
    theta = np.concatenate((knot_theta[knot_k], other))
    t_star = np.concatenate((knot_k.astype(np.float64), t_other))
    integral = np.concatenate((cum[knot_k], i_other))
    cycle = (costs.alpha_d * t_star + costs.beta_d * n * integral
             + costs.alpha_p + costs.beta_p * n * mean_prompt * theta)
    with np.errstate(divide="ignore", invalid="ignore"):
        thr = np.where(cycle > 0.0, theta * n / cycle, np.inf)
    order = np.argsort(theta, kind="stable")  # argmax then keeps the smallest theta of ties
    return float(theta[order][int(np.argmax(thr[order]))])


# ---- EB+ crossover ---------------------------------------------------------------------------------------


def mixing_advantage_per_token(
    costs: PhaseCosts, theta: float, t_star: float, n_eff: float, mean_prompt: float, mean_output: float
) -> float:
    """``R(N)``: the fixed-cost advantage of mixed batching, per token (s/token), POLICIES.md 1.6.

        R(N) = [ (alpha_d t* + alpha_p) / theta - alpha_m mu_out ] / (N (mu_in + mu_out))

    **Derivation.** Compare the time each scheme spends per request. Under EB one cycle costs
    ``alpha_d t* + alpha_p`` in fixed costs and completes ``theta N`` requests: ``(alpha_d t* + alpha_p) /
    (theta N)`` per request. Its per-token work is ``beta_p mu_in + beta_d mu_out = beta_bar(rho) (mu_in +
    mu_out)`` with ``rho = mu_out / (mu_in + mu_out)`` the decode share of tokens (in steady state each
    completed request has decoded ``mu_out`` tokens, whatever the hazard). Under mixed batching each
    iteration costs ``alpha_m``, shared by the ``N`` requests in the batch; a request lives about ``mu_out``
    iterations, so ``alpha_m mu_out / N`` per request, plus ``beta_mix(rho) (mu_in + mu_out)`` of per-token
    work. EB is faster per request iff

        (alpha_d t* + alpha_p) / (theta N) + beta_bar (mu_in + mu_out) < alpha_m mu_out / N + beta_mix (mu_in + mu_out)

    i.e. iff ``beta_mix(rho) - beta_bar(rho) > R(N)``: the fixed-cost difference per request divided by the
    tokens per request. ``R`` falls like ``1/N`` and may be negative (mixing then has no fixed-cost edge).
    Returns ``+inf`` when ``n_eff <= 0`` or ``mu_in + mu_out <= 0`` (no load: mixing).
    """
    if not 0.0 < theta <= 1.0:
        raise ValueError(f"theta must be in (0, 1], got {theta}")
    tokens = mean_prompt + mean_output
    if not (n_eff > 0.0 and tokens > 0.0):
        return math.inf
    fixed_gap = (costs.alpha_d * t_star + costs.alpha_p) / theta - costs.alpha_m * mean_output
    return fixed_gap / (n_eff * tokens)


class Crossover(NamedTuple):
    """The EB+ decision for one step: ``exclusive`` iff ``lhs > rhs`` (POLICIES.md 1.6)."""

    exclusive: bool
    """Run an exclusive step (True) or a mixed one (False)."""
    lhs: float
    """Marginal-cost gap ``beta_mix(rho) - beta_bar(rho)`` (s/token)."""
    rhs: float
    """``R(N_eff) + margin`` (s/token)."""


def crossover(rho: float, costs: PhaseCosts, r_adv: float, margin: float) -> Crossover:
    """EB+'s rule: exclusive when ``beta_mix(rho) - beta_bar(rho) > R + margin``.

    ``rho``: decode share of tokens (an EMA), ``r_adv``: :func:`mixing_advantage_per_token`, ``margin``: the
    operator's priority margin in s/token (< 0 favours mixed = lower TTFT, > 0 favours exclusive).
    """
    lhs = costs.beta_mix(rho) - costs.beta_bar(rho)
    rhs = r_adv + margin
    return Crossover(lhs > rhs, lhs, rhs)


picklable(PhaseCosts)  # compiled with mypyc (setup.py): see picklable
