"""The JSON layout of a calibration profile: :func:`profile_to_json` and its inverse :func:`profile_from_json`.

Human-readable, units in the key names, floats rounded to 6 significant digits (so the shipped files are
stable and diff well), versioned by :data:`SCHEMA_VERSION`. The fields are described with the dataclasses in
:mod:`agent.engine.profile_types`; reading files is :mod:`agent.engine.profiles`.
"""

from __future__ import annotations

import math
from typing import Any

from agent.engine.profile_types import (
    KAPPA_FITTED_ON_PROBE,
    Derivation,
    InterferenceFit,
    KvCapacityEvidence,
    PhaseFit,
    Profile,
    ProfileSource,
)
from policies.cost.fit import FitStats
from policies.cost.step_model import StepCoefficients

SCHEMA_VERSION = 2
"""Version of the JSON layout written by :func:`profile_to_json` (2: interference, derived profiles)."""


def _sig(x: float, digits: int = 6) -> float:
    """``x`` rounded to ``digits`` significant digits (stable, human-readable JSON)."""
    return float(f"{x:.{digits}g}")


def _sig_or_none(x: float) -> float | None:
    """:func:`_sig`, or None (JSON null) for NaN: an error over no steps (a profile without a holdout)."""
    return None if math.isnan(x) else _sig(x)


def _float_or_nan(x: Any) -> float:
    return math.nan if x is None else float(x)


def _step_model_json(c: StepCoefficients) -> dict[str, float]:
    return {"a_ms": _sig(c.a_s * 1e3), "b_us_per_token": _sig(c.b_s * 1e6),
            "c_ns_per_context_token": _sig(c.c_s * 1e9)}


def _step_model_from(d: dict[str, Any]) -> StepCoefficients:
    return StepCoefficients(a_s=float(d["a_ms"]) * 1e-3, b_s=float(d["b_us_per_token"]) * 1e-6,
                            c_s=float(d["c_ns_per_context_token"]) * 1e-9)


def _stats_json(s: FitStats) -> dict[str, float | int]:
    return {"num_steps": s.n, "r2": _sig(s.r2), "mape_fraction": _sig(s.mape)}


def _stats_from(d: dict[str, Any]) -> FitStats:
    return FitStats(n=int(d["num_steps"]), r2=float(d["r2"]), mape=float(d["mape_fraction"]))


def _phase_json(p: PhaseFit | None) -> dict[str, Any] | None:
    return None if p is None else {"step_model": _step_model_json(p.coefficients), "fit": _stats_json(p.fit)}


def _phase_from(d: dict[str, Any] | None) -> PhaseFit | None:
    return None if d is None else PhaseFit(_step_model_from(d["step_model"]), _stats_from(d["fit"]))


def _source_json(p: Profile) -> dict[str, Any] | None:
    if p.source is None:
        return None
    return {
        "files": list(p.source.files), "measured_date": p.source.measured_date,
        "vllm_version": p.source.vllm_version,
        "calibration_workloads": list(p.source.calibration_workloads),
        "holdout_workloads": list(p.source.holdout_workloads),
        "records_file": f"{p.name}.records.csv.gz",
    }


def _source_from(d: dict[str, Any] | None) -> ProfileSource | None:
    if d is None:
        return None
    return ProfileSource(
        files=tuple(d["files"]), measured_date=d["measured_date"], vllm_version=d["vllm_version"],
        calibration_workloads=tuple(d["calibration_workloads"]), holdout_workloads=tuple(d["holdout_workloads"]),
    )


def _interference_json(p: Profile) -> dict[str, Any]:
    f = p.interference
    fit = None if f is None else {
        "num_mixed_steps": f.num_steps, "mixed_mape_linear_fraction": _sig_or_none(f.mape_linear),
        "mixed_mape_fraction": _sig_or_none(f.mape), "num_calibration_mixed_steps": f.calibration_num_steps,
        "calibration_mixed_mape_linear_fraction": _sig_or_none(f.calibration_mape_linear),
        "calibration_mixed_mape_fraction": _sig_or_none(f.calibration_mape),
        "num_holdout_mixed_steps": f.holdout_num_steps,
        "holdout_mixed_mape_linear_fraction": _sig_or_none(f.holdout_mape_linear),
        "holdout_mixed_mape_fraction": _sig_or_none(f.holdout_mape), "kappa_unadjusted": _sig(f.kappa_unadjusted),
        "mixed_mape_attention_fraction": _sig_or_none(f.mape_attention),
        "calibration_mixed_mape_attention_fraction": _sig_or_none(f.calibration_mape_attention),
        "holdout_mixed_mape_attention_fraction": _sig_or_none(f.holdout_mape_attention),
    }
    return {"kappa": _sig(p.interference_kappa), "factor": "1 + kappa * rho * (1 - rho), rho = decode / new tokens",
            "kappa_attention": _sig(p.interference_kappa_attention),
            "factor_attention": "on the context term only: a + b * new + c * ctx * (1 + kappa_attention * rho * "
            "(1 - rho))",
            "fitted_on": None if f is None else f.fitted_on, "fit": fit}


