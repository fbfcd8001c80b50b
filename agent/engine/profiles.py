"""Calibration profiles: measured step-time models and engine limits for the simulator and the policies.

A profile describes one engine configuration measured on real hardware (``shared/calibration``, H100 80GB
HBM3, vLLM 0.26.0, 2026-11-22): the step-time model ``T = a + b * new_tokens + c * context_tokens`` fitted
over the calibration workloads (``mix``, ``longctx``, ``small``, ``dec128``: exactly the steps of
``probe.py``'s ``all`` fit), its error there and on the ``sharegpt_like`` workload it never saw (holdout), a
multiplicative noise level, the mixed-batch interference ``kappa`` (fitted on all its records, see
:func:`agent.engine.calibration.fit_interference_kappa`), the KV-cache capacity and the scheduler limits the
runs used.

A *derived* profile (``derived_from`` set, ``"derived"`` in its name) was never measured: it is computed from
a measured one and published hardware figures (:mod:`agent.engine.calibration`, ``DERIVED_PROFILES``). It has
no step records, so ``source``, ``fit``, ``holdout``, ``kv_evidence``, ``decode_only``, ``mixed`` and
``interference`` are None, and :func:`load_records` refuses it.

KV capacity (``num_gpu_blocks``). vLLM reports KV usage as ``1 - free_blocks / (num_gpu_blocks - 1)``
(block 0 is its reserved null block), so every recorded ``kv`` is ``used_blocks / U`` with an integer
``used_blocks`` and ``U = num_gpu_blocks - 1`` usable blocks. :mod:`agent.engine.calibration` finds ``U``
exactly: the one integer within 10% of the rough estimate ``median(ctx / kv) / block_size`` for which
``kv * U`` is integral in every recorded step (to 1e-3 with ``kv`` stored to 1e-10; a wrong ``U`` misses
by ~0.5). The rough estimate (median of ``ctx / kv`` over decode-only
steps with ``kv > 0.05``, where every running request is scheduled) is kept in the profile as a
cross-check; it sits 0.5-0.6% below the exact capacity because the last block of each request is only
partly filled. The remaining uncertainty is the null-block convention (one block) and, if a later vLLM
changes the usage formula, the fallback to the rough estimate (about +-1%).

Files: ``profiles/<name>.json`` (human-readable, units in the key names) and, for measured profiles,
``profiles/<name>.records.csv.gz`` (the steps the profile was derived from), read with
:mod:`importlib.resources`. The ``profiles/`` folder has no ``__init__.py`` on purpose: a package
``agent/engine/profiles/`` would shadow this module (a regular package wins over a module of the same
name), so it is a namespace data folder (setuptools still installs it through ``package-data``).
Regenerate every file with ``python -m agent.engine.calibration``.

:func:`load_profile` also takes the path of a profile JSON file written elsewhere, by ``trackside calibrate
--out FILE.json`` (:mod:`agent.engine.step_calibration`), which any node can run on its own recorded steps.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

from policies.cost.fit import FitStats, evaluate
from policies.cost.step_model import StepCoefficients

DEFAULT_PROFILE = "h100-llama31-8b"
"""The profile to use when none is named: Llama-3.1-8B, one H100, CUDA graphs."""
SCHEMA_VERSION = 2
"""Version of the JSON layout written by :func:`profile_to_json` (2: interference, derived profiles)."""
RECORD_COLUMNS = ("workload", "t_s", "new", "pre_tok", "dec", "npre", "ctx", "nreq", "kv")
"""Columns of ``<name>.records.csv.gz``: workload tag, step seconds, tokens computed, prefill tokens,
decode tokens, prefilling requests, context tokens, scheduled requests, KV usage fraction after the step."""
RECORD_DTYPE = np.dtype(
    [("workload", "U16"), ("t_s", "f8"), ("new", "i8"), ("pre_tok", "i8"), ("dec", "i8"),
     ("npre", "i8"), ("ctx", "i8"), ("nreq", "i8"), ("kv", "f8")]
)
"""numpy dtype of :func:`load_records` (same fields as :data:`RECORD_COLUMNS`)."""

Records = npt.NDArray[np.void]


class UnknownProfileError(KeyError):
    """No shipped profile has this name; the message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProfileFileError(UnknownProfileError):
    """A profile file that is missing or is not a profile; the message says which. A subclass of
    :class:`UnknownProfileError` so that every command reporting an unknown profile reports this too."""


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
    used: it mistakes vLLM's per-request scheduling cost for interference, see the calibration module)."""
    fitted_on: str = KAPPA_FITTED_ON_PROBE
    """What ``kappa`` was fitted on, in words (the default: a probe file's steps, which time ``schedule()``)."""


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
    crossover_decode_fraction: float
    """Decode share at which a mixed step's per-token marginal cost equals pure decode's (sets ``kappa``)."""
    reference_decode_context_tokens: int
    """Decode context at which that crossover is placed (:func:`agent.engine.timing.marginal_cost_crossover`)."""
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
    }
    return {"kappa": _sig(p.interference_kappa), "factor": "1 + kappa * rho * (1 - rho), rho = decode / new tokens",
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
        "crossover_decode_fraction": _sig(d.crossover_decode_fraction),
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
        crossover_decode_fraction=float(d["crossover_decode_fraction"]),
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
    )


