"""CascadeInfer's length-staged pipeline: stage partition and range refinement (seed 001 sections 4.2, 4.3).

**Buckets** (section 4.2, "Optimizing efficiency"): cut points are the edges of exponentially growing
length buckets, ``0, base, base*g, base*g^2, ..., max_context`` (:func:`exponential_edges`); the last
bucket also holds every length beyond ``max_context``.

**Stage cost.** A stage ``[l', l)`` served by ``k`` units holds the requests ``n_{l',l}`` whose sequence
length ``L`` lies in the range. They are split evenly over the ``k`` units by taking every ``k``-th of the
lengths sorted ascending (unit ``r`` gets positions ``r, r + k, r + 2k, ...``) and the stage costs the
sum of the units' ``Q_B`` (:mod:`policies.dispatch.cascade_model`). The paper (footnote to section 4.2)
approximates this as ``k * Q`` of one representative subset starting at the ``k/2``-th element; we add
the ``k`` subsets up exactly instead. The two agree when the subsets look alike, but the representative
is *empty* when the range holds fewer than ``k/2 + 1`` requests, which would make a sparse range free and
let the DP park units there; the exact sum costs the same with strided prefix sums.

**Cut cost** ``c_{l'}``: the requests straddling cut ``l'`` (prompt ``I < l' <= L``) each move
``l'`` tokens of KV at the hand-over; ``c_{l'} = w * l' * #straddlers`` with ``w`` the caller's cost per
moved token, in the units of ``Q`` (the policy passes seconds per token over the mean output length, so
that a delay of ``d`` seconds counts as ``d / O`` of normalized latency). ``c_0 = 0``.

**Dynamic program** (section 4.2, POLICIES.md 2.4), over edge indices:

    f[s][e][l] = min_{e' in [s-1, e), l' < l} f[s-1][e'][l'] + C(l', l, e - e') + c[l']

with ``f[0][0][0] = 0``; the answer is ``min_s f[s][E][K]``. No term depends on ``s`` itself, so the ``s``
dimension only enumerates stage counts; the min-plus step over all ``(e', l')`` is one numpy reduction.
:func:`partition_brute_force` enumerates every partition with its own plain-Python cost (for tests).

**Fast path** (section 4.2, "two-phase heuristic"): one unit per stage by a simplified DP, then repeatedly
merge the adjacent pair of stages with the largest positive gain (max-heap). When there are more units than
buckets the one-unit-per-stage pipeline does not exist: we build it with as many stages as buckets and give
each remaining unit to the stage whose cost it lowers most, before merging (our extension).

**Range refinement** (section 4.3): :func:`refine_boundary`.

Pure: stdlib and numpy, no clock, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from policies.dispatch.cascade_model import QoeCoefficients
from policies.frozen import picklable

__all__ = [
    "Partition",
    "Refinement",
    "StageCostTable",
    "exponential_edges",
    "partition_brute_force",
    "partition_dp",
    "partition_fast",
    "refine_boundary",
    "representative_share",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
LengthPair = tuple[int, int]
"""``(prompt_tokens, context_tokens)`` of one request."""

_REL_TOL = 1e-12


def exponential_edges(max_context_tokens: int, base_tokens: int, growth: float = 2.0) -> tuple[int, ...]:
    """Bucket edges ``0, base, base*g, ..., max_context`` (strictly increasing integers).

    ``max_context_tokens > base_tokens >= 1`` and ``growth > 1``. 128K context with base 64 and growth 2
    gives 12 buckets: ``[0, 64), [64, 128), ..., [65536, 131072)``.
    """
    if base_tokens < 1 or max_context_tokens <= base_tokens or not growth > 1.0:
        raise ValueError(
            f"need max_context > base >= 1 and growth > 1, got {max_context_tokens}, {base_tokens}, {growth}"
        )
    edges = [0]
    x = float(base_tokens)
    while True:
        nxt = max(round(x), edges[-1] + 1)
        if nxt >= max_context_tokens:
            break
        edges.append(nxt)
        x *= growth
    edges.append(max_context_tokens)
    return tuple(edges)


@dataclass(frozen=True, slots=True)
class Partition:
    """Stages over bucket edges: stage ``j`` covers ``[edges[cuts[j]], edges[cuts[j+1]])`` with ``units[j]``."""

    cuts: tuple[int, ...]
    """Edge indices, from 0 to ``K`` (number of buckets), strictly increasing; one more than stages."""
    units: tuple[int, ...]
    """Units per stage (each >= 1), in stage order."""
    cost: float
    """Pipeline quality: sum of stage costs and cut costs (smaller is better)."""
    edges: tuple[int, ...]

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Stage boundaries in tokens, ``0`` first and ``max_context`` last."""
        return tuple(self.edges[c] for c in self.cuts)

    @property
    def num_stages(self) -> int:
        return len(self.units)