def _interference_from(d: dict[str, Any] | None, fitted_on: str | None) -> InterferenceFit | None:
    if d is None:
        return None
    return InterferenceFit(
        num_steps=int(d["num_mixed_steps"]), mape_linear=_float_or_nan(d["mixed_mape_linear_fraction"]),
        mape=_float_or_nan(d["mixed_mape_fraction"]), calibration_num_steps=int(d["num_calibration_mixed_steps"]),
        calibration_mape_linear=_float_or_nan(d["calibration_mixed_mape_linear_fraction"]),
        calibration_mape=_float_or_nan(d["calibration_mixed_mape_fraction"]),
        holdout_num_steps=int(d["num_holdout_mixed_steps"]),
        holdout_mape_linear=_float_or_nan(d["holdout_mixed_mape_linear_fraction"]),
        holdout_mape=_float_or_nan(d["holdout_mixed_mape_fraction"]), kappa_unadjusted=float(d["kappa_unadjusted"]),
        fitted_on=fitted_on or KAPPA_FITTED_ON_PROBE,
        mape_attention=_float_or_nan(d.get("mixed_mape_attention_fraction")),
        calibration_mape_attention=_float_or_nan(d.get("calibration_mixed_mape_attention_fraction")),
        holdout_mape_attention=_float_or_nan(d.get("holdout_mixed_mape_attention_fraction")),
    )


