"""CascadeInfer's QoE model of one unit running one batch (seed 001 section 4.1; POLICIES.md 2.4).

**The model.** For a batch ``B`` of ``n`` requests on one unit, every request's normalized latency (seconds
per output token) is stretched to the same value (paper, section 4.1):

    Q_1 = D0 + D1 * n + D2 * sum_i I_i + D3 * sum_i I_i^2 + D4 * sum_i L_i
    Q_B = n * Q_1                                                           (paper's Equation 1)

with the paper's symbols: ``I_i`` is request i's *input* (prompt) length, whose prefill costs O(I^2), and
``L_i`` its *sequence* length (context: prompt plus outputs so far, ``L_i = I_i + o_i`` in POLICIES.md),
which one decoding iteration reads in O(L). The features are ``F = (1, n, sum I, sum I^2, sum L)``.
``Q_B`` is the batch's sum of normalized latencies: the quantity the stage partition
(:mod:`policies.dispatch.cascade_partition`) adds up over units and minimises.

The model is linear in ``sum L``: it has no term for the attention kernel's penalty on mixed lengths
(``shared/calibration``: 2-10% on an H100 with FA3). What it rewards is where requests wait: ``n * D4 *
sum L`` charges every request of a batch for the whole batch's context, so a few long requests on their
own unit cost less than the same requests spread over units full of short ones.

**Fit** (section 4.1, "Fitting the parameters D_k"): ordinary least squares of a request's normalized
latency (end-to-end latency over output tokens) against the batch features averaged over its lifetime,
:func:`fit_qoe`, with the mean relative error the paper reports (8.9% on its testbed). Coefficients are
kept non-negative (a negative ``D`` would let the partition gain by *adding* requests to a batch).

**Defaults from the step model** (:meth:`QoeCoefficients.from_step_model`): the policy must work before
any fit, from the step-time model ``T = a + b * new + c * ctx`` of POLICIES.md section 4. Take a unit in
steady state with ``n`` requests, each producing ``O`` output tokens (``O`` = mean output length), mixed
steps with chunked prefill of ``C`` tokens per step:

- *iteration part*: a decode step of the batch costs ``a + b * n + c * sum L`` (``n`` new tokens, context
  ``sum L``), and every request gets one token per step: ``D0 = a``, ``D1 = b``, ``D4 = c``;
- *prefill part*: over one request's lifetime (``O`` steps) each of the ``n`` slots is refilled about once,
  so the unit prefills ``sum I`` prompt tokens in that time. A prompt of ``I`` tokens in chunks of ``C``
  costs ``b * I`` for its tokens plus ``c * sum_k (k * C) ~ c * (I^2 / (2C) + I / 2)`` for the context of
  its ``I / C`` chunks (chunk ``k`` sees ``k * C`` tokens); those steps are shared by every request of the
  batch. Spread over the ``O`` output tokens: ``D2 = (b + c / 2) / O`` and ``D3 = c / (2 * C * O)``.

A step-by-step simulation of such a unit under the step model (``tests/test_cascade_partition.py``) agrees
within 0.2% for prompts of 200-2,048 tokens, chunk 1,024 and 128-400 output tokens; the iteration part
alone would be up to 32% low. What the family cannot express is a request's *own* wait for its prefill
(``I / C`` steps before its first token, a product of ``I`` and the step time): when ``I / C`` is not small
next to ``O`` the defaults run low (8,192-token prompts, chunk 512, 64 outputs: 14% low). With vLLM's usual
chunk of 8,192 tokens that wait is at most one step for prompts up to 8K.

Pure: stdlib and numpy only, no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.cost.step_model import StepCoefficients
from policies.frozen import picklable

__all__ = [
    "BatchFeatures",
    "QoeCoefficients",
    "QoeFit",
    "QoeSample",
    "fit_qoe",
    "fit_qoe_samples",
    "qoe_relative_error",
]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class BatchFeatures:
    """The batch-load features ``F1..F4`` of section 4.1 (``F0 = 1`` is implicit).

    Floats, not ints: for fitting they are a request's *lifetime averages* of its batches' features.
    """

    num_requests: float
    """``n``: requests in the batch."""
    sum_prompt_tokens: float
    """``sum I``: input (prompt) lengths."""
    sum_prompt_sq: float
    """``sum I^2`` (tokens squared)."""
    sum_context_tokens: float
    """``sum L``: sequence lengths (prompt plus outputs so far)."""

    @classmethod
    def of(cls, prompts: Sequence[int], contexts: Sequence[int]) -> BatchFeatures:
        """Features of one batch from its requests' prompt and context lengths (tokens)."""
        if len(prompts) != len(contexts):
            raise ValueError(f"prompts ({len(prompts)}) and contexts ({len(contexts)}) differ in length")
        return cls(
            float(len(prompts)),
            float(sum(prompts)),
            float(sum(p * p for p in prompts)),
            float(sum(contexts)),
        )

    def as_row(self) -> tuple[float, float, float, float, float]:
        """``(F0, F1, F2, F3, F4) = (1, n, sum I, sum I^2, sum L)``."""
        return (1.0, self.num_requests, self.sum_prompt_tokens, self.sum_prompt_sq, self.sum_context_tokens)


