"""Fit a simulator profile from the recorded steps of any engine (``trackside calibrate --db``).

The shipped profiles come from probe files (:mod:`agent.engine.calibration`); this module fits the same
profile from the ``steps`` table of a telemetry store, which every node running ``trackside agent`` fills
(simulated units or a real engine), so any GPU node can produce a profile for the simulator. Per step the
store has what the fit needs: prefill and decode tokens and requests, context tokens (the same definition
as the probe's ``ctx``), the measured duration (``measured_ns``) and the KV blocks in use out of the
unit's ``num_blocks``.

Derivation (the probe's, :func:`agent.engine.profile_fit.fit_profile`, with three differences):

1. **Split.** With at least :data:`HOLDOUT_MIN_STEPS` steps, a random ``holdout_fraction`` of them (fixed
   seed) is held out: never fitted, only evaluated (tag ``holdout`` in the records, ``calibration`` for the
   rest). A probe's holdout is a workload of its own; a store's steps come from whatever ran.
2. **Per-request time.** ``measured_ns`` is the whole step as the node timed it, including what the probe
   records leave out (the rest of the engine loop, which the simulator adds as ``g0 + g1 * requests``).
   ``g0`` is a constant per step and goes into ``a``. ``g1`` is fitted jointly, ``t = a + b * new + c * ctx
   + g1 * requests`` over the calibration steps, and kept when the data separate it from the context term
   (``g1 > 0`` at least :data:`PER_REQUEST_MIN_T` standard errors from zero): in decode steps the requests
   and the context grow together, and without it ``c`` absorbs the per-request time (61 instead of 44 ns
   per context token on a simulated run of the 8B profile). The records' ``t_s`` is then the measured time
   minus ``g1 * requests`` (the part the linear model and its noise describe, like a probe's ``t``), and the
   profile's ``loop_overhead_per_request_s`` is ``g1`` (``loop_overhead_s`` 0).
3. **KV capacity.** The store records each step's ``num_blocks`` (the usable blocks, the simulator's
   convention: vLLM's null block excluded), so the capacity is recorded, not inferred; the smallest value
   over the selected units is used. The probe's ``ctx / kv`` quartiles are kept as a cross-check of the
   block size, which the store does not record.

There is no ``schedule()`` time in the store, so ``kappa`` is fitted on raw step times
(:func:`agent.engine.profile_fit.fit_interference_kappa` with ``schedule_s=None``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from agent.engine.profile_fit import ctx_over_kv, fit_profile
from agent.engine.profile_records import RECORD_DTYPE, Records, format_records, parse_records
from agent.engine.profile_types import KvCapacityEvidence, Profile, ProfileSource

MIN_STEPS = 30
"""Fewest usable steps to fit a profile from (three coefficients, a noise level and ``kappa``)."""
HOLDOUT_MIN_STEPS = 100
"""Fewest usable steps to hold some out (below it, every step is fitted and there is no holdout)."""
PER_REQUEST_MIN_T = 3.0
"""The per-request term is kept when its estimate is at least this many standard errors above zero."""
CALIBRATION_TAG, HOLDOUT_TAG = "calibration", "holdout"
"""The ``workload`` of fitted and of held-out steps in the records."""
STEP_COLUMNS = (
    "time_ns",
    "unit_id",
    "measured_ns",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_prefill_reqs",
    "num_decode_reqs",
    "context_tokens",
    "kv_used_blocks",
    "num_blocks",
)
"""Columns of the store's ``steps`` table that :func:`profile_from_steps` reads."""


class CalibrationError(ValueError):
    """Steps that cannot give a profile (too few, degenerate, inconsistent); the message is one line for the
    operator."""


@dataclass(frozen=True, slots=True)
class PerRequestFit:
    """The joint fit of the per-request time (item 2 of the module docstring)."""

    estimate_s: float
    """``g1`` of the four-term fit (seconds per scheduled request; NaN when it could not be fitted)."""
    t_stat: float
    """``estimate_s`` over its standard error (NaN when it could not be fitted)."""
    kept: bool
    """Whether the profile uses it (else ``g1 = 0`` and the three-term fit absorbs the per-request time)."""

    @property
    def seconds(self) -> float:
        """``g1`` as the profile has it."""
        return self.estimate_s if self.kept else 0.0


@dataclass(frozen=True, slots=True)
class StepCalibration:
    """A profile fitted from recorded steps, with what the summary reports about it."""

    profile: Profile
    records: Records
    """The steps used, tagged ``calibration`` or ``holdout``; ``t_s`` net of the per-request term."""
    per_request: PerRequestFit
    num_dropped: int
    """Steps left out: no tokens, or no measured time."""
    warnings: tuple[str, ...]
    """Things the operator should check (one line each)."""


