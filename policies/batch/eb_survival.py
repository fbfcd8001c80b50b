"""Output lengths for EB(theta*) (POLICIES.md 1.5, seed 002): the window of finished requests and its survival curve.

A small online estimator and the pure functions on its curve that :mod:`policies.batch.eb_model` (costs, the
optimal threshold) and :mod:`policies.batch.eb_memory` (the memory-safe batch size) build on. Nothing here
reads a clock or does I/O; only the standard library and numpy.

**Workload.** :class:`LengthWindow` keeps the (prompt, output) lengths of the last finished requests and
gives their means and the empirical survival curve of output lengths, ``S[t] = P(output > t)``;
:func:`linear_hazard_survival` is the smoothed (linear-hazard) alternative.

**Phases.** With ``N`` slots, a decode phase runs until ``theta * N`` slots are free and one prefill phase
refills them. In the fluid model every request of a decode phase is still running at iteration ``t`` with
probability ``S(t)``, so the phase ends at ``t* = S^-1(1 - theta)`` (:func:`phase_end_iteration`) and
decodes ``N * integral_0^t* S`` tokens (:func:`survival_integral`). :func:`check_survival`,
:func:`cumulative_survival`, :func:`tail_hazard` and :func:`phase_ends` are the vectorized pieces of both,
shared with the throughput and threshold functions of :mod:`policies.batch.eb_model`.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

from policies.types import StepFeedback

__all__ = [
    "FloatArray",
    "IntArray",
    "LengthWindow",
    "SurvivalModel",
    "check_survival",
    "cumulative_survival",
    "linear_hazard_survival",
    "phase_end_iteration",
    "phase_ends",
    "survival_integral",
    "tail_hazard",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
SurvivalModel = Literal["empirical", "linear_hazard"]
"""How :meth:`LengthWindow.survival` builds its curve."""


# ---- workload window -------------------------------------------------------------------------------------


class LengthWindow:
    """Sliding window of the (prompt, output) token lengths of the most recent finished requests.

    A ring of ``maxlen`` pairs: :meth:`add` costs well under a microsecond and overwrites the oldest pair once
    the window is full. Means are kept as exact integer sums.
    """

    __slots__ = ("_count", "_maxlen", "_outputs", "_pos", "_prompts", "_sum_output", "_sum_prompt")

    def __init__(self, maxlen: int = 2000) -> None:
        """Keep at most ``maxlen`` (> 0) requests."""
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._maxlen = int(maxlen)
        self._prompts: IntArray = np.zeros(self._maxlen, dtype=np.int64)
        self._outputs: IntArray = np.zeros(self._maxlen, dtype=np.int64)
        self.clear()

    def clear(self) -> None:
        """Forget every request."""
        self._pos = 0
        self._count = 0
        self._sum_prompt = 0
        self._sum_output = 0

    def add(self, prompt_tokens: int, output_tokens: int) -> None:
        """Record one finished request (token counts, >= 0)."""
        p, o = int(prompt_tokens), int(output_tokens)
        if p < 0 or o < 0:
            raise ValueError(f"token counts must be >= 0, got prompt={p} output={o}")
        i = self._pos
        if self._count == self._maxlen:
            self._sum_prompt -= int(self._prompts[i])
            self._sum_output -= int(self._outputs[i])
        else:
            self._count += 1
        self._prompts[i] = p
        self._outputs[i] = o
        self._sum_prompt += p
        self._sum_output += o
        self._pos = i + 1 if i + 1 < self._maxlen else 0

    def observe(self, feedback: StepFeedback) -> int:
        """Record the requests that finished in a step; return how many.

        ``finished_prompt_tokens`` and ``finished_output_tokens`` must pair up (same length): a ValueError
        otherwise, since a silent mismatch would skew both means.
        """
        outs, prompts = feedback.finished_output_tokens, feedback.finished_prompt_tokens
        if len(outs) != len(prompts):
            raise ValueError(
                f"finished_output_tokens ({len(outs)}) and finished_prompt_tokens ({len(prompts)}) must pair up"
            )
        for p, o in zip(prompts, outs, strict=True):
            self.add(p, o)
        return len(outs)

    def __len__(self) -> int:
        return self._count

    @property
    def maxlen(self) -> int:
        """Capacity of the window (requests)."""
        return self._maxlen

    @property
    def mean_prompt(self) -> float:
        """Mean prompt length ``mu_in`` (tokens); 0.0 when the window is empty."""
        return self._sum_prompt / self._count if self._count else 0.0

    @property
    def mean_output(self) -> float:
        """Mean output length ``mu_out`` (tokens); 0.0 when the window is empty."""
        return self._sum_output / self._count if self._count else 0.0

    def _chronological(self, ring: IntArray) -> IntArray:
        if self._count < self._maxlen:
            return ring[: self._count].copy()
        return np.concatenate((ring[self._pos :], ring[: self._pos]))

    def prompts(self) -> IntArray:
        """Prompt lengths in the window, oldest first (a copy)."""
        return self._chronological(self._prompts)

    def outputs(self) -> IntArray:
        """Output lengths in the window, oldest first (a copy), paired with :meth:`prompts`."""
        return self._chronological(self._outputs)

    def survival(self, cut_quantile: float = 0.95, model: SurvivalModel = "empirical") -> FloatArray:
        """Survival curve of output lengths, cut at the ``cut_quantile`` quantile.

        Returns ``S`` with ``S[t] = #{outputs > t} / n`` for ``t = 0 .. T`` (floats, non-increasing), where
        ``T`` is the empirical ``cut_quantile``-quantile of the outputs (the smallest observed length ``x``
        with ``#{outputs <= x} >= cut_quantile * n``; numpy's ``inverted_cdf``).

        **What cutting means.** The curve is *truncated*, not winsorized: every request, including the ones
        longer than ``T``, still counts in ``S[t]`` for ``t <= T``; the curve just stops at ``T``. By the
        choice of ``T``, ``S[T] <= 1 - cut_quantile``, so every ``theta <= cut_quantile`` (the default
        ``theta_max`` is 0.95, the default cut) ends its decode phase inside the measured part of the curve.
        The sparse tail beyond ``T`` is never read point by point; the functions that must go past ``T``
        (``theta > 1 - S[T]``) extend the curve with a constant hazard (:func:`phase_end_iteration`).
        Clipping the lengths at ``T`` instead (winsorizing) would put a fake completion spike of mass
        ``1 - cut_quantile`` at ``T`` that an optimizer could mistake for an increasing hazard.

        ``model="linear_hazard"`` replaces the empirical curve on ``[0, T]`` by the paper's estimator
        (seed 002, section 3.4): a linear hazard fitted to the empirical one by weighted least squares
        (:func:`linear_hazard_survival`). The empirical curve is the default, as POLICIES.md 1.5 asks, but
        read the caveat there: on a window of 2,000 requests its sampling noise moves the maximizer of
        the (flat) throughput curve by a standard deviation of 0.06-0.08 in ``theta`` on geometric lengths,
        against 0.002-0.006 for the linear-hazard curve (measured, 40 windows; see the tests).

        ``t`` counts decode iterations of the fluid model, which (like the paper) identifies a request's
        iterations with its output length ``L``; in vLLM the prefill samples the first token, so a fresh
        request decodes for ``L - 1`` iterations. The one-iteration shift is neglected (it matters only
        for outputs of a few tokens); :func:`policies.batch.eb_memory.cycle_peak_demand` models it exactly.

        The array is computed fresh (a quantile and a ``bincount`` over the window: ~25 us for 2,000
        requests, ~50 us with the linear-hazard fit). Raises ValueError on an empty window or a quantile
        outside (0, 1].
        """
        if not 0.0 < cut_quantile <= 1.0:
            raise ValueError(f"cut_quantile must be in (0, 1], got {cut_quantile}")
        if self._count == 0:
            raise ValueError("no finished requests in the window yet")
        outs = self._outputs[: self._count]
        cut = int(np.quantile(outs, cut_quantile, method="inverted_cdf"))
        counts = np.bincount(np.minimum(outs, cut + 1), minlength=cut + 2)
        finished_by = np.cumsum(counts[: cut + 1])  # finished_by[t] = #{outputs <= t}
        survival: FloatArray = 1.0 - finished_by / float(self._count)
        if model == "linear_hazard":
            return linear_hazard_survival(survival)
        if model != "empirical":
            raise ValueError(f"unknown survival model {model!r}")
        return survival


# ---- survival-curve calculus -----------------------------------------------------------------------------


def linear_hazard_survival(survival: FloatArray) -> FloatArray:
    """Smooth a survival curve by fitting a linear hazard ``h(t) = h0 + h1 t`` to it (seed 002, section 3.4).

    The empirical discrete hazard at iteration ``t`` is ``h_t = (S[t] - S[t+1]) / S[t]``: the fraction of the
    requests running in iteration ``t`` that finish in it. ``(h0, h1)`` minimize
    ``sum_t S[t] (h_t - h0 - h1 t)^2`` over ``t = 0 .. T-1``, weights proportional to the number at risk
    (the inverse variance of a binomial rate, up to the factor ``h (1 - h)``). The result is
    ``S'[0] = S[0]`` and ``S'[t+1] = S'[t] (1 - clip(h0 + h1 t, 0, 1))``: exactly geometric when ``h1 = 0``,
    so the constant-hazard theory applies unchanged, and non-increasing by construction. A curve shorter
    than 3 points is returned as is.
    """
    s = check_survival(survival)
    last = len(s) - 1
    if last < 2:
        return s.copy()
    w = s[:-1]
    deaths = s[:-1] - s[1:]  # w * h_t
    t = np.arange(last, dtype=np.float64)
    sw, swt, swtt = float(w.sum()), float(w @ t), float(w @ (t * t))
    sd, sdt = float(deaths.sum()), float(deaths @ t)
    det = sw * swtt - swt * swt
    if not (sw > 0.0 and det > 0.0):
        return s.copy()
    h1 = (sw * sdt - swt * sd) / det
    h0 = (sd - h1 * swt) / sw
    hazard = np.clip(h0 + h1 * t, 0.0, 1.0)
    smooth: FloatArray = np.concatenate(([s[0]], s[0] * np.cumprod(1.0 - hazard)))
    return smooth


def check_survival(survival: FloatArray) -> FloatArray:
    """``survival`` as a float array, checked: non-empty, 1-D, finite, within [0, 1] and non-increasing.

    Raises ValueError otherwise.
    """
    s = np.asarray(survival, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0:
        raise ValueError("survival must be a non-empty 1-D array")
    if not (bool(np.isfinite(s).all()) and s[0] <= 1.0 and s[-1] >= 0.0):
        raise ValueError("survival values must be finite and in [0, 1]")
    if len(s) > 1 and bool((np.diff(s) > 0.0).any()):
        raise ValueError("survival must be non-increasing")
    return s


def tail_hazard(s: FloatArray) -> float:
    """Hazard per iteration of the exponential tail that extends a survival curve beyond its last point.

    The mean hazard over the second half of the curve, ``ln(S[T/2] / S[T]) / (T - T/2)``; when that half is
    flat (no completions, possible only in tiny windows), ``1 / T`` (a mean residual life of ``T``).
    """
    last = len(s) - 1
    mid = last // 2
    if last > mid and s[last] > 0.0 and s[mid] > s[last]:
        return math.log(float(s[mid]) / float(s[last])) / (last - mid)
    return 1.0 / max(last, 1)


def phase_ends(theta: FloatArray, s: FloatArray, cum: FloatArray, tail_h: float) -> tuple[FloatArray, FloatArray]:
    """Vectorized ``(t*, integral_0^t* S)`` for an array of thresholds; see :func:`phase_end_iteration`."""
    last = len(s) - 1
    target = 1.0 - theta
    t_star = np.zeros_like(target)
    integral = np.zeros_like(target)
    # 1 - theta is off by up to ~2 ulp(1) when theta was computed as 1 - S[k]: compare with that slack, so a
    # knot never slips past a plateau of S (or off the end of the curve into the tail).
    eps = 4.5e-16
    inside = (target < s[0]) & (target >= s[last] - eps) & (last > 0)
    if inside.any():
        tg = target[inside]
        k = np.maximum(np.searchsorted(-s, -(tg + eps), side="left"), 1)  # first k with S[k] <= target
        s_prev, s_k = s[k - 1], s[k]
        denom = s_prev - s_k
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.clip(np.where(denom > 0.0, (s_prev - tg) / denom, 0.0), 0.0, 1.0)
        t_star[inside] = (k - 1) + frac
        integral[inside] = cum[k - 1] + frac * s_prev
    beyond = (target < s[last] - eps) | ((target < s[0]) & (last == 0))
    if beyond.any():
        tg = target[beyond]
        with np.errstate(divide="ignore"):
            t_star[beyond] = last + np.log(s[last] / np.maximum(tg, 0.0)) / tail_h
        integral[beyond] = cum[last] + (s[last] - np.maximum(tg, 0.0)) / tail_h
    return t_star, integral


def cumulative_survival(s: FloatArray) -> FloatArray:
    """``cum[k] = sum_{j<k} S[j]`` for ``k = 0 .. T`` (the step-function integral up to ``k``)."""
    cum: FloatArray = np.concatenate(([0.0], np.cumsum(s[:-1])))
    return cum


def phase_end_iteration(theta: float, survival: FloatArray) -> float:
    """``t* = S^-1(1 - theta)``: decode iterations until a fraction ``theta`` of a full batch has finished.

    ``S[k]`` (``k`` integer) is the fraction still running after ``k`` iterations, so ``theta`` is reached
    between the last ``k`` with ``S[k] > 1 - theta`` and the next one; ``t*`` interpolates linearly between
    them, and is exactly ``k`` at the knots ``theta = 1 - S[k]`` (the thresholds a real, discrete phase can
    hit). ``t* = 0`` when ``1 - theta >= S[0]``.

    Beyond the cut (``1 - theta < S[T]``) the curve is extended by a constant hazard ``h`` (the mean hazard
    of its second half, see :func:`tail_hazard`): ``S(t) = S[T] exp(-h (t - T))``, so
    ``t* = T + ln(S[T] / (1 - theta)) / h``, and ``+inf`` at ``theta = 1``.
    """
    if not 0.0 <= theta <= 1.0:
        raise ValueError(f"theta must be in [0, 1], got {theta}")
    s = check_survival(survival)
    t_star, _ = phase_ends(np.array([theta]), s, cumulative_survival(s), tail_hazard(s))
    return float(t_star[0])


def survival_integral(t: float, survival: FloatArray) -> float:
    """``integral_0^t S(u) du``: expected iterations a request of a fresh batch runs within the first ``t``.

    ``S`` is read as the right-continuous step function ``S(u) = S[floor(u)]``, because a request that runs
    ``L`` iterations takes part in iterations ``0 .. L-1``: then ``integral_0^k S = sum_{j<k} S[j] =
    E[min(L, k)]`` exactly at integers, and ``N * integral_0^t* S`` is the number of decode tokens of a phase
    (the ``beta_d`` term of ``D(theta)``). Between integers it is linear; beyond the last point the
    exponential tail of :func:`phase_end_iteration` gives ``S[T] (1 - exp(-h (t - T))) / h``.

    (For geometric lengths, ``S[k] = (1 - p)^k``, this gives ``integral = theta / p = mu_out * theta`` at
    every ``t*`` of :func:`phase_end_iteration`, knots and between: the fluid identity of the paper holds
    exactly, not only in the limit.)
    """
    s = check_survival(survival)
    if not t > 0.0:
        return 0.0
    last = len(s) - 1
    cum = cumulative_survival(s)
    if t <= last:
        k = int(t)
        return float(cum[k] + (t - k) * s[k])
    h = tail_hazard(s)
    return float(cum[last] + s[last] * -math.expm1(-h * (t - last)) / h)
