"""Pure placement pieces of staggered batch scheduling (seed 000; POLICIES.md 2.2).

Everything here is a function of its arguments (plus one small sliding window), so that ``sbs`` and any
other dispatcher can reuse it and tests can check it on hand-made numbers:

- :func:`sbs_interval_s`: the dispatch interval ``I = (T_fwd + L_net) / N_active`` (the paper's Algorithm 1);
- :class:`StepTimeWindow`: ``T_fwd``, the mean of the last ``W`` reported forward times, with a default
  before any report;
- :func:`available_tokens` and :func:`water_fill`: PBAA prefill placement (Algorithm 2);
- :func:`iqr_mask` and :func:`place_lexicographic` / :func:`place_iqr_lex`: IQR-masked lexicographic decode
  placement (Algorithm 3).

"No capacity left" (PBAA). The paper's Algorithm 2 places request ``r`` on
``d* = argmax_d C_avail(d) - (L(r) - L_hit(r, d))`` *if* ``C_avail(d*) > 0`` (the check is on the headroom
before the request, not after it), and its input ``D`` is "the set of DP units with available capacity".
We take both literally: the candidates are the units whose current ``C_avail`` is positive, and the best
of them takes the request whatever its length. So a prompt longer than ``C_chunk`` is placed on a unit
with any headroom (it is chunked there over several steps) and can never wait forever; a unit whose
headroom reaches zero or below drops out of the cycle; a request waits for the next cycle only when no
candidate unit has positive headroom.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from policies.frozen import picklable
from policies.types import HandoffRequest, PendingRequest, UnitLoad


def sbs_interval_s(mean_step_s: float, net_latency_s: float, num_healthy: int) -> float | None:
    """``(T_fwd + L_net) / N_active``; None when no unit is healthy (nothing to dispatch to, no interval)."""
    if num_healthy <= 0:
        return None
    return (mean_step_s + net_latency_s) / num_healthy


class StepTimeWindow:
    """Sliding window of the last ``size`` reported forward times; its mean is ``T_fwd``.

    Before any report the mean is ``default_s`` (the paper: a value from offline stress tests; here the
    calibration profile's or the operator's). Non-positive or non-finite samples are ignored: a step of
    zero length would make the interval zero and the dispatcher spin.
    """

    def __init__(self, size: int, default_s: float) -> None:
        if size < 1:
            raise ValueError(f"window size must be at least 1, got {size}")
        self._samples: deque[float] = deque(maxlen=size)
        self.default_s = default_s
        """``T_fwd`` before any report (seconds)."""

    @property
    def size(self) -> int:
        """Capacity ``W`` of the window."""
        maxlen = self._samples.maxlen
        return maxlen if maxlen is not None else len(self._samples)

    def __len__(self) -> int:
        return len(self._samples)

    def resize(self, size: int) -> None:
        """Change ``W``, keeping the newest samples."""
        if size < 1:
            raise ValueError(f"window size must be at least 1, got {size}")
        if size != self.size:
            self._samples = deque(self._samples, maxlen=size)

    def add(self, step_s: float) -> None:
        """Record one reported forward time (seconds); evicts the oldest when full."""
        if step_s > 0.0 and math.isfinite(step_s):
            self._samples.append(step_s)

    @property
    def mean_s(self) -> float:
        """Mean of the window, or ``default_s`` while it is empty."""
        return sum(self._samples) / len(self._samples) if self._samples else self.default_s


# -- prefill placement (PBAA) ----------------------------------------------------------------------------
HeadroomModel = Literal["next_step", "literal"]
"""How :func:`available_tokens` reads a unit's load (see there)."""


