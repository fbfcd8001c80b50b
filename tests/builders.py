"""Small builders shared by tests: policy views, step costs and a dispatcher that moves one request (pure: the policy
tests import only these)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from policies.base import DispatchPolicy
from policies.cost.step_model import StepCoefficients
from policies.types import DispatchDecision, Migration, PendingRequest, RequestView, UnitLoad, UnitView

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


class MoveOne(DispatchPolicy):
    """Everything on unit 0; once ``victim`` has ``after`` output tokens there, move it to unit 1 (once). ``seen``: the
    loads the dispatcher saw when it asked for the move. For the live cluster's migration tests."""

    name: ClassVar[str] = "move_one"
    wants_step_reports: ClassVar[bool] = True
    needs_requests: ClassVar[bool] = True
    rebalances: ClassVar[bool] = True

    def __init__(self, victim: str, after: int) -> None:
        super().__init__()
        self.victim = victim
        self.after = after
        self.asked = False
        self.seen: list[UnitLoad] = []

    def dispatch(self, pending: Sequence[PendingRequest], units: Sequence[UnitLoad], now_s: float
                 ) -> DispatchDecision:
        moves: tuple[Migration, ...] = ()
        if not self.asked:
            for r in units[0].requests:
                if r.request_id == self.victim and r.output_tokens >= self.after:
                    self.seen = list(units)
                    self.asked = True
                    moves = (Migration(r.request_id, 0, 1, "test"),)
        return DispatchDecision(assignments=tuple((p.request_id, 0) for p in pending), migrations=moves)
