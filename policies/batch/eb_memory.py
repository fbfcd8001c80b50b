"""EB's memory side: the memory-safe batch size and the runtime KV reserve (POLICIES.md 1.5, seed 002).

:func:`memory_safe_batch_size` is the largest ``N`` whose simulated per-cycle KV peak exceeds the capacity
with probability at most ``delta`` (a Monte Carlo of the EB sawtooth, :func:`cycle_peak_demand`);
:func:`kv_reserve_blocks` is the reserve of the runtime gate that defers the decode-to-prefill switch.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from policies.batch.eb_survival import FloatArray, IntArray, phase_end_iteration, survival_integral

__all__ = ["cycle_peak_demand", "kv_reserve_blocks", "memory_safe_batch_size"]


def _lengths(prompts: npt.ArrayLike, outputs: npt.ArrayLike) -> tuple[IntArray, IntArray]:
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    if p.ndim != 1 or p.shape != o.shape or len(p) == 0:
        raise ValueError("prompts and outputs must be non-empty 1-D sequences of equal length")
    if int(p.min()) < 0 or int(o.min()) < 0:
        raise ValueError("lengths must be >= 0")
    return p, np.maximum(o, 1)  # a finished request has at least the token its prefill sampled


def cycle_peak_demand(
    prompts: npt.ArrayLike,
    outputs: npt.ArrayLike,
    n_slots: int,
    theta: float,
    *,
    seed: int = 0,
    cycles: int = 2000,
    cycles_per_replica: int = 20,
    warmup_cycles: int = 4,
    block_size: int = 1,
) -> IntArray:
    """Monte Carlo of the EB KV sawtooth: the peak KV demand (tokens) of ``cycles`` simulated cycles.

    **Model.** ``N`` slots, each holding one request drawn (prompt and output *jointly*, so their
    correlation is kept) from the given lengths. A request with prompt ``p`` and ``g`` tokens generated holds
    ``p + g`` tokens of KV (the token its last step sampled included: one token conservative). Its prefill
    samples token 1 (``g = 1``); each decode iteration adds one token to every running request; it finishes
    when ``g`` reaches its output length ``L`` and frees its KV after that iteration. A decode phase ends at
    the iteration after which at least ``k = ceil(theta N)`` of its requests have finished (``tau`` = the
    ``k``-th smallest remaining length ``r = L - g``); the prefill phase then refills every free slot. The
    continuing requests keep their KV throughout (POLICIES.md 1.5).

    **Peak of a cycle, exactly and without stepping.** Demand at iteration ``t`` of the phase is
    ``sum_{r_i >= t} (x_i + t)`` with ``x_i = p_i + g_i`` at the phase start: it rises between completions
    and drops after them, so its maximum is at a completion time ``t = r_(j)`` (``j``-th smallest), where it
    equals ``sum x - sum_{m<j} x_(m) + (N - j) r_(j)``. Only the ``k`` smallest ``r`` matter (one
    ``argpartition`` and a sort of ``k`` values per cycle). This includes the demand just after the previous
    refill (``t = 0`` or, without zero-length requests, the larger ``t = r_(1)``). With ``block_size`` B > 1
    every running request is charged ``B - 1`` extra tokens (the worst case of rounding up to whole blocks).

    **Steady state.** Replicas start from the renewal-theory stationary slot contents (the request in a slot
    at a random time is length-biased, probability proportional to ``L``, with ``g`` uniform on
    ``1..L``), then run ``warmup_cycles`` unrecorded cycles to settle into EB's own sawtooth (checked in the
    tests against a stepwise simulation with a long warmup). ``cycles`` recorded cycles are split over
    ``ceil(cycles / cycles_per_replica)`` independent replicas simulated side by side as ``(replicas, N)``
    arrays. Deterministic for a given ``seed``.
    """
    if n_slots < 1:
        raise ValueError(f"n_slots must be >= 1, got {n_slots}")
    if not 0.0 < theta <= 1.0:
        raise ValueError(f"theta must be in (0, 1], got {theta}")
    if cycles < 1 or cycles_per_replica < 1 or warmup_cycles < 0 or block_size < 1:
        raise ValueError("cycles, cycles_per_replica, block_size must be >= 1 and warmup_cycles >= 0")
    p_all, o_all = _lengths(prompts, outputs)
    rng = np.random.default_rng(seed)
    n = int(n_slots)
    k = min(max(math.ceil(theta * n - 1e-9), 1), n)
    replicas = -(-cycles // cycles_per_replica)
    per = -(-cycles // replicas)
    weights = o_all / float(o_all.sum())
    idx = rng.choice(len(o_all), size=(replicas, n), p=weights)
    length = o_all[idx]
    gen = 1 + (rng.random((replicas, n)) * length).astype(np.int64)  # uniform on 1..L
    x = p_all[idx] + gen  # KV tokens held
    r = length - gen  # decode iterations left
    pad = block_size - 1
    active = (n - np.arange(k, dtype=np.int64))[None, :]
    peaks = np.empty((per, replicas), dtype=np.int64)
    for cycle in range(warmup_cycles + per):
        pick = np.argpartition(r, k - 1, axis=1)[:, :k] if k < n else np.broadcast_to(np.arange(n), (replicas, n))
        rk = np.take_along_axis(r, pick, axis=1)
        xk = np.take_along_axis(x, pick, axis=1)
        order = np.argsort(rk, axis=1, kind="stable")
        rk = np.take_along_axis(rk, order, axis=1)
        xk = np.take_along_axis(xk, order, axis=1)
        tau = rk[:, -1:]
        if cycle >= warmup_cycles:
            before = np.cumsum(xk, axis=1) - xk
            demand = x.sum(axis=1, keepdims=True) - before + active * (rk + pad)
            peaks[cycle - warmup_cycles] = demand.max(axis=1)
        done = r <= tau
        x += tau
        r -= tau
        m = int(done.sum())
        new = rng.integers(0, len(o_all), size=m)
        x[done] = p_all[new] + 1
        r[done] = o_all[new] - 1
    out: IntArray = peaks.T.reshape(-1)[:cycles]
    return out


def memory_safe_batch_size(
    prompts: npt.ArrayLike,
    outputs: npt.ArrayLike,
    capacity_tokens: float,
    theta: float,
    delta: float = 0.01,
    max_n: int = 1024,
    seed: int = 0,
    cycles: int = 2000,
    *,
    block_size: int = 1,
    warmup_cycles: int = 4,
) -> int:
    """The largest ``N <= max_n`` whose EB cycles exceed ``capacity_tokens`` of KV with probability <= delta.

    The probability is the fraction of ``cycles`` simulated cycles (:func:`cycle_peak_demand`, the same
    seed for every ``N``) whose peak demand exceeds the capacity. The search assumes the risk grows with
    ``N``: it starts at the capacity over the stationary mean KV of one slot, takes secant steps on the
    ``(1 - delta)`` peak quantile (nearly proportional to ``N``), and closes with bisection between the
    largest safe and the smallest unsafe ``N`` seen (typically 3-6 simulations near the answer). Returns 0
    when even one slot is unsafe (a single request can outgrow the capacity).

    **Why a Monte Carlo rather than the paper's bound.** The paper (Prop. 3.3, App. D) treats decode-phase
    memory as a random walk with i.i.d. increments and bounds its all-time supremum with Feller's
    exponential bound, under geometric output lengths and with the batch size frozen at ``N``; the authors
    call it heuristic-conservative and need a runtime gate because high-variance workloads still overshoot.
    The simulation uses the windowed joint distribution of prompt and output lengths as it is (any hazard
    shape, correlated lengths), the actual threshold ``theta`` and the exact sawtooth, and measures the
    quantity we promise (per-cycle probability of exceeding capacity) rather than a bound on it, so it is
    neither needlessly small nor unsafe on non-geometric data. Its price is time: it runs rarely (when the
    window or ``theta`` has moved), and ``cycles`` trades its noise (about ``sqrt(delta / cycles)``) for
    speed. ``capacity_tokens`` is the KV capacity in tokens (``num_blocks * block_size``).
    """
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    p_all, o_all = _lengths(prompts, outputs)
    allowed = int(delta * cycles)  # cycles that may exceed the capacity
    risk: dict[int, float] = {}  # N -> the (allowed + 1)-th largest peak: safe iff <= capacity

    def critical_peak(n: int) -> float:
        if n not in risk:
            peaks = cycle_peak_demand(p_all, o_all, n, theta, seed=seed, cycles=cycles,
                                      warmup_cycles=warmup_cycles, block_size=block_size)
            risk[n] = float(np.partition(peaks, len(peaks) - 1 - allowed)[len(peaks) - 1 - allowed])
        return risk[n]

    # Start from the capacity over the stationary mean demand of a slot (length-biased request, uniform age),
    # then secant steps on critical_peak(N) ~ N * const, then bisection between the best safe and unsafe N.
    slot_mean = float((o_all * (p_all + (o_all + 1) / 2.0)).sum() / o_all.sum())
    n = min(max(int(capacity_tokens / slot_mean), 1), max_n)
    good, bad = 0, max_n + 1  # largest N known safe, smallest known unsafe
    for _ in range(8):
        peak = critical_peak(n)
        if peak <= capacity_tokens:
            good = max(good, n)
        else:
            bad = min(bad, n)
        nxt = min(max(int(n * capacity_tokens / peak), 1), max_n) if peak > 0.0 else max_n
        if nxt == n and peak <= capacity_tokens:
            nxt = n + 1
        if not good < nxt < bad or nxt in risk:
            break
        n = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if critical_peak(mid) <= capacity_tokens:
            good = mid
        else:
            bad = mid
    return good


def kv_reserve_blocks(
    n_slots: int,
    survival: FloatArray,
    theta: float,
    block_size: int,
    kappa: float = 1.5,
    base: int = 1,
    lo: int = 1,
    hi: int | None = None,
) -> int:
    """Free KV blocks below which the decode->prefill switch is deferred (the runtime gate, App. D.6).

    ``reserve = clip(ceil(kappa * G / block_size) + base, lo, hi)`` with ``G = N * integral_0^t* S`` the
    expected KV growth of one decode phase in tokens (each of the ``N S(t)`` requests running at iteration
    ``t`` writes one token; :func:`survival_integral`). ``hi = None``: no upper clip.
    """
    if block_size < 1 or n_slots < 0 or kappa < 0.0:
        raise ValueError("need block_size >= 1, n_slots >= 0, kappa >= 0")
    if hi is not None and hi < lo:
        raise ValueError(f"need lo <= hi, got lo={lo} hi={hi}")
    growth = n_slots * survival_integral(phase_end_iteration(theta, survival), survival)
    if not math.isfinite(growth):
        reserve = hi if hi is not None else lo
    else:
        reserve = math.ceil(kappa * growth / block_size) + base
    reserve = max(reserve, lo)
    return min(reserve, hi) if hi is not None else reserve