def available_tokens(unit: UnitLoad, default_chunk_tokens: int, model: HeadroomModel = "next_step") -> int:
    """``C_avail``: prompt tokens the unit's *next* step can still take (seed 000 section 4.2.1).

    ``C_chunk`` is the unit's ``chunk_tokens`` (its ``max_num_batched_tokens``), or ``default_chunk_tokens``
    when the unit reports 0 (unknown). The result may be zero or negative (a backlog beyond one chunk).

    The paper's ``C_avail = C_chunk - U_flight - R_queued`` counts, besides the chunk, tokens *dispatched but
    not yet acknowledged* (``U_flight``: in transit on the network) and the device's backlog (``R_queued``).
    Our node hands requests over synchronously and reads loads afresh at every call, so nothing is in
    transit; but ``UnitLoad.queued_prefill_tokens`` ("dispatched and not yet computed") still includes the
    prefill tokens of the step in flight, which ``inflight_tokens`` counts too. Hence two models:

    - ``next_step`` (default): ``C_chunk - max(queued - inflight, 0) - decodes``, where the backlog after the
      step in flight is ``queued - inflight`` (the step's tokens leave the backlog when it ends; its decode
      tokens make this an underestimate by at most one token per decode) and ``decodes`` reserves one token
      per resident request of a colocated (``mixed``) unit for its next decode;
    - ``literal``: ``C_chunk - inflight - queued``, the formula with ``tokens_in_flight`` read as the step in
      flight. It counts the in-flight prefill chunk twice and against the next step too, so a unit in the
      middle of a full chunk shows about ``-C_chunk`` and takes nothing until its step ends.
    """
    chunk = unit.chunk_tokens if unit.chunk_tokens > 0 else default_chunk_tokens
    if model == "literal":
        return chunk - unit.inflight_tokens - unit.queued_prefill_tokens
    backlog = max(unit.queued_prefill_tokens - unit.inflight_tokens, 0)
    decodes = unit.num_running if unit.role == "mixed" else 0
    return chunk - backlog - decodes


@dataclass(frozen=True, slots=True)
class FillResult:
    """What one PBAA cycle decided."""

    assignments: tuple[tuple[str, int], ...]
    """``(request_id, unit_id)`` in placement order (leftovers first, each group longest first)."""
    held: tuple[str, ...]
    """Requests left for the next cycle (no candidate unit had positive headroom), in placement order."""
    capacity_left: tuple[tuple[int, int], ...]
    """``(unit_id, C_avail)`` after the cycle, in the order given."""


def _cost_tokens(request: PendingRequest, unit_id: int, hits: Mapping[int, int] | None) -> int:
    """``L(r) - L_hit(r, d)`` (cache-aware) or ``L(r)`` (basic); never below zero."""
    if hits is None:
        return request.prompt_tokens
    return max(request.prompt_tokens - min(hits.get(unit_id, 0), request.prompt_tokens), 0)


def water_fill(
    leftover: Sequence[PendingRequest],
    new: Sequence[PendingRequest],
    capacity: Sequence[tuple[int, int]],
    *,
    cache_aware: bool = False,
    longest_first: bool = True,
) -> FillResult:
    """PBAA: place ``leftover`` (earlier cycles) first, then ``new``; each group longest prompt first (seed 000's
    Algorithm 2), or with ``longest_first=False`` in the order given (arrival order).

    ``capacity`` lists ``(unit_id, C_avail)`` of the candidate units; its order breaks ties (the first of
    equally good units wins), so a caller that lists units starting from its rotation target spreads a
    burst over idle units instead of always filling the lowest id first. Each request goes to
    ``argmax_d C_avail(d) - cost(r, d)`` over the units with ``C_avail(d) > 0``, where ``cost`` is
    ``L(r)`` or, with ``cache_aware``, ``L(r) - L_hit(r, d)`` from ``PendingRequest.prefix_hits``; the
    chosen unit's ``C_avail`` then drops by ``cost(r, d*)``. Equal lengths keep their given (FCFS) order.
    A request no unit has positive headroom for is held (see the module docstring).
    """
    order = [unit_id for unit_id, _ in capacity]
    if len(set(order)) != len(order):
        raise ValueError("water_fill: a unit is listed twice")
    avail = dict(capacity)
    assignments: list[tuple[str, int]] = []
    held: list[str] = []
    for group in (leftover, new):
        for request in sorted(group, key=lambda r: -r.prompt_tokens) if longest_first else group:
            hits = dict(request.prefix_hits) if cache_aware else None
            best: int | None = None
            best_score = 0
            for unit_id in order:
                if avail[unit_id] <= 0:
                    continue
                score = avail[unit_id] - _cost_tokens(request, unit_id, hits)
                if best is None or score > best_score:
                    best, best_score = unit_id, score
            if best is None:
                held.append(request.request_id)
                continue
            avail[best] -= _cost_tokens(request, best, hits)
            assignments.append((request.request_id, best))
    return FillResult(tuple(assignments), tuple(held), tuple((u, avail[u]) for u in order))


