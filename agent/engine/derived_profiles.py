"""Profiles that were never measured: computed from a measured one and a target GPU's published figures.

:data:`DERIVED_PROFILES` lists the shipped ones (step 6 of :mod:`agent.engine.calibration`'s derivation,
which writes them after the measured profiles they scale); :func:`derive_bandwidth_scaled_profile`
documents the arithmetic, and :class:`GpuFigures` holds the figures it uses. A derived profile ships a JSON
file only: it has no step records, fit statistics or KV evidence (:mod:`agent.engine.profile_types`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from agent.engine.profile_json import profile_from_json, profile_to_json
from agent.engine.profile_types import Derivation, Profile
from agent.engine.timing import kappa_for_crossover
from policies.cost.step_model import StepCoefficients


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
    """Name of the measured profile in :data:`agent.engine.calibration.SHIPPED_PROFILES`."""
    base_gpu: GpuFigures
    gpu: GpuFigures
    crossover_decode_fraction: float | None
    """Decode share where the paper saw mixed steps' marginal cost cross pure decode's (``kappa`` is set to put
    the crossover there); None: ``kappa`` is the base profile's measured one, so that nothing in the profile comes
    from the claim a benchmark on it would test (issue #19, item 6)."""
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
    DerivedSpec(
        "rtxpro6000-llama31-8b-physical", "h100-llama31-8b", H100_SXM, RTX_PRO_6000,
        crossover_decode_fraction=None, reference_decode_context_tokens=0, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
        reference="seed 002 (exclusive batching), Table 1 for the GPU's figures only; the interference kappa is "
                  "the H100 profile's measured one, not the paper's crossover",
    ),
)


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
      rho c'(C - 1)))``; on the attention term only, ``kappa_attention = (C - 1) / (rho (1 + rho (C - 1)))``);
      or, without a crossover (``crossover_decode_fraction=None``), the base profile's
      measured ``kappa``: the profile then holds nothing but the base's measurements and the GPUs' figures.

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
        f"= {extra_blocks:,} more (same weights and activation reserve); " + (
            f"kappa puts the crossover of the mixed and pure-decode per-token marginal costs at decode share "
            f"{spec.crossover_decode_fraction:g} at a {spec.reference_decode_context_tokens:,}-token decode context."
            if spec.crossover_decode_fraction is not None else
            f"kappa is {spec.base}'s measured {base.interference_kappa:g} (no interference target from a paper)."
        ) + f" Noise, loop overheads and engine limits copied from {spec.base}."
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
    if spec.crossover_decode_fraction is None:
        return _as_shipped(replace(derived, interference_kappa=base.interference_kappa,
                                   interference_kappa_attention=base.interference_kappa_attention))
    coefs = _as_shipped(derived).coefficients  # kappa from the coefficients exactly as shipped
    kappas = [kappa_for_crossover(coefs, spec.crossover_decode_fraction, spec.reference_decode_context_tokens, on)
              for on in ("step", "attention")]
    return _as_shipped(replace(derived, interference_kappa=kappas[0], interference_kappa_attention=kappas[1]))