class StageCostTable:
    """Stage costs ``C(l', l, k)`` and cut costs ``c[l']`` of one length sample over bucket edges.

    Lengths are sorted by ``(L, I)``; a range of buckets is a slice of that order (bucket edges found by
    binary search). The sums over every ``k``-th element use strided prefix sums
    ``G_k[i] = x[i] + G_k[i - k]`` (built once per ``k``), so each subset costs O(1).
    """

    def __init__(
        self,
        prompts: Sequence[int] | npt.ArrayLike,
        contexts: Sequence[int] | npt.ArrayLike,
        edges: Sequence[int],
        coefs: QoeCoefficients,
        cut_cost_per_token: float = 0.0,
    ) -> None:
        inp = np.asarray(prompts, dtype=np.float64).reshape(-1)
        ctx = np.asarray(contexts, dtype=np.float64).reshape(-1)
        if inp.shape != ctx.shape:
            raise ValueError(f"prompts ({inp.shape[0]}) and contexts ({ctx.shape[0]}) differ in length")
        if len(edges) < 2 or any(b <= a for a, b in itertools.pairwise(edges)) or edges[0] != 0:
            raise ValueError(f"edges must start at 0 and increase strictly, got {tuple(edges)}")
        order = np.lexsort((inp, ctx))
        self._inp = inp[order]
        self._ctx = ctx[order]
        self._inp2 = self._inp * self._inp
        self.edges: tuple[int, ...] = tuple(int(e) for e in edges)
        self.coefs = coefs
        k_buckets = len(self.edges) - 1
        pos = np.searchsorted(self._ctx, np.asarray(self.edges, dtype=np.float64), side="left").astype(np.int64)
        pos[0] = 0
        pos[k_buckets] = len(self._ctx)  # the last bucket holds every length >= its lower edge
        self._pos: IntArray = pos
        self.cut_costs: FloatArray = _cut_costs(inp, ctx, self.edges, cut_cost_per_token)
        """``c[j]`` for edge ``j`` (0 at the first and last edge)."""
        self._strided: dict[int, tuple[FloatArray, FloatArray, FloatArray]] = {}

    @property
    def num_buckets(self) -> int:
        return len(self.edges) - 1

    @property
    def num_samples(self) -> int:
        return len(self._ctx)

    def _prefix(self, k: int) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Strided prefix sums ``G_k`` of (I, I^2, L), each padded with one leading 0 per residue."""
        got = self._strided.get(k)
        if got is None:
            n = len(self._ctx)
            rows = -(-n // k) if n else 0
            out: list[FloatArray] = []
            for x in (self._inp, self._inp2, self._ctx):
                padded = np.zeros(rows * k)
                padded[:n] = x
                g = np.cumsum(padded.reshape(rows, k), axis=0).reshape(-1)
                out.append(np.concatenate((np.zeros(k), g)))  # index i + k holds G_k[i]
            got = (out[0], out[1], out[2])
            self._strided[k] = got
        return got

    def _split_cost(self, lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64], k: int) -> FloatArray:
        """Cost of slices ``[lo, hi)`` split over ``k`` units (vectorized over slices)."""
        g_inp, g_inp2, g_ctx = self._prefix(k)
        r = np.arange(k, dtype=np.int64)
        p = lo[:, None] + r[None, :]
        cnt = np.where(p < hi[:, None], (hi[:, None] - 1 - p) // k + 1, 0)
        last = p + (cnt - 1) * k
        valid = cnt > 0
        last_i = np.where(valid, last + k, 0)
        first_i = np.where(valid, p, 0)  # index p holds G_k[p - k] (the leading zeros cover p < k)
        s_inp = np.where(valid, g_inp[last_i] - g_inp[first_i], 0.0)
        s_inp2 = np.where(valid, g_inp2[last_i] - g_inp2[first_i], 0.0)
        s_ctx = np.where(valid, g_ctx[last_i] - g_ctx[first_i], 0.0)
        d = self.coefs
        n = cnt.astype(np.float64)
        q = n * (d.d0 + d.d1 * n + d.d2 * s_inp + d.d3 * s_inp2 + d.d4 * s_ctx)
        return np.asarray(q.sum(axis=1), dtype=np.float64)

    def cost(self, lo_edge: int, hi_edge: int, k: int) -> float:
        """``C(l', l, k)``: the requests of edges ``[lo_edge, hi_edge)`` split over ``k`` units."""
        if not 0 <= lo_edge < hi_edge <= self.num_buckets or k < 1:
            raise ValueError(f"bad stage ({lo_edge}, {hi_edge}, {k}) for {self.num_buckets} buckets")
        lo = self._pos[lo_edge : lo_edge + 1]
        hi = self._pos[hi_edge : hi_edge + 1]
        return float(self._split_cost(lo, hi, k)[0])

    def table(self, max_units: int) -> FloatArray:
        """``C[l', l, k]`` for all edge pairs and ``k = 1..max_units``; inf where ``l' >= l`` or ``k = 0``."""
        kb = self.num_buckets
        out = np.full((kb + 1, kb + 1, max_units + 1), math.inf)
        lo_idx, hi_idx = np.triu_indices(kb + 1, k=1)
        lo, hi = self._pos[lo_idx], self._pos[hi_idx]
        for k in range(1, max_units + 1):
            out[lo_idx, hi_idx, k] = self._split_cost(lo, hi, k)
        return out


def _cut_costs(inp: FloatArray, ctx: FloatArray, edges: Sequence[int], per_token: float) -> FloatArray:
    """``c[j] = per_token * edges[j] * #{i: I_i < edges[j] <= L_i}``; 0 at the first and last edge."""
    e = np.asarray(edges, dtype=np.float64)
    # I <= L, so #{I < e <= L} = #{I < e} - #{L < e}.
    below_inp = np.searchsorted(np.sort(inp), e, side="left")
    below_ctx = np.searchsorted(np.sort(ctx), e, side="left")
    c = per_token * e * (below_inp - below_ctx).astype(np.float64)
    c[0] = 0.0
    c[-1] = 0.0
    return np.asarray(c, dtype=np.float64)


def partition_dp(table: StageCostTable, num_units: int) -> Partition:
    """The optimal partition of ``num_units`` units by the dynamic program ``f[s][e][l]`` (module docstring).

    Ties between stage counts go to the fewest stages; within one stage count to the smallest index of
    ``(e', l')``. Time ``O(E^3 K^2)`` elementary operations in numpy (``K`` buckets, ``E`` units).
    """
    if num_units < 1:
        raise ValueError(f"need at least one unit, got {num_units}")
    e_max, kb = num_units, table.num_buckets
    c = table.table(e_max)
    ep = np.arange(e_max + 1)
    lp = np.arange(kb + 1)
    kdiff = np.clip(ep[None, None, :, None] - ep[:, None, None, None], 0, e_max)
    # trans[e', l', e, l]: cost of a last stage from (e', l') to (e, l), cut cost at l' included.
    trans = c[lp[None, :, None, None], lp[None, None, None, :], kdiff] + table.cut_costs[None, :, None, None]
    trans = trans.reshape((e_max + 1) * (kb + 1), (e_max + 1) * (kb + 1))
    f = np.full((e_max + 1) * (kb + 1), math.inf)
    f[0] = 0.0
    backs: list[IntArray] = []
    best, best_s = math.inf, 0
    target = e_max * (kb + 1) + kb
    for s in range(1, e_max + 1):
        tot = f[:, None] + trans
        arg = np.argmin(tot, axis=0)
        f = tot[arg, np.arange(tot.shape[1])]
        backs.append(arg.astype(np.int64))
        if f[target] < best - _REL_TOL * max(1.0, abs(best) if math.isfinite(best) else 0.0):
            best, best_s = float(f[target]), s
    if not math.isfinite(best):
        raise ValueError("no partition exists")
    cuts, units = [kb], []
    state = target
    for s in range(best_s, 0, -1):
        prev = int(backs[s - 1][state])
        units.append(state // (kb + 1) - prev // (kb + 1))
        cuts.append(prev % (kb + 1))
        state = prev
    return Partition(tuple(reversed(cuts)), tuple(reversed(units)), best, table.edges)


def _stage_cost_direct(
    items: Sequence[tuple[int, int]], lo: int, hi: int | None, k: int, coefs: QoeCoefficients
) -> float:
    """Plain-Python stage cost: ``items`` are ``(L, I)`` sorted; range ``[lo, hi)`` (``hi`` None: no top)."""
    inside = [it for it in items if it[0] >= lo and (hi is None or it[0] < hi)]
    total = 0.0
    for r in range(k):
        part = inside[r::k]
        total += coefs.of_lengths([i for _, i in part], [ell for ell, _ in part])
    return total


def partition_brute_force(
    prompts: Sequence[int],
    contexts: Sequence[int],
    edges: Sequence[int],
    coefs: QoeCoefficients,
    num_units: int,
    cut_cost_per_token: float = 0.0,
) -> Partition:
    """Every partition of ``num_units`` units over the bucket edges, evaluated in plain Python (tests only).

    Independent of :class:`StageCostTable`: it filters, sorts and splits the raw lengths itself. Exponential
    in the number of buckets and units; ties go to the first partition found with the fewest stages.
    """
    items = sorted(zip(contexts, prompts, strict=True))
    kb = len(edges) - 1
    best: Partition | None = None
    for s in range(1, min(num_units, kb) + 1):
        for interior in itertools.combinations(range(1, kb), s - 1):
            cuts = (0, *interior, kb)
            cut_total = 0.0
            for j in interior:
                straddle = sum(1 for ell, i in items if i < edges[j] <= ell)
                cut_total += cut_cost_per_token * edges[j] * straddle
            for bars in itertools.combinations(range(1, num_units), s - 1):
                sizes = [b - a for a, b in itertools.pairwise((0, *bars, num_units))]
                total = cut_total
                for j, k in enumerate(sizes):
                    top = None if cuts[j + 1] == kb else edges[cuts[j + 1]]
                    total += _stage_cost_direct(items, edges[cuts[j]], top, k, coefs)
                if best is None or total < best.cost - _REL_TOL * max(1.0, abs(best.cost)):
                    best = Partition(cuts, tuple(sizes), total, tuple(edges))
    if best is None:
        raise ValueError("no partition exists")
    return best


def partition_fast(table: StageCostTable, num_units: int) -> Partition:
    """Two-phase heuristic of section 4.2: one unit per stage, then greedy merges of adjacent stages.

    Phase 1: a DP over ``s = min(E, K)`` stages of one unit each (``g[s][l] = min_{l'<l} g[s-1][l'] +
    C(l', l, 1) + c[l']``); with ``E > K`` each of the ``E - K`` remaining units goes, one at a time, to the
    stage whose cost it lowers most. Phase 2: while some adjacent pair has a positive merge gain
    ``C(a) + C(b) + c[cut] - C(a u b)`` (units added), merge the pair with the largest gain (max-heap with
    version stamps; ties to the leftmost pair). Evaluates ``O(E log E + K^2)`` stage costs.
    """
    if num_units < 1:
        raise ValueError(f"need at least one unit, got {num_units}")
    kb = table.num_buckets
    cut = table.cut_costs
    n_st = min(num_units, kb)
    c1 = table.table(1)[:, :, 1]
    g = np.full((n_st + 1, kb + 1), math.inf)
    back = np.zeros((n_st + 1, kb + 1), dtype=np.int64)
    g[0, 0] = 0.0
    for s in range(1, n_st + 1):
        tot = g[s - 1][:, None] + c1 + cut[:, None]
        back[s] = np.argmin(tot, axis=0)
        g[s] = tot[back[s], np.arange(kb + 1)]
    cuts = [kb]
    for s in range(n_st, 0, -1):
        cuts.append(int(back[s][cuts[-1]]))
    cuts.reverse()
    lo = cuts[:-1]
    hi = cuts[1:]
    units = [1] * n_st
    cost = [table.cost(a, b, 1) for a, b in zip(lo, hi, strict=True)]
    for _ in range(num_units - n_st):
        gains = [cost[j] - table.cost(lo[j], hi[j], units[j] + 1) for j in range(n_st)]
        j = max(range(n_st), key=lambda i: (gains[i], -i))
        units[j] += 1
        cost[j] -= gains[j]
    # Phase 2 on a doubly linked list of stages.
    nxt = [*range(1, n_st), -1]
    prv = [-1, *range(n_st - 1)]
    version = [0] * n_st
    alive = [True] * n_st
    heap: list[tuple[float, int, int, int, int]] = []

    def push(a: int) -> None:
        b = nxt[a]
        if b < 0:
            return
        merged = table.cost(lo[a], hi[b], units[a] + units[b])
        gain = cost[a] + cost[b] + float(cut[hi[a]]) - merged
        heapq.heappush(heap, (-gain, lo[a], a, version[a], version[b]))

    for a in range(n_st - 1):
        push(a)
    while heap:
        neg_gain, _, a, va, vb = heapq.heappop(heap)
        b = nxt[a]
        if not alive[a] or b < 0 or version[a] != va or version[b] != vb:
            continue
        if -neg_gain <= _REL_TOL * max(1.0, cost[a] + cost[b]):
            break
        units[a] += units[b]
        hi[a] = hi[b]
        cost[a] = table.cost(lo[a], hi[a], units[a])
        alive[b] = False
        nxt[a] = nxt[b]
        if nxt[b] >= 0:
            prv[nxt[b]] = a
        version[a] += 1
        if prv[a] >= 0:
            push(prv[a])
        push(a)
    order = [j for j in range(n_st) if alive[j]]
    final_cuts = (*(lo[j] for j in order), kb)
    # Start values 0.0: mypyc (setup.py) miscompiles the sum of two start-less sum()s as integers.
    total = sum((cost[j] for j in order), 0.0) + sum((float(cut[c]) for c in final_cuts[1:-1]), 0.0)
    return Partition(final_cuts, tuple(units[j] for j in order), total, table.edges)


# ---- range refinement (section 4.3) ----------------------------------------------------------------------


def representative_share(items: Sequence[LengthPair], k: int) -> list[LengthPair]:
    """One unit's share of ``items`` split over ``k`` units (paper, footnote to section 4.2).

    Sort by ``(L, I)``, start from the ``k // 2``-th element and take every ``k``-th: the "average" unit of
    a group, used by range refinement for the successors' workload. Empty for ``k < 1``.
    """
    if k < 1:
        return []
    ordered = sorted(items, key=lambda it: (it[1], it[0]))
    return ordered[k // 2 :: k]


@dataclass(frozen=True, slots=True)
class Refinement:
    """Outcome of :func:`refine_boundary`."""

    boundary: float
    """The smoothed boundary (tokens): the old one when frozen."""
    proposal: int | None
    """``R[b]``'s length before smoothing; None when frozen."""
    frozen: bool
    """Fewer than ``freeze_below`` requests in the merged list: the boundary did not move."""


def refine_boundary(
    own: Sequence[LengthPair],
    successors: Sequence[Sequence[LengthPair]],
    coefs: QoeCoefficients,
    current: float,
    *,
    alpha: float,
    freeze_below: int = 5,
) -> Refinement:
    """One unit's refinement of its upper range boundary (section 4.3).

    ``own``: ``(I, L)`` of the unit's requests; ``successors``: those of each unit of the next stage. The
    successors' lengths are merged and divided by their number with :func:`representative_share` (the
    average successor); merged with ``own`` and sorted by length this is the list ``R`` (``N`` requests).
    With ``N < freeze_below`` the boundary is frozen. Otherwise ``b = argmin_{0 <= i < N} Q(R[:i]) +
    Q(R[i:])`` (first index on ties), the proposal is ``R[b]``'s length, and the boundary moves by an
    exponential moving average: ``(1 - alpha) * current + alpha * proposal``.
    """
    succ = [it for group in successors for it in group]
    merged = sorted([*own, *representative_share(succ, len(successors))], key=lambda it: (it[1], it[0]))
    n = len(merged)
    if n < freeze_below or n == 0:
        return Refinement(current, None, True)
    inp = np.asarray([it[0] for it in merged], dtype=np.float64)
    ctx = np.asarray([it[1] for it in merged], dtype=np.float64)
    zero = np.zeros(1)
    p_n = np.arange(n + 1, dtype=np.float64)
    p_i = np.concatenate((zero, np.cumsum(inp)))
    p_i2 = np.concatenate((zero, np.cumsum(inp * inp)))
    p_l = np.concatenate((zero, np.cumsum(ctx)))
    d = coefs

    def q(cnt: FloatArray, s_i: FloatArray, s_i2: FloatArray, s_l: FloatArray) -> FloatArray:
        return np.asarray(cnt * (d.d0 + d.d1 * cnt + d.d2 * s_i + d.d3 * s_i2 + d.d4 * s_l), dtype=np.float64)

    i = np.arange(n)
    head = q(p_n[i], p_i[i], p_i2[i], p_l[i])
    tail = q(n - p_n[i], p_i[n] - p_i[i], p_i2[n] - p_i2[i], p_l[n] - p_l[i])
    b = int(np.argmin(head + tail))
    proposal = int(merged[b][1])
    return Refinement((1.0 - alpha) * current + alpha * proposal, proposal, False)


picklable(Partition, Refinement)  # compiled with mypyc (setup.py): see picklable
