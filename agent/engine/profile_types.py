"""The calibration profile as data: a measured step-time model and engine limits, and where they come from.

A :class:`Profile` describes one engine configuration measured on real hardware (``shared/calibration``,
H100 80GB HBM3, vLLM 0.26.0, 2026-11-22): the step-time model ``T = a + b * new_tokens + c * context_tokens``
fitted over the calibration workloads (``mix``, ``longctx``, ``small``, ``dec128``: exactly the steps of
``probe.py``'s ``all`` fit), its error there and on the ``sharegpt_like`` workload it never saw (holdout), a
multiplicative noise level, the mixed-batch interference ``kappa`` (fitted on all its records, see
:func:`agent.engine.profile_fit.fit_interference_kappa`), the KV-cache capacity and the scheduler limits the
runs used. Loading the shipped ones: :mod:`agent.engine.profiles`; their JSON layout:
:mod:`agent.engine.profile_json`.

A *derived* profile (``derived_from`` set, ``"derived"`` in its name) was never measured: it is computed from
a measured one and published hardware figures (:mod:`agent.engine.derived_profiles`, ``DERIVED_PROFILES``).
It has no step records, so ``source``, ``fit``, ``holdout``, ``kv_evidence``, ``decode_only``, ``mixed`` and
``interference`` are None, and :func:`agent.engine.profiles.load_records` refuses it.

KV capacity (``num_gpu_blocks``). vLLM reports KV usage as ``1 - free_blocks / (num_gpu_blocks - 1)``
(block 0 is its reserved null block), so every recorded ``kv`` is ``used_blocks / U`` with an integer
``used_blocks`` and ``U = num_gpu_blocks - 1`` usable blocks. :func:`agent.engine.profile_fit.derive_kv_blocks`
finds ``U`` exactly: the one integer within 10% of the rough estimate ``median(ctx / kv) / block_size`` for
which ``kv * U`` is integral in every recorded step (to 1e-3 with ``kv`` stored to 1e-10; a wrong ``U`` misses
by ~0.5). The rough estimate (median of ``ctx / kv`` over decode-only
steps with ``kv > 0.05``, where every running request is scheduled) is kept in the profile as a
cross-check; it sits 0.5-0.6% below the exact capacity because the last block of each request is only
partly filled. The remaining uncertainty is the null-block convention (one block) and, if a later vLLM
changes the usage formula, the fallback to the rough estimate (about +-1%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.cost.fit import FitStats
from policies.cost.step_model import StepCoefficients


@dataclass(frozen=True, slots=True)
class ProfileSource:
    """Where a profile's numbers come from."""

    files: tuple[str, ...]
    """Calibration files (``shared/calibration/...``) the records were taken from."""
    measured_date: str
    """ISO date of the measurement."""
    vllm_version: str
    calibration_workloads: tuple[str, ...]
    """Workloads whose steps were fitted."""
    holdout_workloads: tuple[str, ...]
    """Workloads only evaluated (never fitted)."""


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """Coefficients fitted on one kind of step only, with their error on those steps."""

    coefficients: StepCoefficients
    fit: FitStats


@dataclass(frozen=True, slots=True)
class KvCapacityEvidence:
    """How ``num_gpu_blocks`` was derived, and the rough cross-check."""

    method: str
    """``"exact-denominator"`` (kv * usable blocks integral in every step) or ``"median-ctx-over-kv"``."""
    num_steps: int
    """Decode-only steps with kv > 0.05 behind the median below."""
    ctx_over_kv_median_tokens: float
    ctx_over_kv_p25_tokens: float
    ctx_over_kv_p75_tokens: float


KAPPA_FITTED_ON_PROBE = "all records, schedule() time replaced by its calibration median"
"""How ``kappa`` is fitted on a probe file's steps (:attr:`InterferenceFit.fitted_on`)."""


@dataclass(frozen=True, slots=True)
class InterferenceFit:
    """How well ``interference_kappa`` explains a measured profile's mixed steps (prefill and decode tokens).

    MAPE as fractions, of the linear model alone (``*_linear``) and with the interference factor; over all
    records (the fit's data), and split into the calibration and the holdout workloads' mixed steps.
    """

    num_steps: int
    mape_linear: float
    mape: float
    calibration_num_steps: int
    calibration_mape_linear: float
    calibration_mape: float
    holdout_num_steps: int
    holdout_mape_linear: float
    holdout_mape: float
    kappa_unadjusted: float
    """The fit on raw step times, without replacing each step's ``schedule()`` time by its median (not
    used: it mistakes vLLM's per-request scheduling cost for interference, see
    :func:`agent.engine.profile_fit.fit_interference_kappa`)."""
    fitted_on: str = KAPPA_FITTED_ON_PROBE
    """What ``kappa`` was fitted on, in words (the default: a probe file's steps, which time ``schedule()``)."""
    mape_attention: float = math.nan
    """The mixed steps' MAPE with the factor on the attention term only (``Profile.interference_kappa_attention``)
    instead of the whole step; over all records, then the calibration and the holdout workloads' (NaN: not
    fitted, a profile file written before the attention shape)."""
    calibration_mape_attention: float = math.nan
    holdout_mape_attention: float = math.nan


