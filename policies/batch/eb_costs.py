"""Online phase costs for EB and EB+: least squares over sliding windows of recent steps, one per step kind.

:class:`PhaseCostEstimator` starts from the linear step model ``T = a + b * new + c * ctx`` (through
:meth:`policies.batch.eb_model.PhaseCosts.from_step_model`) and refines decode-only, prefill-only and mixed
step costs from each step's :class:`policies.types.StepFeedback` (POLICIES.md 4: "EB's alpha/beta per phase
kind and beta_mix(rho): from the same step records, split by step kind").
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from policies.batch.eb_model import PhaseCosts
from policies.batch.eb_survival import FloatArray
from policies.cost.step_model import StepCoefficients
from policies.types import StepFeedback

__all__ = ["EstimatorStatus", "PhaseCostEstimator"]


_MAX_STEP_S = 3600.0
"""Steps reported longer than this (or non-positive, or NaN) are ignored as corrupt."""
_MAX_TOKENS = 1 << 40


class _Ring:
    """Fixed-size ring of step records of one kind: new tokens, decode tokens, context tokens, seconds."""

    __slots__ = ("count", "ctx", "decode", "new", "pos", "seconds", "since_fit", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.new: FloatArray = np.zeros(size)
        self.decode: FloatArray = np.zeros(size)
        self.ctx: FloatArray = np.zeros(size)
        self.seconds: FloatArray = np.zeros(size)
        self.pos = 0
        self.count = 0
        self.since_fit = 0

    def clear(self) -> None:
        self.pos = self.count = self.since_fit = 0


def _fit_line(x: FloatArray, y: FloatArray, min_points: int, min_distinct: int, min_spread: float,
              ) -> tuple[float, float] | None:
    """Least squares ``y = alpha + beta x`` with ``alpha, beta >= 0``, or None if ill-conditioned.

    Conditioning: at least ``min_points`` points, ``min_distinct`` distinct ``x`` and a range
    ``max x - min x >= min_spread * max x``. Unconstrained solution by centred sums; if it has a negative
    coefficient, the constrained optimum lies on a boundary (``beta = 0``, ``alpha = mean y``; or
    ``alpha = 0``, ``beta = sum xy / sum x^2``) and the one with the smaller residual is taken.
    """
    if len(x) < min_points:
        return None
    x_max, x_min = float(x.max()), float(x.min())
    if not (x_max > 0.0 and x_max - x_min >= min_spread * x_max) or len(np.unique(x)) < min_distinct:
        return None
    xm, ym = float(x.mean()), float(y.mean())
    dx = x - xm
    beta = float(dx @ (y - ym)) / float(dx @ dx)
    alpha = ym - beta * xm
    if alpha < 0.0 or beta < 0.0:
        b0 = float(x @ y) / float(x @ x)
        sse_const = float(((y - ym) ** 2).sum())
        sse_origin = float(((y - b0 * x) ** 2).sum())
        alpha, beta = (ym, 0.0) if sse_const <= sse_origin else (0.0, b0)
    if not (math.isfinite(alpha) and math.isfinite(beta) and alpha >= 0.0 and beta >= 0.0):
        return None
    return alpha, beta


def _quad_ok(q0: float, q1: float, q2: float, rho_lo: float, rho_hi: float) -> bool:
    """``q0 + q1 rho + q2 rho^2 >= 0`` on ``[rho_lo, rho_hi]`` (ends and interior vertex)."""
    pts = [rho_lo, rho_hi]
    if q2 > 0.0 and rho_lo < -q1 / (2.0 * q2) < rho_hi:
        pts.append(-q1 / (2.0 * q2))
    return all(q0 + r * (q1 + r * q2) >= 0.0 for r in pts)


class EstimatorStatus(NamedTuple):
    """Which fits of a :class:`PhaseCostEstimator` are live, and how many steps each window holds."""

    decode_fitted: bool
    prefill_fitted: bool
    mixed_fit: str
    """``"prior"``, ``"quadratic"`` (alpha_m and q fitted) or ``"quadratic_fixed_alpha"`` (q only)."""
    num_decode_steps: int
    num_prefill_steps: int
    num_mixed_steps: int


class PhaseCostEstimator:
    """Online :class:`PhaseCosts`: least squares over sliding windows of recent steps, one per step kind.

    **Prior.** :meth:`PhaseCosts.from_step_model` of the linear model ``prior``, evaluated at the *observed*
    context per new token of each kind (``sum ctx / sum new`` over its window; before any step,
    ``typical_decode_context`` for decodes and ``prefill_context_per_token`` for prefills). Each fit falls
    back to this prior on its own.

    **Fits.** Steps are classified by their token counts (``mode`` is not trusted): decode-only
    (no prefill tokens), prefill-only (no decode tokens) or mixed (both); empty steps and steps with a
    non-positive, non-finite or absurd (> 1 h) duration are ignored.

    - decode: ``T = alpha_d + beta_d * n_decode``; prefill: ``T = alpha_p + beta_p * n_prefill``. Ordinary
      least squares constrained to non-negative coefficients (``_fit_line``), live once the window has
      ``min_points`` steps with ``min_distinct`` distinct token counts spanning ``min_relative_spread`` of
      the largest; otherwise the prior.
    - mixed: ``T = alpha_m + new * (q0 + q1 rho + q2 rho^2)`` is linear in ``(alpha_m, q0, q1, q2)`` with
      regressors ``(1, new, new rho, new rho^2)`` = ``(1, new, n_decode, n_decode^2 / new)``. Needs
      ``min_points`` steps whose ``rho`` (rounded to 0.001) takes ``min_distinct`` values over a range of
      at least ``min_relative_spread``. The 4-parameter fit is used when ``new`` varies too (range
      ``>= min_relative_spread * max``), the scaled design is well conditioned (condition number < 1e6) and
      it gives ``alpha_m >= 0``; otherwise (e.g. every mixed step fills the same token budget, making
      ``alpha_m`` and ``q0`` inseparable) ``alpha_m`` is held at the prior ``a`` and the three ``q`` are fitted
      to ``T - alpha_m``. A fit whose ``beta_mix`` goes negative within the observed ``rho`` range is
      rejected. Without a mixed fit, ``beta_mix`` is the linear interpolation of the current exclusive
      betas (no interference: the crossover's left side is 0, so EB+ decides on ``R`` and the margin).

    **Cost.** :meth:`observe` writes four numbers into a ring (0.4 us). Fits are lazy: :meth:`costs`
    refits a kind once ``refit_every`` new steps of that kind have arrived (or on ``refresh=True``) and
    otherwise returns the cached :class:`PhaseCosts` (0.1 us); refitting all three kinds over full windows of
    512 steps takes ~50 us, so ``observe`` plus ``costs`` every step costs ~4 us amortized
    (``tests/benchmarks/bench_eb_model.py``).

    Every returned cost is finite and >= 0 by construction (fits failing that are rejected, the prior is
    clamped at 0).
    """

    __slots__ = (
        "_cached", "_decode", "_decode_fit", "_min_distinct", "_min_points", "_min_spread", "_mixed",
        "_mixed_fit", "_mixed_mode", "_prefill", "_prefill_ctx", "_prefill_fit", "_prior", "_refit_every",
        "_typical_decode_ctx",
    )

    def __init__(
        self,
        prior: StepCoefficients,
        *,
        typical_decode_context: float = 1024.0,
        prefill_context_per_token: float = 1.0,
        window: int = 512,
        min_points: int = 8,
        min_distinct: int = 3,
        min_relative_spread: float = 0.1,
        refit_every: int = 16,
    ) -> None:
        """``prior``: the unit's linear step model (seconds). ``typical_decode_context``: mean context of a
        decode (tokens) assumed before any decode step is seen; ``prefill_context_per_token``: context after
        a prefill step per prefill token, likewise. ``window``: steps kept per kind. ``min_points``,
        ``min_distinct``, ``min_relative_spread``: the conditioning a fit needs (class docstring).
        ``refit_every``: new steps of a kind between two refits (1 = refit whenever asked after new data).
        """
        if not all(math.isfinite(v) for v in (prior.a_s, prior.b_s, prior.c_s)):
            raise ValueError(f"prior coefficients must be finite, got {prior}")
        if not (typical_decode_context >= 0.0 and prefill_context_per_token >= 0.0):
            raise ValueError("context sizes must be >= 0")
        if window < 2 or min_points < 2 or min_distinct < 2 or refit_every < 1:
            raise ValueError("need window >= 2, min_points >= 2, min_distinct >= 2, refit_every >= 1")
        if not 0.0 <= min_relative_spread < 1.0:
            raise ValueError(f"min_relative_spread must be in [0, 1), got {min_relative_spread}")
        self._prior = prior
        self._typical_decode_ctx = float(typical_decode_context)
        self._prefill_ctx = float(prefill_context_per_token)
        self._min_points, self._min_distinct = int(min_points), int(min_distinct)
        self._min_spread = float(min_relative_spread)
        self._refit_every = int(refit_every)
        self._decode, self._prefill, self._mixed = _Ring(window), _Ring(window), _Ring(window)
        self.reset()

    def reset(self, prior: StepCoefficients | None = None) -> None:
        """Forget every step (and optionally replace the prior)."""
        if prior is not None:
            if not all(math.isfinite(v) for v in (prior.a_s, prior.b_s, prior.c_s)):
                raise ValueError(f"prior coefficients must be finite, got {prior}")
            self._prior = prior
        for ring in (self._decode, self._prefill, self._mixed):
            ring.clear()
        self._decode_fit: tuple[float, float] | None = None
        self._prefill_fit: tuple[float, float] | None = None
        self._mixed_fit: tuple[float, float, float, float] | None = None
        self._mixed_mode = "prior"
        self._cached: PhaseCosts | None = None

    def observe(self, feedback: StepFeedback) -> bool:
        """Fold in one step; return False if it was ignored (empty, or an invalid duration or count)."""
        n_p, n_d, t = feedback.num_prefill_tokens, feedback.num_decode_tokens, feedback.measured_s
        if not (0.0 < t <= _MAX_STEP_S) or not (0 <= n_p < _MAX_TOKENS and 0 <= n_d < _MAX_TOKENS):
            return False
        ctx = feedback.context_tokens
        if not 0 <= ctx < _MAX_TOKENS:
            ctx = 0
        if n_p == 0:
            if n_d == 0:
                return False
            ring = self._decode
        elif n_d == 0:
            ring = self._prefill
        else:
            ring = self._mixed
        i = ring.pos
        ring.new[i] = n_p + n_d
        ring.decode[i] = n_d
        ring.ctx[i] = ctx
        ring.seconds[i] = t
        ring.pos = i + 1 if i + 1 < ring.size else 0
        if ring.count < ring.size:
            ring.count += 1
        ring.since_fit += 1
        return True

    def prior_costs(self) -> PhaseCosts:
        """The linear model's phase costs at the context per token observed in the current windows."""
        return PhaseCosts.from_step_model(
            self._prior,
            self._context_per_token(self._decode, self._typical_decode_ctx),
            self._context_per_token(self._prefill, self._prefill_ctx),
        )

    @staticmethod
    def _context_per_token(ring: _Ring, default: float) -> float:
        if ring.count == 0:
            return default
        new = float(ring.new[: ring.count].sum())
        return float(ring.ctx[: ring.count].sum()) / new if new > 0.0 else default

    def costs(self, refresh: bool = False) -> PhaseCosts:
        """Current :class:`PhaseCosts` (cached; refits the kinds with ``refit_every`` new steps, or all
        kinds with new steps when ``refresh``)."""
        every = 1 if refresh else self._refit_every
        stale = False
        if self._decode.since_fit >= every:
            self._decode_fit = self._refit_line(self._decode)
            stale = True
        if self._prefill.since_fit >= every:
            self._prefill_fit = self._refit_line(self._prefill)
            stale = True
        if stale or self._mixed.since_fit >= every or self._cached is None:
            prior = self.prior_costs()
            alpha_d, beta_d = self._decode_fit or (prior.alpha_d, prior.beta_d)
            alpha_p, beta_p = self._prefill_fit or (prior.alpha_p, prior.beta_p)
            if self._mixed.since_fit >= every:
                self._refit_mixed(prior.alpha_m)
            if self._mixed_fit is not None:
                alpha_m, q0, q1, q2 = self._mixed_fit
            else:
                alpha_m, q0, q1, q2 = prior.alpha_m, beta_p, beta_d - beta_p, 0.0
            self._cached = PhaseCosts(alpha_d, beta_d, alpha_p, beta_p, alpha_m, q0, q1, q2)
        return self._cached

    def _refit_line(self, ring: _Ring) -> tuple[float, float] | None:
        ring.since_fit = 0
        n = ring.count
        return _fit_line(ring.new[:n], ring.seconds[:n], self._min_points, self._min_distinct, self._min_spread)

    def _refit_mixed(self, alpha_prior: float) -> None:
        ring = self._mixed
        ring.since_fit = 0
        self._mixed_fit, self._mixed_mode = None, "prior"
        n = ring.count
        if n < self._min_points:
            return
        new, dec, y = ring.new[:n], ring.decode[:n], ring.seconds[:n]
        rho = dec / new
        rho_lo, rho_hi = float(rho.min()), float(rho.max())
        if rho_hi - rho_lo < self._min_spread or len(np.unique(np.round(rho, 3))) < self._min_distinct:
            return
        cols = np.column_stack((new, dec, dec * rho))
        new_max = float(new.max())
        if new_max - float(new.min()) >= self._min_spread * new_max:
            sol = _lstsq(np.column_stack((np.ones(n), cols)), y)
            if sol is not None and sol[0] >= 0.0 and _quad_ok(sol[1], sol[2], sol[3], rho_lo, rho_hi):
                self._mixed_fit = (sol[0], sol[1], sol[2], sol[3])
                self._mixed_mode = "quadratic"
                return
        sol = _lstsq(cols, y - alpha_prior)
        if sol is not None and _quad_ok(sol[0], sol[1], sol[2], rho_lo, rho_hi):
            self._mixed_fit = (alpha_prior, sol[0], sol[1], sol[2])
            self._mixed_mode = "quadratic_fixed_alpha"

    @property
    def status(self) -> EstimatorStatus:
        """Which fits are live (as of the last :meth:`costs`) and the window sizes."""
        return EstimatorStatus(
            self._decode_fit is not None, self._prefill_fit is not None, self._mixed_mode,
            self._decode.count, self._prefill.count, self._mixed.count,
        )

    @property
    def prior(self) -> StepCoefficients:
        """The linear step model the estimator falls back to."""
        return self._prior


def _lstsq(design: FloatArray, y: FloatArray) -> list[float] | None:
    """Least squares on column-scaled ``design``; None if rank-deficient, ill-conditioned or non-finite."""
    scale = np.abs(design).max(axis=0)
    if not bool((scale > 0.0).all()):
        return None
    sol, _, rank, sv = np.linalg.lstsq(design / scale, y, rcond=None)
    if rank < design.shape[1] or not float(sv[-1]) * 1e6 > float(sv[0]):
        return None
    out = [float(v) for v in sol / scale]
    return out if all(math.isfinite(v) for v in out) else None
