"""Derive the shipped calibration profiles from the raw probe files in ``shared/calibration``.

    python -m agent.engine.calibration --shared ../shared/calibration --out agent/engine/profiles

rewrites ``<name>.json`` and ``<name>.records.csv.gz`` for every profile in :data:`SHIPPED_PROFILES`. The
output is deterministic (fixed float formats, gzip without timestamp or file name), so a test can check
that the shipped files are exactly what this module produces.

Derivation (see :mod:`agent.engine.profile_types` for what each field means):

1. Records: the steps of the calibration workloads (``mix``, ``longctx``, ``small``, ``dec128``; the
   ``warmup`` run is dropped) and of the holdout (``sharegpt_like``), rounded to the CSV's precision
   (``t_s`` to 0.1 us, ``kv`` to 1e-10; :mod:`agent.engine.profile_records`); every statistic is computed
   from these rounded records, so the shipped CSV reproduces the shipped JSON.
2. Step model, 3. noise, 4. KV capacity (with several engines (files), the smallest per-engine capacity)
   and 5. mixed-batch interference ``kappa``: fitted on the records by :mod:`agent.engine.profile_fit`,
   whose docstring gives each step; this module adds what only the probe files hold (engine-loop and
   ``schedule()`` times).
6. Derived profiles (:data:`agent.engine.derived_profiles.DERIVED_PROFILES`): computed from a measured
   profile and published hardware figures, never measured;
   :func:`agent.engine.derived_profiles.derive_bandwidth_scaled_profile` documents the arithmetic. They ship
   a JSON file only (no records).

Steps 2, 3 and 5 are :func:`agent.engine.profile_fit.fit_profile`, which :mod:`agent.engine.step_calibration`
also runs on the steps a node recorded (``trackside calibrate``).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from agent.engine.derived_profiles import DERIVED_PROFILES, derive_bandwidth_scaled_profile
from agent.engine.profile_fit import derive_kv_blocks, fit_profile
from agent.engine.profile_json import profile_to_json
from agent.engine.profile_records import RECORD_COLUMNS, Records, format_records, parse_records, record_line
from agent.engine.profile_types import KvCapacityEvidence, Profile, ProfileSource

MEASURED_DATE = "2026-11-22"
VLLM_VERSION = "0.26.0"
CALIBRATION_WORKLOADS = ("mix", "longctx", "small", "dec128")
HOLDOUT_WORKLOADS = ("sharegpt_like",)


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


def collect_records(runs: Sequence[dict[str, Any]], workloads: Sequence[str]) -> Records:
    """Steps of ``workloads`` in each probe run (in order), rounded to the CSV's precision."""
    lines = [",".join(RECORD_COLUMNS)]
    for run in runs:
        for result in run["results"]:
            if result["tag"] in workloads:
                start, stop = result["steps"]
                lines += [record_line([result["tag"], s["t"], *(s[c] for c in RECORD_COLUMNS[2:])])
                          for s in run["steps"][start:stop]]
    return parse_records("\n".join(lines) + "\n")


def collect_schedule_s(runs: Sequence[dict[str, Any]], workloads: Sequence[str]) -> npt.NDArray[np.float64]:
    """``t_sched`` (seconds in vLLM's ``schedule()``) of the steps :func:`collect_records` returns, same order."""
    return np.array([s["t_sched"] for run in runs for result in run["results"] if result["tag"] in workloads
                     for s in run["steps"][result["steps"][0]:result["steps"][1]]], dtype=np.float64)


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
