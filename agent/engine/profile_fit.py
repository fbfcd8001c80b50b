"""Fit a calibration profile on step records: the step model, its noise, the interference ``kappa``, the KV capacity.

The shipped profiles are fitted on the probe files' steps (:mod:`agent.engine.calibration`), a node's own
profile on the steps it recorded (:mod:`agent.engine.step_calibration`, ``trackside calibrate``); both run
the steps below on records of :mod:`agent.engine.profile_records` (see :mod:`agent.engine.profile_types` for
what each field means). The numbering is that of :mod:`agent.engine.calibration`'s derivation, whose step 1
collects the records and step 6 derives the profiles that were never measured.

2. Step model: OLS over the calibration steps (``probe.py``'s ``all`` fit); error on them and on the
   holdout; the same fit restricted to decode-only and to mixed steps.
3. Noise: ``log(measured / predicted)`` over the calibration steps; ``noise_sigma`` is the robust
   1.4826 * MAD. Chosen over the plain standard deviation because a few isolated stalls (small decode
   steps taking 2-8x the prediction: host-side hiccups such as GC pauses; 1.8% of the 8B graphs steps
   are off by more than 35%) inflate the latter (0.100 vs 0.059 for the 8B graphs run), while a
   log-normal cannot reproduce such rare events anyway: fitted to them it would widen every step's
   jitter instead. The simulator should model stalls separately if it needs them. Both are shipped
   (``noise_sigma``, ``noise_sigma_std``), with the median log ratio (the bias of the OLS line).
4. KV capacity: exact denominator of the ``kv`` fractions (module docstring of
   :mod:`agent.engine.profile_types`), the median of ``ctx / kv`` as estimate, window and cross-check
   (:func:`derive_kv_blocks`). With several engines (files), the smallest per-engine capacity is taken.
5. Mixed-batch interference ``kappa``: :func:`fit_interference_kappa`, given the coefficients of step 2.

Steps 2, 3 and 5 are :func:`fit_profile`; the KV capacity and the engine limits are its caller's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from agent.engine.profile_records import Records, select, stats_on
from agent.engine.profile_types import (
    KAPPA_FITTED_ON_PROBE,
    InterferenceFit,
    KvCapacityEvidence,
    PhaseFit,
    Profile,
    ProfileSource,
)
from policies.cost.fit import fit_step_model
from policies.cost.step_model import StepCoefficients

_MAD_TO_SIGMA = 1.482602218505602  # 1 / Phi^-1(3/4): MAD of a normal sample -> its sigma


def _exact_usable_blocks(kv: npt.NDArray[np.float64], estimate: float, window: float = 0.1) -> int | None:
    """The unique integer U within ``estimate * (1 +- window)`` with ``kv * U`` integral in every step."""
    kv = kv[kv > 0.0]
    if len(kv) == 0 or not estimate > 0.0:
        return None
    candidates = np.arange(max(1, math.floor(estimate * (1 - window))), math.ceil(estimate * (1 + window)) + 1)
    tolerance = 1e-3  # kv is stored to 1e-10, so kv * U is integral to ~1e-5; wrong U miss by ~0.5
    for chunk in (kv[:64], kv):
        prod = candidates[:, None] * chunk[None, :]
        candidates = candidates[np.abs(prod - np.rint(prod)).max(axis=1) <= tolerance]
    return int(candidates[0]) if len(candidates) == 1 else None


def ctx_over_kv(records: Records, method: str) -> KvCapacityEvidence | None:
    """Quartiles of ``ctx / kv`` (tokens) over the decode-only steps with ``kv > 0.05``, as evidence for
    ``method``; None when there is no such step."""
    use = (records["pre_tok"] == 0) & (records["kv"] > 0.05)
    ratio = records["ctx"][use] / records["kv"][use]
    if len(ratio) == 0:
        return None
    p25, median, p75 = (float(v) for v in np.percentile(ratio, [25, 50, 75]))
    return KvCapacityEvidence(method, int(use.sum()), median, p25, p75)


def derive_kv_blocks(records: Records, block_size: int) -> tuple[int, KvCapacityEvidence]:
    """Usable KV blocks of one engine from its records, and the evidence (:mod:`agent.engine.profile_types`)."""
    rough = ctx_over_kv(records, "median-ctx-over-kv")
    if rough is None:
        raise ValueError("no decode-only step with kv > 0.05: cannot estimate the KV capacity")
    median = rough.ctx_over_kv_median_tokens
    exact = _exact_usable_blocks(records["kv"], median / block_size)
    if exact is None:
        return round(median / block_size), rough
    return exact, replace(rough, method="exact-denominator")


def _phase(records: Records) -> PhaseFit | None:
    """The step model fitted on ``records`` alone; None below 10 steps or when they cannot separate a, b, c."""
    if len(records) < 10:
        return None
    try:
        coefs, stats = fit_step_model(records["new"], records["ctx"], records["t_s"])
    except ValueError:  # rank-deficient (e.g. every such step the same size)
        return None
    return PhaseFit(coefs, stats)


def _mixed_mape(t: npt.NDArray[np.float64], pred: npt.NDArray[np.float64]) -> float:
    return float(np.mean(np.abs(pred - t) / t)) if len(t) else math.nan


def _least_squares_kappa(t: npt.NDArray[np.float64], lin: npt.NDArray[np.float64],
                         g: npt.NDArray[np.float64]) -> float:
    lg = lin * g
    denom = float(np.dot(lg, lg))
    return max(float(np.dot(t - lin, lg)) / denom, 0.0) if denom > 0.0 else 0.0


def fit_interference_kappa(
    records: Records,
    coefficients: StepCoefficients,
    calibration_workloads: Sequence[str],
    schedule_s: npt.NDArray[np.float64] | None = None,
    typical_schedule_s: float = 0.0,
) -> tuple[float, float, InterferenceFit]:
    """Least-squares ``kappa`` of ``t = L * (1 + kappa * rho * (1 - rho))`` given the linear ``L``, the same on the
    attention term only (``t = L + kappa_attention * c * ctx * rho * (1 - rho)``), and their errors.

    ``L = a + b * new + c * ctx`` are the profile's coefficients (fitted first, on the calibration steps) and
    ``rho = dec / new``. With ``g = rho * (1 - rho)`` (0 on pure steps, which therefore do not move the
    fit) the residual ``t - L = kappa * L * g`` is linear in ``kappa``: minimising the absolute squared error,
    the objective of the ``a, b, c`` fit, gives ``kappa = sum((t - L) * L * g) / sum((L * g)^2)``, clipped
    at 0 (interference never speeds a step up). Closed form, so regeneration stays deterministic.

    ``t`` is each step's time with vLLM's ``schedule()`` time (``schedule_s``, per record; the probe files'
    ``t_sched``) replaced by its typical value (``typical_schedule_s``: the calibration median, which ``a``
    already carries). Why: ``schedule()`` is host-side Python whose time grows with the scheduled requests
    (8B graphs: 0.19 ms + 14.9 us per request, 7.5 ms at 512 requests) whether or not the step mixes
    prefill and decode (7.50 ms for pure-decode and 7.63 ms for mixed steps at 450-512 requests). The mixed
    steps with a balanced decode share all sit at the 512-request cap (ShareGPT-like run), so on raw times
    that batch-size cost, which pure-decode steps at the same batch size pay too (+21% over the linear model),
    would be fitted as interference: raw-time ``kappa`` is 0.667 for the 8B graphs profile, 0.043 after the
    replacement. Both are returned (``InterferenceFit.kappa_unadjusted``); ``schedule_s=None`` fits raw times.

    Data: *all* the profile's records, holdout included: the calibration workloads have 36 of 1,604 steps
    (8B graphs) with ``0.2 <= rho <= 0.9``, 14 of them 2-8 token steps, the ShareGPT-like holdout 217. So
    the holdout does not validate ``kappa``; the errors returned (MAPE of the linear model with and without
    the factor on the mixed steps, against the *measured* times) only say what it changes. Shape:
    ``rho * (1 - rho)``, the paper's (see :mod:`agent.engine.timing`). On the 8B graphs records with
    ``schedule()`` replaced, the binned ratios to the linear model are 0.96 below ``rho = 0.2``, 0.99 at
    0.2-0.4 and 1.08-1.12 from 0.4 to 0.9; ``rho^2 * (1 - rho)`` follows that a little better (mixed-step
    MAPE 5.9% vs 6.1%, linear alone 6.2%): not a clear case for another shape or parameter.
    """
    new = records["new"].astype(np.float64)
    dec = records["dec"].astype(np.float64)
    t = records["t_s"]
    lin = coefficients.a_s + coefficients.b_s * new + coefficients.c_s * records["ctx"]
    rho = np.divide(dec, new, out=np.zeros_like(new), where=new > 0)
    g = rho * (1.0 - rho)
    t_fit = t if schedule_s is None else t - schedule_s + typical_schedule_s
    kappa = _least_squares_kappa(t_fit, lin, g)
    pred = lin * (1.0 + kappa * g)
    attention = coefficients.c_s * records["ctx"]
    kappa_attention = _least_squares_kappa(t_fit - lin + attention, attention, g)  # t - L = kappa * (c * ctx) * g
    pred_attention = lin + kappa_attention * attention * g
    mixed = (records["pre_tok"] > 0) & (records["dec"] > 0)
    cal = np.isin(records["workload"], tuple(calibration_workloads))
    parts = [mixed, mixed & cal, mixed & ~cal]
    n = [int(m.sum()) for m in parts]
    before = [_mixed_mape(t[m], lin[m]) for m in parts]
    after = [_mixed_mape(t[m], pred[m]) for m in parts]
    on_attention = [_mixed_mape(t[m], pred_attention[m]) for m in parts]
    fitted_on = KAPPA_FITTED_ON_PROBE if schedule_s is not None else "all records (no schedule() times to replace)"
    return kappa, kappa_attention, InterferenceFit(
        n[0], before[0], after[0], n[1], before[1], after[1], n[2], before[2], after[2],
        kappa_unadjusted=_least_squares_kappa(t, lin, g), fitted_on=fitted_on, mape_attention=on_attention[0],
        calibration_mape_attention=on_attention[1], holdout_mape_attention=on_attention[2],
    )


def fit_profile(
    records: Records,
    *,
    name: str,
    description: str,
    gpu: str,
    model: str,
    mode: str,
    source: ProfileSource,
    block_size: int,
    usable_blocks: int,
    kv_evidence: KvCapacityEvidence,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    engines_per_gpu: int = 1,
    loop_overhead: tuple[float, float] = (0.0, 0.0),
    sched_overhead_s: float = 0.0,
    schedule_s: npt.NDArray[np.float64] | None = None,
) -> Profile:
    """Fit a profile on step records whose ``workload`` column tags each step with a calibration or a holdout
    workload of ``source``: steps 2, 3 and 5 of the module docstring, whatever engine the records come from.

    The step model is fitted on the calibration steps (raises ValueError when they cannot separate ``a``,
    ``b`` and ``c``), evaluated on the holdout steps (``holdout`` None without any), and the noise, the
    decode-only and mixed fits and ``kappa`` follow from it. ``schedule_s`` (per record) and
    ``sched_overhead_s`` are vLLM's ``schedule()`` times where the records have them (probe files; see
    :func:`fit_interference_kappa`), ``loop_overhead`` the engine-loop time per step and per scheduled
    request outside the records' ``t_s``. The KV capacity and engine limits are the caller's.
    """
    calib = select(records, source.calibration_workloads)
    hold = select(records, source.holdout_workloads)
    coefs, fit = fit_step_model(calib["new"], calib["ctx"], calib["t_s"])
    log_ratio = np.log(calib["t_s"] / (coefs.a_s + coefs.b_s * calib["new"] + coefs.c_s * calib["ctx"]))
    log_median = float(np.median(log_ratio))
    kappa, kappa_attention, interference = fit_interference_kappa(records, coefs, source.calibration_workloads,
                                                                  schedule_s, sched_overhead_s)
    return Profile(
        name=name, description=description, gpu=gpu, model=model, mode=mode, engines_per_gpu=engines_per_gpu,
        source=source, coefficients=coefs, fit=fit, holdout=stats_on(coefs, hold) if len(hold) else None,
        noise_sigma=_MAD_TO_SIGMA * float(np.median(np.abs(log_ratio - log_median))),
        noise_sigma_std=float(np.std(log_ratio)), noise_log_median=log_median,
        block_size=block_size, num_gpu_blocks=usable_blocks + 1, kv_evidence=kv_evidence,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        sched_overhead_s=sched_overhead_s,
        loop_overhead_s=loop_overhead[0], loop_overhead_per_request_s=loop_overhead[1],
        decode_only=_phase(calib[calib["pre_tok"] == 0]),
        mixed=_phase(calib[(calib["pre_tok"] > 0) & (calib["dec"] > 0)]),
        interference_kappa=kappa, interference=interference, derived_from=None,
        interference_kappa_attention=kappa_attention,
    )