def fit_per_request(
    new: npt.NDArray[np.float64],
    ctx: npt.NDArray[np.float64],
    nreq: npt.NDArray[np.float64],
    t: npt.NDArray[np.float64],
) -> PerRequestFit:
    """Least squares of ``t = a + b * new + c * ctx + g1 * nreq``; ``g1``, its t statistic and whether to keep it.

    Columns are scaled to unit maximum before the solve (as :func:`policies.cost.fit.fit_step_model` does);
    the standard error is the ordinary one, ``s^2 (X'X)^-1`` with ``s^2 = RSS / (n - 4)``.
    """
    design = np.column_stack((np.ones_like(new), new, ctx, nreq))
    scale = np.abs(design).max(axis=0)
    scale[scale == 0.0] = 1.0
    x = design / scale
    solution, _, rank, _ = np.linalg.lstsq(x, t, rcond=None)
    if rank < 4 or len(t) <= 4:
        return PerRequestFit(math.nan, math.nan, kept=False)
    residual = t - x @ solution
    s2 = float(residual @ residual) / (len(t) - 4)
    var = s2 * float(np.linalg.pinv(x.T @ x)[3, 3])
    g1 = float(solution[3] / scale[3])
    t_stat = float(solution[3] / math.sqrt(var)) if var > 0.0 else math.inf
    return PerRequestFit(g1, t_stat, kept=g1 > 0.0 and t_stat >= PER_REQUEST_MIN_T)


def _split(n: int, holdout_fraction: float, seed: int) -> npt.NDArray[np.bool_]:
    """Which of ``n`` steps are held out: a random ``holdout_fraction`` (seeded), none below the minimum."""
    held = np.zeros(n, dtype=bool)
    k = round(n * holdout_fraction)
    if n >= HOLDOUT_MIN_STEPS and k > 0:
        held[np.random.default_rng(seed).choice(n, size=k, replace=False)] = True
    return held


def _records(
    cols: Mapping[str, npt.NDArray[np.int64]],
    held: npt.NDArray[np.bool_],
    t_s: npt.NDArray[np.float64],
) -> Records:
    """Records of :data:`agent.engine.profiles.RECORD_DTYPE`, rounded to the CSV's precision (so the written
    records reproduce every statistic of the profile)."""
    rec = np.empty(len(t_s), dtype=RECORD_DTYPE)
    rec["workload"] = np.where(held, HOLDOUT_TAG, CALIBRATION_TAG)
    rec["t_s"] = t_s
    rec["pre_tok"] = cols["num_prefill_tokens"]
    rec["dec"] = cols["num_decode_tokens"]
    rec["new"] = rec["pre_tok"] + rec["dec"]
    rec["npre"] = cols["num_prefill_reqs"]
    rec["nreq"] = cols["num_prefill_reqs"] + cols["num_decode_reqs"]
    rec["ctx"] = cols["context_tokens"]
    blocks = cols["num_blocks"].astype(np.float64)
    rec["kv"] = np.divide(cols["kv_used_blocks"], blocks, out=np.zeros_like(blocks), where=blocks > 0)
    return parse_records(format_records(rec))


def _kv_warnings(evidence: KvCapacityEvidence | None, capacity_tokens: int, block_size: int) -> list[str]:
    if evidence is None:
        return ["no decode-only step with KV use above 5%: the block size could not be cross-checked"]
    ratio = evidence.ctx_over_kv_median_tokens / capacity_tokens
    if 0.5 <= ratio <= 1.05:
        return []
    per_block = ratio * block_size
    return [
        f"the steps' context per used KV block (median {per_block:.1f} tokens) does not fit a block size of "
        f"{block_size} tokens: check --block-size (prefix caching shares blocks and raises this figure)"
    ]


def check_usable(profile: Profile, records: Records) -> None:
    """Raise :class:`CalibrationError` unless the simulator can run ``profile``: coefficients of a real engine
    (none negative, every recorded step predicted to take time) and a KV cache that holds ``max_model_len``."""
    c = profile.coefficients
    for label, value, unit, scale in (
        ("a", c.a_s, "ms", 1e3),
        ("b", c.b_s, "us per token", 1e6),
        ("c", c.c_s, "ns per context token", 1e9),
    ):
        if value < 0.0:
            raise CalibrationError(
                f"degenerate fit: {label} = {value * scale:.3g} {unit} is negative (the steps do not vary enough "
                "in new and context tokens to separate a, b and c: record a run with both short and long requests, "
                "under light and heavy load)"
            )
    if len(records) and c.a_s + c.b_s * float(records["new"].min()) <= 0.0:
        raise CalibrationError("degenerate fit: it predicts a step of no time")
    if profile.kv_capacity_tokens < profile.max_model_len:
        raise CalibrationError(
            f"the KV cache holds {profile.kv_capacity_tokens:,} tokens ({profile.usable_gpu_blocks:,} blocks of "
            f"{profile.block_size}), less than max_model_len {profile.max_model_len:,}: pass a smaller --max-model-len"
        )


