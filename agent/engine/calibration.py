"""Derive the shipped calibration profiles from the raw probe files in ``shared/calibration``.

    python -m agent.engine.calibration --shared ../shared/calibration --out agent/engine/profiles

rewrites ``<name>.json`` and ``<name>.records.csv.gz`` for every profile in :data:`SHIPPED_PROFILES`. The
output is deterministic (fixed float formats, gzip without timestamp or file name), so a test can check
that the shipped files are exactly what this module produces.

Derivation (see :mod:`agent.engine.profiles` for what each field means):

1. Records: the steps of the calibration workloads (``mix``, ``longctx``, ``small``, ``dec128``; the
   ``warmup`` run is dropped) and of the holdout (``sharegpt_like``), rounded to the CSV's precision
   (``t_s`` to 0.1 us, ``kv`` to 1e-10); every statistic is computed from these rounded records, so the
   shipped CSV reproduces the shipped JSON.
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
   :mod:`agent.engine.profiles`), the median of ``ctx / kv`` as estimate, window and cross-check. With
   several engines (files), the smallest per-engine capacity is taken.
5. Mixed-batch interference ``kappa``: :func:`fit_interference_kappa`, given the coefficients of step 2.
6. Derived profiles (:data:`DERIVED_PROFILES`): computed from a measured profile and published hardware
   figures, never measured; :func:`derive_bandwidth_scaled_profile` documents the arithmetic. They ship a
   JSON file only (no records).

Steps 2, 3 and 5 are :func:`fit_profile`, which :mod:`agent.engine.step_calibration` also runs on the steps a
node recorded (``trackside calibrate``).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.engine.profiles import (
    KAPPA_FITTED_ON_PROBE,
    RECORD_COLUMNS,
    Derivation,
    InterferenceFit,
    KvCapacityEvidence,
    PhaseFit,
    Profile,
    ProfileSource,
    Records,
    parse_records,
    profile_from_json,
    profile_to_json,
    select,
    stats_on,
)
from agent.engine.timing import kappa_for_crossover
from policies.cost.fit import fit_step_model
from policies.cost.step_model import StepCoefficients

MEASURED_DATE = "2026-11-22"
VLLM_VERSION = "0.26.0"
CALIBRATION_WORKLOADS = ("mix", "longctx", "small", "dec128")
HOLDOUT_WORKLOADS = ("sharegpt_like",)
_FORMATS = {"t_s": "{:.7f}", "kv": "{:.10f}"}
_MAD_TO_SIGMA = 1.482602218505602  # 1 / Phi^-1(3/4): MAD of a normal sample -> its sigma


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """One shipped profile: which probe files, and the hand-written part of its description."""

    name: str
    files: tuple[str, ...]
    model: str
    summary: str
    kv_bytes_per_token: int
    engines_per_gpu: int = 1


_H100 = "one H100 80GB HBM3, vLLM 0.26.0 (FLASH_ATTN/FA3, chunked prefill and prefix caching on, dummy weights)"
SHIPPED_PROFILES: tuple[ProfileSpec, ...] = (
    ProfileSpec("h100-llama31-8b", ("llama31-8b_graphs.json",), "Llama-3.1-8B",
                f"Llama-3.1-8B on {_H100}, CUDA graphs + torch.compile, gpu_memory_utilization 0.85 "
                "(0.85 x 80 GB minus ~16 GB of weights and the activation reserve). The default profile.",
                kv_bytes_per_token=32 * 8 * 128 * 2 * 2),
    ProfileSpec("h100-llama31-8b-eager", ("llama31-8b_eager.json",), "Llama-3.1-8B",
                f"Llama-3.1-8B on {_H100}, eager mode (no CUDA graphs), gpu_memory_utilization 0.85.",
                kv_bytes_per_token=32 * 8 * 128 * 2 * 2),
    ProfileSpec("h100-llama32-1b", ("llama32-1b_solo.json",), "Llama-3.2-1B",
                f"Llama-3.2-1B alone on {_H100}, CUDA graphs. The KV capacity in the records implies "
                "gpu_memory_utilization ~0.4 (the pair's setting), not 0.85, which would leave ~2M tokens.",
                kv_bytes_per_token=16 * 8 * 64 * 2 * 2),
    ProfileSpec("h100-llama32-1b-shared", ("llama32-1b_pair_a.json", "llama32-1b_pair_b.json"), "Llama-3.2-1B",
                f"Llama-3.2-1B, two engines sharing {_H100}, CUDA graphs, gpu_memory_utilization 0.4 each; "
                "fitted over both engines' steps; KV capacity is per engine.",
                kv_bytes_per_token=16 * 8 * 64 * 2 * 2, engines_per_gpu=2),
)


@dataclass(frozen=True, slots=True)
class GpuFigures:
    """Published figures of one GPU (vendor datasheet or a paper), as used by the derivation."""

    name: str
    memory_bandwidth_tb_per_s: float
    dense_bf16_tflops: float
    memory_gib: float
    source: str


H100_SXM = GpuFigures(
    "NVIDIA H100 80GB HBM3 (SXM5)", 3.35, 989.4, 80.0,
    "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16 tensor (1,979 with 2:4 sparsity), 80 GB",
)
RTX_PRO_6000 = GpuFigures(
    "NVIDIA RTX PRO 6000 Blackwell 96GB", 1.792, 252.0, 96.0,
    "seed 002 (exclusive batching vs mixed batching), Table 1: RTX PRO 6000, 1.792 TB/s, 252 FP16 TFLOPS "
    "(141 FLOP/B); 96 GB GDDR7 (its Appendix A.1)",
)


@dataclass(frozen=True, slots=True)
class DerivedSpec:
    """One shipped profile computed from a measured one (:func:`derive_bandwidth_scaled_profile`)."""

    name: str
    base: str
    """Name of the measured profile in :data:`SHIPPED_PROFILES`."""
    base_gpu: GpuFigures
    gpu: GpuFigures
    crossover_decode_fraction: float
    """Decode share where the paper saw mixed steps' marginal cost cross pure decode's."""
    reference_decode_context_tokens: int
    reference: str
    kv_bytes_per_token: int
    gpu_memory_utilization: float = 0.85
    """The base measurement's setting, kept."""


