"""CascadeInfer's stage bookkeeping: installed stages, routing by length, refinement, length sample (seed 001).

POLICIES.md 2.4. A :class:`StageMap` holds what :class:`policies.dispatch.cascade.CascadeInfer` installed:
the stage boundaries ``0, l_1, ..., max_context`` (floats, since refinement moves them by EMA fractions;
integers are what routing and telemetry see) and the unit ids of each stage. On it:

- **Routing** (section 3.2, :meth:`StageMap.route`): a request goes to the stage covering its prompt length,
  inside it (the paper does not say how) to the unit with the lowest ``4 * waiting + running``, vLLM's DP
  balancer's score (``stage_routing=load``, the default since 2026-11-26), or to the least memory demand
  (:func:`demand_tokens`, ``stage_routing=memory``, the default before), counting this call's placements.
- **Range refinement** (section 4.3, :meth:`StageMap.refine`): each unit of stage ``j`` proposes a boundary
  (:func:`policies.dispatch.cascade_partition.refine_boundary`); the stage boundary becomes the mean of the
  unfrozen units' proposals, clipped to stay strictly between its neighbours.
- **Length sample** (section 4.2, :class:`RecentLengths`): the ``(I, L)`` the partition runs over, those of
  the resident and pending requests, topped up with the last seen lengths of departed requests when fewer
  than ``min_partition_samples``.

The partition that chooses the stages is :mod:`policies.dispatch.cascade_partition` (section 4.2); the
migrations between units are :mod:`policies.dispatch.cascade_bidask` (section 4.4).

Pure: stdlib only, no clock, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from policies.dispatch.baseline import LoadScores
from policies.dispatch.cascade_model import QoeCoefficients
from policies.dispatch.cascade_partition import LengthPair, refine_boundary
from policies.frozen import picklable
from policies.types import PendingRequest, UnitLoad

__all__ = ["RecentLengths", "Stage", "StageMap", "demand_tokens"]

_RECENT_MAX = 4096
"""Departed requests remembered for topping up a thin length sample."""


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage as telemetry shows it."""

    lower_tokens: int
    upper_tokens: int
    """Exclusive upper length; the last stage also takes everything above."""
    unit_ids: tuple[int, ...]


