"""Fitting the step-time model ``T = a + b * new_tokens + c * context_tokens`` (POLICIES.md section 4).

The engine-loop term ``d * num_requests`` of :class:`~policies.cost.step_model.StepCoefficients` is not
fitted here: it comes with the prior (a profile measures it from wall time against summed step times) and
:class:`OnlineStepModel` carries it unchanged (see there for why).

Two estimators share the model of :class:`~policies.cost.step_model.StepCoefficients`:

- :func:`fit_step_model`: ordinary least squares over a batch of step records (the calibration profiles are
  fitted this way, exactly like ``shared/gpu/probe.py`` did), with :func:`evaluate` for the error of any
  coefficients on any records.
- :class:`OnlineStepModel`: recursive least squares with exponential forgetting, started from a
  calibration profile, updated once per step by the agent and the simulator.

Units everywhere: tokens are counts, times are seconds; :class:`FitStats` holds dimensionless numbers.
This module is pure (stdlib + numpy, no I/O, no clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.cost.step_model import StepCoefficients
from policies.frozen import picklable

__all__ = ["FitStats", "OnlineStepModel", "evaluate", "fit_step_model"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class FitStats:
    """How well coefficients explain a set of step records."""

    n: int
    """Number of steps evaluated."""
    r2: float
    """Coefficient of determination ``1 - SS_res / SS_tot`` (NaN when all measured times are equal)."""
    mape: float
    """Mean absolute percentage error as a fraction: ``mean(|pred - t| / t)`` (0.061 = 6.1%)."""


def _columns(
    new_tokens: npt.ArrayLike, context_tokens: npt.ArrayLike, seconds: npt.ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Validate the three record columns and return them as 1-D float arrays of equal length."""
    cols = tuple(np.asarray(col, dtype=np.float64) for col in (new_tokens, context_tokens, seconds))
    new, ctx, t = cols
    if any(col.ndim != 1 for col in cols):
        raise ValueError("new_tokens, context_tokens and seconds must be 1-D sequences")
    if not len(new) == len(ctx) == len(t):
        raise ValueError(
            f"columns differ in length: new_tokens {len(new)}, context_tokens {len(ctx)}, seconds {len(t)}"
        )
    if not all(bool(np.isfinite(col).all()) for col in cols):
        raise ValueError("records contain NaN or infinite values")
    if len(t) and float(t.min()) <= 0.0:
        raise ValueError("measured step times must be positive (seconds)")
    return new, ctx, t


def evaluate(
    coefs: StepCoefficients,
    new_tokens: npt.ArrayLike,
    context_tokens: npt.ArrayLike,
    seconds: npt.ArrayLike,
) -> FitStats:
    """Error of ``coefs`` on step records: ``R^2 = 1 - SS_res / SS_tot`` and ``MAPE = mean |pred - t| / t``.

    ``new_tokens`` and ``context_tokens`` are token counts per step, ``seconds`` the measured step times
    (positive). Raises ValueError on empty or mismatched columns.
    """
    new, ctx, t = _columns(new_tokens, context_tokens, seconds)
    if len(t) == 0:
        raise ValueError("no records to evaluate")
    pred = coefs.a_s + coefs.b_s * new + coefs.c_s * ctx
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0.0 else math.nan
    mape = float(np.mean(np.abs(pred - t) / t))
    return FitStats(n=len(t), r2=r2, mape=mape)


def fit_step_model(
    new_tokens: npt.ArrayLike, context_tokens: npt.ArrayLike, seconds: npt.ArrayLike
) -> tuple[StepCoefficients, FitStats]:
    """Ordinary least squares of ``t = a + b * new + c * ctx`` over step records.

    Minimises ``sum_i (t_i - a - b * new_i - c * ctx_i)^2`` (absolute, not relative, errors: the same
    objective as ``probe.py``, so the shipped profiles reproduce the calibration README). The columns are
    scaled to unit maximum before the SVD solve so that tokens (~1e3-1e5) and seconds (~1e-2) do not
    degrade the conditioning. Returns the coefficients (seconds, seconds per token, seconds per context
    token) and their :class:`FitStats` on the same records.

    Raises ValueError on fewer than 3 rows, columns of different lengths, non-finite values,
    non-positive times, or a design matrix of rank < 3 (e.g. every step with the same ``new``).
    """
    new, ctx, t = _columns(new_tokens, context_tokens, seconds)
    if len(t) < 3:
        raise ValueError(f"need at least 3 steps to fit 3 coefficients, got {len(t)}")
    design = np.column_stack((np.ones_like(new), new, ctx))
    scale = np.abs(design).max(axis=0)
    scale[scale == 0.0] = 1.0
    solution, _, rank, _ = np.linalg.lstsq(design / scale, t, rcond=None)
    if rank < 3:
        raise ValueError(
            "rank-deficient records: a, b and c cannot be separated (vary new and context tokens)"
        )
    a, b, c = (float(v) for v in solution / scale)
    coefs = StepCoefficients(a_s=a, b_s=b, c_s=c)
    return coefs, evaluate(coefs, new, ctx, t)