DERIVED_PROFILES: tuple[DerivedSpec, ...] = (
    DerivedSpec(
        "rtxpro6000-llama31-8b-derived", "h100-llama31-8b", H100_SXM, RTX_PRO_6000,
        crossover_decode_fraction=0.2, reference_decode_context_tokens=1024, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
        reference="seed 002 (exclusive batching): on an RTX PRO 6000 (1.792 TB/s) the mixed-batch per-token "
                  "marginal cost exceeds pure decode's from a decode share of about 20% (H200, 4.8 TB/s: about "
                  "80%); Table 1 for the GPU's figures",
    ),
)


def _csv_line(cells: Sequence[Any]) -> str:
    out = [str(cells[0])]
    for col, value in zip(RECORD_COLUMNS[1:], cells[1:], strict=True):
        out.append(_FORMATS[col].format(float(value)) if col in _FORMATS else str(int(value)))
    return ",".join(out)


def format_records(records: Records) -> str:
    """CSV text of a records array (header :data:`RECORD_COLUMNS`, fixed float formats)."""
    lines = [",".join(RECORD_COLUMNS)]
    lines += [_csv_line(tuple(row)) for row in records.tolist()]
    return "\n".join(lines) + "\n"


def collect_records(runs: Sequence[dict[str, Any]], workloads: Sequence[str]) -> Records:
    """Steps of ``workloads`` in each probe run (in order), rounded to the CSV's precision."""
    lines = [",".join(RECORD_COLUMNS)]
    for run in runs:
        for result in run["results"]:
            if result["tag"] in workloads:
                start, stop = result["steps"]
                lines += [_csv_line([result["tag"], s["t"], *(s[c] for c in RECORD_COLUMNS[2:])])
                          for s in run["steps"][start:stop]]
    return parse_records("\n".join(lines) + "\n")


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
    """Usable KV blocks of one engine from its records, and the evidence (see module docstring)."""
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