@dataclass(frozen=True, slots=True)
class QoeSample:
    """One fitting record: a request's normalized latency and its lifetime-average batch features."""

    features: BatchFeatures
    normalized_latency_s: float
    """End-to-end latency over output tokens (seconds per token); > 0."""


@dataclass(frozen=True, slots=True)
class QoeCoefficients:
    """``D0..D4`` of ``Q_1 = D0 + D1 n + D2 sum I + D3 sum I^2 + D4 sum L`` (seconds per output token)."""

    d0: float
    """Seconds (fixed part of an iteration)."""
    d1: float
    """Seconds per request in the batch."""
    d2: float
    """Seconds per prompt token in the batch."""
    d3: float
    """Seconds per squared prompt token."""
    d4: float
    """Seconds per context token in the batch."""

    @classmethod
    def from_step_model(
        cls, step: StepCoefficients, *, mean_output_tokens: float, chunk_tokens: float
    ) -> QoeCoefficients:
        """Defaults derived from ``T = a + b * new + c * ctx`` (module docstring, derivation).

        ``D0 = a``, ``D1 = b``, ``D2 = (b + c/2) / O``, ``D3 = c / (2 C O)``, ``D4 = c`` with ``O`` =
        ``mean_output_tokens`` and ``C`` = ``chunk_tokens`` (both > 0).
        """
        if not (mean_output_tokens > 0 and chunk_tokens > 0):
            raise ValueError(
                f"mean_output_tokens and chunk_tokens must be > 0, got {mean_output_tokens}, {chunk_tokens}"
            )
        o, c = float(mean_output_tokens), float(chunk_tokens)
        return cls(
            d0=step.a_s,
            d1=step.b_s,
            d2=(step.b_s + step.c_s / 2.0) / o,
            d3=step.c_s / (2.0 * c * o),
            d4=step.c_s,
        )

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.d0, self.d1, self.d2, self.d3, self.d4)

    def per_request(self, n: float, sum_prompt: float, sum_prompt_sq: float, sum_context: float) -> float:
        """``Q_1``: every request's normalized latency in this batch (seconds per output token)."""
        return self.d0 + self.d1 * n + self.d2 * sum_prompt + self.d3 * sum_prompt_sq + self.d4 * sum_context

    def batch(self, n: float, sum_prompt: float, sum_prompt_sq: float, sum_context: float) -> float:
        """``Q_B = n * Q_1`` (Equation 1); 0 for an empty batch."""
        if n <= 0:
            return 0.0
        return n * self.per_request(n, sum_prompt, sum_prompt_sq, sum_context)

    def of_lengths(self, prompts: Sequence[int], contexts: Sequence[int]) -> float:
        """``Q_B`` of the batch with these prompt and context lengths."""
        f = BatchFeatures.of(prompts, contexts)
        return self.batch(f.num_requests, f.sum_prompt_tokens, f.sum_prompt_sq, f.sum_context_tokens)

    def predict(self, features: npt.ArrayLike) -> FloatArray:
        """``Q_1`` for each row of an ``(N, 4)`` array of ``(n, sum I, sum I^2, sum L)``."""
        x = _features(features)
        return np.asarray(_design(x) @ np.asarray(self.as_tuple(), dtype=np.float64), dtype=np.float64)


@dataclass(frozen=True, slots=True)
class QoeFit:
    """Result of :func:`fit_qoe`."""

    coefficients: QoeCoefficients
    mean_relative_error: float
    """``mean |pred - Q| / Q`` over the fitted samples (0.089 = the paper's 8.9%)."""
    num_samples: int
    clamped: tuple[int, ...] = ()
    """Indices ``k`` of the ``D_k`` held at 0 by the non-negativity constraint."""