class OnlineStepModel:
    """Recursive least squares (RLS) with forgetting for ``T = a + b * new + c * ctx``, one step at a time.

    **Scaling.** Internally the model works in scaled units so that all quantities are O(1):
    ``x = (1, new / N, ctx / C)``, ``y = T / S`` with ``N = token_scale`` (1e3 tokens), ``C =
    context_scale`` (1e5 tokens), ``S = time_scale_s`` (1e-2 s), and parameters ``theta = (a / S,
    b * N / S, c * C / S)``; for the H100 8B profile ``theta ~ (0.91, 2.4, 0.44)``. Without it the
    information matrix would mix entries of order 1 and 1e10 and the Sherman-Morrison update below would
    lose most of its digits.

    **Objective.** After k steps the estimate minimises the exponentially weighted cost

        J_k(theta) = sum_{i<=k} lam^(k-i) (y_i - x_i' theta)^2 + lam^k (theta - theta_0)' P_0^-1 (theta - theta_0)

    with ``lam = forgetting`` in (0, 1] (memory of about ``1 / (1 - lam)`` steps: 1,000 for 0.999) and the
    prior ``theta_0`` from a calibration profile, worth ``P_0^-1 = prior_strength * I``: ``prior_strength``
    pseudo-steps of unit scaled features. The prior fades at the same rate as old data, so a few noisy
    steps barely move a good calibration, while a persistent change takes over on the scale of
    ``1 / (1 - lam)`` steps (synthetic 8B-like steps, ``a`` jumping from 9 to 20 ms: 19.2 ms after 1,000
    steps from a fresh prior; 16.2 ms after 1,000 and 19.5 ms after 3,000 following 6,000 steady steps).

    **Update (re-derived).** Setting the gradient to zero gives ``R_k theta_k = r_k`` with
    ``R_k = lam R_{k-1} + x x'`` (``R_0 = P_0^-1``) and ``r_k = lam r_{k-1} + x y`` (``r_0 = R_0 theta_0``).
    Let ``P_k = R_k^-1``. By Sherman-Morrison on ``R_k = lam (R_{k-1} + x x' / lam)``:

        P_k = (P_{k-1} - P_{k-1} x x' P_{k-1} / (lam + x' P_{k-1} x)) / lam

    Define the gain ``g = P_{k-1} x / (lam + x' P_{k-1} x)``; one checks ``P_k x = g``. Then
    ``theta_k = P_k r_k = P_k (lam R_{k-1} theta_{k-1} + x y) = P_k (R_k theta_{k-1} - x x' theta_{k-1}
    + x y) = theta_{k-1} + g (y - x' theta_{k-1})``. So each step costs one 3x3 matrix-vector product:

        e = y - x' theta;   g = P x / (lam + x' P x);   theta += g e;   P = (P - g (P x)') / lam

    **Safeguards.** (1) Bounded covariance: when the steps do not excite every direction (long runs of
    identical decode steps) dividing by ``lam`` makes ``P`` grow without bound ("wind-up") and a single
    unusual step would then swing the estimate; the division is skipped whenever it would raise
    ``trace(P)`` above ``trace(P_0)``, i.e. the model never becomes less certain than its prior (that
    step is then still an exact least-squares step, ``R_k = R_{k-1} + x x' / lam``, without forgetting).
    (2) Huber-style clipping: the innovation ``e`` is clipped to ``+-max_relative_innovation * pred`` (1.0
    by default), so a stop-the-world pause of 10x the predicted time counts as a step of 2x; a real
    change of the hardware's speed still moves the estimate every step in the right direction, only
    more slowly when it is larger than 100%. ``None`` disables it (exact RLS). (3) ``P`` is stored as its
    six upper-triangle entries, so it stays exactly symmetric.

    **Cost.** Plain Python floats, the 3x3 algebra unrolled: 1.0 us per :meth:`update` (1.1 us when fed
    numpy scalars) and 0.13 us per :meth:`predict_s`, measured on CPython 3.11.7 on a 2-core Xeon by
    replaying the 3,913 records of the 8B profile 25 times; a step lasts 4-200 ms.

    **The engine-loop term.** ``d`` (seconds per scheduled request, ``StepCoefficients.d_s``) is taken from
    the prior and never refitted. The step records cannot carry it: on a vLLM engine the measured window
    (``schedule()`` to ``update_from_output()``) leaves the loop's output processing out, and where a
    measurement does include it (the simulator's step durations) a pure-decode step has ``num_requests ==
    new_tokens``, so ``d`` and ``b`` are the same direction and only the mix of prefill chunks would tell them
    apart: an online ``d`` would swing with the workload's mix. Pass ``num_requests`` to :meth:`update` when
    the measured time includes the loop term (``d * num_requests`` is then taken off before ``a, b, c`` are
    fitted, so they do not absorb it twice); leave it out when the measurement window excludes the loop.
    :meth:`predict_s` adds ``d * num_requests`` when given the count.

    The coefficients are unconstrained: with bad data ``b`` or ``c`` can become negative, so callers
    that divide by them must guard.
    """

    __slots__ = (
        "_clip", "_d", "_inv_c", "_inv_n", "_inv_t", "_lam", "_num_updates", "_p00", "_p01", "_p02", "_p11",
        "_p12", "_p22", "_prior", "_prior_strength", "_s_c", "_s_n", "_s_t", "_th0", "_th1", "_th2",
        "_trace_max",
    )

    def __init__(
        self,
        prior: StepCoefficients,
        *,
        prior_strength: float = 50.0,
        forgetting: float = 0.999,
        max_relative_innovation: float | None = 1.0,
        time_scale_s: float = 1e-2,
        token_scale: float = 1e3,
        context_scale: float = 1e5,
    ) -> None:
        """Start from ``prior`` (a calibration profile's coefficients, seconds per unit).

        ``prior_strength``: pseudo-steps of evidence behind the prior (> 0). ``forgetting``: per-step
        weight decay in (0, 1]; 1 means ordinary (growing-window) least squares.
        ``max_relative_innovation``: clip of the prediction error as a fraction of the prediction (> 0)
        or None. ``time_scale_s`` (seconds), ``token_scale`` and ``context_scale`` (tokens): the internal
        units, see the class docstring.
        """
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if not (prior_strength > 0.0 and math.isfinite(prior_strength)):
            raise ValueError(f"prior_strength must be positive and finite, got {prior_strength}")
        if max_relative_innovation is not None and not max_relative_innovation > 0.0:
            raise ValueError(f"max_relative_innovation must be positive or None, got {max_relative_innovation}")
        for label, scale in (("time_scale_s", time_scale_s), ("token_scale", token_scale),
                             ("context_scale", context_scale)):
            if not (scale > 0.0 and math.isfinite(scale)):
                raise ValueError(f"{label} must be positive and finite, got {scale}")
        if not all(math.isfinite(v) for v in (prior.a_s, prior.b_s, prior.c_s, prior.d_s)):
            raise ValueError(f"prior coefficients must be finite, got {prior}")
        self._prior = prior
        self._prior_strength = float(prior_strength)
        self._lam = float(forgetting)
        self._clip = math.inf if max_relative_innovation is None else float(max_relative_innovation)
        self._s_t, self._s_n, self._s_c = float(time_scale_s), float(token_scale), float(context_scale)
        self._inv_t, self._inv_n, self._inv_c = 1.0 / self._s_t, 1.0 / self._s_n, 1.0 / self._s_c
        self._trace_max = 3.0 / self._prior_strength
        self.reset()

    def reset(self, prior: StepCoefficients | None = None) -> None:
        """Forget every update and start again from ``prior`` (default: the constructor's prior)."""
        if prior is not None:
            self._prior = prior
        p = self._prior
        self._d = p.d_s
        self._th0 = p.a_s * self._inv_t
        self._th1 = p.b_s * self._s_n * self._inv_t
        self._th2 = p.c_s * self._s_c * self._inv_t
        d = 1.0 / self._prior_strength
        self._p00, self._p01, self._p02, self._p11, self._p12, self._p22 = d, 0.0, 0.0, d, 0.0, d
        self._num_updates = 0

    def update(
        self, new_tokens: int, context_tokens: int, measured_s: float, num_requests: int | None = None
    ) -> float:
        """Fold in one measured step; return the relative error of the prediction made *before* it.

        ``new_tokens``: tokens computed in the step; ``context_tokens``: sum over the scheduled requests
        of computed-so-far plus new tokens; ``measured_s``: the step's duration in seconds (> 0);
        ``num_requests``: the requests scheduled in the step, given only when ``measured_s`` includes the
        engine-loop term ``d * num_requests`` (it is then taken off before fitting; None: the measurement
        leaves the loop out). Returns ``(predicted - measured) / measured`` (positive: the model was too
        slow), the prediction including ``d * num_requests`` when the count is given.
        """
        if not (measured_s > 0.0 and math.isfinite(measured_s)):
            raise ValueError(f"measured_s must be a positive finite number of seconds, got {measured_s}")
        if new_tokens < 0 or context_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got new={new_tokens} context={context_tokens}")
        x1 = float(new_tokens) * self._inv_n  # float(): keep numpy scalars out of the state
        x2 = float(context_tokens) * self._inv_c
        y = float(measured_s) * self._inv_t
        pred = self._th0 + self._th1 * x1 + self._th2 * x2
        if num_requests:
            if num_requests < 0:
                raise ValueError(f"num_requests must be >= 0, got {num_requests}")
            loop = self._d * float(num_requests) * self._inv_t
            rel_error = (pred + loop - y) / y
            y -= loop  # what a, b and c must explain (may be <= 0 for a wild d: the clip below bounds it)
        else:
            rel_error = (pred - y) / y
        p00, p01, p02, p11, p12, p22 = self._p00, self._p01, self._p02, self._p11, self._p12, self._p22
        v0 = p00 + p01 * x1 + p02 * x2  # v = P x, with x = (1, x1, x2)
        v1 = p01 + p11 * x1 + p12 * x2
        v2 = p02 + p12 * x1 + p22 * x2
        denom = self._lam + v0 + v1 * x1 + v2 * x2
        g0, g1, g2 = v0 / denom, v1 / denom, v2 / denom
        err = y - pred
        if pred > 0.0:
            limit = self._clip * pred
            err = limit if err > limit else (-limit if err < -limit else err)
        self._th0 += g0 * err
        self._th1 += g1 * err
        self._th2 += g2 * err
        p00 -= g0 * v0
        p01 -= g0 * v1
        p02 -= g0 * v2
        p11 -= g1 * v1
        p12 -= g1 * v2
        p22 -= g2 * v2
        lam = self._lam
        if lam < 1.0 and (p00 + p11 + p22) <= self._trace_max * lam:
            inv = 1.0 / lam
            p00, p01, p02, p11, p12, p22 = p00 * inv, p01 * inv, p02 * inv, p11 * inv, p12 * inv, p22 * inv
        if not (p00 > 0.0 and p11 > 0.0 and p22 > 0.0):  # lost positive definiteness: restart P only
            d = 1.0 / self._prior_strength
            p00, p01, p02, p11, p12, p22 = d, 0.0, 0.0, d, 0.0, d
        self._p00, self._p01, self._p02, self._p11, self._p12, self._p22 = p00, p01, p02, p11, p12, p22
        self._num_updates += 1
        return rel_error

    def predict_s(self, new_tokens: int, context_tokens: int, num_requests: int = 0) -> float:
        """Predicted step duration (seconds) under the current coefficients (``num_requests`` scheduled
        requests; 0 leaves the loop term out)."""
        return (self._th0 + self._th1 * new_tokens * self._inv_n
                + self._th2 * context_tokens * self._inv_c) * self._s_t + self._d * num_requests

    @property
    def coefficients(self) -> StepCoefficients:
        """Current estimate in unscaled units (seconds, seconds per token, seconds per context token), with
        the prior's engine-loop ``d`` (seconds per request)."""
        return StepCoefficients(
            a_s=self._th0 * self._s_t,
            b_s=self._th1 * self._s_t * self._inv_n,
            c_s=self._th2 * self._s_t * self._inv_c,
            d_s=self._d,
        )

    @property
    def prior(self) -> StepCoefficients:
        """The coefficients the model started from (or was last reset to)."""
        return self._prior

    @property
    def forgetting(self) -> float:
        """Per-step forgetting factor lam in (0, 1]."""
        return self._lam

    @property
    def num_updates(self) -> int:
        """Steps folded in since construction or the last :meth:`reset`."""
        return self._num_updates


picklable(FitStats)  # compiled with mypyc (setup.py): see picklable