def _describe(summary: str, usable: int, block_size: int, ev: KvCapacityEvidence,
              kv_bytes_per_token: int | None, max_ctx: int) -> str:
    cap = usable * block_size
    how = (f"exact: every recorded kv equals used_blocks / {usable:,} (the only such denominator within "
           "10% of the ctx/kv estimate; uncertainty: vLLM's null-block convention, 1 block)"
           if ev.method == "exact-denominator" else "rounded median of ctx/kv (uncertainty about +-1%)")
    below = 100.0 * (1.0 - ev.ctx_over_kv_median_tokens / cap)
    size = (f" = {cap * kv_bytes_per_token / 2**30:.1f} GiB at {kv_bytes_per_token // 1024} KiB/token"
            if kv_bytes_per_token else "")
    return (f"{summary} KV cache: {usable + 1:,} vLLM blocks of {block_size} tokens per engine "
            f"({usable:,} usable after the null block = {cap:,} tokens{size}); {how}. "
            f"Cross-check: median ctx/kv over {ev.num_steps:,} decode-only steps with kv > 0.05 = "
            f"{ev.ctx_over_kv_median_tokens:,.0f} tokens (IQR {ev.ctx_over_kv_p25_tokens:,.0f}-"
            f"{ev.ctx_over_kv_p75_tokens:,.0f}), {below:.1f}% below (partly filled last blocks). "
            f"Largest recorded step context: {max_ctx:,} tokens.")


def fit_loop_overhead(runs: Sequence[dict[str, Any]], workloads: Sequence[str]) -> tuple[float, float]:
    """Per-step engine-loop time outside the recorded window: ``gap = g0 + g1 * scheduled_requests``.

    The records time each step from the start of ``schedule()`` to the end of ``update_from_output()``;
    a workload's wall time also holds the rest of ``LLMEngine.step()`` (output processing). Per workload,
    ``wall - sum(t) = g0 * steps + g1 * sum(nreq)``; least squares over the calibration workloads, clipped
    at zero. Returns ``(g0, g1)`` in seconds.
    """
    rows: list[tuple[float, float]] = []
    gaps: list[float] = []
    for run in runs:
        for result in run["results"]:
            if result["tag"] not in workloads:
                continue
            start, stop = result["steps"]
            steps = run["steps"][start:stop]
            rows.append((float(len(steps)), float(sum(s["nreq"] for s in steps))))
            gaps.append(float(result["wall"]) - float(sum(s["t"] for s in steps)))
    coef, *_ = np.linalg.lstsq(np.array(rows), np.array(gaps), rcond=None)
    return max(float(coef[0]), 0.0), max(float(coef[1]), 0.0)


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
) -> tuple[float, InterferenceFit]:
    """Least-squares ``kappa`` of ``t = L * (1 + kappa * rho * (1 - rho))`` given the linear ``L``; its errors.

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
    mixed = (records["pre_tok"] > 0) & (records["dec"] > 0)
    cal = np.isin(records["workload"], tuple(calibration_workloads))
    parts = [mixed, mixed & cal, mixed & ~cal]
    n = [int(m.sum()) for m in parts]
    before = [_mixed_mape(t[m], lin[m]) for m in parts]
    after = [_mixed_mape(t[m], pred[m]) for m in parts]
    fitted_on = KAPPA_FITTED_ON_PROBE if schedule_s is not None else "all records (no schedule() times to replace)"
    return kappa, InterferenceFit(
        n[0], before[0], after[0], n[1], before[1], after[1], n[2], before[2], after[2],
        kappa_unadjusted=_least_squares_kappa(t, lin, g), fitted_on=fitted_on,
    )


def collect_schedule_s(runs: Sequence[dict[str, Any]], workloads: Sequence[str]) -> npt.NDArray[np.float64]:
    """``t_sched`` (seconds in vLLM's ``schedule()``) of the steps :func:`collect_records` returns, same order."""
    return np.array([s["t_sched"] for run in runs for result in run["results"] if result["tag"] in workloads
                     for s in run["steps"][result["steps"][0]:result["steps"][1]]], dtype=np.float64)


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
    kappa, interference = fit_interference_kappa(records, coefs, source.calibration_workloads, schedule_s,
                                                  sched_overhead_s)
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
    )