def _derivation_json(d: Derivation | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {
        "measured": False, "base_profile": d.base_profile, "reference": d.reference,
        "memory_bandwidth_tb_per_s": _sig(d.memory_bandwidth_tb_per_s),
        "base_memory_bandwidth_tb_per_s": _sig(d.base_memory_bandwidth_tb_per_s),
        "dense_bf16_tflops": _sig(d.dense_bf16_tflops), "base_dense_bf16_tflops": _sig(d.base_dense_bf16_tflops),
        "memory_gib": _sig(d.memory_gib), "base_memory_gib": _sig(d.base_memory_gib),
        "crossover_decode_fraction": (
            None if d.crossover_decode_fraction is None else _sig(d.crossover_decode_fraction)
        ),
        "reference_decode_context_tokens": d.reference_decode_context_tokens, "method": d.method,
    }


def _derivation_from(d: dict[str, Any] | None) -> Derivation | None:
    if d is None:
        return None
    return Derivation(
        base_profile=d["base_profile"], reference=d["reference"],
        memory_bandwidth_tb_per_s=float(d["memory_bandwidth_tb_per_s"]),
        base_memory_bandwidth_tb_per_s=float(d["base_memory_bandwidth_tb_per_s"]),
        dense_bf16_tflops=float(d["dense_bf16_tflops"]), base_dense_bf16_tflops=float(d["base_dense_bf16_tflops"]),
        memory_gib=float(d["memory_gib"]), base_memory_gib=float(d["base_memory_gib"]),
        crossover_decode_fraction=(
            None if d["crossover_decode_fraction"] is None else float(d["crossover_decode_fraction"])
        ),
        reference_decode_context_tokens=int(d["reference_decode_context_tokens"]), method=d["method"],
    )


def _kv_json(p: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {
        "block_size_tokens": p.block_size, "num_gpu_blocks": p.num_gpu_blocks,
        "num_usable_blocks": p.usable_gpu_blocks, "capacity_tokens": p.kv_capacity_tokens,
    }
    ev = p.kv_evidence
    if ev is None:
        return {**out, "method": "derived"}
    return {
        **out, "method": ev.method, "num_steps_ctx_over_kv": ev.num_steps,
        "ctx_over_kv_median_tokens": _sig(ev.ctx_over_kv_median_tokens),
        "ctx_over_kv_p25_tokens": _sig(ev.ctx_over_kv_p25_tokens),
        "ctx_over_kv_p75_tokens": _sig(ev.ctx_over_kv_p75_tokens),
    }


def _kv_evidence_from(kv: dict[str, Any]) -> KvCapacityEvidence | None:
    if kv["method"] == "derived":
        return None
    return KvCapacityEvidence(
        method=kv["method"], num_steps=int(kv["num_steps_ctx_over_kv"]),
        ctx_over_kv_median_tokens=float(kv["ctx_over_kv_median_tokens"]),
        ctx_over_kv_p25_tokens=float(kv["ctx_over_kv_p25_tokens"]),
        ctx_over_kv_p75_tokens=float(kv["ctx_over_kv_p75_tokens"]),
    )


def profile_to_json(p: Profile) -> dict[str, Any]:
    """The JSON document of a profile (floats to 6 significant digits, units in the key names)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": p.name,
        "description": p.description,
        "gpu": p.gpu,
        "model": p.model,
        "mode": p.mode,
        "engines_per_gpu": p.engines_per_gpu,
        "derived_from": _derivation_json(p.derived_from),
        "source": _source_json(p),
        "step_model": _step_model_json(p.coefficients),
        "fit": None if p.fit is None else _stats_json(p.fit),
        "holdout": None if p.holdout is None else _stats_json(p.holdout),
        "decode_only": _phase_json(p.decode_only),
        "mixed": _phase_json(p.mixed),
        "interference": _interference_json(p),
        "noise": {"sigma_log": _sig(p.noise_sigma), "sigma_log_std": _sig(p.noise_sigma_std),
                  "median_log_ratio": _sig(p.noise_log_median)},
        "kv_cache": _kv_json(p),
        "engine": {"max_num_batched_tokens": p.max_num_batched_tokens, "max_num_seqs": p.max_num_seqs,
                   "max_model_len_tokens": p.max_model_len, "sched_overhead_ms": _sig(p.sched_overhead_s * 1e3),
                   "loop_overhead_ms": _sig(p.loop_overhead_s * 1e3),
                   "loop_overhead_us_per_request": _sig(p.loop_overhead_per_request_s * 1e6)},
    }


def profile_from_json(d: dict[str, Any]) -> Profile:
    """Inverse of :func:`profile_to_json`. Raises ValueError on another schema version."""
    if d.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"profile schema_version {d.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    kv, eng, noise, inter = d["kv_cache"], d["engine"], d["noise"], d["interference"]
    return Profile(
        name=d["name"], description=d["description"], gpu=d["gpu"], model=d["model"], mode=d["mode"],
        engines_per_gpu=int(d["engines_per_gpu"]),
        source=_source_from(d["source"]),
        coefficients=_step_model_from(d["step_model"]),
        fit=None if d["fit"] is None else _stats_from(d["fit"]),
        holdout=None if d["holdout"] is None else _stats_from(d["holdout"]),
        noise_sigma=float(noise["sigma_log"]), noise_sigma_std=float(noise["sigma_log_std"]),
        noise_log_median=float(noise["median_log_ratio"]),
        block_size=int(kv["block_size_tokens"]), num_gpu_blocks=int(kv["num_gpu_blocks"]),
        kv_evidence=_kv_evidence_from(kv),
        max_num_batched_tokens=int(eng["max_num_batched_tokens"]), max_num_seqs=int(eng["max_num_seqs"]),
        max_model_len=int(eng["max_model_len_tokens"]), sched_overhead_s=float(eng["sched_overhead_ms"]) * 1e-3,
        loop_overhead_s=float(eng["loop_overhead_ms"]) * 1e-3,
        loop_overhead_per_request_s=float(eng["loop_overhead_us_per_request"]) * 1e-6,
        decode_only=_phase_from(d.get("decode_only")), mixed=_phase_from(d.get("mixed")),
        interference_kappa=float(inter["kappa"]), interference=_interference_from(inter["fit"], inter.get("fitted_on")),
        derived_from=_derivation_from(d["derived_from"]),
        interference_kappa_attention=float(inter.get("kappa_attention", 0.0)),
    )