def _features(features: npt.ArrayLike) -> FloatArray:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != 4:
        raise ValueError(f"features must be an (N, 4) array of (n, sum I, sum I^2, sum L), got shape {x.shape}")
    return x


def _design(x: FloatArray) -> FloatArray:
    return np.column_stack((np.ones(len(x)), x))


def qoe_relative_error(coefs: QoeCoefficients, features: npt.ArrayLike, latency_s: npt.ArrayLike) -> float:
    """Mean relative error ``mean |Q_1(F) - Q| / Q`` of ``coefs`` on records (``Q`` > 0)."""
    x = _features(features)
    y = np.asarray(latency_s, dtype=np.float64)
    if y.shape != (len(x),):
        raise ValueError(f"latency_s must have {len(x)} entries, got shape {y.shape}")
    if len(y) == 0:
        raise ValueError("no records")
    if float(y.min()) <= 0.0:
        raise ValueError("normalized latencies must be positive")
    return float(np.mean(np.abs(coefs.predict(x) - y) / y))


def fit_qoe(features: npt.ArrayLike, latency_s: npt.ArrayLike, *, nonnegative: bool = True) -> QoeFit:
    """Least squares of ``Q = sum_k D_k F_k`` (section 4.1) over records; returns ``D`` and the mean error.

    ``features``: ``(N, 4)`` rows of ``(n, sum I, sum I^2, sum L)`` (a request's lifetime-average batch
    features); ``latency_s``: its normalized latency (seconds per output token, > 0). Minimises the
    absolute squared error, as the paper's argmin does. Columns are scaled to unit maximum before the SVD
    solve (``sum I^2`` reaches 1e13 while ``F0`` is 1).

    With ``nonnegative`` the problem is solved exactly under ``D >= 0``: the optimum of a non-negative
    least-squares problem is the unconstrained least-squares solution on its support, so with five
    coefficients the solver tries all 31 supports and keeps the feasible one with the smallest residual.

    Raises ValueError on fewer than 5 records, non-finite values, non-positive latencies, or features of
    rank < 5 (they do not separate the five coefficients: vary batch sizes and lengths).
    """
    x = _features(features)
    y = np.asarray(latency_s, dtype=np.float64)
    if y.shape != (len(x),):
        raise ValueError(f"latency_s must have {len(x)} entries, got shape {y.shape}")
    if len(y) < 5:
        raise ValueError(f"need at least 5 records to fit 5 coefficients, got {len(y)}")
    if not (bool(np.isfinite(x).all()) and bool(np.isfinite(y).all())):
        raise ValueError("records contain NaN or infinite values")
    if float(y.min()) <= 0.0:
        raise ValueError("normalized latencies must be positive")
    design = _design(x)
    scale = np.abs(design).max(axis=0)
    scale[scale == 0.0] = 1.0
    scaled = design / scale
    if int(np.linalg.matrix_rank(scaled)) < 5:
        raise ValueError("rank-deficient records: D0..D4 cannot be separated (vary batch sizes and lengths)")
    best: FloatArray | None = None
    best_res = math.inf
    supports = [tuple(range(5))]
    if nonnegative:
        supports = [s for r in range(5, 0, -1) for s in itertools.combinations(range(5), r)]
    for support in supports:
        cols = list(support)
        sol, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
        if nonnegative and float(sol.min()) < 0.0:
            continue
        full = np.zeros(5)
        full[cols] = sol
        res = float(np.sum((scaled @ full - y) ** 2))
        if res < best_res * (1.0 - 1e-12) or best is None:
            best, best_res = full, res
        if not nonnegative:
            break
    assert best is not None  # the single-column supports always include a feasible one (y > 0)
    d = best / scale
    coefs = QoeCoefficients(*(float(v) for v in d))
    clamped = tuple(k for k in range(5) if nonnegative and best[k] == 0.0)
    return QoeFit(coefs, qoe_relative_error(coefs, x, y), len(y), clamped)


def fit_qoe_samples(samples: Sequence[QoeSample], *, nonnegative: bool = True) -> QoeFit:
    """:func:`fit_qoe` over :class:`QoeSample` records."""
    rows = [s.features.as_row()[1:] for s in samples]
    return fit_qoe(
        np.asarray(rows, dtype=np.float64).reshape(len(rows), 4),
        [s.normalized_latency_s for s in samples],
        nonnegative=nonnegative,
    )


picklable(BatchFeatures, QoeSample, QoeCoefficients, QoeFit)  # compiled with mypyc (setup.py): see picklable