def derive_profile(
    name: str,
    calibration_json_paths: Sequence[Path | str],
    description: str,
    *,
    model: str | None,
    kv_bytes_per_token: int | None = None,
    engines_per_gpu: int = 1,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 512,
    max_model_len: int = 16384,
    measured_date: str = MEASURED_DATE,
    vllm_version: str = VLLM_VERSION,
    calibration_workloads: tuple[str, ...] = CALIBRATION_WORKLOADS,
    holdout_workloads: tuple[str, ...] = HOLDOUT_WORKLOADS,
) -> tuple[Profile, Records]:
    """Build profile ``name`` from probe files; return it and its step records.

    ``description`` is the hand-written summary; the KV derivation is appended (with its size in GiB when
    ``kv_bytes_per_token`` is given). The probe's engine settings (``block_size`` ... ``max_model_len``,
    tokens) are not in the files and are passed in; ``model`` None takes the last part of the files' model
    path. With several files (engines sharing a GPU) the records are concatenated in file order and
    ``num_gpu_blocks`` is the smallest per-engine value.
    """
    paths = [Path(p) for p in calibration_json_paths]
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    gpus, eager = {r["gpu"] for r in runs}, {bool(r["eager"]) for r in runs}
    if len(gpus) != 1 or len(eager) != 1:
        raise ValueError(f"files mix GPUs or modes: {sorted(gpus)}, eager={sorted(eager)}")
    workloads = calibration_workloads + holdout_workloads
    records = collect_records(runs, workloads)
    per_engine = [derive_kv_blocks(collect_records([r], workloads), block_size) for r in runs]
    usable, evidence = min(per_engine, key=lambda pe: pe[0])
    sched_overhead = float(np.median(collect_schedule_s(runs, calibration_workloads)))
    profile = fit_profile(
        records, name=name,
        description=_describe(description, usable, block_size, evidence, kv_bytes_per_token,
                              int(records["ctx"].max())),
        gpu=gpus.pop(), model=model if model is not None else Path(str(runs[0].get("model", "unknown"))).name,
        mode="eager" if eager.pop() else "cuda-graphs", engines_per_gpu=engines_per_gpu,
        source=ProfileSource(tuple(p.name for p in paths), measured_date, vllm_version,
                             calibration_workloads, holdout_workloads),
        block_size=block_size, usable_blocks=usable, kv_evidence=evidence,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        loop_overhead=fit_loop_overhead(runs, calibration_workloads), sched_overhead_s=sched_overhead,
        schedule_s=collect_schedule_s(runs, workloads),
    )
    return profile, records


def _as_shipped(profile: Profile) -> Profile:
    """``profile`` as :func:`agent.engine.profiles.load_profile` will read it back (6 significant digits)."""
    return profile_from_json(json.loads(json.dumps(profile_to_json(profile))))