def profile_from_steps(
    steps: Mapping[str, npt.NDArray[np.int64]],
    *,
    name: str,
    description: str,
    gpu: str,
    model: str,
    mode: str,
    source_files: tuple[str, ...],
    measured_date: str,
    vllm_version: str,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    engines_per_gpu: int = 1,
    holdout_fraction: float = 0.2,
    seed: int = 0,
) -> StepCalibration:
    """Fit profile ``name`` on recorded steps (the :data:`STEP_COLUMNS` of the store's ``steps`` table, in
    time order). Raises :class:`CalibrationError` with a one-line reason when the steps cannot give one."""
    missing = [c for c in STEP_COLUMNS if c not in steps]
    if missing:
        raise CalibrationError(f"the steps lack the columns {', '.join(missing)}")
    if not 0.0 <= holdout_fraction < 1.0:
        raise CalibrationError(f"the holdout fraction must be in [0, 1), not {holdout_fraction:g}")
    if block_size < 1 or min(max_num_batched_tokens, max_num_seqs, max_model_len, engines_per_gpu) < 1:
        raise CalibrationError("block size and engine limits must be >= 1")
    raw = {c: np.asarray(steps[c], dtype=np.int64) for c in STEP_COLUMNS}
    total = len(raw["time_ns"])
    if total == 0:
        raise CalibrationError("no steps to fit (is the selection empty?)")
    keep = (raw["measured_ns"] > 0) & (raw["num_prefill_tokens"] + raw["num_decode_tokens"] > 0)
    cols = {c: v[keep] for c, v in raw.items()}
    new = (cols["num_prefill_tokens"] + cols["num_decode_tokens"]).astype(np.float64)
    n = int(keep.sum())
    if n < MIN_STEPS:
        raise CalibrationError(f"{n} usable steps, too few to fit a profile (at least {MIN_STEPS})")
    usable_blocks = int(cols["num_blocks"].min())
    if usable_blocks < 1:
        raise CalibrationError("the steps record no KV capacity (num_blocks is 0)")
    held = _split(n, holdout_fraction, seed)
    t = cols["measured_ns"] / 1e9
    nreq = (cols["num_prefill_reqs"] + cols["num_decode_reqs"]).astype(np.float64)
    fitted = ~held
    per_request = fit_per_request(
        new[fitted], cols["context_tokens"][fitted].astype(np.float64), nreq[fitted], t[fitted]
    )
    if per_request.kept and float((t - per_request.seconds * nreq).min()) <= 0.0:
        per_request = PerRequestFit(per_request.estimate_s, per_request.t_stat, kept=False)
    records = _records(cols, held, t - per_request.seconds * nreq)
    capacity = usable_blocks * block_size
    evidence = ctx_over_kv(records, "recorded")
    warnings = _kv_warnings(evidence, capacity, block_size)
    if len(set(cols["num_blocks"].tolist())) > 1:
        warnings.append(f"the units record different KV capacities: the smallest ({usable_blocks:,} blocks) is used")
    try:
        profile = fit_profile(
            records,
            name=name,
            description=_describe(description, records, per_request, usable_blocks, block_size, evidence),
            gpu=gpu,
            model=model,
            mode=mode,
            engines_per_gpu=engines_per_gpu,
            source=ProfileSource(
                source_files, measured_date, vllm_version, (CALIBRATION_TAG,), (HOLDOUT_TAG,) if held.any() else ()
            ),
            block_size=block_size,
            usable_blocks=usable_blocks,
            kv_evidence=evidence or KvCapacityEvidence("recorded", 0, 0.0, 0.0, 0.0),
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            loop_overhead=(0.0, per_request.seconds),
        )
    except ValueError as exc:  # rank-deficient: every step alike
        raise CalibrationError(f"degenerate fit: {exc}") from None
    check_usable(profile, records)
    return StepCalibration(profile, records, per_request, total - n, tuple(warnings))


def _describe(
    summary: str,
    records: Records,
    per_request: PerRequestFit,
    usable: int,
    block_size: int,
    evidence: KvCapacityEvidence | None,
) -> str:
    held = int((records["workload"] == HOLDOUT_TAG).sum())
    split = (
        f"{len(records) - held:,} fitted and {held:,} held out at random"
        if held
        else f"all {len(records):,} fitted (too few to hold some out)"
    )
    per_req = (
        f"The per-request time ({per_request.seconds * 1e6:.2f} us per scheduled request, fitted jointly, "
        f"t = {per_request.t_stat:.1f}) is the engine-loop term; the records' t_s is the measured time "
        "without it."
        if per_request.kept
        else "No per-request term (the steps do not separate it from the context term)."
    )
    check = (
        ""
        if evidence is None
        else f" Cross-check: median ctx/kv over {evidence.num_steps:,} decode-only steps with kv > 0.05 = "
        f"{evidence.ctx_over_kv_median_tokens:,.0f} tokens."
    )
    text = (
        f"{summary.strip()} Fitted by trackside calibrate on {len(records):,} recorded steps ({split}), measured "
        f"step times including the engine loop. {per_req} KV cache: {usable + 1:,} blocks of {block_size} tokens "
        f"({usable:,} usable = {usable * block_size:,} tokens), as recorded.{check}"
    )
    return text.strip()


__all__ = [
    "CALIBRATION_TAG",
    "HOLDOUT_MIN_STEPS",
    "HOLDOUT_TAG",
    "MIN_STEPS",
    "STEP_COLUMNS",
    "CalibrationError",
    "PerRequestFit",
    "StepCalibration",
    "check_usable",
    "fit_per_request",
    "profile_from_steps",
]