# -- decode placement (IQR mask + lexicographic minimum) ---------------------------------------------------
def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """``(Q1, Q3)`` by linear interpolation between order statistics (numpy's default ``percentile``)."""
    if not values:
        raise ValueError("quartiles of an empty sequence")
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return at(0.25), at(0.75)


def iqr_mask(values: Sequence[float], k: float = 1.5) -> tuple[int, ...]:
    """Indices of ``values`` kept by the IQR outlier mask: ``v <= Q3 + k * (Q3 - Q1)``.

    The mask is lifted (every index kept) when it would keep none, so a caller always has a candidate.
    An empty input gives an empty tuple.
    """
    if not values:
        return ()
    q1, q3 = quartiles(values)
    threshold = q3 + k * (q3 - q1)
    kept = tuple(i for i, v in enumerate(values) if v <= threshold)
    return kept if kept else tuple(range(len(values)))


def place_lexicographic(
    items: Sequence[tuple[str, int]], state: Sequence[tuple[int, int, int]], k: float = 1.5
) -> tuple[tuple[str, int], ...]:
    """Seed 000's Algorithm 3 on plain numbers.

    ``items`` are ``(request_id, total_length)``; ``state`` is ``(unit_id, batch_size B, kv_tokens K)`` per
    candidate unit. Items go longest first (equal lengths in the given order); for each, units whose ``K``
    exceeds ``Q3 + k * IQR`` of the *current* ``K`` values are masked (no mask if that leaves none), the
    lexicographic minimum of ``(B, K)`` among the rest wins (lowest unit id on a full tie), and its ``B``
    grows by 1 and its ``K`` by the item's length before the next item.
    """
    if not state:
        return ()
    units = [[unit_id, batch, kv] for unit_id, batch, kv in state]
    out: list[tuple[str, int]] = []
    for request_id, length in sorted(items, key=lambda item: -item[1]):
        safe = iqr_mask([float(u[2]) for u in units], k)
        chosen = min((units[i] for i in safe), key=lambda u: (u[1], u[2], u[0]))
        chosen[1] += 1
        chosen[2] += length
        out.append((request_id, chosen[0]))
    return tuple(out)


def place_iqr_lex(
    handoffs: Sequence[HandoffRequest], units: Sequence[UnitLoad], k: float = 1.5
) -> tuple[tuple[str, int], ...]:
    """Decode units for finished prefills: :func:`place_lexicographic` over the healthy units.

    ``B`` is a unit's running plus waiting requests, ``K`` its ``kv_tokens``, a handoff's length its
    ``context_tokens``. Every handoff must be placed (its KV exists), so when no unit is healthy all units
    are candidates, as in :func:`policies.base.place_min_batch`.
    """
    pool = [u for u in units if u.healthy] or list(units)
    state = [(u.unit_id, u.num_running + u.num_waiting, u.kv_tokens) for u in pool]
    return place_lexicographic([(h.request_id, h.context_tokens) for h in handoffs], state, k)


picklable(FillResult)  # compiled with mypyc (setup.py): see picklable