def derive_bandwidth_scaled_profile(base: Profile, spec: DerivedSpec) -> Profile:
    """A profile for the same model and engine settings on another GPU, computed, never measured.

    From the base profile's coefficients as shipped (``a, b, c``) and the two GPUs' published figures:

    * ``a' = a * BW / BW'`` and ``c' = c * BW / BW'``: the fixed cost is mostly reading the weights once per
      step (8B: ~15 GiB / 3.35 TB/s = 4.8 ms of the H100's 9.1 ms) and ``c`` is reading the KV cache per
      context token, both memory-bound. The rest of ``a`` (``schedule()``, about 1 ms, and kernel launches)
      does not scale with bandwidth, so ``a'`` overstates by up to ~1 ms.
    * ``b' = b * F / F'`` with ``F`` the dense BF16 tensor throughput: the per-token GEMMs are
      compute-bound. ``F'`` is the paper's Table 1 figure (252 TFLOPS); see ``docs/simulator.md`` on why it
      may be half the GPU's dense peak.
    * KV capacity: the base measurement's KV budget is ``u * M - W - R`` (``u`` the
      ``gpu_memory_utilization``, ``M`` the GPU memory, ``W`` the weights, ``R`` the activation and CUDA-graph
      reserve). Same model and settings keep ``W`` and ``R``, so the extra memory adds
      ``u * (M' - M) / (block_size * bytes per token)`` blocks to the base's usable blocks.
    * ``kappa`` (:func:`agent.engine.timing.kappa_for_crossover`): the value that puts the crossover of the
      mixed-step and pure-decode per-token marginal costs at the paper's decode share, at the stated
      reference decode context, given ``a', b', c'`` (closed form: ``kappa = c'(C - 1) / (rho (b' + c' +
      rho c'(C - 1)))``).

    Noise, engine-loop and ``schedule()`` overheads and engine limits are copied from the base (host-side,
    or settings). Fit statistics, records and KV evidence do not exist.
    """
    bw = spec.base_gpu.memory_bandwidth_tb_per_s / spec.gpu.memory_bandwidth_tb_per_s
    fl = spec.base_gpu.dense_bf16_tflops / spec.gpu.dense_bf16_tflops
    base = _as_shipped(base)
    c0 = base.coefficients
    kv_bytes_per_token = spec.kv_bytes_per_token
    block_bytes = base.block_size * kv_bytes_per_token
    extra_blocks = math.floor(spec.gpu_memory_utilization * (spec.gpu.memory_gib - spec.base_gpu.memory_gib)
                              * 2**30 / block_bytes)
    usable = base.usable_gpu_blocks + extra_blocks
    cap = usable * base.block_size
    method = (
        f"DERIVED FROM A PAPER'S FIGURES, NOT MEASURED. Scaled from {spec.base}: a and c (memory-bound: weight "
        f"and KV reads) x {bw:.4f} = {spec.base_gpu.memory_bandwidth_tb_per_s:g} / "
        f"{spec.gpu.memory_bandwidth_tb_per_s:g} TB/s; b (compute-bound) x {fl:.4f} = "
        f"{spec.base_gpu.dense_bf16_tflops:g} / {spec.gpu.dense_bf16_tflops:g} TFLOPS; KV cache: the base's "
        f"{base.usable_gpu_blocks:,} usable blocks + {spec.gpu_memory_utilization:g} x "
        f"({spec.gpu.memory_gib:g} - {spec.base_gpu.memory_gib:g}) GiB / {block_bytes // 2**20} MiB per block "
        f"= {extra_blocks:,} more (same weights and activation reserve); kappa puts the crossover of the mixed "
        f"and pure-decode per-token marginal costs at decode share {spec.crossover_decode_fraction:g} at a "
        f"{spec.reference_decode_context_tokens:,}-token decode context. Noise, loop overheads and engine "
        f"limits copied from {spec.base}."
    )
    derived = replace(
        base,
        name=spec.name,
        description=(
            f"{base.model} on one {spec.gpu.name}, the vLLM settings of {spec.base}. {method} Result: "
            f"{usable + 1:,} vLLM blocks of {base.block_size} tokens ({usable:,} usable = {cap:,} tokens = "
            f"{cap * kv_bytes_per_token / 2**30:.1f} GiB at {kv_bytes_per_token // 1024} KiB/token). GPU figures: "
            f"{spec.gpu.source}; base GPU: {spec.base_gpu.source}."
        ),
        gpu=f"{spec.gpu.name} (derived, not measured)",
        source=None,
        coefficients=StepCoefficients(a_s=c0.a_s * bw, b_s=c0.b_s * fl, c_s=c0.c_s * bw),
        fit=None, holdout=None, kv_evidence=None, decode_only=None, mixed=None, interference=None,
        num_gpu_blocks=usable + 1,
        derived_from=Derivation(
            base_profile=spec.base, reference=spec.reference,
            memory_bandwidth_tb_per_s=spec.gpu.memory_bandwidth_tb_per_s,
            base_memory_bandwidth_tb_per_s=spec.base_gpu.memory_bandwidth_tb_per_s,
            dense_bf16_tflops=spec.gpu.dense_bf16_tflops, base_dense_bf16_tflops=spec.base_gpu.dense_bf16_tflops,
            memory_gib=spec.gpu.memory_gib, base_memory_gib=spec.base_gpu.memory_gib,
            crossover_decode_fraction=spec.crossover_decode_fraction,
            reference_decode_context_tokens=spec.reference_decode_context_tokens, method=method,
        ),
    )
    coefs = _as_shipped(derived).coefficients  # kappa from the coefficients exactly as shipped
    kappa = kappa_for_crossover(coefs, spec.crossover_decode_fraction, spec.reference_decode_context_tokens)
    return _as_shipped(replace(derived, interference_kappa=kappa))