@dataclass(frozen=True, slots=True)
class Derivation:
    """How a profile that was never measured was computed from a measured one and published figures."""

    base_profile: str
    """The measured profile it was scaled from."""
    reference: str
    """Where the target hardware's figures and the interference target come from."""
    memory_bandwidth_tb_per_s: float
    base_memory_bandwidth_tb_per_s: float
    dense_bf16_tflops: float
    base_dense_bf16_tflops: float
    memory_gib: float
    base_memory_gib: float
    crossover_decode_fraction: float | None
    """Decode share at which a mixed step's per-token marginal cost equals pure decode's (sets ``kappa``); None:
    ``kappa`` is the base profile's measured one (no target taken from a paper)."""
    reference_decode_context_tokens: int
    """Decode context at which that crossover is placed (:func:`agent.engine.timing.marginal_cost_crossover`); 0
    without a crossover."""
    method: str
    """The derivation in words (also in the description)."""

    @property
    def bandwidth_ratio(self) -> float:
        """Factor on the memory-bound terms ``a`` and ``c``."""
        return self.base_memory_bandwidth_tb_per_s / self.memory_bandwidth_tb_per_s

    @property
    def compute_ratio(self) -> float:
        """Factor on the compute-bound term ``b``."""
        return self.base_dense_bf16_tflops / self.dense_bf16_tflops


@dataclass(frozen=True)
class Profile:
    """One engine configuration, measured or derived from a measured one (see the module docstring)."""

    name: str
    description: str
    gpu: str
    model: str
    mode: str
    """``"cuda-graphs"`` (CUDA graphs + torch.compile) or ``"eager"``."""
    engines_per_gpu: int
    """Engines sharing the GPU during the measurement (2 for the ``-shared`` profile)."""
    source: ProfileSource | None
    """None for a derived profile (see :attr:`derived_from`)."""
    coefficients: StepCoefficients
    """Fit over the calibration workloads (seconds, seconds per token, seconds per context token)."""
    fit: FitStats | None
    """Error of :attr:`coefficients` on the calibration steps (None: derived, no steps)."""
    holdout: FitStats | None
    """Error of :attr:`coefficients` on the holdout steps (never fitted; None: derived)."""
    noise_sigma: float
    """Robust sigma of ``log(measured / predicted)`` (1.4826 * MAD) on the calibration steps: the
    log-normal step jitter a simulator may apply, ``T * exp(noise_sigma * z)``."""
    noise_sigma_std: float
    """Plain standard deviation of the same log ratios (inflated by a few stalls; for reference)."""
    noise_log_median: float
    """Median of ``log(measured / predicted)``: negative means the typical step beats the OLS line. A derived
    profile copies the three noise numbers of its base profile."""
    block_size: int
    """Tokens per KV block."""
    num_gpu_blocks: int
    """vLLM's ``num_gpu_blocks`` per engine, including its reserved null block."""
    kv_evidence: KvCapacityEvidence | None
    """None for a derived profile (its capacity is computed, see :attr:`derived_from`)."""
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    """Tokens."""
    sched_overhead_s: float
    """Median time inside vLLM's ``schedule()`` over the calibration steps (seconds, informational)."""
    loop_overhead_s: float
    """Engine-loop time per step outside ``schedule()``..``update_from_output()`` (seconds): the rest of
    ``LLMEngine.step()`` (output processing). Fitted with :attr:`loop_overhead_per_request_s` on
    ``wall - sum(t)`` of each calibration workload; the simulator adds both to every step."""
    loop_overhead_per_request_s: float
    """Engine-loop time per step per scheduled request (seconds)."""
    decode_only: PhaseFit | None
    """Fit over the calibration steps without prefill tokens."""
    mixed: PhaseFit | None
    """Fit over the calibration steps with both prefill and decode tokens."""
    interference_kappa: float
    """Mixed-batch interference: a step with decode share ``rho`` takes the linear prediction times
    ``1 + kappa * rho * (1 - rho)`` (:func:`agent.engine.timing.interference_factor`). Simulator only: the
    policies' cost model stays linear."""
    interference: InterferenceFit | None
    """How ``interference_kappa`` changes the error on the mixed steps (None: derived)."""
    derived_from: Derivation | None
    """Set for a profile derived from another one and published figures, never measured."""
    interference_kappa_attention: float = 0.0
    """The same interference on the context (attention) term only: ``a + b * new + c * ctx * (1 + kappa * rho *
    (1 - rho))`` (seed 002's kernel breakdown; ``bench --interference-on attention``), fitted on the same records
    the same way. 0 in a profile file written before it."""

    @property
    def is_derived(self) -> bool:
        """True when the profile was computed, not measured (no step records)."""
        return self.derived_from is not None

    @property
    def usable_gpu_blocks(self) -> int:
        """KV blocks requests can hold (``num_gpu_blocks - 1``)."""
        return self.num_gpu_blocks - 1

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the usable KV blocks hold."""
        return self.usable_gpu_blocks * self.block_size