class StageMap:
    """The installed stages: boundaries and the unit ids of each stage (empty before the first install)."""

    __slots__ = ("bounds", "members", "stage_of")

    def __init__(self, bounds: list[float] | None = None, members: list[tuple[int, ...]] | None = None) -> None:
        self.bounds: list[float] = [] if bounds is None else bounds
        """Stage boundaries ``0, l_1, ..., top`` (one more than stages); refinement moves the inner ones."""
        self.members: list[tuple[int, ...]] = [] if members is None else members
        """Unit ids of each stage, in stage order."""
        self.stage_of: dict[int, int] = {u: j for j, m in enumerate(self.members) for u in m}
        """Stage index of each unit."""

    def int_bounds(self) -> list[int]:
        return [round(b) for b in self.bounds]

    def stages(self) -> tuple[Stage, ...]:
        b = self.int_bounds()
        return tuple(Stage(b[j], b[j + 1], m) for j, m in enumerate(self.members))

    def stage_for_length(self, tokens: int) -> int:
        """Index of the stage covering a sequence length (the last stage covers everything above)."""
        if not self.members:
            raise LookupError("no stages yet")
        j = bisect.bisect_right(self.int_bounds(), tokens) - 1
        return min(max(j, 0), len(self.members) - 1)

    def route(self, pending: Sequence[PendingRequest], by_id: Mapping[int, UnitLoad], *,
              by_memory: bool = False) -> tuple[tuple[str, int], ...]:
        """Each request to the stage covering its prompt length; inside it to the unit with the lowest ``4 *
        waiting + running`` (vLLM's DP balancer's score, ``least_loaded``'s), counting this call's placements, then
        the lowest id; with ``by_memory`` to the least memory demand (:func:`demand_tokens`), then fewer requests."""
        if not by_memory:
            scores = LoadScores(by_id[u] for m in self.members for u in m)
            return tuple((req.request_id, scores.place(self.members[self.stage_for_length(req.prompt_tokens)]))
                         for req in pending)
        demand = {u: demand_tokens(by_id[u]) for m in self.members for u in m}
        count = {u: by_id[u].num_running + by_id[u].num_waiting for u in demand}
        out: list[tuple[str, int]] = []
        for req in pending:
            members = self.members[self.stage_for_length(req.prompt_tokens)]
            unit = min(members, key=lambda k: (demand[k], count[k], k))
            demand[unit] += req.prompt_tokens
            count[unit] += 1
            out.append((req.request_id, unit))
        return tuple(out)

    def refine(self, by_id: Mapping[int, UnitLoad], coefs: QoeCoefficients, *, alpha: float, freeze_below: int) -> bool:
        """Section 4.3 for every stage boundary but the outermost two; True when a rounded boundary moved."""
        moved = False
        for j in range(len(self.members) - 1):
            succ = [_pairs(by_id[u]) for u in self.members[j + 1] if u in by_id]
            smoothed = [
                r.boundary
                for r in (
                    refine_boundary(
                        _pairs(by_id[u]),
                        succ,
                        coefs,
                        self.bounds[j + 1],
                        alpha=alpha,
                        freeze_below=freeze_below,
                    )
                    for u in self.members[j]
                    if u in by_id
                )
                if not r.frozen
            ]
            if not smoothed:
                continue
            lo, hi = round(self.bounds[j]) + 1, round(self.bounds[j + 2]) - 1
            if lo > hi:
                continue
            new = min(max(sum(smoothed) / len(smoothed), float(lo)), float(hi))
            if round(new) != round(self.bounds[j + 1]):
                moved = True
            self.bounds[j + 1] = new
        return moved


class RecentLengths:
    """The partition's length sample (section 4.2), with the last seen ``(I, L)`` of recent requests."""

    __slots__ = ("_recent",)

    def __init__(self) -> None:
        self._recent: dict[str, LengthPair] = {}

    def sample(
        self, units: Sequence[UnitLoad], pending: Sequence[PendingRequest], min_samples: int
    ) -> tuple[list[int], list[int]]:
        """Prompt and sequence lengths of the resident and pending requests, topped up to ``min_samples``
        with departed ones (newest first); remembers the resident ones."""
        prompts: list[int] = []
        contexts: list[int] = []
        live: set[str] = set()
        for u in units:
            for r in u.requests:
                prompts.append(r.prompt_tokens)
                contexts.append(max(r.context_tokens, r.prompt_tokens))
                live.add(r.request_id)
        for q in pending:
            prompts.append(q.prompt_tokens)
            contexts.append(q.prompt_tokens)
        self.remember(units)
        if len(prompts) < min_samples:
            for rid in reversed(self._recent):
                if len(prompts) >= min_samples:
                    break
                if rid not in live:
                    i, ell = self._recent[rid]
                    prompts.append(i)
                    contexts.append(ell)
        return prompts, contexts

    def remember(self, units: Sequence[UnitLoad]) -> None:
        for u in units:
            for r in u.requests:
                self._recent.pop(r.request_id, None)
                self._recent[r.request_id] = (r.prompt_tokens, max(r.context_tokens, r.prompt_tokens))
        while len(self._recent) > _RECENT_MAX:
            del self._recent[next(iter(self._recent))]


def demand_tokens(u: UnitLoad) -> int:
    """Memory demand of a unit (section 4.4): tokens in KV plus prompt tokens queued for prefill."""
    return u.kv_tokens + u.queued_prefill_tokens


def _pairs(u: UnitLoad) -> list[LengthPair]:
    return [(r.prompt_tokens, max(r.context_tokens, r.prompt_tokens)) for r in u.requests]


picklable(Stage)  # compiled with mypyc (setup.py): see picklable
