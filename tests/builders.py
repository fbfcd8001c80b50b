"""Small builders shared by tests: policy views and step costs (pure: the policy tests import only these)."""

from __future__ import annotations

from collections.abc import Sequence

from policies.cost.step_model import StepCoefficients
from policies.types import RequestView, UnitView

UNIT_COST = StepCoefficients(1.0, 0.0, 0.0)
"""Every step lasts one second: step counts and times coincide."""
H100_LIKE = StepCoefficients(9.11e-3, 24.0e-6, 43.9e-9)


def rview(
    rid: str, prompt: int, *, computed: int = 0, output: int = 0, arrival: float = 0.0,
    ttft: float = 0.5, tpot: float = 0.05,
) -> RequestView:
    return RequestView(rid, arrival, prompt, computed, output, ttft, tpot, None, 0)


def uview(
    running: Sequence[RequestView] = (), waiting: Sequence[RequestView] = (), *,
    budget: int = 2048, max_num_seqs: int = 8, free_blocks: int = 1000, num_blocks: int = 1000,
) -> UnitView:
    return UnitView(
        0, 0, tuple(running), tuple(waiting), 16, num_blocks, free_blocks, budget, max_num_seqs, 16_384, H100_LIKE
    )