def parse_records(text: str) -> Records:
    """Parse the CSV text of a records file into a structured array of :data:`RECORD_DTYPE`."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(header) != RECORD_COLUMNS:
        raise ValueError(f"records header {header!r}, expected {','.join(RECORD_COLUMNS)}")
    rows = [tuple(row) for row in reader if row]
    out = np.empty(len(rows), dtype=RECORD_DTYPE)
    for j, field in enumerate(RECORD_COLUMNS):
        out[field] = [row[j] for row in rows]
    return out


def _data_dir() -> Traversable:
    return resources.files("agent.engine").joinpath("profiles")


@lru_cache(maxsize=1)
def _profile_names() -> tuple[str, ...]:
    return tuple(sorted(e.name.removesuffix(".json") for e in _data_dir().iterdir() if e.name.endswith(".json")))


def list_profiles() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return list(_profile_names())


def _check_name(name: str) -> None:
    known = _profile_names()
    if name not in known:
        raise UnknownProfileError(
            f"unknown profile {name!r}; known profiles: {', '.join(known)} (or the path of a profile JSON file, "
            "e.g. ./my-node.json from `trackside calibrate`)"
        )


def is_profile_path(name: str) -> bool:
    """True when ``name`` names a file rather than a shipped profile: it ends in ``.json``, has a directory or
    is an existing file."""
    return name.endswith(".json") or "/" in name or os.sep in name or Path(name).is_file()


def load_profile(name: str = DEFAULT_PROFILE) -> Profile:
    """The shipped profile ``name``, or the profile in the JSON file at path ``name`` (:func:`is_profile_path`).

    Raises :class:`UnknownProfileError` (a KeyError) listing the known ones for an unknown name, and
    :class:`ProfileFileError` (a subclass) for a file that is missing or not a profile. Shipped profiles are
    cached (the same object every time); a file is read again on every call.
    """
    if name not in _profile_names() and is_profile_path(name):
        return load_profile_file(name)
    return _load_shipped(name)


@cache
def _load_shipped(name: str) -> Profile:
    _check_name(name)
    return profile_from_json(json.loads(_data_dir().joinpath(f"{name}.json").read_text(encoding="utf-8")))


def load_profile_file(path: str | Path) -> Profile:
    """The profile in a JSON file (the layout of :func:`profile_to_json`); :class:`ProfileFileError` if it
    cannot be read or is not a profile of this :data:`SCHEMA_VERSION`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFileError(f"no profile file at {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileFileError(f"cannot read profile file {path}: {exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{path} is not a profile: invalid JSON ({exc})") from None
    if not isinstance(doc, dict) or "step_model" not in doc:
        raise ProfileFileError(f"{path} is not a profile: no step_model (write one with `trackside calibrate`)")
    try:
        return profile_from_json(doc)
    except (KeyError, TypeError, ValueError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ProfileFileError(f"{path} is not a usable profile: {what}") from None


class NoRecordsError(LookupError):
    """The profile was derived, not measured: it has no step records."""


@cache
def load_records(name: str = DEFAULT_PROFILE) -> Records:
    """The step records behind profile ``name`` (read-only structured array, :data:`RECORD_DTYPE`).

    Raises :class:`NoRecordsError` for a derived profile. Shipped profiles only (a profile file's records lie
    next to it: :func:`read_records_file`).
    """
    profile = _load_shipped(name)
    if profile.derived_from is not None:
        raise NoRecordsError(f"profile {name!r} is derived from {profile.derived_from.base_profile!r}, "
                             "not measured: it has no step records")
    raw = _data_dir().joinpath(f"{name}.records.csv.gz").read_bytes()
    records = parse_records(gzip.decompress(raw).decode("utf-8"))
    records.flags.writeable = False
    return records


def read_records_file(path: str | Path) -> Records:
    """The records of a ``.records.csv.gz`` file (or a plain ``.csv``) written with a profile."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    return parse_records(text)


class StatsReport(TypedDict):
    """Error of a profile's coefficients on one set of steps."""

    n: int
    r2: float
    mape: float


class FitReport(TypedDict):
    """Coefficients of a profile and their error on its calibration and holdout steps.

    ``calibration`` and ``holdout`` are None for a derived profile, whose ``derived_from`` names the
    measured profile it was computed from (None for measured ones).
    """

    name: str
    a_ms: float
    b_us_per_token: float
    c_ns_per_context_token: float
    interference_kappa: float
    derived_from: str | None
    calibration: StatsReport | None
    holdout: StatsReport | None


def select(records: Records, workloads: tuple[str, ...]) -> Records:
    """The rows of ``records`` whose workload is one of ``workloads``."""
    return records[np.isin(records["workload"], workloads)]


def stats_on(coefs: StepCoefficients, records: Records) -> FitStats:
    """:func:`policies.cost.fit.evaluate` on a records array."""
    return evaluate(coefs, records["new"], records["ctx"], records["t_s"])


def fit_report(name: str = DEFAULT_PROFILE) -> FitReport:
    """Coefficients of profile ``name`` and their error, recomputed from its shipped records (none: derived)."""
    p = load_profile(name)
    report = FitReport(
        name=name, a_ms=p.coefficients.a_s * 1e3, b_us_per_token=p.coefficients.b_s * 1e6,
        c_ns_per_context_token=p.coefficients.c_s * 1e9, interference_kappa=p.interference_kappa,
        derived_from=None if p.derived_from is None else p.derived_from.base_profile,
        calibration=None, holdout=None,
    )
    if p.source is None:
        return report
    rec = load_records(name)
    cal = stats_on(p.coefficients, select(rec, p.source.calibration_workloads))
    hold = stats_on(p.coefficients, select(rec, p.source.holdout_workloads))
    report["calibration"] = StatsReport(n=cal.n, r2=cal.r2, mape=cal.mape)
    report["holdout"] = StatsReport(n=hold.n, r2=hold.r2, mape=hold.mape)
    return report