def _write_json(profile: Profile, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{profile.name}.json"
    json_path.write_text(json.dumps(profile_to_json(profile), indent=2) + "\n", encoding="utf-8")
    return json_path


def write_profile(profile: Profile, records: Records | None, out_dir: Path | str) -> list[Path]:
    """Write ``<name>.json`` and (measured profiles) ``<name>.records.csv.gz`` into ``out_dir``.

    Byte-for-byte deterministic.
    """
    out = Path(out_dir)
    json_path = _write_json(profile, out)
    if records is None:
        return [json_path]
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(format_records(records).encode("utf-8"))
    csv_path = out / f"{profile.name}.records.csv.gz"
    csv_path.write_bytes(buf.getvalue())
    return [json_path, csv_path]


def default_shared_dir() -> Path:
    """``$TRACKSIDE_SHARED`` if set, else ``shared/`` next to the repository root."""
    env = os.environ.get("TRACKSIDE_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


def regenerate(calibration_dir: Path, out_dir: Path) -> list[Profile]:
    """Derive and write every profile of :data:`SHIPPED_PROFILES`, then of :data:`DERIVED_PROFILES`."""
    profiles = []
    for spec in SHIPPED_PROFILES:
        profile, records = derive_profile(
            spec.name, [calibration_dir / f for f in spec.files], spec.summary, model=spec.model,
            kv_bytes_per_token=spec.kv_bytes_per_token, engines_per_gpu=spec.engines_per_gpu,
        )
        write_profile(profile, records, out_dir)
        profiles.append(profile)
    measured = {p.name: p for p in profiles}
    for dspec in DERIVED_PROFILES:
        derived = derive_bandwidth_scaled_profile(measured[dspec.base], dspec)
        write_profile(derived, None, out_dir)
        profiles.append(derived)
    return profiles


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: regenerate the shipped profiles and print a summary."""
    parser = argparse.ArgumentParser(prog="python -m agent.engine.calibration",
                                     description="Regenerate the shipped calibration profiles.")
    parser.add_argument("--shared", type=Path, default=default_shared_dir() / "calibration",
                        help="folder with the probe JSON files (default: $TRACKSIDE_SHARED/calibration)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "profiles",
                        help="where to write the profile files (default: the package's profiles folder)")
    args = parser.parse_args(argv)
    for p in regenerate(args.shared, args.out):
        c = p.coefficients
        head = (f"{p.name:30s} a={c.a_s * 1e3:.3f} ms b={c.b_s * 1e6:.2f} us c={c.c_s * 1e9:.1f} ns "
                f"kappa={p.interference_kappa:.3f} blocks={p.num_gpu_blocks}")
        if p.fit is None or p.holdout is None or p.kv_evidence is None:
            print(f"{head} (derived from {p.derived_from.base_profile if p.derived_from else '?'}, not measured)")
            continue
        print(f"{head} ({p.kv_evidence.method}) R2={p.fit.r2:.4f} MAPE={p.fit.mape:.3f} "
              f"holdout R2={p.holdout.r2:.4f} MAPE={p.holdout.mape:.3f} "
              f"sigma={p.noise_sigma:.3f} (std {p.noise_sigma_std:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
